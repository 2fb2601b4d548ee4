"""Small, method-agnostic helpers shared by train_flow_matching.py and train_ddpm.py.

Nothing here knows about an objective or a sampler: config loading, the embedded demo data, dataset opening
and the latent/text cache, the conditioning module, EMA, the LR function, the resolution time shift, image
grids and checkpoint files. Each trainer reads top to bottom on its own and calls these the same way.
"""
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from PIL import Image, ImageDraw
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

# ----------------------------------------------------------------------------------------------------------
# Config: defaults (a nested dict in each trainer) <- --config file.json <- --dotted.key=value


class Config(dict):
    """A dict whose keys also read as attributes (cfg.train.lr), so it still dumps to JSON as is."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no key '{key}'") from None

    def __setattr__(self, key, value):  # cfg.run_dir = ... sets the key, so config.json records it
        self[key] = value


def _merge(base, override, where, prefix=""):
    out = Config({k: Config(v) if isinstance(v, dict) else v for k, v in base.items()})
    for key, value in override.items():
        name = prefix + key
        if key not in base:
            close = [k for k in base if k.startswith(key[:3])]
            raise ValueError(f"unknown config key '{name}' ({where}); known keys here: {sorted(base)}"
                             + (f", did you mean {close}?" if close else ""))
        default = base[key]
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ValueError(f"config key '{name}' ({where}) must be a section (dict), got {value!r}")
            out[key] = _merge(default, value, where, name + ".")
            continue
        ok = (default is None or (value is None and type(default) is str)  # a str setting can be switched off
              or (type(default) is bool and type(value) is bool)
              or (type(default) is int and type(value) is int)
              or (type(default) is float and type(value) in (int, float))
              or (type(default) in (str, list) and type(value) is type(default)))
        if not ok:
            raise ValueError(f"config key '{name}' ({where}) must be {type(default).__name__}, "
                             f"got {type(value).__name__} {value!r}")
        out[key] = float(value) if type(default) is float else value
    return out


def load_config(defaults, argv=None, method="run"):
    """Resolve the config: the trainer's DEFAULTS, then `--config file.json`, then `--a.b=value` overrides.

    Unknown keys and wrong types raise ValueError naming the key. Values parse as JSON when they can
    (`--train.lr=3e-4`, `--data.label_column=null`) and as plain strings otherwise. A run_dir left unset
    becomes runs/{method}_{config file name} (runs/flow_matching_demo without a config), so one recipe can
    be run by both trainers side by side; for the same reason "{method}" in init_from becomes the trainer's
    name (configs/imagenet512.json starts from runs/{method}_imagenet256).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = _merge(defaults, {}, "defaults")
    overrides, name = [], "demo"
    while argv:
        arg = argv.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: use --config FILE or --key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if not argv:
                raise ValueError(f"argument --{key} needs a value")
            value = argv.pop(0)
        if key == "config":
            if not Path(value).is_file():
                raise FileNotFoundError(f"config file not found: {value}")
            cfg, name = _merge(cfg, json.loads(Path(value).read_text()), f"from {value}"), Path(value).stem
        else:
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
            for part in reversed(key.split(".")):
                value = {part: value}
            overrides.append((value, arg))
    for value, arg in overrides:
        cfg = _merge(cfg, value, f"from {arg}")
    if "run_dir" in cfg and cfg.run_dir is None:
        cfg.run_dir = f"runs/{method}_{name}"
    if cfg.get("init_from"):
        cfg.init_from = cfg.init_from.replace("{method}", method)
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Embedded demo data: coloured shapes, generated deterministically, offline, in about a second.

DEMO_COLORS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230)}
DEMO_SHAPES = ["circle", "square", "triangle"]
DEMO_CLASSES = [f"{c} {s}" for c in DEMO_COLORS for s in DEMO_SHAPES]  # label = index in this list


def draw_shape(label, size, rng, resolution=32):
    """One demo image: class `label`'s shape and colour, side `size` pixels, at a random place."""
    color, shape = DEMO_CLASSES[label].split()
    bg = tuple(int(v) for v in rng.integers(200, 245, 3))
    img = Image.new("RGB", (resolution, resolution), bg)
    x, y = (int(v) for v in rng.integers(1, resolution - size, 2))
    box, fill = [x, y, x + size, y + size], DEMO_COLORS[color]
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return img


def make_demo_dataset(num_samples, seed, resolution=32):
    """A `datasets.Dataset` with image, label and caption columns ("a small red circle")."""
    import datasets

    rng = np.random.default_rng(seed)
    rows = {"image": [], "label": [], "caption": []}
    for i in range(num_samples):
        label = i % len(DEMO_CLASSES)
        size = int(rng.integers(round(resolution * 0.35), round(resolution * 0.75) + 1))
        rows["image"].append(draw_shape(label, size, rng, resolution))
        rows["label"].append(label)
        rows["caption"].append(f"a {'small' if size < resolution * 0.55 else 'large'} {DEMO_CLASSES[label]}")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=DEMO_CLASSES),
                                  "caption": datasets.Value("string")})
    return datasets.Dataset.from_dict(rows, features=features)


# ----------------------------------------------------------------------------------------------------------
# Datasets: embedded demo, hub id, local imagefolder (metadata.jsonl) or parquet files.


def open_dataset(data, split):
    """Split `split` of the source named by `data.source`, with images left undecoded (bytes or path), so
    that a broken file is our error to report rather than a crash inside `datasets`."""
    import datasets

    source = data.source
    if source == "embedded":
        ds = make_demo_dataset(data.demo_samples, seed=0, resolution=data.demo_resolution)
    elif source.endswith(".parquet") or (Path(source).is_dir() and any(Path(source).glob("**/*.parquet"))):
        files = source if source.endswith(".parquet") else str(Path(source) / "**/*.parquet")
        ds = datasets.load_dataset("parquet", data_files={split: files}, split=split)
    elif Path(source).is_dir():
        ds = datasets.load_dataset("imagefolder", data_dir=source, split=split)
    else:
        ds = datasets.load_dataset(source, split=split)
    for key in ("image_column", "label_column", "caption_column"):
        if data[key] is not None and data[key] not in ds.column_names:
            raise ValueError(f"data.{key}='{data[key]}' is not a column of {source} (split '{split}'); "
                             f"its columns are {ds.column_names}")
    return ds.cast_column(data.image_column, datasets.Image(decode=False))


