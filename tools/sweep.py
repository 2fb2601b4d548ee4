"""A sweep: one recipe, some keys varied (a grid, or random draws), each setting trained with several seeds.

    python tools/sweep.py configs/sweep_conditioning.json --local     # here, one run after another
    python tools/sweep.py configs/sweep_conditioning.json             # a SLURM job array through submitit
    python tools/sweep.py configs/sweep_conditioning.json --dry_run   # the runs and their commands, nothing run
    python tools/compare.py runs/sweep_conditioning                   # then: which arm is better, and how sure

The sweep file (JSON; only "grid" or "random" and "seeds" are needed):

    {"method": "flow_matching",                  # the trainer (train_{method}.py); "method" may also be a grid key
     "base": "configs/demo.json",                # the recipe every run starts from (null: the trainer's defaults)
     "overrides": {"train.max_steps": 300},      # fixed for every run (not part of run names)
     "grid": {"conditioning.mode": ["disentangled", "adanorm"]},  # every combination of these values
     "random": {"count": 8, "seed": 0,           # and/or `count` draws (reproducible: `seed`) of
                "keys": {"train.lr": {"log_uniform": [1e-4, 1e-2]}}},  # uniform, log_uniform, int_uniform, choice
     "seeds": [0, 1, 2],                         # each setting once per seed (the config key `seed`)
     "out": "runs/sweep_conditioning",           # run folders: OUT/<key>=<value>,...,seed=<s>; OUT/sweep.json
     "slurm": {"nodes": 1, "gpus_per_node": 8, "time_min": 1440, "partition": "gpu"}}

Every run is an ordinary trainer run: `train_{method}.py --config BASE --key=value ... --seed=S --run_dir
OUT/NAME --resume latest`. Before anything runs or is submitted, every run's config is loaded through its
trainer's own config path (DEFAULTS, the typed CONFIG, the checks at start-up): an unknown key or a value a key's rule
refuses stops the sweep, naming the run and the key. Running the same sweep again skips finished runs (their
export is written at max_steps) and resumes interrupted ones from their newest checkpoint; a run folder whose
config no longer matches the sweep is an error rather than a silent mix.

On SLURM (submitit): one array task per run, `slurm` giving nodes, GPUs per node, time and partition. Each task
starts one `accelerate launch` per node over its GPUs (tasks_per_node=1: accelerate spawns the ranks; a one-GPU
run is the trainer itself, with nothing in between). Preemption or the time limit: the trainer checkpoints
and exits with common.REQUEUE_EXIT_CODE (75), and the task requeues itself through submitit's checkpoint
mechanism; the requeued task continues with --resume latest.
"""
import argparse
import importlib
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from training.config import config  # noqa: E402
from training.run import fit  # noqa: E402

REQUEUE_EXIT_CODE = common.REQUEUE_EXIT_CODE
METHODS = ("flow_matching", "ddpm")
SWEEP_KEYS = {"method", "base", "overrides", "grid", "random", "seeds", "out", "slurm"}
SET_BY_SWEEP = {"seed", "run_dir", "resume"}  # each run's own: never a swept or fixed key
DISTRIBUTIONS = ("uniform", "log_uniform", "int_uniform", "choice")
SLURM_KEYS = {  # sweep file -> submitit AutoExecutor parameter (its name for SLURM's option)
    "nodes": "nodes", "gpus_per_node": "gpus_per_node", "cpus_per_task": "cpus_per_task", "mem_gb": "mem_gb",
    "time_min": "timeout_min", "partition": "slurm_partition", "account": "slurm_account",
    "constraint": "slurm_constraint", "max_parallel": "slurm_array_parallelism",
    "signal_delay_s": "slurm_signal_delay_s", "max_timeouts": "slurm_max_num_timeout"}
SLURM_DEFAULTS = {"nodes": 1, "gpus_per_node": 1, "cpus_per_task": 10, "time_min": 24 * 60,
                  "signal_delay_s": 300, "max_timeouts": 30}  # 300 s: time to write an XL checkpoint (slurm.sbatch)


