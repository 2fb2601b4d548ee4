"""The export of a trained model as a diffusers pipeline folder, which anyone with diffusers loads and samples:

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained("runs/flow_matching_demo/export", trust_remote_code=True)
    pipe("red circle").images[0]

The folder (docs/evaluation.md, Sharing a model):
    model_index.json        the pipeline: its class (pipeline.py), components, the sampling defaults (the run's
                            settings, or tools/tune.py's choice for these weights: training/evaluation/tuning.py),
                            and a VAE or text encoder named by hub id (vae_id, text_encoder_id: referenced, not copied)
    vae/                    the VAE, when encoders.vae is a local folder (an autoencoder made by tools/autoencoder.py,
                            with its autoencoder.json): copied, a component the pipeline loads, since the folder
                            it was trained with is not where the export goes; a hub VAE stays a reference
    text_encoder/,          the text encoder and its tokenizer, when encoders.text_encoder is a local folder (a CLIP
    tokenizer/              made by tools/clip.py, a copy of a hub model): saved as the classes the trainer loaded them
                            as (training/data/encoders.py: a CLIP folder's text tower alone), components the pipeline
                            loads; the export then samples where that folder is gone. A hub id stays a reference
    (SD3 base)              a run whose init_from is a pretrained SD3-family pipeline (training/data/sd3_base.py)
                            references it: vae_id and text_encoder_id name it (vae_subfolder, sd3_text_encoders:
                            which of its text encoders), never copied; a LoRA run's export holds no transformer/
                            either but its adapters and transformer_id, the base (train.lora_merged_export: the
                            merged transformer/ instead)
    pipeline.py             the sampling code (training/sharing/exported/pipeline.py): diffusers loads it for
                            custom pipelines
    transformer/            diffusers' SD3Transformer2DModel (also loadable on its own with from_pretrained)
    conditioner/            the conditioner as a diffusers ModelMixin: conditioner.py (training/sharing/exported/), its
                            config (classes and their names, controls, mode) and weights
    scheduler/              the sampler's schedule: FlowMatchEulerDiscreteScheduler on the run's shift (flow
                            matching); DDIMScheduler or DDPMScheduler with the run's betas, zero terminal SNR and
                            prediction type (DDPM)
    README.md, samples.png  the model card (training/sharing/model_card.py) and the run's last validation grid
    tuned.json              where tools/tune.py chose the sampling defaults for these weights: its record
    config.json             the run's resolved config: what this repository's tools (sample.py, eval_fid.py,
                            init_from) read besides the weights
    class_ids.json          the class ids, for init_from's mapping of classes between runs
    phema.json              for a post-hoc EMA export (tools/phema.py): its reconstruction
    lora.json               for a LoRA run (train.lora_rank): its adapters' and own layers' parameter counts and the
                            base's hash, which the card states (kept by a re-export, whose model is merged)
Nothing from this repository is needed to load it: the two files of training/sharing/exported/ import torch,
diffusers and (a text model) transformers only. A re-export (tools/export.py, tools/phema.py) reads the model back
with load_exported, which points the config at the old export's copies: write carries those, and config.json and the
card keep the names the run gave (as_trained).
"""
import json
import shutil
from pathlib import Path

import diffusers
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler

import common
from training.config import config
from training.data import latents, sd3_base
from training.data.encoders import load_encoders, quiet_transformers
from training.data.classes import readable_names
from training.model import lora
from training.run import hub
from training.evaluation import tuning
from training.objectives import meanflow
from training.record import curves
from training.sharing import model_card
from training.sharing.exported.conditioner import Conditioner as ExportedConditioner

SOURCES = Path(__file__).resolve().parent / "exported"  # the files copied into every folder
BETAS = {"quadratic": "scaled_linear", "linear": "linear", "cosine": "squaredcos_cap_v2"}  # ours -> diffusers'
PREDICTION = {"v": "v_prediction", "eps": "epsilon", "x0": "sample"}


