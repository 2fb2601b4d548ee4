"""Post-hoc EMA (training/run/phema.py, tools/phema.py): the profile formulas against numerical integration, the
tracked EMA against the closed-form profile integral, the reconstruction against a third power EMA tracked
exactly, snapshots that a kill cuts off never read, and the profiles resumed bitwise in a real run."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from scipy import integrate
from safetensors.torch import load_file

from training.run import phema
from conftest import ROOT, tiny_run_args

STEPS, BATCH, DIM = 400, 8, 64


class Weights(torch.nn.Module):
    """A stand-in model: its parameters are set to a known trajectory, one point per optimizer step."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.zeros(DIM)), torch.nn.Parameter(torch.zeros(2, 3))


def trajectory():
    """A smooth drift plus noise that shrinks as 1/sqrt(step), as SGD's iterates do; float64 (STEPS, DIM + 6)."""
    g = torch.Generator().manual_seed(0)
    s = torch.arange(1, STEPS + 1, dtype=torch.float64)[:, None]
    freq = torch.linspace(0.5, 3, DIM + 6, dtype=torch.float64)[None]
    return torch.sin(s / 40 * freq) + 0.5 * torch.randn(STEPS, DIM + 6, generator=g, dtype=torch.float64) / s.sqrt()


def flat(tensors):
    return torch.cat([t.double().flatten() for t in tensors])


def train(stds, every, run_dir, main_process=True):
    """Feed the trajectory through PowerEMA as the trainers do (update once per step, snapshot when due)."""
    model, traj = Weights(), trajectory().float()
    ema = phema.PowerEMA(model, stds, every, BATCH, run_dir, main_process)
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            model.a.copy_(traj[step - 1, :DIM]), model.b.copy_(traj[step - 1, DIM:].view(2, 3))
        ema.update(model)
        if ema.due(step, STEPS):
            ema.snapshot(step)
    return ema


def profile_mean(gamma, steps=STEPS):
    """The EMA at the last step in closed form (eq. 2 integrated over each step's interval): step s's weights
    carry (s^(g+1) - (s-1)^(g+1)) / T^(g+1)."""
    s = torch.arange(1, steps + 1, dtype=torch.float64)
    w = (s ** (gamma + 1) - (s - 1) ** (gamma + 1)) / steps ** (gamma + 1)
    return (w[:, None] * trajectory()).sum(0)


def test_std_and_gamma_are_inverse_and_std_is_the_profiles_relative_width():
    for std in (0.01, 0.05, 0.1, 0.2, 0.28):
        gamma = phema.gamma_of_std(std)
        assert phema.std_of_gamma(gamma) == pytest.approx(std, rel=1e-10)
        # The std of the density (g + 1) tau^g on [0, 1], by quadrature: sigma_rel of a profile ending at t = 1.
        mean = integrate.quad(lambda x: x * (gamma + 1) * x ** gamma, 0, 1)[0]
        var = integrate.quad(lambda x: (x - mean) ** 2 * (gamma + 1) * x ** gamma, 0, 1)[0]
        assert np.sqrt(var) == pytest.approx(std, rel=1e-8)
    assert phema.gamma_of_std(0.05) == pytest.approx(16.97, abs=0.01)  # the paper's pair of profiles
    assert phema.gamma_of_std(0.10) == pytest.approx(6.94, abs=0.01)
    with pytest.raises(ValueError, match="relative std"):
        phema.gamma_of_std(0.29)


def test_profile_inner_products_match_quadrature():
    def p(t, g):
        return lambda x: (g + 1) * x ** g / t ** (g + 1) if x <= t else 0.0

    for t_a, g_a, t_b, g_b in [(1.0, 7.0, 1.0, 17.0), (0.4, 7.0, 1.0, 17.0), (1.0, 0.5, 0.3, 3.0),
                               (2.0, 2.0, 5.0, 0.2)]:
        expected = integrate.quad(lambda x: p(t_a, g_a)(x) * p(t_b, g_b)(x), 0, min(t_a, t_b), limit=200)[0]
        assert phema.profile_inner_products(t_a, g_a, t_b, g_b) == pytest.approx(expected, rel=1e-8)
        assert phema.profile_inner_products(t_b, g_b, t_a, g_a) == pytest.approx(expected, rel=1e-8)


