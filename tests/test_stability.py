"""The stability parts (training/optimisation/time_density.py, clipping.py, convergence.py; training/run/rollback.py)
and the smoothing in monitor.py, against closed forms and known answers: the adaptive time density's importance weights
(unbiased), its update rule, the percentile clip on a planted spike, the gradient noise scale on synthetic gradients of
known noise and signal, the bias-corrected smoothed loss on a falling curve, the validation slopes; end to end (slow): a
planted NaN rolls back to the last good checkpoint with a lower LR and past the data window, on one and on two
processes, and a run with every new state resumes bitwise."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from training.config import config
from training.optimisation import clipping, convergence, smoothing, time_density
from training.run import checkpoints, monitor, stability
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args


def sampler(bins=8, mix=0.25, quantile=lambda u: u):
    return time_density.AdaptiveTimeDensity(bins, mix, quantile, Accelerator(cpu=True), log_every=1)


# ---- Adaptive time density ---------------------------------------------------------------------------------


def test_adaptive_weights_keep_the_objective_unbiased_in_closed_form():
    """Per bin k: p(k) = q_k and weight 1 / (K q_k), so E_p[w L] = sum_k q_k L_k / (K q_k) = mean_k L_k, the
    base objective (equal-mass bins), for any q. Checked in closed form from the weights the sampler returns,
    and by Monte Carlo with a known per-bin loss."""
    s, K = sampler(), 8
    s.q.copy_(torch.tensor([0.30, 0.02, 0.05, 0.10, 0.13, 0.20, 0.15, 0.05]))
    torch.manual_seed(0)
    u, w = s.draw(400_000)
    k = s.bins
    loss_of_bin = torch.tensor([3.0, 0.1, 0.5, 1.0, 2.0, 0.2, 0.7, 5.0])
    weight_of_bin = torch.stack([w[k == b][0] for b in range(K)])
    assert torch.equal(w, weight_of_bin[k])  # one weight per bin
    closed_form = (s.q * weight_of_bin * loss_of_bin).sum()  # sum_k p(k) w_k L_k
    torch.testing.assert_close(closed_form, loss_of_bin.mean(), rtol=1e-6, atol=0)
    # The draws: bin frequencies q, u inside its bin, and the Monte-Carlo estimate within 4 standard errors.
    freq = torch.bincount(k, minlength=K).float() / len(k)
    assert (freq - s.q).abs().max() < 4 * math.sqrt(0.3 * 0.7 / len(k))
    assert torch.equal((u * K).floor().long().clamp(max=K - 1), k)
    estimate = w * loss_of_bin[k]
    assert abs(estimate.mean() - loss_of_bin.mean()) < 4 * estimate.std() / math.sqrt(len(k))


def test_adaptive_density_is_the_square_root_of_the_second_moment_mixed_with_the_base():
    """After one interval: q_k = (1 - mix) sqrt(E[L^2 | k]) / sum_j sqrt(E[L^2 | j]) + mix / K (the variance-
    minimising density, mixed); bins never seen keep the base density; the variance of w L drops below the
    base density's."""
    s, K, mix = sampler(bins=4, mix=0.2), 4, 0.2
    s.draw(4)
    s.bins = torch.tensor([0, 1, 2, 2])  # bin 3 not seen yet: the density stays the base one
    s.observe(torch.tensor([1.0, 2.0, 3.0, 5.0]))
    s.update()
    assert torch.equal(s.q, torch.full((K,), 1 / K))
    second = torch.tensor([4.0, 1.0, 9.0, 0.25])  # E[L^2] per bin, from losses of known magnitude
    s.second_moment = smoothing.BiasCorrectedEMA(K, s.decay, "cpu")
    s.bins = torch.arange(K).repeat(10)
    s.observe(second.sqrt().repeat(10))
    s.update()
    root = second.sqrt()
    torch.testing.assert_close(s.q, (1 - mix) * root / root.sum() + mix / K)
    variance = lambda q: (second / (K ** 2 * q)).sum() - (second.sqrt() / K).sum() ** 2  # constant-loss bins
    assert variance(s.q) < variance(torch.full((K,), 1 / K))


def test_adaptive_draws_follow_the_base_density_within_each_bin():
    """Through the logit-normal inverse CDF, with a far from uniform q: given its bin k, a draw t must follow the
    base density restricted to the bin, whose CDF is K F(t) - k with F the logit-normal CDF Phi((logit t - m) / s)
    in closed form. A KS test per bin (scipy.stats.kstest against the uniform) at 1e-3, and every t inside its
    bin."""
    from scipy.stats import kstest, norm

    obj = config.Config(adaptive_base="logit_normal", logit_mean=0.3, logit_std=0.8)
    s, K = sampler(bins=8, quantile=lambda u: fm.time_quantile(u, obj, 1.0)), 8
    s.q.copy_(torch.tensor([0.30, 0.02, 0.05, 0.10, 0.13, 0.20, 0.15, 0.05]))
    torch.manual_seed(0)
    t, _ = s.draw(200_000)
    cdf = norm.cdf((torch.logit(t.double()).numpy() - 0.3) / 0.8)
    for k in range(K):
        within = K * cdf[(s.bins == k).numpy()] - k
        assert within.min() > -1e-5 and within.max() < 1 + 1e-5, k
        assert kstest(within, "uniform").pvalue > 1e-3, k


