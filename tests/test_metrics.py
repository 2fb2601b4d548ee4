"""training/evaluation/metrics.py: precision, recall, density and coverage against the `prdc` package and closed forms,
chunked and not; DINOv2 features through a tiny random Dinov2Model saved with save_pretrained (no network)."""
import numpy as np
import pytest
import torch

from training.evaluation import metrics


def two_sets(n_real=240, n_fake=180, dim=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_real, dim)), 1.3 * rng.standard_normal((n_fake, dim)) + 0.4


@pytest.fixture(scope="module")
def package_values():
    """prdc.compute_prdc (the oracle: full N x N matrices through scikit-learn) at k = 5 and k = 3."""
    import prdc

    real, fake = two_sets()
    return {k: {name: float(v) for name, v in prdc.compute_prdc(real, fake, nearest_k=k).items()} for k in (5, 3)}


@pytest.mark.parametrize("budget", [2 ** 25, 1000, 1])  # one chunk; 4-5 rows a chunk; one row a chunk
def test_prdc_equals_the_prdc_package(budget, package_values):
    real, fake = two_sets()
    ours = metrics.prdc(real, fake, budget=budget)
    assert ours == pytest.approx(package_values[5], abs=1e-12)
    assert 0.1 < ours["precision"] < 0.9 and 0.1 < ours["coverage"] < 0.9  # a case where every term matters
    assert metrics.prdc(real, fake, k=3, budget=budget) == pytest.approx(package_values[3], abs=1e-12)  # k honoured


def test_knn_radii_are_the_kth_other_neighbour():
    x = torch.tensor([[0.0], [1.0], [3.0], [7.0]], dtype=torch.float64)
    # 2nd nearest other point: of 0 -> 3 (at 3), of 1 -> 3 (at 2), of 3 -> 0 (at 3), of 7 -> 1 (at 6)
    assert metrics.knn_radii(x, k=2, budget=2).tolist() == [9.0, 4.0, 9.0, 36.0]  # squared
    with pytest.raises(ValueError, match="more than 5 samples"):
        metrics.knn_radii(x)


def test_closed_forms_a_set_against_itself_and_against_a_far_set():
    real, _ = two_sets()
    itself = metrics.prdc(real, real, budget=5000)
    # Each real point is in its own ball (distance 0 < r): precision, recall, coverage 1. Density: ball i holds
    # exactly k points (itself and its k - 1 nearest; the k-th lies on the sphere, and '<' is strict), so the
    # count summed over all points is k N and density = k N / (k N) = 1.
    assert itself == {"precision": 1.0, "recall": 1.0, "density": 1.0, "coverage": 1.0}
    far = metrics.prdc(real, real + 1e3, budget=5000)
    assert far == {"precision": 0.0, "recall": 0.0, "density": 0.0, "coverage": 0.0}


def test_precision_and_recall_separate_fidelity_from_diversity():
    """A collapsed generator (every fake near one real mode) has high precision and low recall; a too-wide one
    the reverse: what FID alone cannot tell apart."""
    rng = np.random.default_rng(1)
    real = rng.standard_normal((400, 4))
    collapsed = 0.05 * rng.standard_normal((400, 4))
    wide = 4 * rng.standard_normal((400, 4))
    c, w = metrics.prdc(real, collapsed), metrics.prdc(real, wide)
    assert c["precision"] > 0.95 and c["recall"] < 0.1 and c["coverage"] < 0.1
    assert w["precision"] < 0.4 and w["recall"] > 0.8


def test_manifold_metric_names_and_small_sets():
    real, fake = two_sets(40, 30)
    out = metrics.manifold_metrics(fake, real, "inception", "30")
    assert set(out) == {f"{m}_inception_30" for m in ("precision", "recall", "density", "coverage")}
    assert metrics.manifold_metrics(fake[:5], real, "inception", "5") == {}  # k = 5 needs 6 samples a set
    assert metrics.manifold_metrics(fake, None, "inception", "30") == {}  # a reference without features

    class Named:
        name = "tiny-random-conv"
    assert metrics.feature_tag(Named()) == "tiny_random_conv"
    with pytest.raises(ValueError, match="one D"):
        metrics.prdc(real, fake[:, :3])


def make_tiny_dinov2(folder, image_size=32):
    """A 1-layer random Dinov2Model and an image processor, saved like facebook/dinov2-base (crop 224 there)."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             patch_size=8, image_size=image_size)).save_pretrained(folder)
    BitImageProcessor(crop_size={"height": image_size, "width": image_size}, image_mean=[0.485, 0.456, 0.406],
                      image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return str(folder)


def test_dinov2_features_are_the_cls_token_of_normalised_pixels(tmp_path):
    from transformers import Dinov2Model

    path = make_tiny_dinov2(tmp_path / "dino")
    feature_fn = metrics.dinov2_features(path, batch_size=2)
    rng = np.random.default_rng(0)
    images = list(rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8))
    feats = feature_fn(images)
    assert feats.shape == (3, 32) and feats.dtype == np.float64
    assert feature_fn.name == f"dinov2/{path}" and metrics.feature_tag(feature_fn) == "dinov2"
    # By hand: at the crop size the resize is the identity; ImageNet mean/std; CLS of the last (normed) layer.
    model = Dinov2Model.from_pretrained(path).eval()
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) \
        / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = model(pixel_values=x).last_hidden_state[:, 0].double().numpy()
    np.testing.assert_allclose(feats, expected, rtol=1e-4, atol=1e-5)
    # Other sizes are resized to the crop size first (so 16 px demo samples and 64 px references both work).
    assert feature_fn([images[0][::2, ::2], images[1]]).shape == (2, 32)


def test_dinov2_offline_without_files_says_how_to_prefetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="prefetch.py"):
        metrics.dinov2_features(str(tmp_path / "no-such-dinov2"))
