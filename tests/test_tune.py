"""tools/tune.py: the grid of sampling settings scored on held-out rows, the best and the runner-up found and
confirmed on fresh seeds, every attempt to select on the test split refused before any sampling (tools/phema.py
--sweep alike), and the chosen setting the default of eval_fid.py and sample.py (a flag overrides it)."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import eval_fid  # noqa: E402
import sample  # noqa: E402
from tools import phema as phema_tool  # noqa: E402
from tools import tune  # noqa: E402
from training.evaluation import sampling, tuning  # noqa: E402
from training.evaluation.metrics import size_tag  # noqa: E402

CFG = {"data": {"val_split": None}, "val": {"guidance_scale": 3.0, "steps": 32, "guidance_interval": [0.0, 1.0],
                                            "sampler": "euler"}}


def weight_files(folder, names, value):
    """Stand-ins for weight files: one small tensor each (what tuning.model_identity hashes are the bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        save_file({"w": torch.full((4,), float(value))}, str(folder / name))


@pytest.fixture
def run(tmp_path):
    """A run folder with its config and an export (config and weight files), untrained: what tune.py reads."""
    run = tmp_path / "run"
    weight_files(run / "export" / "transformer", ["diffusion_pytorch_model.safetensors"], 1)
    weight_files(run / "export" / "conditioner", ["diffusion_pytorch_model.safetensors"], 2)
    for folder in (run, run / "export"):
        (folder / "config.json").write_text(json.dumps(CFG))
    return run


def add_checkpoint(run, step, value):
    """A checkpoint folder that checkpoints.find_checkpoint takes as intact, its weights all `value`."""
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    weight_files(ckpt, ["model.safetensors", "ema.safetensors", "optimizer.safetensors"], value)
    torch.save({"step": step, "config": CFG}, ckpt / "state.pt")
    return ckpt


def fake_eval(calls, best=(2.0, 16), confirmed=None, chatter=False):
    """eval_fid.main's stand-in: the distance is smallest at the planted setting `best` (guidance, steps[, interval])
    on the search's seed 0, and at `confirmed` on the confirmation's fresh seeds, if given; named with the sample
    count as eval_fid.py names it. chatter: it prints lines and a warning as eval_fid.py does."""
    def main(argv, feature_fn=None, written_by="eval_fid.py"):
        a = eval_fid.parse_args(argv)
        a.written_by = written_by
        calls.append(a)
        target = best if a.seed == 0 or confirmed is None else confirmed
        if a.guidance_scale is None:  # tools/phema.py --sweep: the run's own settings (a.phema_std varies)
            a.guidance_scale, a.steps = target[:2]
        d = abs(a.guidance_scale - target[0]) + abs(a.steps - target[1]) / 100 + 1 + a.seed / 1000
        if len(target) > 2:
            d += abs(a.guidance_interval[0] - target[2][0]) + abs(a.guidance_interval[1] - target[2][1])
        warnings = [f"fd_classifier's covariances have more dimensions (128) than images (the samples {a.num_samples})"]
        if chatter:
            print("eval_fid chatter: generate 1/10\nwarning: "
                  f"{warnings[0]}\nfd_classifier_{size_tag(a.num_samples)} {d}")
        n = size_tag(a.num_samples)
        return {"metrics": {f"fd_classifier_{n}": d, f"class_accuracy_{n}": 0.5},
                "warnings": warnings if chatter else [],
                "model": {"phema": {"profile_fit_error": 0.0}}, "samples_dir": "eval/x/samples"}
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
    assert saved["best"]["fd_classifier_100"] == 1.0 and saved["runner_up"]["steps"] == 32 and len(saved["rows"]) == 6


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
        (b, 10, interval) for b in range(1, 6) for interval in ([0.1, 0.9], [0.0, 1.0])]  # fresh seeds, same for both
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


def write_tuned(run):
    """tuned.json as tools/tune.py writes it for the run's export sampled by Euler."""
    best = {"guidance_scale": 1.5, "guidance_interval": [0.1, 0.9], "steps": 12, "phema_std": 0.1}
    (run / "tuned.json").write_text(json.dumps({"best": best, "model": tuning.model_identity(run), "sampler": "euler"}))


