"""The evaluation classifier of a class-conditional recipe: a small ResNet (transformers' ResNetForImageClassification,
so it saves and loads with save_pretrained / from_pretrained like any hub model) trained on the recipe's training
split alone. eval_fid.py --classifier uses it twice (docs/evaluation.md):

  * class accuracy: the share of samples of class c that it labels c (sample i is asked for class i % K), printed
    beside its own accuracy on the real test images, which bounds what a perfect generator could score;
  * features (--features classifier): its pooled last-stage features (128 numbers) for a Frechet distance, KID,
    precision and recall where clean-fid's Inception file cannot be had (no network), named fd_classifier_*,
    never FID, since only Inception's numbers compare with published ones.

It is trained by tools/classifier.py. 28 px images are upsampled 2x before the network (its stem downsamples 4x:
at 28 px the first stage would see 7 x 7 pixels).
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from training.data.encoders import quiet_transformers
from training.evaluation.reference import bucket_rows, reference_images

RECORD = "classifier.json"  # beside the weights: what it was trained on and its test accuracy


def build(num_classes, names=None):
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1],
                          layer_type="basic", num_labels=num_classes,
                          id2label={i: n for i, n in enumerate(names)} if names else None)
    return ResNetForImageClassification(config)


def to_input(images, device="cpu"):
    """uint8 (N, H, W, 3) images (a list or an array) -> the network's input: [-1, 1], 3 x 2H x 2W."""
    x = torch.from_numpy(np.stack(list(images))).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1
    return torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


@torch.no_grad()
def logits_and_features(model, images, device="cpu"):
    out = model(to_input(images, device), output_hidden_states=True)
    return out.logits, out.hidden_states[-1].mean((2, 3))  # the pooled last stage, as the head sees it


