"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/performance.md.

The one prepared device check: both trainers' step on the imagenet256 recipe's model, on one GPU; and flow
matching's with MeanFlow (objective.meanflow: its JVP through the MMDiT with the math attention backend); and the
row sd35_lora: configs/sd35_lora_own_data.json's step (check_sd35_lora) on SD3.5 Medium's transformer.

    python benchmarks/gpu_check.py --out docs/gpu_check.json    # one H200: about 6 minutes (docs/performance.md)

For each trainer it builds the recipe's model at the recipe's per-GPU batch on random latents of the recipe's
shape (4 x 32 x 32 for 256 px through an SD-family VAE; no VAE, no dataset, nothing to download), compiles it
in place before accelerate prepares it (as the trainers do), and runs the trainers' step as their loop writes it:
micro-batches under no_sync and `accelerator.autocast()` (bf16), backward with the accumulation scale, clip, the
device-side skip, optimizer.step(), zeroing in place, EMA. It prints

  * graph breaks and recompiles: TORCH_LOGS=graph_breaks,recompiles logs each as it happens (set here unless
    already set), and the summary counts them;
  * peak memory of the compiling first step and of the timed steps;
  * images/s and MFU: model FLOPs per image from benchmarks/sizing.py (FlopCounterMode on the meta device)
    against the card's dense bf16 peak (benchmarks/gpu_throughput.py's table), which it names;
  * a checkpoint written and read back with common's own functions, and whether the steps after it give the
    same losses as the steps before it was read (the next step after a resume must be bitwise the same);
  * eval_fid's sampling throughput: sampling.sample_batch from the EMA at the recipe's val sampler, steps and
    guidance, under autocast, as eval_fid.py samples.

sd35_lora: the recipe's LoRA step on SD3.5 Medium's transformer (SD35_MEDIUM: its config; random weights unless the
pipeline is in the Hugging Face cache, whose config is then read; the step's cost does not depend on the weights),
fp32 master weights frozen under bf16 autocast, rank-16 adapters on the attention with fused AdamW, gradient
checkpointing, at the recipe's batch, resolution and 77 + max_tokens text tokens of width 4096 (cached, as the run
reads them: no text encoder on the GPU); the EMA lives on the CPU (train.ema_device) and is not on the GPU. Its peak
memory and step time check docs/performance.md's estimate ("SD3.5 LoRA: memory").

