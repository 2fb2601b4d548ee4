"""The conditioned MMDiT: diffusers' SD3Transformer2DModel plus the paper's conditioner, guidance, its build, and
the model an export holds read back (load_exported). The run's model at its start (REPA's projector, the EMA,
resume or init_from) is training/run/start.py's; what init_from does to the tensors, transfer.py's.

Conditioning (Berrada et al. 2024, our reading): semantic conditions (class tokens or text tokens) enter the
MMDiT's context stream, i.e. act through attention; control metadata (size, crop, flip) is embedded and added
to the adaptive-norm vector with a weight w(t) per control: low-level ones (size) 0 at pure noise and 1 at
data, high-level ones (crop, flip) 1 from the start. Guidance acts on each. The baselines (conditioning.mode):
adanorm (DiT / SDXL) and both (MMDiT-native: the class in attention and in the adaptive norm).
No objective and no sampler live here: those are each trainer's own.
"""
import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from training.config import config
from training.data import sd3_base
from training.model import lora

# ----------------------------------------------------------------------------------------------------------
# Conditioning: class tokens or text tokens go to the MMDiT's context stream (attention); the pooled
# vector goes to its adaptive-norm input.


CONTROL_FIELDS = {"size": "orig_hw", "crop": "crop_box", "flip": "flip"}  # control -> cached metadata
# Scalars each control's MLP reads. The crop is 3 (top, left, side relative to the original's short side), not the
# 4 pixel values it was before issue 42: an older checkpoint's crop MLP then fails to load with a shape error
# instead of silently reading pixels as fractions (docs/paper.md, "The crop control carries no size").
CONTROL_SCALARS = {"size": 2, "crop": 3, "flip": 1}
CROP_UNITS = 1000  # the relative crop in thousandths of the short side: the range sinusoidal() resolves, as pixels


def control_values(name, cond):
    """The scalars control `name` embeds, (B, CONTROL_SCALARS[name]). Size: the original (h, w) in pixels. Crop:
    where and how much of the image is shown, (top, left, side) / the original's short side, computed here from
    the cached pixel box and orig_hw (so caches stay valid): the crop carries no pixel count, and the original
    size reaches the model only through its own, gated, control (issue 42: with the pixel box, a whole-image crop
    of an 8 px original said "8 px" ungated from pure noise). Flip: 0 or 1."""
    values = cond[CONTROL_FIELDS[name]]
    values = values.reshape(len(values), -1).float()
    if name == "crop":
        short = cond["orig_hw"].reshape(len(values), 2).float().min(1, keepdim=True).values.clamp(min=1)
        # (top, left, the crop's short side): a square crop's side; a bucket's crop (data.buckets) keeps the
        # image's whole short side when the two aspects agree, so 1000 says "uncropped" at any shape
        values = torch.cat([values[:, :2], values[:, 2:4].min(1, keepdim=True).values], 1) / short * CROP_UNITS
    return values


