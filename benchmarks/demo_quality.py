"""Feeds docs/benchmarks/demo_quality.md (the embedded demo's quality).

How often do the demo's samples show what was asked for?

Trains a small CNN on the embedded data (real images, their 9 colour x shape classes), then samples N images
per class from a run's exported EMA model with fixed seeds and reports the share the classifier assigns to
the requested class (and to the requested colour and shape separately), next to the run's training speed.

    python train_flow_matching.py && python benchmarks/demo_quality.py runs/flow_matching_demo
    python train_ddpm.py && python benchmarks/demo_quality.py runs/ddpm_demo
    python benchmarks/demo_quality.py --checkpoints --write runs/sweep_conditioning/*/   # for tools/compare.py
    python benchmarks/demo_quality.py runs/flow_matching_demo --guidance_scale 2,4,6 --guidance_interval "0,1;0.2,0.8"
    python benchmarks/demo_quality.py runs/x --phema_std 0.05,0.1,0.2   # a run trained with ckpt.phema_every

--checkpoints also scores the EMA weights of every kept checkpoint; --write stores the scores per step in
RUN/quality.jsonl, where tools/compare.py finds them (quality evolution, correlation with val_loss).
Every combination of the listed sampling settings (post-hoc EMA std, guidance scale, guidance interval) is
scored with the same noise, so the differences between rows are the settings'; NFE is counted, not predicted.
"""
import argparse
import importlib
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from training.data.sources import DEMO_CLASSES, DEMO_SHAPES, make_demo_dataset  # noqa: E402
from training.evaluation.sampling import interval_arg, load_model  # noqa: E402


def demo_images(num_samples, seed, resolution=32):
    """The embedded images as a tensor in [-1, 1] with their labels."""
    import numpy as np

    ds = make_demo_dataset(num_samples, seed, resolution)
    x = torch.from_numpy(np.stack([np.asarray(img) for img in ds["image"]])).permute(0, 3, 1, 2).float() / 127.5 - 1
    return x, torch.tensor(ds["label"])


def train_classifier(steps=600, seed=0, resolution=16):
    """A 3-layer CNN on the embedded data; returns it with its accuracy on freshly drawn images."""
    torch.manual_seed(seed)
    x, y = demo_images(4608, seed=100, resolution=resolution)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(64, len(DEMO_CLASSES)))
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    for _ in tqdm(range(steps), desc="classifier"):
        idx = torch.randint(len(x), (128,))
        batch = x[idx] + 0.1 * torch.randn_like(x[idx])  # a little noise: samples are not perfectly clean
        loss = nn.functional.cross_entropy(net(batch), y[idx])
        opt.zero_grad(), loss.backward(), opt.step()
    net.eval()
    x_test, y_test = demo_images(900, seed=101, resolution=resolution)
    with torch.no_grad():
        acc = (net(x_test).argmax(1) == y_test).float().mean().item()
    return net, acc


@torch.no_grad()
def score_model(model, cfg, classifier, per_class=20, steps=None, guidance_scale=None, seed=0,
                guidance_interval=None):
    """Sample `per_class` images of each class with fixed noise (the run's own sampler, through its trainer's
    `generate`); the shares the classifier assigns to the requested class, colour and shape, and the network
    evaluations per sample."""
    trainer = importlib.import_module("train_flow_matching" if "time_sampling" in cfg["objective"] else "train_ddpm")
    tc = model.transformer.config
    labels = torch.arange(len(DEMO_CLASSES)).repeat_interleave(per_class)
    noise = torch.randn((len(labels), tc.in_channels, tc.sample_size, tc.sample_size),
                        generator=torch.Generator().manual_seed(seed))
    preds, rows = [], 0
    for i in tqdm(range(0, len(labels), 60), desc="sampling"):
        cond = {"label": labels[i:i + 60], "drop": torch.zeros(len(labels[i:i + 60]), dtype=torch.bool)}
        with common.counting_evaluations(model) as counted:
            x = trainer.generate(model, noise[i:i + 60], cond, cfg, steps=steps, guidance_scale=guidance_scale,
                                 guidance_interval=guidance_interval)
        rows += counted[0]
        preds.append(classifier(x.clamp(-1, 1)).argmax(1))
    preds = torch.cat(preds)
    colour, shape = lambda c: c // len(DEMO_SHAPES), lambda c: c % len(DEMO_SHAPES)
    return {"class_accuracy": (preds == labels).float().mean().item(),
            "colour_accuracy": (colour(preds) == colour(labels)).float().mean().item(),
            "shape_accuracy": (shape(preds) == shape(labels)).float().mean().item(), "nfe": rows / len(labels)}


