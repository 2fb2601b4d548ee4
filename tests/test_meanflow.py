"""MeanFlow (training/objectives/meanflow.py): the target against a hand-written finite difference, its stop-
gradient by the parameters' gradients, the JVP through the real MMDiT in every conditioning mode with controls, REPA
and x-prediction against reverse-mode autograd, r = t as flow matching exactly, a flow-matching run's weights as
the start of a MeanFlow run, the combinations refused at start-up, and a run that trains, resumes exactly,
exports and samples in one step with diffusers alone."""
import json
import math
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import common
import sample
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args
from test_export_pipeline import LOAD_AND_SAMPLE, repo_latents
from training.config import config
from training.evaluation import generation
from training.model.mmdit import build_denoiser
from training.objectives import meanflow, repa, xprediction
from training.run import start
from training.run.start import build_for_run
from training.sharing import pipeline_export

OBJECTIVE = {"meanflow": True, "meanflow_equal_share": 0.75, "meanflow_logit_mean": -0.4, "meanflow_logit_std": 1.0,
             "meanflow_weight_power": 1.0, "meanflow_guidance": 2.0, "meanflow_guidance_mix": 0.5, "prediction": "v",
             "meanflow_anchor": 0.0}


class Tiny(torch.nn.Module):
    """A small smooth stand-in for the Denoiser in float64: the Denoiser's call, nonlinear in x, t, the interval
    t - r (cond["interval"], timestep units) and the class (its null class when dropped)."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 3, generator=g, dtype=dtype) * 0.7)
        self.a = torch.nn.Parameter(torch.randn(3, 1, 1, generator=g, dtype=dtype))
        self.classes = torch.nn.Parameter(torch.randn(5, 3, 1, 1, generator=g, dtype=dtype))

    def forward(self, x, timestep, cond, noise_level=None):
        t, gap = (timestep / 1000).view(-1, 1, 1, 1), (cond["interval"] / 1000).view(-1, 1, 1, 1)
        label = torch.where(cond["drop"], 4, cond["label"])
        h = torch.einsum("ij,bjhw->bihw", self.w, x) * (1 + t) + gap * self.a + self.classes[label]
        return torch.tanh(h) * (1 + 0.5 * gap) + t * gap * x


def tiny_batch(n=6):
    g = torch.Generator().manual_seed(1)
    x0, noise = (torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(2))
    cond = {"label": torch.arange(n) % 4, "drop": torch.tensor([False, False, True, False, False, True][:n])}
    t = torch.tensor([0.9, 0.6, 0.8, 0.95, 0.7, 0.5], dtype=torch.float64)[:n]
    r = torch.tensor([0.9, 0.6, 0.1, 0.0, 0.35, 0.45], dtype=torch.float64)[:n]  # the first two: r = t
    return x0, noise, cond, t, r


def finite_difference_target(model, z, t, r, v, cond, prediction, h=1e-6):
    """v - (t - r) du/dt with du/dt = (u(z + h v, r, t + h) - u(z - h v, r, t - h)) / 2h: the total derivative along
    the path, r held, written out by hand."""
    def u(z, t):
        out = model(z, t * 1000, {**cond, "interval": (t - r) * 1000})
        return xprediction.velocity(out, z, t.view(-1, 1, 1, 1)) if prediction == "x0" else out

    dudt = (u(z + h * v, t + h) - u(z - h * v, t - h)) / (2 * h)
    return v - (t - r).view(-1, 1, 1, 1) * dudt


def hand_written_guidance(model, z, t, v, cond, obj, prediction):
    """v~ = omega v + kappa u(z, t, t | c) + (1 - omega - kappa) u(z, t, t | null), omega = w'(1 - kappa); v where
    dropped."""
    def u(drop):
        out = model(z, t * 1000, {**cond, "drop": drop, "interval": torch.zeros_like(t)})
        return xprediction.velocity(out, z, t.view(-1, 1, 1, 1)) if prediction == "x0" else out

    omega, kappa = obj["meanflow_guidance"] * (1 - obj["meanflow_guidance_mix"]), obj["meanflow_guidance_mix"]
    guided = omega * v + kappa * u(cond["drop"]) + (1 - omega - kappa) * u(torch.ones_like(cond["drop"]))
    return torch.where(cond["drop"].view(-1, 1, 1, 1), v, guided)


@pytest.mark.parametrize("prediction", ["v", "x0"])
def test_the_target_and_its_gradient_are_the_hand_written_finite_difference_ones(prediction):
    """The target (guided, JVP for the samples past the first two, r = t there) equals the finite-difference one in
    float64 to the float32 rounding of the model's output, and the parameters' gradients of the trained objective
    equal those of sg(w') |u - sg(target)|^2 with the hand-written target: a sign error, a wrong tangent or a
    missing stop-gradient each break it."""
    obj = {**OBJECTIVE, "prediction": prediction, "meanflow_equal_share": 2 / 6}  # the first two: r = t
    model = Tiny()
    x0, noise, cond, t, r = tiny_batch()
    t_ = t.view(-1, 1, 1, 1)
    z = (1 - t_) * x0 + t_ * noise
    v = xprediction.velocity(x0, z, t_) if prediction == "x0" else noise - x0
    with torch.no_grad():
        guided = hand_written_guidance(model, z, t, v, cond, obj, prediction)
        expected = finite_difference_target(model, z, t, r, guided, cond, prediction)
        got = meanflow.target(model, z, t, r, meanflow.guided_velocity(model, z, t, v, cond, obj, prediction), cond,
                              meanflow.equal_count(len(z), obj), prediction)
    assert meanflow.equal_count(len(z), obj) == 2 and (expected - guided).abs().max() > 0.1  # the JVP's term shows
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    loss, terms = meanflow.training_loss(model, model, x0, cond, t, r, (0, 2), noise, obj)
    (loss + sum(terms.values())).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = model(z, t * 1000, {**cond, "interval": (t - r) * 1000})
    u = xprediction.velocity(out, z, t_) if prediction == "x0" else out
    error = (u - expected).pow(2).mean(dim=(1, 2, 3))
    weight = 1 / (error.detach() + meanflow.WEIGHT_EPS / x0[0].numel())  # p = 1
    torch.testing.assert_close(loss.double(), error.detach(), rtol=1e-5, atol=1e-7)
    (weight * error).sum().backward()
    for a, b in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("power", [0.5, 2.0])
def test_the_adaptive_weight_takes_its_power(power):
    """meanflow_weight_power p other than the 1 and 0 every other test uses: the trained objective's weight is
    (|Delta|^2 + c / D)^-p, written out here with the authors' c = 0.01 and D = 3 x 4 x 4 elements, on the error
    against v (r = t, no guidance) computed by hand; its term is (w - 1) |Delta|^2 and the gradient is that of
    sg(w) |Delta|^2. A dropped power (1 / (|Delta|^2 + c / D)) is the same at p = 1."""
    obj = {**OBJECTIVE, "meanflow_weight_power": power, "meanflow_guidance": 1.0, "meanflow_guidance_mix": 0.0}
    model = Tiny()
    x0, noise, cond, t, _ = tiny_batch()
    loss, terms = meanflow.training_loss(model, model, x0, cond, t, t, (0, len(x0)), noise, obj)
    (loss + terms["adaptive_weight"]).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    t_ = t.view(-1, 1, 1, 1)
    u = model((1 - t_) * x0 + t_ * noise, t * 1000, {**cond, "interval": torch.zeros_like(t)})
    error = (u - (noise - x0)).pow(2).mean(dim=(1, 2, 3))
    weight = (error.detach() + 0.01 / 48) ** -power
    assert ((error.detach() + 0.01 / 48) ** -1 - weight).abs().min() > 0.1  # |Delta|^2 far from 1: p shows
    torch.testing.assert_close(loss.double(), error.detach(), rtol=1e-5, atol=1e-7)  # (the loss is float32)
    torch.testing.assert_close(terms["adaptive_weight"].double(), (weight - 1) * error.detach(), rtol=1e-5, atol=1e-7)
    (weight * error).sum().backward()
    for a, b in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def mmdit(mode, controls=(), prediction="v", extra=()):
    """A one-block MMDiT (8 px, patch 2) of a MeanFlow config, its interval embedding given weights (they start at
    zero), and a batch with every sample's r < t but the first."""
    cfg = config.load_config(fm.DEFAULTS, ["--data.num_classes=4", "--objective.meanflow=true",
                                           f"--conditioning.mode={mode}",
                                           f"--conditioning.controls={json.dumps(list(controls))}",
                                           "--model.num_layers=1",
                                           "--model.num_attention_heads=2", "--model.attention_head_dim=8",
                                           f"--objective.prediction={prediction}", *extra])
    torch.manual_seed(0)
    model = build_for_run(cfg, (1, 8, 8)).train()
    torch.nn.init.normal_(model.conditioner.interval_embed.linear_2.weight, std=0.02)
    n = 4
    cond = {"label": torch.arange(n) % 4, "drop": torch.tensor([False, True, False, False]),
            "orig_hw": torch.tensor([[8, 8], [12, 20], [30, 16], [8, 40]]),
            "crop_box": torch.tensor([[0, 0, 8, 8]] * n),
            "flip": torch.tensor([[0], [1], [0], [1]]), "drop_controls": torch.zeros(n, dtype=torch.bool)}
    z, v = torch.randn(n, 1, 8, 8), torch.randn(n, 1, 8, 8)
    return cfg, model, cond, z, v, torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.9, 0.2, 0.1, 0.0])


