"""A recipe's reference run: the curves of its documented runs (training loss, held-out loss and its time bins, the
scores of eval_fid.py at a few checkpoints) as a band over seeds, shipped beside the recipe, so that a new run
of it sees at once whether it is on track ("is this spike normal?").

    python tools/curves.py --out configs/fashion_mnist.curves.json RUN_SEED0 RUN_SEED1 RUN_SEED2   # make it
    "val": {"reference_curves": "configs/fashion_mnist.curves.json"}                              # the recipe names it

The file holds, per method, the seeds' runs and, per metric, rows [step, lo, mean, hi] over the seeds (lo and hi:
their minimum and maximum; a few KB). Any recipe can carry one: run it with a few seeds, then tools/curves.py.

The scores are the protocol's only (`protocol`): eval_fid.py's reports sampled at the run's own settings (its val
section's sampler, steps, guidance, control guidance and guidance interval; eval_fid.py's seed 0; the EMA weights)
against a reference other than the held-out rows (the test split). A run folder also holds reports that chose a
setting rather than score the recipe: tools/tune.py's search and confirmation (other guidance, steps, EMA, seeds
1-5) and tools/phema.py's sweep, all on the held-out rows; keyed by metric and step alone they would land in the band.

During a run (RunLog passes every row to off_band) each held-out loss at a step the reference has is compared with
its band [lo, hi]: more than the seed-to-seed spread (hi - lo) outside it, or not finite, the run logs an
`off_reference` event and prints one plain line with the step, the value, the band and by how much. At the end the
report draws the run's curves over the bands (training/record/report.py).
"""
import json
import math
import re
from pathlib import Path

WATCHED = re.compile(r"val_loss(_t\d+)?")  # the held-out losses: the same images, noise and times in every run
# The settings that must match for the curves to be comparable step by step; a difference is said once.
COMPARABLE = [("train", "max_steps"), ("train", "batch_size"), ("train", "grad_accum"), ("train", "lr"),
              ("train", "lr_schedule"), ("model", "num_layers"), ("model", "patch_size"), ("data", "resolution"),
              ("val", "loss_samples"), ("objective", "prediction"),  # x0's loss is not v's, step for step
              ("train", "optimizer"), ("train", "muon_lr")]  # nor AdamW's descent Muon's (docs/benchmarks.md)


def band(values):
    return [min(values), sum(values) / len(values), max(values)]


def make(runs, read_metrics, method):
    """One method's reference from its seed runs:
    {"runs", "seeds", "settings", "curves": {key: [[step, lo, mean, hi]]}}. Training loss: the smoothed loss every
    10th logged step; held-out losses at every validation; eval_fid.py's
    scores by the protocol (protocol_reports) at each checkpoint scored (the export counts as the last step). A
    step enters a curve only where every run has it, so each band rests on all the seeds."""
    if len(runs) < 2:
        raise ValueError(f"a reference band needs at least 2 seed runs (their spread is the tolerance); "
                         f"got {len(runs)}")
    cfgs = [json.loads((Path(r) / "config.json").read_text()) for r in runs]
    series = [read_metrics(Path(r) / "metrics.jsonl")[0] for r in runs]
    for s, run, cfg in zip(series, runs, cfgs):
        seen = {}  # (metric, step) -> the report that gave it: two protocol scores of one point are ambiguous
        for path, report, step in protocol_reports(run, cfg):
            for key, value in report["metrics"].items():
                if (key, step) in seen:
                    raise ValueError(f"{seen[key, step]} and {path} both score {key} at step {step} by the "
                                     f"protocol (the run's settings, not the held-out rows): move one out of "
                                     f"{Path(run) / 'eval'}")
                seen[key, step] = path
                s.setdefault(key, {})[step] = value
    curves = {}
    for key in sorted(set.intersection(*(set(s) for s in series))):
        if not (key == "loss_smoothed" or WATCHED.fullmatch(key) or key.startswith(("fid_", "kid_", "fd_", "kd_",
                                                                                    "precision_", "recall_",
                                                                                    "class_accuracy"))):
            continue
        steps = sorted(set.intersection(*(set(s[key]) for s in series)))
        if key == "loss_smoothed":
            steps = steps[::10] + ([steps[-1]] if steps and (len(steps) - 1) % 10 else [])
        curves[key] = [[step, *[round(v, 6) for v in band([s[key][step] for s in series])]] for step in steps]
    return {"runs": [str(r) for r in runs], "seeds": [c["seed"] for c in cfgs],
            "settings": {f"{a}.{b}": cfgs[0][a][b] for a, b in COMPARABLE}, "curves": curves}


