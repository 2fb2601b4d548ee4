"""Training stability and dynamic scheduling, behind one object the loop calls in a few places (Stability):

    an adaptive time density (objective.time_sampling / timestep_sampling = "adaptive"), adaptive gradient
    clipping (train.grad_clip_mode = "adaptive"), rollback to the last good checkpoint with a lower LR on
    divergence (train.on_divergence = "rollback"), the gradient noise scale (the critical batch size) and the
    slope of the validation loss per time bin.

Each part is a small object with state_dict / load_state_dict (kept in the checkpoint, so a resumed run is
bitwise the uninterrupted one) whose tensors stay on the device: an ordinary step adds no host sync. The
sampler's statistics are all-reduced at log steps; the noise scale is read on gradient-analysis steps. With
every option off the loop trains exactly as without this module (weights 1.0, the fixed norm clip, LR factor 1).
"""
import math
import os
import re
from pathlib import Path

import torch

import common

# ----------------------------------------------------------------------------------------------------------
# Smoothing: the bias-corrected EMA (Adam's correction of the start, Kingma & Ba 2015, sec. 3).


class BiasCorrectedEMA:
    """An EMA per element whose start is corrected like Adam's moments: after n updates it is
    sum_i d^(n-i) (1 - d) x_i / (1 - d^n), a weighted mean of what it has seen, so the first value is x_1 and
    it never drags a zero or a first value along. Written as the running form m += a_n (x - m) with step
    a_n = (1 - d) / (1 - d^n), the same as monitor.find_spikes' smoothed loss. `mask` marks the elements that
    got a value (a time bin with no sample keeps its estimate); a non-finite value is no value: it would pin the
    estimate (an infinity enters as 3.4e38 through nan_to_num) for as long as the EMA remembers it."""

    def __init__(self, size, decay, device):
        self.decay = decay
        self.value = torch.zeros(size, device=device)
        self.count = torch.zeros(size, device=device)  # updates so far, per element

    def update(self, x, mask=None, decay=None):
        d = self.decay if decay is None else decay
        finite = torch.isfinite(x)
        mask = (finite if mask is None else mask & finite).float()
        self.count += mask
        step = (1 - d) / (1 - d ** self.count.clamp(min=1))  # 1 at the first update: the value is x_1
        self.value += mask * step * (torch.where(finite, x, 0.0) - self.value)
        return self.value

    def state_dict(self):
        return {"value": self.value.tolist(), "count": self.count.tolist()}

    def load_state_dict(self, state):
        self.value.copy_(torch.tensor(state["value"])), self.count.copy_(torch.tensor(state["count"]))


# ----------------------------------------------------------------------------------------------------------
# Noise schedule adaptation: the time density follows the loss (Kingma & Gao 2023, app. F; Nichol & Dhariwal
# 2021's loss-second-moment resampler), with importance weights that keep the objective's expectation.


