"""Feeds docs/benchmarks/resolution_transfer.md (resolution transfer on the demo).

Resolution transfer on the embedded data: pre-train at a low resolution, fine-tune at twice the resolution.

One flow-matching model is pre-trained at 8 px (4 x 4 tokens), then fine-tuned at 16 px (8 x 8 tokens) for the
same budget in each variant of the paper's two mechanisms (Berrada et al. 2024, sec. 3 / Pseudocode 1):
  resample + shift   the positional grid resampled to span the positions the model saw, time shift a = 2
  resample           the grid resampled, no shift (a = 1)
  extend + shift     the grid extended past the positions it saw (diffusers' default), a = 2
  extend             neither
  scratch            no pre-training, same fine-tuning budget (what the pre-training buys)
For each: the held-out validation loss at 16 px after fine-tuning (on the fixed, unshifted time grid, so it is
comparable across shifts) and sample quality (the demo classifier's class accuracy on its samples).

    python benchmarks/resolution_transfer.py [--pretrain_steps 400] [--finetune_steps 200] [--per_class 20]
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_flow_matching as fm  # noqa: E402
from demo_quality import score_run, train_classifier  # noqa: E402

VARIANTS = {"resample + shift": ("resample", 2.0), "resample": ("resample", 1.0),
            "extend + shift": ("extend", 2.0), "extend": ("extend", 1.0), "scratch": (None, 1.0)}


def val_losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain_steps", type=int, default=400)
    parser.add_argument("--finetune_steps", type=int, default=200)
    parser.add_argument("--per_class", type=int, default=20, help="samples per class for the quality score")
    parser.add_argument("--classifier_steps", type=int, default=600)
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="extra --a.b=v for every run (tiny runs in tests)")
    args, extra = parser.parse_known_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="resolution_transfer_"))
    base = ["--config", str(Path(__file__).resolve().parents[1] / "configs" / "demo.json"), "--log.wandb=off",
            "--data.cache_dir", str(out / "cache"), "--ckpt.every=100000", *args.overrides, *extra]

    low = fm.main(base + ["--run_dir", str(out / "pretrain_8px"), "--data.resolution=8",
                          f"--train.max_steps={args.pretrain_steps}", f"--val.every={args.pretrain_steps}"])
    classifier, accuracy = train_classifier(steps=args.classifier_steps, resolution=16)
    print(f"classifier accuracy on real 16 px images: {accuracy:.3f}")
    results = {}
    for name, (pos_embed, shift) in VARIANTS.items():
        run = out / name.replace(" + ", "_").replace(" ", "_")
        ft = base + ["--data.resolution=16", f"--objective.time_shift={shift}",
                     f"--train.max_steps={args.finetune_steps}",
                     f"--val.every={args.finetune_steps}", "--run_dir", str(run)]
        ft += ["--init_from", str(low), f"--model.pos_embed_transfer={pos_embed}"] if pos_embed else []
        fm.main(ft)
        results[name] = {"val_loss": val_losses(run)[-1], **score_run(run, classifier, per_class=args.per_class)}
        print(f"{name}: {results[name]}")
    (out / "resolution_transfer.json").write_text(json.dumps(results, indent=1))

    print(f"\npre-trained {args.pretrain_steps} steps at 8 px, fine-tuned {args.finetune_steps} steps at 16 px "
          f"({args.per_class} samples per class); runs in {out}")
    print(f"{'variant':18s} {'val loss':>9s} {'class acc':>9s} {'colour':>7s} {'shape':>7s}")
    for name, r in results.items():
        print(f"{name:18s} {r['val_loss']:9.4f} {r['class_accuracy']:9.3f} {r['colour_accuracy']:7.3f} "
              f"{r['shape_accuracy']:7.3f}")
    return results


if __name__ == "__main__":
    main()
