"""The layout's rules, read from the source (nothing is imported): the modules outside tests/ import one way, with
no import circle, and common.py, the ground floor, imports nothing from the repository. The package's folders
follow a run's stages, ground to top, in ORDER (README.md's folder table lists them in this order): a module
imports from its own folder and the folders below it, never from one above, so no circle runs between folders
either. An import inside a function counts like one at the top: deferring an import hides a circle from Python,
not from this test. And the developers' guide's two measures: no line of a .py file over 120 characters, and a
trainer's main() within 160 lines."""
import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("", "tools", "benchmarks")  # the repository root's scripts and the two script folders; training/: below
# The package's folders, ground to top: the order of a run, written here and in README.md's folder table alone.
ORDER = ("config", "data", "model", "objectives", "optimisation", "run", "evaluation", "record", "sharing")


def modules(root=ROOT):
    """{dotted name: path} of every non-test module ("training.data" is training/data/__init__.py)."""
    paths = [*(path for folder in FOLDERS for path in (root / folder).glob("*.py")), *(root / "training").rglob("*.py")]
    out = {}
    for path in sorted(paths):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path, known):
    """The modules of `known` that the file at `path` imports, anywhere in it. `from training.data import cache` is
    an import of training.data.cache; `from training.data.cache import x` of training.data.cache; `from training
    import data` of the folder's __init__ (which holds nothing). An import by name as the program runs
    (importlib.import_module, __import__) is one too: of each module its string names, and for an f-string, of
    every module whose name starts with its fixed head (f"train_{method}": both trainers)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out.update(subs or ({node.module} & known.keys()))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args:
            for part in ast.walk(node.args[0]):
                if isinstance(part, ast.Constant) and part.value in known:
                    out.add(part.value)
                elif isinstance(part, ast.JoinedStr) and part.values and isinstance(part.values[0], ast.Constant):
                    out.update(name for name in known if name.startswith(part.values[0].value))
    return out


def graph(root=ROOT):
    """{module: the repository modules it imports}, the test files left out."""
    known = modules(root)
    return {name: imports(path, known) - {name} for name, path in known.items()}


def circles(g):
    """Every import circle, each once, as a list of nodes that starts and ends with the same one."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    return found


def file_of(name, root=ROOT):
    return str(modules(root)[name].relative_to(root))


def folder_of(name):
    """The package folder a module lives in ("training.data.cache" -> "data"); None outside one."""
    parts = name.split(".")
    return parts[1] if parts[0] == "training" and len(parts) > 1 else None


def folder_graph(g):
    """{folder: {folder it imports from: [(importing module, imported module), ...]}}, between different folders."""
    out = {}
    for name, targets in g.items():
        for target in targets:
            a, b = folder_of(name), folder_of(target)
            if a and b and a != b:
                out.setdefault(a, {}).setdefault(b, []).append((name, target))
    return out


def against_the_order(g, root=ROOT):
    """Each import that runs up the folders' order, or from the package to a module outside it other than
    common.py, as 'importing file -> imported file: why'."""
    found = []
    for name, targets in sorted(g.items()):
        if not name.startswith("training"):
            continue
        for target in sorted(targets):
            a, b = folder_of(name), folder_of(target)
            if not target.startswith("training") and target != "common":
                why = "the package imports only itself and common.py"
            elif a and b and ORDER.index(a) < ORDER.index(b):
                why = f"{a}/ sits below {b}/ (ground to top: {', '.join(ORDER)})"
            else:
                continue
            found.append(f"{file_of(name, root)} -> {file_of(target, root)}: {why}")
    return found


def folder_circles(g, root=ROOT):
    """Every circle between folders, from its lowest folder on, each step named by the imports that make it."""
    edges = folder_graph(g)
    named = []
    for circle in circles({a: set(b) for a, b in edges.items()}):
        start = circle.index(min(circle[:-1], key=ORDER.index))
        circle = circle[start:-1] + circle[:start + 1]
        named.append("; ".join(f"{a}/ -> {b}/ (" + ", ".join(f"{file_of(m, root)} -> {file_of(t, root)}"
                                                            for m, t in sorted(edges[a][b])) + ")"
                               for a, b in zip(circle, circle[1:])))
    return named