def make_scheduler(cfg):
    """The diffusers scheduler that steps as the run's sampler does (train_*.sample): flow matching's Euler on
    the time shift a (the pipeline passes sigmas = linspace(1, 0, steps + 1)[:-1], the trainer's grid); DDPM's
    trailing timesteps on the run's betas, rescaled to zero terminal SNR, never clipped. DDPM's resolution
    shift, which diffusers' schedulers lack, is the pipeline's time_shift, and its grid the trainer's exact one at
    any step count (pipeline.trailing_timesteps: DDPMScheduler's custom timesteps; DDIM by the pipeline's own
    ddim_step, as DDIMScheduler.step goes back T // steps)."""
    obj = cfg["objective"]
    if curves.method_of(cfg) == "flow_matching":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=common.shift_of(cfg))
    scheduler = DDIMScheduler if cfg["val"]["sampler"] == "ddim" else DDPMScheduler
    extra = {"set_alpha_to_one": True} if scheduler is DDIMScheduler else {"variance_type": "fixed_small"}
    return scheduler(num_train_timesteps=obj["num_timesteps"], beta_schedule=BETAS[obj["beta_schedule"]],
                     beta_start=obj["beta_start"], beta_end=obj["beta_end"],
                     prediction_type=PREDICTION[obj["prediction"]],
                     rescale_betas_zero_snr=obj["zero_terminal_snr"], timestep_spacing="trailing", clip_sample=False,
                     **extra)


def exported_conditioner(conditioner, transformer, class_ids):
    """The trained conditioner as the exported ModelMixin, its weights loaded one to one (strict)."""
    tc = transformer.config
    names = readable_names(class_ids) if class_ids else [f"class {k}" for k in range(conditioner.num_classes)]
    out = ExportedConditioner(
        num_classes=conditioner.num_classes, class_tokens=conditioner.class_tokens, context_dim=tc.joint_attention_dim,
        pooled_dim=conditioner.pooled_dim, width=tc.num_attention_heads * tc.attention_head_dim,
        text_tokens=len(getattr(conditioner, "null_tokens", ())), controls=conditioner.controls, mode=conditioner.mode,
        replicate_padding=conditioner.padding_noise is not None, pooled_text=conditioner.pooled_text,
        class_ids=class_ids, class_names=names if conditioner.num_classes else None,
        interval=conditioner.interval_embed is not None, interval_blocks=conditioner.interval_blocks,
        zero_padding=conditioner.zero_padding)
    out.load_state_dict({k: v.detach().float().cpu() for k, v in conditioner.state_dict().items()})
    return out


def carried(cfg, key):
    """The folder of the run's encoders.vae or .text_encoder when it travels with the export (a local folder), else
    None (pixels, class labels, a hub id). A name that can only be a path (absolute, ~, ./) and is no folder here is
    refused in one line: the export would name a folder its users do not have."""
    name = cfg["encoders"][key]
    if not name or sd3_base.is_base(name):  # an SD3-family pipeline: referenced, never copied (its T5 is 9 GB)
        return None
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    if name.startswith(("/", "~", ".")):
        raise SystemExit(f"encoders.{key}={name!r} is no folder here, so the export cannot carry it: put the folder "
                         f"back (or re-export from an export that holds {key}/)")
    return None


def as_trained(cfg):
    """cfg with the encoders named as the run named them. load_exported (a re-export: tools/export.py, tools/phema.py)
    points a carried VAE or text encoder at the old export's copy (EXPORT/vae, EXPORT/text_encoder); that export's
    config.json still holds the run's own name, which the new config.json and the card keep."""
    enc = dict(cfg["encoders"])
    for key in ("vae", "text_encoder"):  # each carried in the export's folder of the same name
        copy = Path(enc[key]) if enc[key] else None
        if copy and copy.name == key and (copy.parent / "model_index.json").is_file():
            enc[key] = json.loads((copy.parent / "config.json").read_text())["encoders"][key]
    return {**cfg, "encoders": enc}


