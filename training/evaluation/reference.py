"""What generated samples are scored against: FID's Inception network (clean-fid's, looked for before anything is
downloaded, fetched with a bound, verified by its sha256) and the reference statistics of a folder, a dataset or
the run's held-out rows (computed once, shared by the ranks, cached in an .npz keyed on the source and all its
preprocessing), or clean-fid's named statistics. eval_fid.py and the small-N FID in training use these.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import common
from training.config import config
from training.data.buckets import image_sizes, nearest, rows_in, shape_arg
from training.data.sources import (is_stream, load_image, open_dataset, open_splits, preprocess, same_rows,
                                   stream_heldout)
from training.run.monitor import progress

INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"
INCEPTION_FILE = "inception-2015-12-05.pt"
# sha256 of that file (95,607,719 bytes; k-diffusion pins the same digest): checked before every use
INCEPTION_SHA256 = "f58cb9b6ec323ed63459aa4fb441fe750cfe39fafad6da5cb504a16f19e958f4"

# ----------------------------------------------------------------------------------------------------------
# Features: clean-fid's Inception (the TF-ported TorchScript network of StyleGAN2-ADA) and its resizer. The
# file is looked for before anything is downloaded, and a download is bounded, so an offline node fails at
# once with instructions instead of hanging.


def inception_cache_dir():
    """Where the network is downloaded: a per-user cache ($XDG_CACHE_HOME or ~/.cache, /minimal-diffusion),
    never a world-writable folder such as /tmp, where anyone could have left a file of that name."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimal-diffusion"


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def offline():
    """The offline variables a user sets for the Hugging Face libraries: then no download is tried at all."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def inception_places():
    """Where the network is looked for, in order: the per-user cache (where a download goes), then
    $HF_HOME/inception-2015-12-05.pt (where tools/prefetch.py puts it)."""
    from huggingface_hub import constants

    return [inception_cache_dir() / INCEPTION_FILE, Path(constants.HF_HOME) / INCEPTION_FILE]


FETCH_IT = (f"On a machine with network run `python tools/prefetch.py --config YOUR_CONFIG` (or download "
            f"{INCEPTION_URL}), copy the file here and pass --inception_weights PATH (to a trainer: "
            f"--val.inception_weights=PATH). Without it, eval_fid.py scores a class-conditional run in the "
            f"features of an evaluation classifier: tools/classifier.py, then --classifier DIR --features classifier")


def inception_path(weights=None, timeout=20):
    """The Inception file, verified: `weights` if given, else the first of inception_places() that exists, else
    downloaded into the per-user cache once (into a .part file that is checked before it is renamed), unless
    the offline variables are set. A file whose sha256 is not INCEPTION_SHA256 is an error naming it: a
    truncated download or another network would give FIDs comparable with nothing. A missing file is one
    line (FileNotFoundError) naming --inception_weights and tools/prefetch.py."""
    if weights is not None and not Path(weights).is_file():
        raise FileNotFoundError(f"--inception_weights {weights}: no such file. {FETCH_IT}.")
    places = inception_places()
    path = Path(weights) if weights is not None else next((p for p in places if p.is_file()), places[0])
    if not path.is_file():
        where = f"the Inception network of FID ({INCEPTION_FILE}) is in neither {places[0]} nor {places[1]}"
        if offline():
            raise FileNotFoundError(f"{where}, and the offline variables are set (HF_HUB_OFFLINE, "
                                    f"HF_DATASETS_OFFLINE): no download tried. {FETCH_IT}.")
        part = path.with_suffix(".part")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with urllib.request.urlopen(INCEPTION_URL, timeout=timeout) as r:
                part.write_bytes(r.read())
        except OSError as e:
            part.unlink(missing_ok=True)
            raise FileNotFoundError(f"{where}, and it could not be downloaded ({e}). {FETCH_IT}.") from None
        if sha256_of(part) != INCEPTION_SHA256:
            part.unlink()
            raise ValueError(f"the Inception network downloaded from {INCEPTION_URL} has the wrong sha256 (expected "
                             f"{INCEPTION_SHA256}); nothing was kept. Try again, or download it yourself and "
                             f"pass --inception_weights")
        os.replace(part, path)  # atomically: never a half-written file under the real name
    digest = sha256_of(path)
    if digest != INCEPTION_SHA256:
        raise ValueError(f"{path}: sha256 {digest} is not that of {INCEPTION_FILE} ({INCEPTION_SHA256}): a damaged "
                         f"or different file. Delete it (it is downloaded again) or pass --inception_weights with "
                         f"the right file.")
    return path


def inception_features(mode="clean", weights=None, device="cpu", accelerator=None):
    """feature_fn for FID: clean-fid's resizer (mode 'clean': PIL bicubic on float channels to 299 x 299;
    'legacy_tensorflow': the network's own TF-style resize) and its network -> float64 (N, 2048)."""
    from cleanfid.inception_torchscript import InceptionV3W
    from cleanfid.resize import build_resizer

    with accelerator.main_process_first() if accelerator else contextlib.nullcontext():  # one download
        path = inception_path(weights)
    with tempfile.TemporaryDirectory() as tmp:  # InceptionV3W loads <folder>/inception-2015-12-05.pt
        folder = path.parent if path.name == INCEPTION_FILE else Path(tmp)
        if path.name != INCEPTION_FILE:
            (folder / INCEPTION_FILE).symlink_to(path.resolve())
        net = InceptionV3W(str(folder), download=False, resize_inside=mode == "legacy_tensorflow").to(device)
    resize = build_resizer(mode)

    @torch.no_grad()
    def feature_fn(images):
        if len({img.shape for img in images}) > 1:  # legacy_tensorflow resizes inside: one size per batch
            return np.concatenate([feature_fn([img]) for img in images])
        x = np.stack([np.asarray(resize(img), dtype=np.float32) for img in images])
        return net(torch.from_numpy(x).permute(0, 3, 1, 2).to(device)).double().cpu().numpy()
    feature_fn.name, feature_fn.tag, feature_fn.path = f"inception-2015-12-05/{mode}", "inception", str(path)
    feature_fn.sha256 = INCEPTION_SHA256  # verified by inception_path; for the report
    return feature_fn