class SweepError(ValueError):
    """A sweep that cannot run; raised before any run starts or is submitted."""


# ----------------------------------------------------------------------------------------------------------
# The sweep file -> runs.


def read_sweep(path):
    """The sweep file's JSON object, its structure checked (the config keys are checked per run, later)."""
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SweepError(f"sweep file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise SweepError(f"{path}: line {e.lineno}, column {e.colno}: malformed JSON ({e.msg})") from None
    problems = [] if isinstance(spec, dict) else [f"must hold a JSON object, got a {type(spec).__name__}"]
    spec = spec if isinstance(spec, dict) else {}
    problems += [f"unknown key '{k}'; allowed: {sorted(SWEEP_KEYS)}" for k in spec if k not in SWEEP_KEYS]
    grid, rnd = spec.get("grid", {}), spec.get("random", {})
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        problems.append("'grid' must map each key to a non-empty list of values")
    elif not grid and not rnd:
        problems.append("name what varies: 'grid' (lists of values) and/or 'random' (distributions and a count)")
    if rnd:
        if not isinstance(rnd, dict) or set(rnd) - {"count", "seed", "keys"}:
            problems.append("'random' must be {\"count\": N, \"seed\": S, \"keys\": {key: {distribution: ...}}}")
        else:
            if type(rnd.get("count")) is not int or rnd["count"] < 1:
                problems.append(f"random.count={rnd.get('count')!r} must be a whole number >= 1")
            for key, dist in (rnd.get("keys") or {}).items():
                if problem := distribution_problem(dist):
                    problems.append(f"random.keys.{key}: {problem}")
            if not rnd.get("keys"):
                problems.append("random.keys must name at least one key and its distribution")
    seeds = spec.get("seeds", [0])
    if not (isinstance(seeds, list) and seeds and all(type(s) is int and s >= 0 for s in seeds)) or \
            len(set(seeds)) < len(seeds):
        problems.append(f"seeds={seeds!r} must be a non-empty list of distinct whole numbers >= 0")
    swept = [*grid, *(rnd.get("keys") or {} if isinstance(rnd, dict) else {}), *(spec.get("overrides") or {})]
    problems += [f"'{k}' is set by the sweep for each run; use 'seeds' for seeds" for k in swept if k in SET_BY_SWEEP]
    problems += [f"'{k}' is both swept and fixed (in 'overrides')" for k in grid if k in (spec.get("overrides") or {})]
    methods = grid.get("method", [spec.get("method", "flow_matching")]) if isinstance(grid, dict) else []
    problems += [f"method={m!r} must be one of {METHODS}" for m in methods if m not in METHODS]
    if spec.get("base") is not None and not Path(spec["base"]).is_file():
        problems.append(f"base={spec['base']!r}: no such recipe file")
    slurm = spec.get("slurm", {})
    problems += [f"slurm.{k} is not a SLURM setting here; allowed: {sorted(SLURM_KEYS)}" for k in slurm
                 if k not in SLURM_KEYS]
    if problems:
        raise SweepError(f"{path}: " + "; ".join(problems))
    return spec


def distribution_problem(dist):
    if not (isinstance(dist, dict) and len(dist) == 1 and next(iter(dist)) in DISTRIBUTIONS):
        return (f"{dist!r} must be one of {{\"uniform\" | \"log_uniform\" | \"int_uniform\": [low, high]}} "
                f"or {{\"choice\": [...]}}")
    kind, arg = next(iter(dist.items()))
    if kind == "choice":
        return None if isinstance(arg, list) and arg else "choice needs a non-empty list"
    if not (isinstance(arg, list) and len(arg) == 2 and all(isinstance(a, (int, float)) for a in arg)
            and arg[0] < arg[1]):
        return f"{kind} needs [low, high] with low < high, got {arg!r}"
    if kind == "log_uniform" and arg[0] <= 0:
        return f"log_uniform needs low > 0, got {arg!r}"
    if kind == "int_uniform" and not all(type(a) is int for a in arg):
        return f"int_uniform needs whole numbers, got {arg!r}"
    return None


def draw(dist, rng):
    """One value from a distribution; floats kept to 4 significant digits, so the run name is the value."""
    kind, arg = next(iter(dist.items()))
    if kind == "choice":
        return rng.choice(arg)
    if kind == "int_uniform":
        return rng.randint(arg[0], arg[1])  # both ends included
    value = rng.uniform(*arg) if kind == "uniform" else math.exp(rng.uniform(math.log(arg[0]), math.log(arg[1])))
    return float(f"{value:.4g}")


def settings(spec):
    """Every setting (swept key -> value) in order: the grid's product (first key slowest), each combined with
    `random.count` draws. The draws come from random.seed alone, so a rerun expands to the same runs."""
    grid = spec.get("grid", {})
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    rnd = spec.get("random")
    if not rnd:
        return points
    rng = random.Random(rnd.get("seed", 0))
    draws = [{k: draw(d, rng) for k, d in rnd["keys"].items()} for _ in range(rnd["count"])]
    return [{**p, **d} for p in points for d in draws]


def value_name(value):
    text = "+".join(map(str, value)) if isinstance(value, list) else "null" if value is None else str(value)
    return re.sub(r"[^\w.+-]", "-", text)


def run_name(params, seed):
    """'conditioning.mode=adanorm,seed=1': the swept keys and the seed (short names; long ones end in a hash)."""
    name = ",".join(f"{k}={value_name(v)}" for k, v in [*params.items(), ("seed", seed)])
    if len(name) > 150:  # file names stop at 255 bytes
        import hashlib

        name = name[:140] + "," + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def expand(spec):
    """The runs of a sweep: one per setting and seed, each with its trainer's argv."""
    out = Path(spec.get("out") or "runs/sweep").resolve()
    base = ["--config", str(Path(spec["base"]).resolve())] if spec.get("base") else []
    fixed = [f"--{k}={json.dumps(v)}" for k, v in (spec.get("overrides") or {}).items()]
    runs = []
    for params in settings(spec):
        for seed in spec.get("seeds", [0]):
            name = run_name(params, seed)
            swept = [f"--{k}={json.dumps(v)}" for k, v in params.items() if k != "method"]
            runs.append({"name": name, "method": params.get("method", spec.get("method", "flow_matching")),
                         "params": params, "seed": seed, "run_dir": str(out / name),
                         "argv": [*base, *fixed, *swept, f"--seed={seed}", "--run_dir", str(out / name),
                                  "--resume", "latest"]})
    if len({r["name"] for r in runs}) < len(runs):
        raise SweepError("two runs have the same name: a grid or choice lists a value twice, or random draws repeat "
                         "(use more digits of range or fewer draws)")
    return out, runs


# ----------------------------------------------------------------------------------------------------------
# Validation through the trainers' own config path, and the state of each run folder.


def resolve_config(method, argv):
    """The run's config exactly as train_{method}.py loads it at start-up (its DEFAULTS and typed CONFIG,
    the combination checks). A bad key or value raises config.ConfigError naming it. The one place this tool
    touches the config API."""
    trainer = importlib.import_module(f"train_{method}")
    return config.load_config(trainer.DEFAULTS, argv, method=method, schema=trainer.CONFIG)


def validate(runs):
    """Every run's resolved config (run["config"]), or one SweepError naming each bad run and its keys. The
    start-up warnings (budgets) are printed once each, not once per run."""
    problems, warnings = [], {}
    for run in runs:
        printed = io.StringIO()
        try:
            with redirect_stdout(printed):
                run["config"] = json.loads(json.dumps(resolve_config(run["method"], run["argv"])))
        except config.ConfigError as e:
            problems.append(f"run {run['name']}: " + str(e).replace("\n", "\n    "))
        for line in printed.getvalue().splitlines():
            warnings.setdefault(line, run["name"])
    for line, first in warnings.items():
        print(f"{line} (run {first}{' and others' if len(runs) > 1 else ''})")
    if problems:
        raise SweepError(f"{len(problems)} of {len(runs)} runs have invalid configs; nothing was run or submitted:\n  "
                         + "\n  ".join(problems))


def finished(run_dir, max_steps, report=True):
    """Whether a run is done: its export is complete (export/config.json is written last) at max_steps, and its
    report written (the last thing a run does, when log.report is on). Standard library only: the SLURM task
    calls it too."""
    export = Path(run_dir) / "export" / "config.json"
    if not export.is_file():
        return False
    try:
        steps = json.loads(export.read_text())["train"]["max_steps"]
    except (ValueError, KeyError, TypeError):
        return False
    return steps == max_steps and (not report or (Path(run_dir) / "report.md").is_file())


def run_state(run):
    """'finished', 'interrupted' (a folder with a checkpoint or metrics) or 'new'. A folder whose config.json
    differs from the sweep's config for that run (ignoring what the trainer fills in: resume, data.num_classes left
    None, and what train.global_batch resolves at the start, fit.resolved_keys) is an error: rerunning would mix two
    experiments under one name. A None wanted is compared like any value (conditioning.pooled_text: None is off in
    disentangled text runs), and a key the folder's config lacks as what the run did before it (config.recorded)."""
    run_dir, cfg = Path(run["run_dir"]), run["config"]
    saved_file = run_dir / "config.json"
    if saved_file.is_file():
        saved, wanted = config.flatten(json.loads(saved_file.read_text())), config.flatten(cfg)
        filled = {"resume"} | fit.resolved_keys(cfg["train"])
        differ = [k for k, v in wanted.items() if k not in filled and not (v is None and k in config.TRAINER_FILLS)
                  and config.recorded(saved, k, v) != v]
        if differ:
            raise SweepError(f"run {run['name']}: {saved_file} was written with another config ("
                             + ", ".join(f"{k}: {config.recorded(saved, k, None)!r} there, {wanted[k]!r} now"
                                         for k in differ[:5])
                             + "); give the sweep another 'out' (that folder and its checkpoints stay as they are), "
                             "or set those keys back to resume it")
    if finished(run_dir, cfg["train"]["max_steps"], cfg["log"]["report"]):
        return "finished"
    return "interrupted" if (run_dir / "checkpoints").is_dir() or (run_dir / "metrics.jsonl").is_file() else "new"


def prepare(path, write=True):
    """Read, expand and validate a sweep; write OUT/sweep.json (what compare.py reads); return (spec, out, runs)."""
    spec = read_sweep(path)
    out, runs = expand(spec)
    validate(runs)
    for run in runs:
        run["state"] = run_state(run)
    if not write:
        return spec, out, runs
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"sweep": str(Path(path).resolve()), "spec": spec,
                "swept": [*spec.get("grid", {}), *((spec.get("random") or {}).get("keys") or {})],
                "runs": [{k: r[k] for k in ("name", "method", "params", "seed", "run_dir", "argv")} for r in runs]}
    (out / "sweep.json").write_text(json.dumps(manifest, indent=2))
    return spec, out, runs


