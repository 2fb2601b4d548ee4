"""REPA, representation alignment (Yu et al., ICLR 2025, sihyun-yu/REPA), with iREPA's convolution projector and
spatial normalisation (Singh et al. 2025, End2End-Diffusion/iREPA) and HASTE's early stop (arXiv 2505.16792).

The hidden tokens after block k of the MMDiT, through a small projector, are pulled toward a frozen image
encoder's patch tokens of the same (clean) image, DINOv2-B's in the paper; the term added to the denoising loss is

    -lambda mean_n cos(projector(h_n), y_n)     (REPA eq. 8; lambda = 0.5, k = 8 of 28 blocks for SiT-XL)

per sample, logged on its own as loss_repa. The pieces, in the order a run meets them:

  sections.Repa      the objective.repa_* keys (both trainers); problems(): the start-up checks
  repa_targets       the frozen encoder and its targets, stored with the cache's rows (objective.repa_targets=
                     "cache"): training/data/repa_targets.py, a part of the data stage
  attach             the projector on the Denoiser: it trains with the model, lives in its checkpoints, and is not
                     exported (the export writes the transformer and conditioner only)
  Alignment          per step: the targets (the cached ones, or encoded from the batch's pixels) and the weight
  forward, terms     the model's aligned tokens, and the per-sample term
"""
import math

import torch.nn as nn
import torch.nn.functional as F

from training.data import repa_targets, sd3_base

SPATIAL_GAMMA = 0.6  # iREPA's spatial normalisation: y - gamma mean_n(y), over std_n (its default zscore_alpha)


# ----------------------------------------------------------------------------------------------------------
# The targets, as the loss reads them.


def spatial_norm(targets, gamma=SPATIAL_GAMMA):
    """iREPA's spatial normalisation of the encoder tokens (B, N, D): the mean over the tokens partly removed,
    then each channel scaled to unit std over the tokens, so the alignment transfers the spatial structure
    (which token resembles which) rather than the global content every token shares."""
    targets = targets - gamma * targets.mean(dim=1, keepdim=True)
    return targets / (targets.std(dim=1, keepdim=True) + 1e-6)


# ----------------------------------------------------------------------------------------------------------
# The projector, on the model.


class TokenConv(nn.Module):
    """iREPA's projector: a 3 x 3 convolution over the token grid (row-major tokens), instead of REPA's MLP,
    which sees each token alone."""

    def __init__(self, width, dim):
        super().__init__()
        self.conv = nn.Conv2d(width, dim, kernel_size=3, padding=1)

    def forward(self, tokens):
        b, n, d = tokens.shape
        g = math.isqrt(n)
        return self.conv(tokens.transpose(1, 2).reshape(b, d, g, g)).flatten(2).transpose(1, 2)


def projector(kind, width, dim, hidden):
    """mlp: REPA's build_mlp (Linear, SiLU, Linear, SiLU, Linear; hidden 2048 there); conv: iREPA's."""
    if kind == "conv":
        return TokenConv(width, dim)
    return nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                         nn.Linear(hidden, dim))


def attach(model, cfg):
    """With REPA on, the Denoiser gets its projector (model.projector, trained and checkpointed with it) and the
    block whose output it reads (model.align_block, 1-based). Reads only the encoder's config."""
    obj = cfg["objective"]
    if obj.get("repa_weight"):
        tc = model.transformer.config
        dim = repa_targets.encoder_config(obj["repa_encoder"]).hidden_size
        model.projector = projector(obj["repa_projector"], tc.num_attention_heads * tc.attention_head_dim, dim,
                                    obj["repa_projector_dim"])
        model.align_block = obj["repa_block"]
    return model


# ----------------------------------------------------------------------------------------------------------
# In the training loop.


