"""Sample a trained run at scale and score it: FID and KID (clean-fid), precision, recall, density and
coverage on the same features, FD-DINOv2 (--dino), CLIP score. What it scores against (the Inception network,
reference statistics) is training/evaluation/reference.py's; the scores themselves are training/evaluation/metrics.py's.

    python eval_fid.py --run runs/flow_matching_demo --num_samples 1000 --inception_weights inception-2015-12-05.pt
    accelerate launch eval_fid.py --run runs/flow_matching_imagenet256 --reference ILSVRC/imagenet-1k \
        --reference_split validation
    accelerate launch eval_fid.py --run runs/flow_matching_cc12m --prompts heldout \
        --clip_model openai/clip-vit-large-patch14
    python eval_fid.py --run runs/flow_matching_demo --num_samples 1000 --dino facebook/dinov2-base
    python eval_fid.py --run runs/flow_matching_emoji --reference_split test --features clip --clip_model clips/emoji

A text run scored against a captioned dataset split follows the text protocol (training/evaluation/captions.py,
docs/evaluation.md): sample i takes reference row i % R's caption, and every score comes for each part of the rows
(`novelty`) and all together, beside what real images score.

Pipeline: arguments -> model (the exported EMA model, or a checkpoint's EMA or raw weights, with the run's
resolved config) -> generation (sample i always has the same seed, so the images do not depend on the process
count; lossless PNGs) -> features -> reference statistics (computed once, cached in our own .npz keyed on the
source and its preprocessing) -> metrics (FID/KID with clean-fid's math and resizing; precision, recall, density
and coverage on the same features; FD-DINOv2; CLIP score) -> report (JSON + table).
Reading the model back, sampling a batch and the trainers' small-N FID (the same path, in memory) are
training/evaluation/sampling.py's; the run's own sampler is its trainer's `generate` (method_of).

Conventions: generated pixels in [-1, 1] become uint8 by round((x + 1) * 127.5), as in runlog.save_image_grid.
A feature extractor is any feature_fn(list of uint8 (H, W, 3) images) -> (N, D) array; the default is
clean-fid's Inception, the tests pass a tiny fixed conv net. Every multi-rank step is a collective: all ranks
call it. For several nodes, --out_dir and --stats_cache must be on a shared file system.
"""
import argparse
import hashlib
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

import common
import train_ddpm
import train_flow_matching
from training.config import config
from training.data.encoders import load_encoders
from training.run.monitor import progress
from training.evaluation import captions, classifier, reference, sampling
from training.evaluation.generation import load_prompts, make_condition, make_controls
from training.evaluation.metrics import (CLIP_DEFAULT, DINO_DEFAULT, all_scores, check_dino_reference, clip_features,
                                         dino_scores, dinov2_features, feature_tag, fid_size_warning, size_tag)
from training.evaluation.reference import inception_features, reference_for, reference_size
from training.evaluation.sampling import png_path, read_png
from training.evaluation.tuning import tuned_defaults
from training.objectives import meanflow
from training.record import curves

# ----------------------------------------------------------------------------------------------------------
# Arguments. Every default is here; None means "as the run was configured". Reported numbers: 50k samples.


def parse_args(argv=None):
    return parser().parse_args(argv)