@pytest.mark.parametrize("script", [eval_fid, sample])
def test_eval_fid_and_sample_take_the_tuned_setting_unless_a_flag_or_untuned_says_otherwise(run, script, monkeypatch,
                                                                                          capsys):
    write_tuned(run)
    parse = eval_fid.parse_args if script is eval_fid else sample.parse_args
    args = tuning.tuned_defaults(parse(["--run", str(run)]))
    assert (args.guidance_scale, args.guidance_interval, args.steps, args.phema_std) == (1.5, [0.1, 0.9], 12, 0.1)
    assert f"steps 12 ({run / 'tuned.json'})" in capsys.readouterr().out
    args = tuning.tuned_defaults(parse(["--run", str(run), "--steps", "7", "--guidance_interval", "0,1"]))
    assert (args.guidance_scale, args.guidance_interval, args.steps) == (1.5, [0.0, 1.0], 7)
    assert "steps 7 (--steps)" in capsys.readouterr().out
    args = tuning.tuned_defaults(parse(["--run", str(run), "--untuned"]))
    assert (args.guidance_scale, args.guidance_interval, args.steps, args.phema_std) == (None,) * 4
    add_checkpoint(run, 10, 3)
    args = tuning.tuned_defaults(parse(["--run", str(run), "--checkpoint", "latest"]))  # tuned for the export
    assert args.steps is None and "was chosen for other weights, export (ema" in capsys.readouterr().out

    class Loaded(Exception):
        pass

    def load_model(run_, checkpoint=None, weights="ema", phema_std=None):  # main's first use of the settings
        raise Loaded(phema_std)

    monkeypatch.setattr(sampling, "load_model", load_model)
    for flags, std in (([], 0.1), (["--phema_std", "0.05"], 0.05), (["--untuned"], None)):
        with pytest.raises(Loaded) as e:
            script.main(["--run", str(run), *flags])
        assert e.value.args[0] == std, flags


def test_tuned_json_holds_for_the_model_it_was_chosen_for_not_for_the_name_it_was_given(run, monkeypatch, capsys):
    """Tuned with --checkpoint latest: every evaluation samples that checkpoint, and the same checkpoint named by its
    path takes the choice; raw weights, the Heun sampler and the export do not; after more training 'latest' is
    another model and does not either."""
    first = add_checkpoint(run, 100, 3)
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    tune.main(["--run", str(run), "--guidance", "1,2", "--steps", "16", "--num_samples", "100",
               "--confirm_samples", "0",
               "--checkpoint", "latest"])
    assert len(calls) == 2 and all(Path(a.checkpoint) == first for a in calls)  # 'latest' pinned when the search began
    saved = json.loads((run / "tuned.json").read_text())
    assert (saved["model"]["model"], saved["model"]["step"], saved["sampler"]) == \
        ("checkpoints/step_00000100", 100, "euler")

    def steps(*flags):
        return tuning.tuned_defaults(eval_fid.parse_args(["--run", str(run), *flags])).steps

    assert steps("--checkpoint", "latest") == 16 and steps("--checkpoint", str(first)) == 16
    assert steps("--checkpoint", str(first), "--sampler", "euler") == 16
    capsys.readouterr()
    assert steps("--checkpoint", str(first), "--sampler", "heun") is None
    assert "was chosen for the euler sampler, not heun: its settings are not used" in capsys.readouterr().out
    assert steps("--checkpoint", str(first), "--weights", "raw") is None and steps() is None
    add_checkpoint(run, 200, 4)  # the run trained on
    capsys.readouterr()
    assert steps("--checkpoint", "latest") is None
    assert ("was chosen for other weights, checkpoints/step_00000100 at step 100 (ema, weights sha256 "
            f"{saved['model']['sha256'][:12]}), not checkpoints/step_00000200 at step 200") in capsys.readouterr().out


def test_help_lists_what_goes_to_eval_fid_and_its_description_is_whole(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--help"])
    out = capsys.readouterr().out
    assert "then the best two confirmed at the full count.\n" in out  # the first paragraph, whole
    passed = out.split("passed on to eval_fid.py in every evaluation, as they are:")[1]
    for flag in ("--classifier", "--features", "--checkpoint", "--weights", "--sampler", "--seed", "--batch_size"):
        assert f"  {flag} " in passed, flag
    # tune's own, refused
    for flag in ("--reference ", "--reference_split", "--guidance_scale", "--untuned", "--out_dir"):
        assert flag not in passed, flag


def test_a_run_prints_a_line_per_evaluation_each_warning_once_and_names_the_confirmation_by_its_count(run, monkeypatch,
                                                                                                   capsys):
    """eval_fid.py's own lines are kept back (shown when it fails), its warnings printed once each, the confirmation
    headed block by block, and a confirmed score named with the block's sample count, not the search's."""
    monkeypatch.setattr(eval_fid, "main", fake_eval([], chatter=True))
    tune.main(["--run", str(run), "--guidance", "1,2", "--steps", "16,32", "--num_samples", "100",
               "--confirm_samples", "50"])
    out = capsys.readouterr().out
    assert "chatter" not in out and len(out.splitlines()) < 30
    assert out.count("more dimensions (128) than images (the samples 100)") == 1  # 4 search evaluations
    assert out.count("more dimensions (128) than images (the samples 10)") == 1  # 10 confirmation evaluations
    assert [line.split(" (")[0] for line in out.splitlines() if line.startswith("confirm block")] == [
        f"confirm block {b}/5" for b in range(1, 6)]
    assert "confirm block 3/5 (seed 3, 10 samples each): fd_classifier_10 " in out
    chosen = next(line for line in out.splitlines() if line.startswith("chosen:"))
    assert "fd_classifier_10 1.0030 (95% interval" in chosen and "fd_classifier_100" not in chosen
    saved = json.loads((run / "tuned.json").read_text())
    assert saved["confirm"]["metric"] == saved["best"]["confirmed"]["metric"] == "fd_classifier_10"
    assert saved["metric"] == "fd_classifier_100" and saved["best"]["fd_classifier_100"] == 1.0

    def failing(argv, feature_fn=None, written_by=None):
        print("eval_fid's last words")
        raise ValueError("broken")

    monkeypatch.setattr(eval_fid, "main", failing)
    with pytest.raises(ValueError, match="broken"):
        tune.main(["--run", str(run), "--num_samples", "100", "--confirm_samples", "0"])
    assert "eval_fid's last words" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--reference_split", "test"], ["--reference", "fashion_mnist"],
                                   ["--reference_split", "train"]])
