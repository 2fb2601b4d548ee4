"""Where images come from (the seed's "Data Loading" stage):

    source (embedded demo, hub id, imagefolder, parquet, webdataset tar stream) -> open_splits (labels checked
      against data.num_classes, read from the data when unset; train / held-out rows sized and announced)
      (classes.py) -> load_image, preprocess (crop, flip, control metadata) -> [encoders.py: VAE posterior, text
      features or token ids; encoding.py and cache.py: the cache] -> [batching.py: the batches the cache gives
      back]

The validation inputs (fixed conditions, noise and held-out batches) are training/evaluation/validation.py's.
"""
import contextlib
import difflib
import random
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from training.config.config import ConfigError
from training.data import digits, emoji, fashion_mnist
from training.data.buckets import crop_extent
from training.data.classes import check_labels, class_count, class_id_list, labels_are_the_condition

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
    paint_shape(img, shape, DEMO_COLORS[color], x, y, size)
    return img


def paint_shape(img, shape, fill, x, y, size):
    """Draw `shape` (circle, square or triangle) of side `size` with its top-left corner at (x, y) onto `img`."""
    box, draw = [x, y, x + size, y + size], ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)


# data.demo_render: how a demo image of native side s is drawn (benchmarks/control_ablation.py, issue 42).
#   native          the shape drawn at s px directly (the original demo): shapes drawn at 8 and at 32 px snap to
#                   different pixels, so the 8 px image is not the 32 px scene at lower resolution
#   band_limited    a scene (shape, colour, place and size as fractions of the side) drawn at SUPERSAMPLE x s px
#                   and box-averaged down to s px, as a camera's pixels average the light: a smaller original is
#                   the same scene at lower resolution
#   colour_by_size  band_limited, with the native side tied to the colour on disjoint supports (the positive
#                   control): red only at COLOUR_SIDES["red"], blue only at COLOUR_SIDES["blue"], green at any side
DEMO_RENDERS = ("native", "band_limited", "colour_by_size")
SUPERSAMPLE = 8
COLOUR_SIDES = {"red": (8, 14), "blue": (26, 32)}


def demo_scene(label, rng):
    """A resolution-free scene of class `label`: the shape's side and top-left as fractions of the image side
    (side 0.35-0.75, as the native demo's), and the background colour."""
    frac = rng.uniform(0.35, 0.75)
    return {"label": label, "frac": frac, "x": rng.uniform(0.03, 0.97 - frac), "y": rng.uniform(0.03, 0.97 - frac),
            "bg": tuple(int(v) for v in rng.integers(200, 245, 3))}


def render_scene(scene, side, supersample=SUPERSAMPLE):
    """The scene drawn at supersample x side px and box-averaged (Image.reduce) to side x side: band-limited."""
    big = side * supersample
    color, shape = DEMO_CLASSES[scene["label"]].split()
    img = Image.new("RGB", (big, big), scene["bg"])
    paint_shape(img, shape, DEMO_COLORS[color], scene["x"] * big, scene["y"] * big, scene["frac"] * big)
    return img.reduce(supersample)


def native_side(label, sizes, render, rng):
    """The side an image of class `label` is drawn at: uniform over data.demo_sizes, or, for colour_by_size,
    over its colour's support (green: all of demo_sizes)."""
    lo, hi = COLOUR_SIDES.get(DEMO_CLASSES[label].split()[0], sizes) if render == "colour_by_size" else sizes
    return int(rng.integers(lo, hi + 1))


