"""The adaptive time density (objective.time_sampling / timestep_sampling = "adaptive"): times drawn from a
density that follows the running loss per time bin (Kingma & Gao 2023, app. F; Nichol & Dhariwal 2021's
loss-second-moment resampler), with importance weights that keep the objective's expectation. The trainer
chooses it once before the loop (`adaptive_density`); its tensors stay on the device, so an ordinary step adds
no host sync, and its statistics are all-reduced at log steps."""
import torch

from training.optimisation.smoothing import BiasCorrectedEMA


def adaptive_density(cfg, accelerator, quantile):
    """The run's AdaptiveTimeDensity when objective.time_sampling (flow matching) or timestep_sampling (DDPM) is
    "adaptive", else None: the method's own time draw. `quantile(u)`: the base density's inverse CDF."""
    obj = cfg.objective
    if obj.get("time_sampling", obj.get("timestep_sampling")) != "adaptive":
        return None
    return AdaptiveTimeDensity(obj.adaptive_bins, obj.adaptive_mix, quantile, accelerator, cfg.log.every)


class AdaptiveTimeDensity:
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
        """At a log step (every rank; one all-reduce): the interval's E[L^2] per bin into the EMA, then q. Returns
        the new density's metrics, for the log."""
        sums = self.accelerator.reduce(self.sums, "sum") if self.accelerator.num_processes > 1 else self.sums
        seen = sums[1] > 0
        ema = self.second_moment.update(sums[0] / sums[1].clamp(min=1), mask=seen)
        root = ema.clamp(min=0).sqrt()
        target = (1 - self.mix) * root / root.sum().clamp(min=1e-30) + self.mix / self.k_bins
        self.q.copy_(torch.where((self.second_moment.count > 0).all(), target, self.q))
        self.sums.zero_()
        return self.metrics()

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
