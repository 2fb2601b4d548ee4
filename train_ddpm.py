"""DDPM training of an MMDiT (SD3Transformer2DModel), in one file you can read top to bottom.

    python train_ddpm.py                                          # embedded demo, CPU, offline
    accelerate launch train_ddpm.py --config configs/imagenet256.json  # paper-scale recipe
    python train_ddpm.py --config my.json --objective.prediction=x0 --resume latest

Conventions (tests/test_ddpm.py checks each against diffusers' DDPMScheduler and DDIMScheduler):
  * Discrete timesteps t = 0 .. T-1 (T = 1000); t = 0 is (almost) data, t = T-1 is (with zero terminal SNR
    exactly) noise. alpha_bar_t = prod_{s<=t} (1 - beta_s) from the beta schedule, and the forward process is
    x_t = sqrt(ab_t) x0 + sqrt(1 - ab_t) eps (Ho et al. 2020, eq. 4). SNR_t = ab_t / (1 - ab_t).
  * The model predicts v = sqrt(ab) eps - sqrt(1 - ab) x0 (Salimans & Ho 2022; diffusers' "v_prediction"),
    or eps ("epsilon"), or x0 ("sample"), as objective.prediction says.
  * The MMDiT sees the timestep t as a float in [0, T-1]: diffusers' SD3 transformer expects [0, 1000]. Under
    a resolution shift it sees the fractional timestep of the unshifted schedule with the same noise level
    (time_input below), so its time input always means the same noise. The control schedule w of the
    conditioner reads the flow-matching time of equal SNR (noise_level below).
  * Pixels are in [-1, 1]; latents are (z - shift) * scale with the VAE's own factors.

Pipeline: config -> accelerator and seeds -> data (open, cache check, hit/miss, batches) -> model, EMA,
init_from (another run's weights) -> optimizer -> resume -> loop (forward, loss, accumulation, optimizer step,
metrics, gradient analysis, loss spikes) -> validation (samples, loss on a fixed timestep grid) -> checkpoints
-> export -> report.
"""
import math
import sys
from typing import Literal

import numpy as np
import torch
from accelerate.utils import set_seed
from pydantic import BaseModel, Field

import common
from training.config import config
from training.data import batching, buckets, cache, digits, emoji, encoders, latents, sd3_base, sources
from training.model import lora, mmdit
from training.objectives import repa
from training.optimisation import muon, optimizers
from training.run import checkpoints, fit, hub, sharding, stability, start
from training.run.monitor import Monitor
from training.run.phema import PowerEMA
from training.evaluation import sampling, validation
from training.record import runlog
from training.sharing import pipeline_export

# ----------------------------------------------------------------------------------------------------------
# Config. The shared sections (data, encoders, model, conditioning, train, val, log, ckpt) are typed once in
# training/config/sections.py; this method adds its objective section and its sampler keys. A recipe
# (configs/*.json) names only what it changes; --help lists every key, its type, default and use.


class Objective(BaseModel, extra="forbid", strict=True):
    """beta schedule, zero terminal SNR, prediction target, Min-SNR weight, resolution shift"""
    num_timesteps: int = Field(1000, ge=2, description="T")
    beta_schedule: Literal["quadratic", "linear", "cosine"] = Field("quadratic",
                                                                    description="quadratic: SD's scaled_linear")
    beta_start: float = Field(0.00085, gt=0, lt=1, description="beta_0 of quadratic and linear (the paper's)")
    beta_end: float = Field(0.012, gt=0, lt=1, description="beta_{T-1} of quadratic and linear (the paper's)")
    zero_terminal_snr: bool = Field(True, description="rescale so ab_{T-1} = 0 (Lin et al. 2024); needs v or x0")
    prediction: Literal["v", "eps", "x0"] = Field("v", description="what the model predicts")
    min_snr_gamma: float = Field(5.0, ge=0, description="Min-SNR-gamma loss weight (Hang et al. 2023); 0: off")
    min_snr_form: Literal["plus_one", "paper", "floor"] = Field(
        "plus_one", description="min(SNR + 1, g) in x0 space: weight 1 at SNR = 0; paper: min(SNR, g); floor: paper's, "
                                "1 at SNR = 0")
    timestep_sampling: Literal["uniform", "adaptive"] = Field("uniform", description="adaptive: following the loss")
    adaptive_bins: int = Field(16, ge=2, description="adaptive: bins of equal base mass")
    adaptive_mix: float = Field(0.25, gt=0, le=1,
                                description="adaptive: the uniform density's share (weights <= 1 / mix)")
    time_shift: float = Field(1.0, gt=0, description="a: SNR / a^2, flow matching's time shift at equal SNR")
    shift_base_resolution: int | None = Field(None, ge=1, description="if set, a = data.resolution / this")
    loss_bins: int = Field(5, ge=1, description="the loss is also logged per timestep bin [kT/K, (k+1)T/K)")