def parser():
    a = (p := argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).add_argument
    a("--run", required=True, help="run folder (uses run/export) or an export folder")
    a("--checkpoint", default=None, help="score a checkpoint folder (or 'latest') instead of the export")
    a("--weights", default="ema", choices=["ema", "raw"], help="checkpoint weights; the export is always EMA")
    a("--out_dir", default=None, help="default: <run>/eval/<weights>-<sampler><steps>-g<guidance>-seed<seed>, then "
      "-<w>x<h> for a bucket and -ref-<reference> for any reference but the held-out rows")
    a("--num_samples", type=int, default=None, help="default: 50,000; the text protocol's (a text run against a "
      "captioned split): one per reference image, and a multiple of their count")
    a("--batch_size", type=int, default=64, help="per process; stochastic samplers depend on it, noise does not")
    a("--seed", type=int, default=0, help="sample i's noise: seed_for(seed, 0, i)")
    a("--sampler", default=None, help="default: the run's val.sampler (flow matching: euler, heun, meanflow; "
      "DDPM: ddim, ddpm)")
    a("--steps", type=int, default=None, help="default: the run's val.steps")
    a("--guidance_scale", type=float, default=None, help="semantic guidance; default: the run's val.guidance_scale")
    a("--control_guidance_scale", type=float, default=None, help="default: the run's val.control_guidance_scale")
    a("--guidance_interval", type=sampling.interval_arg, default=None, help="'lo,hi': guide only at noise levels lo "
      "<= t <= hi (flow-matching t, 1 = noise; docs/methods.md converts published intervals); default: the run's")
    a("--phema_std", type=float, default=None, help="the post-hoc EMA of this relative std in (0, 0.28], "
      "reconstructed from the run's snapshots (ckpt.phema_every), instead of the export's EMA")
    a("--controls", default="heldout", choices=["heldout", "square"], help="runs with size/crop/flip controls: "
      "'heldout': row i %% n's original size, centre crop, no flip; 'square': an uncropped R x R original (with "
      "--width / --height: an uncropped original of that shape)")
    a("--width", type=int, default=None, help="a run with data.buckets: sample and score one of its buckets, "
      "width x height pixels, against the reference images of that bucket; default: the one with the most of them")
    a("--height", type=int, default=None, help="see --width")
    a("--aspect_ratio", default=None, help="instead of --width and --height: the run's bucket nearest this "
      "width / height ('3:2' or 1.5)")
    a("--prompts", default=None, help="text models: 'reference' (sample i: reference row i %% R's caption; the "
      "default against a captioned dataset split: the text protocol, docs/evaluation.md), 'heldout' (the held-out "
      "rows' captions; the default otherwise) or a captions file (one per line)")
    reference.add_arguments(p)  # --reference, --reference_split, ..., --stats_cache, --mode
    a("--inception_weights", default=None, help="a local inception-2015-12-05.pt (offline clusters)")
    a("--features", default="inception", help="'inception', 'classifier' (--classifier's features: FD, KID, "
      "precision, recall named fd_classifier_N, kd_classifier_N, ...: never FID), 'clip' (--clip_model's image "
      "embeddings: fd_clip_N, ...) or module:factory, returning a feature_fn")
    a("--classifier", default=None, help="a folder from tools/classifier.py: the class accuracy of the samples "
      "(sample i asks for class i %% num_classes; in the text protocol, its reference row's class), beside the "
      "classifier's own accuracy on real test images")
    a("--dino", nargs="?", const=DINO_DEFAULT, default=None, help="also FD-DINOv2 (and precision/recall/density/"
      f"coverage) on DINOv2 features: a transformers Dinov2Model hub id or folder; bare --dino: {DINO_DEFAULT}")
    a("--clip_model", default=CLIP_DEFAULT, help="hub id or local path (tools/clip.py's folder): CLIP score, "
      "retrieval in the text protocol, --features clip; 'none' to skip")
    a("--adm_npz", default=None, help="also write the samples as uint8 NHWC 'arr_0' for ADM's evaluator")
    a("--generate_only", action="store_true", help="write the PNGs and stop (score later, anywhere)")
    a("--mixed_precision", default=None, choices=["no", "fp16", "bf16"],
      help="default: the run's train.mixed_precision")
    a("--untuned", action="store_true", help="ignore RUN/tuned.json (tools/tune.py): the run's own settings")
    return p


def passed_on(mine, when):
    """--help's list (an epilog) of the eval_fid.py options that a tool calling eval_fid.py passes on as they are:
    all but the tool's own `mine` (and --help)."""
    rows = [(", ".join(a.option_strings), (a.help or "").replace("%%", "%")) for a in parser()._actions
            if a.option_strings and not (mine | {"-h"}) & set(a.option_strings)]
    return f"passed on to eval_fid.py {when}, as they are:\n" + "\n".join(f"  {o:26} {h}" for o, h in rows)


def scored_as(report):
    """What a report measured besides its samples (generation.json holds those): its reference (the statistics'
    key), the sample count, clean-fid's mode, the feature network, the classifier, DINOv2's and CLIP's models."""
    ref = report.get("reference") or {}
    return json.loads(json.dumps({
        "reference": {k: v for k, v in ref.items() if k not in ("stats", "key_sha256", "stats_sha256", "images")},
        "num_samples": report.get("num_samples"), "mode": report.get("mode"),
        "feature_extractor": report.get("feature_extractor"), "clip_model": report.get("clip_model"),
        "classifier": (report.get("classifier") or {}).get("path"), "dino": (report.get("dino") or {}).get("model")}))