def sinusoidal(values, dim=64):
    """Each scalar -> `dim` sin/cos features at geometric frequencies (as SDXL embeds its size and crop
    conditions); (B, n) -> (B, n * dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=values.device) / half)
    args = values.float()[..., None] * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1).flatten(1)


def control_weight(noise_level, power):
    """w(t) = cos(pi t / 2)^p with t = 1 at pure noise: for p > 0, 0 at pure noise and 1 at clean data, monotone
    in between, so a low-level control (size) acts only late in denoising, once the layout that semantics decide
    is in place; p = 0 gives w = 1 at every t (0^0 = 1), a high-level control (crop, flip) acting from the start
    (Berrada et al. 2024, as summarised in ../docs/paper.md: a cosine schedule on the control embedding, low-level
    augmentations late, high-level ones early; the per-control powers are our reading)."""
    return torch.cos(math.pi / 2 * noise_level.float().clamp(0, 1)).clamp(min=0) ** power


def zero_padding(tokens, mask):
    """The baseline of noisy replicate padding (conditioning.zero_padding): padded positions j >= n hold zeros, so
    after the context projection every one is the same constant (its bias), whatever the caption."""
    return tokens * mask[..., None].to(tokens.dtype)


def replicate_padding(tokens, mask, noise_std):
    """Noisy replicate padding (Berrada et al. 2024): padded positions j >= n take a copy of real token
    j mod n plus Gaussian noise, instead of the encoder's pad embeddings, so attention over the padding
    carries the prompt rather than an uninformative constant. The noise std is noise_std x the RMS of the
    sample's real tokens, so one setting suits CLIP and T5 features alike. Real tokens are left untouched.
    noise_std = 0: the copies alone (the Conditioner's eval mode), and no random number is drawn."""
    n = mask.sum(1).long().clamp(min=1)
    source = torch.arange(tokens.shape[1], device=tokens.device)[None] % n[:, None]
    copies = tokens.gather(1, source[..., None].expand_as(tokens))
    rms = ((tokens.float().pow(2) * mask[..., None]).sum((1, 2)) / (n * tokens.shape[2])).sqrt()
    if noise_std:
        copies = copies + noise_std * rms[:, None, None].to(tokens.dtype) * torch.randn_like(copies)
    return torch.where(mask[..., None].bool(), tokens, copies)


MODES = ("disentangled", "both", "adanorm")


class Conditioner(nn.Module):
    """Maps a batch's conditions to (context tokens, pooled vector, adaptive-norm addition) for the MMDiT.

    Semantics (mode "disentangled", the paper's): a class label c becomes `class_tokens` learned tokens in
    the context stream, i.e. it acts through attention; label == num_classes is the null class of guidance.
    Text: the cached encoder features, a dropped caption replaced by the empty prompt's encoding (as SD3); the
    pooled text vector reaches the adaptive norm only if `pooled_text` (the paper's reading: not in this mode).
    Controls (size, crop, flip): sinusoidal features and a small MLP each, added to the adaptive-norm vector
    with the weight w(t) of `control_weight` (per-control power). The baselines the paper compares against:
    "adanorm" (DiT / SDXL), class embedding and controls summed into the adaptive-norm vector with w = 1, the
    context stream holding one constant token; "both" (MMDiT / SD3-native), the class tokens in the context
    stream and a class vector in the adaptive norm, controls as in "disentangled". Every class path starts at
    N(0, 0.02) (DiT's initialisation of its label table), so no arm starts with a head start.
    MeanFlow (`interval`; training/objectives/meanflow.py): the network's second time, the interval t - r over which
    it averages the velocity, as cond["interval"] in timestep units (1000 (t - r); absent: 0, r = t), embedded as
    SD3 embeds t (sinusoids, then an MLP) and added to the adaptive-norm vector: the paper's best time input,
    (t, t - r) (Geng et al. 2025, its ablations, Tab. 1). Its last layer starts at zero, so a flow-matching model that
    init_from starts a MeanFlow run from is, before the first step, exactly that model at every (r, t). With
    `interval_blocks` K (objective.meanflow_interval_blocks, Decoupled MeanFlow) the forward leaves it out of the
    vector and the Denoiser adds it (`interval`) for the last K blocks and the final norm only.
    """

    def __init__(self, num_classes, class_tokens, context_dim, pooled_dim, width, text_tokens=0,
                 controls=None, mode="disentangled", padding_noise=None, pooled_text=None, interval=False,
                 interval_blocks=None, zero_padding=False):
        super().__init__()
        self.interval_blocks, self.zero_padding = interval_blocks, zero_padding
        if mode not in MODES:
            raise ValueError(f"conditioning.mode must be one of {MODES}, got {mode!r}")
        self.num_classes, self.class_tokens, self.pooled_dim = num_classes, class_tokens, pooled_dim
        self.mode, self.padding_noise, self.controls = mode, padding_noise, dict(controls or {})
        self.pooled_text = mode != "disentangled" if pooled_text is None else pooled_text
        if num_classes and mode != "adanorm":  # the class through attention
            self.class_embed = nn.Embedding((num_classes + 1) * class_tokens, context_dim)
            nn.init.normal_(self.class_embed.weight, std=0.02)
        if num_classes and mode != "disentangled":  # the class in the adaptive norm
            self.class_vector = nn.Embedding(num_classes + 1, width)
            nn.init.normal_(self.class_vector.weight, std=0.02)  # as the class tokens (nn.Embedding's own: N(0, 1))
        if num_classes and mode == "adanorm":  # the context stream holds one constant token
            self.null_context = nn.Parameter(torch.randn(1, class_tokens, context_dim) * 0.02)
        if text_tokens:
            self.register_buffer("null_tokens", torch.zeros(text_tokens, context_dim))
            self.register_buffer("null_mask", torch.zeros(text_tokens))
            self.register_buffer("null_pooled", torch.zeros(pooled_dim))
        self.control_mlp = nn.ModuleDict()
        for name in self.controls:
            mlp = nn.Sequential(nn.Linear(64 * CONTROL_SCALARS[name], width), nn.SiLU(), nn.Linear(width, width))
            nn.init.zeros_(mlp[2].weight), nn.init.zeros_(mlp[2].bias)  # controls start as a no-op
            self.control_mlp[name] = mlp
        self.interval_proj, self.interval_embed = None, None
        if interval:  # MeanFlow's t - r, embedded as SD3's time (CombinedTimestepTextProjEmbeddings)
            from diffusers.models.embeddings import TimestepEmbedding, Timesteps

            self.interval_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
            self.interval_embed = TimestepEmbedding(256, width)
            nn.init.zeros_(self.interval_embed.linear_2.weight), nn.init.zeros_(self.interval_embed.linear_2.bias)

    def forward(self, cond, noise_level):
        drop, adanorm = cond["drop"], 0
        if "text_tokens" in cond:
            tokens = torch.where(drop[:, None, None], self.null_tokens.to(cond["text_tokens"]), cond["text_tokens"])
            pooled = torch.where(drop[:, None], self.null_pooled.to(cond["text_pooled"]), cond["text_pooled"])
            if self.padding_noise is not None or self.zero_padding:
                mask = torch.where(drop[:, None], self.null_mask.to(cond["text_mask"]), cond["text_mask"])
                # The noise is a training-time regulariser: in eval mode (validation, sampling, FID) the copies
                # come without it, so sampling is deterministic, both guidance branches see the same padding,
                # and the validation loss does not depend on the training RNG.
                tokens = zero_padding(tokens, mask) if self.zero_padding else \
                    replicate_padding(tokens, mask, self.padding_noise if self.training else 0.0)
            context = tokens
            if not self.pooled_text:  # conditioning.pooled_text: the adaptive norm sees time and controls only
                pooled = torch.zeros_like(pooled)
        else:
            label = torch.where(drop, self.num_classes, cond["label"])
            pooled = torch.zeros(len(label), self.pooled_dim, device=label.device)
            if self.mode == "adanorm":
                context = self.null_context.expand(len(label), -1, -1)
            else:
                ids = label[:, None] * self.class_tokens + torch.arange(self.class_tokens, device=label.device)
                context = self.class_embed(ids)
            if self.mode != "disentangled":
                adanorm = self.class_vector(label)
        keep = ~cond["drop_controls"] if "drop_controls" in cond else torch.ones_like(drop)
        for name, power in self.controls.items():
            w = torch.ones_like(noise_level) if self.mode == "adanorm" else control_weight(noise_level, power)
            emb = self.control_mlp[name](sinusoidal(control_values(name, cond)))
            adanorm = adanorm + emb * (w.float() * keep)[:, None]
        if self.interval_embed is not None and not self.interval_blocks:  # MeanFlow's t - r, in every block
            adanorm = adanorm + self.interval(cond, noise_level)
        return context, pooled, adanorm

    def interval(self, cond, noise_level):
        """MeanFlow: the embedding of the interval t - r (absent: r = t, the velocity at t)."""
        gap = cond["interval"] if "interval" in cond else torch.zeros_like(noise_level)
        return self.interval_embed(self.interval_proj(gap).to(self.interval_embed.linear_1.weight.dtype))


class Denoiser(nn.Module):
    """The trained module: MMDiT plus conditioner, so DDP, EMA, checkpoints and export see one thing.

    `timestep` is what diffusers' MMDiT expects, a float in [0, 1000]; `noise_level` in [0, 1] (1 = pure
    noise) drives the control schedule and defaults to timestep / 1000. The forward is the transformer's own
    (SD3Transformer2DModel.forward: patch embedding, time/pooled embedding, context projection, joint blocks,
    final norm, unpatchify) written out with its modules, so that the conditioner's adaptive-norm addition is
    added, in plain sight, to the vector every block's AdaLayerNorm reads. Nothing is kept on the module
    between calls (torch.compile sees one pure function), and the transformer stays a stock diffusers model:
    its weights, state-dict keys and export are diffusers'. tests/test_core.py checks this forward against
    diffusers' own. With REPA on (training/objectives/repa.py attaches `projector` and `align_block`), align=True also
    returns the projected tokens after block `align_block`, from the same pass. MeanFlow's interval placed in the
    last K blocks (conditioner.interval_blocks; Decoupled MeanFlow): those blocks and the final norm read the vector
    with the interval's embedding added, the blocks before them the vector without it, as the flow-matching model.
    """

    def __init__(self, transformer, conditioner):
        super().__init__()
        self.transformer, self.conditioner = transformer, conditioner
        self.projector, self.align_block = None, None
        self.register_load_state_dict_pre_hook(drop_projector)

    def forward(self, x, timestep, cond, noise_level=None, align=False):
        noise_level = timestep / 1000 if noise_level is None else noise_level
        context, pooled, adanorm = self.conditioner(cond, noise_level)
        mmdit, (height, width) = self.transformer, x.shape[-2:]
        tokens = mmdit.pos_embed(x).contiguous()  # patches + sin-cos positions, (B, N, D)
        temb = mmdit.time_text_embed(timestep, pooled)  # time + pooled vector: the adaptive-norm input
        if torch.is_tensor(adanorm):  # controls (and the baseline's class vector) join it here
            temb = temb + adanorm.to(temb.dtype)
        late, blocks = self.conditioner.interval_blocks, mmdit.transformer_blocks  # MeanFlow's interval: last K only
        late_temb = temb + self.conditioner.interval(cond, noise_level).to(temb.dtype) if late else temb
        context = mmdit.context_embedder(context)
        checkpointing = mmdit.gradient_checkpointing and torch.is_grad_enabled()  # train.gradient_checkpointing
        aligned = None  # REPA: the tokens after block align_block
        for i, block in enumerate(blocks, 1):
            vector = late_temb if late and i > len(blocks) - late else temb
            if checkpointing:  # recompute the block in backward instead of keeping its activations
                context, tokens = torch.utils.checkpoint.checkpoint(block, tokens, context, vector, use_reentrant=False)
            else:
                context, tokens = block(hidden_states=tokens, encoder_hidden_states=context, temb=vector)
            aligned = tokens if i == self.align_block else aligned
        tokens = mmdit.proj_out(mmdit.norm_out(tokens, late_temb))  # (B, N, p * p * C)
        p, c = mmdit.config.patch_size, mmdit.out_channels
        tokens = tokens.reshape(len(x), height // p, width // p, p, p, c)
        out = torch.einsum("nhwpqc->nchpwq", tokens).reshape(len(x), c, height, width)
        return (out, self.projector(aligned)) if align else out


TRAINING_ONLY = ("projector.",)  # parts of the trained Denoiser that the export leaves out: REPA's projector


def exported_parameters(model):
    """[(name, parameter)] of what the export holds: every parameter but the training-only parts', so what is
    averaged for export (the post-hoc EMA profiles) matches the model that evaluation and sampling rebuild."""
    return [(name, p) for name, p in model.named_parameters() if not name.startswith(TRAINING_ONLY)]


def drop_projector(module, state, prefix, *args):
    """A REPA run's weights load into a model without the projector (evaluation, sampling, init_from's source):
    the projector's tensors are left out of `state` before the strict key check."""
    if module.projector is None:
        for key in [k for k in state if k.startswith(tuple(prefix + part for part in TRAINING_ONLY))]:
            del state[key]


def rescale_guidance(out, out_c, phi):
    """Guidance rescale (Lin et al. 2024, sec. 3.4; diffusers' rescale_noise_cfg): per sample,
    out <- phi out std(out_c) / std(out) + (1 - phi) out, which undoes the over-exposure that a large
    guidance scale causes with zero terminal SNR. out_c: the fully conditional prediction; phi = 0: off."""
    if phi == 0:
        return out
    dims = list(range(1, out.dim()))
    return phi * out * (out_c.std(dim=dims, keepdim=True) / out.std(dim=dims, keepdim=True)) + (1 - phi) * out


def guided(model, x, timestep, cond, semantic_scale=1.0, control_scale=0.0, noise_level=None, rescale=0.0):
    """Guidance on both condition kinds (Ho & Salimans 2022, extended as in Brooks et al. 2023):
        out = m(null, k) + s (m(c, k) - m(null, k)) + s_k (m(c, k) - m(c, null_k))
    where c is the semantic condition, k the controls, s = semantic_scale, s_k = control_scale. With s_k = 0
    it is standard classifier-free guidance; s = 1, s_k = 0 is the plain conditional model (one pass).
    `rescale` is phi of rescale_guidance (DDPM with zero terminal SNR uses it)."""
    branches = [(False, False)] + [(True, False)] * (semantic_scale != 1) + [(False, True)] * (control_scale != 0)
    if len(branches) == 1:
        return model(x, timestep, cond, noise_level).float()
    n, k = len(x), len(branches)
    batch = {key: torch.cat([v] * k) for key, v in cond.items() if key not in ("drop", "drop_controls")}
    batch["drop"] = torch.cat([cond["drop"] | d for d, _ in branches])
    batch["drop_controls"] = torch.cat([torch.full((n,), dc, device=x.device) for _, dc in branches])
    repeat = (lambda v: None if v is None else torch.cat([v.expand(n)] * k))
    out = model(torch.cat([x] * k), repeat(timestep), batch, repeat(noise_level)).float().chunk(k)
    result = out[0] if semantic_scale == 1 else out[1] + semantic_scale * (out[0] - out[1])
    result = result + control_scale * (out[0] - out[-1]) if control_scale != 0 else result
    return rescale_guidance(result, out[0], rescale)


def make_conditioner(cfg, width, context_dim, pooled_dim, text_tokens=0):
    c = cfg["conditioning"]
    unknown = set(c["controls"]) - set(CONTROL_FIELDS)
    if unknown:
        raise ValueError(f"conditioning.controls: unknown {sorted(unknown)}; choose from {sorted(CONTROL_FIELDS)}")
    num_classes = cfg["data"]["num_classes"] if cfg["data"]["label_column"] and not text_tokens else 0
    meanflow = bool(cfg["objective"].get("meanflow"))  # MeanFlow's second time, t - r (DDPM: no such key)
    if num_classes is None:  # the trainers read it from the data (sources.open_splits) before building the model
        raise ValueError("data.num_classes is unset: set it to build a class-conditional model outside a trainer")
    return Conditioner(num_classes, cfg["model"]["class_tokens"], context_dim, pooled_dim, width, text_tokens,
                       {name: c["control_power"][name] for name in c["controls"]}, c["mode"],
                       c["padding_noise"] if c["replicate_padding"] else None,
                       c["pooled_text"] if "pooled_text" in c else True,  # a run from before the key: pooled on
                       meanflow, cfg["objective"].get("meanflow_interval_blocks") if meanflow else None,  # None: all
                       c.get("zero_padding", False))


def build_denoiser(cfg, channels, size, text_dims=None):
    """SD3Transformer2DModel (MMDiT, Esser et al. 2024) of the configured size and its conditioner.
    `text_dims` = (tokens, token dim, pooled dim) of the text encoder; None for class conditioning, whose
    tokens live in the model width. A run whose init_from is an SD3-family pipeline (sd3_base) has that pipeline's
    transformer, built from its own config (SD3.5's dual attention and qk norm included; model.* is not read), its
    weights loaded by init_from."""
    from diffusers import SD3Transformer2DModel

    if sd3_base.is_base(cfg.get("init_from")):
        transformer = SD3Transformer2DModel.from_config(sd3_base.transformer_config(cfg["init_from"]))
        tc = transformer.config
        tokens, context_dim, pooled_dim = text_dims
        return Denoiser(transformer, make_conditioner(cfg, tc.num_attention_heads * tc.attention_head_dim,
                                                      context_dim, pooled_dim, tokens))
    model = cfg["model"]
    width = model["num_attention_heads"] * model["attention_head_dim"]
    tokens, context_dim, pooled_dim = text_dims or (0, width, width)
    transformer = SD3Transformer2DModel(
        sample_size=size, patch_size=model["patch_size"], in_channels=channels, out_channels=channels,
        num_layers=model["num_layers"], attention_head_dim=model["attention_head_dim"],
        num_attention_heads=model["num_attention_heads"], joint_attention_dim=context_dim,
        caption_projection_dim=width, pooled_projection_dim=pooled_dim,
        pos_embed_max_size=size // model["patch_size"], qk_norm=model["qk_norm"])
    # DiT starts every linear bias at zero: the context projection's default random bias (rms ~0.05 at width
    # 128) would otherwise be 4x a class token's own N(0, 0.02) part, and every class's token mostly the same
    # constant once the blocks' LayerNorm rescales it (tests/test_conditioning.py, the fair start).
    nn.init.zeros_(transformer.context_embedder.bias)
    return Denoiser(transformer, make_conditioner(cfg, width, context_dim, pooled_dim, tokens))


def load_exported(folder):
    """The EMA model that a run exported: transformer via `from_pretrained`, the conditioner's weights, the
    run's config.json. An export that carries its VAE (vae/: encoders.vae was a local folder) decodes with that
    copy, and one that carries its text encoder (text_encoder/ and tokenizer/) encodes prompts with that, wherever
    the folders it was trained with went."""
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = config.Config(json.loads((folder / "config.json").read_text()))
    for key in ("vae", "text_encoder"):
        if (folder / key / "config.json").is_file():
            cfg["encoders"][key] = str(folder / key)
    where = {"pretrained_model_name_or_path": folder / "transformer"} if (folder / "transformer").is_dir() else \
        sd3_base.location(exported_base(folder), "transformer")  # an SD3 base's adapters: the base's transformer
    transformer = SD3Transformer2DModel.from_pretrained(**where, use_safetensors=True)
    transformer.load_state_dict(lora.fold_exported(transformer.state_dict(), folder))  # LoRA: adapters folded in
    state = load_file(str(conditioner_weights(folder)))
    tc = transformer.config
    conditioner = make_conditioner(cfg, tc.num_attention_heads * tc.attention_head_dim, tc.joint_attention_dim,
                                   tc.pooled_projection_dim, len(state.get("null_tokens", ())))
    crop = state.get("control_mlp.crop.0.weight")
    if crop is not None and crop.shape[1] != 64 * CONTROL_SCALARS["crop"]:
        raise ValueError(f"{folder}: its crop control reads {crop.shape[1] // 64} scalars, the crop box in pixels of "
                         f"a model from before issue 42; this code reads {CONTROL_SCALARS['crop']} (top, left, side "
                         f"relative to the short side, docs/paper.md): retrain, or sample it with the older code")
    conditioner.load_state_dict(state)
    return Denoiser(transformer, conditioner).eval(), cfg


def exported_base(folder):
    """The SD3-family pipeline whose transformer an export without transformer/ adapts (model_index.json's
    transformer_id: an SD3 base's LoRA export references the base instead of copying it), or FileNotFoundError."""
    index = Path(folder) / "model_index.json"
    base = json.loads(index.read_text()).get("transformer_id") if index.is_file() else None
    if not sd3_base.is_base(base):
        raise FileNotFoundError(f"{folder}: no transformer/, and its transformer_id {base!r} is no SD3-family pipeline "
                                f"that can be read here to take it from")
    return base


def conditioner_weights(folder):
    """The conditioner's weights in an export: conditioner/ (a pipeline folder), or conditioner.safetensors (an
    export written before the pipeline folder)."""
    new = Path(folder) / "conditioner" / "diffusion_pytorch_model.safetensors"
    return new if new.is_file() else Path(folder) / "conditioner.safetensors"
