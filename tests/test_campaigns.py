"""The campaign scripts of benchmarks/ (the studies run in stages, docs/benchmarks/): their tables pair arms by seed."""
import argparse
import json

import pytest
from scipy.stats import ttest_rel

from benchmarks import buckets


def test_the_buckets_table_pairs_the_arms_by_seed_and_names_the_unpaired_seeds(tmp_path, capsys):
    """Buckets seeds {0, 1, 2} and square seeds {0, 1, 3}: the paired difference is over seeds 0 and 1 alone (the
    issue's table paired by position: buckets' seed 2 against square's seed 3), and the seeds left out are named.
    Each arm's own column keeps all its seeds; a shape the square arm cannot draw has no difference."""
    fd = {"buckets": {0: 10.0, 1: 12.0, 2: 5.0}, "square": {0: 11.0, 1: 12.5, 3: 20.0}}
    for arm, by_seed in fd.items():
        for seed, value in by_seed.items():
            shapes = {f"{w}x{h}": {"fd_classifier": value + w / 100, "class_accuracy": 0.5, "cut_share": 0.1}
                      for w, h in buckets.SHAPES[arm]}
            (tmp_path / f"{arm}_s{seed}").mkdir()
            (tmp_path / f"{arm}_s{seed}" / "scores.json").write_text(json.dumps({"scores": shapes,
                                                                                 "cpu_s_per_step": 1.0}))
    buckets.table(argparse.Namespace(out=str(tmp_path)))
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("| 28x28 | fd_classifier |")).split(" | ")
    low, high = ttest_rel([10.0, 12.0], [11.0, 12.5]).confidence_interval()
    assert row[4] == f"-0.750 [{low:+.3f}, {high:+.3f}] (seeds 0,1)"
    assert row[2].startswith("9.280 [") and row[3].startswith("14.780 [")  # each arm over all its own seeds
    assert next(line for line in lines if line.startswith("| 40x20 | fd_classifier |")).split(" | ")[3:5] == \
        ["cannot draw it", ""]
    assert "unpaired (in the arm's own column, not in the paired difference): buckets seed(s) 2; square seed(s) 3" \
        in lines