def test_a_constant_trajectory_is_reproduced_exactly_even_where_the_fit_is_poor():
    """The coefficients sum to 1 (the mix's profile integrates to 1, as an EMA's does), also for a target the
    snapshots fit badly: three snapshots of a short profile, a std near the end of the range."""
    x, fit_error = phema.solve_coefficients([100, 200, 300], [phema.gamma_of_std(0.05)] * 3, 300,
                                            phema.gamma_of_std(0.28))
    assert fit_error > 0.1 and x.sum() == pytest.approx(1.0, abs=1e-12)


def test_tracked_profile_is_the_closed_form_integral(tmp_path):
    ema = train([0.05, 0.2], every=10**9, run_dir=tmp_path)  # tracking on, one snapshot at the end
    for std, profile in zip(ema.stds, ema.profiles):
        expected = profile_mean(phema.gamma_of_std(std))
        torch.testing.assert_close(flat(profile), expected, rtol=1e-5, atol=1e-6)
    assert ema.images == STEPS * BATCH


@pytest.mark.parametrize("target", [0.07, 0.15])
def test_reconstruction_matches_a_third_power_ema_tracked_exactly(tmp_path, monkeypatch, target):
    """Profiles 0.05 and 0.10 snapshotted every 10 steps; the EMA of std `target` (between them, and beyond
    the longer one) reconstructed from the snapshot files equals a third power EMA tracked at that std, to
    1e-4 relative (with snapshots in fp32; the fp16 ones the trainers write are within their rounding)."""
    monkeypatch.setattr(phema, "SNAPSHOT_DTYPE", torch.float32)
    train([0.05, 0.10], every=10 * BATCH, run_dir=tmp_path / "fp32")
    third = train([target], every=10**9, run_dir=tmp_path / "third")
    weights, info = phema.reconstruct(tmp_path / "fp32" / "phema", target)
    ours, exact = flat([weights["a"], weights["b"]]), flat(third.profiles[0])
    assert info["snapshots"] == STEPS // 10 and info["images"] == STEPS * BATCH and info["profile_fit_error"] < 1e-2
    assert ((ours - exact).norm() / exact.norm()).item() < 1e-4
    torch.testing.assert_close(exact, profile_mean(phema.gamma_of_std(target)), rtol=1e-5, atol=1e-6)
    # The fp16 snapshots: rounding of 2^-11 relative per value, mixed with coefficients of sum 1.
    monkeypatch.setattr(phema, "SNAPSHOT_DTYPE", torch.float16)
    train([0.05, 0.10], every=10 * BATCH, run_dir=tmp_path / "fp16")
    weights16, _ = phema.reconstruct(tmp_path / "fp16" / "phema", target)
    assert ((flat([weights16["a"], weights16["b"]]) - exact).norm() / exact.norm()).item() < 3e-3
    assert load_file(str(next((tmp_path / "fp16" / "phema").glob("*.safetensors"))))["0.05/a"].dtype == torch.float16


def test_a_checkpoints_post_hoc_ema_is_reconstructed_at_its_own_step(tmp_path, monkeypatch):
    """eval_fid.py / sample.py --checkpoint X --phema_std s: the EMA of std s at X's time (snapshots before X and
    X's own fp32 profiles), equal to a third power EMA tracked exactly to X; the run's last snapshot, 145 steps
    later, is another EMA (what --checkpoint X used to be labelled with)."""
    from safetensors.torch import save_file

    monkeypatch.setattr(phema, "SNAPSHOT_DTYPE", torch.float32)
    x_step, target, run = 255, 0.08, tmp_path / "run"  # X between the snapshots of steps 250 and 260
    model, traj = Weights(), trajectory().float()
    ema = phema.PowerEMA(model, [0.05, 0.10], 10 * BATCH, BATCH, run, True)
    third = phema.PowerEMA(model, [target], 10**9, BATCH, tmp_path / "third", True)
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            model.a.copy_(traj[step - 1, :DIM]), model.b.copy_(traj[step - 1, DIM:].view(2, 3))
        ema.update(model), third.update(model)
        if ema.due(step, STEPS):
            ema.snapshot(step)
        if step == x_step:  # the checkpoint as save_checkpoint writes it: the profiles, and the config in state.pt
            ckpt = run / "checkpoints" / f"step_{step:08d}"
            ckpt.mkdir(parents=True)
            save_file(ema.checkpoint_tensors()["phema"], str(ckpt / "phema.safetensors"))
            torch.save({"step": step, "config": {"ckpt": {"phema_stds": [0.05, 0.10]}}}, ckpt / "state.pt")
            exact = flat(third.profiles[0])
    weights, info = phema.reconstruct(run / "phema", target, checkpoint=ckpt)
    ours = flat([weights["a"], weights["b"]])
    assert info["images"] == x_step * BATCH and info["snapshots"] == x_step // 10 + 1
    assert ((ours - exact).norm() / exact.norm()).item() < 1e-4
    last, info = phema.reconstruct(run / "phema", target)
    assert info["images"] == STEPS * BATCH and ((flat([last["a"], last["b"]]) - exact).norm() / exact.norm()) > 0.1
    (ckpt / "phema.safetensors").unlink()  # a checkpoint from before the run tracked profiles: a clear error
    with pytest.raises(FileNotFoundError, match=r"holds no post-hoc EMA profiles.*ckpt.phema_every"):
        phema.reconstruct(run / "phema", target, checkpoint=ckpt)


