"""Batches: the cache's rows in a resumable order, the loader, and a training micro-batch's inputs, its
conditions dropped for guidance.

    cache (CachedDataset: rows, each image's views) -> iterate_batches (a pure function of the micro-batch
      count, for exact resume) -> training_inputs (a micro-batch's x0 and conditions)

Condition dropout (drop_conditions) is applied when the cache is read, never baked into it.
"""
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
    seed: one view per image per epoch, every view of every image within V epochs."""
    views = getattr(dataset, "views", 1)
    images = len(dataset) // views
    per_epoch = images // world // batch_size
    if per_epoch == 0:
        raise ValueError(f"the dataset has {images} samples, fewer than train.batch_size ({batch_size})"
                         f" x {world} processes")
    offsets = torch.randint(views, (images,), generator=torch.Generator().manual_seed(seed)) if views > 1 else None
    epoch, offset = divmod(start, per_epoch)
    while True:
        perm = torch.randperm(images, generator=torch.Generator().manual_seed(seed + epoch))
        mine = perm[rank::world][:per_epoch * batch_size]
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

COND_FIELDS = ("label", "text_tokens", "text_mask", "text_pooled", "orig_hw", "crop_box", "flip")  # what the conditioner reads


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