def heldout(data):
    """The rows the trainer validated on: a streamed source's first held-out samples (the trainer's own
    function), data.val_split when set (opened alone, so no CC12M-sized train split is read), else
    open_splits' seeded hold-out of the training split."""
    if is_stream(data):
        return stream_heldout(data)
    return open_dataset(data, data.val_split) if data.val_split else open_splits(data)[1]


def split_images(data, ds, split):
    """(uint8 images (N, R, R, 3), int labels (N,), class names or None) of the dataset `ds` (split `split`), as
    the trainer's cache would preprocess them; labels and names None without data.label_column."""
    images = np.stack([to_uint8(preprocess(load_image(row[data.image_column]), data.resolution, data,
                                           flip=False)[0][None])[0] for row in progress(ds, f"read {split}", True)])
    if not data.label_column:
        return images, None, None
    return images, np.asarray(ds[data.label_column]), getattr(ds.features[data.label_column], "names", None)


def check_selection(args, cfg):
    """Settings are chosen on images held out from the training split, never on the images that report the final
    score (docs/evaluation.md): a selecting command (tools/tune.py, tools/phema.py --sweep) refuses any other
    reference, and a run whose held-out rows are a test split (data.val_split naming one)."""
    val_split = cfg["data"].get("val_split") or ""
    if args.reference is not None or args.reference_split != "heldout" or "test" in val_split.lower():
        raise ValueError(f"settings are selected on the held-out rows of the training split only, never on the test "
                         f"images that report the final score: drop --reference / --reference_split (given: "
                         f"{args.reference}, {args.reference_split}; the run's data.val_split: {val_split or None}); "
                         f"score the chosen setting on the test split with eval_fid.py afterwards")


