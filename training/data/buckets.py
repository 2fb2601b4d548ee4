"""Aspect-ratio buckets (data.buckets): images of any shape trained at their own shape instead of cropped square.

    data.buckets (aspect ratios, or "auto") -> shapes_for (each bucket's width x height at about data.resolution^2
      pixels, sides multiples of the patch x the VAE's factor) -> resolve (every training image's size read from
      its header, the nearest bucket, buckets smaller than a global batch merged into their neighbours, the table
      printed, data.bucket_shapes set) -> [encoding.py: each image cropped to its bucket (crop_extent) and cached at
      its size; batching.py: micro-batches of one bucket at a time]

An image goes to the bucket nearest its aspect ratio in log scale, |log(w / h) - log(bw / bh)|, so a 1:4 image is
as far from 1:2 as 4:1 is from 2:1 (diffusers' find_nearest_bucket compares |h bw - w bh|, which is not symmetric
between wide and tall). The crop then removes only what the two ratios differ by, and the size and crop controls
carry it as they carry a square crop. Images smaller than their bucket are upscaled, as square crops are, and
counted in the table; images below data.min_image_side are skipped when the cache is built, and counted too.
"""
import io
import math

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

import common
from training.config.config import ConfigError

# diffusers' ladder (training_utils.generate_aspect_ratio_buckets, 2026-07): width : height
AUTO = [(1, 1), (4, 5), (5, 4), (2, 3), (3, 2), (3, 4), (4, 3), (9, 16), (16, 9), (1, 2), (2, 1)]

# ----------------------------------------------------------------------------------------------------------
# The shapes, and each image's bucket and crop.


def shapes_for(buckets, resolution, multiple):
    """[(width, height)] of data.buckets ("auto": AUTO; else aspect ratios width / height) at about resolution^2
    pixels, each side the nearest multiple of `multiple` (at least one), without repeats, tallest first. As
    diffusers: h = sqrt(resolution^2 / ratio), w = h ratio, each rounded."""
    ratios = [w / h for w, h in AUTO] if buckets == "auto" else buckets
    out = set()
    for ratio in ratios:
        h = math.sqrt(resolution ** 2 / ratio)
        out.add((max(multiple, round(h * ratio / multiple) * multiple), max(multiple, round(h / multiple) * multiple)))
    return sorted(out, key=lambda s: (s[0] / s[1], s[0]))


def nearest(sizes, shapes):
    """The index in `shapes` of the bucket nearest each (width, height) of `sizes` (N, 2) in log aspect ratio;
    ties go to the first (the taller)."""
    sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    ratios = np.log(np.asarray(shapes, dtype=np.float64)[:, 0] / np.asarray(shapes, dtype=np.float64)[:, 1])
    return np.abs(np.log(sizes[:, :1] / sizes[:, 1:]) - ratios[None]).argmin(1)


def crop_extent(w, h, width, height):
    """(box width, box height): the largest box of the bucket's aspect width : height inside a w x h image (the
    whole image along the side it is shorter in). With width == height it is the short side both ways: the
    square crop of data.crop."""
    if w * height > h * width:  # the image is wider than the bucket: its full height, part of its width
        return max(1, min(w, round(h * width / height))), h
    return w, max(1, min(h, round(w * height / width)))


def bucket_of(img, data):
    """(index, (width, height)) of a PIL image's bucket among data.bucket_shapes."""
    k = int(nearest([img.size], data.bucket_shapes)[0])
    return k, tuple(data.bucket_shapes[k])


def default_shape(cfg):
    """(width, height) a run samples at unless told: data.resolution square, or the squarest of its buckets."""
    shapes = cfg["data"].get("bucket_shapes")  # .get: runs saved before buckets
    if not shapes:
        return cfg["data"]["resolution"], cfg["data"]["resolution"]
    return tuple(shapes[int(nearest([(1, 1)], shapes)[0])])


