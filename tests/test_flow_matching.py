"""The flow-matching objective and samplers against closed forms and diffusers as the oracle."""
import itertools
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from scipy import stats

import common
from training.config import config
import train_flow_matching as fm


class Recorder(torch.nn.Module):
    """A stand-in model that records its inputs and returns a fixed velocity."""

    def __init__(self, out):
        super().__init__()
        self.out, self.calls = out, []

    def forward(self, x, timestep, cond, noise_level=None):
        self.calls.append((x.clone(), timestep.clone()))
        return self.out


def test_path_and_target_match_diffusers_scale_noise():
    torch.manual_seed(0)
    x0, noise = torch.randn(6, 3, 8, 8), torch.randn(6, 3, 8, 8)
    t = torch.tensor([0.0, 0.1, 0.3, 0.5, 0.9, 1.0])
    model = Recorder(torch.zeros(6, 3, 8, 8))
    loss = fm.flow_matching_loss(model, x0, {}, t, noise)
    x_t, timestep = model.calls[0]
    sched = FlowMatchEulerDiscreteScheduler()
    for i in range(1, 6):  # diffusers' forward process at sigma = t (t = 0 is not on its grid)
        sched.set_timesteps(sigmas=[t[i].item()])
        expected = sched.scale_noise(x0[i:i + 1], sched.timesteps[:1], noise[i:i + 1])[0]
        torch.testing.assert_close(x_t[i], expected)
    torch.testing.assert_close(timestep, t * 1000)  # the MMDiT sees 1000 t, as diffusers' SD3 pipeline feeds it
    # A zero prediction has loss |eps - x0|^2: the target is the velocity eps - x0.
    torch.testing.assert_close(loss, (noise - x0).pow(2).mean(dim=(1, 2, 3)))
    # The endpoints: t = 0 is data, t = 1 is noise.
    torch.testing.assert_close(x_t[0], x0[0]), torch.testing.assert_close(x_t[-1], noise[-1])


def test_logit_normal_time_density():
    torch.manual_seed(0)
    obj = config.Config(time_sampling="logit_normal", logit_mean=0.5, logit_std=0.8)
    t = fm.sample_time(200_000, obj, 1.0, "cpu").double()
    assert 0 < t.min() and t.max() < 1
    # logit(t) ~ N(m, s)  <=>  t has density  exp(-(logit t - m)^2 / 2 s^2) / (s sqrt(2 pi) t (1 - t)).
    assert stats.kstest(torch.logit(t).numpy(), stats.norm(0.5, 0.8).cdf).pvalue > 1e-3
    hist, edges = np.histogram(t.numpy(), bins=20, range=(0, 1))
    with np.errstate(divide="ignore"):
        cdf = stats.norm(0.5, 0.8).cdf(np.log(edges / (1 - edges)))  # closed-form CDF of the logit-normal
    np.testing.assert_allclose(hist / len(t), np.diff(cdf), rtol=0.03, atol=2e-4)


def test_uniform_time_and_shift_move_mass_toward_noise():
    torch.manual_seed(0)
    obj = config.Config(time_sampling="uniform", logit_mean=0.0, logit_std=1.0)
    t1 = fm.sample_time(100_000, obj, 1.0, "cpu")
    t3 = fm.sample_time(100_000, obj, 3.0, "cpu")
    assert abs(t1.mean().item() - 0.5) < 0.01
    # Shifted uniform: P(t' <= u) = P(t <= u / (a - (a - 1) u)), the inverse shift.
    u = torch.tensor([0.25, 0.5, 0.75])
    expected = u / (3.0 - 2.0 * u)
    torch.testing.assert_close((t3[:, None] <= u).float().mean(0), expected, atol=0.01, rtol=0)
    with pytest.raises(ValueError, match="time_sampling"):
        fm.sample_time(4, config.Config(time_sampling="beta"), 1.0, "cpu")


