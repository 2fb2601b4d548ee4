"""The config: layers and overrides, every bad value caught before any work in one message, --help generated
from the trainers' DEFAULTS and comments, --print_config, and budgets that cannot work."""
import json
import os
import subprocess
import sys

import pytest
import torch

import common
from training.config import config
from training.data import cache, sources
from training.run import checkpoints
import train_ddpm as ddpm
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args


def test_config_layers_and_dotted_overrides(tmp_path):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"train": {"lr": 1e-4, "batch_size": 8}, "data": {"caption_column": None}}))
    cfg = config.load_config(fm.DEFAULTS, ["--config", str(recipe), "--train.lr=3e-4", "--model.num_layers", "2",
                                           "--run_dir=/x/y", "--train.betas=[0.9, 0.95]"])
    assert cfg.train.lr == 3e-4 and cfg.train.batch_size == 8 and cfg.model.num_layers == 2
    assert cfg.run_dir == "/x/y" and cfg.train.betas == [0.9, 0.95] and cfg.data.caption_column is None
    assert cfg.train.warmup_steps == fm.DEFAULTS["train"]["warmup_steps"]  # untouched defaults stay
    assert isinstance(cfg.train.lr, float)
    assert fm.DEFAULTS["train"]["lr"] == 2e-3  # the defaults themselves are never mutated (the demo's lr)
    json.dumps(cfg)  # the resolved config is plain JSON


@pytest.mark.parametrize("argv,message", [
    (["--train.lrr=1"], "unknown config key 'train.lrr'"),
    (["--trian.lr=1"], "unknown config key 'trian'"),
    (["--train.batch_size=8.5"],
     r"train.batch_size=8.5 must be a whole number >= 1 or 'auto' \(from --train.batch_size=8.5\)"),
    (["--train.compile=1"], "train.compile=1 must be true or false"),
    (["--train.lr=fast"], "train.lr='fast' must be a number >= 0"),
    (["--train=3"], "'train' .* must be a section"),
    (["--model.num_layers=null"], "model.num_layers=None must be a whole number >= 1"),
    (["stray"], "unexpected argument"),
])
def test_config_errors_name_the_key(argv, message):
    with pytest.raises(ValueError, match=message):
        config.load_config(fm.DEFAULTS, argv, schema=fm.CONFIG)


def test_config_errors_in_a_file_name_the_file(tmp_path):
    recipe = tmp_path / "bad.json"
    recipe.write_text(json.dumps({"data": {"resolutoin": 64}}))
    with pytest.raises(ValueError, match=r"unknown config key 'data.resolutoin' \(from .*bad.json\)"):
        config.load_config(fm.DEFAULTS, ["--config", str(recipe)])
    with pytest.raises(config.ConfigError, match="config file not found: .*missing.json"):
        config.load_config(fm.DEFAULTS, ["--config", str(tmp_path / "missing.json")])


