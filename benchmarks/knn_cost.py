"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/evaluation.md.

What the k-NN part of precision/recall/density/coverage costs: training.metrics.prdc (chunked, float64) on
random features of Inception's width, N real against N fake, at each N; optionally the `prdc` package too.

    python benchmarks/knn_cost.py --n 10000 50000             # ours, each N in a fresh process (clean peak memory)
    python benchmarks/knn_cost.py --n 10000 --package         # and prdc.compute_prdc (3 full N x N matrices)
    python benchmarks/knn_cost.py --n 50000 --device cuda
    python benchmarks/knn_cost.py --n 50000 --chunks 3       # time 3 chunks of each pass, scale to all of them

Prints, per run: wall seconds, CPU seconds of the process (less sensitive to a busy machine than wall time),
peak resident memory, and the four metrics (the two implementations must agree). With --chunks K, only K
chunks of each kind (a k-NN radius chunk, a fake-real chunk) are timed and multiplied by the number of chunks
prdc computes (2 radius passes and 1 fake-real pass): an estimate for a machine too small or too busy for the
whole run; the peak memory is the real one, since every chunk has the same size.
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chunked_estimate(real, fake, chunks, device):
    """Seconds (wall, CPU) of `chunks` radius chunks and fake-real chunks, scaled to a whole prdc call."""
    import torch

    from training.evaluation import metrics

    x, y = (torch.as_tensor(f, dtype=torch.float64, device=device) for f in (real, fake))
    rows = metrics.row_chunks(len(y), len(x), 2 ** 25)
    r = metrics.knn_radii(x[:rows[0].stop * 2])  # a stand-in radius vector of the right kind, for the comparisons
    r = torch.cat([r] * (len(x) // len(r) + 1))[:len(x)]
    times = {}
    for kind in ("radius", "cross"):
        wall, cpu = time.perf_counter(), time.process_time()
        for chunk in rows[:chunks]:
            d = metrics.squared_distances(y[chunk], x)
            if kind == "radius":
                d.topk(metrics.NEAREST_K + 1, dim=1, largest=False)
            else:
                ((d < r[None, :]).sum(1), (d < r[chunk][:, None]).any(0), d.min(0))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times[kind] = ((time.perf_counter() - wall) / chunks, (time.process_time() - cpu) / chunks)
    scale = len(rows)
    return {"chunks": len(rows), "timed_per_kind": chunks,
            "est_wall_s": round(scale * (2 * times["radius"][0] + times["cross"][0]), 1),
            "est_cpu_s": round(scale * (2 * times["radius"][1] + times["cross"][1]), 1)}


def one(n, dim, impl, device, chunks=None):
    import torch

    from training.evaluation import metrics

    # Features on a 32-dimensional manifold (a random linear map) plus noise, so the k-NN balls mean something;
    # the fakes are a wider, shifted copy. The cost depends only on N and D.
    rng = np.random.default_rng(0)
    lift = rng.standard_normal((32, dim)) / np.sqrt(32)
    real = (rng.standard_normal((n, 32)) @ lift + 0.1 * rng.standard_normal((n, dim))).astype(np.float32)  # as cached
    fake = (1.2 * rng.standard_normal((n, 32)) + 0.1) @ lift + 0.1 * rng.standard_normal((n, dim))
    if chunks:
        out = chunked_estimate(real, fake, chunks, device)
        return {"n": n, "dim": dim, "impl": "ours, estimated", "device": device, **out,
                "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}
    wall, cpu = time.perf_counter(), time.process_time()
    if impl == "ours":
        out = metrics.prdc(real, fake, device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    else:
        import prdc

        out = {k: float(v) for k, v in prdc.compute_prdc(real.astype(np.float64), fake, 5).items()}
    return {"n": n, "dim": dim, "impl": impl, "device": device, "threads": torch.get_num_threads(),
            "wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
            **{k: round(v, 5) for k, v in out.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[10_000])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    p.add_argument("--package", action="store_true", help="also time prdc.compute_prdc (needs 3 N^2 x 8 bytes)")
    p.add_argument("--chunks", type=int, default=None, help="time this many chunks of each pass and scale up")
    p.add_argument("--one", nargs=2, metavar=("N", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.dim, args.one[1], args.device, args.chunks)))
        return
    for n in args.n:
        for impl in ["ours"] + (["package"] if args.package else []):
            print(f"N = {n}, {impl} ...", flush=True)
            subprocess.run([sys.executable, __file__, "--one", str(n), impl, "--dim", str(args.dim),
                            "--device", args.device, *(["--chunks", str(args.chunks)] if args.chunks else [])],
                           check=True)


if __name__ == "__main__":
    main()
