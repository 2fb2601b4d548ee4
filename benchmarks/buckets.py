"""Feeds docs/benchmarks/buckets.md (aspect-ratio buckets: garments on wide and tall canvases).

Fashion-MNIST garments placed on wide (56 x 28) and tall (28 x 56) black canvases at a random place along the long
side, a third of the images each, the last third the square originals (issue 60, item 6); the flow-matching recipe
(configs/fashion_mnist.json) trained on them with aspect-ratio buckets (data.buckets=[0.5,1,2]: 20x40, 28x28, 40x20
at the recipe's 28 px and patch 4) against the same data cropped square (data.crop=center, the default), at equal
steps, which is equal CPU here (each bucket holds 49 or 50 tokens; `cost` prints both arms' CPU per step); 3 seeds.
Scored per shape by docs/evaluation.md's protocol for non-square samples: eval_fid.py --width --height against the
test images of that bucket (the square arm, which draws squares only: against the square originals, the same
images as the bucket arm's 28x28 reference), FD in the evaluation classifier's features, class accuracy (a non-square
sample read through its square windows: classifier.window_logits), and the share of samples whose garment the border
cuts (cut_share, below); the real test images' class accuracy and cut share at each shape are the bounds (`reals`).

    python benchmarks/buckets.py data --out runs/buckets                    # the canvases: parquet, train and test
    python benchmarks/buckets.py run --arm buckets --seed 0 --out runs/buckets --classifier classifiers/fashion_mnist
    python benchmarks/buckets.py run --arm square --seed 0 --out runs/buckets --classifier classifiers/fashion_mnist
    python benchmarks/buckets.py reals --out runs/buckets --classifier classifiers/fashion_mnist
    python benchmarks/buckets.py layout --out runs/buckets                  # the cache layout: bytes, build, reads
    python benchmarks/buckets.py table --out runs/buckets                   # mean and 95% interval over the seeds

Every other argument goes to the trainer. Each step is skipped when its result is in --out, so a stopped campaign
resumes; each run's scores are in RUN/scores.json, its CPU in RUN/cpu_seconds.json (benchmarks/fashion_mnist.py's).
"""
import argparse
import io
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval_fid  # noqa: E402
from benchmarks.fashion_mnist import RECIPE, add_cpu, cpu_seconds, step_cpu  # noqa: E402
from tools.compare import paired_comparison, t_interval  # noqa: E402
from training.data import buckets, fashion_mnist  # noqa: E402
from training.data.sources import preprocess  # noqa: E402
from training.evaluation import classifier  # noqa: E402
from training.evaluation.sampling import read_png  # noqa: E402

BUCKETS = [0.5, 1, 2]
SHAPES = {"buckets": [(28, 28), (40, 20), (20, 40)], "square": [(28, 28)]}  # (width, height) each arm samples
INK = 0.2  # a border line is touched where its brightest pixel is above this (0 .. 1; the canvas is 0)
LAYOUT_READS = 200  # layout: micro-batches read in the training order, timed


def canvases(split, seed):
    """(uint8 images, labels, kinds) of a Fashion-MNIST split: image i is kind i's draw (square, wide or tall, a third
    each, seeded), the garment at a uniform place along the long side of a black 56 x 28 or 28 x 56 canvas."""
    images, labels = fashion_mnist.split_arrays(split)
    rng = np.random.default_rng(seed)
    kinds, offsets, out = rng.integers(0, 3, len(images)), rng.integers(0, 29, len(images)), []
    for img, kind, at in zip(images, kinds, offsets):
        canvas = np.zeros((28, 56) if kind == 1 else (56, 28) if kind == 2 else (28, 28), np.uint8)
        if kind == 1:
            canvas[:, at:at + 28] = img
        elif kind == 2:
            canvas[at:at + 28] = img
        else:
            canvas = img
        out.append(canvas)
    return out, labels, np.array(["square", "wide", "tall"])[kinds]


def data(args):
    """OUT/data/{train, test, test_square}/{split}.parquet: the canvases (grey, stored as PNG with ClassLabel
    labels), and the square originals of the test split alone (the square arm's reference). Each file is named by
    its split, as a parquet source is split by file name (sources.parquet_files)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=fashion_mnist.CLASSES)})
    for split, seed in (("train", 0), ("test", 1)):
        images, labels, kinds = canvases(split, seed)
        parts = {split: np.arange(len(images))}
        if split == "test":
            parts["test_square"] = np.flatnonzero(kinds == "square")
        for name, rows in parts.items():
            path = Path(args.out) / "data" / name / f"{split}.parquet"
            if path.is_file():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_dict({"image": [images[i] for i in rows], "label": labels[rows].tolist()},
                                       features=features).to_parquet(str(path))
            print(f"{path}: {len(rows)} images, " + ", ".join(f"{k} {int((kinds[rows] == k).sum())}"
                                                              for k in ("square", "wide", "tall")))


def cut_share(images):
    """The share of uint8 images (N, H, W, 3) whose garment the border cuts: ink (> INK) on exactly one of the
    left and right border columns, or on exactly one of the top and bottom rows. A whole garment touches both or
    neither (Fashion-MNIST centres each garment, its long side spanning the frame); one cut by a crop touches the
    side it was cut at. The real images' share at each shape (`reals`) is the floor a generator is read against."""
    grey = np.stack(list(images)).astype(np.float32).mean(-1) / 255
    left, right = grey[:, :, 0].max(1) > INK, grey[:, :, -1].max(1) > INK
    top, bottom = grey[:, 0].max(1) > INK, grey[:, -1].max(1) > INK
    return float(((left ^ right) | (top ^ bottom)).mean())


