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
  * objective.meanflow (MeanFlow, training/objectives/meanflow.py): the model predicts the average velocity over
    [r, t], the interval 1000 (t - r) its second time input; at r = t that is the velocity, and the loss flow
    matching's.
  * Pixels are in [-1, 1]; latents are (z - shift) * scale with the VAE's own factors.

Pipeline: config -> accelerator and seeds -> data (open, cache check, hit/miss, batches) -> model, EMA,
init_from (another run's weights) -> optimizer -> resume -> loop (forward, loss, accumulation, optimizer step,
metrics, gradient analysis, loss spikes) -> validation (samples, loss on a fixed time grid) -> checkpoints
-> export -> report.
"""
import math
import sys
from typing import Literal

import torch
from accelerate.utils import set_seed
from pydantic import BaseModel, Field

import common
from training.config import config
from training.data import batching, buckets, cache, digits, emoji, encoders, latents, sd3_base, sources
from training.model import lora, mmdit
from training.objectives import contrastive, meanflow, repa, xprediction
from training.optimisation import muon, optimizers
from training.run import checkpoints, fit, hub, sharding, stability, start
from training.run.monitor import Monitor
from training.run.phema import PowerEMA
from training.evaluation import sampling, validation
from training.record import runlog
from training.sharing import pipeline_export

# ----------------------------------------------------------------------------------------------------------
# Config. The shared sections (data, encoders, model, conditioning, train, val, log, ckpt) are typed once in
# training/config/sections.py; this method adds its objective section and its sampler key, and changes a few defaults.
# A recipe (configs/*.json) names only what it changes; --help lists every key, its type, default and use.


class Objective(BaseModel, extra="forbid", strict=True):
    """straight path, velocity target, logit-normal time, resolution shift, optional OT coupling"""
    time_sampling: Literal["logit_normal", "uniform", "adaptive"] = Field(
        "logit_normal", description="t ~ logit-normal, uniform, or adaptive: following the loss")
    adaptive_base: Literal["logit_normal", "uniform"] = Field("logit_normal", description="adaptive: the base density")
    adaptive_bins: int = Field(16, ge=2, description="adaptive: bins of equal base mass")
    adaptive_mix: float = Field(0.25, gt=0, le=1, description="adaptive: the base density's share (weights <= 1 / mix)")
    logit_mean: float = Field(0.0, description="m in t = sigmoid(m + s n), n ~ N(0, 1) (SD3: m = 0, s = 1)")
    logit_std: float = Field(1.0, gt=0, description="s in t = sigmoid(m + s n)")
    time_shift: float = Field(1.0, gt=0, description="a in t' = a t / (1 + (a - 1) t)")
    shift_base_resolution: int | None = Field(None, ge=1, description="if set, a = data.resolution / this")
    ot_coupling: bool = Field(False, description="minibatch OT pairing of noise and data (Tong et al. 2023)")
    loss_bins: int = Field(5, ge=1, description="the loss is also logged per time bin [k/K, (k+1)/K)")
    prediction: Literal["v", "x0"] = Field("v", description="what the network outputs: the velocity, or x0 (JiT; "
                                           "the loss stays on the velocity: training/objectives/xprediction.py)")
    contrastive_weight: float = Field(0.0, ge=0, lt=1, description="contrastive flow matching's lambda (DeltaFM: "
                                      "0.05; training/objectives/contrastive.py); 0: off")
    # MeanFlow (Geng et al. 2025; training/objectives/meanflow.py): the defaults are the paper's and its code's
    meanflow: bool = Field(False, description="MeanFlow: the network predicts the average velocity over [r, t], for "
                           "sampling in 1-2 steps (val.sampler='meanflow')")
    meanflow_equal_share: float = Field(0.75, ge=0, le=1, description="MeanFlow: the share of samples with r = t "
                                        "(the paper: 0.75, i.e. 25% r != t, its ablation's best)")
    meanflow_logit_mean: float = Field(-0.4, description="MeanFlow: t, r the larger and smaller of two draws of "
                                       "sigmoid(m + s n) (the paper: lognorm(-0.4, 1.0))")
    meanflow_logit_std: float = Field(1.0, gt=0, description="MeanFlow: s of those draws")
    meanflow_weight_power: float = Field(1.0, ge=0, description="MeanFlow: p of the adaptive loss weight "
                                         "1 / (|error|^2 + c)^p (the paper: 1; 0: plain squared error)")
    meanflow_guidance: float = Field(2.0, ge=1, description="MeanFlow: the guidance scale folded into the target, "
                                     "so one evaluation is guided (the paper's code: 2, as omega 1, kappa 0.5); "
                                     "1: none")
    meanflow_guidance_mix: float = Field(0.5, ge=0, lt=1, description="MeanFlow: kappa, the target's share of the "
                                         "model's own conditional velocity (the paper's code: 0.5); 0: none")
    # fine-tuning a flow-matching model (init_from) into a few-step one: FACM's anchor, Decoupled MeanFlow's placement
    meanflow_anchor: float = Field(0.0, ge=0, le=1, description="MeanFlow: the share of each batch that keeps flow "
                                   "matching's plain loss at r = t (FACM's flow-matching anchor); 0: none (the "
                                   "paper's), 1: flow matching's loss")
    meanflow_interval_blocks: int | None = Field(None, ge=1, description="MeanFlow: the interval t - r enters only "
                                                 "the last K blocks (Decoupled MeanFlow: the last third); null: "
                                                 "every block (the paper's)")


class Sampler(BaseModel, extra="forbid", strict=True):  # this method's keys in the val section
    sampler: Literal["euler", "heun", "meanflow"] = Field(
        "euler", description="Euler, Heun's 2nd order (2 evaluations a step), or MeanFlow's z_r = z_t - (t - r) "
        "u(z_t, r, t)")


# The whole typed config: the shared sections with these two, and the start-up checks of the options this trainer
# runs, each in its own module (every problem reported at once, before any work); MeanFlow's sampling defaults.
CONFIG = config.schema(Objective, Sampler, checks=(encoders.problems, sharding.problems, repa.problems, hub.problems,
                                                   muon.problems, lora.problems, sd3_base.problems,
                                                   contrastive.problems, meanflow.problems, emoji.problems,
                                                   digits.problems),
                       resolvers=(meanflow.sampling_defaults,))  # MeanFlow: its own sampler, steps and guidance
# The defaults changed here: 32 sampling steps, and the demo's budget and guidance, chosen by
# benchmarks/demo_quality.py (docs/benchmarks/demo_quality.md): a cosine decay of a higher LR over 1000 steps
# and guidance 7 draw the asked-for shape in >= 0.9 of samples, in under 5 min on 2 CPU cores. The recipes set
# their own lr, steps and guidance, and pin the paper's constant LR.
DEFAULTS = config.defaults(CONFIG, {"val.steps": 32, "train.max_steps": 1000, "train.lr": 2e-3,
                                    "train.lr_schedule": "cosine", "val.guidance_scale": 7.0})

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


def draw_times(n, obj, shift, device, density=None):
    """A batch's times and loss weights (t, r, split, weight): t from sample_time, or from the adaptive density
    (objective.time_sampling="adaptive", training/optimisation/time_density.py) with its importance weights, and
    r = t; with objective.meanflow, MeanFlow's t >= r, two logit-normal draws, the first `anchored` flow matching's
    own (objective.meanflow_anchor), r = t for the first `equal` (objective.meanflow_equal_share; training/objectives/
    meanflow.py), weight 1. The split (anchored, equal) is MeanFlow's; flow matching's is (0, n)."""
    if obj.meanflow:
        return (*meanflow.sample_times(n, obj, shift, device, lambda k: sample_time(k, obj, shift, device)), 1.0)
    t, weight = density.draw(n) if density else (sample_time(n, obj, shift, device), 1.0)
    return t, t, (0, n), weight


def time_quantile(u, obj, shift):
    """The base density's inverse CDF t = F^-1(u) (objective.adaptive_base; u ~ U[0, 1) gives sample_time's
    density), shifted: what the adaptive time density (training/optimisation/time_density.py) maps its draws through.
    Logit-normal: F^-1(u) = sigmoid(m + s Phi^-1(u)), Phi^-1(u) = sqrt(2) erfinv(2u - 1)."""
    if obj.adaptive_base == "logit_normal":
        u = torch.sigmoid(obj.logit_mean + obj.logit_std * math.sqrt(2) * torch.erfinv(2 * u - 1))
    return common.time_shift(u, shift)


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


def flow_matching_loss(model, x0, cond, t, noise, prediction="v"):
    """Per-sample MSE between the predicted and true velocity on the straight path (CFM, Lipman et al.
    2023, eq. 22-23 with sigma_min = 0):  x_t = (1 - t) x0 + t eps,  target v = eps - x0. The validation loss;
    training adds the options' terms (training_loss)."""
    return training_loss(model, x0, cond, t, noise, prediction)[0]