def open_splits(data):
    """(train, held-out) datasets: `data.val_split` if the source has one, else `data.val_holdout` rows
    drawn at random (seed 0) from the training split and removed from it."""
    train = open_dataset(data, data.split)
    if data.val_split is not None:
        val = open_dataset(data, data.val_split)
    else:
        perm = np.random.default_rng(0).permutation(len(train))
        val, train = train.select(sorted(perm[:data.val_holdout])), train.select(sorted(perm[data.val_holdout:]))
    if data.max_samples is not None:
        train = train.select(range(min(data.max_samples, len(train))))
    return train, val


def class_ids(data, ds):
    """The WordNet id (or other stable name) of each label index, from the dataset's own metadata, or None.
    `data.class_ids` names a timm ImageNet subset ("imagenet-1k", "imagenet-22k": the synset lists that the
    hub's ImageNet copies are indexed by) or a text file with one id per line; None reads the label column's
    ClassLabel names (an imagefolder of n0xxxxxxx folders holds the WordNet ids there)."""
    import datasets

    if data.class_ids is None:
        feature = ds.features.get(data.label_column) if data.label_column else None
        ids = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    elif Path(data.class_ids).is_file():
        ids = Path(data.class_ids).read_text().split()
    else:
        from timm.data import ImageNetInfo

        ids = list(ImageNetInfo(data.class_ids).label_names())
    if ids is not None and len(ids) != data.num_classes:
        where = data.class_ids or f"the ClassLabel names of column {data.label_column}"
        raise ValueError(f"data.class_ids: {len(ids)} class ids ({where}) but data.num_classes={data.num_classes}")
    return ids


def class_names(data, ds):
    """Readable class names, the captions of `data.label_captions`: WordNet ids become their lemmas
    ("n01440764" -> "tench, Tinca tinca"); other ids are names already."""
    ids = class_ids(data, ds)
    if ids is None:
        raise ValueError(f"data.label_captions needs class names: data.label_column='{data.label_column}' is not a "
                         f"ClassLabel column of {data.source}; set data.class_ids (e.g. 'imagenet-22k' or a file)")
    if all(re.fullmatch(r"n\d{8}", i) for i in ids):
        from timm.data import ImageNetInfo

        info = ImageNetInfo("imagenet-22k")
        return [info.label_name_to_description(i) for i in ids]
    return ids


def load_image(value):
    """Decode an undecoded `datasets.Image` value to RGB; any mode (L, P, RGBA, CMYK, I;16) is converted."""
    import io

    img = Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
    img.load()
    if img.mode in ("RGBA", "LA", "P"):  # composite transparency on white rather than on black
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, img)
    return img.convert("RGB")


def preprocess(img, resolution, data, rng=random):
    """Crop a square box by the crop policy `data.crop`, resize it to `resolution`, flip it if drawn.

    center: the largest centred square; random: the largest square at a random place; random_resized: a
    random square of side U(data.min_crop_scale, 1) x the short side, at a random place. Returns pixels in
    [-1, 1] and the control metadata that describes exactly what was done, so the conditioning is true to the
    data: orig_hw (h, w), crop_box (top, left, height, width) in original pixels, flip (0 or 1).
    """
    w, h = img.size
    side = min(w, h)
    if data.crop == "random_resized":
        side = max(1, round(side * rng.uniform(data.min_crop_scale, 1.0)))
    if data.crop == "center":
        top, left = (h - side) // 2, (w - side) // 2
    elif data.crop in ("random", "random_resized"):
        top, left = rng.randint(0, h - side), rng.randint(0, w - side)
    else:
        raise ValueError(f"data.crop must be 'center', 'random' or 'random_resized', got {data.crop!r}")
    img = img.resize((resolution, resolution), Image.BICUBIC, box=(left, top, left + side, top + side),
                     reducing_gap=None if side < 3 * resolution else 3.0)
    flip = data.random_flip and rng.random() < 0.5
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1
    return x, {"orig_hw": torch.tensor([h, w]), "crop_box": torch.tensor([top, left, side, side]),
               "flip": torch.tensor([int(flip)])}


# ----------------------------------------------------------------------------------------------------------
# Frozen encoders: a diffusers AutoencoderKL (None: pixel space) and a transformers text encoder (None: class
# labels), by hub id or local path.


def load_encoders(enc, device):
    vae = tokenizer = text_encoder = None
    if enc.vae:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(enc.vae, use_safetensors=True).to(device).eval().requires_grad_(False)
    if enc.text_encoder:
        from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel, T5EncoderModel

        kind = AutoConfig.from_pretrained(enc.text_encoder).model_type
        model_cls = {"clip": CLIPTextModel, "clip_text_model": CLIPTextModel, "t5": T5EncoderModel}.get(kind, AutoModel)
        tokenizer = AutoTokenizer.from_pretrained(enc.text_encoder)
        text_encoder = model_cls.from_pretrained(enc.text_encoder, use_safetensors=True).to(device).eval().requires_grad_(False)
    return vae, tokenizer, text_encoder


@torch.no_grad()
def encode_text(tokenizer, encoder, captions, max_tokens):
    """Token features for the context stream and a pooled vector (CLIP's pooler, else the masked mean)."""
    tok = tokenizer(captions, padding="max_length", max_length=max_tokens, truncation=True, return_tensors="pt")
    tok = tok.to(encoder.device)
    out = encoder(input_ids=tok.input_ids, attention_mask=tok.attention_mask)
    mask = tok.attention_mask.float()
    pooled = getattr(out, "pooler_output", None)
    if pooled is None:
        pooled = (out.last_hidden_state * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return {"text_tokens": out.last_hidden_state, "text_mask": mask, "text_pooled": pooled}


def make_encode(vae, tokenizer, text_encoder, max_tokens):
    """The cache's "process" step: pixels in [-1, 1] -> latents (z - shift) * scale with the VAE's own
    factors, stored as posterior mean and std; captions -> text features."""

    @torch.no_grad()
    def encode(pixels, captions):
        if vae is None:
            out = {"x": pixels}
        else:
            posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
            scale, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
            out = {"x": (posterior.mean - shift) * scale, "x_std": posterior.std * scale}
        if text_encoder is not None:
            out.update(encode_text(tokenizer, text_encoder, captions, max_tokens))
        return out

    return encode


@torch.no_grad()
def decode(vae, x):
    """Model space -> pixels in [-1, 1] (inverse of make_encode's scaling)."""
    if vae is None:
        return x
    return vae.decode(x.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)).sample