class Alignment:
    """align(batch, step): None with REPA off; else (targets, weight): the batch's targets (the cache's "repa",
    or encoded now from its pixels, objective.repa_targets="on_the_fly"), spatially normalised for the conv
    projector, and the term's weight; from objective.repa_off_step on (HASTE) (None, 0.0). Host values only:
    no device sync."""

    def __init__(self, cfg, device):
        obj = cfg["objective"]
        self.weight, self.off, self.conv = obj.get("repa_weight", 0.0), obj.get("repa_off_step"), None
        self.encoder, self.grid = None, repa_targets.token_grid(cfg)
        if self.weight:
            self.conv = obj["repa_projector"] == "conv"
            if obj["repa_targets"] == "on_the_fly":  # pixel space (problems): the batch's x are the pixels
                self.encoder = repa_targets.load_encoder(obj["repa_encoder"], device)

    def __call__(self, batch, step):
        if not self.weight:
            return None
        if self.off is not None and step >= self.off:
            return None, 0.0
        targets = batch["repa"] if self.encoder is None else \
            repa_targets.encoder_targets(self.encoder, batch["x"], self.grid)
        return spatial_norm(targets) if self.conv else targets, self.weight


def forward(model, align, *args):
    """(model(*args), None), or with REPA on (align not None) (output, the projected tokens of the aligned
    block) from the same pass (Denoiser.forward's `align`)."""
    return model(*args, align=True) if align is not None else (model(*args), None)


def terms(tokens, align):
    """{"repa": per-sample -weight mean_n cos(tokens_n, targets_n)}, {} with REPA off. Switched off (HASTE) the
    term is a zero that still reaches the projector: every parameter keeps a gradient (DDP waits for each) and
    the compiled forward stays the one graph."""
    if align is None:
        return {}
    targets, weight = align
    if targets is None:
        return {"repa": tokens.float().sum(dim=(1, 2)) * 0.0}
    return {"repa": -weight * F.cosine_similarity(tokens.float(), targets.float(), dim=-1).mean(dim=1)}


def problems(cfg):
    """The start-up checks (handed to the config loader by the trainers: sections.schema): the block exists, the
    encoder's config can be read and is a patch-token image model, and on-the-fly targets have pixels to encode."""
    obj, out = cfg["objective"], []
    if not obj.get("repa_weight"):
        return out
    base = sd3_base.is_base(cfg.get("init_from"))  # an SD3-family base brings its own depth; model.* is not read
    layers = sd3_base.transformer_config(cfg["init_from"])["num_layers"] if base else cfg["model"]["num_layers"]
    if obj["repa_block"] > layers:
        depth = f"init_from={cfg['init_from']!r} has {layers} blocks" if base else f"model.num_layers={layers}"
        out.append(f"objective.repa_block={obj['repa_block']} is past the model's last block ({depth}): choose "
                   f"1 .. {layers} (REPA: 4 of 12 blocks for B-sized models, 8 of 28 for XL)")
    try:
        enc = repa_targets.encoder_config(obj["repa_encoder"])
        if not isinstance(getattr(enc, "patch_size", None), int) or not hasattr(enc, "hidden_size"):
            out.append(f"objective.repa_encoder={obj['repa_encoder']!r} is a {enc.model_type!r} model, not a ViT-like "
                       f"image encoder with patch tokens (its config has no patch_size and hidden_size): use e.g. "
                       f"'facebook/dinov2-base' (the paper's)")
    except SystemExit as e:  # encoders.from_pretrained's one line, naming the key
        out.append(str(e))
    except Exception as e:
        out.append(f"objective.repa_encoder={obj['repa_encoder']!r}: its config cannot be read ({type(e).__name__}: "
                   f"{str(e).strip().splitlines()[0][:200]})")
    if cfg["data"].get("buckets"):
        out.append("objective.repa_weight with data.buckets: REPA's targets are one square grid of encoder patch "
                   "tokens per image, and a bucket's token grid is not square; set objective.repa_weight=0 or "
                   "data.buckets=null")
    if obj["repa_targets"] == "on_the_fly" and cfg["encoders"]["vae"]:
        out.append("objective.repa_targets='on_the_fly' encodes the batch's pixels, and a latent cache (encoders.vae) "
                   "holds none: use 'cache' (the targets are computed once, when the cache is written)")
    return out
