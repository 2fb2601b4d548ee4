"""REPA, representation alignment (Yu et al., ICLR 2025, sihyun-yu/REPA), with iREPA's convolution projector and
spatial normalisation (Singh et al. 2025, End2End-Diffusion/iREPA) and HASTE's early stop (arXiv 2505.16792).

The hidden tokens after block k of the MMDiT, through a small projector, are pulled toward a frozen image
encoder's patch tokens of the same (clean) image, DINOv2-B's in the paper; the term added to the denoising loss is

    -lambda mean_n cos(projector(h_n), y_n)     (REPA eq. 8; lambda = 0.5, k = 8 of 28 blocks for SiT-XL)

per sample, logged on its own as loss_repa. The pieces, in the order a run meets them:

  sections.Repa      the objective.repa_* keys (both trainers); problems(): the start-up checks
  with_targets       the cache's encode, plus the targets of every row it encodes (objective.repa_targets="cache")
  attach             the projector on the Denoiser: it trains with the model, lives in its checkpoints, and is not
                     exported (model.export writes the transformer and conditioner only)
  Alignment          per step: the targets (the cached ones, or encoded from the batch's pixels) and the weight
  forward, terms     the model's aligned tokens, and the per-sample term

The encoder sees the image at the model's token grid times its own patch size (224 px for DINOv2-B and a 16 x 16
grid, REPA's resize), so its patch tokens and the model's tokens are the same grid, both in row-major order.
"""
import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.encoders import from_pretrained
from training.encoding import human_bytes

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # REPA's normalisation for DINOv2
SPATIAL_GAMMA = 0.6  # iREPA's spatial normalisation: y - gamma mean_n(y), over std_n (its default zscore_alpha)


# ----------------------------------------------------------------------------------------------------------
# The frozen encoder and its targets.


def encoder_config(name):
    """The encoder's transformers config (no weights); a model that cannot be found stops with one line naming
    objective.repa_encoder (encoders.from_pretrained)."""
    from transformers import AutoConfig  # here, not at the top: seconds to import, and only REPA runs need it

    return from_pretrained("objective.repa_encoder", AutoConfig.from_pretrained, name)


def load_encoder(name, device):
    """The frozen encoder (transformers AutoModel: a hub id, or a folder written by save_pretrained), its patch
    size, width and pixel normalisation (its image processor's, else ImageNet's, which DINOv2 uses)."""
    from types import SimpleNamespace

    from transformers import AutoImageProcessor, AutoModel  # (REPA runs only)

    model = from_pretrained("objective.repa_encoder", AutoModel.from_pretrained, name)
    try:
        processor = AutoImageProcessor.from_pretrained(name)
        mean, std = processor.image_mean, processor.image_std
    except (OSError, ValueError, AttributeError):  # a folder without preprocessor_config.json
        mean, std = IMAGENET_MEAN, IMAGENET_STD
    resizes = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters  # ViT asks; DINOv2 always does
    return SimpleNamespace(model=model.to(device).eval().requires_grad_(False), patch=model.config.patch_size,
                           dim=model.config.hidden_size, resizes=resizes,
                           mean=torch.tensor(mean, device=device).view(1, 3, 1, 1),
                           std=torch.tensor(std, device=device).view(1, 3, 1, 1))


@torch.no_grad()
def encoder_targets(encoder, pixels, grid):
    """Pixels in [-1, 1] (B, 3, H, W) -> the encoder's last-layer patch tokens (B, grid^2, D), fp32: the image
    resized (bicubic, as REPA) to grid x the encoder's patch size and normalised as the encoder expects; the
    class token and any register tokens, which come first, left out."""
    side = grid * encoder.patch
    x = (pixels.float() + 1) / 2
    if x.shape[-1] != side or x.shape[-2] != side:
        x = F.interpolate(x, size=(side, side), mode="bicubic", align_corners=False)
    x = (x - encoder.mean) / encoder.std
    kwargs = {"interpolate_pos_encoding": True} if encoder.resizes else {}
    tokens = encoder.model(pixel_values=x, **kwargs).last_hidden_state
    return tokens[:, tokens.shape[1] - grid * grid:].float()


def spatial_norm(targets, gamma=SPATIAL_GAMMA):
    """iREPA's spatial normalisation of the encoder tokens (B, N, D): the mean over the tokens partly removed,
    then each channel scaled to unit std over the tokens, so the alignment transfers the spatial structure
    (which token resembles which) rather than the global content every token shares."""
    targets = targets - gamma * targets.mean(dim=1, keepdim=True)
    return targets / (targets.std(dim=1, keepdim=True) + 1e-6)


