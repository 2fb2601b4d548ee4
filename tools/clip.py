"""Train a CLIP for a text-to-image recipe (training/data/clip.py): its tokenizer and a small transformers CLIPModel
made on the recipe's training pairs alone, saved with save_pretrained, so that encoders.text_encoder=FOLDER conditions
a run on its text tower as on openai/clip-vit-large-patch14's. Its image -> caption retrieval on the test split is
recorded beside it (clip.json): the ceiling any generated image is read against.

    python tools/clip.py --config configs/demo.json --out clips/demo --data.caption_column=caption
    python train_flow_matching.py --data.label_column=null --data.caption_column=caption \\
        --encoders.text_encoder=clips/demo --encoders.max_tokens=16

Further --section.key=value arguments override the recipe, as the trainers' do; only the data section and
encoders.max_tokens are read (the encoders themselves are not: the folder this makes may be the recipe's own).
The splits are sources.training_and_test's: every row of the training split (data.split, held-out rows included:
none is a test image); a --test_split that is the training split is refused; a source whose test split reads its
training images is measured on the rows the trainer holds out (test split "heldout"). Images are preprocessed as
the trainers' cache does (centre crop at data.resolution); a row without a caption is skipped and counted.

The context (max_position_embeddings) is encoders.max_tokens, or the longest training caption in tokens (start and
end included) if longer, so no training caption is truncated and the recipe's runs pass the start-up check.
"""
import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_flow_matching  # noqa: E402
from training.config import config  # noqa: E402
from training.data import clip  # noqa: E402
from training.data.classes import class_names  # noqa: E402
from training.data.sources import load_image, preprocess, training_and_test  # noqa: E402
from training.evaluation.reference import to_uint8  # noqa: E402
from training.run.monitor import progress  # noqa: E402


