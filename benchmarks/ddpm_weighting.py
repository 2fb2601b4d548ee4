"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/methods.md.

Which Min-SNR form should DDPM train with? Measured on real images that ship inside scikit-learn.

The 1,797 handwritten digits of sklearn.datasets.load_digits (8 x 8 grey scans of 43 writers, 10 classes; the
UCI optdigits test set): 300 of them held out as the reference, the rest written as an image folder that
train_ddpm.py trains on, once per objective.min_snr_form (the same seed, data order and noise). Each run's EMA
export then draws N samples (balanced classes, guidance 1, 50 DDIM steps, the same noise for every run),
scored against the held-out digits:

  * FD: the Frechet distance (FID's formula) in the hidden layer of an MLP classifier trained on the training
    digits (Inception's weights cannot be downloaded here, and a 8 x 8 digit is not ImageNet), and in pixels;
  * class share: the share of samples the same classifier assigns to the requested class.

    python benchmarks/ddpm_weighting.py --steps 600 --samples 1000 --out /tmp/weighting
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
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def digits(folder, held_out=300, seed=0):
    """Writes the training digits as an image folder (metadata.jsonl with labels); returns the held-out ones
    as (grey pixels in [0, 1], labels) and the training ones likewise."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.round(d.images / 16 * 255).astype(np.uint8)  # 0..16 -> 0..255, the PNGs the trainer reads
    order = np.random.default_rng(seed).permutation(len(images))
    test, train = order[:held_out], order[held_out:]
    out = Path(folder) / "train"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metadata.jsonl", "w") as f:
        for i in train:
            Image.fromarray(images[i]).convert("RGB").save(out / f"{i:04d}.png")
            f.write(json.dumps({"file_name": f"{i:04d}.png", "label": int(d.target[i])}) + "\n")
    flat = images.reshape(len(images), -1) / 255.0
    return (flat[test], d.target[test]), (flat[train], d.target[train])


def frechet(a, b):
    from scipy import linalg

    mu_a, mu_b, ca, cb = a.mean(0), b.mean(0), np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(ca @ cb).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(ca + cb - 2 * covmean))


def train(form, data, out, steps, extra):
    run = Path(out) / f"ddpm_{form}"
    args = [sys.executable, str(ROOT / "train_ddpm.py"), f"--data.source={data}", "--data.resolution=8",
            "--data.num_classes=10", "--data.val_holdout=64", f"--data.cache_dir={Path(out) / 'cache'}",
            f"--run_dir={run}", f"--train.max_steps={steps}", "--train.batch_size=64", "--val.every=100000",
            "--val.num_samples=10", "--ckpt.every=100000", "--log.wandb=off", "--log.report=false",
            "--log.every=50", "--log.grad_every=0", f"--objective.min_snr_form={form}", *extra]
    t0 = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return run, time.perf_counter() - t0


@torch.no_grad()
def samples(run, n, seed=0):
    """n samples of the run's EMA export, classes 0..9 in turn, guidance 1, 50 DDIM steps, fixed noise;
    as grey pixels in [0, 1] quantised like a saved PNG, with their requested labels."""
    import train_ddpm
    from training.model.mmdit import load_exported

    model, cfg = load_exported(Path(run) / "export")
    labels = torch.arange(n) % 10
    noise = torch.randn((n, 3, 8, 8), generator=torch.Generator().manual_seed(seed))
    out = []
    for i in range(0, n, 250):
        cond = {"label": labels[i:i + 250], "drop": torch.zeros(len(labels[i:i + 250]), dtype=torch.bool)}
        x = train_ddpm.generate(model, noise[i:i + 250], cond, cfg, steps=50, guidance_scale=1.0, sampler="ddim")
        out.append(x.clamp(-1, 1).add(1).mul(127.5).round().mean(1).flatten(1) / 255)
    return torch.cat(out).numpy(), labels.numpy()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", default="paper,plus_one,floor")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--out", default="runs/ddpm_weighting")
    parser.add_argument("--seeds", default="0", help="training seeds, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="model.num_layers (the demo's: 4)")
    parser.add_argument("--head_dim", type=int, default=32, help="model.attention_head_dim (the demo's: 32; 4 heads)")
    args = parser.parse_args(argv)
    from sklearn.neural_network import MLPClassifier

    (x_ref, y_ref), (x_train, y_train) = digits(Path(args.out) / "digits")
    clf = MLPClassifier(hidden_layer_sizes=(128,), max_iter=1000, random_state=0).fit(x_train, y_train)
    features = lambda x: np.maximum(x @ clf.coefs_[0] + clf.intercepts_[0], 0)  # the hidden layer (ReLU)
    print(f"classifier accuracy on the 300 held-out real digits: {clf.score(x_ref, y_ref):.3f}; "
          f"FD of the training digits to them: {frechet(features(x_train), features(x_ref)):.2f} (features), "
          f"{frechet(x_train, x_ref):.3f} (pixels)")
    rows = []
    for seed in map(int, args.seeds.split(",")):
        for form in args.forms.split(","):
            run, seconds = train(form, Path(args.out) / "digits", Path(args.out) / f"seed{seed}", args.steps,
                                 [f"--seed={seed}", f"--model.num_layers={args.layers}",
                                  f"--model.attention_head_dim={args.head_dim}"])
            x, y = samples(run, args.samples)
            rows.append({"form": form, "seed": seed, "fd_features": frechet(features(x), features(x_ref)),
                         "fd_pixels": frechet(x, x_ref), "class_share": float((clf.predict(x) == y).mean()),
                         "train_seconds": round(seconds)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.steps} steps at batch 64, {args.layers} layers of width {4 * args.head_dim}, {args.samples} "
          f"samples, guidance 1, 50 DDIM steps, seeds {args.seeds}")
    print(f"{'form':10s} {'FD (features)':>14s} {'FD (pixels)':>12s} {'class share':>12s}")
    for form in args.forms.split(","):
        mine = [r for r in rows if r["form"] == form]
        mean = lambda k: sum(r[k] for r in mine) / len(mine)
        print(f"{form:10s} {mean('fd_features'):14.2f} {mean('fd_pixels'):12.3f} {mean('class_share'):12.3f}")
    return rows


if __name__ == "__main__":
    main()
