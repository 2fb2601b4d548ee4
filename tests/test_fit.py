"""Fitting a run to its GPU (training/run/fit.py), on CPU: the micro-batch probe under an injected out-of-memory error
(torch.cuda.OutOfMemoryError above micro-batch k), the choice of gradient checkpointing by measured speed, the
EMA every k steps (against today's EMA and a closed form) and offloaded, the encoders' places after the cache
stage, and the config keys. The end-to-end runs (bitwise equal to a run configured by hand, exact resume, two
processes agreeing) are in the slow tier."""
import copy
import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import common
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args
from test_config import no_work  # noqa: F401  (fixture)
from training.config import config
from training.data import encoders
from training.model.mmdit import Denoiser
from training.optimisation import optimizers
from training.run import fit
from training.run.start import build_for_run


def oom_above(monkeypatch, limit, limit_checkpointed=None):
    """Every forward with gradients of more than `limit` samples (`limit_checkpointed` with gradient
    checkpointing on; either a callable: the limit now) raises the error a GPU raises, before any work: what a
    probe on a GPU of that size sees."""
    forward = Denoiser.forward

    def limited(self, x, *args, **kwargs):
        k = limit_checkpointed if limit_checkpointed and self.transformer.is_gradient_checkpointing else limit
        k = k() if callable(k) else k
        if torch.is_grad_enabled() and len(x) > k:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                              f"(injected: {len(x)} > {k})")
        return forward(self, x, *args, **kwargs)
    monkeypatch.setattr(Denoiser, "forward", limited)


# ---- The search -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_process", [1, 24, 32, 96, 100, 128, 210])
def test_the_largest_divisor_that_fits_is_found(per_process):
    for k in range(0, per_process + 2):
        tried = []
        found = fit.largest_fitting(fit.divisors(per_process), lambda m: tried.append(m) or m <= k)
        oracle = max([d for d in range(1, per_process + 1) if per_process % d == 0 and d <= k], default=0)
        assert found == oracle, (per_process, k, tried)
        assert len(tried) <= 2 * math.ceil(math.log2(per_process + 1)) + 1  # halving + bisection, not a scan
        assert all(per_process % m == 0 for m in tried)  # only divisors: the global batch is kept


def test_checkpointing_is_chosen_by_measured_speed_only_when_it_matters():
    speeds = {(8, False): 10.0, (24, True): 12.0, (12, True): 11.0, (8, True): 9.0, (6, True): 8.0}
    logged, timed = [], []

    def images_per_s(m, c):
        timed.append((m, c))
        return speeds[m, c]

    def run(limit, limit_ckpt, checkpointing="auto"):
        timed.clear()
        return fit.choose(fit.divisors(24), lambda m, c: m <= (limit_ckpt if c else limit), images_per_s,
                          lambda values: values, checkpointing, logged.append)

    assert run(24, 24) == (24, False, []) and timed == []  # the whole batch fits: nothing to time
    assert run(8, 8) == (8, False, []) and timed == []  # checkpointing fits no more: not timed
    assert run(0, 12)[:2] == (12, True) and timed == [(12, True), (8, True), (6, True)]  # nothing fits without it:
    assert run(0, 1) == (1, True, []) and timed == []                                     # the 3 largest with it timed
    assert run(0, 0) == (0, True, [])
    micro, ckpt, table = run(8, 24)  # with it a larger one fits: every pair is timed, the fastest taken
    assert timed == [(8, False), (24, True), (12, True)] and (micro, ckpt) == (24, True)
    assert [(r["micro_batch"], r["gradient_checkpointing"], r["images_per_s"]) for r in table] == \
        [(8, False, 10.0), (24, True, 12.0), (12, True, 11.0)]
    assert "micro-batch    24, gradient checkpointing on : 12.0" in logged[-1]
    speeds[8, False] = 13.0  # the recompute does not pay: without it
    assert run(8, 24)[:2] == (8, False)
    assert run(8, 24, checkpointing=True) == (24, True, [])  # train.gradient_checkpointing=true: always on


