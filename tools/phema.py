"""Post-hoc EMA: reconstruct the EMA of any relative std from a run's snapshots, export it, or sweep the std.

    python train_flow_matching.py --ckpt.phema_every=4096             # snapshots in runs/flow_matching_demo/phema
    python tools/phema.py --run runs/flow_matching_demo --std 0.1     # -> runs/.../phema/exports/std_0.1/export
    python tools/phema.py --run runs/flow_matching_demo --sweep 0.03,0.05,0.08,0.12,0.18 --num_samples 1000 \\
        --inception_weights inception-2015-12-05.pt                   # FID of each std, the best one named

The reconstruction (training/run/phema.py; Karras et al. 2024, sec. 3 and appendix C) is the least-squares mix of
the snapshots' power-EMA profiles closest to the target profile, at the time of the last snapshot. An export
is a copy of the run's export (its config, buffers, class ids) with the reconstructed weights: eval_fid.py,
sample.py and init_from read it like any export, and eval_fid.py / sample.py also take --phema_std directly.
A sweep scores each std with eval_fid.py (same seeds for every std, so the differences are the EMA's) against
the run's held-out rows, never another reference (a choice made on the test images would flatter the final
score); any further argument goes to eval_fid.py as is (--steps, --guidance_scale, --features, ...).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval_fid  # noqa: E402
from training.run import hub  # noqa: E402
from training.run.phema import list_snapshots, snapshot_folder  # noqa: E402
from training.evaluation.reference import check_selection, reference_args  # noqa: E402
from training.evaluation.sampling import load_model  # noqa: E402
from training.sharing import pipeline_export  # noqa: E402


def stds_arg(text):
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give relative stds separated by commas, e.g. 0.05,0.1") from None


def export_std(run, std, out=None, push_to_hub=None):
    """Reconstruct std's EMA and write it as an export, a pipeline folder whose card records the std (and push
    it when asked); returns the folder holding export/."""
    model, cfg, desc = load_model(run, phema_std=std)
    folder = Path(out or snapshot_folder(run) / "exports" / f"std_{std:g}")
    export_dir = Path(run) if (Path(run) / "transformer").is_dir() else Path(run) / "export"
    ids = export_dir / "class_ids.json"
    path = pipeline_export.write(model, cfg, folder / "export", json.loads(ids.read_text()) if ids.is_file() else None,
                                 run, desc["phema"], push_to_hub)
    if push_to_hub:
        print(f"pushed {path} to {hub.push(path, push_to_hub)} (private)")
    return folder, desc["phema"]


def main(argv=None, feature_fn=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=eval_fid.passed_on({"--run", "--phema_std", "--num_samples"}, "in a sweep"))
    p.add_argument("--run", required=True, help="a run folder trained with ckpt.phema_every > 0")
    p.add_argument("--std", type=stds_arg, default=None, help="export the EMA of these relative stds, in (0, 0.28]")
    p.add_argument("--out", default=None, help="with one --std: the folder to write export/ into")
    p.add_argument("--sweep", type=stds_arg, default=None,
                   help="score these stds by FID (eval_fid.py) and name the best")
    p.add_argument("--num_samples", type=int, default=1000, help="samples per std in a sweep")
    p.add_argument("--push_to_hub", default=None, metavar="REPO", help="with one --std: upload its export to this Hub "
                   "repository (private); the card records the std")
    args, eval_args = p.parse_known_args(argv)
    if not args.std and not args.sweep:
        p.error("give --std (export) or --sweep (score)")
    if args.push_to_hub and len(args.std or []) != 1:
        raise SystemExit(f"tools/phema.py: --push_to_hub uploads one export: give one --std, not {args.std}")
    for problem in hub.push_problems(args.push_to_hub, "--push_to_hub"):  # before any reconstruction, in one line
        raise SystemExit(f"tools/phema.py: {problem}")
    snaps = list_snapshots(snapshot_folder(args.run))
    print(f"{len(snaps)} snapshots in {snapshot_folder(args.run)}, the last at {snaps[-1][1] if snaps else 0:,} images")

    for std in args.std or []:
        folder, info = export_std(args.run, std, args.out if len(args.std) == 1 else None, args.push_to_hub)
        print(f"std {std:g} (gamma {info['gamma']:.2f}): profile fit error {info['profile_fit_error']:.2e}; "
              f"exported to {folder / 'export'}")
    if not args.sweep:
        return None

    check_selection(reference_args(eval_args), load_model(args.run)[1])
    rows = []
    for std in args.sweep:
        report = eval_fid.main(["--run", args.run, "--phema_std", str(std), "--num_samples", str(args.num_samples),
                                *eval_args], feature_fn=feature_fn, written_by="tools/phema.py")
        if report is None:  # not the main process (accelerate launch): it only helps sample
            continue
        fid = next(v for k, v in report["metrics"].items() if k.startswith(("fid_", "fd_")))  # or the classifier's
        rows.append({"std": std, "fid": fid, "profile_fit_error": report["model"]["phema"]["profile_fit_error"],
                     "report": str(Path(report["samples_dir"]).parent / "report.json")})
        print(f"sweep: std {std:g}: FID {fid:.3f}", flush=True)
    if not rows:
        return None
    best = min(rows, key=lambda r: r["fid"])
    print(f"\n{'std':>6} {'FID':>9} {'fit error':>10}\n" + "\n".join(
        f"{r['std']:6g} {r['fid']:9.3f} {r['profile_fit_error']:10.1e}" + ("  <- best" if r is best else "")
        for r in rows))
    out = snapshot_folder(args.run) / "sweep.json"
    out.write_text(json.dumps({"rows": rows, "best_std": best["std"], "num_samples": args.num_samples,
                               "eval_args": eval_args}, indent=1))
    print(f"best std {best['std']:g} (FID {best['fid']:.3f}); table in {out}")
    return rows


if __name__ == "__main__":
    main()
