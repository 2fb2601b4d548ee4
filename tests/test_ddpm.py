"""train_ddpm.py against diffusers' DDPMScheduler / DDIMScheduler as the oracle, and a tiny end-to-end run.

CPU only, offline. Run: python -m pytest tests/test_ddpm.py -q
"""
import json
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, SD3Transformer2DModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg
from diffusers.training_utils import compute_snr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.config import config  # noqa: E402
from training.model.mmdit import guided, load_exported, rescale_guidance  # noqa: E402
import train_ddpm as ddpm  # noqa: E402

T = 1000
DIFFUSERS_SCHEDULE = {"quadratic": "scaled_linear", "linear": "linear", "cosine": "squaredcos_cap_v2"}
DIFFUSERS_PREDICTION = {"v": "v_prediction", "eps": "epsilon", "x0": "sample"}


def scheduler(cls=DDPMScheduler, schedule="quadratic", zero_snr=True, prediction="v", **kw):
    return cls(num_train_timesteps=T, beta_schedule=DIFFUSERS_SCHEDULE[schedule], beta_start=0.00085,
               beta_end=0.012, rescale_betas_zero_snr=zero_snr, timestep_spacing="trailing",
               prediction_type=DIFFUSERS_PREDICTION[prediction], clip_sample=False, **kw)


def schedule(schedule="quadratic", zero_snr=True):
    return ddpm.make_schedule(T, schedule, 0.00085, 0.012, zero_snr)


# ---- Schedule and forward process ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["quadratic", "linear", "cosine"])
@pytest.mark.parametrize("zero_snr", [True, False])
def test_schedule_matches_diffusers(name, zero_snr):
    ours = schedule(name, zero_snr)
    theirs = scheduler(schedule=name, zero_snr=zero_snr).alphas_cumprod
    assert ours.shape == (T,)
    # ours is float64, diffusers' float32 cumprod drifts by ~1e-6 relative over 1000 steps
    torch.testing.assert_close(ours.float(), theirs, rtol=2e-5, atol=1e-7)
    if zero_snr:
        assert ours[-1].item() == 0.0  # exactly zero terminal SNR
        plain = ddpm.make_schedule(T, name, 0.00085, 0.012, False)
        torch.testing.assert_close(ours[0], plain[0], rtol=1e-12, atol=0)  # the first value is unchanged
    else:
        assert ours[-1].item() > 0


def test_quadratic_is_the_papers_schedule():
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, T, dtype=torch.float64) ** 2
    torch.testing.assert_close(ddpm.make_schedule(T, "quadratic", 0.00085, 0.012, False), torch.cumprod(1 - betas, 0))
    assert ddpm.DEFAULTS["objective"]["beta_schedule"] == "quadratic"
    assert ddpm.DEFAULTS["objective"]["num_timesteps"] == 1000


