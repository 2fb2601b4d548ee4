"""tools/tune.py: the grid of sampling settings scored on held-out rows, the best and the runner-up found, and
every attempt to select on the test split refused before any sampling (tools/phema.py --sweep alike)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import eval_fid  # noqa: E402
from tools import phema as phema_tool  # noqa: E402
from tools import tune  # noqa: E402


@pytest.fixture
def run(tmp_path):
    (tmp_path / "run").mkdir()
    cfg = {"data": {"val_split": None}, "val": {"guidance_scale": 3.0, "steps": 32}}
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "run"


def fake_eval(calls, best=(2.0, 16)):
    """eval_fid.main's stand-in: the distance is smallest at the planted setting `best`."""
    def main(argv, feature_fn=None):
        a = eval_fid.parse_args(argv)
        calls.append(a)
        return {"metrics": {"fd_classifier_2k": abs(a.guidance_scale - best[0]) + abs(a.steps - best[1]) / 100 + 1,
                            "class_accuracy_2k": 0.5}}
    return main


def test_the_planted_best_setting_and_runner_up_are_found(run, monkeypatch):
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    ranked = tune.main(["--run", str(run), "--guidance", "1,2,3", "--steps", "16,32", "--num_samples", "100",
                        "--features", "classifier"])
    assert len(calls) == 6 and all(a.reference is None and a.reference_split == "heldout" for a in calls)
    assert all(a.num_samples == 100 and a.features == "classifier" for a in calls)
    assert (ranked[0]["guidance_scale"], ranked[0]["steps"]) == (2.0, 16)
    assert (ranked[1]["guidance_scale"], ranked[1]["steps"]) == (2.0, 32)
    saved = json.loads((run / "tuned.json").read_text())
    assert saved["best"]["fd_classifier_2k"] == 1.0 and saved["runner_up"]["steps"] == 32 and len(saved["rows"]) == 6


def test_defaults_are_the_runs_own_settings(run, monkeypatch):
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    tune.main(["--run", str(run)])
    assert [(a.guidance_scale, a.steps) for a in calls] == [(3.0, 32)]


@pytest.mark.parametrize("extra", [["--reference_split", "test"], ["--reference", "fashion_mnist"],
                                   ["--reference_split", "train"]])
def test_selecting_on_anything_but_the_heldout_rows_is_refused_before_sampling(run, monkeypatch, extra):
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    with pytest.raises(ValueError, match="selected on the held-out rows of the training split only"):
        tune.main(["--run", str(run), "--guidance", "1,2", *extra])
    assert calls == []


def test_a_run_validated_on_a_test_split_is_refused(run, monkeypatch):
    (run / "config.json").write_text(json.dumps({"data": {"val_split": "test"}, "val": {"guidance_scale": 3.0, "steps": 8}}))
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