class AdaptiveTimeSampler:
    """Times from a density that follows the running loss per time bin, each sample weighted by base / p.

    The bins are the K quantile intervals of the base density (u = F_base(t) in [k/K, (k+1)/K)), so each holds
    base mass 1/K and a draw is: bin k ~ q, u uniform in the bin, t = F_base^-1(u) (the trainer's `quantile`).
    The weight base(t) / p(t) is then 1 / (K q_k), and E_p[w L] = sum_k q_k / (K q_k) E[L | k] = E_base[L]:
    the objective is unchanged, only its variance moves. The variance E_p[w^2 L^2] = sum_k E[L^2 | k] / (K^2 q_k)
    is smallest at q_k ~ sqrt(E[L^2 | k]) (Lagrange), the improved-DDPM rule: q_k is that, from a bias-corrected
    EMA of E[L^2] per bin (about 100 steps), mixed with the base density (share `mix`) so no weight exceeds
    K / (mix K) = 1 / mix. Until every bin has been seen the density is the base one."""

    DECAY = 0.99  # per step: the EMA of E[L^2] per bin spans about 100 steps, like the smoothed loss

    def __init__(self, bins, mix, quantile, accelerator, log_every):
        device = accelerator.device
        self.k_bins, self.mix, self.quantile, self.accelerator = bins, mix, quantile, accelerator
        self.decay = self.DECAY ** log_every  # one update per log interval
        self.q = torch.full((bins,), 1.0 / bins, device=device)  # p(bin)
        self.second_moment = BiasCorrectedEMA(bins, self.decay, device)  # E[L^2] per bin
        self.sums = torch.zeros(2, bins, device=device)  # this interval's sum of L^2 and count per bin
        self.bins = None

    def draw(self, n):
        """(t, weight): one uniform per sample through the inverse CDF of the piecewise-uniform density q."""
        r = torch.rand(n, device=self.q.device)
        cdf = torch.cumsum(self.q, 0)
        k = torch.searchsorted(cdf, r, right=True).clamp(max=self.k_bins - 1)
        q_k, below = self.q[k], cdf[k] - self.q[k]
        within = ((r - below) / q_k).clamp(0, 1 - 1e-6)  # uniform in [0, 1) given k
        self.bins = k
        return self.quantile((k + within) / self.k_bins), 1.0 / (self.k_bins * q_k)

    def observe(self, loss):
        """The per-sample losses (before the importance weight) of the last draw. A non-finite one (that step is
        skipped) is left out on the device, no sync: one infinity would make its bin's E[L^2] 3.4e38 and send
        1 - mix + mix / K of the draws there (77% at the defaults) until 0.99^n brings it to O(1): ~8,800 steps."""
        square = loss.detach().float().pow(2)
        finite = torch.isfinite(square)  # also a finite loss whose square overflows
        self.sums[0].index_add_(0, self.bins, torch.where(finite, square, 0.0))
        self.sums[1].index_add_(0, self.bins, finite.float())

    def update(self):
        """At a log step (every rank; one all-reduce): the interval's E[L^2] per bin into the EMA, then q."""
        sums = self.accelerator.reduce(self.sums, "sum") if self.accelerator.num_processes > 1 else self.sums
        seen = sums[1] > 0
        ema = self.second_moment.update(sums[0] / sums[1].clamp(min=1), mask=seen)
        root = ema.clamp(min=0).sqrt()
        target = (1 - self.mix) * root / root.sum().clamp(min=1e-30) + self.mix / self.k_bins
        self.q.copy_(torch.where((self.second_moment.count > 0).all(), target, self.q))
        self.sums.zero_()

    def metrics(self):
        """p(bin) relative to the base density (1 everywhere = the base density), for the log and the report."""
        return {f"time_density/{k}": v for k, v in enumerate((self.q * self.k_bins).tolist())}

    def state_dict(self):
        """A collective: the interval in progress summed over ranks (restored on the main process only)."""
        sums = self.accelerator.reduce(self.sums.clone(), "sum") if self.accelerator.num_processes > 1 else self.sums
        return {"q": self.q.tolist(), "ema": self.second_moment.state_dict(), "sums": sums.tolist()}

    def load_state_dict(self, state):
        self.q.copy_(torch.tensor(state["q"])), self.second_moment.load_state_dict(state["ema"])
        main = self.accelerator.is_main_process  # the interval's sums over ranks: counted once
        self.sums.copy_(torch.tensor(state["sums"]) if main else torch.zeros_like(self.sums))


# ----------------------------------------------------------------------------------------------------------
# Gradient clipping: a fixed norm, or a percentile of the recent norms (TRELLIS's AdaptiveGradClipper).


