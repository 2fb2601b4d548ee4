"""Sampling a trained run, as eval_fid.py, sample.py and the tools do, and the small-N FID of the trainers' validation:
the model read back (the export, a checkpoint's EMA or raw weights, a post-hoc EMA), a batch of samples by their
indices (sample_batch: training/evaluation/generation.py says what sample i is), the PNGs eval_fid.py writes, and
fid_during_training (val.fid_every), the same path at small N, in memory.

The method's own sampler is passed in: `generate(model, noise, cond, cfg, steps, guidance_scale, sampler, ...)` of
the run's trainer. A trainer passes its own; a command that samples a finished run picks the run's trainer by its
config (training/record/curves.method_of). This package never imports a command.
"""
import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import common
from training.config import config
from training.data.encoders import decode
from training.model import lora
from training.model.mmdit import build_denoiser, load_exported
from training.run import checkpoints, hub
from training.run.monitor import progress
from training.run.phema import apply_reconstruction
from training.evaluation.generation import make_condition, make_controls, noise_shape, seed_for
from training.evaluation.metrics import all_scores, check_dino_reference, dino_scores, dinov2_features, feature_tag
from training.evaluation.reference import inception_features, reference_args, reference_for, to_uint8

# ----------------------------------------------------------------------------------------------------------
# Model: the exported EMA model, or a checkpoint's EMA or raw weights, with the run's resolved config.


def load_model(run, checkpoint=None, weights="ema", phema_std=None):
    """(model, cfg, description). A checkpoint's shapes come from its tensors (channels from the patch
    projection, side from the positional grid), so rebuilding it needs neither data nor encoders. phema_std:
    the export's model with the post-hoc EMA of that std reconstructed from the run's snapshots (with a checkpoint:
    at the checkpoint's step, from the snapshots before it and its own profiles, so the label is true)."""
    run = hub.local_folder(run)  # a folder, or the hub id of an exported pipeline folder
    if phema_std is not None:
        model, cfg, desc = load_model(run, checkpoint, weights)
        info = apply_reconstruction(model, run, phema_std, None if checkpoint is None else desc["source"])
        return model, cfg, {**desc, "weights": f"post-hoc EMA, std {phema_std:g}", "phema": info}
    if checkpoint is None:
        export = run if (run / "transformer").is_dir() else run / "export"
        model, cfg = load_exported(export)
        return model, cfg, {"source": str(export), "weights": "ema (export)"}
    ckpt = checkpoints.find_checkpoint(run, checkpoint)
    if ckpt is None:
        raise FileNotFoundError(f"no finished checkpoint under {run}/checkpoints")
    state = checkpoints.read_state(ckpt)  # the small part, on the CPU (never the optimizer)
    cfg = config.Config(state["config"])
    lora.refuse_adapter_checkpoint(state, ckpt, "a checkpoint's model")  # LoRA: the export holds base and adapters
    tensors = checkpoints.read_tensors(ckpt, "ema" if weights == "ema" else "model")  # (sharded: gathered whole)
    channels = tensors["transformer.pos_embed.proj.weight"].shape[1]
    size = math.isqrt(tensors["transformer.pos_embed.pos_embed"].shape[1]) * cfg["model"]["patch_size"]
    text_dims = None
    if "conditioner.null_tokens" in tensors:
        text_dims = (*tensors["conditioner.null_tokens"].shape, tensors["conditioner.null_pooled"].shape[0])
    model = build_denoiser(cfg, channels, size, text_dims)
    model.load_state_dict(tensors)
    return model.eval(), cfg, {"source": str(ckpt), "weights": weights, "step": state["step"]}


def run_class_ids(run, checkpoint):
    """The class ids a run saved with its model (export/class_ids.json, or a checkpoint's state), or None: what
    sample.py and tools/rate.py name the classes by."""
    if checkpoint is None:
        run = hub.local_folder(run)  # a folder, or the hub id of an exported pipeline folder
        export = run if (run / "transformer").is_dir() else run / "export"
        path = export / "class_ids.json"
        return json.loads(path.read_text()) if path.is_file() else None
    ckpt = checkpoints.find_checkpoint(run, checkpoint)
    return checkpoints.read_state(ckpt).get("class_ids") if ckpt else None  # on the CPU, never the optimizer


def interval_arg(text):
    """--guidance_interval 'lo,hi' -> [lo, hi], checked as val.guidance_interval is (eval_fid.py, sample.py, tools)."""
    try:
        value = [float(v) for v in text.split(",")]
    except ValueError:
        value = text
    if not (isinstance(value, list) and len(value) == 2 and 0 <= value[0] <= value[1] <= 1):
        raise argparse.ArgumentTypeError(f"--guidance_interval={text!r} must be 'lo,hi' with 0 <= lo <= hi <= 1 "
                                         f"(noise levels: flow-matching t, 1 = pure noise; '0,1' guides every step)")
    return value


# ----------------------------------------------------------------------------------------------------------
# Generation. Work is cut into fixed batches of sample indices [b B, (b + 1) B), dealt to ranks round robin.
# Sample i's noise has its own seed (generation.py: what sample i is) and a stochastic sampler's RNG is seeded per
# batch, so the PNGs are the same with 1 or 64 processes (on the same kind of device, with the same batch size).


