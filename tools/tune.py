"""Choose a checkpoint's sampling settings on images held out from the training split: guidance scale, guidance
interval, sampler steps (a MeanFlow model's: 1, 2 and 4 unless --steps says, at guidance 1 unless --guidance says)
and (where the run kept post-hoc EMA snapshots) EMA length, a grid searched at a small sample count with
eval_fid.py, then the best two confirmed at the full count.

    python tools/tune.py --run runs/flow_matching_fashion_mnist --guidance 1,1.5,2,3 --steps 16,32 \\
        --guidance_interval 0,1 0.1,0.9 --num_samples 2000 --confirm_samples 10000 \\
        --classifier classifiers/fashion_mnist --features classifier
    python eval_fid.py --run ... --reference_split test ...   # the final score, at the tuned settings (tuned.json)

Search: every setting samples the same seeds (eval_fid.py --seed, 0 by default) at --num_samples, so the
differences are the settings'. Confirmation (--confirm_samples N, 0: none): the search's best and runner-up are
sampled again on fresh noise, in CONFIRM_BLOCKS disjoint blocks of N / CONFIRM_BLOCKS samples (seeds seed + 1 ..
seed + 5, the same for both settings, so block b of each has the same noise and classes): N samples per setting, as
one full-count evaluation costs, but each block scored on its own. A setting's confirmed score is the mean of its
block scores with a 95% Student-t interval over the blocks, and the difference best - runner-up is paired by block
with its paired t-interval (tools/compare.py's statistics: exact coverage for normal block scores at any number
of blocks, where a percentile bootstrap of 5 values cannot be). Fresh seeds, so the winner's luck in the search
does not carry into its confirmed score. A block's score is a distance at N / 5 samples, biased upward against
one at N (FID's bias falls as 1 / n), the same for both settings: it is named with that count (10,000 in 5 blocks:
fd_classifier_2k), and compared with distances at that count. The one with the lower confirmed mean is chosen;
the output says whether the interval of the difference settles it.

The reference is always the run's held-out rows (eval_fid.py's default): --reference and --reference_split are
refused, and so is a run whose held-out rows are a test split (training/evaluation/reference.py, check_selection), so no
setting is ever chosen on the images that report the final score. The score is the first distance in
eval_fid.py's report (FID, or fd_classifier with --features classifier); lower wins. Writes RUN/tuned.json: the
search table, the confirmation, the chosen setting ("best") and the runner-up, the model they were chosen for (what
it is: the digest of its weights, where they were, its step, EMA or raw; --checkpoint latest is resolved to the
checkpoint it names when the search starts) and the sampler, and "at_edge": a note for each setting searched at
three or more values whose chosen value is the smallest or largest of them (printed too: the best may lie beyond
the grid). eval_fid.py and sample.py then sample that model, with that sampler, with "best" wherever no flag sets a
setting (tuning.tuned_defaults; --untuned: the run's own settings), and the export
takes it as its pipeline's defaults (tools/export.py). Any other argument goes to eval_fid.py as is (--help lists them:
--classifier, --features, --checkpoint, --batch_size, ...).

Output: one line per evaluation (eval_fid.py's own lines are kept back, and shown only if it fails), each warning
once, the confirmation by block, the table, the choice.
"""
import argparse
import contextlib
import io
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import eval_fid  # noqa: E402
from tools.compare import paired_comparison, t_interval  # noqa: E402
from training.evaluation import tuning  # noqa: E402
from training.evaluation.reference import check_selection  # noqa: E402
from training.evaluation.sampling import interval_arg, load_model  # noqa: E402
from training.objectives import meanflow  # noqa: E402


def floats(text):
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers separated by commas, e.g. 1,2,3") from None


def distance(metrics):
    """(name, value) of the report's first distance: FID, else the classifier's or DINOv2's Frechet distance."""
    return next((k, v) for k, v in metrics.items() if k.startswith(("fid_", "fd_")))


# A MeanFlow model (training/objectives/meanflow.py) is made for few steps, and which few is its main setting: 1, 2
# and 4 steps (each one evaluation) are searched unless --steps names others.
MEANFLOW_STEPS = (1, 2, 4)


