"""Sample a trained run: chosen classes or prompts -> a labelled grid and single PNGs.

    python sample.py --run runs/flow_matching_demo --classes "red circle,blue square,7"
    python sample.py --run runs/flow_matching_cc12m --prompts prompts.txt --guidance_scale 4 --steps 50
    python sample.py --run runs/flow_matching_emoji --prompt "a red apple" --prompt "maldives flag"
    python sample.py --run runs/ddpm_imagenet256 --checkpoint latest --classes "tench,n01443537,2" --per_class 8

Pipeline: arguments -> model (the run's export, or a checkpoint's EMA or raw weights, as eval_fid.py loads
them) -> conditions (class ids or names, or a text file of prompts encoded by the run's own text encoder) ->
samples (the run's own sampler, `generate` of its trainer, through sampling.sample_batch: image i has the
noise seed_for(seed, 0, i), so the same command gives the same images, and image i is eval_fid.py's sample i
when its condition is the same) -> out/grid.png (one row per class or prompt, labelled), out/grid.txt,
out/NNNN_<label>.png and out/sample.json (the settings); a second call to the same out replaces it whole.
"""
import argparse
import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import train_ddpm
import train_flow_matching
from training.config import config
from training.data.buckets import default_shape, shape_arg, shape_note
from training.data.classes import readable_names
from training.data.encoders import encode_text, load_encoders
from training.evaluation import generation, sampling
from training.evaluation.tuning import tuned_defaults
from training.objectives import meanflow
from training.record import curves, runlog

# ----------------------------------------------------------------------------------------------------------
# Arguments. None means "as the run was configured".


def parse_args(argv=None):
    a = (p := argparse.ArgumentParser(description=__doc__.split("\n")[0])).add_argument
    a("--run", required=True, help="run folder (uses run/export) or an export folder")
    a("--checkpoint", default=None, help="sample a checkpoint folder (or 'latest') instead of the export")
    a("--weights", default="ema", choices=["ema", "raw"], help="checkpoint weights; the export is always EMA")
    a("--classes", default=None, help="class runs: comma-separated class ids or names (default: every class, "
      "if there are at most 64)")
    a("--prompts", default=None, help="text runs: a text file, one prompt per line")
    a("--prompt", action="append", default=None, help="text runs: a prompt (repeat for more), after --prompts' own")
    a("--per_class", type=int, default=4, help="images per class or prompt (one grid row each)")
    a("--width", type=int, default=None, help="pixels, with --height: any shape whose sides are whole patches and fit "
      "the model's positional grid; default: data.resolution square, or a run with data.buckets its squarest bucket")
    a("--height", type=int, default=None, help="see --width")
    a("--aspect_ratio", default=None, help="instead of --width and --height, for a run with data.buckets: its bucket "
      "nearest this width / height ('3:2' or 1.5)")
    a("--guidance_scale", type=float, default=None, help="semantic guidance; default: the run's val.guidance_scale")
    a("--control_guidance_scale", type=float, default=None, help="default: the run's val.control_guidance_scale")
    a("--guidance_interval", type=sampling.interval_arg, default=None, help="'lo,hi': guide only at noise levels "
      "lo <= t <= hi (flow-matching t, 1 = noise); default: the run's val.guidance_interval")
    a("--phema_std", type=float, default=None, help="sample the post-hoc EMA of this relative std, reconstructed "
      "from the run's snapshots (ckpt.phema_every), instead of the export's EMA")
    a("--steps", type=int, default=None, help="default: the run's val.steps")
    a("--sampler", default=None,
      help="default: the run's val.sampler (flow matching: euler, heun, meanflow; DDPM: ddim, ddpm)")
    a("--seed", type=int, default=0)
    a("--batch_size", type=int, default=16)
    a("--mixed_precision", default=None, choices=["no", "fp16", "bf16"],
      help="default: the run's train.mixed_precision")
    a("--untuned", action="store_true", help="ignore RUN/tuned.json (tools/tune.py): the run's own settings")
    a("--out", default=None, help="default: <run>/sampled/<sampler><steps>-g<guidance>-seed<seed>; an earlier "
      "call's folder there is replaced whole")
    return p.parse_args(argv)


