"""The layout's rules, read from the source (nothing is imported): the modules outside tests/ import one way, with
no import circle, and common.py, the ground floor, imports nothing from the repository. An import inside a
function counts like one at the top: deferring an import hides a circle from Python, not from this test."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("", "training", "tools", "benchmarks")  # the repository root's scripts and the three packages


def modules(root=ROOT):
    """{dotted name: path} of every non-test module ("training" is training/__init__.py)."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path, known):
    """The modules of `known` that the file at `path` imports, anywhere in it. `from training import data` is an
    import of training.data (the package's __init__ holds nothing); `from training.data import x` of training.data."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out.update(subs or ({node.module} & known.keys()))
    return out


def graph(root=ROOT):
    """{module: the repository modules it imports}, the test files left out."""
    known = modules(root)
    return {name: imports(path, known) - {name} for name, path in known.items()}


def circles(g):
    """Every import circle, each once, as a list of modules that starts and ends with the same one."""
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


def test_the_modules_import_one_way_with_no_circle():
    g = graph()
    assert {"common", "training.checkpoints", "training.data", "training.encoders"} <= g.keys()  # the graph was read
    found = circles(g)
    assert not found, "import circles:\n  " + "\n  ".join(" -> ".join(map(file_of, c)) for c in found)


def test_common_imports_nothing_from_the_repository():
    upward = graph()["common"]
    assert not upward, f"common.py, the ground floor, imports {sorted(map(file_of, upward))}"


def test_the_config_schema_imports_none_of_the_options_it_describes():
    """sections.py types the keys; each option's start-up check lives in the option's module, handed over by the
    trainer (sections.schema's checks)."""
    assert graph()["training.sections"] == set()


@pytest.mark.parametrize("planted", ["circle", "upward"])
def test_a_planted_circle_or_upward_import_is_caught_naming_the_files(tmp_path, planted):
    """The checks on a copy of the modules with one import added: a circle (sharding.py importing the checkpoints
    module that imports it, deferred inside a function) or common.py importing from the package (a module that
    imports nothing back: no circle, only the wrong direction)."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
        for path in (ROOT / folder).glob("*.py"):
            (tmp_path / folder / path.name).write_text(path.read_text())
    target, line = {"circle": ("training/sharding.py", "\n\ndef planted():\n    from training import checkpoints\n"),
                    "upward": ("common.py", "\n\ndef planted():\n    from training import curves\n")}[planted]
    (tmp_path / target).write_text((tmp_path / target).read_text() + line)
    g = graph(tmp_path)
    if planted == "circle":
        named = [" -> ".join(file_of(m, tmp_path) for m in c) for c in circles(g)]
        assert named == ["training/checkpoints.py -> training/sharding.py -> training/checkpoints.py"]
    else:
        assert g["common"] == {"training.curves"} and not circles(g)