BAD = [  # (trainer, arguments, what the message must say); "{tmp}" is the test's folder
    (fm, ["--train.lr=-1"], r"train.lr=-1.0 must be a number >= 0"),
    (fm, ["--conditioning.zero_padding=true"],
     r"conditioning.zero_padding=true and conditioning.replicate_padding=true"),
    (fm, ["--train.betas=[0.9]"], r"train.betas=\[0.9\] must be a list of 2, each in \[0, 1\) \(from"),
    (fm, ["--data.cache_dtype=float99"], r"data.cache_dtype='float99' must be 'float16' or 'bfloat16' or 'float32'"),
    (fm, ["--model.patch_size=0"], r"model.patch_size=0 must be a number >= 1"),
    (fm, ["--log.every=0"], r"log.every=0 must be a number >= 1"),
    (fm, ["--ckpt.every=0"], r"ckpt.every=0 must be a number >= 1"),
    (fm, ["--config", "{tmp}/malformed.json"], r"malformed.json: line 2, column 28: malformed JSON"),
    (fm, ["--config", "{tmp}/list.json"], r"list.json must hold a JSON object of config sections, got a list"),
    (fm, ["--config", "{tmp}/missing.json"], r"config file not found: .*missing.json"),
    (fm, ["--data.crop=middle"], r"data.crop='middle' must be 'center' or 'random' or 'random_resized'"),
    (fm, ["--train.ema_decay=1.5"], r"train.ema_decay=1.5 must be in \[0, 1\]"),
    (fm, ["--val.steps=0"], r"val.steps=0 must be a number >= 1"),
    (fm, ["--val.sampler=dpm"], r"val.sampler='dpm' must be 'euler' or 'heun' or 'meanflow'"),
    (fm, ["--val.every=0"], r"val.every=0 must be a number >= 1"),
    (fm, ["--train.max_nonfinite_steps=0"], r"train.max_nonfinite_steps=0 must be a number >= 1"),
    (fm, ["--data.shard_size=0"], r"data.shard_size=0 must be a number >= 1"),
    (fm, ["--train.grad_clip=0"], r"train.grad_clip=0.0 must be a number > 0"),
    (fm, ["--data.min_image_side=0"], r"data.min_image_side=0 must be a number >= 1"),
    (fm, ["--val.num_samples=0"], r"val.num_samples=0 must be a number >= 1"),
    (fm, ["--objective.time_sampling=beta"], r"objective.time_sampling='beta' must be 'logit_normal' or 'uniform'"),
    (fm, ["--data.resolution=15"], r"data.resolution=15 is not divisible by model.patch_size=2"),
    (fm, ['--conditioning.controls=["zoom"]'],
     r"conditioning.controls=\['zoom'\] must be a list, each 'size' or 'crop' or 'flip'"),
    (fm, ["--conditioning.semantic_dropout=1.5"], r"conditioning.semantic_dropout=1.5 must be in \[0, 1\]"),
    (fm, ["--data.cache_views=0"], r"data.cache_views=0 must be a number >= 1"),
    (fm, ["--data.cache_views=2"], r"data.cache_views=2 caches that many crops per image, and data.crop='center'"),
    (fm, ["--data.demo_sizes=[32, 8]"], r"data.demo_sizes=\[32, 8\] must be \[lo, hi\] with lo <= hi"),
    (fm, ["--data.demo_render=band_limited"],
     r"data.demo_render='band_limited' draws each image at a native side: set data.demo_sizes"),
    (ddpm, ["--data.demo_render=colour_by_size", "--data.demo_sizes=[10, 32]"],
     r"data.demo_sizes=\[10, 32\] must cover \[8, 32\]"),
    (fm, ["--conditioning.mode=film"], r"conditioning.mode='film' must be 'disentangled' or 'both' or 'adanorm'"),
    (fm, ["--conditioning.control_power.crop=-1"], r"conditioning.control_power.crop=-1.0 must be a number >= 0"),
    (fm, ["--conditioning.pooled_text=maybe"], r"conditioning.pooled_text='maybe' must be true or false \(or null\)"),
    (fm, ["--train.lr_schedule=step"], r"train.lr_schedule='step' must be 'constant' or 'cosine' or 'linear'"),
    (fm, ["--log.wandb=yes"], r"log.wandb='yes' must be 'auto' or 'online' or 'offline' or 'off'"),
    (fm, ["--data.max_samples=2.5"], r"data.max_samples=2.5 must be a whole number >= 1"),
    (fm, ["--resume=/nonexistent/step_5"], r"resume='/nonexistent/step_5' must be 'latest' or a checkpoint folder"),
    (fm, ["--init_from=/nonexistent/run"], r"init_from='/nonexistent/run': no such run"),
    (fm, ["--model.qk_norm=batch_norm"], r"model.qk_norm='batch_norm' must be 'rms_norm' or 'layer_norm'"),
    (fm, ["--data.val_split=3"], r"data.val_split=3 must be a string \(or null\)"),
    (fm, ["--train.warmup_steps=-1"], r"train.warmup_steps=-1 must be a number >= 0"),
    (fm, ["--data.num_workers=-1"], r"data.num_workers=-1 must be a number >= 0"),
    (fm, ["--encoders.vae=/nonexistent/vae"],
     r"encoders.vae='/nonexistent/vae' is not a folder: build it with `python tools/autoencoder.py"),
    (fm, ["--data.class_ids=imagenet-99k"],
     r"data.class_ids='imagenet-99k' must be 'imagenet-1k', 'imagenet-22k' or a file"),
    (fm, ["--data.label_column=null"], r"set data.label_column \(class-conditional\) or data.caption_column"),
    (fm, ["--data.caption_column=caption"], r"encoders.text_encoder goes with data.caption_column"),
    (fm, ["--train.lrr=1"], r"unknown config key 'train.lrr'"),
    (fm, ["--train.compile=1"], r"train.compile=1 must be true or false"),
    (fm, ["--val.fid_every=10", "--val.inception_weights=/nonexistent.pt"],
     r"val.inception_weights='/nonexistent.pt': no such file"),
    (ddpm, ["--objective.prediction=epsilon"], r"objective.prediction='epsilon' must be 'v' or 'eps' or 'x0'"),
    (ddpm, ["--objective.prediction=eps"], r"objective.zero_terminal_snr=true cannot be combined"),
    (ddpm, ["--objective.beta_schedule=sigmoid"], r"objective.beta_schedule='sigmoid' must be 'quadratic'"),
    (ddpm, ["--val.sampler=euler"], r"val.sampler='euler' must be 'ddim' or 'ddpm'"),
    (ddpm, ["--val.steps=2000"], r"val.steps=2000 must be in \[1, objective.num_timesteps=1000\]"),
    (ddpm, ["--objective.beta_start=0.02"], r"objective.beta_start=0.02 must be below objective.beta_end=0.012"),
    (ddpm, ["--val.guidance_rescale=2"], r"val.guidance_rescale=2.0 must be in \[0, 1\]"),
    (fm, ["--val.prompts={tmp}/no_prompts.txt"], r"val.prompts=.*no_prompts.txt.*: no such file"),
    (fm, ["--data.val_shards=[-1]"], r"data.val_shards=\[-1\] must be a list of 2, each a whole number or null"),
    # stability (training/run/stability.py)
    (fm, ["--objective.time_sampling=adaptve"],
     r"objective.time_sampling='adaptve' must be 'logit_normal' or 'uniform' or 'adaptive'"),
    (ddpm, ["--objective.timestep_sampling=adaptive_"],
     r"objective.timestep_sampling='adaptive_' must be 'uniform' or 'adaptive'"),
    (ddpm, ["--objective.min_snr_form=floored"],
     r"objective.min_snr_form='floored' must be 'plus_one' or 'paper' or 'floor'"),
    (fm, ["--objective.adaptive_mix=0"], r"objective.adaptive_mix=0.0 must be in \(0, 1\]"),
    (fm, ["--objective.adaptive_bins=1"], r"objective.adaptive_bins=1 must be a number >= 2"),
    (fm, ["--train.grad_clip_mode=percentile"], r"train.grad_clip_mode='percentile' must be 'norm' or 'adaptive'"),
    (fm, ["--train.grad_clip_percentile=0"], r"train.grad_clip_percentile=0.0 must be in \(0, 100\]"),
    (fm, ["--train.on_divergence=restart"], r"train.on_divergence='restart' must be 'stop' or 'rollback'"),
    (ddpm, ["--train.rollback_lr_factor=2"], r"train.rollback_lr_factor=2.0 must be in \(0, 1\]"),
    (fm, ["--val.slope_window=2"], r"val.slope_window=2 must be a number >= 3"),
    # the training options (training/objectives/xprediction.py, contrastive.py, repa.py)
    (fm, ["--objective.prediction=eps"], r"objective.prediction='eps' must be 'v' or 'x0'"),
    (fm, ["--objective.contrastive_weight=1"], r"objective.contrastive_weight=1.0 must be in \[0, 1\)"),
    (fm, ["--objective.contrastive_weight=0.05", "--train.batch_size=1"], r"train.batch_size=1 has none"),
    (fm, ["--objective.repa_weight=0.5", "--objective.repa_encoder={tmp}/no_encoder"],
     r"objective.repa_encoder='.*no_encoder' cannot be loaded"),
    (ddpm, ["--objective.repa_weight=0.5", "--objective.repa_block=9"],
     r"objective.repa_block=9 is past the model's last block \(model.num_layers=2\): choose 1 .. 2"),
    (fm, ["--objective.repa_projector=linear"], r"objective.repa_projector='linear' must be 'mlp' or 'conv'"),
    (ddpm, ["--objective.repa_targets=disk"], r"objective.repa_targets='disk' must be 'cache' or 'on_the_fly'"),
    (ddpm, ["--objective.repa_weight=-0.5"], r"objective.repa_weight=-0.5 must be a number >= 0"),
    # a single value for a list key says "a list", with the list of it where that works; another trainer's key, whose
    (fm, ["--data.buckets=1.5"], r"data.buckets=1.5 must be 'auto' or a list, each a number > 0 \(or null\), e.g. "
                                 r"\[1.5\] \(from --data.buckets=1.5\)"),
    (fm, ["--ckpt.phema_stds=0.5"], r"ckpt.phema_stds=0.5 must be a list, each in \(0, 0.28\] \(from"),
    (fm, ["--train.betas=0.9"], r"train.betas=0.9 must be a list of 2, each in \[0, 1\) \(from"),
    (ddpm, ["--objective.meanflow=true"],
     r"unknown config key 'objective.meanflow' \(from --objective.meanflow=true\): MeanFlow is flow matching's option "
     r"\(.*\): use train_flow_matching.py"),
]
if not torch.cuda.is_available():
    BAD.append((fm, ["--train.mixed_precision=fp16"], r"train.mixed_precision='fp16' needs a CUDA GPU"))


