"""The core maths, each check against an independent oracle (torchcfm, diffusers, a closed form), each one
written to fail on a specific plausible bug (docs/tests.md lists which):

  * flow matching: path, target and its sign against torchcfm and the SD3 training script;
  * both trainers' generate() use the run's resolution shift (diffusers' schedulers as the oracle);
  * DDPM Min-SNR: every timestep, the last included, keeps a real weight (the default form);
  * DDPM under a shift: the time input keeps meaning the noise level (a Bayes-optimal Gaussian denoiser);
  * noisy replicate padding is training-only: sampling a text model is deterministic.
"""
import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

import train_ddpm as ddpm
import train_flow_matching as fm
from training.config import config
from training.model.mmdit import build_denoiser
from training.run import start

T = 1000


def fm_batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, 8, 8, generator=g), torch.randn(n, 3, 8, 8, generator=g),
            torch.tensor([0.02, 0.1, 0.3, 0.5, 0.9, 1.0])[:n])


# ---- Flow matching: the objective --------------------------------------------------------------------------


def test_true_velocity_has_zero_loss_and_the_sign_flipped_one_a_large_loss():
    """A model that knows the data point x0 and reads the velocity off the path, v = (x_t - x0) / t, has loss 0;
    one that returns -v has loss 4 |eps - x0|^2. A zero model (the older test) cannot see the sign."""
    x0, noise, t = fm_batch()

    def true_velocity(x_t, timestep, cond, noise_level=None):
        return (x_t - x0) / (timestep / 1000).view(-1, 1, 1, 1)

    assert fm.flow_matching_loss(true_velocity, x0, {}, t, noise).abs().max().item() < 1e-10
    flipped = fm.flow_matching_loss(lambda *a: -true_velocity(*a), x0, {}, t, noise)
    torch.testing.assert_close(flipped, 4 * (noise - x0).pow(2).mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-6)
    assert flipped.min().item() > 1.0


@pytest.mark.slow
def test_path_and_target_match_torchcfm_with_its_reversed_time():
    """torchcfm's ConditionalFlowMatcher(sigma=0) runs from noise (its x0, t = 0) to data (its x1, t = 1):
    x_t = t x1 + (1 - t) x0, u_t = x1 - x0. Ours at t is theirs at 1 - t, with the velocity of opposite sign."""
    cfm = pytest.importorskip("torchcfm.conditional_flow_matching")
    x0, noise, t = fm_batch(1)
    matcher = cfm.ConditionalFlowMatcher(sigma=0.0)
    _, x_t_theirs, u_t = matcher.sample_location_and_conditional_flow(noise, x0, t=1 - t)
    seen = {}

    def model(x_t, timestep, cond, noise_level=None):
        seen["x_t"], seen["timestep"] = x_t, timestep
        return -u_t

    loss = fm.flow_matching_loss(model, x0, {}, t, noise)
    torch.testing.assert_close(seen["x_t"], x_t_theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(seen["timestep"], 1000 * t)
    assert loss.abs().max().item() < 1e-10  # our target is -u_t


def test_path_and_target_match_the_sd3_training_script():
    """diffusers' examples/dreambooth/train_dreambooth_sd3.py: timesteps from FlowMatchEulerDiscreteScheduler,
    sigmas = their sigmas, noisy = (1 - sigmas) x0 + sigmas noise, target = noise - x0, and the transformer
    gets the timesteps (= 1000 sigma)."""
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    indices = torch.tensor([0, 100, 400, 700, 950])
    timesteps, sigmas = sched.timesteps[indices], sched.sigmas[indices]
    x0, noise, _ = fm_batch(2, n=5)
    s = sigmas.view(-1, 1, 1, 1)
    noisy, target = (1.0 - s) * x0 + s * noise, noise - x0
    seen = {}

    def model(x_t, timestep, cond, noise_level=None):
        seen["x_t"], seen["timestep"] = x_t, timestep
        return target

    loss = fm.flow_matching_loss(model, x0, {}, sigmas, noise)
    torch.testing.assert_close(seen["x_t"], noisy)
    torch.testing.assert_close(seen["timestep"], timesteps)
    assert loss.abs().max().item() == 0.0


# ---- generate() uses the run's shift ---------------------------------------------------------------------------


def smooth_field(x, timestep, cond, noise_level=None):
    """Any smooth velocity (or v-prediction) that depends on x, on the time input and on the condition."""
    c = torch.where(cond["drop"], 0.0, cond["label"].float() + 1).view(-1, 1, 1, 1)
    return torch.tanh(0.6 * x + 0.1 * c) + (timestep.view(-1, 1, 1, 1) / 1000) * (0.3 + 0.05 * c)


def cond3():
    return {"label": torch.tensor([0, 4, 8]), "drop": torch.zeros(3, dtype=torch.bool)}


@pytest.mark.parametrize("shift_args", [["--objective.time_shift=3"],
                                        ["--data.resolution=48", "--objective.shift_base_resolution=16"]])
def test_flow_matching_generate_uses_the_runs_shift(shift_args):
    cfg = config.load_config(fm.DEFAULTS, shift_args + ["--val.steps=6", "--val.guidance_scale=2.5"])
    noise = torch.randn(3, 3, 4, 4, generator=torch.Generator().manual_seed(3))
    ours = fm.generate(smooth_field, noise, cond3(), cfg)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(sigmas=np.linspace(1, 0, 7)[:-1])
    x, both = noise, {"label": cond3()["label"].repeat(2), "drop": torch.tensor([False] * 3 + [True] * 3)}
    for t in sched.timesteps:
        v_c, v_u = smooth_field(torch.cat([x, x]), t.expand(6), both).chunk(2)
        x = sched.step(v_u + 2.5 * (v_c - v_u), t, x).prev_sample
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)