def to_uint8(x):
    """Pixels in [-1, 1] (N, 3, H, W) -> uint8 (N, H, W, 3), rounded as runlog.save_image_grid does."""
    return x.float().clamp(-1, 1).add(1).mul(127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()


# ----------------------------------------------------------------------------------------------------------
# The options that say what samples are scored against: eval_fid.py's, and every command that scores images as it
# does (the in-training FID, tools/autoencoder.py, the benchmarks) parses them with reference_args.


def add_arguments(p):
    a = p.add_argument
    a("--reference", default=None, help="image folder, dataset (hub id, local path, 'embedded'), one of our "
      "statistics .npz files, or cleanfid:NAME:RES:SPLIT (clean-fid's precomputed ones); default: data.source")
    a("--reference_split", default="heldout", help="'heldout': the rows the trainer validated on")
    a("--reference_resolution", type=int, default=None, help="default: the run's data.resolution")
    a("--reference_crop", default="center")
    a("--reference_image_column", default=None, help="default: the run's data.image_column")
    a("--reference_num", type=int, default=None, help="use only the first N reference images")
    a("--stats_cache", default="cache/fid_stats", help="folder of cached reference statistics (.npz)")
    a("--mode", default="clean", choices=["clean", "legacy_tensorflow"], help="clean-fid's resizing mode")
    return p


def reference_args(argv=()):
    """The reference options of `argv` with eval_fid.py's defaults, and --batch_size (images per feature batch,
    64); any other option in `argv` (eval_fid.py's) is passed over."""
    p = add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    p.add_argument("--batch_size", type=int, default=64)
    return p.parse_known_args(list(argv))[0]


# ----------------------------------------------------------------------------------------------------------
# Which reference, which split and which bucket eval_fid.py scores against, and what its folder is called.


def reference_split(args, cfg):
    """(the split eval_fid.py scores against, a line saying why it is not the one asked for, or None).
    --reference_split as given, but where it names a split of the run's own data.source that reads the very images
    of its training split (same_rows: a local folder without a folder of that name, parquet files, the embedded demo;
    a hub dataset's splits are its own and are not read): then the rows the trainer held out ('heldout'), as
    tools/classifier.py measures itself. The training split named as such is scored as asked. --reference naming
    the run's own source at 'heldout' would change nothing and is refused in one line (ConfigError)."""
    data, split = config.Config(cfg["data"]), args.reference_split
    if args.reference is not None and not same_source(args.reference, data.source):
        return split, None  # another source: its own splits
    if args.reference is not None and split == "heldout":
        raise config.ConfigError(
            f"--reference {args.reference} is the run's own data.source, which eval_fid.py reads as the dataset it "
            f"trained on at --reference_split, here 'heldout': the rows the trainer held out, the reference without "
            f"--reference. Drop it, or add --reference_split {data.split} to score against the images it trained on")
    local = data.source == "embedded" or Path(data.source).expanduser().exists()
    if split in ("heldout", data.split) or not local or is_stream(data):
        return split, None
    if not same_rows(data, open_dataset(data, data.split), open_dataset(data, split)):
        return split, None
    return "heldout", (f"--reference_split {split}: split '{split}' of {data.source} holds the images of its "
                       f"training split '{data.split}' (no {split} folder?), which the model trained on; scored "
                       f"against the rows the trainer held out instead (--reference_split heldout)")


def reference_tag(args, cfg):
    """What eval_fid.py's output folder name says of the reference: '' for the run's own held-out rows (the
    default), else '-ref-' and the split of the run's source, or another source's name (and split), and any
    other preprocessing, so that scores against different references never share a folder."""
    data, source = cfg["data"], args.reference or cfg["data"]["source"]
    own = same_source(source, data["source"])
    whole = not own and (str(source).endswith(".npz") or str(source).startswith("cleanfid:") or image_files(source))
    parts = [] if own else [Path(source).stem if Path(source).expanduser().exists() else source]
    parts += [] if whole or (own and args.reference_split == "heldout") else [args.reference_split]
    parts += [f"{args.reference_resolution}px"] if args.reference_resolution not in (None, data["resolution"]) else []
    parts += [args.reference_crop] if args.reference_crop != "center" else []
    parts += [args.reference_image_column] if args.reference_image_column not in (None, data["image_column"]) else []
    parts += [f"first{args.reference_num}"] if args.reference_num else []
    return "-ref-" + re.sub(r"[^A-Za-z0-9._]+", "-", "-".join(map(str, parts))).strip("-") if parts else ""


def bucket_counts(args, cfg):
    """{(width, height): the reference images whose nearest bucket it is} over a bucket run's buckets, read from the
    image headers alone (--reference_num caps each); None for statistics (an .npz, clean-fid's): one shape."""
    if str(args.reference).endswith(".npz") or str(args.reference).startswith("cleanfid:"):
        return None
    shapes = [tuple(s) for s in cfg["data"]["bucket_shapes"]]
    key = reference_key(argparse.Namespace(**{**vars(args), "shape": shapes[0]}), cfg, "")
    if key["kind"] == "folder":
        sizes = folder_sizes(image_files(key["source"]))
    else:
        sizes = image_sizes(reference_rows(key, reference_data(key, cfg)), key["image_column"], log=lambda line: None)
    counts = np.bincount(bucket_of_each(sizes, shapes), minlength=len(shapes))
    return {s: min(int(n), args.reference_num or int(n)) for s, n in zip(shapes, counts)}


def scored_bucket(cfg, args):
    """(the (width, height) that eval_fid.py samples and scores, a line saying why) for a run with data.buckets;
    (None, None) for a square run, which takes no --width / --height / --aspect_ratio. --width / --height or
    --aspect_ratio pick a bucket; unset, the bucket with the most reference images (the squarest of equals). FD at
    a shape is against the reference images of that bucket (docs/evaluation.md), and a covariance needs 2 of them:
    a bucket with fewer is refused in one line (ConfigError) naming each bucket's count and where more are."""
    data, given = cfg["data"], args.width or args.height or args.aspect_ratio
    if not data.get("bucket_shapes"):
        if given:
            raise config.ConfigError(f"--width / --height / --aspect_ratio: {args.run} was trained square at "
                                     f"{data['resolution']} px (no data.buckets); sample other shapes with sample.py")
        return None, None
    shapes = [tuple(s) for s in data["bucket_shapes"]]
    shape = tuple(shape_arg(cfg, args.width, args.height, args.aspect_ratio)) if given else None
    if shape is not None and shape not in shapes:
        raise config.ConfigError(f"--width {shape[0]} --height {shape[1]}: eval_fid.py scores a bucket the run "
                                 f"trained at, whose reference images exist: one of "
                                 + ", ".join(f"{w}x{h}" for w, h in shapes))
    cleanfid = str(args.reference).startswith("cleanfid:")
    if shape is not None and shape[0] != shape[1] and cleanfid:  # clean-fid's are square images
        raise config.ConfigError(f"--reference {args.reference}: clean-fid's statistics are of square images, so FD "
                                 f"at the {shape[0]}x{shape[1]} bucket would count the shape as a difference; leave "
                                 f"--reference out (that bucket's own reference images) or score a square bucket")
    generate_only = getattr(args, "generate_only", False)  # nothing scored: a bucket asked for needs no reference
    counts = None if shape is not None and generate_only else bucket_counts(args, cfg)
    squarest = min(shapes, key=lambda s: abs(math.log(s[0] / s[1])))
    if counts is None:  # statistics of one shape: the squarest bucket unless told
        return shape or squarest, None
    listed = ", ".join(f"{w}x{h}: {n}" for (w, h), n in counts.items())
    note = None
    if shape is None:
        shape = max(shapes, key=lambda s: (counts[s], s == squarest))
        note = (f"data.buckets: scoring the {shape[0]}x{shape[1]} bucket, the one with the most reference images "
                f"(of each bucket: {listed}); --aspect_ratio or --width / --height scores another")
    if counts[shape] < 2 and not generate_only:
        raise config.ConfigError(
            f"the {shape[0]}x{shape[1]} bucket has {counts[shape]} reference image(s) (of each bucket: {listed}): "
            f"FD needs at least 2. Score a bucket that has them (--aspect_ratio, --width / --height), or against "
            f"more real images: --reference FOLDER (its images of each bucket, cropped as the cache crops them) or "
            f"--reference_split SPLIT")
    return shape, note


def key_of(args, cfg, feature_name):
    """The reference's key, as reference_for reads it: a statistics file's or clean-fid's name alone."""
    if str(args.reference).endswith(".npz") or str(args.reference).startswith("cleanfid:"):
        return {"source": args.reference}
    return reference_key(args, cfg, feature_name)


# ----------------------------------------------------------------------------------------------------------
# Reference statistics: mu and sigma (FID) and the features (KID), computed once and cached in
# <stats_cache>/<source>-<hash>.npz. The hash covers the source and all preprocessing: a change is a miss.


def reference_key(args, cfg, feature_name):
    """What the reference statistics depend on: a folder of images given as --reference, scored as they are (at a
    bucket of a run with data.buckets: its images of that bucket, cropped to it); else a dataset's split,
    preprocessed as in training. The run's own data.source is always a dataset, class folders too: its split
    "heldout" is then the rows the trainer held out, not every image it trained on."""
    data, source = cfg["data"], args.reference or cfg["data"]["source"]
    key = {"source": source, "feature": feature_name, "num": args.reference_num, "format": 1}
    if not same_source(source, data["source"]) and (files := image_files(source)):
        listing = "\n".join(f"{f.relative_to(source)}:{f.stat().st_size}" for f in files)
        key.update(kind="folder", files=hashlib.sha256(listing.encode()).hexdigest())
        if getattr(args, "shape", None):  # a bucket run: the folder's images of that bucket, cropped to it
            key.update(bucket=list(args.shape), buckets=data["bucket_shapes"], crop=args.reference_crop)
        return key
    key.update(kind="dataset", split=args.reference_split, crop=args.reference_crop,
               resolution=args.reference_resolution or data["resolution"],
               image_column=args.reference_image_column or data["image_column"])
    if args.reference_split == "heldout":
        key["heldout"] = [data["split"], data["val_split"], data["val_holdout"]]
    if getattr(args, "shape", None):  # a run with data.buckets, scored at one of them: that bucket's images alone
        key.update(bucket=list(args.shape), buckets=data["bucket_shapes"])
    if source == "embedded":
        # and what the images depend on, as the cache's key
        key["demo"] = [data["demo_samples"], data["demo_resolution"]]
        key["demo"] += [data["demo_sizes"]] if data.get("demo_sizes") else []
        key["demo"] += [data["demo_render"]] if data.get("demo_render", "native") != "native" else []
    return key


def same_source(a, b):
    """Whether two data sources name the same thing (a folder however written, or the same id)."""
    return a == b or (Path(a).expanduser().exists()
                      and Path(a).expanduser().resolve() == Path(b).expanduser().resolve())


def image_files(source):
    """The images of a plain folder, scored as they are (clean-fid's convention); [] for anything else (a
    folder with metadata.jsonl or parquet files is a dataset, preprocessed as in training)."""
    p = Path(source)
    if not p.is_dir() or any(p.glob("**/*.parquet")) or any(p.glob("**/metadata.jsonl")):
        return []
    return sorted(f for f in p.rglob("*") if f.suffix.lower() in {".png", ".jpg", ".jpeg", ".webp", ".bmp"})


def reference_images(key, cfg):
    """One loader per reference image, each returning uint8 (H, W, 3): a folder's files as they are, or
    dataset rows through load_image and preprocess, exactly as the trainer's cache sees them. At a bucket (a run
    with data.buckets), the images whose nearest bucket it is, of a folder or a dataset, each cropped to it as the
    cache crops them."""
    shape, data, resolution = key.get("bucket"), reference_data(key, cfg), key.get("resolution")

    def cropped(value):
        return to_uint8(preprocess(load_image(value), resolution, data, shape=shape)[0][None])[0]
    if key["kind"] == "folder":
        files = image_files(key["source"])
        if shape:
            picked = np.flatnonzero(bucket_of_each(folder_sizes(files), key["buckets"]) == index_of(shape, key))
            items = [lambda f=files[i]: cropped({"path": str(f)}) for i in picked]
        else:
            items = [lambda f=f: np.asarray(Image.open(f).convert("RGB")) for f in files]
    else:
        ds = bucket_rows(key, cfg)  # at a bucket, the images whose nearest bucket it is, cropped to it as the cache
        items = [lambda i=i: cropped(ds[i][key["image_column"]]) for i in range(len(ds))]
    return items[:key["num"]] if key["num"] else items


def reference_data(key, cfg):
    """The run's data section as the reference reads it: its source and image column, the reference's crop, no
    flip, no labels or captions."""
    return config.Config({**cfg["data"], "source": key["source"], "label_column": None, "caption_column": None,
                          "image_column": key.get("image_column") or cfg["data"]["image_column"], "max_samples": None,
                          "crop": key.get("crop", "center"), "random_flip": False})


TRAINED = "trained"  # a key's split: the rows the trainer trains on (open_splits' first), the held-out ones left out


def reference_rows(key, data):
    """A dataset reference's rows: the held-out rows, the trainer's training rows (TRAINED), or the split named."""
    if key["split"] == TRAINED:
        return open_splits(data, log=lambda line: None)[0]
    return heldout(data) if key["split"] == "heldout" else open_dataset(data, key["split"])


def bucket_rows(key, cfg):
    """A dataset reference's rows in the order reference_images reads them (at a bucket: those whose nearest
    bucket it is; a drawn key: its draw, in the order drawn), their other columns (labels, captions) kept: what
    the classifier's accuracy and the text protocol read."""
    ds = reference_rows(key, reference_data(key, cfg))
    ds = ds.select(rows_in(ds, key["image_column"], key["buckets"], key["bucket"])) if key.get("bucket") else ds
    return ds.select(drawn_rows(ds, key["draw"])) if key.get("draw") else ds


def drawn_rows(ds, draw):
    """The rows of a draw (training_draw_key): a seeded permutation's first `count` rows, or with `strata`
    ([[value, count], ...] of `column`) a seeded permutation's first `count` rows of each value, in the order listed
    (fewer where the rows have fewer)."""
    rng = np.random.default_rng(draw["seed"])
    if not draw.get("strata"):
        return rng.permutation(len(ds))[:draw["count"]]
    values = np.asarray(ds[draw["column"]])
    return np.concatenate([rng.permutation(np.flatnonzero(values == v))[:n] for v, n in draw["strata"]])


def training_draw_key(key, cfg, count, seed=0, column=None, values=None):
    """The key of `count` images drawn (seed) from the trainer's training rows of the run's own source, read as the
    reference `key`'s images are (resolution, crop, bucket): the real-data floor of a Frechet distance against that
    reference (docs/evaluation.md, "Real captions"). With `values` (the reference images' `column`, e.g. emoji's
    category), drawn per value in the reference's proportions, so a reference that is mostly one class is read
    against training images of its classes, not against the training set's mix. The held-out rows are never among
    them, so neither is a reference of the held-out rows; a reference that is another split is never the training
    split's rows here (the caller checks). Cached as any reference's statistics."""
    data = cfg["data"]
    out = {k: v for k, v in key.items() if k != "heldout"}
    draw = {"seed": seed, "count": count}
    if values is not None:
        kinds, counts = np.unique(np.asarray(values), return_counts=True)
        draw.update(column=column, strata=[[v.item(), int(n)] for v, n in zip(kinds, counts)])
    return {**out, "split": TRAINED, "num": None, "draw": draw,
            "trained": [data["split"], data["val_split"], data["val_holdout"]]}


def folder_sizes(files):
    """(N, 2) (width, height) of image files, from their headers alone."""
    sizes = np.ones((len(files), 2), dtype=np.int64)
    for i, f in enumerate(files):
        with Image.open(f) as img:
            sizes[i] = img.size
    return sizes


def bucket_of_each(sizes, shapes):
    """The index in `shapes` of each image's nearest bucket, as the cache sorts them (buckets.nearest)."""
    return nearest(np.maximum(sizes, 1), shapes) if len(sizes) else np.zeros(0, dtype=np.int64)


def index_of(shape, key):
    return [list(s) for s in key["buckets"]].index(list(shape))


def stats_path(key, cache_dir):
    """(the cached statistics' .npz of `key`, the key's digest)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{re.sub(r'[^A-Za-z0-9]+', '-', key['source']).strip('-')[-40:]}-{digest}.npz", digest


def reference_size(args, cfg, feature_name):
    """How many images the reference statistics rest on, known before any sampling: the cached statistics' rows,
    else the images or rows the reference would read (None where this cannot be known: clean-fid's named
    statistics, an .npz without features)."""
    if str(args.reference).endswith(".npz"):
        with np.load(args.reference) as f:
            return len(f["feats"]) if "feats" in f else None
    if str(args.reference).startswith("cleanfid:"):
        return None
    key = reference_key(args, cfg, feature_name)
    path = stats_path(key, args.stats_cache)[0]
    if path.exists():
        with np.load(path) as f:
            return len(f["feats"])
    return len(reference_images(key, cfg))


def reference_stats(key, cfg, feature_fn, accelerator, cache_dir, batch_size=64):
    """{mu, sigma, feats, path, key_sha256, sha256}; on a miss the ranks share the feature extraction."""
    path, digest = stats_path(key, cache_dir)
    accelerator.print(f"reference statistics: cache {'hit' if path.exists() else 'miss'}, {path}")
    if not path.exists():
        items, pairs = reference_images(key, cfg), []
        batches = common.my_batches(len(items), batch_size, accelerator.process_index, accelerator.num_processes)
        for idx in progress(batches, "reference features", accelerator.is_local_main_process):
            pairs += zip(idx, feature_fn([items[i]() for i in idx]))
        feats = common.gathered(pairs)
        if accelerator.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path.with_suffix(".tmp.npz"), mu=feats.mean(0), sigma=np.cov(feats, rowvar=False),
                     feats=feats.astype(np.float32), key=json.dumps(key, sort_keys=True))
            os.replace(path.with_suffix(".tmp.npz"), path)
        accelerator.wait_for_everyone()
    with np.load(path) as f, open(path, "rb") as raw:
        return {"mu": f["mu"], "sigma": f["sigma"], "feats": f["feats"], "path": str(path), "key_sha256": digest,
                "sha256": hashlib.file_digest(raw, "sha256").hexdigest()}


def named_reference_stats(spec, mode, accelerator=None):
    """clean-fid's precomputed statistics, cleanfid:NAME:RES:SPLIT (e.g. cleanfid:cifar10:32:train), which
    clean-fid downloads into its package folder; its urlopen has no timeout, so we bound the wait."""
    import socket

    from cleanfid.features import get_reference_statistics

    _, name, res, split = spec.split(":")
    old, feats = socket.getdefaulttimeout(), None
    socket.setdefaulttimeout(30)
    try:
        with accelerator.main_process_first() if accelerator else contextlib.nullcontext():  # one download
            mu, sigma = get_reference_statistics(name, int(res), mode=mode, split=split)
            with contextlib.suppress(OSError):  # not every named set has KID features
                feats = get_reference_statistics(name, int(res), mode=mode, split=split, metric="KID")
    finally:
        socket.setdefaulttimeout(old)
    return {"mu": mu, "sigma": sigma, "feats": feats, "path": spec, "key_sha256": None,
            "sha256": hashlib.sha256(mu.tobytes() + sigma.tobytes()).hexdigest()}


def reference_for(args, cfg, feature_fn, accelerator):
    """(key, statistics) of --reference: one of our .npz files as is, clean-fid's named statistics, or a
    folder or dataset through the cache."""
    if str(args.reference).endswith(".npz"):
        with np.load(args.reference) as f, open(args.reference, "rb") as raw:
            return {"source": args.reference}, {"mu": f["mu"], "sigma": f["sigma"], "feats": f.get("feats"),
                                                "path": args.reference, "key_sha256": None,
                                                "sha256": hashlib.file_digest(raw, "sha256").hexdigest()}
    if str(args.reference).startswith("cleanfid:"):
        return {"source": args.reference}, named_reference_stats(args.reference, args.mode, accelerator)
    key = reference_key(args, cfg, getattr(feature_fn, "name", "custom"))
    return key, reference_stats(key, cfg, feature_fn, accelerator, args.stats_cache, args.batch_size)
