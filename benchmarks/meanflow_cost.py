"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/performance.md ("MeanFlow's step").

What a MeanFlow step costs against a flow-matching one (training/objectives/meanflow.py), on the Fashion-MNIST
recipe's model (configs/fashion_mnist.json: 6 blocks of width 128, 28 px, patch 4, x-prediction, Muon, batch 128),
on random images of its shape: the trainer's step (forward, loss, backward, clip, optimizer step), each arm in a
process of its own, one thread:

  flow_matching    the recipe's loss
  meanflow         objective.meanflow with the paper's defaults: r = t for 75% (the JVP on the other 25%),
                   guidance 2 folded in with kappa 0.5 (two evaluations without autograd: null and conditional)
  meanflow_kappa0  the same with kappa 0 (one guidance evaluation)
  meanflow_plain   no guidance (meanflow_guidance 1, kappa 0): the JVP alone on top of the step
  meanflow_all_r   no guidance, and every sample r < t (the JVP on the whole batch: the paper's Algorithm 1 as written)

It prints CPU seconds per step (the process's own, after --warmup steps), the ratio to flow matching, and the step's
peak memory, measured in a second process per arm: its peak resident memory over one step (VmHWM, reset through
/proc/self/clear_refs before it) less its resident memory before it (model, optimizer state, batch: the same in
every arm), i.e. the step's activations and temporaries; glibc is told to map every block of 64 KB or more on its
own (MALLOC_MMAP_THRESHOLD_), so that a freed block leaves the resident set instead of a free list (which also
slows the step: that process is not timed). Then the JVP's precision: the target under bf16 autocast against
fp32, relative error, as a GPU run computes it.

    OMP_NUM_THREADS=1 python benchmarks/meanflow_cost.py [--steps 10] [--warmup 2]
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_flow_matching as fm  # noqa: E402
from training.config import config  # noqa: E402
from training.objectives import meanflow  # noqa: E402
from training.optimisation import optimizers  # noqa: E402
from training.run.start import build_for_run  # noqa: E402

ARMS = {"flow_matching": [], "meanflow": ["--objective.meanflow=true"],
        "meanflow_kappa0": ["--objective.meanflow=true", "--objective.meanflow_guidance_mix=0"],
        "meanflow_plain": ["--objective.meanflow=true", "--objective.meanflow_guidance=1",
                           "--objective.meanflow_guidance_mix=0"],
        "meanflow_all_r": ["--objective.meanflow=true", "--objective.meanflow_guidance=1",
                           "--objective.meanflow_guidance_mix=0", "--objective.meanflow_equal_share=0"]}


def recipe(arm, extra=()):
    cfg = config.load_config(fm.DEFAULTS, ["--config", str(ROOT / "configs" / "fashion_mnist.json"),
                                           "--data.num_classes=10", *ARMS[arm], *extra])
    torch.manual_seed(0)
    model = build_for_run(cfg, (1, 28, 28)).train()
    b = cfg.train.batch_size
    x0 = torch.rand(b, 1, 28, 28) * 2 - 1
    cond = {"label": torch.randint(0, 10, (b,)), "drop": torch.rand(b) < cfg.conditioning.semantic_dropout}
    return cfg, model, x0, cond


def step(cfg, model, optimizer, x0, cond):
    """The trainer's micro-batch and optimizer step (train_flow_matching.main's loop, its options off)."""
    obj, noise = cfg.objective, torch.randn_like(x0)
    if obj.meanflow:
        t, r, equal = meanflow.sample_times(len(x0), obj, 1.0, x0.device)
        loss, terms = meanflow.training_loss(model, model, x0, cond, t, r, equal, noise, obj)
    else:
        t = fm.sample_time(len(x0), obj, 1.0, x0.device)
        loss, terms = fm.training_loss(model, x0, cond, t, noise, obj.prediction)
    (loss + sum(terms.values())).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def resident_gb(field):
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in GB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 2**20


def measure(arm, steps, warmup):
    cfg, model, x0, cond = recipe(arm)
    optimizer = optimizers.make_optimizer(model, cfg.train)
    for _ in range(warmup):
        step(cfg, model, optimizer, x0, cond)
    gc.collect()
    before = resident_gb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here
    start = time.process_time()
    for _ in range(steps):
        step(cfg, model, optimizer, x0, cond)
    return {"arm": arm, "cpu_s_per_step": (time.process_time() - start) / steps,
            "step_peak_gb": resident_gb("VmHWM") - before, "resident_before_gb": before}


def jvp_precision():
    """The target (guidance off, every sample r < t) under bf16 autocast against fp32, on the recipe's model with
    its interval embedding given weights: |bf16 - fp32| / |fp32| over the batch, and the same for the model's
    output alone (what bf16 does to any forward)."""
    cfg, model, x0, cond = recipe("meanflow_all_r")
    torch.nn.init.normal_(model.conditioner.interval_embed.linear_2.weight, std=0.02)
    obj, n = cfg.objective, len(x0)
    t, r, _ = meanflow.sample_times(n, obj, 1.0, x0.device)
    t_ = t.view(-1, 1, 1, 1)
    noise = torch.randn_like(x0)
    z, v = (1 - t_) * x0 + t_ * noise, noise - x0
    out = {}
    with torch.no_grad():
        for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                out[name] = (meanflow.target(model.forward, z, t, r, v, cond, 0, obj.prediction),
                             meanflow.average_velocity(model, z, t, r, cond, obj.prediction))
    rel = [((out["bf16"][i] - out["fp32"][i]).norm() / out["fp32"][i].norm()).item() for i in (0, 1)]
    return {"target_rel_error_bf16": rel[0], "forward_rel_error_bf16": rel[1]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--arm", default=None, help="measure one arm in this process (the parent runs each in its own)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.arm:
        print(json.dumps(measure(args.arm, args.steps, args.warmup)), flush=True)
        return
    rows = []
    for arm in ARMS:
        timed, memory = (json.loads(subprocess.run(
            [sys.executable, __file__, "--arm", arm, f"--steps={steps}", f"--warmup={args.warmup}"], env=env,
            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            for steps, env in ((args.steps, os.environ), (1, {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})))
        rows.append({**timed, "step_peak_gb": memory["step_peak_gb"]})
        print(f"{arm}: {rows[-1]['cpu_s_per_step']:.3f} CPU s a step, {rows[-1]['step_peak_gb']:.3f} GB", flush=True)
    base = rows[0]["cpu_s_per_step"]
    print(f"\n{args.steps} steps after {args.warmup} of warm-up, batch 128, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)\n| arm | CPU s / step | vs flow matching | step's peak memory (GB) "
          f"| vs flow matching |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {row['cpu_s_per_step']:.3f} | {row['cpu_s_per_step'] / base:.2f}x | "
              f"{row['step_peak_gb']:.3f} | {row['step_peak_gb'] / rows[0]['step_peak_gb']:.2f}x |")
    precision = jvp_precision()
    print(f"\nbf16 autocast against fp32: the target's relative error {precision['target_rel_error_bf16']:.2e}, "
          f"the forward's alone {precision['forward_rel_error_bf16']:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, **precision}, indent=1))


if __name__ == "__main__":
    main()
