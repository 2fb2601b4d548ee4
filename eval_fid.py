"""Sample a trained run at scale and score it: FID and KID (clean-fid), CLIP score, in one file.

    python eval_fid.py --run runs/flow_matching_demo --num_samples 1000              # demo, CPU, offline*
    accelerate launch eval_fid.py --run runs/in1k_256 --reference imagenet-1k --reference_split validation
    python eval_fid.py --run runs/cc12m_256 --prompts heldout --clip_model openai/clip-vit-large-patch14

  (* offline once the Inception file is local: --inception_weights PATH, see inception_path below.)

Pipeline: arguments -> model (exported EMA, or a checkpoint's EMA or raw weights, with the run's resolved
config) -> generation (sample i always uses the same seed, so the images do not depend on the process count;
lossless PNGs) -> reference statistics (computed once, cached in our own .npz keyed on source and
preprocessing) -> metrics (FID/KID with clean-fid's math and resizing, CLIP score) -> report (JSON + table).
`fid_during_training` is the same path with small N, in memory, for the trainers' validation.

Conventions: generated pixels in [-1, 1] become uint8 by round((x + 1) * 127.5) as in common.save_image_grid;
every feature extractor maps uint8 images (N, H, W, 3) to features (N, D); tests pass a tiny fixed conv net.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from PIL import Image
from tqdm.auto import tqdm

import common

# ----------------------------------------------------------------------------------------------------------
# Arguments. Every default is here. Reported numbers use --num_samples 50000 (the ADM / DiT protocol).


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--run", required=True, help="run folder (uses run/export) or an export folder")
    a("--checkpoint", default=None, help="score a checkpoint folder (or 'latest') instead of the export")
    a("--weights", default="ema", choices=["ema", "raw"], help="checkpoint weights; the export is always EMA")
    a("--out_dir", default=None, help="default: <run>/eval/<settings>")
    a("--num_samples", type=int, default=50_000)
    a("--batch_size", type=int, default=64, help="per process; stochastic samplers depend on it, noise does not")
    a("--seed", type=int, default=0)
    a("--sampler", default=None, help="default: the run's val.sampler")
    a("--steps", type=int, default=None, help="default: the run's val.steps")
    a("--guidance_scale", type=float, default=None, help="semantic guidance; default: the run's val.guidance_scale")
    a("--control_guidance_scale", type=float, default=None, help="reserved: control guidance (not yet in the trainers)")
    a("--prompts", default=None, help="text models: a captions file (one per line) or 'heldout' (default)")
    a("--reference", default=None, help="image folder, dataset (hub id, local path, 'embedded'), or "
      "cleanfid:NAME:RES:SPLIT for clean-fid's precomputed statistics; default: the run's data source")
    a("--reference_split", default="heldout", help="'heldout': the split the trainer validated on")
    a("--reference_resolution", type=int, default=None, help="default: the run's data.resolution")
    a("--reference_crop", default="center")
    a("--reference_image_column", default=None, help="default: the run's data.image_column")
    a("--reference_num", type=int, default=None, help="use only the first N reference images")
    a("--stats_cache", default="cache/fid_stats", help="folder of cached reference statistics (.npz)")
    a("--mode", default="clean", choices=["clean", "legacy_tensorflow"], help="clean-fid's resizing mode")
    a("--inception_weights", default=None, help="local inception-2015-12-05.pt (offline clusters)")
    a("--features", default="inception", help="'inception' (clean-fid's) or module:factory, a callable returning "
      "feature_fn(uint8 images (N, H, W, 3)) -> (N, D) features (e.g. DINOv2 for FD_DINOv2; tests: a tiny net)")
    a("--clip_model", default="openai/clip-vit-large-patch14", help="hub id or local path; 'none' to skip")
    a("--adm_npz", default=None, help="also write samples as uint8 NHWC 'arr_0' for the ADM evaluator")
    a("--generate_only", action="store_true", help="write the PNGs and stop (score later on any machine)")
    a("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    a("--report", default=None, help="default: <out_dir>/report.json")
    return p.parse_args(argv)


INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"
INCEPTION_FILE = "inception-2015-12-05.pt"
DEFAULT_INCEPTION_DIR = "./" if platform.system() == "Windows" else "/tmp"  # where clean-fid itself looks

# ----------------------------------------------------------------------------------------------------------
# Model: the exported EMA model, or a checkpoint's EMA or raw weights, and the run's own generate().


def method_of(cfg):
    """The trainer module whose sampler made this run: DDPM configs have objective.prediction, flow
    matching ones objective.time_sampling. Both expose generate(model, noise, cond, cfg, steps, guidance_scale,
    sampler)."""
    import importlib

    return importlib.import_module("train_ddpm" if "prediction" in cfg["objective"] else "train_flow_matching")


def load_model(run, checkpoint=None, weights="ema"):
    """(model, cfg, description). The shapes of a checkpoint's model come from its tensors, so no data or
    encoder is needed to rebuild it: channels from the patch projection, size from the positional grid."""
    from safetensors.torch import load_file

    run = Path(run)
    if checkpoint is None:
        export = run if (run / "transformer").is_dir() else run / "export"
        model, cfg = common.load_exported(export)
        return model, cfg, {"source": str(export), "weights": "ema (export)"}
    ckpt = common.find_checkpoint(run, checkpoint)
    if ckpt is None:
        raise FileNotFoundError(f"no finished checkpoint under {run}/checkpoints")
    state = torch.load(ckpt / "state.pt", weights_only=True)
    cfg = common.Config(state["config"])
    tensors = load_file(str(ckpt / f"{'ema' if weights == 'ema' else 'model'}.safetensors"))
    channels = tensors["transformer.pos_embed.proj.weight"].shape[1]
    size = math.isqrt(tensors["transformer.pos_embed.pos_embed"].shape[1]) * cfg["model"]["patch_size"]
    text_dims = None
    if "conditioner.null_tokens" in tensors:
        text_dims = (*tensors["conditioner.null_tokens"].shape, tensors["conditioner.null_pooled"].shape[0])
    num_classes = cfg["data"]["num_classes"] if cfg["data"]["label_column"] and not text_dims else 0
    model = common.build_denoiser(common.Config(cfg["model"]), channels, size, num_classes, text_dims)
    model.load_state_dict(tensors)
    return model.eval(), cfg, {"source": str(ckpt), "weights": weights, "step": state["step"]}


# ----------------------------------------------------------------------------------------------------------
# Generation. Work is cut into fixed batches of sample indices [b * B, (b + 1) * B), dealt to ranks round
# robin; sample i's noise comes from its own seed, and a stochastic sampler's RNG is seeded per batch, so
# the PNGs are the same with 1 or 64 processes (same device type, same batch size).


def seed_for(*path):
    """A 63-bit seed per (base seed, stream, index), from numpy's SeedSequence, so streams never overlap."""
    return int(np.random.SeedSequence(list(path)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def my_batches(num_samples, batch_size, rank, world):
    starts = range(0, num_samples, batch_size)
    return [list(range(s, min(s + batch_size, num_samples))) for s in starts][rank::world]


def to_uint8(x):
    """Pixels in [-1, 1] (N, 3, H, W) -> uint8 (N, H, W, 3), rounded as common.save_image_grid does."""
    return x.float().clamp(-1, 1).add(1).mul(127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()


def load_prompts(prompts, cfg):
    """Captions for a text model: a file (one caption per line) or 'heldout' (the held-out rows' captions)."""
    if prompts in (None, "heldout"):
        _, val = common.open_splits(common.Config({k: v for k, v in cfg["data"].items()}))
        return list(val[cfg["data"]["caption_column"]])
    lines = [line.strip() for line in Path(prompts).read_text().splitlines()]
    return [line for line in lines if line]


def make_condition(cfg, model, prompts, device):
    """cond(indices) -> the condition dict of those samples: class i % num_classes (balanced over
    classes), or prompt i % len(prompts), encoded with the run's own text encoder."""
    num_classes = model.conditioner.num_classes
    if prompts is None:
        return lambda idx: {"label": torch.tensor(idx, device=device) % num_classes,
                            "drop": torch.zeros(len(idx), dtype=torch.bool, device=device)}
    _, tokenizer, text_encoder = common.load_encoders(common.Config({**cfg["encoders"], "vae": None}), device)

    def cond(idx):
        out = common.encode_text(tokenizer, text_encoder, [prompts[i % len(prompts)] for i in idx],
                                 cfg["encoders"]["max_tokens"])
        return {"text_tokens": out["text_tokens"], "text_pooled": out["text_pooled"],
                "drop": torch.zeros(len(idx), dtype=torch.bool, device=device)}
    return cond


@torch.no_grad()
def sample_batch(model, cfg, generate, vae, cond, idx, seed, steps, guidance_scale, sampler, device,
                 control_guidance_scale=None):
    """uint8 images of samples `idx`. The control guidance scale has its place here; the trainers'
    generate() does not take one yet, so any value is refused rather than silently ignored."""
    if control_guidance_scale is not None:
        raise NotImplementedError("control_guidance_scale: the trainers' generate() has no control guidance yet")
    tc = model.transformer.config
    shape = (tc.in_channels, tc.sample_size, tc.sample_size)
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(seed_for(seed, 0, i)))
                         for i in idx]).to(device)
    torch.manual_seed(seed_for(seed, 1, idx[0]))  # for ancestral samplers' fresh noise, fixed per batch
    x = generate(model, noise, cond(idx), cfg, steps=steps, guidance_scale=guidance_scale, sampler=sampler)
    return to_uint8(common.decode(vae, x))