class GradClipper:
    """train.grad_clip_mode "norm": clip the global norm to train.grad_clip (accelerate's clip_grad_norm_, as
    before). "adaptive": clip to the p-th percentile of the last N pre-clip norms, capped at train.grad_clip
    (TRELLIS, Xiang et al. 2024: p = 95, N = 1000, on flow DiTs with logit-normal t, like ours). A percentile
    rather than ZClip's z-score (mean + z std of EMAs): gradient norms are skewed and heavy-tailed, so a
    Gaussian z-score is mis-calibrated exactly where it matters, a spike inflates ZClip's EMA std (it must feed
    clipped values back to stay usable), while one spike moves a 95th percentile of 1000 norms by at most one
    rank. The history, its position and count live on the device (no sync); non-finite norms are not recorded;
    until it holds min(N, 50) norms the threshold is the cap."""

    def __init__(self, tr, device):
        self.mode, self.cap, self.percentile = tr.grad_clip_mode, tr.grad_clip, tr.grad_clip_percentile
        self.history = torch.full((tr.grad_clip_history,), float("nan"), device=device)
        self.seen = torch.zeros((), dtype=torch.long, device=device)
        self.threshold = self.cap  # the last step's threshold (a device tensor in adaptive mode)

    def current_threshold(self):
        n, size = self.seen.clamp(max=len(self.history)), len(self.history)
        ordered = torch.sort(self.history).values  # NaN (empty slots) sort last
        pos = (self.percentile / 100) * (n - 1).clamp(min=0).float()  # np.percentile's linear interpolation
        lo = pos.floor().long()
        hi = (lo + 1).clamp(max=(n - 1).clamp(min=0))
        a, b = ordered.gather(0, lo.view(1)), ordered.gather(0, hi.view(1))
        value = (a + (pos - lo.float()) * (b - a)).squeeze(0)
        return torch.where(n >= min(size, 50), value.clamp(max=self.cap), torch.full_like(value, self.cap))

    def __call__(self, accelerator, parameters):
        """Clip the gradients (already all-reduced); returns their global norm before clipping."""
        if self.mode == "norm":
            return accelerator.clip_grad_norm_(parameters, self.cap)
        accelerator.unscale_gradients()  # fp16: the norm of the true gradients
        grads = [p.grad for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        self.threshold = self.current_threshold()
        torch._foreach_mul_(grads, (self.threshold / (total + 1e-6)).clamp(max=1.0))  # torch's clip coefficient
        slot = (self.seen % len(self.history)).view(1)
        finite = torch.isfinite(total)
        self.history.scatter_(0, slot, torch.where(finite, total, self.history.gather(0, slot)).view(1).float())
        self.seen += finite.long()
        return total

    def state_dict(self):
        return {"history": self.history.tolist(), "seen": int(self.seen)}

    def load_state_dict(self, state):
        if len(state["history"]) == len(self.history):  # a changed train.grad_clip_history starts afresh
            self.history.copy_(torch.tensor(state["history"])), self.seen.fill_(state["seen"])


# ----------------------------------------------------------------------------------------------------------
# Convergence indicators: the gradient noise scale (McCandlish et al. 2018) and validation slopes per bin.


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

    def __init__(self, window):
        self.window, self.history = window, []  # [[step, loss_t0, loss_t1, ...]]

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


# ----------------------------------------------------------------------------------------------------------
# Rollback on divergence (PaLM, Chowdhery et al. 2022, sec. 5.1: restart from a checkpoint before the spike
# with the data batches around it skipped; here also with a lower LR).


def step_of(folder):
    return int(re.findall(r"\d+", Path(folder).name)[-1])


def last_good_checkpoint(run_dir, last_step):
    """The newest intact checkpoint of at most `last_step` steps, and the newer ones (written during the
    divergence). Checkpoints are run_dir/checkpoints/<name ending in the step>; common.find_checkpoint checks each."""
    newer = []
    for folder in sorted((Path(run_dir) / "checkpoints").glob("step_*"), key=step_of, reverse=True):
        if step_of(folder) > last_step:
            newer.append(folder)
            continue
        try:
            return common.find_checkpoint(run_dir, str(folder)), newer
        except FileNotFoundError:
            print(f"warning: checkpoint {folder} is incomplete or corrupt; trying an earlier one")
    return None, newer


def record_rollback(ckpt, rollback):
    """The rollback's state (count, LR factor, skipped window) written into the checkpoint it returned to, at
    once and atomically (a new state.pt renamed over the old): a run preempted before its next checkpoint
    resumes from this one, and without it would replay the divergence at the full LR, with the window unskipped
    and train.max_rollbacks never reached. Only state.pt changes; an older layout's optimizer in it is kept."""
    path = Path(ckpt) / "state.pt"
    state = torch.load(path, weights_only=True, map_location="cpu")
    state.setdefault("stability", {})["rollback"] = rollback
    torch.save(state, path.with_name("state.pt.tmp"))
    os.replace(path.with_name("state.pt.tmp"), path)


class Rollback:
    """train.on_divergence = "rollback": after train.max_nonfinite_steps non-finite steps in a row (monitor's
    count, which then does not stop the run) or train.rollback_spikes loss spikes within train.rollback_window
    steps, every rank reloads the newest checkpoint from before the divergence began, multiplies the LR by
    train.rollback_lr_factor from then on and skips the data it saw from there to the detection, at most
    train.max_rollbacks times. Every rank decides the same: both signals come from all-reduced statistics."""

    def __init__(self, tr, log_every):
        self.tr, self.log_every = tr, log_every
        self.count, self.lr_factor, self.data_offset = 0, 1.0, 0  # data_offset: micro-batches skipped per rank
        self.spikes = []  # [(log step, cumulative spike count)] back to the window's start

    def diverged_at(self, step, metrics, monitor):
        """The first step of a divergence seen at this log step, or None."""
        if self.tr.on_divergence != "rollback":
            return None
        window = step - self.tr.rollback_window  # the last entry at or before it is the baseline
        self.spikes = ([e for e in self.spikes if e[0] <= window][-1:] + [e for e in self.spikes if e[0] > window]
                       + [(step, metrics["loss_spikes"])])
        if monitor.diverged_at is not None:
            return monitor.diverged_at
        if self.tr.rollback_spikes and len(self.spikes) > 1 and \
                self.spikes[-1][1] - self.spikes[0][1] >= self.tr.rollback_spikes:
            # the first interval in the window with a spike began the divergence
            first = next(i for i in range(1, len(self.spikes)) if self.spikes[i][1] > self.spikes[i - 1][1])
            return self.spikes[first - 1][0] + 1
        return None

    def state_dict(self):
        return {"count": self.count, "lr_factor": self.lr_factor, "data_offset": self.data_offset,
                "spikes": [list(e) for e in self.spikes]}

    def load_state_dict(self, state):
        self.count, self.lr_factor, self.data_offset = state["count"], state["lr_factor"], state["data_offset"]
        self.spikes = [tuple(e) for e in state["spikes"]]


# ----------------------------------------------------------------------------------------------------------
# The object the loop talks to.


class Stability:
    """What the loop calls: draw_time (t and its weight), micro_batch (losses; the small-batch gradient norm on
    noise-scale steps), clip (the gradient clip), lr_factor and data_position (after a rollback), diverged (at
    log steps: the sampler's all-reduce and the divergence check), roll_back, validation (slopes), state_dict.

    `base_draw(n)`: the trainer's times as before (time_sampling not adaptive); `quantile(u)`: the base
    density's inverse CDF, which the adaptive sampler maps its draws through."""

    def __init__(self, cfg, accelerator, model, log, state, base_draw, quantile):
        tr, obj = cfg.train, cfg.objective
        self.cfg, self.accelerator, self.log, self.base_draw = cfg, accelerator, log, base_draw
        self.params = [p for p in accelerator.unwrap_model(model).parameters() if p.requires_grad]
        self.step, device, world = state.get("step", 0), accelerator.device, accelerator.num_processes
        adaptive = obj.get("time_sampling", obj.get("timestep_sampling")) == "adaptive"
        self.sampler = (AdaptiveTimeSampler(obj.adaptive_bins, obj.adaptive_mix, quantile, accelerator, cfg.log.every)
                        if adaptive else None)
        self.clipper = GradClipper(tr, device)
        self.rollback = Rollback(tr, cfg.log.every)
        self.slopes = ValidationSlopes(cfg.val.slope_window)
        # The noise scale needs two batch sizes from one step: the first micro-batch's local gradient (before
        # the others are added and before the all-reduce) or, without accumulation, each rank's gradient (read
        # by a DDP communication hook before its all-reduce); against the global batch's gradient.
        global_batch = tr.batch_size * tr.grad_accum * world
        two_sizes = cfg.log.grad_every and global_batch > tr.batch_size
        self.noise = NoiseScale(tr.batch_size, global_batch, device) if two_sizes else None
        self.small_sq, self.measure, self.batch_status = torch.zeros((), device=device), False, None
        if self.noise is not None and tr.grad_accum == 1:
            model.register_comm_hook(state=None, hook=self.rank_norm_hook)
        if cfg.log.grad_every and self.noise is None:
            accelerator.print("note: the gradient noise scale needs two batch sizes in a step: train.grad_accum >= 2 "
                              "or several processes; not measured in this run")
        self.rollback.spikes = [(self.step, state.get("loss_state", {}).get("spikes", 0))]
        self.load_state_dict(state.get("stability", {}))

    # ---- per micro-batch ---------------------------------------------------------------------------------
    def draw_time(self, n):
        """(t, importance weight) for n samples; the base draw with weight 1.0 when not adaptive."""
        every = self.cfg.log.grad_every
        self.measure = self.noise is not None and (self.step + 1) % every == 0  # a gradient-analysis step
        return self.sampler.draw(n) if self.sampler is not None else (self.base_draw(n), 1.0)

    def micro_batch(self, micro, loss):
        if self.sampler is not None:
            self.sampler.observe(loss)
        if self.measure and micro == 0 and self.cfg.train.grad_accum > 1:  # |G_small|^2 of this rank's micro-batch
            norms = torch._foreach_norm([p.grad for p in self.params if p.grad is not None])
            self.small_sq = torch.stack(norms).float().pow(2).sum() * self.cfg.train.grad_accum ** 2  # loss / accum

    def rank_norm_hook(self, state, bucket):
        """DDP communication hook: this rank's gradient, read before the all-reduce on noise-scale steps."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.measure:
            self.small_sq = self.small_sq + torch.linalg.vector_norm(bucket.buffer().float()) ** 2
        return allreduce_hook(None, bucket)

    # ---- per optimizer step ------------------------------------------------------------------------------
    def clip(self, parameters):
        """The clip (train.grad_clip_mode); on a noise-scale step also the noise scale (a sync, like the rest of
        the gradient analysis on that step). Returns the pre-clip global norm; self.clip_threshold is the limit."""
        grad_norm = self.clipper(self.accelerator, list(parameters))
        if self.measure:
            self.noise_scale(grad_norm)
        self.step += 1
        return grad_norm

    @property
    def clip_threshold(self):
        return self.clipper.threshold

    @property
    def lr_factor(self):
        return self.rollback.lr_factor

    def data_position(self, step):
        """The micro-batch index the data resumes at: a pure function of the step, plus the skipped windows."""
        return step * self.cfg.train.grad_accum + self.rollback.data_offset

    def noise_scale(self, grad_norm):
        acc, scaler = self.accelerator, self.accelerator.scaler
        small = self.small_sq / (scaler.get_scale() ** 2 if scaler is not None else 1.0)  # fp16: unscaled
        small = acc.reduce(small, "mean") if acc.num_processes > 1 else small
        self.small_sq = torch.zeros_like(self.small_sq)
        b_noise = float(self.noise.observe(small, grad_norm.detach().float() ** 2))
        if not math.isfinite(b_noise):  # a skipped step: nothing to log or advise
            return
        self.log({"step": self.step + 1, "grad_noise_scale": b_noise})
        batch = self.noise.b_big
        status = "above" if batch > 10 * b_noise else "below" if batch < b_noise / 10 else "near"
        if status != self.batch_status and self.noise.ema.count[0] >= 5:  # a line when it changes, from 5 estimates
            self.batch_status = status
            if status != "near":
                acc.print(f"step {self.step + 1}: the global batch {batch} is far {status} the critical batch size "
                          f"B_noise = {b_noise:.3g} (McCandlish et al. 2018): " +
                          ("a smaller batch with more steps would reach the same loss on less compute" if status == "above"
                           else "a larger batch would reach the same loss in fewer steps at little extra compute"))

    # ---- at log steps and validation ---------------------------------------------------------------------
    def diverged(self, step, metrics, monitor):
        """Every rank, at a log step after monitor.log_interval (whose metrics it reads): the sampler's update
        (one all-reduce) and its density in the log; whether to roll back now (train.on_divergence)."""
        if self.sampler is not None:
            self.sampler.update()
            self.log({"step": step, **self.sampler.metrics()})
        self.divergence = self.rollback.diverged_at(step, metrics, monitor)
        return self.divergence is not None

    def roll_back(self, step, monitor, load):
        """Reload the newest checkpoint from before the divergence on every rank (`load(ckpt)` is the trainer's
        common.load_checkpoint: weights, EMA, optimizer, RNG), with the monitor's and this object's state from
        it; keep the rollback count, the lower LR and the skipped data window, in memory and in that checkpoint.
        Returns the step to go on from, whose validation, FID, snapshot and checkpoint are done: the loop does
        not repeat them (a second validation point at one step would skew the slopes)."""
        acc, tr, rb = self.accelerator, self.cfg.train, self.rollback
        start = self.divergence
        if rb.count >= tr.max_rollbacks:
            raise FloatingPointError(f"the run diverged at step {start} after {rb.count} rollbacks "
                                     f"(train.max_rollbacks={tr.max_rollbacks}); checkpoints in {self.cfg.run_dir}")
        ckpt, newer = last_good_checkpoint(self.cfg.run_dir, start - 1)
        ckpt = common.same_checkpoint(ckpt, acc)  # a rank that sees none must not leave the others waiting
        if ckpt is None:
            raise FloatingPointError(f"the run diverged at step {start} and has no checkpoint from before it to "
                                     f"roll back to (ckpt.every={self.cfg.ckpt.every})")
        state = load(ckpt)
        monitor.load_state_dict(state)
        keep = (rb.count + 1, rb.lr_factor * tr.rollback_lr_factor,
                rb.data_offset + (step - state["step"]) * tr.grad_accum)  # skip what it saw up to the detection
        self.load_state_dict(state.get("stability", {}))
        rb.count, rb.lr_factor, rb.data_offset = keep
        rb.spikes, self.step = [(state["step"], monitor.loss_state["spikes"])], state["step"]
        acc.wait_for_everyone()  # every rank has read its checkpoint
        if acc.is_main_process:  # set aside the checkpoints written during the divergence: never resumed
            for folder in newer:
                folder.rename(folder.with_name(f"diverged{rb.count}_{folder.name}"))
            record_rollback(ckpt, rb.state_dict())
        event = {"step": state["step"], "event": "rollback", "detected_at": step, "diverged_at": start,
                 "lr_factor": rb.lr_factor, "skipped_batches": (step - state["step"]) * tr.grad_accum}
        self.log(event)
        print(f"rank {acc.process_index}: step {step}: divergence since step {start}: rolled back to {ckpt} "
              f"(rollback {rb.count} of at most {tr.max_rollbacks}); LR x {rb.lr_factor:g} from now on, "
              f"{event['skipped_batches']} micro-batches per rank skipped", flush=True)
        acc.wait_for_everyone()
        return state["step"]

    def validation(self, step, losses):
        """Main process, after each validation: the slope of each bin's validation loss (logged, and a line)."""
        metrics, flat = self.slopes(step, losses)
        if metrics:
            self.log({"step": step, **metrics})
            falling = [k for k in range(len(losses)) if k not in flat]
            self.accelerator.print(f"step {step}: validation loss over the last {len(self.slopes.history)} "
                                   f"validations: still falling in time bins {falling or 'none'}, flat in {flat or 'none'}")

    def state_dict(self):
        """For the checkpoint (a collective: every rank calls it)."""
        state = {"clipper": self.clipper.state_dict(), "rollback": self.rollback.state_dict(),
                 "slopes": self.slopes.state_dict()}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        if self.noise is not None:
            state["noise"] = self.noise.state_dict()
        return {"stability": state}

    def load_state_dict(self, state):
        for name, part in (("clipper", self.clipper), ("rollback", self.rollback), ("slopes", self.slopes),
                           ("sampler", self.sampler), ("noise", self.noise)):
            if part is not None and name in state:
                part.load_state_dict(state[name])