def make_demo_dataset(num_samples, seed, resolution=32, sizes=None, render="native"):
    """A `datasets.Dataset` with image, label and caption columns ("a small red circle"). `sizes` = [lo, hi]
    (data.demo_sizes): each image is drawn natively at a side in lo .. hi px instead of `resolution`, so an
    image upsampled to the training resolution is blurrier the smaller it was drawn: its size carries sharpness,
    which the size control can learn (benchmarks/control_ablation.py). `render` (data.demo_render, above): how
    an image is drawn at its side; band_limited and colour_by_size need `sizes`."""
    if render not in DEMO_RENDERS:
        raise ValueError(f"data.demo_render must be one of {DEMO_RENDERS}, got {render!r}")
    if render != "native" and not sizes:
        raise ValueError(f"data.demo_render={render!r} draws each image at a native side: set data.demo_sizes, "
                         f"e.g. [8, 32]")
    cover = [COLOUR_SIDES["red"][0], COLOUR_SIDES["blue"][1]]  # sections.combination_problems checks it in configs
    if render == "colour_by_size" and not (sizes[0] <= cover[0] and sizes[1] >= cover[1]):
        raise ValueError(f"data.demo_render='colour_by_size' draws red at {COLOUR_SIDES['red']} px and blue at "
                         f"{COLOUR_SIDES['blue']} px: data.demo_sizes={sizes} must cover {cover}")
    import datasets

    rng = np.random.default_rng(seed)
    rows = {"image": [], "label": [], "caption": []}
    for i in range(num_samples):
        label = i % len(DEMO_CLASSES)
        if render == "native":
            side = int(rng.integers(sizes[0], sizes[1] + 1)) if sizes else resolution
            size = int(rng.integers(round(side * 0.35), round(side * 0.75) + 1))
            rows["image"].append(draw_shape(label, size, rng, side))
            small = size < side * 0.55
        else:
            side, scene = native_side(label, sizes, render, rng), demo_scene(label, rng)
            rows["image"].append(render_scene(scene, side))
            small = scene["frac"] < 0.55
        rows["label"].append(label)
        rows["caption"].append(f"a {'small' if small else 'large'} {DEMO_CLASSES[label]}")
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
        ds = make_demo_dataset(data.demo_samples, seed=0, resolution=data.demo_resolution, sizes=data.get("demo_sizes"),
                                render=data.get("demo_render", "native"))
    elif emoji.is_source(source):  # the two pinned packages' images, split by caption
        ds = emoji.load(split, emoji.folder_of(source))
    elif digits.is_source(source):  # the pinned package's digits, split by their pixels
        ds = digits.load(split, digits.folder_of(source))
    else:
        ds = fashion_mnist.load(split) if source == fashion_mnist.SOURCE else load_source(source, split)
    for key in ("image_column", "label_column", "caption_column"):
        if data[key] is not None and data[key] not in ds.column_names:
            raise ValueError(f"data.{key}='{data[key]}' is not a column of {source} (split '{split}'); "
                             f"its columns are {ds.column_names}")
    return ds.cast_column(data.image_column, datasets.Image(decode=False))


def is_parquet(source):
    """Whether data.source names parquet files: a file or a glob ending .parquet, or a folder holding any."""
    path = Path(source).expanduser()
    return source.endswith(".parquet") or (path.is_dir() and any(path.glob("**/*.parquet")))


def load_source(source, split):
    """datasets' reading of data.source: parquet files, a local folder, else a hub id. What cannot be read stops
    the run with one ConfigError naming data.source, what was tried (the local path, then the hub id) and why
    each failed. A path that cannot be a hub id (absolute, ./, ../, ~, a trailing /) is never sent to the hub.
    Parquet files are split by their names (parquet_files); an image folder by its split folders."""
    import datasets

    path = Path(source).expanduser()
    parquet = is_parquet(source)
    if parquet or path.is_dir():
        try:
            with quiet_datasets():  # a local folder's "Downloading data: 180 files" downloads nothing
                return datasets.load_dataset("parquet", data_files={split: parquet_files(source, split)},
                                             split=split) if parquet else \
                    datasets.load_dataset("imagefolder", **imagefolder_files(path, split), split=split)
        except ConfigError:
            raise
        except Exception as e:  # datasets raises many types; the first line of its message says why
            raise ConfigError(f"data.source='{source}': {path.resolve()} could not be read as "
                              f"{'parquet files' if parquet else 'an image folder'} (split '{split}'): "
                              f"{first_line(e)}") from None
    near = difflib.get_close_matches(path.name, [p.name for p in path.parent.iterdir()]) if path.parent.is_dir() else []
    local = (f"{path.resolve()} is a file, neither a folder nor parquet" if path.exists() else
             f"{path.resolve()} does not exist" + (f" (in its folder: {sorted(near)})" if near else ""))
    hub = "not tried as a hub id (it is a path)"
    if not (path.exists() or source.startswith((".", "/", "~")) or source.endswith("/")):
        try:
            return datasets.load_dataset(source, split=split)
        except Exception as e:
            from huggingface_hub import constants

            hub = f"tried as a hub id: {first_line(e)}" + " (HF_HUB_OFFLINE=1)" * bool(constants.HF_HUB_OFFLINE)
    raise ConfigError(f"data.source='{source}' cannot be opened. Tried as a local folder: {local}; {hub}. Set "
                      f"data.source to a folder of images (class folders or metadata.jsonl), parquet files, or a "
                      f"Hugging Face dataset id (user/name).")