def png_path(folder, i):
    return Path(folder) / f"{i:06d}.png"


# ----------------------------------------------------------------------------------------------------------
# Features. clean-fid's Inception (the TF-ported torchscript network of StyleGAN2-ADA) and resizer; the
# file is looked for before anything is downloaded, so an offline node fails at once with instructions.


def inception_path(weights=None, timeout=20):
    if weights is not None:
        if not Path(weights).is_file():
            raise FileNotFoundError(f"--inception_weights {weights}: no such file. Download {INCEPTION_URL} on a "
                                    f"machine with network and copy it to {weights}")
        return Path(weights)
    path = Path(DEFAULT_INCEPTION_DIR) / INCEPTION_FILE
    if not path.is_file():
        try:  # a bounded download into clean-fid's own location, atomically (never a half file)
            with urllib.request.urlopen(INCEPTION_URL, timeout=timeout) as r:
                tmp = path.with_suffix(".part")
                tmp.write_bytes(r.read())
                os.replace(tmp, path)
        except OSError as e:
            raise FileNotFoundError(
                f"the Inception FID network is not available and could not be downloaded ({e}). On a machine "
                f"with network run\n    wget {INCEPTION_URL}\nthen copy the file to this machine and pass "
                f"--inception_weights /path/to/{INCEPTION_FILE} (or put it at {path}).") from None
    return path


