"""Convergence indicators: the gradient noise scale, the batch size around which larger batches stop paying
(McCandlish et al. 2018), measured every log.grad_every steps (NoiseScaleMeter), and the slope of the
validation loss per time bin, still falling or flat (ValidationSlopes). Both only record: nothing here changes
what is trained."""
import math

import torch

from training.optimisation.smoothing import BiasCorrectedEMA


class NoiseScale:
    """B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An empirical model of large-batch training",
    eq. 2.8), the batch size around which larger batches stop paying (B_crit ~ B_simple). From the squared norms
    of two mean gradients over B_small and B_big samples, E|G_B|^2 = |G|^2 + tr(Sigma) / B gives the unbiased
    estimates (appendix A.1)
        |G|^2    = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
        tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big),
    each smoothed (bias-corrected EMA) before the ratio, as the paper does: a single estimate of |G|^2 is
    noisy and may be negative. A step with a non-finite norm (a skipped step) is left out, and observe returns
    NaN for it: through nan_to_num it pinned the ratio at -1 (3.4e38 / -3.4e38) for ~840 estimates (0.9^n)."""

    def __init__(self, b_small, b_big, device, decay=0.9):
        self.b_small, self.b_big = b_small, b_big
        self.ema = BiasCorrectedEMA(2, decay, device)  # |G|^2, tr(Sigma)

    def observe(self, small_sq, big_sq):
        g2 = (self.b_big * big_sq - self.b_small * small_sq) / (self.b_big - self.b_small)
        trace = (small_sq - big_sq) / (1 / self.b_small - 1 / self.b_big)
        both = torch.stack([g2, trace]).float()
        entered = torch.isfinite(both).all()
        g2, trace = self.ema.update(both, mask=entered.expand(2))
        return torch.where(entered, trace / g2, float("nan"))

    def state_dict(self):
        return self.ema.state_dict()

    def load_state_dict(self, state):
        self.ema.load_state_dict(state)


