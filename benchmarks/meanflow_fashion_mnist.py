"""Feeds docs/benchmarks/meanflow_fashion_mnist.md (one- and two-step sampling: MeanFlow on Fashion-MNIST).

Does MeanFlow (objective.meanflow, training/objectives/meanflow.py) give one- and two-evaluation samples near the
flow-matching recipe's 20-step ones? configs/fashion_mnist.json and its MeanFlow variant (MEANFLOW: the paper's
defaults, sampled by the meanflow sampler), trained and scored by docs/evaluation.md's protocol (the evaluation
classifier's FD, KD, precision, recall, class accuracy against the test split), 3 seeds per arm:

  flow_matching  the recipe (benchmarks/fashion_mnist.py ours: the pixel baselines), scored at 1, 2 and 4 Euler
                 steps unguided (1, 2, 4 evaluations an image) and at its guidance 2 (2, 4, 8), beside its own
                 20-step score (40 evaluations)
  meanflow       the variant from scratch at the recipe's training CPU: 620 steps, the recipe's 1,200 over the
                 MeanFlow step's 1.94x (benchmarks/meanflow_cost.py); scored at 1, 2 and 4 meanflow steps
  finetune       the variant started from the flow-matching run of the same seed (init_from its export) for
                 FINETUNE_STEPS, a quarter of meanflow's CPU: warm-up and EMA scaled to the short run
                 (train.ema_decay 0.98: the source's EMA, taken with no warm-up, would otherwise hold 86% of the
                 flow-matching weights after 150 steps at the recipe's 0.999)

    python benchmarks/fashion_mnist.py ours --trainer flow_matching --seed 0 --num_samples 2000 --fractions \\
        --out runs/meanflow_bench/flow_matching                    # (or the baselines already trained)
    python benchmarks/meanflow_fashion_mnist.py train --arm meanflow --seed 0 --out runs/meanflow_bench
    python benchmarks/meanflow_fashion_mnist.py train --arm finetune --seed 0 --out runs/meanflow_bench \\
        --base runs/meanflow_bench/flow_matching
    python benchmarks/meanflow_fashion_mnist.py score --run runs/meanflow_bench/meanflow/flow_matching_s0 \\
        --sampler meanflow --steps 1 2 4 --guidance 1 --out runs/meanflow_bench
    python benchmarks/meanflow_fashion_mnist.py table --out runs/meanflow_bench --base runs/meanflow_bench/flow_matching

The fine-tuning lengths (issue 71; docs/benchmarks/meanflow_fashion_mnist.md, "Fine-tuning to one step"): each
FINETUNE_ARMS arm (`train --arm finetune --name ARM` with LENGTHS and the arm's keys) is one run of LENGTH_STEPS at a
constant LR whose checkpoints every LENGTH_STEPS / 8 steps are the shorter fine-tunings (a constant LR and an EMA of
fixed decay make step N of the long run what an N-step run is); `score --checkpoint` scores each at 1, 2, 4 and 20
meanflow steps, and `aims` reads them against the recipe's 20-step FD and its training CPU.

`train` is benchmarks/fashion_mnist.py's `ours` with the variant's arguments: the run, its CPU record
(cpu_seconds.json: "steps" is the training steps' own CPU, the equal-CPU measure) and its score at its own
settings (1 meanflow step). `score` writes each setting's eval_fid.py report under OUT/scores/ARM_sSEED/ (never
into the run, so the baselines stay as they were). `table` prints every arm and setting: mean and 95% t-interval
over the seeds, and each MeanFlow setting's FD over the recipe's 20-step FD of the same seed (its mean and
interval), the issue's aims being 2 at one evaluation and 1.3 at two.
"""
import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval_fid  # noqa: E402
from benchmarks import fashion_mnist  # noqa: E402  (the one module the other campaigns import, not a second copy)
from tools.compare import t_interval  # noqa: E402