# ----------------------------------------------------------------------------------------------------------
# Running: here, one after another.


def trainer_command(run):
    return [sys.executable, str(ROOT / f"train_{run['method']}.py"), *run["argv"]]


def shown(run):
    """The trainer command as a user pastes it into a shell: `python train_....py --... --seed=0 ...`."""
    return shlex.join(["python", *trainer_command(run)[1:]])


def run_local(runs):
    """Each unfinished run in turn, in its own process (so each peak memory is its own). A run stopped by a
    signal (exit 75, checkpoint written) or failing stops the sweep; rerunning it resumes."""
    todo = [r for r in runs if r["state"] != "finished"]
    for i, run in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {run['name']} ({run['state']}): {shown(run)}", flush=True)
        code = subprocess.run(trainer_command(run)).returncode
        if code == REQUEUE_EXIT_CODE:
            raise SystemExit(f"run {run['name']} stopped by a signal with a checkpoint; run the sweep again to resume")
        if code:
            raise SystemExit(f"run {run['name']} failed (exit code {code}); its folder: {run['run_dir']}")
    return todo


# ----------------------------------------------------------------------------------------------------------
# Running on SLURM: one submitit array task per run.


def executor_parameters(spec, num_runs):
    """submitit AutoExecutor parameters from the sweep's `slurm` section (tasks_per_node=1: one accelerate
    launch per node spawns the ranks; `accelerate launch` inside tasks_per_node > 1 would spawn them twice)."""
    slurm = {**SLURM_DEFAULTS, **spec.get("slurm", {})}
    params = {SLURM_KEYS[k]: v for k, v in slurm.items() if v is not None and k != "max_timeouts"}
    return {**params, "tasks_per_node": 1, "name": Path(spec.get("out") or "sweep").name,
            "slurm_array_parallelism": slurm.get("max_parallel") or num_runs}