@pytest.mark.parametrize("zero_snr", [True, False])
def test_forward_process_and_targets_match_diffusers(zero_snr):
    sched, ab = scheduler(zero_snr=zero_snr), schedule(zero_snr=zero_snr)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(6, 3, 8, 8, generator=g), torch.randn(6, 3, 8, 8, generator=g)
    t = torch.tensor([0, 1, 250, 500, 998, 999])
    torch.testing.assert_close(ddpm.add_noise(x0, noise, t, ab), sched.add_noise(x0, noise, t), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(ddpm.target_of(x0, noise, t, ab, "v"), sched.get_velocity(x0, noise, t),
                               rtol=1e-5, atol=2e-6)
    assert torch.equal(ddpm.target_of(x0, noise, t, ab, "eps"), noise)
    assert torch.equal(ddpm.target_of(x0, noise, t, ab, "x0"), x0)
    if zero_snr:  # the last step is pure noise, and v = -x0 there
        torch.testing.assert_close(ddpm.add_noise(x0, noise, t, ab)[-1], noise[-1])
        torch.testing.assert_close(ddpm.target_of(x0, noise, t, ab, "v")[-1], -x0[-1])


@pytest.mark.parametrize("prediction", ["v", "eps", "x0"])
@pytest.mark.parametrize("zero_snr", [True, False])
def test_snr_and_min_snr_weights_match_diffusers(prediction, zero_snr):
    sched, ab = scheduler(zero_snr=zero_snr, prediction=prediction), schedule(zero_snr=zero_snr)
    t = torch.arange(T)
    snr_theirs = compute_snr(sched, t)
    snr = ab / (1 - ab)
    torch.testing.assert_close(snr.float(), snr_theirs, rtol=5e-5, atol=1e-9)
    gamma = 5.0
    weight = ddpm.min_snr_weight(snr, prediction, gamma, "paper")
    assert torch.isfinite(weight).all() and (weight >= 0).all()
    # diffusers' examples/text_to_image/train_text_to_image.py, where SNR > 0 (0/0 is nan there)
    ref = torch.stack([snr_theirs, gamma * torch.ones_like(snr_theirs)], dim=1).min(dim=1)[0]
    ref = {"eps": ref / snr_theirs, "v": ref / (snr_theirs + 1), "x0": ref}[prediction]
    positive = snr_theirs > 0
    torch.testing.assert_close(weight.float()[positive], ref[positive], rtol=5e-5, atol=1e-9)
    if zero_snr:  # SNR = 0 at the terminal step: the limits, not nan
        assert snr[-1].item() == 0.0
        assert weight[-1].item() == {"eps": 1.0, "v": 0.0, "x0": 0.0}[prediction]
    # off: weight 1 everywhere
    for form in ("paper", "plus_one"):
        assert torch.equal(ddpm.min_snr_weight(snr, prediction, 0.0, form), torch.ones_like(snr))


@pytest.mark.parametrize("name", ["quadratic", "linear", "cosine"])
@pytest.mark.parametrize("prediction", ["v", "eps", "x0"])
@pytest.mark.parametrize("gamma", [0.0, 1.0, 5.0])
def test_weights_finite_everywhere(name, prediction, gamma):
    for zero_snr in (True, False):
        ab = schedule(name, zero_snr)
        for form in ("paper", "plus_one"):
            w = ddpm.min_snr_weight(ab / (1 - ab), prediction, gamma, form)
            assert torch.isfinite(w).all(), (name, prediction, gamma, zero_snr, form)


@pytest.mark.parametrize("prediction", ["v", "x0"])
def test_ddpm_loss_matches_a_diffusers_built_loss(prediction):
    sched, ab = scheduler(prediction=prediction), schedule()
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(5, 3, 8, 8, generator=g), torch.randn(5, 3, 8, 8, generator=g)
    t = torch.tensor([0, 10, 500, 900, 999])
    seen = {}

    def model(x, timestep, cond, noise_level=None):
        seen["t"], seen["noise_level"] = timestep, noise_level
        return 0.3 * x + timestep.view(-1, 1, 1, 1) / 1000

    loss = ddpm.ddpm_loss(model, x0, {}, t, noise, ab, prediction, ddpm.min_snr_weight(ab / (1 - ab), prediction, 5.0,
                                                                                    "paper"))
    assert seen["t"].dtype == torch.float32 and torch.equal(seen["t"], t.float())  # the model sees t in [0, T-1]
    torch.testing.assert_close(seen["noise_level"], ddpm.noise_level(ab[t]).float())
    x_t = sched.add_noise(x0, noise, t)
    target = sched.get_velocity(x0, noise, t) if prediction == "v" else x0
    snr = compute_snr(sched, t)
    w = torch.minimum(snr, torch.full_like(snr, 5.0)) / ((snr + 1) if prediction == "v" else 1)
    ref = (model(x_t, t.float(), {}) - target).pow(2).mean(dim=(1, 2, 3)) * w
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-6)
    # a perfect model has zero loss
    perfect = ddpm.ddpm_loss(lambda x, tt, c, nl: ddpm.target_of(x0, noise, t, ab, prediction), x0, {}, t, noise, ab,
                             prediction, ddpm.min_snr_weight(ab / (1 - ab), prediction, 5.0))
    assert perfect.abs().max().item() == 0.0


def test_zero_terminal_snr_with_eps_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"objective\.zero_terminal_snr.*objective\.prediction"):
        ddpm.main(["--objective.prediction=eps", f"--run_dir={run_dir}", f"--data.cache_dir={tmp_path / 'c'}",
                   "--log.wandb=off", "--data.demo_samples=96", "--data.val_holdout=16", "--train.max_steps=1",
                   "--train.batch_size=8", "--val.steps=1", "--val.num_samples=1", "--val.loss_samples=8"])
    assert not run_dir.exists()  # refused at start-up, before anything was written
    cfg = config.load_config(ddpm.DEFAULTS, ["--objective.prediction=eps", "--objective.zero_terminal_snr=false"])
    ddpm.check_objective(cfg)  # eps without zero terminal SNR is fine
    with pytest.raises(ValueError, match="objective.zero_terminal_snr"):
        ddpm.generate(None, torch.zeros(1, 3, 4, 4), {},
                      config.load_config(ddpm.DEFAULTS, ["--objective.prediction=eps"]))


# ---- Samplers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 10, 25, 32, 50, 100, 250, 999, 1000])
def test_trailing_grid_matches_diffusers(steps):
    sched = scheduler()
    sched.set_timesteps(steps)
    grid = ddpm.timestep_grid(T, steps)
    assert grid == sched.timesteps.tolist()
    assert grid[0] == T - 1  # sampling starts at the last timestep
    assert len(set(grid)) == steps and grid == sorted(grid, reverse=True)