# ----------------------------------------------------------------------------------------------------------
# Cache: "cache check -> hit: load / miss: process -> cache results" (training_pipeline.txt).
# Each shard k holds dataset rows [k * S, (k + 1) * S) and is written by rank k % world_size, atomically;
# an interrupted extraction resumes at the first missing shard. The folder is named by a hash of everything
# that changes the content, so a changed key is a miss, never a silent reuse.


def cache_key(cfg, part, num_rows):
    data, enc = cfg.data, cfg.encoders
    key = {"source": data.source, "part": part, "split": data.split, "val_split": data.val_split,
           "val_holdout": data.val_holdout, "rows": num_rows, "resolution": data.resolution,
           "crop": [data.crop, data.min_crop_scale, data.random_flip],
           "columns": [data.image_column, data.label_column, data.caption_column], "vae": enc.vae,
           "text_encoder": enc.text_encoder, "max_tokens": enc.max_tokens if enc.text_encoder else None,
           "dtype": data.cache_dtype, "min_image_side": data.min_image_side, "format": 3}
    if data.source == "embedded":
        key["demo"] = [data.demo_samples, data.demo_resolution]
    if data.label_captions:
        key["label_captions"] = data.class_ids
    return key


def shard_ok(path):
    """A finished shard opens and its header's tensors all hold the rows it claims (safetensors itself
    rejects a file shorter than its header says, i.e. a truncated one)."""
    try:
        with safe_open(str(path), "pt") as f:
            rows = int(f.metadata()["rows"])
            return all(f.get_slice(name).get_shape()[0] == rows for name in f.keys())
    except Exception:
        return False


def build_cache(ds, part, encode, accelerator, cfg):
    """Cache split `part` ("train" or "val") of `ds`: return its folder, encoding what is missing first.
    `encode(pixels, captions)` maps a batch to a dict of tensors (see make_encode). Unreadable, empty and
    tiny images are reported and skipped; a corrupt shard is detected and rebuilt."""
    data = cfg.data
    key = cache_key(cfg, part, len(ds))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", data.source).strip("-")[-40:]
    folder = Path(data.cache_dir) / f"{slug}-{part}-{digest}"
    manifest = folder / "manifest.json"
    if manifest.exists():
        bad = [n for n in json.loads(manifest.read_text())["shards"] if not shard_ok(folder / n)]
        if not bad:
            accelerator.print(f"cache hit ({part}): {folder}")
            return folder
        accelerator.print(f"cache ({part}): corrupt shards {bad} in {folder}: rebuilding them")
    else:
        for other in Path(data.cache_dir).glob(f"{slug}-{part}-*/manifest.json"):  # say why it is a miss
            old = json.loads(other.read_text())["key"]
            changed = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in key.items() if old.get(k) != v]
            accelerator.print(f"cache miss ({part}): vs {other.parent.name}, changed {'; '.join(changed)}")
        accelerator.print(f"cache miss ({part}): encoding {len(ds)} samples into {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    names = class_names(data, ds) if data.label_captions else None
    size, rank, world = data.shard_size, accelerator.process_index, accelerator.num_processes
    mine = [k for k in range(math.ceil(len(ds) / size)) if k % world == rank]
    for k in tqdm(mine, desc=f"cache {part} (rank {rank})", disable=not accelerator.is_local_main_process):
        path = folder / f"shard_{k:05d}.safetensors"
        if path.exists() and shard_ok(path):
            continue  # finished before an interruption
        rows = ds[k * size:(k + 1) * size]
        rng = random.Random(k)  # crops and flips depend on the shard, not on the rank or the world size
        kept, pixels, metas, skipped = [], [], [], []
        for i, value in enumerate(rows[data.image_column]):
            try:
                img = load_image(value)
                if min(img.size) < data.min_image_side:
                    raise ValueError(f"{img.size[0]}x{img.size[1]} px is below data.min_image_side")
                pixel, meta = preprocess(img, data.resolution, data, rng)
            except Exception as e:  # truncated, empty, not an image, too small: report and skip, never crash
                skipped.append(f"{value.get('path') or f'row {k * size + i}'}: {type(e).__name__}: {e}"[:300])
                continue
            kept.append(i), pixels.append(pixel), metas.append(meta)
        tensors = {}
        captions = [rows[data.caption_column][i] for i in kept] if data.caption_column else None
        if data.label_captions:  # ImageNet-22k as text-to-image data: the class name is the caption
            captions = [names[rows[data.label_column][i]] for i in kept]
        for j in range(0, len(pixels), data.encode_batch_size):
            out = encode(torch.stack(pixels[j:j + data.encode_batch_size]),
                         captions[j:j + data.encode_batch_size] if captions else None)
            for name, value in out.items():
                tensors.setdefault(name, []).append(value.to("cpu", getattr(torch, data.cache_dtype)))
        tensors = {name: torch.cat(parts) for name, parts in tensors.items()}
        tensors.update({name: torch.stack([m[name] for m in metas]) for name in (metas[0] if metas else ())})
        if data.label_column and kept:
            tensors["label"] = torch.tensor([rows[data.label_column][i] for i in kept], dtype=torch.long)
        tmp = path.with_suffix(".tmp")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp),
                  metadata={"rows": str(len(kept)), "skipped": json.dumps(skipped)})
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shards = sorted(p.name for p in folder.glob("shard_*.safetensors"))
        skipped = []
        for name in shards:
            with safe_open(str(folder / name), "pt") as f:
                skipped += json.loads(f.metadata().get("skipped", "[]"))
        if skipped:
            accelerator.print(f"cache ({part}): skipped {len(skipped)} unusable images, first: " + "; ".join(skipped[:5]))
        manifest.with_suffix(".tmp").write_text(json.dumps({"key": key, "shards": shards, "skipped": skipped}, indent=1))
        os.replace(manifest.with_suffix(".tmp"), manifest)
    accelerator.wait_for_everyone()
    return folder


