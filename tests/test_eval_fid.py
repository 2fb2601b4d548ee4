"""eval_fid.py: FID math, reference cache, process-count invariance, report, offline errors, CLIP score.

Offline: a tiny fixed random conv net stands in for Inception (eval_fid takes the feature extractor as a
parameter), and a tiny CLIP is built and saved locally, then loaded through the same path as a hub id.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import eval_fid  # noqa: E402
from training.config import config  # noqa: E402
from training.evaluation import generation, metrics, reference, sampling  # noqa: E402
import train_flow_matching  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))  # conftest's helpers, also when accelerate launch imports this file
from conftest import tiny_run_args, trained_for_the_module  # noqa: E402

# The class run is trained with every control, so sampling must supply size, crop and flip metadata.
CONTROLS = ['--conditioning.controls=["size", "crop", "flip"]']
GEN = ["--steps", "2", "--batch_size", "4"]


class TinyFeatures:
    """A fixed random conv net: uint8 (N, H, W, 3) -> (N, 16) features, deterministic, no download."""

    name = "tiny-random-conv"

    def __init__(self, dim=16):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(),
                                           torch.nn.Conv2d(8, dim, 3, stride=2), torch.nn.AdaptiveAvgPool2d(1),
                                           torch.nn.Flatten()).eval()
        self.calls = 0

    @torch.no_grad()
    def __call__(self, images):
        self.calls += 1
        x = torch.from_numpy(np.asarray(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
        return self.net(x).double().numpy()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny class-conditional flow-matching run with controls, trained in-process (2 steps), exported."""
    return trained_for_the_module(train_flow_matching.main,
                                  [*tiny_run_args(tmp_path_factory.mktemp("fm"), steps=2), *CONTROLS])


def pngs(folder):
    return {p.name: np.asarray(Image.open(p)) for p in sorted(Path(folder).glob("*.png"))}


# ---- FID math ----------------------------------------------------------------------------------------------


def test_fid_of_gaussians_matches_closed_form():
    rng = np.random.default_rng(0)
    d, n = 4, 20000
    mu1, mu2 = np.zeros(d), np.array([1.0, -0.5, 0.0, 2.0])
    var1, var2 = np.array([1.0, 2.0, 0.5, 1.0]), np.array([4.0, 1.0, 0.5, 0.25])
    feats = mu1 + np.sqrt(var1) * rng.standard_normal((n, d))
    ref_feats = mu2 + np.sqrt(var2) * rng.standard_normal((n, d))
    ref = {"mu": ref_feats.mean(0), "sigma": np.cov(ref_feats, rowvar=False), "feats": None}  # None: no KID
    fid = metrics.fid_kid(feats, ref, "clean", n)["fid_clean_20k"]
    # Independently, from the same sample estimates: ||mu1 - mu2||^2 + Tr(S1 + S2 - 2 sqrtm(S1 S2)).
    s1 = np.cov(feats, rowvar=False)
    expected = (np.sum((feats.mean(0) - ref["mu"]) ** 2)
                + np.trace(s1 + ref["sigma"] - 2 * scipy.linalg.sqrtm(s1 @ ref["sigma"]).real))
    assert fid == pytest.approx(expected, rel=1e-6)
    # And the population value of the diagonal case: sum (mu1 - mu2)^2 + sum (sqrt(v1) - sqrt(v2))^2.
    analytic = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2)
    assert fid == pytest.approx(analytic, rel=0.03)


def test_size_tags():
    assert [metrics.size_tag(n) for n in (50000, 1000, 999, 8, 1500)] == ["50k", "1k", "999", "8", "1500"]


# ---- End to end: generation, reference, report -------------------------------------------------------------