class Sampler(BaseModel, extra="forbid", strict=True):  # this method's keys in the val section
    sampler: Literal["ddim", "ddpm"] = Field("ddim", description="DDIM (deterministic, eta = 0) or DDPM (ancestral)")
    guidance_rescale: float = Field(0.7, ge=0, le=1, description="phi of Lin et al. 2024, sec. 3.4; 0: plain guidance")


def check_objective(cfg):
    """The objective's and sampler's problems, as a list (config.load_config reports them with the rest at
    start-up; generate refuses them): e.g. zero terminal SNR with eps prediction."""
    obj, val, problems = cfg["objective"], cfg["val"], []
    if obj["prediction"] not in ("v", "eps", "x0"):
        problems.append(f"objective.prediction must be 'v', 'eps' or 'x0', got {obj['prediction']!r}")
    if obj["zero_terminal_snr"] and obj["prediction"] == "eps":
        problems.append(
            "objective.zero_terminal_snr=true cannot be combined with objective.prediction='eps': at the last "
            "timestep alpha_bar = 0, so x_t is pure noise, eps is x_t itself, and x0 = (x_t - sqrt(1 - ab) eps) / "
            "sqrt(ab) divides by zero (Lin et al. 2024, sec. 3.2). Set objective.prediction to 'v' or 'x0', or "
            "objective.zero_terminal_snr=false.")
    if val["sampler"] not in ("ddim", "ddpm"):
        problems.append(f"val.sampler must be 'ddim' or 'ddpm', got {val['sampler']!r}")
    if obj["beta_schedule"] != "cosine" and obj["beta_start"] >= obj["beta_end"]:
        problems.append(f"objective.beta_start={obj['beta_start']} must be below objective.beta_end={obj['beta_end']}")
    if not 1 <= val["steps"] <= obj["num_timesteps"]:
        problems.append(f"val.steps={val['steps']} must be in [1, objective.num_timesteps={obj['num_timesteps']}]")
    if obj["loss_bins"] > obj["num_timesteps"]:
        problems.append(f"objective.loss_bins={obj['loss_bins']} must be <= objective.num_timesteps")
    if obj.get("min_snr_form", "plus_one") not in ("plus_one", "paper", "floor"):  # .get: configs saved before the key
        problems.append(f"objective.min_snr_form must be 'plus_one', 'paper' or 'floor', got {obj['min_snr_form']!r}")
    return problems


# The whole typed config: the shared sections with these two, and the start-up checks of the options this trainer
# runs, each in its own module (every problem reported at once, before any work).
CONFIG = config.schema(Objective, Sampler, checks=(encoders.problems, sharding.problems, repa.problems, hub.problems,
                                                   muon.problems, lora.problems, sd3_base.problems, check_objective,
                                                   emoji.problems, digits.problems))
# The defaults changed here: the demo's budget and guidance, chosen by benchmarks/demo_quality.py
# (docs/benchmarks/demo_quality.md), as in train_flow_matching.py. The recipes set their own and pin the paper's
# constant LR.
DEFAULTS = config.defaults(CONFIG, {"train.max_steps": 1000, "train.lr": 2e-3, "train.lr_schedule": "cosine",
                                    "val.guidance_scale": 7.0})

# ----------------------------------------------------------------------------------------------------------
# The objective: beta schedule, zero terminal SNR, forward process, v / eps / x0 target, Min-SNR weight.


