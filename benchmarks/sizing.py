"""What a paper recipe costs before you rent the GPUs: tokens per image, training FLOPs per image and per
step (counted with torch.utils.flop_counter on the recipe's model, built on the meta device: no memory, no
GPU), A100 GPU-hours for the whole run at a stated MFU, and memory per GPU at the recipe's per-GPU batch.

    python benchmarks/sizing.py [--mfu 0.4] [--gpus 16] [--out docs/sizing.json] [--measure]

Memory per GPU = 20 bytes per parameter (fp32 weights 4, gradients 4, Adam moments 8, fp32 EMA 4) plus the
activations of one step. --measure (on a GPU) measures the peak of one real training step (bf16, the
recipe's batch, no checkpointing) for each recipe; without it the activations are scaled from the measured
imagenet256 figure in docs/performance.md (bytes per token in the batch), an estimate.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from gpu_throughput import build, count_flops, model_inputs, train_step  # noqa: E402

RECIPES = ["imagenet256", "imagenet512", "imagenet22k_256", "imagenet256_from22k", "imagenet22k_captions_256",
           "cc12m", "cc12m_512", "cc12m_from22k"]
A100_BF16_TFLOPS = 312.0
ACTIVATION_BYTES_PER_TOKEN = 0.55e6  # measured: imagenet256 on an H200, bf16, no checkpointing (performance.md)


def size_recipe(name, gpus, mfu, measure):
    cfg = common.load_config(fm.DEFAULTS, ["--config", f"configs/{name}.json"])
    batch = cfg.train.batch_size
    x0, cond, text_dims = model_inputs(cfg, 1, torch.device("meta"))
    model = build(cfg, x0, text_dims, torch.device("meta"), checkpointing=False)
    params = sum(p.numel() for p in model.parameters())
    image_tokens = (x0.shape[-1] // cfg.model.patch_size) ** 2
    context_tokens = text_dims[0] if text_dims else cfg.model.class_tokens  # the MMDiT's second stream
    flops_per_image = count_flops(lambda: fm.flow_matching_loss(model, x0, cond, torch.rand(1, device="meta"),
                                                                torch.randn_like(x0)).mean().backward())
    global_batch = batch * gpus * cfg.train.grad_accum
    total_flops = flops_per_image * global_batch * cfg.train.max_steps
    tokens_in_batch = batch * (image_tokens + context_tokens)
    activations, how = tokens_in_batch * ACTIVATION_BYTES_PER_TOKEN, "estimated"
    if measure and torch.cuda.is_available():
        activations, how = measured_activations(cfg, batch, params), "measured"
    return {"recipe": name, "parameters_m": params / 1e6, "resolution": cfg.data.resolution,
            "image_tokens": image_tokens, "context_tokens": context_tokens, "batch_per_gpu": batch,
            "global_batch": global_batch, "steps": cfg.train.max_steps,
            "tflop_per_image": flops_per_image / 1e12, "pflop_per_step": flops_per_image * global_batch / 1e15,
            "a100_gpu_hours": total_flops / (A100_BF16_TFLOPS * 1e12 * mfu) / 3600, "mfu": mfu,
            "memory_gb": (20 * params + activations) / 2**30, "activations_gb": activations / 2**30,
            "activations": how}


def measured_activations(cfg, batch, params):
    """Peak memory of a real training step minus the 20 bytes per parameter that are not activations."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    x0, cond, text_dims = model_inputs(cfg, batch, device)
    model = build(cfg, x0, text_dims, device, checkpointing=False)
    ema, optimizer = build(cfg, x0, text_dims, device, checkpointing=False).requires_grad_(False), common.make_optimizer(model, cfg.train)
    try:
        for step in range(2):  # the second step has the optimizer's moments allocated
            train_step(model, model, optimizer, ema, x0, cond, step, cfg.train.mixed_precision == "bf16")
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - 20 * params
    except torch.cuda.OutOfMemoryError:
        return float("inf")
    finally:
        del model, ema, optimizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation on A100s")
    parser.add_argument("--gpus", type=int, default=16, help="the recipes' global batch is per-GPU batch x this")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [size_recipe(name, args.gpus, args.mfu, args.measure) for name in args.recipes.split(",")]
    print(f"| recipe | params | res | tokens / image (image + context) | global batch | steps | TFLOP / image "
          f"| PFLOP / step | A100 GPU-hours at {args.mfu:.0%} MFU | memory / GPU (GB) at its batch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['parameters_m']:.0f}M | {r['resolution']} | {r['image_tokens']} + {r['context_tokens']} "
              f"| {r['global_batch']} ({r['batch_per_gpu']} / GPU) | {r['steps']:,} | {r['tflop_per_image']:.2f} "
              f"| {r['pflop_per_step']:.2f} | {r['a100_gpu_hours']:,.0f} | {r['memory_gb']:.0f} ({r['activations']}) |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
