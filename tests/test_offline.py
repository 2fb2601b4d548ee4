"""Offline nodes: prefetch.py's plan names everything a config needs (computed without network), its fetches go
through the trainers' own loading calls, and a model missing on an offline node stops the run with one line
naming the config key and prefetch.py, not a traceback."""
import os
import subprocess
import sys

import pytest

from training.config import config
from training.evaluation import reference
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import prefetch  # noqa: E402


def plan_of(recipe, *overrides):
    cfg = config.load_config(prefetch.all_defaults(prefetch.train_flow_matching.DEFAULTS,
                                                   prefetch.train_ddpm.DEFAULTS),
                             ["--config", str(ROOT / "configs" / f"{recipe}.json"), *overrides], "prefetch")
    return [(item["key"], item["name"], item.get("split"), item["local"]) for item in prefetch.plan(cfg)]


INCEPTION = ("val.inception_weights", reference.INCEPTION_URL, None, False)


def test_plan_names_dataset_splits_encoders_clip_and_inception_without_network():
    assert plan_of("imagenet256") == [
        ("data.source", "ILSVRC/imagenet-1k", "train", False),
        ("data.source", "ILSVRC/imagenet-1k", "validation", False),  # the held-out split is a split of its own
        ("encoders.vae", "stabilityai/sd-vae-ft-ema", None, False), INCEPTION]
    assert plan_of("cc12m") == [
        ("data.source", "pixparse/cc12m-wds", "train", False),  # held-out rows come from the train split
        ("encoders.vae", "stabilityai/sd-vae-ft-ema", None, False),
        ("encoders.text_encoder", "openai/clip-vit-large-patch14", None, False),
        ("eval_fid.py --clip_model", "openai/clip-vit-large-patch14", None, False), INCEPTION]
    assert plan_of("imagenet22k_captions_256")[-2][0] == "eval_fid.py --clip_model"  # class names as captions
    assert plan_of("demo") == [INCEPTION]  # the embedded data and pixel space need nothing else


def test_plan_marks_local_paths_instead_of_fetching_them(tmp_path, tiny_vae):
    (tmp_path / "weights.pt").write_bytes(b"")
    plan = plan_of("own_data_256", f"--data.source={tmp_path}", f"--encoders.vae={tiny_vae}",
                   f"--val.inception_weights={tmp_path / 'weights.pt'}")
    assert plan == [("data.source", str(tmp_path), "train", True), ("encoders.vae", tiny_vae, None, True),
                    ("val.inception_weights", str(tmp_path / "weights.pt"), None, True)]


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prefetch, "fetch", lambda *a: pytest.fail("a dry run fetched something"))
    items = prefetch.main(["--config", str(ROOT / "configs" / "cc12m.json"), "--dry_run", "--val.steps=10"])
    out = capsys.readouterr().out
    assert len(items) == 5 and "plan only" in out
    assert "encoders.text_encoder      openai/clip-vit-large-patch14  (text encoder and tokenizer; fetch)" in out


def test_dino_is_planned_when_asked_and_fetched_through_eval_fids_call(tmp_path, monkeypatch, capsys):
    from test_metrics import make_tiny_dinov2

    monkeypatch.setattr(prefetch, "fetch", lambda *a: pytest.fail("a dry run fetched something"))
    cc12m = ["--config", str(ROOT / "configs" / "cc12m.json"), "--dry_run"]
    for flags, name in ((["--dino"], "facebook/dinov2-base"),
                        (["--dino", "facebook/dinov2-large"], "facebook/dinov2-large"),
                        (["--dino=facebook/dinov2-small", "--val.steps=10"], "facebook/dinov2-small"),
                        (["--val.fid_dino=facebook/dinov2-giant"], "facebook/dinov2-giant")):
        items = prefetch.main([*cc12m, *flags])
        assert [i["name"] for i in items if i["key"] == "eval_fid.py --dino"] == [name], flags
    assert "DINOv2 model of FD-DINOv2; fetch" in capsys.readouterr().out
    assert not any(i["key"] == "eval_fid.py --dino" for i in prefetch.main(cc12m))  # not unless asked
    monkeypatch.undo()
    tiny = make_tiny_dinov2(tmp_path / "dino")
    cfg = config.load_config(prefetch.train_flow_matching.DEFAULTS, [])
    assert prefetch.fetch({"key": "eval_fid.py --dino", "name": tiny}, cfg, None) == "loaded"


def test_fetch_goes_through_the_trainers_loading_calls(tmp_path, tiny_vae, tiny_text_encoder):
    """Each item is fetched by the call the trainer makes later, so the offline node finds those files."""
    cfg = config.load_config(prefetch.train_flow_matching.DEFAULTS, ["--data.demo_samples=40"])
    dataset = {"key": "data.source", "name": "embedded", "split": "train"}
    assert prefetch.fetch(dataset, cfg, None) == "40 rows"
    for key, name in (("encoders.vae", tiny_vae), ("encoders.text_encoder", tiny_text_encoder)):
        assert prefetch.fetch({"key": key, "name": name}, cfg, None) == "loaded"
    inception = tmp_path / reference.INCEPTION_FILE
    inception.write_bytes(b"already here")  # present: not downloaded again
    assert prefetch.fetch({"key": "val.inception_weights", "name": "http://unreachable.invalid/x"}, cfg,
                          inception) == str(inception)