def check_report(path, scoring):
    """An evaluation never overwrites another: report.json at `path` may be replaced only by one that measured the
    same (scored_as); else a ConfigError naming what differs, before any sampling."""
    if not path.is_file():
        return
    old = scored_as(json.loads(path.read_text()))
    diff = [f"reference {k} {old['reference'].get(k)!r} -> {scoring['reference'].get(k)!r}"
            for k in sorted({*old["reference"], *scoring["reference"]})
            if old["reference"].get(k) != scoring["reference"].get(k)]
    diff += [f"{k} {old[k]!r} -> {v!r}" for k, v in scoring.items() if k != "reference" and old[k] != v]
    if diff:
        raise config.ConfigError(f"{path} is the report of another evaluation of these samples ({'; '.join(diff)}): "
                                 f"give another --out_dir, or move that report away")


# ----------------------------------------------------------------------------------------------------------
# The run's own sampler: its trainer's generate(model, noise, cond, cfg, steps, guidance_scale, sampler, ...).


def method_of(cfg):
    """The trainer of this run (flow-matching configs have objective.time_sampling: curves.method_of)."""
    return {"flow_matching": train_flow_matching, "ddpm": train_ddpm}[curves.method_of(cfg)]


# ----------------------------------------------------------------------------------------------------------


