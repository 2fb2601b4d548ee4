"""Rows -> the tensors a cache shard holds, for streams and map-style sources alike: the rows of each source
shard, decoding and cropping in DataLoader workers (DecodedShards; a damaged or mislabelled image is reported and
skipped, never trained on), the encoding of a decoded batch, and the size estimate of a cache before it is built.
training/data/cache.py writes, checks and reads the shards.
"""
import functools
import random

import torch
from PIL import Image

from training.data.buckets import bucket_of
from training.data.classes import label_problem, labels_are_the_condition
from training.data.sources import is_stream, load_image, preprocess, shard_of, tag_shard


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
    so cache shard k is the same whatever the number of ranks and workers. With `views` > 1 (data.cache_views,
    training rows) each image becomes consecutive rows: its crops, each unflipped and, with data.random_flip,
    mirrored, every row with the metadata of its own view; a batch always holds whole images. Unusable rows (broken
    image, tiny image, missing caption) are reported in the batch's "skipped" and left out, never crash the build."""

    def __init__(self, ds, shards, data, names=None, views=1):
        self.ds, self.shards, self.data, self.names, self.views = ds, shards, data, names, views
        # A map-style dataset's labels were all checked when it was opened (open_splits); a stream's are checked
        # here, as its rows are read: a label that is not a class stops the build, naming the member.
        self.check_labels = labels_are_the_condition(data) and is_stream(data)

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
            if self.check_labels and (problem := label_problem(row[data.label_column], data.num_classes)):
                raise ValueError(f"{where}: {problem} (data.label_column='{data.label_column}'); nothing of this "
                                 f"shard is cached, the shards before it are kept")
            try:
                img = load_image(row[data.image_column])
                if min(img.size) < data.min_image_side:
                    raise ValueError(f"{img.size[0]}x{img.size[1]} px is below data.min_image_side")
                caption = self.caption(row)
                views = self.cropped_views(img, rng)
            except Exception as e:  # truncated, empty, not an image, too small, no caption: report, skip
                batch["skipped"].append(f"{where}: {type(e).__name__}: {e}"[:300])
                continue
            for pixel, meta in views:
                batch["pixels"].append(pixel), batch["metas"].append(meta), batch["captions"].append(caption)
                batch["labels"].append(row[data.label_column] if data.label_column else None)
            if len(batch["pixels"]) >= data.encode_batch_size:
                yield self.collate(k, batch, last=False)
                batch = {name: [] for name in batch}
        if shard is not None:
            yield self.collate(shard, batch, last=True)

    def cropped_views(self, img, rng):
        """[(pixels, metadata)] of one image: one view as drawn (views == 1), or data.cache_views crops, each
        followed by its mirror image when data.random_flip (the mirror is exact: a resampled crop, reversed). With
        data.bucket_shapes, each view is cropped to the image's bucket and its metadata names the bucket."""
        data = self.data
        bucket, shape = bucket_of(img, data) if data.get("bucket_shapes") else (None, None)
        out = [preprocess(img, data.resolution, data, rng, shape=shape)] if self.views == 1 else []
        for _ in range(data.cache_views if self.views > 1 else 0):
            pixel, meta = preprocess(img, data.resolution, data, rng, flip=False, shape=shape)
            out.append((pixel, meta))
            if data.random_flip:
                out.append((pixel.flip(-1), {**meta, "flip": torch.tensor([1])}))
        return out if bucket is None else [(pixel, {**meta, "bucket": bucket}) for pixel, meta in out]

    def collate(self, k, batch, last):
        """A decoded batch: the shard, whether it is the shard's last, the skipped rows, and its rows as groups of
        one shape each (one group without buckets), so each is encoded as one tensor."""
        data, n = self.data, len(batch["pixels"])
        buckets = [m.pop("bucket", None) for m in batch["metas"]]
        groups = []
        for b in sorted(set(buckets), key=lambda b: -1 if b is None else b):
            rows = [i for i, c in enumerate(buckets) if c == b]
            groups.append({"bucket": b, "pixels": torch.stack([batch["pixels"][i] for i in rows]),
                           "metas": {name: torch.stack([batch["metas"][i][name] for i in rows])
                                     for name in batch["metas"][0]},
                           "captions": [batch["captions"][i] for i in rows] if data.caption_column or
                           data.label_captions else None,
                           "labels": torch.tensor([batch["labels"][i] for i in rows], dtype=torch.long)
                           if data.label_column else None})
        return {"shard": k, "last": last, "skipped": batch["skipped"], "rows": n, "groups": groups}


def encoded_rows(group, encode, data, text):
    """One decoded group of rows of one shape -> the tensors its rows add to their cache shard: encoder outputs in
    data.cache_dtype (token ids stay integers), control metadata and labels."""
    out = encode(group["pixels"], group["captions"], **({"text": text} if text == "tokens" else {}))
    dtype = getattr(torch, data.cache_dtype)
    out = {name: value.to("cpu", dtype if value.is_floating_point() else value.dtype) for name, value in out.items()}
    out.update(group["metas"])
    if group["labels"] is not None:
        out["label"] = group["labels"]
    return out


def cache_size(encode, data, text, shard_rows):
    """(bytes per sample, total bytes) of a cache of shards with `shard_rows` rows each: one blank image goes
    through the same encode and tensor layout that build_cache writes, so the estimate is the cache's own
    layout (a shard's safetensors header included); only skipped rows make the real cache smaller."""
    from safetensors.torch import save

    img = Image.new("RGB", (data.resolution, data.resolution))
    pixel, meta = preprocess(img, data.resolution, data, random.Random(0))
    probe = {"pixels": pixel[None], "metas": {k: v[None] for k, v in meta.items()},
             "captions": [""] if data.caption_column or data.label_captions else None,
             "labels": torch.zeros(1, dtype=torch.long) if data.label_column else None}
    tensors = encoded_rows(probe, encode, data, text)
    per_row = sum(t.numel() * t.element_size() for t in tensors.values())
    one_row = save({name: t.contiguous() for name, t in tensors.items()},
                   metadata={"rows": "1", "skipped": "[]", "sha256": "0" * 64})
    header = len(one_row) - per_row
    return per_row, sum(shard_rows) * per_row + len(shard_rows) * header


def human_bytes(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
