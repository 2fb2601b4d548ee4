"""Fashion-MNIST, the real-image ground truth: the IDX reader against upstream's checksums and first labels, the
data source through the trainers' own opening path, the evaluation classifier, and eval_fid.py's class accuracy
and classifier features. The reader's tests need Debian's package (`apt-get install dataset-fashion-mnist`, which
.ci/run installs) and say so when they skip; the rest build their own small IDX files and images."""
import gzip
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import eval_fid  # noqa: E402
import train_flow_matching  # noqa: E402
from training.config import config  # noqa: E402
from training.data import fashion_mnist  # noqa: E402
from training.data.sources import open_dataset  # noqa: E402
from training.evaluation import classifier  # noqa: E402

installed = pytest.mark.skipif(not (fashion_mnist.FOLDER / fashion_mnist.FILES["train"][0]).is_file(),
                               reason=f"Fashion-MNIST is not installed: {fashion_mnist.INSTALL} (as root)")


def write_idx(path, array):
    """An IDX file as upstream writes them: big-endian header (0, 0, 0x08 = unsigned byte, dimensions), values."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


# ---- The reader --------------------------------------------------------------------------------------------


@installed
def test_package_files_are_upstreams():
    """md5 of the decompressed training images as published by zalandoresearch/fashion-mnist, and the first labels."""
    raw = gzip.decompress((fashion_mnist.FOLDER / "train-images-idx3-ubyte.gz").read_bytes())
    assert hashlib.md5(raw).hexdigest() == "f4a8712d7a061bf5bd6d2ca38dc4d50a"
    images, labels = fashion_mnist.split_arrays("train")
    assert images.shape == (60000, 28, 28) and labels.shape == (60000,)
    assert labels[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert np.array_equal(images[0], np.frombuffer(raw, np.uint8, 784, offset=16).reshape(28, 28))
    test_images, test_labels = fashion_mnist.split_arrays("test")
    assert test_images.shape == (10000, 28, 28) and np.bincount(test_labels).tolist() == [1000] * 10
    assert np.bincount(labels).tolist() == [6000] * 10


@pytest.mark.slow  # 2-3 s: the fast tier stays under 60 s
@installed
def test_source_opens_through_the_trainers_path_with_class_names():
    data = config.Config(train_flow_matching.DEFAULTS["data"])
    data.update(source="fashion_mnist", resolution=28, val_holdout=100)
    test = open_dataset(data, "test")
    images, labels = fashion_mnist.split_arrays("test")
    assert len(test) == 10000 and test.features["label"].names[9] == "Ankle boot"
    row = test.cast_column("image", __import__("datasets").Image())[3]
    assert row["label"] == labels[3] and np.array_equal(np.asarray(row["image"]), images[3])
    with pytest.raises(ValueError, match="has the splits \\['test', 'train'\\], not 'validation'"):
        open_dataset(data, "validation")
    assert test._fingerprint == open_dataset(data, "test")._fingerprint  # the cache key sees the data, stably


def test_idx_reader_reads_header_and_values(tmp_path):
    images = np.arange(2 * 3 * 4).reshape(2, 3, 4) % 256
    write_idx(tmp_path / "i.gz", images)
    write_idx(tmp_path / "l.gz", np.array([7, 1]))
    assert np.array_equal(fashion_mnist.read_idx(tmp_path / "i.gz"), images)  # rows, then columns
    assert fashion_mnist.read_idx(tmp_path / "l.gz").tolist() == [7, 1]
    (tmp_path / "bad.gz").write_bytes(gzip.compress(bytes([0, 0, 0x0D, 1, 0, 0, 0, 1]) + b"\0" * 4))  # floats
    with pytest.raises(ValueError, match="not an IDX file of unsigned bytes"):
        fashion_mnist.read_idx(tmp_path / "bad.gz")
    (tmp_path / "short.gz").write_bytes(gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2])))
    with pytest.raises(ValueError, match=r"header says \(5,\) \(5 values\), the file holds 2"):
        fashion_mnist.read_idx(tmp_path / "short.gz")


def test_missing_package_names_the_apt_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist.split_arrays("train", folder=tmp_path)


def test_the_splits_come_from_their_own_files(tmp_path):
    for split, (images, labels) in fashion_mnist.FILES.items():
        write_idx(tmp_path / images, np.full((3, 28, 28), 10 if split == "train" else 200))
        write_idx(tmp_path / labels, np.array([0, 1, 2]) + (3 if split == "test" else 0))
    train, test = fashion_mnist.load("train", tmp_path), fashion_mnist.load("test", tmp_path)
    assert train["label"] == [0, 1, 2] and test["label"] == [3, 4, 5]
    assert np.asarray(train[0]["image"]).max() == 10 and np.asarray(test[0]["image"]).min() == 200
    assert train._fingerprint != test._fingerprint


def test_files_that_are_not_fashion_mnists_are_refused_naming_the_file(tmp_path):
    """Image and label files swapped, images of another size, labels outside 0-9: one line each, naming the file
    (each would otherwise be read: the IDX header is valid)."""
    images, labels = (tmp_path / name for name in fashion_mnist.FILES["train"])

    def refused(image_array, label_array):
        write_idx(images, image_array), write_idx(labels, label_array)
        with pytest.raises(ValueError) as e:
            fashion_mnist.split_arrays("train", tmp_path)
        assert "\n" not in str(e.value)
        return str(e.value)

    good_images, good_labels = np.zeros((3, 28, 28)), np.array([0, 9, 4])
    write_idx(images, good_images), write_idx(labels, good_labels)
    assert fashion_mnist.split_arrays("train", tmp_path)[1].tolist() == [0, 9, 4]  # good files are read
    assert refused(good_labels, good_images).startswith(f"{images}: Fashion-MNIST's images are 28 x 28 (IDX "
                                                        "dimensions N, 28, 28); this file holds shape (3,) (the "
                                                        "label file's shape: are the image and label files swapped?)")
    assert refused(good_images, good_images).startswith(f"{labels}: Fashion-MNIST's labels are one number per image")
    assert "swapped" in refused(good_images, good_images)
    assert refused(np.zeros((3, 32, 32)), good_labels) == (f"{images}: Fashion-MNIST's images are 28 x 28 (IDX "
                                                           "dimensions N, 28, 28); this file holds shape (3, 32, 32)")
    assert refused(good_images, np.array([0, 10, 255])) == (f"{labels}: Fashion-MNIST's labels run 0-9 (10 classes); "
                                                            "2 of its 3 labels do not, first row 1 (label 10)")


# ---- The evaluation classifier ------------------------------------------------------------------------------


def stripes(n, seed):
    """A two-class toy: vertical (0) or horizontal (1) stripes with noise, uint8 (n, 14, 14, 3) (small: a fast test)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    base = (np.arange(14) % 4 < 2) * 200.0
    images = np.where(labels[:, None, None] == 0, base[None, None, :], base[None, :, None])
    images = np.clip(images + rng.normal(0, 30, (n, 14, 14)), 0, 255).astype(np.uint8)
    return np.repeat(images[..., None], 3, axis=3), labels


