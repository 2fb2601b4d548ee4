"""How decoded images become cached tensors, and the data stage of a run (the seed's "cache check -> hit:
load / miss: process -> cache results"), which both trainers spell out:

    frozen_encoders -> for the training and held-out rows: locate_cache (key -> folder) -> check_cache (each
      rank its share: headers, and the contents of any shard changed since verified) -> hit, or write_cache:
      DecodedShards (decode, crop in DataLoader workers) -> encode here -> write_shards (atomic, checksummed,
      read back) -> manifest -> CachedDataset; then encoders.place_encoders

Where the rows come from (sources, streams, preprocessing) is sources.py's, the frozen encoders encoders.py's and
REPA's targets repa_targets.py's; how a row is decoded and encoded, and the size estimate, encoding.py's; a shard's
file (written, checked, read as CachedDataset) cache_shards.py's; the batches read from the cache, batching.py's.
"""
import glob
import hashlib
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

import common
from training.data import repa_targets, sd3_base
from training.data.cache_shards import CachedDataset, save_shard, shard_damage
from training.data.batching import loader_options, views_of
from training.data.classes import class_names, read_class_ids, validation_prompts
from training.data.encoders import encode_text, load_encoders, make_encode, text_encoder_identity, vae_identity
from training.data.encoding import DecodedShards, cache_size, encoded_rows, human_bytes, samples_per_shard
from training.data.sources import expand_braces, is_stream, stream_shards


# ----------------------------------------------------------------------------------------------------------
# Cache: "cache check -> hit: load / miss: process -> cache results" (training_pipeline.txt).
# Each shard k holds dataset rows [k * S, (k + 1) * S) and is written by rank k % world_size, atomically, with
# a checksum of its tensors in its header. A shard counts as finished only once it verifies (header, checksum,
# finite values), so a damaged shard is rebuilt like a missing one and an interrupted extraction resumes at the
# shards still missing. Its contents are verified when it is written (read back) and again whenever its file
# changed since (the manifest keeps each verified shard's size and times), not at every start. The folder is
# named by a hash of everything that changes the content, so a changed key is a miss that names what changed,
# never a silent reuse.


