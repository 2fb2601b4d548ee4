"""Feeds docs/benchmarks/emoji.md (text-to-image on real captions).

Text-to-image on the emoji's real captions (issue 69; docs/data.md, "Emoji"; the text protocol: docs/evaluation.md,
"Real captions"): both trainers in the latents of an autoencoder made here, flow matching in pixels at equal training
CPU, guidance 1 against the guidance chosen on the validation captions. The analysis and its rules were written
before any run (docs/benchmarks/emoji.md). Every stage resumes: a finished tool, run or score is skipped, an
interrupted trainer continues from its newest checkpoint.

  prepare   the recipe's tools, each once: the CLIP whose text tower conditions the runs (clips/emoji, seed 0), the
            evaluation CLIP (clips/emoji_eval, seed 1: a second CLIP, so that no sample is scored by the encoder it
            was conditioned on), the category classifier, the autoencoder (64 px colour -> 4 x 16 x 16)
  cost      the training CPU of a step of the latent and the pixel model (COST_STEPS-step runs): the pixel arm's
            steps, for the latent arm's training CPU
  run       ARM SEED: train (ARMS: fm_latent, ddpm_latent, fm_pixel)
  tune      ARM: tools/tune.py on seed 0's run, on the validation captions (never the test split): guidance and steps
  score     ARM SEED: the protocol on the test split at the arm's tuned setting and at guidance 1; the run exported
            again, so that its model card holds the scores
  report    OUT/report.md: each arm's scores with their intervals, the paired contrasts and their verdicts, the aims
  grid      the README's labelled grid: test captions, a sample of the best arm beside each real image

    python benchmarks/emoji.py prepare --out runs/emoji
    python benchmarks/emoji.py cost --out runs/emoji
    python benchmarks/emoji.py run fm_latent 0 --out runs/emoji        # 3 arms x 3 seeds
    python benchmarks/emoji.py tune fm_latent --out runs/emoji         # each arm, after its seed 0
    python benchmarks/emoji.py score fm_latent 0 --out runs/emoji
    python benchmarks/emoji.py report --out runs/emoji
    python benchmarks/emoji.py grid --out runs/emoji

The tools' folders are the recipe's own (clips/, classifiers/, autoencoders/ at the repository root, as
configs/emoji.json names them). Arguments past the stage's own go to every trainer run (a scaled-down run).
"""
import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval_fid  # noqa: E402
from benchmarks.fashion_mnist import add_cpu, cpu_seconds, step_cpu  # noqa: E402
from tools import export, tune  # noqa: E402
from tools.compare import paired_comparison, t_interval  # noqa: E402

RECIPE = ROOT / "configs" / "emoji.json"
TEXT_CLIP, EVAL_CLIP = "clips/emoji", "clips/emoji_eval"
CLASSIFIER, AUTOENCODER = "classifiers/emoji", "autoencoders/emoji"
TOOLS = {  # folder: the command that makes it (each once; its CPU recorded beside it)
    TEXT_CLIP: ["tools/clip.py", "--seed", "0"],
    EVAL_CLIP: ["tools/clip.py", "--seed", "1"],
    CLASSIFIER: ["tools/classifier.py", "--data.label_column=label"],
    AUTOENCODER: ["tools/autoencoder.py", "--channels", "16,32,64", "--batch_size", "32", "--steps", "2000",
                  "--classifier", CLASSIFIER, "--data.label_column=label"],
}
PIXELS = ["--encoders.vae=null", "--model.patch_size=8"]  # 8 x 8 patches of 64 px: the latent model's 64 tokens
ARMS = {"fm_latent": ("flow_matching", []), "ddpm_latent": ("ddpm", []), "fm_pixel": ("flow_matching", PIXELS)}
COST_STEPS = 60
SEEDS = (0, 1, 2)
# tools/tune.py's search on the 348 validation images: one sample an image per setting, then the best two on
# 5 blocks of 348 fresh samples (guidance 1 is the contrast's other arm, searched too)
TUNE = ["--guidance", "1,2,3,5", "--steps", "20,40", "--num_samples", "348", "--confirm_samples", "1740"]
METRICS = ("fd_clip", "kd_clip", "precision_clip", "recall_clip", "clip_score", "retrieval_top1", "retrieval_top5",
           "class_accuracy")
LOWER = {"fd_clip", "kd_clip"}
PARTS = ("", "_recombination", "_new")  # all test captions, then each part
AIM_FLOOR, AIM_RETRIEVAL = 3.0, 0.5  # FD within 3x the floor; top-5 retrieval at least half the real images'
GRID = ROOT / "docs" / "img" / "emoji_test_captions.png"  # the README's grid (`grid`)


# ----------------------------------------------------------------------------------------------------------
# Tools and runs: one process at a time, its CPU recorded.


