"""Which arm is better, by how much, and how sure: compare.md and PNG plots for a sweep or any set of runs.

    python tools/compare.py runs/sweep_conditioning                    # a sweep folder (tools/sweep.py's out)
    python tools/compare.py runs/a runs/b runs/c --out runs/compare     # any run folders
    python tools/compare.py runs/sweep_conditioning --metric val_loss --a conditioning.mode=adanorm

Runs are grouped into arms by the config keys in which they differ (config.json; the seed aside), and an arm's
runs are its seeds. Read: each run's metrics.jsonl (what the trainers log: training rows, validation, small-N
FID / KID, events) and quality.jsonl (scores computed after training in the same row format, e.g.
benchmarks/demo_quality.py --write). Written, in order:

  quality evolution       val_loss and each quality metric against step and images seen: a line per arm (the
                          mean over seeds), the seeds' range as a band (evolution_<metric>.png)
  parameter sensitivity   the final metric against each swept key: mean and 95% t-interval over the runs with
                          that value (sensitivity.png)
  hypothesis validation   arm A against arm B: the paired difference per seed, its mean with a 95% paired
                          t-interval and P(A better), and a sentence on whether the data support the claim, or,
                          below 3 seeds, first that they cannot (hypothesis.png)
  performance correlation Spearman correlation of val_loss with each quality metric over every run and
                          checkpoint step where both are logged: does the cheap number rank runs as the
                          expensive one does (correlation.png)
  methodology comparison  images/s, peak memory, final quality and stability (loss spikes, skipped steps, clip
                          share) per arm (methods.png)

Statistics (the paired design: A and B share each seed's data order, noise and validation set). The interval is
Student's t on the n paired differences: exact coverage for normal differences at any n, where a percentile
bootstrap of n values cannot be wider than their range (with 2 seeds it is that range, and covers about half
the time). Below 3 seeds no verdict is given: the interval rests on one degree of freedom and on a normality two
values cannot show. Without the normality, no 95% interval exists below 6 seeds, and an exact two-sided Wilcoxon
signed-rank test cannot go below p = 2/2^n (0.25 with 3 seeds, 0.0625 with 5): compare.md says so instead of
printing one.
"""
import argparse
import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from training.config import config  # noqa: E402
from training.record.curves import method_of  # noqa: E402
from training.record.report import fmt, last, load_metrics, style_axis, table, xy  # noqa: E402

NOT_ARMS = {"seed", "run_dir", "resume"}  # differ between runs of one arm, or say nothing about the method
QUALITY = re.compile(r"^(fid|kid|fd|precision|recall|density|coverage|clip_score|"
                     r"class_accuracy|colour_accuracy|shape_accuracy)")
HIGHER_IS_BETTER = re.compile(r"accuracy|precision|recall|density|coverage|clip_score|sharpness")
MIN_SEEDS = 3  # paired seeds below which compare.md gives no verdict (verdict)


# ----------------------------------------------------------------------------------------------------------
# Statistics.


