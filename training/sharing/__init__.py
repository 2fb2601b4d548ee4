"""A trained model leaving the run: pipeline_export.py (the export as a diffusers pipeline folder, pushed with
run/hub.py), exported/ (the code copied into every such folder: pipeline.py and conditioner.py import torch and
diffusers only, nothing of this repository, so an old folder keeps working), model_card.py (its README.md).

May import: common.py and every folder below: config/, data/, model/, objectives/, optimisation/, run/,
evaluation/ and record/.
"""
