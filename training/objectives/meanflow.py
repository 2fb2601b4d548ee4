"""MeanFlow (Geng, Deng, Bai, Kolter & He 2025, "Mean Flows for One-step Generative Modeling", arXiv 2505.13447):
the network predicts the average velocity over an interval [r, t] of the flow-matching path, so that one step
of any length is exact and an image takes one or two network evaluations.

On the path z_t = (1 - t) x0 + t eps (t = 1 noise) with velocity v = eps - x0, the average velocity and the
identity that makes it trainable without the integral (d/dt of (t - r) u = integral_r^t v):

    u(z_t, r, t) = 1 / (t - r) integral_r^t v(z_s, s) ds
    u = v - (t - r) du/dt,   du/dt = v d_z u + d_t u        (the total derivative along the path: dr/dt = 0)

The network u_theta(z_t, r, t) is regressed on the identity's right side at its own current weights, under a stop-
gradient (the paper's Algorithm 1):

    u_tgt = v - (t - r) (v d_z u_theta + d_t u_theta),   loss = sg(w) |u_theta - sg(u_tgt)|^2

where v d_z u + d_t u is one forward-mode derivative, a JVP along the tangent (v, 0, 1) of (z, r, t). Sampling
steps z_r = z_t - (t - r) u(z_t, r, t) (train_flow_matching.sample, sampler "meanflow"); r = t is flow matching:
u(z, t, t) is the velocity at t, and the loss at r = t is flow matching's.

The paper's choices, each a config key of train_flow_matching.py's objective section (defaults the paper's and
its authors' code's, Gsunshine/meanflow, meanflow.py and configs/default.py):

  meanflow_equal_share    r = t for this share of each batch (0.75: 25% r != t, the ablation's best, Tab. 1;
                          the code's data_proportion); only the rest needs the JVP
  meanflow_logit_mean/std t and r the larger and smaller of two draws of sigmoid(m + s n), n ~ N(0, 1): lognorm
                          (-0.4, 1.0), the ablation's best (the code's P_mean, P_std)
  meanflow_weight_power   p of the adaptive loss weight w = 1 / (|Delta|^2 + c)^p (p = 1 the ablation's best,
                          0.5 pseudo-Huber, 0 plain L2; the code's norm_p, its c norm_eps = 0.01)
  meanflow_guidance       guidance folded into the target (the paper's sec. on guidance and its appendix): v is
  meanflow_guidance_mix   replaced, as tangent and target, by v~ = omega v + kappa u(z_t, t, t | c) + (1 - omega -
                          kappa) u(z_t, t, t | null), omega = w' (1 - kappa), so that at the optimum u(., t, t | c)
                          = u_null + w' (u_c - u_null): classifier-free guidance of scale w' in one evaluation.
                          w' = 2, kappa = 0.5 the code's default (omega = 1, kappa = 0.5); samples whose condition
                          was dropped keep v. w' = 1, kappa = 0: no guidance, no extra evaluation

Two keys for fine-tuning a trained flow-matching model (init_from) into a few-step one, each off by default:

  meanflow_anchor         the flow-matching anchor (FACM, flow-anchored consistency models, ICLR 2026, ali-vilab/
                          FACM losses.py: FACMLoss keeps a plain flow-matching loss beside the shortcut's, so the
                          fine-tune keeps the velocity field it starts from): this share of each batch comes first
                          and trains flow matching's own loss, at r = t, at flow matching's time density (objective.
                          time_sampling, logit_mean / _std: the trainer's sample_time, handed over as flow_time),
                          without the adaptive weight; the rest is MeanFlow's batch as above (meanflow_equal_share
                          of it at r = t). Its target is v~, the velocity MeanFlow's r = t samples regress (FACM's
                          anchor regresses the same guided velocity as its shortcut loss; two targets at one input
                          would pull apart): with meanflow_guidance 1 it is flow matching's loss exactly, and at
                          share 1 the whole batch is (tests/test_meanflow.py). Logged as loss_anchor
  meanflow_interval_blocks  where the interval enters the network (Decoupled MeanFlow, kyungmnlee/dmf models/
                          dmft.py: the second time only in the last blocks, the last 8 of DMF-XL/2's 28), so the
                          first blocks stay the flow-matching model's own: None, every block (the paper's: added to
                          the adaptive-norm vector); K, the last K blocks and the final norm only (training/model/
                          mmdit.py, Denoiser.forward)

The JVP: PyTorch's flash and memory-efficient attention kernels (and the CPU's flash kernel) have no forward-mode
derivative (pytorch #165530, #154226), so it runs with the math backend, exact to float rounding; it runs without
autograd (the target is a stop-gradient), on the raw module, eager, so DDP, torch.compile and gradient
checkpointing see only the ordinary forward that the loss differentiates: rCM's way (the JVP in a forward of its
own without gradients, then one forward with them), which is also why it runs on several processes, where
torch.func.jvp through DDP's or FSDP2's wrapper fails (pytorch #182661, #182641). Sharded (train.sharding=fsdp), the
bare module is called through its own __call__: FSDP2's hooks all-gather the root's and each block's weights for the
target's passes as for any forward (its raw forward would meet the root's weights as shards); no gradient, so none
of its backward hooks. Its cost is measured in docs/performance.md ("MeanFlow's step"). How the options combine:
REPA aligns the ordinary forward's tokens; x-prediction differentiates through the conversion u = (z_t - x0_hat) /
max(t, T_MIN); contrastive flow matching and the adaptive time density are refused at start-up (problems).
"""
import random

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import common
from training.objectives import repa, xprediction

