"""Where images come from and how they become cached tensors (the seed's "Data Loading" stage).

    source (embedded demo, hub id, imagefolder, parquet, webdataset tar stream) -> open_splits (labels checked
      against data.num_classes, read from the data when unset; train / held-out rows sized and announced)
      -> check_cache_shared (every rank sees data.cache_dir) -> build_cache: cache check (checksums) -> hit:
         load / miss: DecodedShards in DataLoader workers (load_image, preprocess: crop, flip, control metadata)
         -> encode in the main process (VAE posterior, text features or token ids) -> safetensors shards + manifest
      -> CachedDataset -> iterate_batches (a pure function of the micro-batch count, for exact resume)

Condition dropout (drop_conditions) is applied when the cache is read, never baked into it.
"""
import functools
import glob
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

from monitor import interactive

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


HOLDOUT_FRACTION, HOLDOUT_MAX = 0.1, 256  # data.val_holdout unset: 10% of the rows, at most 256


def open_splits(data, log=print):
    """(train, held-out) datasets, announced with their sizes and origin. Labels are checked first
    (check_labels), and an unset data.num_classes is read from the data (class_count).

    The held-out rows are `data.val_split` if the source has one; else rows drawn at random (seed 0) from the
    training split and removed from it: data.val_holdout of them, or, unset (None), 10% of the rows and at
    most 256 (4,864 demo rows: 256; a 300-image folder: 30). An explicit hold-out must leave at least as many
    rows to train on as it holds out, else it is an error naming data.val_holdout.

    A streamed source (is_stream) gives (the training stream, its held-out rows): see open_stream and
    stream_heldout."""
    if is_stream(data):
        return open_stream(data, data.split), stream_heldout(data)
    train = open_dataset(data, data.split)
    classes = data.label_column and (not data.caption_column or data.label_captions)  # labels are the condition
    if data.label_column and data.num_classes is None and (classes or class_id_list(data, train)):
        data.num_classes, origin = class_count(data, train)  # text runs: only if named (kept with the model)
        log(f"data: data.num_classes={data.num_classes}, read from {origin}")
    if classes:
        check_labels(data, train, data.split)
    if data.val_split is not None:
        val = open_dataset(data, data.val_split)
        if classes:
            check_labels(data, val, data.val_split)
        origin = f"split '{data.val_split}' (data.val_split)"
    else:
        n, holdout = len(train), data.val_holdout
        if holdout is None:
            holdout = max(1, min(HOLDOUT_MAX, int(n * HOLDOUT_FRACTION)))
            origin = f"drawn from split '{data.split}' (data.val_holdout unset: 10% of the rows, at most 256)"
        elif type(holdout) is not int or holdout < 1:
            raise ValueError(f"data.val_holdout={holdout!r} must be a whole number of rows >= 1, or null (10% of "
                             f"the rows, at most 256)")
        else:
            origin = f"drawn from split '{data.split}' (data.val_holdout={holdout})"
        if n - holdout < holdout:
            raise ValueError(f"data.val_holdout={holdout} holds out {min(holdout, n)} of the {n} rows of {data.source} "
                             f"(split '{data.split}'), leaving {max(0, n - holdout)} to train on: fewer than it holds "
                             f"out. Set data.val_holdout to at most {n // 2} (e.g. {max(1, int(n * HOLDOUT_FRACTION))}), "
                             f"leave it null (10% of the rows, at most 256), or name a held-out split in data.val_split")
        perm = np.random.default_rng(0).permutation(n)
        val, train = train.select(sorted(perm[:holdout])), train.select(sorted(perm[holdout:]))
    trimmed = ""
    if data.max_samples is not None and data.max_samples < len(train):
        trimmed = f" (the first {data.max_samples} of {len(train)}: data.max_samples)"
        train = train.select(range(data.max_samples))
    log(f"data: {data.source}: {len(train)} rows train from split '{data.split}'{trimmed}; {len(val)} rows held out "
        f"for validation, {origin}")
    return train, val


