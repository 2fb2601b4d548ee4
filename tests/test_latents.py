"""Latent space with an autoencoder made here (issue 59): tools/autoencoder.py trains on the training rows alone
(a test split that is the training split refused) and writes factors that read back as 1 / std and the mean of the
training latents; the trainers' encode -> decode of a real batch is the autoencoder's own reconstruction, the
cache keeps the posterior's mean and std, decoding ignores the caller's autocast, and the cache key sees the VAE's
factors and weights; the start-up check stops a run on planted wrong factors (10x scale, a dropped shift) with the
line that names the right ones; a latent run trains, resumes exactly and exports a folder that samples with
diffusers alone where the autoencoder's own folder is gone."""
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

import sample
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args
from test_fashion_mnist import installed, write_idx
from test_robustness import assert_same_checkpoint
from tools import autoencoder as autoencoder_tool
from training.evaluation.reference import split_images
from training.config import config
from training.data import cache, cache_shards, fashion_mnist, latents
from training.data.encoders import decode, make_encode
from training.evaluation import classifier, generation
from training.sharing import model_card

LATENT_RECIPE = str(ROOT / "configs" / "fashion_mnist_latent.json")
TINY_AE = ["--channels", "8,8", "--steps", "2", "--batch_size", "16"]  # 28 px -> 4 x 14 x 14, as the recipe's


def idx_source(tmp_path, monkeypatch, train_rows=40, test_rows=20):
    """Fashion-MNIST's loader on small IDX files whose splits tell apart: training image i is grey level i with a
    bright square at a place of its own, test images are brighter (200 + i)."""
    for split, (images, labels) in fashion_mnist.FILES.items():
        n = train_rows if split == "train" else test_rows
        pixels = np.repeat(np.repeat((np.arange(n) + (0 if split == "train" else 200))[:, None, None], 28, 1), 28, 2)
        for i in range(n):
            pixels[i, i % 20: i % 20 + 8, (3 * i) % 20: (3 * i) % 20 + 8] = 255
        write_idx(tmp_path / images, pixels)
        write_idx(tmp_path / labels, np.arange(n) % 10)
    load = fashion_mnist.load
    monkeypatch.setattr(fashion_mnist, "load", lambda split: load(split, tmp_path))


def judge(folder):
    """An evaluation classifier with random weights and its record, as tools/classifier.py leaves one."""
    torch.manual_seed(0)
    classifier.build(10, fashion_mnist.CLASSES).save_pretrained(folder)
    (folder / classifier.RECORD).write_text(json.dumps({"test_accuracy": 0.5, "test_split": "test"}))
    return str(folder)


# ---- tools/autoencoder.py ------------------------------------------------------------------------------------


def test_the_autoencoder_is_never_measured_on_its_training_split(tmp_path, monkeypatch):
    idx_source(tmp_path, monkeypatch)
    with pytest.raises(config.ConfigError, match="--test_split 'train' is the training split \\(data.split\\)"):
        autoencoder_tool.main(["--config", LATENT_RECIPE, "--out", str(tmp_path / "ae"), "--test_split", "train",
                               *TINY_AE])
    assert not (tmp_path / "ae").exists()


