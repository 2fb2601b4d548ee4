"""Feeds docs/benchmarks/lora_digits.md (adapting the Fashion-MNIST model to handwritten digits: LoRA against full
fine-tuning and training from scratch; issue 72, item 4).

The Fashion-MNIST recipe's trained model (configs/fashion_mnist.json, the base) adapted to the MNIST digits
(data.source="mnist_digits", training/data/digits.py) at equal training CPU, 3 seeds an arm (ARMS): LoRA at ranks 4,
16 and 64 (train.lora_rank on init_from's frozen base), full fine-tuning (init_from, every weight trains) and the
recipe from scratch. The digits are 10 new classes: init_from maps class rows by name, none in common, so their
rows start fresh and train in full in every arm (lora.fresh_keys). The analysis and its rules were written before
any run (docs/benchmarks/lora_digits.md). Every stage resumes: a finished tool, run or score is skipped, an
interrupted trainer continues from its newest checkpoint.

  prepare   once: the base (--base: a Fashion-MNIST recipe run or its export; else the recipe trained here, seed 0,
            into OUT/base), the digits' evaluation classifier (tools/classifier.py on their training split), the
            Fashion-MNIST one where it is missing, and the base's Fashion-MNIST score (forgetting's "before")
  cost      each arm's training CPU a step (COST_STEPS-step runs, the trainer's own cpu_s_per_step) and, from them,
            each arm's steps: the reference arm's (full fine-tuning) training CPU for every arm (OUT/cost.json)
  run       ARM SEED: train (ARMS: lora4, lora16, lora64, full, scratch)
  score     ARM SEED: FD and class accuracy on the held-out test digits; the forgetting probe (the adapted model
            with the base's Fashion-MNIST class rows put back) on Fashion-MNIST's test split; trainable parameters,
            checkpoint size, peak memory, CPU a step (OUT/ARM_sSEED/scores.json)
  report    OUT/report.md: each arm's numbers with their seeds' intervals, the paired contrasts of each rank against
            full fine-tuning and against scratch with their verdicts, and the rank the rule picks

    python tools/fetch_mnist.py                                                    # the digits, once
    python benchmarks/lora_digits.py prepare --out runs/lora_digits [--base runs/fashion_mnist_bench/flow_matching_s0]
    python benchmarks/lora_digits.py cost --out runs/lora_digits
    python benchmarks/lora_digits.py run lora4 0 --out runs/lora_digits            # 5 arms x 3 seeds
    python benchmarks/lora_digits.py score lora4 0 --out runs/lora_digits
    python benchmarks/lora_digits.py report --out runs/lora_digits

Arguments past the stage's own go to every trainer run (a scaled-down run).
"""
import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval_fid  # noqa: E402
from benchmarks.fashion_mnist import add_cpu, cpu_seconds, step_cpu  # noqa: E402
from tools.compare import paired_comparison, t_interval  # noqa: E402

RECIPE = ROOT / "configs" / "fashion_mnist.json"
DIGITS_CLASSIFIER, FASHION_CLASSIFIER = "classifiers/mnist_digits", "classifiers/fashion_mnist"
# Every arm trains on the digits, validates on their validation split (never test), with an EMA short enough for a
# run of a few hundred steps (the recipe's 0.999 with init_from's inherited EMA would keep 0.999^800 = 45% of the
# base's weights in full fine-tuning's EMA; LoRA's fresh adapters warm up instead: 0.99 treats both alike), and no
# reference curves (the recipe's are Fashion-MNIST's).
COMMON = ["--data.val_split=validation", "--train.ema_decay=0.99", "--val.reference_curves=null"]
# Adapting arms: AdamW at the recipe's AdamW LR (LoRA refuses Muon: lora.problems), the same for full fine-tuning so
# that LoRA against full fine-tuning differs in what trains alone; scratch is the recipe itself (Muon).
ADAPT = ["--train.optimizer=adamw", "--train.muon_lr=null"]
ARMS = {"lora4": [*ADAPT, "--train.lora_rank=4"], "lora16": [*ADAPT, "--train.lora_rank=16"],
        "lora64": [*ADAPT, "--train.lora_rank=64"], "full": ADAPT, "scratch": []}