A bare GPU machine without network lacks diffusers (and its importlib_metadata): put their wheels in .whl/
(docs/performance.md has the download command) and this script installs them into /tmp/site before anything
else. Extra --key=value arguments override the recipe; tests/test_performance.py runs a tiny form on CPU.
"""
import argparse
import collections
import copy
import gc
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    os.environ.setdefault("TORCH_LOGS", "graph_breaks,recompiles")  # read when torch is imported


def install_carried_wheels(wheels=ROOT / ".whl", target="/tmp/site"):
    """The packages a bare GPU machine lacks (diffusers; the image has torch, accelerate, transformers,
    safetensors), from the wheels carried in .whl/, without network."""
    if importlib.util.find_spec("diffusers") is not None:
        return
    carried = sorted(str(w) for w in Path(wheels).glob("*.whl"))
    if not carried:
        sys.exit(f"diffusers is not installed and {wheels} holds no wheels: see docs/performance.md, "
                 "'The device check'")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", target, *carried], check=True)
    sys.path.insert(0, target)


install_carried_wheels()

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import gpu_throughput  # noqa: E402
import sizing  # noqa: E402
import train_ddpm  # noqa: E402
import train_flow_matching  # noqa: E402
from training.config import config  # noqa: E402
from training.evaluation import sampling  # noqa: E402
from training.data import sd3_base  # noqa: E402
from training.model import lora  # noqa: E402
from training.model.mmdit import Denoiser, build_denoiser, make_conditioner  # noqa: E402
from training.objectives import meanflow  # noqa: E402
from training.optimisation import optimizers  # noqa: E402
from training.run import checkpoints, sharding  # noqa: E402

TRAINERS = {"flow_matching": train_flow_matching, "ddpm": train_ddpm}
# A row "flow_matching:meanflow": the MeanFlow step (training/objectives/meanflow.py, the paper's defaults) and its
# one-step sampling, unguided at sampling time (the guidance is in the weights).
MEANFLOW = ["--objective.meanflow=true", "--val.sampler=meanflow", "--val.steps=1", "--val.guidance_scale=1"]
SD35 = ROOT / "configs" / "sd35_lora_own_data.json"
# stabilityai/stable-diffusion-3.5-medium's transformer/config.json (MMDiT-X: dual attention in its first 13 blocks)
SD35_MEDIUM = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
               "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
               "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
               "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm"}
COMPILE_LOGS = collections.Counter()  # records of dynamo's graph_breaks and recompiles loggers (TORCH_LOGS)


class CountRecords(logging.Handler):
    def emit(self, record):
        COMPILE_LOGS[record.name.rsplit(".__", 1)[-1]] += 1


for _name in [n for n in logging.Logger.manager.loggerDict if n.endswith(("__graph_breaks", "__recompiles"))]:
    logging.getLogger(_name).addHandler(CountRecords())


def objective(trainer, cfg, device, raw):
    """(time sampler, loss(model, x0, cond, t, noise)) of a trainer, as its loop uses them; MeanFlow's time sampler
    gives (t, r, equal), and its loss adds its terms (the adaptive weight) and makes its target with the bare module
    `raw`."""
    if cfg.objective.get("meanflow"):
        obj, shift = cfg.objective, common.shift_of(cfg)

        def loss_of(model, x0, cond, times, noise):
            loss, terms = meanflow.training_loss(model, raw, x0, cond, *times, noise, obj)
            return loss + sum(terms.values())
        return lambda n: meanflow.sample_times(n, obj, shift, device), loss_of
    if trainer is train_flow_matching:
        shift = common.shift_of(cfg)
        return (lambda n: trainer.sample_time(n, cfg.objective, shift, device),
                lambda model, x0, cond, t, noise: trainer.flow_matching_loss(model, x0, cond, t, noise))
    schedule, weight, time_input = (f(cfg).to(device, torch.float32) for f in
                                    (trainer.schedule_of, trainer.loss_weight_of, trainer.time_input_of))
    return (lambda n: torch.randint(0, cfg.objective.num_timesteps, (n,), device=device),
            lambda model, x0, cond, t, noise: trainer.ddpm_loss(model, x0, cond, t, noise, schedule,
                                                                cfg.objective.prediction, weight, time_input))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def check(name, args, overrides):
    """One trainer's check ("flow_matching:fsdp": sharded, training/run/sharding.py); returns its row of results."""
    trainer, sharded = TRAINERS[name.split(":")[0]], name.endswith(":fsdp")
    meanflow_row = MEANFLOW if name.endswith(":meanflow") else []
    cfg = config.load_config(trainer.DEFAULTS, ["--config", args.config, *overrides, *meanflow_row,
                                                f"--train.sharding={'fsdp' if sharded else 'ddp'}",
                                                "--train.compile=false"])
    tr, row = cfg.train, {"trainer": name}
    accelerator = common.make_accelerator(tr.mixed_precision)
    device = accelerator.device
    torch._dynamo.reset()
    counters.clear()
    COMPILE_LOGS.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    x0, cond, text_dims = gpu_throughput.model_inputs(cfg, tr.batch_size, device, args.vae_factor, args.latent_channels)
    with torch.device(device):
        model = build_denoiser(cfg, x0.shape[1], x0.shape[-1], text_dims).train()
    ema = copy.deepcopy(model).requires_grad_(False).float()
    for module in model.transformer.transformer_blocks if sharded else [model]:  # as the trainers: in place, the
        module.compile(backend=args.compile_backend)  # whole model before DDP wraps it, or each block before sharding
    model, ema = sharding.shard(model, ema, cfg, accelerator)
    optimizer = optimizers.make_optimizer(model, tr)
    model, optimizer = sharding.prepare(model, optimizer, accelerator, tr)
    raw = accelerator.unwrap_model(model)
    sample_time, loss_of = objective(trainer, cfg, device, raw)

    def train_step(step):
        """The trainers' step, in their loop's order (the batch is fixed: random latents of the recipe's shape)."""
        for micro in range(tr.grad_accum):
            noise, t = torch.randn_like(x0), sample_time(len(x0))
            with sharding.no_sync(model, accelerator, skip=micro < tr.grad_accum - 1):
                with accelerator.autocast():
                    loss = loss_of(model, x0, cond, t, noise)
                accelerator.backward(loss.mean() / tr.grad_accum)
        grad_norm = common.full(accelerator.clip_grad_norm_(model.parameters(), tr.grad_clip))
        finite = torch.isfinite(grad_norm)
        optimizers.skip_update_if_nonfinite(optimizer, finite, tr.mixed_precision == "fp16")
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        common.ema_update(ema, raw, tr.ema_decay, step, applied=finite)
        return loss.detach().mean()

    # ---- Compile (the first step), warm-up, then the timed steps ------------------------------------------
    reset_peak(device)
    start = time.perf_counter()
    train_step(0)
    synchronize(device)
    row.update(compile_s=time.perf_counter() - start, first_step_peak_gb=peak_gb(device))
    for i in range(1, 1 + args.warmup):
        train_step(i)
    synchronize(device)
    reset_peak(device)
    start = time.perf_counter()
    for i in range(1 + args.warmup, 1 + args.warmup + args.steps):
        train_step(i)
    synchronize(device)
    seconds = time.perf_counter() - start
    images_per_s = args.steps * tr.batch_size * tr.grad_accum / seconds
    flops_per_image, params, tokens, context = sizing.training_flops_per_image(cfg)
    peak = gpu_throughput.peak_tflops(device)
    row.update(parameters_m=params / 1e6, image_tokens=tokens, context_tokens=context, batch_per_gpu=tr.batch_size,
               grad_accum=tr.grad_accum, timed_steps=args.steps, step_ms=1e3 * seconds / args.steps,
               images_per_s=images_per_s, tflop_per_image=flops_per_image / 1e12,
               tflops=images_per_s * flops_per_image / 1e12, peak_memory_gb=peak_gb(device))
    row["mfu"] = row["tflops"] / peak if peak else None

    # ---- Checkpoint: written, read back; the steps after it must repeat bitwise -----------------------------
    step = 1 + args.warmup + args.steps
    with tempfile.TemporaryDirectory(dir=args.tmp) as run_dir:
        start = time.perf_counter()
        state = {"step": step, "config": json.loads(json.dumps(cfg))}  # the small part; the optimizer has its file
        ckpt = checkpoints.save_checkpoint(accelerator, run_dir, step,
                                           {"model": raw.state_dict(), "ema": ema.state_dict()},
                                      optimizer, state, keep=1, model=raw)
        row["checkpoint_write_s"] = time.perf_counter() - start
        before = [train_step(step).item(), train_step(step + 1).item()]  # the RNG continues from the checkpoint's
        start = time.perf_counter()
        checkpoints.load_checkpoint(ckpt, raw, ema, optimizer, accelerator)  # weights, EMA, optimizer, RNG
        row["checkpoint_read_s"] = time.perf_counter() - start
        after = [train_step(step).item(), train_step(step + 1).item()]
        row["checkpoint_gb"] = sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file()) / 2**30
    row.update(losses_before_resume=before, losses_after_resume=after, resume_exact=before == after,
               resume_max_rel_diff=max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(after, before)))

    # ---- eval_fid's sampling: the EMA, eager, at the recipe's sampler and guidance, under autocast ----------
    ema = sharding.full_copy(ema).eval()  # sharded: gathered whole, as validation and FID do
    sample_cond = lambda idx: {k: v[:len(idx)] for k, v in cond.items()  # noqa
                               if k not in ("drop", "drop_controls")} | {
        "drop": torch.zeros(len(idx), dtype=torch.bool, device=device)}
    batch = list(range(args.sample_batch or tr.batch_size))
    with accelerator.autocast():
        sampling.sample_batch(trainer.generate, ema, cfg, sample_cond, batch, 0, steps=2)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        sampling.sample_batch(trainer.generate, ema, cfg, sample_cond, batch, 0)
        synchronize(device)
    row.update(sampling_images_per_s=len(batch) / (time.perf_counter() - start), sampler=cfg.val.sampler,
               sampling_steps=cfg.val.steps, guidance_scale=cfg.val.guidance_scale)

    # ---- What torch.compile did ---------------------------------------------------------------------------
    logged = "recompiles" in os.environ.get("TORCH_LOGS", "")
    row.update(graph_breaks=sum(counters["graph_break"].values()), graphs=counters["stats"]["unique_graphs"],
               recompiles=COMPILE_LOGS["recompiles"] if logged else None)
    return row


