"""Run summary: report.md and PNG plots for any run folder, written after training or on demand.

    python -m training.record.report runs/flow_matching_demo [runs/ddpm_demo ...]     # prints the paths of the reports

Reads run_dir/config.json and run_dir/metrics.jsonl (the trainers' log(): training, gradient-analysis,
validation, quality and event rows), eval_fid.py's reports (run_dir/eval/*/report.json) and human votes
(run_dir/ratings.jsonl, from tools/rate.py), and writes run_dir/report/*.png plus run_dir/report.md, which
embeds them with relative paths. Every plot and table row is optional: whatever the metrics lack (an old run, a feature
turned off) is skipped, never an error. A resumed run logs again the steps after its last checkpoint: per key
the later row wins, so each curve has one value per step; events are kept once per (step, kind, group).
Matplotlib draws through its Agg canvas on Figure objects (no pyplot), so importing this module changes no
global backend and works without a display.
"""
import collections
import contextlib
import json
import math
import re
import shutil
import statistics
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from training.evaluation import ratings
from training.record import curves

MAX_EVENT_ROWS = 20
MANIFOLD = ("precision_", "recall_", "density_", "coverage_")  # evaluation/metrics.py, on Inception or DINOv2 features
QUALITY = ("fid_", "kid_", "fd_", *MANIFOLD)


def fmt(x):
    return "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


# ---- Reading: metrics.jsonl -> {key: {step: value}} and the event rows ------------------------------------

def load_metrics(path):
    """(series, events): series[key][step] = float, the later row winning; events sorted by step. A line that
    does not parse (a run killed mid-write) is skipped."""
    series, events = {}, {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            continue
        step = int(row["step"])
        if "event" in row:
            row = {**row, "event": str(row["event"])}
            events[(step, row["event"], str(row.get("group", "")))] = row
            continue
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(k, {})[step] = float(v)
    return series, [events[k] for k in sorted(events)]


def xy(series, key):
    points = sorted(series.get(key, {}).items())
    return [s for s, _ in points], [v for _, v in points]


def last(series, key):
    return series[key][max(series[key])] if series.get(key) else None


def groups(series, prefix):
    """Per-group keys "prefix/<group>": blocks in index order first, then the others alphabetically."""
    names = [k.split("/", 1)[1] for k in series if k.startswith(prefix + "/")]
    found = [(g, int(g[6:]) if re.fullmatch(r"block_\d+", g) else None) for g in names]
    return sorted(found, key=lambda gi: (gi[1] is None, gi[1] or 0, gi[0]))


# ---- Plots: one PNG per question, each skipped when its metrics are absent -------------------------------

def style_axis(ax, ylabel, logy=False, **legend):
    ax.set_ylabel(ylabel)
    if logy and all(v > 0 for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(v)):
        ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:  # outside the axes, so it never hides a curve
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), **legend)


def plot_groups(fig, ax, series, prefix):
    """One line per "prefix/<group>": blocks coloured first -> last (viridis, with a colorbar), the other
    groups dashed in fixed colours with a legend."""
    found = groups(series, prefix)
    blocks = [i for _, i in found if i is not None] or [0]
    norm, cmap = Normalize(min(blocks), max(max(blocks), min(blocks) + 1)), matplotlib.colormaps["viridis"]
    others = iter(["tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive"] * 10)
    for g, i in found:
        style = dict(color=cmap(norm(i)), lw=1) if i is not None else dict(color=next(others), ls="--", label=g)
        ax.plot(*xy(series, f"{prefix}/{g}"), **style)
    if any(i is not None for _, i in found):
        fig.colorbar(ScalarMappable(norm, cmap), ax=ax, label="block index", pad=0.01)


