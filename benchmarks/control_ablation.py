"""The paper's Fig. 2 claim, tested at demo scale: does changing a low-level control (the image's original size)
change what the image shows? Three arms (conditioning.mode), each with the same fair start (tests/test_conditioning.py):
adanorm (class and controls in the adaptive norm, DiT / SDXL), both (class in attention and in the norm,
MMDiT-native) and disentangled (class through attention only, the size control late by w(t), the paper's).

Data where size carries information: the demo's shapes drawn natively at 8 to 32 px (data.demo_sizes), trained at
16 px with random-resized crops (cached as 4 crops per image, data.cache_views) and the size and crop controls,
so an image drawn at 8 px is a blurry upsample and one drawn at 32 px a sharp downsample
(configs/sweep_conditioning.json). Measured per run, with fixed noise, on the exported EMA model:

  size_drift              share of samples whose class (the demo classifier's) changes when only the size control
                          changes, from the largest size to the smallest, whole-image crop (Fig. 2; lower is better)
  class_accuracy_largest  class accuracy at the largest size, whole-image crop (higher is better)
  fd_classifier           Frechet distance in the classifier's 64 features between samples made with held-out
                          rows' labels, sizes and crops and those held-out images (lower is better)
  sharpness_ratio         mean |Laplacian| of the samples at the largest size over those at the smallest: the size
                          control should change sharpness (> 1; the real images' ratio is printed beside it)

Each run's scores go to RUN/quality.jsonl, and tools/compare.py answers each metric with intervals
(OUT/compare_<metric>/compare.md); a summary table is printed and written to OUT/control_ablation.md.

    python benchmarks/control_ablation.py      # the full protocol: 3 arms x 3 seeds x 1000 steps (~1.5 h on 2 cores)
    python benchmarks/control_ablation.py --steps 300 --seeds 0,1 --layers 2 --out runs/control_ablation_small
"""
import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import eval_fid  # noqa: E402
from training import config  # noqa: E402
from training.data import DEMO_CLASSES, make_demo_dataset, preprocess  # noqa: E402
from training.model import load_exported  # noqa: E402

METRICS = {"size_drift": False, "class_accuracy_largest": True, "fd_classifier": False, "sharpness_ratio": True}


def demo_views(n, seed, data, resolution, sizes=None, whole=False):
    """n demo images (drawn at data.demo_sizes, or `sizes`) preprocessed as training preprocesses them (random-
    resized crops), or whole: pixels in [-1, 1], labels and the control metadata."""
    ds = make_demo_dataset(n, seed, sizes=sizes or data.demo_sizes)
    rng, crop = random.Random(seed), config.Config(data, crop="center" if whole else data.crop, random_flip=False)
    views = [preprocess(img, resolution, crop, rng) for img in ds["image"]]
    meta = {k: torch.stack([m[k] for _, m in views]) for k in ("orig_hw", "crop_box")}
    return torch.stack([x for x, _ in views]), torch.tensor(ds["label"]), meta


def train_classifier(data, resolution, steps=600, seed=0):
    """demo_quality.py's CNN, trained on this data's views (random-resized crops and whole images at every
    size): returns it and its accuracy on freshly drawn whole images at the largest and the smallest size."""
    torch.manual_seed(seed)
    x, y, _ = demo_views(4608, 100, data, resolution)
    xw, yw, _ = demo_views(2304, 102, data, resolution, whole=True)
    x, y = torch.cat([x, xw]), torch.cat([y, yw])
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(64, len(DEMO_CLASSES)))
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    for _ in range(steps):
        idx = torch.randint(len(x), (128,))
        loss = nn.functional.cross_entropy(net(x[idx] + 0.1 * torch.randn_like(x[idx])), y[idx])
        opt.zero_grad(), loss.backward(), opt.step()
    net.eval()
    acc = {}
    with torch.no_grad():
        for side in data.demo_sizes:
            xt, yt, _ = demo_views(450, 101, data, resolution, sizes=[side, side], whole=True)
            acc[side] = (net(xt).argmax(1) == yt).float().mean().item()
    return net, acc


def sharpness(x):
    """Mean |Laplacian| of the grey image: high-frequency energy, what upsampling a small image removes."""
    grey = x.mean(1, keepdim=True)
    kernel = torch.tensor([[0.0, 1, 0], [1, -4, 1], [0, 1, 0]]).view(1, 1, 3, 3)
    return nn.functional.conv2d(grey, kernel).abs().mean().item()


def frechet(a, b):
    from cleanfid.fid import frechet_distance

    a, b = a.double().numpy(), b.double().numpy()
    return float(frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)))