def base_log_snr():
    ab = ddpm.make_schedule(T, "quadratic", 0.00085, 0.012, True)
    return (ab / (1 - ab)).log()


def alpha_bar_read_off(time_input):
    """What a model trained on the unshifted schedule reads off a (fractional) time input: the log-SNR
    interpolated linearly between integer timesteps (a written-out inverse of train_ddpm.time_input)."""
    L = base_log_snr()
    tau = time_input.double()
    i = tau.floor().long().clamp(max=T - 2)
    f = tau - i
    step = L[i + 1] - L[i]
    log_snr = torch.where(f == 0, L[i], L[i] + f * step)  # f = 0: no -inf * 0 at the terminal step
    return torch.sigmoid(log_snr)


@pytest.mark.parametrize("shift_args", [["--objective.time_shift=2"],
                                        ["--data.resolution=32", "--objective.shift_base_resolution=16"]])
def test_ddpm_generate_equals_ddim_on_the_shifted_schedule(shift_args):
    """diffusers' DDIMScheduler with the betas of the shifted alpha_bar', guidance and its rescale; the model
    is given the timestep of equal noise level on the unshifted schedule (found here by bisection)."""
    cfg = config.load_config(ddpm.DEFAULTS, shift_args + ["--val.steps=8", "--val.guidance_scale=3"])
    ab = ddpm.shift_schedule(ddpm.make_schedule(), 2.0)
    betas = torch.cat([1 - ab[:1], 1 - ab[1:] / ab[:-1]]).float()
    sched = DDIMScheduler(num_train_timesteps=T, trained_betas=betas.numpy(), timestep_spacing="trailing",
                          prediction_type="v_prediction", clip_sample=False, set_alpha_to_one=True)
    sched.set_timesteps(8)

    def time_of_equal_noise(t):  # bisection on the read-off alpha_bar, monotone decreasing in the time input
        if ab[t] == 0:
            return float(T - 1)
        lo, hi = 0.0, float(T - 1)
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if alpha_bar_read_off(torch.tensor([mid]))[0] > ab[t] else (lo, mid)
        return lo

    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    noise = torch.randn(3, 3, 4, 4, generator=torch.Generator().manual_seed(4))
    x, both = noise.clone(), {"label": cond3()["label"].repeat(2), "drop": torch.tensor([False] * 3 + [True] * 3)}
    for t in sched.timesteps:
        tau = torch.full((6,), time_of_equal_noise(int(t)))
        out_c, out_u = smooth_field(torch.cat([x, x]), tau, both).chunk(2)
        out = rescale_noise_cfg(out_u + 3.0 * (out_c - out_u), out_c, guidance_rescale=0.7)
        x = sched.step(out, t, x, eta=0.0).prev_sample
    ours = ddpm.generate(smooth_field, noise, cond3(), cfg)
    torch.testing.assert_close(ours, x, rtol=1e-4, atol=1e-4)


# ---- DDPM: Min-SNR at zero terminal SNR; the time input under a shift ------------------------------------------

WEIGHT_FLOOR = 0.004  # gamma / (SNR_0 + 1) = 5 / 1177: the cleanest timestep's weight, as in the paper