def test_ranks_take_the_minimum():
    """Two ranks (threads here) with different limits, exchanging through all_min as the all-reduce does: both
    take the same decisions, at the smaller rank's micro-batch."""
    limits, barrier, slots, results = [16, 6], threading.Barrier(2, timeout=60), [None, None], [None, None]

    def rank(r):
        def all_min(values):
            slots[r] = values
            barrier.wait()
            out = [min(a, b) for a, b in zip(*slots)]
            barrier.wait()
            return out
        results[r] = fit.choose(fit.divisors(16), lambda m, c: m <= limits[r], lambda m, c: 1.0, all_min)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]  # a mismatch breaks the barrier
    [t.start() for t in threads], [t.join(timeout=30) for t in threads]
    assert results == [(4, False, []), (4, False, [])]


# ---- The probe on a real model: the choice, and nothing the run keeps changed ------------------------------------


class Rows:
    """A cached training set as CachedDataset serves it: dataset[list of rows] -> a micro-batch."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.label = torch.randn(n, 3, 16, 16, generator=g), torch.arange(n) % 9

    def __len__(self):
        return len(self.x)

    def __getitem__(self, rows):
        return {"x": self.x[rows], "label": self.label[rows]}


def tiny_run(tmp_path, *args):
    cfg = config.load_config(fm.DEFAULTS, ["--data.num_classes=9", "--model.num_layers=2",
                                           "--model.num_attention_heads=2",
                                           "--model.attention_head_dim=16", f"--run_dir={tmp_path}", *args])
    torch.manual_seed(0)
    model = build_for_run(cfg, (3, 16, 16))
    return cfg, common.make_accelerator("no"), model, optimizers.make_optimizer(model, cfg.train)  # before prepare


def test_the_probe_chooses_the_largest_divisor_below_the_limit_and_changes_nothing(tmp_path, monkeypatch):
    oom_above(monkeypatch, 10)
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=24", "--train.batch_size=auto")
    weights, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64))
    assert (cfg.train.batch_size, cfg.train.grad_accum, cfg.train.gradient_checkpointing) == (8, 3, False)
    # Not a training step: weights, optimizer state, gradients and the RNG as they were.
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert not optimizer.state and "found_inf" not in optimizer.__dict__
    assert all(p.grad is None for p in model.parameters())
    found = json.loads((tmp_path / "fit.json").read_text())
    assert found["micro_batch"] == 8 and found["grad_accum"] == 3 and found["candidates"] == [24, 12, 8, 6, 4, 3, 2, 1]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["batch_size"] == 8  # the run records its choice


def test_the_probe_times_checkpointing_when_it_lets_a_larger_micro_batch_run(tmp_path, monkeypatch, capsys):
    oom_above(monkeypatch, 2, limit_checkpointed=6)
    monkeypatch.setattr(fit, "TIMED_REPEATS", 1)
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=12", "--train.batch_size=auto")
    fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64))
    table = json.loads((tmp_path / "fit.json").read_text())["timed"]
    assert [(r["micro_batch"], r["gradient_checkpointing"]) for r in table] == \
        [(2, False), (6, True), (4, True), (3, True)]
    best = max(table, key=lambda r: r["images_per_s"])
    assert (cfg.train.batch_size, cfg.train.gradient_checkpointing) == \
        (best["micro_batch"], best["gradient_checkpointing"])
    assert cfg.train.grad_accum == 12 // best["micro_batch"]
    assert model.transformer.is_gradient_checkpointing == best["gradient_checkpointing"]  # the model follows
    assert "fit: measured (images/s per process, slowest rank)" in capsys.readouterr().out


class Views(Rows):
    """A cache of 4 views per image (data.cache_views=2 with flips): 4 rows of each image, one shown per epoch."""
    views = 4


def test_images_not_cached_views_bound_the_micro_batch_and_count_in_the_warnings(tmp_path, monkeypatch, capsys):
    """64 rows are 16 images: iterate_batches refuses a micro-batch above 16, so the probe never tries one, and
    the memorisation warnings count epochs and parameters per image of the 16."""
    from training.record import runlog

    oom_above(monkeypatch, 100)
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=24", "--train.batch_size=auto")
    fit.plan_batch(cfg, accelerator, model, optimizer, Views(64))
    assert cfg.train.batch_size == 12 and json.loads((tmp_path / "fit.json").read_text())["candidates"][0] == 12
    cfg.train.max_steps = 1000  # 1000 x 24 images = 1,500 epochs of 16 (375 of 64 rows: no warning)
    runlog.describe_run(accelerator, cfg, model, Views(64), "lr", "method")
    assert "is 1,500 epochs of 16 images: expect memorisation" in capsys.readouterr().out


def test_a_resumed_run_reuses_its_recorded_choice_and_a_fixed_batch_derives_the_accumulation(tmp_path):
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    torch.save({"step": 2, "config": {"train": {"batch_size": 6, "gradient_checkpointing": True}}}, ckpt / "state.pt")
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=24", "--train.batch_size=auto")
    fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64), ckpt=ckpt)  # no probe: nothing OOMs here
    assert (cfg.train.batch_size, cfg.train.grad_accum, cfg.train.gradient_checkpointing) == (6, 4, True)
    assert model.transformer.is_gradient_checkpointing
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=24", "--train.batch_size=12",
                                                  "--train.grad_accum=5")
    fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64))
    assert (cfg.train.batch_size, cfg.train.grad_accum) == (12, 2)  # derived; the configured 5 is replaced


def test_the_recorded_choice_is_read_onto_the_cpu(tmp_path, monkeypatch):
    """Rank 0 saved state.pt with tensors tagged cuda:0: every load maps to the CPU (common.py), this one too."""
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    torch.save({"step": 2, "config": {"train": {"batch_size": 6, "gradient_checkpointing": False}}}, ckpt / "state.pt")
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *args, **kwargs: loads.append(str(kwargs.get("map_location")))
                        or real_load(f, *args, **kwargs))
    assert fit.recorded_choice(ckpt) == (6, False) and loads == ["cpu"]


def test_nothing_fits_stops_naming_the_keys(tmp_path, monkeypatch):
    oom_above(monkeypatch, 0)
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=8", "--train.batch_size=auto")
    with pytest.raises(config.ConfigError, match=r"train.batch_size='auto': not even a micro-batch of 1 "
                       r"fits.*train.ema_device"):
        fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64))


def test_the_probe_runs_repas_encoder_and_projector(tmp_path, monkeypatch, tiny_dino):
    """REPA's projector pass and, with targets on the fly, its frozen encoder take memory in every step of the run:
    the probe's step has them. Injected: a GPU that fits 8 samples without the projector's pass, 4 with it."""
    from training.data import repa_targets
    from training.objectives import repa

    forward, encoded, targets = Denoiser.forward, [], repa_targets.encoder_targets

    def limited(self, x, *args, align=False, **kwargs):
        if torch.is_grad_enabled() and len(x) > (4 if align else 8):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected: {len(x)}, align={align})")
        return forward(self, x, *args, align=align, **kwargs)
    monkeypatch.setattr(Denoiser, "forward", limited)
    monkeypatch.setattr(repa_targets, "encoder_targets",
                        lambda encoder, x, grid: encoded.append(len(x)) or targets(encoder, x, grid))
    cfg, accelerator, model, optimizer = tiny_run(
        tmp_path, "--train.global_batch=8", "--train.batch_size=auto", "--objective.repa_weight=0.5",
        f"--objective.repa_encoder={tiny_dino}", "--objective.repa_block=1", "--objective.repa_targets=on_the_fly")
    fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64), align=repa.Alignment(cfg, torch.device("cpu")))
    assert cfg.train.batch_size == 4 and 8 in encoded and 4 in encoded


def test_the_probe_runs_meanflows_jvp_and_leaves_pythons_generator_alone(tmp_path, monkeypatch):
    """A MeanFlow step also runs the guided target's passes and a JVP of the model (meanflow.target) on every sample
    with r < t: the probe's step has them, for the whole micro-batch. Injected: a GPU whose JVP fits 4 samples
    and whose plain forward and backward fit 8. The probe draws its times from torch's forked generator, never
    from Python's (meanflow.equal_count's), so the run's draws are the same as configured by hand."""
    import random

    from training.objectives import meanflow

    target, jvp_sizes = meanflow.target, []

    def limited(model, z, t, r, v, cond, equal, prediction="v"):
        jvp_sizes.append(len(z) - equal)
        if len(z) - equal > 4:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected: a JVP of {len(z) - equal})")
        return target(model, z, t, r, v, cond, equal, prediction)
    monkeypatch.setattr(meanflow, "target", limited)
    for loss, micro in ((None, 8), ("meanflow", 4)):
        cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=8", "--train.batch_size=auto",
                                                      "--objective.meanflow=true")
        state = random.getstate()
        fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64),
                       loss=loss and meanflow.probe_loss(cfg.objective))
        assert cfg.train.batch_size == micro and random.getstate() == state
    assert 8 in jvp_sizes and 4 in jvp_sizes