def score_run(run_dir, classifier, per_class=20, steps=None, guidance_scale=None, seed=0, phema_std=None,
              guidance_interval=None):
    """The run's export (or its post-hoc EMA of std phema_std) scored by score_model, with its training speed."""
    model, cfg, _ = load_model(run_dir, phema_std=phema_std)
    metrics_file = Path(run_dir) / "metrics.jsonl"
    speeds = [m["images_per_s"] for m in map(json.loads, metrics_file.read_text().splitlines()) if "images_per_s" in m]
    return {**score_model(model, cfg, classifier, per_class, steps, guidance_scale, seed, guidance_interval),
            "train_images_per_s": statistics.median(speeds) if speeds else None,
            "samples": len(DEMO_CLASSES) * per_class}


def score_checkpoints(run_dir, classifier, per_class=20, steps=None, guidance_scale=None):
    """{step: scores} for the EMA weights of every kept checkpoint before the final step (the export's),
    loaded into the exported architecture."""
    from safetensors.torch import load_file

    model, cfg, _ = load_model(run_dir)
    out = {}
    for ckpt in sorted(Path(run_dir).glob("checkpoints/step_*")):
        if int(ckpt.name[5:]) < cfg["train"]["max_steps"]:
            model.load_state_dict(load_file(str(ckpt / "ema.safetensors")))
            out[int(ckpt.name[5:])] = score_model(model, cfg, classifier, per_class, steps, guidance_scale)
    return out


def write_scores(run_dir, scores):
    """run_dir/quality.jsonl: one row per scored step, in metrics.jsonl's format (tools/compare.py reads both)."""
    rows = [{"step": step, **values} for step, values in scores.items()]
    (Path(run_dir) / "quality.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders with an export/ (runs/flow_matching_demo, ...)")
    parser.add_argument("--per_class", type=int, default=20)
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: the run's val.steps)")
    parser.add_argument("--guidance_scale", default=None, help="comma-separated scales (default: the run's)")
    parser.add_argument("--guidance_interval", default=None, help="'lo,hi' noise levels, several separated by ';'")
    parser.add_argument("--phema_std", default=None, help="comma-separated post-hoc EMA stds (default: the export)")
    parser.add_argument("--checkpoints", action="store_true", help="also score every kept checkpoint's EMA weights")
    parser.add_argument("--write", action="store_true",
                        help="write the scores to RUN/quality.jsonl (for tools/compare.py)")
    parser.add_argument("--classifier_steps", type=int, default=600)
    args = parser.parse_args(argv)
    floats = lambda text: [None] if text is None else [float(v) for v in text.split(",")]  # noqa: E731
    intervals = [None] if args.guidance_interval is None else \
        [interval_arg(v) for v in args.guidance_interval.split(";")]
    settings = list(itertools.product(floats(args.phema_std), floats(args.guidance_scale), intervals))
    print(f"{'run':40s} {'phema':>5s} {'w':>4s} {'interval':>10s} {'class acc':>9s} {'colour':>7s} {'shape':>7s} "
          f"{'NFE':>5s} {'train img/s':>11s}")
    classifiers, results = {}, {}
    for run in args.runs:
        export_cfg = json.loads((Path(run) / "export" / "config.json").read_text())
        res = export_cfg["data"]["resolution"]
        if res not in classifiers:
            classifiers[res] = train_classifier(steps=args.classifier_steps, resolution=res)
            print(f"classifier at {res} px: accuracy {classifiers[res][1]:.3f} on held-out real demo images")
        classifier = classifiers[res][0]
        rows = []
        for std, w, interval in settings:
            rows.append(r := score_run(run, classifier, args.per_class, args.steps, w, 0, std, interval))
            print(f"{run:40s} {std or '-':>5} {w or '-':>4} {str(interval or '-'):>10s} {r['class_accuracy']:9.3f} "
                  f"{r['colour_accuracy']:7.3f} {r['shape_accuracy']:7.3f} {r['nfe']:5.1f} "
                  f"{r['train_images_per_s'] or float('nan'):11.1f}", flush=True)
        w, r = settings[0][1], rows[0]  # checkpoints and --write: the first setting's
        scores = score_checkpoints(run, classifier, args.per_class, args.steps, w) if args.checkpoints else {}
        scores[export_cfg["train"]["max_steps"]] = {k: r[k]
                                                    for k in ("class_accuracy", "colour_accuracy", "shape_accuracy")}
        if args.checkpoints:
            print("  class accuracy by step: " + ", ".join(f"{s} {v['class_accuracy']:.3f}" for s, v in scores.items()))
        if args.write:
            write_scores(run, scores)
        results[run] = scores
    return results


if __name__ == "__main__":
    main()