def make_executor(spec, folder, num_runs, cluster="slurm"):
    """A submitit executor for the sweep; cluster="local" is submitit's LocalExecutor (the tests use it)."""
    import submitit

    slurm = {**SLURM_DEFAULTS, **spec.get("slurm", {})}
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster, slurm_max_num_timeout=slurm["max_timeouts"])
    executor.update_parameters(**executor_parameters(spec, num_runs))
    return executor


def launch_command(run, env, gpus_per_node):
    """The command one array task runs on its node. More than one process: `accelerate launch` over the node's
    GPUs, node `env.node` of `env.num_nodes`, the rendezvous on the first node at a port derived from the job id
    (two jobs on a node do not collide). One process: the trainer itself; accelerate's single-process launcher
    would hide its exit code 75 (it exits with 1) and die on SIGTERM while the trainer still checkpoints."""
    processes = env.num_nodes * max(gpus_per_node, 1)
    if processes == 1:
        return trainer_command(run)
    port = 20000 + int(re.sub(r"\D", "", str(env.raw_job_id)) or 0) % 10000
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(env.num_nodes),
            "--num_processes", str(processes), "--machine_rank", str(env.node), "--main_process_ip",
            env.hostnames[0], "--main_process_port", str(port), "--rdzv_backend", "static", "--same_network",
            # accelerate's defaults only: the trainer passes its own
            "--mixed_precision", "no", "--dynamo_backend", "no",
            str(ROOT / f"train_{run['method']}.py"), *run["argv"]]