def prepare(args):
    for folder, command in TOOLS.items():
        if (ROOT / folder).is_dir():
            print(f"{folder}: made ({ROOT / folder})")
            continue
        before = cpu_seconds(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, str(ROOT / command[0]), "--config", str(RECIPE), "--out", folder,
                        *command[1:]], cwd=ROOT, check=True)
        (ROOT / folder / "cpu_seconds.json").write_text(json.dumps(
            {"cpu_s": cpu_seconds(resource.RUSAGE_CHILDREN) - before, "command": command}))


def train(run, method, arm_args, args, seed):
    """Train RUN, or continue it from its newest checkpoint; skipped once it is exported. The trainer processes'
    CPU goes to RUN/cpu_seconds.json (a resumed run: the sum over them) with the steps' own CPU."""
    if (run / "export").is_dir():
        return
    before = cpu_seconds(resource.RUSAGE_CHILDREN)
    try:
        subprocess.run([sys.executable, str(ROOT / f"train_{method}.py"), "--config", str(RECIPE), f"--seed={seed}",
                        f"--run_dir={run}", "--log.wandb=off", "--resume=latest", *arm_args, *args.extra],
                       cwd=ROOT, check=True)
    finally:
        record = add_cpu(run, cpu_seconds(resource.RUSAGE_CHILDREN) - before)
    record["steps"] = step_cpu(run) * json.loads((run / "config.json").read_text())["train"]["max_steps"]
    (run / "cpu_seconds.json").write_text(json.dumps(record))


def cost(args):
    """CPU seconds per training step of the latent and the pixel model, from COST_STEPS-step runs (the trainer's
    own cpu_s_per_step: the steps alone); OUT/cost.json gives the pixel arm the latent arm's training CPU."""
    out = Path(args.out) / "cost"
    per_step = {}
    for name, arm_args in (("latent", []), ("pixel", PIXELS)):
        run = out / name
        train(run, "flow_matching", [*arm_args, f"--train.max_steps={COST_STEPS}", f"--val.every={COST_STEPS}",
                                     f"--ckpt.every={COST_STEPS}", "--log.every=10"], args, 0)
        per_step[name] = step_cpu(run)
    recipe = json.loads(RECIPE.read_text())["train"]["max_steps"]
    record = {"cpu_s_per_step": per_step, "latent_steps": recipe,
              "pixel_steps": round(recipe * per_step["latent"] / per_step["pixel"])}
    (Path(args.out) / "cost.json").write_text(json.dumps(record, indent=1))
    print(f"cost: {per_step['latent']:.3f} CPU s a latent step, {per_step['pixel']:.3f} a pixel step: the pixel arm "
          f"trains {record['pixel_steps']} steps for the latent arm's {recipe}")


def arm_args(arm, args):
    method, extra = ARMS[arm]
    if arm == "fm_pixel":
        extra = [*extra, f"--train.max_steps={json.loads((Path(args.out) / 'cost.json').read_text())['pixel_steps']}"]
    return method, extra


def run(args):
    method, extra = arm_args(args.arm, args)
    train(Path(args.out) / f"{args.arm}_s{args.seed}", method, extra, args, args.seed)


# ----------------------------------------------------------------------------------------------------------
# Sampling settings on the validation captions, then the protocol on the test captions.


def protocol(args):
    return ["--features", "clip", "--clip_model", EVAL_CLIP, "--classifier", CLASSIFIER, "--batch_size", "258",
            "--stats_cache", str(Path(args.out) / "fid_stats")]


def tuned(arm, args):
    """(guidance, steps) that tools/tune.py chose for ARM on its seed 0 (RUN/tuned.json)."""
    best = json.loads((Path(args.out) / f"{arm}_s0" / "tuned.json").read_text())["best"]
    return best["guidance_scale"], best["steps"]


def tune_arm(args):
    run = Path(args.out) / f"{args.arm}_s0"
    if not (run / "tuned.json").is_file():
        tune.main(["--run", str(run), *TUNE, *protocol(args)])
    print(f"{args.arm}: guidance {tuned(args.arm, args)[0]:g}, {tuned(args.arm, args)[1]} steps (seed 0's run, on "
          f"the validation captions)")


def settings(arm, args):
    """{name: (guidance, steps)}: the tuned setting, and guidance 1 at the tuned steps."""
    guidance, steps = tuned(arm, args)
    return {"tuned": (guidance, steps), "g1": (1.0, steps)}


def score(args):
    run = Path(args.out) / f"{args.arm}_s{args.seed}"
    for name, (guidance, steps) in settings(args.arm, args).items():
        out = run / "eval" / f"test-{name}"
        if not (out / "report.json").is_file():
            eval_fid.main(["--run", str(run), "--out_dir", str(out), "--reference_split", "test", "--untuned",
                           "--guidance_scale", str(guidance), "--steps", str(steps), *protocol(args)])
    export.main(["--run", str(run)])  # the model card with the protocol's numbers (issue 69, item 6)


