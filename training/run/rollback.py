"""Rollback on divergence (train.on_divergence = "rollback"; PaLM, Chowdhery et al. 2022, sec. 5.1: restart from
a checkpoint before the spike with the data batches around it skipped; here also with a lower LR). The loop asks
`diverged` at log steps and, when it is, `roll_back`; the LR factor and the data position it reads are pure
functions of the step otherwise (factor 1, no skipped window)."""
import os
import re
from pathlib import Path

import torch

from training.run import checkpoints


def step_of(folder):
    return int(re.findall(r"\d+", Path(folder).name)[-1])


def last_good_checkpoint(run_dir, last_step):
    """The newest intact checkpoint of at most `last_step` steps, and the newer ones (written during the
    divergence). Checkpoints are run_dir/checkpoints/<name ending in the step>; checkpoints.find_checkpoint checks
    each."""
    newer = []
    for folder in sorted((Path(run_dir) / "checkpoints").glob("step_*"), key=step_of, reverse=True):
        if step_of(folder) > last_step:
            newer.append(folder)
            continue
        try:
            return checkpoints.find_checkpoint(run_dir, str(folder)), newer
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
    """After train.max_nonfinite_steps non-finite steps in a row (monitor's count, which then does not stop the
    run) or train.rollback_spikes loss spikes within train.rollback_window steps, every rank reloads the newest
    checkpoint from before the divergence began, multiplies the LR by train.rollback_lr_factor from then on and
    skips the data it saw from there to the detection, at most train.max_rollbacks times. Every rank decides the
    same: both signals come from all-reduced statistics. `restore(state)`: reloads the stability parts' state
    from a checkpoint's (stability.Parts.load_state_dict, this object's included)."""

    def __init__(self, cfg, accelerator, log, restore):
        self.cfg, self.tr, self.accelerator, self.log, self.restore = cfg, cfg.train, accelerator, log, restore
        self.count, self.lr_factor, self.data_offset = 0, 1.0, 0  # data_offset: micro-batches skipped per rank
        self.spikes = []  # [(log step, cumulative spike count)] back to the window's start
        self.divergence = None  # the first step of the divergence seen at the last log step

    def data_position(self, step):
        """The micro-batch index the data resumes at: a pure function of the step, plus the skipped windows."""
        return step * self.tr.grad_accum + self.data_offset

    def diverged(self, step, metrics, monitor):
        """Every rank, at a log step after monitor.log_interval (whose metrics it reads): whether to roll back now."""
        self.divergence = self.diverged_at(step, metrics, monitor)
        return self.divergence is not None

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

    def roll_back(self, step, monitor, load):
        """Reload the newest checkpoint from before the divergence on every rank (`load(ckpt)` is the trainer's
        checkpoints.load_checkpoint: weights, EMA, optimizer, RNG), with the monitor's and the stability parts' state
        from it (`restore`); keep the rollback count, the lower LR and the skipped data window, in memory and in
        that checkpoint. Returns the step to go on from, whose validation, FID, snapshot and checkpoint are done:
        the loop does not repeat them (a second validation point at one step would skew the slopes)."""
        acc, tr = self.accelerator, self.tr
        start = self.divergence
        if self.count >= tr.max_rollbacks:
            raise FloatingPointError(f"the run diverged at step {start} after {self.count} rollbacks "
                                     f"(train.max_rollbacks={tr.max_rollbacks}); checkpoints in {self.cfg.run_dir}")
        ckpt, newer = last_good_checkpoint(self.cfg.run_dir, start - 1)
        ckpt = checkpoints.same_checkpoint(ckpt, acc)  # a rank that sees none must not leave the others waiting
        if ckpt is None:
            raise FloatingPointError(f"the run diverged at step {start} and has no checkpoint from before it to "
                                     f"roll back to (ckpt.every={self.cfg.ckpt.every})")
        state = load(ckpt)
        monitor.load_state_dict(state)
        keep = (self.count + 1, self.lr_factor * tr.rollback_lr_factor,
                self.data_offset + (step - state["step"]) * tr.grad_accum)  # skip what it saw up to the detection
        self.restore(state)  # the clip history, density, noise-scale estimate and step count of the checkpoint
        self.count, self.lr_factor, self.data_offset = keep
        self.spikes = [(state["step"], monitor.loss_state["spikes"])]
        acc.wait_for_everyone()  # every rank has read its checkpoint
        if acc.is_main_process:  # set aside the checkpoints written during the divergence: never resumed
            for folder in newer:
                folder.rename(folder.with_name(f"diverged{self.count}_{folder.name}"))
            record_rollback(ckpt, self.state_dict())
        event = {"step": state["step"], "event": "rollback", "detected_at": step, "diverged_at": start,
                 "lr_factor": self.lr_factor, "skipped_batches": (step - state["step"]) * tr.grad_accum}
        self.log(event)
        print(f"rank {acc.process_index}: step {step}: divergence since step {start}: rolled back to {ckpt} "
              f"(rollback {self.count} of at most {tr.max_rollbacks}); LR x {self.lr_factor:g} from now on, "
              f"{event['skipped_batches']} micro-batches per rank skipped", flush=True)
        acc.wait_for_everyone()
        return state["step"]