def test_the_density_estimate_after_bins_first_seen_at_different_times():
    """Three log intervals: bin 0 seen in the first two, bin 1 in the last two, bin 2 only in the last. Each
    bin's E[L^2] is the bias-corrected EMA of its own observations, (d a_1 + a_2) / (d + 1) for two and the one
    value for one; q stays the base density until every bin has been seen, then follows the closed form."""
    s, d, mix = sampler(bins=3, mix=0.25), time_density.AdaptiveTimeDensity.DECAY, 0.25
    seen = [([0, 0], [1.0, 3.0]), ([0, 1], [2.0, 4.0]), ([1, 2, 2], [1.0, 6.0, 2.0])]
    for i, (bins, losses) in enumerate(seen):
        s.draw(len(bins))
        s.bins = torch.tensor(bins)
        s.observe(torch.tensor(losses))
        s.update()
        if i < 2:
            assert torch.equal(s.q, torch.full((3,), 1 / 3))
    # the intervals' E[L^2]: bin 0 (1 + 9) / 2 = 5 then 4; bin 1 16 then 1; bin 2 (36 + 4) / 2 = 20
    estimate = torch.tensor([(d * 5 + 4) / (d + 1), (d * 16 + 1) / (d + 1), 20.0])
    torch.testing.assert_close(s.second_moment.value, estimate)
    root = estimate.sqrt()
    torch.testing.assert_close(s.q, (1 - mix) * root / root.sum() + mix / 3)


def test_a_nonfinite_loss_does_not_enter_the_adaptive_density():
    """One infinite (and one overflowing) per-sample loss among finite ones: the density is the closed form of
    the finite losses alone, and it stays there at the next update; the old sampler put 3.4e38 (nan_to_num) in
    the bin's E[L^2] and 1 - mix + mix / K of all draws into it."""
    s, K, mix = sampler(bins=4, mix=0.2), 4, 0.2
    s.draw(10)
    s.bins = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 1, 2])
    s.observe(torch.tensor([1.0, 2.0, 3.0, 0.5, 1.0, 2.0, 3.0, 0.5, float("inf"), 1e20]))
    s.update()
    root = torch.tensor([1.0, 2.0, 3.0, 0.5])  # sqrt(E[L^2]) of each bin's finite losses
    expected = (1 - mix) * root / root.sum() + mix / K
    torch.testing.assert_close(s.q, expected)
    assert torch.equal(s.second_moment.count, torch.ones(K))
    s.bins = torch.tensor([1])  # an interval with nothing finite: nothing changes
    s.observe(torch.tensor([float("nan")]))
    s.update()
    torch.testing.assert_close(s.q, expected)
    assert torch.equal(s.second_moment.count, torch.ones(K))


def test_flow_matching_base_quantile_is_the_logit_normal_inverse_cdf():
    """time_quantile(F(t)) = t for F the logit-normal CDF Phi((logit t - m) / s) (scipy), so the adaptive
    sampler's bins are equal-mass bins of sample_time's density."""
    from scipy.stats import norm

    obj = config.Config(adaptive_base="logit_normal", logit_mean=0.3, logit_std=0.8)
    t = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    u = torch.from_numpy(norm.cdf((torch.logit(t).numpy() - 0.3) / 0.8))
    torch.testing.assert_close(fm.time_quantile(u, obj, 1.0), t)
    assert torch.equal(fm.time_quantile(u, config.Config(adaptive_base="uniform"), 1.0), u)


# ---- Gradient clipping -------------------------------------------------------------------------------------


def clipper(history=100, percentile=95.0, cap=10.0):
    tr = config.Config(grad_clip_mode="adaptive", grad_clip=cap, grad_clip_percentile=percentile,
                       grad_clip_history=history)
    return clipping.GradClipper(tr, Accelerator(cpu=True))


def clip_step(clip, p, norm, accelerator):
    p.grad = torch.ones_like(p) * norm / math.sqrt(p.numel())
    return clip([p])


def test_a_planted_gradient_spike_is_clipped_to_the_historys_percentile_and_resume_is_exact():
    acc, p = Accelerator(cpu=True), torch.nn.Parameter(torch.zeros(16))
    clip, norms = clipper(), np.random.default_rng(0).uniform(0.5, 1.5, 120)
    for i, n in enumerate(norms):
        clip_step(clip, p, n, acc)
        if i == 10:  # fewer than 50 norms seen: the cap is the threshold
            assert float(clip.threshold) == 10.0
    clip_step(clip, p, float("nan"), acc)  # a non-finite norm is not recorded
    saved = json.loads(json.dumps(clip.state_dict()))
    total = clip_step(clip, p, 50.0, acc)  # the spike
    expected = np.percentile(norms[-100:], 95)  # the last N finite norms
    assert float(total) == pytest.approx(50.0)
    assert float(clip.threshold) == pytest.approx(expected, rel=1e-6)
    assert float(p.grad.norm()) == pytest.approx(expected, rel=1e-5)
    resumed = clipper()
    resumed.load_state_dict(saved)
    clip_step(resumed, p, 50.0, acc)
    assert torch.equal(resumed.threshold, clip.threshold) and torch.equal(resumed.history, clip.history)
    capped = clipper(cap=0.8)  # the cap bounds the percentile
    for n in norms:
        clip_step(capped, p, n, acc)
    assert float(capped.threshold) == pytest.approx(0.8)


# ---- Gradient noise scale ----------------------------------------------------------------------------------


@pytest.mark.parametrize("b_true", [8.0, 200.0])
def test_noise_scale_recovers_a_known_critical_batch_from_two_batch_sizes(b_true):
    """Per-sample gradients g + xi, xi ~ N(0, sigma^2 I): tr(Sigma) = D sigma^2 and B = tr(Sigma) / |g|^2.
    The step's small batch (B_small samples) is part of its big batch (B_big), as in the trainer."""
    gen, D, b_small, b_big = torch.Generator().manual_seed(0), 2000, 16, 128
    g = torch.randn(D, generator=gen, dtype=torch.float64)
    g /= g.norm()
    sigma = math.sqrt(b_true / D)
    est = convergence.NoiseScale(b_small, b_big, "cpu", decay=0.995)
    for _ in range(2000):
        small = g + sigma / math.sqrt(b_small) * torch.randn(D, generator=gen, dtype=torch.float64)
        rest = g + sigma / math.sqrt(b_big - b_small) * torch.randn(D, generator=gen, dtype=torch.float64)
        big = (b_small * small + (b_big - b_small) * rest) / b_big
        b = est.observe(small.pow(2).sum().float(), big.pow(2).sum().float())
    assert float(b) == pytest.approx(b_true, rel=0.10)