def inception_features(mode="clean", weights=None, device="cpu", accelerator=None):
    """feature_fn(uint8 (N, H, W, 3)) -> float64 (N, 2048): clean-fid's resizer (PIL bicubic on float
    channels to 299 for 'clean'; the network's own TF-style resize for 'legacy_tensorflow') and its network."""
    from cleanfid.inception_torchscript import InceptionV3W
    from cleanfid.resize import build_resizer

    with accelerator.main_process_first() if accelerator else contextlib.nullcontext():  # one download
        path = inception_path(weights)
    with tempfile.TemporaryDirectory() as tmp:  # InceptionV3W loads <folder>/inception-2015-12-05.pt
        folder = path.parent
        if path.name != INCEPTION_FILE:
            folder = Path(tmp)
            (folder / INCEPTION_FILE).symlink_to(path.resolve())
        net = InceptionV3W(str(folder), download=False, resize_inside=mode == "legacy_tensorflow").to(device)
    resize = build_resizer(mode)

    @torch.no_grad()
    def feature_fn(images):
        x = np.stack([np.asarray(resize(img), dtype=np.float32) for img in images])
        return net(torch.from_numpy(x).permute(0, 3, 1, 2).to(device)).double().cpu().numpy()
    feature_fn.name, feature_fn.path = f"inception-2015-12-05/{mode}", str(path)
    return feature_fn


