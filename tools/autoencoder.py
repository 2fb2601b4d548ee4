"""Train the autoencoder of a recipe's latent space (training/data/latents.py): a diffusers AutoencoderKL trained on
the recipe's training split alone, its scaling and shift factors calibrated on those images and written in its
config, saved with save_pretrained, so that encoders.vae=FOLDER loads it as it loads a hub VAE. Its reconstruction
quality on the test split is recorded beside it (autoencoder.json): no model in its latents can beat it.

    python tools/autoencoder.py --config configs/fashion_mnist_latent.json --out autoencoders/fashion_mnist \\
        --classifier classifiers/fashion_mnist       # 15 min of one thread; without --classifier: PSNR alone
    python train_flow_matching.py --config configs/fashion_mnist_latent.json   # its encoders.vae is that folder

The splits are tools/classifier.py's (sources.training_and_test): every row of the training split (data.split,
held-out rows included: none is a test image); a --test_split that is the training split is refused; a source
whose test split reads its training images is measured on the rows the trainer holds out (test split "heldout").

autoencoder.json: the settings; "factors" (scaling_factor = 1 / std and shift_factor = the mean of the training
latents, the posterior's draws); "test": the reconstructions of the test images through the trainers' own encode
and decode (posterior mean, scaled, shifted and back; uint8 as every sample), their PSNR and, with --classifier,
the real-image protocol's scores against the whole test split (docs/evaluation.md): rFD (fd_classifier), KD,
precision, recall and class accuracy at 2,000 images (the campaigns' sample count) and at all of them; "real": the
same scores of as many real training images (drawn at random, seed --seed; never test images) against the same
test split, the protocol's own floor at that count; "warnings": why the rFD is no floor, when the test split has
no more images than the classifier has feature dimensions (then its covariances are singular and the rFD is mostly
the estimator's bias; said before any training); "cpu_seconds": training, and per image the encoder's (a latent
run's cache) and the decoder's (each sample).

Further --section.key=value arguments override the recipe, as the trainers' do. Only its data section is read
(config.tool_config: not the encoders), so a text-to-image recipe serves too, even one that names the folder this
makes; its classes are a column of its rows: `--data.label_column=label` (configs/emoji.json: the category).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_flow_matching  # noqa: E402
from training.config import config  # noqa: E402
from training.data import latents  # noqa: E402
from training.data.sources import training_and_test  # noqa: E402
from training.data.encoders import decode, make_encode  # noqa: E402
from training.evaluation import classifier  # noqa: E402
from training.evaluation.metrics import all_scores, size_tag  # noqa: E402
from training.evaluation.reference import reference_args, reference_for, split_images, to_uint8  # noqa: E402

SCORED = 2000  # the campaigns' samples per run (docs/benchmarks.md): rFD at the count its latent runs are scored at


def channels_arg(text):
    widths = [int(w) for w in text.split(",")] if all(w.strip().isdigit() for w in text.split(",")) else []
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"--channels={text!r}: widths per level, comma-separated (e.g. 32,64,64)")
    return widths


@torch.no_grad()
def reconstruct(vae, images, batch_size=500):
    """(uint8 reconstructions of uint8 `images` through make_encode and decode, the trainers' own path: the
    posterior mean in model space and back to pixels; the encoder's and the decoder's CPU seconds per image)."""
    encode, out, seconds = make_encode(vae.eval(), None, None, 0), [], np.zeros(2)
    for i in range(0, len(images), batch_size):
        t0 = time.process_time()
        x = encode(latents.to_pixels(images[i:i + batch_size]), None)["x"]
        t1 = time.process_time()
        out.append(to_uint8(decode(vae, x)))
        seconds += [t1 - t0, time.process_time() - t1]
    return np.concatenate(out), (seconds / len(images)).tolist()


def psnr(a, b):
    """Mean over images of 10 log10(255^2 / MSE) of uint8 images (N, H, W, 3)."""
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(1)
    return float(np.mean(10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10))))


def scores(images, labels, judge, cfg, args):
    """The protocol's scores of uint8 `images` against the whole test split in the classifier's features, with
    the classifier's accuracy on them (their true `labels`)."""
    feature_fn = classifier.feature_fn(judge)
    feats = np.concatenate([feature_fn(list(images[i:i + 500])) for i in range(0, len(images), 500)])
    reference = reference_args(["--reference_split", args.test_split, "--stats_cache", args.stats_cache])
    from accelerate import Accelerator

    ref = reference_for(reference, cfg, feature_fn, Accelerator(cpu=True))[1]
    return {**all_scores(feats, ref, "clean", len(images), "classifier"),
            f"class_accuracy_{size_tag(len(images))}": classifier.accuracy(judge, images, labels)}


