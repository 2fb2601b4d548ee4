"""Feeds docs/benchmarks/control_ablation.md (the conditioning ablation).

The paper's Fig. 2, tested (issue 42): does changing only a low-level control (the image's original size) move
what the image shows, and does the paper's conditioning (the class through attention, the size control gated
late by w(t) = cos(pi t / 2)^p) keep it in place? The analysis, written before any run, is
docs/benchmarks/control_ablation.md; this script runs it in four stages, each resumable (finished runs and scores are
skipped), each training through tools/sweep.py and comparing through tools/compare.py:

  positive_control  the renderer with size tied to colour on disjoint supports (data.demo_render=colour_by_size:
                    red only at 8-14 px, blue only at 26-32, green everywhere); adanorm and disentangled (p = 1).
                    Red queried at 32 px and blue at 8: colour is decided at t ~ 1, where a gated size control
                    cannot reach, so the disentangled arm should flip about never and adanorm often. If they flip
                    alike, the instrument or the plumbing is broken: find it before `main`.
  main              size the only control, centre crop, band-limited shapes (data.demo_render=band_limited) at a
                    native 8-32 px; five arms (adanorm; both and disentangled with size power 0 and 1), 5 seeds.
  switch_time       main's seeds 0 and 1: size 32 until tau, then 8 (tau = 1, 0.9, 0.75, 0.5, 0.25); where each
                    arm lets size move the content. No training.
  real              Fashion-MNIST box-downsampled to a native 8-28 px and saved at that size (orig_hw is true);
                    adanorm and the paper's arm (disentangled, p = 1), 5 seeds: whether the overall contrast holds
                    on real images (the factorial is main's); layout change and sharpness only (no colour, shapes).

Metrics (classifier-free, on samples from the same noise and class at the largest and the smallest size):
  layout_change     |P(x_hi) - P(x_lo)| / |P(x_hi) - P(x'_hi)|, P = 4x4 average pooling, x' an unrelated sample
                    of the class (another noise): 0 = layout kept, 1 = as different as another sample (primary,
                    at guidance s = 1; layout_change_s3 at s = 3, seeds 0 and 1)
  colour_flip       share of pairs whose shape colour differs (demo)
  centroid_shift    mean distance between the shapes' centroids, in image sides (demo)
  shape_drift       among pairs whose size-32 sample has the asked-for colour and shape, the share whose size-8
                    sample has another shape (demo)
  sharpness_ratio   mean |Laplacian| at the largest size over the smallest: the manipulation check (> 1: the
                    size control was learnt)
  first_step_change relative change of the model's output at t = 1 (the first Euler step) between the sizes: 0
                    exactly in a gated arm, else the size leaks (docs/benchmarks/control_ablation.md, "Bug or result")
  null_change       largest change between two samples with identical inputs: 0, else nondeterminism

    python benchmarks/control_ablation.py positive_control     # first: 2 arms x 2 seeds x 1000 steps
    python benchmarks/control_ablation.py main                 # 5 arms x 5 seeds
    python benchmarks/control_ablation.py switch_time          # after main
    python benchmarks/control_ablation.py real                 # 2 arms x 5 seeds on Fashion-MNIST
    python benchmarks/control_ablation.py positive_control --seeds 0 --out runs/control_ablation_small   # smallest
A 1,000-step run of the demo model takes about 9 min on one thread of this 2-core machine with the other core
idle, 15 min with both busy; the measured stages ran at --steps 300 (docs/benchmarks/control_ablation.md).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import train_ddpm  # noqa: E402
import train_flow_matching  # noqa: E402
from compare import t_interval  # noqa: E402
from training.data.sources import DEMO_CLASSES, DEMO_COLORS  # noqa: E402
from training.model.mmdit import load_exported  # noqa: E402
from training.record.curves import method_of  # noqa: E402

STAGES = ("positive_control", "main", "switch_time", "real")
# Every demo run: size the only control, the whole image (centre crop), guidance 1 in training's validation.
DEMO = {"data.demo_sizes": [8, 32], "data.crop": "center", "conditioning.controls": ["size"],
        "val.guidance_scale": 1.0, "val.every": 1000, "val.num_samples": 9, "ckpt.every": 1000,
        "log.wandb": "off", "log.report": False}
GATED = {"conditioning.mode": ["both", "disentangled"], "conditioning.control_power.size": [0.0, 1.0]}
PAPERS = {"conditioning.mode": ["disentangled"], "conditioning.control_power.size": [1.0]}  # the paper's arm alone
SEEDS = {"positive_control": [0, 1], "main": [0, 1, 2, 3, 4], "real": [0, 1, 2, 3, 4]}
SWITCH_TAUS = (1.0, 0.9, 0.75, 0.5, 0.25)
SWITCH_SEEDS, S3_SEEDS = (0, 1), (0, 1)
REAL_SIDES, REAL_IMAGES = (8, 28), 6000  # Fashion-MNIST: native sides, training images (600 per class)
PER_CLASS = 20  # samples per class and size

# ----------------------------------------------------------------------------------------------------------
# The metrics: images in [-1, 1], (N, 3, H, W); pairs are rows of the same index.


def pooled(x):
    return F.avg_pool2d(x.float(), 4).flatten(1)


def layout_change(hi, lo, unrelated):
    """Mean |P(hi) - P(lo)| over mean |P(hi) - P(unrelated)|: 0 when the pairs are identical, 1 when they differ
    as much as unrelated samples do."""
    base = (pooled(hi) - pooled(unrelated)).norm(dim=1).mean()
    if base == 0:
        raise ValueError("layout_change: the unrelated samples equal the samples; pass samples from other noise")
    return ((pooled(hi) - pooled(lo)).norm(dim=1).mean() / base).item()


def unrelated_of(x, labels):
    """For each sample, another sample of its class (the next one of that class, cyclically)."""
    index = torch.arange(len(x))
    for c in labels.unique():
        rows = index[labels == c]
        if len(rows) < 2:
            raise ValueError(f"unrelated_of: class {int(c)} has one sample; at least 2 per class are needed")
        index[rows] = rows.roll(-1)
    return x[index]


def shape_mask(x):
    """Pixels of the shape: chroma (max - min channel) above half the image's largest; the demo's backgrounds
    are near grey (chroma < 0.36 in [-1, 1] units) and its shapes saturated (>= 1.2)."""
    chroma = x.max(1).values - x.min(1).values
    return chroma > 0.5 * chroma.flatten(1).max(1).values.clamp(min=0.5)[:, None, None]


def colour_of(x):
    """Index in DEMO_COLORS of each image's shape colour (the nearest to the mean over its mask); -1: no shape."""
    mask = shape_mask(x).float()
    area = mask.sum((1, 2))
    mean = (x * mask[:, None]).sum((2, 3)) / area.clamp(min=1)[:, None]
    palette = torch.tensor(list(DEMO_COLORS.values()), dtype=torch.float32) / 127.5 - 1
    return torch.where(area > 0, torch.cdist(mean, palette).argmin(1), -1)


