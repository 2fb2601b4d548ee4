"""A recipe's reference curves (training/record/curves.py, tools/curves.py): the band over seeds, the check of a new
run's held-out loss against it (the log line and the event), and the report's plot over the band."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_flow_matching  # noqa: E402
from tools import curves as curves_tool  # noqa: E402
from training.config import config  # noqa: E402
from training.record import curves, report, runlog  # noqa: E402


def fake_run(folder, seed, val_losses, loss=1.0, fd=None, steps=(100, 200, 300)):
    """A run folder as the trainer writes it: config.json (val.guidance_scale 2), metrics.jsonl (training rows every
    10 steps and a validation row at each of `steps`), and an eval_fid.py report of the export when `fd` is given,
    sampled by the protocol (the run's settings, seed 0, against the test split)."""
    cfg = config.as_config(json.loads(json.dumps(train_flow_matching.DEFAULTS)))
    cfg.seed, cfg.train.max_steps, cfg.val.guidance_scale = seed, steps[-1], 2.0
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    rows = [{"step": s, "loss": loss, "loss_smoothed": loss + s / 1000} for s in range(10, steps[-1] + 1, 10)]
    rows += [{"step": s, "val_loss": v, "val_loss_t0": 2 * v} for s, v in zip(steps, val_losses)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if fd is not None:
        fake_report(folder, "export", fd)
    return folder


def fake_report(run, name, fd, guidance=2.0, split="test", seed=0, model=None):
    """run/eval/name/report.json with the fields eval_fid.py writes that tell one setting from another; the
    defaults are the protocol's (fake_run's val settings, seed 0, the test split, the export's EMA)."""
    (run / "eval" / name).mkdir(parents=True)
    (run / "eval" / name / "report.json").write_text(json.dumps(
        {"model": model or {"weights": "ema (export)"}, "metrics": {"fd_classifier_1k": fd}, "num_samples": 1000,
         "sampler": "euler", "steps": 32, "guidance_scale": guidance, "control_guidance_scale": 0.0,
         "guidance_interval": [0.0, 1.0], "seeds": {"seed": seed, "batch_size": 64},
         "reference": {"source": "fashion_mnist", "kind": "dataset", "split": split}}))


@pytest.fixture
def reference_file(tmp_path):
    runs = [fake_run(tmp_path / f"s{i}", i, [0.50 + i * 0.01, 0.40 + i * 0.01, 0.30 + i * 0.02], fd=10.0 + i)
            for i in range(3)]
    curves_tool.main([*map(str, runs), "--out", str(tmp_path / "r.curves.json")])
    return tmp_path / "r.curves.json"


def test_band_is_min_mean_max_over_seeds_at_shared_steps(reference_file):
    ref = json.loads(reference_file.read_text())["flow_matching"]
    assert ref["seeds"] == [0, 1, 2] and ref["settings"]["train.max_steps"] == 300
    c = ref["curves"]
    assert c["val_loss"] == [[100, 0.5, 0.51, 0.52], [200, 0.4, 0.41, 0.42], [300, 0.3, 0.32, 0.34]]
    assert c["val_loss_t0"][2] == [300, 0.6, 0.64, 0.68]
    assert c["fd_classifier_1k"] == [[300, 10.0, 11.0, 12.0]]  # the export's score, at the last step
    assert [r[0] for r in c["loss_smoothed"]] == [10, 110, 210, 300]  # every 10th logged step, and the last
    assert "loss" not in c and reference_file.stat().st_size < 4000


def test_only_steps_every_seed_has_enter_the_band(tmp_path):
    a = fake_run(tmp_path / "a", 0, [0.5, 0.4, 0.3])
    b = fake_run(tmp_path / "b", 1, [0.5, 0.4], steps=(100, 200))  # stopped early
    assert [r[0] for r in curves.make([a, b], report.load_metrics, "flow_matching")["curves"]["val_loss"]] == [100, 200]


def test_the_band_takes_the_protocols_scores_only(tmp_path):
    """Issue 57: three seeds scored at the run's guidance 2 on the test split (1.01, 1.02, 1.03) and, in one of them,
    tools/tune.py's search at guidance 3 on the held-out rows (9.0) made the band [1.01, 9.0]. Each report that
    is not the protocol's (another guidance, the held-out rows alone, another seed, raw or post-hoc EMA weights)
    stays out, one at a time; two protocol scores of one point are an error naming both."""
    runs = [fake_run(tmp_path / f"s{i}", i, [0.5, 0.4, 0.3], fd=1.01 + i / 100) for i in range(3)]
    fake_report(runs[0], "export-ema-euler32-g3-seed0", 9.0, guidance=3.0, split="heldout")  # the example
    band = curves.make(runs, report.load_metrics, "flow_matching")["curves"]["fd_classifier_1k"]
    assert band == [[300, 1.01, 1.02, 1.03]]
    others = {"test-g3": {"guidance": 3.0}, "heldout-g2": {"split": "heldout"}, "test-seed1": {"seed": 1},
              "raw": {"model": {"weights": "raw", "step": 300}}, "phema": {"model": {"weights": "post-hoc EMA, std "
                                                                                   "0.1", "phema": {"phema_std": 0.1}}}}
    for name, setting in others.items():
        fake_report(runs[1], name, 9.0, **setting)
        assert curves.make(runs, report.load_metrics, "flow_matching")["curves"]["fd_classifier_1k"] == band, name
        assert [v for k, v, _ in curves.scores(runs[1], json.loads((runs[1] / "config.json").read_text()))] == [1.02]
    fake_report(runs[2], "export-again", 1.5)  # the protocol's score of the export, twice
    with pytest.raises(ValueError, match=r"s2/eval/export/report.json and .*s2/eval/export-again/report.json both "
                                         r"score fd_classifier_1k at step 300 by the protocol"):
        curves.make(runs, report.load_metrics, "flow_matching")


def test_the_tool_refuses_runs_that_differ_in_more_than_the_seed(tmp_path):
    a, b = fake_run(tmp_path / "a", 0, [0.5, 0.4, 0.3]), fake_run(tmp_path / "b", 1, [0.5, 0.4, 0.3])
    cfg = json.loads((b / "config.json").read_text())
    cfg["train"]["lr"] = 0.5
    (b / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="differ only in their seed; they differ in \\['train'\\]"):
        curves_tool.main([str(a), str(b), "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="at least 2 seed runs"):
        curves.make([a], report.load_metrics, "flow_matching")
    c = fake_run(tmp_path / "c", 0, [0.5, 0.4, 0.3])
    with pytest.raises(SystemExit, match="same seed"):
        curves_tool.main([str(a), str(c), "--out", str(tmp_path / "x.json")])


def reference(reference_file):
    return json.loads(reference_file.read_text())["flow_matching"]


def test_off_band_flags_only_beyond_the_seed_spread(reference_file):
    ref = reference(reference_file)  # at step 300: val_loss band [0.30, 0.34], spread 0.04
    assert curves.off_band(ref, {"step": 300, "val_loss": 0.36}) == []  # outside, but by less than the spread
    assert curves.off_band(ref, {"step": 300, "val_loss": 0.27}) == []
    assert curves.off_band(ref, {"step": 250, "val_loss": 9.0}) == []  # a step the reference does not have
    assert curves.off_band(ref, {"step": 300, "loss": 9.0}) == []  # training rows are not checked
    [event] = curves.off_band(ref, {"step": 300, "val_loss": 0.40})
    assert event["key"] == "val_loss" and event["band"] == [0.3, 0.34]
    assert event["by"] == pytest.approx(0.06) and event["spread"] == pytest.approx(0.04)
    [low] = curves.off_band(ref, {"step": 100, "val_loss_t0": 0.9})  # band [1.00, 1.04]: below by 0.1
    assert low["by"] == pytest.approx(0.1)
    assert curves.describe(event, ref["seeds"]) == ("step 300: val_loss 0.4000 is above the reference band "
                                                    "[0.3000, 0.3400] (3 seeds) by 0.0600, 1.5 x the seed-to-seed "
                                                    "spread 0.0400")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_heldout_loss_is_off_the_reference(reference_file, value):
    """A NaN held-out loss is above and below no bound (every comparison with NaN is false): without its own check
    it would pass as inside the band. Flagged at any step the reference has, with a line that says so."""
    ref = reference(reference_file)  # at step 300: val_loss band [0.30, 0.34]
    [event] = curves.off_band(ref, {"step": 300, "val_loss": value, "val_loss_t0": 0.65})
    assert (event["key"], event["band"], event["by"]) == ("val_loss", [0.3, 0.34], None)  # by: no distance to give
    assert curves.describe(event, ref["seeds"]) == (f"step 300: val_loss is {value}, not a finite number: off the "
                                                    f"reference band [0.3000, 0.3400] (3 seeds): diverged weights, "
                                                    f"or an overflow at train.mixed_precision")


class FakeAccelerator:
    is_main_process = True

    def __init__(self):
        self.lines = []

    def print(self, line):
        self.lines.append(line)


def test_a_run_logs_and_prints_when_its_heldout_loss_leaves_the_band(reference_file, tmp_path):
    cfg = config.as_config(json.loads(json.dumps(train_flow_matching.DEFAULTS)))
    cfg.val.reference_curves, cfg.log.wandb, cfg.train.max_steps = str(reference_file), "off", 600
    (tmp_path / "run").mkdir()
    acc = FakeAccelerator()
    log = runlog.RunLog(cfg, tmp_path / "run", acc)
    assert acc.lines == ["note: this run differs from the reference curves' runs in train.max_steps 300 -> 600: "
                         "compared step by step all the same"]
    cfg.objective.prediction, cfg.train.optimizer = "x0", "muon"  # another objective's loss, or optimizer's: said too
    assert curves.differences(reference(reference_file), cfg) == ["train.max_steps 300 -> 600",
                                                                  "objective.prediction v -> x0",
                                                                  "train.optimizer adamw -> muon"]
    cfg.objective.prediction, cfg.train.optimizer = "v", "adamw"
    log({"step": 200, "val_loss": 0.41, "val_loss_t0": 0.82})
    log({"step": 300, "val_loss": 0.45, "val_loss_t0": 0.64})
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if r.get("event") == "off_reference"]
    assert [(e["step"], e["key"]) for e in events] == [(300, "val_loss")]
    assert acc.lines[-1].startswith("warning: step 300: val_loss 0.4500 is above the reference band [0.3000, 0.3400]")
    log({"step": 300, "val_loss": float("nan"), "val_loss_t0": 0.64})  # a diverged run: logged and said
    assert acc.lines[-1] == ("warning: step 300: val_loss is nan, not a finite number: off the reference band "
                             "[0.3000, 0.3400] (3 seeds): diverged weights, or an overflow at train.mixed_precision")
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] == "off_reference" and rows[-1]["value"] != rows[-1]["value"] and rows[-1]["by"] is None


def test_a_missing_reference_file_is_a_config_problem_before_any_work(tmp_path):
    with pytest.raises(config.ConfigError, match="val.reference_curves=.*nowhere.json.*no such file"):
        config.load_config(train_flow_matching.DEFAULTS, [f"--val.reference_curves={tmp_path / 'nowhere.json'}"],
                           method="flow_matching", schema=train_flow_matching.CONFIG)


def test_a_named_reference_that_is_missing_or_lacks_the_method_stops_the_run(reference_file, tmp_path):
    cfg = config.as_config(json.loads(json.dumps(train_flow_matching.DEFAULTS)))
    cfg.val.reference_curves = str(tmp_path / "nowhere.json")
    with pytest.raises(FileNotFoundError, match="val.reference_curves=.*no such file"):
        curves.load(cfg)
    cfg.val.reference_curves = str(reference_file)
    del cfg.objective["time_sampling"]  # a DDPM run's objective
    with pytest.raises(ValueError, match="has curves for \\['flow_matching'\\], not ddpm"):
        curves.load(cfg)


@pytest.mark.slow
def test_the_report_draws_the_run_over_the_band(reference_file, tmp_path):
    run = fake_run(tmp_path / "new", 7, [0.5, 0.4, 0.31], fd=11.5)
    cfg = json.loads((run / "config.json").read_text())
    cfg["val"]["reference_curves"] = str(reference_file)
    (run / "config.json").write_text(json.dumps(cfg))
    md = report.write_report(run).read_text()
    assert (run / "report" / "reference.png").is_file() and "![Against the reference run](report/reference.png)" in md


@pytest.mark.parametrize("trainer", ["flow_matching", "ddpm"])
def test_the_shipped_reference_matches_its_recipe(trainer, monkeypatch):
    """configs/fashion_mnist.json names its curves: both trainers find their method's band, made by at least 3 seeds
    of exactly the recipe's settings (a recipe changed without new curves would warn on every run), and the band
    holds every held-out loss bin at each validation."""
    import train_ddpm
    module = {"flow_matching": train_flow_matching, "ddpm": train_ddpm}[trainer]
    monkeypatch.chdir(ROOT)  # the recipe names the file from the repository's root, as its commands run
    cfg = config.load_config(module.DEFAULTS, ["--config", "configs/fashion_mnist.json"], method=trainer,
                             schema=module.CONFIG)
    reference = curves.load(cfg)
    assert len(set(reference["seeds"])) >= 3 and curves.differences(reference, cfg) == []
    assert set(reference["settings"]) == {f"{a}.{b}" for a, b in curves.COMPARABLE}  # each one checked above
    steps = list(range(cfg.val.every, cfg.train.max_steps + 1, cfg.val.every))
    for key in ["val_loss", *(f"val_loss_t{i}" for i in range(5))]:
        assert [row[0] for row in reference["curves"][key]] == steps
        assert all(lo <= mean <= hi for _, lo, mean, hi in reference["curves"][key])