def class_count(data, ds):
    """(number of classes, where it was read) for an unset data.num_classes: the names of a ClassLabel label
    column (an imagefolder's class folders become one), else the ids of data.class_ids."""
    import datasets

    feature = ds.features.get(data.label_column)
    if isinstance(feature, datasets.ClassLabel):
        return feature.num_classes, f"the ClassLabel names of column '{data.label_column}'"
    if data.class_ids is not None:
        return len(class_id_list(data, ds)), f"data.class_ids={data.class_ids!r}"
    labels = ds.with_format("numpy", columns=[data.label_column])[:][data.label_column]
    found = f"; its labels run from {labels.min():g} to {labels.max():g}" if len(labels) else ""
    raise ValueError(f"data.num_classes is unset and column '{data.label_column}' of {data.source} has no class "
                     f"names (it is not a ClassLabel column, nor are there class folders){found}: set "
                     f"data.num_classes, or data.class_ids to a file with one class name per line")


def check_labels(data, ds, split, show=5):
    """Every label of `ds` (split `split` of data.source) must be a class, 0 .. data.num_classes - 1: a larger
    one crashes deep inside torch at the first step (a device-side assert on a GPU), and num_classes itself
    would silently train as the null class of guidance. Raises naming the rows, the range found and a fix."""
    labels = ds.with_format("numpy", columns=[data.label_column])[:][data.label_column]
    if labels.dtype.kind not in "iuf":
        raise ValueError(f"data.label_column='{data.label_column}' of {data.source} (split '{split}') holds "
                         f"{labels.dtype} values such as {labels[:3].tolist()}, not class indices 0, 1, 2, ...")
    k = data.num_classes
    bad = np.flatnonzero(~((labels >= 0) & (labels < k) & (labels == np.round(labels))))  # NaN: a missing label
    if len(bad) == 0:
        return
    rows = []
    for i in bad[:show].tolist():
        path = (ds[i][data.image_column] or {}).get("path")
        rows.append(f"{i} (label {labels[i]:g}{', ' + Path(path).name if path else ''})")
    valid = labels[~np.isnan(labels)] if labels.dtype.kind == "f" else labels
    found = f"{valid.min():g} .. {valid.max():g}" if len(valid) else "none (all missing)"
    hint = ""
    if len(valid) and valid.min() == 1 and valid.max() == k:
        hint = (f" They look 1-based: renumber them 0 .. {k - 1} (subtract 1 in your metadata), or set "
                f"data.num_classes={k + 1} and leave class 0 unused.")
    elif len(valid) and valid.max() >= k:
        hint = f" If there are more classes, set data.num_classes={int(valid.max()) + 1}."
    raise ValueError(f"data.label_column='{data.label_column}': {len(bad)} of the {len(labels)} rows of "
                     f"{data.source} (split '{split}') have a label that is not a class 0 .. {k - 1} "
                     f"(data.num_classes={k}; label {k} would train as the guidance null class): rows "
                     f"{', '.join(rows)}{' ...' if len(bad) > show else ''}. The labels found run {found}.{hint}")


def class_id_list(data, ds):
    """The class ids named by data.class_ids (a timm ImageNet subset or a file), or the label column's
    ClassLabel names when it is None; None when there are none."""
    import datasets

    if data.class_ids is None:
        feature = ds.features.get(data.label_column) if data.label_column else None
        return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    if Path(data.class_ids).is_file():
        return Path(data.class_ids).read_text().split()
    from timm.data import ImageNetInfo

    return list(ImageNetInfo(data.class_ids).label_names())


def read_class_ids(data, ds):
    """The WordNet id (or other stable name) of each label index, from the dataset's own metadata, or None.
    `data.class_ids` names a timm ImageNet subset ("imagenet-1k", "imagenet-22k": the synset lists that the
    hub's ImageNet copies are indexed by) or a text file with one id per line; None reads the label column's
    ClassLabel names (an imagefolder of n0xxxxxxx folders holds the WordNet ids there)."""
    ids = class_id_list(data, ds)
    if ids is not None and len(ids) != data.num_classes:
        where = data.class_ids or f"the ClassLabel names of column {data.label_column}"
        raise ValueError(f"data.class_ids: {len(ids)} class ids ({where}) but data.num_classes={data.num_classes}")
    return ids


def class_names(data, ds):
    """Readable class names, the captions of `data.label_captions`."""
    ids = read_class_ids(data, ds)
    if ids is None:
        raise ValueError(f"data.label_captions needs class names: data.label_column='{data.label_column}' is not a "
                         f"ClassLabel column of {data.source}; set data.class_ids (e.g. 'imagenet-22k' or a file)")
    return readable_names(ids)