class CachedDataset(torch.utils.data.Dataset):
    """Rows of a finished cache, read lazily from memory-mapped shards (ImageNet latents do not fit in RAM
    once per GPU). Returns float32 tensors; a latent cache holds the posterior mean and std, and a sample
    x0 = mean + std * n is drawn at train time, so each epoch sees a fresh draw."""

    def __init__(self, folder):
        self.folder = Path(folder)
        manifest = json.loads((self.folder / "manifest.json").read_text())
        self.shards, self.starts, self.keys = manifest["shards"], [0], []
        for name in self.shards:
            with safe_open(str(self.folder / name), "pt") as f:
                self.starts.append(self.starts[-1] + int(f.metadata()["rows"]))
                self.keys = list(f.keys()) if self.starts[-1] > self.starts[-2] else self.keys
        self.handles = {}

    def __len__(self):
        return self.starts[-1]

    def __getitem__(self, i):
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        if k not in self.handles:  # opened per worker process, lazily: handles do not pickle
            self.handles[k] = safe_open(str(self.folder / self.shards[k]), "pt")
        f, j = self.handles[k], i - self.starts[k]
        return {name: f.get_slice(name)[j].float() if name != "label" else f.get_slice(name)[j]
                for name in self.keys}

    def __getstate__(self):
        return {**self.__dict__, "handles": {}}


# ----------------------------------------------------------------------------------------------------------
# Conditioning: class tokens or text tokens go to the MMDiT's context stream (attention); the pooled
# vector goes to its adaptive-norm input.


CONTROL_FIELDS = {"size": "orig_hw", "crop": "crop_box", "flip": "flip"}  # control -> cached metadata
COND_FIELDS = ("label", "text_tokens", "text_mask", "text_pooled", "orig_hw", "crop_box", "flip")
CONTROL_SCALARS = {"size": 2, "crop": 4, "flip": 1}


def sinusoidal(values, dim=64):
    """Each scalar -> `dim` sin/cos features at geometric frequencies (as SDXL embeds its size and crop
    conditions); (B, n) -> (B, n * dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=values.device) / half)
    args = values.float()[..., None] * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1).flatten(1)


def control_weight(noise_level, power):
    """w(t) = cos(pi t / 2)^p: 0 at pure noise (t = 1), 1 at clean data (t = 0), monotone in between, so
    low-level controls (size, crop, flip) act only late in denoising, once the layout that semantics decide
    is in place (Berrada et al. 2024, our reading: a noise-dependent schedule on the control embedding)."""
    return torch.cos(math.pi / 2 * noise_level.float().clamp(0, 1)).clamp(min=0) ** power


def replicate_padding(tokens, mask, noise_std):
    """Noisy replicate padding (Berrada et al. 2024): padded positions j >= n take a copy of real token
    j mod n plus Gaussian noise, instead of the encoder's pad embeddings, so attention over the padding
    carries the prompt rather than an uninformative constant. The noise std is noise_std x the RMS of the
    sample's real tokens, so one setting suits CLIP and T5 features alike. Real tokens are left untouched."""
    n = mask.sum(1).long().clamp(min=1)
    source = torch.arange(tokens.shape[1], device=tokens.device)[None] % n[:, None]
    copies = tokens.gather(1, source[..., None].expand_as(tokens))
    rms = ((tokens.float().pow(2) * mask[..., None]).sum((1, 2)) / (n * tokens.shape[2])).sqrt()
    copies = copies + noise_std * rms[:, None, None].to(tokens.dtype) * torch.randn_like(copies)
    return torch.where(mask[..., None].bool(), tokens, copies)


class Conditioner(nn.Module):
    """Maps a batch's conditions to (context tokens, pooled vector, adaptive-norm addition) for the MMDiT.

    Semantics (mode "disentangled", the paper's): a class label c becomes `class_tokens` learned tokens in
    the context stream, i.e. it acts through attention; label == num_classes is the null class of guidance.
    Text: the cached encoder features, a dropped caption replaced by the empty prompt's encoding (as SD3).
    Controls (size, crop, flip): sinusoidal features and a small MLP each, added to the adaptive-norm vector
    with the weight w(t) of `control_weight` (per-control power). Mode "adanorm" is the DiT/SDXL baseline the
    paper improves on: class embedding and controls summed into the adaptive-norm vector, with w = 1.
    """

    def __init__(self, num_classes, class_tokens, context_dim, pooled_dim, width, text_tokens=0,
                 controls=None, mode="disentangled", padding_noise=None):
        super().__init__()
        if mode not in ("disentangled", "adanorm"):
            raise ValueError(f"conditioning.mode must be 'disentangled' or 'adanorm', got {mode!r}")
        self.num_classes, self.class_tokens, self.pooled_dim = num_classes, class_tokens, pooled_dim
        self.mode, self.padding_noise, self.controls = mode, padding_noise, dict(controls or {})
        if num_classes and mode == "disentangled":
            self.class_embed = nn.Embedding((num_classes + 1) * class_tokens, context_dim)
            nn.init.normal_(self.class_embed.weight, std=0.02)
        elif num_classes:  # baseline: class in the adaptive norm; the context stream holds one constant token
            self.class_vector = nn.Embedding(num_classes + 1, width)
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

    def forward(self, cond, noise_level):
        drop, adanorm = cond["drop"], 0
        if "text_tokens" in cond:
            tokens = torch.where(drop[:, None, None], self.null_tokens.to(cond["text_tokens"]), cond["text_tokens"])
            pooled = torch.where(drop[:, None], self.null_pooled.to(cond["text_pooled"]), cond["text_pooled"])
            if self.padding_noise is not None:
                mask = torch.where(drop[:, None], self.null_mask.to(cond["text_mask"]), cond["text_mask"])
                tokens = replicate_padding(tokens, mask, self.padding_noise)
            context = tokens
        else:
            label = torch.where(drop, self.num_classes, cond["label"])
            pooled = torch.zeros(len(label), self.pooled_dim, device=label.device)
            if self.mode == "disentangled":
                ids = label[:, None] * self.class_tokens + torch.arange(self.class_tokens, device=label.device)
                context = self.class_embed(ids)
            else:
                context, adanorm = self.null_context.expand(len(label), -1, -1), self.class_vector(label)
        keep = ~cond["drop_controls"] if "drop_controls" in cond else torch.ones_like(drop)
        for name, power in self.controls.items():
            w = control_weight(noise_level, power) if self.mode == "disentangled" else torch.ones_like(noise_level)
            emb = self.control_mlp[name](sinusoidal(cond[CONTROL_FIELDS[name]].view(len(drop), -1)))
            adanorm = adanorm + emb * (w.float() * keep)[:, None]
        return context, pooled, adanorm


