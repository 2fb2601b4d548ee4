"""Batches: the cache's rows in a resumable order, the loader, and a training micro-batch's inputs, its
conditions dropped for guidance.

    cache (CachedDataset: rows, each image's views) -> iterate_batches (a pure function of the micro-batch
      count, for exact resume) -> training_inputs (a micro-batch's x0 and conditions)

Condition dropout (drop_conditions) is applied when the cache is read, never baked into it.
"""
import math

import numpy as np
import torch

from common import ignore_stop_signals
from training.data.encoders import text_features

# ----------------------------------------------------------------------------------------------------------
# Batches: the cache's rows in a resumable order, the loader, and a training micro-batch's inputs.


def views_of(data, part):
    """Rows cached per image: data.cache_views crops, each both ways with data.random_flip, for the training
    split (so flips and crops stay augmentations under the cache); one for the held-out rows."""
    return data.cache_views * (2 if data.random_flip else 1) if part == "train" else 1


def images_in(dataset):
    """Training images, not cached rows: a cache of V views per image (data.cache_views, x 2 with flips) holds V
    rows of each; what epochs, parameters per image and the largest micro-batch are counted in."""
    return len(dataset) // getattr(dataset, "views", 1)


def iterate_batches(dataset, start, batch_size, seed, rank, world, loader_kwargs):
    """Micro-batches forever, starting at micro-batch `start`; `dataset[list of rows]` is one micro-batch
    (CachedDataset). Epoch e visits a permutation seeded by seed + e, split across ranks; so the data position
    is a pure function of the micro-batch count and a resumed run continues exactly where it stopped, with
    nothing seen twice or skipped. A cache of V views per image (`dataset.views`, data.cache_views: an image's
    views are V consecutive rows) shows image i in epoch e its view (o_i + e) mod V, o_i drawn once from the
    seed: one view per image per epoch, every view of every image within V epochs. A bucket cache (its rows'
    `dataset.buckets`) gives micro-batches of one bucket each: bucket_order."""
    views = getattr(dataset, "views", 1)
    images = len(dataset) // views
    buckets = getattr(dataset, "buckets", None)  # each row's bucket (a bucket cache), else None
    if buckets is None:
        per_epoch = images // world // batch_size
    else:
        per_epoch = len(bucket_order(buckets[::views], batch_size * world, seed, 0))
    if images < batch_size * world:
        raise ValueError(f"the dataset has {images} samples, fewer than train.batch_size ({batch_size})"
                         f" x {world} processes")
    offsets = torch.randint(views, (images,), generator=torch.Generator().manual_seed(seed)) if views > 1 else None
    epoch, offset = divmod(start, per_epoch)
    while True:
        if buckets is None:
            perm = torch.randperm(images, generator=torch.Generator().manual_seed(seed + epoch))
            mine = perm[rank::world][:per_epoch * batch_size]
        else:  # rank r takes its slice of each global micro-batch
            mine = torch.stack(bucket_order(buckets[::views], batch_size * world, seed, epoch))
            mine = mine[:, rank * batch_size:(rank + 1) * batch_size].flatten()
        if views > 1:
            mine = mine * views + (offsets[mine] + epoch) % views
        mine = mine.tolist()
        # Whole micro-batches: the dataset reads a list of rows at once (CachedDataset: one gather per tensor),
        # so the loader neither reads row by row nor collates (batch_size=None).
        rows = torch.utils.data.BatchSampler(mine[offset * batch_size:], batch_size, drop_last=True)
        # Its own generator: a DataLoader otherwise draws its worker seed from the global RNG, which would
        # make the training noise depend on when the loader was created (and break exact resume).
        yield from torch.utils.data.DataLoader(dataset, batch_size=None, sampler=rows,
                                               generator=torch.Generator().manual_seed(seed + epoch), **loader_kwargs)
        epoch, offset = epoch + 1, 0


