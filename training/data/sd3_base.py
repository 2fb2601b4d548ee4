"""A pretrained Stable Diffusion 3 / 3.5 pipeline (diffusers' layout: model_index.json of a StableDiffusion3Pipeline,
subfolders transformer/, vae/, text_encoder/ (CLIP-L), text_encoder_2/ (CLIP-G), text_encoder_3/ (T5), tokenizer*/,
scheduler/) as the base of a run: init_from, encoders.vae and encoders.text_encoder may each name one, by local
folder or hub id. Here: recognising one (model_index.json read through diffusers' load_config, so a hub id and a
folder take the same path), its transformer's config and weights, its VAE's location, and its text encoders
conditioned exactly as StableDiffusion3Pipeline.encode_prompt conditions them (tests/test_sd3_base.py checks each
against diffusers). What the rest of the run does with them is the ordinary path: the text encoders are one module
with a tokenizer (TextEncoders, Tokenizers) that encoders.py's encode_tokens reads like any other; the transformer
is built by training/model/mmdit.py's build_denoiser and loaded by training/run/start.py's init_from.

SD3's prompt encoding (Esser et al. 2024, sec. 5.2 and diffusers' pipeline_stable_diffusion_3.py):
  * each CLIP reads its own 77 token ids (CLIP-L's tokenizer pads with its end token, CLIP-G's with "!") with no
    attention mask; its penultimate hidden states (hidden_states[-2]) are its tokens, its projected end-token
    feature (text_embeds) its pooled vector;
  * the two CLIPs' tokens are concatenated on channels (768 + 1280 = 2048) and zero-padded to T5's width (4096);
    T5's tokens (encoders.max_tokens of them, no attention mask either) follow along the sequence: 77 + max_tokens;
  * pooled = [CLIP-L text_embeds, CLIP-G text_embeds] (768 + 1280 = 2048), the adaptive norm's text input;
  * T5 left out (encoders.sd3_text_encoders without text_encoder_3: 9 GB spared): its max_tokens tokens are zeros,
    as the pipeline loaded with text_encoder_3=None gives them.
"""
import functools
import re
from pathlib import Path
from types import SimpleNamespace

import torch

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # CLIP-L, CLIP-G, T5: the pipeline's names
TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
MAX_T5_TOKENS = 512  # StableDiffusion3Pipeline refuses a longer max_sequence_length
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@functools.lru_cache(maxsize=64)
def pipeline_index(name):
    """model_index.json of `name` when it is an SD3-family pipeline (its _class_name a StableDiffusion3* pipeline,
    read by diffusers' load_config: a local folder, or a hub id's file from the cache or the Hub), else None: a VAE
    or text encoder of its own, a run or export folder of this repository (its class is its own pipeline.py), a
    hub id that cannot be read here (the ordinary loaders then say why, naming the key)."""
    if not name or not isinstance(name, str):
        return None
    local = Path(name).expanduser()
    if not local.exists() and (not HUB_ID.fullmatch(name) or name.startswith((".", "/", "~"))):
        return None  # a path that is not there: never a question to the Hub
    if local.exists() and not (local / "model_index.json").is_file():
        return None
    from diffusers import DiffusionPipeline

    try:
        index = DiffusionPipeline.load_config(str(local) if local.exists() else name)
    except (OSError, ValueError):  # no model_index.json there, or not found offline
        return None
    kind = index.get("_class_name")
    return index if isinstance(kind, str) and kind.startswith("StableDiffusion3") else None


def is_base(name):
    return pipeline_index(name) is not None


def location(name, part):
    """from_pretrained's arguments for part `part` (transformer, vae, text_encoder...) of the pipeline `name`."""
    return {"pretrained_model_name_or_path": str(Path(name).expanduser()) if Path(name).expanduser().exists()
            else name, "subfolder": part}


def reference(name):
    """How an export names the pipeline (or other model) `name` it references: a local folder by its absolute path
    (the export is read from anywhere), a hub id as it is."""
    local = Path(name).expanduser() if name else None
    return str(local.resolve()) if local is not None and local.exists() else name


def transformer_config(name):
    """The base's SD3Transformer2DModel config (its own: SD3.5's dual_attention_layers, qk_norm, pos_embed_max_size),
    read without its weights."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.load_config(**location(name, "transformer"))


def transformer_state(name):
    """The base transformer's weights (fp32, as the run's model holds them), names as in its state dict."""
    from diffusers import SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(**location(name, "transformer"), torch_dtype=torch.float32)
    return transformer.state_dict()


def chosen(enc):
    """The pipeline's text encoders the run conditions on: encoders.sd3_text_encoders, or all three."""
    return tuple(enc.get("sd3_text_encoders") or TEXT_ENCODERS)