def make_schedule(num_timesteps=1000, beta_schedule="quadratic", beta_start=0.00085, beta_end=0.012,
                  zero_terminal_snr=True):
    """alpha_bar_t = prod_{s<=t} (1 - beta_s), t = 0 .. T-1, in float64. Betas:
      quadratic: linspace(sqrt(b0), sqrt(b1), T)^2 (Rombach et al. 2022; SD's and diffusers' "scaled_linear")
      linear:    linspace(b0, b1, T) (Ho et al. 2020, with b0 = 1e-4, b1 = 0.02 there)
      cosine:    1 - f(t+1)/f(t), f(t) = cos((t/T + 0.008)/1.008 pi/2)^2, capped at 0.999 (Nichol & Dhariwal 2021)
    Zero terminal SNR (Lin et al. 2024, Algorithm 1): sqrt(ab) <- (sqrt(ab) - sqrt(ab_T-1)) sqrt(ab_0) /
    (sqrt(ab_0) - sqrt(ab_T-1)), so the last step is pure noise (as sampling assumes) and the first unchanged."""
    T = num_timesteps
    if beta_schedule == "quadratic":
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, T, dtype=torch.float64) ** 2
    elif beta_schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, T, dtype=torch.float64)
    elif beta_schedule == "cosine":
        f = [math.cos((i / T + 0.008) / 1.008 * math.pi / 2) ** 2 for i in range(T + 1)]
        betas = torch.tensor([min(1 - f[i + 1] / f[i], 0.999) for i in range(T)], dtype=torch.float64)
    else:
        raise ValueError(f"objective.beta_schedule must be 'quadratic', 'linear' or 'cosine', got {beta_schedule!r}")
    alphas_cumprod = torch.cumprod(1 - betas, dim=0)
    if zero_terminal_snr:
        s = alphas_cumprod.sqrt()
        alphas_cumprod = ((s - s[-1]) * s[0] / (s[0] - s[-1])) ** 2
    return alphas_cumprod


def objective_summary(cfg):
    """The objective in words, for the run's first line."""
    obj = cfg.objective
    return (f"{obj.beta_schedule} betas, zero terminal SNR {obj.zero_terminal_snr}, {obj.prediction} prediction, "
            f"min-SNR gamma {obj.min_snr_gamma:g} ({obj.min_snr_form}), resolution shift a = {common.shift_of(cfg):g}")


def shift_schedule(alphas_cumprod, shift):
    """Resolution shift of the noise schedule: SNR' = SNR / a^2, i.e. alpha_bar' = ab / (ab + a^2 (1 - ab))
    (Hoogeboom et al. 2023, sec. 3.1: twice the side needs twice the noise std for the same signal; Berrada
    et al. 2024 for 256 -> 512 fine-tuning). It equals flow matching's time shift t' = a t / (1 + (a - 1) t) at
    equal SNR, stays monotone, and keeps a zero terminal SNR zero. a = 1: identity."""
    return alphas_cumprod / (alphas_cumprod + shift ** 2 * (1 - alphas_cumprod))


def schedule_of(cfg):
    """The run's alpha_bar with its resolution shift, from its config (a plain dict works: eval_fid.py passes
    config.json), so training, validation and every sampler of a saved model use the same schedule."""
    return shift_schedule(base_schedule_of(cfg), common.shift_of(cfg))


def base_schedule_of(cfg):
    obj = cfg["objective"]
    return make_schedule(obj["num_timesteps"], obj["beta_schedule"], obj["beta_start"], obj["beta_end"],
                         obj["zero_terminal_snr"])


def time_input(base_alphas_cumprod, shift):
    """What the MMDiT sees as time at each timestep of the shifted schedule: the fractional timestep of the
    unshifted schedule that has the same noise level, linear in log-SNR between its integer timesteps. The
    shift then changes how often each noise level is visited, never what the time input means, so a model
    pre-trained at 256 px keeps reading its noise level off the timestep at 512 px (as flow matching, whose
    model sees the shifted t). log SNR' = log SNR - 2 log a (shift_schedule). a = 1: exactly 0 .. T-1.
    Only with zero terminal SNR: pure noise (log SNR = -inf) is T-1, and the one or two shifted steps below
    the last finite log-SNR (ab < 1e-6) get that last finite timestep, the inverse of the interpolation."""
    log_snr = (base_alphas_cumprod.log() - (-base_alphas_cumprod).log1p()).double()  # decreasing in t
    finite = log_snr[torch.isfinite(log_snr)]
    target = log_snr - 2 * math.log(shift)
    tau = np.interp(-target.numpy(), -finite.numpy(), np.arange(len(finite), dtype=np.float64))  # clamps at the ends
    tau[np.isneginf(target.numpy())] = len(log_snr) - 1
    return torch.from_numpy(tau)