def run_offline(code, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_a_model_that_cannot_be_loaded_is_one_line_naming_the_key():
    def missing(name, **kwargs):
        raise OSError(f"{name} does not appear to have a file named config.json.\nCheckout your internet ...")

    with pytest.raises(SystemExit) as stop:
        prefetch.encoders.from_pretrained("encoders.vae", missing, "org/vae", use_safetensors=True)
    message = str(stop.value)
    assert "\n" not in message and message.startswith("encoders.vae='org/vae' cannot be loaded: org/vae does not "
                                                      "appear to have a file named config.json")
    assert "python tools/prefetch.py --config" in message and "set encoders.vae to a local folder" in message
    assert prefetch.encoders.from_pretrained("k", lambda name, **kw: (name, kw), "x", a=1) == ("x", {"a": 1})


@pytest.mark.slow
def test_a_missing_text_encoder_offline_is_one_line_naming_the_key(tmp_path):
    done = run_offline("from training.config import config\nfrom training.data import encoders\n"
                       "encoders.load_encoders(config.Config(vae=None, text_encoder='nonexistent-org/no-such-encoder', "
                       "max_tokens=8), 'cpu')", tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "nonexistent-org" in line]
    assert len(lines) == 1 and lines[0].startswith("encoders.text_encoder='nonexistent-org/no-such-encoder' "
                                                   "cannot be loaded")
    assert "HF_HUB_OFFLINE=1" in lines[0] and "python tools/prefetch.py --config" in lines[0]


@pytest.mark.slow
def test_a_trainer_with_a_missing_vae_offline_stops_with_one_line(tmp_path):
    """The trainer reads the VAE's config in its start-up checks: that is where the line must come from."""
    done = run_offline("import runpy, sys\nsys.argv = ['train_flow_matching.py', '--encoders.vae=nonexistent-org/"
                       f"no-such-vae', '--log.wandb=off', '--run_dir={tmp_path / 'run'}']\n"  # as `python train_...`
                       f"runpy.run_path({str(ROOT / 'train_flow_matching.py')!r}, run_name='__main__')", tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = [line.strip() for line in done.stderr.splitlines() if "nonexistent-org" in line]  # one problem line
    assert len(lines) == 1 and lines[0].startswith("encoders.vae='nonexistent-org/no-such-vae' cannot be loaded")
    assert "prefetch.py" in lines[0] and not (tmp_path / "cache").exists()  # stopped before any work


def test_prefetch_reports_each_failure_says_what_to_copy_and_fails(tmp_path, monkeypatch, capsys):
    """The run after fetching, with the network faked: one item fails as a gated dataset does."""
    import datasets
    from huggingface_hub import constants

    for module, name, value in ((constants, "HF_HOME", str(tmp_path)), (constants, "HF_HUB_OFFLINE", False),
                                (constants, "HF_HUB_CACHE", str(tmp_path / "hub")),
                                (datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))):
        monkeypatch.setattr(module, name, value)

    def fake_fetch(item, cfg, inception_file):
        if item["key"] == "data.source":
            raise ConnectionError("Dataset 'ILSVRC/imagenet-1k' is a gated dataset on the Hub. You must be "
                                  "authenticated to access it.\nmore lines")
        (tmp_path / "hub").mkdir(exist_ok=True)
        (tmp_path / "hub" / item["key"]).write_bytes(b"x" * 1000)
        return "loaded"

    monkeypatch.setattr(prefetch, "fetch", fake_fetch)
    with pytest.raises(SystemExit) as stop:
        prefetch.main(["--config", str(ROOT / "configs" / "imagenet256.json")])
    assert str(stop.value) == "prefetch: 2 of 4 failed: data.source (split train), data.source (split validation)"
    out = capsys.readouterr().out
    assert "data.source: FAILED: Dataset 'ILSVRC/imagenet-1k' is a gated dataset on the Hub" in out
    assert "accept its terms on its hub page (https://huggingface.co/datasets/ILSVRC/imagenet-1k" in out
    assert "encoders.vae: loaded" in out and "val.inception_weights: loaded" in out
    assert f"Copy {tmp_path} (0.0 GB)" in out and "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1" in out
    assert f"--val.inception_weights=$HF_HOME/{reference.INCEPTION_FILE}" in out


def test_prefetch_refuses_to_run_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(prefetch, "fetch", lambda *a: pytest.fail("fetched offline"))
    with pytest.raises(SystemExit, match="HF_HUB_OFFLINE is set: prefetch needs the network"):
        prefetch.main(["--config", str(ROOT / "configs" / "demo.json")])
