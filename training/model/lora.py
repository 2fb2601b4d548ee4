"""LoRA (Hu et al. 2022): a trained model adapted by low-rank adapters, W x + (alpha / r) B A x, B zero at the start,
on a frozen base, through peft as diffusers' train_dreambooth_lora_sd3.py does it (LoraConfig on the transformer's
attention projections, init_lora_weights="gaussian", lora_alpha = rank by default). train.lora_rank > 0 turns it on
for a run started with init_from. What trains: the adapters, and the tensors this run adds that its base lacks
(init_from's missing and reshaped ones, and a class embedding with classes its base lacks: their rows start
fresh), named with their parameter counts at start-up. Everything else is the base, frozen, and hashed:
a checkpoint holds the trained tensors and that hash, and a resume re-reads the base from init_from, checks the hash
and refuses another base with one line. What a LoRA run refuses, and why, is problems().
"""
import copy
import hashlib
from pathlib import Path

import torch

from training.model.transfer import TEXT_BUFFERS

# diffusers' train_dreambooth_lora_sd3.py's default target modules: every attention projection of the joint blocks,
# image and text stream. ADAPTIVE_NORMS: the adaptive-norm modulation (where this project's controls enter, w(t)),
# the documented option for a run whose new condition should reach it (train.lora_targets).
ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
ADAPTIVE_NORMS = ["norm1.linear", "norm1_context.linear", "norm_out.linear"]
# This project's conditioner, named with a "conditioner." prefix: the class tokens (an embedding) and a control's MLP
CONDITIONER = ["conditioner.class_embed", "conditioner.control_mlp.size.0", "conditioner.control_mlp.size.2"]


def problems(cfg):
    """What train.lora_rank > 0 cannot do, each naming its key: its start-up check (handed over by the trainers)."""
    tr, out = cfg["train"], []
    if not tr.get("lora_rank"):
        return out
    rank = tr["lora_rank"]
    if not cfg.get("init_from"):
        out.append(f"train.lora_rank={rank} adapts a trained model: set init_from to a run, checkpoint or export "
                   f"folder (its weights are the frozen base)")
    if tr.get("lora_targets") and all(t.startswith("conditioner.") for t in tr["lora_targets"]):
        out.append(f"train.lora_targets={tr['lora_targets']}: name at least one transformer module (the export's "
                   f"adapter file is the transformer's); lora.ATTENTION lists the default ones")
    if tr.get("optimizer", "adamw") == "muon":
        out.append(f"train.optimizer='muon' with train.lora_rank={rank}: Muon orthogonalises a matrix's update, and "
                   f"an adapter factor's (rank x width) orthogonalised update is not the weight's; use 'adamw' "
                   f"(what peft and diffusers train adapters with)")
    if tr.get("sharding", "ddp") == "fsdp":
        out.append(f"train.sharding='fsdp' with train.lora_rank={rank}: the sharded checkpoint holds whole weights, "
                   f"not adapters and a base hash; use 'ddp' (the frozen base needs no gradients or Adam moments)")
    if cfg.get("ckpt", {}).get("phema_every"):
        out.append(f"ckpt.phema_every > 0 with train.lora_rank={rank}: post-hoc EMA profiles are copies of the whole "
                   f"model; set ckpt.phema_every=0 (the EMA of the adapters, train.ema_decay, works)")
    return out