RANKS = {"lora4": 4, "lora16": 16, "lora64": 64}
REFERENCE, REFERENCE_STEPS = "full", 800  # its steps: 13.6 epochs of the 7,503 training digits at batch 128
COST_STEPS = 50
SEEDS = (0, 1, 2)
MIN_SEEDS = 3  # paired seeds below which a contrast has no verdict (tools/compare.py's MIN_SEEDS)
DIGIT_SAMPLES, FASHION_SAMPLES = 2000, 1000  # one sample a test digit; forgetting: 1,000 against 10,000 garments
# The scores of scores.json: (key, lower is better); the first three are the contrasts' metrics
SCORES = [("fd_digits", True), ("accuracy_digits", False), ("fd_fashion", True), ("accuracy_fashion", False)]
MEASURES = ["steps", "cpu_s_per_step", "train_cpu_s", "trainable_parameters", "checkpoint_mb", "peak_memory_gb"]
COUNTS = {"steps": ",.0f", "train_cpu_s": ",.0f", "trainable_parameters": ",.0f"}  # whole numbers, with commas


# ----------------------------------------------------------------------------------------------------------
# The arms' trainer arguments, and their steps at equal training CPU.


def equal_cpu_steps(per_step, reference=None, reference_steps=None):
    """{arm: steps} so that every arm's training CPU (steps x its CPU a step) is the reference arm's
    (reference_steps x its CPU a step; by default REFERENCE and REFERENCE_STEPS), to the nearest step."""
    budget = (reference_steps or REFERENCE_STEPS) * per_step[reference or REFERENCE]
    return {arm: max(1, round(budget / cpu)) for arm, cpu in per_step.items()}


def arm_argv(arm, seed, run, steps, base_export, source="mnist_digits"):
    """The trainer's arguments for one run of ARM: the recipe, the digits, the arm's keys, init_from the base for
    every arm but scratch, its steps with a validation and a checkpoint half-way and at the end."""
    start = [] if arm == "scratch" else [f"--init_from={base_export}"]
    half = math.ceil(steps / 2)
    return ["--config", str(RECIPE), f"--data.source={source}", *COMMON, *ARMS[arm], *start,
            f"--train.max_steps={steps}", f"--val.every={half}", f"--ckpt.every={half}", f"--seed={seed}",
            f"--run_dir={run}", "--log.wandb=off", "--resume=latest"]


def train(run, argv, args):
    """Train RUN, or continue it from its newest checkpoint; skipped once it is exported. The trainer processes'
    CPU goes to RUN/cpu_seconds.json (a resumed run: the sum over them) with the steps' own CPU."""
    if (run / "export").is_dir():
        return
    before = cpu_seconds(resource.RUSAGE_CHILDREN)
    try:
        subprocess.run([sys.executable, str(ROOT / "train_flow_matching.py"), *argv, *args.extra], cwd=ROOT,
                       check=True)
    finally:
        record = add_cpu(run, cpu_seconds(resource.RUSAGE_CHILDREN) - before)
    record["steps"] = step_cpu(run) * json.loads((run / "config.json").read_text())["train"]["max_steps"]
    (run / "cpu_seconds.json").write_text(json.dumps(record))


def base_export(args):
    """The base's export folder, as prepare recorded it (OUT/base.json)."""
    path = Path(args.out) / "base.json"
    if not path.is_file():
        sys.exit(f"{path} not found: run `python benchmarks/lora_digits.py prepare --out {args.out}` first")
    return json.loads(path.read_text())["export"]


# ----------------------------------------------------------------------------------------------------------
# prepare: the base, the two evaluation classifiers, the base's Fashion-MNIST score.


def prepare(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.base:
        export = Path(args.base) / "export" if (Path(args.base) / "export").is_dir() else Path(args.base)
        if not (export / "model_index.json").is_file():
            sys.exit(f"--base {args.base}: neither an export folder nor a run with one (its export/)")
    elif (out / "base.json").is_file():  # prepare again: the base it recorded, given or made
        export = Path(base_export(args))
    else:  # the recipe as it is, seed 0: the Fashion-MNIST model every adapting arm starts from
        run = out / "base"
        train(run, ["--config", str(RECIPE), "--seed=0", f"--run_dir={run}", "--log.wandb=off", "--resume=latest"],
              args)
        export = run / "export"
    (out / "base.json").write_text(json.dumps({"export": str(export.resolve())}))
    for folder, data in ((DIGITS_CLASSIFIER, [f"--data.source={args.source}", "--data.val_split=validation"]),
                         (FASHION_CLASSIFIER, [])):
        if (ROOT / folder).is_dir():
            print(f"{folder}: made ({ROOT / folder})")
            continue
        before = cpu_seconds(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, str(ROOT / "tools" / "classifier.py"), "--config", str(RECIPE), "--out",
                        folder, *data], cwd=ROOT, check=True)
        (ROOT / folder / "cpu_seconds.json").write_text(json.dumps(
            {"cpu_s": cpu_seconds(resource.RUSAGE_CHILDREN) - before}))
    before = out / "base_fashion"  # forgetting's "before": the base on Fashion-MNIST, as every probe is scored
    if not (before / "report.json").is_file():
        eval_fid.main(["--run", str(export), "--out_dir", str(before), *fashion_protocol(args)])


