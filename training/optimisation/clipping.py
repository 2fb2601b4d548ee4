"""Gradient clipping (train.grad_clip_mode): a fixed norm, or a percentile of the recent norms (TRELLIS's
AdaptiveGradClipper). Its history stays on the device: an ordinary step adds no host sync."""
import torch

import common


class GradClipper:
    """train.grad_clip_mode "norm": clip the global norm to train.grad_clip (accelerate's clip_grad_norm_, as
    before). "adaptive": clip to the p-th percentile of the last N pre-clip norms, capped at train.grad_clip
    (TRELLIS, Xiang et al. 2024: p = 95, N = 1000, on flow DiTs with logit-normal t, like ours). A percentile
    rather than ZClip's z-score (mean + z std of EMAs): gradient norms are skewed and heavy-tailed, so a
    Gaussian z-score is mis-calibrated exactly where it matters, a spike inflates ZClip's EMA std (it must feed
    clipped values back to stay usable), while one spike moves a 95th percentile of 1000 norms by at most one
    rank. The history, its position and count live on the device (no sync); non-finite norms are not recorded;
    until it holds min(N, 50) norms the threshold is the cap."""

    def __init__(self, tr, accelerator):
        self.mode, self.cap, self.percentile = tr.grad_clip_mode, tr.grad_clip, tr.grad_clip_percentile
        self.accelerator, device = accelerator, accelerator.device
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

    def __call__(self, parameters):
        """Clip the gradients (already all-reduced); returns their global norm before clipping. self.threshold is
        the limit this step clipped to."""
        parameters = list(parameters)
        if self.mode == "norm":  # (sharded, train.sharding="fsdp": the norm of the whole gradient, on every rank)
            return common.full(self.accelerator.clip_grad_norm_(parameters, self.cap))
        self.accelerator.unscale_gradients()  # fp16: the norm of the true gradients
        grads = [p.grad for p in parameters if p.grad is not None]
        total = common.full(torch.nn.utils.get_total_norm(grads))
        self.threshold = self.current_threshold()
        # torch's clip coefficient
        torch._foreach_mul_(common.local(grads), (self.threshold / (total + 1e-6)).clamp(max=1.0))
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
