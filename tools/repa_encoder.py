"""REPA's in-domain encoder for the real-image recipe: a small DINOv2-shaped ViT trained on Fashion-MNIST's training
split alone, and the same network at its initial weights as the control (docs/training.md, "REPA").

    python tools/repa_encoder.py --out encoders/fashion_mnist        # about 5 CPU-minutes on one thread
    python train_flow_matching.py --config configs/fashion_mnist.json --objective.repa_weight=0.5 \\
        --objective.repa_encoder=encoders/fashion_mnist/trained ...   # or .../random: the control

Why: REPA needs a frozen encoder whose tokens mean something for the images trained on; DINOv2's weights cannot
be downloaded on these machines, and at 28 px an ImageNet encoder would see little anyway. This one is trained
here, on the 60,000 training images (never the test split, which the evaluation protocol scores against), as a
classifier of the 10 classes: transformers' Dinov2ForImageClassification, whose head reads the class token and the
mean patch token, so the patch tokens REPA aligns to are trained too. Its patch size 4 makes the recipe's 28 px
exactly its 7 x 7 token grid, the MMDiT's at model.patch_size 4 (another grid: repa_targets.py resizes the image and
DINOv2 interpolates its position embeddings). It is not the evaluation classifier (training/evaluation/classifier.py, a
ResNet): eval_fid.py's FD is computed in that classifier's features, and aligning the model to them would
optimise the metric itself. It does share that classifier's supervision (the same labels), which DINOv2's
self-supervised features do not.

Written to --out:
  trained/  the backbone (Dinov2Model, save_pretrained) and its image processor config (BitImageProcessor) whose
            image_mean and image_std are the training images' own pixel mean and std, the normalisation it was
            trained with; repa_targets.load_encoder reads both through AutoModel / AutoImageProcessor, as for a hub id
  random/   the same config and processor, the weights it started from (the control: only training differs)
  encoder.json  rows trained on and held out, the CPU time, and for both: k-NN and linear-probe accuracy on the
            held-out rows of the training split (features: the mean patch token) and the mean cosine between the
            tokens at one position of two different images (near 1: the targets hardly depend on the image, as
            with the 8 px digits, docs/benchmarks/training_options.md).
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.data import fashion_mnist  # noqa: E402

# The architecture: 4 blocks of width 64 (4 heads), patch 4 at 28 px; 142k parameters, about 90 CPU-s an epoch
# (one thread). Module constants rather than flags: the tests shrink them.
ARCH = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "mlp_ratio": 2, "patch_size": 4,
        "image_size": 28}
HELDOUT = 10_000  # the last rows of the training split: the probes' test set, never trained on
BATCH, LR = 128, 1e-3


def build(num_classes, seed):
    from transformers import Dinov2Config, Dinov2ForImageClassification

    torch.manual_seed(seed)
    config = Dinov2Config(**ARCH, num_channels=3, num_labels=num_classes,
                          id2label=dict(enumerate(fashion_mnist.CLASSES[:num_classes])))
    return Dinov2ForImageClassification(config)


def to_input(images, mean, std):
    """uint8 grey (N, 28, 28) -> what repa_targets.encoder_targets hands the encoder for the same image: RGB in [0, 1]
    (the trainer's pixels (x + 1) / 2), normalised by the processor's mean and std."""
    x = torch.from_numpy(np.asarray(images)).float().div(255).unsqueeze(1).expand(-1, 3, -1, -1)
    return (x - mean) / std


def train(model, images, labels, epochs, mean, std, seed, log=print):
    """AdamW with a one-cycle schedule over `epochs` passes, random horizontal flips."""
    g = torch.Generator().manual_seed(seed)
    per_epoch = max(len(images) // BATCH, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, LR, total_steps=epochs * per_epoch, pct_start=0.1)
    labels = torch.tensor(labels, dtype=torch.long)
    model.train()
    for step in range(epochs * per_epoch):
        if step % per_epoch == 0:
            order = torch.randperm(len(images), generator=g)
        idx = order[(step % per_epoch) * BATCH:][:BATCH]
        x = to_input(images[idx.numpy()], mean, std)
        flip = torch.rand(len(idx), generator=g) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        loss = F.cross_entropy(model(pixel_values=x).logits, labels[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % 100 == 0 or step + 1 == epochs * per_epoch:
            log(f"repa_encoder: step {step + 1}/{epochs * per_epoch}, loss {loss.item():.4f}", flush=True)
    return model.eval()


@torch.no_grad()
def patch_tokens(backbone, images, mean, std, batch=1000):
    """The last layer's patch tokens (N, grid^2, D), the class token left out, as REPA's targets are."""
    out = [backbone(pixel_values=to_input(images[i:i + batch], mean, std)).last_hidden_state[:, 1:]
           for i in range(0, len(images), batch)]
    return torch.cat(out)


def probes(backbone, train_images, train_labels, held_images, held_labels, mean, std):
    """k-NN (k = 20, cosine, majority vote) and linear-probe accuracy on the held-out rows, from the mean patch
    token; and the mean cosine between the same token position of two different held-out images."""
    held_tokens = patch_tokens(backbone, held_images, mean, std)
    held, train = held_tokens.mean(1).double(), patch_tokens(backbone, train_images, mean, std).mean(1).double()
    train_labels, held_labels = (torch.tensor(y, dtype=torch.long) for y in (train_labels, held_labels))
    unit = F.normalize(train, dim=1)
    neighbours = torch.cat([train_labels[(F.normalize(h, dim=1) @ unit.T).topk(min(20, len(train))).indices]
                            for h in held.split(1000)])  # 1,000 rows at a time: 400 MB, not 4 GB, of similarities
    knn = (neighbours.mode(dim=1).values == held_labels).double().mean().item()
    # the linear probe: ridge regression onto the one-hot classes on standardised features (closed form: no
    # iterations to tune, seconds for 50,000 rows), the class with the largest output
    mu, sigma = train.mean(0), train.std(0) + 1e-6
    design = lambda f: F.pad((f - mu) / sigma, (0, 1), value=1.0)  # with a bias column
    a = design(train)
    weights = torch.linalg.solve(a.T @ a + 1e-3 * len(a) * torch.eye(a.shape[1], dtype=a.dtype),
                                 a.T @ F.one_hot(train_labels, int(train_labels.max()) + 1).double())
    linear = ((design(held) @ weights).argmax(1) == held_labels).double().mean().item()
    pairs = held_tokens[:2000]  # image i against image i + 1, position by position
    cosine = F.cosine_similarity(pairs[:-1], pairs[1:], dim=-1).mean().item()
    return {"knn_accuracy": knn, "linear_probe_accuracy": linear, "token_cosine_between_images": cosine}


def save(backbone, folder, mean, std):
    """The backbone and its image processor config: a folder AutoModel and AutoImageProcessor load like a hub id."""
    from transformers import BitImageProcessor

    backbone.save_pretrained(folder)
    side = {"height": ARCH["image_size"], "width": ARCH["image_size"]}
    BitImageProcessor(image_mean=[mean] * 3, image_std=[std] * 3, size=side, crop_size=side, do_center_crop=False,
                      do_convert_rgb=True).save_pretrained(folder)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for trained/, random/ and encoder.json")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="(the evaluation classifier's default is 0)")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs must be at least 1, got {args.epochs}")
    start = time.process_time()
    images, labels = fashion_mnist.split_arrays("train")  # the training split only: the protocol scores on "test"
    if len(images) <= HELDOUT:
        sys.exit(f"tools/repa_encoder.py: the training split has {len(images)} rows, not more than the {HELDOUT} "
                 f"held out for the probes")
    fit_images, fit_labels = images[:-HELDOUT], labels[:-HELDOUT]
    held_images, held_labels = images[-HELDOUT:], labels[-HELDOUT:]
    pixels = fit_images.astype(np.float64) / 255
    mean, std = float(pixels.mean()), float(pixels.std())  # one grey channel, repeated for RGB
    model = build(int(labels.max()) + 1, args.seed)
    initial = copy.deepcopy(model.dinov2).eval()  # the control: where training started
    train(model, fit_images, fit_labels, args.epochs, mean, std, args.seed)
    train_seconds = time.process_time() - start
    record = {"source": fashion_mnist.SOURCE, "split": "train", "trained_rows": len(fit_images),
              "heldout_rows": len(held_images), "architecture": {"model_type": "dinov2", **ARCH},
              "epochs": args.epochs, "seed": args.seed, "pixel_mean": mean, "pixel_std": std,
              "train_cpu_seconds": round(train_seconds, 1)}
    for name, backbone in (("trained", model.dinov2.eval()), ("random", initial)):
        save(backbone, Path(args.out) / name, mean, std)
        record[name] = probes(backbone, fit_images, fit_labels, held_images, held_labels, mean, std)
        print(f"repa_encoder: {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in record[name].items()), flush=True)
    record["cpu_seconds"] = round(time.process_time() - start, 1)
    (Path(args.out) / "encoder.json").write_text(json.dumps(record, indent=1))
    print(f"repa_encoder: {args.out}/trained and {args.out}/random ({record['train_cpu_seconds']:.0f} CPU-s to train, "
          f"{record['cpu_seconds']:.0f} in all); objective.repa_encoder takes either folder")
    return record


if __name__ == "__main__":
    main()
