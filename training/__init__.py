"""The modules the trainers import, one concern each: `config` (the typed config), `data` (sources,
preprocessing and batches), `encoders` (the frozen VAE and text encoder), `classes` (labels and class ids),
`cache` (the latent / text cache), `checkpoints` (save, find, load), `model` (the conditioned MMDiT and
guidance), `monitor` (what a step measures), `runlog` and `report` (what a run writes); the README's table has
them all. Imports run one way, with no circle: nothing here imports from tools/, and common.py imports nothing
from here (tests/test_layout.py)."""
