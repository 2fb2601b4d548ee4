"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/training.md.

Adaptive time density against the base density, both trainers, on the embedded demo at equal steps.

For each trainer, two runs that differ only in objective.time_sampling (flow matching: logit_normal vs
adaptive) or objective.timestep_sampling (DDPM: uniform vs adaptive), same seed, data and model. Printed:
the final validation loss (the held-out loss on the fixed time grid, which does not depend on the training
density) and the variance of the per-step training loss (logged every step; the weighted loss under adaptive,
an unbiased estimate of the same objective) over the second half of the run, trend removed (half the
variance of successive differences).

    python benchmarks/adaptive_time.py --steps 300                     # the default: a 2-layer model, batch 32
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KEYS = {"train_flow_matching": ("objective.time_sampling", "logit_normal"),
        "train_ddpm": ("objective.timestep_sampling", "uniform")}


def run(trainer, sampling, args, out):
    key, _ = KEYS[trainer]
    run_dir = Path(out) / f"{trainer}_{sampling}"
    cmd = [sys.executable, str(ROOT / f"{trainer}.py"), f"--run_dir={run_dir}", f"--{key}={sampling}",
           f"--data.cache_dir={Path(out) / 'cache'}", f"--train.max_steps={args.steps}",
           f"--train.batch_size={args.batch_size}", f"--model.num_layers={args.layers}",
           f"--model.attention_head_dim={args.head_dim}", "--log.every=1", "--log.grad_every=0",
           f"--val.every={args.steps}", f"--ckpt.every={args.steps}", "--log.wandb=off", "--log.report=false",
           "--val.num_samples=4", f"--seed={args.seed}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r][args.steps // 2:]
    diffs = [b - a for a, b in zip(losses, losses[1:])]
    mean = sum(diffs) / len(diffs)
    return {"trainer": trainer, "sampling": sampling, "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
            "step_loss_variance": sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / 2,
            "mean_step_loss": sum(losses) / len(losses)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=16, help="width = 4 heads x this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainers", default="train_flow_matching,train_ddpm")
    parser.add_argument("--out", default="runs/adaptive_time")
    args = parser.parse_args(argv)
    results = []
    for trainer in args.trainers.split(","):
        for sampling in (KEYS[trainer][1], "adaptive"):
            results.append(run(trainer, sampling, args, args.out))
            print(json.dumps(results[-1]), flush=True)
    print(f"\n{args.steps} steps at batch {args.batch_size}, {args.layers} layers of width {4 * args.head_dim}, "
          f"seed {args.seed}")
    print(f"{'trainer':22s} {'time density':14s} {'val loss':>9s} {'per-step loss variance':>23s}")
    for r in results:
        print(f"{r['trainer']:22s} {r['sampling']:14s} {r['val_loss']:9.4f} {r['step_loss_variance']:23.3e}")
    return results


if __name__ == "__main__":
    main()
