"""The run's model at its start: built for the data in model space (with REPA's projector when it is on), its fp32
EMA, and its weights: this run's checkpoint to resume, else another run's when init_from names one (a run
folder's newest intact checkpoint, a checkpoint folder, or an export folder; local, or a Hub id). What init_from
does to the tensors (the positional grid resampled, classes mapped by id) is training/model/transfer.py's; the
checkpoint itself is loaded later, once the optimizer exists (checkpoints.load_checkpoint).
"""
import copy
import json
import math
from pathlib import Path

from training.data import buckets, sd3_base
from training.model import lora, mmdit, transfer
from training.objectives import repa
from training.run import checkpoints, hub


def build_for_run(cfg, x_shape, null_text=None):
    """The run's Denoiser for data of shape (channels, size, size) in model space; text runs pass the empty
    prompt's encoding (null_text), which is the dropped condition of guidance and fixes the text dims."""
    text_dims = None if null_text is None else (*null_text["text_tokens"].shape[1:], null_text["text_pooled"].shape[-1])
    model = repa.attach(mmdit.build_denoiser(cfg, x_shape[0], x_shape[-1], text_dims), cfg)  # REPA: its projector
    if null_text is not None:
        for name in ("tokens", "mask", "pooled"):
            getattr(model.conditioner, f"null_{name}").copy_(null_text[f"text_{name}"][0])
    if cfg.train.gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    return model


def prepare_model(cfg, x_shape, null_text, class_ids, run_dir, accelerator):
    """The run's model and its fp32 EMA (also on the GPU), and the checkpoint to resume, if any. Resume (same
    run) continues a checkpoint of run_dir; init_from (a new run) only takes another run's weights, so a
    preempted fine-tuning run resumes its own checkpoint and init_from applies to a fresh start only."""
    model = build_for_run(cfg, x_shape, null_text)
    ema = copy.deepcopy(model).requires_grad_(False).float()
    ema.inherited = set()  # names of EMA tensors init_from takes from another run's EMA (common.ema_update)
    ckpt = checkpoints.find_checkpoint(run_dir, cfg.resume) if cfg.resume else None
    ckpt = checkpoints.same_checkpoint(ckpt, accelerator) if cfg.resume else None
    if cfg.init_from and (ckpt is None or cfg.train.lora_rank):  # LoRA: the base is init_from's at resume too
        report = init_from(cfg.init_from, model, ema, class_ids, cfg.model.pos_embed_transfer, accelerator.print, cfg)
        if accelerator.is_main_process:
            (Path(run_dir) / "init_from.json").write_text(json.dumps(report, indent=1))
        if cfg.train.lora_rank:  # adapters on the frozen base; a resume checks it is the checkpoint's
            model, ema = lora.attach(model, ema, report, cfg.train, accelerator.print)
            if ckpt is not None:
                lora.check_base(model, checkpoints.read_state(ckpt), ckpt)
    return model, ema, ckpt


def read_weights(source):
    """(model state, EMA state, class ids, folder) of an init_from source: a run folder (its newest intact
    checkpoint), a checkpoint folder, or an export folder (whose EMA weights serve as both)."""
    from safetensors.torch import load_file

    if sd3_base.is_base(source):  # a pretrained SD3-family pipeline: its transformer/ alone (not its 10 GB of T5)
        weights = {f"transformer.{k}": v for k, v in sd3_base.transformer_state(source).items()}
        return weights, weights, None, source
    folder = hub.local_folder(source)  # a folder, or the hub id of an exported pipeline folder
    if (folder / "checkpoints").is_dir() and not (folder / "model.safetensors").exists():
        folder = checkpoints.find_checkpoint(folder, "latest") or folder / "checkpoints"
    if checkpoints.checkpoint_ok(folder):  # on the CPU, and never the optimizer
        lora.refuse_adapter_checkpoint(checkpoints.read_state(folder), folder, "init_from")
        return (checkpoints.read_tensors(folder, "model"), checkpoints.read_tensors(folder, "ema"),
                checkpoints.read_state(folder).get("class_ids"), folder)
    if mmdit.conditioner_weights(folder).exists():
        if (folder / "transformer").is_dir():
            state = {k: v for f in sorted((folder / "transformer").glob("*.safetensors"))
                     for k, v in load_file(str(f), device="cpu").items()}
        else:  # an SD3-family base's adapter export holds no copy of its base: the base's own transformer
            state = sd3_base.transformer_state(mmdit.exported_base(folder))
        transformer = lora.fold_exported(state, folder)
        weights = {f"transformer.{k}": v for k, v in transformer.items()}  # LoRA: the adapters folded in
        weights.update({f"conditioner.{k}": v
                        for k, v in load_file(str(mmdit.conditioner_weights(folder)), device="cpu").items()})
        ids = folder / "class_ids.json"
        return weights, weights, json.loads(ids.read_text()) if ids.exists() else None, folder
    raise FileNotFoundError(f"init_from: {source} is not a run folder with an intact checkpoint, a checkpoint "
                            f"(model.safetensors, state.pt) or an export (transformer/, conditioner/)")


def source_config(folder):
    """The config of the run an init_from folder came from: a checkpoint's recorded one, or an export's config.json."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else checkpoints.read_state(folder)["config"]


def squares(source_cfg, cfg, old_grid, new_grid):
    """(old, new): the tokens a side of each run's data.resolution square in its positional grid, which is its
    largest bucket's side with data.buckets (transfer.resample_pos_embed); None when neither run has buckets."""
    if not (source_cfg["data"].get("bucket_shapes") or cfg["data"].get("bucket_shapes")):
        return None
    return tuple(g * c["data"]["resolution"] / buckets.largest_side(c)
                 for c, g in ((source_cfg, old_grid), (cfg, new_grid)))


def init_from(source, model, ema, class_ids=None, pos_embed_mode="resample", log=print, cfg=None):
    """Load another run's weights into `model` and its EMA into `ema` (see adapt_state); log every adapted,
    missing, unexpected and reshaped tensor and return the report. The EMA tensors taken from the source are
    named in `ema.inherited`: they keep averaging from the source's EMA, with no warm-up (common.ema_update).
    `cfg`: this run's config, which with the source's places each run's data.resolution square in its grid."""
    model_state, ema_state, source_ids, folder = read_weights(source)
    grids = [math.isqrt(s["transformer.pos_embed.pos_embed"].shape[1]) for s in (model_state, model.state_dict())]
    pretrained = sd3_base.is_base(source)  # an SD3-family pipeline: no run config, its own grid
    fit = squares(source_config(folder), cfg, *grids) if cfg is not None and not pretrained else None
    reports = []
    for module, state in ((model, model_state), (ema, ema_state)):
        adapted, report = transfer.adapt_state(state, module.state_dict(), source_ids, class_ids, pos_embed_mode, fit)
        module.load_state_dict(adapted)
        reports.append(report)
    ema.inherited = {name for name, _ in ema.named_parameters() if name in reports[1]["taken"]}
    report = {"source": str(folder), **{k: v for k, v in reports[0].items() if k != "taken"}}
    log(f"init_from {folder}: {report['loaded']} tensors loaded (weights and EMA); optimizer, step and data "
        f"position start fresh")
    for kind in ("adapted", "missing", "unexpected", "reshaped"):
        if report[kind]:
            kept = ", kept at fresh init" if kind in ("missing", "reshaped") else ""
            log(f"init_from {kind} ({len(report[kind])}{kept}{', ignored' if kind == 'unexpected' else ''}): "
                + "; ".join(report[kind]))
    return report
