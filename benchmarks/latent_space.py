"""Feeds docs/benchmarks/latent_space.md (latent space: an autoencoder made here against pixels).

Issue 59, item 5: configs/fashion_mnist_latent.json (the real-image recipe in the latents of an autoencoder that
tools/autoencoder.py trains on Fashion-MNIST's training split) against configs/fashion_mnist.json (pixels), both
trainers, 3 seeds, at equal training CPU, scored by docs/evaluation.md's protocol (benchmarks/fashion_mnist.py ours:
2,000 samples, --num_samples, against the test split in the evaluation classifier's features) and compared pairwise
by seed (tools/compare.py's paired t-interval), beside the autoencoder's own reconstruction scores (its rFD: the
floor).

    python tools/classifier.py --config configs/fashion_mnist.json --out classifiers/fashion_mnist   # once
    python benchmarks/latent_space.py autoencoder                     # tools/autoencoder.py into OUT/autoencoder
    python benchmarks/latent_space.py run --trainer ddpm --seed 0      # one latent run, trained and scored
    python benchmarks/fashion_mnist.py ours --trainer ddpm --seed 0 --num_samples 2000 --fractions  # its pixel peer
    python benchmarks/latent_space.py compare --pixel runs/fashion_mnist_bench

The training CPU of a run is its steps' own (fashion_mnist.step_cpu: the trainer's cpu_s_per_step); the two recipes
have the same token count (49) and model, so equal steps are equal CPU unless `compare` measures otherwise (it
prints both). The autoencoder's CPU is counted apart, from its autoencoder.json: its training (once), the encoding
of the cache (every training and held-out image, once per cache) and the decoding of every sample scored.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import fashion_mnist  # noqa: E402
from training.evaluation.metrics import size_tag  # noqa: E402

RECIPE = ROOT / "configs" / "fashion_mnist_latent.json"
TRAINERS = ("flow_matching", "ddpm")
METRICS = ("fd_classifier", "kd_classifier", "precision_classifier", "recall_classifier", "class_accuracy")


def autoencoder(args):
    """tools/autoencoder.py with its defaults on the latent recipe, into OUT/autoencoder (skipped once there)."""
    from tools import autoencoder as tool

    folder = Path(args.out) / "autoencoder"
    if not (folder / "autoencoder.json").is_file():
        tool.main(["--config", str(RECIPE), "--out", str(folder), "--classifier", args.classifier,
                   "--stats_cache", str(Path(args.out) / "fid_stats"), *args.extra])
    return folder


def run(args):
    """One seed of the latent recipe in OUT/autoencoder's latents, trained and scored at --num_samples (2,000)."""
    folder = Path(args.out) / "autoencoder"
    if not (folder / "autoencoder.json").is_file():
        sys.exit(f"{folder}: no autoencoder yet: `python benchmarks/latent_space.py autoencoder --out {args.out}`")
    cache = Path(args.out) / "cache" / f"{args.trainer}_s{args.seed}"  # its own: two queued runs never build one cache
    fashion_mnist.ours(argparse.Namespace(
        trainer=args.trainer, recipe=str(RECIPE), seed=args.seed, out=args.out, classifier=args.classifier,
        num_samples=args.num_samples, curve_samples=args.num_samples, fractions=[],
        eval_args=["--stats_cache", str(Path(args.out) / "fid_stats")],
        extra=[f"--encoders.vae={folder}", f"--data.cache_dir={cache}", *args.extra]))


def final_scores(run):
    rows = [json.loads(line) for line in (run / "quality.jsonl").read_text().splitlines()]
    return max(rows, key=lambda r: r["step"])