def test_a_repa_runs_profiles_load_into_the_model_that_consumers_rebuild(tmp_path, tiny_dino):
    """A REPA run trains a Denoiser with its projector; eval_fid.py / sample.py / tools/phema.py --phema_std rebuild
    the exported model, without it. The snapshots hold exactly its parameters; snapshots written with the
    projector's (before) load too, its names left out."""
    from safetensors.torch import save_file

    from test_repa import run_config
    from training.model.mmdit import build_denoiser
    from training.run.start import build_for_run

    cfg = run_config(tiny_dino)
    trained = build_for_run(cfg, (3, 16, 16))
    ema = phema.PowerEMA(trained, [0.05, 0.10], BATCH, BATCH, tmp_path / "run", True)
    ema.update(trained)
    path = ema.snapshot(1)
    assert not any("projector" in k for k in load_file(str(path)))
    consumer = build_denoiser(cfg, 3, 16)
    assert phema.apply_reconstruction(consumer, tmp_path / "run", 0.08)["snapshots"] == 1
    for name, p in consumer.named_parameters():
        torch.testing.assert_close(p, dict(trained.named_parameters())[name], rtol=1e-3, atol=1e-3)  # (fp16)
    old = {f"{std:g}/{name}": p.detach().half() for std in (0.05, 0.1) for name, p in trained.named_parameters()}
    assert any("/projector." in k for k in old)
    (tmp_path / "old" / "phema").mkdir(parents=True)
    gammas = json.dumps([phema.gamma_of_std(0.05), phema.gamma_of_std(0.1)])
    save_file(old, str(tmp_path / "old" / "phema" / "phema_000000000008.safetensors"),
              metadata={"images": "8", "step": "1", "stds": "[0.05, 0.1]", "gammas": gammas})
    assert phema.apply_reconstruction(build_denoiser(cfg, 3, 16), tmp_path / "old", 0.08)["snapshots"] == 1


def test_loading_a_checkpoint_reads_the_profiles_only_where_they_live(tmp_path, monkeypatch):
    """PowerEMA.load at a resume or rollback: every rank needs the image count, only the main process the
    profiles (10 GB for the recipe model). The other ranks read one 8-byte tensor; the main process reads each
    profile tensor once, never the whole file at once, and gets them back bitwise."""
    import safetensors
    import safetensors.torch

    source = train([0.05, 0.10], every=10**9, run_dir=tmp_path / "run")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    safetensors.torch.save_file(source.checkpoint_tensors()["phema"], str(ckpt / "phema.safetensors"))
    read, real_safe_open = [], safetensors.safe_open

    class Counted:  # safe_open that records every tensor handed out
        def __init__(self, *args, **kwargs):
            self.f = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

        def __getattr__(self, name):
            if name == "get_slice":
                raise AssertionError("a slice read")
            return getattr(self.f, name)

    def refuse(*args, **kwargs):
        raise AssertionError("the whole file was loaded")

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    other = phema.PowerEMA(Weights(), [0.05, 0.10], 10**9, BATCH, tmp_path / "other", main_process=False)
    other.load(ckpt)
    assert read == ["images"] and other.images == STEPS * BATCH and other.profiles == []
    read.clear()
    main = phema.PowerEMA(Weights(), [0.05, 0.10], 10**9, BATCH, tmp_path / "main", main_process=True)
    main.load(ckpt)
    assert sorted(read) == sorted(["images", *(f"{s:g}/{n}" for s in (0.05, 0.1) for n in ("a", "b"))])
    assert main.images == STEPS * BATCH
    assert all(torch.equal(a, b) for pa, pb in zip(main.profiles, source.profiles) for a, b in zip(pa, pb))
    bad = phema.PowerEMA(Weights(), [0.05, 0.2], 10**9, BATCH, tmp_path / "bad", main_process=True)
    with pytest.raises(ValueError, match="has no profile of std 0.2"):
        bad.load(ckpt)


