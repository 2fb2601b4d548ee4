"""Feeds docs/benchmarks/scaling.md (how FD falls with training CPU and model size on Fashion-MNIST).

Issue 73: a grid of points, each a training budget (a multiple of the recipe's training-step CPU,
configs/fashion_mnist.json) at a model size (the recipe's width and depth, a smaller and a larger one, all at the
recipe's 7 x 7 tokens), trained once from step 0 for its own length, its EMA length chosen afterwards from post-hoc
EMA snapshots on the held-out rows, scored by the real-image protocol at 2,000 samples; then the power law
FD - floor = a C^-b fitted per size. The design, its rules and what is left out were written before any run
(docs/benchmarks/scaling.md). Every stage resumes point by point: a scored point is not touched again, a trained
one is not re-trained, an interrupted trainer continues from its newest checkpoint.

  plan      the points, each one's steps and expected CPU (training + EMA choice + score) from OUT/cost.json (or
            the estimate in the design, said so), the totals per tier, and what is left out
  cost      CPU seconds per training step of each size, from COST_STEPS-step runs (the trainer's cpu_s_per_step)
  run       POINT: train it (steps = budget x the recipe's steps x the recipe size's step CPU / this size's)
  ema       POINT: tools/phema.py's sweep of EMA_STDS on the held-out rows (never the test split); the best kept
  score     POINT: the protocol (benchmarks/fashion_mnist.py's) on the test split at the chosen EMA, 2,000 samples
  fit       per size: log(FD - floor) = log a - b log C by least squares, b's 95% interval, the residuals, the
            leave-the-largest-out check; the compute-optimal size per budget; the budget for 2x the floor
  plot      docs/img/scaling.png: FD against training CPU, log-log, a line per size, the floor, the recipe
  report    OUT/report.md: every point's scores, the 3-seed points' intervals, the paired contrasts of the
            defaults (Muon - AdamW at 4x, the LR sweep), the fit and the aim

    python benchmarks/scaling.py cost --out runs/scaling
    python benchmarks/scaling.py plan --out runs/scaling
    python benchmarks/scaling.py run fm-recipe-1x-s0 --out runs/scaling    # then ema, score: each POINT of the plan
    python benchmarks/scaling.py fit --out runs/scaling && python benchmarks/scaling.py plot --out runs/scaling
    python benchmarks/scaling.py report --out runs/scaling

Arguments past the stage's own go to every trainer run (a scaled-down run: --model.num_layers=1 ...).
"""
import argparse
import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval_fid  # noqa: E402
from benchmarks import fashion_mnist as bench  # noqa: E402
from tools import phema  # noqa: E402
from tools.compare import paired_comparison, t_interval  # noqa: E402

RECIPE = bench.RECIPE
RECIPE_CFG = json.loads(RECIPE.read_text())
SIZES = {  # width = heads x 32 (the recipe's head_dim); patch 4 at 28 px: 49 tokens at every size
    "small": ["--model.num_attention_heads=3", "--model.num_layers=4"],    # width 96, 4 blocks
    "recipe": [],                                                          # width 128, 6 blocks
    "large": ["--model.num_attention_heads=6", "--model.num_layers=8"],    # width 192, 8 blocks
}
# The recipe size's step CPU before `cost` has measured it: the recipe's ~18 CPU minutes of steps over 1,200 steps
# (docs/benchmarks/fashion_mnist.md); the other sizes scaled by their blocks x width^2 (the matmuls' share).
ESTIMATE = {"recipe": 0.9, "small": 0.9 * (4 * 96 ** 2) / (6 * 128 ** 2),
            "large": 0.9 * (8 * 192 ** 2) / (6 * 128 ** 2)}
SAMPLE_PER_STEP = 0.21  # a sample's CPU in training steps' (0.19 CPU s a sample at the recipe's 0.9 s a step)
COST_STEPS = 30
NUM_SAMPLES, EMA_SAMPLES = 2000, 400
EMA_STDS = (0.05, 0.1, 0.18)  # the relative stds swept (within EDM2's range), on the held-out rows, same seeds
SNAPSHOTS = 16  # post-hoc EMA snapshots a run keeps (tools/phema.py reconstructs any std from them)
FLOOR = 0.135  # 2,000 real training images against the test split (docs/benchmarks/fashion_mnist.md)
AIM = 0.40  # FD at 2,000 samples: within 3x the floor