def plot_all(series, events, cfg, out):
    """Writes out/*.png; returns [(file name, title, what to look for)] in report order."""
    plots = []

    @contextlib.contextmanager
    def figure(name, title, look_for, rows=1):
        fig = Figure(figsize=(9, 2.6 * rows + 1), layout="constrained")
        FigureCanvasAgg(fig)  # draw with Agg whatever the global backend is
        axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
        for ax in axes:
            ax.grid(True, alpha=0.3)
        axes[-1].set_xlabel("step")
        yield fig, axes
        fig.suptitle(title)
        fig.savefig(out / name, dpi=110)
        plots.append((name, title, look_for))

    def events_of(*kinds, key):
        return [e for e in events if e["event"] in kinds and isinstance(e.get(key), (int, float))]

    if "loss" in series or "val_loss" in series:
        with figure("loss.png", "Loss", "training and validation loss falling together (red crosses: loss spikes; "
                    "a widening gap to val_loss is overfitting)") as (fig, (ax,)):
            for key, style in [("loss", dict(alpha=0.35, lw=1)), ("loss_smoothed", {}), ("val_loss", dict(marker="o")),
                               ("loss_r_eq_t", dict(lw=1)), ("loss_r_lt_t", dict(lw=1))]:  # MeanFlow's two kinds
                if key in series:
                    ax.plot(*xy(series, key), label=key, **style)
            if spikes := events_of("loss_spike", key="loss"):
                ax.plot([e["step"] for e in spikes], [e["loss"] for e in spikes], "x", color="red", ms=8,
                        label=f"loss spike ({len(spikes)})")
            style_axis(ax, "loss", logy=True)
    if "lr" in series:
        with figure("lr.png", "Learning rate", "the warmup ramp and the configured schedule") as (fig, (ax,)):
            ax.plot(*xy(series, "lr"))
            style_axis(ax, "learning rate")
    if "grad_norm" in series or groups(series, "grad_norm"):
        rows = 1 + any(k in series for k in ("clip_share", "clip_excess"))
        with figure("grad_norm.png", "Gradient norm and clipping", "no group drifting decades away from the others "
                    "(red triangles: vanishing / exploding flags) and clipping on few steps after the warmup",
                    rows) as (fig, axes):
            plot_groups(fig, axes[0], series, "grad_norm")
            if "grad_norm" in series:
                axes[0].plot(*xy(series, "grad_norm"), color="black", lw=1.5, label="total")
            if isinstance(clip := cfg.get("train", {}).get("grad_clip"), (int, float)) and clip > 0:
                axes[0].axhline(clip, color="red", ls=":", lw=1, label=f"clip {clip:g}")
            for e in events_of("grad_vanishing", "grad_exploding", key="grad_norm"):
                axes[0].plot(e["step"], e["grad_norm"], "v" if e["event"] == "grad_vanishing" else "^", color="red")
            style_axis(axes[0], "gradient norm", logy=True)
            for key, label in [("clip_share", "share of steps clipped"),
                               ("clip_excess", "mean grad_norm / clip\nover clipped steps")]:
                if key in series:
                    axes[1].plot(*xy(series, key), label=label)
                    style_axis(axes[1], "clipping")
    if groups(series, "update_ratio"):
        with figure("update_ratio.png", "Update / weight ratio per group", "about 1e-3 per step; a group far "
                    "below learns nothing, far above is unstable") as (fig, (ax,)):
            plot_groups(fig, ax, series, "update_ratio")
            style_axis(ax, "|update| / |weight|", logy=True)
    resources = [(k, label) for k, label in [("images_per_s", "images / s (all devices)"),
                 ("data_wait_share", "share of time\nwaiting for data"), ("peak_memory_gb", "peak memory (GiB)")]
                 if k in series]
    if resources:
        with figure("resources.png", "Throughput, data wait and memory", "flat lines: a data-wait share above ~0.1 "
                    "means the input pipeline is the bottleneck, growing memory a leak", len(resources)) as (fig, axes):
            for ax, (key, label) in zip(axes, resources):
                ax.plot(*xy(series, key))
                ax.set_ylim(0, 1.1 * max([y for y in xy(series, key)[1] if math.isfinite(y)] or [1]) or 1)
                style_axis(ax, label)
    if bins := sorted((int(k[len("val_loss_t"):]), k) for k in series if re.fullmatch(r"val_loss_t\d+", k)):
        with figure("val_loss_bins.png", "Validation loss per time bin", "every bin improving; a bin that stalls "
                    "is a noise level the model does not learn") as (fig, (ax,)):
            for k, key in bins:
                ax.plot(*xy(series, key), marker="o", color=matplotlib.colormaps["plasma"](k / max(len(bins), 2)),
                        label=f"bin {k}")
            style_axis(ax, "validation loss", logy=True, title="time bin\n(0: data end)")
    if density := sorted((int(k.split("/")[1]), k) for k in series if re.fullmatch(r"time_density/\d+", k)):
        steps = sorted(series[density[0][1]])
        shown = sorted({steps[round(i * (len(steps) - 1) / 4)] for i in range(5)})  # 5 steps, first to last
        with figure("time_density.png", "Adaptive time density", "where training spends its samples, relative to "
                    "the base density (1: the base density); it follows the loss per time bin") as (fig, (ax,)):
            for j, step in enumerate(shown):
                ax.plot([(k + 0.5) / len(density) for k, _ in density], [series[key][step] for _, key in density],
                        marker=".", color=matplotlib.colormaps["viridis"](j / max(len(shown) - 1, 1)),
                        label=f"step {step}")
            ax.axhline(1, color="grey", ls=":", lw=1)
            ax.set_xlabel("base-density quantile of t (0: data end, 1: noise end)")
            style_axis(ax, "p(t) / base(t)")
    slopes = sorted((int(k[len("val_slope_t"):]), k) for k in series if re.fullmatch(r"val_slope_t\d+", k))
    if "grad_noise_scale" in series or slopes:
        rows = ("grad_noise_scale" in series) + bool(slopes)
        with figure("convergence.png", "Convergence indicators", "the gradient noise scale B_noise (the critical "
                    "batch size, McCandlish et al. 2018) against the global batch; validation-loss slopes per time "
                    "bin near 0 once a bin has stopped improving", rows) as (fig, axes):
            if "grad_noise_scale" in series:
                axes[0].plot(*xy(series, "grad_noise_scale"), label="B_noise")
                t = cfg.get("train", {})
                if isinstance(t.get("batch_size"), int):
                    axes[0].axhline(t["batch_size"] * t.get("grad_accum", 1), color="red", ls=":", lw=1,
                                    label="batch per process")
                style_axis(axes[0], "gradient noise scale", logy=True)
            if slopes:
                for k, key in slopes:
                    axes[-1].plot(*xy(series, key), marker="o", label=f"bin {k}",
                                  color=matplotlib.colormaps["plasma"](k / max(len(slopes), 2)))
                axes[-1].axhline(0, color="grey", ls=":", lw=1)
                style_axis(axes[-1], "val loss slope\n(relative, per 1k steps)")
    families = [("fid_",), ("kid_",), ("fd_",), MANIFOLD]
    if quality := [ks for ks in ([k for k in sorted(series) if k.startswith(f)] for f in families) if ks]:
        with figure("quality.png", "Sample quality during training (small-N FID, KID, FD-DINOv2, precision/recall)",
                    "falling distances (small-N FID is biased upward: compare trends, not values, with published "
                    "numbers); precision is fidelity, recall and coverage diversity", rows=len(quality)) as (fig, axes):
            for ax, keys in zip(axes, quality):
                for key in keys:
                    ax.plot(*xy(series, key), marker="o", label=key)
                style_axis(ax, "precision, recall,\ndensity, coverage" if keys[0].startswith(MANIFOLD)
                           else keys[0].split("_")[0].upper().replace("FD", "FD-DINOv2"))
    return plots