@pytest.mark.slow
def test_fid_of_samples_against_themselves_is_zero_and_report_is_complete(run, tmp_path):
    feature_fn = TinyFeatures()
    out = tmp_path / "eval"
    eval_fid.main(["--run", str(run), "--num_samples", "40", *GEN, "--out_dir", str(out), "--generate_only"])
    assert len(pngs(out / "samples")) == 40
    report = eval_fid.main(["--run", str(run), "--num_samples", "40", *GEN, "--out_dir", str(out),
                            "--reference", str(out / "samples"), "--stats_cache", str(tmp_path / "stats"),
                            "--adm_npz", str(tmp_path / "samples.npz")], feature_fn=feature_fn)
    assert abs(report["metrics"]["fid_clean_40"]) < 1e-6
    assert abs(report["metrics"]["kid_clean_40"]) < 1e-2
    on_disk = json.loads((out / "report.json").read_text())
    for field in ("metrics", "model", "num_samples", "sampler", "steps", "guidance_scale", "control_guidance_scale",
                  "seeds", "conditioning", "reference", "mode", "feature_extractor", "versions", "command", "config"):
        assert field in on_disk, field
    assert on_disk["model"]["weights"] == "ema (export)" and on_disk["model"]["method"] == "train_flow_matching"
    assert on_disk["num_samples"] == 40 and on_disk["steps"] == 2 and on_disk["sampler"] == "euler"
    assert on_disk["guidance_scale"] == train_flow_matching.DEFAULTS["val"]["guidance_scale"]
    assert on_disk["seeds"]["seed"] == 0 and on_disk["mode"] == "clean"
    assert on_disk["control_guidance_scale"] == 0.0 and on_disk["controls"] == "heldout"
    assert on_disk["reference"]["kind"] == "folder" and len(on_disk["reference"]["stats_sha256"]) == 64
    assert on_disk["feature_extractor"] == "tiny-random-conv"
    assert (on_disk["written_by"], on_disk["reference_count"]) == ("eval_fid.py", 40)  # read by the model card
    assert {"torch", "diffusers", "transformers", "accelerate", "clean-fid"} <= set(on_disk["versions"])
    arr = np.load(tmp_path / "samples.npz")["arr_0"]  # the ADM evaluator's format
    assert arr.shape == (40, 16, 16, 3) and arr.dtype == np.uint8
    assert np.array_equal(arr[7], pngs(out / "samples")["000007.png"])


@pytest.mark.slow
def test_checkpoint_raw_weights_against_dataset_reference(run, tmp_path):
    report = eval_fid.main(["--run", str(run), "--checkpoint", "latest", "--weights", "raw", "--num_samples", "8",
                            *GEN, "--out_dir", str(tmp_path / "e"), "--stats_cache", str(tmp_path / "stats"),
                            "--guidance_scale", "1.5", "--sampler", "heun", "--control_guidance_scale", "2",
                            "--controls", "square"], feature_fn=TinyFeatures())
    assert report["model"]["weights"] == "raw" and report["model"]["step"] == 2
    assert report["sampler"] == "heun" and report["guidance_scale"] == 1.5
    assert report["control_guidance_scale"] == 2.0 and report["controls"] == "square"
    assert report["reference"]["source"] == "embedded" and report["reference"]["split"] == "heldout"
    assert report["reference"]["resolution"] == 16
    assert np.isfinite(report["metrics"]["fid_clean_8"]) and "kid_clean_8" in report["metrics"]


def test_the_demo_reference_key_holds_every_setting_the_demo_images_depend_on(tmp_path):
    """The embedded demo's images depend on data.demo_sizes (native sides) and data.demo_render: each is in the
    reference key, as in the cache's, so reference statistics are never reused across them; the plain demo's key
    is unchanged by the keys it does not set."""
    args = eval_fid.parse_args(["--run", str(tmp_path)])
    keys = [reference.reference_key(args, config.load_config(train_flow_matching.DEFAULTS, extra), "f")["demo"]
            for extra in ([], ["--data.demo_sizes=[8, 32]"], ["--data.demo_sizes=[8, 24]"],
                          ["--data.demo_sizes=[8, 32]", "--data.demo_render=band_limited"])]
    assert keys[0] == [config.load_config(train_flow_matching.DEFAULTS, []).data.demo_samples, 16]
    assert len({json.dumps(k) for k in keys}) == 4


@pytest.mark.slow
def test_reference_stats_are_cached_and_invalidated_by_preprocessing(run, tmp_path):
    from accelerate import Accelerator

    cfg = json.loads((run / "export" / "config.json").read_text())
    args = eval_fid.parse_args(["--run", str(run)])
    feature_fn, acc, cache = TinyFeatures(), Accelerator(), tmp_path / "stats"
    key = reference.reference_key(args, cfg, feature_fn.name)
    first = reference.reference_stats(key, cfg, feature_fn, acc, cache)
    calls = feature_fn.calls
    assert calls > 0 and first["feats"].shape == (64, 16)  # the 64 held-out rows
    again = reference.reference_stats(reference.reference_key(args, cfg, feature_fn.name), cfg, feature_fn, acc, cache)
    assert feature_fn.calls == calls and again["path"] == first["path"]  # a hit: nothing recomputed
    args.reference_resolution = 8  # a preprocessing change is a miss, never a silent reuse
    other = reference.reference_stats(reference.reference_key(args, cfg, feature_fn.name), cfg, feature_fn, acc, cache)
    assert feature_fn.calls > calls and other["path"] != first["path"]
    assert not np.allclose(other["mu"], first["mu"])
    assert len(list(cache.glob("*.npz"))) == 2


