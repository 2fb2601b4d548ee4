"""Flow-matching training of an MMDiT (SD3Transformer2DModel), in one file you can read top to bottom.

    python train_flow_matching.py                                        # embedded demo, CPU, offline
    accelerate launch train_flow_matching.py --config configs/cc12m.json # paper-scale recipe
    python train_flow_matching.py --config my.json --train.lr=3e-4 --resume latest

Conventions (tests/test_flow_matching.py checks each):
  * t in [0, 1]; t = 0 is data, t = 1 is noise. x_t = (1 - t) x0 + t eps: the straight (optimal-transport)
    conditional path of rectified flow (Liu et al. 2022) and flow matching (Lipman et al. 2023).
  * The model predicts the velocity v = dx_t/dt = eps - x0. Sampling integrates dx/dt = v from t = 1 to 0.
    This is diffusers' FlowMatchEulerDiscreteScheduler and SD3's convention (Esser et al. 2024).
  * The MMDiT sees time as timestep = 1000 t, the float range diffusers' SD3 transformer expects.
  * Pixels are in [-1, 1]; latents are (z - shift) * scale with the VAE's own factors.

Pipeline: config -> accelerator and seeds -> data (open, cache check, hit/miss, batches) -> model, EMA,
init_from (another run's weights) -> optimizer -> resume -> loop (forward, loss, accumulation, optimizer step,
metrics, gradient analysis, loss spikes) -> validation (samples, loss on a fixed time grid) -> checkpoints
-> export -> report.
"""
import json
import sys
from contextlib import nullcontext

import torch
from accelerate.utils import set_seed

import common
from training import config
import eval_fid
from training import runlog
from training.cache import prepare_data
from training.data import (COND_FIELDS, decode, drop_conditions, heldout_batches, iterate_batches, loader_options,
                  open_splits, text_features, validation_inputs)
from training.model import export, guided, prepare_model
from training.monitor import Monitor
from training import fit

# ----------------------------------------------------------------------------------------------------------
# Config. Every default is here; a recipe (configs/*.json) names only what it changes.