def test_the_modules_import_one_way_with_no_circle():
    g = graph()
    assert {"common", "training.run.checkpoints", "training.data.sources", "training.data.encoders"} <= g.keys()
    found = circles(g)
    assert not found, "import circles:\n  " + "\n  ".join(" -> ".join(map(file_of, c)) for c in found)


def test_the_folders_import_down_the_order_of_a_run_with_no_circle():
    g = graph()
    assert "config" in folder_graph(g)["data"]  # the graph was read
    found = folder_circles(g)
    assert not found, "circles between the package's folders:\n  " + "\n  ".join(found)
    found = against_the_order(g)
    assert not found, "imports against the folders' order:\n  " + "\n  ".join(found)


def test_each_folder_is_a_stage_that_says_what_it_holds_and_re_exports_nothing():
    """On disk: training/ holds the folders of ORDER and no loose module; each folder's __init__.py is a docstring
    alone (what the folder holds and what it may import; nothing re-exported hides where a thing lives) and it
    holds at least two modules (a stage of one module would be that module). README.md's folder table names the
    folders in ORDER."""
    package = ROOT / "training"
    assert sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ORDER)
    assert [p.name for p in package.glob("*.py")] == ["__init__.py"]
    for folder in ("", *ORDER):
        body = ast.parse((package / folder / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), \
            f"training/{folder}/__init__.py: a docstring and nothing else"
        if folder:
            assert len(list((package / folder).glob("*.py"))) >= 3, f"training/{folder}/ holds one module"
    readme = (ROOT / "README.md").read_text()
    rows = readme[readme.index("| folder (`training/`)"):].split("\n\n")[0]  # the table, to its blank line
    table = re.findall(r"^\| `(\w+)/` \|", rows, re.MULTILINE)
    assert tuple(table) == ORDER, f"README.md's folder table: {table}, not the order {ORDER}"


# The top level's commands (common.py is none). A command imports the package, never another command, but for one
# thing: a command that samples a finished run takes the run's own sampler, its trainer's generate.
COMMANDS = ("train_flow_matching", "train_ddpm", "eval_fid", "sample")
TAKES_GENERATE = {"eval_fid": {"train_flow_matching", "train_ddpm"}, "sample": {"train_flow_matching", "train_ddpm"}}


def test_a_command_imports_no_other_but_the_trainer_whose_generate_it_samples_with():
    """The trainers import no command (their in-training FID is training/evaluation/sampling.py's, handed their own
    generate); eval_fid.py and sample.py import the trainers for generate alone and not each other."""
    g = graph()
    for name in COMMANDS:
        others = g[name] & set(COMMANDS)
        assert others <= TAKES_GENERATE.get(name, set()), f"{name}.py imports the command(s) {sorted(others)}"


def test_tools_and_benchmarks_use_eval_fid_and_sample_as_commands_alone():
    """eval_fid.py and sample.py are commands: a script may run them (main) and parse or list the options it hands
    on to eval_fid.py (parse_args, passed_on). What they share with the others (the model read back and its class
    ids, a batch sampled, the PNGs, the reference's options, tuned.json's defaults) lives in the package, where they
    import it from."""
    used = {}
    for path in [*ROOT.glob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in (
                    "eval_fid", "sample"):
                used.setdefault(f"{node.value.id}.{node.attr}", set()).add(path.name)
            elif isinstance(node, ast.ImportFrom) and node.module in ("eval_fid", "sample"):
                for a in node.names:
                    used.setdefault(f"{node.module}.{a.name}", set()).add(path.name)
    assert "eval_fid.main" in used and set(used) <= {"eval_fid.main", "eval_fid.parse_args", "eval_fid.passed_on"}, used


def test_common_imports_nothing_from_the_repository():
    upward = graph()["common"]
    assert not upward, f"common.py, the ground floor, imports {sorted(map(file_of, upward))}"


def test_the_config_schema_imports_none_of_the_options_it_describes():
    """sections.py types the keys; each option's start-up check lives in the option's module, handed over by the
    trainer (sections.schema's checks)."""
    assert graph()["training.config.sections"] == set()


def test_the_exported_code_imports_nothing_from_the_repository():
    """training/sharing/exported/ is copied into every export folder, which loads with torch and diffusers alone."""
    g = graph()
    exported = {name: targets for name, targets in g.items() if name.startswith("training.sharing.exported.")}
    assert len(exported) == 2 and not set().union(*exported.values()), exported


PLANTS = {  # what is added, in a function, to one module of a copy of the repository
    "circle": ("training/run/sharding.py", "training.run", "checkpoints"),  # checkpoints.py imports sharding.py
    "upward": ("common.py", "training.record", "curves"),  # the package imports common.py: no circle
    # the two imports this layout took out: model.py's of REPA's projector, clipping's of the sharded norm
    "against the order": ("training/model/mmdit.py", "training.objectives", "repa"),
    "folder circle": ("training/optimisation/clipping.py", "training.run", "sharding"),
}


@pytest.mark.parametrize("planted", PLANTS)
def test_a_planted_import_is_caught_naming_the_files(tmp_path, planted):
    """The checks on a copy of the modules with one import added inside a function: a circle between modules
    (sharding.py importing the checkpoints module that imports it); common.py importing from the package (a module
    that imports nothing back: no circle, only the wrong direction); an import up the folders' order that makes no
    circle (model/mmdit.py importing objectives/repa.py, which imports nothing from model/); and one that also makes
    a circle between folders but none between modules (optimisation/clipping.py importing run/sharding.py, while
    run/ imports from optimisation/)."""
    for path in modules().values():
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    target, package, name = PLANTS[planted]
    planted_import = f"\n\ndef planted():\n    from {package} import {name}\n"
    (tmp_path / target).write_text((tmp_path / target).read_text() + planted_import)
    g = graph(tmp_path)
    named = [" -> ".join(file_of(m, tmp_path) for m in c) for c in circles(g)]
    up = f" (ground to top: {', '.join(ORDER)})"
    if planted == "circle":
        assert named == ["training/run/checkpoints.py -> training/run/sharding.py -> training/run/checkpoints.py"]
    elif planted == "upward":
        assert g["common"] == {"training.record.curves"} and not named
    elif planted == "against the order":
        assert not named and not folder_circles(g, tmp_path)
        assert against_the_order(g, tmp_path) == [
            "training/model/mmdit.py -> training/objectives/repa.py: model/ sits below objectives/" + up]
    else:
        assert not named and against_the_order(g, tmp_path) == [
            "training/optimisation/clipping.py -> training/run/sharding.py: optimisation/ sits below run/" + up]
        assert folder_circles(g, tmp_path) == [
            "optimisation/ -> run/ (training/optimisation/clipping.py -> training/run/sharding.py); "
            "run/ -> optimisation/ "
            "(training/run/fit.py -> training/optimisation/muon.py, training/run/stability.py -> "
            "training/optimisation/clipping.py, training/run/stability.py -> training/optimisation/convergence.py, "
            "training/run/stability.py -> training/optimisation/time_density.py)"]


def test_an_import_by_name_as_the_program_runs_is_read_as_an_import(tmp_path):
    """importlib.import_module(f"train_{method}") in a function of the package (as eval_fid.py's method_of was,
    while the trainers imported eval_fid.py) is an import of both trainers: the package reaching a command, and the
    circle it closes, both named."""
    for path in modules().values():
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    target = tmp_path / "training/evaluation/sampling.py"
    target.write_text(target.read_text() + "\n\ndef planted(method):\n    import importlib\n\n"
                      "    return importlib.import_module(f\"train_{method}\")\n")
    g = graph(tmp_path)
    assert {"train_ddpm", "train_flow_matching"} <= g["training.evaluation.sampling"]
    assert [f for f in against_the_order(g, tmp_path) if "sampling.py" in f] == [
        f"training/evaluation/sampling.py -> {name}.py: the package imports only itself and common.py"
        for name in ("train_ddpm", "train_flow_matching")]
    named = [" -> ".join(file_of(m, tmp_path) for m in c) for c in circles(g)]
    assert "train_ddpm.py -> training/evaluation/sampling.py -> train_ddpm.py" in named, named


def test_each_benchmark_names_the_study_file_it_feeds_and_the_index_lists_every_file():
    """A benchmark's docstring opens with 'Feeds docs/benchmarks/<study>.md', a file whose row in the index
    (docs/benchmarks.md's table of studies) names the script; one whose numbers stand in another doc feeds
    docs/benchmarks.md, "Numbers kept in other docs", whose table names it. Every file in docs/benchmarks/ has its
    row in the index, and every row its file."""
    index = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = {re.search(r"\]\(benchmarks/([^)]+)\)", line)[1]: line for line in index.splitlines()
            if line.startswith("|") and "](benchmarks/" in line}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        first = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
        if study := re.match(r"Feeds docs/benchmarks/([a-z_]+\.md)\b", first):
            assert f"`{path.name}`" in rows.get(study[1], ""), \
                f"{path.name}: no row of {study[1]} naming it in the index"
        else:
            assert first.startswith('Feeds docs/benchmarks.md, "Numbers kept in other docs"'), f"{path.name}: {first!r}"
            assert f"| `{path.name}` |" in index, f"{path.name}: not in the table of docs/benchmarks.md's last section"
    assert sorted(rows) == sorted(p.name for p in (ROOT / "docs" / "benchmarks").glob("*.md")), "index vs files"


# ----------------------------------------------------------------------------------------------------------
# The developers' guide's measures: no line over 120 characters; a trainer's main() fits in 160 lines.
MAX_LINE, MAX_MAIN = 120, 160
TRAINERS = ("train_flow_matching.py", "train_ddpm.py")


def python_files(root=ROOT):
    """The repository's .py files (paths from the root), without the folders .gitignore names (what runs, tools and
    tests write: runs/, cache/, ...; an export's copy of the exported code among them) and hidden ones (.git, a
    virtual environment)."""
    ignore = root / ".gitignore"
    patterns = [line.strip().strip("/") for line in (ignore.read_text().splitlines() if ignore.is_file() else ())
                if line.strip().endswith("/") and not line.startswith("#")]
    return sorted(str(path.relative_to(root)) for path in root.rglob("*.py")
                  if not any(part.startswith(".") or any(fnmatch.fnmatch(part, p) for p in patterns)
                             for part in path.relative_to(root).parts[:-1]))


def long_lines(root=ROOT, limit=MAX_LINE):
    """{file: ['file:line: N characters', ...]}: the lines of the repository's .py files over `limit` characters."""
    found = {}
    for name in python_files(root):
        for number, line in enumerate((root / name).read_text().split("\n"), 1):
            if len(line) > limit:
                found.setdefault(name, []).append(f"{name}:{number}: {len(line)} characters")
    return found


def test_no_line_of_a_python_file_is_over_120_characters():
    files = python_files()
    assert {"common.py", "train_ddpm.py", "training/run/checkpoints.py", "tests/test_layout.py"} <= set(files)
    problems = [line for lines in long_lines().values() for line in lines]
    assert not problems, f"the developers' guide: no line over {MAX_LINE} characters\n  " + "\n  ".join(problems)


def test_a_planted_long_line_is_named_by_file_and_line(tmp_path):
    """A 121-character line on line 3 of tools/long.py is named; 120 characters pass; what a run wrote under a
    folder .gitignore names is not read."""
    (tmp_path / ".gitignore").write_text("__pycache__/\nruns/\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "fine.py").write_text("x = 1\n" + "#" * 120 + "\n")
    (tmp_path / "tools" / "long.py").write_text("x = 1\n\ny = '" + "a" * 115 + "'\n")
    (tmp_path / "runs" / "demo" / "export").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "export" / "pipeline.py").write_text("#" * 200 + "\n")
    assert long_lines(tmp_path) == {"tools/long.py": ["tools/long.py:3: 121 characters"]}


def function_lines(path, name="main"):
    """The lines a file's top-level function spans, from its def line to its last line."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path}: no top-level function {name}")


def test_a_trainers_main_fits_in_160_lines():
    """A trainer's main() tells the run top to bottom; machinery lives in the package (the developers' guide)."""
    lengths = {name: function_lines(ROOT / name) for name in TRAINERS}
    assert min(lengths.values()) > 100, lengths  # the mains were found and read
    over = {name: n for name, n in lengths.items() if n > MAX_MAIN}
    assert not over, f"main() over {MAX_MAIN} lines (move machinery into training/): {over}"