@pytest.mark.parametrize("prediction", ["v", "x0"])
@pytest.mark.parametrize("shift", [1.0, 2.0, 3.0])
def test_default_min_snr_weight_keeps_every_timestep_above_a_floor(prediction, shift):
    """Defaults (quadratic, zero terminal SNR, gamma 5): every timestep, the last included, gets a weight of
    at least WEIGHT_FLOOR; the last (pure noise, where every sample starts) exactly 1. The paper's form gives
    it 0 (kept selectable, and checked against diffusers in test_ddpm.py)."""
    cfg = config.load_config(ddpm.DEFAULTS, [f"--objective.time_shift={shift}", f"--objective.prediction={prediction}"])
    assert cfg.objective.min_snr_form == "plus_one"
    w = ddpm.loss_weight_of(cfg)
    assert w.shape == (T,) and torch.isfinite(w).all()
    assert w.min().item() >= WEIGHT_FLOOR and w[-1].item() == 1.0
    snr = (lambda ab: ab / (1 - ab))(ddpm.schedule_of(cfg))
    gamma = torch.full_like(snr, 5.0)
    expected = torch.minimum(snr + 1, gamma) / ((snr + 1) if prediction == "v" else 1)  # written out
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)
    paper = torch.minimum(snr, gamma) / ((snr + 1) if prediction == "v" else 1)  # diffusers' examples' form
    assert paper[-1].item() == 0.0 and (w >= paper).all()
    # Where SNR + 1 >= gamma the two forms are the same: the paper's weighting of the clean end is kept.
    clean = snr >= 5.0
    torch.testing.assert_close(w[clean], paper[clean], rtol=1e-12, atol=0)


def test_time_input_is_the_timestep_of_equal_noise_level():
    ab = ddpm.make_schedule()
    assert torch.equal(ddpm.time_input(ab, 1.0), torch.arange(T, dtype=torch.float64))  # no shift: t itself
    for shift in (0.5, 2.0, 3.0):
        tau = ddpm.time_input(ab, shift)
        shifted = ddpm.shift_schedule(ab, shift)
        assert (tau.diff() >= 0).all() and tau[-1] == T - 1
        inside = (shifted > ab[T - 2]) & (shifted < ab[0])  # within the unshifted range (see time_input)
        torch.testing.assert_close(alpha_bar_read_off(tau)[inside].log(), shifted[inside].log(), rtol=1e-9, atol=1e-9)
    assert ddpm.time_input(ab, 2.0)[500].item() == pytest.approx(668.9, abs=0.05)  # the example


class GaussianDenoiser(torch.nn.Module):
    """The Bayes-optimal v-prediction for data x0 ~ N(0, s^2): E[v | x_t] = sqrt(ab (1 - ab)) (1 - s^2) /
    (ab s^2 + 1 - ab) x_t. It reads alpha_bar off its time input as a model trained on the unshifted schedule
    would (read="time"), or from the true noise level (read="noise_level", the oracle)."""

    def __init__(self, s, read):
        super().__init__()
        self.s2, self.read = s * s, read

    def forward(self, x, timestep, cond, noise_level=None):
        if self.read == "time":
            ab = alpha_bar_read_off(timestep)
        else:  # noise_level = sigma / (alpha + sigma): SNR = ((1 - nl) / nl)^2
            snr = ((1 - noise_level.double()) / noise_level.double()) ** 2
            ab = snr / (1 + snr)
        ab = ab.view(-1, 1, 1, 1)
        return ((ab * (1 - ab)).sqrt() * (1 - self.s2) / (ab * self.s2 + 1 - ab)).float() * x


def test_a_denoiser_that_reads_its_noise_level_from_the_time_samples_correctly_under_a_shift():
    """The issue's measurement: with shift 2 and the integer index as time input, DDIM at 1000 steps samples
    std 0.4640 instead of 0.4895 (the sampler's own limit; 0.5 is the data's). The time-reading denoiser must
    sample exactly as the oracle told the true noise level does, and both as the closed form of DDIM on it."""
    cfg = config.load_config(ddpm.DEFAULTS, ["--objective.time_shift=2", "--val.steps=50", "--val.guidance_scale=1",
                                             "--val.guidance_rescale=0"])
    noise = torch.randn(512, 1, 2, 2, generator=torch.Generator().manual_seed(5))
    cond = {"label": torch.zeros(512, dtype=torch.long), "drop": torch.zeros(512, dtype=torch.bool)}
    by_time = ddpm.generate(GaussianDenoiser(0.5, "time"), noise, cond, cfg)
    oracle = ddpm.generate(GaussianDenoiser(0.5, "noise_level"), noise, cond, cfg)
    torch.testing.assert_close(by_time, oracle, rtol=1e-4, atol=1e-5)
    # Closed form: each DDIM step maps x to (sqrt(ab' ab) s^2 + sqrt((1 - ab') (1 - ab))) / (ab s^2 + 1 - ab) x.
    ab, grid, factor = ddpm.schedule_of(cfg), ddpm.timestep_grid(T, 50), 1.0
    for t, prev in zip(grid, grid[1:] + [None]):
        a, a_prev = ab[t].item(), 1.0 if prev is None else ab[prev].item()
        factor *= (math.sqrt(a_prev * a) * 0.25 + math.sqrt((1 - a_prev) * (1 - a))) / (a * 0.25 + 1 - a)
    torch.testing.assert_close(by_time, factor * noise, rtol=1e-4, atol=1e-6)


