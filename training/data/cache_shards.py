"""A cache shard's file, as cache.py writes and checks it and training reads it: a safetensors file holding rows
[k * S, (k + 1) * S) of a split, written atomically with its row count and the checksum of its tensors in its header
(save_shard), found sound or damaged from that header and, when asked, its contents (shard_damage), and read
lazily from memory-mapped files (CachedDataset; with data.buckets, each bucket's rows as tensors of their own).
"""
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


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
            rows, counts = int(meta["rows"]), json.loads(meta.get("buckets", "null"))  # a bucket's tensors: name@b
            if any(f.get_slice(name).get_shape()[0] != (rows if counts is None else counts.get(name.rpartition("@")[2]))
                   for name in names):
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
    bad = [name for name, t in tensors.items() if t.is_floating_point()
           and not torch.isfinite(t.sum(dtype=torch.float64))]
    return f"non-finite values in {bad}" if bad else None


def save_shard(path, tensors, rows, skipped, buckets=None):
    """Atomically: written to a temporary name, renamed when complete, with its row count, the skipped rows
    and the checksum of its tensors in the header; with buckets, the rows of each ({bucket: rows}), whose
    tensors are named name@bucket."""
    tmp = path.with_suffix(".tmp")
    more = {} if buckets is None else {"buckets": json.dumps(buckets)}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp),
              metadata={"rows": str(rows), "skipped": json.dumps(skipped), "sha256": tensors_sha256(tensors), **more})
    os.replace(tmp, path)


SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "U8": torch.uint8, "BOOL": torch.bool}


class CachedDataset(torch.utils.data.Dataset):
    """Rows of a finished cache, read lazily from memory-mapped shards (ImageNet latents do not fit in RAM
    once per GPU). Returns float32 tensors; a latent cache holds the posterior mean and std, and a sample
    x0 = mean + std * n is drawn at train time, so each epoch sees a fresh draw. With `views` > 1 each image's
    cached views are consecutive rows (data.cache_views) and iterate_batches shows one of them per epoch.

    `dataset[i]` is one row; `dataset[list of rows]` is a micro-batch (what iterate_batches asks for), read
    with one gather per tensor and shard: per-row reads and collation cost 2% of a small model's step.

    A bucket cache (data.buckets) holds, in each shard file, each bucket's rows as tensors of their own (name@b):
    the rows are file by file, bucket by bucket, each (file, bucket) a part of one shape. `buckets` is then each
    row's bucket index into `shapes` ([width, height] in pixels), and a micro-batch must be of one bucket."""

    def __init__(self, folder):
        self.folder = Path(folder)
        manifest = json.loads((self.folder / "manifest.json").read_text())
        self.shards, self.shapes = manifest["shards"], manifest.get("buckets")
        self.parts, starts, self.keys, self.mapped, self.files_mapped = [], [0], [], {}, {}  # part: (file, bucket)
        for i, name in enumerate(self.shards):
            with safe_open(str(self.folder / name), "pt") as f:
                meta = f.metadata()
                counts = json.loads(meta["buckets"]) if "buckets" in meta else {"": int(meta["rows"])}
                for bucket, rows in sorted(counts.items(), key=lambda kv: int(kv[0] or -1)):
                    self.parts.append((i, bucket))
                    starts.append(starts[-1] + rows)
                    self.keys = [k.partition("@")[0] for k in f.keys() if k.partition("@")[2] == bucket] or self.keys
        self.starts = torch.tensor(starts)
        self.views = manifest.get("views", 1)  # rows per image (data.cache_views): iterate_batches draws one
        self.buckets = None if self.shapes is None else torch.repeat_interleave(
            torch.tensor([int(b) for _, b in self.parts], dtype=torch.long), self.starts.diff())

    def __len__(self):
        return int(self.starts[-1])

    @property
    def x_shape(self):
        """(channels, side, side) of the model's positional grid in model space: a row's (data.resolution), or with
        buckets the largest bucket's side at the cache's pixels-per-model-unit."""
        shape = self[0]["x"].shape
        if self.shapes is None:
            return shape
        scale = self.shapes[int(self.buckets[0])][0] / shape[-1]  # pixels per model-space unit (the VAE's factor)
        side = round(max(max(s) for s in self.shapes) / scale)
        return torch.Size((shape[0], side, side))

    def __getitem__(self, rows):
        one = not isinstance(rows, (list, tuple, torch.Tensor))
        rows = torch.as_tensor([rows] if one else rows, dtype=torch.long)
        if len(rows) and not (0 <= rows.min() and rows.max() < len(self)):
            raise IndexError(f"rows {rows.min().item()}..{rows.max().item()} of a cache of {len(self)} rows")
        if self.buckets is not None and len(rows) and len(set(self.buckets[rows].tolist())) > 1:
            raise ValueError(f"rows of buckets {sorted(set(self.buckets[rows].tolist()))} in one batch: a batch of a "
                             f"bucket cache holds one bucket (batching.iterate_batches, batching.same_bucket)")
        shard = torch.searchsorted(self.starts, rows, right=True) - 1
        batch = {}
        for k in shard.unique().tolist():
            where = (shard == k).nonzero().squeeze(1)
            for name, tensor in self.tensors(k).items():
                part = tensor[rows[where] - self.starts[k]]
                part = part if name in ("label", "input_ids", "attention_mask") else part.float()  # ids stay integers
                batch.setdefault(name, part.new_empty((len(rows), *part.shape[1:])))[where] = part
        return {name: t[0] for name, t in batch.items()} if one else batch

    def tensors(self, k):
        """Part k's tensors as views of its shard's memory-mapped file, mapped once per process (the DataLoader's
        workers map their own: a mapping does not pickle). A safetensors file is an 8-byte header length, a
        JSON header (each tensor's dtype, shape and byte range) and the tensors' bytes."""
        if k not in self.mapped:
            i, bucket = self.parts[k]
            if i not in self.files_mapped:
                path = self.folder / self.shards[i]
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(n))
                data = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)[8 + n:]
                self.files_mapped[i] = {name: data[a:b].view(SAFETENSORS_DTYPES[h["dtype"]]).view(h["shape"])
                                        for name, h in header.items() if name != "__metadata__"
                                        for a, b in [h["data_offsets"]]}
            self.mapped[k] = {name.partition("@")[0]: t for name, t in self.files_mapped[i].items()
                              if name.partition("@")[2] == bucket}
        return self.mapped[k]

    def __getstate__(self):
        return {**self.__dict__, "mapped": {}, "files_mapped": {}}
