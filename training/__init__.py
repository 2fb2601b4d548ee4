"""The library the commands import (the trainers, eval_fid.py, sample.py, tools/, benchmarks/), in folders by
stage of a run, ground to top as README.md's folder table lists them (tests/test_layout.py holds the order). A
module imports from its own folder and the folders below it, never from one above, so imports run one way with no
circle, between modules and between folders. Nothing is re-exported: neither this file nor a folder's __init__.py
holds code, so an import names the module a thing lives in (`from training.data import cache`). Nothing here
imports from tools/, benchmarks/ or the commands; common.py, under everything, imports nothing from here."""