def largest_side(cfg):
    """The longest side (pixels) the model is built for: the largest bucket's, else data.resolution. The positional
    grid covers it (SD3's cropped 2-D embedding: each shape takes the grid's centre)."""
    shapes = cfg["data"].get("bucket_shapes")
    return max(max(s) for s in shapes) if shapes else cfg["data"]["resolution"]


def shape_arg(cfg, width=None, height=None, aspect_ratio=None):
    """(width, height) that sample.py and eval_fid.py sample at: --width and --height as given, --aspect_ratio
    ("3:2" or 1.5) the nearest of the run's buckets, else default_shape. Each side must fit the positional grid
    (its multiple of patch x the VAE's factor is checked where the model is known: generation.noise_shape); a
    one-line ConfigError says which shapes the run was trained at."""
    shapes = cfg["data"].get("bucket_shapes") or [(cfg["data"]["resolution"],) * 2]
    trained = ", ".join(f"{w}x{h}" for w, h in shapes)
    if aspect_ratio is not None:
        if not cfg["data"].get("bucket_shapes"):  # one shape: its "nearest bucket" would be a square, silently
            raise ConfigError(f"--aspect_ratio {aspect_ratio} picks one of a run's data.buckets, and this run was "
                              f"trained square at {trained} px: give --width and --height instead")
        ratio = ratio_of(aspect_ratio)
        if not (math.isfinite(ratio) and ratio > 0):
            raise ConfigError(f"--aspect_ratio {aspect_ratio}: a width / height above 0, as '3:2' or 1.5")
        return tuple(shapes[int(nearest([(ratio, 1)], shapes)[0])])
    if (width is None) != (height is None):
        raise ConfigError("give both --width and --height (pixels), or --aspect_ratio")
    if width is None:
        return default_shape(cfg)
    if min(width, height) < 1:
        raise ConfigError(f"--width {width} --height {height}: pixels, each at least 1; it was trained at {trained}")
    if max(width, height) > largest_side(cfg):
        raise ConfigError(f"--width {width} --height {height}: the model's positional grid covers {largest_side(cfg)} "
                         f"pixels a side; it was trained at {trained}")
    return width, height


def ratio_of(aspect_ratio):
    """--aspect_ratio ("3:2" or 1.5) as a number, nan where it is none."""
    a, _, b = str(aspect_ratio).partition(":")
    try:
        return float(a) / float(b or 1)
    except (ValueError, ZeroDivisionError):
        return float("nan")


def shape_note(cfg, shape, width=None, height=None, aspect_ratio=None):
    """The line sample.py prints about the shape it samples, (width, height) from shape_arg: which bucket and why (the
    squarest by default; the nearest to --aspect_ratio, saying where the run kept no bucket of that ratio, since
    data.buckets' buckets with fewer training images than a global batch were merged at start-up; --width and
    --height as given, a bucket or not). None for a square run sampled at its square."""
    data = cfg["data"]
    shapes, (w, h) = [tuple(s) for s in data.get("bucket_shapes") or []], shape
    named, listed = f"{w}x{h} (width x height, aspect {w / h:.2f})", ", ".join(f"{a}x{b}" for a, b in shapes)
    if width is not None:
        if shapes:
            trained = "one of" if shape in shapes else "a shape it was not trained at, not one of"
            return f"sampling {named}, as --width and --height give: {trained} this run's buckets ({listed})"
        square = (data["resolution"],) * 2
        return f"sampling {named}, as --width and --height give" + (
            f": the run was trained square at {square[0]} px" if shape != square else "")
    if not shapes:
        return None
    if aspect_ratio is None:
        return (f"sampling the bucket {named}: the squarest of this run's buckets ({listed}); --aspect_ratio or "
                f"--width and --height choose another")
    out = f"sampling the bucket {named}: of this run's buckets ({listed}) the nearest to --aspect_ratio {aspect_ratio}"
    ratios = [a / b for a, b in AUTO] if data.get("buckets") == "auto" else data.get("buckets") or []
    if ratios:  # the data.buckets ratio asked for, and the one this bucket was made for (nearest in log ratio)
        asked, made = (ratios[int(nearest([(r, 1)], [(c, 1) for c in ratios])[0])]
                       for r in (ratio_of(aspect_ratio), w / h))
        if not math.isclose(asked, made):
            out += (f"; it kept no bucket for data.buckets' {asked:.3g} (merged into its neighbours at start-up, with "
                    f"fewer training images than a global batch, or left out with none nearest to it)")
    return out