def time_input_of(cfg):
    """The run's time input per timestep (time_input), from its config, like schedule_of."""
    return time_input(base_schedule_of(cfg), common.shift_of(cfg))


def _coefs(alphas_cumprod, t, like):
    """sqrt(ab_t) and sqrt(1 - ab_t) shaped to broadcast against `like`; t is a LongTensor of timesteps."""
    ab = alphas_cumprod.to(like.device)[t].view(-1, *([1] * (like.dim() - 1)))
    return ab.sqrt().to(like.dtype), (1 - ab).sqrt().to(like.dtype)


def add_noise(x0, noise, t, alphas_cumprod):
    """The forward process q(x_t | x0) (Ho et al. 2020, eq. 4): x_t = sqrt(ab_t) x0 + sqrt(1 - ab_t) eps."""
    a, s = _coefs(alphas_cumprod, t, x0)
    return a * x0 + s * noise


def target_of(x0, noise, t, alphas_cumprod, prediction):
    """What the model learns to output: v = sqrt(ab) eps - sqrt(1 - ab) x0 (Salimans & Ho 2022),
    eps (Ho et al. 2020) or x0."""
    a, s = _coefs(alphas_cumprod, t, x0)
    return {"v": a * noise - s * x0, "eps": noise, "x0": x0}[prediction]


def min_snr_weight(snr, prediction, gamma, form="plus_one"):
    """Min-SNR-gamma (Hang et al. 2023): weight the x0-space loss by min(SNR, gamma), expressed on the chosen
    target, since ||eps err||^2 = SNR ||x0 err||^2 and ||v err||^2 = (SNR + 1) ||x0 err||^2:
      form "paper":    x0: min(SNR, g)      eps: min(SNR, g) / SNR = min(1, g / SNR)    v: min(SNR, g) / (SNR + 1)
      form "plus_one": x0: min(SNR + 1, g)  eps: as "paper"                            v: min(SNR + 1, g) / (SNR + 1)
      form "floor":    the paper's, floored at plus_one's weight 1 only where SNR = 0 (the terminal step)
    The paper's x0 and v weights are 0 at SNR = 0: under zero terminal SNR the last timestep, where every
    sample starts and the model must predict the data mean from pure noise, gets no gradient, and about 160
    of 1000 timesteps (265 with a shift of 2) get less than 0.01. "plus_one" gives weight 1 there and the
    paper's value where SNR >> 1 (where min(., g) = g). eps keeps the paper's form, already 1 at SNR -> 0
    (min(SNR + 1, g) / SNR would be unbounded). But plus_one also changes every weight where SNR < g - 1 (839 of
    1000 timesteps at g = 5): "floor" keeps the terminal step trained and the paper's weights everywhere else
    (docs/methods.md measures the three on real images). gamma <= 0: weight 1 everywhere."""
    if gamma <= 0:
        return torch.ones_like(snr)
    if prediction == "eps":
        return (gamma / snr).clamp(max=1.0)  # gamma / 0 = inf -> 1
    x0_weight = (snr + 1 if form == "plus_one" else snr).clamp(max=gamma)
    if form == "floor":
        x0_weight = torch.where(snr > 0, x0_weight, torch.ones_like(x0_weight))
    return x0_weight if prediction == "x0" else x0_weight / (snr + 1)


def loss_weight_of(cfg):
    """The run's Min-SNR weight per timestep, on its shifted schedule (float64)."""
    obj, ab = cfg["objective"], schedule_of(cfg)
    return min_snr_weight(ab / (1 - ab), obj["prediction"], obj["min_snr_gamma"], obj.get("min_snr_form", "plus_one"))


def noise_level(ab):
    """The flow-matching time of equal SNR, sqrt(1 - ab) / (sqrt(ab) + sqrt(1 - ab)) in [0, 1], 1 = pure noise:
    what the conditioner's control schedule w reads (model.control_weight), so it means the same in both
    trainers. The MMDiT itself sees the timestep."""
    return (1 - ab).sqrt() / (ab.sqrt() + (1 - ab).sqrt())


def ddpm_loss(model, x0, cond, t, noise, alphas_cumprod, prediction, loss_weight=None, time_input=None):
    """Per-sample weighted MSE on the target (Ho et al. 2020, eq. 14, with Min-SNR weights): the number that
    is trained on, logged as loss and val_loss. t: LongTensor in [0, T-1]; loss_weight and time_input are
    per-timestep tables (loss_weight_of, time_input_of; None: weight 1, the model sees t itself)."""
    return training_loss(model, x0, cond, t, noise, alphas_cumprod, prediction, loss_weight, time_input)[0]