WEIGHT_EPS = 0.01  # c of the adaptive weight 1 / (|Delta|^2 + c)^p: the authors' norm_eps (|Delta|^2 summed)


def share_count(n, share):
    """How many of a micro-batch of n a share is: share x n, rounded down or up at random with the fraction's
    probability, so the share is the configured one on average at any micro-batch (a fixed round() would give a
    micro-batch of 1 or 2 no r != t sample at 0.75: flow matching alone, and 3 a third). A host number, drawn from
    Python's generator (seeded per rank, in a checkpoint's RNG state: a resumed run draws the same counts; no tensor
    is read), so the JVP's share of the batch is known without waiting on the device (the authors' code: a fixed
    count per device, its data_proportion). A whole share x n draws nothing."""
    whole, part = divmod(round(share * n, 9), 1)
    return int(whole) + (part > 0 and random.random() < part)


def equal_count(n, obj):
    """How many of the n MeanFlow samples of a micro-batch have r = t (objective.meanflow_equal_share)."""
    return share_count(n, obj["meanflow_equal_share"])


def sample_times(n, obj, shift, device, flow_time=None):
    """(t, r, split), t >= r, split = (anchored, equal): the first `anchored` samples (share_count of
    objective.meanflow_anchor) are the flow-matching anchor, t from `flow_time(k)` (flow matching's own density: the
    trainer's sample_time) and r = t; the others take the larger and smaller of two logit-normal draws, both through
    the run's time shift (common.time_shift, monotone: the order holds), r = t for equal_count of them. r = t for
    the first `equal` samples in all. Without the anchor (0) nothing more is drawn than before the key."""
    anchored = share_count(n, obj["meanflow_anchor"])
    if anchored and flow_time is None:
        raise ValueError("objective.meanflow_anchor > 0: sample_times needs flow matching's time density (flow_time)")
    k = n - anchored
    draws = torch.sigmoid(obj["meanflow_logit_mean"] + obj["meanflow_logit_std"] * torch.randn(k, 2, device=device))
    draws = common.time_shift(draws, shift)
    t, r, equal = draws.max(dim=1).values, draws.min(dim=1).values, equal_count(k, obj)
    r = torch.cat([t[:equal], r[equal:]])
    if anchored:
        anchor = flow_time(anchored)
        t, r = torch.cat([anchor, t]), torch.cat([anchor, r])
    return t, r, (anchored, anchored + equal)


def average_velocity(model, z, t, r, cond, prediction="v"):
    """u(z_t, r, t): the model at time t with the interval t - r (its conditioner's second time embedding); with
    x-prediction the average velocity its clean-image estimate implies, (z_t - x0_hat) / max(t, T_MIN), which at
    r = 0 lands on x0_hat. Differentiable in z, t and r (the JVP goes through the conversion)."""
    t_ = t.view(-1, *([1] * (z.dim() - 1)))
    out = model(z, t * 1000, {**cond, "interval": (t - r) * 1000}).float()
    return xprediction.velocity(out, z, t_) if prediction == "x0" else out