def copy_vae(source, folder):
    """The VAE's config, weights and (an autoencoder made here) its record into `folder`: what from_pretrained
    reads and the model card cites, nothing else the folder may hold."""
    folder.mkdir()
    for name in ("config.json", "diffusion_pytorch_model.safetensors", latents.RECORD):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def save_text_encoder(source, folder):
    """The text encoder in `source` as the trainer loads it (encoders.load_encoders: CLIPTextModel for a CLIP
    folder, the text tower alone of a whole CLIPModel; T5EncoderModel; else AutoModel) into folder/text_encoder, its
    tokenizer into folder/tokenizer: diffusers' layout, so from_pretrained loads both as components. Returns
    model_index.json's entries: each one's transformers class."""
    _, tokenizer, text_encoder = load_encoders(config.Config({"vae": None, "text_encoder": str(source)}), "cpu")
    with quiet_transformers(warnings=False):  # no bar of its shards in a log file
        text_encoder.save_pretrained(folder / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(folder / "tokenizer")
    # transformers 5 names its generic fast tokenizer TokenizersBackend; PreTrainedTokenizerFast, the same class
    # there, is also 4.x's name for it, so the folder loads with either
    kind = type(tokenizer).__name__.replace("TokenizersBackend", "PreTrainedTokenizerFast")
    return {"text_encoder": ["transformers", type(text_encoder).__name__], "tokenizer": ["transformers", kind]}


def model_index(cfg, scheduler, best=None, text=None, transformer=True):
    """model_index.json: the pipeline class in pipeline.py, its components, and the sampling defaults: the run's
    settings, with steps, guidance and its interval from `best` (tools/tune.py's choice for the exported weights:
    tuning.export_choice) when given. A carried VAE is the component vae (vae/), else a hub id in vae_id; a carried
    text encoder (`text`: save_text_encoder's entries) the components text_encoder and tokenizer, else a hub id in
    text_encoder_id."""
    val, obj = cfg["val"], cfg["objective"]
    best = best or {}
    flow = curves.method_of(cfg) == "flow_matching"
    vae = {"vae": ["diffusers", "AutoencoderKL"], "vae_id": None} if carried(cfg, "vae") else \
        {"vae_id": sd3_base.reference(cfg["encoders"]["vae"])}
    text = {**text, "text_encoder_id": None} if text else \
        {"text_encoder_id": sd3_base.reference(cfg["encoders"]["text_encoder"])}
    enc = cfg["encoders"]
    sd3 = {"vae_subfolder": "vae"} if sd3_base.is_base(enc["vae"]) else {}
    sd3.update({"sd3_text_encoders": list(sd3_base.chosen(enc))} if sd3_base.is_base(enc["text_encoder"]) else {})
    sd3.update({"transformer": ["diffusers", "SD3Transformer2DModel"]} if transformer else
               {"transformer_id": sd3_base.reference(cfg["init_from"])})
    return {"_class_name": ["pipeline", "MinimalDiffusionPipeline"], "_diffusers_version": diffusers.__version__,
            **sd3, "conditioner": ["conditioner", "Conditioner"],
            "scheduler": ["diffusers", type(scheduler).__name__], **vae, **text,
            "max_tokens": cfg["encoders"]["max_tokens"], "num_inference_steps": best.get("steps", val["steps"]),
            "guidance_scale": best.get("guidance_scale", val["guidance_scale"]),
            "control_guidance_scale": val["control_guidance_scale"],
            "guidance_interval": list(best.get("guidance_interval", val["guidance_interval"])),
            "guidance_rescale": 0.0 if flow else val["guidance_rescale"],
            "sampler": val["sampler"], "prediction": obj.get("prediction", "v"),
            "time_shift": common.shift_of(cfg), "resolution": cfg["data"]["resolution"],
            **({"buckets": cfg["data"]["bucket_shapes"]} if cfg["data"].get("bucket_shapes") else {})}


def write(ema, cfg, folder, class_ids=None, run_dir=None, phema=None, repo=None):
    """Write the pipeline folder of the model `ema` (a Denoiser) trained by the run `run_dir` (its card's
    source: metrics, evaluations, samples) into `folder`, whole: built beside it, then put in its place.
    phema: the post-hoc EMA's record (tools/phema.py); repo: the hub id it will be pushed to (the card's
    loading lines name it)."""
    folder, run_dir = Path(folder), Path(run_dir or cfg["run_dir"])
    vae, text_encoder = carried(cfg, "vae"), carried(cfg, "text_encoder")  # before any work: a folder that is gone
    part = folder.with_name(folder.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)  # left by an export that died writing
    part.mkdir(parents=True)
    # LoRA: the base and diffusers' adapter file, or (merged) one model. A model read back from an export (tools/
    # export.py) has its adapters folded in already: it is written as one model.
    adapted = getattr(ema, "lora_trained", None) is not None
    adapters = lora.diffusers_adapters(ema) if adapted and not cfg["train"].get("lora_merged_export") else None
    carried_lora = folder / model_card.LORA  # a re-export's model has its adapters folded in: the record it had
    record = model_card.lora_record(ema) if adapted else \
        json.loads(carried_lora.read_text()) if carried_lora.is_file() else None
    ema = lora.without_adapters(ema, merge=adapters is None)
    if adapters is not None:
        from diffusers.loaders import SD3LoraLoaderMixin

        SD3LoraLoaderMixin.save_lora_weights(part, transformer_lora_layers=adapters, weight_name=lora.ADAPTERS)
    # An SD3-family base's adapters reference the base (transformer_id) instead of a copy of its transformer
    transformer = adapters is None or not sd3_base.is_base(cfg.get("init_from"))
    if transformer:
        ema.transformer.save_pretrained(part / "transformer", safe_serialization=True)
    exported_conditioner(ema.conditioner, ema.transformer, class_ids).save_pretrained(part / "conditioner")
    shutil.copy(SOURCES / "conditioner.py", part / "conditioner" / "conditioner.py")
    shutil.copy(SOURCES / "pipeline.py", part / "pipeline.py")
    scheduler = make_scheduler(cfg)
    scheduler.save_pretrained(part / "scheduler")
    if vae:
        copy_vae(vae, part / "vae")
    text = save_text_encoder(text_encoder, part) if text_encoder else None
    (part / "config.json").write_text(json.dumps(as_trained(cfg), indent=2))
    if record is not None:  # the card's LoRA lines (model_card.lora_lines)
        (part / model_card.LORA).write_text(json.dumps(record, indent=1))
    # tools/tune.py's choice, only where it was made for these weights (their digest) and the pipeline's sampler.
    tuned, untuned = tuning.export_choice(run_dir, part, cfg["val"]["sampler"], phema)
    if tuned is not None:
        tuned["model"]["model"] = folder.name  # the folder's own record: eval_fid.py / sample.py on it use it too
        (part / "tuned.json").write_text(json.dumps(tuned, indent=1))
        print(f"the pipeline's sampling defaults are tools/tune.py's choice for these weights "
              f"({run_dir / 'tuned.json'})")
    elif untuned:
        print(f"the pipeline's sampling defaults are the run's own: {run_dir / 'tuned.json'} {untuned}")
    index = model_index(cfg, scheduler, tuned and tuned["best"], text, transformer)
    (part / "model_index.json").write_text(json.dumps(index, indent=2))
    if note := meanflow.sampling_note(cfg["objective"], index["sampler"], index["num_inference_steps"],
                                      index["guidance_scale"], flags=False):  # a run recorded before, or its choice
        print(f"note: the pipeline's defaults sample a MeanFlow model otherwise: {note}")
    if class_ids:
        (part / "class_ids.json").write_text(json.dumps(class_ids))
    if phema is not None:
        (part / "phema.json").write_text(json.dumps(phema, indent=1))
    grids = sorted((run_dir / "samples").glob("step_*.png"))
    if grids:
        shutil.copy(grids[-1], part / model_card.GRID)
    n_params = sum(p.numel() for p in [*ema.transformer.parameters(), *ema.conditioner.parameters()])
    card = model_card.card(as_trained(cfg), run_dir, part, n_params, phema, repo, folder, tuned, untuned)
    (part / "README.md").write_text(card)
    if folder.exists():
        shutil.rmtree(folder)
    part.rename(folder)
    return folder


def export(ema, cfg, folder, class_ids=None, run_dir=None, phema=None):
    """write, then push_to_hub (the config's key) when set: checked before the run began (hub.problems)."""
    repo = cfg.get("push_to_hub")
    folder = write(ema, cfg, folder, class_ids, run_dir, phema, repo)
    if repo:
        print(f"pushed {folder} to {hub.push(folder, repo)} (private)")
    return folder
