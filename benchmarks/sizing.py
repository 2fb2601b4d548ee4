"""What a paper recipe costs before you rent the GPUs: tokens per image, training FLOPs per image and per
step (counted with torch.utils.flop_counter on the recipe's model, built on the meta device: no memory, no
GPU), A100 GPU-hours for the whole run at a stated MFU, and memory per GPU at the recipe's per-GPU batch.

    python benchmarks/sizing.py [--mfu 0.4] [--gpus 16] [--out docs/sizing.json]

Memory per GPU = 20 bytes per parameter (fp32 weights 4, gradients 4, Adam moments 8, fp32 EMA 4) plus the
activations that one step keeps for its backward pass under bf16 autocast, without gradient checkpointing
(activation_bytes). The gradients are counted once: under DDP they are views of its all-reduce buckets
(gradient_as_bucket_view), which the trainers keep by zeroing them in place; set to None, each no_sync backward
would allocate a second copy (4 more bytes per parameter, 5.3 GB for the XL recipes). benchmarks/gpu_throughput.py
and benchmarks/gpu_check.py measure the real peak on a GPU.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from training import config  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from gpu_throughput import build, count_flops, model_inputs  # noqa: E402

RECIPES = ["imagenet256", "imagenet512", "imagenet22k_256", "imagenet256_from22k", "imagenet22k_captions_256",
           "cc12m", "cc12m_512", "cc12m_from22k"]
A100_BF16_TFLOPS = 312.0


def activation_bytes(cfg, layers, batch):
    """Bytes the autograd graph keeps for backward under bf16 autocast: the distinct tensors that a real forward
    (CPU, full width) saves, at 1 and 2 blocks and 1 and 2 images, extrapolated linearly to `layers` blocks and
    `batch` images (every block and image saves the same; autocast's bf16 weight copies are saved once, not
    per image). About what a GPU holds at the peak of a step, the gradients' transients aside."""
    saved = {}
    for n in (1, 2):
        small = config.load_config(fm.DEFAULTS, ["--config", cfg.config_path, f"--model.num_layers={n}"])
        for b in (1, 2):
            x0, cond, text_dims = model_inputs(small, b, torch.device("cpu"))
            model, storages = build(small, x0, text_dims, torch.device("cpu"), checkpointing=False), {}

            def keep(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16):
                fm.flow_matching_loss(model, x0, cond, torch.rand(b), torch.randn_like(x0))
            saved[n, b] = sum(storages.values())
    per_image = [saved[n, 2] - saved[n, 1] for n in (1, 2)]
    fixed = [saved[n, 1] - per_image[n - 1] for n in (1, 2)]
    at = lambda v: v[0] + (layers - 1) * (v[1] - v[0])  # linear in the number of blocks
    return at(fixed) + batch * at(per_image)


def training_flops_per_image(cfg):
    """(FLOPs of one image's forward and backward, parameters, image tokens, context tokens) of a config's model,
    counted on the meta device (benchmarks/gpu_check.py takes its MFU from here)."""
    x0, cond, text_dims = model_inputs(cfg, 1, torch.device("meta"))
    model = build(cfg, x0, text_dims, torch.device("meta"), checkpointing=False)
    flops = count_flops(lambda: fm.flow_matching_loss(model, x0, cond, torch.rand(1, device="meta"),
                                                      torch.randn_like(x0)).mean().backward())
    context_tokens = text_dims[0] if text_dims else cfg.model.class_tokens  # the MMDiT's second stream
    return flops, sum(p.numel() for p in model.parameters()), (x0.shape[-1] // cfg.model.patch_size) ** 2, context_tokens


def size_recipe(name, gpus, mfu):
    cfg = config.load_config(fm.DEFAULTS, ["--config", f"configs/{name}.json"])
    cfg.config_path, batch = f"configs/{name}.json", cfg.train.batch_size
    flops_per_image, params, image_tokens, context_tokens = training_flops_per_image(cfg)
    global_batch = batch * gpus * cfg.train.grad_accum
    total_flops = flops_per_image * global_batch * cfg.train.max_steps
    activations = activation_bytes(cfg, cfg.model.num_layers, batch)
    return {"recipe": name, "parameters_m": params / 1e6, "resolution": cfg.data.resolution,
            "image_tokens": image_tokens, "context_tokens": context_tokens, "batch_per_gpu": batch,
            "global_batch": global_batch, "steps": cfg.train.max_steps,
            "tflop_per_image": flops_per_image / 1e12, "pflop_per_step": flops_per_image * global_batch / 1e15,
            "a100_gpu_hours": total_flops / (A100_BF16_TFLOPS * 1e12 * mfu) / 3600, "mfu": mfu,
            "memory_gb": (20 * params + activations) / 2**30, "activations_gb": activations / 2**30}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation on A100s")
    parser.add_argument("--gpus", type=int, default=16, help="the recipes' global batch is per-GPU batch x this")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [size_recipe(name, args.gpus, args.mfu) for name in args.recipes.split(",")]
    print(f"| recipe | params | res | tokens / image (image + context) | global batch | steps | TFLOP / image "
          f"| PFLOP / step | A100 GPU-hours at {args.mfu:.0%} MFU | memory / GPU (GB) at its batch: total (activations) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['parameters_m']:.0f}M | {r['resolution']} | {r['image_tokens']} + {r['context_tokens']} "
              f"| {r['global_batch']} ({r['batch_per_gpu']} / GPU) | {r['steps']:,} | {r['tflop_per_image']:.2f} "
              f"| {r['pflop_per_step']:.2f} | {r['a100_gpu_hours']:,.0f} | {r['memory_gb']:.0f} ({r['activations_gb']:.0f}) |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