def point(name, method, size, budget, seed=0, tier="core", optimizer="muon", lr_factor=1.0):
    return {"name": name, "method": method, "size": size, "budget": budget, "seed": seed, "tier": tier,
            "optimizer": optimizer, "lr_factor": lr_factor}


def grid():
    """The points, in the order to run them (docs/benchmarks/scaling.md: why these and not more)."""
    points, fm = [], "flow_matching"
    for size, budgets in (("recipe", (0.5, 1, 2, 4, 8)), ("small", (0.5, 1, 2)), ("large", (1, 2, 4))):
        points += [point(f"fm-{size}-{b:g}x-s0", fm, size, b) for b in budgets]
    points += [point(f"ddpm-recipe-{b:g}x-s0", "ddpm", "recipe", b) for b in (1, 4)]
    points += [point(f"fm-recipe-1x-s{s}", fm, "recipe", 1, s) for s in (1, 2)]  # the seed spread at 1x
    # Item 4, the defaults: Muon's other two seeds at 4x (the second 3-seed point), AdamW at 4x on the same three
    # seeds, Muon's LR halved and doubled at 4x, halved at 8x (longer runs want lower LRs, if anything)
    points += [point(f"fm-recipe-4x-s{s}", fm, "recipe", 4, s, "defaults") for s in (1, 2)]
    points += [point(f"fm-recipe-4x-adamw-s{s}", fm, "recipe", 4, s, "defaults", "adamw") for s in (0, 1, 2)]
    points += [point(f"fm-recipe-{b:g}x-lr{f:g}-s0", fm, "recipe", b, 0, "defaults", lr_factor=f)
               for b, f in ((4, 0.5), (4, 2), (8, 0.5))]
    return {p["name"]: p for p in points}


LEFT_OUT = [
    "small at 4x and 8x, large at 0.5x and 8x: each size keeps 3 budgets around where it should be best, the recipe "
    "size all 5; the ends cost most (8x large alone is 8 recipe-runs) for the least news",
    "DDPM at 0.5x, 2x and 8x and at the other sizes: the issue's 1x and 4x give its slope against flow matching's",
    "more seeds: 3 at two points (1x, and 4x in the defaults tier); the others' spread is read from those",
    "batch sizes: every point at the recipe's 128 (a budget is steps, not images per step)",
    "the LR of AdamW and the AdamW group's LR: only Muon's LR is swept",
]


def steps_of(p, cost, unit_steps):
    """A point's training steps: its budget in the recipe size's step CPU, divided by its size's."""
    return max(1, round(p["budget"] * unit_steps * cost["recipe"] / cost[p["size"]]))