# ----------------------------------------------------------------------------------------------------------
# The training images' sizes, and the buckets a run keeps (start-up).


def image_sizes(ds, column, log=print):
    """(N, 2) int array of each row's (width, height), read from the image header only (no pixels decoded);
    (-1, -1) for a row that cannot be read (it is reported and skipped when the cache is built)."""
    sizes, rows = np.full((len(ds), 2), -1, dtype=np.int64), 0
    bar = tqdm(total=len(ds), unit="img", desc="image sizes", disable=len(ds) < 5000,
               mininterval=0.1 if common.interactive() else 60)
    for batch in ds.select_columns([column]).iter(batch_size=1024):
        for value in batch[column]:
            try:
                with Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") is not None else value["path"]) as img:
                    sizes[rows] = img.size
            except Exception:  # a broken file: the cache build reports it, naming the row
                pass
            rows += 1
        bar.update(len(batch[column]))
    bar.close()
    return sizes


def rows_in(ds, column, shapes, shape):
    """The indices of the rows of `ds` whose bucket among `shapes` is `shape` (sizes read from the image headers):
    a bucket's reference images and held-out controls in eval_fid.py."""
    where = nearest(np.maximum(image_sizes(ds, column), 1), shapes)
    return np.flatnonzero(where == [list(s) for s in shapes].index(list(shape))).tolist()


def merge_small(shapes, sizes, batch, min_side=1):
    """(kept shapes, {shape: what became of it}). Every readable image goes to its nearest bucket; a bucket no image
    is nearest is left out, and a bucket holding fewer images than `batch` (one global batch) is merged into its
    neighbours, smallest first: its images go to the nearest bucket that is left. One bucket is always kept."""
    usable = sizes[sizes.min(1) >= min_side]
    shapes, fate = list(shapes), {}
    while len(shapes) > 1 and len(usable):
        where = nearest(usable, shapes)
        counts = np.bincount(where, minlength=len(shapes))
        if not counts.all():
            fate.update({s: "no image is nearer to it than to another bucket: left out"
                         for s, c in zip(shapes, counts) if not c})
            shapes = [s for s, c in zip(shapes, counts) if c]
            continue
        k = int(counts.argmin())
        if counts[k] >= batch:
            break
        rest = shapes[:k] + shapes[k + 1:]
        went = np.bincount(nearest(usable[where == k], rest), minlength=len(rest))
        fate[shapes[k]] = (f"{counts[k]} images, fewer than a global batch of {batch}: merged into "
                           + ", ".join(f"{w}x{h} ({n})" for (w, h), n in zip(rest, went) if n))
        shapes = rest
    return shapes, fate


