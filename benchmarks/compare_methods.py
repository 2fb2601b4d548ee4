"""DDPM against flow matching, side by side: the same data (the embedded demo unless overridden), model, batch,
learning rate and step budget, trained one after another, each in its own process (so each peak memory is
its own), with a checkpoint every --eval_every steps.

The two losses are on different scales, so quality is measured through samples: a small CNN trained on the
real images (demo_quality.train_classifier) classifies --per_class samples per class drawn with fixed noise
from the EMA weights of every kept checkpoint (ema.safetensors loaded into the exported architecture) and
from the final export, each through its trainer's own `generate` (its sampler, steps and guidance). Columns:

  images/s            median over the training rows of metrics.jsonl
  peak GB             largest peak_memory_gb logged (GPU allocator peak; on CPU the process's max RSS)
  quality             class accuracy of the final export's samples (chance 0.111)
  loss spikes         rows of metrics.jsonl with "event": "loss_spike"
  loss rel. std       std of loss / loss_smoothed - 1 over the training rows of the last half (scale-free)
  step / s to thr     first checkpoint step whose class accuracy reaches --threshold, and the training seconds
                      to it (each logged interval's steps x batch / images_per_s, summed and interpolated;
                      startup, validation and checkpoint writes excluded); "not reached" if none does

The table is also written to OUT/compare_methods.json with the accuracy curves. OUT/{flow_matching,ddpm}
are deleted and retrained on each call; OUT/cache is kept.

    python benchmarks/compare_methods.py [--steps 600] [--eval_every 150] [--per_class 10] [--threshold 0.4]
    python benchmarks/compare_methods.py --steps 40 --eval_every 20 --train.batch_size=16  # --a.b=v: both trainers
"""
import argparse
import importlib
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from training.config import load_config  # noqa: E402
from training.data import DEMO_CLASSES  # noqa: E402
from training.model import load_exported  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from demo_quality import train_classifier  # noqa: E402

METHODS = {"flow matching": "train_flow_matching", "ddpm": "train_ddpm"}
HEADERS = ["method", "sampler", "images/s", "peak GB", "quality", "loss spikes", "loss rel. std",
           "step to thr", "s to thr"]


@torch.no_grad()
def class_accuracy(model, cfg, trainer, classifier, per_class, seed=0):
    """Share of `per_class` samples per class classified as asked (fixed noise; as demo_quality.score_run)."""
    tc = model.transformer.config
    labels = torch.arange(len(DEMO_CLASSES)).repeat_interleave(per_class)
    noise = torch.randn((len(labels), tc.in_channels, tc.sample_size, tc.sample_size),
                        generator=torch.Generator().manual_seed(seed))
    hits = 0
    for i in range(0, len(labels), 60):
        cond = {"label": labels[i:i + 60], "drop": torch.zeros(len(labels[i:i + 60]), dtype=torch.bool)}
        x = trainer.generate(model, noise[i:i + 60], cond, cfg)
        hits += (classifier(x.clamp(-1, 1)).argmax(1) == labels[i:i + 60]).sum().item()
    return hits / len(labels)


def quality_curve(run_dir, method, classifier, per_class):
    """{step: class accuracy} over the kept checkpoints' EMA weights; the final step is the export itself."""
    model, cfg = load_exported(run_dir / "export")
    trainer = importlib.import_module(METHODS[method])
    final = cfg["train"]["max_steps"]
    steps = sorted({int(f.name[5:]) for f in (run_dir / "checkpoints").glob("step_*")} - {final})
    curve = {}
    for step in tqdm([final, *steps], desc=f"scoring {method} checkpoints"):
        if step != final:
            model.load_state_dict(load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / "ema.safetensors")))
        curve[step] = class_accuracy(model, cfg, trainer, classifier, per_class)
    return dict(sorted(curve.items())), cfg