def test_a_class_folder_runs_heldout_reference_is_the_rows_the_trainer_held_out(tmp_path):
    """Class folders (no metadata.jsonl) as the run's data.source, --reference_split heldout (the default): the
    reference is the trainer's held-out rows (open_splits), as with metadata.jsonl, not every image it trained on.
    A folder passed as another --reference is still scored as it is."""
    from training.data.sources import open_splits

    for i in range(30):  # 30 flat colours in 2 class folders: each image is known by its colour
        (tmp_path / "pets" / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), (i * 8, 100, 50)).save(tmp_path / "pets" / "ab"[i % 2] / f"{i:03d}.png")
    cfg = config.load_config(train_flow_matching.DEFAULTS,
                             [f"--data.source={tmp_path / 'pets'}", "--data.resolution=8"])
    args = eval_fid.parse_args(["--run", str(tmp_path)])
    key = reference.reference_key(args, cfg, "f")
    assert key["kind"] == "dataset" and key["split"] == "heldout"
    colours = sorted(int(item()[0, 0, 0]) for item in reference.reference_images(key, cfg))
    held = open_splits(config.Config({**cfg.data}), print)[1]
    assert colours == sorted(int(np.asarray(Image.open(row["image"]["path"]))[0, 0, 0]) for row in held)
    assert len(held) == 3
    args = eval_fid.parse_args(["--run", str(tmp_path), "--reference", str(tmp_path / "pets" / "a")])
    assert reference.reference_key(args, cfg, "f")["kind"] == "folder"


def test_a_test_split_that_reads_the_training_images_is_not_scored_and_each_reference_names_its_folder(tmp_path):
    """Issue 68: --reference_split test of a folder without a test folder (and of the embedded demo) read the
    training images. Such a split gives way to the rows the trainer held out, with a line that says so; a folder
    with a test folder keeps it. Every reference but the held-out rows names eval_fid.py's output folder."""
    for split in ("", "train/", "test/"):  # a flat folder, and one with a real test split
        for i in range(12):
            (tmp_path / ("flat" if not split else "split") / split / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (i * 20, 9 * len(split), 50)).save(
                tmp_path / ("flat" if not split else "split") / split / "ab"[i % 2] / f"{i:03d}.png")
    args = eval_fid.parse_args(["--run", "RUN", "--reference_split", "test"])
    for source, kept in (("flat", False), ("split", True), ("embedded", False)):
        cfg = config.load_config(train_flow_matching.DEFAULTS, [
            f"--data.source={tmp_path / source if source != 'embedded' else source}", "--data.resolution=8",
            "--data.demo_samples=40"])
        split, note = reference.reference_split(args, cfg)
        assert (split, note is None) == (("test", True) if kept else ("heldout", False)), source
        assert kept or "holds the images of its training split 'train'" in note
    cfg = config.load_config(train_flow_matching.DEFAULTS, [f"--data.source={tmp_path / 'flat'}",
                                                             "--data.resolution=8"])
    assert reference.reference_split(eval_fid.parse_args(["--run", "RUN", "--reference_split", "train"]), cfg) == (
        "train", None)  # the training split by its name: scored as asked

    def tag(*flags):
        return reference.reference_tag(eval_fid.parse_args(["--run", "RUN", *flags]), cfg)
    assert tag() == "" and tag("--reference", str(tmp_path / "flat"), "--reference_split", "heldout") == ""
    assert tag("--reference_split", "test") == "-ref-test"
    assert tag("--reference", str(tmp_path / "split" / "test")) == "-ref-test"  # a plain folder: its name
    assert tag("--reference", "ILSVRC/imagenet-1k", "--reference_split", "validation") == \
        "-ref-ILSVRC-imagenet-1k-validation"
    assert tag("--reference", "cleanfid:cifar10:32:train") == "-ref-cleanfid-cifar10-32-train"
    assert tag("--reference_num", "100", "--reference_resolution", "16") == "-ref-16px-first100"