def table(shapes, sizes, fate, batch=None, micro=None, min_side=1):
    """The start-up table: per bucket its images, their share, how many are upscaled (smaller than the bucket), how
    many lose more than half their area to the crop and the mean share of area the crop takes from them (a square
    photo in a 2:3 bucket loses a third), and (`batch`: the training images') the batches an epoch gives; then the
    buckets left out or merged, and the images skipped, each with why."""
    usable = sizes.min(1) >= min_side
    where = nearest(sizes[usable], shapes) if usable.any() else np.zeros(0, dtype=np.int64)
    lines = [f"{'bucket':>9} {'w/h':>5} {'images':>7} {'share':>6} {'upscaled':>8} {'crop>1/2':>8} {'lost':>5}"
             + "  batches an epoch" * (batch is not None)]
    for k, (w, h) in enumerate(shapes):
        mine = sizes[usable][where == k]
        boxes = np.array([crop_extent(int(a), int(b), w, h) for a, b in mine]).reshape(-1, 2)
        up = int(((boxes[:, 0] < w) | (boxes[:, 1] < h)).sum())
        lost = int((boxes.prod(1) < mine.prod(1) / 2).sum())
        mean_lost = float((1 - boxes.prod(1) / mine.prod(1)).mean()) if len(mine) else 0.0
        n = len(mine)
        line = f"{f'{w}x{h}':>9} {w / h:5.2f} {n:7d} {n / max(len(where), 1):6.1%} {up:8d} {lost:8d} {mean_lost:5.0%}"
        if batch is not None:
            line += f"  {n / batch:.1f} global batches of {batch}"
            if micro:
                fill = -n % micro
                line += f"; {math.ceil(n / micro)} micro-batches of {micro}" + (
                    f", the last filled with {fill} of its images seen again" if fill else "")
        lines.append(line)
    lines += [f"{f'{w}x{h}':>9} {w / h:5.2f}: {why}" for (w, h), why in fate.items()]
    broken, tiny = int((sizes[:, 0] < 0).sum()), int(((sizes.min(1) >= 0) & ~usable).sum())
    if broken or tiny:
        lines.append(f"not in any bucket: {broken} unreadable, {tiny} below data.min_image_side={min_side} px "
                     "(reported and skipped when the cache is built)")
    return lines


def resolve(cfg, ds, accelerator, heldout=None):
    """data.buckets on: the buckets this run trains at, set in data.bucket_shapes (config.json, checkpoints and the
    export record them; sample.py and eval_fid.py read them), and the start-up table printed, then the same table of
    the `heldout` rows (validation's, and eval_fid.py's reference images by default), cropped to their nearest kept
    bucket as the training images are. The buckets follow from data.buckets, data.resolution, the model's multiple,
    the training images' sizes and the global batch (train.global_batch, else batch x processes x accumulation), so
    a resumed run finds the same ones; a data.bucket_shapes given by hand must be what they come to. Off: nothing."""
    from training.data.encoders import vae_factor

    data, tr, world = cfg.data, cfg.train, accelerator.num_processes
    if not data.buckets:
        return
    multiple = cfg.model.patch_size * (vae_factor(cfg.encoders.vae) if cfg.encoders.vae else 1)
    configured = shapes_for(data.buckets, data.resolution, multiple)
    sizes = image_sizes(ds, data.image_column)
    batch = tr.global_batch or tr.batch_size * world * tr.grad_accum
    micro = tr.batch_size * world if tr.batch_size != "auto" else None
    shapes, fate = merge_small(configured, sizes, batch, data.min_image_side)
    accelerator.print(f"buckets (data.buckets={data.buckets}, about {data.resolution}^2 px, sides multiples of "
                      f"{multiple}): {len(sizes)} training images\n  " +
                      "\n  ".join(table(shapes, sizes, fate, batch, micro, data.min_image_side)))
    shapes = [list(s) for s in shapes]
    if data.bucket_shapes is not None and [list(s) for s in data.bucket_shapes] != shapes:
        raise ConfigError(f"data.bucket_shapes={data.bucket_shapes} is not what data.buckets={data.buckets} gives on "
                          f"this data at a global batch of {batch} ({shapes}): a resumed run needs the global batch it "
                          f"started with (set train.global_batch to its batch_size x processes x grad_accum); a new "
                          f"run: leave data.bucket_shapes unset (null), the run fills it")
    data.bucket_shapes = shapes
    if heldout is not None and len(heldout):  # cropped to their buckets too: say how much, as for the training images
        sizes, which = image_sizes(heldout, data.image_column), f"data.val_split={data.val_split!r}" if \
            data.val_split else "the hold-out"
        accelerator.print(f"held-out images ({which}: validation's, and eval_fid.py's reference by default): "
                          f"{len(sizes)}, each cropped to its nearest kept bucket\n  " + "\n  ".join(
                              table([tuple(s) for s in shapes], sizes, {}, min_side=data.min_image_side)))