@pytest.fixture
def no_work(monkeypatch):
    """Any step past the config check (accelerator, encoders, data) fails the test."""
    def work(*args, **kwargs):
        raise AssertionError("work started before the config was refused")

    monkeypatch.setattr(sources, "open_splits", work)  # what both trainers call first
    monkeypatch.setattr(cache, "load_encoders", work)  # what cache.frozen_encoders calls
    monkeypatch.setattr(common, "make_accelerator", work)


@pytest.mark.parametrize("trainer,args,message", BAD, ids=[" ".join(a)[:60] for _, a, _ in BAD])
def test_every_bad_config_is_refused_before_any_work(tmp_path, no_work, trainer, args, message):
    assert len(BAD) >= 30
    (tmp_path / "malformed.json").write_text('{"train": {"lr": 1e-4},\n "data": {"resolution": 32,}}')
    (tmp_path / "list.json").write_text("[1, 2]")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(config.ConfigError, match=message):
        trainer.main(tiny_run_args(tmp_path) + args)
    assert not (tmp_path / "run").exists()  # not even the run folder


def test_all_problems_are_reported_at_once(no_work, tmp_path):
    with pytest.raises(config.ConfigError) as err:
        fm.main(tiny_run_args(tmp_path)
                + ["--train.lr=-1", "--data.crop=middle", "--log.every=0", "--train.batch_size=0"])
    message = str(err.value)
    assert message.startswith("invalid config (4 problems):")
    for key in ("train.lr", "data.crop", "log.every", "train.batch_size"):
        assert f"\n  {key}=" in message


