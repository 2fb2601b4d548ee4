"""The model card of an exported pipeline folder: its README.md, which the Hub shows as the model's page.

The Hub's metadata header (licence, library, tags, datasets), then what was trained, on what, for how many steps
and images; how to load and sample it in three lines; the command and the whole resolved config; the run's
evaluation numbers with their setting, protocol and date (eval_fid.py's eval/*/report.json, the rows of
quality.jsonl; not those tools/tune.py or tools/phema.py --sweep ran, which chose a setting on the held-out rows);
the last validation grid; the recipe's reference curves (val.reference_curves) against the run's own protocol scores.
Everything comes from the run folder as it is at export time: export again (tools/export.py) after evaluating. No
path of the machine that trained appears (public.config_of, public.command_of): the card is published.
"""
import datetime
import json
from pathlib import Path

from training.data import latents
from training.model import lora
from training.record import curves
from training.sharing import public

GRID = "samples.png"  # the run's last validation grid, copied beside the card
LORA = "lora.json"  # a LoRA run's record beside its export (lora_record): what the card says of the adaptation


def started_from(cfg, run_dir):
    """The Training section's lines on what this run started from: init_from's source, whose weights and EMA it
    took (with init_from.json's counts), and a checkpoint of another run that resume named."""
    lines, source, resume = [], cfg.get("init_from"), cfg.get("resume")
    if source:
        record = Path(run_dir) / "init_from.json"
        r = json.loads(record.read_text()) if record.is_file() else {}
        counts = "".join([f"; {r['loaded']:,} tensors taken" if "loaded" in r else "",
                          f", {len(r['adapted'])} adapted" if r.get("adapted") else "",
                          f", {len(r['missing'])} new at their fresh initialisation" if r.get("missing") else ""])
        lines.append(f"- fine-tuned from {public.run_label(source)}: its weights and EMA (`init_from`; the optimizer, "
                     f"step and data order started fresh{counts})")
    if resume not in (None, "latest") and Path(run_dir).resolve() not in Path(resume).expanduser().resolve().parents:
        lines.append(f"- continued from {public.run_label(resume)}, a checkpoint of another run (`resume`: its "
                     f"weights, EMA, optimizer and step)")
    return lines


def lora_record(model):
    """What the card says of a model adapted by LoRA (training/model/lora.py attach): the adapters' parameter count,
    this run's own layers that trained in full (name: count), the frozen base's count and sha256."""
    params, trained = dict(model.named_parameters()), set(model.lora_trained)
    return {"adapter_parameters": sum(params[n].numel() for n in trained if ".lora_" in n),
            "own_layers": {n: params[n].numel() for n in sorted(trained) if ".lora_" not in n},
            "base_parameters": sum(p.numel() for n, p in params.items() if n not in trained),
            "base_sha256": model.lora_base_hash}


def lora_lines(cfg, folder):
    """The Training section's lines on a LoRA run (train.lora_rank > 0): rank, alpha, dropout, targets, the base it
    adapts (init_from, with its sha256), what trained with parameter counts (the folder's LORA record), and where
    the adapters are: diffusers' adapter file beside the base, or folded into the weights."""
    tr = cfg["train"]
    if not tr.get("lora_rank"):
        return []
    record_path = Path(folder) / LORA
    r = json.loads(record_path.read_text()) if record_path.is_file() else None
    alpha = tr.get("lora_alpha") or tr["lora_rank"]
    targets = (", ".join(f"`{t}`" for t in tr["lora_targets"]) if tr.get("lora_targets") else
               "the attention projections of both streams (diffusers' SD3 LoRA default)")
    base = f" (sha256 `{r['base_sha256'][:12]}`)" if r else ""
    lines = [f"- LoRA (Hu et al. 2022) on a frozen base, {public.run_label(cfg['init_from'])}{base}: rank "
             f"{tr['lora_rank']}, alpha {alpha:g} (scale {alpha / tr['lora_rank']:g}), dropout "
             f"{tr.get('lora_dropout', 0):g}, on {targets}"]
    if r:
        own = "".join(f"; this run's own `{n}` in full ({c:,})" for n, c in r["own_layers"].items())
        total = r["adapter_parameters"] + sum(r["own_layers"].values())
        lines.append(f"- trainable parameters: {total:,} ({total / (total + r['base_parameters']):.2%} of the "
                     f"model): the adapters {r['adapter_parameters']:,}{own}; the base's {r['base_parameters']:,} "
                     f"frozen")
    lines.append(f"- this folder holds the base and the adapters in diffusers' format (`{lora.ADAPTERS}`): "
                 f"`from_pretrained` loads the base, `pipe.load_lora_weights(folder)` adds the adapters and "
                 f"`pipe.set_adapters([...], [scale])` scales them" if (Path(folder) / lora.ADAPTERS).is_file() else
                 "- the adapters are folded into this folder's weights (a merged export: one model)")
    return lines