@torch.no_grad()
def score_run(run_dir, classifier, heldout, per_class=20, batch=90):
    """The four metrics of one run's exported EMA model (its own sampler, steps and guidance), fixed noise."""
    model, cfg = load_exported(Path(run_dir) / "export")
    trainer = eval_fid.method_of(cfg)  # (both objectives have a prediction key since x-prediction)
    res, (lo, hi) = cfg["data"]["resolution"], cfg["data"]["demo_sizes"]
    features = classifier[:-1]

    def generate(labels, orig_hw, crop_box, seed):
        noise = torch.randn((len(labels), 3, res, res), generator=torch.Generator().manual_seed(seed))
        out = []
        for i in range(0, len(labels), batch):
            cond = {"label": labels[i:i + batch], "orig_hw": orig_hw[i:i + batch], "crop_box": crop_box[i:i + batch],
                    "drop": torch.zeros(len(labels[i:i + batch]), dtype=torch.bool)}
            out.append(trainer.generate(model, noise[i:i + batch], cond, cfg).clamp(-1, 1))
        return torch.cat(out)

    labels = torch.arange(len(DEMO_CLASSES)).repeat_interleave(per_class)
    n = len(labels)
    at = {side: generate(labels, torch.tensor([side, side]).expand(n, 2), torch.tensor([0, 0, side, side]).expand(n, 4), 0)
          for side in (hi, lo)}  # the same noise and class, only the size control differs
    pred = {side: classifier(x).argmax(1) for side, x in at.items()}
    x_real, y_real, meta = heldout
    fake = generate(y_real, meta["orig_hw"], meta["crop_box"], 1)
    return {"size_drift": (pred[hi] != pred[lo]).float().mean().item(),
            "class_accuracy_largest": (pred[hi] == labels).float().mean().item(),
            "fd_classifier": frechet(features(fake), features(x_real)),
            "sharpness_ratio": sharpness(at[hi]) / sharpness(at[lo]), "samples": n}


def t_interval(values):
    from scipy.stats import t

    m = statistics.mean(values)
    if len(values) < 2:
        return m, float("nan"), float("nan")
    h = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return m, m - h, m + h


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default=str(ROOT / "configs/sweep_conditioning.json"))
    parser.add_argument("--out", default=None, help="the sweep's folder (default: the sweep file's out)")
    parser.add_argument("--steps", type=int, default=None, help="scaled down: train.max_steps (default: the sweep's)")
    parser.add_argument("--seeds", default=None, help="scaled down: e.g. 0,1 (default: the sweep's)")
    parser.add_argument("--layers", type=int, default=None, help="scaled down: model.num_layers")
    parser.add_argument("--batch_size", type=int, default=None, help="scaled down: train.batch_size")
    parser.add_argument("--per_class", type=int, default=20, help="samples per class for drift and accuracy")
    parser.add_argument("--heldout", type=int, default=270, help="held-out images for the Frechet distance")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.sweep).read_text())
    spec["out"] = args.out or spec["out"]
    for key, value in (("train.max_steps", args.steps), ("model.num_layers", args.layers),
                       ("train.batch_size", args.batch_size)):
        if value is not None:
            spec["overrides"][key] = value
    if args.seeds:
        spec["seeds"] = [int(s) for s in args.seeds.split(",")]
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_file.json").write_text(json.dumps(spec, indent=1))
    # One run after another, one thread each (OMP_NUM_THREADS=1): on a shared machine the runs' speeds stay
    # comparable; the sweep skips finished runs, so the command can be repeated to score again.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "tools/sweep.py"), str(out / "sweep_file.json"), "--local"], env=env, check=True)

    torch.set_num_threads(1)
    manifest = json.loads((out / "sweep.json").read_text())
    base = config.load_config(importlib.import_module("train_flow_matching").DEFAULTS,
                              ["--config", str(ROOT / spec["base"])] + [f"--{k}={json.dumps(v)}" for k, v in spec["overrides"].items()])
    data, res = base.data, base.data.resolution
    classifier, acc = train_classifier(data, res)
    print(f"classifier: accuracy on held-out whole images {acc}")
    heldout = demo_views(args.heldout, 103, data, res)
    lo, hi = data.demo_sizes
    real = {s: demo_views(180, 104, data, res, sizes=[s, s], whole=True)[0] for s in (lo, hi)}
    real_ratio = sharpness(real[hi]) / sharpness(real[lo])
    scores = {}
    for run in manifest["runs"]:
        run_dir = Path(run["run_dir"])
        scores[run["name"]] = s = score_run(run_dir, classifier, heldout, args.per_class)
        steps = json.loads((run_dir / "export/config.json").read_text())["train"]["max_steps"]
        (run_dir / "quality.jsonl").write_text(json.dumps({"step": steps, **s}) + "\n")
        print(run["name"], {k: round(v, 4) for k, v in s.items()}, flush=True)
    for metric in METRICS:
        folder = out / f"compare_{metric}"
        subprocess.run([sys.executable, str(ROOT / "tools/compare.py"), str(out), "--out", str(folder), "--metric", metric,
                        "--a", "conditioning.mode=disentangled"], check=True)
    arms = {}
    for run in manifest["runs"]:
        arms.setdefault(run["params"]["conditioning.mode"], []).append(scores[run["name"]])
    lines = [f"# Control ablation ({out}): {len(manifest['runs'])} runs, overrides {spec['overrides']}", "",
             f"classifier accuracy on held-out whole images by native size: {acc}; real images' sharpness ratio "
             f"{hi} px / {lo} px: {real_ratio:.2f}", "",
             "| arm | runs | " + " | ".join(f"{m} ({'higher' if h else 'lower'} better)" for m, h in METRICS.items()) + " |",
             "| --- | --- |" + " --- |" * len(METRICS)]
    for arm, rows in arms.items():
        cells = []
        for m in METRICS:
            mean, low, high = t_interval([r[m] for r in rows])
            cells.append(f"{mean:.3f} [{low:.3f}, {high:.3f}] ({', '.join(f'{r[m]:.3f}' for r in rows)})")
        lines.append(f"| {arm} | {len(rows)} | " + " | ".join(cells) + " |")
    lines += ["", "Mean [95% t-interval] (per seed). Paired comparisons against disentangled: "
              + ", ".join(f"{out}/compare_{m}/compare.md" for m in METRICS)]
    (out / "control_ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