def reverse_mode_jvp(model, z, t, r, v, cond, prediction):
    """J (v, 1, 0) of u(z, t, r) by reverse mode (the double-backward trick: d/dw <J^T w, tangent>), an AD
    algorithm independent of torch.func.jvp's forward mode."""
    z, t, r = (x.clone().requires_grad_() for x in (z, t, r))
    with sdpa_kernel(SDPBackend.MATH):
        u = meanflow.average_velocity(model, z, t, r, cond, prediction)
        w = torch.zeros_like(u, requires_grad=True)
        grads = torch.autograd.grad(u, (z, t, r), w, create_graph=True)
        tangent = (v, torch.ones_like(t), torch.zeros_like(r))
        return torch.autograd.grad(grads, w, tangent)[0]


@pytest.mark.parametrize("mode,controls,prediction", [("disentangled", ["size", "crop", "flip"], "v"),
                                                      ("both", ["size"], "v"),
                                                      ("adanorm", ["crop", "flip"], "v"), ("disentangled", [], "x0")])
def test_the_jvp_through_the_mmdit_is_reverse_mode_autograds_in_every_mode(mode, controls, prediction):
    """Through the real MMDiT (math attention), in each conditioning mode, with the size / crop / flip controls
    (whose weight w(t) moves with t) and with x-prediction's conversion: the target's du/dt equals reverse-mode
    autograd's J (v, 1, 0) to float rounding, and a dropped condition's sample too."""
    cfg, model, cond, z, v, t, r = mmdit(mode, controls, prediction)
    with torch.no_grad():
        got = meanflow.target(model, z, t, r, v, cond, 1, prediction)
    dudt = reverse_mode_jvp(model, z[1:], t[1:], r[1:], v[1:], {k: x[1:] for k, x in cond.items()}, prediction)
    expected = torch.cat([v[:1], v[1:] - (t - r)[1:].view(-1, 1, 1, 1) * dudt])
    assert (t - r)[1:].view(-1, 1, 1, 1).mul(dudt).abs().max() > 1e-2  # the derivative's term is there to check
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_repa_aligns_the_differentiated_forwards_tokens(tiny_dino):
    """REPA with MeanFlow: its term is the projector's alignment of the ordinary forward's tokens at (z_t, r, t), the
    same pass as u; the target is REPA's no business (the same with and without it)."""
    extra = ["--objective.repa_weight=0.5", f"--objective.repa_encoder={tiny_dino}", "--objective.repa_block=1",
             "--objective.repa_projector_dim=24"]
    cfg, model, cond, z, _, t, r = mmdit("disentangled", extra=extra)
    obj = {**cfg.objective, "meanflow_equal_share": 0.25}
    x0, noise = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(2)).tanh(), torch.randn(4, 1, 8, 8)
    targets = torch.randn(4, 16, 16)
    torch.manual_seed(3)
    loss, terms = meanflow.training_loss(model, model, x0, cond, t, r, (0, 1), noise, obj, align=(targets, 0.5))
    torch.manual_seed(3)
    plain, _ = meanflow.training_loss(model, model, x0, cond, t, r, (0, 1), noise, obj)
    torch.testing.assert_close(loss, plain)
    t_ = t.view(-1, 1, 1, 1)
    _, tokens = model((1 - t_) * x0 + t_ * noise, t * 1000, {**cond, "interval": (t - r) * 1000}, align=True)
    torch.testing.assert_close(terms["repa"], repa.terms(tokens, (targets, 0.5))["repa"])
    (loss + sum(terms.values())).sum().backward()
    assert all(p.grad is not None for p in model.projector.parameters())