def metadata(cfg, text):
    """The YAML header the Hub reads. The licence is "other": the weights' terms follow the training data's and
    the referenced VAE's / text encoder's, which the card names. A class-conditional model has no pipeline_tag:
    the Hub has no class-conditional task, and unconditional-image-generation would say it needs no input."""
    source = cfg["data"]["source"]
    tags = ["diffusers", "minimal-diffusion", "mmdit", curves.method_of(cfg).replace("_", "-"),
            "text-to-image" if text else "class-conditional"]
    lines = ["---", "license: other", "library_name: diffusers", *(["pipeline_tag: text-to-image"] if text else []),
             "tags:", *[f"- {t}" for t in tags]]
    lines += ["datasets:", f"- {source}"] if public.on_hub(source) else []
    return "\n".join(lines + ["---"])


def encoder_text(enc, folder):
    """How the pipeline gets its VAE and text encoder: this folder's copies (a local folder at training:
    pipeline_export.carried), or their hub ids; None for a class model in pixel space."""
    parts = []
    if (Path(folder) / "vae").is_dir():
        parts.append("the VAE is this folder's `vae/`")
    elif enc["vae"]:
        parts.append(f"the VAE `{enc['vae']}` is loaded by its hub id (model_index.json)")
    if (Path(folder) / "text_encoder").is_dir():
        parts.append("the text encoder and its tokenizer are this folder's `text_encoder/` and `tokenizer/`")
    elif enc["text_encoder"]:
        parts.append(f"the text encoder `{enc['text_encoder']}` is loaded by its hub id (model_index.json)")
    return "; ".join(parts) + ", or pass `vae=` / `text_encoder=` and `tokenizer=`" if parts else None


def loading_lines(repo, local, example, adapters=False):
    """The Use section's code and the line after it: the Hub id when the folder is pushed (or to be), else a
    placeholder for it, with the local folder as the way to load it on this machine; with a LoRA adapter file
    (`adapters`), its loading, without which the pipeline is the base."""
    code = ["```python", "from diffusers import DiffusionPipeline",
            f"pipe = DiffusionPipeline.from_pretrained({repo or 'OWNER/NAME'!r}, trust_remote_code=True)",
            *([f"pipe.load_lora_weights({repo or 'OWNER/NAME'!r})  # the adapters: without them, the base"]
              if adapters else []),
            f"image = pipe({example!r}).images[0]", "```", ""]
    if repo:
        return code + [f"`{repo}` is the Hub repository of this folder; a local copy of the folder loads the same "
                       f"way.", ""]
    return code + [f"`OWNER/NAME` stands for the Hub repository this folder is pushed to (`python tools/export.py "
                   f"--run RUN --push_to_hub OWNER/NAME` writes its id here); where the folder is local, its path "
                   f"loads it the same way: `DiffusionPipeline.from_pretrained({local!r}, trust_remote_code=True)`.",
                   ""]