def test_contrastive_flow_matching_refuses_a_probed_micro_batch_of_one(tmp_path, monkeypatch):
    """Written literally, train.batch_size=1 is refused at start-up (test_config); "auto" resolving to 1 must be
    too, or the objective silently becomes (1 - lambda) x plain flow matching (the roll pairs each sample with
    itself)."""
    limit = [1]
    oom_above(monkeypatch, lambda: limit[0])
    args = ["--train.global_batch=8", "--train.batch_size=auto", "--objective.contrastive_weight=0.05"]
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, *args)
    with pytest.raises(config.ConfigError, match=r"objective.contrastive_weight=0.05 .* train.batch_size='auto' chose "
                                                 r"1 \(the largest divisor of 8 that fits.*make room for 2"):
        fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64))
    limit[0] = 2
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, *args)
    fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64))
    assert cfg.train.batch_size == 2


def test_an_error_other_than_out_of_memory_is_not_swallowed(tmp_path, monkeypatch):
    def broken(self, x, *args, **kwargs):
        raise RuntimeError("shape mismatch")
    monkeypatch.setattr(Denoiser, "forward", broken)
    cfg, accelerator, model, optimizer = tiny_run(tmp_path, "--train.global_batch=8", "--train.batch_size=auto")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        fit.plan_batch(cfg, accelerator, model, optimizer, Rows(64))


