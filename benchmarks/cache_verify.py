"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/tests.md.

What does verifying the cache at start-up cost? Time per shard and MB/s of cache_shards.shard_damage with
data.verify_cache on (checksum of every tensor and a finite check) and off (headers only), on a synthetic
shard shaped like an ImageNet 256 px latent shard (1024 rows of 4 x 32 x 32 posterior mean and std, float16,
with the control metadata and labels). The start-up check reads the cache once, split over the processes:
time ~ cache size / (processes x MB/s).

    python benchmarks/cache_verify.py [--rows 1024] [--side 32] [--repeats 5]
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.data.cache_shards import shard_damage, tensors_sha256  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--side", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n, s = args.rows, args.side
    tensors = {"x": torch.randn(n, 4, s, s).half(), "x_std": torch.rand(n, 4, s, s).half(),
               "label": torch.randint(0, 1000, (n,)), "orig_hw": torch.randint(64, 1024, (n, 2)),
               "crop_box": torch.randint(0, 512, (n, 4)), "flip": torch.zeros(n, 1, dtype=torch.long)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard_00000.safetensors"
        save_file(tensors, str(path), metadata={"rows": str(n), "skipped": "[]", "sha256": tensors_sha256(tensors)})
        mb = path.stat().st_size / 2**20
        for verify in (True, False):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                assert shard_damage(path, verify) is None
                times.append(time.perf_counter() - t0)
            best = min(times)
            print(f"verify_cache={verify}: shard of {n} rows, {mb:.1f} MB: {best * 1000:.1f} ms (best of "
                  f"{args.repeats}), {mb / best:.0f} MB/s")


if __name__ == "__main__":
    main()
