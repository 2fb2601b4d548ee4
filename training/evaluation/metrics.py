"""Sample-quality scores on features eval_fid.py already has: FID and KID (clean-fid's math), improved precision
and recall, density and coverage (k-NN balls), FD-DINOv2 and its DINOv2 features, and the CLIP score.
eval_fid.py (and its small-N FID in training) calls these; nothing here samples a model.

Precision, recall (Kynkaanniemi et al. 2019, eq. 1-3) and density, coverage (Naeem et al. 2020, eq. 3-4), with
real features X (N rows), fake features Y (M rows), and r_k(x) the distance from x to its k-th nearest
neighbour in its own set (itself excluded), B(x, r) the open ball:
    precision = 1/M sum_j 1[exists i: Y_j in B(X_i, r_k(X_i))]      (fidelity: fakes on the real manifold)
    recall    = 1/N sum_i 1[exists j: X_i in B(Y_j, r_k(Y_j))]      (diversity: reals on the fake manifold)
    density   = 1/(kM) sum_j sum_i 1[Y_j in B(X_i, r_k(X_i))]       (how many real balls hold each fake)
    coverage  = 1/N sum_i 1[exists j: Y_j in B(X_i, r_k(X_i))]      (reals with a fake in their ball)
exactly as the `prdc` package computes them (k = 5 by default, strict '<'), but chunked: prdc holds three
N x N distance matrices (60 GB at N = 50k in float64); here at most `budget` distances exist at once.
"""
import contextlib
import json
from pathlib import Path

import numpy as np
import torch

from training.data.encoders import quiet_transformers, text_encoder_identity
from training.evaluation.reference import sha256_of

NEAREST_K = 5  # Naeem et al. 2020's default, and prdc's README