def point_args(p, cost, unit_steps):
    """The trainer arguments of a point: its size, and a schedule for its own length: max_steps, the warm-up
    (the recipe's share of the run), checkpoints and validations (4 a run), the post-hoc EMA snapshots."""
    steps = steps_of(p, cost, unit_steps)
    train_cfg = RECIPE_CFG["train"]
    warmup = max(1, round(train_cfg["warmup_steps"] * steps / train_cfg["max_steps"]))
    every = max(1, steps // 4)
    args = [*SIZES[p["size"]], f"--train.max_steps={steps}", f"--train.warmup_steps={warmup}",
            f"--val.every={every}", f"--ckpt.every={every}", "--ckpt.keep=2",
            f"--ckpt.phema_every={max(1, steps * train_cfg['batch_size'] // SNAPSHOTS)}"]
    if p["optimizer"] != "muon":
        args.append(f"--train.optimizer={p['optimizer']}")
    if p["lr_factor"] != 1:
        args.append(f"--train.muon_lr={train_cfg['muon_lr'] * p['lr_factor']:g}")
    return args


def train(run, method, run_args, args, seed):
    """Train RUN from the recipe, or continue it from its newest checkpoint; skipped once exported. The trainer
    processes' CPU goes to RUN/cpu_seconds.json (a resumed run: the sum over them) with the steps' own CPU
    (benchmarks/emoji.py's `train`, on this recipe)."""
    if (run / "export").is_dir():
        return
    before = bench.cpu_seconds(resource.RUSAGE_CHILDREN)
    try:
        subprocess.run([sys.executable, str(ROOT / f"train_{method}.py"), "--config", str(RECIPE), f"--seed={seed}",
                        f"--run_dir={run}", "--log.wandb=off", "--resume=latest", *run_args, *args.extra],
                       cwd=ROOT, check=True)
    finally:
        record = bench.add_cpu(run, bench.cpu_seconds(resource.RUSAGE_CHILDREN) - before)
    record["steps"] = bench.step_cpu(run) * json.loads((run / "config.json").read_text())["train"]["max_steps"]
    (run / "cpu_seconds.json").write_text(json.dumps(record))


def load_cost(out, required=True):
    path = Path(out) / "cost.json"
    if path.is_file():
        return json.loads(path.read_text())
    if required:
        sys.exit(f"{path}: not there: run `benchmarks/scaling.py cost --out {out}` first (each size's step CPU)")
    return None


def named_point(name):
    points = grid()
    if name not in points:
        sys.exit(f"scaling.py: no point {name!r}; the points: {', '.join(points)}")
    return points[name]


# ----------------------------------------------------------------------------------------------------------
# Plan and cost.


def plan(args):
    measured = load_cost(args.out, required=False)
    cost = measured["cpu_s_per_step"] if measured else ESTIMATE
    print(f"step CPU {'measured (cost.json)' if measured else 'estimated (no cost.json yet)'}: " +
          ", ".join(f"{s} {c:.3f} s" for s, c in cost.items()))
    print(f"{'point':<26} {'tier':<9} {'steps':>7} {'train h':>8} {'total h':>8}")
    totals, training = {}, {}
    for p in grid().values():
        steps = steps_of(p, cost, args.unit_steps)
        train_s = steps * cost[p["size"]]
        total = train_s + (NUM_SAMPLES + EMA_SAMPLES * len(EMA_STDS)) * SAMPLE_PER_STEP * cost[p["size"]]
        totals[p["tier"]] = totals.get(p["tier"], 0) + total
        training[p["tier"]] = training.get(p["tier"], 0) + train_s
        print(f"{p['name']:<26} {p['tier']:<9} {steps:7d} {train_s / 3600:8.2f} {total / 3600:8.2f}")
    for tier, seconds in totals.items():
        print(f"total {tier}: {seconds / 3600:.1f} CPU hours, {training[tier] / 3600:.1f} of them training steps")
    print(f"all: {sum(totals.values()) / 3600:.1f} CPU hours\nleft out to fit:\n" +
          "\n".join(f"- {line}" for line in LEFT_OUT))
    return totals


def cost(args):
    out = Path(args.out)
    per_step = {}
    for size, size_args in SIZES.items():
        run = out / "cost" / size
        train(run, "flow_matching", [*size_args, f"--train.max_steps={COST_STEPS}", f"--val.every={COST_STEPS}",
                                     f"--ckpt.every={COST_STEPS}", "--log.every=5", "--train.warmup_steps=1"],
              args, 0)
        per_step[size] = bench.step_cpu(run)
    (out / "cost.json").write_text(json.dumps({"cpu_s_per_step": per_step, "steps": COST_STEPS}, indent=1))
    print("cost: " + ", ".join(f"{s} {c:.3f} CPU s a step" for s, c in per_step.items()))


# ----------------------------------------------------------------------------------------------------------
# A point: train, choose its EMA on the held-out rows, score it on the test split.


def run(args):
    p = named_point(args.point)
    folder = Path(args.out) / p["name"]
    if (folder / "eval" / "test" / "report.json").is_file():
        print(f"{p['name']}: scored; not trained again")
        return
    cost = load_cost(args.out)["cpu_s_per_step"]
    train(folder, p["method"], point_args(p, cost, args.unit_steps), args, p["seed"])
    print(f"{p['name']}: trained ({json.loads((folder / 'cpu_seconds.json').read_text())['steps']:.0f} CPU s in "
          f"its steps)")


def protocol(args):
    return ["--features", "classifier", "--classifier", args.classifier, "--batch_size", "250",
            "--stats_cache", str(Path(args.out) / "fid_stats")]


def ema(args):
    folder = Path(args.out) / named_point(args.point)["name"]
    chosen = folder / "ema.json"
    if not chosen.is_file():
        if not (folder / "export").is_dir():
            sys.exit(f"{folder}: not trained: run `benchmarks/scaling.py run {args.point}` first")
        rows = phema.main(["--run", str(folder), "--sweep", ",".join(map(str, EMA_STDS)),
                           "--num_samples", str(args.ema_samples), *protocol(args)])  # the held-out rows
        best = min(rows, key=lambda r: r["fid"])
        chosen.write_text(json.dumps({"std": best["std"], "rows": rows}, indent=1))
    print(f"{folder.name}: EMA std {json.loads(chosen.read_text())['std']:g} (held-out rows)")


def score(args):
    folder = Path(args.out) / named_point(args.point)["name"]
    out = folder / "eval" / "test"
    if not (out / "report.json").is_file():
        if not (folder / "ema.json").is_file():
            sys.exit(f"{folder}: no EMA chosen: run `benchmarks/scaling.py ema {args.point}` first")
        std = json.loads((folder / "ema.json").read_text())["std"]
        eval_fid.main(["--run", str(folder), "--phema_std", str(std), "--out_dir", str(out),
                       *bench.score_args(args, args.num_samples)])
    metrics = json.loads((out / "report.json").read_text())["metrics"]
    print(f"{folder.name}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


# ----------------------------------------------------------------------------------------------------------
# The fit: FD - floor = a C^-b per size.


def power_fit(cpu, fd, floor, level=0.95):
    """Least squares of log(FD - floor) on log C: {'a', 'b', 'b_low', 'b_high', 'residuals' (log units), 's'}.
    b's interval is the OLS slope's t-interval on n - 2 degrees of freedom (nan below 3 points). A point at or
    under the floor has no logarithm: an error naming it."""
    from scipy.stats import t

    cpu, fd = np.asarray(cpu, dtype=float), np.asarray(fd, dtype=float)
    if np.any(fd <= floor):
        raise ValueError(f"FD {fd[fd <= floor].tolist()} at or under the floor {floor}: FD - floor has no log")
    x, y = np.log(cpu), np.log(fd - floor)
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (intercept + slope * x)
    n = len(x)
    s = math.sqrt(float(residuals @ residuals) / (n - 2)) if n > 2 else math.nan
    half = t.ppf((1 + level) / 2, n - 2) * s / math.sqrt(float(((x - x.mean()) ** 2).sum())) if n > 2 else math.nan
    return {"a": float(math.exp(intercept)), "b": float(-slope), "b_low": float(-slope - half),
            "b_high": float(-slope + half), "residuals": residuals.tolist(), "s": s, "n": n}


def predicted(f, cpu, floor):
    return floor + f["a"] * np.asarray(cpu, dtype=float) ** -f["b"]


def holds_at_the_largest(cpu, fd, floor, level=0.95):
    """Fit on all but the largest budget and ask whether the largest lies in that fit's prediction interval (log
    units, n - 3 degrees of freedom): None below 4 points. The rule of docs/benchmarks/scaling.md for 'the fit
    stops holding'."""
    from scipy.stats import t

    order = np.argsort(cpu)
    cpu, fd = np.asarray(cpu, dtype=float)[order], np.asarray(fd, dtype=float)[order]
    if len(cpu) < 4:
        return None
    f = power_fit(cpu[:-1], fd[:-1], floor)
    x = np.log(cpu[:-1])
    se = f["s"] * math.sqrt(1 + 1 / len(x) + (math.log(cpu[-1]) - x.mean()) ** 2 / ((x - x.mean()) ** 2).sum())
    miss = math.log(fd[-1] - floor) - math.log(predicted(f, cpu[-1], floor) - floor)
    limit = float(t.ppf((1 + level) / 2, len(x) - 2) * se)
    return {"miss": float(miss), "limit": limit, "holds": bool(abs(miss) <= limit)}


def metric(report, name):
    return next((v for k, v in report["metrics"].items() if k.startswith(f"{name}_")), None)


def scored(out):
    """{point name: (point, report, training CPU of its steps)} of the scored points."""
    found = {}
    for p in grid().values():
        folder = Path(out) / p["name"]
        if (folder / "eval" / "test" / "report.json").is_file():
            found[p["name"]] = (p, json.loads((folder / "eval" / "test" / "report.json").read_text()),
                                json.loads((folder / "cpu_seconds.json").read_text())["steps"])
    return found


def curves(out):
    """{size: (cpu, fd)} of flow matching's seed-0 core points, by budget."""
    by_size = {}
    for p, report, cpu in scored(out).values():
        if p["tier"] == "core" and p["method"] == "flow_matching" and p["seed"] == 0:
            by_size.setdefault(p["size"], []).append((cpu, metric(report, "fd_classifier")))
    return {s: tuple(np.array(v) for v in zip(*sorted(rows))) for s, rows in by_size.items()}


def fit(args):
    fits, lines = {}, []
    for size, (cpu, fd) in curves(args.out).items():
        if len(cpu) < 3:
            lines.append(f"{size}: {len(cpu)} points: no fit below 3")
            continue
        f = power_fit(cpu, fd, args.floor)
        f["two_floor_cpu"] = float((f["a"] / args.floor) ** (1 / f["b"])) if f["b"] > 0 else math.inf
        f["largest"] = holds_at_the_largest(cpu, fd, args.floor)
        f["cpu"], f["fd"] = cpu.tolist(), fd.tolist()
        fits[size] = f
        lines.append(f"{size}: FD - {args.floor} = {f['a']:.3g} C^-{f['b']:.3f}, b 95% [{f['b_low']:.3f}, "
                     f"{f['b_high']:.3f}], residuals (log) " + ", ".join(f"{r:+.3f}" for r in f["residuals"]) +
                     f"; 2x the floor at {f['two_floor_cpu'] / 3600:.1f} CPU h")
        if f["largest"] is not None:
            lines.append(f"  the largest budget {'inside' if f['largest']['holds'] else 'OUTSIDE'} the fit of the "
                         f"others (miss {f['largest']['miss']:+.3f}, limit {f['largest']['limit']:.3f} log units)")
    budgets = sorted({float(c) for f in fits.values() for c in f["cpu"]})
    best = {c: min(fits, key=lambda s: predicted(fits[s], c, args.floor)) for c in budgets}
    lines += [f"at {c:.0f} CPU s the fits' best size: {s}" + ("" if min(fits[s]["cpu"]) <= c <= max(fits[s]["cpu"])
                                                              else " (extrapolated: outside its budgets)")
              for c, s in best.items()]
    (Path(args.out) / "fit.json").write_text(json.dumps({"floor": args.floor, "fits": fits,
                                                         "best_size": {str(c): s for c, s in best.items()}}, indent=1))
    print("\n".join(lines))
    return fits


def plot(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    got = curves(args.out)
    fits = json.loads((Path(args.out) / "fit.json").read_text())["fits"] if (Path(args.out) / "fit.json").is_file() \
        else {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for size, (cpu, fd) in got.items():
        line, = ax.plot(cpu / 3600, fd, "o", label=size)
        if size in fits:
            c = np.geomspace(cpu.min(), cpu.max(), 50)
            ax.plot(c / 3600, predicted(fits[size], c, args.floor), "-", color=line.get_color())
    ax.axhline(args.floor, color="grey", ls="--", label=f"floor (real images) {args.floor}")
    ax.axhline(AIM, color="grey", ls=":", label=f"aim {AIM}")
    recipe = scored(args.out).get("fm-recipe-1x-s0")
    if recipe:
        ax.plot(recipe[2] / 3600, metric(recipe[1], "fd_classifier"), "k*", ms=14, label="the recipe")
    ax.set(xscale="log", yscale="log", xlabel="training CPU hours (the steps')",
           ylabel="FD (classifier), 2,000 samples", title="Fashion-MNIST, flow matching: FD against training CPU")
    ax.legend()
    path = Path(args.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"{path}: {sum(len(c) for c, _ in got.values())} points, {len(fits)} fits")


def cell(values):
    mean, low, high = t_interval(values)
    return f"{mean:.4f} [{low:.4f}, {high:.4f}]" if len(values) > 1 else f"{mean:.4f}"


def lr_verdict(sweep, seeds_4x):
    """docs/benchmarks/scaling.md's rule: the recipe's Muon LR (x1) stays right unless another factor's FD is
    lower by more than the half width of the 3-seed 95% t-interval at 4x (the seed spread); one seed per LR."""
    if sweep.get(1) is None or len(seeds_4x) < 3:
        return "not settled (needs x1 and the 4x seeds 0-2)"
    mean, low, high = t_interval(seeds_4x)
    better = [f for f, v in sweep.items() if f != 1 and v is not None and sweep[1] - v > (high - mean)]
    if better:
        return f"x{min(better, key=lambda f: sweep[f]):g} better than the recipe's (beyond the seed spread " \
               f"{high - mean:.4f})"
    return f"the recipe's LR stays (no factor better by more than the seed spread {high - mean:.4f})"


def report(args):
    found = scored(args.out)
    names = ("fd_classifier", "kd_classifier", "precision_classifier", "recall_classifier", "coverage_classifier",
             "class_accuracy")
    lines = ["# Scaling: FD against training CPU and model size", "", "Written by benchmarks/scaling.py report; the "
             "design and rules: docs/benchmarks/scaling.md.", "",
             "| point | training CPU s | EMA std | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 3)]
    for name, (p, rep, cpu) in found.items():
        std = json.loads((Path(args.out) / name / "ema.json").read_text())["std"]
        lines.append(f"| {name} | {cpu:.0f} | {std:g} | " +
                     " | ".join(f"{metric(rep, m):.4f}" if metric(rep, m) is not None else "" for m in names) + " |")
    lines += ["", "## Seeds and contrasts (95% t-intervals, paired by seed)", ""]
    fd = {n: metric(r, "fd_classifier") for n, (_, r, _) in found.items()}
    for stem in ("fm-recipe-1x", "fm-recipe-4x", "fm-recipe-4x-adamw"):
        values = [fd[f"{stem}-s{s}"] for s in (0, 1, 2) if f"{stem}-s{s}" in fd]
        if values:
            lines.append(f"- {stem}: FD {cell(values)} ({len(values)} seeds)")
    seeds = [s for s in (0, 1, 2) if f"fm-recipe-4x-s{s}" in fd and f"fm-recipe-4x-adamw-s{s}" in fd]
    if seeds:
        d = paired_comparison([fd[f"fm-recipe-4x-s{s}"] for s in seeds],
                              [fd[f"fm-recipe-4x-adamw-s{s}"] for s in seeds], higher_is_better=False)
        rule = "cannot tell" if not d["high"] < 0 and not d["low"] > 0 else "Muon better" if d["high"] < 0 else \
            "AdamW better"
        lines.append(f"- Muon - AdamW at 4x, FD: {d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] over seeds "
                     f"{seeds}: {rule if len(seeds) > 1 else 'one seed: not settled'}")
    spread = [fd[f"fm-recipe-4x-s{s}"] for s in (0, 1, 2) if f"fm-recipe-4x-s{s}" in fd]
    for b in (4, 8):
        sweep = {f: fd.get(f"fm-recipe-{b}x-lr{f:g}-s0") for f in (0.5, 2)} | {1: fd.get(f"fm-recipe-{b}x-s0")}
        if any(v is not None for v in sweep.values()):
            lines.append(f"- Muon LR at {b}x (seed 0): " + ", ".join(f"x{f:g} {v:.4f}" for f, v in sorted(sweep.items())
                                                                  if v is not None) + ": " + lr_verdict(sweep, spread))
    fit_path = Path(args.out) / "fit.json"
    if fit_path.is_file():
        fits = json.loads(fit_path.read_text())["fits"]
        lines += ["", "## The fit", ""] + [f"- {s}: b = {f['b']:.3f} [{f['b_low']:.3f}, {f['b_high']:.3f}], 2x the "
                                           f"floor at {f['two_floor_cpu'] / 3600:.1f} CPU h" for s, f in fits.items()]
    best = min(((v, n) for n, v in fd.items() if found[n][0]["method"] == "flow_matching"), default=None)
    if best:
        lines += ["", f"The aim (FD <= {AIM} at 2,000 samples): best point {best[1]} at FD {best[0]:.4f}: "
                  f"{'met' if best[0] <= AIM else 'not met'}"]
    (Path(args.out) / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].split("\n")[0])
    p.add_argument("stage", choices=["plan", "cost", "run", "ema", "score", "fit", "plot", "report"])
    p.add_argument("point", nargs="?")
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--classifier", default="classifiers/fashion_mnist")
    p.add_argument("--unit_steps", type=int, default=RECIPE_CFG["train"]["max_steps"], help="the recipe size's "
                   "steps at 1x (default: configs/fashion_mnist.json's); smaller scales the whole grid (the tests)")
    p.add_argument("--num_samples", type=int, default=NUM_SAMPLES, help="score's samples (the design: 2,000)")
    p.add_argument("--ema_samples", type=int, default=EMA_SAMPLES, help="samples per std in the EMA sweep")
    p.add_argument("--floor", type=float, default=FLOOR, help="the real images' FD the fit subtracts")
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "scaling.png"))
    args, args.extra = p.parse_known_args(argv)
    if args.stage in ("run", "ema", "score") and args.point is None:
        p.error(f"{args.stage} takes a POINT; the points: {', '.join(grid())}")
    args.eval_args = []
    {"plan": plan, "cost": cost, "run": run, "ema": ema, "score": score, "fit": fit, "plot": plot,
     "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
