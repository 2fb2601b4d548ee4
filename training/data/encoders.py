"""The frozen encoders: a diffusers AutoencoderKL (None: pixel space) and a transformers text encoder (None: class
labels), by hub id or local path. Loading them (from_pretrained: a model that cannot be found is one line naming
its config key), where they sit while training runs, tokenising and encoding captions, and the VAE's encoding
into model space and decoding back to pixels. What the cache stores of them is encoding.py's and cache.py's.

problems(): the start-up check of the encoders section (the VAE's config reads, and data.resolution divides into
the model's patches at the VAE's downsampling; the text encoder's config reads, and encoders.max_tokens fits its
positions), handed to the config loader by the trainers (sections.schema). An autoencoder made here
(tools/autoencoder.py) is a local folder like any other; its latents' scale is checked once cached
(latents.check_scale); so is a CLIP made here (tools/clip.py, training/data/clip.py).

Captions become token ids as the text encoder's own tokenizer makes them (tokenize): start and end tokens added,
padded to encoders.max_tokens, and a longer caption truncated to it, its end token kept last (CLIP's and T5's
tokenizers both count their special tokens within max_length). The empty caption (the dropped condition of
guidance, and the null text of the model) is the start and end tokens alone; a CLIP's pooled vector is the final
hidden state at its end token, a T5's the mean over the real tokens (docs/data.md, "Captions into tokens").
"""
import contextlib
from pathlib import Path

import torch

import common

def from_pretrained(key, load, name, recipe=None, **kwargs):
    """load(name, **kwargs) for the model that config key `key` names. A model that is neither a local folder
    nor in the Hugging Face cache, and cannot be downloaded (an offline node, a gated or misspelt id), stops the
    run with one line naming the key and the command that fetches it, not a library traceback; a VAE, also the
    command that builds an autoencoder of one's own there (`recipe`: the config file that names it)."""
    if key == "encoders.vae" and name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise SystemExit(f"{key}='{name}' is not a folder: {build_hint(name, recipe)}") from None  # a path, no hub id
    try:
        return load(name, **kwargs)
    except OSError as e:  # what diffusers and transformers raise for a model they cannot find
        from huggingface_hub import constants

        why = str(e).strip().splitlines()[0].rstrip(".") + (" (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "")
        own = f" An autoencoder of your own: {build_hint(name, recipe)}." if key == "encoders.vae" else ""
        raise SystemExit(f"{key}='{name}' cannot be loaded: {why}. On a machine with network run `python "
                         f"tools/prefetch.py --config YOUR_CONFIG` and copy the Hugging Face cache it names (HF_HOME) "
                         f"here, or set {key} to a local folder.{own}") from None


def build_hint(name, recipe=None):
    """The command that builds the autoencoder folder `name` for the recipe that names it."""
    return f"build it with `python tools/autoencoder.py --config {recipe or 'YOUR_RECIPE'} --out {name}`"


def load_encoders(enc, device):
    """(vae, tokenizer, text_encoder) that `enc` (the encoders section) names, frozen, on `device`. An SD3-family
    pipeline (training/data/sd3_base.py) named by encoders.vae gives its vae/; named by encoders.text_encoder, its
    text encoders as SD3 conditions on them (encoders.sd3_text_encoders: which), one module and one tokenizer that
    the rest of this file reads like any other."""
    from training.data import sd3_base

    vae = tokenizer = text_encoder = None
    if enc.vae:
        from diffusers import AutoencoderKL  # here, not at the top: seconds to import, and only latent runs need it

        vae = from_pretrained("encoders.vae", AutoencoderKL.from_pretrained, enc.vae, use_safetensors=True,
                              **vae_location(enc.vae))
        vae = vae.to(device).eval().requires_grad_(False)
    if enc.text_encoder and sd3_base.is_base(enc.text_encoder):  # bf16 on a GPU (T5-XXL: 9.5 GB), as diffusers'
        tokenizer, text_encoder = sd3_base.load_text_encoders(
            enc.text_encoder, enc, lambda load, **kw: from_pretrained("encoders.text_encoder", load,
                                                                      kw.pop("pretrained_model_name_or_path"), **kw),
            torch.bfloat16 if torch.device(device).type == "cuda" else None)
        text_encoder = text_encoder.to(device).eval().requires_grad_(False)
    elif enc.text_encoder:
        from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel, T5EncoderModel  # (text runs only)

        key, name = "encoders.text_encoder", enc.text_encoder
        kind = from_pretrained(key, AutoConfig.from_pretrained, name).model_type
        model_cls = {"clip": CLIPTextModel, "clip_text_model": CLIPTextModel, "t5": T5EncoderModel}.get(kind, AutoModel)
        tokenizer = from_pretrained(key, AutoTokenizer.from_pretrained, tokenizer_folder(name))
        # a whole CLIP (tools/clip.py's) is read with its vision tower left out on purpose: no warning of it
        with quiet_transformers(warnings=kind == "clip"):
            text_encoder = from_pretrained(key, model_cls.from_pretrained, name, use_safetensors=True)
        text_encoder = text_encoder.to(device).eval().requires_grad_(False)
    return vae, tokenizer, text_encoder


@contextlib.contextmanager
def quiet_transformers(warnings=True):
    """transformers quieter while a model loads or saves: in a log file (not a terminal) its bar of each load or
    save ("Loading weights", "Writing model shards") is off, a line of noise every time a tool reads a model; with
    `warnings`, its warnings too: a whole CLIPModel read as its text tower (CLIPTextModel) otherwise prints a table
    of every vision weight it leaves out ("UNEXPECTED"), which is what is meant."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if warnings:
        hf_logging.set_verbosity_error()
    if bars and not common.interactive():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars and not hf_logging.is_progress_bar_enabled():
            hf_logging.enable_progress_bar()


def tokenizer_folder(name):
    """Where the tokenizer of the text encoder `name` is: beside it, in tokenizer/, for the text_encoder/ of a
    diffusers pipeline folder (an export of this repository, a local Stable Diffusion), which holds none; else
    `name` itself (a hub id, a transformers folder)."""
    path = Path(name).expanduser()
    beside = path.parent / "tokenizer"
    if path.name == "text_encoder" and beside.is_dir() and not (path / "tokenizer_config.json").is_file():
        return str(beside)
    return name


def place_encoders(vae, text_encoder, device, encode_each_step):
    """Once the cache is built: the VAE leaves the GPU (decode() brings it back for validation and FID); the text
    encoder too, unless it encodes every batch (data.cache_text=false), where it stays on the GPU in bf16: half
    its memory, and its features come out in fp32 like the cache's (encode_tokens)."""
    if vae is not None:
        vae.to("cpu")
    if text_encoder is not None and encode_each_step:
        text_encoder.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else text_encoder.dtype)
    elif text_encoder is not None:
        text_encoder.to("cpu")