def token_grid(cfg, vae_factor=1):
    """The model's token grid side: data.resolution / (the VAE's downsampling x model.patch_size)."""
    return cfg["data"]["resolution"] // (vae_factor * cfg["model"]["patch_size"])


def with_targets(encode, cfg, vae, device, log=print):
    """The cache's encode (encoders.make_encode) plus "repa": the encoder's targets of the same pixels, stored with
    each row in data.cache_dtype, when objective.repa_targets is "cache" (else `encode` itself). The encoder is
    loaded at the first call, i.e. only on a cache miss, and says first what the targets cost on disk."""
    obj = cfg["objective"]
    if not obj.get("repa_weight") or obj["repa_targets"] != "cache":
        return encode
    grid = token_grid(cfg, 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 1)
    encoder = None

    def encode_with_targets(pixels, captions, **kwargs):
        nonlocal encoder
        if encoder is None:
            encoder = load_encoder(obj["repa_encoder"], device)
            size = grid * grid * encoder.dim * getattr(torch, cfg["data"]["cache_dtype"]).itemsize
            log(f"cache: REPA targets of {obj['repa_encoder']} stored with each row: {grid * grid} tokens x "
                f"{encoder.dim} x {size // (grid * grid * encoder.dim)} B = {human_bytes(size)} per image "
                f"(objective.repa_targets='on_the_fly' stores none, in pixel space)")
        out = encode(pixels, captions, **kwargs)
        out["repa"] = encoder_targets(encoder, pixels.to(device), grid)
        return out

    return encode_with_targets


def cache_key(cfg):
    """What the cached targets depend on, for the cache key (nothing when none are cached: old keys hold)."""
    obj = cfg["objective"]
    if not obj.get("repa_weight") or obj["repa_targets"] != "cache":
        return {}
    return {"repa": {"encoder": obj["repa_encoder"], "patch_size": cfg["model"]["patch_size"], "format": 1}}


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
        model.projector = projector(obj["repa_projector"], tc.num_attention_heads * tc.attention_head_dim,
                                    encoder_config(obj["repa_encoder"]).hidden_size, obj["repa_projector_dim"])
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
        self.encoder, self.grid = None, token_grid(cfg)
        if self.weight:
            self.conv = obj["repa_projector"] == "conv"
            if obj["repa_targets"] == "on_the_fly":  # pixel space (problems): the batch's x are the pixels
                self.encoder = load_encoder(obj["repa_encoder"], device)

    def __call__(self, batch, step):
        if not self.weight:
            return None
        if self.off is not None and step >= self.off:
            return None, 0.0
        targets = batch["repa"] if self.encoder is None else encoder_targets(self.encoder, batch["x"], self.grid)
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
    """The start-up checks (handed to the config loader by the trainers: sections.schema): the block exists, the encoder's config can be read
    and is a patch-token image model, and on-the-fly targets have pixels to encode."""
    obj, out = cfg["objective"], []
    if not obj.get("repa_weight"):
        return out
    layers = cfg["model"]["num_layers"]
    if obj["repa_block"] > layers:
        out.append(f"objective.repa_block={obj['repa_block']} is past the model's last block (model.num_layers="
                   f"{layers}): choose 1 .. {layers} (REPA: 4 of 12 blocks for B-sized models, 8 of 28 for XL)")
    try:
        enc = encoder_config(obj["repa_encoder"])
        if not isinstance(getattr(enc, "patch_size", None), int) or not hasattr(enc, "hidden_size"):
            out.append(f"objective.repa_encoder={obj['repa_encoder']!r} is a {enc.model_type!r} model, not a ViT-like "
                       f"image encoder with patch tokens (its config has no patch_size and hidden_size): use e.g. "
                       f"'facebook/dinov2-base' (the paper's)")
    except SystemExit as e:  # encoders.from_pretrained's one line, naming the key
        out.append(str(e))
    except Exception as e:
        out.append(f"objective.repa_encoder={obj['repa_encoder']!r}: its config cannot be read ({type(e).__name__}: "
                   f"{str(e).strip().splitlines()[0][:200]})")
    if obj["repa_targets"] == "on_the_fly" and cfg["encoders"]["vae"]:
        out.append("objective.repa_targets='on_the_fly' encodes the batch's pixels, and a latent cache (encoders.vae) "
                   "holds none: use 'cache' (the targets are computed once, when the cache is written)")
    return out
