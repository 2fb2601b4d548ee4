"""Step bookkeeping, checked on what a run leaves behind (weights, EMA, optimizer state, metrics, checkpoints,
exit codes), never on how the loop is written: accumulation, the EMA on real optimizer steps, a skipped
non-finite step, exact resume of the DDPM trainer, preemption of one of two ranks, DataLoader workers under
SIGTERM. All are end-to-end runs: the slow tier.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import common
from training.run import checkpoints
import train_ddpm as ddpm
import train_flow_matching as fm
import conftest
from conftest import ROOT

pytestmark = pytest.mark.slow

# Bookkeeping (accumulation, EMA, counters, resume, signals, ranks) is the loop's, not the model's size: every run
# here trains two narrow blocks (width 32), about half the CPU of the default four of width 128.
NARROW = ["--model.num_layers=2", "--model.num_attention_heads=2", "--model.attention_head_dim=16"]


def tiny_run_args(*args, **kwargs):
    return conftest.tiny_run_args(*args, **kwargs) + NARROW


def ckpt(run, step, name):
    return load_file(str(Path(run) / "checkpoints" / f"step_{step:08d}" / f"{name}.safetensors"))


def state(run, step):
    return checkpoints.read_state(Path(run) / "checkpoints" / f"step_{step:08d}")


def optimizer_state(run, step):
    return checkpoints.read_optimizer_state(Path(run) / "checkpoints" / f"step_{step:08d}")


def train_rows(run):
    return [m for m in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


NO_DROPOUT = ["--conditioning.semantic_dropout=0", "--conditioning.control_dropout=0"]


def row_determined_loss(monkeypatch, poison_call=None):
    """Replace the flow-matching loss by the same loss with noise and time that are functions of the row
    (so how the batch is split into micro-batches cannot change them); optionally a NaN loss on one call."""
    original, calls = fm.training_loss, []  # training's, and validation's through flow_matching_loss

    def loss(model, x0, cond, t, noise, *options):
        noise = torch.sin(7 * x0 + 1.0)
        t = torch.sigmoid(3 * x0.mean(dim=tuple(range(1, x0.dim()))))
        out, terms = original(model, x0, cond, t, noise, *options)
        calls.append(len(x0))
        return out * float("nan") if len(calls) - 1 == poison_call else out, terms

    monkeypatch.setattr(fm, "training_loss", loss)
    return calls


# ---- Accumulation ------------------------------------------------------------------------------------------


def test_accumulation_equals_one_big_batch(tmp_path, monkeypatch):
    """Batch 16 x grad_accum 2 and batch 32 x grad_accum 1 see the same 32 rows (the same epoch permutation):
    the same pre-clip gradient norm, the same Adam moments and, after one optimizer step, the same weights."""
    row_determined_loss(monkeypatch)
    args = ["--log.every=1", "--log.report=false"] + NO_DROPOUT
    accum = fm.main(tiny_run_args(tmp_path, "accum", steps=1) + args
                    + ["--train.batch_size=16", "--train.grad_accum=2"])
    big = fm.main(tiny_run_args(tmp_path, "big", steps=1) + args + ["--train.batch_size=32"])
    norms = [train_rows(run)[0]["grad_norm"] for run in (accum, big)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # a dropped 1 / grad_accum doubles it
    # Adam's moments after one step are (1 - beta) g and (1 - beta2) g^2 of the clipped gradient: linear in it.
    moments = [optimizer_state(run, 1)["state"] for run in (accum, big)]
    for p in moments[0]:
        assert float(moments[0][p]["step"]) == float(moments[1][p]["step"]) == 1.0
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = moments[0][p][key], moments[1][p][key]
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5 * float(b.abs().max()) + 1e-30, msg=(p, key))
    # The weights: Adam's first update lr g / (|g| + eps) turns float rounding of a near-zero gradient entry
    # into up to ~lr, so a handful of entries differ by more than 1e-6 (the two narrow blocks' 80k: 3 measured, at
    # most 1.9e-6; the default model's 2.3M: 28, at most 1.4e-5).
    lr = 1e-3 / 2  # step 1 of a 2-step warm-up
    a, b = ckpt(accum, 1, "model"), ckpt(big, 1, "model")
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diff.max().item() < 0.1 * lr and (diff > 1e-6).float().mean().item() < 1e-4


# ---- EMA and counters on real optimizer steps; a skipped non-finite step changes nothing -------------------------


@pytest.fixture(scope="module")
def three_steps_third_poisoned(tmp_path_factory):
    """3 optimizer steps of 2 micro-batches each, a checkpoint after every step; the loss of the last
    micro-batch of step 3 is NaN, so step 3 is skipped."""
    tmp = tmp_path_factory.mktemp("ema")
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = row_determined_loss(monkeypatch, poison_call=5)
        run = conftest.trained_for_the_module(fm.main, tiny_run_args(tmp, "ema", steps=3) + NO_DROPOUT + [
            "--train.grad_accum=2", "--train.batch_size=8", "--ckpt.every=1", "--ckpt.keep=5", "--log.every=1"])
    return run, calls


def test_ema_and_counters_move_once_per_optimizer_step(three_steps_third_poisoned):
    run, calls = three_steps_third_poisoned
    assert calls[:6] == [8] * 6  # 3 steps x 2 micro-batches were trained
    decay = fm.DEFAULTS["train"]["ema_decay"]
    n = 1  # step 2 is the second update: one before it
    d = min(decay, (1 + n) / (10 + n))  # the warm-up of common.ema_update (documented in the README)
    ema1, ema2, model2 = ckpt(run, 1, "ema"), ckpt(run, 2, "ema"), ckpt(run, 2, "model")
    for k in ema2:
        torch.testing.assert_close(ema2[k], torch.lerp(ema1[k], model2[k], 1 - d), rtol=1e-6, atol=1e-7, msg=k)
    assert any(not torch.equal(ema1[k], ema2[k]) for k in ema1)
    assert [state(run, s)["step"] for s in (1, 2)] == [1, 2]
    adam_steps = {float(v["step"]) for v in optimizer_state(run, 2)["state"].values()}
    assert adam_steps == {2.0}  # one Adam update per optimizer step, not per micro-batch
    assert [m["step"] for m in train_rows(run)] == [1, 2, 3]


def test_a_skipped_nonfinite_step_leaves_weights_ema_and_optimizer_bitwise_unchanged(three_steps_third_poisoned):
    run, _ = three_steps_third_poisoned
    for name in ("model", "ema"):
        before, after = ckpt(run, 2, name), ckpt(run, 3, name)
        assert all(torch.equal(before[k], after[k]) for k in before), name
    before, after = optimizer_state(run, 2), optimizer_state(run, 3)
    assert before["state"].keys() == after["state"].keys()
    for p in before["state"]:
        for key, value in before["state"][p].items():
            assert torch.equal(value, after["state"][p][key]), (p, key)
    assert state(run, 3)["skipped_steps"] == 1 and train_rows(run)[-1]["skipped_steps"] == 1


# ---- Exact resume: the DDPM trainer --------------------------------------------------------------------------


def test_ddpm_resumes_exactly(tmp_path):
    """4 steps straight vs 2 steps, then --resume latest to 4: bitwise the same weights, EMA, optimizer
    state and losses (the noise, timesteps, dropout and data order continue from the saved RNG states)."""
    from test_robustness import assert_same_checkpoint

    extra = ["--log.every=1", "--ckpt.every=2", "--train.grad_accum=2", "--train.batch_size=8"]
    ddpm.main(tiny_run_args(tmp_path, "straight", steps=4) + extra)
    ddpm.main(tiny_run_args(tmp_path, "resumed", steps=2) + extra)
    ddpm.main(tiny_run_args(tmp_path, "resumed", steps=4) + extra + ["--resume=latest"])
    assert [m["step"] for m in train_rows(tmp_path / "resumed")] == [1, 2, 3, 4]
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "resumed", 4)


def test_a_run_on_cached_views_resumes_exactly(tmp_path):
    """data.cache_views=2 crops x 2 flips, 64 training images in 4 micro-batches a epoch: 6 steps straight vs 3,
    then --resume latest to 6 (mid-epoch, after an epoch boundary, so the view drawn per image changed):
    bitwise the same weights, EMA and optimizer state."""
    from test_robustness import assert_same_checkpoint

    extra = ["--data.demo_samples=96", "--data.val_holdout=32", "--data.crop=random_resized", "--data.random_flip=true",
             "--data.cache_views=2", '--conditioning.controls=["size", "crop", "flip"]', "--ckpt.every=3",
             "--train.grad_accum=2", "--model.num_layers=1", "--log.every=1"]
    fm.main(tiny_run_args(tmp_path, "straight", steps=6) + extra)
    fm.main(tiny_run_args(tmp_path, "resumed", steps=3) + extra)
    fm.main(tiny_run_args(tmp_path, "resumed", steps=6) + extra + ["--resume=latest"])
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "resumed", 6)


# ---- Preemption ------------------------------------------------------------------------------------------------


def wait_for_training(metrics, proc, rows=2, timeout=300):
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "the run did not start training"
        time.sleep(0.2)


@contextlib.contextmanager
def killed_at_exit(proc):
    """A run that hangs (the bug some of these tests exist for) is killed, with every process it started
    (torchrun puts each rank in a session of its own)."""
    try:
        yield
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.communicate(timeout=60)


def signal_rank_one(proc, marker, metrics):
    """SIGUSR1 to rank 1 of an `accelerate launch` (found by its RANK and our marker), once it trains."""
    wait_for_training(metrics, proc)

    def rank_of(p):
        try:
            env = p.environ()
            return int(env["RANK"]) if env.get("TEST_MARKER") == marker and "RANK" in env else None
        except (psutil.Error, KeyError, ValueError):
            return None

    ranks = {rank_of(p): p for p in psutil.Process(proc.pid).children(recursive=True)}
    assert {0, 1} <= set(ranks), ranks
    ranks[1].send_signal(signal.SIGUSR1)  # rank 1 only
    return proc.communicate(timeout=120)


@pytest.mark.xdist_group("gloo")
def test_one_rank_signalled_both_stop_at_the_same_step_with_one_checkpoint(tmp_path):
    args = tiny_run_args(tmp_path, "ddp", steps=10_000) + ["--log.every=1"]
    marker = f"bookkeeping-{os.getpid()}-{tmp_path.name}"
    proc = subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                             str(ROOT / "train_flow_matching.py"), *args], cwd=tmp_path, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TEST_MARKER": marker},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    with killed_at_exit(proc):
        stdout, stderr = signal_rank_one(proc, marker, tmp_path / "ddp" / "metrics.jsonl")
    stopped = re.search(r"stopped by a signal at step (\d+)", stdout)  # printed by rank 0, which was not signalled
    assert stopped, stderr[-3000:]
    step = int(stopped[1])
    folders = sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").iterdir())
    assert folders == [f"step_{step:08d}"]  # exactly one checkpoint, at the step where both stopped
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints" / folders[0]).glob("rng_*")) == \
        ["rng_0.pt", "rng_1.pt"]
    assert train_rows(tmp_path / "ddp")[-1]["step"] == step
    # torchrun reports the first rank to exit with the requeue code, then stops the other with SIGTERM: that
    # rank, if torchrun's signal reaches it before its own exit, is reported with 15 (seen once in CI).
    codes = [int(c) for c in re.findall(r"exitcode\W+(-?\d+)", stderr)]
    assert common.REQUEUE_EXIT_CODE in codes and set(codes) <= {common.REQUEUE_EXIT_CODE, 15, -15}, stderr[-3000:]


def test_dataloader_workers_ignore_sigterm_and_the_run_checkpoints_and_exits_75(tmp_path):
    """A scheduler's SIGTERM reaches the whole process group, DataLoader workers included: they must ignore
    it (a killed worker would crash the loop) while the trainer checkpoints and exits for a requeue."""
    args = tiny_run_args(tmp_path, "workers", steps=10_000) + ["--log.every=1", "--data.num_workers=2"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_flow_matching.py"), *args], cwd=tmp_path, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with killed_at_exit(proc):
        wait_for_training(tmp_path / "workers" / "metrics.jsonl", proc)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2  # the DataLoader's worker processes are alive
        os.killpg(proc.pid, signal.SIGTERM)  # the trainer and its workers, as a scheduler does
        stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == common.REQUEUE_EXIT_CODE, stderr[-3000:]
    step = int(re.search(r"stopped by a signal at step (\d+)", stdout)[1])
    assert checkpoints.find_checkpoint(tmp_path / "workers", "latest").name == f"step_{step:08d}"


# ---- Two processes: disjoint rows, averaged gradients ---------------------------------------------------------

TWO_RANKS = '''
import sys, torch
sys.path.insert(0, sys.argv[1])
import train_flow_matching as fm
original = fm.training_loss

def loss(model, x0, cond, t, noise, *options):  # noise and time are functions of the row (see row_determined_loss)
    return original(model, x0, cond, torch.sigmoid(3 * x0.mean(dim=tuple(range(1, x0.dim())))), torch.sin(7 * x0 + 1.0),
                    *options)

fm.training_loss = loss
fm.main(sys.argv[2:])
'''


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_two_ranks_train_on_disjoint_rows_and_average_their_gradients(tmp_path, monkeypatch):
    """2 ranks x batch 16 x accumulation 2 against 1 process x batch 32 x accumulation 2: each micro-batch of
    the single process holds exactly the rows the two ranks hold together, so the weights after one step are the
    same only if the ranks' rows are disjoint (overlapping rows average 16 rows, not 32) and their gradients are
    averaged (without the all-reduce, rank 0 steps on its own half)."""
    row_determined_loss(monkeypatch)
    args = ["--log.every=1", "--log.report=false", "--train.grad_accum=2"] + NO_DROPOUT
    one = fm.main(tiny_run_args(tmp_path, "one", steps=1) + args + ["--train.batch_size=32"])
    (tmp_path / "two_ranks.py").write_text(TWO_RANKS)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           str(tmp_path / "two_ranks.py"), str(ROOT),
                           *tiny_run_args(tmp_path, "two", steps=1), *args, "--train.batch_size=16"],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    norms = [train_rows(run)[0]["grad_norm"] for run in (one, tmp_path / "two")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    lr = 1e-3 / 2  # step 1 of a 2-step warm-up; Adam's first step is about lr per entry (see the test above)
    a, b = ckpt(one, 1, "model"), ckpt(tmp_path / "two", 1, "model")
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diff.max().item() < 0.1 * lr and (diff > 1e-6).float().mean().item() < 1e-3
