"""Fashion-MNIST (Xiao et al. 2017) read straight from the Debian package `dataset-fashion-mnist`: the real-image
ground truth of this project (data.source="fashion_mnist"; configs/fashion_mnist.json, docs/evaluation.md).

The package installs upstream's four gzipped IDX files under /usr/share/datasets/fashion-mnist/: 60,000 training
and 10,000 test images, 28 x 28 grey, 10 classes. We read them directly, rather than writing a folder of 70,000
PNGs first: nothing is copied (no second 70k-file tree, no Arrow copy), nothing can fall out of step with the
package, the split "test" is upstream's test set by construction, and the class names travel with the labels
(a ClassLabel column), so every sample grid is captioned "Ankle boot", not "9". Nothing is downloaded.

IDX (LeCun et al.): a big-endian header, magic 0x00000803 (unsigned bytes, 3 dimensions: N, rows, columns) for
images and 0x00000801 (1 dimension: N) for labels, then the values row by row.
"""
import gzip
import hashlib
from pathlib import Path

import numpy as np

SOURCE = "fashion_mnist"  # the data.source value that names it
FOLDER = Path("/usr/share/datasets/fashion-mnist")
INSTALL = "apt-get install dataset-fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
# The images' terms (the package's /usr/share/doc/dataset-fashion-mnist/copyright), for a model card.
LICENCE = "Fashion-MNIST (https://github.com/zalandoresearch/fashion-mnist): MIT License, Copyright 2017 Zalando SE"
# Upstream's class names (zalandoresearch/fashion-mnist, README), in label order.
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


def read_idx(path):
    """The array in a gzipped IDX file: uint8, shape (N,) or (N, rows, columns), checked against its header."""
    raw = gzip.decompress(Path(path).read_bytes())
    zeros, dtype, ndim = raw[0:2], raw[2], raw[3]
    if zeros != b"\0\0" or dtype != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (header {raw[:4].hex()})")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} ({int(np.prod(shape))} values), the file holds {body.size}")
    return body.reshape(shape)


def split_arrays(split, folder=FOLDER):
    """(images uint8 (N, 28, 28), labels uint8 (N,)) of split 'train' or 'test'. A missing package is one line
    naming the apt command; an unknown split names the two there are; files that are not Fashion-MNIST's (an image
    file with other dimensions or sizes, labels outside 0-9, image and label files swapped) one line naming the file."""
    if split not in FILES:
        raise ValueError(f"data.source='{SOURCE}' has the splits {sorted(FILES)}, not '{split}'")
    paths = [Path(folder) / name for name in FILES[split]]
    if missing := [str(p) for p in paths if not p.is_file()]:
        raise FileNotFoundError(f"data.source='{SOURCE}': {', '.join(missing)} not found. Install the Debian "
                                f"package as root: {INSTALL}")
    images, labels = (read_idx(p) for p in paths)
    swapped = " (the label file's shape: are the image and label files swapped?)" * (images.ndim == 1)
    if images.shape[1:] != (28, 28):
        raise ValueError(f"{paths[0]}: Fashion-MNIST's images are 28 x 28 (IDX dimensions N, 28, 28); this file "
                         f"holds shape {images.shape}{swapped}")
    if labels.ndim != 1:
        raise ValueError(f"{paths[1]}: Fashion-MNIST's labels are one number per image (IDX dimensions N); this "
                         f"file holds shape {labels.shape}" + " (an image file's: are the image and label files "
                         "swapped?)" * (labels.ndim == 3))
    if (bad := np.flatnonzero(labels >= len(CLASSES))).size:
        raise ValueError(f"{paths[1]}: Fashion-MNIST's labels run 0-9 ({len(CLASSES)} classes); {bad.size} of its "
                         f"{len(labels)} labels do not, first row {bad[0]} (label {labels[bad[0]]})")
    if len(images) != len(labels):
        raise ValueError(f"{paths[0]} holds {len(images)} images but {paths[1]} {len(labels)} labels")
    return images, labels


def load(split, folder=FOLDER):
    """Split `split` as a `datasets.Dataset` (image, label: a ClassLabel of CLASSES). Its fingerprint is the
    files' digest, so the trainers' cache key sees the data, not the moment it was read."""
    import datasets

    images, labels = split_arrays(split, folder)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    ds = datasets.Dataset.from_dict({"image": list(images), "label": labels.tolist()}, features=features)
    digest = hashlib.sha256(b"".join(hashlib.sha256(gzip.decompress((Path(folder) / f).read_bytes())).digest()
                                     for f in FILES[split])).hexdigest()[:16]
    ds._fingerprint = f"fashion-mnist-{split}-{digest}"
    return ds
