"""benchmarks/resolution_transfer.py end to end on a tiny budget: every variant runs, is scored and reported."""
import json
import math
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.slow
def test_resolution_transfer_benchmark_runs_every_variant(tmp_path, capsys):
    import resolution_transfer

    tiny = ["--data.demo_samples=320", "--data.val_holdout=64", "--train.batch_size=16", "--train.warmup_steps=2",
            "--val.steps=2", "--val.loss_samples=16", "--val.num_samples=4", "--model.num_layers=1",
            "--model.num_attention_heads=2", "--model.attention_head_dim=16"]
    results = resolution_transfer.main(["--pretrain_steps=2", "--finetune_steps=2", "--per_class=2",
                                        "--classifier_steps=5", "--out", str(tmp_path), *tiny])
    assert list(results) == list(resolution_transfer.VARIANTS)
    for r in results.values():
        assert math.isfinite(r["val_loss"]) and 0 <= r["class_accuracy"] <= 1
    assert json.loads((tmp_path / "resolution_transfer.json").read_text()).keys() == results.keys()
    report = json.loads((tmp_path / "resample_shift" / "init_from.json").read_text())
    assert report["adapted"][0].startswith("transformer.pos_embed.pos_embed: resample 4^2 -> 8^2")
    assert json.loads((tmp_path / "extend" / "init_from.json").read_text())["adapted"][0].startswith(
        "transformer.pos_embed.pos_embed: extend")
    assert not (tmp_path / "scratch" / "init_from.json").exists()
    table = capsys.readouterr().out.split("variant")[-1]
    assert all(name in table for name in results)