def readable_names(ids):
    """WordNet ids become their lemmas ("n01440764" -> "tench, Tinca tinca"); other ids are names already, and
    so is a WordNet-like id that ImageNet-22k does not know."""
    if not ids or not all(re.fullmatch(r"n\d{8}", i) for i in ids):
        return list(ids)
    from timm.data import ImageNetInfo

    info = ImageNetInfo("imagenet-22k")
    known = set(info.label_names())
    return [info.label_name_to_description(i) if i in known else i for i in ids]


def load_image(value):
    """Decode an undecoded `datasets.Image` value to 8-bit RGB, converted with its full range, never clipped:
    16-bit grey (I;16) divides by 257 (65535 -> 255), as does 16-bit RGB (Pillow keeps the high byte);
    32-bit int (I) and float (F) images go through to_8bit; CMYK, palette and grey convert as Pillow does;
    transparency (RGBA, LA, PA, a palette's transparent index) is composited on white, not on black."""
    import io

    img = Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") is not None else value["path"])  # b"": empty
    img.load()
    if img.mode.startswith("I") or img.mode.startswith("F"):  # I;16, I;16B, I, F: not 8-bit
        img = Image.fromarray(to_8bit(np.asarray(img), img.mode))
    if img.mode in ("RGBA", "LA", "PA", "P", "La", "RGBa") or "transparency" in img.info:
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, img)
    return img.convert("RGB")