def plot_reference(series, cfg, run_dir, out):
    """The run's training loss, held-out loss and eval_fid.py scores over the reference run's bands
    (val.reference_curves, training/record/curves.py); [] when the recipe has none or its file is gone."""
    path = cfg.get("val", {}).get("reference_curves")
    if not path or not Path(path).is_file():
        return []
    reference = json.loads(Path(path).read_text()).get(curves.method_of(cfg))
    if not reference:
        return []
    series = {k: dict(v) for k, v in series.items()}
    for key, value, step in curves.scores(run_dir, cfg):  # the run's own evaluations, at their steps
        series.setdefault(key, {})[step] = value
    keys = [k for k in reference["curves"] if k in series and not re.fullmatch(r"val_loss_t\d+", k)]  # bins: too many
    if not keys:
        return []
    fig = Figure(figsize=(9, 2.6 * len(keys) + 1), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, key in zip(fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0], keys):
        steps, lo, mean, hi = zip(*reference["curves"][key])
        ax.fill_between(steps, lo, hi, color="grey", alpha=0.35, label=f"reference, {len(reference['seeds'])} seeds")
        ax.plot(steps, mean, color="grey", ls="--", lw=1)
        ax.plot(*xy(series, key), marker="o" if len(series[key]) < 20 else None, color="C0", label="this run")
        ax.grid(True, alpha=0.3)
        style_axis(ax, key, logy=key.startswith(("loss", "val_loss")))
    fig.axes[-1].set_xlabel("step")
    fig.suptitle(f"Against the reference run ({path})")
    fig.savefig(out / "reference.png", dpi=110)
    return [("reference.png", "Against the reference run", "this run inside the grey band of the reference's seeds; "
             "the log names every held-out loss that left it by more than the seeds' spread (off_reference events)")]