def test_selecting_on_anything_but_the_heldout_rows_is_refused_before_sampling(run, monkeypatch, extra):
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    with pytest.raises(ValueError, match="selected on the held-out rows of the training split only"):
        tune.main(["--run", str(run), "--guidance", "1,2", *extra])
    assert calls == []


def test_a_run_validated_on_a_test_split_is_refused(run, monkeypatch):
    (run / "config.json").write_text(json.dumps({"data": {"val_split": "test"},
                                                 "val": {"guidance_scale": 3.0, "steps": 8}}))  # noqa: E501
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    with pytest.raises(ValueError, match="the run's data.val_split: test"):
        tune.main(["--run", str(run)])
    assert calls == []


def test_the_phema_sweep_refuses_the_test_split_too(run, monkeypatch):
    cfg = json.loads((run / "config.json").read_text())
    monkeypatch.setattr(phema_tool, "load_model", lambda *a, **k: (None, cfg, {}))
    monkeypatch.setattr(phema_tool, "list_snapshots", lambda folder: [])
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    with pytest.raises(ValueError, match="selected on the held-out rows"):
        phema_tool.main(["--run", str(run), "--sweep", "0.05,0.1", "--reference_split", "test"])
    assert calls == []


def test_tune_and_the_phema_sweep_say_that_they_ran_each_evaluation(run, monkeypatch):
    """The model card leaves out the reports that chose a setting on the held-out rows by what wrote them, never by
    their settings (issue 68): every eval_fid.py run of tools/tune.py and tools/phema.py --sweep records its name."""
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls))
    tune.main(["--run", str(run), "--guidance", "1,2", "--num_samples", "100", "--confirm_samples", "10"])
    assert len(calls) == 2 + 2 * tune.CONFIRM_BLOCKS and {a.written_by for a in calls} == {"tools/tune.py"}
    cfg = json.loads((run / "config.json").read_text())
    monkeypatch.setattr(phema_tool, "load_model", lambda *a, **k: (None, cfg, {}))
    monkeypatch.setattr(phema_tool, "list_snapshots", lambda folder: [])
    (run / "phema").mkdir()
    calls.clear()
    phema_tool.main(["--run", str(run), "--sweep", "0.05,0.1"])
    assert [a.phema_std for a in calls] == [0.05, 0.1] and {a.written_by for a in calls} == {"tools/phema.py"}


def test_a_meanflow_models_step_count_is_searched_by_default(tmp_path, monkeypatch):
    """The meanflow sampler (objective.meanflow): 1, 2 and 4 steps searched without --steps, the planted best (2)
    chosen and recorded for that sampler; eval_fid.py then samples it at 2 steps."""
    cfg = {**CFG, "val": {**CFG["val"], "sampler": "meanflow", "steps": 1, "guidance_scale": 1.0}}
    run = tmp_path / "run"
    weight_files(run / "export" / "transformer", ["diffusion_pytorch_model.safetensors"], 1)
    for folder in (run, run / "export"):
        (folder / "config.json").write_text(json.dumps(cfg))
    calls = []
    monkeypatch.setattr(eval_fid, "main", fake_eval(calls, best=(1.0, 2)))
    ranked = tune.main(["--run", str(run), "--num_samples", "100", "--confirm_samples", "0"])
    assert sorted(a.steps for a in calls) == [1, 2, 4] and all(a.guidance_scale == 1.0 for a in calls)
    assert ranked[0]["steps"] == 2 and json.loads((run / "tuned.json").read_text())["sampler"] == "meanflow"
    args = tuning.tuned_defaults(eval_fid.parse_args(["--run", str(run)]))
    assert args.steps == 2