def test_a_sharded_snapshot_is_kept_in_cpu_memory_by_the_main_process_only(tmp_path, monkeypatch):
    """Sharded, every rank holds its shards of the profiles and takes part in gathering each whole; only the main
    process, which writes the snapshot, makes CPU copies (2.7 GB per rank for the XL recipes with two profiles)."""
    gathered, copied = [], []

    class Whole:  # what common.full returns on the device: its conversion is the CPU copy
        def __init__(self, tensor):
            self.tensor = tensor

        def to(self, dtype):
            copied.append(dtype)
            return self.tensor.to(dtype)

    monkeypatch.setattr(phema.common, "full", lambda p: gathered.append(p) or Whole(p))
    for main in (False, True):
        ema = phema.PowerEMA(Weights(), [0.05, 0.10], BATCH, BATCH, tmp_path / str(main), main_process=True)
        ema.main = main  # a sharded rank: profiles on every rank, the main one writes
        ema.update(Weights())
        assert (ema.snapshot(1) is not None) == main and len(gathered) == 4  # 2 stds x 2 tensors, on every rank
        assert len(copied) == (4 if main else 0)
        gathered.clear(), copied.clear()


def test_a_sharded_checkpoint_without_a_std_tracked_now_names_it(tmp_path):
    """A resume with ckpt.phema_stds changed: the DDP layout names the std (the test above); the sharded one
    (torch.distributed.checkpoint's shards) failed inside the loader on a missing key. It names it too, before
    loading; the stds it holds load bitwise."""
    import torch.distributed.checkpoint as dcp

    source = train([0.05, 0.10], 10**9, tmp_path / "source")
    ckpt = tmp_path / "step_00000400"
    dcp.save({"phema": source.checkpoint_tensors()["phema"]}, checkpoint_id=str(ckpt / "sharded"), no_dist=True)
    bad = phema.PowerEMA(Weights(), [0.05, 0.2], 10**9, BATCH, tmp_path / "bad", main_process=True)
    with pytest.raises(ValueError,
                       match=r"step_00000400 has no profile of std 0.2 \(ckpt.phema_stds changed on resume"):
        bad.load(ckpt)
    good = phema.PowerEMA(Weights(), [0.1], 10**9, BATCH, tmp_path / "good", main_process=True)
    good.load(ckpt)
    assert good.images == STEPS * BATCH and all(torch.equal(a, b) for a, b in zip(good.profiles[0], source.profiles[1]))


def killed_write(run_dir):
    """In a forked child (the modules already imported: no new interpreter to start): one complete snapshot,
    then SIGKILL halfway through writing the next, as a kill during the write would leave it."""
    import signal

    import safetensors.torch

    def save_half_then_die(tensors, path, metadata=None):  # the process is killed halfway through the write
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    model = torch.nn.Linear(4, 3)
    ema = phema.PowerEMA(model, [0.05, 0.1], 8, 8, run_dir, True)
    ema.update(model)
    ema.snapshot(1)                  # a complete snapshot at 8 images
    ema.update(model)
    safetensors.torch.save_file = save_half_then_die
    ema.snapshot(2)                  # killed while writing the one at 16 images


