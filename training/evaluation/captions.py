"""The text protocol (docs/evaluation.md, "Real captions: the text protocol"): a text run scored against a captioned
dataset split (emoji's test captions; its validation captions, where tools/tune.py chooses) is sampled from that
split's own captions and read against its own images:

  * prompts: sample i takes reference row i % R's caption (R reference rows, in the order their images are read;
    --num_samples a multiple of R, by default R: one image per reference image), its noise seed_for(seed, 0, i);
  * FD, KD, precision, recall, density, coverage in any features, fd_clip_N in the evaluation CLIP's (--features
    clip: metrics.clip_features);
  * CLIP score: each sample against its own caption;
  * retrieval: each sample ranks the distinct captions of the R rows by CLIP similarity (each caption once, however
    many images share it: training/data/clip.py's caption_index and caption_ranks, as tools/clip.py ranks the real
    test images); top-1 and top-5 are the shares whose own caption ranks first and within five;
  * category accuracy (--classifier): the classifier against row i % R's label (the column its classifier.json names);
  * parts: rows with a `novelty` column (emoji's "recombination" and "new") give every metric for each part apart
    (the part's samples against the part's reference images) and for all together;
  * real images, beside each metric under its name: the Frechet-family floor is as many images drawn (seed 0) from
    the trainer's training rows as the group has reference images, per class in the group's proportions (emoji's
    category), against them (reference.training_draw_key); CLIP score, retrieval and accuracy are the reference
    images' own (the ceiling a generated image is read against).

eval_fid.py calls these; report.json keeps `metrics` (the samples'), `real` (the same names) and `text_protocol`.
"""
import json
import re

import numpy as np
import torch

from training.config import config
from training.data import clip, emoji
from training.data.sources import is_stream
from training.evaluation.metrics import NOT_INCEPTION, all_scores, clip_cosines, fid_size_warning, size_tag
from training.evaluation.reference import bucket_rows, key_of, reference_stats, same_source, training_draw_key

REFERENCE = "reference"  # --prompts: the reference rows' captions, sample i row i % R's
PART_COLUMN = "novelty"  # emoji's: "recombination" or "new" in validation and test (training/data/emoji.py)
PER_SAMPLE = "per_sample.jsonl"  # beside report.json: each sample's row, caption, part, label and scores
PROMPTS = "prompts.txt"  # beside generation.json: the R captions, one a line (--prompts FILE makes the same images)

# ----------------------------------------------------------------------------------------------------------
# Which rows: the reference's, when it is a captioned dataset split of a text run.


def protocol_rows(args, cfg):
    """The rows a text run is sampled from and scored against: the reference's rows (a dataset split, or the held-out
    rows; at a bucket that bucket's; --reference_num's first), in the order reference_images reads their images,
    without the images. None where the protocol does not apply: a class run, --prompts FILE or heldout, a reference
    without the run's caption column (a folder, statistics), unless --prompts reference asks for it: then one line."""
    caption = cfg["data"].get("caption_column")
    if not cfg["encoders"]["text_encoder"] or args.prompts not in (None, REFERENCE):
        return None
    key = key_of(args, cfg, "")
    rows = bucket_rows(key, cfg) if key.get("kind") == "dataset" else None
    if rows is None or not caption or caption not in rows.column_names:
        if args.prompts == REFERENCE:
            where = key["source"] + (f", split {key['split']}" if "split" in key else "")
            raise config.ConfigError(
                f"--prompts reference: the reference ({where}) has no captions (data.caption_column={caption!r}): "
                f"score against a captioned dataset split (--reference_split test), or give --prompts FILE or heldout")
        return None
    rows = rows.remove_columns([key["image_column"]])
    return rows.select(range(min(len(rows), key["num"]))) if key["num"] else rows