DEFAULTS = {
    "run_dir": None,                 # None: runs/flow_matching_{config name}, runs/flow_matching_demo without one
    "seed": 0,
    "resume": None,                  # "latest" (this run_dir's newest checkpoint) or a checkpoint folder
    "init_from": None,               # another run's folder, checkpoint or export: its weights and EMA start this
                                     # new run (256 -> 512 px, 22k -> 1k); "{method}" in it: this trainer's name
    "data": {
        "source": "embedded",        # "embedded" (generated demo), a hub id, an imagefolder or parquet path, or
                                     # webdataset tar shards "/data/cc12m/{00000..01242}.tar" (streamed)
        "streaming": False,          # stream a hub dataset's shards instead of downloading and converting it
        "split": "train",
        "val_split": None,           # a held-out split of the source; None: hold out val_holdout train rows
        "val_holdout": None,         # held-out rows drawn from split; None: 10% of the rows, at most 256
        "val_shards": None,          # streamed: source shards [first, stop) held out ([-1, null]: the last one);
                                     # the held-out rows are their first val_holdout samples
        "image_column": "image",
        "label_column": "label",     # None for text-only data
        "caption_column": None,      # e.g. "caption" for text-to-image (needs encoders.text_encoder)
        "num_classes": None,         # None: read from the label column's class names (ClassLabel, folders)
        "class_ids": None,           # WordNet ids of the labels, for init_from's class mapping: None = the label
                                     # column's ClassLabel names; "imagenet-1k" / "imagenet-22k"; or a file
        "label_captions": False,     # text-to-image on class data: the caption is the class name (22k -> CC12M)
        "resolution": 16,
        "crop": "center",            # "center", "random" or "random_resized"; drawn once, when the cache is built
        "min_crop_scale": 0.5,       # random_resized: crop side >= this x the short side
        "random_flip": False,        # horizontal flip with probability 1/2 (recorded as the flip control)
        "min_image_side": 8,         # smaller images are reported and skipped when the cache is built
        "max_samples": None,         # use only the first N training rows
        "demo_samples": 4864,        # size and side of the embedded demo set
        "demo_resolution": 16,
        "cache_dir": "cache",
        "cache_dtype": "float16",
        "cache_text": True,          # cache text features; False: token ids only, encoded at each step (lean)
        "shard_size": 1024,          # rows per cache shard (part of the cache key)
        "verify_cache": True,        # check every cached value (checksum, finite) at start, split over processes;
                                     # False: headers only (for caches too large to read at each start)
        "encode_batch_size": 64,
        "num_workers": 0,
        "prefetch_factor": 2,
    },
    "encoders": {
        "vae": None,                 # AutoencoderKL hub id or path (e.g. "stabilityai/sd-vae-ft-ema"); None: pixels
        "text_encoder": None,        # transformers text encoder id or path (CLIP or T5); None: class labels
        "max_tokens": 77,
    },
    "model": {                       # SD3Transformer2DModel; width = heads x head_dim
        "patch_size": 2,
        "num_layers": 4,
        "num_attention_heads": 4,
        "attention_head_dim": 32,
        "class_tokens": 1,           # context tokens per class label
        "qk_norm": None,             # "rms_norm" for large models
        "pos_embed_transfer": "resample",  # init_from at another token grid: "resample" the positions the
                                     # model saw (the paper's) or "extend" them (diffusers' default)
    },
    "conditioning": {                # semantic (class / text) vs control (size, crop, flip) conditioning
        "mode": "disentangled",      # semantics through attention, controls through the adaptive norm with
                                     # weight w(t) (the paper's); "adanorm": both summed into the adaptive
                                     # norm (the DiT / SDXL baseline)
        "controls": [],              # any of "size", "crop", "flip"
        "control_power": {"size": 1.0, "crop": 1.0, "flip": 1.0},  # w(t) = cos(pi t / 2)^p, per control
        "semantic_dropout": 0.1,     # dropped independently, for guidance on each
        "control_dropout": 0.1,
        "replicate_padding": True,   # text: noisy replicate padding instead of pad embeddings
        "padding_noise": 0.02,       # its noise std, relative to the RMS of the real token features
    },
    "objective": {
        "time_sampling": "logit_normal",  # or "uniform"
        "logit_mean": 0.0,           # t = sigmoid(m + s n), n ~ N(0, 1) (SD3's rf/lognorm(0.00, 1.00))
        "logit_std": 1.0,
        "time_shift": 1.0,           # a in t' = a t / (1 + (a - 1) t)
        "shift_base_resolution": None,  # if set, a = data.resolution / this (overrides time_shift)
        "ot_coupling": False,        # minibatch OT pairing of noise and data (Tong et al. 2023)
        "loss_bins": 5,              # loss is also logged per time bin [k/K, (k+1)/K)
    },
    "train": {
        "max_steps": 600,            # optimizer steps
        "batch_size": 64,            # per device and micro-batch; global = batch x processes x grad_accum; "auto"
                                     # (with global_batch): the largest that fits, probed at start (performance.md)
        "global_batch": None,        # images per optimizer step; set: grad_accum = global / (batch x processes)
        "grad_accum": 1,             # micro-batches per step; the recipes use 2 to fit an 80 GB A100 (performance.md)
        "lr": 1e-3,                  # the paper: 1e-4 at batch 2048; the tiny demo model likes more
        "lr_schedule": "constant",   # after warm-up: "constant" (the paper's), "cosine" or "linear" decay to 0
        "lr_scaling": "none",        # "sqrt" or "linear": lr x (global batch / lr_reference_batch)^(1/2 or 1)
        "lr_reference_batch": 2048,  # the global batch that train.lr was tuned for
        "betas": [0.9, 0.999],
        "weight_decay": 0.0,
        "warmup_steps": 50,
        "grad_clip": 1.0,
        "max_nonfinite_steps": 20,   # a NaN/inf loss or gradient skips the step; this many in a row stop the run
        "mixed_precision": "no",     # "no", "fp16" or "bf16" (autocast; master weights and EMA stay fp32); the
                                     # recipes: bf16, tensor-core speed with fp32's range, so no loss scaling
        "ema_decay": 0.999,
        "ema_device": "same",        # "cpu": the fp32 EMA in pinned CPU memory, 4 bytes per parameter off the GPU
        "ema_every": 1,              # update the EMA every k steps, the k decays compounded (training/fit.py)
        "gradient_checkpointing": False,  # recompute activations in backward: far less memory for ~1/3 more FLOPs;
                                     # off in the recipes, where grad_accum fits the batch at no FLOP cost
        "compile": False,            # torch.compile the model: fused kernels, faster steps after a minute or two
                                     # of compiling (docs/performance.md); on in the paper recipes
    },
    "val": {
        "every": 200,                # and at the last step
        "num_samples": 36,           # grid size: classes in order, or the first held-out captions
        "sampler": "euler",          # "euler" or "heun"
        "steps": 32,
        "guidance_scale": 3.0,       # semantic guidance scale (1: none)
        "control_guidance_scale": 0.0,  # control guidance scale (0: none; standard CFG)
        "loss_samples": 256,         # held-out samples for the validation loss, at t = (k + 0.5) / loss_bins
        "prompts": None,             # text runs: a file of validation prompts, one per line; None: held-out captions
        "fid_every": 0,              # small-N FID/KID through eval_fid.py every this many steps (0: off)
        "fid_samples": 1000,
        "fid_reference": None,       # None: the held-out split; else any eval_fid.py --reference
        "inception_weights": None,   # a local inception-2015-12-05.pt (offline clusters)
    },
    "log": {
        "every": 10,                 # loss, LR, clipping, throughput, memory (averaged over these steps)
        "grad_every": 50,            # gradient norm and update / weight ratio per layer group (0: off)
        "grad_flag_ratio": 100.0,    # flag a group whose gradient norm is this far below / above the median group's
        "spike_threshold": 6.0,      # a loss spike: this many running standard deviations above the running mean
        "report": True,              # report.md and PNG plots in run_dir at the end (python -m training.report RUN_DIR)
        "wandb": "auto",             # auto (online with WANDB_API_KEY, else offline), online, offline, off
        "project": "minimal-diffusion",
    },
    "ckpt": {"every": 500, "keep": 3},
}