def sampling_text(val, method, tuned, untuned):
    """The pipeline's sampling defaults and where each comes from: tools/tune.py's choice for these weights
    (tuning.export_choice: steps, guidance and its interval, with what was searched and how it was scored), or the
    run's own val.* settings, saying why a tuned.json of the run was not used."""
    best = tuned["best"] if tuned else {}
    steps, guidance = best.get("steps", val["steps"]), best.get("guidance_scale", val["guidance_scale"])
    interval = tuple(best.get("guidance_interval", val["guidance_interval"]))
    chosen = f"`num_inference_steps={steps}`, `guidance_scale={guidance:g}`, `guidance_interval={interval}`"
    own = f"`control_guidance_scale={val['control_guidance_scale']:g}`" + (
        f", `guidance_rescale={val['guidance_rescale']:g}`" if method == "ddpm" else "")
    if tuned is None:
        why = f"; the run's tuned.json {untuned}" if untuned else ""
        return f"the run's own sampling settings (its config's val.*, not tuned{why}): {chosen}, {own}"
    names = {"guidance_scale": "guidance_scale", "guidance_interval": "guidance_interval",
             "steps": "num_inference_steps", "phema_std": "post-hoc EMA std"}
    searched, fixed = [], []
    for key, name in names.items():
        values = sorted({tuple(r[key]) if key == "guidance_interval" else r[key] for r in tuned["rows"]} - {None})
        if values:
            (searched if len(values) > 1 else fixed).append(
                f"{name} {', '.join(str(v) if key == 'guidance_interval' else f'{v:g}' for v in values)}")
    c = tuned.get("confirm")
    confirmed = "" if not c else (
        f"; the best two confirmed on {tuned['confirm_samples']:,} fresh samples each in {c['blocks']} blocks: "
        f"{c['metric']} {c['best']['mean']:.4f} (95% interval [{c['best']['low']:.4f}, {c['best']['high']:.4f}])")
    return (f"{chosen}, chosen for these weights by tools/tune.py on the held-out rows of the training split, never "
            f"the test images (searched: {'; '.join(searched) or 'one setting'}"
            f"{', at ' + ' and '.join(fixed) if fixed else ''}: {len(tuned['rows'])} settings at "
            f"{tuned['num_samples']:,} samples each, scored by {tuned['metric']}{confirmed}; the folder's tuned.json "
            f"holds the whole search), and the run's own {own}")


def read_rows(path):
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
    return [r for r in rows if isinstance(r, dict) and "event" not in r]


def global_batch(cfg, rows):
    """Images per optimizer step: train.global_batch, else the micro-batch x accumulation x the processes the run
    logged (images_per_s / images_per_s_per_device)."""
    tr = cfg["train"]
    if tr.get("global_batch"):
        return tr["global_batch"]
    speed = [r for r in rows if r.get("images_per_s_per_device")]
    world = round(speed[-1]["images_per_s"] / speed[-1]["images_per_s_per_device"]) if speed else 1
    return tr["batch_size"] * tr["grad_accum"] * world


CHOOSERS = ("tools/tune.py", "tools/phema.py")  # what runs eval_fid.py to choose a setting on the held-out rows


def written_by(report):
    """The program that ran eval_fid.py for a report: its record, or (a report written before it was recorded) the
    program its command names first (tune.py, phema.py; a benchmark's name), else eval_fid.py itself."""
    program = report.get("written_by") or report.get("command", "eval_fid.py").partition(" ")[0]
    return f"tools/{program}" if program in ("tune.py", "phema.py") else program


def prompts_of(report):
    """What a text model's report was conditioned on (eval_fid.py's conditioning: the held-out captions, or a file
    of prompts, by its name), its count and digest; nothing for a class model's."""
    c = report.get("conditioning") or {}
    if "prompts" not in c:
        return ""
    named = {"heldout": "the held-out captions", "reference": "the reference rows' captions (sample i: row i % R)"}
    which = named.get(c["prompts"]) or f"the prompts of {public.source_name(c['prompts'])}"
    count = f"{c['num_prompts']:,}" if "num_prompts" in c else "?"
    digest = f", sha256 {c['prompts_sha256'][:12]}" if "prompts_sha256" in c else ""
    return f", conditioned on {which} ({count}{digest})"


