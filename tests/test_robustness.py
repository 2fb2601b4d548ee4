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
from training.config import config
from training.data.cache import build_cache
from training.data.cache_shards import CachedDataset
from training.data.sources import open_splits
from training.run import checkpoints
from training.record import runlog
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args


def weights(run_dir, step, name):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:08d}" / f"{name}.safetensors"))


def assert_same_checkpoint(run_a, run_b, step):
    for name in ("model", "ema"):
        a, b = weights(run_a, step, name), weights(run_b, step, name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    sa, sb = (checkpoints.read_optimizer_state(Path(r) / "checkpoints" / f"step_{step:08d}") for r in (run_a, run_b))
    for (ka, va), (kb, vb) in zip(sa["state"].items(), sb["state"].items()):
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
    assert not check or out.returncode == 0, out.stdout[-1500:] + out.stderr[-3000:]
    return out


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_exact_resume_with_accumulation_mid_epoch_on_two_processes(tmp_path):
    # 192 - 64 held out = 128 rows; 2 ranks x batch 16 x accumulation 2: 2 optimizer steps per epoch, so a
    # stop at step 3 is mid-epoch and the run crosses an epoch boundary after it. Two narrow blocks: the
    # sampler's and the RNG's state are what is resumed, the same whatever the model's size.
    common_args = ["--train.grad_accum=2", "--log.every=1", "--ckpt.every=3", "--data.demo_samples=192",
                   "--model.num_layers=2", "--model.num_attention_heads=2", "--model.attention_head_dim=16"]
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
    assert checkpoints.find_checkpoint(tmp_path / "preempted", "latest").name == f"step_{stopped:08d}"
    # Requeued: the same command with --resume latest continues from there.
    __import__(trainer).main(tiny_run_args(tmp_path, "preempted", steps=stopped + 2)
                             + ["--log.every=1", "--resume=latest"])
    steps = [m["step"] for m in map(json.loads, metrics.read_text().splitlines()) if "loss" in m]
    assert steps == list(range(1, stopped + 3))


@pytest.mark.slow
def test_ctrl_c_checkpoints_exits_75_in_one_line_and_the_relaunch_resumes(tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole foreground process group, the trainer and its DataLoader workers.
    The run says so at once, stops at the next log step with a checkpoint and exit code 75 (SIGTERM's), no
    traceback; the relaunch with --resume latest continues from that checkpoint."""
    args = tiny_run_args(tmp_path, "stopped", steps=10_000) + ["--log.every=1", "--data.num_workers=2"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_flow_matching.py"), *args], cwd=tmp_path, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # as the terminal does: the workers get it too
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == common.REQUEUE_EXIT_CODE, stderr[-3000:]
    assert stderr.count(common.CTRL_C) == 1 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    stopped = int(re.search(r"stopped by a signal at step (\d+): checkpoint written; exiting with code 75", stdout)[1])
    assert checkpoints.find_checkpoint(tmp_path / "stopped", "latest").name == f"step_{stopped:08d}"
    fm.main(tiny_run_args(tmp_path, "stopped", steps=stopped + 1) + ["--log.every=1", "--resume=latest"])
    steps = [m["step"] for m in map(json.loads, metrics.read_text().splitlines()) if "loss" in m]
    assert steps == list(range(1, stopped + 2))  # one step more, from the checkpoint: not from step 0


def test_resuming_a_finished_run_says_so_and_how_to_train_longer(tmp_path, capsys):
    """--resume latest of a run whose checkpoint is at train.max_steps, with its export of that step and its report
    after it: done, said with the flag that trains longer, also once the export was written again after the report
    (tools/export.py). Not done: more steps asked, no export, the export of a shorter run trained on
    since, a report missing or older than the checkpoint (a run stopped after its export)."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    for name in ("model", "ema", "optimizer"):
        save_file({}, str(ckpt / f"{name}.safetensors"))
    torch.save({"step": 4, "config": {}}, ckpt / "state.pt")

    def finished(*args):
        return runlog.finished_run(config.load_config(fm.DEFAULTS, ["--run_dir", str(run), "--resume=latest",
                                                                    "--train.max_steps=4", *args]))

    def export(max_steps, report_after):
        (run / "export").mkdir(exist_ok=True)
        (run / "export" / "config.json").write_text(json.dumps({"train": {"max_steps": max_steps}}))
        (run / "report.md").write_text("report")
        os.utime(run / "report.md", (1e9, 1e9) if not report_after else None)  # 2001: before the export

    assert finished() is None  # no export: the resumed run exports
    export(2, report_after=True)
    assert finished() is None  # the export and report of the first 2 steps: this one exports step 4
    export(4, report_after=False)
    assert finished() is None and finished("--log.report=false") == run  # stopped before its report: writes it
    export(4, report_after=True)
    capsys.readouterr()
    assert finished() == run
    said = capsys.readouterr().out
    assert said.startswith(f"resume: {run} is done: its checkpoint step_00000004 is at step 4 (train.max_steps=4)")
    assert "Nothing left to train; nothing was written. To train longer: --resume latest --train.max_steps=N, " \
           "N > 4" in said
    assert finished("--train.max_steps=6") is None
    os.utime(run / "export" / "config.json", (2e9, 2e9))  # 2033: exported again after the report (tools/export.py)
    assert finished() == run
    assert finished("--train.lr_schedule=cosine") == run
    assert "(the cosine LR schedule is then laid over the N steps)" in capsys.readouterr().out


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    run = fm.main(tiny_run_args(tmp_path, "ckpt", steps=4) + ["--ckpt.every=1", "--ckpt.keep=2"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    newest = run / "checkpoints" / "step_00000004" / "ema.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a crash mid-write on a shared filesystem
    (run / "checkpoints" / ".tmp_step_00000005").mkdir()  # an unfinished one is never picked
    assert checkpoints.find_checkpoint(run, "latest").name == "step_00000003"
    assert "step_00000004 is incomplete or corrupt" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no intact checkpoint"):
        checkpoints.find_checkpoint(run, str(run / "checkpoints" / "step_00000004"))


@pytest.mark.slow
def test_every_checkpoint_load_maps_to_the_cpu(tmp_path, monkeypatch):
    """Resume, init_from (a run folder), sampling.load_model and run_class_ids (sample.py's class names): every
    torch.load and safetensors load of a checkpoint file maps to the CPU. (Rank 0 saved tensors tagged cuda:0: without
    map_location every rank of a node would load its copy onto GPU 0.)"""
    import safetensors.torch

    from training.evaluation import sampling

    run = fm.main(tiny_run_args(tmp_path, "cpu", steps=2) + ["--ckpt.every=2"])
    loads, real_load, real_load_file = [], torch.load, safetensors.torch.load_file

    def load(f, *args, **kwargs):
        loads.append((Path(f).name, str(kwargs.get("map_location"))))
        return real_load(f, *args, **kwargs)

    def load_file(f, device="cpu"):
        loads.append((Path(f).name, str(device)))
        return real_load_file(f, device=device)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    monkeypatch.setattr(checkpoints, "load_file", load_file)
    fm.main(tiny_run_args(tmp_path, "cpu", steps=3) + ["--resume=latest"])
    fm.main(tiny_run_args(tmp_path, "tuned", steps=1) + [f"--init_from={run}"])
    sampling.load_model(run, "latest")
    assert sampling.run_class_ids(run, "latest") is not None
    assert {"state.pt", "rng_0.pt", "model.safetensors", "ema.safetensors"} <= {name for name, _ in loads}
    assert [(name, where) for name, where in loads if where != "cpu"] == []
    assert not any(name == "optimizer.safetensors" for name, _ in loads)  # read through safe_open, on the CPU


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
    run = fm.main(tiny_run_args(tmp_path, "nan", steps=2) + ["--ckpt.every=1", "--log.every=1"])
    shard = next((tmp_path / "cache").glob("embedded-train-*/shard_00000.safetensors"))
    tensors, meta = load_file(str(shard)), None
    from safetensors import safe_open
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors["x"][::7] = float("nan")  # a few poisoned images: the batches holding them are skipped
    save_file(tensors, str(shard), metadata=meta)  # (its old checksum: only data.verify_cache would notice)
    fm.main(tiny_run_args(tmp_path, "nan", steps=8) + ["--ckpt.every=1", "--log.every=1", "--resume=latest",
                                                       "--data.verify_cache=false"])
    logs = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert logs[-1]["step"] == 8 and logs[-1]["skipped_steps"] >= 3
    for name in ("model", "ema"):
        assert all(torch.isfinite(v).all() for v in weights(run, 8, name).values())
    # All poisoned: K bad steps in a row stop the run with a clear error; the last good checkpoint stays.
    tensors["x"][:] = float("nan")
    save_file(tensors, str(shard), metadata=meta)
    # (The count of bad steps in a row carries over the resume: the 8-step run ended on bad steps.)
    with pytest.raises(FloatingPointError, match=r"\d+ optimizer steps in a row"):
        fm.main(tiny_run_args(tmp_path, "nan", steps=20) + ["--ckpt.every=1", "--resume=latest",
                                                           "--train.max_nonfinite_steps=3",
                                                            "--data.verify_cache=false"])
    latest = checkpoints.find_checkpoint(run, "latest")
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


def small_cache(tmp_path, *extra):
    """A 90-row pixel cache of the demo data in 3 shards, and a counter of the rows encoded."""
    from accelerate import Accelerator

    cfg = config.load_config(fm.DEFAULTS, ["--data.cache_dir", str(tmp_path / "cache"), "--data.demo_samples=100",
                                           "--data.val_holdout=10", "--data.shard_size=32", *extra])
    train, _ = open_splits(cfg.data)
    calls = []

    def encode(pixels, captions):
        calls.append(len(pixels))
        return {"x": pixels}

    return lambda: build_cache(train, "train", encode, Accelerator(cpu=True), cfg), calls


def test_damaged_shard_contents_are_detected_and_rebuilt(tmp_path, capsys):
    build, calls = small_cache(tmp_path)
    folder = build()
    shard = folder / "shard_00001.safetensors"
    original = {k: v.clone() for k, v in load_file(str(shard)).items()}  # not a view of the file
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    damages = {
        "checksum mismatch": lambda b: b[:header + 100] + bytes(16) + b[header + 116:],  # header intact
        "unreadable": lambda b: b[:-100],  # truncated
    }
    for reason, damage in damages.items():
        shard.write_bytes(damage(shard.read_bytes()))
        calls.clear()
        assert build() == folder
        out = capsys.readouterr().out
        # + the size estimate's probe
        assert f"{shard} is damaged ({reason}" in out and "1 (re)built" in out and sum(calls) == 32 + 1
        assert all(torch.equal(original[k], v) for k, v in load_file(str(shard)).items())
    # NaNs written with a matching checksum, in a folder whose manifest was lost: damage too.
    from training.data.cache_shards import tensors_sha256

    poisoned = {k: v.clone() for k, v in original.items()}
    poisoned["x"][3] = float("nan")
    save_file(poisoned, str(shard), metadata={"rows": "32", "skipped": "[]", "sha256": tensors_sha256(poisoned)})
    (folder / "manifest.json").unlink()
    build()
    assert "non-finite values in ['x']" in capsys.readouterr().out
    assert torch.isfinite(load_file(str(shard))["x"]).all()
    # A sound cache is a hit that encodes nothing.
    calls.clear()
    build()
    assert "cache hit (train)" in capsys.readouterr().out and not calls
    # An encoder that overflows on some images: those rows are reported and left out, never cached.
    from accelerate import Accelerator

    cfg = config.load_config(fm.DEFAULTS, ["--data.cache_dir", str(tmp_path / "nan"), "--data.demo_samples=100",
                                           "--data.val_holdout=10", "--data.shard_size=32"])
    train, _ = open_splits(cfg.data)
    overflow = lambda pixels, captions: {"x": pixels / (pixels[:, :1, :1, :1] > -2).float().cumsum(0).ne(5).float()}
    nan_folder = build_cache(train, "train", overflow, Accelerator(cpu=True), cfg)
    assert len(CachedDataset(nan_folder)) == 87 and "row 4: encoded to non-finite values" in capsys.readouterr().out


def test_a_warm_start_reads_headers_and_reverifies_only_changed_shards(tmp_path, capsys, monkeypatch):
    """Contents are verified when a shard is written (read back) and whenever its file changed since; an
    unchanged cache is checked from headers alone, so a start does not read the whole cache."""
    from training.data import cache, cache_shards

    hashed, real_sha = [], cache_shards.tensors_sha256
    monkeypatch.setattr(cache_shards, "tensors_sha256", lambda tensors: hashed.append(1) or real_sha(tensors))
    build, calls = small_cache(tmp_path)
    folder = build()
    assert len(hashed) == 2 * 3  # each of the 3 shards: its checksum as written, then verified from the file
    hashed.clear(), calls.clear()
    assert build() == folder and not hashed and not calls  # warm: headers only, a hit
    # An older cache's manifest without stamps: verified in full once, then warm again.
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "verified"}))
    build()
    assert len(hashed) == 3 and json.loads((folder / "manifest.json").read_text()) == manifest
    # Bytes overwritten inside a shard's tensors, its modification time put back: the change time still moved,
    # so the shard is verified again, found damaged and rebuilt.
    hashed.clear()
    shard = folder / "shard_00002.safetensors"
    stat, data = shard.stat(), bytearray(shard.read_bytes())
    data[-40:-24] = bytes(16)
    time.sleep(0.01)
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    capsys.readouterr()
    build()
    assert f"{shard} is damaged (checksum mismatch" in capsys.readouterr().out and sum(calls) == 26 + 1
    # A shard that does not read back as written stops the build, naming the storage.
    real_save = cache.save_shard

    def save_then_flip(path, tensors, rows, skipped, buckets=None):
        real_save(path, tensors, rows, skipped, buckets)
        data = bytearray(path.read_bytes())
        data[-8:] = bytes(8) if any(data[-8:]) else b"\xff" * 8
        path.write_bytes(bytes(data))

    monkeypatch.setattr(cache, "save_shard", save_then_flip)
    shard.unlink()
    with pytest.raises(RuntimeError, match="reads back damaged right after writing"):
        build()


def test_the_source_fingerprint_of_a_folder_stats_no_file(tmp_path, monkeypatch):
    """A local image folder's fingerprint is `datasets`' own, which already covers each file's modification
    time: no second pass over a million files (an edit in place is still a miss:
    test_image_edited_in_place_is_a_miss_that_names_the_source)."""
    from training.data.cache import source_fingerprint

    folder = tmp_path / "images" / "train"
    folder.mkdir(parents=True)
    for i in range(6):
        Image.fromarray(np.full((20, 20, 3), 30 * i, np.uint8)).save(folder / f"{i}.png")
    cfg = config.load_config(fm.DEFAULTS, [f"--data.source={tmp_path / 'images'}", "--data.val_holdout=2",
                                           "--data.label_column=null", "--data.cache_dir", str(tmp_path / "cache")])
    train, _ = open_splits(cfg.data)
    stats, real_stat = [], os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: stats.append(path) or real_stat(path, *a, **k))
    fingerprint = source_fingerprint(cfg.data, train)
    assert fingerprint == {"dataset_fingerprint": train._fingerprint} and not stats


def test_unreadable_or_missing_manifest_is_a_miss_that_reuses_finished_shards(tmp_path, capsys):
    build, calls = small_cache(tmp_path)
    folder = build()
    manifest = folder / "manifest.json"
    good = json.loads(manifest.read_text())
    for broken in (manifest.read_text()[:40], "", "[1, 2]"):  # truncated, empty, not the manifest's shape
        manifest.write_text(broken)
        calls.clear()
        assert build() == folder and not calls  # every shard verified and reused, nothing encoded
        assert "manifest.json cannot be read" in capsys.readouterr().out
        assert json.loads(manifest.read_text()) == good  # written again
    manifest.unlink()
    build()
    assert "reusing 3 finished shards of 3" in capsys.readouterr().out and not calls
    # Another setting's build is not blocked by a broken cache folder of the same source.
    (folder / "key.json").write_text("{")
    small_cache(tmp_path, "--data.resolution=8")[0]()


def test_shard_size_changed_mid_build_is_a_new_cache_without_duplicates(tmp_path, capsys):
    build, _ = small_cache(tmp_path)
    folder = build()
    rows = [row["x"] for row in CachedDataset(folder)]
    (folder / "manifest.json").unlink()
    (folder / "shard_00002.safetensors").unlink()  # interrupted before its last shard
    capsys.readouterr()
    folder16 = small_cache(tmp_path, "--data.shard_size=16")[0]()
    assert folder16 != folder and "changed shard_size: 32 -> 16" in capsys.readouterr().out
    resized = CachedDataset(folder16)
    assert len(resized) == 90 and len(resized.shards) == 6
    assert all(torch.equal(rows[i], resized[i]["x"]) for i in range(90))  # each row once, in order


def test_image_edited_in_place_is_a_miss_that_names_the_source(tmp_path, capsys):
    from accelerate import Accelerator

    folder = tmp_path / "images" / "train"
    folder.mkdir(parents=True)
    for i in range(8):
        Image.fromarray(np.full((20, 20, 3), 30 * i, np.uint8)).save(folder / f"{i}.png")
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps({"file_name": f"{i}.png", "label": i % 2})
                                                     for i in range(8)))
    cfg = config.load_config(fm.DEFAULTS, [f"--data.source={tmp_path / 'images'}", "--data.val_holdout=2",
                                           "--data.num_classes=2", "--data.cache_dir", str(tmp_path / "cache")])
    train, _ = open_splits(cfg.data)
    encode = lambda pixels, captions: {"x": pixels}
    before = build_cache(train, "train", encode, Accelerator(cpu=True), cfg)
    Image.fromarray(np.full((20, 20, 3), 255, np.uint8)).save(folder / "3.png")  # same name, new content
    stat = (folder / "3.png").stat()
    os.utime(folder / "3.png", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse-mtime filesystem
    capsys.readouterr()
    train, _ = open_splits(cfg.data)
    after = build_cache(train, "train", encode, Accelerator(cpu=True), cfg)
    assert after != before and "changed source_files" in capsys.readouterr().out
    assert any(CachedDataset(after)[i]["x"].min() == 1 for i in range(len(train)))  # the white image is cached


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
    assert checkpoints.find_checkpoint(run, "latest").name == "step_00000004"


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_stop_signal_during_the_cache_build_exits_75_and_the_build_resumes(tmp_path, tiny_vae, processes, capsys):
    """SIGTERM while the cache is being encoded (to one rank only, with 2 processes launched as the README's
    SLURM script does, one per task): every rank finishes its shard and exits 75; the next run reuses the
    finished shards, and the cache ends up identical to one built without interruption."""
    args = tiny_run_args(tmp_path, "run", steps=1) + ["--encoders.vae", tiny_vae, "--data.resolution=32",
                                                      "--data.demo_resolution=32", "--data.demo_samples=2000",
                                                      "--data.shard_size=32", "--log.report=false"]
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if processes > 1 else {} for r in range(processes)]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "train_flow_matching.py"), *args],
                              cwd=tmp_path, env={**env, **r},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ranks]
    deadline = time.time() + 300
    while not list((tmp_path / "cache").glob("*-train-*/shard_*.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    procs[-1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [common.REQUEUE_EXIT_CODE] * processes, outs[0][1][-2000:]
    assert "stopped by a signal during the cache build (train)" in outs[0][0]
    folder = next((tmp_path / "cache").glob("*-train-*"))
    finished = len(list(folder.glob("shard_*.safetensors")))
    assert 1 <= finished < 61 and not (folder / "manifest.json").exists()
    run = fm.main(args)  # requeued: resumes the build
    assert f"reusing {finished} finished shards of 61" in capsys.readouterr().out
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["shards"]) == 61 and len(CachedDataset(folder)) == 2000 - 64
    if processes == 1:  # the same shards as an uninterrupted build, checksum for checksum
        fm.main([*args, "--data.cache_dir", str(tmp_path / "straight"), "--run_dir", str(tmp_path / "straight_run")])
        straight = json.loads(next((tmp_path / "straight").glob("*-train-*/manifest.json")).read_text())
        assert straight["sha256"] == manifest["sha256"]
    assert (run / "export").exists()



@pytest.mark.slow
def test_killed_run_resumes_with_the_metrics_of_an_uninterrupted_one(tmp_path, monkeypatch):
    """Killed while writing the checkpoint of step 4, after the rows of step 4 were logged; the checkpoint of
    step 3 sits in the middle of the log interval 3-4. On resume the rows of step 4 are set aside (not
    deleted), and the interval is logged in full again, so every logged statistic equals the uninterrupted
    run's."""
    args = ["--log.every=2", "--ckpt.every=3", "--log.grad_every=0", "--log.report=false"]
    straight = fm.main(tiny_run_args(tmp_path, "straight", steps=4) + args)
    saves, save_checkpoint = [], checkpoints.save_checkpoint

    def killed_in_the_second_checkpoint(*a):
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt("killed")
        return save_checkpoint(*a)

    monkeypatch.setattr(checkpoints, "save_checkpoint", killed_in_the_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        fm.main(tiny_run_args(tmp_path, "killed", steps=4) + args)
    monkeypatch.setattr(checkpoints, "save_checkpoint", save_checkpoint)
    killed = fm.main(tiny_run_args(tmp_path, "killed", steps=4) + args + ["--resume=latest"])

    def rows(path):
        timing = ("images_per_s", "images_per_s_per_device", "data_wait_share", "peak_memory_gb", "cpu_s_per_step")
        return [{k: v for k, v in r.items() if k not in timing} for r in map(json.loads, path.read_text().splitlines())]

    assert [r["step"] for r in rows(killed / "metrics.jsonl")] == [2, 4, 4]  # two loss rows and the val_loss row
    assert rows(killed / "metrics.jsonl") == rows(straight / "metrics.jsonl")
    aside = rows(killed / "metrics.after_step_3.jsonl")
    assert [r["step"] for r in aside] == [4, 4] and aside == rows(straight / "metrics.jsonl")[1:]


def test_rows_past_the_resumed_step_and_a_cut_short_row_are_set_aside(tmp_path):
    from types import SimpleNamespace

    rows = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(rows) + '{"step": 6, "lo')  # killed mid-write
    cfg = config.Config(log=config.Config(wandb="off"))
    runlog.RunLog(cfg, tmp_path, SimpleNamespace(is_main_process=True, print=print), start_step=3)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(rows[:3])
    assert (tmp_path / "metrics.after_step_3.jsonl").read_text() == "".join(rows[3:]) + '{"step": 6, "lo\n'
