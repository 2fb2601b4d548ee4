"""End to end: tiny runs of train_flow_matching.py write samples, metrics, checkpoints and a loadable export,
resume where they stopped, train on latents and text, and run on two processes."""
import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import load_file

from training.data.cache_shards import CachedDataset
from training.model.mmdit import load_exported
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_run_writes_everything_and_resumes_exactly(tmp_path, capsys):
    args = tiny_run_args(tmp_path, "straight", steps=6) + ["--ckpt.every=3", "--val.every=3", "--log.every=1"]
    run = fm.main(args)
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 6
    assert sorted(p.name for p in (run / "samples").glob("*.png")) == ["step_00000003.png", "step_00000006.png"]
    metrics = read_metrics(run)
    train_logs = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in train_logs] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "loss_smoothed", "lr", "grad_norm", "images_per_s", "data_wait_share", "peak_memory_gb",
                "cpu_s_per_step", "loss_t0", "loss_t4"):
        assert all(torch.isfinite(torch.tensor(m[key])) for m in train_logs), key
    assert [m["step"] for m in metrics if "val_loss" in m] == [3, 6]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    # The export loads with diffusers' own loader and reproduces the EMA weights.
    transformer = SD3Transformer2DModel.from_pretrained(run / "export" / "transformer")
    ema = load_file(str(run / "checkpoints" / "step_00000006" / "ema.safetensors"))
    for name, value in transformer.state_dict().items():
        torch.testing.assert_close(value, ema["transformer." + name])
    model, cfg = load_exported(run / "export")
    x = fm.generate(model, torch.randn(2, 3, 16, 16), {"label": torch.tensor([0, 1]),
                                                      "drop": torch.zeros(2, dtype=torch.bool)}, cfg, steps=2)
    assert x.shape == (2, 3, 16, 16) and torch.isfinite(x).all()

    # Resume: a second run stops at step 3, then continues to 6 with --resume latest.
    short = fm.main(tiny_run_args(tmp_path, "resumed", steps=3) + ["--ckpt.every=3", "--log.every=1"])
    fm.main(tiny_run_args(tmp_path, "resumed", steps=6) + ["--ckpt.every=3", "--log.every=1", "--resume", "latest"])
    exported = (short / "export" / "config.json").stat().st_mtime_ns
    fm.main(tiny_run_args(tmp_path, "resumed", steps=6) + ["--resume", "latest"])  # done: nothing trained or exported
    assert (short / "export" / "config.json").stat().st_mtime_ns == exported
    # Exported again after the run (tools/export.py: a model card with evaluations): every relaunch says the run
    # is done and writes nothing, the first as the second (it had exported once more, silently).
    __import__("tools.export").export.main(["--run", str(short)])
    files = {p: p.stat().st_mtime_ns for p in short.rglob("*")}
    for _ in range(2):
        capsys.readouterr()
        fm.main(tiny_run_args(tmp_path, "resumed", steps=6) + ["--resume", "latest"])
        assert f"resume: {short} is done" in capsys.readouterr().out
        assert {p: p.stat().st_mtime_ns for p in short.rglob("*")} == files
    resumed = [m for m in read_metrics(short) if "loss" in m]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]  # continues the step count
    # The continued run is the straight run: the same loss at every step and, bitwise, the same weights.
    assert [m["loss"] for m in resumed] == [m["loss"] for m in train_logs]
    for name in ("model", "ema"):
        a = load_file(str(run / "checkpoints" / "step_00000006" / f"{name}.safetensors"))
        b = load_file(str(short / "checkpoints" / "step_00000006" / f"{name}.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_latent_space_text_to_image_run(tmp_path, tiny_vae, tiny_text_encoder):
    args = tiny_run_args(tmp_path, "t2i", steps=2) + [
        "--encoders.vae", tiny_vae, "--encoders.text_encoder", tiny_text_encoder, "--encoders.max_tokens=8",
        "--data.caption_column=caption", "--data.label_column=null", "--data.resolution=16", "--log.wandb=offline"]
    run = fm.main(args)
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))  # logged to wandb, offline without a key
    cache = CachedDataset(next((tmp_path / "cache").glob("embedded-train-*")))
    row = cache[0]
    assert row["x"].shape == (4, 8, 8) and row["x_std"].shape == (4, 8, 8) and (row["x_std"] > 0).all()
    assert row["text_tokens"].shape == (8, 32) and row["text_pooled"].shape == (32,) and "label" not in row
    assert (run / "samples" / "step_00000002.png").exists()
    model, cfg = load_exported(run / "export")
    torch.testing.assert_close(model.conditioner.null_tokens.abs().sum() > 0, torch.tensor(True))


def test_caption_column_without_text_encoder_is_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="encoders.text_encoder goes with data.caption_column"):
        fm.main(tiny_run_args(tmp_path) + ["--data.caption_column=caption"])