# ----------------------------------------------------------------------------------------------------------
# cost, then the runs.


def cost(args):
    """CPU seconds per training step of each arm from COST_STEPS-step runs (seed 0; the trainer's own
    cpu_s_per_step: the steps alone), and each arm's steps at the reference arm's training CPU (OUT/cost.json)."""
    out, export = Path(args.out), base_export(args)
    per_step = {}
    for arm in ARMS:
        run = out / "cost" / arm
        argv = arm_argv(arm, 0, run, COST_STEPS, export, args.source)
        train(run, [*argv, f"--val.every={COST_STEPS}", f"--ckpt.every={COST_STEPS}", "--log.every=10"], args)
        per_step[arm] = step_cpu(run)
    steps = equal_cpu_steps(per_step)
    record = {"cpu_s_per_step": per_step, "reference": REFERENCE, "steps": steps,
              "training_cpu_s": {arm: steps[arm] * per_step[arm] for arm in ARMS}}
    (out / "cost.json").write_text(json.dumps(record, indent=1))
    for arm in ARMS:
        print(f"cost: {arm:8} {per_step[arm]:.3f} CPU s a step: {steps[arm]:5} steps, "
              f"{record['training_cpu_s'][arm]:.0f} CPU s of training")


def run(args):
    path = Path(args.out) / "cost.json"
    if not path.is_file():
        sys.exit(f"{path} not found: run `python benchmarks/lora_digits.py cost --out {args.out}` first (each "
                 f"arm's steps at equal training CPU)")
    steps = json.loads(path.read_text())["steps"][args.arm]
    folder = Path(args.out) / f"{args.arm}_s{args.seed}"
    train(folder, arm_argv(args.arm, args.seed, folder, steps, base_export(args), args.source), args)


# ----------------------------------------------------------------------------------------------------------
# score: the digits, forgetting on Fashion-MNIST, and what the run cost.


def digits_protocol(args):
    return ["--num_samples", str(DIGIT_SAMPLES), "--reference_split", "test", "--classifier", DIGITS_CLASSIFIER,
            "--features", "classifier", "--batch_size", "250", "--stats_cache", str(Path(args.out) / "fid_stats"),
            "--untuned"]


def fashion_protocol(args):
    return ["--num_samples", str(FASHION_SAMPLES), "--reference", "fashion_mnist", "--reference_split", "test",
            "--classifier", FASHION_CLASSIFIER, "--features", "classifier", "--batch_size", "250",
            "--stats_cache", str(Path(args.out) / "fid_stats"), "--untuned"]


def fashion_probe(export, base, out):
    """The adapted model asked for garments: a copy of the run's export whose class rows are the base's
    (Fashion-MNIST's ten; the digits' own rows replaced, its null row and every other weight the adapted model's),
    with the base's class names. What it draws for "Trouser" is what adapting did to the shared weights."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(export, out)
    weights = Path("conditioner") / "diffusion_pytorch_model.safetensors"
    state, theirs = load_file(str(out / weights)), load_file(str(Path(base) / weights))
    names = json.loads((Path(base) / "conditioner" / "config.json").read_text())["class_names"]
    rows = state["class_embed.weight"]
    if theirs["class_embed.weight"].shape != rows.shape:
        raise ValueError(f"{base}: its class rows {tuple(theirs['class_embed.weight'].shape)} do not fit "
                         f"{export}'s {tuple(rows.shape)}")
    tokens = rows.shape[0] // (len(names) + 1)  # each class's rows, then the null class's
    rows[:len(names) * tokens] = theirs["class_embed.weight"][:len(names) * tokens]
    save_file(state, str(out / weights), metadata={"format": "pt"})
    for name in ("conditioner/config.json", "class_ids.json"):
        if (Path(base) / name).is_file():
            shutil.copy(Path(base) / name, out / name)
    return out


def metric(report, name):
    """A report's metric by its name without the sample-count tag (fd_classifier_2k: "fd_classifier")."""
    return next(v for k, v in report["metrics"].items() if k.rsplit("_", 1)[0] == name)