def evaluations(cfg, run_dir, phema=None, tuned=None, repo=None):
    """Table rows (metric, value, real images' value or None, setting, protocol, date, warnings) of eval_fid.py's
    reports on these weights (the export's EMA, or the post-hoc EMA of phema's std) and of quality.jsonl (the
    export's: its rows name their step),
    and the number of reports left out. A report written by tools/tune.py or tools/phema.py --sweep (written_by:
    what ran it, never its settings) chose a setting on the held-out rows and does not score the model: it is left
    out, and counted. Every other row says its setting: the run's own, tune.py's choice (`tuned`: the tuned.json
    chosen for these weights, tuning.export_choice; a choice made for other weights labels nothing), or what
    differs from the card's defaults (tune.py's choice where there is one, else the run's own); its metric names
    its bucket (a run with data.buckets scored at one shape), its protocol the reference's image count, its
    warnings eval_fid.py's (a reference too small for the Frechet distance). No path of the machine that trained
    appears (public.command_of, public.source_name)."""
    best = tuned["best"] if tuned else None
    as_tuned = best and {**cfg, "val": {**cfg["val"], **{k: best[k] for k in ("guidance_scale", "guidance_interval",
                                                                             "steps")}}}  # the run at tune.py's choice
    out, left_out = [], 0
    for path in sorted(Path(run_dir).glob("eval/*/report.json")):
        r = json.loads(path.read_text())
        std = r["model"].get("phema", {}).get("phema_std")
        if "step" in r["model"] or std != (phema or {}).get("phema_std"):  # a checkpoint's, or other weights'
            continue
        if written_by(r) in CHOOSERS:
            left_out += 1
            continue
        differs = curves.sampling_differences(r, cfg)
        if as_tuned and differs:  # the card's defaults are tune.py's choice: a row says how it differs from them
            from_tuned = curves.sampling_differences(r, as_tuned)
            setting = ("; ".join(from_tuned) + " (against tools/tune.py's choice)" if from_tuned else
                       "tools/tune.py's choice (tuned.json)")
        else:
            setting = "; ".join(differs) or "the run's own"
        ref = r.get("reference") or {}
        # The command as eval_fid.py's: a report records the program that ran it (a benchmark) before eval_fid.py's
        # own arguments, which alone reproduce the report.
        command = public.command_of(("eval_fid.py " + r.get("command", "eval_fid.py").partition(" ")[2]).strip(),
                                 run_dir, repo)
        against = (f"the held-out rows of {public.source_name(ref['source'])}" if curves.on_heldout_rows(r) else
                   f"{public.source_name(ref.get('source', '?'))} {ref.get('split') or ''}".strip())
        count = f" ({r['reference_count']:,} images)" if r.get("reference_count") else ""
        protocol = (f"{r['num_samples']:,} samples ({r['model'].get('weights', '')}), {r['sampler']} {r['steps']} "
                    f"steps, "
                    f"guidance {r['guidance_scale']:g}, interval {r.get('guidance_interval', [0, 1])}{prompts_of(r)}, "
                    f"against {against}{count}, {r.get('feature_extractor') or 'inception'} features"
                    f"{', CLIP score by ' + public.source_name(r['clip_model']) if r.get('clip_model') else ''}"
                    f"; `{command}`")
        bucket = " ({}x{} bucket)".format(*r["shape"]) if r.get("shape") else ""
        date = datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()
        real = r.get("real") or {}  # the text protocol's real images, under the samples' names
        out += [(k + bucket, v, real.get(k), setting, protocol, date, r.get("warnings") or [])
                for k, v in r["metrics"].items()]
    quality = Path(run_dir) / "quality.jsonl"
    for row in read_rows(quality) if phema is None else []:
        date = datetime.date.fromtimestamp(quality.stat().st_mtime).isoformat()
        out += [(k, v, None, "not recorded", f"quality.jsonl, step {row['step']}", date, []) for k, v in row.items()
                if k != "step"]
    return out, left_out


