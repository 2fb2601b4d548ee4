"""Sharded training (train.sharding="fsdp", training/run/sharding.py) on two CPU processes over gloo, checked against
the DDP run as the oracle: the same steps give the same weights, EMA and post-hoc EMA profiles; a run stopped by a
signal and resumed is the uninterrupted run bitwise; a two-process checkpoint resumes on one process; the export
is the DDP run's format. Plus what a sharded run refuses at start-up, and the full copy and norms it relies on."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_flow_matching as fm
from conftest import ROOT, tiny_run_args
from test_bookkeeping import killed_at_exit, signal_rank_one, train_rows
from training.config import config
from training.run import checkpoints, sharding

# accumulation (no reduce-scatter on the first micro-batch), the post-hoc EMA, the gradient analysis and a
# checkpoint at every step; fp32, so the sharded sums differ from DDP's only by fp32 rounding
RUN = ["--train.grad_accum=2", "--log.every=1", "--ckpt.every=1", "--ckpt.keep=8", "--ckpt.phema_every=32",
       "--log.grad_every=2", "--train.batch_size=8"]
STEPS = 6


def launch(tmp_path, name, extra, marker=None):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           str(ROOT / "train_flow_matching.py"), *tiny_run_args(tmp_path, name, steps=STEPS), *RUN, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"TEST_MARKER": marker} if marker else {})}
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def finished(proc, code=0):
    with killed_at_exit(proc):
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == code, out[-1500:] + err[-3000:]
    return out


def sharded_checkpoint(run, step):
    """{"model", "ema", "optimizer", "phema"} of a sharded checkpoint, whole, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(run) / "checkpoints" / f"step_{step:08d}"
    dcp_to_torch_save(folder / "sharded", folder / "whole.pt")
    return torch.load(folder / "whole.pt", weights_only=False)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """DDP and FSDP runs of the same steps, and an FSDP run stopped by a signal to rank 1 then resumed. Session-
    scoped: xdist's loadgroup interleaves the gloo group's modules on one worker, which would end a module-scoped
    fixture between this file's tests and launch the runs again (seen: twice, 150 s each)."""
    tmp = tmp_path_factory.mktemp("sharding")
    finished(launch(tmp, "ddp", []))  # first: it writes the cache the others read
    straight = launch(tmp, "fsdp", ["--train.sharding=fsdp"])
    finished(straight)
    marker = f"sharding-{os.getpid()}"
    stopped = launch(tmp, "resumed", ["--train.sharding=fsdp"], marker)
    with killed_at_exit(stopped):
        out, err = signal_rank_one(stopped, marker, tmp / "resumed" / "metrics.jsonl")
    assert stopped.returncode != 0 and "stopped by a signal at step" in out, err[-3000:]
    step = int(re.search(r"stopped by a signal at step (\d+)", out)[1])
    assert step < STEPS, "the signal came too late to test a resume"
    shutil.copytree(tmp / "resumed", tmp / "one_process")  # the stopped run, to resume on one process
    finished(launch(tmp, "resumed", ["--train.sharding=fsdp", "--resume=latest"]))
    return tmp, step


@pytest.mark.slow
@pytest.mark.xdist_group("gloo")
def test_sharded_steps_equal_the_ddp_run_and_export_the_same_model(runs):
    tmp, _ = runs
    ddp = {name: load_file(str(tmp / "ddp" / "checkpoints" / f"step_{STEPS:08d}" / f"{name}.safetensors"))
           for name in ("model", "ema", "phema")}
    fsdp = sharded_checkpoint(tmp / "fsdp", STEPS)
    for name in ("model", "ema", "phema"):
        assert set(ddp[name]) == set(fsdp[name]), name
        for key, value in ddp[name].items():  # a few fp32 roundings apart, after 6 steps of Adam at lr 2e-3
            torch.testing.assert_close(fsdp[name][key], value, rtol=1e-4, atol=2e-5, msg=f"{name} {key}")
    # the losses, gradient norms and the gradient analysis per layer group (its norms all-reduced over shards)
    rows = [[{k: v for k, v in m.items() if k.startswith(("loss", "grad_norm"))} for m in map(json.loads, (
        tmp / run / "metrics.jsonl").read_text().splitlines()) if "loss" in m or "grad_norm/block_00" in m]
        for run in ("ddp", "fsdp")]
    assert len(rows[0]) == len(rows[1]) and any("grad_norm/block_00" in r for r in rows[1])
    for a, b in zip(*rows):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-4 * max(1, abs(a[k])) for k in a), (a, b)
    # the export: the same single SD3Transformer2DModel folder, loadable with from_pretrained, the EMA's weights
    from diffusers import SD3Transformer2DModel

    exported = SD3Transformer2DModel.from_pretrained(tmp / "fsdp" / "export" / "transformer")
    for key, value in exported.state_dict().items():
        assert torch.equal(value, fsdp["ema"][f"transformer.{key}"]), key
    assert sorted(p.name for p in (tmp / "fsdp" / "export").iterdir()) == \
        sorted(p.name for p in (tmp / "ddp" / "export").iterdir())
    assert sorted(p.name for p in (tmp / "fsdp" / "phema").iterdir()) == \
        sorted(p.name for p in (tmp / "ddp" / "phema").iterdir())


@pytest.mark.slow
@pytest.mark.xdist_group("gloo")
def test_a_sharded_run_stopped_by_a_signal_resumes_bitwise(runs):
    tmp, step = runs
    assert sorted(p.name for p in (tmp / "one_process" / "checkpoints").glob("step_*"))[-1] == f"step_{step:08d}"
    straight, resumed = (sharded_checkpoint(tmp / run, STEPS) for run in ("fsdp", "resumed"))
    for name in ("model", "ema", "phema"):
        assert all(torch.equal(straight[name][k], resumed[name][k]) for k in straight[name]), name
    for key, value in straight["optimizer"]["state"].items():
        assert all(torch.equal(value[s], resumed["optimizer"]["state"][key][s]) for s in value), key
    assert [r["loss"] for r in train_rows(tmp / "fsdp")] == [r["loss"] for r in train_rows(tmp / "resumed")]