def compare(args):
    """Per trainer: each metric's mean [95% t-interval] over the seeds in pixels and in latents, the paired
    difference latent - pixel (tools/compare.py's statistic), the training steps' CPU of each; then the
    autoencoder's scores and costs. Markdown on stdout, for docs/benchmarks/latent_space.md."""
    from tools.compare import ci_text, paired_comparison, t_interval

    record = json.loads((Path(args.out) / "autoencoder" / "autoencoder.json").read_text())
    metrics = [f"{m}_{size_tag(args.num_samples)}" for m in METRICS]  # as scored: fd_classifier_2k ...
    for trainer in TRAINERS:
        runs = {space: [Path(folder) / f"{trainer}_s{s}" for s in args.seeds]
                for space, folder in (("pixels", args.pixel), ("latents", args.out))}
        if missing := [str(r) for rs in runs.values() for r in rs if not (r / "quality.jsonl").is_file()]:
            print(f"{trainer}: not yet scored: {', '.join(missing)}\n")
            continue
        scores = {space: [final_scores(r) for r in rs] for space, rs in runs.items()}
        print(f"| {trainer}, {len(args.seeds)} seeds, {args.num_samples:,} samples | " + " | ".join(metrics)
              + " | CPU s per step |")
        print("| --- |" + " --- |" * (len(metrics) + 1))
        for space in runs:  # mean [95% t-interval] (each seed's value)
            cells = [[s[m] for s in scores[space]] for m in metrics] + [[fashion_mnist.step_cpu(r)
                                                                          for r in runs[space]]]
            print(f"| {space} | " + " | ".join(f"{ci_text(*t_interval(v))} ({', '.join(f'{x:.3f}' for x in v)})"
                                               for v in cells) + " |")
        diffs = [paired_comparison([s[m] for s in scores["latents"]], [s[m] for s in scores["pixels"]],
                                   m.startswith(("precision", "recall", "class"))) for m in metrics]
        settled = ["**" * (d["low"] > 0 or d["high"] < 0) for d in diffs]  # the interval clear of zero
        print("| latents - pixels, paired by seed | " + " | ".join(
            f"{b}{ci_text(d['mean'], d['low'], d['high'])}{b}" for d, b in zip(diffs, settled)) + " | |\n")
    test, real, cpu = record["test"], record["real"], record["cpu_seconds"]
    images = record["train_rows"]
    # the tool scores its reconstructions and the real images at 2,000 (tools/autoencoder.py's SCORED), or at the
    # whole test split where it is smaller: the keys of "real" name that count
    scored = [m for m in real if m.rsplit("_", 1)[0] in METRICS]
    print(f"autoencoder: {record['parameters']:,} parameters, {record['channels']} -> {record['latent_shape']}; "
          f"test reconstructions: PSNR {test['psnr']:.2f} dB, " + ", ".join(f"{m} {test[m]:.4f}" for m in scored)
          + "; real test images: " + ", ".join(f"{m} {real[m]:.4f}" for m in scored))
    print(f"autoencoder CPU s: training {cpu['train']:.0f} (once), calibration {cpu['calibrate']:.0f}; encoding the "
          f"cache's {images:,} images {cpu['encode_per_image'] * images:.0f} (once per cache); decoding "
          f"{args.num_samples:,} samples {cpu['decode_per_image'] * args.num_samples:.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["autoencoder", "run", "compare"])
    p.add_argument("--trainer", default="flow_matching", choices=TRAINERS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default="0,1,2", help="compare: the seeds paired")
    p.add_argument("--out", default="runs/latent_space")
    p.add_argument("--pixel", default="runs/fashion_mnist_bench", help="compare: the pixel runs' folder "
                   "(benchmarks/fashion_mnist.py ours --out), TRAINER_sSEED in it")
    p.add_argument("--classifier", default="classifiers/fashion_mnist")
    p.add_argument("--num_samples", type=int, default=2000, help="run: samples scored per run; compare: the count "
                   "they were scored at")
    args, args.extra = p.parse_known_args(argv)  # the rest: to tools/autoencoder.py, or to the trainer
    args.seeds = [int(s) for s in args.seeds.split(",")]
    {"autoencoder": autoencoder, "run": run, "compare": compare}[args.what](args)


if __name__ == "__main__":
    main()
