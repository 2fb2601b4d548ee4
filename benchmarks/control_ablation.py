"""The paper's main ablation on the embedded data: controls through the adaptive norm with the schedule
w(t) and semantics through attention ("disentangled"), against class and controls summed into the adaptive
norm ("adanorm", the DiT / SDXL baseline), on the same data, model and budget.

Training uses random-resized crops (side 0.4-1 of the image) with the size and crop controls. Then:
  (a) quality: the share of samples a classifier sees as the requested class, controls set to "whole image";
  (b) semantic drift: with the same noise and class, only the crop control changes (zoomed to 4 boxes);
      the share of (noise, class) pairs whose classified class changes. Lower is better: a control should
      change how an image is framed, not what it shows.

    python benchmarks/control_ablation.py [--steps 400] [--per_class 8]
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training import config  # noqa: E402
from training.data import DEMO_CLASSES  # noqa: E402
from training.model import load_exported  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from demo_quality import train_classifier  # noqa: E402

BOXES = {"whole": [0, 0, 1, 1], "top-left": [0, 0, 0.5, 0.5], "bottom-right": [0.5, 0.5, 0.5, 0.5],
         "centre": [0.25, 0.25, 0.5, 0.5], "wide-centre": [0.125, 0.125, 0.75, 0.75]}  # (top, left, h, w) / side


@torch.no_grad()
def evaluate(run_dir, classifier, per_class):
    model, cfg = load_exported(Path(run_dir) / "export")
    side, res = cfg["data"]["demo_resolution"], cfg["data"]["resolution"]
    labels = torch.arange(len(DEMO_CLASSES)).repeat_interleave(per_class)
    noise = torch.randn((len(labels), 3, res, res), generator=torch.Generator().manual_seed(0))
    preds = {}
    for name, box in BOXES.items():
        cond = {"label": labels, "drop": torch.zeros(len(labels), dtype=torch.bool),
                "orig_hw": torch.tensor([side, side]).expand(len(labels), 2),
                "crop_box": (torch.tensor(box) * side).round().long().expand(len(labels), 4)}
        preds[name] = classifier(fm.generate(model, noise, cond, cfg).clamp(-1, 1)).argmax(1)
    changed = torch.stack([preds[n] != preds["whole"] for n in BOXES if n != "whole"])
    return {"quality": (preds["whole"] == labels).float().mean().item(), "drift": changed.float().mean().item()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--per_class", type=int, default=8)
    args, extra = parser.parse_known_args()
    classifier, acc = train_classifier(resolution=config.load_config(fm.DEFAULTS, extra).data.resolution)
    print(f"classifier accuracy on held-out real demo images: {acc:.3f}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("disentangled", "adanorm"):
            run = fm.main([f"--run_dir={tmp}/{mode}", f"--data.cache_dir={tmp}/cache", "--log.wandb=off",
                           f"--train.max_steps={args.steps}", "--val.every=1000000", "--ckpt.every=1000000",
                           "--data.crop=random_resized", "--data.min_crop_scale=0.4",
                           '--conditioning.controls=["size", "crop"]', f"--conditioning.mode={mode}", *extra])
            results[mode] = evaluate(run, classifier, args.per_class)
    print(f"\n{'conditioning':14s} {'quality (class acc)':>20s} {'semantic drift':>15s}")
    for mode, r in results.items():
        print(f"{mode:14s} {r['quality']:20.3f} {r['drift']:15.3f}")
