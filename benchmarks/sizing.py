"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/performance.md.

What a paper recipe costs before you rent the GPUs: tokens per image, training FLOPs per image and per
step (counted with torch.utils.flop_counter on the recipe's model, built on the meta device: no memory, no
GPU), A100 GPU-hours for the whole run at a stated MFU, and memory per GPU at the recipe's per-GPU batch.

    python benchmarks/sizing.py [--mfu 0.4] [--gpus 16] [--out docs/sizing.json]
    python benchmarks/sizing.py --gpu_memory [A100-40GB,A100-80GB,H100-80GB,24GB or GiB numbers]
    python benchmarks/sizing.py --sharding [24GB,48GB,A100-80GB or GiB numbers]

Memory per GPU = 20 bytes per parameter (fp32 weights 4, gradients 4, Adam moments 8, fp32 EMA 4) plus the
activations that one step keeps for its backward pass under bf16 autocast, without gradient checkpointing
(activation_bytes). The gradients are counted once: under DDP they are views of its all-reduce buckets
(gradient_as_bucket_view), which the trainers keep by zeroing them in place; set to None, each no_sync backward
would allocate a second copy (4 more bytes per parameter, 5.3 GB for the XL recipes). benchmarks/gpu_throughput.py
and benchmarks/gpu_check.py measure the real peak on a GPU.

--gpu_memory: what train.batch_size="auto" (training/run/fit.py) would choose for each recipe's global batch on
each GPU, by this memory model instead of a probe: the largest divisor of global batch / GPUs whose memory stays
under fit.FIT_MARGIN of the card, without and with gradient checkpointing, with the EMA on the GPU and
offloaded (train.ema_device="cpu": 16 bytes per parameter). Checkpointed activations = what the step saves
with checkpointing on (counted the same way: outside the blocks, and every block's inputs, which the
non-reentrant checkpoint saves for the recompute) + one block's activations (recomputed in backward).

--sharding: train.sharding="ddp" against "fsdp" (fully_shard on every MMDiT block and the root, bf16 parameters
for compute) on 8 and 16 of each card, at the recipe's micro-batch and accumulation: memory per GPU
(memory_per_gpu: DDP's 20 bytes per parameter on every GPU, FSDP's divided by the GPUs plus the gathered blocks
and, while accumulating, an unsharded fp32 gradient), the activations measured again as FSDP computes
(fully_sharded_like: no bf16 weight copies held), which fits, the bytes each GPU sends per step, and the deepest
model at the recipe's width that fits (its parameters).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from training.config import config  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from gpu_throughput import build, count_flops, model_inputs  # noqa: E402
from training.run import fit  # noqa: E402

RECIPES = ["imagenet256", "imagenet512", "imagenet22k_256", "imagenet256_from22k", "imagenet22k_captions_256",
           "cc12m", "cc12m_512", "cc12m_from22k"]
A100_BF16_TFLOPS = 312.0
# Memory as nvidia-smi reports it (MiB); a "24 GB card": RTX 3090 / 4090, A5000, L4 (22.5 GiB: less).
GPU_MIB = {"A100-40GB": 40960, "A100-80GB": 81920, "H100-80GB": 81559, "24GB": 24564,
           "48GB": 49140}  # a "48 GB card": RTX A6000, A40 (L40S: 46068 MiB)
FIT_CARDS = "A100-40GB,A100-80GB,H100-80GB,24GB"  # --gpu_memory's default
SHARDING_CARDS, SHARDING_GPUS = "24GB,48GB,A100-80GB", (8, 16)  # --sharding's
RECIPE_GPUS = {"own_data_256": 1}  # the single-GPU recipe; the others are for 2 nodes x 8 GPUs (--gpus)