def test_the_autoencoder_trains_on_the_training_rows_and_its_factors_read_back(tmp_path, monkeypatch, capsys):
    """What latents.train receives is exactly the training rows, what is reconstructed and scored exactly the test
    rows; the saved config's factors, read back by from_pretrained, are 1 / std and the mean of the training
    latents' draws (computed here from diffusers' posterior in one batch), and through the trainers' encode those
    latents have mean 0 and std 1. The real images' row (the floor) scores 20 training images, not the test images
    against themselves; 20 test images in the classifier's 128 dimensions are no floor, said before the training, in
    autoencoder.json and on the model card."""
    idx_source(tmp_path, monkeypatch)
    seen, train, reconstruct, scores = {}, latents.train, autoencoder_tool.reconstruct, autoencoder_tool.scores
    monkeypatch.setattr(latents, "train",
                        lambda vae, images, *a: (print("training"), seen.setdefault("trained", images))
                        and train(vae, images, *a))
    monkeypatch.setattr(autoencoder_tool, "reconstruct", lambda vae, images: seen.setdefault("measured", images) is None
                        or reconstruct(vae, images))
    monkeypatch.setattr(autoencoder_tool, "scores", lambda images, *a: seen.setdefault("scored", []).append(images)
                        or scores(images, *a))
    out = autoencoder_tool.main(["--config", LATENT_RECIPE, "--out", str(tmp_path / "ae"), *TINY_AE,
                                 "--classifier", judge(tmp_path / "judge"), "--stats_cache", str(tmp_path / "stats")])
    levels = lambda images: sorted(images[:, 27, 27, 0].tolist())  # noqa: E731  (a corner no square reaches)
    assert levels(seen["trained"]) == list(range(40)) and levels(seen["measured"]) == list(range(200, 220))
    vae = AutoencoderKL.from_pretrained(out).eval()
    with torch.no_grad():
        posterior = vae.encode(latents.to_pixels(seen["trained"])).latent_dist
        mean = posterior.mean.double().mean().item()
        std = (posterior.mean.double().var(correction=0) + posterior.var.double().mean()).sqrt().item()
        assert vae.config.shift_factor == pytest.approx(mean, rel=1e-6)
        assert vae.config.scaling_factor == pytest.approx(1 / std, rel=1e-6)
        cached = make_encode(vae, None, None, 0)(latents.to_pixels(seen["trained"]), None)
    assert latents.moments(cached["x"], cached["x_std"]) == pytest.approx((0, 1), abs=1e-5)
    record = json.loads((out / latents.RECORD).read_text())
    assert (record["train_rows"], record["test_split"], record["test"]["rows"]) == (40, "test", 20)
    assert record["factors"]["scaling_factor"] == vae.config.scaling_factor and record["latent_shape"] == [4, 14, 14]
    assert {"psnr", "fd_classifier_20", "precision_classifier_20", "class_accuracy_20"} <= set(record["test"])
    real = seen["scored"][-1]  # the floor's images: 20 distinct training images, none of the test's
    assert len(set(levels(real))) == 20 and set(levels(real)) <= set(range(40))
    assert (record["real"]["rows"], record["real"]["split"]) == (20, "train") and record["real"]["fd_classifier_20"] > 1
    warning = autoencoder_tool.floor_warning(20, 128, "test")
    assert record["warnings"] == [warning] and "20 'test' images in the classifier's 128 feature dimensions" in warning
    printed = capsys.readouterr().out
    assert printed.index(f"warning: {warning}") < printed.index("training")
    card = " ".join(model_card.autoencoder_lines(out / latents.RECORD))
    assert f"20 real 'train' images against the same test images: {record['real']['fd_classifier_20']:.3f}" in card
    assert warning in card and "no model in its latents scores better" not in card
    assert autoencoder_tool.floor_warning(128, 128, "test") and autoencoder_tool.floor_warning(129, 128, "test") is None


@installed
def test_encode_then_decode_of_a_real_batch_is_the_autoencoders_own_reconstruction():
    """A real batch (Fashion-MNIST test images) through the trainers' encode (the cache's x and x_std) and decode
    equals diffusers' own reconstruction of it from the posterior mean (AutoencoderKL.forward without sampling),
    with calibrated factors (a shift and a scale that are not 0 and 1); the cache's x_std is the posterior's std
    in model space."""
    images = np.repeat(fashion_mnist.split_arrays("test")[0][:32, :, :, None], 3, axis=3)
    vae = latents.build(28, [8, 16, 16]).eval()
    with torch.no_grad():
        vae.quant_conv.weight[:4] *= 10  # the posterior mean's channels spread and offset: a scale and a shift
        vae.quant_conv.bias[:4] += 1.0  # that matter
        latents.calibrate(vae, images)
        scale, shift = vae.config.scaling_factor, vae.config.shift_factor
        assert abs(shift) > 0.5 and abs(scale - 1) > 0.1
        x = latents.to_pixels(images)
        own, posterior = vae(x, sample_posterior=False).sample, vae.encode(x).latent_dist
        cached = make_encode(vae, None, None, 0)(x, None)
        torch.testing.assert_close(cached["x_std"], posterior.std * scale)
        torch.testing.assert_close(decode(vae, cached["x"]), own, atol=1e-5, rtol=1e-5)


def test_decoding_is_in_the_vaes_dtype_whatever_the_callers_autocast(tiny_vae):
    """sample.py and eval_fid.py sample under the run's mixed precision: the decode inside it is the validation
    grid's and the exported pipeline's, in the VAE's fp32, not a bf16 one."""
    vae = AutoencoderKL.from_pretrained(tiny_vae).eval()
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = decode(vae, x)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, decode(vae, x))