def reference_rows(cfg, run_dir, rows):
    """(metric, step, band lo .. hi, mean, this run) at the last step of each of the recipe's reference curves."""
    try:
        ref = curves.load(cfg)
    except (FileNotFoundError, ValueError):  # the recipe's file is not beside this export (another machine)
        return []
    if not ref:
        return []
    mine = {}
    for row in rows:
        mine.update({(k, row["step"]): v for k, v in row.items() if isinstance(v, (int, float))})
    mine.update({(k, step): v for k, v, step in curves.scores(run_dir, cfg)})
    return [(key, band[-1][0], band[-1][1], band[-1][3], band[-1][2], mine.get((key, band[-1][0])))
            for key, band in sorted(ref["curves"].items()) if band]


def autoencoder_lines(record):
    """A paragraph on an autoencoder made by tools/autoencoder.py (its autoencoder.json, carried in vae/): what it
    is, what it was trained on, and its reconstruction quality on the test split, the floor of this model's
    scores; nothing for any other VAE."""
    if not record.is_file():
        return []
    r = json.loads(record.read_text())
    test, shape = r["test"], " x ".join(map(str, r["latent_shape"]))
    rfd = [f"{v:.3f} at {k.rsplit('_', 1)[1]}" for k, v in test.items() if k.startswith("fd_classifier_")]
    real = r.get("real") if "rows" in (r.get("real") or {}) else None  # before issue 68: test images against their own
    floor = [v for k, v in (real or {}).items() if k.startswith("fd_classifier_")]
    return [f"The autoencoder (`vae/`, an AutoencoderKL of {r['parameters'] / 1e6:.2f}M parameters made by "
            f"minimal-diffusion's tools/autoencoder.py): {r['resolution']} px to {shape} latents, trained on "
            f"{r['train_rows']:,} images of the '{r['train_split']}' split of {public.data_name(r['source'])}, its "
            f"factors calibrated on their latents (scaling {r['factors']['scaling_factor']:.4g}, shift "
            f"{r['factors']['shift_factor']:.4g}). Its reconstructions of the {test['rows']:,} '{r['test_split']}' "
            f"images: PSNR {test['psnr']:.2f} dB" + (f", rFD {' and '.join(rfd)} images (the Frechet distance in the "
                                                     f"evaluation classifier's features)" if rfd else "")
            + (f"; {real['rows']:,} real '{real['split']}' images against the same test images: {floor[0]:.3f}, the "
               f"protocol's floor at that count" if floor else "")
            + (": no model in its latents scores better than its own reconstructions." if not r.get("warnings") else
               ". " + " ".join(f"{w}." for w in r["warnings"])), ""]