def train(model, images, labels, epochs=3, batch_size=256, lr=2e-3, seed=0, log=print):
    """AdamW with a cosine decay over `epochs` passes of uint8 images (N, H, W, 3) and int labels (N,). A set
    smaller than a batch is one batch a pass (a folder of 60 images: 3 steps)."""
    batch_size = min(batch_size, len(images))
    g, per_epoch = torch.Generator().manual_seed(seed), len(images) // batch_size
    steps = epochs * per_epoch
    log(f"classifier: {steps} steps of {batch_size} images ({epochs} epochs of {len(images)} images)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    labels = torch.as_tensor(labels).long()
    model.train()
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(len(images), generator=g)
        idx = order[(step % per_epoch) * batch_size:][:batch_size]
        loss = torch.nn.functional.cross_entropy(model(to_input(images[idx.numpy()])).logits, labels[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"classifier: step {step + 1}/{steps}, loss {loss.item():.4f}")
    return model.eval()


@torch.no_grad()
def accuracy(model, images, labels, batch_size=500):
    hits = sum((logits_and_features(model, images[i:i + batch_size])[0].argmax(1) == torch.as_tensor(
        labels[i:i + batch_size]).long()).sum().item() for i in range(0, len(images), batch_size))
    return hits / len(images)


def class_hits(model, images, indices, num_classes, device="cpu", side=None):
    """1.0 where the classifier labels sample i with the class it was asked for, i % num_classes, else 0.0.
    Non-square images (a run with data.buckets) are read as window_logits does."""
    return hits(model, images, [i % num_classes for i in indices], device, side)


def hits(model, images, labels, device="cpu", side=None):
    """1.0 where the classifier labels image k (uint8 (H, W, 3), one shape) labels[k], else 0.0; non-square images
    through window_logits (`side`: the classifier's training resolution)."""
    labels = torch.as_tensor(labels).long()
    if images[0].shape[0] != images[0].shape[1]:
        return (window_logits(model, images, side, device).argmax(1).cpu() == labels).double().numpy()
    return (logits_and_features(model, images, device)[0].argmax(1).cpu() == labels).double().numpy()


def reference_accuracy(model, key, cfg, device="cpu", side=None, batch_size=256):
    """{"images", "accuracy"} of the classifier on the real reference images of `key` (reference.reference_key: a
    dataset's split; a bucket run's, that bucket's images cropped to it, as eval_fid.py scores them), against their
    labels (data.label_column), read as the samples of that shape are (hits): beside the samples' class accuracy at a
    bucket, the bound a perfect generator could reach there, which the test accuracy on squares is not. None where
    the reference has no labels (a folder, an .npz, a split without the column)."""
    right = reference_hits(model, key, cfg, cfg["data"].get("label_column"), device, side, batch_size)
    return None if right is None else {"images": len(right), "accuracy": float(right.mean())}


def reference_hits(model, key, cfg, column, device="cpu", side=None, batch_size=256):
    """1.0 where the classifier labels reference image k (reference_images' order) with its row's `column`, else
    0.0; None where the reference has no such labels (a folder, an .npz, a split without the column, no images)."""
    if key.get("kind") != "dataset" or not column:
        return None
    rows, items = bucket_rows(key, cfg), reference_images(key, cfg)
    if column not in rows.column_names or not len(items):
        return None
    labels, right = rows[column][:len(items)], []
    for start in range(0, len(items), batch_size):
        chunk = range(start, min(start + batch_size, len(items)))
        right.append(hits(model, [items[i]() for i in chunk], [labels[i] for i in chunk], device, side))
    return np.concatenate(right)


@torch.no_grad()
def window_logits(model, images, side=None, device="cpu"):
    """The logits of non-square uint8 images (N, H, W, 3) of one shape, for a classifier trained on squares: each
    image's square windows of its short side, every 1/16 of it along the long side (every pixel below 32 px; and one
    at the end), each resized to `side` (the classifier's training resolution; None: as they are); an image's logits
    are those of its most confident window, where the object it shows is whole and centred if anywhere. (On the
    wide garments of benchmarks/buckets.py, 40 x 20: 0.68 of real images right this way, 0.61 at a quarter's
    stride, 0.50 averaging the windows, 0.26 padded to a square.)"""
    x = torch.from_numpy(np.stack(list(images))).to(device).permute(0, 3, 1, 2).float()
    short, long = min(x.shape[-2:]), max(x.shape[-2:])
    starts = sorted({*range(0, long - short + 1, max(1, short // 16)), long - short})
    windows = [x[..., s:s + short, :] if x.shape[-2] > x.shape[-1] else x[..., s:s + short] for s in starts]
    best, logits = None, None
    for w in windows:
        if side and side != short:
            w = torch.nn.functional.interpolate(w, size=(side, side), mode="bilinear", align_corners=False,
                                                antialias=True)
        out = model(to_input(w.round().clamp(0, 255).byte().permute(0, 2, 3, 1).cpu().numpy(), device)).logits
        confidence = out.softmax(1).max(1).values
        take = confidence > best if best is not None else torch.ones_like(confidence, dtype=torch.bool)
        best = torch.where(take, confidence, best) if best is not None else confidence
        logits = torch.where(take[:, None], out, logits) if logits is not None else out
    return logits


def load(path, device="cpu"):
    """(model in eval mode, its record: source, splits, test accuracy). A folder without the record was not
    made by tools/classifier.py: its test accuracy would be unknown, so it is refused."""
    from transformers import ResNetForImageClassification

    if not (Path(path) / RECORD).is_file():
        raise FileNotFoundError(f"--classifier {path}: no {RECORD} there; train one with `python tools/classifier.py "
                                f"--config YOUR_RECIPE --out {path}`")
    with quiet_transformers(warnings=False):  # no bar of its weights in a log file
        model = ResNetForImageClassification.from_pretrained(path).to(device).eval()
    return model, json.loads((Path(path) / RECORD).read_text())


def feature_fn(model, device="cpu"):
    """eval_fid.py's feature_fn: list of uint8 (H, W, 3) -> float64 (N, 128). Named for the reference cache by a
    digest of its weights, so a classifier retrained in place never reads the statistics of the one before."""
    def features(images):
        return logits_and_features(model, images, device)[1].double().cpu().numpy()
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    features.name, features.tag = f"classifier@{digest.hexdigest()[:16]}", "classifier"
    return features