@pytest.mark.parametrize("trainer", [fm, ddpm], ids=["flow_matching", "ddpm"])
def test_every_options_problem_is_reported_with_the_others_at_once(no_work, tmp_path, tiny_vae, tiny_dino, trainer):
    """One bad key of each option, each checked in its own module and handed to the loader by the trainer
    (sections.schema's checks): the encoders (a resolution the VAE's patches do not divide), sharding, REPA, the
    trainer's objective (contrastive flow matching; DDPM's eps with zero terminal SNR), and a shared combination,
    all in one ConfigError."""
    own = {fm: (["--objective.contrastive_weight=0.05", "--train.batch_size=1"], "objective.contrastive_weight=0.05"),
           ddpm: (["--objective.prediction=eps", "--objective.zero_terminal_snr=true"],
                  "objective.zero_terminal_snr=true")}
    args, own_message = own[trainer]
    with pytest.raises(config.ConfigError) as err:
        trainer.main(tiny_run_args(tmp_path) + args + [
            "--encoders.vae", tiny_vae, "--data.resolution=18",  # encoders: 18 px is not 4 px patches of latents
            "--train.sharding=fsdp", "--train.ema_device=cpu",  # sharding
            "--objective.repa_weight=0.5", f"--objective.repa_encoder={tiny_dino}", "--objective.repa_block=99",  # REPA
            "--data.cache_views=2"])  # a shared combination: several crops, all centred
    message = str(err.value)
    assert message.startswith("invalid config (5 problems):"), message
    for says in ("data.resolution=18 is not divisible", "train.ema_device='cpu' with train.sharding='fsdp'",
                 "objective.repa_block=99 is past the model's last block", own_message, "data.cache_views=2 caches"):
        assert says in message, (says, message)
    assert not (tmp_path / "run").exists()