# The MeanFlow variant of configs/fashion_mnist.json: the objective with the paper's defaults, its sampler at one
# step (the guidance is trained in: none on top), the equal-CPU step count, and no reference curves (the recipe's
# are flow matching's validation losses; MeanFlow's guided target moves them).
MEANFLOW = ["--objective.meanflow=true", "--val.sampler=meanflow", "--val.steps=1", "--val.guidance_scale=1",
            "--train.max_steps=620", "--val.every=310", "--ckpt.every=310", "--val.reference_curves=null"]
FINETUNE_STEPS = 150
FINETUNE = [f"--train.max_steps={FINETUNE_STEPS}", "--train.warmup_steps=15", "--train.ema_decay=0.98",
            f"--val.every={FINETUNE_STEPS}", f"--ckpt.every={FINETUNE_STEPS}"]
# Issue 71: the fine-tuning lengths in one run a (arm, seed), and the arms (FACM's anchor; DMF's interval placement)
LENGTH_STEPS = 600  # 97% of the recipe's training CPU at the MeanFlow step's 1.94x; checkpoints at 75, 150, 300
LENGTHS = [f"--train.max_steps={LENGTH_STEPS}", "--train.lr_schedule=constant", f"--ckpt.every={LENGTH_STEPS // 8}",
           "--ckpt.keep=8", f"--val.every={LENGTH_STEPS}"]
SCORED_STEPS = (75, 150, 300, 600)  # 12.1%, 24.3%, 48.5%, 97% of the recipe's training CPU
# (with the anchor, equal share 0.5 as the recipe: r < t, the JVP's part, is 25% of every arm's batch)
ANCHOR = ["--objective.meanflow_anchor=0.5", "--objective.meanflow_equal_share=0.5"]
FINETUNE_ARMS = {"plain": ["--objective.meanflow_anchor=0", "--objective.meanflow_interval_blocks=null"],
                 "anchor": [*ANCHOR, "--objective.meanflow_interval_blocks=null"],
                 "anchor_dmf": [*ANCHOR, "--objective.meanflow_interval_blocks=2"]}
AIMS = {1: 3.0, 2: 1.5, 20: 1.2}  # evaluations: the most FD / the recipe's 20-step FD (issue 71, item 3)
AIM_CPU = 0.5  # at no more than half the recipe's training CPU
METRICS = ("fd_classifier", "kd_classifier", "precision_classifier", "recall_classifier", "class_accuracy")


def value(metrics, name):
    """A report's metric by its name without the sample-count tag (fd_classifier_2k: "fd_classifier")."""
    return next(v for k, v in metrics.items() if k.rsplit("_", 1)[0] == name)


def train(args):
    """One seed of an arm: benchmarks/fashion_mnist.py's `ours` (train, record the CPU, score the export at the
    run's own settings) with the variant's arguments, under OUT/NAME/flow_matching_sSEED (NAME: --name, else the
    arm); arguments past the script's own go to the trainer after the variant's (an ablation's keys win)."""
    start = [*FINETUNE, f"--init_from={Path(args.base) / f'flow_matching_s{args.seed}' / 'export'}"] \
        if args.arm == "finetune" else []
    extra = [*MEANFLOW, *start, *args.extra]  # the arm's keys, then the command line's (a scaled-down run's too)
    fashion_mnist.ours(SimpleNamespace(out=str(Path(args.out) / (args.name or args.arm)), trainer="flow_matching",
                                       recipe=str(fashion_mnist.RECIPE), seed=args.seed, extra=extra,
                                       num_samples=args.num_samples, curve_samples=args.num_samples, fractions=[],
                                       classifier=args.classifier, eval_args=[]))


def score(args):
    """The run's export (or --checkpoint) at each --steps x --guidance with --sampler, one eval_fid.py report each,
    under OUT/scores/LABEL_sSEED/ (LABEL: --name, else the run's folder: "flow_matching" for the recipe's runs)."""
    run = Path(args.run)
    label = args.name or ("flow_matching" if run.parent.name in ("base", "flow_matching") else run.parent.name)
    where = ["--checkpoint", args.checkpoint] if args.checkpoint else []
    for steps in args.steps:
        for guidance in args.guidance:
            prefix = Path(args.checkpoint).name + "-" if args.checkpoint else ""
            setting = f"{prefix}{args.sampler}{steps}-g{guidance:g}"
            out = Path(args.out) / "scores" / f"{label}_{run.name.rsplit('_', 1)[-1]}" / setting
            if not (out / "report.json").is_file():
                eval_fid.main(["--run", str(run), *where, "--out_dir", str(out),
                               *fashion_mnist.score_args(SimpleNamespace(classifier=args.classifier, out=args.out),
                                                         args.num_samples),
                               "--sampler", args.sampler, "--steps", str(steps), "--guidance_scale", str(guidance)])


