"""benchmarks/real_options.py's and fashion_mnist.py's bookkeeping (no trainer runs): the arms per trainer, the
combination's checks, a step's CPU cost from the trainer's training steps alone, and the equal-CPU step counts and
run folders from it; a resumed run's CPU summed over its processes; the benchmark's scores at the recipe's settings."""
import argparse
import json
from pathlib import Path

import pytest
import torch

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


def fake_run(folder, cpu_per_step, peaks, steps):
    """A trained run as `cost` reads it: its export, and a training row per peak (evenly spaced over `steps`) with
    the trainer's cpu_s_per_step."""
    (folder / "export").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": steps * (i + 1) // len(peaks), "loss": 1.0, "images_per_s": 10.0, "cpu_s_per_step": cpu_per_step,
         "peak_memory_gb": p}) + "\n" for i, p in enumerate(peaks)))


def score(run, step):
    """The run's quality.jsonl as the scorer leaves it: a scored run, skipped by the campaign, read by compare."""
    (run / "quality.jsonl").write_text(json.dumps({"step": step, "fd_classifier_1k": 1.0}) + "\n")


def test_a_steps_cost_comes_from_the_equal_steps_runs_and_sets_the_equal_cpu_steps(tmp_path):
    """Base's runs spend 1.5 and 1.65 CPU-s a training step (1.575), muon's 2.1: at equal CPU muon trains
    200 x 1.575 / 2.1 = 150 steps; memory is the largest peak any run logged."""
    for seed, (b, m) in enumerate([(1.5, 2.1), (1.65, 2.1)]):
        fake_run(tmp_path / "steps200" / "base" / f"ddpm_s{seed}", b, [1.0, 1.5], 200)
        fake_run(tmp_path / "steps200" / "muon" / f"ddpm_s{seed}", m, [1.2, 1.6 + seed], 200)
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
        fake_run(run, per_step[arm], [1.0], steps)
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
    from training.config import config

    got = {}

    def ours(ns):
        cfg = config.load_config(train_flow_matching.DEFAULTS, ["--config", str(ro.fashion_mnist.RECIPE), *ns.extra],
                                 method="flow_matching", schema=train_flow_matching.CONFIG)
        got[Path(ns.out).name] = cfg.objective.prediction
        run = Path(ns.out) / f"{ns.trainer}_s{ns.seed}"
        fake_run(run, 1.0, [1.0], 1)
        score(run, 1)

    monkeypatch.setattr(ro.fashion_mnist, "ours", ours)
    args = argparse.Namespace(out=str(tmp_path), trainers=["flow_matching"], combo=None, seeds=[0], steps=10,
                              budgets=["steps"], classifier="c", num_samples=10, extra=[])
    ro.campaign(args, {"base": [], "x0": ro.ARMS["x0"]})
    assert json.loads(ro.fashion_mnist.RECIPE.read_text())["objective"]["prediction"] == "x0"
    assert got == {"base": "v", "x0": "x0"}


def scorer(monkeypatch, last_step):
    """eval_fid.main for benchmarks/fashion_mnist.py, as far as the sampling settings go (eval_fid.py's own parser
    and tuned_defaults), then a report where it writes one; returns the (checkpoint, guidance, steps) it sees."""
    import eval_fid
    from training.evaluation import tuning

    settings = []

    def scored(argv):
        args = tuning.tuned_defaults(eval_fid.parse_args(argv))
        settings.append((args.checkpoint, args.guidance_scale, args.steps))
        step = int(Path(args.checkpoint).name.split("_")[1]) if args.checkpoint else last_step
        Path(args.out_dir).mkdir(parents=True)
        (Path(args.out_dir) / "report.json").write_text(json.dumps({"model": {"step": step},
                                                                    "metrics": {"fd_classifier_1k": 1.0}}))

    monkeypatch.setattr(ro.fashion_mnist.eval_fid, "main", scored)
    return settings


def ours_args(out, fractions):
    return argparse.Namespace(trainer="flow_matching", recipe=str(ro.fashion_mnist.RECIPE), seed=0, out=str(out),
                              classifier="c", num_samples=100, curve_samples=100, fractions=fractions, eval_args=[],
                              extra=[])


def test_the_benchmark_scores_the_recipes_settings_whatever_tuned_json_the_run_holds(tmp_path, monkeypatch):
    """A trained run (export and checkpoints) holding a tuned.json that tools/tune.py wrote for its export
    (guidance 3): every score benchmarks/fashion_mnist.py asks of eval_fid.py, the export's and the 25 / 50%
    checkpoints', samples at the run's own settings (eval_fid.py's argument parser and tuned_defaults decide)."""
    run = tmp_path / "flow_matching_s0"
    (run / "export").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {"max_steps": 8}}))
    (run / "tuned.json").write_text(json.dumps({"best": {"guidance_scale": 3.0, "guidance_interval": [0, 1],
                                                         "steps": 40, "phema_std": None},
                                                "model": {"checkpoint": None, "weights": "ema"}}))
    settings = scorer(monkeypatch, 8)
    ro.fashion_mnist.ours(ours_args(tmp_path, [0.25, 0.5]))
    assert settings == [(None, None, None), (str(run / "checkpoints" / "step_00000002"), None, None),
                        (str(run / "checkpoints" / "step_00000004"), None, None)]  # None: the run's config's
    assert [json.loads(r)["step"] for r in (run / "quality.jsonl").read_text().splitlines()] == [2, 4, 8]