def test_the_cache_key_sees_the_vaes_factors_and_weights(tmp_path, tiny_vae):
    """The cache holds (z - shift) * scale: a VAE folder whose factors are corrected, or whose weights are retrained
    in place, is a miss, never the old latents under the same name."""
    folder = tmp_path / "vae"
    shutil.copytree(tiny_vae, folder)
    cfg = config.load_config(fm.DEFAULTS, [f"--encoders.vae={folder}"], schema=fm.CONFIG)

    def key():
        return cache.cache_key(cfg, "train", None, 320)

    first = key()
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "shift_factor": None}))
    dropped = key()
    (folder / "config.json").write_text(json.dumps(settings))
    assert key() == first and dropped != first
    weights = folder / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: a retrained autoencoder at the same path
    assert key() != first


def test_a_missing_autoencoder_folder_names_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./autoencoders here
    with pytest.raises(config.ConfigError) as e:
        config.load_config(fm.DEFAULTS, ["--config", LATENT_RECIPE], schema=fm.CONFIG)
    assert str(e.value).splitlines()[1].strip() == (
        f"encoders.vae='./autoencoders/fashion_mnist' is not a folder: build it with `python tools/autoencoder.py "
        f"--config {LATENT_RECIPE} --out ./autoencoders/fashion_mnist`")


# ---- The start-up check ---------------------------------------------------------------------------------------


def offset_autoencoder(folder, args):
    """A tiny AutoencoderKL for the demo's 16 px images whose latents have a large mean (an offset on the
    posterior mean), calibrated on the run's training images: the right factors, and a shift that matters."""
    from training.data.sources import open_splits

    cfg = config.load_config(fm.DEFAULTS, args)
    images = split_images(cfg.data, open_splits(cfg.data, lambda line: None)[0], "train")[0]
    vae = latents.build(16, [8, 8]).eval()
    with torch.no_grad():
        vae.quant_conv.bias[:4] += 3.0
        mean, std = latents.calibrate(vae, images)
    vae.save_pretrained(folder)
    return mean, std


@pytest.mark.slow
def test_planted_wrong_factors_stop_the_run_with_the_factors_that_fix_them(tmp_path, capsys):
    """10x the scale and a dropped shift each stop the run once the cache is built, with one line naming
    scaling_factor and shift_factor and the values that make the latents mean 0 and std 1: the calibrated ones.
    encoders.latent_check=warn goes on after the same line as a warning; the right factors pass (the latent run
    below prints their mean and std)."""
    folder = tmp_path / "vae"
    args = tiny_run_args(tmp_path, "planted") + [f"--encoders.vae={folder}", "--data.resolution=16"]
    mean, std = offset_autoencoder(folder, args)
    right = json.loads((folder / "config.json").read_text())
    for plant in ({"scaling_factor": 10 / std}, {"shift_factor": None}):
        (folder / "config.json").write_text(json.dumps({**right, **plant}))
        with pytest.raises(SystemExit) as stop:
            fm.main(args)
        line = str(stop.value)
        assert "\n" not in line and line.startswith(f"encoders.vae='{folder}': the cached latents have mean ")
        fix = re.search(r"set scaling_factor=(\S+) and shift_factor=(\S+) in (\S+) ", line)
        assert fix[3] == f"{folder}/config.json"
        assert (float(fix[1]), float(fix[2])) == pytest.approx((1 / std, mean), rel=0.02)
        assert line.endswith("or encoders.latent_check='warn' to train on them as they are")
        assert not (tmp_path / "planted" / "checkpoints").exists()  # stopped before any training
    newest = max((tmp_path / "cache").glob("embedded-train-*"), key=lambda p: p.stat().st_mtime)
    dataset = cache_shards.CachedDataset(newest)
    vae = AutoencoderKL.from_pretrained(folder)
    warned = latents.check_scale(dataset, vae, config.Config(vae=str(folder), latent_check="warn"))
    assert abs(warned[0]) > 1 and "warning: encoders.vae=" in capsys.readouterr().out


# ---- A latent run end to end -----------------------------------------------------------------------------------

LOAD_AND_SAMPLE = """
import sys, numpy as np, torch
try:
    import training
    sys.exit("this repository is importable here")
except ImportError:
    pass
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)
seeds = [int(s) for s in sys.argv[3].split(",")]
images = pipe(["T-shirt/top", "Trouser"], generator=[torch.Generator().manual_seed(s) for s in seeds]).images
np.save(sys.argv[2], np.stack([np.asarray(i) for i in images]))
"""


