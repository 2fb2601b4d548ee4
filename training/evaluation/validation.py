"""What both trainers' validation does around the method's own sampler and loss: its fixed inputs (the grid's
conditions and noise; the held-out batches with their noise), the sample grid split over the ranks (with its
network evaluations counted), the held-out loss on a fixed time grid, and the row and line that report them.
Every rank calls each; the results are a one-process run's. What each cell shows (a class name or a prompt) is
chosen with the data, when the cache stage encodes the prompts: data/classes.py, validation_prompts."""
import math

import torch

import common
from training.data.batching import conditions_of, same_bucket

# ----------------------------------------------------------------------------------------------------------
# Fixed inputs: the grid's conditions and noise, and the held-out batches.


def validation_inputs(val_set, num_samples, num_classes, x_shape, seed, device, text=None):
    """Fixed conditions and noise for the validation grid: classes in order (0, 1, 2, ...) for class runs,
    the encoded validation prompts `text` (encode_text of validation_prompts) for text runs; controls (size,
    crop, flip) from the held-out rows, cycled. A bucket cache (data.buckets) gives a few buckets' grids, lists of
    (noise, conditions) one a bucket: grid_buckets."""
    if getattr(val_set, "buckets", None) is not None:
        return bucket_inputs(val_set, num_samples, num_classes, seed, device, text)
    rows = [val_set[i % len(val_set)] for i in range(num_samples)]
    n = num_samples
    cond = conditions_of({k: torch.stack([r[k] for r in rows]) for k in rows[0]}, device)
    if "label" in cond:
        cond["label"] = torch.arange(n, device=device) % num_classes
    if text is not None:
        cond.update({k: v.to(device) for k, v in text.items()})
    noise = torch.randn((n, *x_shape), generator=torch.Generator().manual_seed(seed)).to(device)
    return noise, cond


def grid_buckets(val_set):
    """The buckets the validation grid shows, by index: the squarest, the widest and the tallest that hold
    held-out rows (fewer when they coincide)."""
    present = sorted(set(val_set.buckets.tolist()))
    ratios = {b: math.log(val_set.shapes[b][0] / val_set.shapes[b][1]) for b in present}
    return list(dict.fromkeys([min(present, key=lambda b: abs(ratios[b])), max(present, key=ratios.get),
                               min(present, key=ratios.get)]))


def bucket_inputs(val_set, num_samples, num_classes, seed, device, text=None):
    """validation_inputs of a bucket cache: ([noise], [conditions]), one of each per grid_buckets, num_samples cells
    in all, split as evenly as they go (the first buckets one more; a bucket left with none is not shown): each
    bucket's cells are the grid's first cells (classes 0, 1, 2, ... or the first prompts), with the controls of that
    bucket's held-out rows, cycled."""
    shown = grid_buckets(val_set)
    cells = [num_samples // len(shown) + (k < num_samples % len(shown)) for k in range(len(shown))]
    noises, conds = [], []
    for k, (b, per) in enumerate(zip(shown, cells)):
        if not per:
            continue
        members = torch.nonzero(val_set.buckets == b).flatten().tolist()
        batch = val_set[[members[i % len(members)] for i in range(per)]]
        cond = conditions_of(batch, device)
        if "label" in cond:
            cond["label"] = torch.arange(per, device=device) % num_classes
        if text is not None:
            cond.update({key: v[:per].to(device) for key, v in text.items()})
        noises.append(torch.randn(batch["x"].shape, generator=torch.Generator().manual_seed(seed + k)).to(device))
        conds.append(cond)
    return noises, conds


def heldout_batches(val_set, num_samples, batch_size, seed, device):
    """(x0, noise, cond) batches of the first `num_samples` held-out rows with fixed latents draws and noise,
    so the validation loss of two checkpoints differs only by the model. A bucket cache's in batches of one
    bucket each (batching.same_bucket)."""
    gen, n = torch.Generator().manual_seed(seed), min(num_samples, len(val_set))
    for group in same_bucket(val_set, range(n), batch_size):
        rows = [val_set[j] for j in group]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        x0 = (batch["x"] + batch["x_std"] * torch.randn(batch["x"].shape, generator=gen) if "x_std" in batch
              else batch["x"])
        noise = torch.randn(x0.shape, generator=gen)
        yield x0.to(device), noise.to(device), conditions_of(batch, device)


# ----------------------------------------------------------------------------------------------------------
# The grid and the held-out loss.



def sample_grid(generate, ema, noise, cond, cfg, accelerator):
    """(samples, network evaluations per sample): the grid of fixed noise and conditions sampled as the run is
    configured (`generate`, the trainer's), at the run's precision; each rank samples its share and the grid is
    gathered. The main process counts its own share's evaluations (fewer with a guidance interval). A bucket
    run's grids (lists, bucket_inputs): a list of samples, one tensor a bucket, and the mean evaluations."""
    if isinstance(noise, list):
        done = [sample_grid(generate, ema, n, c, cfg, accelerator) for n, c in zip(noise, cond)]
        return [x for x, _ in done], sum(nfe for _, nfe in done) / len(done)
    with accelerator.autocast(), common.counting_evaluations(ema) as evals:
        x = common.split_over_ranks(lambda rows: generate(ema, noise[rows], {k: v[rows] for k, v in cond.items()}, cfg),
                                    len(noise), accelerator)
    share = common.share_of(len(noise), accelerator, rank=0)  # the main process logs its own count
    return x, evals[0] / (share.stop - share.start)


def heldout_loss(val_set, cfg, accelerator, loss_in_bin):
    """The validation loss per time bin (a CPU tensor): every held-out sample (val.loss_samples of them) in every
    bin k, with fixed noise. Each rank takes every world-th batch (and draws every batch's noise) and the sums
    are all-reduced. `loss_in_bin(x0, cond, noise, k)`: the per-sample loss at the bin's fixed time."""
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    bins, n = cfg.objective.loss_bins, min(cfg.val.loss_samples, len(val_set))
    losses = torch.zeros(bins, device=device)
    for i, (x0, noise, cond) in enumerate(heldout_batches(val_set, n, cfg.train.batch_size, cfg.seed + 1, device)):
        for k in range(bins) if i % world == rank else ():  # every rank draws every batch's noise
            with accelerator.autocast():
                losses[k] += loss_in_bin(x0, cond, noise, k).sum()
    return accelerator.reduce(losses, "sum").cpu() / n


def report(log, step, losses, nfe, path, accelerator):
    """The validation row (val_loss, its bins, val_nfe) and the line naming where the samples are."""
    log({"step": step, "val_loss": losses.mean().item(), "val_nfe": nfe,
         **{f"val_loss_t{k}": v.item() for k, v in enumerate(losses)}})
    accelerator.print(f"step {step}: val_loss {losses.mean().item():.4f}, samples in {path}")
