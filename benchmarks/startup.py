"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/performance.md.

What does a start with a warm cache cost, at scale? (docs/performance.md, "Start-up with a warm cache")

    python benchmarks/startup.py [--files 100000] [--cache_gb 2] [--shard_size 4096] [--dir /big/disk]

Builds a synthetic local source (an image folder of `--files` tiny PNGs in 100 class folders, as ImageNet's
layout is) and a cache of about `--cache_gb` GB for it (the real cache build: each image decoded and cropped,
a stand-in encoder that emits `--cache_gb` worth of float16 per row), then times what every start of a run
does before its first step, each part on its own, in wall and CPU seconds (the faster of two tries; one try
for the open, which is unchanged), with the file system's caches warm, as on a requeued node (a network file
system is slower per metadata call):

  1. open: `sources.open_splits` on the warm `datasets` cache (datasets lists and stats the files itself)
  2. the source fingerprint: the former one (path, size and modification time of every file, reproduced
     here) against `cache.source_fingerprint` now
  3. the cache check of the training split: the former one (every shard's contents verified at every start,
     `shard_damage(verify=True)` on each) against `cache.build_cache` now (headers; contents only of shards
     changed since verified), and with data.verify_cache=false
  4. a changed source: one image rewritten in place (its modification time moved on): the cache key differs

Bigger: --files 1000000 --cache_gb 50 (about 60 GB of disk under --dir; the cold build is the long part).
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.config import config  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from training.data import cache, cache_shards  # noqa: E402
from training.data.sources import open_splits  # noqa: E402


class OneProcess:
    process_index, num_processes, is_main_process, is_local_main_process = 0, 1, True, True
    device = torch.device("cpu")

    def print(self, *args):
        pass

    def wait_for_everyone(self):
        pass


def make_source(root, files):
    """`files` PNGs of 8 x 8 px in 100 class folders (all the same bytes: their number is what counts)."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 60, 30)).save(buf, "PNG")
    png = buf.getvalue()
    for i in range(files):
        folder = root / f"class_{i % 100:03d}"
        if i < 100:
            folder.mkdir(parents=True)
        (folder / f"{i:07d}.png").write_bytes(png)


def best_of(fn, repeats=2):
    """(wall seconds, CPU seconds of this process, result) of the faster of `repeats` calls."""
    best, out = None, None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        took = (time.perf_counter() - t0, time.process_time() - c0)
        best = took if best is None or took[0] < best[0] else best
    return (*best, out)


def former_fingerprint(root):
    """The fingerprint a local folder had before: a stat of every file (a million metadata calls for ImageNet-22k
    as a folder, at every start, on every rank)."""
    digest, total = hashlib.sha256(), 0
    files = sorted(p for p in Path(root).rglob("*") if p.is_file())
    for path in files:
        stat = path.stat()
        total += stat.st_size
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"files": len(files), "bytes": total, "sha256": digest.hexdigest()[:16]}


def former_check(folder):
    """The cache check a start did before with data.verify_cache=true: every shard's contents verified."""
    manifest = json.loads((folder / "manifest.json").read_text())
    return [cache_shards.shard_damage(folder / name, True, manifest["sha256"][name]) for name in manifest["shards"]]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--cache_gb", type=float, default=2.0)
    p.add_argument("--shard_size", type=int, default=4096, help="rows per cache shard (the recipes' 4096)")
    p.add_argument("--dir", default=None, help="where to write source and cache (default: a temporary folder)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(dir=args.dir, prefix="startup_"))
    try:
        source, t0 = tmp / "images", time.perf_counter()
        make_source(source, args.files)
        print(f"source: {args.files} files in {source} ({time.perf_counter() - t0:.0f} s to write)", flush=True)
        os.environ.setdefault("HF_DATASETS_CACHE", str(tmp / "hf_datasets"))
        argv = [f"--data.source={source}", f"--data.cache_dir={tmp / 'cache'}", "--data.resolution=8",
                "--data.min_image_side=8", f"--data.shard_size={args.shard_size}", "--data.encode_batch_size=256"]
        cfg = config.load_config(fm.DEFAULTS, argv)
        t0 = time.perf_counter()
        train, val = open_splits(cfg.data, log=lambda *a: None)
        print(f"open (cold: datasets builds its Arrow table): {time.perf_counter() - t0:.1f} s", flush=True)
        per_row = max(1, int(args.cache_gb * 1e9 / len(train) / 2))  # float16 values per row

        def encode(pixels, captions):  # stands in for the VAE: cache_gb of float16, drawn fresh per batch
            return {"x": torch.randn(len(pixels), per_row, dtype=torch.float16)}

        t0 = time.perf_counter()
        folder = cache.build_cache(train, "train", encode, OneProcess(), cfg)
        size = sum(f.stat().st_size for f in folder.glob("shard_*.safetensors"))
        print(f"cache build (cold): {len(train)} rows, {size / 1e9:.2f} GB in {folder.name}: "
              f"{time.perf_counter() - t0:.1f} s", flush=True)

        rows = []
        wall, cpu, (train, val) = best_of(lambda: open_splits(cfg.data, log=lambda *a: None), repeats=1)
        rows.append(("open_splits (datasets lists and stats the files itself)", (wall, cpu), (wall, cpu)))
        before = best_of(lambda: former_fingerprint(source))[:2]
        rows.append(("source fingerprint", before, best_of(lambda: cache.source_fingerprint(cfg.data, train))[:2]))
        before = best_of(lambda: former_check(folder))[:2]
        wall, cpu, again = best_of(lambda: cache.build_cache(train, "train", encode, OneProcess(), cfg))
        assert again == folder, "a warm start must be a hit"
        rows.append(("cache check, data.verify_cache=true", before, (wall, cpu)))
        cfg.data.verify_cache = False
        after = best_of(lambda: cache.build_cache(train, "train", encode, OneProcess(), cfg))[:2]
        rows.append(("cache check, data.verify_cache=false (headers only)", after, after))
        cfg.data.verify_cache = True
        print(f"\nwarm start, {args.files} files, {size / 1e9:.2f} GB cache in {len(list(folder.glob('shard_*')))} "
              f"shards, 1 process; seconds, wall / CPU (load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores):")
        print("| part | before | now |\n|---|---|---|")
        for name, (w0, c0), (w1, c1) in rows:
            print(f"| {name} | {w0:.2f} / {c0:.2f} | {w1:.2f} / {c1:.2f} |")
        total = [sum(r[i][j] for r in rows[:3]) for i in (1, 2) for j in (0, 1)]
        print(f"| **data stage of a warm start** | **{total[0]:.1f} / {total[1]:.1f}** | "
              f"**{total[2]:.1f} / {total[3]:.1f}** |")

        key = cache.cache_key(cfg, "train", train, len(train))
        edited = next((source / "class_003").iterdir())
        Image.new("RGB", (8, 8), (255, 255, 255)).save(edited)
        stat = edited.stat()
        os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse-mtime file system
        train, _ = open_splits(cfg.data, log=lambda *a: None)
        changed = cache.cache_key(cfg, "train", train, len(train))
        print(f"\none image rewritten in place: cache key changed: {changed != key} "
              f"({'a miss, as it must be' if changed != key else 'NOT A MISS'})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