def check_out(out):
    """--out must be new, empty or an earlier call's (its sample.json): that one is replaced whole at the end,
    so two calls' images never mix; a folder of other files is refused before any work."""
    if out.is_dir() and any(out.iterdir()) and not (out / "sample.json").is_file():
        raise ValueError(f"--out {out} holds files that sample.py did not write (no sample.json): choose a new folder")


def publish(part, out):
    """Move the finished folder `part` to `out`, replacing an earlier call's folder whole."""
    if out.exists():
        check_out(out)
        shutil.rmtree(out)
    part.rename(out)

# ----------------------------------------------------------------------------------------------------------
# Conditions: which classes or prompts, and their labels.


def pick_classes(spec, num_classes, ids):
    """[(label, name)] for --classes: each comma-separated item a class index, a class id (e.g. a WordNet id)
    or a class name (its full name or its first synonym, case-insensitive)."""
    names = readable_names(ids) if ids else [f"class {k}" for k in range(num_classes)]
    if spec is None:
        if num_classes > 64:
            raise ValueError(f"this run has {num_classes} classes: choose some with --classes (ids or names)")
        return list(enumerate(names))
    lookup = {}
    for k, name in enumerate(names):
        for key in (name, name.split(",")[0], ids[k] if ids else None):
            if key:
                lookup.setdefault(key.strip().lower(), k)
    picked = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        k = int(item) if re.fullmatch(r"\d+", item) else lookup.get(item.lower())
        if k is None or not 0 <= k < num_classes:
            known = ", ".join(f"{i}: {n}" for i, n in list(enumerate(names))[:12])
            raise ValueError(f"--classes: {item!r} is not a class of this run (ids 0 .. {num_classes - 1}"
                             f"{', or names: ' + known + (' ...' if num_classes > 12 else '') if ids else ''})")
        picked.append((k, names[k]))
    return picked


def read_prompts(path):
    if path is None or not Path(path).is_file():
        raise FileNotFoundError(f"--prompts {path}: this is a text-to-image run; give a text file, one prompt per line "
                                f"(or --prompt TEXT)")
    prompts = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompts (one per line)")
    return prompts

# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def main(argv=None):
    args = tuned_defaults(parse_args(argv))  # RUN/tuned.json's setting where no flag gives one
    if args.out:
        check_out(Path(args.out))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, cfg, model_desc = sampling.load_model(args.run, args.checkpoint, args.weights, args.phema_std)
    model.to(device)
    is_text = bool(cfg["encoders"]["text_encoder"])
    if is_text and args.classes:
        raise ValueError("--classes: this is a text-to-image run; give --prompts FILE or --prompt TEXT")
    if not is_text and (args.prompts or args.prompt):
        raise ValueError(f"{'--prompts' if args.prompts else '--prompt'}: this is a class-conditional run; give "
                         f"--classes (ids or names)")

    # ---- Conditions: row r of the grid is class or prompt r, repeated --per_class times ---------------------
    if is_text:
        prompts = (read_prompts(args.prompts) if args.prompts or not args.prompt else []) + (args.prompt or [])
        rows = list(enumerate(prompts))
        tokenizer, text_encoder = load_encoders(config.Config({**cfg["encoders"], "vae": None}), device)[1:]
    else:
        rows = pick_classes(args.classes, model.conditioner.num_classes,
                            sampling.run_class_ids(args.run, args.checkpoint))
    items = [row for row in rows for _ in range(args.per_class)]
    shape = shape_arg(cfg, args.width, args.height, args.aspect_ratio)  # (width, height) in pixels
    if why := shape_note(cfg, shape, args.width, args.height, args.aspect_ratio):  # which bucket, and why
        print(why)
    controls = generation.make_controls(cfg, "square", shape)  # an uncropped, unflipped original of that shape

    def cond(idx):
        out = {"drop": torch.zeros(len(idx), dtype=torch.bool, device=device)}
        if is_text:
            out.update(encode_text(tokenizer, text_encoder, [items[i][1] for i in idx], cfg["encoders"]["max_tokens"]))
        else:
            out["label"] = torch.tensor([items[i][0] for i in idx], device=device)
        if controls is not None:
            meta = [controls(i) for i in idx]
            out.update({k: torch.stack([m[k] for m in meta]).to(device) for k in meta[0]})
        return out

    # ---- Samples: the run's own sampler; image i has its own seeded noise --------------------------------
    val = cfg["val"]
    steps, sampler = args.steps or val["steps"], args.sampler or val["sampler"]
    guidance = val["guidance_scale"] if args.guidance_scale is None else args.guidance_scale
    control_guidance = (val.get("control_guidance_scale", 0.0) if args.control_guidance_scale is None
                        else args.control_guidance_scale)
    interval = args.guidance_interval or val.get("guidance_interval", [0.0, 1.0])
    if note := meanflow.sampling_note(cfg["objective"], sampler, steps, guidance):  # e.g. a run's Euler from before
        print(f"note: a MeanFlow model sampled otherwise: {note}")
    tag = (f"{sampler}{steps}-g{guidance:g}"
           + (f"-gi{interval[0]:g}-{interval[1]:g}" if list(interval) != [0, 1] else "")
           + (f"-phema{args.phema_std:g}" if args.phema_std is not None else "") + f"-seed{args.seed}"
           + (f"-{shape[0]}x{shape[1]}" if cfg["data"].get("bucket_shapes") or shape != default_shape(cfg) else ""))
    out = Path(args.out or Path(args.run) / "sampled" / tag)
    check_out(out)
    vae = load_encoders(config.Config({"vae": cfg["encoders"]["vae"], "text_encoder": None}), device)[0]
    precision = args.mixed_precision or cfg["train"]["mixed_precision"]  # the run's, as its validation sampled
    autocast = torch.autocast(device.type, dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
                              enabled=precision != "no")
    generate = {"flow_matching": train_flow_matching, "ddpm": train_ddpm}[curves.method_of(cfg)].generate  # its own
    images = []
    for start in range(0, len(items), args.batch_size):
        idx = list(range(start, min(start + args.batch_size, len(items))))
        with autocast:
            images += list(sampling.sample_batch(generate, model, cfg, cond, idx, args.seed, steps, guidance, sampler,
                                                 vae, control_guidance, interval, shape))
        print(f"sampled {idx[-1] + 1}/{len(items)}", flush=True)

    # ---- Out: single PNGs, the labelled grid, the settings, written beside out and then moved there whole ---
    part = out.with_name(out.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)  # left by a call that died writing
    part.mkdir(parents=True)
    for i, (img, (_, label)) in enumerate(zip(images, items)):
        Image.fromarray(img).save(part / f"{i:04d}_{re.sub(r'[^A-Za-z0-9]+', '-', label).strip('-')[:60]}.png")
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    runlog.save_image_grid(pixels, part / "grid.png", nrow=args.per_class, labels=[label for _, label in items])
    settings = {"model": {"run": str(args.run), **model_desc}, "sampler": sampler, "steps": steps,
                "mixed_precision": precision, "guidance_scale": guidance, "control_guidance_scale": control_guidance,
                "guidance_interval": list(interval), "seed": args.seed, "width": shape[0], "height": shape[1],
                "shape_chosen": why or "the run's square",
                "noise": "image i: generation.seed_for(seed, 0, i)", "batch_size": args.batch_size,
                "conditions": [label for _, label in items]}
    (part / "sample.json").write_text(json.dumps(settings, indent=1))
    replaced = out.exists()
    publish(part, out)
    print(("replaced the earlier samples: " if replaced else "")
          + f"{len(items)} images in {out}; grid: {out / 'grid.png'} (labels: {out / 'grid.txt'})")
    return out


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, config.ConfigError) as e:  # a missing run, file or source: its one line, no traceback
        raise SystemExit(f"sample.py: {e}")
