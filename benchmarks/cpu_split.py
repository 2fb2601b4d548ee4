"""Feeds docs/benchmarks/real_options.md (the training options on the real-image recipe: where a run's CPU goes).

Where a training run's CPU goes: start-up, the training steps, validations, checkpoints and the export (issue
57). An equal-CPU comparison divides by the training steps' own CPU (the trainer's `cpu_s_per_step`); dividing a
whole run's CPU by its steps spreads the rest over the steps, which raises every arm's cost per step by the same
amount and moves the slower arm's equal-CPU step count towards base's. This measures by how much, on one short run
of the real-image recipe in this process:

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/cpu_split.py [--trainer flow_matching] [trainer arguments]

A warm-up run (2 steps, a child process) builds the data cache first, as a campaign's runs find it built. The
measured run (by default 40 steps, a log every 10, a validation and a checkpoint every 20) is split by phase: start-up
(the process's CPU when the training monitor starts: interpreter, imports, data, model), each logged interval's
steps, each validation and checkpoint, and what follows the loop (export, report). Printed: each part, and the
fixed part of a run of --steps steps at the recipe's validation and checkpoint interval, in steps of training.
"""
import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_ddpm  # noqa: E402
import train_flow_matching  # noqa: E402
from training.run import monitor  # noqa: E402

RECIPE = ROOT / "configs" / "fashion_mnist.json"
MEASURED = ["--train.max_steps=40", "--log.every=10", "--val.every=20", "--ckpt.every=20", "--log.wandb=off",
            "--log.report=false"]


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measured_run(trainer, argv):
    """The run in this process with the monitor's phases timed in CPU seconds: {phase: [seconds, ...]}."""
    parts = {"start-up": [], "validation": [], "checkpoint": [], "after the loop": []}
    init, pause, close = monitor.Monitor.__init__, monitor.Monitor.pause, monitor.Monitor.close

    def timed_init(self, *a, **k):
        parts["start-up"].append(cpu())
        init(self, *a, **k)

    def timed_pause(self, work, step, name=None):
        before = cpu()
        pause(self, work, step, name)
        parts.setdefault(name.split()[0] if name else work.__name__, []).append(cpu() - before)

    def timed_close(self):
        close(self)
        parts["closed"] = cpu()

    monitor.Monitor.__init__, monitor.Monitor.pause, monitor.Monitor.close = timed_init, timed_pause, timed_close
    try:
        run = trainer.main(argv)
    finally:
        monitor.Monitor.__init__, monitor.Monitor.pause, monitor.Monitor.close = init, pause, close
    parts["after the loop"], parts["whole process"] = [cpu() - parts.pop("closed")], [cpu()]
    return run, parts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainer", default="flow_matching", choices=["flow_matching", "ddpm"])
    p.add_argument("--steps", type=int, nargs="*", default=[300, 1200], help="run lengths to state the fixed part for")
    args, extra = p.parse_known_args(argv)
    trainer = {"flow_matching": train_flow_matching, "ddpm": train_ddpm}[args.trainer]
    recipe = json.loads(RECIPE.read_text())
    every = recipe["val"]["every"], recipe["ckpt"]["every"]
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--config", str(RECIPE), f"--data.cache_dir={tmp}/cache", *extra]
        started = time.time()
        subprocess.run([sys.executable, str(ROOT / f"train_{args.trainer}.py"), *common, f"--run_dir={tmp}/warm",
                        "--train.max_steps=2", "--log.wandb=off",
                        "--log.report=false"], check=True, capture_output=True)
        print(f"warm-up run (cache built): {time.time() - started:.0f} s", flush=True)
        run, parts = measured_run(trainer, [*common, *MEASURED, f"--run_dir={tmp}/measured"])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "cpu_s_per_step" in r]
    steps = [b["step"] - a["step"] for a, b in zip([{"step": 0}, *rows], rows)]
    parts["training steps"] = [r["cpu_s_per_step"] * n for r, n in zip(rows, steps)]
    per_step = sum(parts["training steps"]) / sum(steps)
    between = parts["whole process"][0] - sum(sum(v) for k, v in parts.items() if k != "whole process")
    print(f"\n{args.trainer}, {sum(steps)} steps, one process ({' '.join(extra) or 'the recipe'}), CPU seconds:")
    print("  intervals' CPU per step: " + ", ".join(f"{r['cpu_s_per_step']:.3f}" for r in rows)
          + f" (all: {per_step:.3f})")
    for name, values in parts.items():
        print(f"  {name:16s} {sum(values):8.1f}" + (f"  ({len(values)} x {sum(values) / len(values):.2f})"
                                                  if len(values) > 1 else ""))
    print(f"  {'between phases':16s} {between:8.1f}  (logging, the loop's set-up)")
    once = parts["start-up"][0] + parts["after the loop"][0] + between
    validation, checkpoint = (sum(parts[k]) / len(parts[k]) for k in ("validation", "checkpoint"))
    print(f"\nthe rest of a run beside its training steps, at the recipe's validation every {every[0]} and checkpoint "
          f"every {every[1]} steps, each also at the last step ({once:.1f} once, {validation:.1f} a validation, "
          f"{checkpoint:.2f} a checkpoint):")
    for n in args.steps:  # common.due: every `every` steps and at the last
        fixed = once + validation * -(-n // every[0]) + checkpoint * -(-n // every[1])
        print(f"  {n:5d} steps: {fixed:6.1f} CPU-s = {fixed / per_step:5.1f} steps of training; the whole run's CPU "
              f"over its steps is {1 + fixed / (n * per_step):.3f}x the training steps' own")

if __name__ == "__main__":
    main()