def test_time_shift_matches_diffusers_and_identity():
    t = torch.linspace(0, 1, 11)
    torch.testing.assert_close(common.time_shift(t, 1.0), t)
    for shift in (0.5, 2.0, 3.0):
        sched = FlowMatchEulerDiscreteScheduler(shift=shift)
        sched.set_timesteps(sigmas=np.linspace(1, 0, 11)[:-1])
        torch.testing.assert_close(common.time_shift(t.flip(0), shift), sched.sigmas.float(), atol=1e-6, rtol=0)
        s = common.time_shift(t, shift)
        assert s[0] == 0 and s[-1] == 1 and (s.diff() > 0).all()


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_sampler_matches_diffusers_step_by_step(shift):
    torch.manual_seed(0)
    w = torch.randn(3, 3) * 0.3

    def velocity_field(x, timestep, cond, noise_level=None):  # any smooth, time-dependent field
        return torch.einsum("ij,bjhw->bihw", w, x) + timestep.view(-1, 1, 1, 1) / 1000

    noise = torch.randn(2, 3, 4, 4)
    ours = fm.sample(velocity_field, noise, {"drop": torch.zeros(2, dtype=torch.bool)}, steps=7, shift=shift)
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(sigmas=np.linspace(1, 0, 8)[:-1])
    x = noise
    for t in sched.timesteps:
        x = sched.step(velocity_field(x, t.expand(2), None), t, x).prev_sample
    torch.testing.assert_close(ours, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method,steps", [("euler", 1), ("euler", 5), ("heun", 3)])
def test_exact_velocity_lands_on_the_data_point(method, steps):
    # For data concentrated at c, the true velocity is v(x, t) = (x - c) / t; both samplers are exact on it.
    c = torch.tensor([0.5, -0.25, 1.0]).view(1, 3, 1, 1)

    def velocity_field(x, timestep, cond, noise_level=None):
        return (x - c) / (timestep.view(-1, 1, 1, 1) / 1000)

    x = fm.sample(velocity_field, torch.randn(4, 3, 2, 2), {"drop": torch.zeros(4, dtype=torch.bool)}, steps,
                  shift=2.0, method=method)
    torch.testing.assert_close(x, c.expand(4, 3, 2, 2), atol=1e-5, rtol=0)


def test_heun_is_second_order():
    # dx/dt = x from t = 1 to 0: x(0) = x(1) / e. Halving the step cuts Heun's error ~4x, Euler's ~2x.
    def velocity_field(x, timestep, cond, noise_level=None):
        return x

    cond = {"drop": torch.zeros(1, dtype=torch.bool)}
    x1 = torch.ones(1, 1, 1, 1)
    err = {m: [abs(fm.sample(velocity_field, x1, cond, n, method=m).item() - math.exp(-1)) for n in (8, 16)]
           for m in ("euler", "heun")}
    assert 3.5 < err["heun"][0] / err["heun"][1] < 4.5
    assert 1.8 < err["euler"][0] / err["euler"][1] < 2.2
    assert err["heun"][1] < err["euler"][1] / 20


def test_classifier_free_guidance_combines_conditional_and_null():
    def velocity_field(x, timestep, cond, noise_level=None):  # conditional rows move by +1, null rows by -1
        return torch.where(cond["drop"].view(-1, 1, 1, 1), -1.0, 1.0).expand_as(x)

    cond = {"drop": torch.zeros(2, dtype=torch.bool), "label": torch.tensor([0, 1])}
    x = fm.sample(velocity_field, torch.zeros(2, 1, 2, 2), cond, steps=1, guidance_scale=4.0)
    # One Euler step from t = 1 to 0: x = 0 - (v_u + w (v_c - v_u)) = -(-1 + 4 * 2) = -7.
    torch.testing.assert_close(x, torch.full((2, 1, 2, 2), -7.0))


def brute_force_cost(x0, noise):
    """The oracle: the least total squared distance over every re-pairing (all n! permutations)."""
    cost = torch.cdist(x0.flatten(1).double(), noise.flatten(1).double()).pow(2).numpy()
    perms = np.array(list(itertools.permutations(range(len(x0)))))
    return cost[np.arange(len(x0)), perms].sum(1).min()


def which_noise_row(paired, noise):
    """For each row of the re-paired noise, the index of the original noise row it is (exactly one)."""
    same = (paired[:, None] == noise[None]).flatten(2).all(-1)
    assert (same.sum(1) == 1).all()
    return same.int().argmax(1)


def test_ot_coupling_is_the_exact_minimum_assignment():
    """Over several sizes and seeds (one draw of five can have an optimum that is its own inverse, so that
    applying the inverse permutation would pass): the re-pairing uses every noise row once and has the
    brute-force minimum cost; with labels, noise moves only within a class, at each class's minimum."""
    cost = lambda a, b: (a - b).pow(2).sum().item()
    not_self_inverse = 0
    for n, seed in itertools.product((2, 3, 5, 7), range(5)):
        g = torch.Generator().manual_seed(seed)
        x0, noise = torch.randn(n, 2, 3, 3, generator=g), torch.randn(n, 2, 3, 3, generator=g)
        paired = fm.ot_pair(x0, noise)
        perm = which_noise_row(paired, noise)
        assert sorted(perm.tolist()) == list(range(n)), (n, seed)
        assert cost(x0, paired) == pytest.approx(brute_force_cost(x0, noise), rel=1e-6), (n, seed)
        not_self_inverse += bool((perm[perm] != torch.arange(n)).any())
        labels = torch.randint(0, 2, (n,), generator=g)
        per_class = fm.ot_pair(x0, noise, labels)
        assert (labels[which_noise_row(per_class, noise)] == labels).all(), (n, seed)
        for c in labels.unique():
            idx = (labels == c).nonzero().flatten()
            assert cost(x0[idx], per_class[idx]) == pytest.approx(brute_force_cost(x0[idx], noise[idx]), rel=1e-6)
    assert not_self_inverse >= 5  # the cases where the inverse permutation is another pairing