def test_ddpm_loss_feeds_the_time_of_the_noise_it_added():
    """Training: the model's time input, read on the unshifted schedule, is the noise level of x_t."""
    cfg = config.load_config(ddpm.DEFAULTS, ["--objective.time_shift=2"])
    ab, tau = ddpm.schedule_of(cfg), ddpm.time_input_of(cfg)
    t = torch.tensor([0, 100, 500, 900, 990])
    seen = {}

    def model(x_t, timestep, cond, noise_level=None):
        seen["timestep"] = timestep
        return torch.zeros_like(x_t)

    x0, noise = torch.randn(5, 3, 4, 4), torch.randn(5, 3, 4, 4)
    ddpm.ddpm_loss(model, x0, {}, t, noise, ab, "v", ddpm.loss_weight_of(cfg), tau)
    torch.testing.assert_close(alpha_bar_read_off(seen["timestep"]).log(), ab[t].log(), rtol=1e-5, atol=1e-5)


# ---- Noisy replicate padding: training only --------------------------------------------------------------------


def tiny_text_model(padding_noise=0.5):
    cfg = config.load_config(fm.DEFAULTS, [f"--conditioning.padding_noise={padding_noise}", "--model.num_layers=1",
                                           "--model.num_attention_heads=2", "--model.attention_head_dim=8"])
    torch.manual_seed(0)
    return build_denoiser(cfg, 3, 8, text_dims=(6, 16, 16))


def text_cond(n=2):
    g = torch.Generator().manual_seed(6)
    return {"text_tokens": torch.randn(n, 6, 16, generator=g), "text_pooled": torch.randn(n, 16, generator=g),
            "text_mask": torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]][:n]).float(),
            "drop": torch.zeros(n, dtype=torch.bool)}


@pytest.mark.parametrize("trainer", [fm, ddpm])
def test_sampling_a_text_model_twice_from_the_same_noise_gives_identical_images(trainer):
    model = tiny_text_model()
    for p in model.parameters():  # a trained-looking model: every layer passes signal (diffusers zero-inits some)
        torch.nn.init.normal_(p, std=0.2)
    cfg = config.load_config(trainer.DEFAULTS, ["--val.steps=3", "--val.guidance_scale=3"])
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    model.eval()
    first = trainer.generate(model, noise, text_cond(), cfg)
    torch.manual_seed(123)  # another global RNG state changes nothing either
    assert torch.equal(first, trainer.generate(model, noise, text_cond(), cfg))
    # In training the padding is still noisy: two forward passes differ.
    model.train()
    x, t = torch.randn(2, 3, 8, 8), torch.full((2,), 500.0)
    assert not torch.equal(model(x, t, text_cond()), model(x, t, text_cond()))


@pytest.mark.slow
def test_a_shifted_ddpm_run_feeds_the_time_of_the_noise_in_training_and_validation(tmp_path, monkeypatch):
    """Every forward pass of a run with shift 2 (training, validation samples, validation loss): the time
    input, read on the unshifted schedule, names the noise level that the conditioner is given."""
    from conftest import tiny_run_args

    seen, build = [], start.build_for_run

    def recording_build(*args, **kwargs):
        model = build(*args, **kwargs)  # the EMA is a deep copy: it records too
        model.register_forward_pre_hook(lambda module, inputs: seen.append((inputs[1].detach(), inputs[3].detach())))
        return model

    monkeypatch.setattr(start, "build_for_run", recording_build)  # called by start.prepare_model
    ddpm.main(tiny_run_args(tmp_path, "shifted", steps=1) + ["--objective.time_shift=2", "--log.report=false"])
    assert len(seen) > 3  # a training step, the sampler's steps, the validation loss bins
    for timestep, noise_level in seen:
        snr = ((1 - noise_level.double()) / noise_level.double()) ** 2  # noise_level = sigma / (alpha + sigma)
        torch.testing.assert_close(alpha_bar_read_off(timestep).log(), (snr / (1 + snr)).log(), rtol=1e-4, atol=1e-4)