def default_steps(cfg, sampler):
    return list(MEANFLOW_STEPS) if sampler == "meanflow" else [cfg["val"]["steps"]]


def default_guidance(cfg):
    """The run's val.guidance_scale; a MeanFlow model with guidance trained into its weights: 1, none on top (a run
    recorded before MeanFlow sampled its own way by default holds the flow-matching sampler's, guidance 7)."""
    obj = cfg.get("objective", {})
    return [1.0] if obj.get("meanflow") and obj["meanflow_guidance"] > 1 else [cfg["val"]["guidance_scale"]]


CONFIRM_BLOCKS = 5  # disjoint seed blocks of the confirmation (tools/compare.py: 3 seeds at least, 5 where open)


def label(row):
    lo, hi = row["guidance_interval"]
    return (f"guidance {row['guidance_scale']:g} in t [{lo:g}, {hi:g}], {row['steps']} steps, "
            f"EMA {row['phema_std'] or 'export'}")


def at_edge(best, rows):
    """The searched settings whose chosen value is the smallest or largest of three or more searched: the best may
    lie beyond the grid (the best guidance moves with training length and recipe: LightningDiT#49)."""
    notes = []
    for key, flag in (("guidance_scale", "--guidance"), ("steps", "--steps"), ("phema_std", "--phema_std")):
        values = sorted({row[key] for row in rows if row[key] is not None})
        if len(values) >= 3 and best[key] in (values[0], values[-1]):
            side = "smallest" if best[key] == values[0] else "largest"
            notes.append(f"{flag} {best[key]:g} is the {side} of {', '.join(f'{v:g}' for v in values)} searched: "
                         f"the best may lie beyond it; search past it")
    return notes


OWN = {"--run", "--num_samples", "--guidance_scale", "--guidance_interval", "--steps", "--phema_std", "--untuned",
       "--reference", "--reference_split", "--out_dir", "--generate_only"}  # set per evaluation, or refused