def gathered(pairs):
    """[(index, feature row)] from every rank -> features in index order, on every rank."""
    pairs = sorted(gather_object(pairs), key=lambda p: p[0])
    return np.stack([f for _, f in pairs])


# ----------------------------------------------------------------------------------------------------------
# Reference statistics: mu, sigma (FID) and the features themselves (KID), computed once and cached in
# <stats_cache>/<source>-<hash>.npz. The hash covers the source and all preprocessing: a change is a miss.


def reference_key(args, cfg, feature_name):
    data = cfg["data"]
    source = args.reference or data["source"]
    key = {"source": source, "feature": feature_name, "format": 1}
    if is_image_folder(source):
        files = _image_files(source)
        key["files"] = hashlib.sha256("\n".join(f"{f.name}:{f.stat().st_size}" for f in files).encode()).hexdigest()
        key["kind"] = "folder"
    else:
        key.update(kind="dataset", split=args.reference_split, crop=args.reference_crop,
                   resolution=args.reference_resolution or data["resolution"],
                   image_column=args.reference_image_column or data["image_column"])
        if args.reference_split == "heldout":  # what common.open_splits holds out
            key["heldout"] = [data["split"], data["val_split"], data["val_holdout"]]
        if source == "embedded":
            key["demo"] = [data["demo_samples"], data["demo_resolution"]]
    key["num"] = args.reference_num
    return key


def is_image_folder(source):
    """A plain folder of images (scored as the files are); a folder with metadata.jsonl or parquet files is
    a dataset, preprocessed as in training."""
    p = Path(source)
    return p.is_dir() and not any(p.glob("**/*.parquet")) and not any(p.glob("**/metadata.jsonl"))


def _image_files(folder):
    exts = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"}
    return sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in exts)


def reference_images(key, cfg):
    """A list of loaders, one per reference image, each returning uint8 (H, W, 3): a folder's files as
    they are (clean-fid's folder convention), or dataset rows preprocessed exactly as the trainer does."""
    if key["kind"] == "folder":
        items = [lambda f=f: np.asarray(Image.open(f).convert("RGB")) for f in _image_files(key["source"])]
    else:
        data = common.Config({**cfg["data"], "source": key["source"], "image_column": key["image_column"],
                              "label_column": None, "caption_column": None, "max_samples": None})
        ds = common.open_splits(data)[1] if key["split"] == "heldout" else common.open_dataset(data, key["split"])

        def load(i):
            x, _ = common.preprocess(common.load_image(ds[i][key["image_column"]]), key["resolution"], key["crop"])
            return to_uint8(x[None])[0]
        items = [lambda i=i: load(i) for i in range(len(ds))]
    return items[:key["num"]] if key["num"] else items