def parquet_files(source, split):
    """The parquet files of split `split`, named as `datasets` names a folder's splits (its data_files patterns, the
    hub's layout among them): data/train-00000-of-00002.parquet, train.parquet, train/*.parquet, my_test-0.parquet
    and their validation (valid, val, dev) and test (testing, eval) kin; a folder whose files name no split is one
    split, 'train'. A source naming files (a file or a glob ending in .parquet) is one split, 'train', as datasets
    reads data_files. A split that matches no file is an error naming the splits there are: reading every file
    for every split trained on the test rows and scored --reference_split test against the training rows."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    if source.endswith(".parquet"):
        splits = {"train": [str(Path(source).expanduser())]}
    else:
        folder = str(Path(source).expanduser())
        found = DataFilesDict.from_patterns(get_data_patterns(folder), base_path=folder)
        splits = {str(name): [f for f in files if f.endswith(".parquet")] for name, files in found.items()}
        splits = {name: files for name, files in splits.items() if files}
    if split not in splits:
        raise ConfigError(f"data.source='{source}' has no split '{split}': its parquet files make the splits "
                          f"{sorted(splits)} (split by file name as datasets does: train-*.parquet, test-*.parquet, "
                          f"data/validation-00000-of-00001.parquet, a folder named by its split; files that name no "
                          f"split are one split, 'train'). Name one of these splits, or point data.source at a folder "
                          f"whose files name '{split}'")
    return splits[split]


def first_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].rstrip('.') if lines else ''}"


@contextlib.contextmanager
def quiet_datasets():
    """datasets' progress bars off (they are one global switch: set back as it was)."""
    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            enable_progress_bars()


def imagefolder_files(folder, split):
    """What `load_dataset("imagefolder")` reads for `split`: the files named directly when the layout is plain
    (a folder called `split`, or no split folders at all), else the folder, whose splits datasets infers. Both
    read the same rows, labels (class folders) and metadata.jsonl; naming the files skips datasets' split
    inference, which walks the whole folder once per split-name pattern it tries (66 walks, 663k stat calls for
    10k files: minutes at every start of a large folder; docs/performance.md)."""
    from datasets.data_files import SPLIT_KEYWORDS

    if (folder / split).is_dir():
        return {"data_files": {split: str(folder / split / "**")}}
    keywords = {k for names in SPLIT_KEYWORDS.values() for k in names}
    if not any(child.name.lower() in keywords for child in folder.iterdir() if child.is_dir()):
        return {"data_files": {split: str(folder / "**")}}
    return {"data_dir": str(folder)}  # split folders under other names (val/, dev/): datasets maps them


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
    stream = is_stream(data)
    train = open_stream(data, data.split) if stream else open_dataset(data, data.split)
    classes = labels_are_the_condition(data)
    if data.label_column and data.num_classes is None and (classes or class_id_list(data, train)):
        data.num_classes, origin = class_count(data, train)  # text runs: only if named (kept with the model)
        log(f"data: data.num_classes={data.num_classes}, read from {origin}")
    if stream:  # its training labels are checked row by row as the cache is built (DecodedShards)
        val = stream_heldout(data)
        if classes:
            check_labels(data, val, data.val_split or data.split)
        return train, val
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
            raise ValueError(f"data.val_holdout={holdout} holds out {min(holdout, n)} of the {n} rows of "
                             f"{data.source} (split '{data.split}'), leaving {max(0, n - holdout)} to train on: fewer "
                             f"than it holds out. Set data.val_holdout to at most {n // 2} (e.g. "
                             f"{max(1, int(n * HOLDOUT_FRACTION))}), leave it null (10% of the rows, at most 256), or "
                             "name a held-out split in data.val_split")
        perm = np.random.default_rng(0).permutation(n)
        val, train = train.select(sorted(perm[:holdout])), train.select(sorted(perm[holdout:]))
    trimmed = ""
    if data.max_samples is not None and data.max_samples < len(train):
        trimmed = f" (the first {data.max_samples} of {len(train)}: data.max_samples)"
        train = train.select(range(data.max_samples))
    log(f"data: {data.source}: {len(train)} rows train from split '{data.split}'{trimmed}; {len(val)} rows held out "
        f"for validation, {origin}")
    return train, val