def training_loss(model, x0, cond, t, noise, alphas_cumprod, prediction, loss_weight=None, time_input=None, align=None):
    """(ddpm_loss, {name: per-sample term}): REPA's alignment term (training/objectives/repa.py; `align`: its
    targets and weight, or None), added to what is trained and logged on its own."""
    ab = alphas_cumprod.to(x0.device)[t]
    timestep = t.float() if time_input is None else time_input.to(x0.device, torch.float32)[t]
    out, tokens = repa.forward(model, align, add_noise(x0, noise, t, alphas_cumprod), timestep, cond,
                               noise_level(ab).float())
    mse = (out.float() - target_of(x0, noise, t, alphas_cumprod, prediction).float()).pow(2)
    mse = mse.mean(dim=tuple(range(1, x0.dim())))
    loss = mse if loss_weight is None else mse * loss_weight.to(x0.device, torch.float32)[t]
    return loss, repa.terms(tokens, align)


# ----------------------------------------------------------------------------------------------------------
# The samplers: DDIM (eta = 0) or ancestral DDPM on a trailing timestep grid, with guidance and its rescale.


def timestep_grid(num_timesteps, steps):
    """Trailing spacing (Lin et al. 2024, sec. 3.3, Table 2): t_i = round(T - i T / steps) - 1, i = 0 .. steps-1,
    so sampling starts at t = T-1, where zero terminal SNR makes x_T pure noise. This is diffusers'
    timestep_spacing="trailing", computed exactly (its float arange differs at a few counts, e.g. 48 and 61)."""
    if not 1 <= steps <= num_timesteps:
        raise ValueError(f"val.steps must be in [1, {num_timesteps}], got {steps}")
    return [round(num_timesteps * (steps - i) / steps) - 1 for i in range(steps)]


def predict_x0_eps(out, x, ab, prediction):
    """The model output as (x0, eps) estimates, from x_t = sqrt(ab) x0 + sqrt(1 - ab) eps and the target's
    definition; `ab` is alpha_bar at the current timestep, a float."""
    a, s = ab ** 0.5, (1 - ab) ** 0.5
    if prediction == "v":  # x0 = sqrt(ab) x_t - sqrt(1 - ab) v,  eps = sqrt(ab) v + sqrt(1 - ab) x_t
        return a * x - s * out, a * out + s * x
    if prediction == "eps":
        return (x - s * out) / a, out
    return out, (x - a * out) / s


def ddim_step(x0, eps, ab_prev):
    """DDIM, eta = 0 (Song et al. 2021, eq. 12): x_prev = sqrt(ab_prev) x0 + sqrt(1 - ab_prev) eps."""
    return ab_prev ** 0.5 * x0 + (1 - ab_prev) ** 0.5 * eps


def ddpm_step(x0, x, ab, ab_prev, noise):
    """Ancestral step: a draw from the posterior q(x_prev | x_t, x0) (Ho et al. 2020, eq. 6-7) across the
    jump t -> prev, with alpha = ab / ab_prev, beta = 1 - alpha:
      mean = sqrt(ab_prev) beta / (1 - ab) x0 + sqrt(alpha) (1 - ab_prev) / (1 - ab) x_t
      var  = (1 - ab_prev) / (1 - ab) beta   (diffusers' "fixed_small"; 0 on the last step, ab_prev = 1)."""
    alpha = ab / ab_prev
    beta = 1 - alpha
    mean = ab_prev ** 0.5 * beta / (1 - ab) * x0 + alpha ** 0.5 * (1 - ab_prev) / (1 - ab) * x
    return mean + ((1 - ab_prev) / (1 - ab) * beta) ** 0.5 * noise


