"""What does the trainer's bookkeeping cost? Ratio of train_flow_matching.py's images/s to a bare
forward-backward-optimizer loop on the same model, batch size and optimizer (fused AdamW), in one process, one run.

    python benchmarks/step_overhead.py [--steps 60] [--batch_size 64] [extra --key=value trainer overrides]

The two alternate: after each of the trainer's logged 10-step intervals (its own images/s, in metrics.jsonl)
the bare loop runs 10 steps, and the trainer's clock restarts after it. A shared machine's load then falls on
both alike; the ratio of the medians is the overhead (the first, warm-up interval of each is dropped). The
trainer runs with its defaults, the gradient analysis included (every log.grad_every = 50 steps).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import monitor  # noqa: E402
from model import build_denoiser  # noqa: E402
import train_flow_matching as fm  # noqa: E402


def bare_loop(cfg):
    """A function that runs 10 steps of forward, loss, backward and Adam step alone, returning images/s."""
    torch.manual_seed(0)
    model = build_denoiser(cfg, 3, cfg.data.resolution)
    opt = common.make_optimizer(model, cfg.train)
    b, r = cfg.train.batch_size, cfg.data.resolution
    x0, noise = torch.randn(b, 3, r, r), torch.randn(b, 3, r, r)
    cond = {"label": torch.randint(0, cfg.data.num_classes, (b,)), "drop": torch.zeros(b, dtype=torch.bool)}

    def ten_steps():
        start = time.perf_counter()
        for _ in range(10):
            loss = fm.flow_matching_loss(model, x0, cond, torch.rand(b), noise).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return 10 * b / (time.perf_counter() - start)
    return ten_steps


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=64)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"--run_dir={tmp}/run", f"--data.cache_dir={tmp}/cache", f"--train.max_steps={args.steps}",
                     f"--train.batch_size={args.batch_size}", "--log.every=10", "--log.wandb=off", "--log.report=false",
                     "--val.every=1000000", "--ckpt.every=1000000", "--val.steps=1", "--val.num_samples=1",
                     "--val.loss_samples=1", *extra]
        cfg = common.load_config(fm.DEFAULTS, overrides)
        ten_bare_steps, bare = bare_loop(cfg), []
        log_interval = monitor.Monitor.log_interval

        def log_then_bare(self, step, lr):  # the trainer's interval, then the bare loop's, then the clock restarts
            metrics = log_interval(self, step, lr)
            bare.append(ten_bare_steps())
            self.restart_clock()
            return metrics
        monitor.Monitor.log_interval = log_then_bare
        fm.main(overrides)
        logs = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        trainer = [m["images_per_s"] for m in logs if "images_per_s" in m][1:]
        wait = statistics.median(m["data_wait_share"] for m in logs if "images_per_s" in m)
    bare = bare[1:]
    print(f"bare loop: median {statistics.median(bare):.1f}, best {max(bare):.1f} images/s; trainer: median "
          f"{statistics.median(trainer):.1f}, best {max(trainer):.1f} images/s (data wait {wait:.1%})")
    print(f"ratio trainer / bare: medians {statistics.median(trainer) / statistics.median(bare):.3f}, "
          f"best {max(trainer) / max(bare):.3f}, means {statistics.mean(trainer) / statistics.mean(bare):.3f} "
          f"({len(trainer)} alternated intervals)")
