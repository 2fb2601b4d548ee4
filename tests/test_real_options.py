"""benchmarks/real_options.py's bookkeeping (no trainer runs): the arms per trainer, the combination's checks, a
step's CPU cost as the difference of two run lengths, and the equal-CPU step counts and run folders from it."""
import argparse
import json
from pathlib import Path

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


def score(run, step):
    """The run's quality.jsonl as the scorer leaves it: a scored run, skipped by the campaign, read by compare."""
    (run / "quality.jsonl").write_text(json.dumps({"step": step, "fd_classifier_1k": 1.0}) + "\n")


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
    args.combo = "x0,muon"  # a combination's runs are named by what it stacks: another one is not "done before"
    assert ro.run_dir(args, "ddpm", "combo", "steps", 0, 200)[0] == tmp_path / "steps200" / "combo_x0+muon" / "ddpm_s0"
    args.combo = None
    with pytest.raises(SystemExit, match="at --steps 300"):  # costs measured at another budget are not used
        ro.steps_for(args, "ddpm", "muon", "cpu", 300)
    # an arm within COST_TIE of base's cost (below what the runs can tell apart) trains base's steps at equal CPU
    rows["muon"]["cpu_s_per_step"] = 1.575 * (1 + ro.COST_TIE * 0.9)
    (tmp_path / "cost.json").write_text(json.dumps({"ddpm": rows}))
    assert ro.steps_for(args, "ddpm", "muon", "cpu", 200) == 200


def test_the_campaign_trains_equal_steps_then_measures_then_trains_equal_cpu(tmp_path, monkeypatch):
    """A fake trainer-and-scorer (fashion_mnist.ours): base costs 1.0 CPU-s a step, muon 2.0. The campaign trains
    every arm at --steps, measures the cost on those runs, then trains muon for half the steps; a second call
    trains nothing; the combination's runs go to a folder named by what it stacks."""
    per_step = {(): 1.0, ("--train.optimizer=muon",): 2.0}
    trained = []

    def ours(ns):
        steps = int(next(a for a in ns.extra if a.startswith("--train.max_steps=")).split("=")[1])
        arm = tuple(a for a in ns.extra if a == "--train.optimizer=muon")
        run = Path(ns.out) / f"{ns.trainer}_s{ns.seed}"
        fake_run(run, per_step[arm] * steps, [1.0])
        score(run, steps)
        trained.append((Path(ns.out).relative_to(tmp_path).as_posix(), ns.seed, steps))

    monkeypatch.setattr(ro.fashion_mnist, "ours", ours)
    args = argparse.Namespace(out=str(tmp_path), trainers=["ddpm"], combo=None, seeds=[0, 1], steps=100,
                              budgets=["steps", "cpu"], classifier="c", num_samples=10, extra=[])
    table = {"base": [], "muon": ro.ARMS["muon"]}
    ro.campaign(args, table)
    assert trained == [("steps100/base", 0, 100), ("steps100/muon", 0, 100), ("steps100/base", 1, 100),
                       ("steps100/muon", 1, 100), ("steps50/muon", 0, 50), ("steps50/muon", 1, 50)]
    ro.campaign(args, table)
    assert len(trained) == 6  # everything scored is skipped
    args.combo, args.budgets = "x0,muon", ["steps"]
    ro.campaign(args, ro.arms("x0,muon"))
    assert ("steps100/combo_x0+muon", 0, 100) in trained


def test_each_set_of_compared_arms_gets_its_own_comparison_folder(tmp_path, monkeypatch):
    """Comparing base with x0 and then base with muon on the same runs keeps both compare.md files."""
    written = []
    monkeypatch.setattr("tools.compare.compare", lambda runs, out, metric: written.append(
        (sorted({r.parent.name for r in runs}), Path(out).relative_to(tmp_path / "compare").as_posix())))
    for arm in ("base", "x0", "muon"):
        for seed in (0, 1):
            run = tmp_path / "steps100" / arm / f"ddpm_s{seed}"
            run.mkdir(parents=True)
            score(run, 100)
    args = argparse.Namespace(out=str(tmp_path), trainers=["ddpm"], combo=None, seeds=[0, 1], steps=100,
                              budgets=["steps"])
    for arms in (("base", "x0"), ("base", "muon")):
        ro.compare(args, {a: ro.ARMS[a] for a in arms})
    assert written == [(["base", "x0"], "ddpm_steps100_steps_fd_classifier_1k/base_vs_x0"),
                       (["base", "muon"], "ddpm_steps100_steps_fd_classifier_1k/base_vs_muon")]


