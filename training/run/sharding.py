"""Fully sharded data parallel training (train.sharding="fsdp"), for models whose weights, gradients, Adam
moments and EMA (20 bytes per parameter) do not fit on one GPU beside the activations.

PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`; Zhao et al. 2023, the ZeRO-3 layout of Rajbhandari et
al. 2020): every MMDiT block and the root (embedders, conditioner, final layer, a REPA projector) hold 1/N of
each parameter as a DTensor shard; a block's forward and backward all-gather its weights just in time and free
them after, and the gradients are reduce-scattered, so each GPU keeps and updates only its shard. Everything
else in a run stays what it is under DDP:

  * mixed precision: train.mixed_precision="bf16" computes in bf16 from fp32 master weights (the weights are
    all-gathered in bf16, the gradients reduced in fp32), as DDP's autocast does; "no" is fp32 throughout, and
    a few sharded steps then equal the DDP run's to fp32 tolerance (tests/test_sharding.py).
  * accumulation: the micro-batches before the last skip the reduce-scatter (no_sync), as DDP's skip the
    all-reduce; the price is an unsharded fp32 gradient per GPU while a step accumulates (docs/performance.md).
  * train.compile compiles each block before it is sharded (FSDP's hooks stay outside the compiled graphs);
    gradient checkpointing recomputes a block, all-gather included.
  * the EMA and the post-hoc EMA profiles are sharded exactly like the weights, so every update is elementwise
    on local shards with no communication; every EMA rule (warm-up, inherited tensors, every k steps) is the
    same code as under DDP, applied to the shards (common.local).
  * validation and FID sample from a full fp32 copy of the EMA gathered for the call and freed after (4 bytes
    per parameter on each GPU for that time: sampling needs no collective then, and each rank samples its own
    share as under DDP); the export gathers it into the main process's CPU memory instead.
  * checkpoints are written sharded with torch.distributed.checkpoint (checkpoints/step_N/sharded/: each rank
    writes its shards, in parallel), in the same atomic folder beside state.pt and rng_{rank}.pt; they load on
    any process count, one included.

Refused at start-up (problems): train.batch_size="auto" (its probe tries micro-batches rank by rank, and a sharded
forward is a collective every rank must join), train.ema_device="cpu" (the sharded EMA is already 4 / N bytes per
parameter), fp16 (its gradient scaler is DDP's). The gradient noise scale is not measured sharded (its small
batch is a gradient FSDP never holds whole); the rest of the gradient analysis is.
"""
import contextlib
import copy
import os

import torch
import torch.distributed as dist

import common


def problems(cfg):
    """What train.sharding="fsdp" cannot do, each naming its key: its start-up check (handed to the config loader by
    the trainers: sections.schema)."""
    tr, out = cfg["train"], []
    if tr.get("sharding", "ddp") != "fsdp":
        return out
    if tr["batch_size"] == "auto":
        out.append("train.sharding='fsdp' needs a fixed train.batch_size: 'auto' probes micro-batches rank by rank, "
                   "and a sharded forward is a collective every rank must join (benchmarks/sizing.py sizes it)")
    if tr["ema_device"] == "cpu":
        out.append("train.ema_device='cpu' with train.sharding='fsdp': the sharded EMA is already 4 / processes bytes "
                   "per parameter on each GPU; use train.ema_device='same'")
    if tr["mixed_precision"] == "fp16":
        out.append("train.mixed_precision='fp16' with train.sharding='fsdp': its gradient scaler is DDP's; use 'bf16'")
    return out


def is_sharded(module):
    """Whether `module`'s parameters are sharded (train.sharding="fsdp")."""
    return any(map(common.is_dtensor, module.parameters()))


# ----------------------------------------------------------------------------------------------------------
# Sharding the model and its EMA, and the optimizer around them.


def shard(model, ema, cfg, accelerator):
    """The model and the fp32 EMA on the device with rank 0's weights on every rank (DDP broadcasts the model it
    wraps; the EMA, copied before, gets the same here), then under "fsdp" both sharded block by block (the
    blocks compiled first with train.compile). Returns (model, ema)."""
    tr, device = cfg.train, accelerator.device
    if tr.sharding != "fsdp":
        common.same_on_every_rank(ema.to(device), accelerator)
        return model, ema
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():  # one process: a group of one, so that the same code runs (end_training closes it)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    template = copy.deepcopy(ema).to("meta")  # the unsharded structure full copies are rebuilt in (meta: no memory)
    for module in (model.to(device), ema.to(device)):
        common.same_on_every_rank(module, accelerator)
    mesh = init_device_mesh(device.type, (accelerator.num_processes,))
    # bf16: weights all-gathered in bf16 for compute, gradients reduced in fp32 (DDP's autocast computes in bf16
    # and all-reduces fp32 gradients). The inputs are not cast: autocast decides per op, as under DDP (FSDP's own
    # cast would round the time input 537.3 to 536 in bf16). The EMA samples in fp32, as under DDP.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if tr.mixed_precision == "bf16" else None,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    for module, mp in ((model, policy), (ema, MixedPrecisionPolicy())):
        for block in module.transformer.transformer_blocks:
            if tr.compile and module is model:
                block.compile()  # per block, before sharding: FSDP's all-gather hooks stay outside the graphs
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)
    ema.unsharded = (template,)  # (a tuple: not registered as a submodule)
    return model, ema