def test_an_unknown_key_and_a_bad_value_are_reported_together(no_work, tmp_path):
    with pytest.raises(config.ConfigError) as err:
        fm.main(tiny_run_args(tmp_path) + ["--train.lrr=1", "--data.crop=middle"])
    message = str(err.value)
    assert message.startswith("invalid config (2 problems):")
    assert "unknown config key 'train.lrr'" in message and "\n  data.crop='middle' must be" in message


def test_every_key_has_a_type_and_a_description():
    for trainer in (fm, ddpm):
        specs = dict(config.fields(trainer.CONFIG))
        assert list(specs) == list(config.flatten(trainer.DEFAULTS)), trainer.__name__  # the models are the keys
        for key, spec in specs.items():
            assert spec.get("description") and config.allowed(spec) not in ("None", "a section"), key
        assert trainer.CONFIG.model_validate(trainer.DEFAULTS)  # and the defaults are valid


def test_help_lists_every_key_with_its_type_default_and_description(capsys):
    outs = {}
    for trainer in (fm, ddpm):
        with pytest.raises(SystemExit) as exit:
            trainer.main(["--help"])
        assert exit.value.code == 0
        out = outs[trainer] = capsys.readouterr().out
        for key, value in config.flatten(trainer.DEFAULTS).items():
            assert f"--{key}={json.dumps(value)}  [" in out, key
        assert "--data.crop=\"center\"  ['center' or 'random' or 'random_resized']\n      drawn at cache time, " \
               "data.cache_views of them" in out
        assert "--train.lr=0.002  [a number >= 0]\n      the paper: 1e-4 at batch 2048" in out
        assert "--data.max_samples=null  [a whole number >= 1 (or null)]\n      use only the first N" in out
        assert "--train.betas=[0.9, 0.999]  [a list of 2, each in [0, 1)]" in out
        assert "model:  (SD3Transformer2DModel)" in out
    assert "--val.steps=32  [" in outs[fm] and "--val.sampler=\"euler\"  ['euler' or 'heun' or 'meanflow']" in outs[fm]
    assert "--val.steps=50  [" in out and "--val.sampler=\"ddim\"  ['ddim' or 'ddpm']" in out and \
        "--val.guidance_rescale=0.7  [in [0, 1]]" in out
    assert "--objective.beta_start=0.00085  [in (0, 1)]" in out  # the DDPM trainer's own section


def test_print_config_prints_the_resolved_config_and_exits(tmp_path, no_work, capsys):
    with pytest.raises(SystemExit) as exit:
        fm.main(["--print_config", "--train.lr=3e-4", "--run_dir", str(tmp_path / "r")])
    assert exit.value.code == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train"]["lr"] == 3e-4 and cfg["run_dir"] == str(tmp_path / "r") and not (tmp_path / "r").exists()