def bucket_order(buckets, size, seed, epoch):
    """Epoch `epoch`'s global micro-batches of a bucket cache: [tensor of `size` image indices], each from one
    bucket. Each bucket's images in their own permutation (seeded by seed, epoch and the bucket), cut into
    micro-batches; its last one, when short, is filled with the first images of the same permutation (seen twice
    in this epoch: every image is seen at least once an epoch, and nothing is dropped); then the micro-batches of
    all buckets in a permutation seeded by seed and epoch. A pure function of its arguments: exact resume."""
    chunks = []
    for b in buckets.unique().tolist():
        members = torch.nonzero(buckets == b).flatten()
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch, b]).generate_state(1)[0]))
        perm = members[torch.randperm(len(members), generator=gen)]
        perm = perm.repeat(-(-size // len(perm)) + 1)[:-(-len(members) // size) * size]  # the short one filled
        chunks += list(perm.view(-1, size))
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(int(
        np.random.SeedSequence([seed, epoch]).generate_state(1)[0])))
    return [chunks[i] for i in order.tolist()]


def same_bucket(dataset, rows, batch_size):
    """`rows` in batches of at most batch_size that each hold one bucket (a bucket cache: each bucket's rows in
    their order, bucket after bucket), else consecutive batches of `rows` as they are."""
    buckets = getattr(dataset, "buckets", None)
    rows = list(rows)
    groups = [rows] if buckets is None else [[r for r in rows if buckets[r] == b] for b in
                                             sorted(set(buckets[rows].tolist()))]
    return [group[i:i + batch_size] for group in groups for i in range(0, len(group), batch_size)]


def probe_rows(dataset, n):
    """n rows for a memory probe (training/run/fit.py): the rows of the bucket with the most values a row (its
    worst case), repeated when it has fewer; any rows of a cache without buckets."""
    buckets = getattr(dataset, "buckets", None)
    if buckets is None:
        return [i % len(dataset) for i in range(n)]
    sizes = {b: math.prod(dataset.shapes[b]) for b in buckets.unique().tolist()}
    members = torch.nonzero(buckets == max(sizes, key=sizes.get)).flatten().tolist()
    return [members[i % len(members)] for i in range(n)]


def drop_conditions(batch_size, rate, device, generator=None):
    """Bernoulli(rate) mask of samples whose condition is replaced by the null one (CFG training,
    Ho & Salimans 2022). Applied when the cache is read, never baked into it."""
    return torch.rand(batch_size, device=device, generator=generator) < rate


def loader_options(data, device):
    """DataLoader settings: workers (which leave stop signals to the trainer), pinned memory on CUDA."""
    kwargs = dict(num_workers=data.num_workers, pin_memory=device.type == "cuda", worker_init_fn=ignore_stop_signals)
    if data.num_workers > 0:
        kwargs["prefetch_factor"] = data.prefetch_factor
    return kwargs


# ----------------------------------------------------------------------------------------------------------
# A micro-batch's conditions: what the conditioner reads, dropped for guidance in training.

# what the conditioner reads
COND_FIELDS = ("label", "text_tokens", "text_mask", "text_pooled", "orig_hw", "crop_box", "flip")


def conditions_of(batch, device):
    """The condition fields of a batch, on the device, with no condition dropped."""
    cond = {k: v.to(device) for k, v in batch.items() if k in COND_FIELDS}
    cond["drop"] = torch.zeros(len(next(iter(batch.values()))), dtype=torch.bool, device=device)
    return cond


def training_inputs(batch, text_encoder, conditioning, accelerator):
    """(batch, x0, cond) of a training micro-batch: its text features (data.cache_text=false: encoded here, at the
    run's precision), x0 (a latent cache holds the posterior's mean and std: a fresh draw mean + std n each time)
    and its conditions, the semantic and the control ones dropped independently for guidance on each."""
    device = accelerator.device
    with accelerator.autocast():
        batch = text_features(batch, text_encoder)
    x0 = batch["x"] + batch["x_std"] * torch.randn_like(batch["x"]) if "x_std" in batch else batch["x"]
    cond = {k: v for k, v in batch.items() if k in COND_FIELDS}
    cond["drop"] = drop_conditions(len(x0), conditioning.semantic_dropout, device)
    cond["drop_controls"] = drop_conditions(len(x0), conditioning.control_dropout, device)
    return batch, x0, cond