def to_8bit(a, mode):
    """A high-depth grey image as uint8, by the range of its type: I;16 is 0 .. 65535; I (32-bit int) is taken
    as 8-bit if its values fit 0 .. 255, as 16-bit if they fit 0 .. 65535 (16-bit PNG / TIFF read as I), else
    stretched from its min to its max; F is taken as 0 .. 1 if its values fit, as 0 .. 255 if they fit, else
    stretched likewise."""
    a = a.astype(np.float64)
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if mode.startswith("I;16"):
        lo, hi = 0.0, 65535.0
    elif mode == "F" and 0 <= lo and hi <= 1:
        lo, hi = 0.0, 1.0
    elif 0 <= lo and hi <= 255:
        lo, hi = 0.0, 255.0
    elif mode.startswith("I") and 0 <= lo and hi <= 65535:
        lo, hi = 0.0, 65535.0
    return np.round((a - lo) / max(hi - lo, 1e-12) * 255).clip(0, 255).astype(np.uint8)


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
    source shards data.val_shards (unset: 256), in shard order, as a small in-memory Dataset. They are the same rows for
    every process count, and eval_fid.py reads the same ones (it calls this)."""
    import itertools

    import datasets

    val = open_stream(data, data.val_split or data.split)
    rows = itertools.chain.from_iterable(shard_of(val, k) for k in stream_shards(data, val, "val"))
    return datasets.Dataset.from_list(list(itertools.islice(rows, data.val_holdout or HOLDOUT_MAX)), features=val.features)


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
    one_row = save({name: t.contiguous() for name, t in tensors.items()}, metadata={"rows": "1", "skipped": "[]", "sha256": "0" * 64})
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
# Each shard k holds dataset rows [k * S, (k + 1) * S) and is written by rank k % world_size, atomically, with
# a checksum of its tensors in its header. A shard counts as finished only once it verifies (header, checksum,
# finite values), so a damaged shard is rebuilt like a missing one and an interrupted extraction resumes at the
# shards still missing. The folder is named by a hash of everything that changes the content, so a changed key
# is a miss that names what changed, never a silent reuse.


def source_fingerprint(data, ds):
    """A cheap fingerprint of the source's content, so that data changed under the same name is a miss: the
    relative path, size and modification time of every file of a local source (an image edited in place
    changes it), the dataset's own fingerprint for hub data (its revision and files), None for the demo
    (its parameters are in the key)."""
    if data.source == "embedded":
        return None
    root = Path(data.source)
    if is_stream(data) and ".tar" in data.source:  # local tar shards: the files the pattern names
        root = Path("/")
        files = sorted(Path(f).resolve() for pattern in expand_braces(data.source) for f in glob.glob(pattern))
    elif not root.exists():
        return {"dataset_fingerprint": getattr(ds, "_fingerprint", None)}  # hub data (a stream has none)
    else:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest, total = hashlib.sha256(), 0
    for path in files:
        stat = path.stat()
        total += stat.st_size
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"files": len(files), "bytes": total, "sha256": digest.hexdigest()[:16]}


def cache_key(cfg, part, ds, rows):
    """Everything that changes what the shards of split `part` hold (shard_size too: it decides which rows a
    shard file holds, so resuming a build under another size would duplicate or drop rows)."""
    data, enc = cfg.data, cfg.encoders
    key = {"source": data.source, "part": part, "split": data.split, "val_split": data.val_split,
           "val_holdout": data.val_holdout, "rows": rows, "resolution": data.resolution,
           "crop": [data.crop, data.min_crop_scale, data.random_flip],
           "columns": [data.image_column, data.label_column, data.caption_column], "vae": enc.vae,
           "text_encoder": enc.text_encoder, "max_tokens": enc.max_tokens if enc.text_encoder else None,
           "dtype": data.cache_dtype, "min_image_side": data.min_image_side, "shard_size": data.shard_size,
           "source_files": source_fingerprint(data, ds), "format": 4}
    if data.source == "embedded":
        key["demo"] = [data.demo_samples, data.demo_resolution]
    if data.label_captions:
        key["label_captions"] = data.class_ids
    if is_stream(data):
        key["val_shards"] = data.val_shards
    if part == "train" and not data.cache_text and enc.text_encoder:
        key["cache_text"] = False  # token ids, not features
    return key


def check_cache_shared(cache_dir, accelerator, retries=5):
    """Every rank must see the same data.cache_dir: the ranks split the encoding between them and read each
    other's shards and the main process's manifest, so node-local disks would fail the second node after
    hours of encoding. Rank 0 writes a marker with a fresh token; every rank reads it (retrying a few times
    for a network file system's attribute cache); all ranks stop at once, with the same message, if any
    rank cannot see it."""
    from accelerate.utils import broadcast_object_list, gather_object

    if accelerator.num_processes == 1:
        return
    token = [os.urandom(8).hex() if accelerator.is_main_process else None]
    broadcast_object_list(token)
    marker = Path(cache_dir) / f".rank0_marker_{token[0]}"
    if accelerator.is_main_process:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(token[0])
    accelerator.wait_for_everyone()
    for attempt in range(retries):
        seen = marker.is_file() and marker.read_text() == token[0]
        if seen or attempt == retries - 1:
            break
        time.sleep(1)
    blind = [r for r, ok in enumerate(gather_object([seen])) if not ok]
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink()
    if blind:
        raise RuntimeError(f"data.cache_dir='{cache_dir}' is not shared: rank(s) {blind} of {accelerator.num_processes} "
                           f"do not see the marker that rank 0 wrote to {Path(cache_dir).resolve()}. The ranks "
                           f"write and read each other's cache shards: put data.cache_dir on storage every node "
                           f"mounts at the same path (a shared file system), not on a node-local disk")


def tensors_sha256(tensors):
    """sha256 of a shard's tensors (names, dtypes, shapes and bytes), independent of the file layout."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def shard_damage(path, verify=True, expected=None):
    """None if the shard at `path` is sound, else what is wrong with it. Always: it opens and its tensors hold
    the rows its header claims (safetensors itself rejects a truncated file). With `verify`: its tensors match
    the checksum written with them, and every cached value is finite. `expected`: the manifest's checksum."""
    try:
        with safe_open(str(path), "pt") as f:
            meta, names = f.metadata(), list(f.keys())
            rows = int(meta["rows"])
            if any(f.get_slice(name).get_shape()[0] != rows for name in names):
                return f"its tensors do not hold the {rows} rows its header claims"
            if expected is not None and meta.get("sha256") != expected:
                return "its checksum is not the one the manifest recorded"
            if not verify:
                return None
            tensors = {name: f.get_tensor(name) for name in names}
    except Exception as e:
        return f"unreadable ({type(e).__name__}: {e})"[:200]
    if tensors_sha256(tensors) != meta.get("sha256"):
        return "checksum mismatch: its contents changed after it was written"
    # One float64 sum per tensor: finite exactly when every value is (and 2x faster than isfinite on fp16).
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t.sum(dtype=torch.float64))]
    return f"non-finite values in {bad}" if bad else None


