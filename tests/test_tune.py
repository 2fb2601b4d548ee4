"""tools/tune.py: the grid of sampling settings scored on held-out rows, the best and the runner-up found and
confirmed on fresh seeds, every attempt to select on the test split refused before any sampling (tools/phema.py
--sweep alike), and the chosen setting the default of eval_fid.py and sample.py (a flag overrides it)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import eval_fid  # noqa: E402
import sample  # noqa: E402
from tools import phema as phema_tool  # noqa: E402
from tools import tune  # noqa: E402


@pytest.fixture
def run(tmp_path):
    (tmp_path / "run").mkdir()
    cfg = {"data": {"val_split": None}, "val": {"guidance_scale": 3.0, "steps": 32, "guidance_interval": [0.0, 1.0]}}
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "run"


def fake_eval(calls, best=(2.0, 16), confirmed=None):
    """eval_fid.main's stand-in: the distance is smallest at the planted setting `best` (guidance, steps[, interval])
    on the search's seed 0, and at `confirmed` on the confirmation's fresh seeds, if given."""
    def main(argv, feature_fn=None):
        a = eval_fid.parse_args(argv)
        calls.append(a)
        target = best if a.seed == 0 or confirmed is None else confirmed
        d = abs(a.guidance_scale - target[0]) + abs(a.steps - target[1]) / 100 + 1 + a.seed / 1000
        if len(target) > 2:
            d += abs(a.guidance_interval[0] - target[2][0]) + abs(a.guidance_interval[1] - target[2][1])
        return {"metrics": {"fd_classifier_2k": d, "class_accuracy_2k": 0.5}}
    return main


def test_the_planted_best_setting_and_runner_up_are_found(run, monkeypatch):
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    ranked = tune.main(["--run", str(run), "--guidance", "1,2,3", "--steps", "16,32", "--num_samples", "100",
                        "--confirm_samples", "0", "--features", "classifier"])
    assert len(calls) == 6 and all(a.reference is None and a.reference_split == "heldout" for a in calls)
    assert all(a.num_samples == 100 and a.features == "classifier" and a.untuned for a in calls)
    assert (ranked[0]["guidance_scale"], ranked[0]["steps"]) == (2.0, 16)
    assert (ranked[1]["guidance_scale"], ranked[1]["steps"]) == (2.0, 32)
    saved = json.loads((run / "tuned.json").read_text())
    assert saved["best"]["fd_classifier_2k"] == 1.0 and saved["runner_up"]["steps"] == 32 and len(saved["rows"]) == 6


def test_the_guidance_interval_is_searched_and_the_best_two_confirmed_on_fresh_seeds(run, monkeypatch, capsys):
    """The search (seed 0) ranks (2, 16, [0.1, 0.9]) first and (2, 16, [0, 1]) second; on the confirmation's fresh
    seeds the planted best is the runner-up of the search, and that is the one chosen."""
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls, best=(2.0, 16, [0.1, 0.9]), confirmed=(2.0, 16, [0.0, 1.0])))
    tune.main(["--run", str(run), "--guidance", "1,2", "--steps", "16", "--guidance_interval", "0,1", "0.1,0.9",
               "--num_samples", "100", "--confirm_samples", "50"])
    search, confirm = calls[:4], calls[4:]
    assert sorted((a.guidance_scale, tuple(a.guidance_interval)) for a in search) == [
        (1.0, (0.0, 1.0)), (1.0, (0.1, 0.9)), (2.0, (0.0, 1.0)), (2.0, (0.1, 0.9))]
    assert all(a.seed == 0 and a.num_samples == 100 for a in search)
    assert [(a.seed, a.num_samples, a.guidance_interval) for a in confirm] == [
        (b, 10, interval) for interval in ([0.1, 0.9], [0.0, 1.0]) for b in range(1, 6)]  # fresh seeds, same for both
    assert all(a.reference is None and a.reference_split == "heldout" and a.untuned for a in calls)
    saved = json.loads((run / "tuned.json").read_text())
    assert saved["best"]["guidance_interval"] == [0.0, 1.0] and saved["runner_up"]["guidance_interval"] == [0.1, 0.9]
    c = saved["confirm"]
    assert c["best"]["low"] < c["best"]["mean"] < c["best"]["high"] and c["difference"]["high"] < 0
    assert c["best"]["mean"] == pytest.approx(1 + 3 / 1000)  # seeds 1..5: 1 + seed / 1000 at the planted setting
    out = capsys.readouterr().out
    assert "chosen: guidance 2 in t [0, 1], 16 steps" in out and "95% interval" in out and "runner-up:" in out


@pytest.mark.parametrize("planted, note", [(3.0, "--guidance 3 is the largest of 1, 2, 3 searched"),
                                           (1.0, "--guidance 1 is the smallest of 1, 2, 3 searched"), (2.0, None)])
def test_a_best_setting_at_the_grids_edge_is_flagged(run, monkeypatch, capsys, planted, note):
    """A best at the end of a searched range may have a better one beyond it: said, and kept in tuned.json; a best
    inside the range, or on a setting searched at two values (always an end), is not flagged."""
    monkeypatch.setattr(eval_fid, "main", fake_eval([], best=(planted, 16)))
    tune.main(["--run", str(run), "--guidance", "1,2,3", "--steps", "16,32", "--num_samples", "100",
               "--confirm_samples", "0"])
    saved, out = json.loads((run / "tuned.json").read_text()), capsys.readouterr().out
    assert saved["best"]["guidance_scale"] == planted and saved["best"]["steps"] == 16
    assert saved["at_edge"] == ([] if note is None else [note + ": the best may lie beyond it; search past it"])
    assert ("at the grid's edge" in out) == (note is not None)


def test_defaults_are_the_runs_own_settings(run, monkeypatch):
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    tune.main(["--run", str(run)])
    assert [(a.guidance_scale, a.steps, a.guidance_interval) for a in calls] == [(3.0, 32, [0.0, 1.0])]


def write_tuned(run, model=None):
    best = {"guidance_scale": 1.5, "guidance_interval": [0.1, 0.9], "steps": 12, "phema_std": 0.1}
    (run / "tuned.json").write_text(json.dumps({"best": best, "model": model or {"checkpoint": None, "weights": "ema"}}))


@pytest.mark.parametrize("script", [eval_fid, sample])
def test_eval_fid_and_sample_take_the_tuned_setting_unless_a_flag_or_untuned_says_otherwise(run, script, monkeypatch,
                                                                                          capsys):
    write_tuned(run)
    parse = eval_fid.parse_args if script is eval_fid else sample.parse_args
    args = eval_fid.tuned_defaults(parse(["--run", str(run)]))
    assert (args.guidance_scale, args.guidance_interval, args.steps, args.phema_std) == (1.5, [0.1, 0.9], 12, 0.1)
    assert f"steps 12 ({run / 'tuned.json'})" in capsys.readouterr().out
    args = eval_fid.tuned_defaults(parse(["--run", str(run), "--steps", "7", "--guidance_interval", "0,1"]))
    assert (args.guidance_scale, args.guidance_interval, args.steps) == (1.5, [0.0, 1.0], 7)
    assert "steps 7 (--steps)" in capsys.readouterr().out
    args = eval_fid.tuned_defaults(parse(["--run", str(run), "--untuned"]))
    assert (args.guidance_scale, args.guidance_interval, args.steps, args.phema_std) == (None,) * 4
    args = eval_fid.tuned_defaults(parse(["--run", str(run), "--checkpoint", "latest"]))  # tuned for the export
    assert args.steps is None and "was chosen for" in capsys.readouterr().out

    class Loaded(Exception):
        pass

    def load_model(run_, checkpoint=None, weights="ema", phema_std=None):  # main's first use of the settings
        raise Loaded(phema_std)

    monkeypatch.setattr(eval_fid, "load_model", load_model)
    for flags, std in (([], 0.1), (["--phema_std", "0.05"], 0.05), (["--untuned"], None)):
        with pytest.raises(Loaded) as e:
            script.main(["--run", str(run), *flags])
        assert e.value.args[0] == std, flags


@pytest.mark.parametrize("extra", [["--reference_split", "test"], ["--reference", "fashion_mnist"],
                                   ["--reference_split", "train"]])
def test_selecting_on_anything_but_the_heldout_rows_is_refused_before_sampling(run, monkeypatch, extra):
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    with pytest.raises(ValueError, match="selected on the held-out rows of the training split only"):
        tune.main(["--run", str(run), "--guidance", "1,2", *extra])
    assert calls == []


def test_a_run_validated_on_a_test_split_is_refused(run, monkeypatch):
    (run / "config.json").write_text(json.dumps({"data": {"val_split": "test"}, "val": {"guidance_scale": 3.0, "steps": 8}}))  # noqa: E501
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    with pytest.raises(ValueError, match="the run's data.val_split: test"):
        tune.main(["--run", str(run)])
    assert calls == []


def test_the_phema_sweep_refuses_the_test_split_too(run, monkeypatch):
    monkeypatch.setattr(eval_fid, "load_model", lambda *a, **k: (None, json.loads((run / "config.json").read_text()), {}))
    monkeypatch.setattr(phema_tool, "list_snapshots", lambda folder: [])
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    with pytest.raises(ValueError, match="selected on the held-out rows"):
        phema_tool.main(["--run", str(run), "--sweep", "0.05,0.1", "--reference_split", "test"])
    assert calls == []