def squared_distances(a, b):
    """(len(a), len(b)) squared Euclidean distances, |a|^2 + |b|^2 - 2 a.b (clamped at 0 against rounding)."""
    return ((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T).clamp_(min=0)


def row_chunks(rows, cols, budget):
    """Row slices of a rows x cols matrix with at most `budget` entries each (at least one row)."""
    step = max(1, budget // max(cols, 1))
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


def knn_radii(x, k=NEAREST_K, budget=2 ** 25):
    """Squared distance from each row of x to its k-th nearest other row (the (k+1)-th smallest, counting the
    row itself at distance 0), computed one chunk of rows at a time."""
    if len(x) <= k:
        raise ValueError(f"k-NN radii with k = {k} need more than {k} samples; got {len(x)}")
    return torch.cat([squared_distances(x[rows], x).topk(k + 1, dim=1, largest=False).values[:, -1]
                      for rows in row_chunks(len(x), len(x), budget)])


@torch.no_grad()
def prdc(real, fake, k=NEAREST_K, device="cpu", budget=2 ** 25):
    """{'precision', 'recall', 'density', 'coverage'} of fake features against real ones (numpy or torch,
    (N, D) and (M, D)), in float64 on `device`. Distances are compared squared: the same order as prdc's."""
    x, y = (torch.as_tensor(np.asarray(f), dtype=torch.float64, device=device) for f in (real, fake))
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"prdc: real {tuple(x.shape)} and fake {tuple(y.shape)} features must be (N, D) with one D")
    r_real, r_fake = knn_radii(x, k, budget), knn_radii(y, k, budget)
    in_real_balls = torch.zeros(len(y), dtype=torch.float64, device=device)  # per fake: real balls holding it
    real_in_fake_ball = torch.zeros(len(x), dtype=torch.bool, device=device)  # per real: inside some fake's ball
    nearest_fake = torch.full((len(x),), float("inf"), dtype=torch.float64, device=device)
    for rows in row_chunks(len(y), len(x), budget):  # one pass over the M x N fake-real distances
        d = squared_distances(y[rows], x)
        in_real_balls[rows] = (d < r_real[None, :]).sum(1, dtype=torch.float64)
        real_in_fake_ball |= (d < r_fake[rows, None]).any(0)
        nearest_fake = torch.minimum(nearest_fake, d.min(0).values)
    return {"precision": (in_real_balls > 0).double().mean().item(),
            "recall": real_in_fake_ball.double().mean().item(),
            "density": (in_real_balls.sum() / (k * len(y))).item(),
            "coverage": (nearest_fake < r_real).double().mean().item()}


def feature_tag(feature_fn):
    """The features' part of a metric name: 'inception', 'dinov2', or the extractor's name made safe."""
    name = getattr(feature_fn, "tag", None) or getattr(feature_fn, "name", "custom")
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def manifold_metrics(feats, ref_feats, tag, n_tag, device="cpu"):
    """{'precision_<tag>_<n>', 'recall_..', 'density_..', 'coverage_..'}; {} when either set has k or fewer
    samples or the reference has no stored features (clean-fid's named statistics without KID features)."""
    if ref_feats is None or min(len(feats), len(ref_feats)) <= NEAREST_K:
        return {}
    return {f"{name}_{tag}_{n_tag}": value for name, value in prdc(ref_feats, feats, device=device).items()}


# ----------------------------------------------------------------------------------------------------------
# DINOv2 features for FD-DINOv2 (Stein et al. 2023): the CLS token after the final layer norm (what torch hub's
# DINOv2 returns and EDM2 / dgm-eval use), the whole image resized bicubically (antialiased) to the image
# processor's crop size (224 for facebook/dinov2-*), normalised with its mean and std: EDM2's preprocessing.

DINO_DEFAULT = "facebook/dinov2-base"  # ViT-B/14: 4x cheaper than ViT-L/14, which EDM2 reports with


def dinov2_features(model_id=DINO_DEFAULT, device="cpu", accelerator=None, batch_size=64):
    """feature_fn(list of uint8 (H, W, 3) images) -> float64 (N, hidden) from a transformers Dinov2Model (a hub
    id or a folder saved with save_pretrained). An offline node without the files gets instructions."""
    from transformers import AutoImageProcessor, Dinov2Model

    try:
        with accelerator.main_process_first() if accelerator else contextlib.nullcontext():  # one download
            with quiet_transformers(warnings=False):
                model = Dinov2Model.from_pretrained(model_id).to(device).eval()
            processor = AutoImageProcessor.from_pretrained(model_id)
    except OSError as e:
        raise FileNotFoundError(f"DINOv2 {model_id!r} could not be loaded ({str(e).splitlines()[0]}). On a machine "
                                f"with network run `python tools/prefetch.py --config CONFIG --dino {model_id}` and "
                                f"copy the Hugging Face cache, or pass a local folder saved with "
                                f"save_pretrained.") from None
    crop = processor.crop_size
    size = (crop["height"], crop["width"])
    mean = torch.tensor(processor.image_mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std, device=device).view(1, 3, 1, 1)

    @torch.no_grad()
    def feature_fn(images):
        out = []
        for start in range(0, len(images), batch_size):  # images of any sizes: resized one by one
            x = torch.cat([torch.nn.functional.interpolate(
                torch.from_numpy(np.array(img)).to(device).permute(2, 0, 1)[None].float() / 255, size=size,
                mode="bicubic", antialias=True, align_corners=False) for img in images[start:start + batch_size]])
            out.append(model(pixel_values=(x - mean) / std).pooler_output.double().cpu().numpy())
        return np.concatenate(out)
    feature_fn.name, feature_fn.tag, feature_fn.path = f"dinov2/{model_id}", "dinov2", str(model_id)
    feature_fn.sha256 = None  # a hub model is pinned by its revision in the HF cache, not by one file
    return feature_fn


# ----------------------------------------------------------------------------------------------------------
# FID = ||mu1 - mu2||^2 + Tr(S1 + S2 - 2 sqrt(S1 S2)) (Heusel et al. 2017); KID: unbiased MMD^2 with the cubic
# polynomial kernel (Binkowski et al. 2018); both as clean-fid computes them (Parmar et al. 2022). Precision,
# recall, density and coverage (above) use the same features and the cached reference features; FD-DINOv2 is
# the same Frechet distance on DINOv2 features (Stein et al. 2023).


NOT_INCEPTION = ("classifier", "clip")  # features whose distances are named fd_<tag>, kd_<tag>: never FID, KID


def size_tag(n):
    """50000 -> '50k', 1000 -> '1k', 999 -> '999', 1500 -> '1500' (only whole thousands get a 'k')."""
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def fid_size_warning(n_ref, n_samples, dim, tag=None):
    """What a FID can and cannot mean when its covariances have fewer images than feature dimensions (then they
    are singular and FID is mostly the estimator's bias), with what fits instead; None when both sets are
    larger. Named as the distances are (all_scores): fd_classifier and kd_classifier for the classifier's features
    (tag 'classifier'), fd_clip and kd_clip for CLIP's, FID and KID otherwise. Fewer than 2 reference images give
    no covariance at all: a ValueError."""
    fd, kd = (f"fd_{tag}", f"kd_{tag}") if tag in NOT_INCEPTION else ("FID", "KID")
    if n_ref is not None and n_ref < 2:
        raise ValueError(f"the {fd} reference has {n_ref} image(s): a covariance needs at least 2. Score against "
                         f"more real images: --reference FOLDER, or more held-out rows (data.val_holdout)")
    few_ref, few_samples = n_ref is not None and n_ref <= dim, n_samples <= dim
    if not (few_ref or few_samples):
        return None
    small = [f"the reference has {n_ref}"] * few_ref + [f"the samples {n_samples}"] * few_samples
    more = [f"more than {dim} samples (--num_samples)"] * few_samples + [
        f"more than {dim} real images: --reference FOLDER (a larger folder of real images), a dataset split "
        f"(--reference SOURCE --reference_split SPLIT)" + (" or clean-fid's statistics (--reference "
                                                          "cleanfid:NAME:RES:SPLIT)" if fd == "FID" else "")] * few_ref
    return (f"{fd}'s covariances have more dimensions ({dim}) than images ({' and '.join(small)}): they are singular, "
            f"so this {fd} is mostly the estimator's bias and noise. It can rank models scored against the same "
            f"reference with the same --num_samples, roughly; it cannot be compared with other "
            + ("FIDs (papers, other references, other sample counts)" if fd == "FID" else
               f"{fd} values (other references, other sample counts, another {tag})")
            + f" nor read as a distance. {kd}, reported beside it, is unbiased at any size and fits small sets. "
            f"For {'a' if fd == 'FID' else 'an'} {fd} that means more, score "
            f"{' against '.join(more) if few_samples else 'against ' + more[0]}.")


def frechet(mu1, sigma1, mu2, sigma2):
    """clean-fid's Frechet distance; where its sqrtm of a singular S1 S2 fails ('Imaginary component'), the
    same trace from the eigenvalues of S1 S2 (those of S1^1/2 S2 S1^1/2: real, >= 0 up to rounding), so a
    run of sampling is never lost to it."""
    from cleanfid.fid import frechet_distance

    try:
        return float(frechet_distance(mu1, sigma1, mu2, sigma2))
    except ValueError:
        roots = np.sqrt(np.clip(np.linalg.eigvals(sigma1 @ sigma2).real, 0, None))
        return float(np.sum((mu1 - mu2) ** 2) + np.trace(sigma1) + np.trace(sigma2) - 2 * roots.sum())


def fid_kid(feats, ref, mode, n, names=None):
    """{'fid_<mode>_<N>', 'kid_<mode>_<N>'}; `names` = (Frechet, kernel) prefixes for features that are not
    Inception's, whose distances must not be called FID and KID ('fd_classifier', 'kd_classifier')."""
    from cleanfid.fid import kernel_distance

    fd, kd = names or (f"fid_{mode}", f"kid_{mode}")
    fid = frechet(feats.mean(0), np.cov(feats, rowvar=False), ref["mu"], ref["sigma"])
    out = {f"{fd}_{size_tag(n)}": float(fid)}
    if ref["feats"] is not None and min(len(feats), len(ref["feats"])) >= 2:
        np.random.seed(0)  # kernel_distance draws its subsets from numpy's global RNG
        out[f"{kd}_{size_tag(n)}"] = float(kernel_distance(feats, ref["feats"]))
    return out


def all_scores(feats, ref, mode, n, tag, device="cpu"):
    """fid_kid plus '<precision|recall|density|coverage>_<tag>_<N>' (k = 5) against the reference features.
    The evaluation classifier's features (tag 'classifier') give fd_classifier_<N> and kd_classifier_<N>, CLIP's
    (tag 'clip') fd_clip_<N> and kd_clip_<N>."""
    names = (f"fd_{tag}", f"kd_{tag}") if tag in NOT_INCEPTION else None
    return {**fid_kid(feats, ref, mode, n, names), **manifold_metrics(feats, ref["feats"], tag, size_tag(n), device)}


def dino_scores(feats, ref, n, device="cpu"):
    """'fd_dinov2_<N>' and the manifold metrics on DINOv2 features."""
    fd = frechet(feats.mean(0), np.cov(feats, rowvar=False), ref["mu"], ref["sigma"])
    return {f"fd_dinov2_{size_tag(n)}": float(fd),
            **manifold_metrics(feats, ref["feats"], "dinov2", size_tag(n), device)}


def check_dino_reference(reference):
    """FD-DINOv2 needs reference images: a statistics file or clean-fid's named statistics are Inception's."""
    if str(reference).endswith(".npz") or str(reference).startswith("cleanfid:"):
        raise ValueError(f"--dino: the reference {reference} is precomputed Inception statistics; DINOv2 needs the "
                         f"images (a folder or a dataset) to compute its own, cached like Inception's")


CLIP_DEFAULT = "openai/clip-vit-large-patch14"  # eval_fid.py's --clip_model (the CC12M recipe's text encoder)

# ----------------------------------------------------------------------------------------------------------
# CLIP (Radford et al. 2021): a hub id or a folder saved with save_pretrained beside its tokenizer and image processor
# (tools/clip.py's), read with its own preprocessing. Its image embeddings are FD's features (--features clip), and,
# L2-normalised, the CLIP score's and retrieval's (training/evaluation/captions.py).


def load_clip(model_id, device="cpu"):
    """(CLIPModel in eval mode, its tokenizer, its image processor), loaded once per process: kept while the same
    model (a local folder's files unchanged: encoders.text_encoder_identity) is asked for on the same device."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    key = (str(model_id), str(device), json.dumps(text_encoder_identity(str(model_id))))
    if getattr(load_clip, "cache", (None,))[0] != key:
        try:
            with quiet_transformers(warnings=False):  # no bar of its weights in a log file
                model = CLIPModel.from_pretrained(model_id, use_safetensors=True).to(device).eval()
            load_clip.cache = (key, model, AutoTokenizer.from_pretrained(model_id),
                               AutoImageProcessor.from_pretrained(model_id))
        except OSError as e:  # offline without the files, a folder that is not there: one line (eval_fid.py)
            raise FileNotFoundError(f"--clip_model {model_id}: no CLIP could be loaded ({str(e).splitlines()[0]}). "
                                    f"Give a folder made by tools/clip.py (or saved with save_pretrained), a hub id "
                                    f"in the Hugging Face cache (tools/prefetch.py), or 'none' to score without CLIP"
                                    ) from None
    return load_clip.cache[1:]


def clip_features(model_id=CLIP_DEFAULT, device="cpu", batch_size=64):
    """feature_fn(list of uint8 (H, W, 3) images) -> float64 (N, projection_dim): CLIP's projected image embeddings
    before their L2 normalisation (CLIPModel's image_embeds), the images through its own image processor. Its
    `text(captions)` -> their L2-normalised text embeddings (torch, float32), CLIP's tokenizer truncating to its
    context. Named for the reference cache by the model: a hub id, or a folder's weights' sha256, so a CLIP retrained
    in place never reads statistics of the old one."""
    model, tokenizer, processor = load_clip(model_id, device)
    weights = Path(model_id) / "model.safetensors"
    digest = sha256_of(weights) if weights.is_file() else None

    @torch.no_grad()
    def feature_fn(images):
        out = []
        for start in range(0, len(images), batch_size):
            batch = [np.array(img) for img in images[start:start + batch_size]]  # writable copies, for torch
            pixels = processor(images=batch, return_tensors="pt")["pixel_values"]
            pooled = model.vision_model(pixel_values=pixels.to(device)).pooler_output
            out.append(model.visual_projection(pooled).double().cpu().numpy())
        return np.concatenate(out)

    @torch.no_grad()
    def text(captions):
        tok = tokenizer(list(captions), padding=True, truncation=True, return_tensors="pt",
                        max_length=model.config.text_config.max_position_embeddings).to(device)
        pooled = model.text_model(input_ids=tok.input_ids, attention_mask=tok.attention_mask).pooler_output
        return torch.nn.functional.normalize(model.text_projection(pooled), dim=-1).float().cpu()
    feature_fn.name = f"clip@{digest[:16]}" if digest else f"clip@{model_id}"
    feature_fn.tag, feature_fn.path, feature_fn.sha256, feature_fn.text = "clip", str(model_id), digest, text
    return feature_fn


def clip_cosines(image_feats, text_emb):
    """cos(E_img, E_txt) of each image's features (N, D; clip_features', unnormalised) and its caption's
    L2-normalised embedding (N, D)."""
    image = torch.nn.functional.normalize(torch.as_tensor(np.asarray(image_feats), dtype=torch.float32), dim=-1)
    return (image * text_emb).sum(-1).double().numpy()


def clip_scores(model_id, images, captions, device):
    """Per image, 100 * max(cos(E_img, E_txt), 0) (CLIPScore, Hessel et al. 2021, w = 100 as torchmetrics),
    with CLIP's own preprocessing: its image processor, its tokenizer truncated to its context length."""
    clip = clip_features(model_id, device)
    return 100 * np.maximum(clip_cosines(clip(list(images)), clip.text(captions)), 0)