@pytest.mark.parametrize("prediction,zero_snr", [("v", True), ("x0", True), ("eps", False), ("v", False)])
def test_ddim_step_matches_diffusers(prediction, zero_snr):
    sched, ab = scheduler(DDIMScheduler, zero_snr=zero_snr, prediction=prediction, set_alpha_to_one=True), \
        schedule(zero_snr=zero_snr)
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(2)
    for t in sched.timesteps.tolist():
        x, out = torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 3, 8, 8, generator=g)
        theirs = sched.step(out, t, x, eta=0.0).prev_sample
        prev = t - T // 10  # DDIMScheduler's previous timestep
        x0, eps = ddpm.predict_x0_eps(out, x, ab[t].item(), prediction)
        ours = ddpm.ddim_step(x0, eps, ab[prev].item() if prev >= 0 else 1.0)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prediction,zero_snr", [("v", True), ("x0", True), ("eps", False)])
def test_ancestral_step_matches_diffusers(prediction, zero_snr):
    sched, ab = scheduler(zero_snr=zero_snr, prediction=prediction), schedule(zero_snr=zero_snr)
    sched.set_timesteps(10)
    ts = sched.timesteps.tolist()
    g = torch.Generator().manual_seed(3)
    for i, t in enumerate(ts):
        x, out = torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 3, 8, 8, generator=g)
        theirs = sched.step(out, t, x, generator=torch.Generator().manual_seed(i)).prev_sample
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(i))  # the same draw
        ab_prev = ab[ts[i + 1]].item() if i + 1 < len(ts) else 1.0
        x0, _ = ddpm.predict_x0_eps(out, x, ab[t].item(), prediction)
        ours = ddpm.ddpm_step(x0, x, ab[t].item(), ab_prev, noise)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_guidance_rescale_matches_diffusers():
    g = torch.Generator().manual_seed(4)
    out_c, out_u = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    for w, phi in [(1.0, 0.0), (3.0, 0.0), (3.0, 0.7), (7.5, 1.0)]:
        out = out_u + w * (out_c - out_u)
        ref = rescale_noise_cfg(out, out_c, guidance_rescale=phi)
        torch.testing.assert_close(rescale_guidance(out, out_c, phi), ref)


