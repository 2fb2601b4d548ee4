"""The bias-corrected EMA (Adam's correction of the start, Kingma & Ba 2015, sec. 3) that the adaptive time
density (time_density.py) and the gradient noise scale (convergence.py) smooth their estimates with."""
import torch


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