def source_fingerprint(data, ds):
    """A fingerprint of the source's content, so that data changed under the same name is a miss, at no cost
    per file of ours. A map-style source (hub data, a local image folder or parquet files): the dataset's own
    fingerprint, which for local files already covers every file's path and modification time (`datasets`
    lists and stats them itself, at every start, to name its Arrow cache), so an image edited in place changes
    it; a pass of our own over a million-file folder doubled that: a million more metadata calls per start, on
    every rank. Local tar shards (a stream has no fingerprint): the path, size and modification time of each of
    the shard files (thousands, not millions). None for the demo (its parameters are in the key)."""
    if data.source == "embedded":
        return None
    if not (is_stream(data) and ".tar" in data.source):
        return {"dataset_fingerprint": getattr(ds, "_fingerprint", None)}  # a hub stream has none
    files = sorted(Path(f).resolve() for pattern in expand_braces(data.source) for f in glob.glob(pattern))
    digest, total = hashlib.sha256(), 0
    for path in files:
        stat = path.stat()
        total += stat.st_size
        digest.update(f"{path.relative_to('/')}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
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
        key["demo"] = [data.demo_samples, data.demo_resolution] + ([data.demo_sizes] if data.get("demo_sizes") else [])
        key["demo"] += [data.demo_render] if data.get("demo_render", "native") != "native" else []
    if data.label_captions:
        key["label_captions"] = data.class_ids
    if is_stream(data):
        key["val_shards"] = data.val_shards
    if data.get("bucket_shapes"):  # each image cropped to its bucket and cached at its shape (data.buckets)
        key["buckets"] = data.bucket_shapes
    if views_of(data, part) > 1:  # data.cache_views crops, each both ways with data.random_flip
        key["views"] = [data.cache_views, data.random_flip]
    if part == "train" and not data.cache_text and enc.text_encoder:
        key["cache_text"] = False  # token ids, not features
    if enc.vae:  # its factors (and a local folder's weights): a recalibrated or retrained VAE is a miss
        key["vae_identity"] = vae_identity(enc.vae)
    if enc.text_encoder and text_encoder_identity(enc.text_encoder):  # a local folder's files: retrained, a miss
        key["text_encoder_identity"] = text_encoder_identity(enc.text_encoder)
    key.update(sd3_base.cache_key(enc))  # an SD3-family pipeline: which of its text encoders encode
    key.update(repa_targets.cache_key(cfg))  # REPA's targets, when stored with the rows
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
        raise RuntimeError(f"data.cache_dir='{cache_dir}' is not shared: rank(s) {blind} of "
                           f"{accelerator.num_processes} do not see the marker that rank 0 wrote to "
                           f"{Path(cache_dir).resolve()}. The ranks write and read each other's cache shards: put "
                           "data.cache_dir on storage every node mounts at the same path (a shared file system), not "
                           "on a node-local disk")


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
    views = views_of(data, part)
    loader = torch.utils.data.DataLoader(DecodedShards(ds, todo, data, names, views), batch_size=None,
                                         generator=torch.Generator().manual_seed(0),
                                         **loader_options(data, torch.device("cpu")))
    rank = accelerator.process_index
    bar = tqdm(total=sum(rows[k] for k in todo), unit="img", desc=f"cache {part} (rank {rank})",
               disable=not accelerator.is_local_main_process, mininterval=0.1 if common.interactive() else 60)
    pending, done, encoded, skipped, start = {}, 0, 0, 0, time.perf_counter()

    def agree():
        if signals is not None:
            signals.exit_if_agreed(accelerator, f"the cache build ({part}); the next run resumes from "
                                   "its finished shards")

    bucketed = bool(data.get("bucket_shapes"))  # a bucket's rows are tensors of their own: name@bucket
    for batch in loader:  # decoded in the workers; encoded here, on the device
        shard = pending.setdefault(batch["shard"], {"tensors": {}, "skipped": [], "rows": 0, "buckets": {}})
        for group in batch["groups"]:  # rows of one shape each (one group without buckets)
            out = encoded_rows(group, encode, data, text)
            finite = torch.ones(len(group["pixels"]), dtype=torch.bool)
            for t in out.values():
                if t.is_floating_point():
                    finite &= torch.isfinite(t.flatten(1).float()).all(1)
            finite = finite.view(-1, views).all(1).repeat_interleave(views)  # an image keeps all its views or none
            for i in torch.nonzero(~finite).flatten().tolist():
                shard["skipped"].append(f"shard {batch['shard']}, row {shard['rows'] + i}: encoded to non-finite "
                                        "values")
            suffix = "" if group["bucket"] is None else f"@{group['bucket']}"
            for name, value in out.items():
                shard["tensors"].setdefault(name + suffix, []).append(value[finite])
            shard["rows"] += int(finite.sum())
            if bucketed:
                bucket = str(group["bucket"])
                shard["buckets"][bucket] = shard["buckets"].get(bucket, 0) + int(finite.sum())
        shard["skipped"] += batch["skipped"]
        encoded, skipped = encoded + batch["rows"] // views, skipped + len(batch["skipped"])  # images
        bar.update(batch["rows"] + views * len(batch["skipped"]))
        if batch["last"]:
            shard = pending.pop(batch["shard"])
            save_shard(path_of(batch["shard"]), {n: torch.cat(parts) for n, parts in shard["tensors"].items()},
                       shard["rows"], shard["skipped"], shard["buckets"] if bucketed else None)
            done += 1
            agree()
    for k in todo:  # a shard with no rows at all never reached the loop: it is finished, and empty
        if not path_of(k).exists():
            save_shard(path_of(k), {}, 0, [], {} if bucketed else None)
    bar.close()
    seconds = time.perf_counter() - start
    print(f"cache {part} rank {rank}: encoded {encoded} images, skipped {skipped}, {len(todo)} shards in "
          f"{seconds:.1f} s ({encoded / max(seconds, 1e-9):.1f} images/s)", flush=True)
    for _ in range(rounds - done):
        agree()


def cached_split(cfg, part, ds, encode, accelerator, signals=None):
    """Split `part` ("train" or "val") of `ds` as a CachedDataset (build_cache, then the memory-mapped shards,
    read lazily)."""
    return CachedDataset(build_cache(ds, part, encode, accelerator, cfg, signals))


def build_cache(ds, part, encode, accelerator, cfg, signals=None):
    """The cache of split `part` of `ds`: its key -> folder (locate_cache), each rank checks its share of the
    shards; hit: nothing to do; miss: the missing or damaged shards are encoded with `encode` and written
    (write_cache). Returns its folder."""
    where = locate_cache(cfg, part, ds, accelerator)  # key -> folder: a hash of all that changes it
    todo = check_cache(where, cfg, accelerator)  # each rank checks its share of the shards
    if any(todo):  # miss: the missing or damaged shards are encoded and written (hit: nothing to do)
        write_cache(where, todo, encode, cfg, accelerator, signals)
    return where.folder

def locate_cache(cfg, part, ds, accelerator):
    """Where split `part` ("train" or "val") of `ds` is cached: a folder named by a hash of its key (everything
    that changes what the shards hold), announced as a check, a miss that names what changed, or a resumed build.
    Returns what check_cache and write_cache work on: the source shards, key, folder and manifest."""
    import datasets
    from types import SimpleNamespace

    data = cfg.data
    streamed = isinstance(ds, datasets.IterableDataset)
    shards = stream_shards(data, ds, part) if streamed else list(range(math.ceil(len(ds) / data.shard_size)))
    key = cache_key(cfg, part, ds, f"{len(shards)} source shards" if streamed else len(ds))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", data.source).strip("-")[-40:]
    folder = Path(data.cache_dir) / f"{slug}-{part}-{digest}"
    manifest, problem = read_json(folder / "manifest.json") if (folder / "manifest.json").exists() else (None, None)
    if problem or \
            (manifest is not None and not (isinstance(manifest, dict) and isinstance(manifest.get("sha256"), dict))):
        accelerator.print(f"warning: cache ({part}): {folder / 'manifest.json'} cannot be read "
                          f"({problem or 'no checksums'}); treating the folder as a miss: finished shards are "
                          "verified and reused, the rest encoded")
        manifest = None
    found = len(list(folder.glob("shard_*.safetensors")))
    if manifest is not None:
        accelerator.print(f"cache check ({part}): {folder}, {len(manifest['shards'])} shards")
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
    return SimpleNamespace(part=part, ds=ds, shards=shards, key=key, folder=folder, manifest=manifest, mine=[],
                           verified={}, views=views_of(data, part))


def file_stamp(path):
    """[size, modification time, change time] (ns) of a file: a write, truncation, replacement or copy changes it
    (the change time cannot be set from user space, so even a copy that keeps modification times does)."""
    stat = Path(path).stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def check_cache(cache, cfg, accelerator):
    """The cache check. The shard at position j of cache.shards is rank j % world's to check and, if missing or
    damaged, to write. Every shard is checked from its header (it opens, its tensors hold the rows it claims,
    its checksum is the manifest's), and its contents (checksum of the tensors, finite values) are verified
    only if its file changed since they last were (the manifest's stamp of it: size and times), so a start
    with an unchanged cache reads headers, not terabytes; data.verify_cache=false skips even that. Returns the
    shards to write, per rank (the same lists on every rank); all empty: a hit, and the manifest is final."""
    from accelerate.utils import gather_object

    data, rank, world = cfg.data, accelerator.process_index, accelerator.num_processes
    manifest = cache.manifest or {}
    expected, stamps = manifest.get("sha256", {}), manifest.get("verified", {})
    todo = []
    for k in [k for j, k in enumerate(cache.shards) if j % world == rank]:
        path = cache.folder / f"shard_{k:05d}.safetensors"
        if path.exists():
            stamp = file_stamp(path)
            unchanged = stamps.get(path.name) == stamp  # its contents were verified as they are now
            damage = shard_damage(path, data.verify_cache and not unchanged, expected.get(path.name))
            if damage is None:
                if unchanged or data.verify_cache:
                    cache.verified[path.name] = stamp
                continue  # finished before, and sound
            print(f"cache ({cache.part}): {path} is damaged ({damage}): rebuilding it", flush=True)
        todo.append(k)
    cache.mine = todo
    todo_by_rank = gather_object([todo]) if world > 1 else [todo]
    if not any(todo_by_rank):
        write_manifest(cache, 0, accelerator)
    return todo_by_rank


def write_cache(cache, todo_by_rank, encode, cfg, accelerator, signals=None):
    """Miss: decode the shards still to write in DataLoader workers (DecodedShards), encode them here with
    `encode(pixels, captions)` (see make_encode), write each atomically with the checksum of its tensors and
    verify it again from its file; a streamed source's shard k is cache shard k. `signals` (StopSignals): the
    ranks agree on a stop after each shard they write, so a stop signal ends the build after the shards in
    progress, exiting for a requeue; the next run resumes from the finished shards. Then the manifest."""
    data, part, folder = cfg.data, cache.part, cache.folder
    names = class_names(data, cache.ds) if data.label_captions else None
    text = "tokens" if part == "train" and not data.cache_text else "features"  # held-out rows keep features
    todo, missing = cache.mine, sorted(k for t in todo_by_rank for k in t)  # this rank's, everyone's

    def path_of(k):
        return folder / f"shard_{k:05d}.safetensors"

    views = views_of(data, part)  # rows per image: data.cache_views crops x 2 flips with data.random_flip
    rows = {k: n * views for k, n in samples_per_shard(cache.ds, missing, data.shard_size).items()}
    per_row, size = cache_size(encode, data, text, list(rows.values()))
    free = shutil.disk_usage(folder).free
    many = (f" ({data.cache_views} crop{'s' * (data.cache_views > 1)} x {2 if data.random_flip else 1} flip"
            f"{'s' * data.random_flip} per image)") if views > 1 else ""
    accelerator.print(f"cache ({part}): {len(missing)} of {len(cache.shards)} shards to write, about "
                      f"{sum(rows.values())} samples{many} x {per_row} bytes = {human_bytes(size)}; "
                      f"{human_bytes(free)} free on {data.cache_dir}")
    if size > free:
        raise SystemExit(f"data.cache_dir='{data.cache_dir}' has {human_bytes(free)} free, the {part} cache needs "
                         f"about {human_bytes(size)}: free space, choose another data.cache_dir, or shrink the "
                         f"cache (data.cache_text=false keeps token ids instead of text features)")
    write_shards(cache.ds, todo, path_of, encode, data, names, text, rows, accelerator, part, signals,
                 rounds=max(len(t) for t in todo_by_rank))
    for k in todo:  # verified once from the file as written: a shard is trusted only as it reads back
        if (damage := shard_damage(path_of(k), verify=True)) is not None:
            raise RuntimeError(f"cache ({part}): {path_of(k)} reads back damaged right after writing ({damage}): "
                               f"check the storage of data.cache_dir='{data.cache_dir}'")
        cache.verified[path_of(k).name] = file_stamp(path_of(k))
    write_manifest(cache, len(missing), accelerator)


def write_manifest(cache, built, accelerator):
    """The main process writes manifest.json (the shards, their checksums and skipped rows, and the stamps of the
    shards whose contents were verified) when anything changed, and says whether the cache was a hit."""
    from accelerate.utils import gather_object

    verified = gather_object([cache.verified]) if accelerator.num_processes > 1 else [cache.verified]
    folder, manifest = cache.folder, cache.manifest
    if accelerator.is_main_process:
        stamps = {name: stamp for part in verified for name, stamp in part.items()}
        shards = [f"shard_{k:05d}.safetensors" for k in cache.shards]
        if manifest is None or built or stamps != manifest.get("verified", {}):
            sums, skipped = {}, []
            for name in shards:
                with safe_open(str(folder / name), "pt") as f:
                    skipped += json.loads(f.metadata().get("skipped", "[]"))
                    sums[name] = f.metadata()["sha256"]
            if built and skipped:
                accelerator.print(f"cache ({cache.part}): skipped {len(skipped)} unusable images, first: "
                                  + "; ".join(skipped[:5]))
            tmp = folder / "manifest.tmp"
            tmp.write_text(json.dumps({"key": cache.key, "shards": shards, "sha256": sums, "skipped": skipped,
                                       "verified": stamps, "views": cache.views,
                                       **({"buckets": cache.key["buckets"]} if "buckets" in cache.key else {})},
                                      indent=1))
            os.replace(tmp, folder / "manifest.json")
        accelerator.print(f"cache {'hit' if not built else 'ready'} ({cache.part}): {folder}, {len(shards)} shards"
                          + (f", {built} (re)built" if built else ", all sound"))
    accelerator.wait_for_everyone()


def explain_miss(folder, key, part, accelerator):
    """Say why a new cache folder is a miss: the settings that changed against the newest folder of the same
    source and split (a finished one or an interrupted build)."""
    others = sorted(folder.parent.glob(f"{folder.name.rsplit('-', 1)[0]}-*/key.json"), key=lambda p: p.stat().st_mtime)
    old = read_json(others[-1])[0] if others else None
    if isinstance(old, dict):
        changed = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in key.items() if old.get(k) != v]
        accelerator.print(f"cache miss ({part}): vs {others[-1].parent.name}, changed {'; '.join(changed)}")