# ----------------------------------------------------------------------------------------------------------
# The text encoders, as one module and one tokenizer: ids of CLIP-L (77), CLIP-G (77) and T5 (max_tokens) side by side.


class Tokenizers:
    """The pipeline's tokenizers as one: a caption -> CLIP-L's ids, CLIP-G's and T5's, concatenated along the
    sequence, each padded as StableDiffusion3Pipeline pads it (CLIP: to CLIP-L's model_max_length, its own pad
    token; T5: to max_length, the run's encoders.max_tokens, its end token added). It is called as any tokenizer
    (encoders.tokenize); SD3's padding and truncation are fixed, whatever the other arguments say."""

    def __init__(self, clip_l, clip_g, t5=None):
        self.clip_l, self.clip_g, self.t5 = clip_l, clip_g, t5
        self.clip_tokens = clip_l.model_max_length  # the pipeline's tokenizer_max_length, for both CLIPs

    def __call__(self, captions, padding="max_length", max_length=None, truncation=True, return_tensors="pt"):
        parts = [tok(captions, padding="max_length", max_length=self.clip_tokens, truncation=True,
                     return_tensors="pt") for tok in (self.clip_l, self.clip_g)]
        if self.t5 is not None:
            parts.append(self.t5(captions, padding="max_length", max_length=max_length, truncation=True,
                                 add_special_tokens=True, return_tensors="pt"))
        return SimpleNamespace(input_ids=torch.cat([p.input_ids for p in parts], 1),
                               attention_mask=torch.cat([p.attention_mask for p in parts], 1))


class TextEncoders(torch.nn.Module):
    """CLIP-L, CLIP-G and (optionally) T5 as one frozen encoder: Tokenizers' ids -> (tokens, pooled, mask) as
    StableDiffusion3Pipeline.encode_prompt makes them (this module's docstring). `width`: T5's, the transformer's
    joint_attention_dim; `t5_tokens`: encoders.max_tokens, the zeros' length without T5. The returned mask marks
    the real tokens (each CLIP-L token the tokenizer did not pad, then T5's; zeros without T5): the model reads
    every position, as SD3 does; only replicate padding would read the mask, and an SD3 base refuses it."""

    def __init__(self, clip_l, clip_g, t5, width, clip_tokens, t5_tokens):
        super().__init__()
        self.clip_l, self.clip_g, self.t5 = clip_l, clip_g, t5
        self.width, self.clip_tokens, self.t5_tokens = width, clip_tokens, t5_tokens

    @property
    def device(self):
        return self.clip_l.device

    @property
    def dtype(self):
        return self.clip_l.dtype

    def forward(self, input_ids, attention_mask):
        n = self.clip_tokens
        clip_l = self.clip_l(input_ids[:, :n], output_hidden_states=True)  # no mask: SD3 reads the padding too
        clip_g = self.clip_g(input_ids[:, n:2 * n], output_hidden_states=True)
        clip = torch.cat([clip_l.hidden_states[-2], clip_g.hidden_states[-2]], dim=-1)  # penultimate, on channels
        clip = torch.nn.functional.pad(clip, (0, self.width - clip.shape[-1]))  # zeros up to T5's width
        if self.t5 is not None:
            t5, t5_mask = self.t5(input_ids[:, 2 * n:])[0], attention_mask[:, 2 * n:]
        else:  # T5 left out: the pipeline's zeros
            t5 = torch.zeros(len(input_ids), self.t5_tokens, self.width, device=clip.device, dtype=clip.dtype)
            t5_mask = torch.zeros(len(input_ids), self.t5_tokens, device=attention_mask.device)
        pooled = torch.cat([clip_l.text_embeds, clip_g.text_embeds], dim=-1)
        return SimpleNamespace(last_hidden_state=torch.cat([clip, t5.to(clip.dtype)], dim=1), pooler_output=pooled,
                               attention_mask=torch.cat([attention_mask[:, :n], t5_mask.to(attention_mask)], 1))


