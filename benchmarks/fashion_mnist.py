"""Feeds docs/benchmarks/fashion_mnist.md (real images: Fashion-MNIST).

The real-image benchmark: configs/fashion_mnist.json trained and scored by docs/evaluation.md's protocol, for both
trainers and a peer (torchcfm's own class-conditional MNIST recipe) at equal CPU time.
docs/benchmarks/fashion_mnist.md has the numbers and the commands; each step writes into --out (default
runs/fashion_mnist_bench) and is skipped when its result is already there, so the whole thing resumes.

    python tools/classifier.py --config configs/fashion_mnist.json --out classifiers/fashion_mnist   # once
    python benchmarks/fashion_mnist.py ours --trainer flow_matching --seed 0   # train, then score at 25/50/100%
    python benchmarks/fashion_mnist.py peer --seed 0 --cpu_seconds 1400        # torchcfm, ours' "steps" CPU
    python tools/compare.py runs/fashion_mnist_bench/flow_matching_s* runs/fashion_mnist_bench/ddpm_s* ...
    python tools/curves.py --out configs/fashion_mnist.curves.json runs/fashion_mnist_bench/flow_matching_s*

Scores (eval_fid.py --classifier --features classifier --reference_split test --untuned: the recipe's sampling
settings, whatever tuned.json a run holds; --eval_args gives others): fd_classifier and kd_classifier
(the Frechet and kernel distances in the evaluation classifier's features: clean-fid's Inception file cannot
be fetched here; with it, add --inception_weights and the same command gives FID), precision and recall, class
accuracy. Each run's scores are also written as rows of its quality.jsonl, which tools/compare.py reads. CPU time
is the process's own (user + system), so machine load from elsewhere does not count against either: ours in
cpu_seconds.json, "train" the trainer processes' (every one a resumed run took) and "steps" its training steps'
alone (the trainer's cpu_s_per_step), which is what the peer's --cpu_seconds matches (its training loop's).
"""
import argparse
import json
import os
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
import train_flow_matching  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from training.config import config  # noqa: E402
from training.data import fashion_mnist  # noqa: E402
from training.evaluation import classifier  # noqa: E402
from training.evaluation.metrics import all_scores, size_tag  # noqa: E402
from training.evaluation.reference import reference_args, reference_for  # noqa: E402
from training.evaluation.sampling import png_path  # noqa: E402

RECIPE = ROOT / "configs" / "fashion_mnist.json"


def cpu_seconds(who=resource.RUSAGE_SELF):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def score_args(args, num_samples):
    """The protocol's eval_fid.py arguments. --untuned: a benchmark scores the recipe's sampling settings, never a
    tuned.json that tools/tune.py left in the run (it would apply to the export and not to the checkpoints, or
    meet samples made without it); a setting of its own goes in --eval_args."""
    return ["--num_samples", str(num_samples), "--reference_split", "test", "--classifier", args.classifier,
            "--features", "classifier", "--batch_size", "250", "--stats_cache", str(Path(args.out) / "fid_stats"),
            "--untuned"]