def centroid(x):
    """(row, column) of the shape mask's centroid, in image sides."""
    mask = shape_mask(x).float()
    h, w = mask.shape[1:]
    area = mask.sum((1, 2)).clamp(min=1)
    rows = (mask.sum(2) * torch.arange(h)).sum(1) / area / h
    cols = (mask.sum(1) * torch.arange(w)).sum(1) / area / w
    return torch.stack([rows, cols], 1)


FILL = {"circle": torch.pi / 4, "square": 1.0, "triangle": 0.5}  # shape area / its bounding box


def shape_of(x):
    """Index in DEMO_SHAPES order (circle, square, triangle) of each shape: the one whose area over bounding box
    (pi / 4, 1, 1 / 2) is nearest the mask's."""
    mask = shape_mask(x)
    fills = []
    for m in mask:
        rows, cols = m.any(1).nonzero(), m.any(0).nonzero()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1) if len(rows) else 1
        fills.append(m.sum().item() / float(box))
    return (torch.tensor(fills)[:, None] - torch.tensor(list(FILL.values()))).abs().argmin(1)


def sharpness(x):
    """Mean |Laplacian| of the grey image: high-frequency energy, what upsampling a small image removes."""
    kernel = torch.tensor([[0.0, 1, 0], [1, -4, 1], [0, 1, 0]]).view(1, 1, 3, 3)
    return F.conv2d(x.float().mean(1, keepdim=True), kernel).abs().mean().item()