def load_text_encoders(name, enc, load, dtype=None):
    """(Tokenizers, TextEncoders) of the pipeline `name`, the encoders `enc` names (chosen), each component by the
    class its model_index.json names (CLIPTextModelWithProjection, T5EncoderModel, CLIPTokenizer, T5TokenizerFast),
    as diffusers loads it. `load(fn, **kwargs)`: encoders.from_pretrained's one-line errors for the key. `dtype`:
    the encoders' (bf16 on a GPU, as diffusers' SD3 scripts load them: T5-XXL is 19 GB in fp32, 9.5 GB in bf16;
    None: as stored, fp32 on the CPU)."""
    import transformers

    index, parts = pipeline_index(name), chosen(enc)
    models, tokenizers = {}, {}
    for part in TEXT_ENCODERS:
        if part in parts:
            models[part] = load(getattr(transformers, index[part][1]).from_pretrained, **location(name, part),
                                **({"dtype": dtype} if dtype else {}))
            tok = TOKENIZERS[part]
            tokenizers[part] = load(getattr(transformers, index[tok][1]).from_pretrained, **location(name, tok))
    width = transformer_config(name)["joint_attention_dim"]
    tokenizer = Tokenizers(tokenizers["text_encoder"], tokenizers["text_encoder_2"], tokenizers.get("text_encoder_3"))
    encoder = TextEncoders(models["text_encoder"], models["text_encoder_2"], models.get("text_encoder_3"), width,
                           tokenizer.clip_tokens, enc["max_tokens"])
    return tokenizer, encoder


def cache_key(enc):
    """What of the SD3 text encoding the cache key adds: which of the pipeline's encoders encode (a switch of the
    subset is a miss; max_tokens is in the key already) and, for a local pipeline folder, the stamp of its
    model_index.json and of each chosen encoder's weights."""
    name = enc["text_encoder"]
    if not is_base(name):
        return {}
    key = {"sd3_text_encoders": list(chosen(enc))}
    folder = Path(name).expanduser()
    if folder.is_dir():
        files = [folder / "model_index.json"] + [f for part in chosen(enc) for f in sorted((folder / part).glob("*"))]
        key["sd3_files"] = {str(f.relative_to(folder)): [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    return key


def problems(cfg):
    """An SD3-family base's start-up check (one line each, before any work): init_from's base conditions on its own
    VAE's latents and its own text encoders, so encoders.vae and encoders.text_encoder name an SD3-family pipeline
    too; it was trained with its real padding embeddings and the pooled text in the adaptive norm
    (conditioning.replicate_padding false, conditioning.pooled_text true: a mismatch is refused, not changed);
    encoders.sd3_text_encoders keeps both CLIPs (SD3's pipeline can drop T5 only) and needs an SD3 text encoder;
    T5 reads at most 512 tokens, as the pipeline allows."""
    enc, cond, out = cfg["encoders"], cfg["conditioning"], []
    base, text = is_base(cfg.get("init_from")), is_base(enc["text_encoder"])
    if base and "time_sampling" not in cfg["objective"]:  # DDPM's objective section has none
        out.append(f"init_from={cfg['init_from']!r} is an SD3-family pipeline, a rectified-flow model (velocity "
                   f"noise - x0): fine-tune it with train_flow_matching.py")
    elif base and cfg["objective"].get("prediction", "v") != "v":
        out.append(f"objective.prediction={cfg['objective']['prediction']!r} with an SD3-family init_from: the base "
                   f"predicts the velocity; set objective.prediction='v'")
    if base:
        for key in ("vae", "text_encoder"):
            if not is_base(enc[key]):
                out.append(f"init_from={cfg['init_from']!r} is an SD3-family pipeline: set encoders.{key} to it too "
                           f"(its {key}/ is what the base was trained with), not {enc[key]!r}")
        if cond.get("replicate_padding"):
            out.append("conditioning.replicate_padding=true with an SD3-family init_from: SD3 was trained on its "
                       "encoders' own padding embeddings; set conditioning.replicate_padding=false")
        if not cond.get("pooled_text", True):
            out.append("conditioning.pooled_text=false with an SD3-family init_from: SD3's adaptive norm reads the "
                       "pooled CLIP text; set conditioning.pooled_text=true")
    if enc.get("sd3_text_encoders") is not None:
        parts = enc["sd3_text_encoders"]
        if not text:
            out.append(f"encoders.sd3_text_encoders={parts} chooses among an SD3-family pipeline's text encoders: "
                       f"encoders.text_encoder={enc['text_encoder']!r} is none")
        if not {"text_encoder", "text_encoder_2"} <= set(parts) or set(parts) - set(TEXT_ENCODERS):
            out.append(f"encoders.sd3_text_encoders={parts}: name both CLIPs, 'text_encoder' and 'text_encoder_2', "
                       f"and optionally 'text_encoder_3' (T5; SD3's pipeline can drop T5 alone)")
    if text and enc["max_tokens"] > MAX_T5_TOKENS:
        out.append(f"encoders.max_tokens={enc['max_tokens']}: T5's tokens in SD3's encoding are at most "
                   f"{MAX_T5_TOKENS} (StableDiffusion3Pipeline's max_sequence_length)")
    return out