@pytest.mark.slow
def test_a_latent_run_trains_resumes_exactly_and_exports_with_its_autoencoder(tmp_path, monkeypatch, capsys):
    """The recipe in an autoencoder made by tools/autoencoder.py (tiny, 2 steps) on small IDX files: the start-up
    check passes and prints the latents' mean and std; 4 steps straight equal 2 steps and a resume to 4, bitwise;
    the export carries the autoencoder (vae/, a component of model_index.json) and its card names it with its rFD;
    with the autoencoder's folder gone, the folder loads and samples with diffusers alone in a process that cannot
    import this repository, and sample.py on it gives the same images."""
    idx_source(tmp_path, monkeypatch, train_rows=96)
    ae = autoencoder_tool.main(["--config", LATENT_RECIPE, "--out", str(tmp_path / "ae"), *TINY_AE,
                                "--classifier", judge(tmp_path / "judge"), "--stats_cache", str(tmp_path / "stats")])
    run_args = ["--config", LATENT_RECIPE, f"--encoders.vae={ae}", "--data.cache_dir", str(tmp_path / "cache"),
                "--data.val_holdout=32", "--train.batch_size=16", "--train.warmup_steps=1", "--val.steps=2",
                "--val.num_samples=4", "--val.loss_samples=16", "--val.every=1000", "--ckpt.every=2", "--log.every=1",
                "--log.wandb=off", "--log.report=false", "--model.num_layers=1", "--model.num_attention_heads=2",
                "--model.attention_head_dim=16"]
    straight = fm.main(run_args + ["--run_dir", str(tmp_path / "straight"), "--train.max_steps=4"])
    line = f"latents \\(encoders.vae='{ae}'\\): mean (\\S+), std (\\S+) over 64 cached"
    checked = re.search(line, capsys.readouterr().out)
    assert abs(float(checked[1])) < 0.2 and abs(float(checked[2]) - 1) < 0.2  # calibrated on these images and 32 more
    fm.main(run_args + ["--run_dir", str(tmp_path / "resumed"), "--train.max_steps=2"])
    fm.main(run_args + ["--run_dir", str(tmp_path / "resumed"), "--train.max_steps=4", "--resume=latest"])
    assert_same_checkpoint(straight, tmp_path / "resumed", 4)

    export = straight / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"] and index["vae_id"] is None
    card = (export / "README.md").read_text()
    record = json.loads((ae / latents.RECORD).read_text())
    assert f"in the latents of `ae` (this folder's `vae/`)" in card
    assert f"rFD {record['test']['fd_classifier_20']:.3f} at 20 images" in card
    shutil.move(ae, tmp_path / "elsewhere")  # the folder it was trained with is gone
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    seeds = ",".join(str(generation.seed_for(0, 0, i)) for i in range(2))  # sample.py's noise for images 0 and 1
    done = subprocess.run([sys.executable, "-I", "-c", LOAD_AND_SAMPLE, str(export), str(tmp_path / "theirs.npy"),
                           seeds], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = np.load(tmp_path / "theirs.npy")
    out = sample.main(["--run", str(export), "--classes", "0,1", "--per_class", "1", "--seed", "0",
                       "--out", str(tmp_path / "sampled")])
    ours = np.stack([np.asarray(Image.open(p)) for p in sorted(out.glob("0*.png"))])
    assert theirs.shape == ours.shape == (2, 28, 28, 3)
    diff = np.abs(theirs.astype(int) - ours.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, "the folder's images differ from sample.py's"



COMMANDS = ["tools.autoencoder", "tools.classifier", "tools.compare", "tools.curves", "tools.export", "tools.phema",
            "tools.rate", "tools.repa_encoder", "tools.sweep", "tools.tune", "eval_fid", "sample"]  # argparse's (not
# tools/prefetch.py: its --help is the config's)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_opens_with_whole_paragraphs_of_its_docstring(command, monkeypatch):
    """`--help`'s description is the command's docstring from its start, cut at a paragraph's end, never inside a
    sentence (tools/autoencoder.py's ended at "...a diffusers AutoencoderKL trained on")."""
    import argparse
    import importlib
    import inspect

    def described(parser, *args, **kwargs):
        raise SystemExit(parser.description)

    module = importlib.import_module(command)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", described)  # parse_args calls it too
    with pytest.raises(SystemExit) as done:
        (getattr(module, "parse_args", None) or module.main)(["--help"])
    description = " ".join(done.value.code.split())
    paragraphs = [" ".join(p.split()) for p in inspect.getdoc(module).split("\n\n")]
    assert any(description == " ".join(paragraphs[:k]) for k in range(1, len(paragraphs) + 1)), description