@torch.no_grad()
def sample(model, noise, cond, alphas_cumprod, steps, prediction="v", guidance_scale=1.0, guidance_rescale=0.0,
           method="ddim", control_guidance_scale=0.0, generator=None, time_input=None, guidance_interval=(0.0, 1.0)):
    """From x = noise at t = T-1 down the trailing grid to x0. Guidance w = 1 is the plain conditional model.
    Guidance acts only on steps whose noise level (the flow-matching time of equal SNR, noise_level) lies in
    guidance_interval [lo, hi] (Kynkaanniemi et al. 2024); the others take one conditional pass, no rescale.
    The ancestral sampler draws its fresh noise from `generator` (None: the global RNG). time_input: the
    model's time per timestep, as in training (time_input_of; None: t itself)."""
    if method not in ("ddim", "ddpm"):
        raise ValueError(f"val.sampler must be 'ddim' or 'ddpm', got {method!r}")
    ts, n = timestep_grid(len(alphas_cumprod), steps), len(noise)
    x = noise.float()
    for i, t in enumerate(ts):
        ab = alphas_cumprod[t].item()
        ab_prev = alphas_cumprod[ts[i + 1]].item() if i + 1 < len(ts) else 1.0  # past the grid: data, ab = 1
        # Guidance on semantics and controls (mmdit.guided), then the rescale (Lin et al. 2024, sec. 3.4).
        timestep = float(t) if time_input is None else time_input[t].item()
        level = noise_level(torch.tensor(ab, dtype=torch.float64)).item()  # host values: no device sync
        guide = guidance_interval[0] <= level <= guidance_interval[1]
        out = mmdit.guided(model, x, torch.full((n,), timestep, device=x.device), cond,
                           guidance_scale if guide else 1.0, control_guidance_scale if guide else 0.0,
                           noise_level(torch.full((n,), ab, device=x.device)),
                           rescale=guidance_rescale if guide else 0.0)
        x0, eps = predict_x0_eps(out, x, ab, prediction)
        if method == "ddim":
            x = ddim_step(x0, eps, ab_prev)
        else:
            z = torch.randn(x.shape, generator=generator, device=x.device) if i + 1 < len(ts) else torch.zeros_like(x)
            x = ddpm_step(x0, x, ab, ab_prev, z)
    return x


def generate(model, noise, cond, cfg, steps=None, guidance_scale=None, sampler=None, control_guidance_scale=None,
             guidance_interval=None):
    """Sample as the run `cfg` is configured (its shifted schedule and time input, prediction, val sampler,
    guidance, its interval and rescale), with optional overrides. The one entry point that validation,
    eval_fid.py and the benchmarks call."""
    if problems := check_objective(cfg):
        raise config.ConfigError("\n".join(problems))
    val = cfg["val"]
    return sample(model, noise, cond, schedule_of(cfg), steps or val["steps"], cfg["objective"]["prediction"],
                  val["guidance_scale"] if guidance_scale is None else guidance_scale, val["guidance_rescale"],
                  sampler or val["sampler"],
                  val["control_guidance_scale"] if control_guidance_scale is None else control_guidance_scale,
                  time_input=time_input_of(cfg),
                  guidance_interval=guidance_interval or val.get("guidance_interval", (0.0, 1.0)))


# ----------------------------------------------------------------------------------------------------------