def reference_stats(key, cfg, feature_fn, accelerator, cache_dir, batch_size=64):
    """(stats dict with mu, sigma, feats, path, sha256). Ranks share the feature extraction."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key["source"]).strip("-")[-40:]
    path = Path(cache_dir) / f"{slug}-{digest}.npz"
    if not path.exists():
        accelerator.print(f"reference statistics: cache miss, computing {path}")
        items, rank, world = reference_images(key, cfg), accelerator.process_index, accelerator.num_processes
        pairs = []
        for idx in tqdm(my_batches(len(items), batch_size, rank, world), desc="reference features",
                        disable=not accelerator.is_local_main_process):
            pairs += zip(idx, feature_fn(np.stack([items[i]() for i in idx])))
        feats = gathered(pairs)
        if accelerator.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, mu=feats.mean(0), sigma=np.cov(feats, rowvar=False), feats=feats.astype(np.float32),
                     key=json.dumps(key, sort_keys=True))
            os.replace(tmp, path)
        accelerator.wait_for_everyone()
    else:
        accelerator.print(f"reference statistics: cache hit {path}")
    with np.load(path) as f:
        stats = {"mu": f["mu"], "sigma": f["sigma"], "feats": f["feats"]}
    return {**stats, "path": str(path), "key_sha256": digest, "sha256": file_sha256(path)}


def named_reference_stats(spec, mode, accelerator=None):
    """clean-fid's precomputed statistics, `cleanfid:NAME:RES:SPLIT` (e.g. cleanfid:cifar10:32:train).
    They are downloaded by clean-fid into its package folder, with a bounded wait."""
    import socket

    from cleanfid.features import get_reference_statistics

    _, name, res, split = spec.split(":")
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)  # clean-fid's urlopen has no timeout of its own
    try:
        with accelerator.main_process_first() if accelerator else contextlib.nullcontext():  # one download
            mu, sigma = get_reference_statistics(name, int(res), mode=mode, split=split)
            try:
                feats = get_reference_statistics(name, int(res), mode=mode, split=split, metric="KID")
            except OSError:
                feats = None  # not every named set has KID features
    finally:
        socket.setdefaulttimeout(old)
    return {"mu": mu, "sigma": sigma, "feats": feats, "path": spec, "key_sha256": None,
            "sha256": hashlib.sha256(mu.tobytes() + sigma.tobytes()).hexdigest()}


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Metrics. FID: ||mu1 - mu2||^2 + Tr(S1 + S2 - 2 sqrt(S1 S2)) (Heusel et al. 2017); KID: unbiased MMD^2
# with the cubic polynomial kernel (Binkowski et al. 2018); both computed by clean-fid (Parmar et al. 2022).


def size_tag(n):
    """50000 -> '50k', 1000 -> '1k', 500 -> '500', 1500 -> '1500' (only whole thousands get a 'k')."""
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def fid_kid(feats, ref, mode, n):
    from cleanfid.fid import frechet_distance, kernel_distance

    out = {f"fid_{mode}_{size_tag(n)}": float(frechet_distance(feats.mean(0), np.cov(feats, rowvar=False),
                                                                ref["mu"], ref["sigma"]))}
    if ref["feats"] is not None and min(len(feats), len(ref["feats"])) >= 2:
        np.random.seed(0)  # kernel_distance draws its subsets from numpy's global RNG
        out[f"kid_{mode}_{size_tag(n)}"] = float(kernel_distance(feats, ref["feats"]))
    return out


@torch.no_grad()
def clip_scores(model_id, images, captions, device):
    """CLIP score = 100 * max(cos(E_img, E_txt), 0) (Hessel et al. 2021, w = 100 as in torchmetrics), per
    image, with CLIP's own preprocessing (its image processor resizes and normalizes; text truncated to
    its context length). Averaged by the caller."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    if not hasattr(clip_scores, "cache") or clip_scores.cache[0] != model_id:
        clip_scores.cache = (model_id, CLIPModel.from_pretrained(model_id).to(device).eval(),
                             AutoTokenizer.from_pretrained(model_id), AutoImageProcessor.from_pretrained(model_id))
    _, clip, tokenizer, processor = clip_scores.cache
    pixels = processor(images=list(images), return_tensors="pt")["pixel_values"].to(device)
    text = tokenizer(list(captions), padding=True, truncation=True, return_tensors="pt",
                     max_length=clip.config.text_config.max_position_embeddings).to(device)
    out = clip(input_ids=text.input_ids, attention_mask=text.attention_mask, pixel_values=pixels)
    cos = (out.image_embeds * out.text_embeds).sum(-1)  # both are L2-normalised by CLIPModel
    return (100 * cos.clamp(min=0)).double().cpu().numpy()


# ----------------------------------------------------------------------------------------------------------
# In training: a small-N FID every M steps, in memory, no PNGs. Every rank must call it.