def training_loss(model, x0, cond, t, noise, prediction="v", contrastive_weight=0.0, align=None):
    """(flow_matching_loss, {name: per-sample term}): the terms the options add to what is trained, each logged
    on its own: contrastive flow matching's (training/objectives/contrastive.py) and REPA's alignment
    (training/objectives/repa.py; `align`: its targets and weight, or None). With prediction "x0" the network
    outputs the clean image and the loss stays on the velocity it implies (training/objectives/xprediction.py)."""
    t_ = t.view(-1, *([1] * (x0.dim() - 1)))
    x_t = (1 - t_) * x0 + t_ * noise
    out, tokens = repa.forward(model, align, x_t, t * 1000, cond)
    if prediction == "x0":
        v_hat, v = xprediction.velocity(out.float(), x_t, t_), xprediction.velocity(x0.float(), x_t, t_)
    else:
        v_hat, v = out.float(), (noise - x0).float()
    terms = repa.terms(tokens, align)
    if contrastive_weight:
        terms["contrastive"] = contrastive.term(v_hat, v, contrastive_weight)
    return (v_hat - v).pow(2).mean(dim=tuple(range(1, x0.dim()))), terms


# ----------------------------------------------------------------------------------------------------------
# The sampler: Euler or Heun on dx/dt = v from t = 1 to t = 0, with classifier-free guidance; or MeanFlow's steps.