def tokenize(tokenizer, captions, max_tokens):
    tok = tokenizer(captions, padding="max_length", max_length=max_tokens, truncation=True, return_tensors="pt")
    return tok.input_ids, tok.attention_mask


def encode_text(tokenizer, encoder, captions, max_tokens):
    """Token features for the context stream and a pooled vector (CLIP's pooler, else the masked mean)."""
    return encode_tokens(encoder, *tokenize(tokenizer, captions, max_tokens))


@torch.no_grad()
def encode_tokens(encoder, input_ids, attention_mask):
    input_ids, attention_mask = input_ids.to(encoder.device, torch.long), attention_mask.to(encoder.device, torch.long)
    out = encoder(input_ids=input_ids, attention_mask=attention_mask)
    mask = getattr(out, "attention_mask", attention_mask).float()  # an SD3 base's: its tokens', not its ids' (sd3_base)
    pooled = getattr(out, "pooler_output", None)
    if pooled is None:
        pooled = (out.last_hidden_state * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return {"text_tokens": out.last_hidden_state.float(), "text_mask": mask, "text_pooled": pooled.float()}


def text_features(batch, text_encoder):
    """data.cache_text=false: the cache holds token ids, and the frozen text encoder turns them into the
    features the cache would have held, here, at each step. A batch that holds features passes unchanged."""
    if "input_ids" in batch:
        batch.update(encode_tokens(text_encoder, batch.pop("input_ids"), batch.pop("attention_mask")))
    return batch


def make_encode(vae, tokenizer, text_encoder, max_tokens):
    """The cache's "process" step: pixels in [-1, 1] -> latents (z - shift) * scale with the VAE's own
    factors, stored as posterior mean and std; captions -> text features, or with text="tokens" only their
    token ids and mask (data.cache_text=false: 77 x 5 bytes instead of 77 x 768 x 2 for CLIP-L)."""

    @torch.no_grad()
    def encode(pixels, captions, text="features"):
        if vae is None:
            out = {"x": pixels}
        else:
            posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
            scale, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
            out = {"x": (posterior.mean - shift) * scale, "x_std": posterior.std * scale}
        if text_encoder is not None and text == "tokens":
            input_ids, attention_mask = tokenize(tokenizer, captions, max_tokens)
            out.update(input_ids=input_ids.int(), attention_mask=attention_mask.to(torch.uint8))
        elif text_encoder is not None:
            out.update(encode_text(tokenizer, text_encoder, captions, max_tokens))
        return out

    return encode


@torch.no_grad()
def decode(vae, x, device=None):
    """Model space -> pixels in [-1, 1] (inverse of make_encode's scaling), in the VAE's own dtype whatever the
    caller's autocast: the validation grid, sample.py, eval_fid.py (which sample under the run's mixed precision)
    and the exported pipeline decode alike, and an fp16 autocast cannot overflow the decoder. With `device`, an
    offloaded VAE comes to it for the call and leaves again (encoders stay off the GPU while training). A list (a
    bucket run's validation grids, one tensor a bucket): a list."""
    if isinstance(x, list):
        return [decode(vae, part, device) for part in x]
    if vae is None:
        return x
    if device is not None:
        vae.to(device)
    with torch.autocast(vae.device.type, enabled=False):
        out = vae.decode(x.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)).sample
    if device is not None:
        vae.cpu()
    return out