@pytest.mark.slow
def test_classifier_learns_saves_and_loads_with_its_record(tmp_path):
    torch.manual_seed(0)
    images, labels = stripes(384, 0)
    test_images, test_labels = stripes(200, 1)
    model = classifier.train(classifier.build(2, ["vertical", "horizontal"]), images, labels, epochs=2,
                             batch_size=64, log=lambda line: None)
    assert classifier.accuracy(model, test_images, test_labels) > 0.95  # shuffled labels: about 0.5
    model.save_pretrained(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="no classifier.json there; train one with `python tools/classifier.py"):
        classifier.load(tmp_path / "c")
    (tmp_path / "c" / classifier.RECORD).write_text(json.dumps({"test_accuracy": 0.5}))
    again, record = classifier.load(tmp_path / "c")
    assert record["test_accuracy"] == 0.5 and again.config.id2label[1] == "horizontal"
    assert torch.equal(classifier.logits_and_features(again, test_images[:4])[0],
                       classifier.logits_and_features(model, test_images[:4])[0])
    features = classifier.feature_fn(again)(list(test_images[:3]))
    assert features.shape == (3, 128) and features.dtype == np.float64
    # named for the reference cache by its weights: the same classifier read back the same, another not (a
    # classifier retrained in place never reads the statistics of the one before)
    assert classifier.feature_fn(again).name == classifier.feature_fn(model).name != classifier.feature_fn(
        classifier.build(2, ["vertical", "horizontal"])).name
    named = classifier.feature_fn(again)
    assert named.name.startswith("classifier@") and named.tag == "classifier"


