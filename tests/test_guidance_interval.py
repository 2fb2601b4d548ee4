"""Guidance in a limited interval (Kynkaanniemi et al. 2024): on the steps whose noise level lies in
val.guidance_interval each trainer's sampler is classifier-free guidance, elsewhere it is the conditional
sampler, one network pass; checked against hand-written loops (flow matching) and diffusers' DDIM step (DDPM),
with the network evaluations counted."""
import pytest
import torch
from diffusers import DDIMScheduler
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

import common
from training.config import config
import train_ddpm as ddpm
import train_flow_matching as fm
from test_ddpm import ToyModel, schedule, scheduler

COND = {"label": torch.tensor([0, 4, 8]), "drop": torch.zeros(3, dtype=torch.bool)}
NOISE = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(5))


def branch_outputs(model, x, timestep, noise_level=None):
    """The conditional and unconditional predictions, each from its own forward call."""
    n = len(x)
    out_c = model(x, timestep, COND, noise_level)
    out_u = model(x, timestep, {**COND, "drop": torch.ones(n, dtype=torch.bool)}, noise_level)
    return out_c, out_u


def flow_oracle(steps, shift, w, interval, heun=False):
    """Euler / Heun on dx/dt = v from t = 1 to 0, v = v_u + w (v_c - v_u) on steps with lo <= t_i <= hi."""
    model, x = ToyModel(), NOISE.clone()
    ts = common.time_shift(torch.linspace(1, 0, steps + 1), shift)

    def velocity(x, t, guide):
        v_c, v_u = branch_outputs(model, x, torch.full((len(x),), float(t) * 1000))
        return v_u + w * (v_c - v_u) if guide else v_c

    for t, t_next in zip(ts[:-1], ts[1:]):
        guide = interval[0] <= float(t) <= interval[1]
        v = velocity(x, t, guide)
        if heun and t_next > 0:
            v = (v + velocity(x + (t_next - t) * v, t_next, guide)) / 2
        x = x + (t_next - t) * v
    return x


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_flow_sampler_guides_inside_the_interval_and_is_conditional_outside(method):
    steps, shift, w = 8, 3.0, 3.0
    levels = common.time_shift(torch.linspace(1, 0, steps + 1), shift)[:-1]
    heun = method == "heun"
    for interval in ([0.3, 0.9], [0.0, 1.0], [0.95, 1.0]):
        ours = fm.sample(ToyModel(), NOISE, COND, steps, shift, w, 0.0, method, interval)
        torch.testing.assert_close(ours, flow_oracle(steps, shift, w, interval, heun), rtol=1e-6, atol=1e-6)
        # The unconditional pass is skipped outside: 2 evaluations per step inside, 1 outside (x2 for Heun).
        with common.counting_evaluations(model := ToyModel()) as rows:
            fm.sample(model, NOISE, COND, steps, shift, w, 0.0, method, interval)
        per_step = [2 if heun and i + 1 < steps else 1 for i in range(steps)]  # Heun: no 2nd slope at t = 0
        guided_steps = [interval[0] <= t <= interval[1] for t in levels.tolist()]
        assert rows[0] / len(NOISE) == sum(k * (1 + g) for k, g in zip(per_step, guided_steps))
        assert interval != [0.3, 0.9] or 0 < sum(guided_steps) < steps  # a real part of the grid
    # An interval that holds no step is exactly the conditional sampler; [0, 1] exactly plain guidance.
    none = fm.sample(ToyModel(), NOISE, COND, steps, shift, w, 0.0, method, [0.0, 0.0])
    assert torch.equal(none, fm.sample(ToyModel(), NOISE, COND, steps, shift, 1.0, 0.0, method))
    everywhere = fm.sample(ToyModel(), NOISE, COND, steps, shift, w, 0.0, method, [0.0, 1.0])
    assert torch.equal(everywhere, fm.sample(ToyModel(), NOISE, COND, steps, shift, w, 0.0, method))


def ddim_oracle(steps, w, phi, interval):
    """diffusers' DDIM loop (trailing spacing), guidance and rescale only where the step's noise level
    sqrt(1 - ab) / (sqrt(ab) + sqrt(1 - ab)) lies in the interval; the conditional prediction elsewhere."""
    sched = scheduler(DDIMScheduler, set_alpha_to_one=True)
    sched.set_timesteps(steps)
    model, x = ToyModel(), NOISE.clone()
    for t in sched.timesteps:
        ab = float(sched.alphas_cumprod[t])
        level = (1 - ab) ** 0.5 / (ab ** 0.5 + (1 - ab) ** 0.5)
        out_c, out_u = branch_outputs(model, x, torch.full((len(x),), float(t)))
        guide = interval[0] <= level <= interval[1]
        out = rescale_noise_cfg(out_u + w * (out_c - out_u), out_c, guidance_rescale=phi) if guide else out_c
        x = sched.step(out, t, x, eta=0.0).prev_sample
    return x


def test_ddpm_sampler_guides_inside_the_interval_of_its_noise_level():
    steps, w, phi = 10, 3.0, 0.7
    ab = schedule()
    levels = ddpm.noise_level(ab[ddpm.timestep_grid(len(ab), steps)]).tolist()
    for interval in ([0.36, 0.85], [0.0, 1.0], [0.0, 0.5]):
        ours = ddpm.sample(ToyModel(), NOISE, COND, ab, steps, "v", w, phi, "ddim", guidance_interval=interval)
        torch.testing.assert_close(ours, ddim_oracle(steps, w, phi, interval), rtol=1e-4, atol=1e-4)
        with common.counting_evaluations(model := ToyModel()) as rows:
            ddpm.sample(model, NOISE, COND, ab, steps, "v", w, phi, "ddim", guidance_interval=interval)
        assert rows[0] / len(NOISE) == steps + sum(interval[0] <= v <= interval[1] for v in levels)
    none = ddpm.sample(ToyModel(), NOISE, COND, ab, steps, "v", w, phi, "ddpm",
                       generator=torch.Generator().manual_seed(1),
                       guidance_interval=[0.0, 0.0])
    plain = ddpm.sample(ToyModel(), NOISE, COND, ab, steps, "v", 1.0, phi, "ddpm",
                        generator=torch.Generator().manual_seed(1))
    assert torch.equal(none, plain)  # no step at noise level 0 (the grid ends at t = 0, ab < 1): conditional


def test_generate_reads_the_interval_from_the_config_and_a_bad_one_is_refused():
    cfg = config.load_config(fm.DEFAULTS,
                             ["--val.guidance_interval=[0.2, 0.6]", "--val.steps=6", "--val.guidance_scale=3"])
    x = fm.generate(ToyModel(), NOISE, COND, cfg)
    torch.testing.assert_close(x, flow_oracle(6, 1.0, 3.0, [0.2, 0.6]), rtol=1e-6, atol=1e-6)
    for bad in ("[0.8, 0.2]", "[0, 1.5]", "[0.5]", '["a", 1]'):
        with pytest.raises(config.ConfigError, match="val.guidance_interval"):
            config.load_config(ddpm.DEFAULTS, [f"--val.guidance_interval={bad}"], schema=ddpm.CONFIG)