def ignore_usr_signals():
    """In the launched processes, before exec: USR1 and USR2 ignored unless a process installs its own handler.
    The trainers handle USR1 (StopSignals); the launcher and helpers must not die of it, and SLURM delivers
    submitit's USR2 to every process of the job."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def process_tree(pid):
    """pid and all its descendants (Linux /proc): torchrun starts each rank in a session of its own, so a
    process group would miss them."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def signal_tree(pid, signum):
    for p in process_tree(pid):
        try:
            os.kill(p, signum)
        except ProcessLookupError:
            pass


class RunTask:
    """One array task: its run, launched on this node, requeued through submitit when the trainer stops for a
    requeue. submitit calls checkpoint() on the preemption / time-limit signal (USR2, sent `signal_delay_s` before
    the limit), in this process's main thread: it asks the trainer to stop (USR1: checkpoint and exit 75), waits
    until it has, and returns the same task to run again. A SIGTERM (preemption) is passed on to the trainer,
    which checkpoints and exits; the task then hands itself to the same mechanism (submitit's signal). Only the
    standard library and submitit here: this runs on the cluster's nodes, from a pickle."""

    def __init__(self, gpus_per_node=1):
        self.gpus_per_node, self.process, self.stopped = gpus_per_node, None, False

    def __call__(self, run):
        import submitit

        if finished(run["run_dir"], run["max_steps"], run["report"]):
            return run["run_dir"]
        env = submitit.JobEnvironment()
        signal.signal(signal.SIGTERM, self.forward_stop)
        cmd = launch_command(run, env, self.gpus_per_node)
        print(f"{env}: {shlex.join(cmd)}", flush=True)
        environ = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONUNBUFFERED": "1",
                   "HF_DATASETS_OFFLINE": os.environ.get("HF_DATASETS_OFFLINE", "1")}  # prefetch.py filled the cache
        self.process = subprocess.Popen(cmd, env=environ, preexec_fn=ignore_usr_signals)
        code = self.process.wait()
        if finished(run["run_dir"], run["max_steps"], run["report"]):
            return run["run_dir"]
        if env.global_rank != 0:  # another node of a multi-node run: the first node's task decides
            return None
        if code == REQUEUE_EXIT_CODE or self.stopped:  # checkpoint written: requeue as submitit does on its signal
            os.kill(os.getpid(), getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG))  # handled here; exits
        raise RuntimeError(f"run {run['name']} failed: exit code {code} (folder {run['run_dir']})")

    def forward_stop(self, signum, frame):
        self.stopped = True
        if self.process is not None:
            signal_tree(self.process.pid, signum)

    def checkpoint(self, run):
        import submitit

        if self.process is not None and self.process.returncode is None:
            self.stopped = True
            signal_tree(self.process.pid, signal.SIGUSR1)  # the trainer checkpoints at its next log step, exits 75
            try:  # os.waitpid, not Popen.wait: the interrupted Popen.wait holds its lock
                os.waitpid(self.process.pid, 0)
            except ChildProcessError:
                pass
        return submitit.helpers.DelayedSubmission(RunTask(self.gpus_per_node), run)