# The two-process run, as `accelerate launch` starts it, with two things watched from outside the trainer: a DDP
# communication hook (DDP's own all-reduce) records where each gradient bucket lives, and after every backward
# each rank writes down where its gradients live.
WATCHED = """
import json, os, sys
import torch
import torch._dynamo
from accelerate import Accelerator
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from test_train_flow_matching import compile_for_the_test
compile_for_the_test(torch)
import common
import train_flow_matching

prepare, backward, record = Accelerator.prepare, Accelerator.backward, {{"buckets": [], "grads": []}}

def prepare_and_watch(self, model, *rest):
    model, *rest = prepare(self, model, *rest)
    def hook(group, bucket):
        record["buckets"].append([len(record["grads"]), bucket.buffer().untyped_storage().data_ptr()])
        return allreduce_hook(group, bucket)
    model.register_comm_hook(None, hook)
    record["params"] = list(model.parameters())
    return (model, *rest)

def backward_and_watch(self, loss, **kwargs):
    backward(self, loss, **kwargs)
    record["grads"].append([None if p.grad is None else p.grad.untyped_storage().data_ptr() for p in record["params"]])

def write_then_end(accelerator, *rest):  # a multi-process run's processes leave in common.end_processes
    del record["params"]
    open(f"watched_{{os.environ['RANK']}}.json", "w").write(json.dumps(record))
    end_processes(accelerator, *rest)

Accelerator.prepare, Accelerator.backward = prepare_and_watch, backward_and_watch
end_processes, common.end_processes = common.end_processes, write_then_end
train_flow_matching.main(sys.argv[1:])
"""


def compile_for_the_test(torch):
    """train.compile as the trainers do it, with two changes for a CPU test: a recompilation is an error, and the
    backend is aot_eager (dynamo's graph capture, guards and AOT autograd, without inductor's C++ build, which
    takes minutes on 2 cores; tests/test_performance.py compiles with inductor)."""
    torch._dynamo.config.error_on_recompile = True
    compile = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kwargs: compile(self, backend="aot_eager")


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_two_processes_compiled_give_the_one_process_validation_and_keep_gradients_in_ddp_buckets(tmp_path,
                                                                                                  monkeypatch):
    """Three compiled steps with accumulation and a recompilation made an error, on one process and on two. At LR 0
    the weights and the EMA stay at their start, so the two runs' validation (split over ranks, gathered) must
    give the one-process grid and held-out loss. On two processes, from the second step on, every gradient is a
    view of DDP's buckets after every backward, the no_sync one included (zeroed in place, never freed)."""
    import numpy as np
    from PIL import Image

    args = tiny_run_args(tmp_path, "ddp", steps=3) + [
        "--train.grad_accum=2", "--train.compile=true", "--train.lr=0", "--val.every=3", "--val.num_samples=5",
        "--val.loss_samples=48", '--conditioning.controls=["size", "crop", "flip"]', "--log.report=false"]
    script = tmp_path / "watched.py"
    script.write_text(WATCHED.format(root=str(ROOT), tests=str(ROOT / "tests")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-3000:]
    assert "global batch 16 x 2 processes x 2 accumulation = 64" in out.stdout
    metrics = read_metrics(tmp_path / "ddp")
    assert [m["step"] for m in metrics if "loss" in m] == [2, 3]
    assert SD3Transformer2DModel.from_pretrained(tmp_path / "ddp" / "export" / "transformer") is not None
    # Both ranks wrote their own RNG state.
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints" / "step_00000003").glob("rng_*")) == \
        ["rng_0.pt", "rng_1.pt"]
    for rank in (0, 1):
        watched = json.loads((tmp_path / f"watched_{rank}.json").read_text())
        grads = watched["grads"]
        assert len(grads) == 6  # 3 steps x 2 micro-batches
        for i in range(2, 6):  # steps 2 and 3: after each backward, every gradient lives in that step's buckets
            buckets = {ptr for at, ptr in watched["buckets"] if at == i // 2 * 2 + 1}
            assert None not in grads[i] and set(grads[i]) <= buckets, (rank, i)

    # dynamo's own scoped patch: pytest's monkeypatch on torch._dynamo.config deletes the entry on undo (torch 2.14),
    # which broke every later test that compiles.
    import torch._dynamo
    compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compile(self, backend="aot_eager"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        one = fm.main([a.replace(str(tmp_path / "ddp"), str(tmp_path / "one")) for a in args])
    val_one, val_two = ([m for m in read_metrics(run) if "val_loss" in m] for run in (one, tmp_path / "ddp"))
    assert len(val_one) == len(val_two) == 1
    for key in val_one[0]:
        assert val_two[0][key] == pytest.approx(val_one[0][key], rel=1e-6), key
    grids = [np.asarray(Image.open(run / "samples" / "step_00000003.png")) for run in (one, tmp_path / "ddp")]
    assert np.array_equal(*grids)


@pytest.mark.slow
def test_small_fid_during_training_is_logged(tmp_path, monkeypatch):
    # The trainer calls eval_fid.py's own code (training/evaluation/sampling.py); a 16-dimensional random-conv extractor
    # stands in for Inception (whose 2048 x 2048 matrix square root alone takes a minute on 2 CPU cores at small N).
    from test_eval_fid import TinyFeatures
    from training.evaluation import sampling

    asked = []
    monkeypatch.setattr(sampling, "inception_features", lambda mode, weights, device, accelerator:
                        asked.append((mode, weights)) or TinyFeatures())
    weights = tmp_path / "inception.pt"
    weights.write_bytes(b"")  # the start-up check wants the file to be there
    run = fm.main(tiny_run_args(tmp_path, "fid", steps=4) + ["--val.fid_every=2", "--val.fid_samples=12",
                                                          f"--val.inception_weights={weights}"])
    fids = [m for m in read_metrics(run) if "fid_clean_12" in m]
    assert [m["step"] for m in fids] == [2, 4] and asked == [("clean", str(weights))] * 2
    assert all(m["fid_clean_12"] > 0 and "kid_clean_12" in m for m in fids)
    assert len(list((tmp_path / "cache" / "fid_stats").glob("*.npz"))) == 1  # reference statistics, cached once
