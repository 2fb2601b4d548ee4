"""Where images come from and how they become cached tensors (the seed's "Data Loading" stage).

    source (embedded demo, hub id, imagefolder, parquet, webdataset tar stream) -> open_splits (train / held-out)
      -> build_cache: cache check -> hit: load / miss: DecodedShards in DataLoader workers (load_image,
         preprocess: crop, flip, control metadata) -> encode in the main process (VAE posterior, text features
         or token ids) -> safetensors shards + manifest
      -> CachedDataset -> iterate_batches (a pure function of the micro-batch count, for exact resume)

Condition dropout (drop_conditions) is applied when the cache is read, never baked into it.
"""
import functools
import hashlib
import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

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
    drawn at random (seed 0) from the training split and removed from it. A streamed source (is_stream)
    gives (the training stream, its held-out rows): see open_stream and stream_heldout."""
    if is_stream(data):
        return open_stream(data, data.split), stream_heldout(data)
    train = open_dataset(data, data.split)
    if data.val_split is not None:
        val = open_dataset(data, data.val_split)
    else:
        perm = np.random.default_rng(0).permutation(len(train))
        val, train = train.select(sorted(perm[:data.val_holdout])), train.select(sorted(perm[data.val_holdout:]))
    if data.max_samples is not None:
        train = train.select(range(min(data.max_samples, len(train))))
    return train, val


def read_class_ids(data, ds):
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
    ids = read_class_ids(data, ds)
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

    img = Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") is not None else value["path"])  # b"": empty
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
# Streaming sources: webdataset tar shards (a local pattern such as /data/cc12m/{00000..01242}.tar, or a hub
# dataset with data.streaming) read by `datasets` one shard at a time as the cache needs it, never downloaded
# whole or converted to Arrow. Source shard k becomes cache shard k, so which rows a cache shard holds and how
# they are cropped depend on k alone, not on the number of nodes, ranks or DataLoader workers.


def is_stream(data):
    if data.source == "embedded":  # the demo data is generated, never streamed (a recipe run on it in the tests)
        return False
    return bool(data.get("streaming")) or ".tar" in data.source  # .get: runs saved before streaming existed


def expand_braces(pattern):
    """'/d/{00000..00002}.tar' -> ['/d/00000.tar', '/d/00001.tar', '/d/00002.tar'] (webdataset's shard
    notation, which `datasets` does not read; globs such as /d/*.tar are left to `datasets`)."""
    m = re.search(r"\{(\d+)\.\.(\d+)\}", pattern)
    if not m:
        return [pattern]
    first, last = m.groups()
    return [p for i in range(int(first), int(last) + 1)
            for p in expand_braces(pattern[:m.start()] + str(i).zfill(len(first)) + pattern[m.end():])]


def open_stream(data, split):
    """Split `split` of a streamed source as one `datasets.IterableDataset` with images undecoded; nothing is
    read yet but the shard list. The held-out shards are checked here, before any work."""
    import datasets

    if ".tar" in data.source:
        ds = datasets.load_dataset("webdataset", data_files={split: expand_braces(data.source)}, split=split,
                                   streaming=True)
    else:
        ds = datasets.load_dataset(data.source, split=split, streaming=True)
    columns = list(ds.features or ())
    errors = [f"data.{key}='{data[key]}' is not a column of {data.source} (split '{split}'); its columns are "
              f"{columns}" for key in ("image_column", "label_column", "caption_column")
              if data[key] is not None and columns and data[key] not in columns]
    if data.max_samples is not None:
        errors.append("data.max_samples does not apply to a streamed source: name fewer shards in data.source")
    if data.val_split is not None and ".tar" in data.source:
        errors.append("data.val_split needs a hub dataset with that split; for tar shards hold out data.val_shards")
    if data.val_split is None and not 0 < len(val_shard_range(data, ds.num_shards)) < ds.num_shards:
        errors.append(f"data.val_shards={data.val_shards}: a streamed source holds out the source shards [first, "
                      f"stop) of its {ds.num_shards} (negative: from the end, as in Python; null stop: to the end), "
                      f"leaving some to train on, e.g. [-1, null] (the last); or set data.val_split")
    if errors:
        raise ValueError("invalid streamed source:\n  " + "\n  ".join(errors))
    return ds.cast_column(data.image_column, datasets.Image(decode=False))


def val_shard_range(data, num_shards):
    shards = data.val_shards
    if not (isinstance(shards, list) and len(shards) == 2 and all(v is None or isinstance(v, int) for v in shards)):
        return range(0)
    return range(*slice(*shards).indices(num_shards))


def stream_shards(data, ds, part):
    """The source shards of `part`: data.val_shards [first, stop) are held out and the training part has the
    others (with data.val_split, each split is its own stream and has all of its shards)."""
    if data.val_split is not None:
        return list(range(ds.num_shards))
    held = val_shard_range(data, ds.num_shards)
    return list(held) if part == "val" else [k for k in range(ds.num_shards) if k not in held]


def shard_of(ds, k):
    return ds.shard(num_shards=ds.num_shards, index=k)  # source shard k alone (one tar file)


def tag_shard(row, k):
    return {"__shard__": k}


def stream_heldout(data):
    """The held-out rows of a streamed source: the first data.val_holdout samples of data.val_split, or of the
    source shards data.val_shards, in shard order, as a small in-memory Dataset. They are the same rows for
    every process count, and eval_fid.py reads the same ones (it calls this)."""
    import itertools

    import datasets

    val = open_stream(data, data.val_split or data.split)
    rows = itertools.chain.from_iterable(shard_of(val, k) for k in stream_shards(data, val, "val"))
    return datasets.Dataset.from_list(list(itertools.islice(rows, data.val_holdout)), features=val.features)


def samples_per_shard(ds, shards, size):
    """Rows of each cache shard, to size the cache and the progress bar. A stream's are estimated as the count
    of its first shard (webdataset shards are written with equal counts but the last); others are exact."""
    import datasets

    if not isinstance(ds, datasets.IterableDataset):
        return {k: min(size, len(ds) - k * size) for k in shards}
    first = sum(1 for _ in shard_of(ds, shards[0])) if shards else 0
    return {k: first for k in shards}


class DecodedShards(torch.utils.data.IterableDataset):
    """The rows of cache shards `shards`, decoded, checked and cropped in DataLoader workers (data.num_workers)
    while the encoders run in the main process. Each worker reads whole shards, one after another, and yields
    each in batches of data.encode_batch_size tagged with the shard; crops and flips draw from random.Random(k),
    so cache shard k is the same whatever the number of ranks and workers. Unusable rows (broken image, tiny
    image, missing caption) are reported in the batch's "skipped" and left out, never crash the build."""

    def __init__(self, ds, shards, data, names=None):
        self.ds, self.shards, self.data, self.names = ds, shards, data, names

    def rows(self):
        """(shard, where, row) of this worker's shards, shard after shard. A stream's shards are shared out to
        the DataLoader workers by `datasets` itself (each worker streams only its own tar files); a map-style
        dataset's by us, shards[w::W], shard k holding rows [k S, (k + 1) S)."""
        import datasets

        if isinstance(self.ds, datasets.IterableDataset):
            if not self.shards:
                return
            tagged = [shard_of(self.ds, k).map(functools.partial(tag_shard, k=k)) for k in self.shards]
            for row in datasets.concatenate_datasets(tagged):
                k = row["__shard__"]
                yield k, f"{row.get('__url__', f'shard {k}')}:{row.get('__key__')}", row
            return
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        size = self.data.shard_size
        for k in self.shards[worker::workers]:
            columns = self.ds[k * size:(k + 1) * size]
            for i, values in enumerate(zip(*columns.values())):
                row = dict(zip(columns, values))
                yield k, row[self.data.image_column].get("path") or f"row {k * size + i}", row

    def caption(self, row):
        data = self.data
        if data.label_captions:  # ImageNet-22k as text-to-image data: the class name is the caption
            return self.names[row[data.label_column]]
        if data.caption_column is None:
            return None
        if not isinstance(row[data.caption_column], str) or not row[data.caption_column].strip():
            raise ValueError(f"missing caption (data.caption_column='{data.caption_column}')")
        return row[data.caption_column]

    def __iter__(self):
        data, shard, rng, batch = self.data, None, None, None
        for k, where, row in self.rows():
            if k != shard:  # a worker reads its shards one after another: the previous one is finished
                if shard is not None:
                    yield self.collate(shard, batch, last=True)
                # Crops and flips depend on the shard, not on the rank, the world size or the worker.
                shard, rng = k, random.Random(k)
                batch = {name: [] for name in ("pixels", "metas", "captions", "labels", "skipped")}
            try:
                img = load_image(row[data.image_column])
                if min(img.size) < data.min_image_side:
                    raise ValueError(f"{img.size[0]}x{img.size[1]} px is below data.min_image_side")
                caption = self.caption(row)
                pixel, meta = preprocess(img, data.resolution, data, rng)
            except Exception as e:  # truncated, empty, not an image, too small, no caption: report, skip
                batch["skipped"].append(f"{where}: {type(e).__name__}: {e}"[:300])
                continue
            batch["pixels"].append(pixel), batch["metas"].append(meta), batch["captions"].append(caption)
            batch["labels"].append(row[data.label_column] if data.label_column else None)
            if len(batch["pixels"]) == data.encode_batch_size:
                yield self.collate(k, batch, last=False)
                batch = {name: [] for name in batch}
        if shard is not None:
            yield self.collate(shard, batch, last=True)

    def collate(self, k, batch, last):
        data, n = self.data, len(batch["pixels"])
        return {"shard": k, "last": last, "skipped": batch["skipped"],
                "pixels": torch.stack(batch["pixels"]) if n else torch.zeros(0, 3, data.resolution, data.resolution),
                "metas": {name: torch.stack([m[name] for m in batch["metas"]]) for name in (batch["metas"] or [{}])[0]},
                "captions": batch["captions"] if data.caption_column or data.label_captions else None,
                "labels": torch.tensor(batch["labels"], dtype=torch.long) if data.label_column and n else None}


def encoded_rows(batch, encode, data, text):
    """One decoded batch -> the tensors its rows add to their cache shard: encoder outputs in data.cache_dtype
    (token ids stay integers), control metadata and labels."""
    out = encode(batch["pixels"], batch["captions"], **({"text": text} if text == "tokens" else {}))
    dtype = getattr(torch, data.cache_dtype)
    out = {name: value.to("cpu", dtype if value.is_floating_point() else value.dtype) for name, value in out.items()}
    out.update(batch["metas"])
    if batch["labels"] is not None:
        out["label"] = batch["labels"]
    return out


def cache_size(encode, data, text, shard_rows):
    """(bytes per sample, total bytes) of a cache of shards with `shard_rows` rows each: one blank image goes
    through the same encode and tensor layout that build_cache writes, so the estimate is the cache's own
    layout (a shard's safetensors header included); only skipped rows make the real cache smaller."""
    from safetensors.torch import save

    img = Image.new("RGB", (data.resolution, data.resolution))
    pixel, meta = preprocess(img, data.resolution, data, random.Random(0))
    probe = {"pixels": pixel[None], "metas": {k: v[None] for k, v in meta.items()}, "skipped": [],
             "captions": [""] if data.caption_column or data.label_captions else None,
             "labels": torch.zeros(1, dtype=torch.long) if data.label_column else None}
    tensors = encoded_rows(probe, encode, data, text)
    per_row = sum(t.numel() * t.element_size() for t in tensors.values())
    one_row = save({name: t.contiguous() for name, t in tensors.items()}, metadata={"rows": "1", "skipped": "[]"})
    header = len(one_row) - per_row
    return per_row, sum(shard_rows) * per_row + len(shard_rows) * header


def human_bytes(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000

# ----------------------------------------------------------------------------------------------------------
# Frozen encoders: a diffusers AutoencoderKL (None: pixel space) and a transformers text encoder (None: class
# labels), by hub id or local path.


def from_pretrained(key, load, name, **kwargs):
    """load(name, **kwargs) for the model that config key `key` names. A model that is neither a local folder
    nor in the Hugging Face cache, and cannot be downloaded (an offline node, a gated or misspelt id), stops the
    run with one line naming the key and the command that fetches it, not a library traceback."""
    try:
        return load(name, **kwargs)
    except OSError as e:  # what diffusers and transformers raise for a model they cannot find
        from huggingface_hub import constants

        why = str(e).strip().splitlines()[0].rstrip(".") + (" (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "")
        raise SystemExit(f"{key}='{name}' cannot be loaded: {why}. On a machine with network run `python "
                         f"prefetch.py --config YOUR_CONFIG` and copy the Hugging Face cache it names (HF_HOME) "
                         f"here, or set {key} to a local folder.") from None


def load_encoders(enc, device):
    vae = tokenizer = text_encoder = None
    if enc.vae:
        from diffusers import AutoencoderKL

        vae = from_pretrained("encoders.vae", AutoencoderKL.from_pretrained, enc.vae, use_safetensors=True)
        vae = vae.to(device).eval().requires_grad_(False)
    if enc.text_encoder:
        from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel, T5EncoderModel

        key, name = "encoders.text_encoder", enc.text_encoder
        kind = from_pretrained(key, AutoConfig.from_pretrained, name).model_type
        model_cls = {"clip": CLIPTextModel, "clip_text_model": CLIPTextModel, "t5": T5EncoderModel}.get(kind, AutoModel)
        tokenizer = from_pretrained(key, AutoTokenizer.from_pretrained, name)
        text_encoder = from_pretrained(key, model_cls.from_pretrained, name, use_safetensors=True)
        text_encoder = text_encoder.to(device).eval().requires_grad_(False)
    return vae, tokenizer, text_encoder


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
    mask = attention_mask.float()
    pooled = getattr(out, "pooler_output", None)
    if pooled is None:
        pooled = (out.last_hidden_state * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return {"text_tokens": out.last_hidden_state, "text_mask": mask, "text_pooled": pooled}


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
    """Model space -> pixels in [-1, 1] (inverse of make_encode's scaling). With `device`, an offloaded VAE
    comes to it for the call and leaves again (encoders stay off the GPU while training)."""
    if vae is None:
        return x
    if device is not None:
        vae.to(device)
    out = vae.decode(x.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)).sample
    if device is not None:
        vae.cpu()
    return out

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
    if is_stream(data):
        key["val_shards"] = data.val_shards
    if part == "train" and not data.cache_text and enc.text_encoder:
        key["cache_text"] = False  # token ids, not features
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
    import datasets

    data = cfg.data
    streamed = isinstance(ds, datasets.IterableDataset)
    shards = stream_shards(data, ds, part) if streamed else list(range(math.ceil(len(ds) / data.shard_size)))
    key = cache_key(cfg, part, f"{len(shards)} source shards" if streamed else len(ds))
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
        accelerator.print(f"cache miss ({part}): encoding {len(shards)} shards into {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    names = class_names(data, ds) if data.label_captions else None
    rank, world = accelerator.process_index, accelerator.num_processes
    text = "tokens" if part == "train" and not data.cache_text else "features"  # held-out rows keep features

    def path_of(k):
        return folder / f"shard_{k:05d}.safetensors"
    missing = [k for k in shards if not (path_of(k).exists() and shard_ok(path_of(k)))]  # resume: finished stay
    rows = samples_per_shard(ds, missing, data.shard_size)
    per_row, size = cache_size(encode, data, text, list(rows.values()))
    free = shutil.disk_usage(folder).free
    accelerator.print(f"cache ({part}): {len(missing)} of {len(shards)} shards to write, about {sum(rows.values())} "
                      f"samples x {per_row} bytes = {human_bytes(size)}; {human_bytes(free)} free on {data.cache_dir}")
    if size > free:
        raise SystemExit(f"data.cache_dir='{data.cache_dir}' has {human_bytes(free)} free, the {part} cache needs "
                         f"about {human_bytes(size)}: free space, choose another data.cache_dir, or shrink the cache "
                         f"(data.cache_text=false keeps token ids instead of text features)")
    mine = [k for j, k in enumerate(shards) if j % world == rank and k in rows]  # a shard's rank: its position
    # Its own generator: a DataLoader with workers otherwise draws their seed from the global RNG, and a run
    # that built the cache would initialise its model differently from one that found it (no exact resume).
    loader = torch.utils.data.DataLoader(DecodedShards(ds, mine, data, names), batch_size=None,
                                         generator=torch.Generator().manual_seed(0),
                                         **loader_options(data, torch.device("cpu")))
    progress = tqdm(total=sum(rows[k] for k in mine), unit="img", desc=f"cache {part} (rank {rank})",
                    disable=not accelerator.is_local_main_process)
    pending, encoded, skipped, start = {}, 0, 0, time.perf_counter()
    for batch in loader:  # decoded in the workers; encoded here, on the device
        shard = pending.setdefault(batch["shard"], {"tensors": {}, "skipped": [], "rows": 0})
        if len(batch["pixels"]):
            for name, value in encoded_rows(batch, encode, data, text).items():
                shard["tensors"].setdefault(name, []).append(value)
        shard["skipped"] += batch["skipped"]
        shard["rows"] += len(batch["pixels"])
        encoded, skipped = encoded + len(batch["pixels"]), skipped + len(batch["skipped"])
        progress.update(len(batch["pixels"]) + len(batch["skipped"]))
        if batch["last"]:
            shard = pending.pop(batch["shard"])
            tmp = path_of(batch["shard"]).with_suffix(".tmp")
            save_file({name: torch.cat(parts).contiguous() for name, parts in shard["tensors"].items()}, str(tmp),
                      metadata={"rows": str(shard["rows"]), "skipped": json.dumps(shard["skipped"])})
            os.replace(tmp, path_of(batch["shard"]))
    for k in mine:  # a shard with no rows at all never reached the loop: it is finished, and empty
        if not path_of(k).exists():
            save_file({}, str(path_of(k)), metadata={"rows": "0", "skipped": "[]"})
    progress.close()
    seconds = time.perf_counter() - start
    print(f"cache {part} rank {rank}: encoded {encoded} images, skipped {skipped}, {len(mine)} shards in "
          f"{seconds:.1f} s ({encoded / max(seconds, 1e-9):.1f} images/s)", flush=True)
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
        return {name: f.get_slice(name)[j] if name in ("label", "input_ids", "attention_mask")  # stay integers
                else f.get_slice(name)[j].float() for name in self.keys}

    def __getstate__(self):
        return {**self.__dict__, "handles": {}}

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


def drop_conditions(batch_size, rate, device, generator=None):
    """Bernoulli(rate) mask of samples whose condition is replaced by the null one (CFG training,
    Ho & Salimans 2022). Applied when the cache is read, never baked into it."""
    return torch.rand(batch_size, device=device, generator=generator) < rate



def loader_options(data, device):
    """DataLoader settings: workers (which leave stop signals to the trainer), pinned memory on CUDA."""
    from common import ignore_stop_signals

    kwargs = dict(num_workers=data.num_workers, pin_memory=device.type == "cuda", worker_init_fn=ignore_stop_signals)
    if data.num_workers > 0:
        kwargs["prefetch_factor"] = data.prefetch_factor
    return kwargs


# ----------------------------------------------------------------------------------------------------------
# Validation inputs: fixed conditions and noise for the sample grid, fixed batches for the held-out loss.

COND_FIELDS = ("label", "text_tokens", "text_mask", "text_pooled", "orig_hw", "crop_box", "flip")  # what the conditioner reads


def conditions_of(batch, device):
    """The condition fields of a batch, on the device, with no condition dropped."""
    cond = {k: v.to(device) for k, v in batch.items() if k in COND_FIELDS}
    cond["drop"] = torch.zeros(len(next(iter(batch.values()))), dtype=torch.bool, device=device)
    return cond


def validation_inputs(val_set, num_samples, num_classes, x_shape, seed, device):
    """Fixed conditions and noise for the validation grid: the first held-out rows' captions and controls,
    and the classes in order (0, 1, 2, ...) for class-conditional runs."""
    n = min(num_samples, len(val_set))
    rows = [val_set[i] for i in range(n)]
    cond = conditions_of({k: torch.stack([r[k] for r in rows]) for k in rows[0]}, device)
    if "label" in cond:
        cond["label"] = torch.arange(n, device=device) % num_classes
    noise = torch.randn((n, *x_shape), generator=torch.Generator().manual_seed(seed)).to(device)
    return noise, cond


def heldout_batches(val_set, num_samples, batch_size, seed, device):
    """(x0, noise, cond) batches of the first `num_samples` held-out rows with fixed latents draws and noise,
    so the validation loss of two checkpoints differs only by the model."""
    gen, n = torch.Generator().manual_seed(seed), min(num_samples, len(val_set))
    for i in range(0, n, batch_size):
        rows = [val_set[j] for j in range(i, min(i + batch_size, n))]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        x0 = batch["x"] + batch["x_std"] * torch.randn(batch["x"].shape, generator=gen) if "x_std" in batch else batch["x"]
        noise = torch.randn(x0.shape, generator=gen)
        yield x0.to(device), noise.to(device), conditions_of(batch, device)
