"""Checkpoints: a run's RNG state, save (atomic, the last K kept), find (the newest intact one), the intact
check, load, and the every-rank agreement on which one to load; the DDP layout (whole tensors in safetensors
files, written by the main process) and the sharded one (train.sharding="fsdp": every rank writes its shards
through training/run/sharding.py).

A checkpoint folder step_N holds model.safetensors and ema.safetensors (the weights), optimizer.safetensors
(Adam's moments: the largest file, twice the weights), state.pt (the small part: step, config, class ids,
monitor state, fp16's gradient scaler) and rng_{rank}.pt. Every load maps to the CPU: rank 0 saved tensors
tagged cuda:0, so without map_location every rank of a node would put its copy on GPU 0
(optimizer.load_state_dict moves the moments to the parameters' device itself). Checkpoints written before
optimizer.safetensors existed keep the optimizer in state.pt and still load.
"""
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from training.config import config
from training.model import lora
from training.run import sharding

# ----------------------------------------------------------------------------------------------------------
# RNG state: one file per rank.


def rng_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as lists: safe to load with weights_only=True
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(ckpt, rank, world):
    """This rank's RNG state from a checkpoint. A checkpoint written by a different number of processes
    still resumes (weights, EMA, optimizer, step), but not exactly: the data order and noise change."""
    saved = len(list(Path(ckpt).glob("rng_*.pt")))
    if saved != world:
        print(f"warning: {ckpt} was written by {saved} processes and is resumed by {world}: weights, EMA, "
              f"optimizer and step continue, but data order and noise differ from an uninterrupted run")
    if (Path(ckpt) / f"rng_{rank}.pt").exists():
        set_rng_state(torch.load(Path(ckpt) / f"rng_{rank}.pt", weights_only=True, map_location="cpu"))


def set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------------------
# Reading: the small part, the tensors, the optimizer; the intact check and the search for the newest.


def read_state(ckpt):
    """The small part of a checkpoint (step, config, class ids, monitor state), on the CPU, without the
    optimizer (which an older checkpoint keeps in state.pt)."""
    state = torch.load(Path(ckpt) / "state.pt", weights_only=True, map_location="cpu")
    state.pop("optimizer", None)
    return state


def read_tensors(ckpt, name):
    """{key: tensor} of a checkpoint's `name` ("model", "ema", "phema"), whole, on the CPU: from its safetensors
    file, or gathered from a sharded checkpoint's shards (train.sharding="fsdp")."""
    if (Path(ckpt) / sharding.SHARDED).is_dir():
        return sharding.read_whole(ckpt, name)
    return load_file(str(Path(ckpt) / f"{name}.safetensors"), device="cpu")


def read_optimizer_state(ckpt):
    """The optimizer's state dict of a checkpoint, on the CPU: from optimizer.safetensors (moments
    "state.{param}.{name}", param_groups as JSON in its header), or from an older checkpoint's state.pt."""
    path = Path(ckpt) / "optimizer.safetensors"
    if not path.exists():
        return torch.load(Path(ckpt) / "state.pt", weights_only=True, map_location="cpu")["optimizer"]
    state = {}
    with safe_open(str(path), "pt", device="cpu") as f:
        groups = json.loads(f.metadata()["param_groups"])  # JSON made the tuples (betas) lists: back to tuples
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]
        for key in f.keys():
            _, param, name = key.split(".", 2)
            state.setdefault(int(param), {})[name] = f.get_tensor(key)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def optimizer_file(optimizer_state):
    """(tensors, header metadata) of optimizer.safetensors for an optimizer's state dict."""
    tensors = {}
    for param, values in optimizer_state["state"].items():
        for name, value in values.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {param}.{name} is a {type(value).__name__}, not a tensor")
            tensors[f"state.{param}.{name}"] = value.detach().cpu().contiguous()
    return tensors, {"param_groups": json.dumps(optimizer_state["param_groups"])}