def submit(spec, out, runs, cluster="slurm"):
    """Submit the unfinished runs as one array (one task per run); returns the submitit jobs."""
    import cloudpickle

    todo = [r for r in runs if r["state"] != "finished"]
    if not todo:
        return []
    if __name__ != "__main__":  # imported (tests): the nodes cannot import tools/sweep.py by name
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    executor = make_executor(spec, out / "submitit", len(todo), cluster)
    gpus = {**SLURM_DEFAULTS, **spec.get("slurm", {})}["gpus_per_node"]
    tasks = [{k: r[k] for k in ("name", "method", "run_dir", "argv")}
             | {"max_steps": r["config"]["train"]["max_steps"], "report": r["config"]["log"]["report"]} for r in todo]
    jobs = executor.map_array(RunTask(gpus if cluster == "slurm" else 0), tasks)
    for run, job in zip(todo, jobs):
        print(f"submitted {run['name']} ({run['state']}) as job {job.job_id}")
    return jobs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a sweep file, e.g. configs/sweep_conditioning.json")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--local", action="store_true", help="run here, one after another (default: SLURM via submitit)")
    how.add_argument("--dry_run", action="store_true", help="print the runs and their state; run nothing")
    args = parser.parse_args(argv)
    try:
        spec, out, runs = prepare(args.sweep, write=not args.dry_run)
    except SweepError as e:
        raise SystemExit(f"sweep: {e}") from None
    states = {s: sum(r["state"] == s for r in runs) for s in ("finished", "interrupted", "new")}
    print(f"{len(runs)} runs in {out} (" + ", ".join(f"{n} {s}" for s, n in states.items()) + ")")
    todo = sum(r["state"] != "finished" for r in runs)
    if args.dry_run:
        for run in runs:
            print(f"{run['state']:12s} {run['name']}: {shown(run)}")
        print(f"dry run: nothing was run; {todo} of {len(runs)} runs would run (--local here, or on SLURM without it)")
        return runs
    done = run_local(runs) if args.local else submit(spec, out, runs)
    print(f"sweep: {len(done)} run(s) {'done here' if args.local else 'submitted'}, {len(runs) - todo} finished before"
          f"; {'when they finish, ' * (not args.local)}compare them: python tools/compare.py {out}")
    return done


if __name__ == "__main__":
    main()