def guided_velocity(model, z, t, v, cond, obj, prediction="v"):
    """v~ = omega v + kappa u(z_t, t, t | c) + (1 - omega - kappa) u(z_t, t, t | null), omega = w' (1 - kappa), in one
    batched pass of the model (no gradient: it is part of the target); v itself where the sample's condition was
    dropped, and where w' = 1 and kappa = 0."""
    scale, mix = obj["meanflow_guidance"], obj["meanflow_guidance_mix"]
    if scale == 1 and mix == 0:
        return v
    omega, k = scale * (1 - mix), 1 + bool(mix)  # the null branch, and the conditional one when kappa > 0
    both = {key: torch.cat([value] * k) for key, value in cond.items()}
    both["drop"] = torch.cat([torch.ones_like(cond["drop"]), cond["drop"]][:k])
    u = average_velocity(model, torch.cat([z] * k), t.repeat(k), t.repeat(k), both, prediction).chunk(k)
    guided = omega * v + (1 - omega - mix) * u[0] + (mix * u[1] if mix else 0)
    return torch.where(cond["drop"].view(-1, *([1] * (v.dim() - 1))), v, guided)


def target(model, z, t, r, v, cond, equal, prediction="v"):
    """u_tgt = v - (t - r) du/dt, du/dt = v d_z u + d_t u by torch.func.jvp along (v, 0, 1) of (z, r, t) at the
    model's current weights, for the samples past the first `equal` (r = t there: the target is v, the second term
    being 0). Call it without autograd: the target is a stop-gradient."""
    if equal == len(z):
        return v
    rest = {key: value[equal:] for key, value in cond.items()}

    def u(z, t, r):
        return average_velocity(model, z, t, r, rest, prediction)

    tangents = (v[equal:].to(z.dtype), torch.ones_like(t[equal:]), torch.zeros_like(r[equal:]))
    with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no forward-mode derivative
        _, dudt = torch.func.jvp(u, (z[equal:], t[equal:], r[equal:]), tangents)
    gap = (t - r)[equal:].view(-1, *([1] * (z.dim() - 1)))
    return torch.cat([v[:equal], v[equal:] - gap * dudt.float()])


def eager(raw):
    """What makes the target, without autograd: the bare module's forward, outside DDP and torch.compile (the
    compiled module's __call__); a sharded module (FSDP2) through its __call__, whose hooks all-gather the weights."""
    return raw if any(map(common.is_dtensor, raw.parameters())) else raw.forward


def training_loss(model, raw, x0, cond, t, r, split, noise, obj, align=None):
    """(per-sample |u_theta - sg(u_tgt)|^2, the mean over elements as flow matching's loss, {name: per-sample term})
    of the micro-batch, (t, r, split) from sample_times (t >= r; split = (anchored, equal): the first `anchored` the
    flow-matching anchor, r = t for the first `equal`). `model` is the module the loop trains (DDP, compiled,
    sharded): its forward is the one differentiated, with REPA's tokens (`align`, repa.py); `raw` the bare module
    (accelerator.unwrap_model), whose forward (eager) makes the target without autograd: the guided velocity v~ and
    the JVP.

    The adaptive weight is a term of its own, "adaptive_weight" = (sg(w') - 1) |Delta|^2, so that what is trained
    is sg(w') |Delta|^2 and the logged loss stays the plain error, per time bin as flow matching's. w' = 1 /
    (|Delta|^2 + c / D)^p with |Delta|^2 the mean over the D elements is the paper's w = 1 / (D |Delta|^2 + c)^p
    times D^p, a constant: p = 0 is flow matching's loss exactly and p = 1 the paper's gradient exactly. The anchor's
    samples take w' = 1: flow matching's plain loss (FACM's anchor is unweighted)."""
    anchored, equal = split
    t_ = t.view(-1, *([1] * (x0.dim() - 1)))
    z = (1 - t_) * x0 + t_ * noise
    # v as flow matching's target: eps - x0, or with x-prediction the velocity x0 implies (clamped below T_MIN)
    v = xprediction.velocity(x0.float(), z, t_) if obj["prediction"] == "x0" else (noise - x0).float()
    with torch.no_grad():
        forward = eager(raw)  # outside DDP and torch.compile: the target's passes are no training step's
        v = guided_velocity(forward, z, t, v, cond, obj, obj["prediction"])
        u_tgt = target(forward, z, t, r, v, cond, equal, obj["prediction"])
    out, tokens = repa.forward(model, align, z, t * 1000, {**cond, "interval": (t - r) * 1000})
    u = xprediction.velocity(out.float(), z, t_) if obj["prediction"] == "x0" else out.float()
    error = (u - u_tgt).pow(2).mean(dim=tuple(range(1, x0.dim())))
    terms = repa.terms(tokens, align)
    if obj["meanflow_weight_power"]:
        weight = 1 / (error.detach() + WEIGHT_EPS / x0[0].numel()) ** obj["meanflow_weight_power"]
        weight[:anchored] = 1  # the anchor: flow matching's own, unweighted loss
        terms["adaptive_weight"] = (weight - 1) * error
    return error, terms


