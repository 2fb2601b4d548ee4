"""Make a recipe's reference curves from its seed runs (training/record/curves.py), to ship beside the recipe.

    python tools/curves.py --out configs/fashion_mnist.curves.json runs/fm_s0 runs/fm_s1 runs/fm_s2
    python tools/curves.py --out configs/fashion_mnist.curves.json runs/ddpm_s0 runs/ddpm_s1 runs/ddpm_s2

The runs must be one method and one recipe, differing only in their seed; score their checkpoints first by the
protocol (eval_fid.py --checkpoint step_N --reference_split test --untuned: the run's own settings, seed 0, reports
in each run's eval/) so the quality bands are there too; reports on the held-out rows (tools/tune.py's) and at
other settings are not used (training/record/curves.py, protocol). The file keeps the other method's curves; the recipe
then names it: "val": {"reference_curves": "configs/<recipe>.curves.json"}.
"""
import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.record import curves  # noqa: E402
from training.record.report import load_metrics  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run folders of one method and recipe, one per seed")
    p.add_argument("--out", required=True, help="the curves file (created, or its method's entry replaced)")
    args = p.parse_args(argv)
    cfgs = [json.loads((Path(r) / "config.json").read_text()) for r in args.runs]
    methods = {curves.method_of(c) for c in cfgs}
    # Keys only some runs have were added to the trainers between them (a new key defaults to the old behaviour).
    others = {k for c in cfgs[1:] for k in ("data", "model", "train", "objective", "conditioning")
              if any(c[k][key] != cfgs[0][k][key] for key in c[k].keys() & cfgs[0][k].keys())}
    if len(methods) > 1 or others:
        sys.exit(f"tools/curves.py: the runs must differ only in their seed; they differ in "
                 f"{sorted(others) or 'their method'}")
    if len({c["seed"] for c in cfgs}) < len(cfgs):
        sys.exit("tools/curves.py: two runs have the same seed: their spread would not be the seeds'")
    entry = curves.make(args.runs, load_metrics, methods.pop())
    entry["made"] = datetime.date.today().isoformat()
    everything = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    everything[curves.method_of(cfgs[0])] = entry
    Path(args.out).write_text(json.dumps(everything, separators=(",", ":")) + "\n")
    print(f"{args.out}: {curves.method_of(cfgs[0])}, {len(args.runs)} seeds, curves "
          f"{', '.join(f'{k} ({len(v)} steps)' for k, v in entry['curves'].items())}; "
          f"{Path(args.out).stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