def fid_during_training(model, cfg, accelerator, num_samples, reference, *, vae=None, conditions=None,
                        feature_fn=None, mode="clean", inception_weights=None, stats_cache="cache/fid_stats",
                        steps=None, guidance_scale=None, sampler=None, batch_size=64, seed=0):
    """{'fid_clean_1k': .., 'kid_clean_1k': ..} for `model` (e.g. the EMA) sampled as `cfg` is configured.

    reference: a cached statistics .npz (ours), or a source understood by --reference (folder, dataset,
    'embedded', cleanfid:NAME:RES:SPLIT), or None for the run's own held-out split. conditions: None for
    balanced class labels, else a dict of per-sample tensors (e.g. the held-out cache's text_tokens and
    text_pooled) indexed by i % len. The same seeds as eval_fid.py, so numbers are comparable over steps."""
    device, generate = accelerator.device, method_of(cfg).generate
    feature_fn = feature_fn or inception_features(mode, inception_weights, device, accelerator)
    if conditions is None:
        cond = make_condition(cfg, model, None, device)
    else:
        n_cond = len(next(iter(conditions.values())))
        cond = lambda idx: {**{k: v[[i % n_cond for i in idx]].to(device) for k, v in conditions.items()},
                            "drop": torch.zeros(len(idx), dtype=torch.bool, device=device)}
    pairs = []
    was_training = model.training
    model.eval()
    for idx in my_batches(num_samples, batch_size, accelerator.process_index, accelerator.num_processes):
        with accelerator.autocast():
            images = sample_batch(model, cfg, generate, vae, cond, idx, seed, steps, guidance_scale, sampler, device)
        pairs += zip(idx, feature_fn(images))
    model.train(was_training)
    feats = gathered(pairs)
    if str(reference).endswith(".npz"):
        with np.load(reference) as f:
            ref = {"mu": f["mu"], "sigma": f["sigma"], "feats": f["feats"] if "feats" in f else None}
    elif str(reference).startswith("cleanfid:"):
        ref = named_reference_stats(reference, mode, accelerator)
    else:
        args = argparse.Namespace(reference=reference, reference_split="heldout", reference_resolution=None,
                                  reference_crop="center", reference_image_column=None, reference_num=None)
        key = reference_key(args, cfg, getattr(feature_fn, "name", "custom"))
        ref = reference_stats(key, cfg, feature_fn, accelerator, stats_cache, batch_size)
    return fid_kid(feats, ref, mode, num_samples)


# ----------------------------------------------------------------------------------------------------------


