"""Training that survives preemption, bad data and bad configs, and resumes exactly: each fault provoked
for real (a signal to a running process, files truncated on disk, NaNs in the data, two processes)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import common
from data import CachedDataset, build_cache, open_splits
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args


def weights(run_dir, step, name):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:08d}" / f"{name}.safetensors"))


def assert_same_checkpoint(run_a, run_b, step):
    for name in ("model", "ema"):
        a, b = weights(run_a, step, name), weights(run_b, step, name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    sa, sb = (torch.load(Path(r) / "checkpoints" / f"step_{step:08d}" / "state.pt", weights_only=True) for r in (run_a, run_b))
    for (ka, va), (kb, vb) in zip(sa["optimizer"]["state"].items(), sb["optimizer"]["state"].items()):
        assert all(torch.equal(va[s], vb[s]) for s in va)
    losses = [[m["loss"] for m in map(json.loads, (Path(r) / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
              for r in (run_a, run_b)]
    assert losses[0] == losses[1]


def launch(args, processes, cwd, check=True):
    cmd = [sys.executable, str(ROOT / "train_flow_matching.py"), *args] if processes == 1 else \
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
         str(ROOT / "train_flow_matching.py"), *args]
    out = subprocess.run(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=900)
    assert not check or out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_exact_resume_with_accumulation_mid_epoch_on_two_processes(tmp_path):
    # 320 - 64 held out = 256 rows; 2 ranks x batch 16 x accumulation 2: 4 optimizer steps per epoch, so a
    # stop at step 3 is mid-epoch and the run crosses an epoch boundary after it.
    common_args = ["--train.grad_accum=2", "--log.every=1", "--ckpt.every=3"]
    launch(tiny_run_args(tmp_path, "straight", steps=6) + common_args, 2, tmp_path)
    launch(tiny_run_args(tmp_path, "resumed", steps=3) + common_args, 2, tmp_path)
    launch(tiny_run_args(tmp_path, "resumed", steps=6) + common_args + ["--resume=latest"], 2, tmp_path)
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "resumed", 6)


@pytest.mark.slow
@pytest.mark.parametrize("trainer,sig", [("train_flow_matching", signal.SIGTERM), ("train_ddpm", signal.SIGUSR1)])
def test_preemption_signal_checkpoints_and_exits_for_requeue_then_resumes(tmp_path, trainer, sig):
    args = tiny_run_args(tmp_path, "preempted", steps=10_000) + ["--log.every=1"]
    proc = subprocess.Popen([sys.executable, str(ROOT / f"{trainer}.py"), *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == common.REQUEUE_EXIT_CODE, stderr[-2000:]
    stopped = int(re.search(r"stopped by a signal at step (\d+)", stdout).group(1))
    assert 2 <= stopped < 10_000
    assert common.find_checkpoint(tmp_path / "preempted", "latest").name == f"step_{stopped:08d}"
    # Requeued: the same command with --resume latest continues from there.
    __import__(trainer).main(tiny_run_args(tmp_path, "preempted", steps=stopped + 2) + ["--log.every=1", "--resume=latest"])
    steps = [m["step"] for m in map(json.loads, metrics.read_text().splitlines()) if "loss" in m]
    assert steps == list(range(1, stopped + 3))


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    run = fm.main(tiny_run_args(tmp_path, "ckpt", steps=4) + ["--ckpt.every=1", "--ckpt.keep=2"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    newest = run / "checkpoints" / "step_00000004" / "ema.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a crash mid-write on a shared filesystem
    (run / "checkpoints" / ".tmp_step_00000005").mkdir()  # an unfinished one is never picked
    assert common.find_checkpoint(run, "latest").name == "step_00000003"
    assert "step_00000004 is incomplete or corrupt" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no intact checkpoint"):
        common.find_checkpoint(run, str(run / "checkpoints" / "step_00000004"))


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
    run = fm.main(tiny_run_args(tmp_path, "nan", steps=2) + ["--ckpt.every=1", "--log.every=1"])
    shard = next((tmp_path / "cache").glob("embedded-train-*/shard_00000.safetensors"))
    tensors, meta = load_file(str(shard)), None
    from safetensors import safe_open
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors["x"][::7] = float("nan")  # a few poisoned images: the batches holding them are skipped
    save_file(tensors, str(shard), metadata=meta)
    fm.main(tiny_run_args(tmp_path, "nan", steps=8) + ["--ckpt.every=1", "--log.every=1", "--resume=latest"])
    logs = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert logs[-1]["step"] == 8 and logs[-1]["skipped_steps"] >= 3
    for name in ("model", "ema"):
        assert all(torch.isfinite(v).all() for v in weights(run, 8, name).values())
    # All poisoned: K bad steps in a row stop the run with a clear error; the last good checkpoint stays.
    tensors["x"][:] = float("nan")
    save_file(tensors, str(shard), metadata=meta)
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"):
        fm.main(tiny_run_args(tmp_path, "nan", steps=20) + ["--ckpt.every=1", "--resume=latest",
                                                           "--train.max_nonfinite_steps=3"])
    latest = common.find_checkpoint(run, "latest")
    assert all(torch.isfinite(v).all() for v in load_file(str(latest / "model.safetensors")).values())


@pytest.mark.slow
def test_bad_images_are_reported_and_skipped(tmp_path, capsys):
    folder = tmp_path / "images" / "train"
    folder.mkdir(parents=True)
    rows = []
    for i in range(12):
        Image.fromarray(np.full((40, 40, 3), 20 * i, np.uint8)).save(folder / f"good_{i}.png")
        rows.append({"file_name": f"good_{i}.png", "label": i % 3})
    good = (folder / "good_0.png").read_bytes()
    (folder / "truncated.png").write_bytes(good[: len(good) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "notimage.png").write_text("this is not an image")
    Image.new("RGB", (3, 3)).save(folder / "tiny.png")
    rows += [{"file_name": n, "label": 0} for n in ("truncated.png", "empty.png", "notimage.png", "tiny.png")]
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run = fm.main(tiny_run_args(tmp_path, "bad", steps=2) + [f"--data.source={tmp_path / 'images'}",
                  "--data.num_classes=3", "--data.val_holdout=2", "--train.batch_size=4"])
    out = capsys.readouterr().out
    assert re.search(r"skipped [1-4] unusable images", out)  # the held-out split takes its share of them
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*/manifest.json")]
    reported = " ".join(" ".join(m["skipped"]) for m in manifests)
    for name in ("truncated.png", "empty.png", "notimage.png", "tiny.png"):
        assert name in reported
    assert sum(len(CachedDataset(p.parent)) for p in (tmp_path / "cache").glob("*/manifest.json")) == 12
    assert (run / "export" / "transformer").exists()


def test_corrupt_shard_is_rebuilt_and_a_changed_key_is_named(tmp_path, capsys):
    from accelerate import Accelerator

    cfg = common.load_config(fm.DEFAULTS, ["--data.cache_dir", str(tmp_path), "--data.demo_samples=100",
                                           "--data.val_holdout=10", "--data.shard_size=32"])
    train, _ = open_splits(cfg.data)
    encode = lambda pixels, captions: {"x": pixels}
    folder = build_cache(train, "train", encode, Accelerator(cpu=True), cfg)
    before = {k: v.clone() for k, v in load_file(str(folder / "shard_00001.safetensors")).items()}
    shard = folder / "shard_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert build_cache(train, "train", encode, Accelerator(cpu=True), cfg) == folder
    assert "corrupt shards ['shard_00001.safetensors']" in capsys.readouterr().out
    after = load_file(str(shard))
    assert all(torch.equal(before[k], after[k]) for k in before)
    cfg2 = common.load_config(fm.DEFAULTS, ["--data.cache_dir", str(tmp_path), "--data.demo_samples=100",
                                            "--data.val_holdout=10", "--data.shard_size=32", "--data.resolution=8"])
    build_cache(train, "train", encode, Accelerator(cpu=True), cfg2)
    assert "changed resolution: 16 -> 8" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--data.resolution=15"], "data.resolution=15 is not divisible by model.patch_size=2"),
    (["--data.caption_column=caption"], "encoders.text_encoder goes with data.caption_column"),
    (["--data.label_column=null"], "set data.label_column"),
    (["--train.mixed_precision=fp8"], "train.mixed_precision='fp8'"),
    (["--train.grad_accum=0", "--train.batch_size=0"], "train.batch_size=0 must be >= 1\n  train.grad_accum=0"),
    (['--conditioning.controls=["zoom"]'], "conditioning.controls: unknown \\['zoom'\\]"),
])
def test_illegal_configs_are_refused_at_start_up(tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        fm.main(tiny_run_args(tmp_path) + args)


def test_vae_factor_enters_the_divisibility_check(tmp_path, tiny_vae):
    with pytest.raises(ValueError, match="data.resolution=18 .* model.patch_size=2 x the VAE's downsampling factor 2"):
        fm.main(tiny_run_args(tmp_path) + ["--encoders.vae", tiny_vae, "--data.resolution=18"])


def test_safe_loading_only():
    # Weights only from safetensors, other state only through torch.load(weights_only=True), no remote code.
    for path in [*ROOT.glob("*.py"), *ROOT.glob("benchmarks/*.py")]:
        source = path.read_text()
        for call in re.findall(r"torch\.load\([^\n]*", source):
            assert "weights_only=True" in call, f"{path.name}: {call}"
        assert "trust_remote_code=True" not in source, path.name
        for callee, call in re.findall(r"(\w+)\.from_pretrained\(([^\n]*)", source):
            if not re.search("Tokenizer|Config|Processor", callee):  # a model: its weights
                assert "use_safetensors=True" in call, f"{path.name}: {callee}.from_pretrained({call}"
        assert "pickle.load" not in source and "use_safetensors=False" not in source, path.name


@pytest.mark.slow
def test_resume_with_another_process_count_warns_and_continues(tmp_path, capsys):
    run = fm.main(tiny_run_args(tmp_path, "world", steps=2) + ["--ckpt.every=2"])
    ckpt = run / "checkpoints" / "step_00000002"
    (ckpt / "rng_1.pt").write_bytes((ckpt / "rng_0.pt").read_bytes())  # as if written by 2 processes
    fm.main(tiny_run_args(tmp_path, "world", steps=4) + ["--resume=latest"])
    out = capsys.readouterr().out
    assert "written by 2 processes and is resumed by 1" in out and "resumed from" in out
    assert common.find_checkpoint(run, "latest").name == "step_00000004"
