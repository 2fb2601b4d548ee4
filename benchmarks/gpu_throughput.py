"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/performance.md.

Training and sampling speed of a recipe's model on one GPU: images/s, achieved TFLOP/s and MFU (model FLOPs
utilisation against the device's dense bf16 peak), with torch.compile and gradient checkpointing on and off,
and peak memory. Self-contained: random weights, synthetic latents and conditions, no dataset, no network.

    python benchmarks/gpu_throughput.py --config configs/imagenet256.json --out docs/gpu_throughput.md

The training step is the trainers' (bf16 autocast, fused AdamW with the device-side non-finite skip, gradient
clipping, fp32 EMA) on the recipe's model at its resolution and per-GPU batch (train.batch_size images in
each of train.grad_accum micro-batches). FLOPs are
counted with torch.utils.flop_counter.FlopCounterMode on one eager step, not guessed; MFU uses the model's
FLOPs (forward + backward), so gradient checkpointing's recomputed forward counts as cost, not as work.
Sampling: 50 Euler steps with classifier-free guidance (two model passes per step) from the EMA model.
Latents are those of an SD-family VAE (8x smaller side, 4 channels; --vae_factor, --latent_channels), text
recipes get CLIP ViT-L/14-shaped features (77 tokens of 768). Extra --key=value arguments override the
recipe (the CPU test runs a tiny model that way). Writes the markdown table to --out and the same as JSON
next to it.
"""
import argparse
import copy
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from training.config import config  # noqa: E402
from training.model.mmdit import build_denoiser, guided  # noqa: E402
from training.optimisation import optimizers  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets (SXM parts; the sparse figures are 2x).
PEAK_BF16_TFLOPS = {"A100": 312.0, "H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0}
TEXT_DIMS = (77, 768, 768)  # CLIP ViT-L/14: tokens, token features, pooled features


def peak_tflops(device):
    """The device's dense bf16 peak, or None (a CPU, or a GPU missing from the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def model_inputs(cfg, batch, device, vae_factor=8, latent_channels=4):
    """Random latents, noise, times and conditions of the recipe's shapes; the text dims (None for classes)."""
    d, text = cfg.data, bool(cfg.encoders.text_encoder)
    channels, side = (latent_channels, d.resolution // vae_factor) if cfg.encoders.vae else (3, d.resolution)
    x0 = torch.randn(batch, channels, side, side, device=device)
    cond = {"drop": torch.rand(batch, device=device) < 0.1, "drop_controls": torch.rand(batch, device=device) < 0.1,
            "orig_hw": torch.full((batch, 2), float(d.resolution), device=device),
            "crop_box": torch.zeros(batch, 4, device=device), "flip": torch.zeros(batch, 1, device=device)}
    if text:
        tokens, width, pooled = TEXT_DIMS
        cond.update(text_tokens=torch.randn(batch, tokens, width, device=device),
                    text_mask=torch.ones(batch, tokens, device=device),
                    text_pooled=torch.randn(batch, pooled, device=device))
    else:
        cond["label"] = torch.randint(0, d.num_classes, (batch,), device=device)
    return x0, cond, (TEXT_DIMS if text else None)


def build(cfg, x0, text_dims, device, checkpointing):
    with torch.device(device):
        model = build_denoiser(cfg, x0.shape[1], x0.shape[-1], text_dims)
    if checkpointing:
        model.transformer.enable_gradient_checkpointing()
    return model


def train_step(model, forward, optimizer, ema, x0, cond, step, bf16, accum=1):
    """One step as the trainers take it: `accum` micro-batches of bf16 autocast forward, fp32 loss and backward,
    then clip, fused AdamW with the device-side non-finite skip, EMA."""
    for _ in range(accum):
        with torch.autocast(x0.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = fm.flow_matching_loss(forward, x0, cond, torch.rand(len(x0), device=x0.device), torch.randn_like(x0))
        (loss.mean() / accum).backward()
    finite = torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizers.skip_update_if_nonfinite(optimizer, finite)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    common.ema_update(ema, model, 0.9999, step, applied=finite)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def measure_training(cfg, x0, cond, text_dims, device, compile, checkpointing, steps, warmup, bf16):
    """Seconds per step and peak memory (GB) of `steps` training steps after `warmup` (compilation happens
    there). Everything it builds is gone when it returns, so the next variant's peak is its own."""
    torch._dynamo.reset()  # compiled graphs hold the previous variant's model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build(cfg, x0, text_dims, device, checkpointing)
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = optimizers.make_optimizer(model, cfg.train)
    forward = torch.compile(model) if compile else model
    for i in range(warmup):
        train_step(model, forward, optimizer, ema, x0, cond, i, bf16, cfg.train.grad_accum)
    synchronize(device)
    start = time.perf_counter()
    for i in range(steps):
        train_step(model, forward, optimizer, ema, x0, cond, warmup + i, bf16, cfg.train.grad_accum)
    synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", default="docs/gpu_throughput.md")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens there)")
    parser.add_argument("--sample_steps", type=int, default=50)
    parser.add_argument("--variants", default="eager,checkpointing,compile,compile+checkpointing")
    parser.add_argument("--budget_s", type=float, default=330, help="variants not started by then are skipped")
    parser.add_argument("--vae_factor", type=int, default=8)
    parser.add_argument("--latent_channels", type=int, default=4)
    args, overrides = parser.parse_known_args(argv)
    started = time.perf_counter()
    cfg = config.load_config(fm.DEFAULTS, ["--config", args.config, *overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as make_accelerator
    bf16 = cfg.train.mixed_precision == "bf16"
    batch, peak = cfg.train.batch_size, peak_tflops(device)
    torch.manual_seed(0)
    x0, cond, text_dims = model_inputs(cfg, batch, device, args.vae_factor, args.latent_channels)

    # FLOPs of one training step (forward + backward) and of one guided sampling step, counted on the model.
    probe = build(cfg, x0, text_dims, device, checkpointing=False)
    params = sum(p.numel() for p in probe.parameters())
    tokens = (x0.shape[-1] // cfg.model.patch_size) ** 2

    def forward_backward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            fm.flow_matching_loss(probe, x0, cond, torch.rand(batch, device=device),
                                  torch.randn_like(x0)).mean().backward()
    train_flops = count_flops(forward_backward)
    guidance = cfg.val.guidance_scale
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        sample_flops = args.sample_steps * count_flops(
            lambda: guided(probe, x0, torch.full((batch,), 500.0, device=device), cond, guidance))
    del probe

    result = {"config": args.config, "overrides": overrides,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else f"CPU ({platform.processor() or platform.machine()})",
              "peak_bf16_tflops": peak, "torch": torch.__version__, "mixed_precision": cfg.train.mixed_precision,
              "parameters_m": params / 1e6, "resolution": cfg.data.resolution, "latent": list(x0.shape[1:]),
              "tokens_per_image": tokens, "batch_per_gpu": batch, "grad_accum": cfg.train.grad_accum,
              "train_step_tflop": train_flops * cfg.train.grad_accum / 1e12,
              "train": [], "sampling": {"steps": args.sample_steps, "guidance_scale": guidance, "batch": batch}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every measurement, so a run cut short still leaves its table
        result["seconds"] = time.perf_counter() - started
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.write_text(markdown(result))

    rows = result["train"]
    for variant in args.variants.split(","):
        row = {"variant": variant}
        if time.perf_counter() - started > args.budget_s:
            rows.append({**row, "error": f"skipped: past the {args.budget_s:g} s budget"})
            continue
        try:
            seconds, memory = measure_training(cfg, x0, cond, text_dims, device, "compile" in variant,
                                               "checkpointing" in variant, args.steps, args.warmup, bf16)
            tflops = train_flops * cfg.train.grad_accum / seconds / 1e12
            row.update(images_per_s=batch * cfg.train.grad_accum / seconds, step_ms=1e3 * seconds, tflops=tflops,
                       mfu=tflops / peak if peak else None, peak_memory_gb=memory)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # OOM or a compile failure: report, go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()

    # Sampling: 50 Euler steps with guidance (eval_fid.py's bf16 autocast), from an fp32 model as the EMA is.
    sampling = result["sampling"]
    torch._dynamo.reset()
    gc.collect()
    try:
        ema = build(cfg, x0, text_dims, device, checkpointing=False).eval()
        run = lambda steps: fm.sample(ema, torch.randn_like(x0), cond, steps, common.shift_of(cfg), guidance)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            run(2)  # warm-up
            synchronize(device)
            start = time.perf_counter()
            run(args.sample_steps)
            synchronize(device)
        seconds = time.perf_counter() - start
        tflops = sample_flops / seconds / 1e12
        sampling.update(images_per_s=batch / seconds, seconds_per_batch=seconds, tflops=tflops,
                        mfu=tflops / peak if peak else None)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        sampling["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"

    save()
    print(markdown(result))
    return result


def markdown(r):
    fmt = lambda v, spec: "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)
    lines = [f"# Throughput: {r['config']} on {r['device']}", "",
             f"{r['parameters_m']:.1f}M parameters, {r['resolution']} px (latent {r['latent']}), "
             f"{r['tokens_per_image']} tokens per image, batch {r['batch_per_gpu']} x {r['grad_accum']} micro-batches "
             f"per GPU, {r['mixed_precision']}; "
             f"one training step = {r['train_step_tflop']:.3g} TFLOP (FlopCounterMode, forward + backward); "
             f"peak {fmt(r['peak_bf16_tflops'], '.0f')} TFLOP/s dense bf16; torch {r['torch']}.", "",
             "| training step | images/s | step (ms) | TFLOP/s | MFU | peak memory (GB) |",
             "|---|---|---|---|---|---|"]
    for row in r["train"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | {row['error']} | | | | |")
        else:
            lines.append(f"| {row['variant']} | {row['images_per_s']:.1f} | {row['step_ms']:.0f} | {row['tflops']:.3g} "
                         f"| {fmt(row['mfu'], '.1%')} | {fmt(row['peak_memory_gb'], '.1f')} |")
    s = r["sampling"]
    lines += ["", f"Sampling ({s['steps']} Euler steps, guidance {s['guidance_scale']:g}: two model passes per step, "
                  f"batch {s['batch']}): " + (s.get("error", "not measured") if "images_per_s" not in s else
                  f"{s['images_per_s']:.2f} images/s ({s['seconds_per_batch']:.1f} s per batch), "
                  f"{s['tflops']:.3g} TFLOP/s, MFU {fmt(s['mfu'], '.1%')}."), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