def floor_warning(n_test, dim, split):
    """Why an rFD on n_test test images in the classifier's `dim` feature dimensions is no floor, or None: with no
    more images than dimensions the covariances are singular (metrics.fid_size_warning's rule), the Frechet distance
    mostly the estimator's bias, and so is the real images' row."""
    if n_test > dim:
        return None
    return (f"rFD is no floor here: it rests on {n_test} '{split}' images in the classifier's {dim} feature "
            f"dimensions, so its covariances are singular and it is mostly the estimator's bias (the real images' "
            f"row alike); PSNR and KD (unbiased at any size) still hold. For an rFD that is a floor, measure on a "
            f"test split of more than {dim} images (--test_split)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the recipe (its data section names the source and resolution)")
    p.add_argument("--out", required=True, help="folder for the autoencoder (save_pretrained) and autoencoder.json")
    p.add_argument("--test_split", default="test", help="the split its reconstructions are measured on (never "
                   "trained on)")
    p.add_argument("--classifier", default=None, help="a folder from tools/classifier.py: rFD and the protocol's "
                   "scores")
    p.add_argument("--stats_cache", default="cache/fid_stats", help="eval_fid.py's cached reference statistics")
    p.add_argument("--channels", type=channels_arg, default=[16, 32], help="width per level; each level but the "
                   "last halves the side (16,32: 28 px -> 14 x 14; docs/benchmarks/latent_space.md chose it)")
    p.add_argument("--latent_channels", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500, help="AdamW steps of --batch_size images")
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--kl_weight", type=float, default=1e-6, help="on the KL's sum over an image's latents (LDM's)")
    p.add_argument("--seed", type=int, default=0)
    args, overrides = p.parse_known_args(argv)
    cfg = config.tool_config(train_flow_matching, ["--config", args.config, *overrides])  # its data section
    data, factor = cfg.data, 2 ** (len(args.channels) - 1)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if data.resolution % factor:
        sys.exit(f"tools/autoencoder.py: data.resolution={data.resolution} is not divisible by the downsampling "
                 f"factor {factor} of --channels {args.channels}")
    judge = classifier.load(args.classifier) if args.classifier else None  # a wrong folder fails before any work
    train_ds, test_ds, args.test_split = training_and_test(data, args.test_split, "tools/autoencoder.py")
    images, labels, _ = split_images(data, train_ds, data.split)
    test_images, test_labels, _ = split_images(data, test_ds, args.test_split)
    first = min(SCORED, len(test_images))
    warnings = []
    if judge is not None:  # said before the training, which a user may then spare
        dim = classifier.feature_fn(judge[0])([test_images[0]]).shape[1]
        warnings = [w for w in [floor_warning(len(test_images), dim, args.test_split)] if w]
        for w in warnings:
            print(f"tools/autoencoder.py: warning: {w}")

    # ---- Train on the training images, then calibrate the factors on them --------------------------------------
    vae = latents.build(data.resolution, args.channels, args.latent_channels, args.seed)
    n_params = sum(p.numel() for p in vae.parameters())
    print(f"autoencoder: {n_params / 1e6:.2f}M parameters, {data.resolution} px -> {args.latent_channels} x "
          f"{data.resolution // factor} x {data.resolution // factor}; {args.steps} steps of {args.batch_size} of "
          f"{len(images)} training images")
    cpu = time.process_time()
    loss = latents.train(vae, images, args.steps, args.batch_size, args.lr, args.kl_weight, args.seed)
    cpu, train_cpu = time.process_time(), time.process_time() - cpu
    mu, sigma = latents.calibrate(vae, images)
    calibrate_cpu = time.process_time() - cpu
    print(f"autoencoder: training latents have mean {mu:.4f} and std {sigma:.4f}: scaling_factor "
          f"{vae.config.scaling_factor:.6g}, shift_factor {vae.config.shift_factor:.6g}")

    # ---- Reconstruction quality on the test split: the floor of every latent run -----------------------------
    rebuilt, (encode_cpu, decode_cpu) = reconstruct(vae, test_images)
    test = {"rows": len(test_images), "psnr": psnr(rebuilt, test_images)}
    real = None
    if judge is not None:
        test.update(scores(rebuilt[:first], test_labels[:first], judge[0], cfg, args))
        test.update(scores(rebuilt, test_labels, judge[0], cfg, args) if first < len(test_images) else {})
        # The floor of real images: as many training images (never a test image) against the same test split. The
        # test images themselves would score against themselves (0 when they are the whole split).
        drawn = np.sort(np.random.default_rng(args.seed).permutation(len(images))[:first])
        real = {"rows": len(drawn), "split": data.split, **scores(images[drawn], labels[drawn], judge[0], cfg, args)}
    record = {"source": data.source, "resolution": data.resolution, "train_split": data.split,
              "train_rows": len(images), "test_split": args.test_split, "channels": args.channels,
              "latent_channels": args.latent_channels, "latent_shape": [args.latent_channels, data.resolution //
                                                                          factor, data.resolution // factor],
              "parameters": n_params, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
              "kl_weight": args.kl_weight, "seed": args.seed, "final_loss": loss,
              "factors": {"scaling_factor": vae.config.scaling_factor, "shift_factor": vae.config.shift_factor,
                          "latent_mean": mu, "latent_std": sigma},
              "test": test, "real": real, "warnings": warnings,
              "classifier": None if judge is None else {"path": args.classifier, **judge[1]},
              "cpu_seconds": {"train": train_cpu, "calibrate": calibrate_cpu, "encode_per_image": encode_cpu,
                              "decode_per_image": decode_cpu},
              "command": " ".join(["tools/autoencoder.py", *(sys.argv[1:] if argv is None else argv)])}
    vae.save_pretrained(args.out)
    (Path(args.out) / latents.RECORD).write_text(json.dumps(record, indent=1))
    rfd = test.get(f"fd_classifier_{size_tag(first)}")
    floor = "" if real is None else f" (real training images: {real['fd_classifier_' + size_tag(real['rows'])]:.3f})"
    print(f"autoencoder in {args.out}: PSNR {test['psnr']:.2f} dB on {len(test_images)} '{args.test_split}' images"
          + (f", rFD {rfd:.3f} at {first}{floor}" if rfd is not None else "; rFD: give --classifier")
          + f"; {train_cpu / 60:.1f} CPU min to train" + "".join(f"\nwarning: {w}" for w in warnings))
    return Path(args.out)


if __name__ == "__main__":
    try:
        main()
    except config.ConfigError as e:
        sys.exit(f"tools/autoencoder.py: {e}")
