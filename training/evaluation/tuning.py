"""RUN/tuned.json, tools/tune.py's choice of sampling settings, and the model it was chosen for.

A choice holds for one model sampled by one sampler: the step count tuned for Euler is not Heun's, and a
checkpoint named 'latest', or an export written again after more training, is another model. So tuned.json
records what the model is, not how it was named: the SHA-256 of its weight files (an export's transformer and
conditioner, a checkpoint's ema or model file, or its shards), beside where they were, the step and EMA or raw,
and the sampler it was searched with. eval_fid.py and sample.py (tuned_defaults) and the export
(training/sharing/pipeline_export.py) use the choice only for a model whose weights have that digest, with that sampler;
the same checkpoint named by its path or by 'latest' is the same model.
"""
import hashlib
import json
import math
import os
from pathlib import Path

from training.run import checkpoints, hub, sharding

TUNED = ("guidance_scale", "guidance_interval", "steps", "phema_std")  # what tools/tune.py chooses


def digest(root, files):
    """SHA-256 over the files' paths (relative to root) and bytes: the same weights written again hash alike."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def model_identity(run, checkpoint=None, weights="ema"):
    """What the model that eval_fid.py / sample.py sample for `run` (a run folder or an export folder) and
    --checkpoint / --weights is: {"model": its folder ("export", "checkpoints/step_00000040", relative to the run
    where inside it), "step" (None for an export), "weights", "sha256" of its weight files, "sampler": its
    config's val.sampler}. 'latest' is resolved to the checkpoint it names now."""
    run = Path(run)
    if checkpoint is None:
        root = run if (run / "transformer").is_dir() else run / "export"
        files, step, weights = sorted(root.rglob("*.safetensors")), None, "ema"
        cfg = json.loads((root / "config.json").read_text())
    else:
        root = checkpoints.find_checkpoint(run, checkpoint)
        if root is None:
            raise FileNotFoundError(f"no finished checkpoint under {run}/checkpoints")
        shards = root / sharding.SHARDED  # a sharded checkpoint keeps model and EMA in the same files
        files = sorted(f for f in shards.rglob("*") if f.is_file()) if shards.is_dir() else \
            [root / f"{'ema' if weights == 'ema' else 'model'}.safetensors"]
        state = checkpoints.read_state(root)
        cfg, step = state["config"], state["step"]
    try:
        where = str(root.resolve().relative_to(run.resolve()))
    except ValueError:  # a checkpoint named by a path outside the run
        where = str(root)
    return {"model": root.name if where == "." else where, "step": step, "weights": weights,
            "sha256": digest(root, files), "sampler": cfg["val"]["sampler"]}


def describe(model):
    step = "" if model.get("step") is None else f" at step {model['step']:,}"
    return f"{model['model']}{step} ({model['weights']}, weights sha256 {model['sha256'][:12]})"


def read_choice(path, model, sampler):
    """(tuned.json's record, None) when it was chosen for `model` (model_identity) sampled by `sampler`, else
    (None, why not: words that follow the file's name, "was chosen for the euler sampler, not heun")."""
    tuned = json.loads(Path(path).read_text())
    chosen = tuned.get("model") or {}
    if "sha256" not in chosen:
        return None, ("does not say which weights it was chosen for (written before tuned.json recorded them): "
                      "run tools/tune.py again")
    if (chosen["sha256"], chosen["weights"]) != (model["sha256"], model["weights"]):
        return None, f"was chosen for other weights, {describe(chosen)}, not {describe(model)}"
    if tuned["sampler"] != sampler:
        return None, f"was chosen for the {tuned['sampler']} sampler, not {sampler}"
    return tuned, None


def tuned_defaults(args):
    """`args` with RUN/tuned.json's chosen setting ("best", tools/tune.py) in each of TUNED that no flag sets, when
    the file was chosen for the model being sampled, by what it is (its weights' digest, EMA or raw) and the sampler,
    and --untuned is not given; prints where each setting comes from (eval_fid.py and sample.py call it first). A
    run folder that does not exist stops here, before any work (hub.local_folder)."""
    run = hub.local_folder(args.run)  # a folder, or the hub id of an exported pipeline folder
    path, tuned, note = run / "tuned.json", None, ""
    if path.is_file() and not args.untuned:
        model = model_identity(run, args.checkpoint, args.weights)
        tuned, why = read_choice(path, model, args.sampler or model["sampler"])
        note = f" ({path} {why}: its settings are not used)" if why else ""
    where = {}
    for key in TUNED:
        if getattr(args, key) is not None:
            where[key] = f"--{key}"
        elif tuned is not None and tuned["best"][key] is not None:
            setattr(args, key, tuned["best"][key])
            where[key] = str(path)
        else:
            where[key] = "the run's config" if key != "phema_std" else "the model's own EMA"
    if int(os.environ.get("RANK", 0)) == 0:
        print("sampling settings: " + "; ".join(f"{key} {getattr(args, key)} ({where[key]})" if getattr(args, key)
                                                is not None else f"{key} from {where[key]}" for key in TUNED)
              + note)
    return args


def export_choice(run_dir, folder, sampler, phema=None):
    """(record, why not: as read_choice's) of RUN/tuned.json for the weights exported to `folder` (already written
    there): the choice when it was made for them, i.e. for the run's export sampled as it is (no post-hoc EMA
    chosen), or for the export whose post-hoc EMA of the chosen std `phema` reconstructs. The record is the
    folder's own tuned.json: its model is the folder's weights, and 'phema_std' is None in "best" (they are that
    EMA already); "chosen_for" keeps the model it was chosen for. (None, None) where the run has no tuned.json."""
    path = Path(run_dir) / "tuned.json"
    if not path.is_file():
        return None, None
    exported = model_identity(folder)
    tuned, why = read_choice(path, exported if phema is None else model_identity(run_dir), sampler)
    if tuned is None:
        return None, why
    std = tuned["best"]["phema_std"]
    if (std is None) != (phema is None) or (std is not None and not math.isclose(std, phema["phema_std"])):
        chosen = (f"the post-hoc EMA of std {std:g} (tools/phema.py --std {std:g} exports it with these settings)"
                  if std is not None else "the export's own EMA")
        return None, f"chose its settings for {chosen}, not for these weights"
    return {**tuned, "model": exported, "chosen_for": {**tuned["model"], "phema_std": std},
            "best": {**tuned["best"], "phema_std": None}}, None
