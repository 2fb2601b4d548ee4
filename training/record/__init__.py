"""What a run writes, and reads back: runlog.py (the run folder, metrics.jsonl, wandb, labelled grids), report.py
(report.md and its plots, the evaluations and ratings included), curves.py (a recipe's reference curves and the
check against them).

May import: common.py, config/, data/, model/, objectives/, optimisation/, run/ and evaluation/.
"""