@pytest.mark.slow
@pytest.mark.xdist_group("gloo")
def test_a_two_process_sharded_checkpoint_resumes_on_one_process(runs, capsys):
    """At the checkpoint's own step: nothing trains, and the export is that checkpoint's EMA, gathered whole."""
    tmp, step = runs
    fm.main(tiny_run_args(tmp, "one_process", steps=step) + RUN + ["--train.sharding=fsdp", "--resume=latest"])
    assert "was written by 2 processes and is resumed by 1" in capsys.readouterr().out
    saved = sharded_checkpoint(tmp / "one_process", step)["ema"]
    exported = load_file(str(tmp / "one_process" / "export" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(value, saved[f"transformer.{key}"]) for key, value in exported.items())


def test_what_a_sharded_run_cannot_do_is_refused_naming_the_key():
    for args, key in ((["--train.global_batch=32", "--train.batch_size=auto"], "train.batch_size"),
                      (["--train.ema_device=cpu"], "train.ema_device"), (["--train.mixed_precision=fp16"], "fp16")):
        with pytest.raises(config.ConfigError, match=re.escape(key)):
            config.load_config(fm.DEFAULTS, ["--train.sharding=fsdp", *args], method="flow_matching", schema=fm.CONFIG)
    config.load_config(fm.DEFAULTS, ["--train.ema_device=cpu"], method="flow_matching", schema=fm.CONFIG)  # DDP: fine


@pytest.mark.slow
def test_a_sharded_run_rolls_back_to_its_sharded_checkpoint(tmp_path, monkeypatch):
    """One process, sharded, with gradient checkpointing: NaN losses at steps 7 and 8 roll back to step 6's sharded
    checkpoint (its weights, EMA, optimizer through sharding.load), halve the LR, and the run finishes finite."""
    from test_stability import CONSTANT_LR, poisoned_loss, rows

    poisoned_loss(monkeypatch, {6, 7})
    run = fm.main(tiny_run_args(tmp_path, "rb", steps=9) + [
        "--log.every=1", "--ckpt.every=1", "--ckpt.keep=10", "--train.max_nonfinite_steps=2", "--log.report=false",
        "--train.on_divergence=rollback", "--train.rollback_lr_factor=0.5", "--train.sharding=fsdp", *CONSTANT_LR,
        "--train.gradient_checkpointing=true"])  # (a checkpointed block recomputes its all-gather in backward)
    events = [r for r in rows(run) if r.get("event") == "rollback"]
    assert len(events) == 1 and events[0]["step"] == 6 and events[0]["detected_at"] == 8
    train = [r for r in rows(run) if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9)) + [7, 8, 9] and train[-1]["lr"] == pytest.approx(0.5e-3)
    assert torch.isfinite(torch.tensor([r["loss"] for r in train[-3:]])).all()
    assert (run / "checkpoints" / "step_00000009" / "sharded" / ".metadata").is_file()


def test_a_sharded_checkpoint_is_intact_only_once_its_metadata_is_written(tmp_path):
    """torch.distributed.checkpoint writes .metadata after every rank's shards: without it (a write cut off) the
    checkpoint is not intact and --resume latest falls back to the one before."""
    for step, complete in ((1, True), (2, False)):
        folder = tmp_path / "checkpoints" / f"step_{step:08d}"
        (folder / "sharded").mkdir(parents=True)
        (folder / "sharded" / "__0_0.distcp").write_bytes(b"shard")
        torch.save({"step": step}, folder / "state.pt")
        if complete:
            (folder / "sharded" / ".metadata").write_bytes(b"metadata")
    assert checkpoints.checkpoint_ok(tmp_path / "checkpoints" / "step_00000001")
    assert not checkpoints.checkpoint_ok(tmp_path / "checkpoints" / "step_00000002")
    assert checkpoints.find_checkpoint(tmp_path, "latest").name == "step_00000001"


@pytest.mark.slow
@pytest.mark.xdist_group("gloo")
def test_evaluation_sampling_and_init_from_read_a_sharded_checkpoint_whole(runs):
    """eval_fid.py / sample.py --checkpoint (EMA, raw, post-hoc EMA of any std) and init_from read a sharded
    checkpoint in one process, no group: the DDP run's checkpoint read the same way is the oracle."""
    from training.evaluation import sampling
    from training.run.start import read_weights

    tmp, _ = runs
    saved = sharded_checkpoint(tmp / "fsdp", STEPS)
    for weights, phema_std in (("ema", None), ("raw", None), ("ema", 0.1)):
        (sharded, _, desc), (ddp, _, _) = (sampling.load_model(tmp / run, "latest", weights, phema_std)
                                           for run in ("fsdp", "ddp"))
        assert desc["source"].endswith(f"step_{STEPS:08d}")
        for key, value in ddp.state_dict().items():
            torch.testing.assert_close(sharded.state_dict()[key], value, rtol=1e-4, atol=2e-5, msg=key)
        if phema_std is None:  # exactly the checkpoint's tensors
            part = saved["ema" if weights == "ema" else "model"]
            assert all(torch.equal(v, part[k]) for k, v in sharded.state_dict().items())
    model, ema, _, folder = read_weights(tmp / "fsdp")  # init_from's reader, from the run's newest checkpoint
    assert folder.name == f"step_{STEPS:08d}" and all(torch.equal(v, saved["model"][k]) for k, v in model.items())