def setting(report):
    """What a score sampled: (checkpoint step, None for the export; sampler; steps; guidance), its row in the table."""
    return report["model"].get("step"), report["sampler"], report["steps"], report["guidance_scale"]


def baselines(args):
    """{seed: the recipe's own score of that seed's baseline under --base}: its final score (eval/test-stepN at
    the run's train.max_steps), made at the recipe's own sampling settings."""
    found = {}
    for run in sorted(Path(args.base).glob("flow_matching_s*")):
        final = run / "eval" / f"test-step{json.loads((run / 'config.json').read_text())['train']['max_steps']}"
        if (final / "report.json").is_file():
            found[int(run.name.rsplit("_s", 1)[1])] = json.loads((final / "report.json").read_text())
    return found


def arm_folders(args):
    """OUT's folders of trained arms (ARM/flow_matching_sSEED), without --base's when it lies in OUT: the baselines
    are the recipe's arm, "flow_matching", never an arm named after their folder."""
    return [folder for folder in sorted(Path(args.out).iterdir()) if list(folder.glob("flow_matching_s*/config.json"))
            and folder.resolve() != Path(args.base).resolve()]


def reports(args):
    """{(arm, checkpoint step or None, sampler, steps, guidance): {seed: metrics}} of every score: the recipe's own
    score of each baseline (under --base), each trained arm's score at its own settings (benchmarks/
    fashion_mnist.py's eval/test-stepN, under OUT/ARM/), and every score under OUT/scores/."""
    found = {}

    def add(arm, report, seed):
        found.setdefault((arm, *setting(report)), {})[seed] = report["metrics"]

    for seed, report in baselines(args).items():
        add("flow_matching", report, seed)
    for folder in arm_folders(args):
        for path in sorted(folder.glob("flow_matching_s*/eval/test-step*/report.json")):
            add(folder.name, json.loads(path.read_text()), int(path.parts[-4].rsplit("_s", 1)[1]))
    for path in sorted((Path(args.out) / "scores").glob("*/*/report.json")):
        arm, seed = path.parts[-3].rsplit("_s", 1)
        add(arm, json.loads(path.read_text()), int(seed))
    return found


def table(args):
    found, settings = reports(args), {setting(r) for r in baselines(args).values()}
    if len(settings) > 1:
        sys.exit(f"{args.base}: the baselines were scored at different settings {sorted(settings, key=str)}; the "
                 f"recipe's FD each setting is read against must be one")
    recipe = found.get(("flow_matching", *settings.pop()), {}) if settings else {}  # the recipe's own: 20 steps
    print(f"| arm | sampling | seeds | {' | '.join(METRICS)} | FD / the recipe's 20-step FD |\n"
          f"|---|---|---|{'---|' * len(METRICS)}---|")
    for (arm, step, sampler, steps, guidance), by_seed in sorted(found.items(), key=lambda kv: str(kv[0])):
        evaluations = steps * (1 + (guidance != 1))  # one a step, two with guidance on top (one batched pass)
        sampling = f"{sampler} {steps}, guidance {guidance:g} ({evaluations} evaluations)"
        seeds = sorted(by_seed)
        cells = []
        for metric in METRICS:
            mean, low, high = t_interval([value(by_seed[s], metric) for s in seeds])
            cells.append(f"{mean:.4g} [{low:.3g}, {high:.3g}]" if len(seeds) > 1 else f"{mean:.4g}")
        paired = [s for s in seeds if s in recipe]
        ratio = t_interval([value(by_seed[s], "fd_classifier") / value(recipe[s], "fd_classifier") for s in paired]) \
            if paired else None
        ratio = "-" if ratio is None else f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]" if len(paired) > 1 \
            else f"{ratio[0]:.2f}"
        name = arm if step is None else f"{arm}, step {step}"
        print(f"| {name} | {sampling} | {','.join(map(str, seeds))} | {' | '.join(cells)} | {ratio} |")
    base = [json.loads(p.read_text())["steps"]
            for p in sorted(Path(args.base).glob("flow_matching_s*/cpu_seconds.json"))]
    for folder in [f for f in arm_folders(args) if list(f.glob("flow_matching_s*/cpu_seconds.json"))]:
        cpu = [json.loads(p.read_text())["steps"] for p in sorted(folder.glob("flow_matching_s*/cpu_seconds.json"))]
        if base:
            print(f"{folder.name}: training steps' CPU {t_interval(cpu)[0]:.0f} s, seeds {[round(c) for c in cpu]} "
                  f"(the recipe's: {t_interval(base)[0]:.0f} s, {[round(c) for c in base]}; ratio "
                  f"{t_interval(cpu)[0] / t_interval(base)[0]:.2f})")


