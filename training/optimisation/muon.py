"""Muon (train.optimizer="muon"): PyTorch's own torch.optim.Muon for the 2-D weights inside the MMDiT blocks, the
run's fused AdamW for every other parameter, as one optimizer the trainers use as they use AdamW.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) replaces a matrix's momentum by the nearest
semi-orthogonal matrix (5 Newton-Schulz iterations in bf16), so every direction of the update moves at the same
rate. It is meant for the hidden weight matrices only; "embeddings, classifier heads, and hidden gains/biases
should be optimized using standard AdamW" (KellerJordan/Muon, README). The split, as Photoroom's PRX draws it
(training/optimizer.py there: `param.ndim == 2 and "blocks" in name`):

  Muon:  every 2-D weight of transformer.transformer_blocks: attention q/k/v/out (both streams), the MLPs, and
         each block's adaptive-norm modulation linears
  AdamW: everything else: the patch embedding (a conv), the time, pooled-text and context embedders, qk-norm
         gains, every bias, the conditioner (class tokens, control MLPs), the final norm and projection, REPA's
         projector

LRs. Muon's step is scaled by torch's adjust_lr_fn="match_rms_adamw" (Liu et al. 2025, "Muon is Scalable for LLM
Training", sec. 2.2: 0.2 sqrt(max(A, B)) gives the update the RMS of AdamW's, so Muon reuses AdamW's LR and weight
decay), which is PRX's rms_scale: PRX trains Muon and its AdamW group both at 1e-4, its AdamW baseline's LR
(configs/yamls/optimizer/muon.yaml). Hence train.muon_lr defaults to train.lr, and the AdamW group keeps the run's
AdamW settings (train.lr, train.betas, train.weight_decay), so a Muon run differs from its AdamW run only in how the
blocks' matrices are updated. Momentum 0.95 with Nesterov and 5 Newton-Schulz steps are torch's defaults, Keller
Jordan's ("typically work well. Only the learning rate and weight decay must be tuned"). The schedule (warm-up,
decay, batch scaling, a rollback's cut) multiplies both LRs alike: fit.set_lr sets train.lr x factor in the AdamW
group and lr_of(train) x factor in Muon's, both from today's config, so train.lr=0 (the AdamW group frozen) still
trains the blocks at train.muon_lr.

The skip of a non-finite step, on the device (optimizers.skip_update_if_nonfinite sets `found_inf`): the fused AdamW
skips by itself; torch.optim.Muon has no such input, so its weights and momentum buffers are copied before its step
and put back by torch.where(found_inf, copy, new) after it. No host sync. The cost: a transient copy of the Muon
group's weights and momentum (8 bytes per Muon parameter, freed after the step) and three elementwise passes over
them, small next to the 5 Newton-Schulz iterations (about 6 matmuls each per matrix). Muon keeps one fp32 buffer
per parameter (4 bytes) where Adam keeps two.

Checkpoints: one torch.optim.Optimizer whose param_groups are [Muon's, AdamW's] and whose `state` the two share, so
its state_dict is the usual one (integer parameter ids, tensors only) and checkpoints.save_checkpoint / load_checkpoint
write and read it as they do AdamW's: the momentum buffers resume exactly.

Refused at start-up (problems): a torch without torch.optim.Muon (new in 2.9; requirements.txt keeps torch>=2.6
for everything else), and train.sharding="fsdp" (Newton-Schulz needs each matrix whole; FSDP holds 1/N of it).
"""
import torch

BLOCKS = "transformer.transformer_blocks."  # the MMDiT's blocks in a Denoiser's parameter names (model/mmdit.py)
TO_ADAMW = "train.optimizer='adamw' (--train.optimizer=adamw --train.muon_lr=null where a recipe sets Muon)"


def problems(cfg):
    """What train.optimizer="muon" cannot do, each naming its keys (handed to config.load_config by the trainers)."""
    tr = cfg["train"]
    if tr.get("optimizer", "adamw") != "muon":
        if tr.get("muon_lr") is None:
            return []
        return [f"train.muon_lr={tr['muon_lr']} is Muon's LR, and train.optimizer='adamw' has no Muon group: set "
                f"train.optimizer='muon', or unset it (--train.muon_lr=null where a recipe sets it)"]
    out = []
    if not hasattr(torch.optim, "Muon"):
        out.append(f"train.optimizer='muon' needs torch.optim.Muon, new in torch 2.9, and this torch is "
                   f"{torch.__version__}: upgrade torch (pip install 'torch>=2.9'), or use {TO_ADAMW}")
    if tr.get("sharding", "ddp") == "fsdp":
        out.append("train.optimizer='muon' with train.sharding='fsdp': Muon orthogonalises each weight matrix whole, "
                   f"and FSDP holds 1/N of it on each GPU; use train.sharding='ddp', or {TO_ADAMW}")
    return out


def lr_of(tr):
    """Muon's LR before the schedule: train.muon_lr, or train.lr when it is unset."""
    return tr["lr"] if tr.get("muon_lr") is None else tr["muon_lr"]


def split(model):
    """([(name, parameter)] for Muon, [(name, parameter)] for AdamW): the blocks' 2-D weights, and the rest."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if name.startswith(BLOCKS) and p.ndim == 2 else adamw).append((name, p))
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the blocks' matrices and fused torch.optim.AdamW on the rest, stepped together; their
    param_groups ([Muon's, AdamW's]) and state are this optimizer's, so set_lr, zero_grad, state_dict, step hooks
    and accelerate's wrapper see one optimizer."""

    def __init__(self, model, tr):
        muon, adamw = split(model)
        self.muon = torch.optim.Muon([p for _, p in muon], lr=lr_of(tr), weight_decay=tr["weight_decay"],
                                     momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([p for _, p in adamw], lr=tr["lr"], betas=tuple(tr["betas"]),
                                       weight_decay=tr["weight_decay"], fused=True)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})  # the same group dicts
        self.link()

    def link(self):
        """The two optimizers work on this one's groups and state (after __init__ and after load_state_dict,
        which replaces both)."""
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:1], self.param_groups[1:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        """Both optimizers' step. With `found_inf` set (a 0-dim float tensor, 1: skip), the step leaves every weight
        and every state tensor as it was when found_inf is 1, decided on the device."""
        found_inf = getattr(self, "found_inf", None)
        self.adamw.found_inf = found_inf  # the fused kernel skips, and takes back its step count
        if found_inf is None:
            self.muon.step()
            return self.adamw.step()
        params = [p for p in self.param_groups[0]["params"] if p.grad is not None]
        for p in params:  # created now, as Muon's first step would, so that it can be put back
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        tensors = [t for p in params for t in (p, self.state[p]["momentum_buffer"])]
        kept = [t.clone() for t in tensors]
        self.muon.step()
        skip = found_inf.bool()
        for new, old in zip(tensors, kept):
            new.copy_(torch.where(skip, old, new))
        return self.adamw.step()

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != 2 or "ns_steps" not in groups[0]:
            raise ValueError("the optimizer state being loaded is not train.optimizer='muon''s (a Muon group and an "
                             "AdamW group): resume the run with the train.optimizer it was started with, or start a "
                             "new run from its weights with init_from")
        super().load_state_dict(state_dict)  # the checkpoint's LRs, until fit.set_lr sets today's
        self.link()