def sample_count(num_samples, rows):
    """--num_samples for the text protocol: R (one image per reference image) when not given, else a multiple of R,
    so every caption is asked for equally often; anything else one line, before any work."""
    n_rows = len(rows)
    if num_samples is None:
        return n_rows
    if num_samples < n_rows or num_samples % n_rows:
        near = sorted({max(1, num_samples // n_rows) * n_rows, (num_samples // n_rows + 1) * n_rows})
        raise config.ConfigError(
            f"--num_samples {num_samples}: the text protocol samples each of the {n_rows} reference rows' captions "
            f"equally often (sample i: row i % {n_rows}), so it takes a multiple of {n_rows} (nearest: "
            f"{' or '.join(map(str, near))}), or leave it out: {n_rows}, one image per reference image")
    return num_samples


def label_column(record):
    """The column a classifier was trained on (its classifier.json's; "label" for one recorded before)."""
    return record.get("label_column") or "label"


def row_labels(rows, record, path, num_labels):
    """The class of each reference row for the classifier of `record` (its classifier.json): the column it was
    trained on, checked against its classes; else one line, before any sampling."""
    column = label_column(record)
    if rows is None or column not in rows.column_names:
        raise config.ConfigError(
            f"--classifier {path}: a text run's category accuracy reads each sample's class from its reference row "
            f"(column '{column}', the classifier's); " + ("this reference has no such column" if rows is not None else
                                                          "no reference rows: score against a captioned dataset split "
                                                          "(--reference_split test) with the default --prompts"))
    labels = np.asarray(rows[column])
    if labels.min() < 0 or labels.max() >= num_labels:
        raise config.ConfigError(f"--classifier {path}: it knows {num_labels} classes, the reference rows' '{column}' "
                                 f"runs from {labels.min()} to {labels.max()}: not the classes it was trained on")
    return labels


def groups(rows):
    """{"": every row, then each part: its rows} (indices into rows): the parts of PART_COLUMN, emoji's order first
    (recombination, new), others sorted; only "" when the column is missing or holds one value."""
    out = {"": np.arange(len(rows))}
    if PART_COLUMN in rows.column_names:
        values = np.asarray(rows[PART_COLUMN], dtype=object)
        known = {v: i for i, v in enumerate(emoji.NOVELTY)}
        names = sorted(set(values), key=lambda v: (known.get(v, len(known)), str(v)))
        if len(names) > 1:
            out.update({safe(name): np.flatnonzero(values == name) for name in names})
    return out


def safe(name):
    """A part's name as metric names carry it: lower case, letters and digits ("none" for an empty value)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", str(name or "")).strip("_").lower() or "none"

# ----------------------------------------------------------------------------------------------------------
# What each image is asked: its caption's CLIP embedding, among the distinct captions.


def caption_embeddings(clip_fn, captions, batch_size=500):
    """(the distinct captions' L2-normalised CLIP text embeddings (C, D), each caption's index among them)."""
    distinct, own = clip.caption_index(captions)
    text = torch.cat([clip_fn.text(distinct[i:i + batch_size]) for i in range(0, len(distinct), batch_size)])
    return text, own


def clip_rows(image_feats, text, own):
    """(N, 2): per image its CLIP score, 100 * max(cos, 0) with its caption (index `own` among `text`), and its
    caption's rank among all of `text` (0: first)."""
    cos = clip_cosines(image_feats, text[own])
    image = torch.nn.functional.normalize(torch.as_tensor(np.asarray(image_feats), dtype=torch.float32), dim=-1)
    return np.stack([100 * np.maximum(cos, 0), clip.caption_ranks(image, text, own).double().numpy()], 1)


def part_warnings(parts, num_samples, dim, tag):
    """One line for each part whose covariances are singular (fid_size_warning, said in full for all of them)."""
    n_rows, out = len(parts[""]), []
    for name, idx in list(parts.items())[1:]:
        n = num_samples // n_rows * len(idx)
        if fid_size_warning(max(len(idx), 2), n, dim, tag) or len(idx) < 2:
            fd = f"fd_{tag}" if tag in NOT_INCEPTION else "FID"
            out.append(f"part '{name}': {len(idx)} reference images and {n} samples against {dim} feature dimensions: "
                       f"its {fd} is mostly the estimator's bias" + (" (none: fewer than 2 images)" if len(idx) < 2
                                                                    else "; compare it only at the same counts"))
    return out


# ----------------------------------------------------------------------------------------------------------
# The scores of each group, of the samples and of real images.


def part_statistics(ref_feats, idx):
    f = np.asarray(ref_feats, dtype=np.float64)[idx]
    return {"mu": f.mean(0), "sigma": np.cov(f, rowvar=False), "feats": f}


def unsized(metrics, n):
    """{'fd_clip': ..} of {'fd_clip_774': ..}: the names without their size."""
    return {k[:-len(size_tag(n)) - 1]: v for k, v in metrics.items()}


def means(per, mask):
    """The group's CLIP score, retrieval top-1 and top-5 and class accuracy: means over `mask` of the per-image
    columns in `per` ({"clip": (N, 2) score and rank, "hits": (N,)}, each optional)."""
    out = {}
    if per.get("clip") is not None:
        score, rank = per["clip"][mask, 0], per["clip"][mask, 1]
        out.update(clip_score=float(score.mean()), retrieval_top1=float((rank < 1).mean()),
                   retrieval_top5=float((rank < 5).mean()))
    if per.get("hits") is not None:
        out["class_accuracy"] = float(np.asarray(per["hits"]).reshape(-1)[mask].mean())
    return out


def sample_scores(feats, ref, parts, per, mode, tag, device="cpu"):
    """{group: {metric: value}} of the samples (sample i: row i % R): each group's samples against its reference
    images (all of them for "", the part's for a part); a part with fewer than 2 images or samples has no distances."""
    row_of, out = np.arange(len(feats)) % len(parts[""]), {}
    for name, idx in parts.items():
        mask = np.isin(row_of, idx)
        part_ref = ref if not name else part_statistics(ref["feats"], idx)
        distances = all_scores(feats[mask], part_ref, mode, int(mask.sum()), tag, device) if min(
            int(mask.sum()), len(idx)) >= 2 else {}
        out[name] = {**unsized(distances, int(mask.sum())), **means(per, mask)}
    return out


def real_scores(floor, ref, parts, per, mode, tag, device="cpu"):
    """{group: {metric: value}} of real images: the Frechet family of the group's drawn training images (`floor`:
    {group: features}, training_floor's; None: none) against the group's reference images, and the per-row means
    (`per`, over the reference images themselves: CLIP score, retrieval, class accuracy)."""
    out = {}
    for name, idx in parts.items():
        part_ref = ref if not name else part_statistics(ref["feats"], idx)
        drawn = None if floor is None else floor[name]
        distances = {} if drawn is None or len(drawn) < 2 else unsized(
            all_scores(drawn, part_ref, mode, len(drawn), tag, device), len(drawn))
        out[name] = {**distances, **means(per, np.isin(np.arange(len(parts[""])), idx))}
    return out


def training_floor(key, cfg, rows, parts, feature_fn, accelerator, args):
    """({group: the features of as many images drawn from the trainer's training rows as the group has reference
    images, read as the reference's} or None; a line saying which, or why none): the Frechet family's real-data
    floor. Drawn per class where the rows carry the run's data.label_column (else "label": emoji's
    category), in the group's proportions. None where the reference is not the run's own source (other images than
    it trained on), is its training split, or the source is streamed. A collective: every rank calls it."""
    data = cfg["data"]
    if not same_source(key["source"], data["source"]):
        return None, f"none: the reference is not the run's own data.source ({data['source']})"
    if key["split"] == data["split"] or is_stream(config.Config(data)):
        return None, f"none: the reference is the training split '{data['split']}', or the source is streamed"
    column = data.get("label_column") or "label"
    values = np.asarray(rows[column]) if column in rows.column_names else None
    floor, paths = {}, []
    for name, idx in parts.items():
        draw = training_draw_key(key, cfg, len(idx), 0, column, None if values is None else values[idx])
        stats = reference_stats(draw, cfg, feature_fn, accelerator, args.stats_cache, args.batch_size)
        floor[name], paths = stats["feats"], paths + [stats["path"]]
    how = f" per '{column}' in each group's proportions" if values is not None else ""
    return floor, (f"as many images as each group has, drawn (seed 0){how} from the training rows of split "
                   f"'{data['split']}' ({', '.join(paths)})")


def flat(nested, num_samples, n_rows, parts):
    """{metric_<N>[_part]: value}: each group's metrics named with its sample count (a part's: its rows x
    num_samples / R), "all" first (the name tools/tune.py reads), then each part."""
    out = {}
    for name, values in nested.items():
        n = num_samples // n_rows * len(parts[name])
        out.update({f"{k}_{size_tag(n)}" + (f"_{name}" if name else ""): v for k, v in values.items()})
    return out


def table(samples, real, parts, num_samples):
    """The printed table: a row per metric, a column per group (all, then each part), each cell 'samples (real)'."""
    n_rows = len(parts[""])
    heads = [f"{name or 'all'} ({num_samples // n_rows * len(idx):,} samples)" for name, idx in parts.items()]
    names = list(dict.fromkeys(k for values in samples.values() for k in values))
    cells = [[name] + [f"{samples[g][name]:.4f}" + (f" ({real[g][name]:.4f})" if name in real.get(g, {}) else "")
                       if name in samples[g] else "-" for g in parts] for name in names]
    lines = [["metric (real images)", *heads], *cells]
    widths = [max(len(r[i]) for r in lines) for i in range(len(heads) + 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]

# ----------------------------------------------------------------------------------------------------------
# What the report keeps.


def record(rows, parts, prompts, num_samples, floor_note):
    """report.json's text_protocol: what sample i is, the groups (rows, captions, samples), retrieval's chance."""
    n_rows, distinct = len(rows), len(set(prompts))
    return {"sample_i": f"reference row i % {n_rows}'s caption, noise seed_for(seed, 0, i)", "rows": n_rows,
            "captions": distinct, "samples_per_row": num_samples // n_rows,
            "groups": {name or "all": {"rows": len(idx), "captions": len({prompts[i] for i in idx}),
                                       "samples": num_samples // n_rows * len(idx)} for name, idx in parts.items()},
            "retrieval": f"each image ranks the {distinct} distinct captions of the rows; chance: top-1 "
                         f"{1 / distinct:.4f}, top-5 {min(5, distinct) / distinct:.4f}",
            "real": "the Frechet family: " + floor_note + "; CLIP score, retrieval, class accuracy: the reference "
                    "images themselves", "per_sample": PER_SAMPLE}


def write_per_sample(path, rows, parts, prompts, num_samples, per, labels):
    """One JSON line per sample: its index, row, caption, part, class (with --classifier), CLIP score, its caption's
    rank among the distinct captions (0: first) and whether the classifier saw its class."""
    part_of = {int(i): name for name, idx in list(parts.items())[1:] for i in idx}
    with open(path, "w") as f:
        for i in range(num_samples):
            row = i % len(rows)
            line = {"sample": i, "row": row, "caption": prompts[row], "part": part_of.get(row)}
            if labels is not None:
                line["label"] = int(labels[row])
            if per.get("clip") is not None:
                line.update(clip_score=float(per["clip"][i, 0]), caption_rank=int(per["clip"][i, 1]))
            if per.get("hits") is not None:
                line["class_hit"] = bool(np.asarray(per["hits"]).reshape(-1)[i])
            f.write(json.dumps(line) + "\n")