def measures(run):
    """What a run cost: steps, CPU a step (the trainer's own), the training steps' CPU, trainable parameters (a
    LoRA run's checkpoint holds them alone; else every parameter of the exported model), the final checkpoint
    folder's size, the trainer's peak memory (the largest peak_memory_gb it logged: RSS on the CPU)."""
    from safetensors import safe_open

    from training.model.mmdit import load_exported

    cfg = json.loads((run / "config.json").read_text())
    steps = cfg["train"]["max_steps"]
    last = run / "checkpoints" / f"step_{steps:08d}"
    if cfg["train"].get("lora_rank"):
        with safe_open(str(last / "model.safetensors"), "pt") as f:
            trainable = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    else:
        trainable = sum(p.numel() for p in load_exported(run / "export")[0].parameters())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"steps": steps, "cpu_s_per_step": step_cpu(run),
            "train_cpu_s": json.loads((run / "cpu_seconds.json").read_text())["steps"],
            "trainable_parameters": trainable,
            "checkpoint_mb": sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) / 1e6,
            "peak_memory_gb": max(r["peak_memory_gb"] for r in rows if "peak_memory_gb" in r)}


def score(args):
    run = Path(args.out) / f"{args.arm}_s{args.seed}"
    digits_out, fashion_out = run / "eval" / "digits-test", run / "eval" / "fashion-test"
    if not (digits_out / "report.json").is_file():
        eval_fid.main(["--run", str(run), "--out_dir", str(digits_out), *digits_protocol(args)])
    if not (fashion_out / "report.json").is_file():
        probe = fashion_probe(run / "export", base_export(args), run / "fashion_probe")
        eval_fid.main(["--run", str(probe), "--out_dir", str(fashion_out), *fashion_protocol(args)])
    digits_report, fashion_report = (json.loads((o / "report.json").read_text()) for o in (digits_out, fashion_out))
    scores = {"fd_digits": metric(digits_report, "fd_classifier"),
              "accuracy_digits": metric(digits_report, "class_accuracy"),
              "fd_fashion": metric(fashion_report, "fd_classifier"),
              "accuracy_fashion": metric(fashion_report, "class_accuracy"), **measures(run)}
    (run / "scores.json").write_text(json.dumps(scores, indent=1))
    print(f"{run.name}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))


# ----------------------------------------------------------------------------------------------------------
# report: every number with its seeds' interval; the contrasts paired by seed; the rank by the rule written first.


def verdict(d, lower_is_better, names):
    """docs/benchmarks/lora_digits.md's rule: A better where the paired 95% interval of A - B excludes 0 on A's
    side, B better on B's, else cannot tell; no verdict below 3 seeds."""
    a, b = names
    if d["n"] < MIN_SEEDS or np.isnan(d["low"]):
        return f"no verdict ({d['n']} seed{'s' * (d['n'] != 1)})"
    if d["high"] < 0:
        return f"{a if lower_is_better else b} better"
    if d["low"] > 0:
        return f"{b if lower_is_better else a} better"
    return "cannot tell"


def contrast(scores, a, b, key, lower_is_better):
    """(paired_comparison of a - b over the seeds both have, verdict)."""
    seeds = sorted(set(scores.get(a, {})) & set(scores.get(b, {})))
    d = paired_comparison([scores[a][s][key] for s in seeds], [scores[b][s][key] for s in seeds],
                          higher_is_better=not lower_is_better)
    return d, verdict(d, lower_is_better, (a, b))


def recommend(scores):
    """The rank a user should start with (docs/benchmarks/lora_digits.md, written before any run), by FD on the
    test digits: the smallest rank that neither full fine-tuning nor a larger rank beats (a settled verdict); if
    full fine-tuning beats every rank, the rank of lowest mean FD, and full fine-tuning is the advice. Returns
    (arm or None, the sentence)."""
    ranks = [arm for arm in sorted(RANKS, key=RANKS.get) if arm in scores]
    if not ranks or REFERENCE not in scores:
        return None, "not yet: every rank and full fine-tuning need their scores"
    if any(contrast(scores, r, REFERENCE, "fd_digits", True)[1].startswith("no verdict") for r in ranks):
        return None, f"not yet: every rank needs {MIN_SEEDS} seeds paired with full fine-tuning's"
    beaten = {r: contrast(scores, r, REFERENCE, "fd_digits", True)[1] == f"{REFERENCE} better" for r in ranks}
    if all(beaten.values()):
        best = min(ranks, key=lambda r: np.mean([s["fd_digits"] for s in scores[r].values()]))
        return best, (f"full fine-tuning beats every rank on the digits' FD: fine-tune every weight; if an adapter "
                      f"it must be, {best} (the lowest mean FD)")
    for r in ranks:
        larger = [q for q in ranks if RANKS[q] > RANKS[r]]
        if not beaten[r] and not any(contrast(scores, q, r, "fd_digits", True)[1] == f"{q} better" for q in larger):
            return r, (f"{r}: the smallest rank that neither full fine-tuning nor a larger rank beats on the digits' "
                       f"FD")
    return None, "no rank qualifies"  # unreachable: the largest rank not beaten by full fine-tuning qualifies


def collect(out):
    """{arm: {seed: scores.json}} of every scored run under OUT."""
    found = {}
    for arm in ARMS:
        for seed in SEEDS:
            path = Path(out) / f"{arm}_s{seed}" / "scores.json"
            if path.is_file():
                found.setdefault(arm, {})[seed] = json.loads(path.read_text())
    return found


def cell(values, form=".4g"):
    mean, low, high = t_interval(values)
    return f"{mean:{form}} [{low:{form}}, {high:{form}}]" if len(values) > 1 else f"{mean:{form}}"


def report(args):
    out = Path(args.out)
    if not out.is_dir():
        sys.exit(f"{out}: no campaign there: run `python benchmarks/lora_digits.py prepare --out {out}` first")
    scores = collect(out)
    lines = ["# LoRA on the digits: adapting the Fashion-MNIST model", "",
             "Written by benchmarks/lora_digits.py report; the analysis and rules: docs/benchmarks/lora_digits.md.", ""]
    before = out / "base_fashion" / "report.json"
    if before.is_file():
        b = json.loads(before.read_text())
        lines += [f"The base on Fashion-MNIST (forgetting's before, {FASHION_SAMPLES:,} samples): FD "
                  f"{metric(b, 'fd_classifier'):.4g}, class accuracy {metric(b, 'class_accuracy'):.4g}.", ""]
    keys = [k for k, _ in SCORES] + MEASURES
    lines += ["| arm | seeds | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 2)]
    for arm, by_seed in scores.items():
        lines.append(f"| {arm} | {', '.join(map(str, by_seed))} | "
                     + " | ".join(cell([s[k] for s in by_seed.values()], COUNTS.get(k, ".4g")) for k in keys) + " |")
    lines += ["", "## Contrasts (paired by seed, 95% t-interval)", "",
              "| contrast | metric | difference | seeds | verdict |", "| --- | --- | --- | --- | --- |"]
    for arm in RANKS:
        for other in (REFERENCE, "scratch"):
            if arm not in scores or other not in scores:
                continue
            for key, lower in SCORES[:3]:
                d, said = contrast(scores, arm, other, key, lower)
                interval = f" [{d['low']:+.4g}, {d['high']:+.4g}]" if d["n"] > 1 else ""
                lines.append(f"| {arm} - {other} | {key} | {d['mean']:+.4g}{interval} | {d['n']} | {said} |")
    arm, sentence = recommend(scores)
    lines += ["", "## Which rank to start with (the rule written before the runs)", "", sentence]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return arm


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=["prepare", "cost", "run", "score", "report"])
    p.add_argument("arm", nargs="?", choices=list(ARMS))
    p.add_argument("seed", nargs="?", type=int)
    p.add_argument("--out", default="runs/lora_digits")
    p.add_argument("--base", default=None, help="prepare: a Fashion-MNIST recipe run (or its export) as the base; "
                   "default: the recipe trained here, seed 0")
    p.add_argument("--source", default="mnist_digits", help="the digits' data.source (mnist_digits:/folder when "
                   "tools/fetch_mnist.py --out put them elsewhere)")
    args, args.extra = p.parse_known_args(argv)
    if args.stage in ("run", "score") and (args.arm is None or args.seed is None):
        p.error(f"{args.stage} takes an arm ({', '.join(ARMS)}) and a seed")
    return {"prepare": prepare, "cost": cost, "run": run, "score": score, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