class Denoiser(nn.Module):
    """The trained module: MMDiT plus conditioner, so DDP, EMA, checkpoints and export see one thing.

    `timestep` is what diffusers' MMDiT expects, a float in [0, 1000]; `noise_level` in [0, 1] (1 = pure
    noise) drives the control schedule and defaults to timestep / 1000. The conditioner's adaptive-norm
    addition is added to the output of the transformer's time/pooled embedding (the vector every block's
    AdaLayerNorm reads) by a forward hook, so the transformer stays a stock diffusers model.
    """

    def __init__(self, transformer, conditioner):
        super().__init__()
        self.transformer, self.conditioner = transformer, conditioner
        self._adanorm = None
        transformer.time_text_embed.register_forward_hook(self._add_to_adanorm)

    def _add_to_adanorm(self, module, args, output):
        return output + self._adanorm.to(output.dtype) if torch.is_tensor(self._adanorm) else output  # 0: nothing

    def forward(self, x, timestep, cond, noise_level=None):
        noise_level = timestep / 1000 if noise_level is None else noise_level
        context, pooled, self._adanorm = self.conditioner(cond, noise_level)
        try:
            return self.transformer(hidden_states=x, encoder_hidden_states=context, pooled_projections=pooled,
                                    timestep=timestep).sample
        finally:
            self._adanorm = None


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
    return Conditioner(num_classes, cfg["model"]["class_tokens"], context_dim, pooled_dim, width, text_tokens,
                       {name: c["control_power"][name] for name in c["controls"]}, c["mode"],
                       c["padding_noise"] if c["replicate_padding"] else None)


def build_denoiser(cfg, channels, size, text_dims=None):
    """SD3Transformer2DModel (MMDiT, Esser et al. 2024) of the configured size and its conditioner.
    `text_dims` = (tokens, token dim, pooled dim) of the text encoder; None for class conditioning, whose
    tokens live in the model width."""
    from diffusers import SD3Transformer2DModel

    model = cfg["model"]
    width = model["num_attention_heads"] * model["attention_head_dim"]
    tokens, context_dim, pooled_dim = text_dims or (0, width, width)
    transformer = SD3Transformer2DModel(
        sample_size=size, patch_size=model["patch_size"], in_channels=channels, out_channels=channels,
        num_layers=model["num_layers"], attention_head_dim=model["attention_head_dim"],
        num_attention_heads=model["num_attention_heads"], joint_attention_dim=context_dim,
        caption_projection_dim=width, pooled_projection_dim=pooled_dim,
        pos_embed_max_size=size // model["patch_size"], qk_norm=model["qk_norm"])
    return Denoiser(transformer, make_conditioner(cfg, width, context_dim, pooled_dim, tokens))


def load_exported(folder):
    """The EMA model that a run exported: transformer via `from_pretrained`, conditioner from safetensors."""
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = Config(json.loads((folder / "config.json").read_text()))
    transformer = SD3Transformer2DModel.from_pretrained(folder / "transformer", use_safetensors=True)
    state = load_file(str(folder / "conditioner.safetensors"))
    tc = transformer.config
    conditioner = make_conditioner(cfg, tc.num_attention_heads * tc.attention_head_dim, tc.joint_attention_dim,
                                   tc.pooled_projection_dim, len(state.get("null_tokens", ())))
    conditioner.load_state_dict(state)
    return Denoiser(transformer, conditioner).eval(), cfg


def iterate_batches(dataset, start, batch_size, seed, rank, world, loader_kwargs):
    """Micro-batches forever, starting at micro-batch `start`. Epoch e visits a permutation seeded by
    seed + e, split across ranks; so the data position is a pure function of the micro-batch count and a
    resumed run continues exactly where it stopped, with nothing seen twice or skipped."""
    per_epoch = len(dataset) // world // batch_size
    if per_epoch == 0:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than train.batch_size ({batch_size})"
                         f" x {world} processes")
    epoch, offset = divmod(start, per_epoch)
    while True:
        perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch))
        mine = perm[rank::world][:per_epoch * batch_size].tolist()
        # Its own generator: a DataLoader otherwise draws its worker seed from the global RNG, which would
        # make the training noise depend on when the loader was created (and break exact resume).
        yield from torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=mine[offset * batch_size:],
                                               drop_last=True, generator=torch.Generator().manual_seed(seed + epoch),
                                               **loader_kwargs)
        epoch, offset = epoch + 1, 0


# ----------------------------------------------------------------------------------------------------------
# Training helpers: condition dropout, EMA, LR, time shift.


def make_accelerator(mixed_precision):
    """The Accelerator every script uses. cpu=True without CUDA: `accelerate launch --multi_gpu` then forms
    one gloo group of CPU processes; otherwise accelerate 1.x lets each process silently train alone, which
    is also refused here. TF32 matmuls and convolutions on Ampere and newer."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    if world != int(os.environ.get("WORLD_SIZE", world)):
        raise RuntimeError(f"launched {os.environ['WORLD_SIZE']} processes but accelerate formed a group of {world}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return accelerator


REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; the SLURM script in the README requeues on it


def ignore_stop_signals(worker_id=None):
    """DataLoader workers leave SIGTERM / SIGUSR1 to the training process, which checkpoints and exits."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def check_config(cfg):
    """Refuse illegal combinations at start-up, with a message naming the keys (all problems at once)."""
    d, m, tr = cfg["data"], cfg["model"], cfg["train"]
    factor = 1
    if cfg["encoders"]["vae"]:  # only the VAE's config is read here (no weights)
        from diffusers import AutoencoderKL

        factor = 2 ** (len(AutoencoderKL.load_config(cfg["encoders"]["vae"])["block_out_channels"]) - 1)
    errors = []
    if d["resolution"] % (m["patch_size"] * factor):
        errors.append(f"data.resolution={d['resolution']} is not divisible by model.patch_size={m['patch_size']}"
                      f" x the VAE's downsampling factor {factor}")
    if bool(d["caption_column"] or d["label_captions"]) != bool(cfg["encoders"]["text_encoder"]):
        errors.append("encoders.text_encoder goes with data.caption_column (or data.label_captions): set both or neither")
    if d["label_captions"] and (d["caption_column"] or not d["label_column"]):
        errors.append("data.label_captions captions each image with its class name: it needs data.label_column "
                      "and no data.caption_column")
    if m["pos_embed_transfer"] not in ("resample", "extend"):
        errors.append(f"model.pos_embed_transfer={m['pos_embed_transfer']!r} must be 'resample' or 'extend'")
    if not d["label_column"] and not d["caption_column"]:
        errors.append("set data.label_column (class-conditional) or data.caption_column (text-to-image)")
    if d["label_column"] and not d["caption_column"] and d["num_classes"] < 1:
        errors.append(f"data.num_classes={d['num_classes']} must be >= 1 with data.label_column")
    if tr["mixed_precision"] not in ("no", "fp16", "bf16"):
        errors.append(f"train.mixed_precision={tr['mixed_precision']!r} must be 'no', 'fp16' or 'bf16'")
    if tr["lr_schedule"] not in ("constant", "cosine", "linear"):
        errors.append(f"train.lr_schedule={tr['lr_schedule']!r} must be 'constant', 'cosine' or 'linear'")
    if tr["lr_scaling"] not in ("none", "sqrt", "linear"):
        errors.append(f"train.lr_scaling={tr['lr_scaling']!r} must be 'none', 'sqrt' or 'linear'")
    for key in ("batch_size", "grad_accum", "max_steps"):
        if tr[key] < 1:
            errors.append(f"train.{key}={tr[key]} must be >= 1")
    if errors:
        raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def drop_conditions(batch_size, rate, device, generator=None):
    """Bernoulli(rate) mask of samples whose condition is replaced by the null one (CFG training,
    Ho & Salimans 2022). Applied when the cache is read, never baked into it."""
    return torch.rand(batch_size, device=device, generator=generator) < rate


