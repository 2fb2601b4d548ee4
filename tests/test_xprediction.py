"""x-prediction for flow matching (training/objectives/xprediction.py): the same weights give the same loss and the same
samples as the v-prediction path, and the loss is on the velocity with t clamped at T_MIN (JiT)."""
import pytest
import torch

import train_flow_matching as fm
from training.objectives import xprediction


class Velocity(torch.nn.Module):
    """A fixed nonlinear velocity field v(x, t, label): a stand-in network with weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 3) * 0.5)

    def forward(self, x, timestep, cond, noise_level=None):
        t = (timestep / 1000).view(-1, 1, 1, 1)
        return torch.tanh(torch.einsum("ij,bjhw->bihw", self.w, x)) * (1 + t) + cond["label"].view(-1, 1, 1, 1) * 0.1


class AsCleanImage(torch.nn.Module):
    """The same weights, read as an x-prediction network: x0_hat = x_t - t v(x_t), the clean image that the
    velocity v implies on the straight path x_t = (1 - t) x0 + t eps."""

    def __init__(self, velocity):
        super().__init__()
        self.velocity = velocity

    def forward(self, x, timestep, cond, noise_level=None):
        return x - (timestep / 1000).view(-1, 1, 1, 1) * self.velocity(x, timestep, cond)


def batch(n=6):
    g = torch.Generator().manual_seed(1)
    cond = {"label": torch.arange(n) % 3, "drop": torch.zeros(n, dtype=torch.bool)}
    return torch.randn(n, 3, 4, 4, generator=g), torch.randn(n, 3, 4, 4, generator=g), cond


def test_the_x0_loss_equals_the_v_loss_at_the_same_weights_where_t_is_above_the_clamp():
    x0, noise, cond = batch()
    v_model = Velocity()
    t = torch.tensor([0.05, 0.1, 0.3, 0.5, 0.9, 1.0])
    v_loss = fm.flow_matching_loss(v_model, x0, cond, t, noise, "v")
    x_loss = fm.flow_matching_loss(AsCleanImage(v_model), x0, cond, t, noise, "x0")
    torch.testing.assert_close(x_loss, v_loss)


def test_below_the_clamp_the_loss_is_the_clean_image_error_over_t_min_squared():
    x0, noise, cond = batch()
    model = Velocity()
    t = torch.tensor([0.0, 0.01, 0.02, 0.03, 0.04, 0.049])
    x_loss = fm.flow_matching_loss(model, x0, cond, t, noise, "x0")
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    x0_hat = model(x_t, t * 1000, cond)
    expected = (x0_hat - x0).pow(2).mean(dim=(1, 2, 3)) / xprediction.T_MIN ** 2  # JiT: both sides clamped
    torch.testing.assert_close(x_loss, expected)


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_the_sampler_converts_x0_to_the_velocity_and_matches_v_sampling(method):
    """Steps = 16: every grid time t_i >= 1/16 > T_MIN, where the conversion is exact; with guidance."""
    _, noise, cond = batch()
    v_model = Velocity()
    v = fm.sample(v_model, noise, cond, 16, guidance_scale=2.0, method=method, prediction="v")
    x = fm.sample(AsCleanImage(v_model), noise, cond, 16, guidance_scale=2.0, method=method, prediction="x0")
    torch.testing.assert_close(x, v, rtol=1e-5, atol=1e-5)


def test_generate_reads_the_prediction_from_the_run_config():
    cfg = fm.DEFAULTS.copy()
    _, noise, cond = batch()
    v_model = Velocity()
    cfg_x0 = {**cfg, "objective": {**cfg["objective"], "prediction": "x0"}, "val": {**cfg["val"], "steps": 8}}
    cfg_v = {**cfg_x0, "objective": {**cfg["objective"], "prediction": "v"}}
    torch.testing.assert_close(fm.generate(AsCleanImage(v_model), noise, cond, cfg_x0, guidance_scale=1.0),
                               fm.generate(v_model, noise, cond, cfg_v, guidance_scale=1.0), rtol=1e-5, atol=1e-5)


def test_eval_fid_still_tells_the_methods_apart_now_that_both_have_a_prediction_key():
    import eval_fid
    import train_ddpm

    assert "prediction" in fm.DEFAULTS["objective"] and "prediction" in train_ddpm.DEFAULTS["objective"]
    assert eval_fid.method_of(fm.DEFAULTS) is fm and eval_fid.method_of(train_ddpm.DEFAULTS) is train_ddpm