def evaluate(argv, feature_fn):
    """eval_fid.main(argv) with its own lines kept back (tune prints one per evaluation); they are printed if it
    fails, so nothing it said is lost."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            return eval_fid.main(argv, feature_fn=feature_fn, written_by="tools/tune.py")  # the card leaves it out
    except BaseException:
        sys.stdout.write(held.getvalue())
        raise


def main(argv=None, feature_fn=None):
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=eval_fid.passed_on(OWN, "in every evaluation"))
    p.add_argument("--run", required=True, help="the run folder: its export, or the checkpoint that --checkpoint "
                   "names; tuned.json is written there")
    p.add_argument("--guidance", type=floats, default=None, help="guidance scales; default: the run's "
                   "val.guidance_scale (a MeanFlow model with guidance in its weights: 1)")
    p.add_argument("--guidance_interval", type=interval_arg, nargs="+", default=None, help="'lo,hi' "
                   "intervals (flow-matching t, 1 = noise), e.g. 0,1 0.1,0.9; default: the run's val.guidance_interval")
    p.add_argument("--steps", type=floats, default=None, help="sampler steps; default: the run's val.steps (the "
                   f"meanflow sampler: {','.join(map(str, MEANFLOW_STEPS))})")
    p.add_argument("--phema_std", type=floats, default=None, help="post-hoc EMA lengths (relative std); default: "
                   "the export's EMA")
    p.add_argument("--num_samples", type=int, default=2000, help="samples per setting in the search")
    p.add_argument("--confirm_samples", type=int, default=10_000, help="samples per setting confirming the best two, "
                   f"in {CONFIRM_BLOCKS} blocks (the real-image protocol's 10k); 0: no confirmation")
    args, eval_args = p.parse_known_args(argv)
    if args.confirm_samples and args.confirm_samples < 2 * CONFIRM_BLOCKS:
        raise ValueError(f"--confirm_samples={args.confirm_samples}: at least {2 * CONFIRM_BLOCKS} ({CONFIRM_BLOCKS} "
                         f"blocks of 2), or 0 for no confirmation")
    cfg = json.loads((Path(args.run) / "config.json").read_text()) if (Path(args.run) / "config.json").is_file() \
        else load_model(args.run)[1]
    given = eval_fid.parse_args(["--run", args.run, *eval_args])
    check_selection(given, cfg)
    # The model, by what it is: 'latest' is the checkpoint it names now, for every evaluation and in tuned.json.
    model = tuning.model_identity(args.run, given.checkpoint, given.weights)
    sampler = given.sampler or model["sampler"]
    pinned = ["--checkpoint", str(Path(args.run) / model["model"])] if given.checkpoint else []
    grid = list(itertools.product(args.guidance or default_guidance(cfg),
                                  args.guidance_interval or [list(cfg["val"].get("guidance_interval", [0.0, 1.0]))],
                                  [int(s) for s in args.steps or default_steps(cfg, sampler)],
                                  args.phema_std or [None]))
    warned = set()

    def score(row, num_samples, seed):
        """eval_fid.py at `row`'s settings, every one given (--untuned: an earlier tuned.json never fills one in):
        (distance name, value, the report's class accuracies, seconds), or None off the main process. Each of its
        warnings is printed the first time it comes."""
        t0 = time.perf_counter()
        report = evaluate(["--run", args.run, *eval_args, *pinned, "--untuned", "--num_samples", str(num_samples),
                           "--seed", str(seed), "--guidance_scale", str(row["guidance_scale"]), "--steps",
                           str(row["steps"]), "--guidance_interval", ",".join(map(str, row["guidance_interval"])),
                           *(["--phema_std", str(row["phema_std"])] if row["phema_std"] else [])], feature_fn)
        if report is None:  # not the main process (accelerate launch): it only helps sample
            return None
        for w in report["warnings"]:
            if w not in warned:
                warned.add(w)
                print(f"warning: {w}", flush=True)
        accuracy = {k: v for k, v in report["metrics"].items() if k.startswith("class_accuracy")}
        return (*distance(report["metrics"]), accuracy, time.perf_counter() - t0)

    if int(os.environ.get("RANK", 0)) == 0:
        confirming = (f"the best two in {CONFIRM_BLOCKS} blocks of {args.confirm_samples // CONFIRM_BLOCKS:,} fresh "
                      f"samples" if args.confirm_samples else "no confirmation")
        print(f"tune: {len(grid)} settings at {args.num_samples:,} samples each, then {confirming}; "
              f"{tuning.describe(model)}, {sampler} sampler, against the run's held-out rows", flush=True)
        # a MeanFlow model searched otherwise than its own way: said once, not in every evaluation's hidden lines
        if note := next(filter(None, (meanflow.sampling_note(cfg.get("objective", {}), sampler, steps, guidance)
                                      for guidance, _, steps, _ in grid)), None):
            print(f"note: a MeanFlow model sampled otherwise: {note}", flush=True)
    rows = []
    for i, (guidance, interval, steps, std) in enumerate(grid):
        row = {"guidance_scale": guidance, "guidance_interval": list(interval), "steps": steps, "phema_std": std}
        scored = score(row, args.num_samples, given.seed)
        if scored is None:
            continue
        name, value, accuracy, seconds = scored
        rows.append({**row, name: value, **accuracy})
        print(f"tune {i + 1}/{len(grid)}: {label(row)}: {name} {value:.4f} ({seconds:.0f} s)", flush=True)
    # The search's best two, on every process (accelerate launch: only the main one has the scores).
    ranked = sorted(rows, key=lambda r: r[distance(r)[0]])
    top = [ranked[:2]]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(top, src=0)
    top = top[0]
    blocks = None
    if args.confirm_samples and len(top) > 1:
        n = args.confirm_samples // CONFIRM_BLOCKS
        blocks = [[], []]  # per setting, its block scores; block by block, so a stopped run leaves paired blocks
        for b in range(CONFIRM_BLOCKS):
            scored = [score(row, n, given.seed + 1 + b) for row in top]
            blocks[0].append(scored[0])
            blocks[1].append(scored[1])
            if scored[0] is not None:
                print(f"confirm block {b + 1}/{CONFIRM_BLOCKS} (seed {given.seed + 1 + b}, {n:,} samples each): "
                      f"{scored[0][0]} {scored[0][1]:.4f} (the search's best), {scored[1][1]:.4f} (its runner-up)",
                      flush=True)
    if not rows:
        return None
    name = distance(rows[0])[0]
    print(f"\n{'guidance':>8} {'interval':>11} {'steps':>5} {'EMA':>7} {name:>16}\n" + "\n".join(
        f"{r['guidance_scale']:8g} {'[%g, %g]' % tuple(r['guidance_interval']):>11} {r['steps']:5d} "
        f"{str(r['phema_std'] or 'export'):>7} {r[name]:16.4f}"
        + ("  <- best" if r is ranked[0] else "  <- runner-up" if len(ranked) > 1 and r is ranked[1] else "")
        for r in rows))
    confirm = None
    if blocks is not None:
        metric = blocks[0][0][0]  # the distance at the block's sample count (fd_classifier_2k), not the search's
        blocks = [[value for _, value, _, _ in scored] for scored in blocks]
        stats = [dict(zip(("mean", "low", "high"), t_interval(v)), blocks=v) for v in blocks]
        if stats[1]["mean"] < stats[0]["mean"]:  # the search's runner-up wins on fresh noise
            ranked[:2], stats, blocks = ranked[1::-1], stats[::-1], blocks[::-1]
        diff = paired_comparison(blocks[0], blocks[1], higher_is_better=False)
        confirm = {"metric": metric, "samples_per_block": args.confirm_samples // CONFIRM_BLOCKS,
                   "blocks": CONFIRM_BLOCKS, "seeds": [given.seed + 1 + b for b in range(CONFIRM_BLOCKS)],
                   "best": stats[0], "runner_up": stats[1], "difference": {k: diff[k] for k in ("mean", "low", "high")}}
        ranked[0] = {**ranked[0], "confirmed": {"metric": metric, **stats[0]}}
        ranked[1] = {**ranked[1], "confirmed": {"metric": metric, **stats[1]}}
    best, runner_up = ranked[0], ranked[1] if len(ranked) > 1 else None
    edge = at_edge(best, rows)
    out = Path(args.run) / "tuned.json"
    out.write_text(json.dumps({"best": best, "runner_up": runner_up, "rows": rows, "confirm": confirm, "at_edge": edge,
                               "num_samples": args.num_samples, "confirm_samples": args.confirm_samples,
                               "model": model, "sampler": sampler, "metric": name,
                               "reference": "held-out rows of the training split", "eval_args": eval_args}, indent=1))
    print(f"\nchosen: {label(best)}: " + (f"{name} {best[name]:.4f} at {args.num_samples} samples (not confirmed)"
                                          if confirm is None else confirmed_text(confirm, "best")))
    if runner_up is not None:
        print(f"runner-up: {label(runner_up)}: " + (f"{name} {runner_up[name]:.4f}" if confirm is None
                                                    else confirmed_text(confirm, "runner_up")))
    if confirm is not None:
        d = confirm["difference"]
        settled = d["high"] < 0
        print(f"difference, best - runner-up, paired by block: {d['mean']:+.4f} (95% interval [{d['low']:+.4f}, "
              f"{d['high']:+.4f}]): " + ("the best is better" if settled else
                                         "the two cannot be told apart at this count; either will do"))
    for note in edge:
        print(f"at the grid's edge: {note}")
    print(f"written to {out}: eval_fid.py and sample.py use the chosen setting by default for {tuning.describe(model)} "
          f"with the {sampler} sampler" + ("" if given.checkpoint else ", and so does its export (tools/export.py)")
          + "; --untuned or a flag overrides it")
    return ranked


def confirmed_text(confirm, which):
    s = confirm[which]
    return (f"{confirm['metric']} {s['mean']:.4f} (95% interval [{s['low']:.4f}, {s['high']:.4f}]; the mean of "
            f"{confirm['blocks']} blocks of {confirm['samples_per_block']:,} fresh samples)")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"tools/tune.py: {e}")