@torch.no_grad()
def ema_update(ema, model, decay, num_updates):
    """ema <- d * ema + (1 - d) * model with the warm-up d = min(decay, (1 + n) / (10 + n)), so a short run
    samples from what it learned rather than from a blend with the random initialisation."""
    d = min(decay, (1 + num_updates) / (10 + num_updates))
    ema_p = list(ema.parameters())
    torch._foreach_lerp_(ema_p, [p.detach().float() for p in model.parameters()], 1 - d)


def lr_at(step, base_lr, warmup_steps, schedule="constant", max_steps=1):
    """Linear warm-up to base_lr, then constant (the paper trains at a constant 1e-4), or a decay to 0 at
    max_steps: cosine (Loshchilov & Hutter 2017) or linear. A pure function of the optimizer step, so resuming
    needs no scheduler state."""
    warmup = min(1.0, (step + 1) / max(1, warmup_steps))
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, max_steps - warmup_steps)))
    if schedule == "constant":
        return base_lr * warmup
    if schedule == "cosine":
        return base_lr * warmup * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return base_lr * warmup * (1 - progress)
    raise ValueError(f"train.lr_schedule must be 'constant', 'cosine' or 'linear', got {schedule!r}")


def scaled_lr(tr, global_batch):
    """train.lr for train.lr_reference_batch, scaled to this run's global batch: "sqrt" (lr ~ sqrt(batch), the
    rule that keeps Adam's update noise constant; Malladi et al. 2022) or "linear" (Goyal et al. 2017, for
    SGD); "none" keeps train.lr. Returns the LR and a line saying how it was obtained, printed at start."""
    ratio = global_batch / tr["lr_reference_batch"]
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[tr["lr_scaling"]]  # check_config refused other values
    lr = tr["lr"] * ratio ** power
    how = "" if power == 0 else f" = {tr['lr']:g} x ({global_batch} / {tr['lr_reference_batch']})^{power:g}"
    return lr, (f"lr {lr:.3g}{how} ({tr['lr_scaling']} scaling rule), {tr['lr_schedule']} schedule, "
                f"{tr['warmup_steps']} warm-up steps of {tr['max_steps']}")


def shift_of(cfg):
    """The resolution shift a of a run: data.resolution / objective.shift_base_resolution if that is set
    (a = 2 for 512 px against a 256 px base), else objective.time_shift. Both trainers read it from the run's
    config, which is saved with the model, so training and sampling use the same shifted schedule."""
    obj = cfg["objective"]
    return cfg["data"]["resolution"] / obj["shift_base_resolution"] if obj["shift_base_resolution"] else obj["time_shift"]


def time_shift(t, shift):
    """Resolution time shift t' = a t / (1 + (a - 1) t) (SD3, Esser et al. 2024, eq. 23): a > 1 moves
    the same t toward noise, as more pixels need more noise to destroy the same signal. a = 1: identity."""
    return shift * t / (1 + (shift - 1) * t)


# ----------------------------------------------------------------------------------------------------------
# Monitoring: gradient norm and update size per layer group, vanishing / exploding flags, loss spikes.


def layer_groups(model):
    """{group: parameters} of a Denoiser: patch_embed, block_00 .. block_NN, final_layer, and conditioning
    (class / text / control embeddings, the time and context embedders)."""
    groups = {}
    for name, p in model.named_parameters():
        block = re.match(r"transformer\.transformer_blocks\.(\d+)\.", name)
        group = (f"block_{int(block[1]):02d}" if block else "patch_embed" if name.startswith("transformer.pos_embed.")
                 else "final_layer" if name.startswith(("transformer.norm_out.", "transformer.proj_out.")) else "conditioning")
        groups.setdefault(group, []).append(p)
    return groups


@torch.no_grad()
def group_grad_norms(groups, total_norm, clip):
    """The gradient norm of each group before clipping (the clip scaled every gradient by one factor, undone
    here), so the groups' norms add up in squares to the total norm that clip_grad_norm_ returned."""
    scale = max(1.0, (float(total_norm) + 1e-6) / clip)  # torch's clip_coef = clip / (total + 1e-6), capped at 1
    norms = torch.stack([torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
        [p.grad for p in ps if p.grad is not None] or [torch.zeros(1, device=ps[0].device)]))) for ps in groups.values()])
    return dict(zip(groups, (norms.float() * scale).tolist()))


@torch.no_grad()
def group_update_ratios(groups, before):
    """||w_after - w_before|| / ||w_before|| per group: the relative step the optimizer took (about 1e-3 per
    step is the usual healthy range for Adam at a sensible LR). `before`: {group: [weights before the step]}."""
    ratios = {}
    for g, ps in groups.items():
        delta = torch.stack(torch._foreach_norm(torch._foreach_sub([p.detach() for p in ps], before[g])))
        ratios[g] = (torch.linalg.vector_norm(delta) / torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(before[g]))).clamp(min=1e-12))
    return {g: float(r) for g, r in ratios.items()}