@torch.no_grad()
def sample(model, noise, cond, steps, shift=1.0, guidance_scale=1.0, control_guidance_scale=0.0, method="euler",
           guidance_interval=(0.0, 1.0), prediction="v"):
    """The grid is t_i = shift(1 - i / steps), the same shift as training (it equals diffusers'
    FlowMatchEulerDiscreteScheduler with `sigmas=linspace(1, 0, steps + 1)[:-1]` and `shift`). Guidance on
    the semantic and the control condition (mmdit.guided): with control_guidance_scale = 0 it is
    classifier-free guidance, v = v(x, null) + w (v(x, c) - v(x, null)) (Ho & Salimans 2022), applied only
    on steps whose t_i lies in guidance_interval [lo, hi] (Kynkaanniemi et al. 2024; both Heun evaluations of
    a step, as their sampler); the other steps take the conditional velocity alone, one network pass.
    prediction "x0": the network's clean-image estimate becomes the velocity it implies
    (training/objectives/xprediction.py; guidance is linear, so guiding the estimates is guiding the velocities).
    method "meanflow" (training/objectives/meanflow.py): the model's average velocity over the step, z_r = z_t -
    (t - r) u(z_t, r, t), the interval t - r its second time; a model trained without it has no such input and
    takes Euler's steps."""
    if method not in ("euler", "heun", "meanflow"):
        raise ValueError(f"val.sampler must be 'euler', 'heun' or 'meanflow', got {method!r}")
    ts = common.time_shift(torch.linspace(1, 0, steps + 1, device=noise.device), shift)
    lo, hi = guidance_interval

    def velocity(x, t, guide, gap=None):  # gap: MeanFlow's t - r (None: r = t, the velocity at t)
        c = cond if gap is None else {**cond, "interval": (gap * 1000).expand(len(x))}
        out = mmdit.guided(model, x, (t * 1000).expand(len(x)), c, guidance_scale if guide else 1.0,
                           control_guidance_scale if guide else 0.0)
        return xprediction.velocity(out, x, t) if prediction == "x0" else out

    x = noise.float()
    for t, t_next, level in zip(ts[:-1], ts[1:], ts.tolist()):  # level: t_i on the host, no sync per step
        v = velocity(x, t, lo <= level <= hi, t - t_next if method == "meanflow" else None)
        if method == "heun" and t_next > 0:  # Heun's 2nd order: average the slopes at both ends
            v = (v + velocity(x + (t_next - t) * v, t_next, lo <= level <= hi)) / 2
        x = x + (t_next - t) * v
    return x


def generate(model, noise, cond, cfg, steps=None, guidance_scale=None, sampler=None, control_guidance_scale=None,
             guidance_interval=None):
    """Sample as the run `cfg` is configured (its time shift, val sampler, guidance and its interval), with
    optional overrides. The one entry point that validation, eval_fid.py and the benchmarks call."""
    val = cfg["val"]
    return sample(model, noise, cond, steps or val["steps"], common.shift_of(cfg),
                  val["guidance_scale"] if guidance_scale is None else guidance_scale,
                  val["control_guidance_scale"] if control_guidance_scale is None else control_guidance_scale,
                  sampler or val["sampler"], guidance_interval or val.get("guidance_interval", (0.0, 1.0)),
                  cfg["objective"].get("prediction", "v"))  # .get: configs saved before the key