# This method's keys, checked at start-up with the shared ones (config.RULES: a range, or the allowed values).
RULES = {"objective.time_sampling": ("logit_normal", "uniform"), "objective.logit_mean": float,
         "objective.logit_std": "> 0", "objective.ot_coupling": bool, "val.sampler": ("euler", "heun")}

# ----------------------------------------------------------------------------------------------------------
# The objective: straight path, velocity target, logit-normal time, resolution shift, optional OT coupling.


def sample_time(n, obj, shift, device):
    """t ~ logit-normal(m, s) (SD3, Esser et al. 2024, sec. 3.1: more weight on middle times, where the
    velocity is hardest to predict) or uniform, then shifted toward noise for larger images."""
    if obj.time_sampling == "logit_normal":
        t = torch.sigmoid(obj.logit_mean + obj.logit_std * torch.randn(n, device=device))
    elif obj.time_sampling == "uniform":
        t = torch.rand(n, device=device)
    else:
        raise ValueError(f"objective.time_sampling must be 'logit_normal' or 'uniform', got {obj.time_sampling!r}")
    return common.time_shift(t, shift)


def ot_pair(x0, noise, labels=None):
    """Minibatch OT coupling (Tong et al. 2023; Pooladian et al. 2023): re-pair the batch's noise with its
    data by an exact assignment on squared distance, which straightens the paths the model must learn.
    It re-pairs within each class when labels are given: across classes it would tie a class to the noise
    regions nearest its images, which is meant for unconditional or within-class pairing only."""
    from scipy.optimize import linear_sum_assignment

    noise = noise.clone()
    groups = [torch.arange(len(x0))] if labels is None else [torch.nonzero(labels == c).flatten()
                                                              for c in labels.unique()]
    for idx in groups:
        cost = torch.cdist(x0[idx].flatten(1).float(), noise[idx].flatten(1).float()).pow(2)
        rows, cols = linear_sum_assignment(cost.cpu().numpy())
        noise[idx[rows]] = noise[idx[cols]]
    return noise