def vae_location(name):
    """from_pretrained's subfolder of the VAE `name`: vae/ of an SD3-family pipeline, else none (the folder itself)."""
    from training.data import sd3_base

    return {"subfolder": "vae"} if sd3_base.is_base(name) else {}


def vae_identity(name):
    """What of the VAE `name` decides its cached latents beyond its name, for the cache key: its scaling and shift
    factors (the cache holds (z - shift) * scale) and, for a local folder, the size and time of its weights, so a
    recalibrated or retrained autoencoder at the same path is a miss, never the old latents. Its config only."""
    from diffusers import AutoencoderKL

    where = vae_location(name)
    vae = from_pretrained("encoders.vae", AutoencoderKL.load_config, name, **where)
    weights = Path(name) / where.get("subfolder", "") / "diffusion_pytorch_model.safetensors"
    stamp = [weights.stat().st_size, weights.stat().st_mtime_ns] if weights.is_file() else None
    return {"scaling_factor": vae.get("scaling_factor"), "shift_factor": vae.get("shift_factor"), "weights": stamp}


def vae_factor(name, recipe=None):
    """The VAE's downsampling factor, 2^(levels - 1), from its config alone (no weights)."""
    from diffusers import AutoencoderKL  # here, not at the top: diffusers takes seconds to import, pixel runs never do

    config = from_pretrained("encoders.vae", AutoencoderKL.load_config, name, recipe, **vae_location(name))
    return 2 ** (len(config["block_out_channels"]) - 1)


def text_encoder_identity(name):
    """What of a local text encoder folder `name` decides its cached features beyond its name, for the cache key:
    the size and time of its weights, config and tokenizer files, so a CLIP retrained in place (tools/clip.py) is
    a miss, never the old features. None for a hub id (its name is its identity)."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return None
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(folder.iterdir())
            if f.suffix in (".safetensors", ".bin", ".json", ".txt", ".model")}


def text_positions(name):
    """The positions the text encoder `name` has (its text config's max_position_embeddings), from its config
    alone; None for one without a fixed number (T5's relative positions; an SD3-family pipeline, whose CLIPs read
    their 77 tokens whatever max_tokens is and whose T5 is checked by sd3_base.problems)."""
    from transformers import AutoConfig

    from training.data import sd3_base

    if sd3_base.is_base(name):
        return None

    config = from_pretrained("encoders.text_encoder", AutoConfig.from_pretrained, name)
    return getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)


def problems(cfg):
    """The encoders' start-up check: the VAE's config can be read (only the config: no weights), and data.resolution
    is a whole number of the model's patches at the VAE's downsampling factor (1 in pixel space); the text
    encoder's config can be read, and encoders.max_tokens is at most its positions (more would fail inside
    transformers once the cache is being built)."""
    d, m, enc, out, factor = cfg["data"], cfg["model"], cfg["encoders"], [], 1
    if enc["vae"]:
        try:
            origin = getattr(cfg, "origin", {}).get("encoders.vae", "")  # "from configs/x.json": the recipe
            factor = vae_factor(enc["vae"], origin[len("from "):] if origin.endswith(".json") else None)
        except SystemExit as e:  # from_pretrained: a model that cannot be found, in one line
            out.append(str(e))
        except Exception as e:
            out.append(f"encoders.vae={enc['vae']!r}: its config cannot be read ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0][:200]})")
    if enc["text_encoder"]:
        try:
            positions = text_positions(enc["text_encoder"])
        except SystemExit as e:  # from_pretrained: a model that cannot be found, in one line
            out.append(str(e))
        except Exception as e:
            out.append(f"encoders.text_encoder={enc['text_encoder']!r}: its config cannot be read ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0][:200]})")
        else:
            if positions is not None and enc["max_tokens"] > positions:
                out.append(f"encoders.max_tokens={enc['max_tokens']} is more than the {positions} positions of "
                           f"encoders.text_encoder={enc['text_encoder']!r} (its max_position_embeddings): set "
                           f"encoders.max_tokens to at most {positions}")
    if d["resolution"] % (m["patch_size"] * factor):
        out.append(f"data.resolution={d['resolution']} is not divisible by model.patch_size={m['patch_size']}"
                   f" x the VAE's downsampling factor {factor}")
    return out
