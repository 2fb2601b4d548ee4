"""The stability parts of a training run, each an object in its own module that the loop calls by name:

    density      the adaptive time density (time_density.py; objective.time_sampling / timestep_sampling =
                 "adaptive"; None: the method's own time draw)
    clip         gradient clipping to train.grad_clip or a percentile of recent norms (clipping.py)
    noise_scale  the gradient noise scale, the critical batch size (convergence.py; log.grad_every)
    slopes       the slope of the validation loss per time bin (convergence.py)
    rollback     rollback to the last good checkpoint with a lower LR on divergence (rollback.py;
                 train.on_divergence = "rollback")

Parts builds them from the config and keeps their state in the checkpoint, under "stability", so a resumed run
is bitwise the uninterrupted one. Their tensors stay on the device: an ordinary step adds no host sync. With
every option off the loop trains exactly as without them (weights 1.0, the fixed norm clip, LR factor 1).
"""
from training.optimisation import clipping, convergence, time_density
from training.run import rollback


class Parts:
    """The run's stability parts by name, and their checkpoint state. `quantile(u)`: the base time density's
    inverse CDF, which the adaptive density maps its draws through."""

    def __init__(self, cfg, accelerator, model, log, state, quantile):
        self.density = time_density.adaptive_density(cfg, accelerator, quantile)
        self.clip = clipping.GradClipper(cfg.train, accelerator)
        self.noise_scale = convergence.NoiseScaleMeter(cfg, accelerator, model, log)
        self.slopes = convergence.ValidationSlopes(cfg.val.slope_window, log, accelerator)
        self.rollback = rollback.Rollback(cfg, accelerator, log, restore=self.load_state_dict)
        self.rollback.spikes = [(state.get("step", 0), state.get("loss_state", {}).get("spikes", 0))]
        self.load_state_dict(state)

    def named(self):
        """(name in the checkpoint, part) of the parts this run has."""
        noise = self.noise_scale if self.noise_scale.estimate is not None else None
        return [(name, part) for name, part in (("clipper", self.clip), ("rollback", self.rollback),
                                                ("slopes", self.slopes), ("sampler", self.density), ("noise", noise))
                if part is not None]

    def state_dict(self):
        """For the checkpoint (a collective: every rank calls it)."""
        return {"stability": {name: part.state_dict() for name, part in self.named()}}

    def load_state_dict(self, state):
        """A checkpoint's state (at start, and on a rollback): each part's, and the step the noise scale counts from."""
        self.noise_scale.step = state.get("step", 0)
        saved = state.get("stability", {})
        for name, part in self.named():
            if name in saved:
                part.load_state_dict(saved[name])
