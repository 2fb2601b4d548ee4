"""A loop that never waits on the device: zero host-device reads and collectives on an ordinary step (counted
with a dispatch mode on CPU), the non-finite skip decided on the device, and the GPU options (compile,
gradient checkpointing) giving the same results as without them."""
import copy

import pytest
import torch
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode

import common
from training.config import config
from training.optimisation import optimizers
from training.run import monitor, start
from conftest import tiny_run_args


class SyncCounter(TorchDispatchMode):
    """Records every device-to-host read (.item(), bool(), float(), int() all reach aten._local_scalar_dense;
    .tolist(), .numpy(), .cpu() are counted by the test's patches) and every collective, each under the training
    step it happened in (the loop's first call, common.lr_at, marks a step's start)."""

    def __init__(self):
        super().__init__()
        self.step, self.paused, self.events = None, False, {}

    def record(self, what):
        if self.step is not None and not self.paused:
            self.events.setdefault(self.step, []).append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.record("item")
        return func(*args, **(kwargs or {}))


def count_syncs(monkeypatch, counter):
    def counted(name, original):
        def wrapper(*args, **kwargs):
            counter.record(name)
            return original(*args, **kwargs)
        return wrapper

    for name in ("tolist", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for name in ("reduce", "gather", "wait_for_everyone"):
        monkeypatch.setattr(Accelerator, name, counted(name, getattr(Accelerator, name)))
    for name in ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(torch.distributed, name, counted(name, getattr(torch.distributed, name)))
    monkeypatch.setattr(common.StopSignals, "agreed", counted("stop_signal_reduce", common.StopSignals.agreed))
    lr_at = common.lr_at

    def step_start(step, *args, **kwargs):
        counter.step = step
        return lr_at(step, *args, **kwargs)
    monkeypatch.setattr(common, "lr_at", step_start)
    batches = monitor.Monitor.batches

    def host_data(self, loader, device):  # reading host data in the loader is not a device sync (on a GPU it
        inner = batches(self, loader, device)  # runs in the loader's workers); the copy to the device is async
        while True:
            counter.paused = True
            try:
                batch = next(inner)
            finally:
                counter.paused = False
            yield batch
    monkeypatch.setattr(monitor.Monitor, "batches", host_data)


# A sync is a matter of the loop, not of the model's size: two narrow blocks (REPA aligns the second) and a small
# data set keep each run to a few seconds under the counter, which sees every operator.
SMALL = ["--model.num_layers=2", "--model.num_attention_heads=2", "--model.attention_head_dim=16",
         "--data.demo_samples=96", "--data.val_holdout=32", "--val.loss_samples=8"]
STABILITY = ["--train.grad_clip_mode=adaptive", "--train.grad_clip_history=4", "--train.on_divergence=rollback"]


@pytest.mark.parametrize("trainer,extra", [("train_flow_matching", ["--train.grad_accum=2"]),
                                           ("train_ddpm", ["--train.mixed_precision=bf16"]),
                                           pytest.param("train_flow_matching", [  # fit.py: probe, EMA in a thread
                                               "--train.global_batch=16", "--train.batch_size=auto",
                                               "--train.ema_device=cpu", "--train.ema_every=2"],
                                               marks=pytest.mark.slow),
                                           # every stability option on (training/run/stability.py), the noise scale
                                           # measured on the gradient-analysis steps
                                           pytest.param("train_flow_matching", ["--train.grad_accum=2", *STABILITY,
                                                        "--objective.time_sampling=adaptive"], marks=pytest.mark.slow),
                                           pytest.param("train_ddpm", ["--train.grad_accum=2", *STABILITY,
                                                        "--objective.timestep_sampling=adaptive"],
                                                        marks=pytest.mark.slow),
                                           # sharded (training/run/sharding.py), a group of one process
                                           pytest.param("train_flow_matching", ["--train.sharding=fsdp",
                                                        "--train.grad_accum=2", "--ckpt.phema_every=64"],
                                                        marks=pytest.mark.slow),
                                           pytest.param("train_ddpm", ["--train.sharding=fsdp", *STABILITY[:2],
                                                        "--train.mixed_precision=bf16"], marks=pytest.mark.slow)])
def test_ordinary_steps_never_wait_on_the_device(tmp_path, monkeypatch, trainer, extra):
    counter = SyncCounter()
    count_syncs(monkeypatch, counter)
    args = tiny_run_args(tmp_path, steps=8) + ["--train.batch_size=8", "--log.every=4", "--log.grad_every=3",
                                               "--log.report=false", *SMALL, *extra]
    with counter:
        __import__(trainer).main(args)
    # Step s (0-based) ends at optimizer step s + 1: a log step at 4 and 8, gradient analysis at 3 and 6.
    special = [s for s in range(8) if (s + 1) % 4 == 0 or (s + 1) % 3 == 0]
    ordinary = [s for s in range(8) if s not in special]
    assert {s: counter.events.get(s, []) for s in ordinary} == {s: [] for s in ordinary}
    # The counter sees the syncs where they belong: the log steps' all-reduce, reads and stop-signal check.
    assert all(counter.events.get(s) for s in special)
    assert "stop_signal_reduce" in counter.events[3] and "reduce" in counter.events[7]


@pytest.mark.parametrize("trainer,extra", [
    pytest.param("train_flow_matching", ["--objective.repa_targets=on_the_fly", "--objective.repa_projector=conv",
                             "--objective.repa_off_step=5", "--objective.contrastive_weight=0.05",
                             "--objective.prediction=x0"], marks=pytest.mark.slow),
    pytest.param("train_ddpm", ["--train.grad_accum=2"], marks=pytest.mark.slow),  # targets from the cache
    pytest.param("train_flow_matching", ["--objective.meanflow=true", "--objective.prediction=x0",
                                         "--val.sampler=meanflow", "--val.steps=1", "--objective.meanflow_anchor=0.3",
                                         "--objective.meanflow_interval_blocks=1"], marks=pytest.mark.slow)])
def test_ordinary_steps_never_wait_on_the_device_with_the_training_options(tmp_path, monkeypatch, tiny_dino, trainer,
                                                                            extra):
    """REPA (its encoder on the fly in flow matching, switched off at step 5; cached targets in DDPM),
    contrastive flow matching and x-prediction on; and MeanFlow (its JVP, guided target and adaptive weight, the
    flow-matching anchor on a drawn share, the interval in the last block) with REPA and x-prediction: still no sync
    on an ordinary step."""
    repa = ["--objective.repa_weight=0.5", f"--objective.repa_encoder={tiny_dino}", "--objective.repa_block=2",
            "--objective.repa_projector_dim=16"]
    test_ordinary_steps_never_wait_on_the_device(tmp_path, monkeypatch, trainer, repa + extra)


def test_a_nonfinite_step_leaves_weights_ema_and_optimizer_bitwise_unchanged():
    tr = config.Config(lr=1e-2, betas=[0.9, 0.999], weight_decay=0.01)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    ema = copy.deepcopy(model)
    optimizer = optimizers.make_optimizer(model, tr)

    def train_step(step, poison):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        if poison:
            model[1].weight.grad[0, 0] = float("nan")
        finite = torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizers.skip_update_if_nonfinite(optimizer, finite)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        common.ema_update(ema, model, 0.9, step, applied=finite)

    train_step(0, poison=False)
    before = copy.deepcopy((model.state_dict(), ema.state_dict(), optimizer.state_dict()["state"]))
    train_step(1, poison=True)
    after = (model.state_dict(), ema.state_dict(), optimizer.state_dict()["state"])
    for b, a in zip(before[:2], after[:2]):
        assert all(torch.equal(b[k], a[k]) for k in b)
    for i in before[2]:
        assert all(torch.equal(before[2][i][k], after[2][i][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert after[2][0]["step"] == 1  # Adam's step count (its bias correction) did not advance
    train_step(2, poison=False)  # the flag is per step: the next finite step updates everything again
    assert optimizer.state_dict()["state"][0]["step"] == 2
    assert not torch.equal(before[0]["0.weight"], model.state_dict()["0.weight"])
    assert not torch.equal(before[1]["0.weight"], ema.state_dict()["0.weight"])


def tiny_model_and_batch(checkpointing=False, layers=2):
    cfg = config.load_config(__import__("train_flow_matching").DEFAULTS,
                             ["--data.num_classes=9", f"--model.num_layers={layers}", "--model.num_attention_heads=2",
                              "--model.attention_head_dim=16",
                              '--conditioning.controls=["size", "crop", "flip"]',
                              f"--train.gradient_checkpointing={str(checkpointing).lower()}"])
    from training.run.start import build_for_run
    torch.manual_seed(0)
    model = build_for_run(cfg, (3, 16, 16)).train()
    g = torch.Generator().manual_seed(1)
    b = 4
    cond = {"label": torch.randint(0, 9, (b,), generator=g), "drop": torch.tensor([False, True, False, False]),
            "drop_controls": torch.tensor([False, False, True, False]), "orig_hw": torch.rand(b, 2, generator=g) * 64,
            "crop_box": torch.rand(b, 4, generator=g) * 16, "flip": torch.tensor([[0.], [1.], [0.], [1.]])}
    x0, noise = torch.randn(b, 3, 16, 16, generator=g), torch.randn(b, 3, 16, 16, generator=g)
    t = torch.rand(b, generator=g)
    return model, (x0, cond, t, noise)


def loss_and_grads(model, forward, batch):
    import train_flow_matching as fm
    loss = fm.flow_matching_loss(forward, *batch).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_identical_loss_and_gradients():
    """Checkpointing recomputes each block's forward in the backward pass: the same numbers, less memory. The
    conditioner's adaptive-norm addition and the control weights must survive the recompute."""
    plain, batch = tiny_model_and_batch()
    checkpointed, _ = tiny_model_and_batch(checkpointing=True)
    assert checkpointed.transformer.gradient_checkpointing and not plain.transformer.gradient_checkpointing
    loss_a, grads_a = loss_and_grads(plain, plain, batch)
    loss_b, grads_b = loss_and_grads(checkpointed, checkpointed, batch)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


@pytest.mark.slow
def test_compiled_and_checkpointed_model_gives_the_same_loss_and_gradients():
    """torch.compile (train.compile) fuses kernels: the same loss and gradients up to float rounding, also with
    gradient checkpointing inside the compiled graph. One block: inductor's C++ build on a new machine costs
    minutes per block on 2 cores, and every block compiles the same kernels."""
    model, batch = tiny_model_and_batch(layers=1)
    loss_a, grads_a = loss_and_grads(model, model, batch)
    model.transformer.enable_gradient_checkpointing()
    model.zero_grad(set_to_none=True)
    loss_b, grads_b = loss_and_grads(model, torch.compile(model), batch)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.slow
def test_gpu_throughput_benchmark_runs_on_cpu_at_a_tiny_size(tmp_path):
    import json
    import sys

    import conftest
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_throughput

    out, switches = tmp_path / "throughput.md", conftest.tf32_switches()
    result = gpu_throughput.main(["--config", str(ROOT / "configs" / "imagenet256.json"), "--out",
                                  str(out), "--steps=2",
                                  "--warmup=1", "--sample_steps=2", "--variants=eager,checkpointing",
                                  "--model.num_layers=1", "--model.num_attention_heads=2",
                                  "--model.attention_head_dim=16",
                                  "--train.batch_size=2", "--data.resolution=32"])
    conftest.set_tf32_switches(switches)  # the command turns TF32 on for its process, as the trainers do
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(json.dumps(result))
    assert [r["variant"] for r in result["train"]] == ["eager", "checkpointing"]
    assert all(r["images_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None for r in result["train"])
    assert result["tokens_per_image"] == (32 // 8 // 2) ** 2 and result["sampling"]["images_per_s"] > 0
    assert "| eager |" in out.read_text() and "| checkpointing |" in out.read_text()


def training_forward(trainer, text, options=()):
    """(model prepared by accelerate under bf16, the trainer's training forward and loss as a function of its
    inputs, those inputs) for a tiny model with class labels or text, and the size, crop and flip controls.
    `options`: --objective.* arguments; with REPA among them the loss is training_loss with cached targets."""
    import train_ddpm
    import train_flow_matching

    module = {"train_flow_matching": train_flow_matching, "train_ddpm": train_ddpm}[trainer]
    cfg = config.load_config(module.DEFAULTS, ["--data.num_classes=9", "--model.num_layers=2",
                                               "--model.num_attention_heads=2", "--model.attention_head_dim=16",
                                               '--conditioning.controls=["size", "crop", "flip"]', *options])
    from training.model.mmdit import build_denoiser
    from training.objectives import repa
    torch.manual_seed(0)
    model = repa.attach(build_denoiser(cfg, 3, 16, (6, 24, 20) if text else None), cfg).train()
    accelerator = common.make_accelerator("bf16")
    model = accelerator.prepare(model)
    b, g = 4, torch.Generator().manual_seed(1)
    cond = {"drop": torch.tensor([False, True, False, False]),
            "drop_controls": torch.tensor([False, False, True, False]),
            "orig_hw": torch.rand(b, 2, generator=g) * 64, "crop_box": torch.rand(b, 4, generator=g) * 16,
            "flip": torch.tensor([[0.], [1.], [0.], [1.]])}
    if text:
        cond.update(text_tokens=torch.randn(b, 6, 24, generator=g), text_pooled=torch.randn(b, 20, generator=g),
                    text_mask=torch.tensor([[1.] * 3 + [0.] * 3] * b))
    else:
        cond["label"] = torch.randint(0, 9, (b,), generator=g)
    x0, noise = torch.randn(b, 3, 16, 16, generator=g), torch.randn(b, 3, 16, 16, generator=g)
    obj = cfg.objective
    total = lambda loss, terms: loss.sum() + sum(v.sum() for v in terms.values())  # noqa: E731
    align = (torch.randn(b, 64, 16, generator=g), obj.repa_weight) if obj.repa_weight else None
    if trainer == "train_flow_matching" and options:
        inputs = (x0, cond, torch.rand(b, generator=g), noise)
        loss = lambda x0, cond, t, noise: total(*module.training_loss(  # noqa: E731
            model, x0, cond, t, noise, obj.prediction, obj.contrastive_weight, align))
    elif trainer == "train_flow_matching":
        inputs = (x0, cond, torch.rand(b, generator=g), noise)
        loss = lambda x0, cond, t, noise: module.flow_matching_loss(model, x0, cond, t, noise)  # noqa: E731
    elif options:
        schedule, weight, time = (f(cfg).float()
                                  for f in (module.schedule_of, module.loss_weight_of, module.time_input_of))
        inputs = (x0, cond, torch.randint(0, 1000, (b,), generator=g), noise)
        loss = lambda x0, cond, t, noise: total(*module.training_loss(  # noqa: E731
            model, x0, cond, t, noise, schedule, "v", weight, time, align))
    else:
        schedule, weight, time = (f(cfg).float()
                                  for f in (module.schedule_of, module.loss_weight_of, module.time_input_of))
        inputs = (x0, cond, torch.randint(0, 1000, (b,), generator=g), noise)
        loss = lambda x0, cond, t, noise: module.ddpm_loss(model, x0, cond, t, noise, schedule, "v",
                                                           weight, time)  # noqa: E731

    def forward_and_loss(*args):
        with accelerator.autocast():  # as the trainers' loop writes it
            return loss(*args)
    return model, forward_and_loss, inputs


@pytest.mark.slow
@pytest.mark.parametrize("text", [False, True], ids=["class", "text"])
@pytest.mark.parametrize("trainer", ["train_flow_matching", "train_ddpm"])
def test_the_training_forward_compiles_to_one_graph(trainer, text):
    """torch._dynamo.explain over the trainers' training forward and loss (the accelerate-prepared model under
    bf16 autocast, with every condition kind on): zero graph breaks, so train.compile gets one graph."""
    assert_one_graph(*training_forward(trainer, text))


@pytest.mark.slow
@pytest.mark.parametrize("trainer,options", [
    ("train_flow_matching", ["--objective.prediction=x0", "--objective.contrastive_weight=0.05"]),
    ("train_flow_matching", ["--objective.repa_projector=conv"]), ("train_ddpm", ["--objective.repa_projector=mlp"])])
def test_the_training_forward_with_the_options_compiles_to_one_graph(tiny_dino, trainer, options):
    """The same with REPA (the projector's tokens from the same pass), x-prediction and contrastive FM."""
    repa = ["--objective.repa_weight=0.5", f"--objective.repa_encoder={tiny_dino}", "--objective.repa_block=1",
            "--objective.repa_projector_dim=16"]
    assert_one_graph(*training_forward(trainer, False, (repa if "repa" in str(options) else []) + options))


def assert_one_graph(model, forward_and_loss, inputs):
    explained = torch._dynamo.explain(forward_and_loss)(*inputs)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["train_flow_matching", "train_ddpm"])
def test_bf16_reaches_the_denoisers_linear_layers_in_training_validation_and_evaluation(tmp_path, monkeypatch, trainer):
    """Under train.mixed_precision=bf16 every linear layer of the denoiser runs under bf16 autocast and some see
    bf16 inputs (a forward pre-hook records both), in the training step, validation (samples and held-out
    loss), the FID of val.fid_every, and eval_fid.py's and sample.py's sampling of the finished run."""
    import eval_fid
    import sample
    from test_eval_fid import TinyFeatures
    from training.evaluation import sampling

    module, phase, seen = __import__(trainer), ["training"], {}

    def record(layer, inputs):
        bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        seen.setdefault(phase[0], []).append((bf16, inputs[0].dtype))

    def hooked(model):
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_pre_hook(record)
        return model

    prepare_model, pause, load_model = start.prepare_model, monitor.Monitor.pause, sampling.load_model
    monkeypatch.setattr(start, "prepare_model",
                        lambda *a: (lambda m, e, c: (hooked(m), hooked(e), c))(*prepare_model(*a)))

    def named_pause(self, work, step, name=None):  # validation, FID or a checkpoint: its own phase
        phase[0] = (name or "checkpoint").split(" ")[0]
        pause(self, work, step, name)
        phase[0] = "training"
    monkeypatch.setattr(monitor.Monitor, "pause", named_pause)
    monkeypatch.setattr(sampling, "inception_features", lambda *a, **k: TinyFeatures())  # the FID of val.fid_every
    monkeypatch.setattr(sampling, "load_model", lambda *a: (lambda m, c, d: (hooked(m), c, d))(*load_model(*a)))
    weights = tmp_path / "inception.pt"
    weights.write_bytes(b"")
    run = module.main(tiny_run_args(tmp_path, steps=2) + [
        "--train.mixed_precision=bf16", "--val.every=2", "--val.fid_every=2", "--val.fid_samples=4",
        f"--val.inception_weights={weights}", "--log.report=false", '--conditioning.controls=["size", "flip"]'])
    phase[0] = "eval_fid"
    eval_fid.main(["--run", str(run), "--num_samples=2", "--batch_size=2", "--steps=2", "--generate_only"])
    phase[0] = "sample"
    sample.main(["--run", str(run), "--classes=0", "--per_class=1", "--steps=2", "--out", str(tmp_path / "sampled")])
    assert sorted(seen) == ["FID", "eval_fid", "sample", "training", "validation"]
    for name, calls in seen.items():
        assert all(bf16 for bf16, _ in calls), name  # every matmul of the denoiser in bf16
        assert torch.bfloat16 in {dtype for _, dtype in calls}, name


TINY_SD35 = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16, "joint_attention_dim": 32,
             "caption_projection_dim": 32, "pooled_projection_dim": 16, "dual_attention_layers": [0],
             "pos_embed_max_size": 8}


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_at_a_tiny_size(tmp_path):
    """benchmarks/gpu_check.py as the device runs it (a subprocess, TORCH_LOGS read at start-up), on a tiny model:
    both trainers, the sharded row (a group of one) and MeanFlow's, no graph break or recompile, the resumed steps
    bitwise those before, sampling measured; and the SD3.5 LoRA recipe's step on a shrunk SD3.5 Medium config."""
    import json
    import os
    import subprocess
    import sys
    from conftest import ROOT

    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out), "--steps=2",
                          "--warmup=1", "--sample_batch=2", "--compile_backend=aot_eager", f"--tmp={tmp_path}",
                          "--model.num_layers=1", "--model.num_attention_heads=2", "--model.attention_head_dim=16",
                          "--train.batch_size=2", "--data.resolution=32", "--val.steps=2", "--sd35_resolution=32",
                          "--sd35_config", json.dumps(TINY_SD35)],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["trainer"] for r in result["trainers"]] == ["flow_matching", "ddpm", "flow_matching:fsdp",
                                                          "flow_matching:meanflow", "sd35_lora"] and \
        result["peak_bf16_tflops"] is None
    sd35 = result["trainers"].pop()  # configs/sd35_lora_own_data.json's step: batch 4, 77 + 256 text tokens
    assert (sd35["batch_per_gpu"], sd35["context_tokens"], sd35["image_tokens"]) == (4, 333, (32 // 8 // 2) ** 2)
    assert sd35["step_ms"] > 0 and 0 < sd35["adapter_parameters_m"] < sd35["parameters_m"] / 2
    assert "sd35_lora (SD35_MEDIUM, random):" in run.stdout
    for r in result["trainers"]:
        assert r["graph_breaks"] == 0 and r["recompiles"] == 0 and r["graphs"] >= 1, r
        assert r["resume_exact"] and r["losses_before_resume"] == r["losses_after_resume"], r
        assert r["images_per_s"] > 0 and r["tflops"] > 0 and r["sampling_images_per_s"] > 0 and r["mfu"] is None
        assert r["image_tokens"] == (32 // 8 // 2) ** 2 and r["checkpoint_gb"] > 0
    assert "| flow_matching | 0 | 0 |" in run.stdout and "| ddpm | 0 | 0 |" in run.stdout and \
        "| flow_matching:fsdp | 0 | 0 |" in run.stdout and "| flow_matching:meanflow | 0 | 0 |" in run.stdout
    assert result["trainers"][-1]["sampler"] == "meanflow" and result["trainers"][-1]["sampling_steps"] == 1


def test_the_gpu_check_counts_graph_breaks_and_recompiles():
    """The counts the device check prints come from dynamo's own graph_breaks and recompiles logs."""
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    def breaks_once(x, n):
        if n > 0:
            print("a graph break")
        return x * n

    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    try:
        gpu_check.COMPILE_LOGS.clear()
        compiled = torch.compile(breaks_once, backend="eager")
        compiled(torch.ones(3), 1), compiled(torch.ones(3), 2)  # a constant guard fails: a recompile
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert gpu_check.COMPILE_LOGS["graph_breaks"] >= 1 and gpu_check.COMPILE_LOGS["recompiles"] >= 1
