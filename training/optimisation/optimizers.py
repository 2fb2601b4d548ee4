"""The optimizer of a run: fused AdamW (the paper's Adam), or Muon for the blocks' matrices with AdamW for the rest
(train.optimizer, training/optimisation/muon.py), and the device-side skip of a non-finite step that both take."""
import torch

from training.optimisation import muon


def make_optimizer(model, tr):
    """Adam(W) (weight_decay 0 = Adam, as in the paper), fused: one kernel for all weights per step on CUDA, and
    the kernel that takes a skip decision on the device (skip_update_if_nonfinite). Fused runs on CPU too, so the
    tests exercise the same optimizer as a GPU run. train.optimizer="muon": Muon for the blocks' matrices and this
    AdamW for the rest (training/optimisation/muon.py)."""
    if tr.get("optimizer", "adamw") == "muon":
        return muon.MuonAdamW(model, tr)
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters, not the frozen base
    return torch.optim.AdamW(trained, lr=tr.lr, betas=tuple(tr.betas), weight_decay=tr.weight_decay,
                             fused=True)


def skip_update_if_nonfinite(optimizer, finite, fp16=False):
    """The next optimizer.step() leaves weights and moments as they are when `finite` (0-dim bool tensor) is False,
    decided on the device so the host never waits to read it: the fused AdamW reads `found_inf` (torch's
    GradScaler mechanism) and takes back its step-count increment. Under fp16 the grad scaler sets found_inf
    itself (its own check of the unscaled gradients) and lowers its scale; accelerate then reads the scale, a
    sync fp16 keeps."""
    if not fp16:
        getattr(optimizer, "optimizer", optimizer).found_inf = (~finite).float()  # inside accelerate's wrapper