@torch.no_grad()
def sample_batch(generate, model, cfg, cond, idx, seed, steps=None, guidance_scale=None, sampler=None, vae=None,
                 control_guidance_scale=None, guidance_interval=None, shape=None):
    """uint8 images of samples `idx` by the method's `generate` (`shape`: width, height in pixels; None: the run's
    square); the caller's RNG state is left as it was."""
    device = next(model.parameters()).device
    size = noise_shape(cfg, model.transformer, shape)
    noise = torch.stack([torch.randn(size, generator=torch.Generator().manual_seed(seed_for(seed, 0, i))) for i in idx])
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed_for(seed, 1, idx[0]))  # ancestral samplers' fresh noise, fixed per batch
        x = generate(model, noise.to(device), cond(idx), cfg, steps=steps, sampler=sampler,
                     guidance_scale=guidance_scale, control_guidance_scale=control_guidance_scale,
                     guidance_interval=guidance_interval)
    return to_uint8(decode(vae, x))


def png_path(folder, i):
    return Path(folder) / f"{i:06d}.png"


def read_png(folder, i):
    return np.asarray(Image.open(png_path(folder, i)).convert("RGB"))


# ----------------------------------------------------------------------------------------------------------
# In training: a small-N FID every M steps, in memory (no PNGs), on all ranks.


def fid_of_run(generate, ema, cfg, accelerator, val_set, vae=None, text=False, log=None, step=None):
    """Small-N FID/KID during training (val.fid_every): fid_during_training with the run's settings and the
    trainer's `generate`; text runs take their conditions from the held-out cache's caption features. Every rank
    takes part. With `log` (a runlog.RunLog), the metrics are logged at `step` and printed."""
    val, n = cfg["val"], min(cfg["val"]["fid_samples"], len(val_set))
    conditions = None if not text else {
        k: torch.stack([val_set[i][k] for i in range(n)]) for k in ("text_tokens", "text_mask", "text_pooled")}
    if vae is not None:
        vae.to(accelerator.device)
    metrics = fid_during_training(generate, ema, cfg, accelerator, val["fid_samples"], val["fid_reference"], vae=vae,
                                  conditions=conditions, inception_weights=val["inception_weights"],
                                  dino=val.get("fid_dino"),
                                  stats_cache=str(Path(cfg["data"]["cache_dir"]) / "fid_stats"),
                                  batch_size=cfg["train"]["batch_size"])
    if vae is not None:
        vae.cpu()
    if log is not None:
        log({"step": step, **metrics})
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    return metrics


def fid_during_training(generate, model, cfg, accelerator, num_samples, reference=None, *, vae=None, conditions=None,
                        feature_fn=None, mode="clean", inception_weights=None, stats_cache="cache/fid_stats",
                        steps=None, guidance_scale=None, control_guidance_scale=None, sampler=None, batch_size=64,
                        seed=0, dino=None):
    """{'fid_clean_1k': .., 'kid_clean_1k': .., 'precision_inception_1k': .., ..} of `model` (unwrapped, e.g. the
    EMA) sampled by `generate` as `cfg` says; with `dino` (a DINOv2 model id or folder) also 'fd_dinov2_1k' and its kin.

    reference: one of our statistics .npz files, a --reference source (folder, dataset, 'embedded',
    cleanfid:NAME:RES:SPLIT), or None for the run's own held-out rows. vae: on the device, for latent runs.
    conditions: None for balanced class labels (and held-out controls), else a dict of per-sample tensors
    named as in batching.COND_FIELDS (e.g. the held-out cache's rows), sample i taking row i % len; text runs
    must pass it. Same seeds as eval_fid.py's, so the numbers of successive calls are comparable."""
    device = accelerator.device
    feature_fn = feature_fn or inception_features(mode, inception_weights, device, accelerator)
    if dino:
        check_dino_reference(reference or "")
    dino_fn, dino_pairs = dinov2_features(dino, device, accelerator) if dino else None, []
    if conditions is None and cfg["encoders"]["text_encoder"]:
        raise ValueError("fid_during_training: a text run needs conditions (e.g. the held-out cache's text rows)")
    if conditions is None:
        cond = make_condition(cfg, model, None, device, make_controls(cfg, "heldout"))
    else:
        rows = len(next(iter(conditions.values())))
        cond = lambda idx: {**{k: v[[i % rows for i in idx]].to(device) for k, v in conditions.items()},  # noqa
                            "drop": torch.zeros(len(idx), dtype=torch.bool, device=device)}
    pairs, was_training = [], model.training
    model.eval()
    batches = common.my_batches(num_samples, batch_size, accelerator.process_index, accelerator.num_processes)
    for idx in progress(batches, "FID samples", accelerator.is_local_main_process):
        with accelerator.autocast():
            images = sample_batch(generate, model, cfg, cond, idx, seed, steps, guidance_scale, sampler, vae,
                                  control_guidance_scale)
        pairs += zip(idx, feature_fn(list(images)))
        if dino_fn is not None:
            dino_pairs += zip(idx, dino_fn(list(images)))
    model.train(was_training)
    args = reference_args(["--mode", mode, "--stats_cache", stats_cache, "--batch_size", str(batch_size),
                           *(["--reference", str(reference)] if reference else [])])
    ref = reference_for(args, cfg, feature_fn, accelerator)[1]
    out = all_scores(common.gathered(pairs), ref, mode, num_samples, feature_tag(feature_fn), device)
    if dino_fn is not None:
        out.update(dino_scores(common.gathered(dino_pairs), reference_for(args, cfg, dino_fn, accelerator)[1],
                               num_samples, device))
    return out
