"""A recipe's reference run: the curves of its documented runs (training loss, held-out loss and its time bins, the
scores of eval_fid.py at a few checkpoints) as a band over seeds, shipped beside the recipe, so that a new run
of it sees at once whether it is on track ("is this spike normal?").

    python tools/curves.py --out configs/fashion_mnist.curves.json RUN_SEED0 RUN_SEED1 RUN_SEED2   # make it
    "val": {"reference_curves": "configs/fashion_mnist.curves.json"}                              # the recipe names it

The file holds, per method, the seeds' runs and, per metric, rows [step, lo, mean, hi] over the seeds (lo and hi:
their minimum and maximum; a few KB). Any recipe can carry one: run it with a few seeds, then tools/curves.py.

During a run (RunLog passes every row to off_band) each held-out loss at a step the reference has is compared with
its band [lo, hi]: more than the seed-to-seed spread (hi - lo) outside it, the run logs an `off_reference`
event and prints one plain line with the step, the value, the band and by how much. At the end the report
draws the run's curves over the bands (training/report.py).
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
    """One method's reference from its seed runs: {"runs", "seeds", "settings", "curves": {key: [[step, lo, mean, hi]]}}.
    Training loss: the smoothed loss every 10th logged step; held-out losses at every validation; eval_fid.py's
    scores (eval/*/report.json) at each checkpoint scored (the export counts as the last step). A step enters a
    curve only where every run has it, so each band rests on all the seeds."""
    if len(runs) < 2:
        raise ValueError(f"a reference band needs at least 2 seed runs (their spread is the tolerance); got {len(runs)}")
    cfgs = [json.loads((Path(r) / "config.json").read_text()) for r in runs]
    series = [read_metrics(Path(r) / "metrics.jsonl")[0] for r in runs]
    for s, run, cfg in zip(series, runs, cfgs):
        for key, value, step in scores(run, cfg):
            s.setdefault(key, {})[step] = value
    curves = {}
    for key in sorted(set.intersection(*(set(s) for s in series))):
        if not (key == "loss_smoothed" or WATCHED.fullmatch(key) or key.startswith(("fid_", "kid_", "fd_", "kd_",
                                                                                    "precision_", "recall_", "class_accuracy"))):
            continue
        steps = sorted(set.intersection(*(set(s[key]) for s in series)))
        if key == "loss_smoothed":
            steps = steps[::10] + ([steps[-1]] if steps and (len(steps) - 1) % 10 else [])
        curves[key] = [[step, *[round(v, 6) for v in band([s[key][step] for s in series])]] for step in steps]
    return {"runs": [str(r) for r in runs], "seeds": [c["seed"] for c in cfgs],
            "settings": {f"{a}.{b}": cfgs[0][a][b] for a, b in COMPARABLE}, "curves": curves}


def scores(run, cfg):
    """(metric, value, step) of each eval_fid.py report in run/eval: a checkpoint's step, or the export's
    (train.max_steps)."""
    for path in sorted(Path(run).glob("eval/*/report.json")):
        report = json.loads(path.read_text())
        step = report["model"].get("step", cfg["train"]["max_steps"])
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
    """The trainer of a run's config: flow matching's objective has time_sampling (eval_fid.method_of imports it)."""
    return "flow_matching" if "time_sampling" in cfg.get("objective", {}) else "ddpm"


def differences(reference, cfg):
    """The settings in which this run differs from the reference's runs: 'train.max_steps 2000 -> 4000'."""
    return [f"{k} {v} -> {cfg[k.split('.')[0]][k.split('.')[1]]}" for k, v in reference["settings"].items()
            if cfg[k.split(".")[0]][k.split(".")[1]] != v]


def off_band(reference, row):
    """The `off_reference` events of a logged row: each watched key more than the seeds' spread outside its band."""
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
                           "band": [lo, hi], "by": outside, "spread": spread})
    return events


def describe(event, seeds):
    lo, hi = event["band"]
    side = "above" if event["value"] > hi else "below"
    return (f"step {event['step']}: {event['key']} {event['value']:.4f} is {side} the reference band "
            f"[{lo:.4f}, {hi:.4f}] ({len(seeds)} seeds) by {event['by']:.4f}, "
            f"{event['by'] / event['spread']:.1f} x the seed-to-seed spread {event['spread']:.4f}"
            if event["spread"] > 0 else f"step {event['step']}: {event['key']} {event['value']} is off the reference")