def sampling_differences(report, cfg):
    """How an eval_fid.py report's sampling differs from the run's own: its val section's sampler, steps, guidance,
    control guidance and interval, and eval_fid.py's defaults, seed 0 and the held-out rows' controls
    (['guidance_scale 3.0, not 2.0']; [] for the run's own). A report written before a setting existed sampled at
    that setting's default."""
    val = cfg["val"]
    own = {"sampler": val["sampler"], "steps": val["steps"], "guidance_scale": val["guidance_scale"],
           "control_guidance_scale": val.get("control_guidance_scale", 0.0),
           "guidance_interval": list(val.get("guidance_interval", [0.0, 1.0])), "seed": 0,
           "controls": "heldout" if cfg["conditioning"]["controls"] else None}
    used = {**{k: report.get(k) for k in ("sampler", "steps", "guidance_scale")},
            "control_guidance_scale": report.get("control_guidance_scale", 0.0),
            "guidance_interval": list(report.get("guidance_interval", [0.0, 1.0])),
            "seed": report.get("seeds", {}).get("seed", 0), "controls": report.get("controls", own["controls"])}
    return [f"{k} {used[k]}, not {own[k]}" for k in own if used[k] != own[k]]


def on_heldout_rows(report):
    """Whether a report was scored against the run's held-out training rows (eval_fid.py's default reference, the
    only one tools/tune.py and tools/phema.py --sweep accept): images that choose settings, not the test split."""
    return (report.get("reference") or {}).get("split") == "heldout"


def protocol(report, cfg):
    """Whether an eval_fid.py report scores the recipe as its reference runs were scored: the run's own sampling
    settings and seed, the EMA weights (no raw weights, no post-hoc EMA), against a reference other than the
    held-out rows (docs/evaluation.md's final score: the test split)."""
    model = report.get("model", {})
    return (not sampling_differences(report, cfg) and not on_heldout_rows(report) and "phema" not in model
            and model.get("weights", "ema") in ("ema", "ema (export)"))


def protocol_reports(run, cfg):
    """(path, report, step) of each protocol report in run/eval: a checkpoint's step, or the export's
    (train.max_steps)."""
    for path in sorted(Path(run).glob("eval/*/report.json")):
        report = json.loads(path.read_text())
        if protocol(report, cfg):
            yield path, report, report["model"].get("step", cfg["train"]["max_steps"])


def scores(run, cfg):
    """(metric, value, step) of each protocol report of the run (protocol_reports)."""
    for _, report, step in protocol_reports(run, cfg):
        for key, value in report["metrics"].items():
            yield key, value, step


def load(cfg):
    """The reference of this run's method named by val.reference_curves, or None (unset). A named file that is
    missing or lacks the method is an error at start-up, not a silent run without it."""
    path = cfg.get("val", {}).get("reference_curves")  # (a config without a val section: a tool's or a test's)
    if not path:
        return None
    if not Path(path).is_file():
        raise FileNotFoundError(f"val.reference_curves='{path}': no such file (make one with tools/curves.py, or "
                                f"set val.reference_curves=null)")
    everything = json.loads(Path(path).read_text())
    if method_of(cfg) not in everything:
        raise ValueError(f"val.reference_curves='{path}' has curves for {sorted(everything)}, not {method_of(cfg)}")
    return everything[method_of(cfg)]


def method_of(cfg):
    """The trainer of a run's config: flow matching's objective has time_sampling (eval_fid.py and sample.py sample
    with its generate)."""
    return "flow_matching" if "time_sampling" in cfg.get("objective", {}) else "ddpm"


def differences(reference, cfg):
    """The settings in which this run differs from the reference's runs: 'train.max_steps 2000 -> 4000'."""
    return [f"{k} {v} -> {cfg[k.split('.')[0]][k.split('.')[1]]}" for k, v in reference["settings"].items()
            if cfg[k.split(".")[0]][k.split(".")[1]] != v]


def off_band(reference, row):
    """The `off_reference` events of a logged row: each watched key more than the seeds' spread outside its band, or not
    finite (NaN: outside no bound by comparison, so checked on its own)."""
    events = []
    for key, value in row.items():
        if not WATCHED.fullmatch(key) or not isinstance(value, (int, float)) or key not in reference["curves"]:
            continue
        at = [r for r in reference["curves"][key] if r[0] == row["step"]]
        if not at:
            continue
        _, lo, mean, hi = at[0]
        spread = hi - lo
        outside = value - hi if value > hi else lo - value if value < lo else 0.0
        if outside > spread or not math.isfinite(value):
            events.append({"step": row["step"], "event": "off_reference", "key": key, "value": value,
                           "band": [lo, hi], "by": outside if math.isfinite(value) else None, "spread": spread})
    return events


def describe(event, seeds):
    lo, hi = event["band"]
    if not math.isfinite(event["value"]):
        return (f"step {event['step']}: {event['key']} is {event['value']}, not a finite number: off the reference "
                f"band [{lo:.4f}, {hi:.4f}] ({len(seeds)} seeds): diverged weights, or an overflow at "
                "train.mixed_precision")
    side = "above" if event["value"] > hi else "below"
    return (f"step {event['step']}: {event['key']} {event['value']:.4f} is {side} the reference band "
            f"[{lo:.4f}, {hi:.4f}] ({len(seeds)} seeds) by {event['by']:.4f}, "
            f"{event['by'] / event['spread']:.1f} x the seed-to-seed spread {event['spread']:.4f}"
            if event["spread"] > 0 else f"step {event['step']}: {event['key']} {event['value']} is off the reference")
