"""Feeds docs/benchmarks/real_options.md (the training options on the real-image recipe).

The training options on the real-image recipe (issue 43, item 3): Muon, x-prediction, contrastive flow matching
and REPA (in-domain encoder, and its random control) against the baseline, and a combination, on
configs/fashion_mnist.json, for both trainers where an option applies; at equal steps and at equal CPU time; scored
by docs/evaluation.md's protocol (benchmarks/fashion_mnist.py: eval_fid.py --classifier --features classifier
--reference_split test); compared with tools/compare.py (paired over seeds, 95% intervals).
docs/benchmarks/real_options.md has the commands and the numbers.

    python tools/classifier.py --config configs/fashion_mnist.json --out classifiers/fashion_mnist   # once
    python tools/repa_encoder.py --out encoders/fashion_mnist                                         # once
    python benchmarks/real_options.py run --seeds 0,1,2 --budgets steps      # train and score (resumes)
    python benchmarks/real_options.py cost --seeds 0,1,2         # CPU-s per step and peak memory, from those runs
    python benchmarks/real_options.py run --seeds 0,1,2 --budgets cpu [--combo x0,muon]   # the equal-CPU runs
    python benchmarks/real_options.py compare [--combo x0,muon]  # each arm against base, per trainer and budget

Every other argument (e.g. --data.cache_dir=/tmp/fm/cache) goes to every trainer run. Budgets: "steps" trains
every arm --steps (default: the recipe's train.max_steps); "cpu" trains each arm for the steps the base arm's CPU
time buys at that arm's CPU seconds per step (`cost`, OUT/cost.json: read from the equal-steps runs, each the
CPU of the training steps alone, as the trainer logs it (cpu_s_per_step: its process's own, so load from other
processes does not count; start-up, validations and the export, the same in every arm, left out); short timing
runs measured the same arm 25% apart here, three whole runs agree within a few per cent). An arm within COST_TIE
of base's CPU per step trains base's steps at equal CPU too (the difference is below what `cost` can tell),
sharing its equal-steps runs. A run is named by what decides it: OUT/steps<N>/<arm>/<trainer>_s<seed> (the
combination's arm: combo_<a>+<b>), so runs of equal steps from either budget are one run.
Peak memory is the trainer process's peak RSS (the kernel's, as the trainer logs on CPU). Each step is skipped
when its result is already in OUT, so a stopped campaign resumes; progress is one plain line per run.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import fashion_mnist  # noqa: E402

ENCODERS = ROOT / "encoders" / "fashion_mnist"  # tools/repa_encoder.py --out encoders/fashion_mnist
# REPA at this size: the paper's weight; block 2 of the recipe's 6 (the paper's 4 of 12); the MLP projector's
# hidden width 256 for a model of width 128 (the paper's 2048 is for width 1152); targets encoded from each
# batch's pixels (pixel space), so the cache stays the base arm's and the encoder's cost is in the step.
REPA = ["--objective.repa_weight=0.5", "--objective.repa_block=2", "--objective.repa_projector_dim=256",
        "--objective.repa_targets=on_the_fly"]
ARMS = {"base": [],
        "muon": ["--train.optimizer=muon"],
        "x0": ["--objective.prediction=x0"],  # DDPM: its own x0 target (the loss on x0), JiT's on flow matching
        "contrastive": ["--objective.contrastive_weight=0.05"],
        "repa_trained": [*REPA, f"--objective.repa_encoder={ENCODERS / 'trained'}"],
        "repa_random": [*REPA, f"--objective.repa_encoder={ENCODERS / 'random'}"]}
FLOW_MATCHING_ONLY = {"contrastive"}
TRAINERS = ("flow_matching", "ddpm")
# Every arm starts from the recipe as it was when the campaign ran: v-prediction and AdamW (the recipe predicts x0 and
# trains with Muon at 1e-2 since this campaign settled both at 1,200 steps; an arm's own arguments come after, so the
# x0 and muon arms and the combinations override them, and --train.muon_lr=1e-2 after those sets Muon's LR).
RUN = ["--log.wandb=off", "--log.report=false", "--objective.prediction=v", "--train.optimizer=adamw",
       "--train.muon_lr=null"]
COST_TIE = 0.05  # below this, a CPU per step difference is within the seeds' spread (docs/benchmarks/real_options.md)


def arms(combo):
    """{name: trainer arguments}: ARMS and, with --combo a,b, the arm "combo" that stacks them."""
    out = dict(ARMS)
    if combo:
        parts = combo.split(",")
        if unknown := [a for a in parts if a not in ARMS or a == "base"]:
            sys.exit(f"--combo {combo}: {unknown} not among the options {[a for a in ARMS if a != 'base']}")
        if {"repa_trained", "repa_random"} <= set(parts):
            sys.exit(f"--combo {combo}: one REPA encoder at a time")
        out["combo"] = [arg for a in parts for arg in ARMS[a]]
    return out


def applies(arm, trainer, combo):
    parts = combo.split(",") if arm == "combo" else [arm]
    return trainer == "flow_matching" or not FLOW_MATCHING_ONLY & set(parts)


def check_encoders(table):
    if any("--objective.repa_weight=0.5" in arm for arm in table.values()):
        missing = [str(ENCODERS / k) for k in ("trained", "random") if not (ENCODERS / k / "config.json").is_file()]
        if missing:
            sys.exit(f"the REPA arms need {', '.join(missing)}: run `python tools/repa_encoder.py --out {ENCODERS}`")


def cost(args, table):
    """CPU seconds per step and peak memory of every arm and trainer, from its equal-steps runs (--steps, every
    seed of --seeds): a run's CPU per step is its training steps' own (fashion_mnist.step_cpu), its memory the
    largest peak_memory_gb the trainer logged (on CPU, the process's peak RSS). Into OUT/cost.json."""
    path = Path(args.out) / "cost.json"
    result = json.loads(path.read_text()) if path.is_file() else {}  # other trainers' and arms' rows stay
    for trainer in args.trainers:
        for arm in [a for a in table if applies(a, trainer, args.combo)]:
            runs = [run_dir(args, trainer, arm, "steps", seed, args.steps)[0] for seed in args.seeds]
            if missing := [str(r) for r in runs if not (r / "export").is_dir()]:
                print(f"cost {trainer} {arm}: not yet trained: {', '.join(missing)}")
                continue
            cpu = [fashion_mnist.step_cpu(r) for r in runs]
            logs = [(r / "metrics.jsonl").read_text().splitlines() for r in runs]
            peak = [max(json.loads(line).get("peak_memory_gb", 0) for line in log) for log in logs]
            result.setdefault(trainer, {})[name(args, arm)] = {"cpu_s_per_step": sum(cpu) / len(cpu),
                                                               "cpu_s_per_step_runs": cpu,
                                                   "peak_memory_gib": max(peak), "steps": args.steps}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    for trainer, rows in result.items():
        base = rows.get("base")
        for arm, row in rows.items():
            rel = (f" ({row['cpu_s_per_step'] / base['cpu_s_per_step']:.2f}x base, "
                   f"{row['peak_memory_gib'] - base['peak_memory_gib']:+.3f} GiB)") if base else ""
            spread = "/".join(f"{c:.3f}" for c in row["cpu_s_per_step_runs"])
            print(f"{trainer:14s} {arm:13s} {row['cpu_s_per_step']:.3f} CPU-s/step (runs {spread})  "
                  f"{row['peak_memory_gib']:.2f} GiB{rel}")


def measured_costs(args, trainer):
    path = Path(args.out) / "cost.json"
    return json.loads(path.read_text()).get(trainer, {}) if path.is_file() else {}


def steps_for(args, trainer, arm, budget, recipe_steps):
    """The arm's train.max_steps under a budget: the recipe's, or the base arm's CPU time over the arm's CPU per
    step."""
    if budget == "steps" or arm == "base":
        return recipe_steps
    rows, path = measured_costs(args, trainer), Path(args.out) / "cost.json"
    key = name(args, arm)
    if "base" not in rows or key not in rows or rows[key]["steps"] != recipe_steps:
        sys.exit(f"budget 'cpu' needs the CPU per step of base and {key} ({trainer}) at --steps {recipe_steps} in "
                 f"{path}: train the equal-steps runs (--budgets steps), then `python benchmarks/real_options.py cost`")
    ratio = rows["base"]["cpu_s_per_step"] / rows[key]["cpu_s_per_step"]
    # a run is a step or more
    return recipe_steps if abs(ratio - 1) <= COST_TIE else max(1, round(recipe_steps * ratio))


def name(args, arm):
    """An arm's folder and cost.json key: the combination's names what it stacks (another one is not its runs)."""
    return arm if arm != "combo" else "combo_" + "+".join(args.combo.split(","))


def run_dir(args, trainer, arm, budget, seed, recipe_steps):
    steps = steps_for(args, trainer, arm, budget, recipe_steps)
    return Path(args.out) / f"steps{steps}" / name(args, arm) / f"{trainer}_s{seed}", steps


def campaign(args, table):
    """Train and score every (budget, arm, trainer, seed), skipping what is already there: the equal-steps runs
    first, since the equal-CPU step counts are measured on them (`cost`, run here between the two)."""
    started = time.time()
    for budget in args.budgets:
        if budget == "cpu" and any(measured_costs(args, t).get(name(args, a), {}).get("steps") != args.steps
                                   for t in args.trainers for a in ["base", *table] if applies(a, t, args.combo)):
            # measured once, on the seeds given then: later seeds keep its step counts
            cost(args, {"base": [], **table})
        todo = []
        for seed in args.seeds:
            for trainer in args.trainers:
                for arm in [a for a in table if applies(a, trainer, args.combo)]:
                    run, steps = run_dir(args, trainer, arm, budget, seed, args.steps)
                    if run not in [t[4] for t in todo]:
                        todo.append((budget, arm, trainer, seed, run, steps))
        for i, (budget, arm, trainer, seed, run, steps) in enumerate(todo, 1):
            if (run / "quality.jsonl").is_file():
                print(f"[{budget} {i}/{len(todo)}] {arm} {trainer} seed {seed}: done before", flush=True)
                continue
            print(f"[{budget} {i}/{len(todo)}] {arm} {trainer} seed {seed}: {steps} steps "
                  f"({time.time() - started:.0f} s into this session)", flush=True)
            fashion_mnist.ours(argparse.Namespace(
                trainer=trainer, recipe=str(fashion_mnist.RECIPE), seed=seed, out=str(run.parent),
                classifier=args.classifier, num_samples=args.num_samples, curve_samples=args.num_samples, fractions=[],
                eval_args=["--stats_cache", str(Path(args.out) / "fid_stats")],
                extra=[*RUN, *table[arm], f"--train.max_steps={steps}", *args.extra]))


def compare(args, table):
    """tools/compare.py on each trainer and budget: every arm against base, paired over seeds."""
    from tools.compare import compare as compare_runs

    recipe_steps = args.steps
    for trainer in args.trainers:
        for budget in args.budgets:
            measured = [a for a in table if applies(a, trainer, args.combo)
                        and name(args, a) in measured_costs(args, trainer)]
            if budget == "cpu" and "base" not in measured:
                print(f"{trainer} cpu: no CPU cost measured yet (real_options.py cost)")
                continue
            runs = [run for arm in table if applies(arm, trainer, args.combo) and (budget == "steps" or arm in measured)
                    for seed in args.seeds
                    for run in [run_dir(args, trainer, arm, budget, seed, recipe_steps)[0]]
                    if (run / "quality.jsonl").is_file()]  # base first: compare's arm A
            if len({r.parent for r in runs}) < 2:
                print(f"{trainer} {budget}: fewer than two arms scored yet")
                continue
            keys = json.loads((runs[0] / "quality.jsonl").read_text().splitlines()[-1])
            # a compare of other arms: its own folder
            compared = "_vs_".join(dict.fromkeys(r.parent.name for r in runs))
            for metric in [k for k in keys if k.startswith(("fd_classifier", "class_accuracy"))]:
                out = Path(args.out) / "compare" / f"{trainer}_steps{recipe_steps}_{budget}_{metric}" / compared
                md = compare_runs(runs, out, metric=metric)
                print(f"{trainer} {budget} {metric}: {md}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["cost", "run", "compare"])
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    p.add_argument("--combo", default=None, help="the options the combination arm stacks, e.g. x0,muon (chosen "
                   "from the single-option results)")
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None, help="the equal-steps budget (default: the recipe's "
                   "train.max_steps); equal CPU is the base arm's CPU time at it")
    p.add_argument("--budgets", default="steps,cpu", help="steps, cpu or both: which comparisons to train / make")
    p.add_argument("--out", default="runs/real_options")
    p.add_argument("--classifier", default="classifiers/fashion_mnist")
    p.add_argument("--num_samples", type=int, default=2000, help="samples scored per run (the protocol's "
                   "final score: 10,000; 2,000 as in docs/benchmarks/real_options.md's 3-seed comparison)")
    args, args.extra = p.parse_known_args(argv)
    if bad := [a for a in args.extra if a.startswith("--train.max_steps")]:
        p.error(f"{bad[0]}: give the budget as --steps (the equal-CPU step counts are computed from it)")
    args.steps = args.steps or json.loads(fashion_mnist.RECIPE.read_text())["train"]["max_steps"]
    table = arms(args.combo)
    names = args.arms.split(",") + (["combo"] if args.combo else [])
    if unknown := [a for a in names if a not in table]:
        p.error(f"--arms: {unknown} unknown; the arms: {list(table)}")
    if "base" not in names and args.what != "run":
        names.insert(0, "base")  # every comparison, and every cost ratio, is against it (`run` trains what it is given)
    table = {a: table[a] for a in sorted(names, key=list(table).index)}
    args.trainers, args.seeds = args.trainers.split(","), [int(s) for s in args.seeds.split(",")]
    if bad := [b for b in args.budgets.split(",") if b not in ("steps", "cpu")]:
        p.error(f"--budgets: {bad}; the budgets: steps, cpu")
    args.budgets = args.budgets.split(",")
    if bad := [t for t in args.trainers if t not in TRAINERS]:
        p.error(f"--trainers: {bad}; the trainers: {list(TRAINERS)}")
    check_encoders(table)
    {"cost": cost, "run": campaign, "compare": compare}[args.what](args, table)


if __name__ == "__main__":
    main()