def prepare(model, optimizer, accelerator, tr):
    """DDP: the model compiled whole (in place, before DDP wraps it: its state-dict keys unchanged) and wrapped;
    FSDP: the model is already sharded (and its blocks compiled), and accelerate wraps only the optimizer."""
    if tr.sharding == "fsdp":
        return model, accelerator.prepare(optimizer)
    if tr.compile:
        model.compile()
    return accelerator.prepare(model, optimizer)


@contextlib.contextmanager
def no_sync(model, accelerator, skip):
    """A micro-batch's backward without the gradient reduction when `skip` (all but a step's last): DDP's no_sync,
    or FSDP's requires_gradient_sync off (the gradients accumulate unsharded until the last micro-batch)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP
        model.set_requires_gradient_sync(not skip)
        yield
    else:
        with accelerator.no_sync(model) if skip else contextlib.nullcontext():
            yield


# ----------------------------------------------------------------------------------------------------------
# Full copies: for validation and FID (on the device), for the export (on the main process's CPU).


def full_copy(module, to_cpu=False):
    """`module` itself unless sharded; else an unsharded copy with the gathered weights (a collective: every rank
    calls it): on the device on every rank, or with to_cpu in CPU memory on the main process only (None on the
    others), gathered one tensor at a time."""
    if not is_sharded(module):
        return module
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=to_cpu))
    if to_cpu and dist.get_rank() != 0:
        return None
    copy_ = copy.deepcopy(module.unsharded[0])
    copy_.load_state_dict(state, assign=True)  # the gathered tensors become the copy's, no second copy
    for name, buffer in module.named_buffers():  # not sharded, and not all in the state dict (non-persistent)
        owner, _, leaf = name.rpartition(".")
        setattr(copy_.get_submodule(owner), leaf, buffer.cpu() if to_cpu else buffer)
    return copy_.requires_grad_(False)


# ----------------------------------------------------------------------------------------------------------
# Sharded checkpoints: torch.distributed.checkpoint, every rank writing its shards.

SHARDED = "sharded"  # the folder in checkpoints/step_N that holds them


def save(folder, tensors, model, optimizer):
    """Every rank writes its shards of `tensors` ({name: state dict}: model, EMA, post-hoc EMA profiles) and of the
    optimizer's moments (keyed by parameter name, so they load into another process count) into folder/sharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({**tensors, "optimizer": get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer))},
             checkpoint_id=os.path.join(folder, SHARDED))


def load(folder, model, ema, optimizer):
    """The weights, EMA and optimizer of a sharded checkpoint, into this run's shards (any process count)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    state = {"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": get_optimizer_state_dict(model, inner)}
    if not os.path.isdir(os.path.join(folder, SHARDED)):
        raise ValueError(f"{folder} was written by a train.sharding='ddp' run (whole tensors, no sharded/ folder): "
                         f"resume it with train.sharding='ddp'")
    dcp.load(state, checkpoint_id=os.path.join(folder, SHARDED))  # in place, into the shards
    model.load_state_dict(state["model"])
    ema.load_state_dict(state["ema"])
    set_optimizer_state_dict(model, inner, state["optimizer"])


def saved_keys(folder, name):
    """The keys of part `name` ("phema", ...) that a sharded checkpoint holds, read from its metadata alone."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(os.path.join(folder, SHARDED)).read_metadata().state_dict_metadata
    return {key[len(name) + 1:] for key in saved if key.startswith(f"{name}.")}


def load_tensors(folder, tensors):
    """`tensors` ({name: {key: tensor}}, e.g. the post-hoc EMA profiles) loaded in place from a sharded checkpoint;
    False (nothing loaded) when the checkpoint has no `name` (written before that part was on)."""
    import torch.distributed.checkpoint as dcp

    if not all(saved_keys(folder, name) for name in tensors):
        return False
    dcp.load(tensors, checkpoint_id=os.path.join(folder, SHARDED))
    return True


def read_whole(folder, name, keys=None):
    """{key: tensor} of one part ("model", "ema", "phema") of a sharded checkpoint (or only its `keys`), whole and on
    the CPU, in this process alone (no process group): what evaluation, sampling and init_from read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(folder, SHARDED)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    part = {key[len(name) + 1:]: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in saved.items()
            if key.startswith(f"{name}.") and isinstance(meta, TensorStorageMetadata)
            and (keys is None or key[len(name) + 1:] in keys)}
    if not part:
        raise FileNotFoundError(f"{folder} holds no '{name}' tensors")
    dcp.load({name: part}, checkpoint_id=path, no_dist=True)
    return part