def card(cfg, run_dir, folder, n_params, phema=None, repo=None, local=None, tuned=None, untuned=None):
    """README.md's text for the pipeline folder `folder` of the run in `run_dir` (phema: the post-hoc EMA's
    record, when the weights are one; repo: the hub id it is pushed to, if any; local: the folder's final path;
    tuned: the folder's tuned.json, when tools/tune.py chose the pipeline's defaults for these weights, else
    untuned: why the run's tuned.json was not used, if it has one; tuning.export_choice)."""
    d, enc, m, c, val = cfg["data"], cfg["encoders"], cfg["model"], cfg["conditioning"], cfg["val"]
    method, text = curves.method_of(cfg), bool(enc["text_encoder"])
    rows = read_rows(Path(run_dir) / "metrics.jsonl")
    steps = max([r["step"] for r in rows if "loss" in r] or [cfg["train"]["max_steps"]])
    batch = global_batch(cfg, rows)
    names = json.loads((Path(folder) / "conditioner" / "config.json").read_text()).get("class_names") or []
    example = "a small red circle" if text else (names[0] if names else "0")
    objective = cfg["objective"]
    if method == "flow_matching":
        what = (f"flow matching (rectified flow, {objective['prediction']}-prediction, {objective['time_sampling']} "
                f"time sampling)")
    else:
        what = (f"DDPM ({objective['prediction']}-prediction, {objective['beta_schedule']} betas, zero terminal SNR "
                f"{objective['zero_terminal_snr']}, Min-SNR-{objective['min_snr_gamma']:g})")
    made = ""
    if objective.get("meanflow"):  # made for few steps: say how many (the pipeline's default, tuned or the run's)
        best = (tuned or {}).get("best", {})
        n, guidance = best.get("steps", val["steps"]), best.get("guidance_scale", val["guidance_scale"])
        anchor, blocks = objective.get("meanflow_anchor"), objective.get("meanflow_interval_blocks")  # .get: older
        what = (f"MeanFlow (Geng et al. 2025: the average velocity over [r, t], {objective['prediction']}-prediction, "
                f"r = t for {objective['meanflow_equal_share']:.0%} of the samples, guidance "
                f"{objective['meanflow_guidance']:g} folded into training"
                + (f"; flow matching's own loss kept on {anchor:.0%} of each batch (FACM's anchor)" if anchor else "")
                + (f"; the interval t - r in the last {blocks} blocks only (Decoupled MeanFlow)" if blocks else "")
                + ")")
        # the pipeline's default guidance_scale is applied on top of the trained-in guidance: two evaluations a step
        per_step = ("one network evaluation a step, the guidance already in the weights" if guidance == 1 else
                    f"two network evaluations a step: classifier-free guidance {guidance:g} on top of the "
                    f"{objective['meanflow_guidance']:g} in the weights (`guidance_scale=1`: one, the weights' own)")
        made = (f" It was made for sampling in {n} step{'s' * (n > 1)} of its `{val['sampler']}` sampler: {per_step} "
                f"(`num_inference_steps` sets another count).")
    carried = (Path(folder) / "vae").is_dir()  # a local VAE, copied into the folder (pipeline_export.copy_vae)
    space = (f"the latents of `{Path(enc['vae']).name}` (this folder's `vae/`)" if carried else
             f"the latents of `{enc['vae']}`" if enc["vae"] else "pixel space")
    encoder = (f"`{Path(enc['text_encoder']).name}` (this folder's `text_encoder/`)"
               if (Path(folder) / "text_encoder").is_dir() else f"`{enc['text_encoder']}`")  # a path: its name only
    conditioning = f"captions encoded by {encoder}" if text else f"{len(names) or d['num_classes']} classes"
    weights = ("the EMA of the weights" if phema is None else
               f"the post-hoc EMA of relative std {phema['phema_std']:g} (gamma {phema['gamma']:.2f}, profile fit "
               f"error "
               f"{phema['profile_fit_error']:.1e}), reconstructed from the run's snapshots (Karras et al. 2024)")
    out = [metadata(cfg, text), "", f"# {Path(cfg['run_dir']).name}", "",
           f"A {n_params / 1e6:.1f}M-parameter MMDiT (diffusers' SD3Transformer2DModel: {m['num_layers']} layers, "
           f"{m['num_attention_heads']} heads of {m['attention_head_dim']}, patch {m['patch_size']}) trained by "
           f"minimal-diffusion with {what} on {public.data_name(d['source'])} at {d['resolution']} px"
           + (f" (aspect-ratio buckets, width x height: {', '.join(f'{w}x{h}' for w, h in d['bucket_shapes'])})"
              if d.get("bucket_shapes") else "") + f" in {space}, "
           f"conditioned on {conditioning} ({c['mode']} conditioning"
           f"{'; controls ' + ', '.join(c['controls']) if c['controls'] else ''}). The weights are {weights}.{made} "
           f"Licence: the terms of the training data and of the VAE and text encoder apply.", "",
           *autoencoder_lines(Path(folder) / "vae" / latents.RECORD), *public.licence_lines(d["source"]),
           "## Use", "", *loading_lines(repo, str(local or folder), example, (Path(folder) / lora.ADAPTERS).is_file()),
           f"The first argument is {'a prompt' if text else 'a class name, id or index'} (or a list). The defaults are "
           + sampling_text(val, method, tuned, untuned)
           + ("; the controls are the arguments `original_size=(h, w)`, `crop_box=(top, left, height, width)` in the "
              "original's pixels (the model reads it relative to the short side: where and how much is shown, never "
              "the size), `flip`" if c["controls"] else "")
           + ("; `height=` and `width=` (pixels) sample another shape, the squarest bucket by default"
              if d.get("bucket_shapes") else "")
           + ". `generator=` (one per image) and `latents=` fix the noise"
           + (f"; {encoder_text(enc, folder)}." if encoder_text(enc, folder) else "."), "",
           "## Training", "",
           f"- {steps:,} optimizer steps of {batch:,} images: {steps * batch:,} images seen",
           *started_from(cfg, run_dir), *lora_lines(cfg, folder),
           f"- command: `python train_{method}.py --config config.json` (config.json: this folder's, the run's "
           f"resolved config, every key; below with the training machine's paths by their names)", ""]
    out += ["<details><summary>config.json</summary>", "", "```json", json.dumps(public.config_of(cfg), indent=1),
            "```", "", "</details>", ""]
    out += ["## Evaluation", ""]
    scores, left_out = evaluations(cfg, run_dir, phema, tuned, repo)
    warnings = list(dict.fromkeys(w for *_, ws in scores for w in ws))  # each once, numbered in the order met
    if scores:
        out += ["| metric | value | setting | protocol | date |", "| --- | --- | --- | --- | --- |"]
        out += [f"| {k} | {v:.4f}" + ("" if real is None else f" (real images: {real:.4f})") + f" | {setting} | "
                f"{protocol}" + "".join(f"; warning {warnings.index(w) + 1}" for w in ws) + f" | {date} |"
                for k, v, real, setting, protocol, date, ws in scores]
        if any(real is not None for _, _, real, *_ in scores):
            out += ["", "(real images: ...) is what real images score the same way (eval_fid.py's text protocol, "
                    "docs/evaluation.md): for FD, KD, precision, recall, density and coverage, as many training images "
                    "as the reference has, against it (the floor); for CLIP score, retrieval and class accuracy, the "
                    "reference images themselves (the ceiling). A metric ending in a part's name (recombination, new) "
                    "is that part's samples against that part's images."]
    else:
        out += ["Not evaluated yet: run eval_fid.py on the run, then export again (tools/export.py)."]
    if warnings:
        out += ["", "eval_fid.py's warnings on these evaluations:", ""]
        out += [f"{i}. {w}" for i, w in enumerate(warnings, 1)]
    if left_out:
        out += ["", f"{left_out} more evaluation{'s' if left_out > 1 else ''} of these weights, run by tools/tune.py "
                f"(or tools/phema.py --sweep) on the held-out rows, chose a setting; "
                f"{'they do' if left_out > 1 else 'it does'} not score it: not shown."]
    if (Path(folder) / GRID).is_file():
        out += ["", "## Samples", "", f"![the last validation grid]({GRID})", "",
                f"The run's last validation grid: {val['steps']} {val['sampler']} steps, guidance "
                f"{val['guidance_scale']:g}."]
    reference = reference_rows(cfg, run_dir, rows)
    if reference:
        out += ["", "## Reference curves", "", f"The recipe's reference runs "
                f"({public.source_name(val['reference_curves'])}) at their last step: the band over their seeds and "
                f"this run's value (a score only where the run was scored as they were: at its own settings, not on "
                f"the held-out rows).", "",
                "| metric | step | band | mean | this run |", "| --- | --- | --- | --- | --- |"]
        out += [f"| {k} | {s} | {lo:.4f} .. {hi:.4f} | {mean:.4f} | {'-' if v is None else f'{v:.4f}'} |"
                for k, s, lo, hi, mean, v in reference]
    return "\n".join(out) + "\n"
