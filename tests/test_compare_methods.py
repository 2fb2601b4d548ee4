"""benchmarks/compare_methods.py end to end on a tiny budget: both trainers, checkpoint scoring, table, JSON."""
import json
import math
import sys

import pytest
import torch.nn as nn
from conftest import ROOT, tiny_run_args

sys.path.insert(0, str(ROOT / "benchmarks"))
import compare_methods  # noqa: E402

SET_BY_BENCHMARK = ("--run_dir", "--data.cache_dir", "--train.max_steps", "--val.every", "--ckpt.every", "--log.wandb")


@pytest.mark.slow
def test_compare_methods_tiny(tmp_path, capsys, monkeypatch):
    # The demo classifier's data alone takes ~7 s to draw; an untrained CNN keeps the test under a minute
    # (the two trainers' start-up, importing diffusers, is most of the rest).
    calls = []
    stub = lambda steps, resolution: calls.append((steps, resolution)) or (
        nn.Sequential(nn.Conv2d(3, 9, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval(), 0.5)
    monkeypatch.setattr(compare_methods, "train_classifier", stub)
    args = tiny_run_args(tmp_path)
    extra = [a for a, prev in zip(args, [None] + args) if not a.startswith(SET_BY_BENCHMARK)
             and prev not in SET_BY_BENCHMARK]  # the tiny data and sampler; the benchmark sets the rest
    results = compare_methods.main(["--steps", "4", "--eval_every", "2", "--per_class", "1", "--threshold", "0",
                                    "--classifier_steps", "20", "--out", str(tmp_path / "out"), *extra])
    assert calls == [(20, 16)]
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("method  ")):]
    for header in compare_methods.HEADERS:
        assert header.replace("thr", "0") in table[0]
    assert [line.split("  ")[0].strip() for line in table[2:4]] == ["flow matching", "ddpm"]

    saved = json.loads((tmp_path / "out" / "compare_methods.json").read_text())
    assert set(saved["results"]) == {"flow matching", "ddpm"} and saved["table"] in printed
    for method, r in saved["results"].items():
        assert math.isfinite(r["images_per_s"]) and r["images_per_s"] > 0
        assert 0 <= r["quality"] <= 1 and r["quality"] == r["quality_curve"]["4"] == results[method]["quality"]
        assert sorted(map(int, r["quality_curve"])) == [2, 4]  # every checkpoint scored
        assert r["step_to_threshold"] == 2 and r["seconds_to_threshold"] > 0  # threshold 0: the first checkpoint
        assert r["loss_spikes"] >= 0 and math.isfinite(r["loss_rel_std"])