@pytest.mark.parametrize("prediction", ["v", "x0"])
def test_r_equal_to_t_is_flow_matching_exactly(prediction):
    """Every sample r = t, guidance 1 with no mix, p = 0: the loss is flow matching's bitwise (the same forward, the
    same target, x-prediction's clamp below T_MIN included), and so are the gradients; the JVP's path at r = t
    gives v itself."""
    cfg, model, cond, _, v, _, _ = mmdit("disentangled", prediction=prediction)
    obj = {**cfg.objective, "meanflow_equal_share": 1.0, "meanflow_guidance": 1.0, "meanflow_guidance_mix": 0.0,
           "meanflow_weight_power": 0.0}
    x0, noise = torch.randn(4, 1, 8, 8).tanh(), torch.randn(4, 1, 8, 8)
    t = torch.tensor([0.02, 0.3, 0.6, 0.97])  # one below x-prediction's T_MIN
    loss, terms = meanflow.training_loss(model, model, x0, cond, t, t, (0, 4), noise, obj)
    assert terms == {}
    loss.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected, _ = fm.training_loss(model, x0, cond, t, noise, prediction)
    expected.sum().backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    with torch.no_grad():
        z = torch.randn(4, 1, 8, 8)
        assert torch.equal(meanflow.target(model, z, t, t, v, cond, 0, prediction), v)


def test_the_times_follow_the_paper():
    """t >= r, the first round(0.75 n) with r = t, both logit-normal(-0.4, 1) draws sorted: medians sigmoid(-0.4 +-
    0.545) (the median of the larger / smaller of two standard normals: +-0.5449)."""
    torch.manual_seed(0)
    t, r, (_, equal) = meanflow.sample_times(200_000, OBJECTIVE, 1.0, torch.device("cpu"))
    assert equal == 150_000 and (t >= r).all() and torch.equal(t[:150_000], r[:150_000]) and \
        (t[150_000:] > r[150_000:]).all()
    logit = lambda x: (x / (1 - x)).log()  # noqa: E731
    torch.testing.assert_close(logit(t).median(), torch.tensor(-0.4 + 0.5449), atol=0.01, rtol=0)
    torch.testing.assert_close(logit(r[150_000:]).median(), torch.tensor(-0.4 - 0.5449), atol=0.015, rtol=0)



@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_the_r_equal_to_t_share_holds_at_any_micro_batch(n):
    """r = t for share x n of a micro-batch on average at any n: a micro-batch of 1 or 2 (train.batch_size 'auto' on a
    large model) trains r != t on 25% of its samples too, not never (round(0.75 n) = n there: flow matching
    alone). A whole share x n is drawn without the RNG: 0.75 x 64 is always 48."""
    random.seed(0)
    counts = torch.tensor([meanflow.sample_times(n, OBJECTIVE, 1.0, torch.device("cpu"))[2][1] for _ in range(4000)],
                          dtype=torch.float64)
    assert set(counts.tolist()) <= {float(int(0.75 * n)), float(int(0.75 * n) + 1)}
    frac = 0.75 * n - int(0.75 * n)  # the mean of 4,000 draws of floor + Bernoulli(frac): within 5 standard errors
    assert abs(counts.mean() - 0.75 * n) < 5 * (frac * (1 - frac) / 4000) ** 0.5 + 1e-12
    state = random.getstate()
    assert meanflow.equal_count(64, OBJECTIVE) == 48 and random.getstate() == state


# ----------------------------------------------------------------------------------------------------------
# The flow-matching anchor (objective.meanflow_anchor, FACM): 0 is MeanFlow as before, 1 flow matching's loss.


def test_without_the_anchor_the_draws_are_the_ones_before_the_key():
    """meanflow_anchor 0: sample_times draws what it drew before the key, bitwise, and leaves torch's and Python's
    generators where that left them (a run without the anchor trains as before, step for step): one (n, 2) normal
    draw for t and r, one Python draw for the fractional r = t count, none for the anchor's whole 0."""
    obj = {**OBJECTIVE, "meanflow_equal_share": 0.6}  # 0.6 x 6 = 3.6: the equal count is drawn
    torch.manual_seed(3), random.seed(3)
    t, r, split = meanflow.sample_times(6, obj, 2.0, torch.device("cpu"), flow_time=lambda k: torch.rand(k))
    after = torch.get_rng_state(), random.getstate()
    torch.manual_seed(3), random.seed(3)
    draws = common.time_shift(torch.sigmoid(-0.4 + torch.randn(6, 2)), 2.0)
    equal = 3 + (random.random() < 0.6)
    assert split == (0, equal) and torch.equal(t, draws.max(1).values)
    assert torch.equal(r, torch.cat([t[:equal], draws.min(1).values[equal:]]))
    assert torch.equal(torch.get_rng_state(), after[0]) and random.getstate() == after[1]


