"""What does the trainer's bookkeeping cost? Ratio of train_flow_matching.py's images/s to a bare
forward-backward-optimizer loop on the same model and batch size, measured in one process, one run.

    python benchmarks/step_overhead.py [--steps 60] [--batch_size 64] [extra --key=value trainer overrides]

Both speeds are taken per 10 steps: the trainer's from its logged intervals after the first (warm-up) in
metrics.jsonl, the bare loop's from 10-step chunks measured before and after the trainer. On a shared machine
single intervals swing by 20%, so the ratio is printed for the medians and for the best intervals (the speed
each reaches when undisturbed).
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
import config  # noqa: E402
from model import build_denoiser  # noqa: E402
import train_flow_matching as fm  # noqa: E402


def bare_loop(cfg, steps):
    """images/s of forward, loss, backward and Adam step alone, per 10-step chunk."""
    torch.manual_seed(0)
    model = build_denoiser(cfg, 3, cfg.data.resolution)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    b, r = cfg.train.batch_size, cfg.data.resolution
    x0, noise = torch.randn(b, 3, r, r), torch.randn(b, 3, r, r)
    cond = {"label": torch.randint(0, cfg.data.num_classes, (b,)), "drop": torch.zeros(b, dtype=torch.bool)}
    rates = []
    for i in range(steps + 3):
        if i >= 3 and (i - 3) % 10 == 0:
            start = time.perf_counter()
        t = torch.rand(b)
        loss = fm.flow_matching_loss(model, x0, cond, t, noise).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3 and (i - 3) % 10 == 9:
            rates.append(10 * b / (time.perf_counter() - start))
    return rates


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=64)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"--run_dir={tmp}/run", f"--data.cache_dir={tmp}/cache", f"--train.max_steps={args.steps}",
                     f"--train.batch_size={args.batch_size}", "--log.every=10", "--log.wandb=off",
                     "--val.every=1000000", "--ckpt.every=1000000", "--val.steps=1", "--val.num_samples=1",
                     "--val.loss_samples=1", "--data.num_classes=9", *extra]
        cfg = config.load_config(fm.DEFAULTS, overrides)
        bare = bare_loop(cfg, args.steps)
        fm.main(overrides)
        bare += bare_loop(cfg, args.steps)
        logs = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        trainer = [m["images_per_s"] for m in logs if "images_per_s" in m and m["step"] > 10]
        wait = statistics.median(m["data_wait_share"] for m in logs if "images_per_s" in m and m["step"] > 10)
    print(f"bare loop: median {statistics.median(bare):.1f}, best {max(bare):.1f} images/s; trainer: median "
          f"{statistics.median(trainer):.1f}, best {max(trainer):.1f} images/s (data wait {wait:.1%})")
    print(f"ratio trainer / bare: medians {statistics.median(trainer) / statistics.median(bare):.3f}, "
          f"best {max(trainer) / max(bare):.3f}")