def summarize(run_dir, cfg, curve, threshold):
    """One table row from metrics.jsonl and the quality curve."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = sorted((r for r in rows if "images_per_s" in r and "event" not in r), key=lambda r: r["step"])
    max_steps = cfg["train"]["max_steps"]
    late = [r["loss"] / r["loss_smoothed"] - 1 for r in train if r["step"] > max_steps / 2 and r["loss_smoothed"]]
    batch = cfg["train"]["batch_size"] * cfg["train"]["grad_accum"]
    steps, seconds = [0], [0.0]  # cumulative training time at each logged step
    for r in train:
        seconds.append(seconds[-1] + (r["step"] - steps[-1]) * batch / r["images_per_s"])
        steps.append(r["step"])
    reached = next((s for s, acc in curve.items() if acc >= threshold), None)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return {"sampler": f"{cfg['val']['sampler']} {cfg['val']['steps']}",
            "images_per_s": statistics.median(r["images_per_s"] for r in train),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in train),
            "quality": curve[max_steps],
            "loss_spikes": sum(r.get("event") == "loss_spike" for r in rows),
            "loss_rel_std": statistics.pstdev(late) if late else math.nan,
            "step_to_threshold": reached,
            "seconds_to_threshold": None if reached is None else float(np.interp(reached, steps, seconds)),
            "final_val_loss_own_scale": val[-1] if val else None,  # not comparable across methods
            "quality_curve": curve}


def format_table(results, threshold):
    head = [h.replace("thr", f"{threshold:g}") for h in HEADERS]
    lines = []
    for method, r in results.items():
        reached = r["step_to_threshold"] is not None
        lines.append([method, r["sampler"], f"{r['images_per_s']:.1f}", f"{r['peak_memory_gb']:.2f}",
                      f"{r['quality']:.3f}", str(r["loss_spikes"]), f"{r['loss_rel_std']:.3f}",
                      str(r["step_to_threshold"]) if reached else "not reached",
                      f"{r['seconds_to_threshold']:.0f}" if reached else "not reached"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, lines)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.json"))
    parser.add_argument("--steps", type=int, default=600, help="training steps of each method")
    parser.add_argument("--eval_every", type=int, default=150, help="checkpoint interval at which quality is scored")
    parser.add_argument("--per_class", type=int, default=10, help="samples per class at each scored checkpoint")
    parser.add_argument("--threshold", type=float, default=0.4, help="class accuracy for 'time to quality'")
    parser.add_argument("--classifier_steps", type=int, default=600)
    parser.add_argument("--out", default="runs/compare_methods")
    args, extra = parser.parse_known_args(argv)  # the rest: --a.b=value overrides for both trainers
    out, config = Path(args.out).resolve(), str(Path(args.config).resolve())  # the trainers run in ROOT
    resolution = load_config(fm.DEFAULTS, ["--config", config, *extra]).data.resolution
    classifier, acc = train_classifier(steps=args.classifier_steps, resolution=resolution)
    tqdm.write(f"classifier accuracy on held-out real demo images: {acc:.3f}")
    results = {}
    for method, script in METHODS.items():  # one after another, never concurrently
        run_dir = out / script.removeprefix("train_")
        shutil.rmtree(run_dir, ignore_errors=True)  # a leftover run would be resumed or appended to
        cmd = [sys.executable, str(ROOT / f"{script}.py"), "--config", config, "--run_dir", str(run_dir),
               f"--data.cache_dir={out / 'cache'}", "--log.wandb=off", f"--train.max_steps={args.steps}",
               f"--ckpt.every={args.eval_every}", f"--ckpt.keep={args.steps // args.eval_every + 2}",
               "--val.every=1000000000", *extra]  # validation only at the last step; quality is scored here
        tqdm.write(f"training {method}: {' '.join(cmd[1:])}")
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        wall = time.perf_counter() - start
        curve, cfg = quality_curve(run_dir, method, classifier, args.per_class)
        results[method] = {**summarize(run_dir, cfg, curve, args.threshold), "run_wall_s": wall}
    table = format_table(results, args.threshold)
    print(f"\n{args.steps} steps each, quality = class accuracy of {len(DEMO_CLASSES) * args.per_class} samples "
          f"(classifier {acc:.3f} on real images), threshold {args.threshold:g}\n{table}")
    for method, r in results.items():
        print(f"quality by step, {method}: " + ", ".join(f"{s} {a:.3f}" for s, a in r["quality_curve"].items()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_methods.json").write_text(json.dumps(
        {"settings": {**vars(args), "overrides": extra, "classifier_accuracy": acc}, "table": table,
         "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