@pytest.mark.parametrize("args,message", [
    (["--train.batch_size=auto"], r"train.batch_size='auto' finds the micro-batch that keeps train.global_batch"),
    (["--train.batch_size=big"], r"train.batch_size='big' must be a whole number >= 1 or 'auto'"),
    (["--train.global_batch=24", "--train.batch_size=16"],
     r"train.global_batch=24 is not a multiple of train.batch_size=16"),
    (["--train.global_batch=0"], r"train.global_batch=0 must be a number >= 1"),
    (["--train.ema_device=gpu"], r"train.ema_device='gpu' must be 'same' or 'cpu'"),
    (["--train.ema_every=0"], r"train.ema_every=0 must be a number >= 1"),
])
def test_bad_fit_keys_are_refused_before_any_work(tmp_path, no_work, args, message):  # noqa: F811
    with pytest.raises(config.ConfigError, match=message):
        fm.main(tiny_run_args(tmp_path) + args)


# ---- The EMA every k steps, offloaded ----------------------------------------------------------------------------


def trajectory(n, shape=(3, 4)):
    """Known weights after each step: w_1 .. w_n."""
    return [torch.sin(torch.arange(math.prod(shape), dtype=torch.float32).view(shape) * 0.37 + 0.5 * s)
            for s in range(1, n + 1)]


def updater_run(every, device_setting, weights, applied, decay=0.9):
    model = torch.nn.Linear(4, 3, bias=False)
    ema = copy.deepcopy(model).requires_grad_(False)
    tr = config.Config(ema_decay=decay, ema_every=every, max_steps=len(weights), ema_device=device_setting)
    update = fit.EMAUpdater(ema, model, None, tr, torch.device("cpu"))
    start = ema.weight.detach().clone()
    history = []
    for step, (w, ok) in enumerate(zip(weights, applied)):
        with torch.no_grad():
            model.weight.copy_(w)
        update(step, torch.tensor(ok))
        update.wait()
        history.append(ema.weight.detach().clone())
    return start, history


def test_ema_every_1_offloaded_equals_todays_ema_bitwise():
    weights, applied = trajectory(12), [True] * 5 + [False] + [True] * 6  # a skipped step included
    start, history = updater_run(1, "cpu", weights, applied)
    model, ema = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 3, bias=False).requires_grad_(False)
    with torch.no_grad():
        ema.weight.copy_(start)
    for step, (w, ok) in enumerate(zip(weights, applied)):
        with torch.no_grad():
            model.weight.copy_(w)
        common.ema_update(ema, model, 0.9, step, applied=torch.tensor(ok))
        assert torch.equal(ema.weight, history[step]), step


