"""Fetch the emoji data once (data.source="emoji"; training/data/emoji.py, docs/data.md "Emoji"): `npm pack` of
emoji-datasource-google@16.0.0 and emoji-datasource-twitter@16.0.0 into a folder, each file then checked against
the registry's sha512 pinned in training/data/emoji.py, and the split's counts printed. Runs read the two .tgz
files as they are (no extracted copy) and never download anything.

    python tools/fetch_emoji.py                       # into ~/.cache/minimal-diffusion/emoji: data.source="emoji"
    python tools/fetch_emoji.py --out /shared/emoji   # data.source="emoji:/shared/emoji"

A package already there and intact is not fetched again; a wrong or truncated one is replaced. Without npm, fetch
the two files with any client from the registry (https://registry.npmjs.org/emoji-datasource-google/-/
emoji-datasource-google-16.0.0.tgz, the same with twitter) into the folder, and run this to check them.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.config.config import ConfigError  # noqa: E402
from training.data import emoji, npm  # noqa: E402

TOOL = "tools/fetch_emoji.py"


def intact(folder, vendor):
    path = emoji.tarball(folder, vendor)
    return path.is_file() and emoji.integrity(path.read_bytes()) == emoji.PINNED[vendor]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=emoji.DEFAULT_FOLDER, help="the folder (default: %(default)s)")
    args = p.parse_args(argv)
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    if need := [vendor for vendor in emoji.PINNED if not intact(out, vendor)]:
        npm.pack([f"emoji-datasource-{vendor}@{emoji.VERSION}" for vendor in need], out, TOOL)
    try:
        rows = emoji.table(out)[0]  # each file's integrity checked again, then read
    except ConfigError as e:
        sys.exit(f"{TOOL}: {e}")
    source = emoji.SOURCE if out == emoji.DEFAULT_FOLDER.resolve() else f"{emoji.SOURCE}:{out}"
    print(f"{TOOL}: both packages in {out} are intact: data.source={source!r}")
    for split, c in emoji.counts(rows).items():
        kinds = f"; recombination {c['recombination']}, new {c['new']}" if split != "train" else ""
        print(f"  {split:10} {c['captions']:5,} captions, {c['images']:5,} images (both vendors){kinds}")
    return out


if __name__ == "__main__":
    main()