def gradient_flags(norms, ratio):
    """Groups whose gradient norm is `ratio` times below (vanishing: a dead or disconnected part) or above
    (exploding) the median group's, or not finite."""
    finite = sorted(v for v in norms.values() if math.isfinite(v))
    median = finite[len(finite) // 2] if finite else float("nan")
    return [(g, "grad_vanishing" if v < median / ratio else "grad_exploding") for g, v in norms.items()
            if not math.isfinite(v) or v < median / ratio or v > median * ratio]


def find_spikes(losses, state, threshold, warmup=100, decay=0.99):
    """(index, running mean) of each loss spike in a run of per-step losses: a loss more than `threshold`
    running standard deviations above the running mean, both EMAs over about 1 / (1 - decay) steps, after
    `warmup` steps.
    `state` ({"mean", "var", "n"}, saved in checkpoints) carries the EMAs across calls; its mean is the
    smoothed loss."""
    spikes = []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            continue
        if state["n"] == 0:
            state["mean"] = x
        limit = state["mean"] + threshold * math.sqrt(state["var"])
        if state["n"] >= warmup and x > limit:
            spikes.append((i, state["mean"]))
            x = limit  # a spike enters the statistics clipped, so it does not hide the next one
        delta = x - state["mean"]
        state["mean"] += (1 - decay) * delta
        state["var"] = decay * (state["var"] + (1 - decay) * delta ** 2)
        state["n"] += 1
    return spikes


# ----------------------------------------------------------------------------------------------------------
# Images and checkpoints.


def save_image_grid(images, path, nrow):
    """images in [-1, 1], (N, 3, H, W) -> one PNG grid; returns the PIL image."""
    from torchvision.utils import make_grid

    grid = make_grid(images.float().clamp(-1, 1).add(1).mul(127.5).round().byte().cpu(), nrow=nrow, padding=2)
    img = Image.fromarray(grid.permute(1, 2, 0).numpy())
    if images.shape[-1] < 64:  # small images (the demo's 16 px) are enlarged, pixel for pixel, to be seen
        factor = math.ceil(64 / images.shape[-1])
        img = img.resize((img.width * factor, img.height * factor), Image.NEAREST)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return img


def rng_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as lists: safe to load with weights_only=True
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(ckpt, rank, world):
    """This rank's RNG state from a checkpoint. A checkpoint written by a different number of processes
    still resumes (weights, EMA, optimizer, step), but not exactly: the data order and noise change."""
    saved = len(list(Path(ckpt).glob("rng_*.pt")))
    if saved != world:
        print(f"warning: {ckpt} was written by {saved} processes and is resumed by {world}: weights, EMA, "
              f"optimizer and step continue, but data order and noise differ from an uninterrupted run")
    if (Path(ckpt) / f"rng_{rank}.pt").exists():
        set_rng_state(torch.load(Path(ckpt) / f"rng_{rank}.pt", weights_only=True))


def set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_ok(folder):
    """Every file of a checkpoint opens: safetensors headers match the file sizes, state.pt unpickles."""
    try:
        for path in Path(folder).glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                f.keys()
        torch.load(Path(folder) / "state.pt", weights_only=True, map_location="cpu")
        return (Path(folder) / "model.safetensors").exists()
    except Exception:
        return False


def find_checkpoint(run_dir, resume):
    """`resume` is 'latest' (newest intact checkpoint of this run, or None) or a checkpoint folder. A
    truncated or corrupt newest checkpoint falls back to the previous one, with a warning."""
    if resume != "latest":
        if not checkpoint_ok(resume):
            raise FileNotFoundError(f"resume: no intact checkpoint at {resume} (model.safetensors, state.pt)")
        return Path(resume)
    for folder in sorted((Path(run_dir) / "checkpoints").glob("step_*"), reverse=True):
        if checkpoint_ok(folder):
            return folder
        print(f"warning: checkpoint {folder} is incomplete or corrupt; falling back to an earlier one")
    return None


def save_checkpoint(accelerator, run_dir, step, tensors, state, keep):
    """Write checkpoints/step_N atomically: into a temporary folder, renamed when complete; keep the last
    `keep`. Every rank calls this (each saves its own RNG state); the main process writes the rest."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, sd in tensors.items():
            save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(tmp / f"{name}.safetensors"))
        torch.save(state, tmp / "state.pt")  # written last: its presence marks a finished checkpoint
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


# ----------------------------------------------------------------------------------------------------------
# Transfer (init_from): a new run starts from another run's weights, at another resolution (256 -> 512 px) or
# on other data (ImageNet-22k -> 1k, or -> text-to-image). Unlike resume, optimizer, step and data position
# start fresh.

TEXT_BUFFERS = ("conditioner.null_tokens", "conditioner.null_mask", "conditioner.null_pooled")  # this run's encoder


def grid_positions(pos_embed):
    """The positions along one axis that a square 2-D sin-cos grid encodes, read back from its lowest
    frequency (diffusers' layout: [sin, cos] of the column, then of the row, D/4 frequencies each). A grid
    built by diffusers gives 0, 1, ..., g-1; a grid resampled before gives its fractional positions."""
    g, q = math.isqrt(pos_embed.shape[-2]), pos_embed.shape[-1] // 4
    lowest = pos_embed.reshape(g, g, 4, q)[0, :, :2, -1].double()  # row 0: sin, cos of the column position
    pos = torch.atan2(lowest[:, 0], lowest[:, 1]) / (1 / 10000 ** ((q - 1) / q))
    return pos.round() if (pos - pos.round()).abs().max() < 1e-3 else pos  # integers are exact


def resample_pos_embed(pos_embed, new_grid, mode="resample"):
    """The (1, new_grid^2, D) sin-cos grid for a new token grid, from an old one (1, g^2, D).
    resample (Berrada et al. 2024, Pseudocode 1, "rectified grid sampling"): new token i sits at old position
    p_i = (i + 0.5) g / new_grid - 0.5, so the new grid spans the positions the model was trained on (corners
    align, centres coincide) and the sin-cos features are evaluated there exactly.
    extend (diffusers' default): positions continue at the old spacing, centred (SD3 crops the centre of a
    larger grid), so a 2x grid reaches positions the model never saw."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed_from_grid

    old = grid_positions(pos_embed)
    g, spacing = len(old), (old[-1] - old[0]) / max(len(old) - 1, 1)
    i = torch.arange(new_grid, dtype=torch.float64)
    index = (i + 0.5) * g / new_grid - 0.5 if mode == "resample" else i - (new_grid - g) / 2
    pos = (old[0] + index * spacing).float()  # float32 positions, as diffusers builds its grid
    grid = torch.stack(torch.meshgrid(pos, pos, indexing="xy")).reshape(2, 1, new_grid, new_grid)
    return get_2d_sincos_pos_embed_from_grid(pos_embed.shape[-1], grid).float()[None]


def map_classes(source, target, source_ids, target_ids):
    """Class-embedding rows of the target's classes, taken from the source class with the same id (WordNet
    id for ImageNet-22k -> 1k); the last row, the null class of guidance, from the source's null class.
    Classes the source lacks keep their fresh initialisation. Each class may own several rows (class tokens)."""
    tokens = source.shape[0] // (len(source_ids) + 1)
    if target.shape[0] != (len(target_ids) + 1) * tokens or source.shape[0] != (len(source_ids) + 1) * tokens:
        raise ValueError(f"class embeddings {tuple(source.shape)} -> {tuple(target.shape)} do not fit "
                         f"{len(source_ids)} -> {len(target_ids)} classes with {tokens} tokens each")
    where = {c: i for i, c in enumerate(source_ids)}
    pairs = [(j, where[c]) for j, c in enumerate(target_ids) if c in where] + [(len(target_ids), len(source_ids))]
    out = target.clone().view(len(target_ids) + 1, tokens, -1)
    rows = torch.tensor(pairs, dtype=torch.long)
    out[rows[:, 0]] = source.view(len(source_ids) + 1, tokens, -1)[rows[:, 1]].to(out.dtype)
    return out.view_as(target), [c for c in target_ids if c not in where]


def adapt_state(source, target, source_ids=None, target_ids=None, pos_embed_mode="resample"):
    """The target model's state dict filled from a source state dict, and a report of what happened.
    Same-shaped tensors load; the positional grid is resampled (or extended) to the new token grid; class
    embeddings are mapped by id when both runs know their class ids; any other shape change, missing or
    unexpected tensor keeps the target's fresh value and is reported."""
    out, report = dict(target), {"loaded": 0, "adapted": [], "missing": [], "unexpected": [], "reshaped": []}
    for key, value in target.items():
        if key in TEXT_BUFFERS:
            continue  # the empty prompt of this run's own text encoder, set by the trainer
        if key not in source:
            report["missing"].append(key)
            continue
        src = source[key]
        if key.endswith("pos_embed.pos_embed") and src.shape != value.shape:
            out[key] = resample_pos_embed(src, math.isqrt(value.shape[1]), pos_embed_mode)
            report["adapted"].append(f"{key}: {pos_embed_mode} {math.isqrt(src.shape[1])}^2 -> "
                                     f"{math.isqrt(value.shape[1])}^2 positions")
        elif key.endswith(("class_embed.weight", "class_vector.weight")) and source_ids and target_ids:
            out[key], unmatched = map_classes(src, value, source_ids, target_ids)
            hint = "" if len(unmatched) < len(target_ids) else (
                f" (no id in common: the source's look like {source_ids[:2]}, this run's like {target_ids[:2]};"
                f" set data.class_ids so both name classes the same way)")
            report["adapted"].append(f"{key}: {len(target_ids) - len(unmatched)} of {len(target_ids)} classes "
                                     f"mapped by id from {len(source_ids)}; unmatched (fresh): {unmatched[:20]}{hint}")
        elif src.shape != value.shape:
            report["reshaped"].append(f"{key}: {tuple(src.shape)} -> {tuple(value.shape)}")
        else:
            out[key], report["loaded"] = src.to(value.dtype), report["loaded"] + 1
    report["unexpected"] = sorted(k for k in source if k not in target)
    return out, report


def read_weights(source):
    """(model state, EMA state, class ids, folder) of an init_from source: a run folder (its newest intact
    checkpoint), a checkpoint folder, or an export folder (whose EMA weights serve as both)."""
    from safetensors.torch import load_file

    folder = Path(source)
    if (folder / "checkpoints").is_dir() and not (folder / "model.safetensors").exists():
        folder = find_checkpoint(folder, "latest") or folder / "checkpoints"
    if checkpoint_ok(folder):
        state = torch.load(folder / "state.pt", weights_only=True)
        return (load_file(str(folder / "model.safetensors")), load_file(str(folder / "ema.safetensors")),
                state.get("class_ids"), folder)
    if (folder / "transformer").is_dir() and (folder / "conditioner.safetensors").exists():
        weights = {f"transformer.{k}": v for f in sorted((folder / "transformer").glob("*.safetensors"))
                   for k, v in load_file(str(f)).items()}
        weights.update({f"conditioner.{k}": v for k, v in load_file(str(folder / "conditioner.safetensors")).items()})
        ids = folder / "class_ids.json"
        return weights, weights, json.loads(ids.read_text()) if ids.exists() else None, folder
    raise FileNotFoundError(f"init_from: {source} is not a run folder with an intact checkpoint, a checkpoint "
                            f"(model.safetensors, state.pt) or an export (transformer/, conditioner.safetensors)")


def init_from(source, model, ema, class_ids=None, pos_embed_mode="resample", log=print):
    """Load another run's weights into `model` and its EMA into `ema` (see adapt_state); log every adapted,
    missing, unexpected and reshaped tensor and return the report."""
    model_state, ema_state, source_ids, folder = read_weights(source)
    reports = []
    for module, state in ((model, model_state), (ema, ema_state)):
        adapted, report = adapt_state(state, module.state_dict(), source_ids, class_ids, pos_embed_mode)
        module.load_state_dict(adapted)
        reports.append(report)
    report = {"source": str(folder), **reports[0]}
    log(f"init_from {folder}: {report['loaded']} tensors loaded (weights and EMA); optimizer, step and data "
        f"position start fresh")
    for kind in ("adapted", "missing", "unexpected", "reshaped"):
        if report[kind]:
            log(f"init_from {kind} ({len(report[kind])}{', kept at fresh init' if kind in ('missing', 'reshaped') else ''}"
                f"{', ignored' if kind == 'unexpected' else ''}): " + "; ".join(report[kind]))
    return report