def pair_metrics(hi, lo, labels, demo):
    """The metrics of pairs (size hi, size lo) from the same noise and class."""
    out = {"layout_change": layout_change(hi, lo, unrelated_of(hi, labels)),
           "sharpness_ratio": sharpness(hi) / sharpness(lo)}
    if demo:
        colour, shape = labels // 3, labels % 3  # DEMO_CLASSES: colour-major
        c_hi, c_lo, s_hi, s_lo = colour_of(hi), colour_of(lo), shape_of(hi), shape_of(lo)
        right = (c_hi == colour) & (s_hi == shape)
        out.update(colour_flip=(c_hi != c_lo).float().mean().item(),
                   centroid_shift=(centroid(hi) - centroid(lo)).norm(dim=1).mean().item(),
                   shape_drift=(s_lo[right] != shape[right]).float().mean().item() if right.any() else float("nan"),
                   right_at_hi=right.float().mean().item())
    return out

# ----------------------------------------------------------------------------------------------------------
# Sampling a run's exported EMA model with its own sampler and steps, fixed noise, only the size moved.


class SizeSwitch:
    """The model, asked for size `hi` while the noise level t > tau and for `lo` from then on (tau = 1: lo all
    along; the switch-time curve)."""

    def __init__(self, model, hi, lo, tau):
        self.model, self.hi, self.lo, self.tau = model, hi, lo, tau

    def __call__(self, x, timestep, cond, noise_level=None):
        t = timestep / 1000 if noise_level is None else noise_level
        side = torch.where(t > self.tau, self.hi, self.lo).to(cond["orig_hw"])[:, None]
        return self.model(x, timestep, {**cond, "orig_hw": side.expand(-1, 2), "crop_box": sized_box(side[:, 0])},
                          noise_level)


def sized_box(side):
    return torch.stack([torch.zeros_like(side), torch.zeros_like(side), side, side], 1)


def conditions(labels, side):
    side = torch.full((len(labels),), side)
    return {"label": labels, "orig_hw": torch.stack([side, side], 1), "crop_box": sized_box(side),
            "drop": torch.zeros(len(labels), dtype=torch.bool)}


@torch.no_grad()
def sample(model, cfg, labels, side, noise_seed, guidance=1.0, switch=None):
    """Samples of `labels` at original size `side` (switch = (hi, lo, tau): SizeSwitch), noise from noise_seed."""
    res = cfg["data"]["resolution"]
    noise = torch.randn((len(labels), 3, res, res), generator=torch.Generator().manual_seed(noise_seed))
    net = SizeSwitch(model, *switch) if switch else model
    trainer = {"flow_matching": train_flow_matching, "ddpm": train_ddpm}[method_of(cfg)]  # the run's own sampler
    return trainer.generate(net, noise, conditions(labels, side), cfg, guidance_scale=guidance).clamp(-1, 1)


@torch.no_grad()
def first_step_change(model, cfg, labels, hi, lo):
    """Relative change of the model's output at t = 1 (pure noise) when only the size moves from hi to lo."""
    res = cfg["data"]["resolution"]
    x = torch.randn((len(labels), 3, res, res), generator=torch.Generator().manual_seed(7))
    t = torch.full((len(labels),), 1000.0)
    a, b = model(x, t, conditions(labels, hi)), model(x, t, conditions(labels, lo))
    return ((a - b).norm() / a.norm()).item()


