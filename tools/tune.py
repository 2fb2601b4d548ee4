"""Choose a checkpoint's sampling settings on images held out from the training split: guidance scale, sampler
steps and (where the run kept post-hoc EMA snapshots) EMA length, a grid scored with eval_fid.py.

    python tools/tune.py --run runs/flow_matching_fashion_mnist --guidance 1,1.5,2,3 --steps 16,32 \\
        --num_samples 2000 --classifier classifiers/fashion_mnist --features classifier
    python eval_fid.py --run ... --guidance_scale G --steps S --reference_split test ...   # then the final score

Every setting samples the same seeds, so the differences are the settings'. The reference is always the run's
held-out rows (eval_fid.py's default): --reference and --reference_split are refused, and so is a run whose
held-out rows are a test split (training/reference.py, check_selection), so no setting is ever chosen on the
images that report the final score. The score is the first distance in eval_fid.py's report (FID, or
fd_classifier with --features classifier); lower wins. Writes RUN/tuned.json: the table, the best and the
runner-up. Any other argument goes to eval_fid.py as is (--classifier, --features, --batch_size, ...).
"""
import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval_fid  # noqa: E402
from training.reference import check_selection  # noqa: E402


def floats(text):
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers separated by commas, e.g. 1,2,3") from None


def distance(metrics):
    """(name, value) of the report's first distance: FID, else the classifier's or DINOv2's Frechet distance."""
    return next((k, v) for k, v in metrics.items() if k.startswith(("fid_", "fd_")))


def main(argv=None, feature_fn=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True)
    p.add_argument("--guidance", type=floats, default=None, help="guidance scales; default: the run's val.guidance_scale")
    p.add_argument("--steps", type=floats, default=None, help="sampler steps; default: the run's val.steps")
    p.add_argument("--phema_std", type=floats, default=None, help="post-hoc EMA lengths (relative std); default: "
                   "the export's EMA")
    p.add_argument("--num_samples", type=int, default=2000, help="samples per setting (a selection, not the final score)")
    args, eval_args = p.parse_known_args(argv)
    cfg = json.loads((Path(args.run) / "config.json").read_text()) if (Path(args.run) / "config.json").is_file() \
        else eval_fid.load_model(args.run)[1]
    check_selection(eval_fid.parse_args(["--run", args.run, *eval_args]), cfg)
    grid = list(itertools.product(args.guidance or [cfg["val"]["guidance_scale"]],
                                  [int(s) for s in args.steps or [cfg["val"]["steps"]]], args.phema_std or [None]))
    rows = []
    for i, (guidance, steps, std) in enumerate(grid):
        report = eval_fid.main(["--run", args.run, "--num_samples", str(args.num_samples), "--guidance_scale",
                                str(guidance), "--steps", str(steps), *(["--phema_std", str(std)] if std else []),
                                *eval_args], feature_fn=feature_fn)
        if report is None:  # not the main process (accelerate launch): it only helps sample
            continue
        name, score = distance(report["metrics"])
        rows.append({"guidance_scale": guidance, "steps": steps, "phema_std": std, name: score,
                     **{k: v for k, v in report["metrics"].items() if k.startswith("class_accuracy")}})
        print(f"tune {i + 1}/{len(grid)}: guidance {guidance:g}, {steps} steps, EMA {std or 'export'}: {name} "
              f"{score:.4f}", flush=True)
    if not rows:
        return None
    name = distance(rows[0])[0]
    ranked = sorted(rows, key=lambda r: r[name])
    print(f"\n{'guidance':>8} {'steps':>5} {'EMA':>7} {name:>16}\n" + "\n".join(
        f"{r['guidance_scale']:8g} {r['steps']:5d} {str(r['phema_std'] or 'export'):>7} {r[name]:16.4f}"
        + ("  <- best" if r is ranked[0] else "  <- runner-up" if len(ranked) > 1 and r is ranked[1] else "")
        for r in rows))
    out = Path(args.run) / "tuned.json"
    out.write_text(json.dumps({"best": ranked[0], "runner_up": ranked[1] if len(ranked) > 1 else None, "rows": rows,
                               "num_samples": args.num_samples, "reference": "held-out rows of the training split",
                               "eval_args": eval_args}, indent=1))
    print(f"best: guidance {ranked[0]['guidance_scale']:g}, {ranked[0]['steps']} steps, EMA "
          f"{ranked[0]['phema_std'] or 'export'} ({name} {ranked[0][name]:.4f}); table in {out}")
    return ranked


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"tools/tune.py: {e}")