@pytest.mark.parametrize("scales", [(1.0, 0.0), (3.0, 0.0), (3.0, 2.0), (1.0, 2.0)])
def test_guided_with_rescale_rescales_commons_guidance(scales):
    """The DDPM guidance is guided (semantic and control guidance), then rescaled by the fully
    conditional branch's std."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 3, 8, 8, generator=g)
    cond = {"label": torch.tensor([0, 4, 8]), "drop": torch.tensor([False, True, False])}
    t, nl = torch.full((3,), 500.0), torch.full((3,), 0.4)
    model = ToyModel(controls=True)
    plain = guided(model, x, t, cond, *scales, noise_level=nl)
    conditional = model(x, t, {**cond, "drop_controls": torch.zeros(3, dtype=torch.bool)}, nl).float()
    torch.testing.assert_close(guided(model, x, t, cond, *scales, noise_level=nl, rescale=0.7),
                               rescale_noise_cfg(plain, conditional, guidance_rescale=0.7))


def test_noise_level_is_the_flow_time_of_equal_snr():
    ab = schedule()
    nl = ddpm.noise_level(ab)
    assert nl[-1].item() == 1.0 and 0 < nl[0].item() < 0.05 and (nl[1:] >= nl[:-1]).all()
    # flow matching x_t = (1 - t) x0 + t eps has SNR ((1 - t) / t)^2
    torch.testing.assert_close(((1 - nl) / nl)[:-1] ** 2, (ab / (1 - ab))[:-1])


class ToyModel(torch.nn.Module):
    """A fixed, nonlinear stand-in for the denoiser whose output depends on x, t and the condition."""

    def __init__(self, controls=False):  # controls: also a term that the control condition and noise level set
        super().__init__()
        self.controls = controls

    def forward(self, x, timestep, cond, noise_level=None):
        c = torch.where(cond["drop"], 0.0, cond["label"].float() + 1).view(-1, 1, 1, 1)
        out = torch.tanh(0.7 * x + 0.1 * c) + (timestep.view(-1, 1, 1, 1) / 1000) * 0.2 * c
        if self.controls:
            keep = ~cond["drop_controls"] if "drop_controls" in cond else torch.ones_like(cond["drop"])
            out = out + 0.5 * (noise_level * keep).view(-1, 1, 1, 1) * torch.cos(x)
        return out


def diffusers_loop(sched, noise, cond, steps, w, phi, generator=None):
    sched.set_timesteps(steps)
    model, x, n = ToyModel(), noise.clone(), len(noise)
    for t in sched.timesteps:
        tt = torch.full((n,), float(t))
        both = {"label": torch.cat([cond["label"]] * 2), "drop": torch.cat([torch.zeros(n), torch.ones(n)]).bool()}
        out_c, out_u = model(torch.cat([x, x]), torch.cat([tt, tt]), both).chunk(2)
        out = rescale_noise_cfg(out_u + w * (out_c - out_u), out_c, guidance_rescale=phi)
        kw = {"eta": 0.0} if isinstance(sched, DDIMScheduler) else {"generator": generator}
        x = sched.step(out, t, x, **kw).prev_sample
    return x


@pytest.mark.parametrize("method", ["ddim", "ddpm"])
@pytest.mark.parametrize("steps", [4, 10])
def test_full_sampler_matches_a_diffusers_loop(method, steps):
    """The whole loop, with guidance and its rescale, from x_T = noise at t = T-1 (trailing spacing)."""
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(3, 3, 8, 8, generator=g)
    cond = {"label": torch.tensor([0, 4, 8]), "drop": torch.zeros(3, dtype=torch.bool)}
    ours = ddpm.sample(ToyModel(), noise, cond, schedule(), steps, "v", 3.0, 0.7, method,
                       generator=torch.Generator().manual_seed(6))
    sched = scheduler(DDIMScheduler, set_alpha_to_one=True) if method == "ddim" else scheduler()
    theirs = diffusers_loop(sched, noise, cond, steps, 3.0, 0.7, torch.Generator().manual_seed(6))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_generate_reads_a_plain_dict_config():
    cfg = json.loads(json.dumps(ddpm.DEFAULTS))  # as eval_fid.py passes an exported config.json
    cfg["val"]["steps"], cfg["val"]["guidance_scale"] = 3, 3.0
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    cond = {"label": torch.tensor([1, 2]), "drop": torch.zeros(2, dtype=torch.bool)}
    x = ddpm.generate(ToyModel(), noise, cond, cfg)
    ref = ddpm.sample(ToyModel(), noise, cond, schedule(), 3, "v", 3.0, 0.7, "ddim")
    torch.testing.assert_close(x, ref)
    y = ddpm.generate(ToyModel(), noise, cond, cfg, steps=5, guidance_scale=1.0, sampler="ddim")
    torch.testing.assert_close(y, ddpm.sample(ToyModel(), noise, cond, schedule(), 5, "v", 1.0, 0.7, "ddim"))


# ---- End to end ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_run_resumes_and_exports(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--data.demo_samples=320", "--data.val_holdout=64", "--train.batch_size=16", "--val.steps=2",
            "--val.num_samples=4", "--val.loss_samples=16", "--log.wandb=off", "--log.every=1",
            "--train.warmup_steps=1", f"--run_dir={run_dir}", f"--data.cache_dir={tmp_path / 'cache'}"]
    ddpm.main(args + ["--train.max_steps=2"])
    assert (run_dir / "checkpoints" / "step_00000002" / "state.pt").exists()
    ddpm.main(args + ["--train.max_steps=4", "--resume", "latest"])
    exported = (run_dir / "export" / "config.json").stat().st_mtime_ns
    assert ddpm.main(args + ["--resume", "latest"]) == run_dir  # done: nothing trained, nothing exported again
    assert (run_dir / "export" / "config.json").stat().st_mtime_ns == exported

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m["step"] for m in metrics if "loss" in m]
    assert train_steps == [1, 2, 3, 4]  # the resumed run continued at step 3, not at 1
    val = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in val] == [2, 4] and all(0 < m["val_loss"] < 10 for m in val)
    assert all(f"loss_t{k}" in metrics[0] for k in range(5))
    assert torch.load(run_dir / "checkpoints" / "step_00000004" / "state.pt", weights_only=True)["step"] == 4
    assert (run_dir / "samples" / "step_00000004.png").exists()

    export = run_dir / "export"
    exported_cfg = json.loads((export / "config.json").read_text())
    assert "prediction" in exported_cfg["objective"] and "time_sampling" not in exported_cfg["objective"]
    assert "method" not in exported_cfg
    transformer = SD3Transformer2DModel.from_pretrained(export / "transformer")
    assert transformer.config.sample_size == 16
    model, cfg = load_exported(export)
    noise = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    cond = {"label": torch.tensor([0, 1]), "drop": torch.zeros(2, dtype=torch.bool)}
    x = ddpm.generate(model, noise, cond, exported_cfg, steps=2)
    assert x.shape == noise.shape and torch.isfinite(x).all()