def score_run(run_dir, stage, seed):
    """One run's scores (a dict), written once to RUN/quality.jsonl; a finished score is read back, not redone."""
    path = Path(run_dir) / "quality.jsonl"
    if path.is_file():
        return json.loads(path.read_text().splitlines()[-1])
    model, cfg = load_exported(Path(run_dir) / "export")
    demo = stage != "real"
    classes = len(DEMO_CLASSES) if demo else cfg["data"]["num_classes"]
    lo, hi = cfg["data"]["demo_sizes"] if demo else REAL_SIDES
    labels = torch.arange(classes).repeat_interleave(PER_CLASS)
    if stage == "positive_control":  # red (labels 0-2) and blue (6-8) queried off their supports, then on them
        red, blue, green = (labels[labels // 3 == c] for c in range(3))
        s = {}
        for name, queries in (("off_support", ((red, hi), (blue, lo))), ("on_support", ((red, lo), (blue, hi)))):
            x = torch.cat([sample(model, cfg, asked, side, 0) for asked, side in queries])
            asked_colours = torch.cat([asked // 3 for asked, _ in queries])
            s[f"colour_flip_{name}"] = (colour_of(x) != asked_colours).float().mean().item()
        s["sharpness_ratio"] = sharpness(sample(model, cfg, green, hi, 0)) / sharpness(sample(model, cfg, green, lo, 0))
    else:
        at = {side: sample(model, cfg, labels, side, 0) for side in (hi, lo)}
        s = pair_metrics(at[hi], at[lo], labels, demo)
        if seed in S3_SEEDS:
            s["layout_change_s3"] = pair_metrics(sample(model, cfg, labels, hi, 0, 3.0),
                                                 sample(model, cfg, labels, lo, 0, 3.0),
                                                 labels, demo)["layout_change"]
    s["first_step_change"] = first_step_change(model, cfg, labels, hi, lo)
    s["null_change"] = (sample(model, cfg, labels[:PER_CLASS], hi, 0)
                        - sample(model, cfg, labels[:PER_CLASS], hi, 0)).abs().max().item()
    s["step"] = cfg["train"]["max_steps"]
    path.write_text(json.dumps(s) + "\n")
    return s

# ----------------------------------------------------------------------------------------------------------
# Runs: sweep files through tools/sweep.py (skips finished runs), one thread each so speeds stay comparable.


def sweep(out, grid, overrides, seeds, steps):
    """Train the runs of one sweep file (OUT/sweep_file.json) and return the manifest's runs."""
    spec = {"method": "flow_matching", "base": "configs/demo.json", "grid": grid, "seeds": seeds, "out": str(out),
            "overrides": {**overrides, **({"train.max_steps": steps} if steps else {})}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_file.json").write_text(json.dumps(spec, indent=1))
    print(f"[control_ablation] sweep {out}: grid {grid}, seeds {seeds}", flush=True)
    subprocess.run([sys.executable, str(ROOT / "tools/sweep.py"), str(out / "sweep_file.json"), "--local"],
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads((out / "sweep.json").read_text())["runs"]


def arms(out, gated, overrides, seeds, steps):
    """The gated arms (main: both and disentangled x size power 0 and 1; real: the paper's) in one sweep, adanorm
    in another."""
    return (sweep(out / "gated", gated, overrides, seeds, steps)
            + sweep(out / "adanorm", {"conditioning.mode": ["adanorm"]}, overrides, seeds, steps))


def arm_of(run):
    mode = run["params"].get("conditioning.mode", "adanorm")
    return mode if mode == "adanorm" else f"{mode} p={run['params'].get('conditioning.control_power.size', 1.0):g}"


def scores_of(runs, stage):
    table = {}
    for i, run in enumerate(runs, 1):
        seed = run["seed"]
        print(f"[control_ablation] scoring {i}/{len(runs)}: {run['name']}", flush=True)
        table.setdefault(arm_of(run), {})[seed] = score_run(run["run_dir"], stage, seed)
    return table


def compare(dirs, out, metric, arm_a):
    subprocess.run([sys.executable, str(ROOT / "tools/compare.py"), *map(str, dirs), "--out", str(out), "--metric",
                    metric, "--a", arm_a], check=True)


def cell(values):
    mean, low, high = t_interval(values)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def arm_table(table, metrics):
    lines = ["| arm | seeds | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for arm, by_seed in table.items():
        lines.append(f"| {arm} | {len(by_seed)} | " + " | ".join(
            cell([s[m] for s in by_seed.values() if m in s]) for m in metrics) + " |")
    return lines


DELTA = 0.1  # the smallest reduction of layout change that counts (docs/benchmarks/control_ablation.md, pre-registered)


def contrasts(table, metric="layout_change"):
    """The pre-registered paired contrasts over seeds (docs/benchmarks/control_ablation.md): per seed, then mean
    [95% t]; with the paper's arm and adanorm alone (the real stage), the overall contrast only."""
    seeds = sorted(set.intersection(*(set(v) for v in table.values())))
    m = {arm: np.array([table[arm][s][metric] for s in seeds]) for arm in table}
    overall = {"overall (disentangled p=1 - adanorm)": m["disentangled p=1"] - m["adanorm"]}
    if len(m) == 2:
        return seeds, overall
    both0, both1, dis0, dis1 = m["both p=0"], m["both p=1"], m["disentangled p=0"], m["disentangled p=1"]
    return seeds, {"gating (p=1 - p=0, mean over class path)": ((both1 - both0) + (dis1 - dis0)) / 2,
                   "class path (disentangled - both, mean over p)": ((dis0 - both0) + (dis1 - both1)) / 2,
                   "interaction ((dis p1 - p0) - (both p1 - p0))": (dis1 - dis0) - (both1 - both0), **overall}


def verdict(table, overall):
    """The pre-registered sentences (docs/benchmarks/control_ablation.md) for the overall contrast on layout change,
    one verdict per interval. As registered the rules overlapped: an interval inside (-DELTA, 0) lies below 0
    ("supports") and above -DELTA ("contradicts"), and the first rule won; that interval is now a verdict of its own
    that says both."""
    _, low, high = t_interval(overall)
    learnt = all(t_interval([s["sharpness_ratio"] for s in v.values()])[1] > 1 for v in table.values())
    if not learnt:
        return "cannot tell: an arm's sharpness ratio interval reaches 1, so not every arm learnt the size control"
    reduced, small = high < 0, low > -DELTA  # an effect in the paper's direction; one of DELTA or more excluded
    if reduced and small:
        return (f"supports in direction, contradicts in size: the paper's conditioning keeps the layout more than "
                f"adanorm, by less than {DELTA} (a reduction of {DELTA} or more is excluded)")
    if reduced:
        return "supports: the paper's conditioning keeps the layout when only the size changes, more than adanorm"
    if small:
        return f"contradicts: a reduction of layout change by {DELTA} or more against adanorm is excluded"
    return "cannot tell: the interval holds both no effect and an effect of the size that counts"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--out", default="runs/control_ablation")
    parser.add_argument("--seeds", default=None, help="scaled down: e.g. 0 (default: the stage's)")
    parser.add_argument("--steps", type=int, default=None, help="scaled down: train.max_steps (default: 1000)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else SEEDS.get(args.stage)
    torch.set_num_threads(1)
    lines = [f"# Control ablation, stage {args.stage} ({out})", ""]

    if args.stage == "positive_control":
        runs = sweep(out / "positive_control", {"conditioning.mode": ["adanorm", "disentangled"]},
                     {**DEMO, "data.demo_render": "colour_by_size"}, seeds, args.steps)
        table = scores_of(runs, args.stage)
        lines += arm_table(table, ["colour_flip_off_support", "colour_flip_on_support", "sharpness_ratio",
                                   "first_step_change", "null_change"])
        lines += ["", "Passes if disentangled flips off the supports about never, adanorm often, both rarely on them."]
    elif args.stage in ("main", "real"):
        if args.stage == "real":
            folder = real_images(out / "real_data")
            overrides = {**{k: v for k, v in DEMO.items() if k != "data.demo_sizes"}, "data.source": str(folder),
                         "data.label_column": "label", "data.num_classes": 10}
        else:
            overrides = {**DEMO, "data.demo_render": "band_limited"}
        runs = arms(out / args.stage, GATED if args.stage == "main" else PAPERS, overrides, seeds, args.steps)
        table = scores_of(runs, args.stage)
        metrics = ["layout_change", "layout_change_s3", "sharpness_ratio", "first_step_change", "null_change"]
        metrics += ["colour_flip", "centroid_shift", "shape_drift", "right_at_hi"] if args.stage == "main" else []
        lines += arm_table(table, metrics)
        seeds_used, effects = contrasts(table)
        lines += ["",
                  f"Pre-registered contrasts on layout_change (s = 1), paired over seeds {seeds_used}: mean [95% t]",
                  ""]
        lines += [f"- {name}: {cell(v)} (per seed {', '.join(f'{d:.3f}' for d in v)})" for name, v in effects.items()]
        lines += ["", "Verdict: " + verdict(table, effects["overall (disentangled p=1 - adanorm)"])]
        paper = "conditioning.mode=disentangled" + (",conditioning.control_power.size=1.0" if args.stage == "main"
                                                    else "")
        for metric in ("layout_change", "sharpness_ratio"):  # compare.py names an arm by the keys that vary
            compare([out / args.stage / "gated", out / args.stage / "adanorm"], out / args.stage / f"compare_{metric}",
                    metric, paper)
    else:  # switch_time: main's runs, no training
        manifest = json.loads((out / "main/gated/sweep.json").read_text())["runs"]
        manifest += json.loads((out / "main/adanorm/sweep.json").read_text())["runs"]
        curve = {}
        for run in (r for r in manifest if r["seed"] in SWITCH_SEEDS):
            print(f"[control_ablation] switch times: {run['name']}", flush=True)
            model, cfg = load_exported(Path(run["run_dir"]) / "export")
            lo, hi = cfg["data"]["demo_sizes"]
            labels = torch.arange(len(DEMO_CLASSES)).repeat_interleave(PER_CLASS)
            ref = sample(model, cfg, labels, hi, 0)
            for tau in SWITCH_TAUS:
                x = sample(model, cfg, labels, hi, 0, switch=(hi, lo, tau))
                change = layout_change(ref, x, unrelated_of(ref, labels))
                curve.setdefault(arm_of(run), {}).setdefault(tau, []).append(change)
        lines += ["| arm | " + " | ".join(f"tau={t:g}" for t in SWITCH_TAUS) + " |",
                  "|---|" + "---|" * len(SWITCH_TAUS)]
        lines += [f"| {arm} | " + " | ".join(" / ".join(f"{v:.3f}" for v in by_tau[t]) for t in SWITCH_TAUS) + " |"
                  for arm, by_tau in curve.items()]
        lines += ["",
                  f"Layout change against the size-32 sample (seeds {SWITCH_SEEDS}): size 32 while t > tau, then 8."]
    (out / f"{args.stage}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def real_images(folder, split="train", count=REAL_IMAGES, seed=0):
    """`count` Fashion-MNIST images of `split` (None: all), each box-downsampled to a native side drawn in
    REAL_SIDES and saved at that side (class folders of PNGs), so that orig_hw is the image's true size. Written
    once. benchmarks/paper_claims.py writes both splits whole, with another seed for the test split."""
    from PIL import Image

    from training.data import fashion_mnist

    if (folder / "done").is_file():
        return folder
    images, labels = fashion_mnist.split_arrays(split)
    rng = np.random.default_rng(seed)
    for i in rng.permutation(len(images))[:count]:
        side = int(rng.integers(REAL_SIDES[0], REAL_SIDES[1] + 1))
        target = folder / f"{labels[i]}" / f"{i}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).convert("RGB").resize((side, side), Image.BOX).save(target)
    (folder / "done").write_text("")
    return folder


if __name__ == "__main__":
    main()
