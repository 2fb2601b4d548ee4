"""benchmarks/real_options.py's bookkeeping (no trainer runs): the arms per trainer, the combination's checks, a
step's CPU cost as the difference of two run lengths, and the equal-CPU step counts and run folders from it."""
import argparse
import json

import pytest

from benchmarks import real_options as ro


def test_the_arms_apply_where_their_option_exists_and_the_combination_is_checked():
    assert ro.applies("contrastive", "flow_matching", None) and not ro.applies("contrastive", "ddpm", None)
    assert ro.applies("repa_trained", "ddpm", None) and ro.applies("muon", "ddpm", None)
    table = ro.arms("x0,contrastive")
    assert table["combo"] == [*ro.ARMS["x0"], *ro.ARMS["contrastive"]]
    assert not ro.applies("combo", "ddpm", "x0,contrastive") and ro.applies("combo", "ddpm", "x0,muon")
    for bad in ("x0,nope", "base,x0", "repa_trained,repa_random"):
        with pytest.raises(SystemExit):
            ro.arms(bad)


def test_a_steps_cost_is_the_difference_of_two_run_lengths(tmp_path, monkeypatch):
    """A fake trainer: 30 CPU-s to start, then 1.5 a step (base) or 2.0 (muon); peak RSS of the longer run."""
    per_step = {"base": 1.5, "muon": 2.0}

    def trainer_cpu(cmd):
        steps = int(next(a for a in cmd if a.startswith("--train.max_steps=")).split("=")[1])
        arm = "muon" if "--train.optimizer=muon" in cmd else "base"
        return 30 + per_step[arm] * steps, 1.5 + steps / 100

    monkeypatch.setattr(ro, "trainer_cpu", trainer_cpu)
    args = argparse.Namespace(out=str(tmp_path), trainers=["ddpm"], combo=None, extra=[])
    ro.cost(args, {"base": [], "muon": ro.ARMS["muon"]})
    rows = json.loads((tmp_path / "cost.json").read_text())["ddpm"]
    assert rows["base"] == pytest.approx({"cpu_s_per_step": 1.5, "peak_rss_gib": 1.75})
    assert rows["muon"]["cpu_s_per_step"] == pytest.approx(2.0)
    # equal CPU: base's 1,200 steps at 1.5 CPU-s buy muon 900; a run is named by its steps, whichever budget asks
    assert ro.run_dir(args, "ddpm", "muon", "cpu", 0, 1200) == (tmp_path / "steps900" / "muon" / "ddpm_s0", 900)
    assert ro.run_dir(args, "ddpm", "muon", "steps", 0, 900) == (tmp_path / "steps900" / "muon" / "ddpm_s0", 900)
    assert ro.run_dir(args, "ddpm", "base", "cpu", 0, 1200) == (tmp_path / "steps1200" / "base" / "ddpm_s0", 1200)
    # an arm within COST_TIE of base's cost (below what the measurement can tell) trains base's steps at equal CPU
    rows = json.loads((tmp_path / "cost.json").read_text())
    rows["ddpm"]["muon"]["cpu_s_per_step"] = 1.5 * (1 + ro.COST_TIE * 0.9)
    (tmp_path / "cost.json").write_text(json.dumps(rows))
    assert ro.steps_for(args, "ddpm", "muon", "cpu", 1200) == 1200
    with pytest.raises(SystemExit, match="run `python benchmarks/real_options.py cost` first"):
        ro.steps_for(args, "flow_matching", "muon", "cpu", 1200)