def parts(t, r, split, obj):
    """The batch's kinds of sample, each one's loss logged apart (monitor.Monitor.micro_batch): r = t, where the
    target is the velocity (guided: meanflow_guidance), so its loss is flow matching's, on its scale; and r < t,
    the average velocity against the JVP's target, MeanFlow's own part, larger, growing as the model learns du/dt
    (docs/training.md, "What a healthy run looks like"). With objective.meanflow_anchor, the anchor's samples (the
    first split[0]) are a part of their own, "anchor", and not in "r_eq_t": every rank logs the same names."""
    if not obj["meanflow_anchor"]:
        return {"r_eq_t": t == r, "r_lt_t": t != r}
    anchor = torch.arange(len(t), device=t.device) < split[0]
    return {"anchor": anchor, "r_eq_t": (t == r) & ~anchor, "r_lt_t": t != r}


def probe_loss(obj):
    """training_loss as fit.plan_batch's memory probe runs it (train.batch_size='auto'): every sample with r < t, so
    the whole micro-batch goes through the JVP (a step's most memory: the share with r = t varies by micro-batch),
    the guided target's passes included. Times and noise come from torch's generator, which the probe forks;
    equal_count's Python draw, which it does not, is never made."""
    def loss(forward, model, x0, cond, align):
        t = torch.rand(len(x0), device=x0.device)
        return training_loss(forward, model, x0, cond, t, t * torch.rand_like(t), (0, 0), torch.randn_like(x0), obj,
                             align)
    return loss


def problems(cfg):
    """The start-up checks of objective.meanflow (handed to the config loader by train_flow_matching.py)."""
    obj, out = cfg["objective"], []
    if not obj.get("meanflow"):
        return [f"objective.{key}={obj[key]} without objective.meanflow: {what}; set objective.meanflow=true, or "
                f"{unset}" for key, what, unset in (
                    ("meanflow_anchor", "the anchor is the flow-matching share of a MeanFlow batch (FACM)",
                     "objective.meanflow_anchor=0"),
                    ("meanflow_interval_blocks", "MeanFlow's interval t - r is the input it places",
                     "objective.meanflow_interval_blocks=null"))
                if obj.get(key)]
    blocks, depth = obj["meanflow_interval_blocks"], cfg["model"]["num_layers"]
    if blocks is not None and blocks > depth:
        out.append(f"objective.meanflow_interval_blocks={blocks}: the model has {depth} blocks (model.num_layers); "
                   f"give 1 .. {depth} (Decoupled MeanFlow: the last third, {max(1, depth // 3)}), or null for every "
                   f"block")
    if obj["contrastive_weight"]:
        out.append(f"objective.contrastive_weight={obj['contrastive_weight']} with objective.meanflow: contrastive "
                   "flow matching's negatives are other samples' velocities, MeanFlow's targets average velocities "
                   "over their own intervals; set objective.contrastive_weight=0")
    if obj["time_sampling"] == "adaptive":
        out.append("objective.time_sampling='adaptive' with objective.meanflow: MeanFlow draws (r, t) itself "
                   "(objective.meanflow_logit_mean / _std); use 'logit_normal' or 'uniform'")
    return out


# ----------------------------------------------------------------------------------------------------------
# Sampling: a MeanFlow model's own sampler, steps and guidance, where the run does not choose others, and one line
# wherever it is sampled otherwise (validation and export follow the resolved config; sample.py, eval_fid.py and
# tools/tune.py follow the run's recorded one, and say so for a run that recorded another sampler).