def flow_matching_loss(model, x0, cond, t, noise):
    """Per-sample MSE between the predicted and true velocity on the straight path (CFM, Lipman et al.
    2023, eq. 22-23 with sigma_min = 0):  x_t = (1 - t) x0 + t eps,  target v = eps - x0."""
    t_ = t.view(-1, *([1] * (x0.dim() - 1)))
    x_t = (1 - t_) * x0 + t_ * noise
    v = model(x_t, t * 1000, cond)
    return (v.float() - (noise - x0).float()).pow(2).mean(dim=tuple(range(1, x0.dim())))


# ----------------------------------------------------------------------------------------------------------
# The sampler: Euler or Heun on dx/dt = v from t = 1 to t = 0, with classifier-free guidance.


@torch.no_grad()
def sample(model, noise, cond, steps, shift=1.0, guidance_scale=1.0, control_guidance_scale=0.0, method="euler"):
    """The grid is t_i = shift(1 - i / steps), the same shift as training (it equals diffusers'
    FlowMatchEulerDiscreteScheduler with `sigmas=linspace(1, 0, steps + 1)[:-1]` and `shift`). Guidance on
    the semantic and the control condition (model.guided): with control_guidance_scale = 0 it is
    classifier-free guidance, v = v(x, null) + w (v(x, c) - v(x, null)) (Ho & Salimans 2022)."""
    if method not in ("euler", "heun"):
        raise ValueError(f"val.sampler must be 'euler' or 'heun', got {method!r}")
    ts = common.time_shift(torch.linspace(1, 0, steps + 1, device=noise.device), shift)

    def velocity(x, t):
        return guided(model, x, (t * 1000).expand(len(x)), cond, guidance_scale, control_guidance_scale)

    x = noise.float()
    for t, t_next in zip(ts[:-1], ts[1:]):
        v = velocity(x, t)
        if method == "heun" and t_next > 0:  # Heun's 2nd order: average the slopes at both ends
            v = (v + velocity(x + (t_next - t) * v, t_next)) / 2
        x = x + (t_next - t) * v
    return x


def generate(model, noise, cond, cfg, steps=None, guidance_scale=None, sampler=None, control_guidance_scale=None):
    """Sample as the run `cfg` is configured (its time shift, val sampler and guidance), with optional
    overrides. The one entry point that validation, eval_fid.py and the benchmarks call."""
    val = cfg["val"]
    return sample(model, noise, cond, steps or val["steps"], common.shift_of(cfg),
                  val["guidance_scale"] if guidance_scale is None else guidance_scale,
                  val["control_guidance_scale"] if control_guidance_scale is None else control_guidance_scale,
                  sampler or val["sampler"])


# ----------------------------------------------------------------------------------------------------------