# ----------------------------------------------------------------------------------------------------------
# Report: every number with its seeds' interval; the contrasts paired by seed; the verdicts by the rule written first.


def reports(out, arm, name):
    """{seed: report} of the arm's scored seeds at setting NAME."""
    found = {}
    for seed in SEEDS:
        path = Path(out) / f"{arm}_s{seed}" / "eval" / f"test-{name}" / "report.json"
        if path.is_file():
            found[seed] = json.loads(path.read_text())
    return found


def value(report, metric, part):
    """A metric of the report at a part ('' all), whatever its sample count: metric_N[_part]."""
    for key, v in report["metrics"].items():
        stem, _, rest = key.partition(f"{metric}_")
        if stem == "" and rest.split("_", 1)[0].rstrip("k").isdigit() and rest.endswith(part) and \
                (part or "_" not in rest):
            return v
    return None


def real_value(report, metric, part):
    return value({"metrics": report.get("real", {})}, metric, part)


def cell(values, digits=4):
    mean, low, high = t_interval(values)
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]" if len(values) > 1 else f"{mean:.{digits}f}"


def verdict(d, lower_is_better, names):
    """The rule of docs/benchmarks/emoji.md: A better where the paired 95% interval excludes 0 on A's side, B
    better on B's, else cannot tell."""
    a, b = names
    if np.isnan(d["low"]):
        return "not settled (one seed)"
    if d["high"] < 0:
        return f"{a if lower_is_better else b} better"
    if d["low"] > 0:
        return f"{b if lower_is_better else a} better"
    return "cannot tell"


def contrast(first, second, metric, part=""):
    """The paired difference first - second over the seeds both have, its interval and verdict, in a table row."""
    (arm_a, name_a, got_a), (arm_b, name_b, got_b) = first, second
    seeds = sorted(set(got_a) & set(got_b))
    a = [value(got_a[s], metric, part) for s in seeds]
    b = [value(got_b[s], metric, part) for s in seeds]
    d = paired_comparison(a, b, higher_is_better=metric not in LOWER)
    names = (f"{arm_a} {name_a}", f"{arm_b} {name_b}")
    interval = f" [{d['low']:+.4f}, {d['high']:+.4f}]" if len(seeds) > 1 else ""  # one seed: no interval
    return (f"| {names[0]} - {names[1]} | {metric}{part} | {d['mean']:+.4f}{interval} | "
            f"{', '.join(map(str, seeds))} | {verdict(d, metric in LOWER, names)} |")


def report(args):
    out = Path(args.out)
    lines = ["# Emoji: text-to-image on real captions", "", "Written by benchmarks/emoji.py report; the analysis "
             "and rules: docs/benchmarks/emoji.md.", ""]
    cost_record = json.loads((out / "cost.json").read_text()) if (out / "cost.json").is_file() else None
    if cost_record:
        lines += [f"Training CPU per step: latent {cost_record['cpu_s_per_step']['latent']:.3f} s, pixel "
                  f"{cost_record['cpu_s_per_step']['pixel']:.3f} s; the pixel arm trains {cost_record['pixel_steps']} "
                  f"steps for the latent arm's {cost_record['latent_steps']}.", ""]
    got = {}
    for arm in ARMS:
        if not (out / f"{arm}_s0" / "tuned.json").is_file():
            continue
        guidance, steps = tuned(arm, args)
        lines += [f"## {arm}: guidance {guidance:g}, {steps} steps (tuned on seed 0's validation captions)", ""]
        for name in ("tuned", "g1"):
            got[arm, name] = found = reports(out, arm, name)
            if not found:
                continue
            lines += [f"### {name} ({len(found)} seeds: {', '.join(map(str, found))})", "",
                      "| metric | all | recombination | new |", "| --- | --- | --- | --- |"]
            first = next(iter(found.values()))
            for metric in METRICS:
                cells = []
                for part in PARTS:
                    values = [v for v in (value(r, metric, part) for r in found.values()) if v is not None]
                    real = real_value(first, metric, part)
                    cells.append("" if not values else cell(values) + ("" if real is None else f" ({real:.4f})"))
                lines.append(f"| {metric} | " + " | ".join(cells) + " |")
            cpu = [json.loads((out / f"{arm}_s{s}" / "cpu_seconds.json").read_text()) for s in found]
            lines += ["", f"Training CPU: {cell([c['train'] for c in cpu], 0)} s a run "
                      f"({cell([c['steps'] for c in cpu], 0)} in the steps). In brackets: the real images' value (FD: "
                      f"training images against the test images, the floor; the others: the test images themselves, "
                      f"the ceiling).", ""]
    lines += ["## Contrasts (paired by seed, 95% t-interval)", "",
              "| contrast | metric | difference | seeds | verdict |", "| --- | --- | --- | --- | --- |"]
    pairs = [(("fm_latent", "tuned"), ("ddpm_latent", "tuned")), (("fm_latent", "tuned"), ("fm_pixel", "tuned"))]
    pairs += [((arm, "tuned"), (arm, "g1")) for arm in ARMS]
    for a, b in pairs:
        if got.get(a) and got.get(b):
            for metric, part in (("fd_clip", ""), ("fd_clip", "_recombination"), ("fd_clip", "_new"),
                                 ("retrieval_top5", "_recombination"), ("clip_score", "")):
                lines.append(contrast((*a, got[a]), (*b, got[b]), metric, part))
    lines += ["", "## The aims", ""]
    for arm in ("fm_latent", "ddpm_latent"):
        found = got.get((arm, "tuned"))
        if not found:
            continue
        first = next(iter(found.values()))
        fd = np.mean([value(r, "fd_clip", "") for r in found.values()])
        top5 = np.mean([value(r, "retrieval_top5", "_recombination") for r in found.values()])
        floor, real5 = real_value(first, "fd_clip", ""), real_value(first, "retrieval_top5", "_recombination")
        lines.append(f"- {arm}: FD {fd:.3f} = {fd / floor:.2f}x the floor {floor:.3f} (aim <= {AIM_FLOOR:g}x: "
                     f"{'met' if fd / floor <= AIM_FLOOR else 'not met'}); top-5 retrieval on the recombinations "
                     f"{top5:.3f} = {top5 / real5:.2f}x the real images' {real5:.3f} (aim >= {AIM_RETRIEVAL:g}x: "
                     f"{'met' if top5 / real5 >= AIM_RETRIEVAL else 'not met'})")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ----------------------------------------------------------------------------------------------------------