def test_a_resumed_runs_cpu_is_the_sum_over_its_trainer_processes(tmp_path, monkeypatch):
    """The benchmark's trainer is killed after 10 CPU-s (the benchmark stopped), then resumed and done in 5 more:
    cpu_seconds.json's "train" is 15 (not the last process's 5), and "steps" the training steps' own CPU, from the
    trainer's logged cpu_s_per_step (0.5 a step over 8 steps: 4)."""
    import subprocess

    run, clock, calls = tmp_path / "flow_matching_s0", [0.0], []

    def trainer(cmd, check):  # a trainer process, as the benchmark's children CPU clock sees it
        calls.append(cmd)
        if len(calls) == 1:
            run.mkdir()
            clock[0] += 10.0
            raise subprocess.CalledProcessError(-9, cmd)  # killed
        clock[0] += 5.0
        (run / "config.json").write_text(json.dumps({"train": {"max_steps": 8}}))
        fake_run(run, 0.5, [1.0, 1.0], 8)

    monkeypatch.setattr(ro.fashion_mnist.subprocess, "run", trainer)
    monkeypatch.setattr(ro.fashion_mnist, "cpu_seconds", lambda who: clock[0])
    scorer(monkeypatch, 8)
    with pytest.raises(subprocess.CalledProcessError):
        ro.fashion_mnist.ours(ours_args(tmp_path, []))
    ro.fashion_mnist.ours(ours_args(tmp_path, []))
    assert all("--resume=latest" in cmd for cmd in calls) and len(calls) == 2
    assert json.loads((run / "cpu_seconds.json").read_text()) == {"processes": [10.0, 5.0], "train": 15.0, "steps": 4.0}


def test_the_cpu_per_step_is_the_training_steps_own_without_start_up_validation_or_the_resume(tmp_path, monkeypatch):
    """A run of 8 steps at 2 CPU-s a step, driven through the trainer's monitor as the loop drives it, on a fake
    process clock: 100 CPU-s of start-up in each of its two processes, a 50 CPU-s validation inside an interval, a
    checkpoint at step 6 inside the next, a killed process after it (step 7 done, lost), then the resumed process.
    Its CPU per step is 2 exactly (the whole processes' over the steps: 37.4); an arm at 3 a step, with the same
    fixed costs, trains 8 x 2 / 3 = 5 steps at equal CPU (by the whole processes' CPU, 38.5 a step, all 8)."""
    from accelerate import Accelerator

    import train_flow_matching as fm
    from training.config import config
    from training.model.mmdit import build_denoiser
    from training.run import monitor

    clock = [0.0]
    monkeypatch.setattr(monitor.time, "process_time", lambda: clock[0])
    cfg = config.load_config(fm.DEFAULTS, ["--train.max_steps=8", "--log.every=4", "--log.grad_every=0",
                                           "--model.num_layers=1", "--data.num_classes=3"])
    model, accelerator = build_denoiser(cfg, 3, 8), Accelerator(cpu=True)

    def train(out, per_step):
        rows, state = [], {}

        def steps(mon, first, last):
            for step in range(first, last + 1):
                clock[0] += per_step
                mon.micro_batch(torch.tensor([0.5, 0.7]), torch.tensor([0, 1]))
                mon.optimizer_step(torch.tensor(0.3), torch.tensor(True))
                if step % 4 == 0:
                    mon.log_interval(step, 1e-3)

        def validation(step):
            clock[0] += 50.0

        def checkpoint(step):  # the trainer's: the state first (the monitor's interval in it), then the write
            state.update(json.loads(json.dumps({"step": step, **mon.state_dict()})))
            clock[0] += 1.0

        clock[0] += 100.0  # start-up
        mon = monitor.Monitor(cfg, model, accelerator, rows.append, {"step": 0})
        steps(mon, 1, 5)
        mon.pause(validation, 5, "validation")
        steps(mon, 6, 6)
        mon.pause(checkpoint, 6)
        steps(mon, 7, 7)  # then killed: step 7 is trained again
        mon.close()
        clock[0] += 100.0  # the resumed process's start-up
        mon = monitor.Monitor(cfg, model, accelerator, rows.append, state)
        steps(mon, 7, 8)
        mon.close()
        clock[0] += 30.0  # the export
        fake_run(out, per_step, [1.0], 8)  # its export folder; then the rows the monitor logged
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    start = clock[0]
    rows = train(tmp_path / "steps8" / "base" / "ddpm_s0", 2.0)
    assert [r["step"] for r in rows] == [4, 8] and (clock[0] - start) / 8 == pytest.approx(37.375)
    assert ro.fashion_mnist.step_cpu(tmp_path / "steps8" / "base" / "ddpm_s0") == pytest.approx(2.0)
    train(tmp_path / "steps8" / "muon" / "ddpm_s0", 3.0)
    args = argparse.Namespace(out=str(tmp_path), trainers=["ddpm"], combo=None, seeds=[0], steps=8)
    ro.cost(args, {"base": [], "muon": ro.ARMS["muon"]})
    assert ro.steps_for(args, "ddpm", "muon", "cpu", 8) == 5
    # intervals of other lengths weigh by their steps (4 at 1.0, a last one of 2 at 4.0: 2.0, not their mean 2.5);
    # validation and event rows are not steps; a run from before the trainer logged its CPU is named, not guessed
    rows = [{"step": 4, "loss": 1.0, "images_per_s": 9.0, "cpu_s_per_step": 1.0}, {"step": 5, "val_loss": 1.0},
            {"step": 5, "event": "loss_spike", "loss": 3.0}, {"step": 6, "loss": 1.0, "images_per_s": 9.0,
                                                              "cpu_s_per_step": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ro.fashion_mnist.step_cpu(tmp_path) == pytest.approx(2.0)
    rows[0].pop("cpu_s_per_step")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="metrics.jsonl: training rows without cpu_s_per_step"):
        ro.fashion_mnist.step_cpu(tmp_path)