def test_a_run_folders_config_json_loads_back(tmp_path):
    """The resolved config a run writes (runlog, export, checkpoints: the same keys before and after the typed
    config) validates, and is a recipe the trainer accepts; one from an older run without a newer key takes that
    key's default; a key that is gone is named, with the keys known."""
    saved = json.loads(json.dumps(config.load_config(ddpm.DEFAULTS, ["--run_dir", str(tmp_path / "r")], "ddpm",
                                                     schema=ddpm.CONFIG)))
    assert ddpm.CONFIG.model_validate(saved)
    del saved["objective"]["min_snr_form"]  # runs before that key
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = config.load_config(ddpm.DEFAULTS, ["--config", str(tmp_path / "config.json")], "ddpm", schema=ddpm.CONFIG)
    assert cfg.objective.min_snr_form == "plus_one" and cfg.run_dir == str(tmp_path / "r")
    saved["objective"]["old_key"] = 1
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(config.ConfigError,
                       match=r"unknown config key 'objective.old_key' \(from .*config.json\); known"):
        config.load_config(ddpm.DEFAULTS, ["--config", str(tmp_path / "config.json")], "ddpm", schema=ddpm.CONFIG)


def test_a_new_run_into_a_run_dir_that_holds_one_is_refused_before_any_work(tmp_path, no_work):
    """Without --resume, a run_dir with a run's outputs (old checkpoints that a later --resume latest may pick, old
    eval/ that would reach the new report) is refused naming both ways on; config.json alone (a start stopped in
    the cache build) and --resume latest go on to work (no_work: the accelerator is the first)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    for trainer in (fm, ddpm):
        with pytest.raises(AssertionError, match="work started"):
            trainer.main(tiny_run_args(tmp_path))
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "eval").mkdir()
    for trainer in (fm, ddpm):
        with pytest.raises(config.ConfigError, match=r"run_dir='.*run' already holds a run \(checkpoints, eval\): "
                                                     r"continue it with --resume latest, or give this run a new "
                                                     r"run_dir"):
            trainer.main(tiny_run_args(tmp_path))
        with pytest.raises(AssertionError, match="work started"):
            trainer.main(tiny_run_args(tmp_path) + ["--resume", "latest"])


@pytest.mark.parametrize("trainer", [fm, ddpm])
def test_a_resumed_run_keeps_the_values_it_started_with(tmp_path, no_work, capsys, trainer):
    """--resume: a default changed since the run started (control_power.crop 1 -> 0) and a key added since whose
    default does another thing (conditioning.pooled_text: the pooled text reached the norm before it) take the
    checkpoint's recorded values, before any work; what is set now wins (a change on purpose)."""
    from safetensors.torch import save_file

    run, method = tmp_path / "run", trainer.__name__.removeprefix("train_")
    args = ["--run_dir", str(run), '--conditioning.controls=["crop", "flip"]']
    recorded = json.loads(json.dumps(config.load_config(trainer.DEFAULTS, args, method, schema=trainer.CONFIG)))
    recorded["conditioning"]["control_power"].update(crop=1.0, flip=1.0)  # the defaults the run started with
    del recorded["conditioning"]["pooled_text"]  # a run from before the key
    ckpt = run / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    for name in ("model", "ema", "optimizer"):
        save_file({}, str(ckpt / f"{name}.safetensors"))
    torch.save({"step": 4, "config": recorded}, ckpt / "state.pt")
    with pytest.raises(AssertionError, match="work started"):
        trainer.main(args + ["--resume", "latest", "--conditioning.control_power.flip=0.0"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume: ")]
    assert lines == ["resume: conditioning.control_power.crop=1.0, as the run started (step_00000004; today's default: "
                     "0.0; set it to change it)", "resume: conditioning.pooled_text=True, as the run started "
                     "(step_00000004; today's default: None, i.e. off in disentangled (the paper's reading), on in "
                     "both and adanorm (SD3); set it to change it)"]
    cfg = config.load_config(trainer.DEFAULTS, args + ["--resume", "latest"], method, schema=trainer.CONFIG)
    assert set(checkpoints.keep_recorded(cfg, log=lambda line: None)) == {"conditioning.control_power.crop",
                                                                          "conditioning.control_power.flip",
                                                                          "conditioning.pooled_text"}
    assert cfg.conditioning.control_power == {"size": 1.0, "crop": 1.0, "flip": 1.0} and cfg.conditioning.pooled_text


def test_every_meanflow_key_given_to_ddpm_says_whose_it_is():
    """Each of MeanFlow's keys on train_ddpm.py's command line: one line naming flow matching's trainer, not the
    list of DDPM's keys."""
    keys = [k for k in fm.DEFAULTS.objective if k.startswith("meanflow")]
    with pytest.raises(config.ConfigError) as e:
        config.load_config(ddpm.DEFAULTS, [f"--objective.{k}={json.dumps(fm.DEFAULTS.objective[k])}" for k in keys],
                           "ddpm", schema=ddpm.CONFIG)
    lines = str(e.value).splitlines()[1:]
    assert len(keys) == 9 and len(lines) == len(keys)
    assert all(line.endswith("flow matching's option (the average velocity of its straight path): use "
                             "train_flow_matching.py") and "known keys" not in line for line in lines)


def test_a_none_is_printed_with_what_it_does():
    """config.shown, as the resume lines print a value: None with its key's "None: ..." clause (up to the next ';'),
    from the trainer's schema or, loaded without one (or unpickled), the shared sections; "unset" for a key that
    names none."""
    cfg = config.load_config(fm.DEFAULTS, [], schema=fm.CONFIG)
    assert config.shown(cfg, "encoders.vae", None) == "None, i.e. pixel space"
    assert config.shown(cfg, "val.fid_reference", None) == "None, i.e. the held-out split"
    assert config.shown(cfg, "train.muon_lr", None) == "None, i.e. train.lr"
    assert config.shown(cfg, "objective.shift_base_resolution", None) == "None, i.e. unset"
    assert config.shown(cfg, "train.lr", 3e-4) == "0.0003"
    assert config.shown(config.load_config(fm.DEFAULTS, []), "data.val_holdout", None) == "None, i.e. 10%, at most 256"
    import pickle  # the schema it keeps (a class built at run time) does not stop it pickling (a spawned worker's copy)

    again = pickle.loads(pickle.dumps(config.load_config(fm.DEFAULTS, ["--train.lr=3e-4"], schema=fm.CONFIG)))
    assert again.train.lr == 3e-4 and again.explicit == {"train.lr"} and config.shown(again, "encoders.vae", None) == \
        "None, i.e. pixel space"


def test_budgets_that_cannot_work_are_flagged(capsys):
    cfg = config.load_config(fm.DEFAULTS, ["--train.max_steps=100", "--train.warmup_steps=400", "--val.every=500"],
                             schema=fm.CONFIG)
    out = capsys.readouterr().out
    assert "warning: train.warmup_steps=400 is longer than the run (train.max_steps=100): the LR never reaches " \
           "train.lr, only 25% of it" in out
    assert "warning: val.every=500 is beyond the run" in out and "log.every" not in out
    assert config.size_warnings(cfg, 2_300_000, 4608, 1) == []  # the demo: fine
    big = config.size_warnings(cfg, 675_000_000, 300, 1)
    assert len(big) == 1 and "2,250,000 per image" in big[0]
    assert "epochs" in config.size_warnings(config.load_config(fm.DEFAULTS, []), 1_000_000, 300, 8)[0]


@pytest.mark.slow
def test_config_errors_print_one_message_without_a_traceback(tmp_path):
    (tmp_path / "bad.json").write_text('{\n  "train": {"lr": 1e-4}\n  "val": {}\n}')
    for script, args in (("train_flow_matching.py", ["--train.lr=-1", "--data.crop=middle"]),
                         ("train_ddpm.py", ["--config", str(tmp_path / "bad.json")])):
        out = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("invalid config (")
    assert "bad.json: line 3, column 3: malformed JSON (Expecting ',' delimiter)" in out.stderr