# Two meanflow steps: at the scale docs/benchmarks/meanflow_fashion_mnist.md measured ("One- and two-step
# sampling", fine-tuned, 3 seeds), two evaluations score FD 8.5 where one scores 19.1; four gain less (5.5) for
# twice the cost.
OWN_STEPS = 2


def chosen(cfg, key):
    """Whether the run chose `key` for a MeanFlow model: on the command line, or in a --config file that turns
    objective.meanflow on itself. A recipe's sampling settings without it are its flow-matching sampler's (every
    recipe sets val.steps and val.guidance_scale for Euler, 20-50 steps guided), not a MeanFlow model's."""
    origin = getattr(cfg, "origin", {})
    where = origin.get(key)
    return where is not None and (where.startswith("from --") or where == origin.get("objective.meanflow"))


def sampling_note(obj, sampler, steps, guidance_scale, flags=True):
    """For a MeanFlow model (objective section `obj`) sampled otherwise than by its own sampler or with guidance on
    top of the guidance trained into its weights, what that does, in words (with `flags`: sample.py's and
    eval_fid.py's flags for its own way), for one line; None where it is sampled its own way, or is no MeanFlow
    model."""
    if not obj.get("meanflow"):
        return None
    trained, out = obj["meanflow_guidance"], []
    if sampler != "meanflow":
        out.append(f"the {sampler} sampler's {steps} step{'s' * (steps != 1)} follow{'s' * (steps == 1)} the "
                   f"model's r = t velocity as a flow-matching model's, not the average velocity over each step that "
                   f"it was trained for")
    if guidance_scale != 1 and trained > 1:
        out.append(f"guidance {guidance_scale:g} comes on top of the {trained:g} trained into its weights "
                   f"(objective.meanflow_guidance): the two compound, at two evaluations a step")
    if not out:
        return None
    own = f"--sampler meanflow --steps {OWN_STEPS}" + " --guidance_scale 1" * (trained > 1)
    return "; ".join(out) + (f" (its own way: {own})" if flags else "")


def sampling_defaults(cfg):
    """The config loader's resolver for objective.meanflow (handed over by train_flow_matching.py): val.sampler,
    val.steps and val.guidance_scale that the run does not choose (chosen) become the model's own, its sampler at
    OWN_STEPS steps and guidance 1 (none on top of objective.meanflow_guidance; with that 1, the trainer's
    guidance stays the only one); validation, the export and every tool that reads the run's config follow them.
    Returns the start-up lines: what was filled, and one line where the run chose another way (sampling_note)."""
    obj, val = cfg["objective"], cfg["val"]
    if not obj.get("meanflow"):
        return []
    sampler = val["sampler"] if chosen(cfg, "val.sampler") else "meanflow"
    own = {"sampler": sampler, "steps": OWN_STEPS if sampler == "meanflow" else val["steps"],  # Euler's: the trainer's
           "guidance_scale": 1.0 if obj["meanflow_guidance"] > 1 else val["guidance_scale"]}
    filled, replaced = [], []
    for leaf, value in own.items():
        key = f"val.{leaf}"
        if chosen(cfg, key) or val[leaf] == value:
            continue
        if key in cfg.origin:  # a recipe's, for the flow-matching sampler
            replaced.append(f"{key}={val[leaf]!r} ({cfg.origin[key]})")
        val[leaf] = value
        filled.append(f"{key}={value!r}")
    line = []
    if filled:
        line.append(f"sampled its own way, {', '.join(filled)}" + (f", not the flow-matching sampler's "
                                                                    f"{', '.join(replaced)}" if replaced else ""))
    note = sampling_note(obj, val["sampler"], val["steps"], val["guidance_scale"], flags=False)
    if note:  # a choice of the run's: the sampler, or guidance on top
        keys = ["val.sampler"] * (val["sampler"] != "meanflow") + ["val.guidance_scale"] * (
            val["guidance_scale"] != 1 and obj["meanflow_guidance"] > 1)
        line.append(", ".join(f"{k}={val[k[4:]]!r} ({cfg.origin[k]})" for k in keys) + f": {note}; unset, "
                    f"{'they are' if len(keys) > 1 else 'it is'} its own")
    return [f"objective.meanflow: {'; '.join(line)}"] if line else []