def test_the_classifier_trains_on_the_training_split_and_is_measured_on_the_test_split(tmp_path, monkeypatch,
                                                                                      classifier_rows):
    """tools/classifier.py on the recipe, with small IDX files whose splits tell apart: training images dark (one
    grey level a row), test images bright. What classifier.train receives is exactly the training rows, and what
    its accuracy is measured on exactly the test rows (the protocol's class accuracy and FD rest on that)."""
    from tools import classifier as classifier_tool

    for split, (images, labels) in fashion_mnist.FILES.items():
        levels = np.arange(40) if split == "train" else 200 + np.arange(20)
        write_idx(tmp_path / images, levels[:, None, None].repeat(28, 1).repeat(28, 2))
        write_idx(tmp_path / labels, np.arange(len(levels)) % 10)
    load = fashion_mnist.load
    monkeypatch.setattr(fashion_mnist, "load", lambda split: load(split, tmp_path))
    classifier_tool.main(["--config", str(ROOT / "configs/fashion_mnist.json"), "--out", str(tmp_path / "c")])
    grey = lambda images: sorted(images[:, 0, 0, 0].tolist())  # noqa: E731  (every pixel of a row alike)
    assert grey(classifier_rows["trained"]) == list(range(40))
    assert grey(classifier_rows["measured"]) == list(range(200, 220))
    record = json.loads((tmp_path / "c" / classifier.RECORD).read_text())
    assert (record["train_rows"], record["test_split"], record["test_rows"]) == (40, "test", 20)


# ---- A real-image run, scored with the classifier ------------------------------------------------------------


def judged_by_brightness(model, images, device="cpu"):
    """A stand-in verdict that varies from image to image: class = the image's pixel sum mod 10."""
    sums = torch.tensor([int(np.asarray(img, np.int64).sum()) for img in images])
    return torch.nn.functional.one_hot(sums % 10, 10).float(), torch.stack([sums.float(), -sums.float()], 1)


@installed
@pytest.mark.slow
def test_a_run_on_fashion_mnist_is_scored_with_class_accuracy_and_classifier_features(tmp_path, monkeypatch):
    """A few steps of the recipe's shape on 300 training images: the grid is captioned with class names; then
    eval_fid.py --classifier --features classifier against the test split. Class accuracy is checked against
    the classifier's verdict on the PNGs, recomputed here (sample i asks for class i % 10)."""
    run = train_flow_matching.main([
        "--config", str(ROOT / "configs/fashion_mnist.json"), "--run_dir", str(tmp_path / "run"),
        "--data.cache_dir", str(tmp_path / "cache"), "--data.max_samples=300", "--data.val_holdout=64",
        "--train.max_steps=2", "--train.batch_size=16", "--train.warmup_steps=1", "--val.steps=2",
        "--val.num_samples=10", "--val.loss_samples=16", "--val.every=2", "--ckpt.every=2", "--log.every=1",
        "--log.wandb=off", "--model.num_layers=1", "--val.reference_curves=null"])
    captions = [line.split("\t")[-1] for line in (run / "samples" / "step_00000002.txt").read_text().splitlines()]
    assert captions[:3] == ["T-shirt/top", "Trouser", "Pullover"] and captions[9] == "Ankle boot"
    torch.manual_seed(0)
    model = classifier.build(10, fashion_mnist.CLASSES)
    model.save_pretrained(tmp_path / "judge")
    (tmp_path / "judge" / classifier.RECORD).write_text(json.dumps({"test_accuracy": 0.25, "test_split": "test"}))
    out = tmp_path / "eval"
    monkeypatch.setattr(classifier, "logits_and_features", judged_by_brightness)
    report = eval_fid.main(["--run", str(run), "--num_samples", "20", "--steps", "2", "--batch_size", "8",
                            "--out_dir", str(out), "--reference_split", "test", "--reference_num", "30",
                            "--stats_cache", str(tmp_path / "stats"), "--classifier", str(tmp_path / "judge"),
                            "--features", "classifier"])
    m = report["metrics"]
    assert {"fd_classifier_20", "kd_classifier_20", "precision_classifier_20", "class_accuracy_20"} <= set(m)
    assert not any(k.startswith(("fid_", "kid_")) for k in m)  # never called FID: not Inception's features
    pngs = [np.asarray(__import__("PIL.Image").Image.open(out / "samples" / f"{i:06d}.png")) for i in range(20)]
    predicted = judged_by_brightness(None, pngs)[0].argmax(1)
    assert len(set(predicted.tolist())) > 3  # a verdict that tells the samples apart, so the pairing is tested
    assert m["class_accuracy_20"] == pytest.approx((predicted == torch.arange(20) % 10).double().mean().item())
    assert report["classifier"]["test_accuracy"] == 0.25 and report["reference"]["split"] == "test"
    assert report["reference"]["num"] == 30