class NoiseScaleMeter:
    """The noise scale as the loop measures it (log.grad_every; needs two batch sizes in a step: train.grad_accum
    >= 2 or several processes). The small batch is the first micro-batch's local gradient (before the others are
    added and before the all-reduce) or, without accumulation, each rank's gradient (read by a DDP communication
    hook before its all-reduce); the big one is the global batch's gradient, whose norm the clip returns. The loop
    calls micro_batch after each backward and measure after the clip, on every step; it counts the steps
    itself (from the checkpoint's, like the monitor), so it knows before the backward whether this step measures.
    Off (estimate None): measure only counts."""

    def __init__(self, cfg, accelerator, model, log, step=0):
        tr, device, world = cfg.train, accelerator.device, accelerator.num_processes
        self.accelerator, self.log, self.every, self.accum = accelerator, log, cfg.log.grad_every, tr.grad_accum
        self.step = step  # the optimizer steps done
        self.params = [p for p in accelerator.unwrap_model(model).parameters() if p.requires_grad]
        global_batch = tr.batch_size * tr.grad_accum * world
        two_sizes = cfg.log.grad_every and global_batch > tr.batch_size
        sharded = tr.get("sharding") == "fsdp"  # its small batch would be a gradient FSDP never holds whole
        self.estimate = NoiseScale(tr.batch_size, global_batch, device) if two_sizes and not sharded else None
        self.small_sq, self.batch_status = torch.zeros((), device=device), None
        if self.estimate is not None and tr.grad_accum == 1:
            model.register_comm_hook(state=None, hook=self.rank_norm_hook)
        if cfg.log.grad_every and sharded:
            accelerator.print("note: the gradient noise scale is not measured with train.sharding='fsdp'")
        elif cfg.log.grad_every and self.estimate is None:
            accelerator.print("note: the gradient noise scale needs two batch sizes in a step: train.grad_accum >= 2 "
                              "or several processes; not measured in this run")

    @property
    def measuring(self):
        """Whether the step in progress measures the noise scale (a gradient-analysis step)."""
        return self.estimate is not None and (self.step + 1) % self.every == 0

    def micro_batch(self, micro):
        """After a micro-batch's backward: on a measuring step with accumulation, |G_small|^2 of this rank's first
        micro-batch (its gradient is loss / accum: hence the accum^2)."""
        if self.measuring and micro == 0 and self.accum > 1:
            norms = torch._foreach_norm([p.grad for p in self.params if p.grad is not None])
            self.small_sq = torch.stack(norms).float().pow(2).sum() * self.accum ** 2

    def rank_norm_hook(self, state, bucket):
        """DDP communication hook: this rank's gradient, read before the all-reduce on noise-scale steps."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.measuring:
            self.small_sq = self.small_sq + torch.linalg.vector_norm(bucket.buffer().float()) ** 2
        return allreduce_hook(None, bucket)

    def measure(self, grad_norm):
        """After the clip, every step (before optimizer.step, whose fp16 scaler update would change the scale): on
        a measuring step the estimate (a sync, like the rest of the gradient analysis on that step), logged, and
        a line when the global batch is far from it. Then the step counts."""
        if self.measuring:
            self.observe(grad_norm)
        self.step += 1

    def observe(self, grad_norm):
        acc, scaler = self.accelerator, self.accelerator.scaler
        small = self.small_sq / (scaler.get_scale() ** 2 if scaler is not None else 1.0)  # fp16: unscaled
        small = acc.reduce(small, "mean") if acc.num_processes > 1 else small
        self.small_sq = torch.zeros_like(self.small_sq)
        b_noise = float(self.estimate.observe(small, grad_norm.detach().float() ** 2))
        if not math.isfinite(b_noise):  # a skipped step: nothing to log or advise
            return
        self.log({"step": self.step + 1, "grad_noise_scale": b_noise})
        batch = self.estimate.b_big
        status = "above" if batch > 10 * b_noise else "below" if batch < b_noise / 10 else "near"
        if status != self.batch_status and self.estimate.ema.count[0] >= 5:  # a line when it changes, from 5 estimates
            self.batch_status = status
            if status != "near":
                advice = ("a smaller batch with more steps would reach the same loss on less compute"
                          if status == "above" else
                          "a larger batch would reach the same loss in fewer steps at little extra compute")
                acc.print(f"step {self.step + 1}: the global batch {batch} is far {status} the critical batch size "
                          f"B_noise = {b_noise:.3g} (McCandlish et al. 2018): {advice}")

    def state_dict(self):
        return self.estimate.state_dict()

    def load_state_dict(self, state):
        self.estimate.load_state_dict(state)


def slope_and_error(x, y):
    """Least-squares slope of y on x and its standard error (n >= 3 points)."""
    n, mx, my = len(x), sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
    residual = sum((b - my - slope * (a - mx)) ** 2 for a, b in zip(x, y))
    return slope, math.sqrt(residual / (n - 2) / sxx)


class ValidationSlopes:
    """Per time bin, the slope of the validation loss over the last `window` validations (least squares, per
    1000 steps, relative to the bin's mean loss), and whether the bin is still improving: its slope is
    significantly below 0 (t = slope / standard error < -2), else flat. Main process (validation runs there)."""

    def __init__(self, window, log=None, accelerator=None):
        self.window, self.history = window, []  # [[step, loss_t0, loss_t1, ...]]
        self.log, self.accelerator = log, accelerator  # where record writes

    def record(self, step, losses):
        """Main process, after each validation: the slope of each bin's validation loss, logged, and a line."""
        metrics, flat = self(step, losses)
        if metrics:
            self.log({"step": step, **metrics})
            falling = [k for k in range(len(losses)) if k not in flat]
            self.accelerator.print(f"step {step}: validation loss over the last {len(self.history)} validations: "
                                   f"still falling in time bins {falling or 'none'}, flat in {flat or 'none'}")

    def __call__(self, step, losses):
        self.history = (self.history + [[step, *losses]])[-self.window:]
        if len(self.history) < 3:
            return {}, []
        x = [row[0] / 1000 for row in self.history]
        metrics, flat = {}, []
        for k in range(len(losses)):
            y = [row[1 + k] for row in self.history]
            slope, error = slope_and_error(x, y)
            metrics[f"val_slope_t{k}"] = slope / (sum(y) / len(y))
            if not slope < -2 * error:
                flat.append(k)
        return metrics, flat

    def state_dict(self):
        return {"history": self.history}

    def load_state_dict(self, state):
        self.history = [list(row) for row in state["history"]]
