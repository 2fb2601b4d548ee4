"""Transfer (init_from): a new run starts from another run's weights, at another resolution (256 -> 512 px) or
on other data (ImageNet-22k -> 1k, or -> text-to-image). Unlike resume, optimizer, step and data position start
fresh. Here, what happens to the tensors: the positional grid resampled (or extended) to the new token grid,
class embeddings mapped by class id, everything else loaded when its shape matches. Where the weights come from
(a run folder, a checkpoint, an export; local or on the Hub) is training/run/start.py's.
"""
import math

import torch

TEXT_BUFFERS = ("conditioner.null_tokens", "conditioner.null_mask", "conditioner.null_pooled")  # this run's encoder


def grid_positions(pos_embed):
    """The positions along one axis that a square 2-D sin-cos grid encodes, read back from its lowest
    frequency (diffusers' layout: [sin, cos] of the column, then of the row, D/4 frequencies each). A grid
    built by diffusers gives 0, 1, ..., g-1; a grid resampled before gives its fractional positions."""
    g, q = math.isqrt(pos_embed.shape[-2]), pos_embed.shape[-1] // 4
    lowest = pos_embed.reshape(g, g, 4, q)[0, :, :2, -1].double()  # row 0: sin, cos of the column position
    pos = torch.atan2(lowest[:, 0], lowest[:, 1]) / (1 / 10000 ** ((q - 1) / q))
    return pos.round() if (pos - pos.round()).abs().max() < 1e-3 else pos  # integers are exact


def resample_pos_embed(pos_embed, new_grid, mode="resample", squares=None):
    """The (1, new_grid^2, D) sin-cos grid for a new token grid, from an old one (1, g^2, D).
    resample (Berrada et al. 2024, Pseudocode 1, "rectified grid sampling"): new token i sits at old position
    p_i = (i + 0.5) g / new_grid - 0.5, so the new grid spans the positions the model was trained on (corners
    align, centres coincide) and the sin-cos features are evaluated there exactly.
    extend (diffusers' default): positions continue at the old spacing, centred (SD3 crops the centre of a
    larger grid), so a 2x grid reaches positions the model never saw.
    squares (old, new): the tokens a side of each run's data.resolution square, centred in its grid, when a run
    has buckets (its grid is its largest bucket's side: SD3's cropped embedding); resample then maps the new
    square onto the old one, p_i = o + (i - n + 0.5) S / s - 0.5, and extend centres it on the old one at the old
    spacing, p_i = o + i - n - (s - S) / 2; the grid beyond continues at that spacing. o, n: each square's offset
    in its grid, (grid - square) // 2 as diffusers' cropped_pos_embed takes it, so with an odd margin (a 7-token
    square in a 10-grid) the square is where the crop reads it, not half a token off. None: each whole grid is
    its square."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed_from_grid

    old = grid_positions(pos_embed)
    g, spacing = len(old), (old[-1] - old[0]) / max(len(old) - 1, 1)
    i = torch.arange(new_grid, dtype=torch.float64)
    old_square, new_square = squares or (g, new_grid)
    o, n = (g - round(old_square)) // 2, (new_grid - round(new_square)) // 2  # where the crop reads each square
    index = (o + (i - n + 0.5) * old_square / new_square - 0.5 if mode == "resample"
             else o + i - n - (new_square - old_square) / 2)
    pos = (old[0] + index * spacing).float()  # float32 positions, as diffusers builds its grid
    grid = torch.stack(torch.meshgrid(pos, pos, indexing="xy")).reshape(2, 1, new_grid, new_grid)
    return get_2d_sincos_pos_embed_from_grid(pos_embed.shape[-1], grid).float()[None]


def map_classes(source, target, source_ids, target_ids):
    """Class-embedding rows of the target's classes, taken from the source class with the same id (WordNet
    id for ImageNet-22k -> 1k); the last row, the null class of guidance, from the source's null class.
    Classes the source lacks keep their fresh initialisation. Each class may own several rows (class tokens)."""
    tokens = source.shape[0] // (len(source_ids) + 1)
    if target.shape[0] != (len(target_ids) + 1) * tokens or source.shape[0] != (len(source_ids) + 1) * tokens:
        raise ValueError(f"class embeddings {tuple(source.shape)} -> {tuple(target.shape)} do not fit "
                         f"{len(source_ids)} -> {len(target_ids)} classes with {tokens} tokens each")
    where = {c: i for i, c in enumerate(source_ids)}
    pairs = [(j, where[c]) for j, c in enumerate(target_ids) if c in where] + [(len(target_ids), len(source_ids))]
    out = target.clone().view(len(target_ids) + 1, tokens, -1)
    rows = torch.tensor(pairs, dtype=torch.long)
    out[rows[:, 0]] = source.view(len(source_ids) + 1, tokens, -1)[rows[:, 1]].to(out.dtype)
    return out.view_as(target), [c for c in target_ids if c not in where]


def adapt_state(source, target, source_ids=None, target_ids=None, pos_embed_mode="resample", squares=None):
    """The target model's state dict filled from a source state dict, and a report of what happened.
    Same-shaped tensors load; the positional grid is resampled (or extended) to the new token grid (`squares`:
    resample_pos_embed's, for runs with buckets); class
    embeddings are mapped by id when both runs know their class ids; any other shape change, missing or
    unexpected tensor keeps the target's fresh value and is reported."""
    out, report = dict(target), {"loaded": 0, "adapted": [], "missing": [], "unexpected": [], "reshaped": []}
    report["taken"] = set()  # the keys whose value came from the source (loaded or adapted)
    for key, value in target.items():
        if key in TEXT_BUFFERS:
            continue  # the empty prompt of this run's own text encoder, set by the trainer
        if key not in source:
            report["missing"].append(key)
            continue
        src = source[key]
        if key.endswith("pos_embed.pos_embed") and src.shape != value.shape:
            out[key] = resample_pos_embed(src, math.isqrt(value.shape[1]), pos_embed_mode, squares)
            report["taken"].add(key)
            report["adapted"].append(f"{key}: {pos_embed_mode} {math.isqrt(src.shape[1])}^2 -> "
                                     f"{math.isqrt(value.shape[1])}^2 positions")
        elif key.endswith(("class_embed.weight", "class_vector.weight")) and source_ids and target_ids:
            out[key], unmatched = map_classes(src, value, source_ids, target_ids)
            report["taken"].add(key)
            hint = "" if len(unmatched) < len(target_ids) else (
                f" (no id in common: the source's look like {source_ids[:2]}, this run's like {target_ids[:2]};"
                f" set data.class_ids so both name classes the same way)")
            report["adapted"].append(f"{key}: {len(target_ids) - len(unmatched)} of {len(target_ids)} classes "
                                     f"mapped by id from {len(source_ids)}; unmatched (fresh): {unmatched[:20]}{hint}")
        elif src.shape != value.shape:
            report["reshaped"].append(f"{key}: {tuple(src.shape)} -> {tuple(value.shape)}")
        else:
            out[key], report["loaded"] = src.to(value.dtype), report["loaded"] + 1
            report["taken"].add(key)
    report["unexpected"] = sorted(k for k in source if k not in target)
    return out, report