def checkpoint_ok(folder):
    """Whether a checkpoint is intact, reading only headers and the small state.pt: every safetensors header
    matches its file's size (safetensors checks it on opening), state.pt unpickles, and the weights, the EMA and
    the optimizer are there. The optimizer's moments are never read here (an older checkpoint's state.pt,
    which holds them, is read whole)."""
    folder = Path(folder)
    try:
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                f.keys()
        state = torch.load(folder / "state.pt", weights_only=True, map_location="cpu")
        # torch.distributed.checkpoint writes .metadata once every shard is written
        if (folder / sharding.SHARDED).is_dir():
            return (folder / "sharded" / ".metadata").is_file()
        return all((folder / f"{name}.safetensors").exists() for name in ("model", "ema")) and \
            ("optimizer" in state or (folder / "optimizer.safetensors").exists())
    except Exception:
        return False


def find_checkpoint(run_dir, resume):
    """`resume` is 'latest' (newest intact checkpoint of this run, or None) or a checkpoint folder. A
    truncated or corrupt newest checkpoint falls back to the previous one, with a warning."""
    if resume != "latest":
        if not checkpoint_ok(resume):
            raise FileNotFoundError(f"resume: no intact checkpoint at {resume} (model.safetensors, ema.safetensors, "
                                    f"optimizer.safetensors, state.pt)")
        return Path(resume)
    for folder in sorted((Path(run_dir) / "checkpoints").glob("step_*"), reverse=True):
        if checkpoint_ok(folder):
            return folder
        print(f"warning: checkpoint {folder} is incomplete or corrupt; falling back to an earlier one")
    return None


# ----------------------------------------------------------------------------------------------------------
# Writing, and loading into a run.


def save_checkpoint(accelerator, run_dir, step, tensors, optimizer, state, keep, model=None):
    """Write checkpoints/step_N atomically: into a temporary folder, renamed when complete; keep the last
    `keep`. `tensors`: {file name: state dict} (model, EMA); `state`: the small part. Every rank calls this
    (each saves its own RNG state); the main process writes the rest. A sharded `model` (train.sharding="fsdp"):
    every rank writes its shards of the tensors and the optimizer into step_N/sharded instead."""
    sharded = model is not None and sharding.is_sharded(model)
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if sharded:  # train.sharding="fsdp": every rank writes its shards (training/run/sharding.py)
        sharding.save(tmp, tensors, model, optimizer)
    if accelerator.is_main_process:
        for name, sd in tensors.items() if not sharded else ():
            save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(tmp / f"{name}.safetensors"))
        if not sharded:
            moments, header = optimizer_file(optimizer.state_dict())
            save_file(moments, str(tmp / "optimizer.safetensors"), metadata=header)
            del moments
        scaler = getattr(accelerator, "scaler", None)  # fp16's loss scale: the same on every rank (all-reduced grads)
        state = {**state, "scaler": scaler.state_dict()} if scaler is not None else state
        torch.save(state, tmp / "state.pt")  # written last: its presence marks a finished checkpoint
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def same_checkpoint(ckpt, accelerator):
    """`ckpt` (or None) once every rank has picked the same (each picks from the file system alone: a shared file
    system slow to show one rank a checkpoint would have the replicas train apart): one all-gather, or an error."""
    picks = gather_object([ckpt and Path(ckpt).name]) if accelerator.num_processes > 1 else []
    if len(set(picks)) > 1:
        raise RuntimeError("the ranks picked different checkpoints to load (" + ", ".join(
            f"rank {r}: {p or 'none'}" for r, p in enumerate(picks)) + "): every rank must see the same checkpoints "
            "folder; on a shared file system, wait until it shows every rank the same files, then rerun")
    return ckpt


