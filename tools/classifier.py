"""Train the evaluation classifier of a class-conditional recipe on its training split alone
(training/evaluation/classifier.py).

    python tools/classifier.py --config configs/fashion_mnist.json --out classifiers/fashion_mnist
    python eval_fid.py --run runs/flow_matching_fashion_mnist --classifier classifiers/fashion_mnist ...
    python tools/classifier.py --config configs/emoji.json --out classifiers/emoji --data.label_column=label

Further --section.key=value arguments override the recipe, as the trainers' do: a text recipe's classes (emoji's
category, the column "label") are named so. classifier.json records the column, which eval_fid.py reads from a text
run's reference rows for its category accuracy (docs/evaluation.md, "Real captions").

Every row of the recipe's training split (data.split, held-out rows included: none of them is a test image) is
preprocessed exactly as the trainer's cache sees it (load_image, preprocess: centre crop, data.resolution, RGB).
Its accuracy on the test split (--test_split) is measured once here and written to classifier.json, which
eval_fid.py prints beside the class accuracy of samples. Fashion-MNIST: 3 epochs, about 4 minutes on 2 CPU cores.

A source whose test split reads the very images of its training split (a folder of class folders without a test
folder: datasets gives its one set of images under any split name) would score training images as test images.
Then the rows are split as the trainer splits them (sources.training_and_test): the classifier trains on the trainer's
training rows and is measured on the rows the trainer holds out (test_split "heldout" in classifier.json, the rows
eval_fid.py's default --reference_split scores against), and says so.

Further --section.key=value arguments override the recipe, as the trainers' do. Only its data section is read
(config.tool_config: not the encoders), so a text-to-image recipe serves too, even one that names the folder this
makes; its classes are a column of its rows: `--data.label_column=label` (configs/emoji.json: the category).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_flow_matching  # noqa: E402
from training.config import config  # noqa: E402
from training.data.sources import training_and_test  # noqa: E402
from training.evaluation import classifier  # noqa: E402
from training.evaluation.reference import split_images  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the recipe (its data section names the source and resolution)")
    p.add_argument("--out", required=True, help="folder for the classifier (save_pretrained) and classifier.json")
    p.add_argument("--test_split", default="test", help="the split its accuracy is measured on (never trained on)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args, overrides = p.parse_known_args(argv)
    cfg = config.tool_config(train_flow_matching, ["--config", args.config, *overrides])  # its data section
    data = cfg.data
    if not data.label_column:
        sys.exit(f"tools/classifier.py: {args.config} has no data.label_column: a classifier needs classes (a text "
                 f"recipe whose rows carry them: add --data.label_column=COLUMN, e.g. label)")
    torch.manual_seed(args.seed)
    start = time.time()
    train_ds, test_ds, args.test_split = training_and_test(data, args.test_split, "tools/classifier.py")
    images, labels, names = split_images(data, train_ds, data.split)
    test_images, test_labels, _ = split_images(data, test_ds, args.test_split)
    model = classifier.build(int(labels.max()) + 1, names)
    classifier.train(model, images, labels, args.epochs, seed=args.seed)
    record = {"source": data.source, "train_split": data.split, "train_rows": len(images),
              "resolution": data.resolution, "label_column": data.label_column,  # what a text run's rows must carry
              "test_split": args.test_split, "test_rows": len(test_images),
              "test_accuracy": classifier.accuracy(model, test_images, test_labels),
              "train_accuracy": classifier.accuracy(model, images[:10000], labels[:10000]),
              "epochs": args.epochs, "seed": args.seed, "seconds": round(time.time() - start, 1)}
    model.save_pretrained(args.out)
    (Path(args.out) / classifier.RECORD).write_text(json.dumps(record, indent=1))
    print(f"classifier in {args.out}: test accuracy {record['test_accuracy']:.4f} on {len(test_images)} images "
          f"of split '{args.test_split}' ({record['seconds']:.0f} s)")


if __name__ == "__main__":
    try:
        main()
    except config.ConfigError as e:  # a source that cannot be opened (a split it lacks): its one line
        sys.exit(f"tools/classifier.py: {e}")