def pairs(data, ds, split):
    """(uint8 images (N, R, R, 3), their captions, rows skipped for want of a caption) of the dataset `ds`, the
    images as the trainers' cache preprocesses them; data.label_captions: the class name is the caption."""
    names = class_names(data, ds) if data.label_captions else None
    images, captions, skipped = [], [], 0
    for row in progress(ds, f"read {split}", True):
        caption = names[row[data.label_column]] if names else row[data.caption_column]
        if not isinstance(caption, str) or not caption.strip():
            skipped += 1
            continue
        x = preprocess(load_image(row[data.image_column]), data.resolution, data, flip=False)[0]
        images.append(to_uint8(x[None])[0]), captions.append(caption)
    if not images:
        raise SystemExit(f"tools/clip.py: split '{split}' of {data.source} has no captioned row "
                         f"(data.caption_column={data.caption_column!r})")
    return np.stack(images), captions, skipped


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the recipe (its data section names the source and resolution)")
    p.add_argument("--out", required=True, help="folder for the model, tokenizer, image processor and clip.json")
    p.add_argument("--test_split", default="test", help="the split its retrieval is measured on (never trained on)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--width", type=int, default=128, help="both towers' width (heads of 64) and the projection's")
    p.add_argument("--layers", type=int, default=4, help="both towers' depth")
    p.add_argument("--patch_size", type=int, default=None, help="the ViT's patch side; default data.resolution / 8, "
                   "at least 4 px (docs/data.md: 2 px patches learnt shapes far slower)")
    p.add_argument("--vocab_size", type=int, default=2048, help="the BPE's tokens at most (256 bytes + 2 + merges)")
    p.add_argument("--seed", type=int, default=0)
    args, overrides = p.parse_known_args(argv)
    cfg = config.tool_config(train_flow_matching, ["--config", args.config, *overrides])  # types, no encoders
    data, start = cfg.data, time.time()
    patch = args.patch_size or max(4, data.resolution // 8)
    if not (data.caption_column or data.label_captions):
        sys.exit(f"tools/clip.py: {args.config} has no data.caption_column: a CLIP learns from captioned images "
                 f"(add --data.caption_column=caption)")
    if data.resolution % patch or min(args.epochs, args.batch_size, args.width, args.layers) < 1 or \
            args.width > 64 and args.width % 64:
        sys.exit(f"tools/clip.py: --patch_size {patch} must divide data.resolution={data.resolution}, --width "
                 f"{args.width} be a multiple of 64 (heads of 64) or below 64 (one head), and --epochs, --batch_size, "
                 f"--width, --layers >= 1")
    train_ds, test_ds, args.test_split = training_and_test(data, args.test_split, "tools/clip.py")
    images, captions, skipped = pairs(data, train_ds, data.split)
    test_images, test_captions, test_skipped = pairs(data, test_ds, args.test_split)
    seen = {hashlib.sha1(image.tobytes()).digest() for image in images}
    shared_images = sum(hashlib.sha1(image.tobytes()).digest() in seen for image in test_images)
    shared_captions = len(set(test_captions) & set(captions))
    if shared_images:
        print(f"tools/clip.py: warning: {shared_images} of the {len(test_images)} '{args.test_split}' images are also "
              f"training images (pixel for pixel after preprocessing): their retrieval is not a held-out measurement")

    # ---- The tokenizer, on the training captions alone; the context fits the longest of them -------------------
    distinct = sorted(set(captions))
    tokenizer = clip.build_tokenizer(distinct, args.vocab_size, context=10 ** 6)
    lengths = clip.token_count(tokenizer, distinct)
    context = max(cfg.encoders.max_tokens, max(lengths))
    tokenizer.model_max_length = context
    test_lengths = clip.token_count(tokenizer, sorted(set(test_captions)))
    truncated = sum(n > context for n in test_lengths)
    tokens = clip.tokenize(tokenizer, distinct, context)
    index = {c: i for i, c in enumerate(distinct)}
    caption_ids = torch.tensor([index[c] for c in captions])

    # ---- The model, trained contrastively on the training pairs --------------------------------------------------
    model = clip.build(tokenizer, data.resolution, patch, args.width, args.layers, context, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"clip: {n_params / 1e6:.2f}M parameters (ViT {data.resolution} px in {patch} px patches, text over "
          f"{context} tokens, width {args.width}, {args.layers} layers each); tokenizer of {len(tokenizer)} tokens "
          f"from {len(distinct)} training captions, the longest {max(lengths)} tokens; {args.epochs} epochs of "
          f"{len(images)} pairs in batches of {args.batch_size}")
    loss = clip.train(model, images, caption_ids, tokens, args.epochs, args.batch_size, args.lr, args.seed)
    train_seconds = time.time() - start

    # ---- Image -> caption retrieval among the test split's captions: the ceiling of every generated image -------
    test = clip.retrieval(model, tokenizer, test_images, test_captions, context)
    first = min(len(images), len(test_images))  # the training pairs at the test split's count, for the gap
    train = clip.retrieval(model, tokenizer, images[:first], captions[:first], context)
    record = {"source": data.source, "resolution": data.resolution, "train_split": data.split,
              "train_rows": len(images), "train_captions": len(distinct), "train_skipped": skipped,
              "test_split": args.test_split, "test_rows": len(test_images), "test_skipped": test_skipped,
              "test_images_also_in_training": shared_images, "test_captions_also_in_training": shared_captions,
              "tokenizer": {"vocab_size": len(tokenizer), "longest_training_caption": max(lengths),
                            "longest_test_caption": max(test_lengths), "context": context,
                            "test_captions_truncated": truncated},
              "model": {"parameters": n_params, "width": args.width, "layers": args.layers, "patch_size": patch},
              "training": {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                           "final_loss": loss, "augmentation": None, "seconds": round(train_seconds, 1)},
              "retrieval": {"test": test, "train": train}, "seconds": round(time.time() - start, 1),
              "command": " ".join(["tools/clip.py", *(sys.argv[1:] if argv is None else argv)])}
    model.save_pretrained(args.out)
    clip.save_tokenizer(tokenizer, args.out)
    clip.image_processor(data.resolution).save_pretrained(args.out)
    (Path(args.out) / clip.RECORD).write_text(json.dumps(record, indent=1))
    print(f"clip in {args.out}: image -> caption top-1 {test['top1']:.3f}, top-5 {test['top5']:.3f} among the "
          f"{test['captions']} captions of {test['images']} '{args.test_split}' images (chance "
          f"{test['chance_top1']:.3f}, {test['chance_top5']:.3f}; training images among their {train['captions']}: "
          f"{train['top1']:.3f}, {train['top5']:.3f}); {record['seconds']:.0f} s")
    return Path(args.out)


if __name__ == "__main__":
    try:
        main()
    except config.ConfigError as e:
        sys.exit(f"tools/clip.py: {e}")
