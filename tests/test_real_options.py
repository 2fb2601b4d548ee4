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


def fake_run(folder, cpu, peaks):
    folder.mkdir(parents=True)
    (folder / "cpu_seconds.json").write_text(json.dumps({"train": cpu}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "peak_memory_gb": p}) + "\n"
                                                  for i, p in enumerate(peaks)))


def test_a_steps_cost_comes_from_the_equal_steps_runs_and_sets_the_equal_cpu_steps(tmp_path):
    """Base's runs spend 300 and 330 CPU-s on 200 steps (1.575 a step), muon's 420 and 420 (2.1): at equal CPU
    muon trains 200 x 1.575 / 2.1 = 150 steps; memory is the largest peak any run logged."""
    for seed, (b, m) in enumerate([(300, 420), (330, 420)]):
        fake_run(tmp_path / "steps200" / "base" / f"ddpm_s{seed}", b, [1.0, 1.5])
        fake_run(tmp_path / "steps200" / "muon" / f"ddpm_s{seed}", m, [1.2, 1.6 + seed])
    args = argparse.Namespace(out=str(tmp_path), trainers=["ddpm"], combo=None, seeds=[0, 1], steps=200)
    table = {"base": [], "muon": ro.ARMS["muon"]}
    with pytest.raises(SystemExit, match="train the equal-steps runs"):
        ro.steps_for(args, "ddpm", "muon", "cpu", 200)
    ro.cost(args, table)
    rows = json.loads((tmp_path / "cost.json").read_text())["ddpm"]
    assert rows["base"]["cpu_s_per_step"] == pytest.approx(1.575) and rows["base"]["peak_memory_gib"] == 1.5
    assert rows["muon"]["cpu_s_per_step"] == pytest.approx(2.1) and rows["muon"]["peak_memory_gib"] == 2.6
    # a run is named by its steps, whichever budget asks for it
    assert ro.run_dir(args, "ddpm", "muon", "cpu", 0, 200) == (tmp_path / "steps150" / "muon" / "ddpm_s0", 150)
    assert ro.run_dir(args, "ddpm", "base", "cpu", 1, 200) == (tmp_path / "steps200" / "base" / "ddpm_s1", 200)
    with pytest.raises(SystemExit, match="at --steps 300"):  # costs measured at another budget are not used
        ro.steps_for(args, "ddpm", "muon", "cpu", 300)
    # an arm within COST_TIE of base's cost (below what the runs can tell apart) trains base's steps at equal CPU
    rows["muon"]["cpu_s_per_step"] = 1.575 * (1 + ro.COST_TIE * 0.9)
    (tmp_path / "cost.json").write_text(json.dumps({"ddpm": rows}))
    assert ro.steps_for(args, "ddpm", "muon", "cpu", 200) == 200