def ours(args):
    """Train one seed of the recipe (skipped when its export exists), then score its checkpoints at 25 and 50%
    of the steps and its export (100%) on the test split; append each score to quality.jsonl."""
    run = Path(args.out) / f"{args.trainer}_s{args.seed}"
    if not (run / "export").is_dir():
        before = cpu_seconds(resource.RUSAGE_CHILDREN)
        try:
            subprocess.run([sys.executable, str(ROOT / f"train_{args.trainer}.py"), "--config", args.recipe,
                            f"--seed={args.seed}", f"--run_dir={run}", "--log.wandb=off", "--resume=latest",
                            *args.extra], check=True)  # --resume latest: an interrupted run continues
        finally:  # an interrupted process's CPU too: a resumed run's is the sum over its processes
            record = add_cpu(run, cpu_seconds(resource.RUSAGE_CHILDREN) - before)
        record["steps"] = step_cpu(run) * json.loads((run / "config.json").read_text())["train"]["max_steps"]
        (run / "cpu_seconds.json").write_text(json.dumps(record))  # the steps' own CPU: the peer's equal CPU
        print(f"{run.name}: {record['train']:.0f} CPU s in {len(record['processes'])} trainer process(es), "
              f"{record['steps']:.0f} of them in the training steps (the peer's --cpu_seconds at equal CPU)")
    cfg = json.loads((run / "config.json").read_text())
    steps = cfg["train"]["max_steps"]
    final = run / "eval" / f"test-step{steps}"
    for fraction in (1.0, *args.fractions):  # the final score first
        step = round(steps * fraction)
        out = run / "eval" / f"test-step{step}"
        where = [] if fraction == 1.0 else ["--checkpoint", str(run / "checkpoints" / f"step_{step:08d}")]
        if not (out / "report.json").is_file():
            n = args.num_samples if fraction == 1.0 else args.curve_samples
            eval_fid.main(["--run", str(run), *where, "--out_dir", str(out), *score_args(args, n), *args.eval_args])
        # the first --curve_samples alone: the curve's last point
        if fraction == 1.0 and args.num_samples > args.curve_samples:
            first_samples(final, run / "eval" / f"test-step{steps}-first", args)
    rows = []  # quality.jsonl rebuilt from every report, so a resumed benchmark never repeats a row
    for report in sorted((run / "eval").glob("test-step*/report.json")):
        report = json.loads(report.read_text())
        rows.append({"step": report["model"].get("step", steps), **report["metrics"]})
        print(f"{run.name} step {rows[-1]['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in report["metrics"].items()))
    (run / "quality.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["step"])))


def add_cpu(run, seconds):
    """One trainer process's CPU seconds into run/cpu_seconds.json: "processes" each one's, "train" their sum."""
    path = run / "cpu_seconds.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["processes"] = [*record.get("processes", []), seconds]
    record["train"] = sum(record["processes"])
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return record


def step_cpu(run):
    """A run's CPU seconds per training step: the trainer's logged intervals (cpu_s_per_step: its process's CPU
    in the steps alone), weighted by their steps; every process of a resumed run is in metrics.jsonl, each step
    once. Not the process's CPU over the steps: start-up, validations and the export, the same in every arm, would
    raise each arm's cost by the same amount, and an equal-CPU budget would give a slower arm more (issue 57)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "images_per_s" in r]  # the training rows (not validation's, not events)
    if not rows or any("cpu_s_per_step" not in r for r in rows):
        sys.exit(f"{run / 'metrics.jsonl'}: training rows without cpu_s_per_step (a run from before the trainer "
                 f"logged it): train it again for its CPU per step")
    steps = [b["step"] - a["step"] for a, b in zip([{"step": 0}, *rows], rows)]
    return sum(r["cpu_s_per_step"] * n for r, n in zip(rows, steps)) / sum(steps)


def first_samples(final, out, args):
    """Score the first --curve_samples of the final samples on their own: the same images a run of that size
    would make (sample i's noise depends on i alone), so the 100% point of the quality curve and the peer's
    score (sampled at that size: its dopri5 took about 2 CPU s a sample once trained) compare at equal sample counts."""
    if (out / "report.json").is_file():
        return
    (out / "samples").mkdir(parents=True, exist_ok=True)
    for i in range(args.curve_samples):  # hard links: no copies of the images
        link = png_path(out / "samples", i)
        if not link.exists():
            os.link(png_path(final / "samples", i), link)
    generation = json.loads((final / "generation.json").read_text())
    (out / "generation.json").write_text(json.dumps(generation, indent=1))
    eval_fid.main(["--run", generation["model"]["run"], "--out_dir", str(out), *score_args(args, args.curve_samples),
                   *args.eval_args])


# ---- The peer: torchcfm's conditional MNIST example (examples/images/conditional_mnist.ipynb), unchanged but
# for the data (Fashion-MNIST's training split) and the stopping rule (equal CPU time, or its 10 epochs). -------


def peer_train(args, model, optimizer, fm, x_all, y_all):
    """The example's loop: Adam, batch 128, 10 epochs or --cpu_seconds of this process's CPU, whichever first."""
    start, step, log = cpu_seconds(), 0, []
    for epoch in range(10):  # the example's n_epochs
        for idx in torch.randperm(len(x_all)).split(128):  # batch_size 128, shuffled
            x1, y = x_all[idx], y_all[idx]
            x0 = torch.randn_like(x1)
            t, xt, ut = fm.sample_location_and_conditional_flow(x0, x1)  # torchcfm: t = 0 noise, t = 1 data
            loss = torch.mean((model(t, xt, y) - ut) ** 2)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 50 == 0:
                log.append({"step": step, "loss": loss.item(), "cpu_seconds": cpu_seconds() - start})
                print(f"torchcfm step {step} (epoch {epoch}): loss {loss.item():.4f}, {log[-1]['cpu_seconds']:.0f} "
                      f"CPU s of {args.cpu_seconds}", flush=True)
            if cpu_seconds() - start >= args.cpu_seconds:
                break
        else:
            continue
        break
    return step, cpu_seconds() - start, log


def peer(args):
    from torchcfm.conditional_flow_matching import ConditionalFlowMatcher
    from torchcfm.models.unet import UNetModel
    import torchdiffeq

    out = Path(args.out) / f"torchcfm_s{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    images, labels = fashion_mnist.split_arrays("train")
    x_all = torch.from_numpy(images).float().div(127.5).sub(1).unsqueeze(1)  # ToTensor + Normalize((0.5,), (0.5,))
    y_all = torch.from_numpy(labels).long()
    model = UNetModel(dim=(1, 28, 28), num_channels=32, num_res_blocks=1, num_classes=10, class_cond=True)
    optimizer = torch.optim.Adam(model.parameters())  # the example's: Adam at its default lr 1e-3
    fm = ConditionalFlowMatcher(sigma=0.0)
    trained = out / "model.pt"  # the trained peer, so that a stopped benchmark resumes at sampling
    if trained.exists():
        saved = torch.load(trained, weights_only=True)
        model.load_state_dict(saved.pop("model"))
        step, train_cpu, log = saved["step"], saved["train_cpu_seconds"], saved["log"]
    else:
        step, train_cpu, log = peer_train(args, model, optimizer, fm, x_all, y_all)
        torch.save({"model": model.state_dict(), "step": step, "train_cpu_seconds": train_cpu, "log": log}, trained)
    # Sampling as the example does: dopri5 from noise (t = 0) to data (t = 1), atol = rtol = 1e-4, class i % 10.
    model.eval()
    samples, nfe, sampled = [], [0], 0

    def velocity(t, x, y):
        nfe[0] += 1
        return model(t, x, y)
    with torch.no_grad():
        for first in range(0, args.num_samples, 250):
            n = min(250, args.num_samples - first)
            batch_file = out / f"samples_{first:06d}_{n}.npy"  # each batch kept: sampling resumes where it stopped
            if batch_file.exists():
                samples.append(np.load(batch_file))
                continue
            y = torch.arange(first, first + n) % 10
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + first)
            x = torchdiffeq.odeint(lambda t, x: velocity(t, x, y), torch.randn(n, 1, 28, 28, generator=g),
                                   torch.linspace(0, 1, 2), atol=1e-4, rtol=1e-4, method="dopri5")[-1]
            samples.append(x.clamp(-1, 1).add(1).mul(127.5).round().byte().squeeze(1).numpy())
            np.save(batch_file, samples[-1])
            sampled += 1
            print(f"torchcfm samples {first + n}/{args.num_samples}", flush=True)
    images = np.repeat(np.concatenate(samples)[..., None], 3, axis=3)  # grey -> RGB, as load_image converts
    metrics = score_images(images, args)
    result = {"steps": step, "train_cpu_seconds": train_cpu, "nfe_per_batch": nfe[0] / max(sampled, 1),
              "metrics": metrics, "num_samples": args.num_samples, "log": log}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    with open(out / "quality.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    print(f"torchcfm seed {args.seed}: {step} steps in {train_cpu:.0f} CPU s: " +
          ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def score_images(images, args):
    """The protocol's scores of uint8 (N, 28, 28, 3) images asked for class i % 10, as eval_fid.py computes them."""
    judge, record = classifier.load(args.classifier)
    feature_fn = classifier.feature_fn(judge)
    cfg = config.load_config(train_flow_matching.DEFAULTS, ["--config", str(RECIPE)], method="flow_matching",
                             schema=train_flow_matching.CONFIG)
    eval_args = reference_args(score_args(args, len(images)))
    feats, hits = [], []
    for first in range(0, len(images), 500):
        batch = list(images[first:first + 500])
        feats.append(feature_fn(batch))
        hits.append(classifier.class_hits(judge, batch, range(first, first + len(batch)), 10))
    _, ref = reference_for(eval_args, cfg, feature_fn, Accelerator(cpu=True))
    metrics = all_scores(np.concatenate(feats), ref, "clean", len(images), "classifier")
    metrics[f"class_accuracy_{size_tag(len(images))}"] = float(np.concatenate(hits).mean())
    return metrics


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["ours", "peer"])
    p.add_argument("--trainer", default="flow_matching", choices=["flow_matching", "ddpm"])
    p.add_argument("--recipe", default=str(RECIPE), help="ours: the recipe trained (configs/fashion_mnist_latent.json: "
                   "benchmarks/latent_space.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/fashion_mnist_bench")
    p.add_argument("--classifier", default="classifiers/fashion_mnist")
    p.add_argument("--num_samples", type=int, default=10_000, help="the final score's samples (the protocol: 10k)")
    p.add_argument("--curve_samples", type=int, default=2_000, help="samples at 25 and 50%% of the steps (a trend)")
    p.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.5], help="the quality curve's checkpoints "
                   "(fractions of the steps) scored at --curve_samples; none: the final score alone")
    p.add_argument("--cpu_seconds", type=float, default=None, help="peer: stop training at this CPU time")
    p.add_argument("--eval_args", nargs="*", default=[], help="more eval_fid.py arguments (--guidance_scale ...)")
    args, args.extra = p.parse_known_args(argv)
    if args.what == "peer" and args.cpu_seconds is None:
        p.error("peer needs --cpu_seconds: ours' training steps' (\"steps\" in a run's cpu_seconds.json) for equal CPU")
    started = time.time()
    (ours if args.what == "ours" else peer)(args)
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
