"""The run's machinery: start.py (the model at its start: built, its EMA, this run's checkpoint to resume or
another run's weights, init_from), sharding.py (FSDP2), checkpoints.py (RNG, atomic save, the newest intact one,
load, every rank's agreement, the config a resumed run started with), hub.py (a folder or a Hub id read, a folder
pushed), fit.py (fitting the run to its GPU), monitor.py (what a step measures, the progress line), phema.py
(post-hoc EMA), stability.py and rollback.py (the stability parts by name, rollback on divergence).

May import: common.py, config/, data/, model/, objectives/ and optimisation/.
"""