class Quadratic(torch.nn.Module):
    """Per-sample loss 0.5 |w - z|^2: the per-sample gradient w - z."""

    def __init__(self, dim):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, z):
        return 0.5 * (self.w - z).pow(2).sum(1)


def noise_scale_through_the_trainer(argv, steps=60, dim=4000, b_true=16.0, bad_step=None):
    """The noise scale as the trainers' loop measures it (backward of loss / accum under no_sync but the last,
    noise_scale.micro_batch, the clip, noise_scale.measure), on z ~ N(mu, s^2 I_D): the per-sample gradient w - z has
    mean w - mu and covariance s^2 I, so B_simple = tr(Sigma) / |G|^2 = D s^2 / |w - mu|^2 (McCandlish et
    al. 2018, eq. 2.8) exactly, here b_true with |w - mu| = 1. Each rank draws its own samples. `bad_step`:
    its last micro-batch has an infinite sample. Returns (the stability parts, the logged rows)."""
    from contextlib import nullcontext

    acc = Accelerator(cpu=True)
    cfg = config.load_config(fm.DEFAULTS, argv + ["--log.grad_every=1", "--run_dir=unused"], method="flow_matching",
                             schema=fm.CONFIG)
    tr, gen = cfg.train, torch.Generator().manual_seed(1000 * cfg.seed + acc.process_index)
    model = acc.prepare(Quadratic(dim))
    mu, s = torch.zeros(dim), math.sqrt(b_true / dim)
    mu[0] = 1.0
    logged = []
    stab = stability.Parts(cfg, acc, model, logged.append, {}, lambda u: u)
    for step in range(steps):
        for micro in range(tr.grad_accum):
            z = mu + s * torch.randn(tr.batch_size, dim, generator=gen)
            if step == bad_step and micro == tr.grad_accum - 1:
                z[0, 1] = float("inf")
            with acc.no_sync(model) if micro < tr.grad_accum - 1 else nullcontext():
                loss = model(z)
                acc.backward(loss.mean() / tr.grad_accum)
            stab.noise_scale.micro_batch(micro)
        stab.noise_scale.measure(stab.clip(model.parameters()))
        model.zero_grad(set_to_none=False)
    return stab, logged


def test_the_trainers_noise_scale_recovers_a_known_one_with_accumulation_and_skips_a_nonfinite_step(capsys):
    """One process, 4 micro-batches of 4: B_small 4 (the first micro-batch), B_big 16, B_true 16; the trainer's
    decay (0.9) over 60 steps: within 8% (8 seeds: 0.97-1.03). Step 30's gradient is infinite: that step
    enters nothing (no row, one estimate fewer) and no advice is printed; the old estimator was pinned at -1
    and told the user the batch was far above B_noise."""
    stab, logged = noise_scale_through_the_trainer(["--train.batch_size=4", "--train.grad_accum=4"], bad_step=30)
    g2, trace = stab.noise_scale.estimate.ema.value.tolist()
    assert (stab.noise_scale.estimate.b_small, stab.noise_scale.estimate.b_big) == (4, 16)
    assert trace / g2 == pytest.approx(16.0, rel=0.08)
    assert [r["step"] for r in logged] == [s for s in range(1, 61) if s != 31]
    assert stab.noise_scale.estimate.ema.count.tolist() == [59.0, 59.0]
    assert logged[-1]["grad_noise_scale"] == pytest.approx(trace / g2)
    assert "critical batch size" not in capsys.readouterr().out


def resume_mid_interval_on_this_rank():
    """Two ranks, log every 4 steps, a checkpoint's state taken after step 2 and loaded by a fresh Monitor and
    stability parts (as a resume does), then steps 3 and 4. Losses and bins are functions of (rank, step, sample), so
    the interval's loss, its per-bin losses and the density's E[L^2] per bin have a closed form over both ranks;
    each rank's share of steps 1-2 must count exactly once."""
    acc = Accelerator(cpu=True)
    cfg = config.load_config(fm.DEFAULTS, ["--objective.time_sampling=adaptive", "--objective.adaptive_bins=4",
                                           "--log.every=4", "--log.grad_every=0", "--run_dir=unused"],
                             method="flow_matching", schema=fm.CONFIG)
    model = acc.prepare(Quadratic(8))
    loss_of = lambda r, step: torch.tensor([1.0 + step + 10 * r + i for i in range(4)])
    bins_of = lambda r, step: torch.tensor([(step + r + i) % 4 for i in range(4)])

    def steps(mon, stab, first, last):
        for step in range(first, last):
            stab.density.draw(4)
            stab.density.bins = bins_of(acc.process_index, step)
            stab.density.observe(loss_of(acc.process_index, step))
            mon.micro_batch(loss_of(acc.process_index, step), bins_of(acc.process_index, step))
            mon.optimizer_step(torch.tensor(1.0), torch.tensor(True))

    new = lambda state: (monitor.Monitor(cfg, model, acc, lambda row: None, state),
                         stability.Parts(cfg, acc, model, lambda row: None, state, lambda u: u))
    mon, stab = new({})
    steps(mon, stab, 0, 2)
    state = json.loads(json.dumps({"step": 2, **mon.state_dict(), **stab.state_dict()}))  # as state.pt keeps it
    mon, stab = new(state)
    steps(mon, stab, 2, 4)
    metrics = mon.log_interval(4, 1e-3)
    stab.density.update()
    losses = torch.cat([loss_of(r, s) for r in range(2) for s in range(4)])
    bins = torch.cat([bins_of(r, s) for r in range(2) for s in range(4)])
    second = torch.stack([losses[bins == k].pow(2).mean() for k in range(4)])
    root = second.sqrt()
    return {"loss": [metrics["loss"], losses.mean().item()],
            "loss_t": [[metrics[f"loss_t{k}"] for k in range(4)], [losses[bins == k].mean().item() for k in range(4)]],
            "q": [stab.density.q.tolist(), ((1 - 0.25) * root / root.sum() + 0.25 / 4).tolist()]}


