"""Feeds docs/benchmarks/paper_claims.md (the paper's claims on real images).

The paper's FD claims on real images, with seeds (issue 62).

Two claims, on Fashion-MNIST by the real-image protocol (docs/evaluation.md: the evaluation classifier's FD, KD,
precision, recall and class accuracy), flow matching, the recipe's model (configs/fashion_mnist.json). The
analysis and its decision rules were written before any run (docs/benchmarks/paper_claims.md). Each stage is one
job of the CPU queue and resumes: a finished run or score is skipped, an interrupted trainer continues from its
newest checkpoint.

  data          Fashion-MNIST's training and test splits whole, each image box-downsampled to a native side drawn
                uniformly in 8..28 px and saved at that side (control_ablation's `real` data), as train/ and
                test/; then the trainer's cache of it warmed by a 1-step run
  cost          the training CPU of a step at 12 and at 28 px: the difference of two runs' process CPU (20 and
                220 steps, each cache built before), so start-up, validation and export cancel (issue 57, item
                7); sets the pre-training's
                steps (as much training CPU as the fine-tuning) and scratch's (equal training CPU)
  conditioning  ARM SEED: the recipe on the mixed-size data with the size control, conditioning.mode ARM
                (adanorm; disentangled: the paper's, the size gated by w(t) = cos(pi t / 2); both), COND_STEPS;
                scored on 2,000 samples whose sizes follow the data's against the test split at the same sizes
                (the primary), on 2,000 asked for 28 px against the plain test split, and the size check
  pretrain      SEED: the recipe at 12 px (3 x 3 tokens) for cost.json's pretrain_steps
  transfer      ARM SEED: FINETUNE_STEPS at 28 px (7 x 7 tokens) from the 12-px run, the positional grid
                resampled or extended, with or without the time shift a = 28 / 12, the EMA at FINETUNE_EMA;
                scratch: at 28 px from scratch for the same training CPU as pre-training and fine-tuning together
  report        the pre-registered contrasts and verdicts, tools/compare.py's comparisons, the FD floors: OUT/report.md

    python benchmarks/paper_claims.py data --out runs/paper_claims
    python benchmarks/paper_claims.py cost --out runs/paper_claims
    python benchmarks/paper_claims.py conditioning adanorm 0 --out runs/paper_claims     # 2 arms x 5 seeds
    python benchmarks/paper_claims.py pretrain 0 --out runs/paper_claims                 # 3 seeds
    python benchmarks/paper_claims.py transfer resample_shift 0 --out runs/paper_claims  # 5 arms x 3 seeds
    python benchmarks/paper_claims.py report --out runs/paper_claims

Every trainer process's own CPU (user + system) is appended to RUN/cpu_seconds.jsonl, so a resumed run's CPU is
the sum over its processes (a process killed outright records nothing; the report counts the processes).
Arguments past the stage's own go to every trainer run (a scaled-down run: --model.num_layers=1 ...).
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval_fid  # noqa: E402
from benchmarks import control_ablation, fashion_mnist  # noqa: E402
from tools.compare import compare, paired_comparison, t_interval  # noqa: E402
from training.evaluation.metrics import size_tag  # noqa: E402
from training.model.mmdit import load_exported  # noqa: E402

COND_STEPS, FINETUNE_STEPS = 1200, 400  # docs/benchmarks/paper_claims.md: why these lengths (1,200: the recipe's)
# The fine-tuning's EMA decay (amended after seed 0, docs/benchmarks/paper_claims.md): init_from keeps the source's
# EMA with no warm-up, so at the recipe's 0.999 the 400-step run's EMA would be 0.999^400 = 67% the 12-px weights; at
# 0.99 it is 1.8%, and its averaging window (~100 steps) is the one scratch's warm-up gives at step 800 (d = 801 / 810)
FINETUNE_EMA = 0.99
LOW, HIGH = 12, 28  # pre-training and recipe resolution: 3 x 3 and 7 x 7 tokens at the recipe's patch 4
TIMING_STEPS = (20, 220)  # the two run lengths whose CPU difference is a step's cost
PAPER_EFFECT = -0.07  # the paper's FD change from disentangled conditioning, ImageNet 256 (-7%)
CONDITIONING = {"adanorm": ["--conditioning.mode=adanorm"], "disentangled": ["--conditioning.mode=disentangled"],
                "both": ["--conditioning.mode=both"]}  # the size control's power: its default p = 1, the paper's
TRANSFER = {"resample_shift": ["--model.pos_embed_transfer=resample", f"--objective.shift_base_resolution={LOW}"],
            "resample": ["--model.pos_embed_transfer=resample"],
            "extend_shift": ["--model.pos_embed_transfer=extend", f"--objective.shift_base_resolution={LOW}"],
            "extend": ["--model.pos_embed_transfer=extend"],
            "scratch": []}
PRETRAIN = "pretrain12"  # the pre-training run, beside its seed's fine-tuning runs; init_from names it relatively,
# so every seed's config reads the same init_from and tools/compare.py groups the seeds into one arm
SAMPLES = 2000
AT28 = ["--controls", "square", "--reference", "fashion_mnist"]  # eval_fid.py: every sample asked for 28 x 28


# ----------------------------------------------------------------------------------------------------------
# Runs: one trainer process at a time, its CPU recorded; scores through eval_fid.py, each kept in RUN/eval/NAME.


def common_args(args):
    return ["--log.wandb=off", "--log.report=false", "--val.reference_curves=null",
            f"--data.cache_dir={Path(args.out) / 'cache'}", *args.extra]


def train(run, trainer_args, args, cwd=None):
    """Train RUN, or continue it from its newest checkpoint; skipped once it is exported. The trainer process's
    CPU is appended to RUN/cpu_seconds.jsonl (one row per process: a resumed run sums them)."""
    if (run / "export").is_dir():
        return
    before, started = fashion_mnist.cpu_seconds(resource.RUSAGE_CHILDREN), time.time()
    done = subprocess.run([sys.executable, str(ROOT / "train_flow_matching.py"), "--config", str(fashion_mnist.RECIPE),
                           f"--run_dir={run}", "--resume=latest", *trainer_args, *common_args(args)], cwd=cwd)
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "cpu_seconds.jsonl", "a") as f:
        f.write(json.dumps({"cpu_s": fashion_mnist.cpu_seconds(resource.RUSAGE_CHILDREN) - before,
                            "wall_s": time.time() - started, "returncode": done.returncode}) + "\n")
    if done.returncode:
        sys.exit(f"paper_claims: the trainer of {run} stopped with exit code {done.returncode}; "
                 "rerun the job to resume")


def run_cpu(run):
    """(CPU seconds summed over the run's trainer processes, how many processes)."""
    rows = [json.loads(line) for line in (run / "cpu_seconds.jsonl").read_text().splitlines()]
    return sum(r["cpu_s"] for r in rows), len(rows)


def score(run, name, args, extra=()):
    """eval_fid.py's metrics of RUN's export on SAMPLES samples against a test split (docs/evaluation.md), kept in
    RUN/eval/NAME (an interrupted score resumes at its next batch)."""
    out = run / "eval" / name
    if not (out / "report.json").is_file():
        eval_fid.main(["--run", str(run), "--out_dir", str(out), *fashion_mnist.score_args(args, SAMPLES), *extra])
    return json.loads((out / "report.json").read_text())["metrics"]


def write_quality(run, row):
    """RUN/quality.jsonl, the row tools/compare.py reads, at the run's last step."""
    steps = json.loads((run / "config.json").read_text())["train"]["max_steps"]
    (run / "quality.jsonl").write_text(json.dumps({"step": steps, **row}) + "\n")
    print(f"{run}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)


# ----------------------------------------------------------------------------------------------------------
# Stages.


def data_stage(args):
    """The mixed-size folder (train/, test/), its cache warmed by a 1-step run and both references' statistics
    computed, so that no two jobs build the same file at once."""
    folder = Path(args.out) / "data" / "mixed_sizes"
    control_ablation.real_images(folder / "train", "train", count=None, seed=0)
    control_ablation.real_images(folder / "test", "test", count=None, seed=1)
    warm = Path(args.out) / "data" / "cache_warmup"
    train(warm, [*mixed_args(args), "--train.max_steps=1"], args)
    for extra in ([], AT28):
        reference(warm, extra, args)


def reference(run, extra, args):
    """(the run's config, the evaluation classifier, its feature function, the reference statistics eval_fid.py
    scores RUN against with `extra`), computed once into the stats cache."""
    from accelerate import Accelerator

    from training.config import config
    from training.evaluation import classifier
    from training.evaluation.reference import reference_args, reference_for

    cfg = config.Config(json.loads((run / "config.json").read_text()))
    judge, _ = classifier.load(args.classifier)
    feature_fn = classifier.feature_fn(judge)
    eval_args = reference_args([*fashion_mnist.score_args(args, SAMPLES), *extra])
    return cfg, judge, feature_fn, reference_for(eval_args, cfg, feature_fn, Accelerator(cpu=True))[1]


def mixed_args(args):
    return [f"--data.source={Path(args.out) / 'data' / 'mixed_sizes'}", '--conditioning.controls=["size"]']


def cost_stage(args):
    """A training step's CPU at LOW and HIGH px: (CPU of the longer run - the shorter's) / the steps between, the
    runs alternating resolutions so that load from elsewhere falls on both alike; then the pre-training's steps
    (its training CPU equal to the fine-tuning's) and scratch's (equal to both together) into OUT/cost.json."""
    per_step, folder = {}, Path(args.out) / "cost"
    for res in (LOW, HIGH):  # first the cache at each resolution, whose building would count in one run alone
        train(folder / f"res{res}_cache", [f"--data.resolution={res}", "--train.max_steps=1"], args)
    for steps in TIMING_STEPS:
        for res in (LOW, HIGH):
            train(folder / f"res{res}_steps{steps}", [f"--data.resolution={res}", f"--train.max_steps={steps}",
                                                      "--val.every=100000", "--ckpt.every=100000"], args)
    for res in (LOW, HIGH):
        (short, _), (long, _) = (run_cpu(folder / f"res{res}_steps{n}") for n in TIMING_STEPS)
        per_step[res] = (long - short) / (TIMING_STEPS[1] - TIMING_STEPS[0])
    ratio = per_step[LOW] / per_step[HIGH]
    pretrain = round(FINETUNE_STEPS / ratio)
    result = {"cpu_s_per_step": per_step, "ratio": ratio, "finetune_steps": FINETUNE_STEPS,
              "pretrain_steps": pretrain, "scratch_steps": FINETUNE_STEPS + round(pretrain * ratio)}
    (Path(args.out) / "cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def costs(args):
    path = Path(args.out) / "cost.json"
    if not path.is_file():
        sys.exit(f"paper_claims: {path} is missing: run the cost stage first")
    return json.loads(path.read_text())


def conditioning_stage(args):
    """One (arm, seed): train, then the two scores and the size check, into RUN/quality.jsonl."""
    run = Path(args.out) / "conditioning" / args.arm / f"s{args.seed}"
    train(run, [f"--seed={args.seed}", f"--train.max_steps={args.steps or COND_STEPS}", *mixed_args(args),
                *CONDITIONING[args.arm]], args)
    mixed = score(run, "mixed", args)  # sizes from the held-out rows (the data's), the test split at those sizes
    at28 = score(run, "size28", args, AT28)  # asked for an uncropped 28 x 28 original, against the plain test split
    write_quality(run, {**mixed, **{f"{k}_at28": v for k, v in at28.items()}, **size_check(run)})


def size_check(run):
    """The manipulation check (docs/benchmarks/paper_claims.md): the same noise and class asked for at 28 and at 8
    px, guidance 1 (control_ablation's `real` metrics): sharpness ratio 28 / 8 (> 1: the size control was learnt) and
    layout change."""
    path = run / "size_check.json"
    if not path.is_file():
        model, cfg = load_exported(run / "export")
        labels = torch.arange(cfg["data"]["num_classes"]).repeat_interleave(control_ablation.PER_CLASS)
        lo, hi = control_ablation.REAL_SIDES
        at = {side: control_ablation.sample(model, cfg, labels, side, 0) for side in (hi, lo)}
        path.write_text(json.dumps(control_ablation.pair_metrics(at[hi], at[lo], labels, demo=False)))
    return json.loads(path.read_text())


def pretrain_stage(args):
    seed_dir = Path(args.out) / "transfer" / f"s{args.seed}"
    train(seed_dir / PRETRAIN, [f"--seed={args.seed}", f"--data.resolution={LOW}",
                                f"--train.max_steps={args.steps or costs(args)['pretrain_steps']}"], args)


def transfer_stage(args):
    """One (arm, seed): fine-tuning from the seed's pre-training run (which must be exported), or scratch."""
    seed_dir, cost = Path(args.out) / "transfer" / f"s{args.seed}", costs(args)
    if args.arm == "scratch":
        steps, start = cost["scratch_steps"], []
    else:
        if not (seed_dir / PRETRAIN / "export").is_dir():
            sys.exit(f"paper_claims: {seed_dir / PRETRAIN} is not trained yet: run `pretrain {args.seed}` first")
        steps, start = cost["finetune_steps"], [f"--init_from={PRETRAIN}", f"--train.ema_decay={FINETUNE_EMA}"]
    run = seed_dir / args.arm
    seed_dir.mkdir(parents=True, exist_ok=True)
    train(run, [f"--seed={args.seed}", f"--data.resolution={HIGH}", f"--train.max_steps={args.steps or steps}", *start,
                *TRANSFER[args.arm]], args, cwd=seed_dir)
    write_quality(run, score(run, "test", args))

# ----------------------------------------------------------------------------------------------------------
# The pre-registered analysis (docs/benchmarks/paper_claims.md): contrasts per seed, 95% t-intervals, disjoint verdicts.


def conditioning_verdict(relative, learnt, paper=PAPER_EFFECT):
    """relative: per seed FD(disentangled) / FD(adanorm) - 1 (the primary FD). learnt: whether every arm's
    sharpness-ratio interval lies above 1. paper: the paper's change (ImageNet 256's -7%; benchmarks/emoji_claims.py
    gives CC12M's). Exactly one of supports / contradicts / cannot tell."""
    mean, low, high = t_interval(relative)
    said, its = f"({mean:+.1%} [{low:+.1%}, {high:+.1%}])", f"the paper's {paper:.0%}"
    if not learnt:
        return "cannot tell: an arm's sharpness ratio interval reaches 1 (the size control not learnt)"
    if high < 0:
        size = (f"larger than {its}" if high < paper else f"smaller than {its} (excluded)" if low > paper
                else f"as large as {its} or smaller")
        return f"supports: disentangled conditioning lowers FD {said}, {size}"
    if low > paper:
        return f"contradicts: no FD reduction shown and one of {-paper:.0%} (the paper's) or more excluded {said}"
    return f"cannot tell: the interval {said} holds both no change and {its}"


def sign_verdict(differences, claim):
    """differences: per seed FD(the claimed-better arm) - FD(the other). Exactly one of the three."""
    mean, low, high = t_interval(differences)
    said = f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"
    return (f"supports: {claim} ({said})" if high < 0 else f"contradicts: the opposite of '{claim}' ({said})"
            if low > 0 else f"cannot tell: the interval {said} holds 0")


def transfer_contrasts(fd):
    """{name: per-seed values} from {arm: per-seed FD arrays}: each variant against scratch, and the 2 x 2
    factorial's main effects (resample - extend, shift - no shift) and interaction."""
    rs, r, es, e, s = (fd[a] for a in ("resample_shift", "resample", "extend_shift", "extend", "scratch"))
    return {**{f"{a} - scratch": fd[a] - s for a in TRANSFER if a != "scratch"},
            "resample - extend (mean over shift)": ((rs - es) + (r - e)) / 2,
            "shift - no shift (mean over grid)": ((rs - r) + (es - e)) / 2,
            "interaction ((rs - r) - (es - e))": (rs - r) - (es - e)}


VERDICTS = {"resample_shift - scratch": "pre-training at 12 px with the paper's transfer beats scratch at equal CPU",
            "resample - extend (mean over shift)": "resampling the positional grid beats extending it",
            "shift - no shift (mean over grid)": "the time shift helps the fine-tuning"}

# ----------------------------------------------------------------------------------------------------------
# The report.


def cell(values, digits=3):
    mean, low, high = t_interval(values)
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def read_scores(runs):
    """{arm: {seed: the quality row}} of the scored runs among {arm: {seed: run}}."""
    return {arm: {s: json.loads((r / "quality.jsonl").read_text().splitlines()[-1]) for s, r in by_seed.items()
                  if (r / "quality.jsonl").is_file()} for arm, by_seed in runs.items()}


def paired(scores, a, b, metric):
    seeds = sorted(set(scores[a]) & set(scores[b]))
    return seeds, np.array([scores[a][s][metric] for s in seeds]), np.array([scores[b][s][metric] for s in seeds])


def metric_table(scores, metrics):
    lines = ["| arm | seeds | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for arm, by_seed in scores.items():
        if by_seed:
            lines.append(f"| {arm} | {','.join(map(str, sorted(by_seed)))} | " + " | ".join(
                cell([r[m] for r in by_seed.values()], 4 if m.startswith("kd") else 3) for m in metrics) + " |")
    return lines


def differences(scores, a, b, metrics):
    """Paired A - B per metric (tools/compare.py's statistic): mean [95% t], per seed."""
    lines = [f"| {a} - {b} | mean [95% paired t] | per seed |", "|---|---|---|"]
    for m in metrics:
        seeds, x, y = paired(scores, a, b, m)
        if len(seeds) >= 2:
            c = paired_comparison(x, y, False)
            lines.append(f"| {m} | {c['mean']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] | "
                         + ", ".join(f"{d:+.4f}" for d in c["diff"]) + f" (seeds {seeds}) |")
    return lines


def report_stage(args):
    out, lines = Path(args.out), [f"# The paper's claims on real images ({args.out})", ""]
    metrics = [f"{m}_{size_tag(SAMPLES)}" for m in ("fd_classifier", "kd_classifier", "precision_classifier",
                                                    "recall_classifier", "class_accuracy")]
    fd, accuracy = metrics[0], metrics[-1]
    # ---- conditioning
    runs = {arm: {s: out / "conditioning" / arm / f"s{s}" for s in range(10)} for arm in CONDITIONING}
    scores = read_scores(runs)
    lines += ["## Conditioning, mixed native sizes", ""]
    lines += metric_table(scores, metrics + [f"{m}_at28" for m in metrics] + ["sharpness_ratio", "layout_change"])
    seeds, dis, ada = paired(scores, "disentangled", "adanorm", fd)
    if len(seeds) >= 2:
        learnt = all(t_interval([r["sharpness_ratio"] for r in scores[a].values()])[1] > 1
                     for a in ("disentangled", "adanorm"))
        relative = dis / ada - 1
        lines += ["", f"Primary, FD(disentangled) / FD(adanorm) - 1 per seed {seeds}: "
                      + ", ".join(f"{v:+.1%}" for v in relative),
                  "", "Verdict: " + conditioning_verdict(relative, learnt)]
        _, dis28, ada28 = paired(scores, "disentangled", "adanorm", f"{fd}_at28")
        mean, low, high = t_interval(dis28 / ada28 - 1)
        lines += ["", f"Secondary, the same at 28 px: {mean:+.1%} [{low:+.1%}, {high:+.1%}] (per seed "
                      + ", ".join(f"{v:+.1%}" for v in dis28 / ada28 - 1) + ")", ""]
        lines += differences(scores, "disentangled", "adanorm", metrics + [f"{m}_at28" for m in metrics]
                             + ["sharpness_ratio", "layout_change"])
        for metric in (fd, f"{fd}_at28", accuracy):
            compare([r for arm in ("disentangled", "adanorm") for r in runs[arm].values()
                     if (r / "quality.jsonl").is_file()],
                    out / "compare" / f"conditioning_{metric}", metric)
    # ---- transfer
    runs = {arm: {s: out / "transfer" / f"s{s}" / arm for s in range(10)} for arm in TRANSFER}
    scores = read_scores(runs)
    lines += ["", "## Resolution transfer, 12 -> 28 px, against scratch at equal training CPU", ""]
    lines += metric_table(scores, metrics)
    seeds = sorted(set.intersection(*(set(v) for v in scores.values())))
    if len(seeds) >= 2:
        by_arm = {arm: np.array([scores[arm][s][fd] for s in seeds]) for arm in TRANSFER}
        lines += ["", f"Contrasts on {fd}, paired over seeds {seeds}: mean [95% t] (per seed)", ""]
        for name, values in transfer_contrasts(by_arm).items():
            lines.append(f"- {name}: {cell(values)} ({', '.join(f'{v:+.3f}' for v in values)})"
                         + (f"; verdict: {sign_verdict(values, VERDICTS[name])}" if name in VERDICTS else ""))
        lines += [""] + differences(scores, "resample_shift", "scratch", metrics)
        for metric in (fd, accuracy):
            compare([r for arm in TRANSFER for r in runs[arm].values() if (r / "quality.jsonl").is_file()],
                    out / "compare" / f"transfer_{metric}", metric)
    lines += ["", "## CPU (trainer processes, summed over resumed ones)", ""] + cpu_lines(out)
    lines += ["", "## Floors: 2,000 real held-out images scored as samples", ""] + floors(args)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cpu_lines(out):
    lines = []
    for path in sorted(out.glob("**/cpu_seconds.jsonl")):
        cpu, processes = run_cpu(path.parent)
        lines.append(f"- {path.parent.relative_to(out)}: {cpu:.0f} CPU-s in {processes} process(es)")
    return lines


def balanced(rows, n, seed=0):
    """n / 10 rows of each class, drawn at random (seed): as the samples are (sample i asks for class i % 10). A
    class-folder source lists its rows class by class, so its first n rows would hold a few classes only."""
    labels, order = np.asarray(rows["label"]), np.random.default_rng(seed).permutation(len(rows))
    return rows.select(sorted(np.concatenate([order[labels[order] == c][:n // 10] for c in np.unique(labels)])))


def floors(args):
    """What a perfect generator scores at SAMPLES samples: SAMPLES held-out training rows (of the recipe's 5,000,
    balanced over classes), preprocessed as in training, against each reference, plain and mixed-size; and the
    evaluation classifier's accuracy on each test split (class accuracy's ceiling)."""
    from training.evaluation.reference import split_images
    from training.config import config
    from training.data.sources import load_image, open_dataset, preprocess
    from training.evaluation import classifier
    from training.evaluation.metrics import all_scores
    from training.evaluation.reference import heldout, to_uint8

    lines, out = [], Path(args.out)
    for name, runs in (("plain (transfer)", sorted(out.glob("transfer/s*/scratch/config.json"))),
                       ("mixed sizes (conditioning)", sorted(out.glob("conditioning/*/s*/config.json")))):
        if not runs:
            continue
        cfg, judge, feature_fn, ref = reference(runs[0].parent, [], args)
        data = config.Config(cfg["data"])
        images = [to_uint8(preprocess(load_image(row[data.image_column]), data.resolution, data,
                                      flip=False)[0][None])[0]
                  for row in balanced(heldout(data), SAMPLES)]
        scores = all_scores(feature_fn(images), ref, "clean", SAMPLES, "classifier")
        s = {k.rsplit("_", 1)[0]: v for k, v in scores.items()}
        test, labels, _ = split_images(data, open_dataset(data, "test"), "test")
        lines.append(f"- {name}: FD {s['fd_classifier']:.3f}, KD {s['kd_classifier']:.4f}, precision "
                     f"{s['precision_classifier']:.3f}, recall {s['recall_classifier']:.3f}; the classifier's "
                     f"accuracy on its test split {classifier.accuracy(judge, test, labels):.4f}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["data", "cost", "conditioning", "pretrain", "transfer", "report"])
    p.add_argument("names", nargs="*", help="conditioning / transfer: ARM SEED; pretrain: SEED")
    p.add_argument("--out", default="runs/paper_claims")
    p.add_argument("--classifier", default="classifiers/fashion_mnist")
    p.add_argument("--steps", type=int, default=None, help="scaled down: the run's train.max_steps")
    args, args.extra = p.parse_known_args(argv)
    args.out = str(Path(args.out).resolve())  # absolute: the fine-tuning runs start in their seed's folder
    arms = {"conditioning": CONDITIONING, "transfer": TRANSFER}.get(args.stage)
    wanted = 2 if arms else 1 if args.stage == "pretrain" else 0
    if len(args.names) != wanted or (arms and args.names[0] not in arms) or (wanted and not args.names[-1].isdigit()):
        p.error(f"{args.stage} takes " + ("ARM SEED, ARM one of " + ", ".join(arms) if arms else "SEED" if wanted
                                          else "no names") + f"; given {args.names}")
    args.arm, args.seed = (args.names[0] if arms else None), (int(args.names[-1]) if wanted else None)
    torch.set_num_threads(1)
    {"data": data_stage, "cost": cost_stage, "conditioning": conditioning_stage, "pretrain": pretrain_stage,
     "transfer": transfer_stage, "report": report_stage}[args.stage](args)


if __name__ == "__main__":
    main()