def same_rows(data, a, b, chunk=1000):
    """Whether two splits hold the same images, row for row (undecoded: the same files, or the same bytes); read
    a chunk at a time, stopping at the first that differs (two real splits differ in the first)."""
    return len(a) == len(b) and all(a[i:i + chunk][data.image_column] == b[i:i + chunk][data.image_column]
                                    for i in range(0, len(a), chunk))


def training_and_test(data, test_split, tool):
    """(training rows, test rows, the test split's name) for a tool that learns from the recipe's training split
    and is measured on `test_split` (tools/classifier.py, tools/autoencoder.py, tools/clip.py). A test split that is
    the training split is refused before any work (ConfigError), as is learning from an emoji or digits source's
    test split (emoji.test_refusal, digits.test_refusal); one that reads the training split's images (a folder
    without a test folder) gives way to the trainer's own split: its training rows, and the rows it holds out (test
    split 'heldout'), and `tool` says so."""
    if line := emoji.test_refusal(data.source, data.split, "data.split") or \
            digits.test_refusal(data.source, data.split, "data.split"):
        raise ConfigError(line)
    if test_split == data.split:
        raise ConfigError(f"--test_split '{test_split}' is the training split (data.split): it learns from that "
                          f"split and is measured on another")
    train_ds, test_ds = open_dataset(data, data.split), open_dataset(data, test_split)
    if same_rows(data, train_ds, test_ds):  # scored on them, training images would pass for test images
        print(f"{tool}: split '{test_split}' of {data.source} holds the images of its training split "
              f"'{data.split}' (no {test_split} folder?): trained on the trainer's training rows and measured on "
              f"the rows the trainer holds out, never trained on (test split 'heldout')")
        return (*open_splits(data), "heldout")
    return train_ds, test_ds, test_split


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


def preprocess(img, resolution, data, rng=random, flip=None, shape=None):
    """Crop a box by the crop policy `data.crop`, resize it to `resolution` square, or to `shape` (width, height: an
    aspect-ratio bucket, training/data/buckets.py), flip it if drawn (`flip` None: with probability 1/2 if
    data.random_flip; True / False: as given, nothing drawn).

    The box has the output's aspect (a square; a bucket's: the largest such box, buckets.crop_extent). center: the
    largest box, centred; random: the largest box at a random place; random_resized: a random box of U(
    data.min_crop_scale, 1) x that size, at a random place. Returns pixels in [-1, 1] and the control metadata
    that describes exactly what was done, so the conditioning is true to the data: orig_hw (h, w), crop_box (top,
    left, height, width) in original pixels, flip (0 or 1).
    """
    w, h = img.size
    width, height = shape or (resolution, resolution)
    box_w, box_h = crop_extent(w, h, width, height)
    if data.crop == "random_resized":
        scale = rng.uniform(data.min_crop_scale, 1.0)
        box_w, box_h = max(1, round(box_w * scale)), max(1, round(box_h * scale))
    if data.crop == "center":
        top, left = (h - box_h) // 2, (w - box_w) // 2
    elif data.crop in ("random", "random_resized"):
        top, left = rng.randint(0, h - box_h), rng.randint(0, w - box_w)
    else:
        raise ValueError(f"data.crop must be 'center', 'random' or 'random_resized', got {data.crop!r}")
    img = img.resize((width, height), Image.BICUBIC, box=(left, top, left + box_w, top + box_h),
                     reducing_gap=None if box_h < 3 * height else 3.0)
    flip = data.random_flip and rng.random() < 0.5 if flip is None else flip
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1
    return x, {"orig_hw": torch.tensor([h, w]), "crop_box": torch.tensor([top, left, box_h, box_w]),
               "flip": torch.tensor([int(flip)])}

# ----------------------------------------------------------------------------------------------------------
# Streaming sources: webdataset tar shards (a local pattern such as /data/cc12m/{00000..01242}.tar, or a hub
# dataset with data.streaming) read by `datasets` one shard at a time as the cache needs it, never downloaded
# whole or converted to Arrow. Source shard k becomes cache shard k, so which rows a cache shard holds and how
# they are cropped depend on k alone, not on the number of nodes, ranks or DataLoader workers.


def is_stream(data):
    if data.source == "embedded" or emoji.is_source(data.source) or digits.is_source(data.source):  # read whole
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
    return datasets.Dataset.from_list(list(itertools.islice(rows, data.val_holdout or HOLDOUT_MAX)),
                                      features=val.features)