def main(argv=None, feature_fn=None):
    """Returns the report dict (None with --generate_only). `feature_fn` replaces Inception (tests)."""
    args = parse_args(argv)
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    t_start = time.time()

    # ---- Model and settings (None: as the run was configured) ---------------------------------------------
    model, cfg, model_desc = load_model(args.run, args.checkpoint, args.weights)
    model.to(device)
    generate = method_of(cfg).generate
    steps, sampler = args.steps or cfg["val"]["steps"], args.sampler or cfg["val"]["sampler"]
    guidance = cfg["val"]["guidance_scale"] if args.guidance_scale is None else args.guidance_scale
    is_text = bool(cfg["encoders"]["text_encoder"])
    weights = f"{Path(args.checkpoint).name}-{args.weights}" if args.checkpoint else "export-ema"
    tag = f"{weights}-{sampler}{steps}-g{guidance:g}-seed{args.seed}"
    out_dir = Path(args.out_dir or Path(args.run) / "eval" / tag)
    samples_dir = out_dir / "samples"
    if accelerator.is_main_process:
        samples_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()

    # ---- Generation: my batches of indices; batches already on disk are skipped (resume) -------------------
    prompts = load_prompts(args.prompts, cfg) if is_text else None
    vae = common.load_encoders(common.Config({"vae": cfg["encoders"]["vae"], "text_encoder": None}), device)[0]
    cond = make_condition(cfg, model, prompts, device)
    batches = my_batches(args.num_samples, args.batch_size, rank, world)
    for idx in tqdm(batches, desc=f"generate (rank {rank})", disable=not accelerator.is_local_main_process):
        if all(png_path(samples_dir, i).exists() for i in idx):
            continue
        with accelerator.autocast():
            images = sample_batch(model, cfg, generate, vae, cond, idx, args.seed, steps, guidance, sampler,
                                  device, args.control_guidance_scale)
        for i, img in zip(idx, images):  # PNG is lossless; written atomically, so a resumed run trusts it
            tmp = png_path(samples_dir, i).with_suffix(".tmp")
            Image.fromarray(img).save(tmp, format="PNG")
            os.replace(tmp, png_path(samples_dir, i))
    accelerator.wait_for_everyone()
    del model, vae
    if args.generate_only:
        accelerator.print(f"{args.num_samples} samples in {samples_dir}")
        return None

    # ---- Features of the samples, and the reference statistics -------------------------------------------
    if feature_fn is None and args.features != "inception":
        import importlib

        module, factory = args.features.split(":")
        feature_fn = getattr(importlib.import_module(module), factory)()
    feature_fn = feature_fn or inception_features(args.mode, args.inception_weights, device, accelerator)
    feature_name = getattr(feature_fn, "name", "custom")
    pairs, clip_pairs = [], []
    for idx in tqdm(batches, desc="features", disable=not accelerator.is_local_main_process):
        images = np.stack([np.asarray(Image.open(png_path(samples_dir, i)).convert("RGB")) for i in idx])
        pairs += zip(idx, feature_fn(images))
        if is_text and args.clip_model != "none":
            clip_pairs += zip(idx, clip_scores(args.clip_model, images, [prompts[i % len(prompts)] for i in idx],
                                               device))
    feats = gathered(pairs)
    if args.reference and args.reference.startswith("cleanfid:"):
        key, ref = {"source": args.reference}, named_reference_stats(args.reference, args.mode, accelerator)
    else:
        key = reference_key(args, cfg, feature_name)
        ref = reference_stats(key, cfg, feature_fn, accelerator, args.stats_cache, args.batch_size)

    # ---- Metrics and report -------------------------------------------------------------------------------
    metrics = fid_kid(feats, ref, args.mode, args.num_samples)
    if is_text and args.clip_model != "none":  # a collective: every rank gathers, even with no batches
        metrics[f"clip_score_{size_tag(args.num_samples)}"] = float(gathered(clip_pairs).mean())
    if args.adm_npz and accelerator.is_main_process:  # what ADM's evaluator.py reads (Dhariwal & Nichol 2021)
        arr = np.stack([np.asarray(Image.open(png_path(samples_dir, i)).convert("RGB"))
                        for i in range(args.num_samples)])
        np.savez(args.adm_npz, arr_0=arr)
    report = None
    if accelerator.is_main_process:
        import importlib.metadata as md

        report = {
            "metrics": metrics,
            "model": {"run": str(args.run), **model_desc, "method": method_of(cfg).__name__},
            "num_samples": args.num_samples, "sampler": sampler, "steps": steps, "guidance_scale": guidance,
            "control_guidance_scale": args.control_guidance_scale,
            "seeds": {"seed": args.seed, "batch_size": args.batch_size,
                      "rule": "noise of sample i: torch.Generator seeded with seed_for(seed, 0, i); stochastic "
                              "sampler RNG of the batch starting at i: torch.manual_seed(seed_for(seed, 1, i))"},
            "conditioning": ({"prompts": args.prompts or "heldout", "num_prompts": len(prompts),
                              "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest()}
                             if is_text else {"labels": "i % num_classes", "num_classes": cfg["data"]["num_classes"]}),
            "clip_model": args.clip_model if is_text else None,
            "reference": {**key, "stats": ref["path"], "key_sha256": ref["key_sha256"], "stats_sha256": ref["sha256"]},
            "mode": args.mode, "feature_extractor": feature_name,
            "feature_weights": getattr(feature_fn, "path", None),
            "feature_weights_sha256": file_sha256(feature_fn.path) if hasattr(feature_fn, "path") else None,
            "samples_dir": str(samples_dir), "adm_npz": args.adm_npz, "num_processes": world,
            "mixed_precision": args.mixed_precision, "config": cfg,
            "versions": {"python": platform.python_version(), **{p: md.version(p) for p in (
                "torch", "diffusers", "transformers", "accelerate", "clean-fid", "numpy", "scipy", "pillow")}},
            "command": " ".join([Path(sys.argv[0]).name] + list(sys.argv[1:] if argv is None else argv)),
            "seconds": round(time.time() - t_start, 1),
        }
        path = Path(args.report or out_dir / "report.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))
        rows = {**metrics, "model": f"{model_desc['source']} ({model_desc['weights']})", "N": args.num_samples,
                "sampler": f"{sampler}, {steps} steps", "guidance": guidance, "reference": key["source"],
                "mode": args.mode, "report": str(path)}
        width = max(map(len, rows))
        print("\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                        for k, v in rows.items()))
    accelerator.wait_for_everyone()
    return report


if __name__ == "__main__":
    main()