@pytest.mark.parametrize("prediction", ["v", "x0"])
def test_at_share_one_the_loss_is_the_trainers_flow_matching_loss(prediction):
    """meanflow_anchor 1 (no guidance in the target): every sample is the anchor, its times flow matching's own
    (the trainer's sample_time, drawn from the same generator state), r = t, and the loss and the gradients of what
    is trained (the adaptive weight left at its default p = 1) are the trainer's flow-matching ones, bitwise."""
    cfg, model, cond, _, _, _, _ = mmdit("disentangled", prediction=prediction)
    obj = {**cfg.objective, "meanflow_anchor": 1.0, "meanflow_guidance": 1.0, "meanflow_guidance_mix": 0.0}
    assert obj["meanflow_weight_power"] == 1.0
    x0, noise = torch.randn(4, 1, 8, 8).tanh(), torch.randn(4, 1, 8, 8)
    flow_time = lambda k: fm.sample_time(k, cfg.objective, 1.5, torch.device("cpu"))  # noqa: E731
    torch.manual_seed(4)
    t, r, split = meanflow.sample_times(4, obj, 1.5, torch.device("cpu"), flow_time)
    torch.manual_seed(4)
    assert torch.equal(t, flow_time(4)) and torch.equal(r, t) and split == (4, 4)
    loss, terms = meanflow.training_loss(model, model, x0, cond, t, r, split, noise, obj)
    (loss + sum(terms.values())).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected, _ = fm.training_loss(model, x0, cond, t, noise, prediction)
    expected.sum().backward()
    assert torch.equal(loss, expected) and torch.equal(terms["adaptive_weight"], torch.zeros(4))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_an_intermediate_share_splits_the_batch_as_documented():
    """meanflow_anchor 0.5 and meanflow_equal_share 0.5 on 8 samples: the first 4 are the anchor (times from
    flow_time, drawn after MeanFlow's own, r = t, flow matching's unweighted loss against the guided velocity v~, as
    FACM's anchor), the next 2 MeanFlow's r = t (adaptively weighted), the last 2 r < t against the JVP's target;
    each of the three logged apart (parts). Target and gradient against the hand-written ones (finite differences,
    written-out guidance)."""
    obj = {**OBJECTIVE, "meanflow_anchor": 0.5, "meanflow_equal_share": 0.5}
    torch.manual_seed(5)
    t, r, split = meanflow.sample_times(8, obj, 1.0, torch.device("cpu"), lambda k: torch.rand(k, dtype=torch.float64))
    torch.manual_seed(5)
    draws = torch.sigmoid(-0.4 + torch.randn(4, 2)).double()
    anchor_t = torch.rand(4, dtype=torch.float64)
    assert split == (4, 6) and torch.equal(t, torch.cat([anchor_t, draws.max(1).values]))
    assert torch.equal(r[:6], t[:6]) and torch.equal(r[6:], draws.min(1).values[2:]) and (r[6:] < t[6:]).all()
    parts = meanflow.parts(t, r, split, obj)
    assert [parts[k].nonzero().flatten().tolist() for k in ("anchor", "r_eq_t", "r_lt_t")] == [[0, 1, 2, 3], [4, 5],
                                                                                             [6, 7]]
    model = Tiny()
    x0, noise, cond, _, _ = tiny_batch(6)
    x0, noise = torch.cat([x0, x0[:2].flip(1)]), torch.cat([noise, noise[:2].flip(1)])
    cond = {"label": torch.arange(8) % 4, "drop": torch.tensor([False, True, False, False, False, True, False, False])}
    loss, terms = meanflow.training_loss(model, model, x0, cond, t, r, split, noise, obj)
    (loss + sum(terms.values())).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    t_ = t.view(-1, 1, 1, 1)
    z = (1 - t_) * x0 + t_ * noise
    with torch.no_grad():
        expected = finite_difference_target(model, z, t, r, hand_written_guidance(model, z, t, noise - x0, cond, obj,
                                                                                  "v"), cond, "v")
    error = (model(z, t * 1000, {**cond, "interval": (t - r) * 1000}) - expected).pow(2).mean(dim=(1, 2, 3))
    weight = torch.cat([torch.ones(4, dtype=torch.float64), 1 / (error[4:].detach() + meanflow.WEIGHT_EPS / 48)])
    torch.testing.assert_close(loss.double(), error.detach(), rtol=1e-5, atol=1e-7)
    assert torch.equal(terms["adaptive_weight"][:4], torch.zeros(4)) and (terms["adaptive_weight"][4:] != 0).all()
    (weight * error).sum().backward()
    for a, b in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n", [1, 3, 6])
def test_the_anchors_share_holds_at_any_micro_batch(n):
    """The anchor's count is share x n on average at any n, by share_count's random rounding (a fixed round() gives a
    micro-batch of 1 no anchor at 0.25, and of 3 a third)."""
    random.seed(1)
    obj = {**OBJECTIVE, "meanflow_anchor": 0.25}
    counts = torch.tensor([meanflow.sample_times(n, obj, 1.0, torch.device("cpu"), torch.rand)[2][0]
                           for _ in range(4000)], dtype=torch.float64)
    frac = 0.25 * n - int(0.25 * n)
    assert set(counts.tolist()) <= {float(int(0.25 * n)), float(int(0.25 * n) + 1)}
    assert abs(counts.mean() - 0.25 * n) < 5 * (frac * (1 - frac) / 4000) ** 0.5 + 1e-12


# ----------------------------------------------------------------------------------------------------------
# Where the interval enters (objective.meanflow_interval_blocks, Decoupled MeanFlow).


def tokens_after(model, block, z, t, cond):
    """The image tokens after `block` (1-based) of the model's forward: REPA's hook with an identity projector."""
    model.projector, model.align_block = torch.nn.Identity(), block
    try:
        return model(z, t * 1000, cond, align=True)[1]
    finally:
        model.projector, model.align_block = None, None


def test_the_interval_enters_only_the_last_blocks_and_all_of_them_is_the_papers_placement():
    """meanflow_interval_blocks K of 3 blocks, controls and the class vector in the adaptive norm: the tokens after the
    first 3 - K blocks do not depend on the interval and those after the next one do; K = 3 is the paper's placement
    (every block and the final norm) to float rounding, and K = 1 is not."""
    outputs = {}
    for blocks in (None, 3, 1):
        extra = ["--model.num_layers=3"] + [f"--objective.meanflow_interval_blocks={blocks}"] * bool(blocks)
        cfg, model, cond, z, _, t, r = mmdit("both", ["size", "flip"], extra=extra)
        assert model.conditioner.interval_blocks == blocks
        model.eval()
        with torch.no_grad():
            gaps = [{**cond, "interval": gap * 1000} for gap in (torch.zeros_like(t), t - r)]
            outputs[blocks] = model(z, t * 1000, gaps[1])
            if blocks == 1:
                a, b = (tokens_after(model, 2, z, t, c) for c in gaps)
                assert torch.equal(a, b)
                a, b = (tokens_after(model, 3, z, t, c) for c in gaps)
                assert (a - b).abs().max() > 1e-4
    torch.testing.assert_close(outputs[3], outputs[None], rtol=1e-5, atol=1e-6)
    assert (outputs[1] - outputs[None]).abs().max() > 1e-4


@pytest.mark.parametrize("blocks,mode,controls", [(None, "disentangled", []), (1, "both", ["size", "flip"])])
def test_a_flow_matching_runs_weights_start_a_meanflow_run_as_that_model(tmp_path, blocks, mode, controls):
    """init_from an export of a flow-matching model: the MeanFlow model's interval embedding is the only thing
    missing, kept at its zero start, so before the first step its outputs are the source's, bitwise, at r = t and
    at any other r; with the interval in every block (the paper's) and in the last of two only (Decoupled
    MeanFlow's placement, the class vector and controls in the adaptive norm beside it)."""
    shape = ["--model.num_layers=2", f"--conditioning.mode={mode}", f"--conditioning.controls={json.dumps(controls)}"]
    source_cfg = config.load_config(fm.DEFAULTS, ["--data.num_classes=4", "--model.num_layers=1",
                                                  "--run_dir", str(tmp_path),
                                                  "--model.num_attention_heads=2", "--model.attention_head_dim=8",
                                                  *shape])
    torch.manual_seed(0)
    source = build_denoiser(source_cfg, 1, 8).eval()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.1 * torch.randn_like(p))
    folder = pipeline_export.write(source, json.loads(json.dumps(source_cfg)), tmp_path / "export")
    cfg, model, cond, z, _, t, r = mmdit(mode, controls, extra=shape + [
        f"--objective.meanflow_interval_blocks={blocks}"] * bool(blocks))
    assert model.conditioner.interval_blocks == blocks
    torch.nn.init.zeros_(model.conditioner.interval_embed.linear_2.weight)  # as built (mmdit() gave it weights)
    ema = build_for_run(cfg, (1, 8, 8))
    report = start.init_from(str(folder), model, ema, log=lambda *a: None)
    assert sorted(report["missing"]) == sorted(f"conditioner.interval_embed.{k}" for k in
                                               ("linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"))
    model.eval()
    with torch.no_grad():
        for gap in (torch.zeros_like(t), t - r):
            assert torch.equal(model(z, t * 1000, {**cond, "interval": gap * 1000}), source(z, t * 1000, cond))
        assert torch.equal(ema(z, t * 1000, cond), source(z, t * 1000, cond))