def saved_bytes(cfg, blocks, batch, checkpointing=False, sharded=False):
    """Bytes of the distinct tensors a real forward (CPU, full width, bf16 autocast) saves for backward. sharded:
    as under fully_shard with MixedPrecisionPolicy(param_dtype=bf16) (fully_sharded_like)."""
    small = config.load_config(fm.DEFAULTS, ["--config", cfg.config_path, f"--model.num_layers={blocks}", *cfg.extra])
    x0, cond, text_dims = model_inputs(small, batch, torch.device("cpu"))
    model, storages = build(small, x0, text_dims, torch.device("cpu"), checkpointing=checkpointing), {}
    gathered = fully_sharded_like(model) if sharded else set()

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        fm.flow_matching_loss(model, x0, cond, torch.rand(batch), torch.randn_like(x0))
    return sum(n for ptr, n in storages.items() if ptr not in gathered)


def fully_sharded_like(model):
    """Make a model save for backward what fully_shard(MixedPrecisionPolicy(param_dtype=bf16)) on every MMDiT block
    and the root makes it save, without a process group: its parameters in bf16 (the all-gathered copies, so
    autocast makes no bf16 copies of the weights). Returns their storages: FSDP frees a block's gathered copies
    after its forward and gathers them again for its backward, so what backward saves of them is not held (the
    root's stay gathered: memory_per_gpu's transient has them). The policy's cast of each block's and the root's
    floating-point inputs to bf16 changes no bytes saved (autocast casts them anyway), so it is left out.
    tests/test_recipes.py checks the bytes against a real fully_shard on one CPU process."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def linear_model(measure):
    """(fixed, per image) bytes at `layers` blocks, from measure(blocks, batch) at 1 and 2 blocks and 1 and 2
    images, extrapolated linearly (every block and image saves the same; autocast's bf16 weight copies are saved
    once, not per image)."""
    saved = {(n, b): measure(n, b) for n in (1, 2) for b in (1, 2)}
    per_image = [saved[n, 2] - saved[n, 1] for n in (1, 2)]
    fixed = [saved[n, 1] - per_image[n - 1] for n in (1, 2)]
    return fixed, per_image


def activation_bytes(cfg, layers, batch, parts=None):
    """Bytes the autograd graph keeps for backward under bf16 autocast: the distinct tensors that a real forward
    (CPU, full width) saves, at 1 and 2 blocks and 1 and 2 images, extrapolated linearly to `layers` blocks and
    `batch` images. About what a GPU holds at the peak of a step, the gradients' transients aside."""
    fixed, per_image = parts or linear_model(lambda n, b: saved_bytes(cfg, n, b))
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
    parameters = sum(p.numel() for p in model.parameters())
    return flops, parameters, (x0.shape[-1] // cfg.model.patch_size) ** 2, context_tokens


def checkpointed_activation_bytes(cfg, layers, batch, parts, ckpt_parts):
    """With gradient checkpointing: what the step saves, measured with it on (outside the blocks, and each block's
    inputs, which the non-reentrant checkpoint saves for the recompute: bf16 image and context tokens) + one
    block's activations, recomputed in backward (the slope of the measurement without it)."""
    (fixed, per_image), (c_fixed, c_per_image) = parts, ckpt_parts
    at = lambda v: v[0] + (layers - 1) * (v[1] - v[0])
    one_block = (fixed[1] - fixed[0]) + batch * (per_image[1] - per_image[0])
    return at(c_fixed) + batch * at(c_per_image) + one_block


def load_recipe(name, extra=()):
    """configs/<name>.json, with --key=value overrides (`extra`; the tests shrink the model this way)."""
    path = str(Path(__file__).resolve().parents[1] / "configs" / f"{name}.json")
    cfg = config.load_config(fm.DEFAULTS, ["--config", path, *extra])
    if not (cfg.data.num_classes or cfg.encoders.text_encoder):  # own data: the class count is read from it
        extra = ["--data.num_classes=1000", *extra]
        cfg = config.load_config(fm.DEFAULTS, ["--config", path, *extra])
    cfg.config_path, cfg.extra = path, list(extra)
    return cfg


def size_recipe(name, gpus, mfu):
    cfg = load_recipe(name)
    batch = cfg.train.batch_size
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


def fit_recipe(name, gpus, cards):
    """For each card: what train.batch_size="auto" would choose for the recipe's global batch (its per-GPU batch x
    --gpus x its grad_accum), by the memory model, with the EMA on the GPU and offloaded."""
    cfg = load_recipe(name)
    gpus = RECIPE_GPUS.get(name, gpus)
    x0, cond, text_dims = model_inputs(cfg, 1, torch.device("meta"))
    params = sum(p.numel() for p in build(cfg, x0, text_dims, torch.device("meta"), checkpointing=False).parameters())
    parts = linear_model(lambda n, b: saved_bytes(cfg, n, b))
    ckpt_parts = linear_model(lambda n, b: saved_bytes(cfg, n, b, checkpointing=True))
    global_batch = cfg.train.batch_size * gpus * cfg.train.grad_accum
    per_gpu = global_batch // gpus
    layers = cfg.model.num_layers

    def memory(micro, ckpt, ema_on_gpu):
        act = (checkpointed_activation_bytes(cfg, layers, micro, parts, ckpt_parts) if ckpt
               else activation_bytes(cfg, layers, micro, parts))
        return ((20 if ema_on_gpu else 16) * params + act) / 2**30

    rows = []
    for card, mib in cards.items():
        budget = fit.FIT_MARGIN * mib / 1024
        row = {"recipe": name, "gpu": card, "gib": mib / 1024, "gpus": gpus, "global_batch": global_batch}
        for ema, on_gpu in (("ema_gpu", True), ("ema_cpu", False)):
            largest = {ckpt: fit.largest_fitting(fit.divisors(per_gpu), lambda m: memory(m, ckpt, on_gpu) <= budget)
                       for ckpt in (False, True)}
            off, on = largest[False], largest[True]
            if off == per_gpu or (off and on <= off):
                choice, timed = (off, False), False
            elif on:
                choice, timed = ((off, False) if off else (on, True)), bool(off)  # timed: the probe measures both
            else:
                choice, timed = (0, False), False
            micro, ckpt = choice
            row[ema] = {"off": off, "on": on, "micro": micro, "checkpointing": ckpt, "timed": timed,
                        "accum": per_gpu // micro if micro else None,
                        "memory_gib": memory(micro, ckpt, on_gpu) if micro else None,
                        "static_gib": (20 if on_gpu else 16) * params / 2**30}
        rows.append(row)
    return rows


def fit_table(rows):
    def cell(r):
        if not r["micro"]:
            return f"none fits ({r['static_gib']:.0f} GiB before activations)"
        choice = (f"{r['micro']} x {r['accum']}, checkpointing {'on' if r['checkpointing'] else 'off'}, "
                  f"{r['memory_gib']:.0f} GiB")
        alt = f" (timed against {r['on']} with checkpointing)" if r["timed"] else ""
        return choice + alt
    lines = ["| recipe | GPU | global batch (GPUs) | EMA on the GPU: micro x accumulation, checkpointing, memory | "
             "EMA offloaded (train.ema_device=cpu) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['gpu']} ({r['gib']:.1f} GiB) | {r['global_batch']} ({r['gpus']}) "
                     f"| {cell(r['ema_gpu'])} | {cell(r['ema_cpu'])} |")
    return "\n".join(lines)


def memory_per_gpu(params, activations, gpus=1, sharded=False, profiles=0, accumulating=False, block=0, root=0):
    """Bytes on the fullest GPU. DDP: 20 per parameter on every GPU (fp32 weights 4, gradients 4, Adam's moments
    8, EMA 4) and the post-hoc EMA profiles (4 each) on the main process. Sharded (fully_shard on every block and
    the root): all of it divided by the GPUs, plus what is held whole for a while: the bf16 parameters of the
    block computed, of the next one prefetched and of the root (gathered through the step), one block's bf16
    gradient and its fp32 copy for the reduce-scatter (`block`, `root`: their parameter counts); accumulating
    (set_requires_gradient_sync(False) on all but the last micro-batch): an unsharded fp32 gradient of the whole
    model, 4 per parameter on every GPU."""
    if not sharded:
        return (20 + 4 * profiles) * params + activations
    gathered = 2 * (2 * block + root) + (2 + 4) * block
    return (20 + 4 * profiles) * params / gpus + 4 * params * accumulating + gathered + activations


def bytes_sent_per_step(params, gpus, accum, sharded):
    """Bytes each GPU sends per optimizer step, ring collectives: (N - 1) / N of the buffer per all-gather or
    reduce-scatter, twice that per all-reduce. DDP: one all-reduce of the fp32 gradients per step (no_sync on the
    other micro-batches). Sharded: the bf16 parameters all-gathered in every micro-batch's forward and again in
    its backward (the root's, about 1% of them, once: counted twice here), one fp32 reduce-scatter per step."""
    share = (gpus - 1) / gpus
    return ((2 * 2 * accum + 4) if sharded else 2 * 4) * params * share


def deepest(memory, budget):
    """The most blocks L >= 1 with memory(L) <= budget, 0 if none; memory is affine in L (parameters and
    activations both grow by one block's worth per block)."""
    per_block = memory(2) - memory(1)
    depth = max(0, int((budget - (memory(1) - per_block)) // per_block))
    while depth and memory(depth) > budget:  # float rounding at the boundary
        depth -= 1
    while memory(depth + 1) <= budget:
        depth += 1
    return depth


def shard_recipe(name, cards, gpu_counts=SHARDING_GPUS, extra=()):
    """For --gpus in gpu_counts: memory per GPU at the recipe's micro-batch under DDP and fully sharded (with and
    without accumulation, with and without checkpointing), what fits on each card, and the deepest model at the
    recipe's width that fits (its parameters). extra: --key=value overrides of the recipe."""
    cfg = load_recipe(name, extra)
    x0, cond, text_dims = model_inputs(cfg, 1, torch.device("meta"))
    model = build(cfg, x0, text_dims, torch.device("meta"), checkpointing=False)
    count = lambda m: sum(p.numel() for p in m.parameters())
    blocks = [count(b) for b in model.transformer.transformer_blocks]
    params, layers, micro, accum = count(model), cfg.model.num_layers, cfg.train.batch_size, cfg.train.grad_accum
    profiles = len(cfg.ckpt.phema_stds) if cfg.ckpt.phema_every else 0
    measured = {(sharded, ckpt): linear_model(lambda n, b: saved_bytes(cfg, n, b, ckpt, sharded))
                for sharded in (False, True) for ckpt in (False, True)}

    def memory(depth, gpus, sharded, ckpt, accumulating):
        parts = measured[sharded, False]
        act = (checkpointed_activation_bytes(cfg, depth, micro, parts, measured[sharded, True]) if ckpt
               else activation_bytes(cfg, depth, micro, parts))
        return memory_per_gpu(params + (depth - layers) * blocks[0], act, gpus, sharded, profiles, accumulating,
                              max(blocks), params - sum(blocks))

    setups = {"ddp": (False, accum > 1), "fsdp_1": (True, False), "fsdp_k": (True, True)}  # k: accumulating
    rows = []
    for gpus in gpu_counts:
        row = {"recipe": name, "parameters": params, "layers": layers, "micro": micro, "accum": accum, "gpus": gpus,
               "profiles": profiles, "sent_gb": {s: bytes_sent_per_step(params, gpus, accum, s == "fsdp") / 1e9
                                                 for s in ("ddp", "fsdp")},
               "gib": {k: [memory(layers, gpus, v[0], ckpt, v[1]) / 2**30 for ckpt in (False, True)]
                       for k, v in setups.items()}, "cards": {}}
        for card, mib in cards.items():
            budget = fit.FIT_MARGIN * mib * 2**20
            fits = lambda setup: next((("yes", "ckpt")[ckpt] for ckpt in (False, True)
                                       if memory(layers, gpus, setup[0], ckpt, setup[1]) <= budget), "no")
            largest = {k: [params + (d - layers) * blocks[0] if d else 0 for d in
                           (deepest(lambda n: memory(n, gpus, v[0], ckpt, v[1]), budget) for ckpt in (False, True))]
                       for k, v in setups.items()}
            row["cards"][card] = {"gib": mib / 1024, "ddp": fits(setups["ddp"]),
                                  "fsdp": fits(setups["fsdp_k" if accum > 1 else "fsdp_1"]), "largest": largest}
        rows.append(row)
    return rows


def shard_tables(rows):
    """Two markdown tables: memory per GPU and what fits; the largest model per card."""
    cards = list(rows[0]["cards"])
    pair = lambda v: f"{v[0]:.1f} / {v[1]:.1f}"
    mem = ["| recipe (params) | micro-batch x accumulation | GPUs | DDP, GiB (GPU 0): checkpointing off / on "
           "| FSDP, no accumulation | FSDP, accumulating | GB sent per GPU and step: DDP / FSDP | "
           + " | ".join(f"fits {c} ({rows[0]['cards'][c]['gib']:.1f} GiB): DDP, FSDP" for c in cards) + " |",
           "|---|---|---|---|---|---|---|" + "---|" * len(cards)]
    big = ["| recipe | GPUs | " + " | ".join(f"{c}: DDP · FSDP accumulating · FSDP without accumulation"
                                             for c in cards) + " |", "|---|---|" + "---|" * len(cards)]
    bn = lambda v: f"{v[0] / 1e9:.1f} / {v[1] / 1e9:.1f}"
    for r in rows:
        g = r["gib"]
        mem.append(f"| {r['recipe']} ({r['parameters'] / 1e9:.2f}B) | {r['micro']} x {r['accum']} | {r['gpus']} "
                   f"| {pair(g['ddp'])} | {pair(g['fsdp_1'])} | {pair(g['fsdp_k'])} "
                   f"| {r['sent_gb']['ddp']:.1f} / {r['sent_gb']['fsdp']:.1f} | "
                   + " | ".join(f"{r['cards'][c]['ddp']}, {r['cards'][c]['fsdp']}" for c in cards) + " |")
        big.append(f"| {r['recipe']} | {r['gpus']} | " + " | ".join(
            " · ".join(bn(r["cards"][c]["largest"][k]) for k in ("ddp", "fsdp_k", "fsdp_1")) for c in cards) + " |")
    return "\n".join(mem) + "\n\n" + "\n".join(big)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation on A100s")
    parser.add_argument("--gpus", type=int, default=16, help="the recipes' global batch is per-GPU batch x this")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--gpu_memory", nargs="?", const=FIT_CARDS, default=None,
                        help="instead: what train.batch_size=auto would choose on these cards (names of GPU_MIB or "
                             "GiB)")
    parser.add_argument("--sharding", nargs="?", const=SHARDING_CARDS, default=None,
                        help="instead: memory per GPU under DDP and fully sharded on 8 and 16 of these cards, what "
                             "fits, the largest model")
    args = parser.parse_args(argv)
    if args.sharding:
        cards = {c: GPU_MIB[c] if c in GPU_MIB else float(c) * 1024 for c in args.sharding.split(",")}
        rows = [r for name in args.recipes.split(",") for r in shard_recipe(name, cards)]
        print(shard_tables(rows))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return rows
    if args.gpu_memory:
        cards = {c: GPU_MIB[c] if c in GPU_MIB else float(c) * 1024 for c in args.gpu_memory.split(",")}
        rows = [r for name in args.recipes.split(",") for r in fit_recipe(name, args.gpus, cards)]
        print(fit_table(rows))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return rows
    rows = [size_recipe(name, args.gpus, args.mfu) for name in args.recipes.split(",")]
    print(f"| recipe | params | res | tokens / image (image + context) | global batch | steps | TFLOP / image "
          f"| PFLOP / step | A100 GPU-hours at {args.mfu:.0%} MFU | memory / GPU (GB) at its batch: total "
          "(activations) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['parameters_m']:.0f}M | {r['resolution']} | {r['image_tokens']} + "
              f"{r['context_tokens']} | {r['global_batch']} ({r['batch_per_gpu']} / GPU) | {r['steps']:,} | "
              f"{r['tflop_per_image']:.2f} "
              f"| {r['pflop_per_step']:.2f} | {r['a100_gpu_hours']:,.0f} | {r['memory_gb']:.0f} "
              f"({r['activations_gb']:.0f}) |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
