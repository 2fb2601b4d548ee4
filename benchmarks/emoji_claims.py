"""Feeds docs/benchmarks/emoji_claims.md (the paper's text-to-image claims on real captions).

The two rows of docs/paper.md's claims table that only text-to-image can answer (issue 70), on the emoji recipe
(configs/emoji.json: flow matching in the latents of an autoencoder made here, a CLIP made here) by the text protocol
(docs/evaluation.md, "Real captions"). The analysis and its rules were written before any run
(docs/benchmarks/emoji_claims.md). Every stage resumes: a finished run or score is skipped, an interrupted trainer
continues from its newest checkpoint.

  data    the emoji's three splits, each image box-downsampled to a native side drawn uniformly in SIDES (seeded per
          split) and kept at that side, as parquet files (OUT/data/mixed_sizes): the trainer upsamples every image to
          64 px and its size control reads the true side, so the size is a real signal (as paper_claims.py's data)
  run     ARM SEED: the recipe on that data with the size control; ARMS: adanorm (the paper's baseline),
          disentangled (its conditioning, with its noisy replicate padding), zero_padding (disentangled with zeros
          at the padded text positions: the padding claim's baseline)
  score   ARM SEED: the protocol on the test split at GUIDANCE and STEPS (eval_fid.py); the size check and the
          padding probe into RUN/checks.json
  report  OUT/report.md: each arm's scores, the two pre-registered verdicts, the secondary contrasts

    python benchmarks/emoji_claims.py data --out runs/emoji_claims
    python benchmarks/emoji_claims.py run disentangled 0 --out runs/emoji_claims     # 3 arms x 5 seeds
    python benchmarks/emoji_claims.py score disentangled 0 --out runs/emoji_claims
    python benchmarks/emoji_claims.py report --out runs/emoji_claims

It needs the emoji recipe's tools (python benchmarks/emoji.py prepare). Arguments past the stage's own go to every
trainer run (a scaled-down run: --train.max_steps=20 ...).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval_fid  # noqa: E402
import train_flow_matching  # noqa: E402
from benchmarks import emoji as recipe_campaign  # noqa: E402
from benchmarks.control_ablation import layout_change, sharpness, sized_box, unrelated_of  # noqa: E402
from benchmarks.paper_claims import conditioning_verdict, sign_verdict  # noqa: E402
from tools.compare import t_interval  # noqa: E402

SIDES = (16, 64)  # native sides, uniform; the recipe's 64 px is the largest (a 4x range, as paper_claims' 8-28 px)
PADDING_OFF = ["--conditioning.replicate_padding=false", "--conditioning.zero_padding=true"]
ARMS = {"adanorm": ["--conditioning.mode=adanorm"], "disentangled": ["--conditioning.mode=disentangled"],
        "zero_padding": ["--conditioning.mode=disentangled", *PADDING_OFF]}
SEEDS = (0, 1, 2, 3, 4)
# The sampling setting of every score: the one tools/tune.py chose for the recipe on its validation captions
# (docs/benchmarks/emoji.md, fm_latent seed 0), fixed before these runs; no arm is tuned on its own
GUIDANCE, STEPS = 3.0, 40
PAPER_EFFECT = -0.08  # the paper's FD change from its conditioning on CC12M at 256 px
CHECK_CAPTIONS = 64  # the size check and the padding probe: test captions, each from 2 noises
PROBE_LEVELS = (0.9, 0.5, 0.2)  # noise levels t (1 = pure noise) where the guidance direction is measured
METRICS = [("fd_clip", ""), ("fd_clip", "_recombination"), ("fd_clip", "_new"), ("clip_score", ""),
           ("retrieval_top5", ""), ("retrieval_top5", "_recombination"), ("class_accuracy", "")]
CHECKS = ["sharpness_ratio", "layout_change", "guidance_gap_short", "guidance_gap_long", "clip_score_short",
          "clip_score_long", "top5_short", "top5_long"]


def data_folder(args):
    return Path(args.out) / "data" / "mixed_sizes"


def run_dir(args, arm, seed):
    return Path(args.out) / f"{arm}_s{seed}"


def arm_args(args, arm):
    return [f"--data.source={data_folder(args).resolve()}", '--conditioning.controls=["size"]', *ARMS[arm]]

# ----------------------------------------------------------------------------------------------------------
# Data and runs.


def data_stage(args):
    """Each split of the emoji at mixed native sizes, as OUT/data/mixed_sizes/SPLIT-00000-of-00001.parquet; the
    sides drawn are recorded in sides.json. Written once."""
    import datasets
    from PIL import Image

    import common
    from training.data import emoji
    from training.sharing import public

    if not common.interactive():
        datasets.disable_progress_bars()  # a log file: one plain line a split, not a bar redrawn
    folder = data_folder(args)
    folder.mkdir(parents=True, exist_ok=True)
    # the images' terms, which the model card of every run on this folder copies (public.licence_lines)
    (folder / public.LICENCES).write_text("\n".join(emoji.LICENCES) + f", then box-downsampled to a side drawn "
                                              f"in {SIDES[0]}-{SIDES[1]} px\n")
    if (folder / "sides.json").is_file():
        print(f"{folder}: made")
        return
    record = {}
    for seed, split in enumerate(("train", "validation", "test")):
        ds = emoji.load(split, emoji.folder_of(args.source))
        sides = np.random.default_rng(seed).integers(SIDES[0], SIDES[1] + 1, len(ds))
        ds = ds.map(lambda row, i: {"image": row["image"].resize((int(sides[i]),) * 2, Image.BOX)}, with_indices=True)
        ds.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
        record[split] = {"images": len(ds), "mean_side": float(sides.mean()), "sides": [int(s) for s in sides]}
        print(f"{split}: {len(ds)} images at native sides {SIDES[0]}-{SIDES[1]} px (mean {sides.mean():.1f})")
    (folder / "sides.json").write_text(json.dumps(record))
    print(f"{folder}: " + ", ".join(f"{k} {v['images']} images (mean side {v['mean_side']:.1f} px)"
                                    for k, v in record.items()))


def run(args):
    recipe_campaign.train(run_dir(args, args.arm, args.seed), "flow_matching", arm_args(args, args.arm), args,
                          args.seed)

# ----------------------------------------------------------------------------------------------------------
# Scores: the protocol, then what each claim needs beside it (RUN/checks.json).


def score(args):
    run_folder = run_dir(args, args.arm, args.seed)
    out = run_folder / "eval" / "test"
    if not (out / "report.json").is_file():
        eval_fid.main(["--run", str(run_folder), "--out_dir", str(out), "--reference_split", "test", "--untuned",
                       "--guidance_scale", str(GUIDANCE), "--steps", str(STEPS), *recipe_campaign.protocol(args)])
    if not (run_folder / "checks.json").is_file():
        (run_folder / "checks.json").write_text(json.dumps(checks(run_folder)))
    print(json.dumps(json.loads((run_folder / "checks.json").read_text())))


@torch.no_grad()
def checks(run_folder):
    """The size check (the manipulation check of the conditioning claim) and the padding probe (what the padding
    changes in the trained model), on CHECK_CAPTIONS test captions spread over the protocol's, each from two
    noises: samples at GUIDANCE and STEPS asked for 64 and for 16 px; the guidance direction at PROBE_LEVELS; the
    protocol's per-sample scores split by caption length."""
    from training.config import config
    from training.data.encoders import decode, encode_text, load_encoders
    from training.evaluation.generation import noise_shape
    from training.model.mmdit import load_exported

    model, cfg = load_exported(run_folder / "export")
    vae, tokenizer, text_encoder = load_encoders(config.Config(cfg["encoders"]), torch.device("cpu"))
    prompts = (run_folder / "eval" / "test" / "prompts.txt").read_text().splitlines()
    picked = prompts[::max(1, len(prompts) // CHECK_CAPTIONS)][:CHECK_CAPTIONS]
    text = encode_text(tokenizer, text_encoder, [c for c in picked for _ in range(2)], cfg["encoders"]["max_tokens"])
    n = len(text["text_tokens"])
    noise = torch.randn((n, *noise_shape(cfg, model.transformer)), generator=torch.Generator().manual_seed(0))
    latents, images = {}, {}
    for side in reversed(SIDES):
        latents[side] = train_flow_matching.generate(model, noise, at_side(text, side), cfg, steps=STEPS,
                                                     guidance_scale=GUIDANCE)
        images[side] = decode(vae, latents[side]).clamp(-1, 1)
    hi, lo = images[SIDES[1]], images[SIDES[0]]
    same_caption = torch.arange(len(picked)).repeat_interleave(2)  # "unrelated": the same caption, the other noise
    lengths = text["text_mask"].sum(1)
    short = lengths <= lengths.median()
    gap = guidance_gap(model, latents[SIDES[1]], at_side(text, SIDES[1]))
    out = {"sharpness_ratio": sharpness(hi) / sharpness(lo),
           "layout_change": layout_change(hi, lo, unrelated_of(hi, same_caption)),
           "guidance_gap_short": gap[short].mean().item(), "guidance_gap_long": gap[~short].mean().item(),
           "median_tokens": lengths.median().item()}
    return {**out, **by_length(run_folder / "eval" / "test" / "per_sample.jsonl", tokenizer, cfg, out["median_tokens"])}


def at_side(text, side):
    """The conditions of text features asked for an uncropped side x side original (the size control)."""
    sides = torch.full((len(text["text_tokens"]),), side)
    return {**text, "orig_hw": torch.stack([sides, sides], 1), "crop_box": sized_box(sides),
            "drop": torch.zeros(len(sides), dtype=torch.bool)}


def guidance_gap(model, x0, cond):
    """Per sample, the guidance direction's size relative to the unconditional prediction, averaged over
    PROBE_LEVELS: |m(x_t, c) - m(x_t, null)| / |m(x_t, null)| on x_t = (1 - t) x0 + t noise (flow matching's path),
    x0 the model's own samples. What classifier-free guidance multiplies: a model that reads little from a caption
    has a small gap."""
    gaps = []
    for k, level in enumerate(PROBE_LEVELS):
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(100 + k))
        x, t = (1 - level) * x0 + level * noise, torch.full((len(x0),), 1000.0 * level)
        conditional = model(x, t, cond).float()
        unconditional = model(x, t, {**cond, "drop": torch.ones_like(cond["drop"])}).float()
        gaps.append((conditional - unconditional).flatten(1).norm(dim=1) / unconditional.flatten(1).norm(dim=1))
    return torch.stack(gaps).mean(0)


def by_length(per_sample, tokenizer, cfg, median):
    """The protocol's CLIP score and top-5 retrieval of every test sample, for captions of at most `median` tokens
    (start and end included) and for longer ones."""
    from training.data.encoders import tokenize

    rows = [json.loads(line) for line in Path(per_sample).read_text().splitlines()]
    lengths = tokenize(tokenizer, [r["caption"] for r in rows], cfg["encoders"]["max_tokens"])[1].sum(1).numpy()
    out = {}
    for name, keep in (("short", lengths <= median), ("long", lengths > median)):
        picked = [r for r, k in zip(rows, keep) if k]
        out[f"clip_score_{name}"] = float(np.mean([r["clip_score"] for r in picked]))
        out[f"top5_{name}"] = float(np.mean([r["caption_rank"] <= 5 for r in picked]))
    return out

# ----------------------------------------------------------------------------------------------------------
# Report: the rules of docs/benchmarks/emoji_claims.md, on whatever seeds are scored.


def scores(out):
    """{arm: {seed: {metric: value}}} of the scored runs: the protocol's metrics (metric + part) and the checks."""
    found = {}
    for arm in ARMS:
        for seed in SEEDS:
            run_folder = Path(out) / f"{arm}_s{seed}"
            if not (run_folder / "checks.json").is_file():
                continue
            report = json.loads((run_folder / "eval" / "test" / "report.json").read_text())
            row = {m + p: recipe_campaign.value(report, m, p) for m, p in METRICS}
            row.update(json.loads((run_folder / "checks.json").read_text()))
            cpu = run_folder / "cpu_seconds.json"
            row["train_cpu_s"] = json.loads(cpu.read_text())["train"] if cpu.is_file() else float("nan")
            found.setdefault(arm, {})[seed] = row
    return found


def paired(found, a, b, metric):
    """Per seed both arms have: metric(a) - metric(b)."""
    seeds = sorted(set(found.get(a, {})) & set(found.get(b, {})))
    return np.array([found[a][s][metric] - found[b][s][metric] for s in seeds]), seeds


def verdicts(found):
    """The two pre-registered verdicts: {claim: sentence}."""
    seeds = sorted(set(found.get("adanorm", {})) & set(found.get("disentangled", {})))
    out = {}
    if len(seeds) < 2:
        out["conditioning"] = f"not settled: {len(seeds)} seed(s) of both arms"
    else:
        relative = [found["disentangled"][s]["fd_clip"] / found["adanorm"][s]["fd_clip"] - 1 for s in seeds]
        learnt = all(t_interval([found[arm][s]["sharpness_ratio"] for s in seeds])[1] > 1
                     for arm in ("adanorm", "disentangled"))
        out["conditioning"] = conditioning_verdict(relative, learnt, PAPER_EFFECT)
    difference, seeds = paired(found, "disentangled", "zero_padding", "fd_clip")
    out["padding"] = (f"not settled: {len(seeds)} seed(s) of both arms" if len(seeds) < 2 else
                      sign_verdict(difference, "noisy replicate padding lowers FD against zero padding"))
    return out


def cell(values, digits=3):
    mean, low, high = t_interval(values)
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]" if len(values) > 1 else f"{mean:.{digits}f}"