def test_every_arm_starts_from_the_v_prediction_recipe_the_campaign_measured(tmp_path, monkeypatch):
    """The recipe now predicts x0; the campaign's base stays v-prediction (what its documented runs are), and the
    x0 arm's own argument wins: the trainer's config, resolved from the arguments each run gets."""
    import train_flow_matching
    from training import config

    got = {}

    def ours(ns):
        cfg = config.load_config(train_flow_matching.DEFAULTS, ["--config", str(ro.fashion_mnist.RECIPE), *ns.extra],
                                 method="flow_matching", schema=train_flow_matching.CONFIG)
        got[Path(ns.out).name] = cfg.objective.prediction
        run = Path(ns.out) / f"{ns.trainer}_s{ns.seed}"
        fake_run(run, 1.0, [1.0])
        score(run, 1)

    monkeypatch.setattr(ro.fashion_mnist, "ours", ours)
    args = argparse.Namespace(out=str(tmp_path), trainers=["flow_matching"], combo=None, seeds=[0], steps=10,
                              budgets=["steps"], classifier="c", num_samples=10, extra=[])
    ro.campaign(args, {"base": [], "x0": ro.ARMS["x0"]})
    assert json.loads(ro.fashion_mnist.RECIPE.read_text())["objective"]["prediction"] == "x0"
    assert got == {"base": "v", "x0": "x0"}


def test_the_benchmark_scores_the_recipes_settings_whatever_tuned_json_the_run_holds(tmp_path, monkeypatch):
    """A trained run (export and checkpoints) holding a tuned.json that tools/tune.py wrote for its export
    (guidance 3): every score benchmarks/fashion_mnist.py asks of eval_fid.py, the export's and the 25 / 50%
    checkpoints', samples at the run's own settings (eval_fid.py's argument parser and tuned_defaults decide)."""
    import eval_fid

    run = tmp_path / "flow_matching_s0"
    (run / "export").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {"max_steps": 8}}))
    (run / "tuned.json").write_text(json.dumps({"best": {"guidance_scale": 3.0, "guidance_interval": [0, 1],
                                                         "steps": 40, "phema_std": None},
                                                "model": {"checkpoint": None, "weights": "ema"}}))
    settings = []

    def scored(argv):  # eval_fid.main as far as the settings go, then a report where it writes one
        args = eval_fid.tuned_defaults(eval_fid.parse_args(argv))
        settings.append((args.checkpoint, args.guidance_scale, args.steps))
        step = int(Path(args.checkpoint).name.split("_")[1]) if args.checkpoint else 8
        Path(args.out_dir).mkdir(parents=True)
        (Path(args.out_dir) / "report.json").write_text(json.dumps({"model": {"step": step},
                                                                    "metrics": {"fd_classifier_1k": 1.0}}))

    monkeypatch.setattr(ro.fashion_mnist.eval_fid, "main", scored)
    ro.fashion_mnist.ours(argparse.Namespace(trainer="flow_matching", seed=0, out=str(tmp_path), classifier="c",
                                             num_samples=100, curve_samples=100, fractions=[0.25, 0.5],
                                             eval_args=[], extra=[]))
    assert settings == [(None, None, None), (str(run / "checkpoints" / "step_00000002"), None, None),
                        (str(run / "checkpoints" / "step_00000004"), None, None)]  # None: the run's config's
    assert [json.loads(r)["step"] for r in (run / "quality.jsonl").read_text().splitlines()] == [2, 4, 8]