# ---- The report ------------------------------------------------------------------------------------------

def table(rows, header=("", "")):
    lines = [f"| {' | '.join(header)} |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + [f"| {' | '.join(str(c) for c in row)} |" for row in rows]


def config_rows(cfg, series):
    d, m, t, o = (cfg.get(k, {}) for k in ("data", "model", "train", "objective"))
    rows = [("method", curves.method_of(cfg)),
            ("data", d.get("source", "-")), ("resolution", d.get("resolution", "-"))]
    if "num_layers" in m:
        width = m.get("num_attention_heads", 0) * m.get("attention_head_dim", 0)
        rows.append(("model", f"{m['num_layers']} layers, width {width or '-'}, patch {m.get('patch_size', '-')}"))
    ratios = [a / b for a, b in zip(xy(series, "images_per_s")[1], xy(series, "images_per_s_per_device")[1]) if b]
    bs, accum = t.get("batch_size", "-"), t.get("grad_accum", 1)
    world = round(statistics.median(ratios)) if ratios and isinstance(bs, int) else None  # not in the config
    rows += [("global batch", f"{bs} x {world} processes x {accum} accumulation = {bs * world * accum}" if world
              else f"{bs} per process x {accum} accumulation (process count unknown)"),
             ("lr", fmt(t.get("lr"))), ("steps", t.get("max_steps", "-"))]
    return rows


def final_rows(series, events):
    rows = [("last step", max((s for v in series.values() for s in v), default="-"))]
    rows += [(k, fmt(last(series, k))) for k in ("loss", "loss_r_eq_t", "loss_r_lt_t", "loss_smoothed", "val_loss")
             if k in series]  # loss_r_*: MeanFlow's r = t samples (flow matching's loss) and the r < t ones
    val = [(v, s) for s, v in zip(*xy(series, "val_loss")) if math.isfinite(v)]
    if val:
        best, step = min(val)
        rows.append(("best val_loss", f"{fmt(best)} at step {step}"))
    if "images_per_s" in series:
        rows.append(("median images/s", fmt(statistics.median(xy(series, "images_per_s")[1]))))
    if "peak_memory_gb" in series:
        rows.append(("peak memory (GiB)", fmt(max(xy(series, "peak_memory_gb")[1]))))
    if "skipped_steps" in series:
        rows.append(("skipped steps (non-finite)", fmt(int(last(series, "skipped_steps")))))
    if "clip_share" in series:  # training rows (all but the last) cover log.every steps: the mean is the share
        rows.append(("clip share overall", fmt(statistics.mean(xy(series, "clip_share")[1]))))
    rows += [(f"{k} (last)", fmt(last(series, k))) for k in sorted(series) if k.startswith(QUALITY)]
    if "grad_noise_scale" in series:
        rows.append(("gradient noise scale B_noise (last)", fmt(last(series, "grad_noise_scale"))))
    if slopes := sorted((int(k[len("val_slope_t"):]), k) for k in series if re.fullmatch(r"val_slope_t\d+", k)):
        rows.append(("val loss slope per time bin (last; relative, per 1k steps)",
                     ", ".join(f"t{k} {last(series, key):+.3g}" for k, key in slopes)))
    if rollbacks := [e for e in events if e["event"] == "rollback"]:
        rows.append(("rollbacks", f"{len(rollbacks)}, LR x {rollbacks[-1].get('lr_factor', '-')}"))
    n_events = sum(e["event"] == "loss_spike" for e in events)
    if "loss_spikes" in series or n_events:  # the trainer's cumulative count; else count the events
        rows.append(("loss spikes", int(last(series, "loss_spikes")) if "loss_spikes" in series else n_events))
    return rows


def evaluation_lines(run_dir):
    """eval_fid.py's reports (one row per output folder) and what the human votes in the run folder say."""
    md = []
    reports = sorted(run_dir.glob("eval/*/report.json"))
    if reports:
        md += ["", "## Evaluations (eval_fid.py)", ""]
        rows = []
        for path in reports:
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                r = json.loads(path.read_text())
                rows.append((f"`{path.parent.name}`", r["num_samples"],
                             ", ".join(f"{k} {fmt(v)}" for k, v in r["metrics"].items())))
        md += table(rows, ("settings", "samples", "metrics"))
    if (run_dir / ratings.VOTES_FILE).is_file():
        votes = ratings.read_votes([run_dir])
        md += ["", f"## Human ratings (tools/rate.py, {len(votes)} votes)", ""]
        md += [f"    {line}" for line in ratings.summary_lines(votes)]
    return md


def write_report(run_dir) -> Path:
    """Writes run_dir/report/*.png and run_dir/report.md; returns the path of report.md."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    series, events = load_metrics(run_dir / "metrics.jsonl")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    for old in out.glob("*.png"):  # a plot that no longer applies must not linger from an earlier report
        old.unlink()
    plots = plot_all(series, events, cfg, out)
    plots += plot_reference(series, cfg, run_dir, out)
    grids = sorted((run_dir / "samples").glob("step_*.png"))
    md = [f"# Run report: {run_dir.resolve().name}", "", f"`{run_dir}`", "", "## Config", ""]
    md += table(config_rows(cfg, series), ("setting", "value"))
    md += ["", "## Final numbers", ""] + table(final_rows(series, events), ("metric", "value"))
    md += ["", "## Events", ""]
    if events:
        counts = collections.Counter(e["event"] for e in events)
        md += [", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) +
               (f" ({len(events)} in all, the first {MAX_EVENT_ROWS} shown; all are in metrics.jsonl)"
                if len(events) > MAX_EVENT_ROWS else ""), ""]
        detail = lambda e: ", ".join(f"{k} {fmt(v)}" for k, v in e.items() if k not in ("step", "event"))
        md += table([(e["step"], e["event"], detail(e)) for e in events[:MAX_EVENT_ROWS]],
                    ("step", "event", "details"))
    else:
        md.append("No events logged.")
    md += evaluation_lines(run_dir)
    md += ["", "## Plots", ""]
    for name, title, look_for in plots:
        md += [f"![{title}](report/{name})", "", f"*{title}:* look for {look_for}.", ""]
    if grids:
        shutil.copyfile(grids[-1], out / "samples_final.png")
        md += ["![final samples](report/samples_final.png)", "",
               f"*Final samples* (`samples/{grids[-1].name}`): look for the right class in every cell.", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(md).rstrip() + "\n")
    return path


def main(argv=None):
    """Write the report of each run folder named; a folder that is not a run is refused before any is written."""
    import argparse

    parser = argparse.ArgumentParser(description="Write report.md and PNG plots for training run folders (what "
                                     "train_flow_matching.py / train_ddpm.py write at the end of a run).")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run folder: it holds config.json and "
                        "metrics.jsonl (e.g. runs/flow_matching_demo)")
    args = parser.parse_args(argv)
    for run_dir in map(Path, args.run_dirs):
        if not run_dir.is_dir():
            parser.error(f"{run_dir}: no such folder")
        if not (run_dir / "metrics.jsonl").is_file():
            parser.error(f"{run_dir} is not a run folder: it has no metrics.jsonl (a run folder is the trainer's "
                         f"run_dir, e.g. runs/flow_matching_demo)")
    return [write_report(run_dir) for run_dir in args.run_dirs]


if __name__ == "__main__":
    for path in main():
        print(path)