@pytest.mark.slow
def test_a_test_score_on_training_images_is_refused_and_no_evaluation_overwrites_another(run, tmp_path, monkeypatch):
    """The embedded demo has no test split: --reference_split test scores the 64 held-out rows, says so in its report
    and writes where the held-out score goes (it is that score); the training split goes to its own folder and
    leaves that report alone; and an evaluation at other settings sent into a folder with a report is refused
    before any sampling, naming what differs, the report kept as it was."""
    base = ["--run", str(run), "--num_samples", "8", *GEN, "--stats_cache", str(tmp_path / "stats")]
    test = eval_fid.main([*base, "--reference_split", "test"], feature_fn=TinyFeatures())
    folder = Path(test["samples_dir"]).parent
    assert folder.name == "export-ema-euler2-g7-seed0" and test["reference"]["split"] == "heldout"
    assert test["reference"]["images"] == 64 and any("holds the images of its training split" in w
                                                     for w in test["warnings"])
    train = eval_fid.main([*base, "--reference_split", "train"], feature_fn=TinyFeatures())
    assert Path(train["samples_dir"]).parent.name == folder.name + "-ref-train"
    assert train["reference"]["split"] == "train" and train["reference"]["images"] == 320
    kept = (folder / "report.json").read_text()
    assert json.loads(kept)["reference"]["split"] == "heldout"
    monkeypatch.setattr(sampling, "sample_batch", lambda *a, **k: pytest.fail("sampled before the report check"))
    for other, differs in ((["--reference_split", "train"], "reference split 'heldout' -> 'train'"),
                           (["--num_samples", "12"], "num_samples 8 -> 12")):
        with pytest.raises(config.ConfigError, match=differs):
            eval_fid.main([*base, "--out_dir", str(folder), *other], feature_fn=TinyFeatures())
    assert (folder / "report.json").read_text() == kept


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_two_processes_make_the_same_images_and_scores_as_one(run, tmp_path):
    args = ["--run", str(run), "--num_samples", "10", "--steps", "2", "--batch_size", "3",
            "--features", "tests.test_eval_fid:TinyFeatures"]
    one_report = eval_fid.main([*args, "--out_dir", str(tmp_path / "one"), "--stats_cache", str(tmp_path / "s1")])
    # eval_fid's Accelerator(cpu=True) without CUDA joins the 2 processes in one gloo group (MULTI_CPU);
    # num_processes == 2 in the report proves they shared the work rather than each doing all of it.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(ROOT / "eval_fid.py"), *args, "--out_dir", str(tmp_path / "two"),
                           "--stats_cache", str(tmp_path / "s2")],  # reference features split over 2 ranks too
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    two_report = json.loads((tmp_path / "two" / "report.json").read_text())
    assert one_report["num_processes"] == 1 and two_report["num_processes"] == 2
    one, two = pngs(tmp_path / "one" / "samples"), pngs(tmp_path / "two" / "samples")
    assert len(one) == 10 and one.keys() == two.keys()
    # Not bitwise: the parent runs with its default thread count, the ranks with OMP_NUM_THREADS=1, and CPU
    # matrix kernels block (and so round) by thread count. Float differences of ~1e-6 can flip a rounding
    # to uint8; a different seed per rank or a wrong sample order would change most pixels by far more.
    for name in one:
        diff = np.abs(one[name].astype(int) - two[name].astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, name
    assert not np.array_equal(one["000000.png"], one["000001.png"])  # every sample has its own noise
    one_stats, two_stats = (np.load(next((tmp_path / d).glob("*.npz"))) for d in ("s1", "s2"))
    for name in one_stats.files:  # the same reference statistics, up to float32 batch-split rounding
        if one_stats[name].dtype.kind == "f":
            np.testing.assert_allclose(one_stats[name], two_stats[name], rtol=1e-6, atol=1e-7)
        else:
            assert one_stats[name].tolist() == two_stats[name].tolist(), name
    assert two_report["metrics"] == pytest.approx(one_report["metrics"], rel=1e-3)  # from those near-equal images


@pytest.mark.slow
def test_fid_during_training(run, tmp_path):
    """The value against the closed form on the same features, and the batch size changing the images only
    at float rounding (CPU matrix kernels block by batch size: bitwise equality is not a claim to make)."""
    from accelerate import Accelerator

    model, cfg = sampling.load_model(run)[:2]
    generate = train_flow_matching.generate
    metrics = sampling.fid_during_training(generate, model, cfg, Accelerator(), 12, None, feature_fn=TinyFeatures(),
                                           stats_cache=str(tmp_path / "stats"), steps=2, batch_size=6)
    manifold = {f"{m}_tiny_random_conv_12" for m in ("precision", "recall", "density", "coverage")}
    assert set(metrics) == {"fid_clean_12", "kid_clean_12"} | manifold
    assert not model.training
    # Closed form: ||mu - mu_r||^2 + Tr(S + S_r - 2 sqrtm(S S_r)) of the same 12 samples' features.
    cond = generation.make_condition(cfg, model, None, "cpu", generation.make_controls(cfg, "heldout"))
    images = {b: np.concatenate([sampling.sample_batch(generate, model, cfg, cond, idx, 0, 2)
                                 for idx in common.my_batches(12, b, 0, 1)]) for b in (6, 4)}
    feats = TinyFeatures()(list(images[6]))
    stats_file = next((tmp_path / "stats").glob("*.npz"))  # our cached statistics also serve as a reference
    with np.load(stats_file) as ref:
        mu, sigma = ref["mu"], ref["sigma"]
    s1 = np.cov(feats, rowvar=False)
    expected = np.sum((feats.mean(0) - mu) ** 2) + np.trace(s1 + sigma - 2 * scipy.linalg.sqrtm(s1 @ sigma).real)
    assert metrics["fid_clean_12"] == pytest.approx(expected, rel=1e-6)
    import prdc  # and the manifold metrics on the same features against the cached reference features

    with np.load(stats_file) as ref:
        oracle = prdc.compute_prdc(ref["feats"].astype(np.float64), feats, nearest_k=5)
    assert {k: metrics[f"{k}_tiny_random_conv_12"] for k in oracle} == pytest.approx(oracle, abs=1e-9)
    # Another batch size: the same images up to a rounding flip of a pixel, and the same FID to float accuracy.
    diff = np.abs(images[6].astype(int) - images[4].astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    again = sampling.fid_during_training(generate, model, cfg, Accelerator(), 12, str(stats_file),
                                         feature_fn=TinyFeatures(), steps=2, batch_size=4)
    assert again == pytest.approx(metrics, rel=1e-3)


@pytest.mark.slow
def test_dino_and_manifold_metrics_of_samples_against_themselves(run, tmp_path):
    """FD-DINOv2 through a tiny random Dinov2Model (saved with save_pretrained): the samples against their own
    folder give FD 0 and precision = recall = density = coverage = 1 on both feature sets; DINOv2's reference
    statistics are cached beside Inception's (features included), keyed on the model."""
    from test_metrics import make_tiny_dinov2

    dino = make_tiny_dinov2(tmp_path / "dino")
    out, stats = tmp_path / "eval", tmp_path / "stats"
    base = ["--run", str(run), "--num_samples", "12", *GEN, "--out_dir", str(out), "--stats_cache", str(stats)]
    eval_fid.main([*base, "--generate_only"])
    with pytest.raises(ValueError, match="precomputed Inception statistics"):  # refused before any sampling
        eval_fid.main([*base, "--dino", dino, "--reference", str(tmp_path / "some.npz")], feature_fn=TinyFeatures())
    report = eval_fid.main([*base, "--dino", dino, "--reference", str(out / "samples")], feature_fn=TinyFeatures())
    m = report["metrics"]
    assert abs(m["fid_clean_12"]) < 1e-6 and abs(m["fd_dinov2_12"]) < 1e-6
    for tag in ("tiny_random_conv", "dinov2"):
        assert [m[f"{k}_{tag}_12"] for k in ("precision", "recall", "density", "coverage")] == [1.0] * 4, tag
    assert report["dino"]["model"] == dino and report["dino"]["stats"] != report["reference"]["stats"]
    cached = {p.name: np.load(p)["feats"].shape for p in stats.glob("*.npz")}
    assert sorted(cached.values()) == [(12, 16), (12, 32)]  # tiny conv: 16-d, tiny DINOv2: 32-d
    with pytest.raises(ValueError, match="val.fid_dino needs reference images"):  # the trainers' start-up check
        config.load_config(train_flow_matching.DEFAULTS, ["--val.fid_dino=x", "--val.fid_reference=a.npz"],
                           "flow_matching", schema=train_flow_matching.CONFIG)


@pytest.mark.slow
def test_rate_generates_the_same_seeds_and_conditions_for_each_side(run, tmp_path):
    """tools/rate.py on a run and one of its checkpoints: each sampled through eval_fid.py --generate_only with
    the same seed, sample i conditioned on class i % num_classes, named; a second start reuses the PNGs."""
    sys.path.insert(0, str(ROOT / "tools"))
    import rate

    ckpt = next((run / "checkpoints").glob("step_*"))
    args = rate.parse_args([str(run), str(ckpt), "--num_samples", "4", "--steps", "2", "--batch_size", "4"])
    sides = rate.prepare(args.items, args)
    g = f"g{train_flow_matching.DEFAULTS.val.guidance_scale:g}"  # each run's own guidance scale
    assert [s["label"] for s in sides] == [f"run/export-ema-euler2-{g}", f"run/{ckpt.name}-ema-euler2-{g}"]
    assert all(s["run"] == run.resolve() and len(list((s["dir"] / "samples").glob("*.png"))) == 4 for s in sides)
    assert sides[0]["generation"]["seeds"] == sides[1]["generation"]["seeds"]
    names = rate.condition_names(sides[0])
    k = sides[0]["generation"]["conditioning"]["num_classes"]
    assert [names(i).split(":")[0] for i in (0, 1, k)] == ["class 0", "class 1", "class 0"]
    stamps = {p: p.stat().st_mtime_ns for s in sides for p in (s["dir"] / "samples").glob("*.png")}
    again = rate.prepare(args.items, args)
    assert [s["dir"] for s in again] == [s["dir"] for s in sides]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # reused, not regenerated
    study = rate.Study(sides, rate.sample_count(sides, 4))
    assert len(study.queue) == 4 and study.kind == "pair"


# ---- Offline Inception ---------------------------------------------------------------------------------------


def no_offline_variables(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def test_missing_inception_file_gives_clear_error(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="inception-2015-12-05.pt") as err:
        reference.inception_features(weights=str(tmp_path / "nope.pt"))
    assert reference.INCEPTION_URL in str(err.value) and "tools/prefetch.py" in str(err.value)

    def unreachable(*a, **k):
        raise OSError("network is unreachable")

    no_offline_variables(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(reference.urllib.request, "urlopen", unreachable)
    with pytest.raises(FileNotFoundError, match="--inception_weights") as err:
        reference.inception_features()
    assert reference.INCEPTION_URL in str(err.value) and "unreachable" in str(err.value)
    assert not list((tmp_path / "minimal-diffusion").iterdir())  # no half-written file left behind


def test_offline_a_missing_inception_file_is_one_line_and_no_download_is_tried(tmp_path, monkeypatch):
    """With the offline variables set, nothing is downloaded: one line naming where it looked, --inception_weights
    and tools/prefetch.py. The file prefetch.py writes ($HF_HOME/inception-2015-12-05.pt) is found there."""
    from huggingface_hub import constants

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(reference.urllib.request, "urlopen", lambda *a, **k: pytest.fail("a download was tried"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        no_offline_variables(monkeypatch)
        monkeypatch.setenv(name, "1")
        with pytest.raises(FileNotFoundError) as err:
            reference.inception_path()
        message = str(err.value)
        assert "\n" not in message and "no download tried" in message
        assert str(tmp_path / "xdg" / "minimal-diffusion" / "inception-2015-12-05.pt") in message
        assert str(tmp_path / "hf" / "inception-2015-12-05.pt") in message
        assert "--inception_weights" in message and "python tools/prefetch.py" in message
        assert "tools/classifier.py, then --classifier DIR --features classifier" in message  # the offline route
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "inception-2015-12-05.pt").write_bytes(b"as prefetch.py wrote it")
    monkeypatch.setattr(reference, "INCEPTION_SHA256", reference.sha256_of(tmp_path / "hf" / "inception-2015-12-05.pt"))
    assert reference.inception_path() == tmp_path / "hf" / "inception-2015-12-05.pt"


def test_what_a_fid_on_few_images_can_mean_is_said_and_a_failed_sqrtm_loses_nothing(monkeypatch):
    assert metrics.fid_size_warning(5000, 10000, 2048) is None and metrics.fid_size_warning(None, 10000, 2048) is None
    text = metrics.fid_size_warning(18, 1000, 2048)
    assert "more dimensions (2048) than images (the reference has 18 and the samples 1000)" in text
    assert "KID" in text and "--reference FOLDER" in text and "cannot be compared with other FIDs" in text
    assert "(the samples 16)" in metrics.fid_size_warning(None, 16, 16)
    # The classifier's distances are named as the report names them, never FID; too few samples ask for more samples.
    text = metrics.fid_size_warning(5000, 100, 128, "classifier")
    assert text.startswith("fd_classifier's covariances have more dimensions (128) than images (the samples 100)")
    assert "kd_classifier, reported beside it" in text and "FID" not in text and "KID" not in text
    assert text.endswith("score more than 128 samples (--num_samples).") and "--reference" not in text
    with pytest.raises(ValueError, match="the FID reference has 1 image"):
        metrics.fid_size_warning(1, 1000, 2048)
    # clean-fid's sqrtm failing ('Imaginary component') on singular covariances: the eigenvalue trace instead,
    # equal to clean-fid's where clean-fid works.
    import cleanfid.fid

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((12, 8)) @ rng.standard_normal((8, 8)), rng.standard_normal((40, 8)) + 0.3
    ref = {"mu": a.mean(0), "sigma": np.cov(a, rowvar=False), "feats": a}
    want = metrics.fid_kid(b, ref, "clean", 40)
    monkeypatch.setattr(cleanfid.fid, "frechet_distance",
                        lambda *x: (_ for _ in ()).throw(ValueError("Imaginary component 0.2")))
    got = metrics.fid_kid(b, ref, "clean", 40)
    assert got["fid_clean_40"] == pytest.approx(want["fid_clean_40"], rel=1e-8)
    assert got["kid_clean_40"] == want["kid_clean_40"]


def test_inception_file_is_verified_and_downloaded_into_a_per_user_cache(tmp_path, monkeypatch):
    """A wrong file under the right name (in the cache or given by --inception_weights) is an error naming it;
    a download lands in $XDG_CACHE_HOME/minimal-diffusion, never /tmp, and only once its sha256 is right."""
    import hashlib
    import io

    served = [b"not the inception network"]
    no_offline_variables(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(reference.urllib.request, "urlopen", lambda *a, **k: io.BytesIO(served[0]))
    with pytest.raises(ValueError, match="wrong sha256"):  # a corrupted or substituted download
        reference.inception_path()
    assert not list((tmp_path / "xdg" / "minimal-diffusion").iterdir())
    monkeypatch.setattr(reference, "INCEPTION_SHA256", hashlib.sha256(served[0]).hexdigest())
    path = reference.inception_path()  # the right bytes this time
    assert path == tmp_path / "xdg" / "minimal-diffusion" / "inception-2015-12-05.pt" and path.read_bytes() == served[0]
    path.write_bytes(b"tampered with later")
    with pytest.raises(ValueError, match=f"{path}: sha256 .* not that of inception-2015-12-05.pt"):
        reference.inception_path()
    with pytest.raises(ValueError, match="mine.pt: sha256"):
        (tmp_path / "mine.pt").write_bytes(b"some other network")
        reference.inception_features(weights=str(tmp_path / "mine.pt"))


def test_local_inception_file_under_any_name_is_loaded_without_download(tmp_path, monkeypatch):
    """clean-fid's InceptionV3W interface (base(x, return_features) and base.layers) on a tiny scripted net,
    saved under another name: loaded from the given path, resized by clean-fid, never downloaded."""

    class FakeInception(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                              torch.nn.Linear(3, 2048))

        def forward(self, x, return_features: bool = False):
            return self.layers(x / 255)

    torch.jit.script(FakeInception()).save(str(tmp_path / "my_inception.pt"))
    monkeypatch.setattr(reference, "INCEPTION_SHA256", reference.sha256_of(tmp_path / "my_inception.pt"))
    monkeypatch.setattr(reference.urllib.request, "urlopen", None)  # any download attempt would fail loudly
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    for mode in ("clean", "legacy_tensorflow"):
        feature_fn = reference.inception_features(mode, weights=str(tmp_path / "my_inception.pt"))
        feats = feature_fn(images)
        assert feats.shape == (3, 2048) and np.isfinite(feats).all()
        assert feature_fn.name == f"inception-2015-12-05/{mode}" and feature_fn.path.endswith("my_inception.pt")


class FakeInceptionLayers(torch.nn.Module):
    """clean-fid's InceptionV3W interface on a tiny fixed net: base(x, return_features) and base.layers,
    2048 features (as InceptionV3W reshapes them) of rank <= 48."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 2048))

    def forward(self, x, return_features: bool = False):
        return self.layers(x / 255)


@pytest.mark.parametrize("script", ["eval_fid", "sample"])
def test_a_mistyped_run_folder_is_named_before_any_work_and_the_hub_is_not_asked(tmp_path, monkeypatch, capsys, script):
    """runs/flow_matcing_demo beside runs/ is a local path that does not exist, not a Hub id: said in one line, with
    the folder meant, before the sampling settings are read; a name that can only be local alike."""
    import sample
    from training.run import hub

    (tmp_path / "runs" / "flow_matching_demo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("asked the Hub"))
    main = {"eval_fid": eval_fid, "sample": sample}[script].main
    with pytest.raises(FileNotFoundError, match=r"^runs/flow_matcing_demo: no such folder \(read as a local path, not "
                                                r"a Hub model id: runs/ is a folder here\); did you mean "
                                                r"runs/flow_matching_demo\?$"):
        main(["--run", "runs/flow_matcing_demo"])
    with pytest.raises(FileNotFoundError, match=r"^run: no such folder; did you mean runs\?$"):
        main(["--run", "run"])
    with pytest.raises(FileNotFoundError, match=r"^\./elsewhere/run: no such folder; \. holds no folder 'elsewhere'$"):
        main(["--run", "./elsewhere/run"])
    assert capsys.readouterr().out == ""  # no "sampling settings ... from the run's config"


@pytest.mark.slow
def test_few_reference_images_are_flagged_before_sampling_and_a_missing_network_leaves_no_folder(run, tmp_path,
                                                                                                 monkeypatch, capsys):
    with pytest.raises(FileNotFoundError, match="--inception_weights"):
        eval_fid.main(["--run", str(run), "--num_samples", "8", *GEN, "--out_dir", str(tmp_path / "none"),
                       "--inception_weights", str(tmp_path / "nope.pt")])
    assert not (tmp_path / "none").exists()  # stopped before any folder was made
    monkeypatch.setattr(sampling, "sample_batch", lambda *a, **k: pytest.fail("sampled before the reference check"))
    with pytest.raises(pytest.fail.Exception, match="sampled before"):
        eval_fid.main(["--run", str(run), "--num_samples", "8", *GEN, "--out_dir", str(tmp_path / "e"),
                       "--stats_cache", str(tmp_path / "stats")], feature_fn=TinyFeatures(dim=64))
    out = capsys.readouterr().out
    heldout = len(reference.heldout(config.Config(json.loads((run / "config.json").read_text())["data"])))
    assert f"warning: FID's covariances have more dimensions (64) than images (the reference has {heldout} and " \
           f"the samples 8)" in out


@pytest.mark.slow
def test_fid_end_to_end_equals_clean_fids_own_compute_fid(run, tmp_path, monkeypatch):
    """The same two image folders, scored by eval_fid.py (its PNGs, resizer, features, statistics) and by
    clean-fid's compute_fid with the same feature network: the same 2048-dimensional means and covariances
    handed to clean-fid's frechet_distance (1e-6 relative), and the same FID to 1e-6 relative. Both sides'
    frechet_distance is clean-fid's own, run on the first 16 coordinates of those statistics: two 2048 x 2048
    matrix square roots cost ~50 CPU-s and would prove nothing more than the statistics' equality does."""
    from cleanfid import fid
    from cleanfid.inception_torchscript import InceptionV3W

    seen, own_frechet = [], fid.frechet_distance

    def frechet_on_16(mu1, sigma1, mu2, sigma2):
        seen.append((mu1, sigma1, mu2, sigma2))
        return own_frechet(mu1[:16], sigma1[:16, :16], mu2[:16], sigma2[:16, :16])

    monkeypatch.setattr(fid, "frechet_distance", frechet_on_16)  # eval_fid's metrics.frechet and compare_folders'

    monkeypatch.setattr(reference.urllib.request, "urlopen", None)  # any download attempt would fail loudly
    weights = tmp_path / "inception" / reference.INCEPTION_FILE
    weights.parent.mkdir()
    torch.jit.script(FakeInceptionLayers()).save(str(weights))
    monkeypatch.setattr(reference, "INCEPTION_SHA256", reference.sha256_of(weights))  # the stand-in's own digest
    reference_dir = tmp_path / "reference"
    eval_fid.main(["--run", str(run), "--num_samples", "24", *GEN, "--seed", "1", "--out_dir", str(reference_dir),
                   "--generate_only"])
    report = eval_fid.main(["--run", str(run), "--num_samples", "24", *GEN, "--out_dir", str(tmp_path / "ours"),
                            "--reference", str(reference_dir / "samples"), "--inception_weights", str(weights),
                            "--stats_cache", str(tmp_path / "stats")])
    network = InceptionV3W(str(weights.parent), download=False, resize_inside=False)
    theirs = fid.compute_fid(str(tmp_path / "ours" / "samples"), str(reference_dir / "samples"), mode="clean",
                             custom_feat_extractor=network, device=torch.device("cpu"), num_workers=0,
                             batch_size=8, verbose=False)
    assert len(seen) == 2 and seen[0][1].shape == (2048, 2048)  # ours, then clean-fid's
    for ours, cleanfids in zip(seen[0], seen[1]):
        np.testing.assert_allclose(ours, cleanfids, rtol=1e-5, atol=1e-6 * np.abs(cleanfids).max())  # float32 features
    assert report["metrics"]["fid_clean_24"] == pytest.approx(theirs, rel=1e-6)
    assert theirs > 1e-3  # two different sample sets: a real distance, not 0 = 0


# ---- Text-to-image: CLIP score through a tiny local CLIP ----------------------------------------------------


def make_tiny_clip(folder):
    """A CLIP small enough to train with, saved like a hub model: model, tokenizer, image processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    from training.data.sources import DEMO_CLASSES

    words = sorted({w for c in DEMO_CLASSES for w in c.split()} | {"a", "small", "large"})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                            model_max_length=16).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(text_config=dict(vocab_size=len(vocab), max_position_embeddings=16, eos_token_id=2,
                                         pad_token_id=0, **small),
                        vision_config=dict(image_size=32, patch_size=8, **small), projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)


@pytest.mark.slow
def test_clip_score_for_a_text_model(tmp_path):
    clip = tmp_path / "clip"
    make_tiny_clip(clip)
    run = train_flow_matching.main([*tiny_run_args(tmp_path, steps=2), "--encoders.text_encoder", str(clip),
                                    "--encoders.max_tokens=16", "--data.caption_column=caption",
                                    "--data.label_column=null", "--model.num_layers=1"])
    (tmp_path / "captions.txt").write_text("a red circle\na large blue square\n")
    report = eval_fid.main(["--run", str(run), "--num_samples", "6", *GEN, "--prompts", str(tmp_path / "captions.txt"),
                            "--clip_model", str(clip), "--out_dir", str(tmp_path / "e"),
                            "--stats_cache", str(tmp_path / "stats")], feature_fn=TinyFeatures())
    score = report["metrics"]["clip_score_6"]
    assert 0 <= score <= 100 and report["conditioning"]["num_prompts"] == 2
    # The documented scale, checked by hand for one image: 100 * max(cos, 0) of CLIP's normalised embeddings.
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(clip).eval()
    img = np.asarray(Image.open(tmp_path / "e" / "samples" / "000000.png"))
    with torch.no_grad():
        e_img = model.get_image_features(**AutoImageProcessor.from_pretrained(clip)(images=[img], return_tensors="pt"))
        e_txt = model.get_text_features(**AutoTokenizer.from_pretrained(clip)(["a red circle"], return_tensors="pt"))
    e_img, e_txt = [getattr(e, "pooler_output", e) for e in (e_img, e_txt)]
    cos = torch.nn.functional.cosine_similarity(e_img, e_txt).item()
    got = metrics.clip_scores(str(clip), img[None], ["a red circle"], "cpu")[0]
    assert got == pytest.approx(100 * max(cos, 0), abs=1e-4)
