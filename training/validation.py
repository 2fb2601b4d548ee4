"""What both trainers' validation does around the method's own sampler and loss: the sample grid split over the
ranks (with its network evaluations counted), the held-out loss on a fixed time grid, and the row and line that
report them. Every rank calls each; the results are a one-process run's."""
import torch

import common
from training.data import heldout_batches


def sample_grid(generate, ema, noise, cond, cfg, accelerator):
    """(samples, network evaluations per sample): the grid of fixed noise and conditions sampled as the run is
    configured (`generate`, the trainer's), at the run's precision; each rank samples its share and the grid is
    gathered. The main process counts its own share's evaluations (fewer with a guidance interval)."""
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