def read_json(path):
    """A JSON file's contents, or None with the reason if it cannot be read (truncated, empty, not JSON)."""
    try:
        return json.loads(Path(path).read_text()), None
    except (OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


def write_shards(ds, todo, path_of, encode, data, names, text, rows, accelerator, part, signals, rounds):
    """Decode this rank's shards `todo` in DataLoader workers, encode them here, and write each one atomically
    with the checksum of its tensors. Rows an encoder turns non-finite (an fp16 VAE overflow) are damage, not
    data: left out and reported. After each shard the ranks agree on a stop signal; every rank takes part in
    `rounds` such agreements (the most shards any rank writes), so they all leave after the same round."""
    # Its own generator: a DataLoader with workers otherwise draws their seed from the global RNG, and a run
    # that built the cache would initialise its model differently from one that found it (no exact resume).
    loader = torch.utils.data.DataLoader(DecodedShards(ds, todo, data, names), batch_size=None,
                                         generator=torch.Generator().manual_seed(0),
                                         **loader_options(data, torch.device("cpu")))
    rank = accelerator.process_index
    bar = tqdm(total=sum(rows[k] for k in todo), unit="img", desc=f"cache {part} (rank {rank})",
               disable=not accelerator.is_local_main_process, mininterval=0.1 if interactive() else 60)
    pending, done, encoded, skipped, start = {}, 0, 0, 0, time.perf_counter()

    def agree():
        if signals is not None:
            signals.exit_if_agreed(accelerator, f"the cache build ({part}); the next run resumes from its finished shards")

    for batch in loader:  # decoded in the workers; encoded here, on the device
        shard = pending.setdefault(batch["shard"], {"tensors": {}, "skipped": [], "rows": 0})
        if len(batch["pixels"]):
            out = encoded_rows(batch, encode, data, text)
            finite = torch.ones(len(batch["pixels"]), dtype=torch.bool)
            for t in out.values():
                if t.is_floating_point():
                    finite &= torch.isfinite(t.flatten(1).float()).all(1)
            for i in torch.nonzero(~finite).flatten().tolist():
                shard["skipped"].append(f"shard {batch['shard']}, row {shard['rows'] + i}: encoded to non-finite values")
            for name, value in out.items():
                shard["tensors"].setdefault(name, []).append(value[finite])
            shard["rows"] += int(finite.sum())
        shard["skipped"] += batch["skipped"]
        encoded, skipped = encoded + len(batch["pixels"]), skipped + len(batch["skipped"])
        bar.update(len(batch["pixels"]) + len(batch["skipped"]))
        if batch["last"]:
            shard = pending.pop(batch["shard"])
            save_shard(path_of(batch["shard"]), {n: torch.cat(parts) for n, parts in shard["tensors"].items()},
                       shard["rows"], shard["skipped"])
            done += 1
            agree()
    for k in todo:  # a shard with no rows at all never reached the loop: it is finished, and empty
        if not path_of(k).exists():
            save_shard(path_of(k), {}, 0, [])
    bar.close()
    seconds = time.perf_counter() - start
    print(f"cache {part} rank {rank}: encoded {encoded} images, skipped {skipped}, {len(todo)} shards in "
          f"{seconds:.1f} s ({encoded / max(seconds, 1e-9):.1f} images/s)", flush=True)
    for _ in range(rounds - done):
        agree()


def save_shard(path, tensors, rows, skipped):
    """Atomically: written to a temporary name, renamed when complete, with its row count, the skipped rows
    and the checksum of its tensors in the header."""
    tmp = path.with_suffix(".tmp")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp),
              metadata={"rows": str(rows), "skipped": json.dumps(skipped), "sha256": tensors_sha256(tensors)})
    os.replace(tmp, path)