def recipe_cpu(args):
    """{seed: the recipe's training steps' CPU} of the baselines under --base."""
    return {int(p.parent.name.rsplit("_s", 1)[1]): json.loads(p.read_text())["steps"]
            for p in sorted(Path(args.base).glob("flow_matching_s*/cpu_seconds.json"))}


def length_rows(found, recipe, recipe_cpu_s, args):
    """{(arm, step): {"fraction": per seed, evaluations: per seed FD / the recipe's 20-step FD, "fd_E": FDs}} of
    the fine-tuning arms' checkpoint scores (meanflow sampler, guidance 1): a checkpoint's training CPU is its share
    of the run's steps' CPU, over the recipe's of the same seed."""
    rows = {}
    for (arm, step, sampler, steps, guidance), by_seed in found.items():
        if arm not in FINETUNE_ARMS or step is None or sampler != "meanflow" or guidance != 1:
            continue
        row = rows.setdefault((arm, step), {})
        for seed, metrics in by_seed.items():
            run = Path(args.out) / arm / f"flow_matching_s{seed}"
            if seed not in recipe or seed not in recipe_cpu_s or not (run / "cpu_seconds.json").is_file():
                continue
            cpu = json.loads((run / "cpu_seconds.json").read_text())["steps"] * step / LENGTH_STEPS
            row.setdefault("fraction", {})[seed] = cpu / recipe_cpu_s[seed]
            row.setdefault(steps, {})[seed] = value(metrics, "fd_classifier") / value(recipe[seed], "fd_classifier")
            row.setdefault(f"fd_{steps}", {})[seed] = value(metrics, "fd_classifier")
    return rows


def interval_text(values, digits=2):
    mean, low, high = t_interval(list(values))
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]" if len(values) > 1 else f"{mean:.{digits}f}"