TWO_RANKS_STATE = '''
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import test_stability as ts
out = {"resume": ts.resume_mid_interval_on_this_rank()}
for name, argv in (("hook", ["--train.batch_size=4"]),
                   ("accumulation", ["--train.batch_size=4", "--train.grad_accum=2"])):
    stab, _ = ts.noise_scale_through_the_trainer(argv, b_true=8.0)
    g2, trace = stab.noise_scale.estimate.ema.value.tolist()
    out[name] = [stab.noise_scale.estimate.b_small, stab.noise_scale.estimate.b_big, trace / g2]
if stab.rollback.accelerator.is_main_process:
    open(sys.argv[2], "w").write(json.dumps(out))
import common
common.end_processes(stab.rollback.accelerator)  # as a run leaves: not through the teardown where gloo can abort
'''


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_two_ranks_noise_scale_and_a_resume_mid_interval():
    """Two CPU processes (gloo), one launch: the noise scale through the trainer's code recovers B_true = 8
    without accumulation (each rank's gradient read by the DDP communication hook: B_small 4, B_big 8) and with
    accumulation 2 (B_small 4, B_big 16), within 15%; a resume in the middle of a log interval counts each rank's
    share once (resume_mid_interval_on_this_rank)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "two.py", Path(tmp) / "out.json"
        script.write_text(TWO_RANKS_STATE)
        proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                               "--num_processes", "2",
                               str(script), str(ROOT), str(out)], cwd=tmp, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
    assert result["hook"][:2] == [4, 8] and result["accumulation"][:2] == [4, 16]
    assert result["hook"][2] == pytest.approx(8.0, rel=0.15) and result["accumulation"][2] == \
        pytest.approx(8.0, rel=0.15)
    for key in ("loss", "loss_t", "q"):
        got, expected = result["resume"][key]
        assert got == pytest.approx(expected, rel=1e-6), key


# ---- Smoothing -----------------------------------------------------------------------------------------------


def test_smoothed_loss_tracks_a_falling_curve_from_the_first_steps():
    """A weighted mean of a straight line is the line at the weights' centre of mass, and so is a centred
    moving average there: on a falling (linear) loss with noise the smoothed loss must equal the centred
    moving average at the point its weights are centred on, d^(s-i) normalised, from step 1 on. An EMA
    started at the first loss (the old smoothing: 0.27 against 0.14 at step 300 in the demo) keeps d^(s-1)
    of it, one started at 0 without the correction is low by that share: both are far off for hundreds of
    steps."""
    n, d = np.arange(1, 601), 0.99
    loss = 2.5 - 0.004 * n + 0.01 * np.random.default_rng(0).standard_normal(len(n))
    state, smoothed = {"mean": 0.0, "var": 0.0, "n": 0, "spikes": 0}, []
    for i in range(0, len(loss), 10):  # as the monitor feeds it: one log interval at a time
        for j in range(i, i + 10):
            monitor.find_spikes([loss[j]], state, threshold=6.0)
            smoothed.append(state["mean"])
    for s in range(1, len(n) + 1):
        w = d ** (s - np.arange(1, s + 1))
        w /= w.sum()
        centre = (w * np.arange(1, s + 1)).sum()
        half = max(1, round((w * np.abs(np.arange(1, s + 1) - centre)).sum()))
        c = round(centre)
        cma = loss[max(c - half, 1) - 1:c + half].mean()
        assert abs(smoothed[s - 1] - cma) < 0.02 * cma + 0.01, (s, smoothed[s - 1], cma)
    # The spike detector's variance is the same weighting's: the population variance of the first two.
    state = {"mean": 0.0, "var": 0.0, "n": 0, "spikes": 0}
    monitor.find_spikes([1.0, 3.0], state, threshold=6.0)
    assert state["mean"] == pytest.approx((d * 1.0 + 3.0) / (1 + d)) and state["var"] > 0
    w = np.array([d, 1.0]) / (1 + d)
    assert state["var"] == pytest.approx((w * (np.array([1.0, 3.0]) - state["mean"]) ** 2).sum())


def test_validation_slopes_tell_falling_bins_from_flat_ones():
    slopes = convergence.ValidationSlopes(window=5)
    rng = np.random.default_rng(0)
    for i, step in enumerate(range(200, 1400, 200)):
        metrics, flat = slopes(step,
                               [1.0 - 0.05 * i + 0.002 * rng.standard_normal(), 0.5 + 0.01 * rng.standard_normal()])
    assert len(slopes.history) == 5 and flat == [1]
    # bin 0 falls by 0.05 per 200 steps: -0.25 per 1000, relative to its mean over the window
    mean0 = sum(row[1] for row in slopes.history) / 5
    assert metrics["val_slope_t0"] == pytest.approx(-0.25 / mean0, rel=0.05)


# ---- The importance weight in the trainers' step ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["train_flow_matching", "train_ddpm"])
def test_the_importance_weight_reaches_the_backward_pass(tmp_path, monkeypatch, trainer):
    """With every adaptive weight 0 the step's gradient is 0, so Adam leaves the weights at their init and the
    EMA (an average of init and itself) equals them bitwise; a trainer that backpropagated the unweighted loss
    would move them. The logged step loss is the weighted one (0), the per-bin losses the unweighted ones."""
    import importlib

    module = importlib.import_module(trainer)
    real = time_density.AdaptiveTimeDensity.draw
    monkeypatch.setattr(time_density.AdaptiveTimeDensity, "draw", lambda self, n: (real(self, n)[0], torch.zeros(n)))
    key = "objective.time_sampling" if trainer == "train_flow_matching" else "objective.timestep_sampling"
    run = module.main(tiny_run_args(tmp_path, "zero", steps=2) + [f"--{key}=adaptive", "--ckpt.every=2",
                                                                   "--log.report=false", "--train.warmup_steps=0"])
    model, ema = (load_file(str(run / "checkpoints" / "step_00000002" / f"{n}.safetensors")) for n in ("model", "ema"))
    assert all(torch.equal(model[k], ema[k]) for k in model)
    train = [r for r in rows(run) if "loss" in r]
    assert train[-1]["loss"] == 0.0 and min(v for k, v in train[-1].items() if k.startswith("loss_t")) >= 0
    assert max(v for k, v in train[-1].items() if k.startswith("loss_t")) > 0


# ---- Rollback: when, and to what state ------------------------------------------------------------------------


def test_loss_spikes_roll_back_at_the_right_step_to_exactly_the_checkpoints_state(tmp_path):
    """The trainers' loop order on a small quadratic model (Monitor, the stability parts: the adaptive density, the
    adaptive clip, the noise scale at accumulation 2, AdamW, checkpoints.save_checkpoint every 8 steps), log
    every 4 steps, rollback after 3 loss spikes within 40 steps. Spikes (losses x 50) at steps 105, 130, 160
    and 166: at log step 160 only two lie in the window, at 168 three (130, 160, 166): the divergence began in
    the interval 129-132, so it rolls back to step 128, sets aside the checkpoints 136-160 and skips 40 steps of
    data. After it the optimizer's moments, the clip history, the time density and the noise-scale estimate
    (and the monitor's smoothed loss) are bitwise the ones held in memory at step 128, which all moved since."""
    from contextlib import nullcontext

    acc = Accelerator(cpu=True)
    cfg = config.load_config(fm.DEFAULTS, [
        "--objective.time_sampling=adaptive", "--objective.adaptive_bins=4", "--train.grad_clip_mode=adaptive",
        "--train.grad_clip_history=20", "--train.batch_size=4", "--train.grad_accum=2", "--log.every=4",
        "--log.grad_every=4", "--train.on_divergence=rollback", "--train.rollback_spikes=3",
        "--train.rollback_window=40", "--train.max_steps=200", f"--run_dir={tmp_path}"],
        method="flow_matching", schema=fm.CONFIG)
    torch.manual_seed(0)
    model, ema = Quadratic(64), Quadratic(64)
    model.w.data.fill_(0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    logged = []
    mon = monitor.Monitor(cfg, model, acc, logged.append, {})
    stab = stability.Parts(cfg, acc, model, logged.append, {}, lambda u: u)

    def memory():
        return {"moments": {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()},
                "clip": stab.clip.history.clone(), "q": stab.density.q.clone(),
                "second_moment": stab.density.second_moment.value.clone(),
                "noise": stab.noise_scale.estimate.ema.value.clone(), "loss_state": dict(mon.loss_state)}

    def load(ckpt):
        return checkpoints.load_checkpoint(ckpt, model, ema, optimizer, acc)

    step, snapshots = 0, {}
    while step < 168:
        for micro in range(2):
            t, weight = stab.density.draw(4)
            z = 1.0 + 0.1 * torch.randn(4, 64)
            with acc.no_sync(model) if micro == 0 else nullcontext():
                loss = model(z) * (50.0 if step + 1 in (105, 130, 160, 166) else 1.0)
                acc.backward((weight * loss).mean() / 2)
            stab.density.observe(loss)
            stab.noise_scale.micro_batch(micro)
            mon.micro_batch(loss, (t * 5).long().clamp(max=4), weight)
        grad_norm = stab.clip(model.parameters())
        stab.noise_scale.measure(grad_norm)
        optimizer.step()
        mon.optimizer_step(grad_norm, torch.isfinite(grad_norm), stab.clip.threshold)
        optimizer.zero_grad(set_to_none=False)
        step += 1
        if step % 4 == 0:
            metrics = mon.log_interval(step, 1e-3)
            logged.append({"step": step, **stab.density.update()})
            if stab.rollback.diverged(step, metrics, mon):
                break
        if step % 8 == 0:
            snapshots[step] = memory()
            state = {"step": step, "config": json.loads(json.dumps(cfg)), **mon.state_dict(), **stab.state_dict()}
            checkpoints.save_checkpoint(acc, tmp_path, step, {"model": model.state_dict(), "ema": ema.state_dict()},
                                   optimizer, state, keep=100)
    assert [r["step"] for r in logged if r.get("event") == "loss_spike"] == [105, 130, 160, 166]
    assert (step, stab.rollback.divergence) == (168, 129)
    before = memory()
    assert stab.rollback.roll_back(step, mon, load) == 128 and stab.noise_scale.step == 128
    after, saved = memory(), snapshots[128]
    for key in ("clip", "q", "second_moment", "noise"):
        assert torch.equal(after[key], saved[key]) and not torch.equal(before[key], saved[key]), key
    assert all(torch.equal(after["moments"][k], v) for k, v in saved["moments"].items())
    assert not torch.equal(before["moments"]["exp_avg"], saved["moments"]["exp_avg"])
    assert after["loss_state"] == saved["loss_state"] != before["loss_state"]
    rb = stab.rollback
    assert (rb.count, rb.lr_factor, rb.data_offset) == (1, 0.5, (168 - 128) * 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("diverged1_*")) == \
        [f"diverged1_step_{s:08d}" for s in range(136, 161, 8)]


# ---- Rollback (end to end) -----------------------------------------------------------------------------------


# The LR these tests compute with: constant 1e-3 (the demo's default decays over max_steps, so a run resumed to
# more steps would follow another schedule)
CONSTANT_LR = ["--train.lr=1e-3", "--train.lr_schedule=constant"]


def rows(run):
    return [json.loads(r) for r in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def poisoned_loss(monkeypatch, bad_calls):
    """The flow-matching loss, NaN on the given calls (0-based); records each call's batch."""
    original, batches = fm.training_loss, []  # training's, and validation's through flow_matching_loss

    def loss(model, x0, cond, t, noise, *options):
        batches.append(x0.detach().clone())
        out, terms = original(model, x0, cond, t, noise, *options)
        return out * float("nan") if len(batches) - 1 in bad_calls else out, terms

    monkeypatch.setattr(fm, "training_loss", loss)
    return batches


@pytest.mark.slow
def test_a_planted_nan_rolls_back_and_finishes_with_the_lower_lr(tmp_path, monkeypatch):
    """Steps 7 and 8 have a NaN loss; with max_nonfinite_steps=2 the log of step 8 sees the divergence (begun
    at step 7): the run reloads step 6's checkpoint, sets aside step 7's (written during the divergence),
    halves the LR and skips the 2 micro-batches it saw since step 6, then finishes."""
    args = tiny_run_args(tmp_path, "rb", steps=10) + [
        "--log.every=1", "--ckpt.every=1", "--ckpt.keep=10", "--train.max_nonfinite_steps=2", "--log.report=false",
        "--train.on_divergence=rollback", "--train.rollback_lr_factor=0.5", "--val.every=1000", *CONSTANT_LR]
    clean = poisoned_loss(monkeypatch, set())
    fm.main(tiny_run_args(tmp_path, "clean", steps=10) + args[len(tiny_run_args(tmp_path)):])
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    batches = poisoned_loss(monkeypatch, {6, 7})
    run = fm.main(args)
    events = [r for r in rows(run) if r.get("event") == "rollback"]
    assert len(events) == 1 and events[0]["step"] == 6 and events[0]["detected_at"] == 8
    assert events[0]["diverged_at"] == 7 and events[0]["skipped_batches"] == 2
    train = [r for r in rows(run) if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9)) + list(range(7, 11))
    assert train[-1]["lr"] == pytest.approx(0.5e-3) and train[5]["lr"] == pytest.approx(1e-3)
    assert math.isfinite(train[-1]["loss"])
    # step 7 after the rollback trains on micro-batch 8 (the window 6, 7 skipped): the clean run's 9th batch
    assert torch.equal(batches[8], clean[8]) and not torch.equal(batches[8], clean[6])
    folders = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "diverged1_step_00000007" in folders and "step_00000010" in folders
    state = torch.load(run / "checkpoints" / "step_00000010" / "state.pt", weights_only=True)
    assert state["stability"]["rollback"]["count"] == 1 and state["stability"]["rollback"]["lr_factor"] == 0.5
    # max_rollbacks=0: the same divergence stops the run, naming the limit
    AcceleratorState._reset_state(reset_partial_state=True)
    poisoned_loss(monkeypatch, {6, 7})
    with pytest.raises(FloatingPointError, match="max_rollbacks=0"):
        fm.main(tiny_run_args(tmp_path, "none", steps=10) + args[len(tiny_run_args(tmp_path)):]
                + ["--train.max_rollbacks=0"])


class RolledBack(Exception):
    """Ends a run right after its rollback, once the optimizer's state is read."""


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["train_flow_matching", "train_ddpm"])
def test_the_trainers_rollback_restores_the_checkpoints_adam_moments(tmp_path, monkeypatch, trainer):
    """The trainer's own rollback (its loop, its `load`): NaN losses at steps 6 and 7 roll the run back to the
    checkpoint of step 4, past step 5's real update. Right after it, every exp_avg and exp_avg_sq is bitwise the
    checkpoint's, which the moments of the divergence were not (test_loss_spikes_roll_back_... checks the same
    through a loop of its own, which would pass with a trainer that kept the diverged moments)."""
    from training.optimisation import optimizers
    from training.run import rollback

    module = __import__(trainer)
    made, seen, calls = [], {}, []
    make_optimizer, roll_back, loss = optimizers.make_optimizer, rollback.Rollback.roll_back, module.training_loss
    monkeypatch.setattr(optimizers, "make_optimizer", lambda *a, **k: made.append(make_optimizer(*a, **k)) or made[-1])

    def poisoned(*args, **kwargs):  # calls 6 and 7 (steps 6 and 7: one micro-batch a step) are NaN
        calls.append(1)
        out, terms = loss(*args, **kwargs)
        return (out * float("nan") if len(calls) in (6, 7) else out), terms

    def moments():
        state = made[0].state_dict()["state"]
        return {k: {m: v[m].clone() for m in ("exp_avg", "exp_avg_sq")} for k, v in state.items()}

    def watched(self, step, monitor, load):
        seen["diverged"] = moments()
        seen["step"] = roll_back(self, step, monitor, load)
        seen["restored"] = moments()
        raise RolledBack

    monkeypatch.setattr(module, "training_loss", poisoned)
    monkeypatch.setattr(rollback.Rollback, "roll_back", watched)
    with pytest.raises(RolledBack):
        module.main(tiny_run_args(tmp_path, "rb", steps=10) + [
            "--log.every=1", "--ckpt.every=4", "--train.max_nonfinite_steps=2", "--train.on_divergence=rollback",
            "--log.report=false", "--train.batch_size=8", *CONSTANT_LR])
    saved = checkpoints.read_optimizer_state(tmp_path / "rb" / "checkpoints" / "step_00000004")["state"]
    assert seen["step"] == 4 and len(made) == 1 and sorted(seen["restored"]) == sorted(saved)
    assert any(not torch.equal(seen["diverged"][k][m], saved[k][m]) for k in saved for m in ("exp_avg", "exp_avg_sq"))
    for k in saved:
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(seen["restored"][k][m], saved[k][m]), (k, m)


@pytest.mark.slow
def test_a_rollback_to_a_preemption_checkpoint_is_kept_there_and_repeats_no_validation(tmp_path, monkeypatch):
    """A run stops at step 5 (its last checkpoint is off the ckpt.every=4 grid, as a preemption's is), resumes to
    10, and steps 6 and 7 have a NaN loss: it rolls back to step 5. The rollback (count 1, LR x 0.5, 2 micro-
    batches skipped) is in step 5's state.pt at once; step 5's validation and FID are not repeated (one point per
    step in the slope history). A second preemption before the next checkpoint (checkpoints 8 and 10 removed)
    resumes from step 5 at the lower LR past the skipped window, and the same divergence then meets
    train.max_rollbacks=1 instead of rolling back forever."""
    from training.evaluation import sampling

    fid_steps = []

    def fid(generate, ema, cfg, accelerator, val_set, vae=None, text=False, log=None, step=None):  # only when it runs
        fid_steps.append(step)

    monkeypatch.setattr(sampling, "fid_of_run", fid)
    args = tiny_run_args(tmp_path, "off", steps=5) + [
        "--log.every=1", "--ckpt.every=4", "--ckpt.keep=10", "--val.every=5", "--val.fid_every=5", "--log.report=false",
        "--train.max_nonfinite_steps=2", "--train.on_divergence=rollback",
        "--train.rollback_lr_factor=0.5", *CONSTANT_LR]
    run, ckpts = tmp_path / "off", tmp_path / "off" / "checkpoints"
    poisoned_loss(monkeypatch, set())
    fm.main(args)
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = poisoned_loss(monkeypatch, {0, 1})  # this process's steps 6 and 7
    fm.main(args + ["--train.max_steps=10", "--resume=latest"])
    events = [r for r in rows(run) if r.get("event") == "rollback"]
    assert [(e["step"], e["detected_at"], e["diverged_at"]) for e in events] == [(5, 7, 6)]
    assert [r["step"] for r in rows(run) if "val_loss" in r] == [5, 10] and fid_steps == [5, 10]
    slopes = checkpoints.read_state(ckpts / "step_00000010")["stability"]["slopes"]["history"]
    assert [row[0] for row in slopes] == [5, 10]
    kept = checkpoints.read_state(ckpts / "step_00000005")["stability"]["rollback"]
    assert (kept["count"], kept["lr_factor"], kept["data_offset"]) == (1, 0.5, 2)
    AcceleratorState._reset_state(reset_partial_state=True)
    for step in (8, 10):  # preempted again before its next checkpoint
        shutil.rmtree(ckpts / f"step_{step:08d}")
    replay = poisoned_loss(monkeypatch, {0, 1})
    with pytest.raises(FloatingPointError, match=r"after 1 rollbacks \(train.max_rollbacks=1\)"):
        fm.main(args + ["--train.max_steps=10", "--resume=latest", "--train.max_rollbacks=1"])
    assert [r["lr"] for r in rows(run) if "loss" in r and r["step"] == 6] == [pytest.approx(0.5e-3)]
    assert torch.equal(replay[0], resumed[2])  # step 6 after the rollback: the window skipped


TWO_RANKS_NAN = '''
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import train_flow_matching as fm
original, calls = fm.training_loss, []

def loss(model, x0, cond, t, noise, *options):  # NaN on rank 1 only, at its 5th and 6th micro-batch
    calls.append(1)
    out, terms = original(model, x0, cond, t, noise, *options)
    return out * float("nan") if os.environ["RANK"] == "1" and len(calls) in (5, 6) else out, terms

fm.training_loss = loss
fm.main(sys.argv[2:])
'''


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_two_ranks_roll_back_at_the_same_step(tmp_path):
    """A NaN on one rank makes the all-reduced gradient non-finite on both: both see the divergence at the
    same log step and reload the same checkpoint; the run finishes. Without accumulation the noise scale
    reads each rank's gradient in the DDP communication hook."""
    (tmp_path / "two.py").write_text(TWO_RANKS_NAN)
    args = tiny_run_args(tmp_path, "two", steps=8) + [
        "--log.every=1", "--ckpt.every=2", "--train.max_nonfinite_steps=2", "--train.on_divergence=rollback",
        "--log.grad_every=2", "--log.report=false", "--train.batch_size=8", *CONSTANT_LR]
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           str(tmp_path / "two.py"), str(ROOT), *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = re.findall(r"rank (\d): step (\d+): divergence since step (\d+): rolled back to (\S+)", proc.stdout)
    assert sorted(r for r, *_ in lines) == ["0", "1"], proc.stdout[-2000:]
    assert len({tuple(rest) for _, *rest in lines}) == 1  # the same step and checkpoint on both ranks
    assert lines[0][1:3] == ("6", "5") and lines[0][3].endswith("step_00000004")
    train = [r for r in rows(tmp_path / "two") if "loss" in r]
    assert train[-1]["step"] == 8 and train[-1]["lr"] == pytest.approx(0.5e-3)
    noise = [r["grad_noise_scale"] for r in rows(tmp_path / "two") if "grad_noise_scale" in r]
    assert noise and all(math.isfinite(b) for b in noise)


@pytest.mark.slow
def test_every_new_state_resumes_bitwise(tmp_path):
    """Adaptive time density, adaptive clip, noise scale (accumulation 2) and a rollback (a poisoned row in the
    cache): 8 steps straight against 6 steps then --resume latest to 8, bitwise the same weights, EMA,
    optimizer, stability state and losses."""
    prep = tiny_run_args(tmp_path, "prep", steps=1) + ["--log.report=false"]
    fm.main(prep)
    from accelerate.state import AcceleratorState
    shard = next((tmp_path / "cache").glob("embedded-train-*/shard_00000.safetensors"))
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(shard))
    # micro-batch 8 (step 5 at accumulation 2) of epoch 0 holds row perm[8 * 16]: poison it
    row = int(torch.randperm(len(tensors["x"]), generator=torch.Generator().manual_seed(0))[8 * 16])
    tensors["x"][row] = float("nan")
    save_file(tensors, str(shard), metadata=meta)
    extra = ["--train.grad_accum=2", "--log.every=1", "--ckpt.every=2", "--log.grad_every=2", "--log.report=false",
             "--objective.time_sampling=adaptive", "--train.grad_clip_mode=adaptive", "--train.grad_clip_history=3",
             "--train.on_divergence=rollback", "--train.max_nonfinite_steps=1",
             "--data.verify_cache=false", *CONSTANT_LR]
    for name, steps in (("straight", 8), ("resumed", 6), ("resumed", 8)):
        AcceleratorState._reset_state(reset_partial_state=True)  # the last run's is the fixture's to undo (conftest)
        fm.main(tiny_run_args(tmp_path, name, steps=steps) + extra
                + (["--resume=latest"] if steps == 8 and name == "resumed" else []))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert [r["step"] for r in rows(straight) if r.get("event") == "rollback"] == [4]
    for name in ("model", "ema"):
        a, b = (load_file(str(r / "checkpoints" / "step_00000008" / f"{name}.safetensors"))
                for r in (straight, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    oa, ob = (checkpoints.read_optimizer_state(r / "checkpoints" / "step_00000008") for r in (straight, resumed))
    for p in oa["state"]:
        assert all(torch.equal(v, ob["state"][p][k]) for k, v in oa["state"][p].items())
    sa, sb = (checkpoints.read_state(r / "checkpoints" / "step_00000008") for r in (straight, resumed))
    # (the validation slopes differ: the 6-step run validated at its last step, the straight one did not)
    without_slopes = lambda st: {k: v for k, v in st["stability"].items() if k != "slopes"}
    assert without_slopes(sa) == without_slopes(sb) and sa["loss_state"] == sb["loss_state"]
    assert sa["stability"]["rollback"]["count"] == 1 and "sampler" in sa["stability"] and "noise" in sa["stability"]
    nan_free = lambda run: [[None if isinstance(v, float) and math.isnan(v) else v for k, v in sorted(r.items())
                             if k not in ("images_per_s", "images_per_s_per_device",
                                          "data_wait_share", "peak_memory_gb",
                                           "cpu_s_per_step")]
                            for r in rows(run) if "loss" in r or "time_density/0" in r or "grad_noise_scale" in r]
    assert nan_free(straight) == nan_free(resumed)


def test_report_shows_the_density_the_indicators_and_the_rollbacks(tmp_path):
    from training.record import report

    rows = [{"step": s, "loss": 1 / s, "lr": 1e-3} for s in range(10, 110, 10)]
    rows += [{"step": s, **{f"time_density/{k}": 1 + 0.01 * k * s / 100 for k in range(8)}} for s in range(10, 110, 10)]
    rows += [{"step": s, "grad_noise_scale": 30.0 + s} for s in (50, 100)]
    rows += [{"step": 100, "val_slope_t0": -0.2, "val_slope_t1": 0.01}]
    rows += [{"step": 40, "event": "rollback", "detected_at": 60, "diverged_at": 45, "lr_factor": 0.5,
              "skipped_batches": 20}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"train": {"batch_size": 16, "grad_accum": 2}}))
    md = report.write_report(tmp_path).read_text()
    assert {"time_density.png", "convergence.png"} <= {p.name for p in (tmp_path / "report").glob("*.png")}
    assert "| gradient noise scale B_noise (last) | 130 |" in md and "t0 -0.2, t1 +0.01" in md
    assert "| rollbacks | 1, LR x 0.5 |" in md and "| 40 | rollback |" in md


def test_a_rollback_whose_ranks_pick_different_checkpoints_stops_on_every_rank(tmp_path, monkeypatch):
    """Each rank picks the checkpoint to roll back to from the file system alone. Where one rank sees none (a
    shared file system slow to show it), it must not raise alone and leave the others waiting in a collective:
    the picks are gathered first (the other rank's pick injected into gather_object) and every rank stops with
    the same error naming both picks."""
    import types

    cfg = config.load_config(fm.DEFAULTS, ["--train.on_divergence=rollback", f"--run_dir={tmp_path}"],
                             method="flow_matching", schema=fm.CONFIG)
    rollback = stability.Parts(cfg, Accelerator(cpu=True), Quadratic(4), lambda row: None, {}, lambda u: u).rollback
    rollback.accelerator = types.SimpleNamespace(num_processes=2, process_index=0, is_main_process=True)
    monkeypatch.setattr(checkpoints, "gather_object", lambda picks: picks + ["step_00000008"])
    rollback.divergence = 12
    with pytest.raises(RuntimeError, match=r"rank 0: none, rank 1: step_00000008"):
        rollback.roll_back(12, None, lambda ckpt: pytest.fail("loaded"))