def load_checkpoint(ckpt, model, ema, optimizer, accelerator):
    """Resume (and roll back): weights, EMA, optimizer, the fp16 gradient scaler and this rank's RNG from a
    checkpoint; returns its small state (step, ...). The optimizer's CPU copy is dropped once load_state_dict has
    moved it to the parameters' device."""
    same_checkpoint(ckpt, accelerator)  # a rollback's pick, and a resume's again
    if (ckpt / sharding.SHARDED).is_dir() or sharding.is_sharded(model):  # into this run's shards, any process count
        sharding.load(ckpt, model, ema, optimizer)
    else:
        lora.load_state(model, load_file(str(ckpt / "model.safetensors"), device="cpu"))  # LoRA: the adapters
        lora.load_state(ema, load_file(str(ckpt / "ema.safetensors"), device="cpu"))
        optimizer.load_state_dict(read_optimizer_state(ckpt))  # a temporary: nothing keeps it after this line
    state = read_state(ckpt)
    ema.inherited = set(state.get("ema_inherited", ()))  # init_from's EMA tensors: no warm-up (ema_update)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and "scaler" in state:  # fp16: a resume continues the loss scale, a rollback undoes its cuts
        scaler.load_state_dict(state["scaler"])
    restore_rng(ckpt, accelerator.process_index, accelerator.num_processes)
    accelerator.print(f"resumed from {ckpt} at step {state['step']}")
    return state


def save_run(accelerator, step, cfg, model, ema, optimizer, phema, class_ids, *parts):
    """A trainer's checkpoint at `step` in cfg.run_dir (save_checkpoint, the last ckpt.keep kept): the weights, the
    EMA and the post-hoc EMA profiles (phema.checkpoint_tensors); state.pt holds the step, the resolved config (what
    keep_recorded and the tools read back), the class ids, which EMA tensors init_from carried over (no warm-up for
    them after a resume), and each of `parts`' state_dict() (the monitor's statistics, the stability parts')."""
    state = {"step": step, "config": json.loads(json.dumps(cfg)), "class_ids": class_ids,
             "ema_inherited": sorted(ema.inherited), "lora_base_hash": getattr(model, "lora_base_hash", None)}
    for part in parts:
        state.update(part.state_dict())
    tensors = {"model": lora.saved_state(model), "ema": lora.saved_state(ema), **phema.checkpoint_tensors()}
    return save_checkpoint(accelerator, cfg.run_dir, step, tensors, optimizer, state, cfg.ckpt.keep, model)


def load_run(ckpt, model, ema, optimizer, accelerator, phema):
    """A trainer's checkpoint read back, at resume and on a rollback: weights, EMA, optimizer, RNG
    (load_checkpoint), then the post-hoc EMA profiles; returns its state (save_run's)."""
    state = load_checkpoint(ckpt, model, ema, optimizer, accelerator)
    phema.load(ckpt)
    return state


# ----------------------------------------------------------------------------------------------------------
# Resume: the values the run started with.


def keep_recorded(cfg, skip=(), log=print):
    """--resume: the run goes on with the values it started with. Every key that neither a --config file nor the
    command line sets now takes the value of the checkpoint's recorded config (or its value from before the key,
    config.BEFORE_THE_KEY) where today's default differs: a default changed since would otherwise resume another
    model without a word. What is set now wins (a change on purpose); `skip` and config.RESUME_REFILLS: keys the
    trainer resolves itself at every start. Each key taken is printed. Reads only the checkpoint's
    config (memory-mapped state.pt); no checkpoint: nothing."""
    ckpt = find_checkpoint(cfg.run_dir, cfg.resume) if cfg.resume else None
    if ckpt is None:
        return {}
    state = torch.load(Path(ckpt) / "state.pt", mmap=True, weights_only=True, map_location="cpu")  # (not its optimizer)
    then = config.flatten(state["config"])
    taken, kept = {}, {*cfg.explicit, *skip, "resume"}
    for key, now in config.flatten(cfg).items():
        old = json.loads(json.dumps(config.recorded(then, key, now)))  # as recorded (JSON): a tuple, its list equal
        if key in kept or (now is None and key in config.RESUME_REFILLS) or old == json.loads(json.dumps(now)):
            continue
        *sections, leaf = key.split(".")
        section = cfg
        for name in sections:
            section = section[name]
        section[leaf], taken[key] = old, (old, now)
    for key, (old, now) in taken.items() if int(os.environ.get("RANK", 0)) == 0 else ():
        log(f"resume: {key}={config.shown(cfg, key, old)}, as the run started ({ckpt.name}; today's default: "
            f"{config.shown(cfg, key, now)}; set it to change it)")
    return taken