def build_cache(ds, part, encode, accelerator, cfg, signals=None):
    """Cache split `part` ("train" or "val") of `ds`: return its folder, encoding what is missing first.
    `encode(pixels, captions)` maps a batch to a dict of tensors (see make_encode). Images are decoded and
    cropped in DataLoader workers (DecodedShards) while the encoders run here; a streamed source's shard k is
    cache shard k. Every shard is checked before it is used (data.verify_cache: its checksum and finite values
    too) by the rank that would write it; a missing or damaged one is (re)built. `signals` (common.StopSignals):
    the ranks agree on a stop after each shard they write, so a stop signal ends the build after the shards in
    progress, exiting for a requeue; the next run resumes from the finished shards."""
    import datasets
    from accelerate.utils import gather_object

    data = cfg.data
    streamed = isinstance(ds, datasets.IterableDataset)
    shards = stream_shards(data, ds, part) if streamed else list(range(math.ceil(len(ds) / data.shard_size)))
    key = cache_key(cfg, part, ds, f"{len(shards)} source shards" if streamed else len(ds))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", data.source).strip("-")[-40:]
    folder = Path(data.cache_dir) / f"{slug}-{part}-{digest}"
    manifest, problem = read_json(folder / "manifest.json") if (folder / "manifest.json").exists() else (None, None)
    if problem or (manifest is not None and not (isinstance(manifest, dict) and isinstance(manifest.get("sha256"), dict))):
        accelerator.print(f"warning: cache ({part}): {folder / 'manifest.json'} cannot be read ({problem or 'no checksums'}); "
                          f"treating the folder as a miss: finished shards are verified and reused, the rest encoded")
        manifest = None
    rank, world = accelerator.process_index, accelerator.num_processes
    found = len(list(folder.glob("shard_*.safetensors")))
    if manifest is not None:
        accelerator.print(f"cache check ({part}): {folder}, {len(manifest['shards'])} shards"
                          + (" (verifying checksums)" if data.verify_cache else ""))
    elif found:
        accelerator.print(f"cache miss ({part}): reusing {found} finished shards of {len(shards)} in {folder} "
                          f"(each verified first), encoding the rest")
    else:
        explain_miss(folder, key, part, accelerator)
        accelerator.print(f"cache miss ({part}): encoding {len(shards)} shards into {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        (folder / "key.json").write_text(json.dumps(key, indent=1))  # names what changed for a later miss
    accelerator.wait_for_everyone()
    names = class_names(data, ds) if data.label_captions else None
    expected = manifest["sha256"] if manifest else {}
    text = "tokens" if part == "train" and not data.cache_text else "features"  # held-out rows keep features

    def path_of(k):
        return folder / f"shard_{k:05d}.safetensors"

    # The shard at position j of `shards` is rank j % world's to check and, if missing or damaged, to write.
    todo = []
    for k in [k for j, k in enumerate(shards) if j % world == rank]:
        if path_of(k).exists():
            damage = shard_damage(path_of(k), data.verify_cache, expected.get(path_of(k).name))
            if damage is None:
                continue  # finished before, and sound
            print(f"cache ({part}): {path_of(k)} is damaged ({damage}): rebuilding it", flush=True)
        todo.append(k)
    todo_by_rank = gather_object([todo]) if world > 1 else [todo]
    missing = sorted(k for t in todo_by_rank for k in t)
    if missing:
        rows = samples_per_shard(ds, missing, data.shard_size)
        per_row, size = cache_size(encode, data, text, list(rows.values()))
        free = shutil.disk_usage(folder).free
        accelerator.print(f"cache ({part}): {len(missing)} of {len(shards)} shards to write, about "
                          f"{sum(rows.values())} samples x {per_row} bytes = {human_bytes(size)}; {human_bytes(free)} "
                          f"free on {data.cache_dir}")
        if size > free:
            raise SystemExit(f"data.cache_dir='{data.cache_dir}' has {human_bytes(free)} free, the {part} cache needs "
                             f"about {human_bytes(size)}: free space, choose another data.cache_dir, or shrink the "
                             f"cache (data.cache_text=false keeps token ids instead of text features)")
        write_shards(ds, todo, path_of, encode, data, names, text, rows, accelerator, part, signals,
                     rounds=max(len(t) for t in todo_by_rank))
    built = len(missing)
    if accelerator.is_main_process:
        shards, sums, skipped = [path_of(k).name for k in shards], {}, []
        for name in shards:
            with safe_open(str(folder / name), "pt") as f:
                skipped += json.loads(f.metadata().get("skipped", "[]"))
                sums[name] = f.metadata()["sha256"]
        if built and skipped:
            accelerator.print(f"cache ({part}): skipped {len(skipped)} unusable images, first: " + "; ".join(skipped[:5]))
        if manifest is None or built:
            tmp = folder / "manifest.tmp"
            tmp.write_text(json.dumps({"key": key, "shards": shards, "sha256": sums, "skipped": skipped}, indent=1))
            os.replace(tmp, folder / "manifest.json")
        accelerator.print(f"cache {'hit' if not built else 'ready'} ({part}): {folder}, {len(shards)} shards"
                          + (f", {built} (re)built" if built else ", all sound"))
    accelerator.wait_for_everyone()
    return folder


def explain_miss(folder, key, part, accelerator):
    """Say why a new cache folder is a miss: the settings that changed against the newest folder of the same
    source and split (a finished one or an interrupted build)."""
    others = sorted(folder.parent.glob(f"{folder.name.rsplit('-', 1)[0]}-*/key.json"), key=lambda p: p.stat().st_mtime)
    old = read_json(others[-1])[0] if others else None
    if isinstance(old, dict):
        changed = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in key.items() if old.get(k) != v]
        accelerator.print(f"cache miss ({part}): vs {others[-1].parent.name}, changed {'; '.join(changed)}")


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


