"""The modules the trainers import, one concern each: `config` (the typed config), `data` (sources and
preprocessing), `classes` (labels and class ids), `cache` (the latent / text cache), `model` (the conditioned
MMDiT and guidance), `monitor` (what a step measures), `runlog` and `report` (what a run writes).
Nothing here imports from tools/."""