# ----------------------------------------------------------------------------------------------------------
# The data stage of a run, as both trainers take it.


def frozen_encoders(cfg, train_ds, val_ds, accelerator):
    """The frozen encoders on the device and what the run conditions on: `encode` (pixels, captions -> cached
    tensors), the VAE and text encoder, the empty prompt's encoding (the null condition of guidance), the
    validation grid's prompts or class names and their encoding, and the class ids kept with the model."""
    from types import SimpleNamespace

    data, device = cfg.data, accelerator.device
    vae, tokenizer, text_encoder = load_encoders(cfg.encoders, device)
    encode = make_encode(vae, tokenizer, text_encoder, cfg.encoders.max_tokens)
    out = SimpleNamespace(vae=vae, text_encoder=text_encoder, null_text=None, val_text=None,
                          encode=repa_targets.with_targets(encode, cfg, vae, device, accelerator.print),  # REPA's too
                          val_prompts=validation_prompts(cfg, train_ds, val_ds),  # what each grid cell shows
                          class_ids=read_class_ids(data, train_ds) if data.label_column else None)
    if text_encoder is not None:
        out.null_text = encode_text(tokenizer, text_encoder, [""], cfg.encoders.max_tokens)
        out.val_text = encode_text(tokenizer, text_encoder, out.val_prompts, cfg.encoders.max_tokens)
    return out