def report(args):
    found = scores(args.out)
    names = [m + p for m, p in METRICS] + CHECKS + ["train_cpu_s"]
    lines = ["# The paper's text-to-image claims on the emoji", "", "Written by benchmarks/emoji_claims.py report; "
             "the analysis and its rules: docs/benchmarks/emoji_claims.md.", "",
             f"Every arm sampled at guidance {GUIDANCE:g}, {STEPS} steps; in brackets the seeds' 95% t-interval.", "",
             "| metric | " + " | ".join(f"{a} ({len(found.get(a, {}))} seeds)" for a in ARMS) + " |",
             "| --- |" + " --- |" * len(ARMS)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(cell([r[name] for r in found[a].values()]) if found.get(a) else ""
                                                 for a in ARMS) + " |")
    lines += ["", "## Verdicts (primary: FD in the evaluation CLIP's features, all test captions)", ""]
    lines += [f"- {claim}: {said}" for claim, said in verdicts(found).items()]
    lines += ["", "## Secondary contrasts (paired by seed; no verdict of their own)", "",
              "| contrast | metric | difference | seeds |", "| --- | --- | --- | --- |"]
    for a, b in (("disentangled", "adanorm"), ("disentangled", "zero_padding")):
        for name in names:
            difference, seeds = paired(found, a, b, name)
            if len(seeds) > 1:
                lines.append(f"| {a} - {b} | {name} | {cell(difference, 4)} | {', '.join(map(str, seeds))} |")
    (Path(args.out) / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("stage", choices=["data", "run", "score", "report"])
    p.add_argument("arm", nargs="?", choices=list(ARMS))
    p.add_argument("seed", nargs="?", type=int)
    p.add_argument("--out", default="runs/emoji_claims")
    p.add_argument("--source", default="emoji", help='the emoji packages (data.source: "emoji" or "emoji:FOLDER")')
    args, args.extra = p.parse_known_args(argv)
    if args.stage in ("run", "score") and (args.arm is None or args.seed is None):
        p.error(f"{args.stage} takes an arm ({', '.join(ARMS)}) and a seed")
    {"data": data_stage, "run": run, "score": score, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