# ----------------------------------------------------------------------------------------------------------
# MeanFlow on several processes: DDP and FSDP2 against one process on the same global batch.

DATA_PARALLEL = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import test_meanflow
test_meanflow.data_parallel_steps(sys.argv[1:-1], sys.argv[-1])
"""


def data_parallel_steps(modes, out):
    """Two SGD steps of MeanFlow's whole objective (the anchor on a quarter, guidance 2 with kappa 0.5, the adaptive
    weight, the interval in the last of two blocks, a size control) on a global batch of 2 x 4 samples, each half
    split as (1 anchored, 1 MeanFlow r = t, 2 r < t), for each train.sharding of `modes` on this launch's
    processes: rank k of N takes halves 2k / N .. 2(k + 1) / N - 1, one micro-batch each, accumulated as the loop
    accumulates them (so one process is the two-process run's global batch). The model, its wrapping and the
    target's bare module are the trainer's (sharding.shard, sharding.prepare, accelerator.unwrap_model). Rank 0
    writes {mode: (the two steps' losses, the weights after them)} to `out` and returns it."""
    from training.run import sharding

    accelerator = common.make_accelerator("no", 5)
    rank, world, results = accelerator.process_index, accelerator.num_processes, {}
    mine = range(rank * 2 // world, (rank + 1) * 2 // world)
    for mode in modes:
        cfg = config.load_config(fm.DEFAULTS, [
            "--data.num_classes=4", "--objective.meanflow=true", "--model.num_layers=2",
            "--model.num_attention_heads=2", "--model.attention_head_dim=8", "--objective.meanflow_anchor=0.25",
            "--objective.meanflow_interval_blocks=1", '--conditioning.controls=["size"]', f"--train.sharding={mode}",
            "--train.batch_size=4"])
        torch.manual_seed(0)
        model, ema = build_for_run(cfg, (1, 8, 8)).train(), build_for_run(cfg, (1, 8, 8))
        torch.nn.init.normal_(model.conditioner.interval_embed.linear_2.weight, std=0.02)
        model, ema = sharding.shard(model, ema, cfg, accelerator)
        model, optimizer = sharding.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5), accelerator, cfg.train)
        raw, g, losses = accelerator.unwrap_model(model), torch.Generator().manual_seed(1), []
        for step in range(2):
            halves = [(torch.randn(4, 1, 8, 8, generator=g).tanh(), torch.randn(4, 1, 8, 8, generator=g),
                       torch.rand(4, generator=g) * 0.9 + 0.05) for _ in range(2)]
            total = 0
            for i, half in enumerate(mine):
                x0, noise, t = halves[half]
                r = torch.cat([t[:2], t[2:] * torch.tensor([0.5, 0.1])])
                cond = {"label": torch.tensor([0, 1, 2, 3]), "drop": torch.tensor([False, False, True, False]),
                        "orig_hw": torch.tensor([[8, 8], [12, 20], [30, 16], [8, 40]])}
                with sharding.no_sync(model, accelerator, skip=i < len(mine) - 1):
                    loss, terms = meanflow.training_loss(model, raw, x0, cond, t, r, (1, 2), noise, cfg.objective)
                    accelerator.backward((loss + sum(terms.values())).mean() / len(mine))
                total = total + loss.mean().detach() / len(mine)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(total, "mean").item())
        weights = {k: v.full_tensor() if common.is_dtensor(v) else v.detach().clone()  # FSDP: gathered (collective)
                   for k, v in accelerator.unwrap_model(model).state_dict().items()}
        results[mode] = (losses, weights)
    if accelerator.is_main_process:
        torch.save(results, out)
    if world > 1:
        common.end_processes(accelerator)
    return results


@pytest.mark.slow
@pytest.mark.xdist_group("gloo")
def test_two_processes_train_meanflow_as_one_process_on_the_same_global_batch_with_ddp_and_fsdp(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` over gloo: two SGD steps of MeanFlow's objective under DDP
    and under FSDP2 (train.sharding=fsdp) give one process's losses on the same global batch (its two halves
    accumulated) and its weights, to fp32 rounding. The JVP runs on the bare module outside either wrapper (through
    DDP's it fails: an in-place copy_ of a captured tensor, torch 2.14.1); sharded, through the bare module's own
    hooks, which all-gather its weights. And the trainer itself trains MeanFlow sharded on two processes, the anchor
    and the placement on: every rank logs the same parts (their all-reduce), and it exports."""
    script = tmp_path / "data_parallel.py"
    script.write_text(DATA_PARALLEL.format(root=str(ROOT), tests=str(ROOT / "tests")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          str(script), "ddp", "fsdp", str(tmp_path / "two.pt")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt")
    losses, weights = data_parallel_steps(["ddp"], tmp_path / "one.pt")["ddp"]
    assert losses[1] < losses[0] * 0.999  # the step moved the weights
    for mode in ("ddp", "fsdp"):
        assert two[mode][0] == pytest.approx(losses, rel=1e-5), mode
        assert two[mode][1].keys() == weights.keys()
        for key, value in weights.items():
            torch.testing.assert_close(two[mode][1][key], value, rtol=1e-4, atol=1e-6, msg=f"{mode} {key}")

    args = tiny_run_args(tmp_path, "fsdp", steps=2) + [
        "--train.sharding=fsdp", "--objective.meanflow=true", "--objective.meanflow_anchor=0.25",
        "--objective.meanflow_interval_blocks=1", "--log.every=1", "--log.report=false"]
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          str(ROOT / "train_flow_matching.py"), *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r[f"loss_{k}"]) for r in rows for k in ("anchor", "r_eq_t", "r_lt_t"))
    assert (tmp_path / "fsdp" / "export" / "model_index.json").is_file()


@pytest.mark.parametrize("arg,words", [("--objective.contrastive_weight=0.05", "objective.contrastive_weight=0.05 with "
                                        "objective.meanflow"),
                                       ("--objective.time_sampling=adaptive", "objective.time_sampling='adaptive' with "
                                        "objective.meanflow"),
                                       ("--objective.meanflow_anchor=1.5", "objective.meanflow_anchor"),
                                       ("--objective.meanflow_interval_blocks=0",
                                        "objective.meanflow_interval_blocks"),
                                       ("--objective.meanflow_interval_blocks=7",
                                        "objective.meanflow_interval_blocks=7: the model has 6 blocks "
                                        "(model.num_layers); give 1 .. 6 (Decoupled MeanFlow: the last third, 2)")])
def test_the_combinations_meanflow_cannot_make_are_refused_in_one_line(arg, words):
    with pytest.raises(config.ConfigError) as e:
        config.load_config(fm.DEFAULTS, ["--objective.meanflow=true", "--model.num_layers=6", arg], schema=fm.CONFIG)
    lines = [line for line in str(e.value).splitlines() if "meanflow" in line]
    assert len(lines) == 1 and words in lines[0]


@pytest.mark.parametrize("arg,words", [("--objective.meanflow_anchor=0.5", "objective.meanflow_anchor=0.5 without "
                                        "objective.meanflow: the anchor is the flow-matching share of a MeanFlow "
                                        "batch"),
                                       ("--objective.meanflow_interval_blocks=2",
                                        "objective.meanflow_interval_blocks=2 without objective.meanflow")])
def test_the_fine_tuning_keys_without_meanflow_are_refused_in_one_line(arg, words):
    """Each names its key and value, and the two ways out; and MeanFlow with FSDP (refused before issue 71) starts."""
    with pytest.raises(config.ConfigError) as e:
        config.load_config(fm.DEFAULTS, [arg], schema=fm.CONFIG)
    lines = [line for line in str(e.value).splitlines() if "meanflow" in line]
    assert len(lines) == 1 and words in lines[0] and "set objective.meanflow=true, or" in lines[0]
    config.load_config(fm.DEFAULTS, ["--objective.meanflow=true", "--train.sharding=fsdp", "--train.batch_size=8",
                                     "--objective.meanflow_anchor=0.5"], schema=fm.CONFIG)


def test_the_sampler_steps_the_average_velocity():
    """sampler "meanflow": z_r = z_t - (t - r) u(z_t, r, t) on the grid, the interval t - r given to the model (written
    out here for 2 steps); a model without the interval input takes Euler's steps."""
    model = Tiny(torch.float32)
    noise = torch.randn(2, 3, 4, 4)
    cond = {"label": torch.tensor([0, 3]), "drop": torch.zeros(2, dtype=torch.bool)}
    x = fm.sample(model, noise, cond, 2, method="meanflow")
    z = noise
    with torch.no_grad():
        for t, r in ((1.0, 0.5), (0.5, 0.0)):
            z = z - (t - r) * model(z, torch.full((2,), t * 1000),
                                    {**cond, "interval": torch.full((2,), (t - r) * 1000)})
    torch.testing.assert_close(x, z, rtol=1e-6, atol=1e-6)
    cfg = config.load_config(fm.DEFAULTS, ["--data.num_classes=4", "--model.num_layers=1",
                                           "--model.num_attention_heads=2",
                                           "--model.attention_head_dim=8"])
    plain = build_denoiser(cfg, 1, 8).eval()
    noise, cond = torch.randn(2, 1, 8, 8), {"label": torch.tensor([0, 3]), "drop": torch.zeros(2, dtype=torch.bool)}
    assert torch.equal(fm.sample(plain, noise, cond, 3, method="meanflow"), fm.sample(plain, noise, cond, 3))


def resolved(args, capsys):
    """(val.sampler, val.steps, val.guidance_scale) of a flow-matching start with `args`, and the lines it printed
    about them."""
    cfg = config.load_config(fm.DEFAULTS, args, method="flow_matching", schema=fm.CONFIG)
    lines = [line for line in capsys.readouterr().out.splitlines() if "meanflow" in line]
    return (cfg.val.sampler, cfg.val.steps, cfg.val.guidance_scale), lines


def test_a_meanflow_run_samples_its_own_way_unless_it_chooses_another_and_then_says_so(tmp_path, capsys):
    """objective.meanflow: val.sampler, val.steps and val.guidance_scale that the run does not choose become its own
    (the meanflow sampler, OWN_STEPS, guidance 1 on top of the 2 in the weights), also over a flow-matching recipe's
    (its 20 Euler steps at guidance 2 are for Euler); a MeanFlow recipe's own choice and the command line's are kept,
    and a choice of another sampler or of guidance on top prints one line saying what it does."""
    MF = "--objective.meanflow=true"
    assert resolved([], capsys) == (("euler", 32, 7.0), [])  # flow matching: untouched
    own, lines = resolved([MF], capsys)
    assert own == ("meanflow", meanflow.OWN_STEPS, 1.0) and len(lines) == 1 and "sampled its own way" in lines[0]
    own, lines = resolved(["--config", "configs/fashion_mnist.json", MF], capsys)
    assert own == ("meanflow", meanflow.OWN_STEPS, 1.0) and len(lines) == 1
    assert "not the flow-matching sampler's val.steps=20 (from configs/fashion_mnist.json)" in lines[0]
    recipe = tmp_path / "mf.json"
    recipe.write_text(json.dumps({"objective": {"meanflow": True}, "val": {"steps": 1}}))
    assert resolved(["--config", str(recipe)], capsys)[0] == ("meanflow", 1, 1.0)  # a MeanFlow recipe's choice
    assert resolved([MF, "--val.steps=4"], capsys)[0] == ("meanflow", 4, 1.0)
    own, lines = resolved([MF, "--val.sampler=euler"], capsys)
    assert own == ("euler", 32, 1.0) and len(lines) == 1  # Euler's own steps; no guidance on top
    assert "val.sampler='euler' (from --val.sampler=euler): the euler sampler's 32 steps follow the model's r = t" \
        in lines[0]
    own, lines = resolved([MF, "--val.guidance_scale=3"], capsys)
    assert own == ("meanflow", meanflow.OWN_STEPS, 3.0) and len(lines) == 1
    assert "guidance 3 comes on top of the 2 trained into its weights" in lines[0]
    assert resolved([MF, "--objective.meanflow_guidance=1"], capsys)[0] == ("meanflow", meanflow.OWN_STEPS, 7.0)
    assert meanflow.sampling_note(OBJECTIVE, "meanflow", 2, 1.0) is None  # its own way: nothing to say
    assert meanflow.sampling_note({"prediction": "v"}, "euler", 32, 7.0) is None  # no MeanFlow model


@pytest.mark.slow
def test_a_meanflow_model_recorded_with_eulers_settings_says_so_wherever_it_is_sampled(tmp_path, monkeypatch, capsys):
    """A MeanFlow run trained before it sampled its own way by default records val.sampler='euler', 32 steps and
    guidance 7: its export, sample.py, eval_fid.py and tools/tune.py each say so in one line (with the flags of its
    own way), and say nothing when it is sampled its own way; tune.py searches guidance 1 unless told."""
    import eval_fid
    from tools import tune

    run = tmp_path / "run"
    cfg = config.load_config(fm.DEFAULTS, ["--objective.meanflow=true", "--data.resolution=8", "--data.num_classes=4",
                                           "--model.num_layers=1", "--model.num_attention_heads=2",
                                           # as before: no resolver
                                           "--model.attention_head_dim=8", "--run_dir", str(run)])
    cfg = json.loads(json.dumps(cfg))
    assert (cfg["val"]["sampler"], cfg["val"]["steps"], cfg["val"]["guidance_scale"]) == ("euler", 32, 7.0)
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg))
    pipeline_export.write(build_denoiser(cfg, 3, 8).eval(), cfg, run / "export", run_dir=run)
    said = [line for line in capsys.readouterr().out.splitlines() if "MeanFlow" in line]
    assert len(said) == 1 and "the pipeline's defaults sample a MeanFlow model otherwise: the euler sampler's 32" in \
        said[0] and "guidance 7 comes on top of the 2" in said[0]

    def notes(main, *flags):
        main(["--run", str(run), "--steps", "1", *flags])
        return [line for line in capsys.readouterr().out.splitlines() if "MeanFlow" in line]

    for main, flags in ((sample.main, ["--classes", "0", "--per_class", "1", "--out"]),
                        (eval_fid.main, ["--num_samples", "1", "--generate_only", "--out_dir"])):
        said = notes(main, *flags, str(tmp_path / "euler"))
        assert len(said) == 1 and "the euler sampler's 1 step follows" in said[0], main
        assert "(its own way: --sampler meanflow --steps 2 --guidance_scale 1)" in said[0]
        assert notes(main, *flags, str(tmp_path / "own"), "--sampler", "meanflow", "--guidance_scale", "1") == []
    calls = []
    monkeypatch.setattr(eval_fid, "main", lambda argv, feature_fn=None, written_by=None: calls.append(
        eval_fid.parse_args(argv)) or {"metrics": {"fd_classifier_1": float(len(calls)), "class_accuracy_1": 0.5},
                                       "warnings": []})
    tune.main(["--run", str(run), "--sampler", "meanflow", "--num_samples", "1", "--confirm_samples", "0"])
    assert sorted(a.steps for a in calls) == [1, 2, 4] and all(a.guidance_scale == 1.0 for a in calls)
    assert [line for line in capsys.readouterr().out.splitlines() if "MeanFlow" in line] == []
    tune.main(["--run", str(run), "--num_samples", "1", "--confirm_samples", "0", "--guidance", "1,3"])
    said = [line for line in capsys.readouterr().out.splitlines() if "MeanFlow" in line]
    assert len(said) == 1 and "the euler sampler's 32 steps" in said[0]  # once, not per evaluation


@pytest.mark.slow
def test_a_meanflow_run_trains_resumes_exactly_exports_and_samples_in_one_step_with_diffusers_alone(tmp_path):
    """The Fashion-MNIST variant's settings on the tiny demo: 4 steps straight, and the same run stopped at its step-2
    checkpoint and resumed: the same losses and, bitwise, the same weights (MeanFlow's draws come from the run's
    RNG). Validation and the export sample its own way by default (the meanflow sampler, no guidance on top): the
    export, loaded where this repository cannot be imported, samples in one step what sample.py does."""
    args = tiny_run_args(tmp_path, "straight", steps=4) + [
        "--model.num_layers=1", "--log.every=1", "--ckpt.every=2", "--log.report=false", "--objective.meanflow=true",
        "--objective.prediction=x0", "--val.steps=1"]  # its own sampler and guidance 1 by default
    run = fm.main(args)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("loss_adaptive_weight" in r for r in rows if "loss" in r)
    assert [r["val_nfe"] for r in rows if "val_nfe" in r] == [1.0]  # validation: one evaluation an image
    # each kind of sample's loss beside the whole one (12 r = t and 4 r < t of 16): the loop hands the Monitor the parts
    losses = [(r["loss"], r["loss_r_eq_t"], r["loss_r_lt_t"]) for r in rows if "loss" in r]
    assert len(losses) == 4 and all(abs(a - (12 * b + 4 * c) / 16) < 1e-5 * a for a, b, c in losses)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004"), shutil.rmtree(resumed / "export")
    fm.main([*args, "--run_dir", str(resumed), "--resume", "latest"])
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again if "loss" in r] == [r["loss"] for r in rows if "loss" in r]
    from safetensors.torch import load_file
    for name in ("model", "ema"):
        a, b = (load_file(str(d / "checkpoints" / "step_00000004" / f"{name}.safetensors")) for d in (run, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a), name

    job = {"name": "meanflow", "folder": str(run / "export"), "prompts": ["red circle", "8"],
           "seeds": [generation.seed_for(0, 0, i) for i in range(2)], "kwargs": {}}
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-I", "-c", LOAD_AND_SAMPLE, json.dumps([job]), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(ROOT) not in done.stderr
    theirs = torch.load(tmp_path / "out.pt")["meanflow"]["latent"]
    torch.testing.assert_close(theirs, repo_latents(run, [0, 8]), atol=2e-4, rtol=1e-4)
    model, cfg, _ = sample.sampling.load_model(run)
    cond = {"label": torch.tensor([0, 8]), "drop": torch.zeros(2, dtype=torch.bool)}
    with torch.no_grad(), common.counting_evaluations(model) as rows:
        fm.generate(model, torch.randn(2, 3, 16, 16), cond, cfg)
    assert rows[0] == 2  # one evaluation an image
    index = json.loads((run / "export" / "model_index.json").read_text())
    assert (index["sampler"], index["num_inference_steps"], index["guidance_scale"]) == ("meanflow", 1, 1.0)
    assert "made for sampling in 1 step of its `meanflow` sampler" in (run / "export" / "README.md").read_text()


@pytest.mark.slow
def test_the_fine_tuning_recipe_starts_from_a_flow_matching_run_resumes_exactly_and_exports_one_step(tmp_path):
    """configs/fashion_mnist_meanflow.json, shrunk (the embedded data at 16 px, three narrow blocks): a flow-matching
    run of configs/fashion_mnist.json shrunk the same way, then the recipe with its init_from pointed at it. The run
    starts from that run's weights, trains with the anchor and the interval in the last two blocks, and stopped at its
    step-2 checkpoint and resumed gives the same losses and, bitwise, the same weights; its export samples in one
    step what the trainer's sampler does (the folder's pipeline, assembled as diffusers does), at guidance 1."""
    from safetensors.torch import load_file
    from test_export_pipeline import folder_pipeline

    shrink = [a for a in tiny_run_args(tmp_path, "x", steps=4) if not a.startswith(("--val.steps", "--run_dir",
                                                                                      str(tmp_path / "x")))]
    shrink += ["--data.source=embedded", "--data.resolution=16", "--model.num_layers=3", "--log.every=1",
               "--log.report=false"]
    source = fm.main(["--config", str(ROOT / "configs" / "fashion_mnist.json"), *shrink, "--train.max_steps=2",
                      "--val.reference_curves=null", "--run_dir", str(tmp_path / "source")])
    recipe = ["--config", str(ROOT / "configs" / "fashion_mnist_meanflow.json"), *shrink, "--ckpt.every=2",
              "--init_from", str(source)]
    run = fm.main([*recipe, "--run_dir", str(tmp_path / "run")])
    cfg = json.loads((run / "config.json").read_text())
    obj = cfg["objective"]
    assert (obj["meanflow_anchor"], obj["meanflow_interval_blocks"], cfg["init_from"]) == (0.5, 2, str(source))
    assert json.loads((run / "init_from.json").read_text())["loaded"] > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss_anchor" in r] == [1, 2, 3, 4]

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004"), shutil.rmtree(resumed / "export")
    fm.main([*recipe, "--run_dir", str(resumed), "--resume", "latest"])
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again if "loss" in r] == [r["loss"] for r in rows if "loss" in r]
    for name in ("model", "ema"):
        a, b = (load_file(str(d / "checkpoints" / "step_00000004" / f"{name}.safetensors")) for d in (run, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a), name

    pipe = folder_pipeline(run / "export")
    assert (pipe.config.sampler, pipe.config.num_inference_steps, pipe.config.guidance_scale) == ("meanflow", 1, 1.0)
    assert pipe.conditioner.config.interval_blocks == 2
    card = (run / "export" / "README.md").read_text()
    assert "made for sampling in 1 step of its `meanflow` sampler" in card
    assert "flow matching's own loss kept on 50% of each batch (FACM's anchor); the interval t - r in the last 2 " \
        "blocks only (Decoupled MeanFlow)" in card
    model, cfg, _ = sample.sampling.load_model(run)
    noise = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    cond = {"label": torch.tensor([0, 8]), "drop": torch.zeros(2, dtype=torch.bool)}
    with torch.no_grad(), common.counting_evaluations(model) as evaluations:
        ours = fm.generate(model, noise, cond, cfg)
    assert evaluations[0] == 2  # one evaluation an image
    theirs = pipe([0, 8], latents=noise, output_type="latent").images
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


# ---- Issue 71's fine-tuning lengths: benchmarks/meanflow_fashion_mnist.py aims ----------------------------------


def write_report(folder, step, sampler, steps, guidance, fd):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({"model": {"step": step}, "sampler": sampler, "steps": steps,
                                                    "guidance_scale": guidance, "metrics": {"fd_classifier_2k": fd}}))


def test_the_fine_tuning_lengths_are_read_against_the_recipes_fd_and_cpu(tmp_path, capsys):
    """Synthetic scores laid out as the campaign writes them: the recipe (20-step FD 1.0 and 2.0 for seeds 0 and 1,
    1,000 CPU s of steps each) and the anchor arm (600 steps in 2,000 CPU s: step 150 is half the recipe's CPU) whose
    one-evaluation FD ratio follows 6 f^-0.5 in the CPU fraction f: the rows' fractions and ratios, each aim's verdict
    on the seeds' mean, the paired difference between arms, flow matching's best at an evaluation count, and the
    power law's prediction (f = 4 for the 3x aim)."""
    from benchmarks import meanflow_fashion_mnist as mf

    out, base = tmp_path / "bench", tmp_path / "bench" / "base"
    for seed, fd in ((0, 1.0), (1, 2.0)):
        run = base / f"flow_matching_s{seed}"
        write_report(run / "eval" / "test-step1200", None, "euler", 20, 2.0, fd)
        (run / "config.json").write_text(json.dumps({"train": {"max_steps": 1200}}))
        (run / "cpu_seconds.json").write_text(json.dumps({"steps": 1000.0}))
        write_report(out / "scores" / f"flow_matching_s{seed}" / "euler1", None, "euler", 1, 1.0, 30 * fd)
        write_report(out / "scores" / f"flow_matching_s{seed}" / "euler1-g2", None, "euler", 1, 2.0, 20 * fd)
        for arm, offset in (("anchor", 0.0), ("plain", 0.5)):
            run = out / arm / f"flow_matching_s{seed}"
            run.mkdir(parents=True, exist_ok=True)
            (run / "config.json").write_text("{}")
            (run / "cpu_seconds.json").write_text(json.dumps({"steps": 2000.0}))
            for step in mf.SCORED_STEPS:
                fraction = 2000.0 * step / mf.LENGTH_STEPS / 1000.0
                for e, ratio in ((1, 6 * fraction ** -0.5), (2, 1.4), (20, 1.3)):
                    write_report(out / "scores" / f"{arm}_s{seed}" / f"step{step}-{e}", step, "meanflow", e, 1.0,
                                 (ratio + offset) * fd)
    args = mf.main.__globals__["argparse"].Namespace(out=str(out), base=str(base))
    rows = mf.length_rows(mf.reports(args), {0: {"fd_classifier_2k": 1.0}, 1: {"fd_classifier_2k": 2.0}},
                          mf.recipe_cpu(args), args)
    assert rows[("anchor", 150)]["fraction"] == {0: 0.5, 1: 0.5}
    assert rows[("anchor", 150)][1] == pytest.approx({0: 6 * 0.5 ** -0.5, 1: 6 * 0.5 ** -0.5})
    capsys.readouterr()
    mf.aims(args)
    printed = capsys.readouterr().out
    assert "| anchor | 150 | 0.50 [0.50, 0.50] | 8.49 [8.49, 8.49] | 1.40 [1.40, 1.40] | - | 1.30 [1.30, 1.30] | " \
           "1: not met, 2: met, 20: not met, CPU: met |" in printed
    assert "anchor - plain, step 75, 1 evaluations: -0.750 [-3.927, 2.427] (seeds [0, 1])" in printed
    assert "1 evaluations: FD 45.000 (euler 1, g1)" in printed and "2 evaluations: FD 30.000 (euler 1, g2)" in printed
    assert "anchor: one evaluation at 3x the recipe's FD predicted at 4.00x the recipe's training CPU" in printed
