"""What sample i is, the same in eval_fid.py, sample.py, tools/rate.py and the exported pipeline's tests: its
noise seed (seed_for), its condition (make_condition: class i % num_classes or prompt i, load_prompts), its control
metadata (make_controls) and its shape in model space (noise_shape). Each depends on i alone, never on the
process count or the batch that i falls in.
"""
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from training.config import config
from training.data.buckets import default_shape, largest_side, rows_in
from training.data.encoders import encode_text, load_encoders
from training.data.sources import preprocess
from training.evaluation.reference import heldout


def seed_for(*path):
    """A 63-bit seed per (base seed, stream, index) from numpy's SeedSequence: streams never overlap."""
    return int(np.random.SeedSequence(list(path)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def load_prompts(prompts, cfg):
    """Captions for a text model: a file (one caption per line) or 'heldout' (the held-out rows' captions)."""
    if prompts in (None, "heldout"):
        return list(heldout(config.Config(cfg["data"]))[cfg["data"]["caption_column"]])
    return [line.strip() for line in Path(prompts).read_text().splitlines() if line.strip()]


def make_controls(cfg, policy, shape=None):
    """controls(i) -> the size/crop/flip metadata of sample i, for runs trained with controls (else None),
    made by preprocess itself (centre crop, no flip) from an original size: held-out row i % n's
    ('heldout': the distribution the reference comes from; only the image header is read) or R x R. `shape`
    (width, height; a run with buckets): the held-out rows of that bucket, each cropped to it, or ('square') an
    uncropped original of that shape."""
    if not cfg["conditioning"]["controls"]:
        return None
    data = config.Config({**cfg["data"], "crop": "center", "random_flip": False})
    rows = heldout(data) if policy == "heldout" else None
    if rows is not None and shape is not None:  # that bucket's held-out rows (none: an uncropped original of it)
        picked = rows_in(rows, data.image_column, data.bucket_shapes, shape)
        rows = rows.select(picked) if picked else None

    def controls(i):
        size = shape or (data.resolution, data.resolution)
        if rows is not None:
            value = rows[i % len(rows)][data.image_column]
            size = Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]).size
        return preprocess(Image.new("RGB", size), 8, data, shape=shape)[1]  # the metadata, not the pixels
    return controls


def make_condition(cfg, model, prompts, device, controls=None):
    """cond(indices) -> the conditions of those samples: class i % num_classes (balanced over classes), or
    prompt i % len(prompts) encoded by the run's own text encoder; plus controls(i) when the run has them."""
    text = None
    if prompts is not None:
        text = load_encoders(config.Config({**cfg["encoders"], "vae": None}), device)[1:]

    def cond(idx):
        out = {"drop": torch.zeros(len(idx), dtype=torch.bool, device=device)}
        if text is None:
            out["label"] = torch.tensor(idx, device=device) % model.conditioner.num_classes
        else:
            captions = [prompts[i % len(prompts)] for i in idx]
            out.update(encode_text(*text, captions, cfg["encoders"]["max_tokens"]))
        if controls is not None:
            meta = [controls(i) for i in idx]
            out.update({k: torch.stack([m[k] for m in meta]).to(device) for k in meta[0]})
        return out
    return cond


def noise_shape(cfg, transformer, shape=None):
    """(channels, height, width) in model space of samples `shape` (width, height) pixels (None: a square run's
    data.resolution, a bucket run's squarest bucket). Each side must be a whole number of patches at the VAE's factor
    and fit the positional grid: else one ConfigError naming the sides that work."""
    tc = transformer.config
    shape = shape or (default_shape(cfg) if cfg["data"].get("bucket_shapes") else None)
    if shape is None:
        return tc.in_channels, tc.sample_size, tc.sample_size
    scale, multiple = largest_side(cfg) // tc.sample_size, largest_side(cfg) // tc.sample_size * tc.patch_size
    if any(side % multiple or side > largest_side(cfg) for side in shape):
        raise config.ConfigError(f"{shape[0]}x{shape[1]} px: each side must be a multiple of {multiple} (patch "
                                 f"{tc.patch_size} x the VAE's factor {scale}) and at most {largest_side(cfg)} (the "
                                 f"positional grid)")
    return tc.in_channels, shape[1] // scale, shape[0] // scale