def base_hash(state, skip=()):
    """sha256 of a state dict's tensors (name, dtype, shape, bytes), in name order, minus `skip` and this run's own
    empty-prompt buffers (they come from this run's text encoder, not from the base)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        if name in skip or name in TEXT_BUFFERS:
            continue
        t = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fresh_keys(report):
    """The state names init_from left at this run's initialisation (missing, reshaped) or filled only in part (a
    class embedding mapped by id): the layers this run adds, which train in full beside the adapters."""
    keys = set(report["missing"]) | {r.split(":")[0] for r in report["reshaped"]}
    return keys | {a.split(":")[0] for a in report["adapted"]
                   if "class_" in a.split(":")[0] and "unmatched (fresh): []" not in a}  # some rows are new


def attach(model, ema, report, tr, log=print):
    """LoRA on `model`'s transformer, on the base init_from loaded. The base is the source's EMA (the weights it
    samples and exports with), loaded into the model first; the returned EMA is a copy of the adapted model, so it
    averages the adapters (and the run's new layers) over an identical frozen base. Sets model.lora_base_hash and
    model.lora_trained (the names a checkpoint holds); returns (model, ema)."""
    from peft import LoraConfig, inject_adapter_in_model

    model.load_state_dict(ema.state_dict())
    fresh = {k for k in fresh_keys(report) if k in dict(model.named_parameters())}
    model.lora_base_hash = base_hash(model.state_dict(), skip=fresh)
    model.requires_grad_(False)
    targets = list(tr.lora_targets) if tr.lora_targets else ATTENTION
    ours = [t.removeprefix("conditioner.") for t in targets if t.startswith("conditioner.")]  # this project's part

    def adapters(modules):
        return LoraConfig(r=tr.lora_rank, lora_alpha=tr.lora_alpha or tr.lora_rank, lora_dropout=tr.lora_dropout,
                          init_lora_weights="gaussian", target_modules=modules)

    model.transformer.add_adapter(adapters([t for t in targets if not t.startswith("conditioner.")]))
    if ours:  # the conditioner is no diffusers model: peft's own injection; its adapters are folded in at export
        inject_adapter_in_model(adapters(ours), model.conditioner)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.replace("base_layer.", "") in fresh)
    trained = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    model.lora_trained = sorted(n for n, _ in trained)
    model.lora_scale = (tr.lora_alpha or tr.lora_rank) / tr.lora_rank  # peft's scaling, alpha / r
    adapters = sum(c for n, c in trained if ".lora_" in n)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    log(f"LoRA rank {tr.lora_rank} (alpha {tr.lora_alpha or tr.lora_rank}, dropout {tr.lora_dropout}) on "
        f"{', '.join(targets)}: {adapters:,} adapter parameters train, {base:,} base parameters frozen "
        f"(sha256 {model.lora_base_hash[:12]})")
    for name, count in trained:
        if ".lora_" not in name:
            log(f"LoRA: this run's own layer trains in full (its base lacks it): {name} ({count:,} parameters)")
    new_ema = copy.deepcopy(model).requires_grad_(False).float()
    new_ema.inherited = set()  # the adapters start fresh: their EMA warms up (common.ema_update)
    return model, new_ema


def check_base(model, recorded, ckpt):
    """A resume's base is the one the checkpoint's adapters were trained on, or the run stops with one line."""
    want = recorded.get("lora_base_hash")
    if want != model.lora_base_hash:
        raise SystemExit(f"resume {ckpt}: its adapters were trained on a base with sha256 {str(want)[:12]}, but "
                         f"init_from now gives {model.lora_base_hash[:12]}: set init_from to the run's original base")


def refuse_adapter_checkpoint(state, ckpt, reader):
    """A LoRA run's checkpoint holds its adapters, not a whole model: what reads whole weights from a checkpoint
    (`reader`) stops with one line pointing to the run's export, which holds the base and the adapters."""
    if state.get("lora_base_hash"):
        raise SystemExit(f"{reader}: {ckpt} is a LoRA run's checkpoint (its adapters alone, on the base "
                         f"{state['config'].get('init_from')}); read the run's export instead")


def saved_state(module):
    """What a checkpoint holds of a model or its EMA: with LoRA the trained tensors only (the base is init_from's,
    checked by its hash), else the whole state dict."""
    state = module.state_dict()
    names = getattr(module, "lora_trained", None)
    return state if names is None else {k: state[k] for k in names}


def load_state(module, state):
    """saved_state read back: the whole state strictly, or with LoRA exactly the trained tensors (nothing else
    the file holds, nothing of them missing)."""
    names = getattr(module, "lora_trained", None)
    if names is None:
        return module.load_state_dict(state)
    if set(state) != set(names):
        raise ValueError(f"LoRA checkpoint: holds {len(state)} tensors, the run trains {len(names)}; different: "
                         f"{sorted(set(state) ^ set(names))[:5]}")
    module.load_state_dict(state, strict=False)


ADAPTERS = "pytorch_lora_weights.safetensors"  # diffusers' LoRA file name (save_lora_weights, load_lora_weights)


def without_adapters(model, merge=True):
    """A copy of an adapted model with the peft layers replaced by plain ones: each adapter folded into its weight,
    W + (alpha / r) B A (peft's merge), or (merge=False) the transformer's dropped, leaving its base (the
    conditioner's, outside diffusers' LoRA format, are folded in either way). Unadapted: the model itself."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if getattr(model, "lora_trained", None) is None:
        return model
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if isinstance(module, BaseTunerLayer):
            if merge or name.startswith("conditioner."):  # the conditioner's adapters: always folded in
                module.merge(safe_merge=True)
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent), child, module.get_base_layer())
    for attr in ("lora_trained", "lora_base_hash", "lora_scale"):
        delattr(out, attr)
    out.transformer.__dict__.pop("peft_config", None)  # a stock diffusers transformer again (save_pretrained)
    out.transformer._hf_peft_config_loaded = False
    return out


def diffusers_adapters(model):
    """The transformer's adapters as diffusers' SD3 LoRA loader reads them (peft's state dict, "transformer." keys
    added by save_lora_weights), with alpha / r folded into B: without adapter metadata diffusers takes alpha = r,
    so the file means the same at any train.lora_alpha."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model.transformer)
    return {k: (v * model.lora_scale if ".lora_B." in k else v).detach().float().cpu().contiguous()
            for k, v in state.items()}


def fold_exported(transformer_state, folder):
    """An export's transformer weights with its adapters (ADAPTERS beside them, diffusers' format) folded in,
    W + B A, so sample.py, eval_fid.py and init_from read the adapted model; without the file, as they are."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTERS
    if not path.is_file():
        return transformer_state
    adapters, out = load_file(str(path), device="cpu"), dict(transformer_state)
    for key, a in adapters.items():
        if ".lora_A." in key:
            module = key.removeprefix("transformer.").split(".lora_A.")[0]
            b = adapters[key.replace(".lora_A.", ".lora_B.")]
            w = out[f"{module}.weight"]
            out[f"{module}.weight"] = (w.double() + b.double() @ a.double()).to(w.dtype)
    return out