def test_a_snapshot_cut_off_by_sigkill_is_never_read(tmp_path, capsys):
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest, whatever happens
        try:
            killed_write(str(tmp_path / "run"))
        finally:
            os._exit(1)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child writing the snapshots hung")
    assert os.WIFSIGNALED(done[1]) and os.WTERMSIG(done[1]) == signal.SIGKILL, done[1]
    folder = tmp_path / "run" / "phema"
    assert sorted(p.name for p in folder.iterdir()) == \
        [".phema_000000000016.safetensors.tmp", "phema_000000000008.safetensors"]
    assert [s[1] for s in phema.list_snapshots(folder)] == [8]
    weights, info = phema.reconstruct(folder, 0.1)
    assert info["images"] == 8 and set(weights) == {"weight", "bias"}
    # A snapshot damaged after it was written (a disk, a copy) is reported and left out, never half-read.
    good = folder / "phema_000000000008.safetensors"
    (folder / "phema_000000000024.safetensors").write_bytes(good.read_bytes()[:200])
    assert [s[1] for s in phema.list_snapshots(folder)] == [8]
    assert "phema_000000000024.safetensors is not a readable post-hoc EMA snapshot" in capsys.readouterr().out


@pytest.mark.slow
def test_profiles_resume_bitwise_and_the_tool_exports_a_reconstruction(tmp_path):
    """4 steps straight vs 2 steps and --resume latest to 4, snapshots every 2 steps (32 images): the same
    profiles in the checkpoints and the same snapshot files, bit for bit; then tools/phema.py exports a
    reconstruction that sample.py reads by its std."""
    import train_flow_matching as fm
    from test_robustness import assert_same_checkpoint

    extra = ["--log.every=1", "--ckpt.every=2", "--ckpt.phema_every=32", "--train.batch_size=16"]
    fm.main(tiny_run_args(tmp_path, "straight", steps=4) + extra)
    fm.main(tiny_run_args(tmp_path, "resumed", steps=2) + extra)
    fm.main(tiny_run_args(tmp_path, "resumed", steps=4) + extra + ["--resume=latest"])
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "resumed", 4)
    a, b = (load_file(str(tmp_path / r / "checkpoints" / "step_00000004" / "phema.safetensors"))
            for r in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and int(a["images"]) == 64
    snaps = {r: sorted((tmp_path / r / "phema").glob("phema_*.safetensors")) for r in ("straight", "resumed")}
    assert [p.name for p in snaps["straight"]] == ["phema_000000000032.safetensors", "phema_000000000064.safetensors"]
    for a, b in zip(snaps["straight"], snaps["resumed"]):  # (not the raw bytes: safetensors orders metadata at random)
        ta, tb = load_file(str(a)), load_file(str(b))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        assert phema.list_snapshots(a.parent)[0][1:] == phema.list_snapshots(b.parent)[0][1:]

    out = subprocess.run([sys.executable, str(ROOT / "tools" / "phema.py"), "--run", str(tmp_path / "straight"),
                          "--std", "0.08"], capture_output=True, text=True, cwd=tmp_path, env={**os.environ})
    assert out.returncode == 0, out.stderr[-2000:]
    export = tmp_path / "straight" / "phema" / "exports" / "std_0.08" / "export"
    assert json.loads((export / "phema.json").read_text())["phema_std"] == 0.08
    from training.model.mmdit import load_exported
    model, _ = load_exported(export)
    weights, _ = phema.reconstruct(tmp_path / "straight" / "phema", 0.08)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    from training.evaluation import sampling  # --checkpoint X --phema_std: the EMA at X's step (32 images)
    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000002"
    model, _, desc = sampling.load_model(tmp_path / "straight", str(ckpt), phema_std=0.08)
    weights, _ = phema.reconstruct(tmp_path / "straight" / "phema", 0.08, checkpoint=ckpt)
    assert desc["step"] == 2 and desc["phema"]["images"] == 32 and desc["phema"]["checkpoint"] == str(ckpt)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    import sample
    folder = sample.main(["--run", str(tmp_path / "straight"), "--phema_std", "0.08", "--classes", "0,1",
                          "--per_class", "1", "--steps", "2", "--guidance_interval", "0.2,0.8"])
    settings = json.loads((folder / "sample.json").read_text())
    assert settings["model"]["weights"] == "post-hoc EMA, std 0.08" and settings["guidance_interval"] == [0.2, 0.8]


def test_help_lists_what_a_sweep_passes_on_to_eval_fid(capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import phema as tool

    with pytest.raises(SystemExit):
        tool.main(["--help"])
    out = capsys.readouterr().out
    listed = out[out.index("passed on to eval_fid.py"):]
    for flag in ("--reference", "--steps", "--guidance_scale", "--features", "--inception_weights", "--batch_size"):
        assert f"\n  {flag} " in listed, flag
    assert "\n  --phema_std" not in listed and "\n  --num_samples" not in listed  # set by the sweep itself
