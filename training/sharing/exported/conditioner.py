"""The conditioner of a model trained with minimal-diffusion, as a diffusers model: the file an exported pipeline
folder holds in conditioner/ (diffusers loads it from there; trust_remote_code=True). It imports nothing from the
repository that trained it, so the folder samples where only torch and diffusers are installed.

It is training/model/mmdit.py's Conditioner in inference form (no condition dropout drawn, padding copies without
noise), with the same parameter names, so the trained weights load one to one; tests/test_export_pipeline.py
holds the two equal. It maps a batch's conditions to (context tokens, pooled vector, adaptive-norm addition):
classes (or the text encoder's tokens) go to the MMDiT's context stream, the controls (size, crop, flip) to the
adaptive norm with a weight w(t) per control (Berrada et al. 2024).
"""
import math

import torch
import torch.nn as nn
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps

CONTROL_FIELDS = {"size": "orig_hw", "crop": "crop_box", "flip": "flip"}  # control -> its condition field
CONTROL_SCALARS = {"size": 2, "crop": 3, "flip": 1}  # crop: (top, left, side) / short side, so no pixel count
CROP_UNITS = 1000  # the relative crop in thousandths of the short side


def control_values(name, cond):
    """(B, n) scalars of a control: size (h, w) in pixels; crop (top, left, side) / the original's short side,
    from crop_box (top, left, height, width) in original pixels and orig_hw; flip 0 or 1."""
    values = cond[CONTROL_FIELDS[name]]
    values = values.reshape(len(values), -1).float()
    if name == "crop":
        short = cond["orig_hw"].reshape(len(values), 2).float().min(1, keepdim=True).values.clamp(min=1)
        values = torch.cat([values[:, :2], values[:, 2:4].min(1, keepdim=True).values], 1) / short * CROP_UNITS
    return values


def sinusoidal(values, dim=64):
    """Each scalar -> `dim` sin/cos features at geometric frequencies (as SDXL embeds size and crop)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=values.device) / half)
    args = values.float()[..., None] * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1).flatten(1)


def control_weight(noise_level, power):
    """w(t) = cos(pi t / 2)^p, t = 1 at pure noise: a low-level control (p > 0) acts late, p = 0 from the start."""
    return torch.cos(math.pi / 2 * noise_level.float().clamp(0, 1)).clamp(min=0) ** power


def replicate_padding(tokens, mask):
    """Padded text positions j >= n take a copy of real token j mod n (the noise of training left out)."""
    n = mask.sum(1).long().clamp(min=1)
    source = torch.arange(tokens.shape[1], device=tokens.device)[None] % n[:, None]
    copies = tokens.gather(1, source[..., None].expand_as(tokens))
    return torch.where(mask[..., None].bool(), tokens, copies)


class Conditioner(ModelMixin, ConfigMixin):
    """cond -> (context, pooled, adaptive-norm addition). `cond` holds "label" (class index; num_classes is the
    null class of guidance) or "text_tokens", "text_mask", "text_pooled"; "drop" (bool per sample: the null
    semantic condition), optionally "drop_controls", and the controls' fields (orig_hw, crop_box, flip).
    mode: "disentangled" (classes through attention, the paper's), "both" (attention and the adaptive norm) or
    "adanorm" (DiT / SDXL). class_ids and class_names name the classes in index order. interval: a MeanFlow model's
    second time, "interval" in cond (t - r in timestep units; absent: 0), embedded as SD3 embeds t and added to the
    adaptive norm: of every block, or with interval_blocks K (Decoupled MeanFlow) of the last K blocks and the final
    norm only, which the pipeline adds (`interval`)."""

    @register_to_config
    def __init__(self, num_classes=0, class_tokens=1, context_dim=64, pooled_dim=64, width=64, text_tokens=0,
                 controls=None, mode="disentangled", replicate_padding=False, pooled_text=False, class_ids=None,
                 class_names=None, interval=False, interval_blocks=None, zero_padding=False):
        super().__init__()
        self.controls = dict(controls or {})
        if num_classes and mode != "adanorm":
            self.class_embed = nn.Embedding((num_classes + 1) * class_tokens, context_dim)
        if num_classes and mode != "disentangled":
            self.class_vector = nn.Embedding(num_classes + 1, width)
        if num_classes and mode == "adanorm":
            self.null_context = nn.Parameter(torch.zeros(1, class_tokens, context_dim))
        if text_tokens:  # the empty prompt's encoding: the dropped condition of guidance
            self.register_buffer("null_tokens", torch.zeros(text_tokens, context_dim))
            self.register_buffer("null_mask", torch.zeros(text_tokens))
            self.register_buffer("null_pooled", torch.zeros(pooled_dim))
        self.control_mlp = nn.ModuleDict({name: nn.Sequential(nn.Linear(64 * CONTROL_SCALARS[name], width), nn.SiLU(),
                                                              nn.Linear(width, width)) for name in self.controls})
        if interval:  # MeanFlow: the average velocity's interval t - r
            self.interval_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
            self.interval_embed = TimestepEmbedding(256, width)

    def forward(self, cond, noise_level):
        c, drop, adanorm = self.config, cond["drop"], 0
        if "text_tokens" in cond:
            tokens = torch.where(drop[:, None, None], self.null_tokens.to(cond["text_tokens"]), cond["text_tokens"])
            pooled = torch.where(drop[:, None], self.null_pooled.to(cond["text_pooled"]), cond["text_pooled"])
            if c.replicate_padding or c.zero_padding:
                mask = torch.where(drop[:, None], self.null_mask.to(cond["text_mask"]), cond["text_mask"])
                zeros = tokens * mask[..., None].to(tokens.dtype)  # zero_padding: the padded positions hold zeros
                tokens = zeros if c.zero_padding else replicate_padding(tokens, mask)
            context = tokens
            if not c.pooled_text:
                pooled = torch.zeros_like(pooled)
        else:
            label = torch.where(drop, c.num_classes, cond["label"])
            pooled = torch.zeros(len(label), c.pooled_dim, device=label.device)
            if c.mode == "adanorm":
                context = self.null_context.expand(len(label), -1, -1)
            else:
                ids = label[:, None] * c.class_tokens + torch.arange(c.class_tokens, device=label.device)
                context = self.class_embed(ids)
            if c.mode != "disentangled":
                adanorm = self.class_vector(label)
        keep = ~cond["drop_controls"] if "drop_controls" in cond else torch.ones_like(drop)
        for name, power in self.controls.items():
            w = torch.ones_like(noise_level) if c.mode == "adanorm" else control_weight(noise_level, power)
            emb = self.control_mlp[name](sinusoidal(control_values(name, cond)))
            adanorm = adanorm + emb * (w.float() * keep)[:, None]
        if c.interval and not c.interval_blocks:
            adanorm = adanorm + self.interval(cond, noise_level)
        return context, pooled, adanorm

    def interval(self, cond, noise_level):
        """The embedding of a MeanFlow model's interval t - r (absent: 0, r = t)."""
        gap = cond["interval"] if "interval" in cond else torch.zeros_like(noise_level)
        return self.interval_embed(self.interval_proj(gap).to(self.interval_embed.linear_1.weight.dtype))
