"""Feeds docs/benchmarks/step_overhead.md (the trainer's step against a bare loop).

What does the trainer's bookkeeping cost? Ratio of train_flow_matching.py's images/s to a bare
forward-backward-optimizer loop on the same model, batch size and optimizer (fused AdamW), in one process, one run.

    python benchmarks/step_overhead.py [--steps 60] [--batch_size 64] [extra --key=value trainer overrides]

The two alternate step by step: each trainer step is followed by a bare step, which the trainer's clock skips,
so each logged 10-step interval gives the trainer's images/s (metrics.jsonl) and the bare loop's over the same
minutes. A shared machine's load then falls on both alike; the ratio of the medians, and the median of the
intervals' ratios, is the overhead (the first, warm-up interval of each is dropped). The
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
from training.config import config  # noqa: E402
from training.model.mmdit import build_denoiser  # noqa: E402
from training.optimisation import optimizers  # noqa: E402
from training.run import monitor  # noqa: E402
import train_flow_matching as fm  # noqa: E402


def same_model_and_batch(cfg):
    """The model, fused AdamW, batch and condition that both the bare loop and the part-by-part timing use."""
    torch.manual_seed(0)
    model = build_denoiser(cfg, 3, cfg.data.resolution)
    b, r = cfg.train.batch_size, cfg.data.resolution
    cond = {"label": torch.randint(0, cfg.data.num_classes, (b,)), "drop": torch.zeros(b, dtype=torch.bool)}
    return model, optimizers.make_optimizer(model, cfg.train), torch.randn(b, 3, r, r), torch.randn(b, 3, r, r), cond


def bare_loop(cfg):
    """A function that runs one step of forward, loss, backward and Adam step alone, returning its seconds."""
    model, opt, x0, noise, cond = same_model_and_batch(cfg)

    def one_step():
        start = time.perf_counter()
        loss = fm.flow_matching_loss(model, x0, cond, torch.rand(len(x0)), noise).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return time.perf_counter() - start
    return one_step


def parts(cfg, train_set, repeats=20):
    """Where the trainer's extra time goes: each part of a step the bare loop does not have, timed alone on the
    same model and batch (median of `repeats`, interleaved so that load falls on all parts alike), in ms."""
    import copy

    from accelerate import Accelerator
    from training.data.batching import iterate_batches

    model, opt, x0, noise, cond = same_model_and_batch(cfg)
    ema, b, tr, finite = copy.deepcopy(model), len(x0), cfg.train, torch.tensor(True)
    batches = iterate_batches(train_set, 0, b, 0, 0, 1, {})
    records = monitor.Monitor(cfg, model, Accelerator(cpu=True), log=lambda row: None)
    losses, bins, norm = torch.rand(b), torch.randint(0, cfg.objective.loss_bins, (b,)), torch.tensor(1.0)

    def forward_backward():
        fm.flow_matching_loss(model, x0, cond, torch.rand(b), noise).mean().backward()

    def monitor_records():  # what the monitor writes into its device buffers on an ordinary step
        records.since_log = 0
        records.micro_batch(losses, bins)
        records.optimizer_step(norm, finite)

    steps = {
        "forward + backward (both loops)": forward_backward,
        "fused AdamW step, device-side skip (both loops)": lambda: (optimizers.skip_update_if_nonfinite(opt, finite),
                                                                    opt.step()),
        "gradient clipping (norm, then scale)": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                                       tr.grad_clip),
        "EMA (foreach lerp, the skip flag as weight)": lambda: common.ema_update(ema, model, tr.ema_decay, 1000,
                                                                                 finite),
        "reading a micro-batch from the cache": lambda: next(batches),
        "noise, time sampling, condition dropout": lambda: (torch.randn_like(x0),
                                                            fm.sample_time(b, cfg.objective, 1.0, "cpu"),
                                                             torch.rand(b) < 0.1, torch.rand(b) < 0.1),
        "the monitor's per-step records": monitor_records,
    }
    seconds = {name: [] for name in steps}
    for _ in range(repeats):
        for name, work in steps.items():
            start = time.perf_counter()
            work()
            seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(s) for name, s in seconds.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=64)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"--run_dir={tmp}/run", f"--data.cache_dir={tmp}/cache", f"--train.max_steps={args.steps}",
                     f"--train.batch_size={args.batch_size}", "--log.every=10", "--log.wandb=off", "--log.report=false",
                     "--val.every=1000000", "--ckpt.every=1000000", "--val.steps=1", "--val.num_samples=1",
                     "--val.loss_samples=1", "--data.num_classes=9", *extra]
        cfg = config.load_config(fm.DEFAULTS, overrides)
        bare_step, bare_seconds, bare = bare_loop(cfg), [], []
        optimizer_step, log_interval = monitor.Monitor.optimizer_step, monitor.Monitor.log_interval

        def then_a_bare_step(self, *args):  # each trainer step is followed by a bare one, off the trainer's clock
            optimizer_step(self, *args)
            bare_seconds.append(bare_step())
            self.t_last += bare_seconds[-1]

        def log_and_bare_rate(self, step, lr):  # the bare loop's images/s over the same interval
            bare.append(len(bare_seconds) * cfg.train.batch_size / sum(bare_seconds))
            bare_seconds.clear()
            return log_interval(self, step, lr)
        monitor.Monitor.optimizer_step, monitor.Monitor.log_interval = then_a_bare_step, log_and_bare_rate
        fm.main(overrides)
        logs = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        monitor.Monitor.optimizer_step, monitor.Monitor.log_interval = optimizer_step, log_interval  # unpatched
        from training.data.cache_shards import CachedDataset
        ms = parts(cfg, CachedDataset(next(Path(tmp, "cache").glob("*-train-*"))))
        trainer = [m["images_per_s"] for m in logs if "images_per_s" in m][1:]
        wait = statistics.median(m["data_wait_share"] for m in logs if "images_per_s" in m)
    bare = bare[1:]
    print(f"bare loop: median {statistics.median(bare):.1f}, best {max(bare):.1f} images/s; trainer: median "
          f"{statistics.median(trainer):.1f}, best {max(trainer):.1f} images/s (data wait {wait:.1%})")
    ratios = [t / b for t, b in zip(trainer, bare)]
    print(f"ratio trainer / bare: medians {statistics.median(trainer) / statistics.median(bare):.3f}, median of "
          f"the {len(ratios)} intervals' ratios {statistics.median(ratios):.3f} (each "
          f"{', '.join(f'{r:.3f}' for r in ratios)}), "
          f"best {max(trainer) / max(bare):.3f}")
    step = ms["forward + backward (both loops)"]
    print("part of a step (median of 20, interleaved) | ms | share of forward + backward")
    for name, t in ms.items():
        print(f"{name} | {t:.2f} | {t / step:.2%}")
