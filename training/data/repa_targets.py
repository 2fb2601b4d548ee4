"""REPA's targets (training/objectives/repa.py is the alignment itself): a frozen image encoder's patch tokens of
each clean image, DINOv2-B's in the paper (Yu et al., ICLR 2025), stored with the cache's rows when
objective.repa_targets is "cache" (with_targets, and their part of the cache key), or encoded from each batch's
pixels ("on_the_fly"). The encoder is frozen, as the VAE and the text encoder are (encoders.py), and sees the image
at the model's token grid times its own patch size (224 px for DINOv2-B and a 16 x 16 grid, REPA's resize), so
its patch tokens and the model's tokens are the same grid, both in row-major order.
"""
import inspect

import torch
import torch.nn.functional as F

from training.data.encoders import from_pretrained
from training.data.encoding import human_bytes

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # REPA's normalisation for DINOv2


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