def aims(args):
    """Issue 71's aims on the fine-tuning lengths: each arm and length, its training CPU over the recipe's and FD at
    1, 2, 4 and 20 evaluations over the recipe's 20-step FD (mean and 95% t-interval over the seeds), each aim met
    where the seeds' mean is within it; the arms paired by seed; flow matching's best FD at the same evaluation
    counts; and, for an arm that misses the one-step aim, the CPU where a power law through its lengths reaches it."""
    found, settings = reports(args), {setting(r) for r in baselines(args).values()}
    if len(settings) != 1:
        sys.exit(f"{args.base}: no baselines scored at one setting ({sorted(settings, key=str)})")
    recipe, cpu_s = found.get(("flow_matching", *settings.pop()), {}), recipe_cpu(args)
    rows = length_rows(found, recipe, cpu_s, args)
    evaluations = " | ".join(f"{e} eval. FD / recipe's" for e in (1, 2, 4, 20))
    print(f"| arm | step | training CPU / the recipe's | {evaluations}"
          + " | aims (1 <= 3x, 2 <= 1.5x, 20 <= 1.2x, CPU <= 0.5) |")
    print("|---|---|---|---|---|---|---|---|")
    for (arm, step), row in sorted(rows.items()):
        if "fraction" not in row:
            continue
        means = {k: t_interval(list(v.values()))[0] for k, v in row.items() if not str(k).startswith("fd_")}
        met = [f"{e}: {'met' if means[e] <= limit else 'not met'}" for e, limit in AIMS.items() if e in means]
        met.append(f"CPU: {'met' if means['fraction'] <= AIM_CPU else 'not met'}")
        cells = [interval_text(row[e].values()) if e in row else "-" for e in (1, 2, 4, 20)]
        fraction = interval_text(row["fraction"].values())
        print(f"| {arm} | {step} | {fraction} | {' | '.join(cells)} | {', '.join(met)} |")
    print("\nPaired by seed (FD difference, 95% t-interval):")
    for a, b in (("anchor", "plain"), ("anchor_dmf", "anchor")):
        for step in SCORED_STEPS:
            for e in (1, 2, 20):
                ra, rb = rows.get((a, step), {}).get(f"fd_{e}", {}), rows.get((b, step), {}).get(f"fd_{e}", {})
                seeds = sorted(set(ra) & set(rb))
                if len(seeds) > 1:
                    print(f"  {a} - {b}, step {step}, {e} evaluations: "
                          f"{interval_text([ra[s] - rb[s] for s in seeds], 3)} (seeds {seeds})")
    print("\nFlow matching at the same evaluation counts (its best setting, Euler, guidance 1 or 2):")
    for e in (1, 2, 4):
        best = [(np.mean([value(m, "fd_classifier") for m in by_seed.values()]), f"{sampler} {steps}, g{guidance:g}")
                for (arm, step, sampler, steps, guidance), by_seed in found.items()
                if arm == "flow_matching" and step is None and steps * (1 + (guidance != 1)) == e]
        if best:
            print(f"  {e} evaluations: FD {min(best)[0]:.3f} ({min(best)[1]})")
    for arm in FINETUNE_ARMS:
        points = sorted((t_interval(list(row["fraction"].values()))[0], t_interval(list(row[1].values()))[0])
                        for (name, _), row in rows.items() if name == arm and 1 in row and "fraction" in row)
        if len(points) >= 2 and points[-1][1] > AIMS[1]:
            print(f"{arm}: {predicted_cpu(points, AIMS[1])}")


def predicted_cpu(points, target):
    """Where log(FD ratio) = a + b log(CPU fraction), fitted through (fraction, ratio) points, reaches `target`."""
    x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    b, a = np.polyfit(x, y, 1)
    if b >= 0:
        return f"the one-evaluation ratio does not fall with training CPU here (slope {b:+.2f}): no prediction"
    return (f"one evaluation at {target:g}x the recipe's FD predicted at {np.exp((np.log(target) - a) / b):.2f}x the "
            f"recipe's training CPU (power law through {len(points)} lengths, slope {b:+.2f}; an extrapolation)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["train", "score", "table", "aims"])
    p.add_argument("--arm", default="meanflow", choices=["meanflow", "finetune"])
    p.add_argument("--name", default=None, help="train: the arm's folder (an ablation's); score: its label")
    p.add_argument("--checkpoint", default=None, help="score: a checkpoint folder of the run instead of its export")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/meanflow_bench")
    p.add_argument("--base", default="runs/meanflow_bench/flow_matching", help="the recipe's runs, flow_matching_sSEED")
    p.add_argument("--run", default=None, help="score: a run folder (its export is scored)")
    p.add_argument("--sampler", default="meanflow")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--guidance", type=float, nargs="+", default=[1.0])
    p.add_argument("--classifier", default="classifiers/fashion_mnist")
    p.add_argument("--num_samples", type=int, default=2000, help="samples per score (the recent campaigns': 2,000)")
    args, args.extra = p.parse_known_args(argv)
    {"train": train, "score": score, "table": table, "aims": aims}[args.what](args)


if __name__ == "__main__":
    main()