# ----------------------------------------------------------------------------------------------------------


def main(argv=None):
    signals = common.StopSignals()  # first: from here on a stop signal ends the run with exit code 75
    cfg = config.load_config(DEFAULTS, argv, method="flow_matching", schema=CONFIG)  # all problems at once, before work
    runlog.refuse_earlier_run(cfg)  # a run_dir that holds a run continues only with --resume
    checkpoints.keep_recorded(cfg, skip=fit.resolved_keys(cfg.train))  # --resume: the values the run started with
    if done := runlog.finished_run(cfg):  # --resume of a run trained to train.max_steps and exported: says so
        return done
    data, obj, tr = cfg.data, cfg.objective, cfg.train

    # ---- Accelerator and seeds ----------------------------------------------------------------------------
    accelerator = common.make_accelerator(tr.mixed_precision, tr.timeout_minutes)  # CPU-only too; TF32
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    set_seed(cfg.seed + rank)  # different noise and times on each rank
    shift = common.shift_of(cfg)

    # ---- Data: open -> cache check -> hit: load / miss: encode and write -> batches -----------------------
    train_ds, val_ds = sources.open_splits(data, accelerator.print)  # labels checked; unset data.num_classes read
    buckets.resolve(cfg, train_ds, accelerator, val_ds)  # data.buckets: each image's bucket, small ones merged, tables
    run_dir = runlog.start_run(cfg, accelerator)  # writes the resolved config.json
    cache.check_cache_shared(data.cache_dir, accelerator)  # every rank must see the same cache folder
    d = cache.frozen_encoders(cfg, train_ds, val_ds, accelerator)  # encode; null and grid prompts; class ids
    train_set, val_set = (cache.cached_split(cfg, part, ds, d.encode, accelerator, signals)  # key, check, hit/miss
                          for part, ds in (("train", train_ds), ("val", val_ds)))  # memory-mapped, read lazily
    latents.check_scale(train_set, d.vae, cfg.encoders, accelerator.print)  # mean ~0, std ~1 or stop naming the factors
    encoders.place_encoders(d.vae, d.text_encoder, device, encode_each_step=not data.cache_text)  # off GPU till needed

    # ---- Model, EMA, optimizer ----------------------------------------------------------------------------
    x_shape = val_set.x_shape  # (channels, size, size) in model space: the positional grid's (buckets: the largest)
    # fp32 EMA; the checkpoint to resume, else another run's weights when init_from names one
    model, ema, ckpt = start.prepare_model(cfg, x_shape, d.null_text, d.class_ids, run_dir, accelerator)
    model, ema = sharding.shard(model, ema, cfg, accelerator)  # rank 0's weights everywhere; fsdp: block by block
    optimizer = optimizers.make_optimizer(model, tr)  # fused AdamW (weight_decay 0: Adam, the paper's), or Muon + AdamW
    ema_update = fit.EMAUpdater(ema, model, optimizer, tr, device)  # on the GPU, or in pinned CPU memory
    # post-hoc EMA profiles (ckpt.phema_every; 0: off) on the main process, allocated before the batch probe
    phema = PowerEMA.of_run(model.to(device), cfg, world, run_dir, accelerator.is_main_process)
    # train.global_batch: the micro-batch ("auto": probed, or a resumed run's), accumulation and checkpointing
    align = repa.Alignment(cfg, device)  # REPA's targets and weight per step (off: None); its encoder on the device
    fit.plan_batch(cfg, accelerator, model, optimizer, train_set, d.text_encoder, ckpt, align,
                   meanflow.probe_loss(obj) if obj.meanflow else None)  # MeanFlow: its JVP in the probe's step
    model, optimizer = sharding.prepare(model, optimizer, accelerator, tr)  # compiled (train.compile), DDP; or sharded
    lr_scale, lr_rule = common.lr_scale(tr, tr.batch_size * world * tr.grad_accum)  # the batch rule's factor
    raw_model = accelerator.unwrap_model(model)
    runlog.describe_run(accelerator, cfg, raw_model, train_set, lr_rule, f"time shift a = {shift:g}")

    # ---- Resume: same run, continues step, data position, optimizer, EMA, RNG and statistics ---------------
    def load(ckpt):  # at resume and on a rollback: weights, EMA, optimizer, RNG, then the post-hoc EMA profiles
        return checkpoints.load_run(ckpt, raw_model, ema, optimizer, accelerator, phema)

    state = load(ckpt) if ckpt else {"step": 0}
    step = state["step"]
    log = runlog.RunLog(cfg, run_dir, accelerator, step)  # metrics.jsonl (rows past `step` set aside), wandb
    monitor = Monitor(cfg, raw_model, accelerator, log, state)  # progress bar, or plain lines in a log file
    # the stability parts, each by name: time density, clip, noise scale, validation slopes, rollback
    stab = stability.Parts(cfg, accelerator, model, log, state, lambda u: time_quantile(u, obj, shift))

    # ---- Validation: EMA samples with fixed noise and conditions, and a held-out loss on a fixed t grid ------
    val_noise, val_cond = validation.validation_inputs(val_set, len(d.val_prompts), data.num_classes, x_shape,
                                                       cfg.seed, device, d.val_text)

    @ema_update.on_device  # the whole EMA on the device: an offloaded one visits the GPU, a sharded one is gathered
    @torch.no_grad()
    @torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])  # draws nothing from training's RNG
    def validate(step, ema):                                                   # (padding noise): exact resume
        ema.eval()  # the grid split over the ranks, gathered: a one-process run's
        x, nfe = validation.sample_grid(generate, ema, val_noise, val_cond, cfg, accelerator)
        path = accelerator.is_main_process and log.samples(encoders.decode(d.vae, x, device), step, d.val_prompts)
        # Validation loss: every held-out sample at every t_k = (k + 0.5) / K, with fixed noise.
        losses = validation.heldout_loss(val_set, cfg, accelerator, lambda x0, cond, noise, k: flow_matching_loss(
            ema, x0, cond, torch.full((len(x0),), (k + 0.5) / obj.loss_bins, device=device), noise, obj.prediction))
        stab.slopes.record(step, losses.tolist())  # the slope of each bin's validation loss: still falling, or flat
        validation.report(log, step, losses, nfe, path, accelerator)

    def checkpoint(step):  # the weights, EMA, optimizer, RNG and post-hoc EMA profiles; the monitor's, stab's state
        checkpoints.save_run(accelerator, step, cfg, raw_model, ema, optimizer, phema, d.class_ids, monitor, stab)

    @ema_update.on_device
    def fid(step, ema):  # every rank samples its share
        sampling.fid_of_run(generate, ema, cfg, accelerator, val_set, d.vae, d.null_text is not None, log, step)

    # ---- Training loop --------------------------------------------------------------------------------------
    def batches_from(step):  # on the device, wait timed; after a rollback without the window it skipped
        return monitor.batches(batching.iterate_batches(train_set, stab.rollback.data_position(step), tr.batch_size,
                                                        cfg.seed, rank, world, batching.loader_options(data, device)),
                               device)

    batches = batches_from(step)
    density = stab.density  # objective.time_sampling="adaptive": times and weights that follow the loss; else None
    model.train()
    while step < tr.max_steps:
        factor = stab.rollback.lr_factor * common.lr_at(step, lr_scale, tr.warmup_steps, tr.lr_schedule, tr.max_steps)
        lr = fit.set_lr(optimizer, tr, factor)  # train.lr (Muon's group: muon_lr) x factor; a rollback lowers it
        for micro in range(tr.grad_accum):
            # x0 and its conditions, the semantic and control ones dropped independently, for guidance on each
            batch, x0, cond = batching.training_inputs(next(batches), d.text_encoder, cfg.conditioning, accelerator)
            noise = torch.randn_like(x0)
            noise = ot_pair(x0, noise, batch.get("label")) if obj.ot_coupling else noise  # straighter paths
            t, r, split, weight = draw_times(len(x0), obj, shift, device, density)  # MeanFlow: r <= t, the anchor
            # Gradients are all-reduced (sharded: reduce-scattered) only on the last micro-batch; the others accumulate
            with sharding.no_sync(model, accelerator, skip=micro < tr.grad_accum - 1):  # locally
                with accelerator.autocast():  # train.mixed_precision: bf16 matmuls; the loss itself in fp32
                    if obj.meanflow:  # |u(z_t, r, t) - sg(v - (t - r) du/dt)|^2, du/dt by a JVP along (v, 0, 1)
                        loss, terms = meanflow.training_loss(model, raw_model, x0, cond, t, r, split, noise, obj,
                                                             align(batch, step))  # v guided; the adaptive weight
                    else:
                        loss, terms = training_loss(model, x0, cond, t, noise, obj.prediction, obj.contrastive_weight,
                                                    align(batch, step))  # terms: the options' own (REPA, contrastive)
                accelerator.backward((weight * (loss + sum(terms.values()))).mean() / tr.grad_accum)  # the step's mean
            if density:
                density.observe(loss)  # the per-bin loss it follows
            stab.noise_scale.micro_batch(micro)  # on its steps: the small batch's gradient norm
            monitor.micro_batch(loss, (t * obj.loss_bins).long().clamp(max=obj.loss_bins - 1), weight, terms,
                                meanflow.parts(t, r, split, obj) if obj.meanflow else None)  # r = t, r < t, anchor
        # Everything below happens once per real optimizer step, never per micro-batch.
        grad_norm = stab.clip(model.parameters())  # to train.grad_clip, or a percentile of recent norms
        stab.noise_scale.measure(grad_norm)  # every log.grad_every steps: the gradient noise scale
        # A non-finite loss or gradient skips the update (weights, EMA and optimizer state untouched), decided on
        # the device so the host never waits for it. The norm is of the all-reduced gradients, so every rank
        # decides the same. The step still counts: the data position and the LR stay pure functions of it.
        finite = torch.isfinite(grad_norm)
        optimizers.skip_update_if_nonfinite(optimizer, finite, tr.mixed_precision == "fp16")
        optimizer.step()
        monitor.optimizer_step(grad_norm, finite, stab.clip.threshold)  # on analysis steps it reads the gradients
        optimizer.zero_grad(set_to_none=False)  # in place: the gradients stay views of DDP's buckets, one copy
        ema_update(step, applied=finite)  # every train.ema_every steps, on the GPU or in pinned CPU memory
        phema.update(raw_model)  # post-hoc EMA profiles, on the device (ckpt.phema_every; off: nothing)
        step += 1

        # Up to here nothing waits for the device. The host syncs at log steps (one all-reduce of the interval's
        # statistics, the skipped-step check, the preemption check), validation, FID and checkpoints.
        stop = False
        if common.due(step, cfg.log.every, tr.max_steps):
            metrics = monitor.log_interval(step, lr)
            stop = signals.agreed(accelerator)  # a signal stops the run within log.every - 1 steps
            if density:
                log({"step": step, **density.update()})  # the interval's losses into the density (an all-reduce)
            if stab.rollback.diverged(step, metrics, monitor):  # train.on_divergence=rollback: every rank reloads
                step = stab.rollback.roll_back(step, monitor, load)  # the last good checkpoint, LR lowered
                batches = batches_from(step)
                if stop:  # the checkpoint rolled back to is the one the requeued run resumes
                    common.exit_for_requeue(accelerator, step)
                continue  # that step's validation, FID, snapshot and checkpoint were done before the divergence
        if common.due(step, cfg.val.every, tr.max_steps):  # (pauses are not counted as training throughput)
            monitor.pause(validate, step, "validation")
        if common.due(step, cfg.val.fid_every, tr.max_steps):
            monitor.pause(fid, step, f"FID ({cfg.val.fid_samples} samples)")
        if phema.due(step, tr.max_steps):
            monitor.pause(phema.snapshot, step)  # the main process writes it
        if common.due(step, cfg.ckpt.every, tr.max_steps) or stop:
            monitor.pause(checkpoint, step)
        if stop:
            common.exit_for_requeue(accelerator, step)
    monitor.close()

    # ---- Export: the fp32 EMA weights, loadable with SD3Transformer2DModel.from_pretrained ------------------
    whole = sharding.full_copy(ema, to_cpu=True)  # sharded: gathered into the main process's CPU memory
    if accelerator.is_main_process:
        print(f"exported EMA model to {pipeline_export.export(whole, cfg, run_dir / 'export', d.class_ids, run_dir)}")
    signals.exit_if_agreed(accelerator, "the export, which is complete (the requeued run writes the report)")
    log.finish(cfg, accelerator)  # report.md and plots, wandb
    return run_dir


if __name__ == "__main__":
    try:
        main()
    except config.ConfigError as e:  # one clear message, not a traceback
        sys.exit(str(e))
    except KeyboardInterrupt as e:  # a second Ctrl-C (the first stops at the next log step, with a checkpoint)
        sys.exit(common.stopped_at_once(e))