# The README's grid: test captions, each generated image beside its real one.


def grid(args):
    from PIL import Image, ImageDraw

    from training.data import emoji

    arm, seed, per_part = args.arm or "fm_latent", 0, 4
    folder = Path(args.out) / f"{arm}_s{seed}" / "eval" / "test-tuned"
    rows = [json.loads(line) for line in (folder / "per_sample.jsonl").read_text().splitlines()]
    source = json.loads((folder.parents[1] / "config.json").read_text())["data"]["source"]
    test = emoji.load("test", emoji.folder_of(source))  # the packages the run was scored on, where the recipe has them
    picked = []
    for part in ("recombination", "new"):  # the first test images of each part whose vendor is google
        picked += [r for r in rows if r["part"] == part and test[r["row"]]["vendor"] == "google"][:per_part]
    cell_px, label_h = 96, 30
    canvas = Image.new("RGB", (cell_px * 2 * len(picked) // 2, (cell_px + label_h) * 2), "white")
    draw = ImageDraw.Draw(canvas)
    for k, r in enumerate(picked):
        x, y = (k % (len(picked) // 2)) * cell_px * 2, (k // (len(picked) // 2)) * (cell_px + label_h)
        sample = Image.open(folder / "samples" / f"{r['sample']:06d}.png").resize((cell_px, cell_px), Image.NEAREST)
        real = test[r["row"]]["image"].convert("RGB").resize((cell_px, cell_px), Image.NEAREST)
        canvas.paste(sample, (x, y)), canvas.paste(real, (x + cell_px, y))
        caption = r["caption"] if len(r["caption"]) <= 30 else r["caption"][:28] + ".."
        draw.text((x + 4, y + cell_px + 2), caption, fill="black")
        draw.text((x + 4, y + cell_px + 15), f"({r['part']}) sample | real", fill="grey")
    canvas.save(GRID)
    print(f"{GRID}: {len(picked)} test captions of {arm} seed {seed}, each sample beside its real image")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("stage", choices=["prepare", "cost", "run", "tune", "score", "report", "grid"])
    p.add_argument("arm", nargs="?", choices=list(ARMS))
    p.add_argument("seed", nargs="?", type=int)
    p.add_argument("--out", default="runs/emoji")
    args, args.extra = p.parse_known_args(argv)
    if args.stage in ("run", "score") and (args.arm is None or args.seed is None) or args.stage == "tune" and \
            args.arm is None:
        p.error(f"{args.stage} takes an arm ({', '.join(ARMS)}){' and a seed' if args.stage != 'tune' else ''}")
    {"prepare": prepare, "cost": cost, "run": run, "tune": tune_arm, "score": score, "report": report,
     "grid": grid}[args.stage](args)


if __name__ == "__main__":
    main()