@pytest.mark.parametrize("device_setting", ["same", "cpu"])
def test_ema_every_k_equals_the_closed_form_of_k_compounded_updates(device_setting):
    k, decay, n = 3, 0.9, 13
    weights, applied = trajectory(n), [True] * n
    applied[8] = False  # the last step of the third window is skipped: that window moves by its other 2 decays only
    start, history = updater_run(k, device_setting, weights, applied, decay)
    d = [min(decay, (1 + s) / (10 + s)) for s in range(n)]  # the warm-up of common.ema_update
    expected = start.double()
    for step in range(n):  # after step `step` the count is step + 1; windows [end - k, end) end at multiples of k
        end = step + 1
        if end % k == 0:  # D = the product of the window's per-step decays
            D = math.prod(d[end - k:end - 1]) * (d[end - 1] if applied[end - 1] else 1.0)
            expected = D * expected + (1 - D) * weights[end - 1].double()
        else:  # nothing moves inside a window
            assert torch.equal(history[step], history[step - 1] if step else start), step
        torch.testing.assert_close(history[step].double(), expected, rtol=1e-6, atol=1e-7)


def test_ema_every_k_equals_todays_ema_when_the_weights_hold_over_each_window():
    k, n = 4, 12
    weights = [w for w in trajectory(n // k) for _ in range(k)]  # one w per window [jk, (j + 1) k)
    start, history = updater_run(k, "cpu", weights, [True] * n)
    model, ema = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 3, bias=False).requires_grad_(False)
    with torch.no_grad():
        ema.weight.copy_(start)
    for step, w in enumerate(weights):
        with torch.no_grad():
            model.weight.copy_(w)
        common.ema_update(ema, model, 0.9, step)
        if (step + 1) % k == 0:
            torch.testing.assert_close(history[step], ema.weight, rtol=1e-6, atol=1e-7)
    assert not torch.equal(history[-1], start)


@pytest.mark.parametrize("every,device_setting", [(1, "cpu"), (3, "same"), (3, "cpu")])
def test_an_inherited_ema_gets_no_warm_up_on_every_path(every, device_setting):
    """init_from's EMA tensors (`ema.inherited`) are a long average already: common.ema_update gives them the decay
    from the first step. The updater must too, bitwise for k = 1 (skipped steps included), and within rounding for k
    steps over which the weights hold. An inherited EMA of 5.0 at decay 0.999 then moves 0.05 in 10 steps, not 5."""
    n, decay = 12, 0.999
    weights = [w for w in trajectory(n // every) for _ in range(every)]
    applied = [every > 1 or step != 5 for step in range(n)]  # k = 1: a skipped step included
    runs = []
    for path in ("updater", "today"):
        model = torch.nn.Linear(4, 3)
        ema = copy.deepcopy(model).requires_grad_(False)
        with torch.no_grad():
            ema.weight.fill_(5.0)
            ema.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        ema.inherited = {"weight"}  # the bias is fresh: it warms up
        tr = config.Config(ema_decay=decay, ema_every=every, max_steps=n, ema_device=device_setting)
        update = fit.EMAUpdater(ema, model, None, tr, torch.device("cpu"))
        for step, (w, ok) in enumerate(zip(weights, applied)):
            with torch.no_grad():
                model.weight.copy_(w)
                model.bias.copy_(w[:, 0])
            if path == "updater":
                update(step, torch.tensor(ok))
                update.wait()
            else:
                common.ema_update(ema, model, decay, step, applied=torch.tensor(ok))
        runs.append(dict(ema.named_parameters()))
    assert (runs[1]["weight"] - 5.0).abs().max() < 0.1  # today's EMA keeps the source's average
    for name in ("weight", "bias"):
        if every == 1:
            assert torch.equal(runs[0][name], runs[1][name]), name
        else:
            torch.testing.assert_close(runs[0][name], runs[1][name], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_the_offloaded_ema_waits_for_the_update_in_flight(monkeypatch):
    lerp = fit.EMAUpdater.lerp
    monkeypatch.setattr(fit.EMAUpdater, "lerp", lambda self: time.sleep(0.3) or lerp(self))  # a slow host
    model = torch.nn.Linear(8, 8)
    ema = copy.deepcopy(model).requires_grad_(False)
    update = fit.EMAUpdater(ema, model, None,
                            config.Config(ema_decay=0.5, ema_every=2, max_steps=100, ema_device="cpu"),
                            torch.device("cpu"))
    with torch.no_grad():
        model.weight.fill_(1.0)
    expected = torch.lerp(ema.weight.detach().clone(), model.weight.detach(),
                          1 - fit.decay_at(0.5, 0) * fit.decay_at(0.5, 1))
    update(0, torch.tensor(True))
    update(1, torch.tensor(True))  # an update starts in the background thread
    saved = {k: v.clone() for k, v in ema.state_dict().items()}  # what a checkpoint writes
    assert torch.equal(saved["weight"], expected)  # state_dict joined the update first


# ---- Encoders after the cache stage ------------------------------------------------------------------------------


class Recorder(torch.nn.Module):
    """Records where it is sent; moves nothing (so a CPU machine can stand in for a GPU one)."""

    def __init__(self):
        super().__init__()
        self.moves, self.dtype, self.device = [], torch.float32, torch.device("cpu")  # decode reads dtype and device
        self.config = type("C", (), {"scaling_factor": 0.5, "shift_factor": 0.0})()

    def to(self, *args, **kwargs):
        self.moves.append((str(kwargs.get("device", args[0] if args else None)), kwargs.get("dtype")))
        return self

    def cpu(self):
        return self.to("cpu")

    def decode(self, z):
        return type("Out", (), {"sample": z})()


@pytest.mark.parametrize("cache_text", [True, False])
def test_encoders_leave_the_gpu_after_the_cache_stage_unless_the_text_encoder_encodes_every_step(cache_text):
    vae, text_encoder = Recorder(), Recorder()
    encoders.place_encoders(vae, text_encoder, torch.device("cuda"), encode_each_step=not cache_text)
    assert vae.moves == [("cpu", None)]
    assert text_encoder.moves == ([("cpu", None)] if cache_text else [("cuda", torch.bfloat16)])
    vae.moves.clear()
    encoders.decode(vae, torch.zeros(1, 4, 2, 2), torch.device("cuda"))  # validation decoding: there and back
    assert vae.moves == [("cuda", None), ("cpu", None)]


def test_a_bf16_text_encoder_gives_fp32_features(tiny_text_encoder):
    _, tokenizer, encoder = encoders.load_encoders(config.Config(vae=None, text_encoder=tiny_text_encoder), "cpu")
    reference = encoders.encode_text(tokenizer, encoder, ["a red circle"], 8)
    encoder.to(dtype=torch.bfloat16)
    features = encoders.encode_text(tokenizer, encoder, ["a red circle"], 8)
    assert features["text_tokens"].dtype == features["text_pooled"].dtype == torch.float32  # as the cache serves them
    torch.testing.assert_close(features["text_tokens"], reference["text_tokens"], rtol=0.05, atol=0.05)


# ---- End to end (slow): a run with the probe equals the run configured by hand, bitwise --------------------------


@pytest.mark.slow
def test_an_auto_run_equals_the_run_configured_by_hand_and_resumes_exactly(tmp_path, monkeypatch):
    """global 24 on a GPU that fits 10: micro-batch 8 x accumulation 3, found by the probe. Straight by hand
    (4 steps) vs auto for 2 steps, then resumed to 4 on a 'larger GPU' (no limit): the resumed run keeps its
    recorded choice, and weights, EMA (offloaded, every 3 steps: the resume falls inside a window), optimizer
    state and losses are bitwise the same."""
    from test_robustness import assert_same_checkpoint

    both = ["--log.every=1", "--ckpt.every=2", "--train.ema_device=cpu", "--train.ema_every=3"]
    fm.main(tiny_run_args(tmp_path, "hand", steps=4) + both + ["--train.batch_size=8", "--train.grad_accum=3"])
    from accelerate.state import AcceleratorState
    auto = ["--train.global_batch=24", "--train.batch_size=auto"]
    with monkeypatch.context() as patch:
        oom_above(patch, 10)
        AcceleratorState._reset_state(reset_partial_state=True)
        fm.main(tiny_run_args(tmp_path, "auto", steps=2) + both + auto)
    AcceleratorState._reset_state(reset_partial_state=True)
    fm.main(tiny_run_args(tmp_path, "auto", steps=4) + both + auto + ["--resume=latest"])
    train = json.loads((tmp_path / "auto" / "config.json").read_text())["train"]
    assert (train["batch_size"], train["grad_accum"]) == (8, 3)
    assert_same_checkpoint(tmp_path / "hand", tmp_path / "auto", 4)
    ema2, ema4 = (torch.load(tmp_path / "auto" / "checkpoints" / f"step_0000000{s}" / "state.pt", weights_only=True)
                  for s in (2, 4))
    assert ema2["config"]["train"]["batch_size"] == ema4["config"]["train"]["batch_size"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("method", ["flow_matching", "ddpm"])
def test_the_batch_probe_runs_with_the_post_hoc_ema_profiles_allocated(tmp_path, monkeypatch, method):
    """A GPU that fits 10 samples, only 4 once the post-hoc EMA profiles (ckpt.phema_every > 0: two fp32 copies of
    the weights) are allocated. The probe must measure with them in memory, or the micro-batch it picks (8 of 24)
    runs out of memory at the first step; with them it picks 4 and the run trains."""
    import importlib

    from training.run import phema

    trainer, live, init = importlib.import_module(f"train_{method}"), [], phema.PowerEMA.__init__
    monkeypatch.setattr(phema.PowerEMA, "__init__", lambda self, *args: init(self, *args) or live.append(self))
    oom_above(monkeypatch, lambda: 4 if any(p.profiles for p in live) else 10)
    # Stopped after the first step as by a signal (a checkpoint, exit 75): no validation or export to wait for.
    monkeypatch.setattr(common.StopSignals, "agreed", lambda self, accelerator: bool(live and live[0].images))
    with pytest.raises(SystemExit) as stop:
        trainer.main(tiny_run_args(tmp_path, steps=2) + ["--train.global_batch=24", "--train.batch_size=auto",
                                                         "--ckpt.phema_every=24", "--log.every=1"])
    assert stop.value.code == common.REQUEUE_EXIT_CODE
    assert json.loads((tmp_path / "run" / "fit.json").read_text())["micro_batch"] == 4
    assert live[0].images == 24 and (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()  # it trained


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_two_processes_with_different_limits_agree_on_the_smaller(tmp_path):
    script = tmp_path / "limited.py"
    script.write_text(f"""import os, sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
import pytest, train_flow_matching
from test_fit import oom_above
with pytest.MonkeyPatch.context() as patch:
    oom_above(patch, [16, 6][int(os.environ["RANK"])])  # rank 0 fits 16, rank 1 only 6
    train_flow_matching.main(sys.argv[1:])
""")
    args = tiny_run_args(tmp_path, "two", steps=1) + ["--train.global_batch=32", "--train.batch_size=auto"]
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          str(script), *args], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-3000:]
    assert "fit: rank 0 tried micro-batch 16 fits" in out.stdout
    assert "fit: rank 1 tried micro-batch 16 does not fit, 8 does not fit, 4 fits" in out.stdout
    assert "fit: micro-batch 4 (" in out.stdout and "x 2 processes x 4 accumulation = 32" in out.stdout
    train = json.loads((tmp_path / "two" / "config.json").read_text())["train"]
    assert (train["batch_size"], train["grad_accum"]) == (4, 4)


@pytest.mark.slow
def test_the_sizing_table_applies_the_probes_rule_to_the_memory_model():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sizing

    os.chdir(ROOT)
    rows = sizing.fit_recipe("own_data_256", 1, {"24GB": 24564, "small": 6 * 1024})
    for row in rows:
        for ema in ("ema_gpu", "ema_cpu"):
            r = row[ema]
            assert r["micro"] == 0 or (256 % r["micro"] == 0 and r["accum"] * r["micro"] == 256)
            assert r["micro"] == 0 or r["memory_gib"] <= fit.FIT_MARGIN * row["gib"]
            assert r["on"] >= r["off"] or r["on"] == 0  # checkpointing never fits fewer images
        assert row["ema_cpu"]["static_gib"] == pytest.approx(row["ema_gpu"]["static_gib"] * 16 / 20)
    assert rows[0]["ema_gpu"]["micro"] > rows[1]["ema_gpu"]["micro"]  # a smaller card, a smaller micro-batch
    assert "| own_data_256 | 24GB (24.0 GiB) | 256 (1) |" in sizing.fit_table(rows)