def main(argv=None):
    signals = common.StopSignals()  # first: from here on a stop signal ends the run with exit code 75
    # Every config problem is reported here, all at once, before any work (config.RULES and this method's RULES).
    cfg = config.load_config(DEFAULTS, argv, method="flow_matching", rules=RULES)
    data, obj, tr = cfg.data, cfg.objective, cfg.train

    # ---- Accelerator and seeds ----------------------------------------------------------------------------
    accelerator = common.make_accelerator(tr.mixed_precision)  # also on CPU-only machines, TF32 on
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    set_seed(cfg.seed + rank)  # different noise and times on each rank
    shift = common.shift_of(cfg)

    # ---- Data: open -> cache check -> hit: load / miss: encode and write -> batches -----------------------
    train_ds, val_ds = open_splits(data, accelerator.print)  # labels checked; unset data.num_classes read
    run_dir = runlog.start_run(cfg, accelerator)  # writes the resolved config.json
    d = prepare_data(cfg, train_ds, val_ds, accelerator, signals)  # cached sets, encoders, null and grid prompts
    train_set, val_set, vae, text_encoder = d.train_set, d.val_set, d.vae, d.text_encoder

    # ---- Model, EMA, optimizer ----------------------------------------------------------------------------
    x_shape = val_set[0]["x"].shape  # (channels, size, size) in model space
    # fp32 EMA; the checkpoint to resume, else another run's weights when init_from names one
    model, ema, ckpt = prepare_model(cfg, x_shape, d.null_text, d.class_ids, run_dir, accelerator)
    optimizer = common.make_optimizer(model, tr)  # fused AdamW; weight_decay 0 = Adam, as in the paper
    ema_update = fit.EMAUpdater(ema, model, optimizer, tr, device)  # on the GPU, or in pinned CPU memory
    # train.global_batch: the micro-batch ("auto": probed, or a resumed run's), accumulation and checkpointing
    fit.plan_batch(cfg, accelerator, model, optimizer, train_set, text_encoder, ckpt)
    model, optimizer = accelerator.prepare(model, optimizer)
    base_lr, lr_rule = common.scaled_lr(tr, tr.batch_size * world * tr.grad_accum)
    forward = torch.compile(model) if tr.compile else model
    raw_model = accelerator.unwrap_model(model)
    accelerator.print(f"model: {sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters; "
                      f"global batch {tr.batch_size} x {world} processes x {tr.grad_accum} accumulation = "
                      f"{tr.batch_size * world * tr.grad_accum}; {lr_rule}; time shift a = {shift:g}")
    for warning in config.size_warnings(cfg, sum(p.numel() for p in raw_model.parameters()), len(train_set), world):
        accelerator.print(f"warning: {warning}")  # a model far larger than its data

    # ---- Resume: same run, continues step, data position, optimizer, EMA, RNG and statistics ---------------
    state = common.load_checkpoint(ckpt, raw_model, ema, optimizer, accelerator) if ckpt else {"step": 0}
    step = state["step"]
    log = runlog.RunLog(cfg, run_dir, accelerator, step)  # metrics.jsonl (rows past `step` set aside), wandb
    monitor = Monitor(cfg, raw_model, accelerator, log, state)  # progress bar, or plain lines in a log file

    # ---- Validation: EMA samples with fixed noise and conditions, and a held-out loss on a fixed t grid ------
    val_noise, val_cond = validation_inputs(val_set, len(d.val_prompts), data.num_classes, x_shape, cfg.seed,
                                            device, d.val_text)

    @ema_update.on_device  # an offloaded EMA visits the GPU
    @torch.no_grad()
    @torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])  # draws nothing from training's RNG
    def validate(step):                                                        # (padding noise): exact resume
        ema.eval()
        path = log.samples(decode(vae, generate(ema, val_noise, val_cond, cfg), device), step, d.val_prompts)
        # Validation loss: every held-out sample at every t_k = (k + 0.5) / K, with fixed noise.
        losses, n = torch.zeros(obj.loss_bins), min(cfg.val.loss_samples, len(val_set))
        for x0, noise, cond in heldout_batches(val_set, n, tr.batch_size, cfg.seed + 1, device):
            for k in range(obj.loss_bins):
                t = torch.full((len(x0),), (k + 0.5) / obj.loss_bins, device=device)
                with accelerator.autocast():
                    losses[k] += flow_matching_loss(ema, x0, cond, t, noise).sum().cpu()
        losses /= n
        log({"step": step, "val_loss": losses.mean().item(), **{f"val_loss_t{k}": v.item() for k, v in enumerate(losses)}})
        accelerator.print(f"step {step}: val_loss {losses.mean().item():.4f}, samples in {path}")

    def checkpoint(step):
        state = {"step": step, "optimizer": optimizer.state_dict(), "config": json.loads(json.dumps(cfg)),
                 "class_ids": d.class_ids, **monitor.state_dict()}
        tensors = {"model": raw_model.state_dict(), "ema": ema.state_dict()}
        common.save_checkpoint(accelerator, run_dir, step, tensors, state, cfg.ckpt.keep)

    @ema_update.on_device
    def fid(step):  # every rank samples its share
        eval_fid.fid_of_run(ema, cfg, accelerator, val_set, vae, d.null_text is not None, log, step)

    # ---- Training loop --------------------------------------------------------------------------------------
    batches = iterate_batches(train_set, step * tr.grad_accum, tr.batch_size, cfg.seed, rank, world,
                              loader_options(data, device))
    model.train()
    while step < tr.max_steps:
        lr = common.lr_at(step, base_lr, tr.warmup_steps, tr.lr_schedule, tr.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(tr.grad_accum):
            batch = text_features(monitor.next_batch(batches, device), text_encoder)  # cache_text=false: encode
            x0 = batch["x"] + batch["x_std"] * torch.randn_like(batch["x"]) if "x_std" in batch else batch["x"]
            cond = {k: v for k, v in batch.items() if k in COND_FIELDS}
            # Semantic and control conditions are dropped independently, for guidance on each.
            cond["drop"] = drop_conditions(len(x0), cfg.conditioning.semantic_dropout, device)
            cond["drop_controls"] = drop_conditions(len(x0), cfg.conditioning.control_dropout, device)
            noise = torch.randn_like(x0)
            if obj.ot_coupling:
                noise = ot_pair(x0, noise, batch.get("label"))
            t = sample_time(len(x0), obj, shift, device)
            # Gradients are all-reduced only on the last micro-batch; the others accumulate locally.
            with accelerator.no_sync(model) if micro < tr.grad_accum - 1 else nullcontext():
                loss = flow_matching_loss(forward, x0, cond, t, noise)
                accelerator.backward(loss.mean() / tr.grad_accum)
            monitor.micro_batch(loss, (t * obj.loss_bins).long().clamp(max=obj.loss_bins - 1))
        # Everything below happens once per real optimizer step, never per micro-batch.
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), tr.grad_clip)
        # A non-finite loss or gradient skips the update (weights, EMA and optimizer state untouched), decided on
        # the device so the host never waits for it. The norm is of the all-reduced gradients, so every rank
        # decides the same. The step still counts: the data position and the LR stay pure functions of it.
        finite = torch.isfinite(grad_norm)
        monitor.before_update(step, grad_norm, finite)
        common.step_unless_nonfinite(optimizer, finite, tr.mixed_precision == "fp16")
        optimizer.zero_grad(set_to_none=True)
        ema_update(step, applied=finite)  # every train.ema_every steps, on the GPU or the CPU
        monitor.after_update(step, grad_norm, finite, accelerator.optimizer_step_was_skipped)
        step += 1

        # Up to here nothing waits for the device. The host syncs at log steps (one all-reduce of the interval's
        # statistics, the skipped-step check, the preemption check), validation, FID and checkpoints.
        stop = False
        if common.due(step, cfg.log.every, tr.max_steps):
            monitor.log_interval(step, lr)
            stop = signals.agreed(accelerator)  # a signal stops the run within log.every - 1 steps
        if common.due(step, cfg.val.every, tr.max_steps):  # (pauses are not counted as training throughput)
            monitor.pause(validate, step, "validation", main_only=True)
        if common.due(step, cfg.val.fid_every, tr.max_steps):
            monitor.pause(fid, step, f"FID ({cfg.val.fid_samples} samples)")
        if common.due(step, cfg.ckpt.every, tr.max_steps) or stop:
            monitor.pause(checkpoint, step)
        if stop:
            common.exit_for_requeue(accelerator, step)
    monitor.close()

    # ---- Export: the fp32 EMA weights, loadable with SD3Transformer2DModel.from_pretrained ------------------
    if accelerator.is_main_process:
        accelerator.print(f"exported EMA model to {export(ema, cfg, run_dir, d.class_ids)}")
    signals.exit_if_agreed(accelerator, "the export, which is complete (the requeued run writes the report)")
    log.finish(cfg, accelerator)  # report.md and plots, wandb
    return run_dir


if __name__ == "__main__":
    try:
        main()
    except config.ConfigError as e:  # one clear message, not a traceback
        sys.exit(str(e))