def t_interval(values, level=0.95):
    """(mean, low, high): Student's t interval for the mean, mean +- t_{(1+level)/2, n-1} s / sqrt(n)."""
    from scipy.stats import t

    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = float(t.ppf((1 + level) / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return mean, mean - half, mean + half


def paired_comparison(a, b, higher_is_better, level=0.95):
    """A against B over paired seeds: d = a - b. The mean difference with its paired t-interval, and P(A better):
    the probability that the true mean difference lies on A's side of 0 under the t distribution of the mean
    (Student's, centred at the mean with scale s / sqrt(n): the posterior under a flat prior). For normal
    differences the interval covers 95% at any n >= 2; a percentile bootstrap of n values cannot be wider than
    their range, so at n = 2..5 it covers far less than it claims (tests/test_compare.py measures both)."""
    from scipy.stats import t

    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = len(d)
    mean, low, high = t_interval(d, level)
    se = float(d.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    if n < 2:
        p_better = math.nan
    elif se == 0:  # every seed gave the same difference
        p_better = 0.5 if mean == 0 else float((mean > 0) == higher_is_better)
    else:
        p_better = float(t.cdf(mean / se, n - 1) if higher_is_better else t.sf(mean / se, n - 1))
    return {"n": n, "diff": d.tolist(), "mean": mean, "low": low, "high": high, "p_better": p_better}


def min_wilcoxon_p(n):
    """The smallest two-sided p an exact Wilcoxon signed-rank test can give with n pairs: every difference on
    one side has probability 2^-n under the null, and two-sided doubles it."""
    return 2 / 2**n


def verdict(cmp, name_a, name_b, metric, higher_is_better):
    """The sentence(s) on whether the data support 'A is better than B'. Below MIN_SEEDS paired seeds it says
    first that no interval can be trusted and gives no verdict."""
    n = cmp["n"]
    interval = f"[{fmt(cmp['low'])}, {fmt(cmp['high'])}]"
    if n < MIN_SEEDS:
        return (f"Too few seeds for a verdict: {n} paired seed{'s' * (n != 1)} cannot say whether {name_a} is better "
                f"than {name_b} on {metric}. " + (
                    f"The 95% t-interval of the paired difference, {interval}, rests on one degree of freedom (the "
                    f"spread of two numbers) and covers 95% only if the differences are normal, which two values "
                    f"cannot show. " if n == 2 else "No interval can be computed from one seed. ")
                + f"Run at least {MIN_SEEDS} seeds per arm (6 for a test that assumes nothing about the differences).")
    a_side = (cmp["low"] > 0) if higher_is_better else (cmp["high"] < 0)
    b_side = (cmp["high"] < 0) if higher_is_better else (cmp["low"] > 0)
    better = "higher" if higher_is_better else "lower"
    if a_side:
        out = (f"The data support the claim that {name_a} is better than {name_b} on {metric} ({better} is better): "
               f"the 95% t-interval of the paired difference, {interval}, excludes 0")
    elif b_side:
        out = (f"The data contradict the claim that {name_a} is better than {name_b} on {metric}: the 95% t-interval "
               f"of the paired difference, {interval}, lies on {name_b}'s side of 0")
    else:
        out = (f"The data do not settle whether {name_a} is better than {name_b} on {metric}: the 95% t-interval "
               f"of the paired difference, {interval}, includes 0")
    out += f" (P({name_a} better) = {cmp['p_better']:.2f}, {n} paired seeds)."
    if n <= 5:
        out += (f" With {n} seeds the interval assumes roughly normal differences: no interval that assumes nothing "
                f"reaches 95% below 6 seeds (a sign-test interval covers 1 - 2/2^{n} = {1 - 2 / 2**n:.3g}).")
    p_min = min_wilcoxon_p(n)
    if p_min >= 0.05:
        out += (f" No rank test can reach p < 0.05 with {n} paired seeds (an exact two-sided Wilcoxon signed-rank "
                f"test's smallest p is 2/2^{n} = {p_min:.3g}), so none is reported; that takes at least 6 seeds.")
    else:
        from scipy.stats import wilcoxon

        d = np.asarray(cmp["diff"])
        p = wilcoxon(d, method="exact").pvalue if np.any(d != 0) else 1.0
        out += (f" Exact two-sided Wilcoxon signed-rank test: p = {p:.3g} (smallest possible with {n} seeds: "
                f"{p_min:.3g}).")
    return out


def spearman(x, y):
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties get their average rank)."""
    from scipy.stats import rankdata

    if len(x) < 3:
        return math.nan
    rx, ry = rankdata(x), rankdata(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


# ----------------------------------------------------------------------------------------------------------
# Runs and arms.


def find_runs(paths):
    """Run folders from the arguments: a sweep folder (sweep.json: its runs in sweep order, those that have
    started) or a run folder (metrics.jsonl). Anything else is an error naming it."""
    found = []
    for path in map(Path, paths):
        if (path / "sweep.json").is_file():
            manifest = json.loads((path / "sweep.json").read_text())
            found += [Path(r["run_dir"]) for r in manifest["runs"] if (Path(r["run_dir"]) / "metrics.jsonl").is_file()]
        elif (path / "metrics.jsonl").is_file():
            found.append(path)
        else:
            raise SystemExit(f"compare: {path} is neither a sweep folder (sweep.json) nor a run folder (metrics.jsonl)")
    if not found:
        raise SystemExit("compare: no runs with metrics.jsonl found in " + ", ".join(map(str, paths)))
    return list(dict.fromkeys(found))


def load_runs(paths):
    """([{dir, cfg, seed, params, arm, series, events}], swept keys, {key: keys that vary with it}): params are
    the config keys in which the runs differ (and the method, when both trainers are there), the arm their label."""
    runs = []
    for run_dir in find_runs(paths):
        cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
        series, events = load_metrics(run_dir / "metrics.jsonl")
        for key, values in load_metrics(run_dir / "quality.jsonl")[0].items():  # scores computed after training
            series.setdefault(key, {}).update(values)
        runs.append({"dir": run_dir, "cfg": cfg, "seed": cfg.get("seed", 0), "series": series, "events": events,
                     "flat": {"method": method_of(cfg), **config.flatten(cfg)}})
    common_keys = set.intersection(*(set(r["flat"]) for r in runs)) - NOT_ARMS
    swept, partitions, along = [], {}, {}
    for k in (k for k in runs[0]["flat"] if k in common_keys):
        values = [json.dumps(r["flat"][k], sort_keys=True) for r in runs]
        partition = tuple(values.index(v) for v in values)  # which runs share a value
        if len(set(values)) > 1 and partition in partitions:  # splits the runs as an earlier key does (the
            along.setdefault(partitions[partition], []).append(k)  # trainers' own defaults, e.g. val.sampler)
        elif len(set(values)) > 1:
            partitions[partition] = k
            swept.append(k)
    for r in runs:
        r["params"] = {k: r["flat"][k] for k in swept}
        r["arm"] = ",".join(f"{k}={v}" for k, v in r["params"].items()) or "all runs"
    return runs, swept, along


def arms_of(runs):
    """{arm label: its runs sorted by seed}, in the order the arms first appear."""
    arms = {}
    for r in runs:
        arms.setdefault(r["arm"], []).append(r)
    return {a: sorted(rs, key=lambda r: r["seed"]) for a, rs in arms.items()}


def final(run, key):
    return last(run["series"], key)


def quality_keys(runs):
    """Quality metrics logged by every run (FID first, then the others alphabetically)."""
    keys = set.intersection(*({k for k in r["series"] if QUALITY.match(k)} for r in runs))
    return sorted(keys, key=lambda k: (not k.startswith("fid"), k))


def global_batch(run):
    """Images per optimizer step: batch x grad_accum x processes (processes from images_per_s / per device)."""
    tr = run["cfg"].get("train", {})
    ratios = [a / b for a, b in zip(xy(run["series"], "images_per_s")[1],
                                    xy(run["series"], "images_per_s_per_device")[1]) if b]
    world = round(statistics.median(ratios)) if ratios else 1
    return tr.get("batch_size", 1) * tr.get("grad_accum", 1) * world


def stability(run):
    """(median images/s, peak memory GiB, loss spikes, skipped steps, mean clip share) from the training rows."""
    s = run["series"]
    speed = statistics.median(xy(s, "images_per_s")[1]) if "images_per_s" in s else math.nan
    memory = max(xy(s, "peak_memory_gb")[1]) if "peak_memory_gb" in s else math.nan
    spikes = last(s, "loss_spikes") if "loss_spikes" in s else sum(e["event"] == "loss_spike" for e in run["events"])
    skipped = last(s, "skipped_steps") if "skipped_steps" in s else math.nan
    clip = statistics.mean(xy(s, "clip_share")[1]) if "clip_share" in s else math.nan
    return {"images/s": speed, "peak memory (GiB)": memory, "loss spikes": spikes, "skipped steps": skipped,
            "clip share": clip}


def correlation_points(runs, quality):
    """(val_loss, quality) at every step of every run where both are logged, and the run of each point."""
    points = []
    for i, r in enumerate(runs):
        val, q = r["series"].get("val_loss", {}), r["series"].get(quality, {})
        points += [(val[s], q[s], i) for s in sorted(set(val) & set(q))
                   if math.isfinite(val[s]) and math.isfinite(q[s])]
    return points


# ----------------------------------------------------------------------------------------------------------
# Plots (Agg canvas on Figure objects, as training/record/report.py: no global backend, no display).


def figure(rows=1, cols=1, width=9):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 2.8 * rows + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    return fig, axes


def colours(arms):
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {a: cmap(i % 10) for i, a in enumerate(arms)}


def plot_evolution(arms, key, path):
    """Mean over an arm's seeds at the steps all of them logged, the seeds' min..max as a band; against step
    and against images seen."""
    fig, axes = figure(1, 2, width=11)
    colour = colours(arms)
    for arm, runs in arms.items():
        steps = sorted(set.intersection(*(set(r["series"].get(key, {})) for r in runs)))
        if not steps:
            continue
        values = np.array([[r["series"][key][s] for s in steps] for r in runs])
        images = np.array(steps) * global_batch(runs[0])
        for ax, x in zip(axes[0], (steps, images)):
            ax.plot(x, values.mean(0), marker="o", ms=3, color=colour[arm], label=f"{arm} ({len(runs)} seeds)")
            if len(runs) > 1:
                ax.fill_between(x, values.min(0), values.max(0), color=colour[arm], alpha=0.2)
    axes[0][0].set_xlabel("step")
    axes[0][1].set_xlabel("images seen")
    axes[0][0].set_ylabel(key)
    style_axis(axes[0][1], key)  # the legend, outside the right panel
    fig.suptitle(f"{key}: mean over seeds, band = range of the seeds")
    fig.savefig(path, dpi=110)


def plot_sensitivity(rows_by_key, metric, path):
    fig, axes = figure(1, len(rows_by_key), width=max(5, 4 * len(rows_by_key)))
    for ax, (key, rows) in zip(axes[0], rows_by_key.items()):
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v, *_ in rows)
        x = [v for v, *_ in rows] if numeric else list(range(len(rows)))
        means = [m for _, m, *_ in rows]
        err = [[m - lo if math.isfinite(lo) else 0 for _, m, lo, _, _ in rows],
               [hi - m if math.isfinite(hi) else 0 for _, m, _, hi, _ in rows]]
        ax.errorbar(x, means, yerr=err, fmt="o", capsize=4)
        for xi, (_, _, _, _, finals) in zip(x, rows):
            ax.plot([xi] * len(finals), finals, ".", color="gray", alpha=0.6)
        if not numeric:
            ax.set_xticks(x, [str(v) for v, *_ in rows], rotation=20)
        elif all(v > 0 for v in x) and max(x) / min(x) > 20:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(f"final {metric}")
    fig.suptitle(f"Sensitivity: final {metric}, mean and 95% t-interval over runs (gray: each run)")
    fig.savefig(path, dpi=110)


def plot_hypothesis(comparisons, metric, path):
    fig, axes = figure(len(comparisons), 1)
    for ax, ((a, b), cmp, seeds) in zip(axes[:, 0], comparisons):
        ax.plot(seeds, cmp["diff"], "o", label="paired difference per seed")
        ax.axhline(cmp["mean"], color="black", label=f"mean {fmt(cmp['mean'])}")
        if math.isfinite(cmp["low"]):
            ax.axhspan(cmp["low"], cmp["high"], color="tab:blue", alpha=0.2, label="95% t-interval")
        ax.axhline(0, color="red", ls=":", lw=1)
        ax.set_xticks(seeds)
        ax.set_xlabel("seed")
        ax.set_title(f"{a} minus {b}: P(A better) = {cmp['p_better']:.2f}", fontsize="medium")
        style_axis(ax, f"{metric} difference")
    fig.suptitle(f"Hypothesis: {metric}, A - B per seed")
    fig.savefig(path, dpi=110)


def plot_correlation(runs, arms, qualities, path):
    fig, axes = figure(1, len(qualities), width=max(5, 4.5 * len(qualities)))
    colour = colours(arms)
    for ax, q in zip(axes[0], qualities):
        points = correlation_points(runs, q)
        for arm in arms:
            mine = [(v, y) for v, y, i in points if runs[i]["arm"] == arm]
            if mine:
                ax.plot(*zip(*mine), "o", color=colour[arm], label=arm, alpha=0.8)
        ax.set_xlabel("val_loss")
        ax.set_title(f"Spearman {fmt(spearman([p[0] for p in points], [p[1] for p in points]))} "
                     f"({len(points)} points)", fontsize="medium")
        style_axis(ax, q)
    fig.suptitle("Does the validation loss predict sample quality? (every run and logged step)")
    fig.savefig(path, dpi=110)


def plot_methods(arms, per_run, path):
    columns = list(next(iter(per_run.values())))
    fig, axes = figure(1, len(columns), width=max(9, 2.6 * len(columns)))
    for ax, col in zip(axes[0], columns):
        for i, (arm, runs) in enumerate(arms.items()):
            values = [per_run[r["dir"]][col] for r in runs]
            finite = [v for v in values if math.isfinite(v)]
            ax.bar(i, statistics.mean(finite) if finite else 0, color=colours(arms)[arm], alpha=0.6)
            ax.plot([i] * len(finite), finite, "k.")
        ax.set_xticks(range(len(arms)), list(arms), rotation=30, ha="right", fontsize="small")
        ax.set_title(col, fontsize="medium")
    fig.suptitle("Methodology comparison per arm (bars: mean over seeds, dots: each seed)")
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------------------
# compare.md


def ci_text(mean, low, high):
    return fmt(mean) if not math.isfinite(low) else f"{fmt(mean)} [{fmt(low)}, {fmt(high)}]"


def compare(paths, out, metric=None, arm_a=None, arm_b=None):
    """Writes out/compare.md and out/compare/*.png; returns the path of compare.md."""
    runs, swept, along = load_runs(paths)
    arms = arms_of(runs)
    qualities = quality_keys(runs)
    metric = metric or (qualities[0] if qualities else "val_loss")
    missing = [str(r["dir"]) for r in runs if metric not in r["series"]]
    if missing:
        raise SystemExit(f"compare: metric '{metric}' is not logged by {', '.join(missing)}; logged by all: "
                         f"{sorted(set.intersection(*(set(r['series']) for r in runs)))}")
    higher = bool(HIGHER_IS_BETTER.search(metric))
    out = Path(out)
    plots_dir = out / "compare"
    plots_dir.mkdir(parents=True, exist_ok=True)
    for old in plots_dir.glob("*.png"):  # a plot that no longer applies must not linger
        old.unlink()

    md = [f"# Comparison: {len(runs)} runs in {len(arms)} arms", "",
          f"Swept: {', '.join(swept) or 'nothing (the runs differ only in seed)'}"
          + "".join(f" ({k} brings {', '.join(v)} along)" for k, v in along.items())
          + f". Primary metric: `{metric}` "
          f"({'higher' if higher else 'lower'} is better), its value at each run's last logged step.", ""]
    md += table([(a, ", ".join(str(r["seed"]) for r in rs), ", ".join(f"`{r['dir'].name}`" for r in rs))
                 for a, rs in arms.items()], ("arm", "seeds", "runs"))

    md += ["", "## Quality metrics evolution", ""]
    for key in [k for k in ["val_loss", *qualities] if all(k in r["series"] for r in runs)]:
        name = "evolution_" + re.sub(r"[^\w.-]", "_", key) + ".png"
        plot_evolution(arms, key, plots_dir / name)
        md += [f"![{key}](compare/{name})", ""]

    md += ["## Parameter sensitivity", ""]
    rows_by_key = {}
    for key in swept:
        values = list(dict.fromkeys(json.dumps(r["params"][key]) for r in runs))
        rows = []
        for v in values:
            finals = [final(r, metric) for r in runs if json.dumps(r["params"][key]) == v]
            rows.append((json.loads(v), *t_interval(finals), finals))
        rows_by_key[key] = rows
        md += table([(f"{key}={v}", len(f), ci_text(m, lo, hi)) for v, m, lo, hi, f in rows],
                    (key, "runs", f"final {metric}: mean [95% t-interval]")) + [""]
    if rows_by_key:
        plot_sensitivity(rows_by_key, metric, plots_dir / "sensitivity.png")
        md += ["![sensitivity](compare/sensitivity.png)", ""]
    else:
        md += ["Nothing swept.", ""]

    md += ["## Hypothesis validation", ""]
    names = list(arms)
    for given in (arm_a, arm_b):
        if given is not None and given not in arms:
            raise SystemExit(f"compare: no arm '{given}'; the arms: {names}")
    a = arm_a or names[0]
    pairs = [(a, arm_b)] if arm_b else [(a, other) for other in names if other != a]
    comparisons = []
    for a, b in pairs:
        by_seed_a, by_seed_b = ({r["seed"]: final(r, metric) for r in arms[x]} for x in (a, b))
        seeds = sorted(set(by_seed_a) & set(by_seed_b))
        md += [f"**A = {a}, B = {b}** ({metric}, paired over seeds {seeds})", ""]
        if not seeds:
            md += ["No seed is shared by both arms: nothing to pair.", ""]
            continue
        cmp = paired_comparison([by_seed_a[s] for s in seeds], [by_seed_b[s] for s in seeds], higher)
        comparisons.append(((a, b), cmp, seeds))
        if cmp["n"] < MIN_SEEDS:  # said first, and no verdict after the numbers
            md += [verdict(cmp, a, b, metric, higher), ""]
        md += table([(s, fmt(by_seed_a[s]), fmt(by_seed_b[s]), fmt(d)) for s, d in zip(seeds, cmp["diff"])],
                    ("seed", "A", "B", "A - B"))
        md += ["", f"Mean difference {fmt(cmp['mean'])}" + (f", 95% paired t-interval [{fmt(cmp['low'])}, "
                   f"{fmt(cmp['high'])}], P(A better) = {cmp['p_better']:.2f}." if cmp["n"] >= 2 else "."), ""]
        md += [verdict(cmp, a, b, metric, higher), ""] if cmp["n"] >= MIN_SEEDS else []
    if comparisons:
        plot_hypothesis(comparisons, metric, plots_dir / "hypothesis.png")
        md += ["![hypothesis](compare/hypothesis.png)", ""]
    elif len(arms) < 2:
        md += ["One arm only: nothing to compare.", ""]

    md += ["## Performance correlation", ""]
    if qualities and any(correlation_points(runs, q) for q in qualities):
        rows = []
        for q in qualities:
            points = correlation_points(runs, q)
            finals = [(final(r, "val_loss"), final(r, q)) for r in runs if "val_loss" in r["series"]]
            rho_points = spearman([p[0] for p in points], [p[1] for p in points])
            rows.append((q, len(points), len({p[2] for p in points}), fmt(rho_points), fmt(spearman(*zip(*finals)))))
        md += table(rows, ("quality metric", "points", "runs", "Spearman (all points)", "Spearman (final, per run)"))
        md += ["", "Spearman's rho of val_loss with the quality metric over every logged (run, step) pair: for a "
                   "lower-is-better metric (FID) rho near +1 means the cheap validation loss ranks checkpoints as "
                   "the expensive metric does; for a higher-is-better one (accuracy) near -1. Points of one run "
                   "are not independent: read rho as a description, not a test.", ""]
        plot_correlation(runs, arms, [q for q in qualities if correlation_points(runs, q)],
                         plots_dir / "correlation.png")
        md += ["![correlation](compare/correlation.png)", ""]
    else:
        md += ["No quality metric logged at the steps of val_loss (FID: val.fid_every; the demo: "
               "benchmarks/demo_quality.py --write --checkpoints RUN...).", ""]

    md += ["## Methodology comparison", ""]
    per_run = {r["dir"]: {**stability(r), **{f"final {k}": final(r, k) for k in dict.fromkeys(["val_loss", *qualities])
                                             if k in r["series"]}} for r in runs}
    columns = list(next(iter(per_run.values())))
    rows = []
    for arm, rs in arms.items():
        cells = []
        for col in columns:
            values = [per_run[r["dir"]][col] for r in rs if math.isfinite(per_run[r["dir"]][col])]
            cells.append("-" if not values else ci_text(*t_interval(values)) if col.startswith("final")
                         else fmt(statistics.mean(values)))
        rows.append((arm, *cells))
    md += table(rows, ("arm", *columns))
    md += ["", "Per arm, the mean over its seeds (final metrics: with the 95% t-interval). images/s: median over a "
               "run's training rows; peak memory: its largest row; loss spikes and skipped (non-finite) steps: the "
               "run's totals; clip share: the mean share of steps whose gradient norm was clipped.", ""]
    plot_methods(arms, per_run, plots_dir / "methods.png")
    md += ["![methods](compare/methods.png)", ""]
    path = out / "compare.md"
    path.write_text("\n".join(md).rstrip() + "\n")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", metavar="RUN_OR_SWEEP_DIR")
    parser.add_argument("--out", help="where compare.md and compare/ go (default: the folder given, if one)")
    parser.add_argument("--metric",
                        help="the metric compared (default: a logged quality metric, FID first, else val_loss)")
    parser.add_argument("--a", help="arm A of the hypothesis (default: the first arm)")
    parser.add_argument("--b", help="arm B (default: every other arm in turn)")
    args = parser.parse_args(argv)
    if args.out is None and len(args.dirs) > 1:
        parser.error("several folders: name --out")
    path = compare(args.dirs, args.out or args.dirs[0], args.metric, args.a, args.b)
    print(path)
    return path


if __name__ == "__main__":
    main()