def validation_prompts(cfg, train_ds, val_ds):
    """What each cell of the validation grid shows, in grid order (also written beside the grid). Text runs:
    the lines of the file val.prompts, else the first held-out captions (label_captions: the held-out rows'
    class names). Class runs: the names of classes 0, 1, 2, ... (cycled), from the data's class names
    (ClassLabel, class folders, data.class_ids), else "class k"."""
    data, n = cfg.data, cfg.val.num_samples
    if cfg.val.prompts is not None:
        if not cfg.encoders.text_encoder:
            raise ValueError(f"val.prompts={cfg.val.prompts!r} is for text-to-image runs (encoders.text_encoder); "
                             f"a class-conditional run's grid shows its classes in order")
        path = Path(cfg.val.prompts)
        if not path.is_file():
            raise FileNotFoundError(f"val.prompts={cfg.val.prompts!r}: no such file (a text file, one prompt per line)")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"val.prompts={cfg.val.prompts!r} holds no prompts (one per line)")
        return prompts[:n]
    if data.label_captions:
        names = class_names(data, train_ds)
        return [names[label] for label in val_ds[:n][data.label_column]]
    if data.caption_column:
        return [str(caption) for caption in val_ds[:n][data.caption_column]]
    ids = read_class_ids(data, train_ds)
    names = readable_names(ids) if ids else [f"class {k}" for k in range(data.num_classes)]
    return [names[k % data.num_classes] for k in range(n)]


def validation_inputs(val_set, num_samples, num_classes, x_shape, seed, device, text=None):
    """Fixed conditions and noise for the validation grid: classes in order (0, 1, 2, ...) for class runs,
    the encoded validation prompts `text` (encode_text of validation_prompts) for text runs; controls (size,
    crop, flip) from the held-out rows, cycled."""
    rows = [val_set[i % len(val_set)] for i in range(num_samples)]
    n = num_samples
    cond = conditions_of({k: torch.stack([r[k] for r in rows]) for k in rows[0]}, device)
    if "label" in cond:
        cond["label"] = torch.arange(n, device=device) % num_classes
    if text is not None:
        cond.update({k: v.to(device) for k, v in text.items()})
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


# ----------------------------------------------------------------------------------------------------------
# The data stage of a run, as both trainers take it.


def prepare_data(cfg, train_ds, val_ds, accelerator, signals=None):
    """Cache check -> hit: load / miss: encode and write, for the training and held-out rows; then the
    encoders leave the GPU (the text encoder stays when it encodes at each step, data.cache_text=false).
    Returns the cached datasets, the frozen encoders, the empty prompt's encoding (the null condition of
    guidance), the validation grid's prompts or class names and their encoding, and the class ids."""
    from types import SimpleNamespace

    data, device = cfg.data, accelerator.device
    check_cache_shared(data.cache_dir, accelerator)  # every rank must see the same cache folder
    vae, tokenizer, text_encoder = load_encoders(cfg.encoders, device)
    encode = make_encode(vae, tokenizer, text_encoder, cfg.encoders.max_tokens)
    out = SimpleNamespace(vae=vae, text_encoder=text_encoder, null_text=None, val_text=None,
                          val_prompts=validation_prompts(cfg, train_ds, val_ds),  # what each grid cell shows
                          class_ids=read_class_ids(data, train_ds) if data.label_column else None)  # kept with the model
    out.train_set = CachedDataset(build_cache(train_ds, "train", encode, accelerator, cfg, signals))
    out.val_set = CachedDataset(build_cache(val_ds, "val", encode, accelerator, cfg, signals))
    if text_encoder is not None:
        out.null_text = encode_text(tokenizer, text_encoder, [""], cfg.encoders.max_tokens)
        out.val_text = encode_text(tokenizer, text_encoder, out.val_prompts, cfg.encoders.max_tokens)
        text_encoder.to("cpu" if data.cache_text else device)
    if vae is not None:
        vae.cpu()
    return out