def score_args(args):
    return ["--num_samples", str(args.num_samples), "--classifier", args.classifier, "--features", "classifier",
            "--batch_size", "250", "--stats_cache", str(Path(args.out) / "fid_stats"), "--untuned",
            "--reference_split", "test"]


def run(args):
    """Train one arm and seed (skipped when its export exists), then sample and score it at each of its shapes."""
    out = Path(args.out)
    run_dir = out / f"{args.arm}_s{args.seed}"
    if not (run_dir / "export").is_dir():
        before = cpu_seconds(resource.RUSAGE_CHILDREN)
        arm = [f"--data.buckets={json.dumps(BUCKETS)}"] if args.arm == "buckets" else []
        try:
            subprocess.run([sys.executable, str(ROOT / "train_flow_matching.py"), "--config", str(RECIPE),
                            f"--seed={args.seed}", f"--run_dir={run_dir}", "--log.wandb=off", "--resume=latest",
                            f"--data.source={out / 'data' / 'train'}",
                            f"--data.cache_dir={out / 'cache' / run_dir.name}", *arm,
                            *args.extra], check=True)
        finally:
            record = add_cpu(run_dir, cpu_seconds(resource.RUSAGE_CHILDREN) - before)
        record["steps"] = step_cpu(run_dir) * json.loads((run_dir / "config.json").read_text())["train"]["max_steps"]
        (run_dir / "cpu_seconds.json").write_text(json.dumps(record))
    scores = {}
    for w, h in SHAPES[args.arm]:
        folder = run_dir / "eval" / f"test-{w}x{h}"
        if not (folder / "report.json").is_file():
            where = ["--width", str(w), "--height", str(h), "--reference", str(out / "data" / "test")] \
                if args.arm == "buckets" else ["--reference", str(out / "data" / "test_square")]
            eval_fid.main(["--run", str(run_dir), "--out_dir", str(folder), *score_args(args), *where])
        report = json.loads((folder / "report.json").read_text())
        images = [read_png(folder / "samples", i) for i in range(report["num_samples"])]
        scores[f"{w}x{h}"] = {**{k.rsplit("_", 1)[0]: v for k, v in report["metrics"].items()},
                              "cut_share": cut_share(images)}
        print(f"{run_dir.name} {w}x{h}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores[f"{w}x{h}"].items()))
    (run_dir / "scores.json").write_text(json.dumps({"scores": scores, "cpu_s_per_step": step_cpu(run_dir)}, indent=1))


def reals(args):
    """The real test images at each shape, as each arm sees them: class accuracy (the same reading as the samples',
    with their true labels) and cut share; the bucket arm's shapes (each bucket's images cropped to it), the square
    originals, and the square arm's training view (every canvas cropped to its centre square)."""
    import datasets

    judge, record = classifier.load(args.classifier)
    ds = datasets.load_dataset("parquet", data_files={"test": str(Path(args.out) / "data" / "test" / "*.parquet")},
                               split="test").cast_column("image", datasets.Image(decode=False))
    shapes = buckets.shapes_for(BUCKETS, 28, 4)
    views = {f"{w}x{h}": (buckets.rows_in(ds, "image", shapes, (w, h)), (w, h)) for w, h in shapes}
    views["square crops"] = (list(range(len(ds))), None)
    center = argparse.Namespace(crop="center", random_flip=False)
    out = {}
    for name, (rows, shape) in views.items():
        images, labels = [], []
        for i in rows:
            row = ds[i]
            x, _ = preprocess(Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB"), 28, center,
                              shape=shape)
            images.append(((x + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())
            labels.append(row["label"])
        hits = []
        for first in range(0, len(images), 500):
            batch = images[first:first + 500]
            logits = classifier.window_logits(judge, batch, record["resolution"]) if batch[0].shape[0] != \
                batch[0].shape[1] else classifier.logits_and_features(judge, batch)[0]
            hits += (logits.argmax(1).numpy() == np.array(labels[first:first + 500])).tolist()
        out[name] = {"images": len(images), "class_accuracy": float(np.mean(hits)), "cut_share": cut_share(images)}
        print(f"real test images, {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in out[name].items()))
    (Path(args.out) / "reals.json").write_text(json.dumps(out, indent=1))


def layout(args):
    """The cache layout, measured (issue 60, item 2): the same canvases (the first --layout_images training rows) cached
    square and with buckets (each bucket's rows as tensors of their own in each shard file): bytes on disk per image,
    the time to read their sizes (the start-up pass) and to build each, and micro-batches of the recipe's
    train.batch_size (128; other arguments override the recipe's keys) read per second in the training order
    (iterate_batches); beside them, what padding every image to the largest bucket would store."""
    import datasets
    from accelerate import Accelerator

    import train_flow_matching as fm
    from training.config import config
    from training.data.batching import iterate_batches
    from training.data.cache import build_cache
    from training.data.cache_shards import CachedDataset

    ds = datasets.load_dataset("parquet", data_files={"train": str(Path(args.out) / "data" / "train" / "*.parquet")},
                               split="train").select(range(args.layout_images)).cast_column(
                                   "image", datasets.Image(decode=False))
    accelerator, rows = Accelerator(cpu=True), {}
    for name, extra in (("square", []), ("buckets", [f"--data.buckets={json.dumps(BUCKETS)}"])):
        cfg = config.load_config(fm.DEFAULTS, ["--config", str(RECIPE), *extra, "--data.cache_dir",
                                               str(Path(args.out) / "layout"), "--data.num_classes=10",
                                               f"--data.source={Path(args.out) / 'data' / 'train'}", *args.extra])
        started = time.perf_counter()
        buckets.resolve(cfg, ds, accelerator)
        sized = time.perf_counter() - started
        folder = build_cache(ds, "train", lambda pixels, captions: {"x": pixels}, accelerator, cfg)
        built = time.perf_counter() - started - sized
        cached, disk = CachedDataset(folder), sum(f.stat().st_size for f in folder.glob("shard_*.safetensors"))
        batches = iterate_batches(cached, 0, cfg.train.batch_size, 0, 0, 1, {})
        next(batches)  # every shard mapped once before the clock
        started = time.perf_counter()
        for _ in range(LAYOUT_READS):
            next(batches)
        rows[name] = {"bytes_per_image": disk / len(cached), "sizes_s": sized, "build_s": built,
                      "micro_batches_per_s": LAYOUT_READS / (time.perf_counter() - started)}
    rows["padded to the largest bucket"] = {"bytes_per_image": rows["square"]["bytes_per_image"] * 40 * 40 / (28 * 28)}
    for name, row in rows.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
    (Path(args.out) / "layout.json").write_text(json.dumps(rows, indent=1))


def table(args):
    """Markdown rows: per shape and score, each arm's mean and 95% interval over its seeds, the paired difference
    over the seeds both arms have where both sample that shape (the seeds named; a seed one arm lacks is said, not
    paired with another seed), and the real images' value."""
    out = Path(args.out)
    runs = {arm: dict(sorted((int(p.parent.name.rsplit("_s", 1)[1]), json.loads(p.read_text()))
                             for p in out.glob(f"{arm}_s*/scores.json"))) for arm in SHAPES}  # {seed: scores}
    real = json.loads((out / "reals.json").read_text()) if (out / "reals.json").is_file() else {}

    def cell(values):
        mean, low, high = t_interval(values)
        return f"{mean:.3f} [{low:.3f}, {high:.3f}]" if len(values) > 1 else f"{mean:.3f}"

    print("| shape | score | buckets | square crops | buckets - square (paired by seed) | real test images |")
    print("| --- | --- | --- | --- | --- | --- |")
    for w, h in SHAPES["buckets"]:
        shape = f"{w}x{h}"
        for key, better in (("fd_classifier", False), ("class_accuracy", True), ("cut_share", False)):
            a, b = ({seed: r["scores"][shape][key] for seed, r in runs[arm].items() if shape in r["scores"]}
                    for arm in ("buckets", "square"))
            seeds, diff = sorted(set(a) & set(b)), ""
            if len(seeds) > 1:
                d = paired_comparison([a[s] for s in seeds], [b[s] for s in seeds], better)
                diff = f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] (seeds {','.join(map(str, seeds))})"
            bound = f"{real[shape][key]:.3f}" if key in real.get(shape, {}) else ""
            print(f"| {shape} | {key} | {cell(list(a.values())) if a else ''} | "
                  f"{cell(list(b.values())) if b else 'cannot draw it'} | {diff} | {bound} |")
    unpaired = [f"{arm} seed(s) {','.join(map(str, sorted(set(runs[arm]) - set(runs[other]))))}"
                for arm, other in (("buckets", "square"), ("square", "buckets")) if set(runs[arm]) - set(runs[other])]
    if unpaired:
        print("unpaired (in the arm's own column, not in the paired difference): " + "; ".join(unpaired))
    for arm, rows in runs.items():
        if rows:
            print(f"{arm}: {len(rows)} seeds ({','.join(map(str, rows))}), CPU s per step "
                  f"{cell([r['cpu_s_per_step'] for r in rows.values()])}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["data", "run", "reals", "layout", "table"])
    p.add_argument("--arm", default="buckets", choices=list(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/buckets")
    p.add_argument("--classifier", default="classifiers/fashion_mnist")
    p.add_argument("--num_samples", type=int, default=2_000, help="samples per shape (the recent campaigns' 2,000)")
    p.add_argument("--layout_images", type=int, default=20_000, help="layout: training rows cached each way")
    args, args.extra = p.parse_known_args(argv)
    started = time.time()
    {"data": data, "run": run, "reals": reals, "layout": layout, "table": table}[args.what](args)
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