def check_sd35_lora(args):
    """The SD3.5 recipe's step (see the module's docstring): peak GPU memory and step time; `args.sd35_config` shrinks
    the transformer (tests/test_performance.py, on CPU), args.sd35_resolution the images."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    cfg = config.load_config(train_flow_matching.DEFAULTS, ["--config", str(SD35)])
    tr, base = cfg.train, cfg.init_from
    found = sd3_base.is_base(base)  # in the cache: its own config
    transformer_config = {**(sd3_base.transformer_config(base) if found else SD35_MEDIUM),
                          **json.loads(args.sd35_config)}
    accelerator = common.make_accelerator(tr.mixed_precision)
    device = accelerator.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    with torch.device(device):
        transformer = SD3Transformer2DModel.from_config(transformer_config)
        tc = transformer.config
        width, text = tc.num_attention_heads * tc.attention_head_dim, 77 + cfg.encoders.max_tokens
        model = Denoiser(transformer, make_conditioner(cfg, width, tc.joint_attention_dim, tc.pooled_projection_dim,
                                                       text)).train()
    model.transformer.enable_gradient_checkpointing()
    model.requires_grad_(False)  # the frozen base, as lora.attach leaves it
    model.transformer.add_adapter(LoraConfig(r=tr.lora_rank, lora_alpha=tr.lora_alpha or tr.lora_rank,
                                             init_lora_weights="gaussian", target_modules=lora.ATTENTION))
    model.to(device)
    optimizer = optimizers.make_optimizer(model, tr)
    side = (args.sd35_resolution or cfg.data.resolution) // 8  # SD3's VAE: 8x down, 16 channels
    x0 = torch.randn(tr.batch_size, tc.in_channels, side, side, device=device)
    cond = {"drop": torch.rand(tr.batch_size, device=device) < 0.1,
            "text_tokens": torch.randn(tr.batch_size, text, tc.joint_attention_dim, device=device),
            "text_mask": torch.ones(tr.batch_size, text, device=device),
            "text_pooled": torch.randn(tr.batch_size, tc.pooled_projection_dim, device=device)}
    shift = common.shift_of(cfg)

    def train_step():
        with accelerator.autocast():
            t = train_flow_matching.sample_time(len(x0), cfg.objective, shift, device)
            loss = train_flow_matching.flow_matching_loss(model, x0, cond, t, torch.randn_like(x0))
        accelerator.backward(loss.mean())
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], tr.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach().mean()

    train_step()
    synchronize(device)
    reset_peak(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step()
    synchronize(device)
    seconds = time.perf_counter() - start
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainer": "sd35_lora", "weights": "pretrained config" if found else "SD35_MEDIUM, random",
            "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6, "adapter_parameters_m": adapters / 1e6,
            "batch_per_gpu": tr.batch_size, "resolution": side * 8, "image_tokens": (side // tc.patch_size) ** 2,
            "context_tokens": text, "timed_steps": args.steps, "step_ms": 1e3 * seconds / args.steps,
            "images_per_s": args.steps * tr.batch_size / seconds, "peak_memory_gb": peak_gb(device)}


def report(result):
    rows = result["trainers"]
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = [f"gpu_check {result['date']}: {result['config']} on {result['device']} (dense bf16 peak "
             f"{fmt(result['peak_bf16_tflops'], '.0f')} TFLOP/s), torch {result['torch']}, {result['seconds']:.0f} s",
             "| trainer | graph breaks | recompiles | compile (s) | peak GB: first step / timed | images/s | TFLOP/s | "
             "MFU | checkpoint GB, write / read s | resume exact | sampling images/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in [r for r in rows if r["trainer"] != "sd35_lora"]:
        lines.append(f"| {r['trainer']} | {r['graph_breaks']} | {r['recompiles']} | {r['compile_s']:.0f} | "
                     f"{fmt(r['first_step_peak_gb'], '.1f')} / {fmt(r['peak_memory_gb'], '.1f')} | "
                     f"{r['images_per_s']:.1f} | {r['tflops']:.3g} | {fmt(r['mfu'], '.1%')} | "
                     f"{r['checkpoint_gb']:.1f}, {r['checkpoint_write_s']:.0f} / {r['checkpoint_read_s']:.0f} | "
                     f"{r['resume_exact']} | {r['sampling_images_per_s']:.2f} |")
    for r in [r for r in rows if r["trainer"] == "sd35_lora"]:
        lines.append(f"sd35_lora ({r['weights']}): {r['parameters_m']:.0f}M parameters, "
                     f"{r['adapter_parameters_m']:.1f}M in adapters, batch {r['batch_per_gpu']} at {r['resolution']} "
                     f"px ({r['image_tokens']} + {r['context_tokens']} tokens): peak "
                     f"{fmt(r['peak_memory_gb'], '.1f')} GB, {r['step_ms']:.0f} ms a step, {r['images_per_s']:.2f} "
                     f"images/s")
    rows = [r for r in rows if r["trainer"] != "sd35_lora"] or [None]
    r = rows[0]
    if r is None:
        return "\n".join(lines)
    lines.append(f"{r['parameters_m']:.0f}M parameters, {r['image_tokens']} + {r['context_tokens']} tokens, batch "
                 f"{r['batch_per_gpu']} x {r['grad_accum']} micro-batches, {r['tflop_per_image']:.3g} TFLOP per image "
                 f"(sizing.py), {r['timed_steps']} timed steps; sampling: {r['sampler']}, {r['sampling_steps']} steps, "
                 f"guidance {r['guidance_scale']:g}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "imagenet256.json"))
    parser.add_argument("--trainers", default="flow_matching,ddpm,flow_matching:fsdp,flow_matching:meanflow,"
                        "sd35_lora", help="name[:fsdp] (sharded), flow_matching:meanflow, sd35_lora "
                        "(configs/sd35_lora_own_data.json)")
    parser.add_argument("--sd35_config", default="{}", help="sd35_lora: JSON overrides of SD3.5 Medium's transformer "
                        "config (the CPU test's tiny one)")
    parser.add_argument("--sd35_resolution", type=int, default=None, help="sd35_lora: pixels (default: the recipe's)")
    parser.add_argument("--steps", type=int, default=24, help="timed optimizer steps per trainer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling first one")
    parser.add_argument("--sample_batch", type=int, default=None, help="images in the timed sampling batch; "
                        "default: train.batch_size")
    parser.add_argument("--compile_backend", default="inductor", help="the suite's CPU run uses aot_eager "
                        "(inductor's C++ build takes minutes on 2 cores)")
    parser.add_argument("--vae_factor", type=int, default=8)
    parser.add_argument("--latent_channels", type=int, default=4)
    parser.add_argument("--tmp", default=None, help="where the checkpoint is written (21 GB for the XL recipes)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args, overrides = parser.parse_known_args(argv)
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"date": time.strftime("%Y-%m-%d"), "config": Path(args.config).name, "overrides": overrides,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "peak_bf16_tflops": gpu_throughput.peak_tflops(device), "torch": torch.__version__, "trainers": []}
    for name in args.trainers.split(","):
        row = check_sd35_lora(args) if name == "sd35_lora" else check(name, args, overrides)
        result["trainers"].append(row)
        print(json.dumps(result["trainers"][-1]), flush=True)
    result["seconds"] = time.perf_counter() - started
    print(report(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