def main(argv=None):
    signals = common.StopSignals()  # first: from here on a stop signal ends the run with exit code 75
    cfg = config.load_config(DEFAULTS, argv, method="ddpm", schema=CONFIG)  # all problems at once, before work
    runlog.refuse_earlier_run(cfg)  # a run_dir that holds a run continues only with --resume
    checkpoints.keep_recorded(cfg, skip=fit.resolved_keys(cfg.train))  # --resume: the values the run started with
    if done := runlog.finished_run(cfg):  # --resume of a run trained to train.max_steps and exported: says so
        return done
    data, obj, tr = cfg.data, cfg.objective, cfg.train

    # ---- Accelerator and seeds ----------------------------------------------------------------------------
    accelerator = common.make_accelerator(tr.mixed_precision, tr.timeout_minutes)  # CPU-only too; TF32
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    set_seed(cfg.seed + rank)  # different noise and times on each rank
    # per timestep: alpha_bar, the Min-SNR weight and the model's time input (float32: MPS has no float64)
    alphas_cumprod, loss_weight, model_time = (table.to(device, torch.float32) for table in
                                               (schedule_of(cfg), loss_weight_of(cfg), time_input_of(cfg)))
    T = obj.num_timesteps

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
    fit.plan_batch(cfg, accelerator, model, optimizer, train_set, d.text_encoder, ckpt, align)
    model, optimizer = sharding.prepare(model, optimizer, accelerator, tr)  # compiled (train.compile), DDP; or sharded
    lr_scale, lr_rule = common.lr_scale(tr, tr.batch_size * world * tr.grad_accum)  # the batch rule's factor
    raw_model = accelerator.unwrap_model(model)
    runlog.describe_run(accelerator, cfg, raw_model, train_set, lr_rule, objective_summary(cfg))

    # ---- Resume: same run, continues step, data position, optimizer, EMA, RNG and statistics ---------------
    def load(ckpt):  # at resume and on a rollback: weights, EMA, optimizer, RNG, then the post-hoc EMA profiles
        return checkpoints.load_run(ckpt, raw_model, ema, optimizer, accelerator, phema)

    state = load(ckpt) if ckpt else {"step": 0}
    step = state["step"]
    log = runlog.RunLog(cfg, run_dir, accelerator, step)  # metrics.jsonl (rows past `step` set aside), wandb
    monitor = Monitor(cfg, raw_model, accelerator, log, state)  # progress bar, or plain lines in a log file
    # the stability parts, each by name: time density (bins: runs of timesteps), clip, noise scale, slopes, rollback
    stab = stability.Parts(cfg, accelerator, model, log, state, lambda u: (u * T).long().clamp(max=T - 1))

    # ---- Validation: EMA samples with fixed noise and conditions, and a held-out loss on a fixed t grid ------
    val_noise, val_cond = validation.validation_inputs(val_set, len(d.val_prompts), data.num_classes, x_shape,
                                                       cfg.seed, device, d.val_text)

    @ema_update.on_device  # the whole EMA on the device: an offloaded one visits the GPU, a sharded one is gathered
    @torch.no_grad()
    @torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])  # draws nothing from training's RNG
    def validate(step, ema):                                                   # (padding noise): exact resume
        ema.eval()  # val.sampler=ddpm: fresh noise per rank's share of the grid (it depends on the process count)
        torch.manual_seed(cfg.seed + rank)  # the ancestral sampler's noise: fixed, and the training RNG untouched
        x, nfe = validation.sample_grid(generate, ema, val_noise, val_cond, cfg, accelerator)
        path = accelerator.is_main_process and log.samples(encoders.decode(d.vae, x, device), step, d.val_prompts)
        # Validation loss: every held-out sample at every t_k = floor((k + 0.5) T / K), with fixed noise.
        losses = validation.heldout_loss(val_set, cfg, accelerator, lambda x0, cond, noise, k: ddpm_loss(
            ema, x0, cond, torch.full((len(x0),), int((k + 0.5) * T / obj.loss_bins), device=device), noise,
            alphas_cumprod, obj.prediction, loss_weight, model_time))
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
    density = stab.density  # objective.timestep_sampling="adaptive": timesteps and weights that follow the loss
    model.train()
    while step < tr.max_steps:
        factor = stab.rollback.lr_factor * common.lr_at(step, lr_scale, tr.warmup_steps, tr.lr_schedule, tr.max_steps)
        lr = fit.set_lr(optimizer, tr, factor)  # train.lr (Muon's group: muon_lr) x factor; a rollback lowers it
        for micro in range(tr.grad_accum):
            # x0 and its conditions, the semantic and control ones dropped independently, for guidance on each
            batch, x0, cond = batching.training_inputs(next(batches), d.text_encoder, cfg.conditioning, accelerator)
            noise = torch.randn_like(x0)
            # t uniform over the T timesteps (Ho et al. 2020), or the adaptive density's with its weights
            t, weight = density.draw(len(x0)) if density else (torch.randint(0, T, (len(x0),), device=device), 1.0)
            # Gradients are all-reduced (sharded: reduce-scattered) only on the last micro-batch; the others accumulate
            with sharding.no_sync(model, accelerator, skip=micro < tr.grad_accum - 1):  # locally
                with accelerator.autocast():  # train.mixed_precision: bf16 matmuls; the loss itself in fp32
                    loss, terms = training_loss(model, x0, cond, t, noise, alphas_cumprod, obj.prediction,
                                                loss_weight, model_time, align(batch, step))  # terms: REPA's, when on
                accelerator.backward((weight * (loss + sum(terms.values()))).mean() / tr.grad_accum)  # the step's mean
            if density:
                density.observe(loss)  # the per-bin loss it follows
            stab.noise_scale.micro_batch(micro)  # on its steps: the small batch's gradient norm
            monitor.micro_batch(loss, t * obj.loss_bins // T, weight, terms)
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