def main(argv=None, feature_fn=None, written_by="eval_fid.py"):
    """Returns the report (None with --generate_only, and on ranks other than the main one). written_by: the program
    that ran it, recorded in the report (tools/tune.py's and tools/phema.py's choose a setting, never score one)."""
    args = tuned_defaults(parse_args(argv))  # RUN/tuned.json's setting where no flag gives one
    t_start = time.time()

    # ---- Model and settings ---------------------------------------------------------------------------------
    model, cfg, model_desc = sampling.load_model(args.run, args.checkpoint, args.weights, args.phema_std)
    args.reference_split, split_note = reference.reference_split(args, cfg)  # a test split that is the training one
    args.shape, bucket_note = reference.scored_bucket(cfg, args)  # data.buckets: the bucket scored (None: square)
    ref_rows = captions.protocol_rows(args, cfg)  # a text run against a captioned split: the text protocol, else None
    if ref_rows is not None:  # sample i: row i % R's caption; one sample per reference image unless told
        args.prompts, args.num_samples = captions.REFERENCE, captions.sample_count(args.num_samples, ref_rows)
    args.num_samples = args.num_samples or 50_000
    precision = args.mixed_precision or cfg["train"]["mixed_precision"]  # sampled at the run's precision
    # cpu=True without CUDA, as in the trainers: `accelerate launch --multi_gpu` then runs CPU processes over gloo.
    accelerator = common.make_accelerator(precision)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    model.to(device)
    steps, sampler = args.steps or cfg["val"]["steps"], args.sampler or cfg["val"]["sampler"]
    interval = args.guidance_interval or cfg["val"].get("guidance_interval", [0.0, 1.0])
    guidance = cfg["val"]["guidance_scale"] if args.guidance_scale is None else args.guidance_scale
    control_guidance = (cfg["val"].get("control_guidance_scale", 0.0) if args.control_guidance_scale is None
                        else args.control_guidance_scale)
    if note := meanflow.sampling_note(cfg["objective"], sampler, steps, guidance):  # e.g. a run's Euler from before
        accelerator.print(f"note: a MeanFlow model sampled otherwise: {note}")
    is_text, n_tag = bool(cfg["encoders"]["text_encoder"]), size_tag(args.num_samples)
    weights = f"{Path(args.checkpoint).name}-{args.weights}" if args.checkpoint else "export-ema"
    weights = weights if args.phema_std is None else f"{weights}-phema{args.phema_std:g}"
    cg = f"-cg{control_guidance:g}" if control_guidance else ""
    gi = f"-gi{interval[0]:g}-{interval[1]:g}" if list(interval) != [0, 1] else ""
    tag = f"{weights}-{sampler}{steps}-g{guidance:g}{cg}{gi}-seed{args.seed}" + (
        f"-{args.shape[0]}x{args.shape[1]}" if args.shape else "") + reference.reference_tag(args, cfg)
    out_dir = Path(args.out_dir or Path(args.run) / "eval" / tag)
    samples_dir = out_dir / "samples"
    prompts = list(ref_rows[cfg["data"]["caption_column"]]) if ref_rows is not None else \
        load_prompts(args.prompts, cfg) if is_text else None
    settings = {  # everything that decides the images; recorded with them and in the report
        "model": {"run": str(args.run), **model_desc, "method": method_of(cfg).__name__},
        "sampler": sampler, "steps": steps, "guidance_scale": guidance, "control_guidance_scale": control_guidance,
        "guidance_interval": list(interval),
        "controls": args.controls if cfg["conditioning"]["controls"] else None, "mixed_precision": precision,
        **({"shape": list(args.shape)} if args.shape else {}),
        "seeds": {"seed": args.seed, "batch_size": args.batch_size, "noise": "sample i: seed_for(seed, 0, i)",
                  "sampler_rng": "batch starting at sample i: seed_for(seed, 1, i)"},
        "conditioning": ({"prompts": args.prompts or "heldout", "num_prompts": len(prompts),
                          "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
                          **({"sample_i": f"reference row i % {len(ref_rows)}'s caption ({captions.PROMPTS})"}
                             if ref_rows is not None else {})}
                         if is_text else {"labels": "i % num_classes", "num_classes": cfg["data"]["num_classes"]})}
    judge, labels = None, None  # the evaluation classifier and its record (test accuracy), loaded now: a wrong path
    if args.classifier and not args.generate_only:  # fails before sampling; a text run's classes are its rows'
        judge = classifier.load(args.classifier, device)
        if is_text:
            labels = captions.row_labels(ref_rows, judge[1], args.classifier, judge[0].config.num_labels)
    if args.features == "classifier" and judge is None and not args.generate_only:
        raise ValueError("--features classifier needs --classifier FOLDER (tools/classifier.py)")
    if feature_fn is None and not args.generate_only:  # a missing Inception file fails now, not after sampling
        if args.features == "classifier":
            feature_fn = classifier.feature_fn(judge[0], device)
        elif args.features == "clip":
            if args.clip_model == "none":
                raise config.ConfigError("--features clip reads the image embeddings of --clip_model: name one")
            feature_fn = clip_features(args.clip_model, device)
        elif args.features != "inception":
            module, factory = args.features.split(":")
            feature_fn = getattr(importlib.import_module(module), factory)()
        else:
            feature_fn = inception_features(args.mode, args.inception_weights, device, accelerator)
    dino_fn = None
    if args.dino and not args.generate_only:  # as early: a missing DINOv2 or a reference it cannot use
        check_dino_reference(args.reference or "")
        dino_fn = dinov2_features(args.dino, device, accelerator)
    if bucket_note:
        accelerator.print(bucket_note)
    warnings = [split_note] if split_note else []  # and the covariances against the feature dimension
    feature_name, use_clip = getattr(feature_fn, "name", "custom"), is_text and args.clip_model != "none"
    clip_fn = text = own = None  # the evaluation CLIP, each caption's text embedding: loaded before any sampling
    if use_clip and not args.generate_only:
        clip_fn = feature_fn if getattr(feature_fn, "path", None) == str(args.clip_model) and \
            getattr(feature_fn, "tag", None) == "clip" else clip_features(args.clip_model, device)
        text, own = captions.caption_embeddings(clip_fn, prompts)
    parts = captions.groups(ref_rows) if ref_rows is not None else None  # "": all rows, then each part's
    if feature_fn is not None:
        dim = feature_fn([np.zeros((cfg["data"]["resolution"],) * 2 + (3,), np.uint8)]).shape[1]
        n_ref = reference_size(args, cfg, feature_name)
        warnings += [w for w in [fid_size_warning(n_ref, args.num_samples, dim, feature_tag(feature_fn))] if w]
        warnings += captions.part_warnings(parts, args.num_samples, dim, feature_tag(feature_fn)) if parts else []
        check_report(out_dir / "report.json", scored_as({
            "reference": reference.key_of(args, cfg, feature_name), "num_samples": args.num_samples, "mode": args.mode,
            "feature_extractor": feature_name, "clip_model": args.clip_model if use_clip else None,
            "classifier": judge and {"path": args.classifier}, "dino": dino_fn and {"model": args.dino}}))
    for w in warnings:
        accelerator.print(f"warning: {w}")
    record = out_dir / "generation.json"  # PNGs made with other settings are never silently reused
    if record.exists() and json.loads(record.read_text()) != json.loads(json.dumps(settings)):
        raise config.ConfigError(f"{out_dir} holds samples made with other settings ({record}); use another --out_dir")
    samples_dir.mkdir(parents=True, exist_ok=True)  # only now: a run stopped above leaves no empty folder
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record.write_text(json.dumps(settings, indent=1))
        if ref_rows is not None:  # sample i's caption is line i % R: --prompts FILE with it makes the same images
            (out_dir / captions.PROMPTS).write_text("".join(f"{p}\n" for p in prompts))

    # ---- Generation: this rank's batches; a batch already on disk is skipped (resume) ----------------------
    vae = load_encoders(config.Config({"vae": cfg["encoders"]["vae"], "text_encoder": None}), device)[0]
    cond = make_condition(cfg, model, prompts, device, make_controls(cfg, args.controls, args.shape))
    batches, nfe = common.my_batches(args.num_samples, args.batch_size, rank, world), [0, 0]  # evaluations, samples
    for idx in progress(batches, "generate", accelerator.is_local_main_process):
        if all(png_path(samples_dir, i).exists() for i in idx):
            continue
        with accelerator.autocast(), common.counting_evaluations(model) as rows:
            images = sampling.sample_batch(method_of(cfg).generate, model, cfg, cond, idx, args.seed, steps, guidance,
                                           sampler, vae, control_guidance, interval, args.shape)
        nfe = [nfe[0] + rows[0], nfe[1] + len(idx)]
        for i, img in zip(idx, images):  # PNG: lossless; written atomically, so a resumed run can trust it
            Image.fromarray(img).save(png_path(samples_dir, i).with_suffix(".tmp"), format="PNG")
            os.replace(png_path(samples_dir, i).with_suffix(".tmp"), png_path(samples_dir, i))
    accelerator.wait_for_everyone()
    del model, vae
    if args.generate_only:
        accelerator.print(f"{args.num_samples} samples in {samples_dir}")
        return None

    # ---- Features of the samples (and CLIP scores), then the reference statistics --------------------------
    pairs, clip_pairs, dino_pairs, judged = [], [], [], []
    for idx in progress(batches, "features", accelerator.is_local_main_process):
        images = [read_png(samples_dir, i) for i in idx]
        pairs += zip(idx, feats := feature_fn(images))
        if judge is not None:  # 1 where the classifier sees the class that sample i asked for (i % K; its row's)
            wanted = labels[np.array(idx) % len(labels)] if labels is not None else [
                i % cfg["data"]["num_classes"] for i in idx]
            judged += zip(idx, classifier.hits(judge[0], images, wanted, device, judge[1].get("resolution"))[:, None])
        if dino_fn is not None:
            dino_pairs += zip(idx, dino_fn(images))
        if use_clip:  # CLIP score, and its caption's rank among the distinct captions (sample i: prompt i % P)
            emb = feats if clip_fn is feature_fn else clip_fn(images)
            clip_pairs += zip(idx, captions.clip_rows(emb, text, own[np.array(idx) % len(own)]))
    feats = common.gathered(pairs)
    key, ref = reference_for(args, cfg, feature_fn, accelerator)
    real = None  # a bucket's real reference images: the classifier's accuracy there, the samples' bound at that shape
    if judge is not None and args.shape and accelerator.is_main_process and ref_rows is None:
        real = classifier.reference_accuracy(judge[0], key, cfg, device, judge[1].get("resolution"))

    # ---- Metrics, ADM export, report ------------------------------------------------------------------------
    per = {"clip": common.gathered(clip_pairs) if use_clip else None,  # on every rank, also one without a batch
           "hits": common.gathered(judged) if judge is not None else None}
    samples = real_images = None
    shown = set()  # the text protocol's metrics, printed as its table
    if ref_rows is None:
        metrics = all_scores(feats, ref, args.mode, args.num_samples, feature_tag(feature_fn), device)
        if judge is not None:
            metrics[f"class_accuracy_{n_tag}"] = float(per["hits"].mean())
        if use_clip:
            metrics[f"clip_score_{n_tag}"] = float(per["clip"][:, 0].mean())
    else:  # the text protocol: each group's scores, and real images' beside them under the same names (captions.py)
        floor, floor_note = captions.training_floor(key, cfg, ref_rows, parts, feature_fn, accelerator, args)
        real_clip = reference_for(args, cfg, clip_fn, accelerator)[1]["feats"] if use_clip else None
        real_per = {"clip": None if real_clip is None else captions.clip_rows(real_clip, text, own), "hits": None if
                    judge is None else classifier.reference_hits(judge[0], key, cfg, captions.label_column(judge[1]),
                                                                 device, judge[1].get("resolution"))}
        samples = captions.sample_scores(feats, ref, parts, per, args.mode, feature_tag(feature_fn), device)
        real_images = captions.real_scores(floor, ref, parts, real_per, args.mode, feature_tag(feature_fn), device)
        metrics = captions.flat(samples, args.num_samples, len(ref_rows), parts)
        shown = set(metrics)
    if ref["feats"] is None:
        accelerator.print(f"{ref['path']} has no features: no KID, precision, recall, density or coverage")
    dino_ref = None
    if dino_fn is not None:
        dino_ref = reference_for(args, cfg, dino_fn, accelerator)[1]
        metrics.update(dino_scores(common.gathered(dino_pairs), dino_ref, args.num_samples, device))
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return None
    if args.adm_npz:  # the sample batch that ADM's evaluator.py reads (Dhariwal & Nichol 2021)
        np.savez(args.adm_npz, arr_0=np.stack([read_png(samples_dir, i) for i in range(args.num_samples)]))
    import importlib.metadata as md

    if ref_rows is not None:  # each sample's row, caption, part, class and scores; what the protocol read
        captions.write_per_sample(out_dir / captions.PER_SAMPLE, ref_rows, parts, prompts, args.num_samples, per,
                                  labels)
        protocol = {"real": captions.flat(real_images, args.num_samples, len(ref_rows), parts),
                    "text_protocol": captions.record(ref_rows, parts, prompts, args.num_samples, floor_note)}
    report = {
        "metrics": metrics, **(protocol if ref_rows is not None else {}), "num_samples": args.num_samples, **settings,
        "nfe_per_sample": nfe[0] / nfe[1] if nfe[1] else None,  # network evaluations (this rank's new samples)
        "clip_model": args.clip_model if use_clip else None,
        "reference": {**key, "stats": ref["path"], "key_sha256": ref["key_sha256"], "stats_sha256": ref["sha256"],
                      "images": None if ref["feats"] is None else len(ref["feats"])},  # the rows its statistics rest on
        "mode": args.mode, "feature_extractor": feature_name, "feature_weights": getattr(feature_fn, "path", None),
        "feature_weights_sha256": getattr(feature_fn, "sha256", None), "samples_dir": str(samples_dir),
        "dino": None if dino_ref is None else {"model": args.dino, "stats": dino_ref["path"],
                                               "key_sha256": dino_ref["key_sha256"],
                                               "stats_sha256": dino_ref["sha256"]},
        "classifier": None if judge is None else {"path": args.classifier, **judge[1], "bucket_reference": real},
        "adm_npz": args.adm_npz, "warnings": warnings, "written_by": written_by, "reference_count": n_ref,
        "num_processes": world, "seconds": round(time.time() - t_start, 1),
        "versions": {"python": platform.python_version(), **{p: md.version(p) for p in (
            "torch", "diffusers", "transformers", "accelerate", "clean-fid", "numpy", "scipy", "pillow")}},
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "config": cfg,
    }
    (path := out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    lines = captions.table(samples, real_images, parts, args.num_samples) if ref_rows is not None else []
    table = {**{k: f"{v:.4f}" for k, v in metrics.items() if k not in shown},
             "model": f"{model_desc['source']} ({weights})",
             "sampler": f"{sampler}, {steps} steps, guidance {guidance:g} in t {interval}",
             "reference": key["source"], "report": path}
    if judge is not None:
        table["classifier"] = (f"{args.classifier}: {judge[1]['test_accuracy']:.4f} on real "
                               f"'{judge[1]['test_split']}' images")
        if real is not None:  # beside the samples' class accuracy at this bucket: the real images' of the same bucket
            table["classifier"] += (f"; {real['accuracy']:.4f} on the {real['images']} real reference images of the "
                                    f"{args.shape[0]}x{args.shape[1]} bucket, read as its samples are")
    print("\n".join([*lines, *(f"{k:<{max(map(len, table)) + 1}} {v}" for k, v in table.items())]))
    accelerator.wait_for_everyone()
    return report


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, config.ConfigError) as e:  # a missing file or source: its one line, no traceback
        sys.exit(f"eval_fid.py: {e}")
