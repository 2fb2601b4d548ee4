"""LoRA adapters on a trained run (issue 72, training/model/lora.py): only the adapters and the run's own new layers
train, the base stays bitwise the source's, a checkpoint holds the adapters and the base's hash (resume exact,
another base refused), the combinations LoRA cannot run refused at start-up, and the export folds the adapters in."""
import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from training.config import config
from training.model import lora
from training.model.mmdit import build_denoiser, load_exported
from training.evaluation import sampling
from training.sharing import pipeline_export
import train_ddpm as ddpm
from tools import export as export_tool
import train_flow_matching as fm
from conftest import TINY_MODEL, tiny_run_args, trained_for_the_module

SOURCE_STEPS = ("step_00000002", "step_00000004")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 4-step run at 8 x 8 with checkpoints at steps 2 and 4: two different bases."""
    return trained_for_the_module(fm.main, tiny_run_args(tmp_path_factory.mktemp("lora"), "base", steps=4)
                                  + ["--data.resolution=8", "--ckpt.every=2"])


def lora_args(tmp_path, source, name, steps=4):
    return tiny_run_args(tmp_path, name, steps=steps) + [
        "--data.resolution=8", f"--init_from={source}", "--train.lora_rank=4", "--train.lr=1e-2",
        "--train.warmup_steps=0", "--train.lr_schedule=constant", "--conditioning.controls", '["size"]',
        "--ckpt.every=2"]


def captured(monkeypatch):
    """The trainer's model object, as lora.attach hands it over (trained in place)."""
    models, attach = [], lora.attach

    def keep(*args, **kwargs):
        out = attach(*args, **kwargs)
        models.append(out)
        return out

    monkeypatch.setattr(lora, "attach", keep)
    return models


@pytest.mark.slow
@pytest.mark.parametrize("trainer", [fm, ddpm], ids=["flow_matching", "ddpm"])
def test_only_the_adapters_and_the_new_layer_train_and_the_base_stays_bitwise(trainer, source, tmp_path,
                                                                              monkeypatch, capsys):
    base_run = source if trainer is fm else trained_for_the_module(
        ddpm.main, tiny_run_args(tmp_path, "ddpm_base", steps=2) + ["--data.resolution=8"])
    models = captured(monkeypatch)
    capsys.readouterr()
    # DDPM's run also accumulates two micro-batches under bf16 autocast, with its EMA in CPU memory: all work
    # Flow matching's adapts the documented option too: the adaptive norms and the conditioner's class tokens
    extra = ["--train.lora_targets", json.dumps(lora.ATTENTION + lora.ADAPTIVE_NORMS + lora.CONDITIONER[:1])] \
        if trainer is fm else ["--train.grad_accum=2", "--train.mixed_precision=bf16", "--train.ema_device=cpu"]
    run = trainer.main(lora_args(tmp_path, base_run, "adapted") + extra)
    out = capsys.readouterr().out
    model, ema = models[0]
    base = load_file(str(base_run / "checkpoints" / ("step_00000004" if trainer is fm else "step_00000002")
                         / "ema.safetensors"))  # the base is the source's EMA
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or n.startswith("conditioner.control_mlp.size") for n in trained)
    assert any(n.startswith("conditioner.control_mlp.size") for n in trained)  # the layer the base lacks
    frozen = {n.replace("base_layer.", ""): p for n, p in model.named_parameters() if p.requires_grad is False}
    assert len(frozen) > 20 and all(torch.equal(p.detach().cpu(), base[n]) for n, p in frozen.items())
    # Every adapter moved, but the last block's text queries: that block's text output is dropped (context_pre_only)
    still = [n for n, p in model.named_parameters() if "lora_B" in n and p.detach().abs().sum() == 0]
    assert still == ["transformer.transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"]
    adapted = {n.split(".lora_")[0] for n in trained if ".lora_" in n}
    assert ("transformer.transformer_blocks.0.norm1.linear" in adapted) == (trainer is fm)
    assert ("conditioner.class_embed" in adapted) == (trainer is fm)
    assert "LoRA rank 4" in out and "conditioner.control_mlp.size" in out and "parameters" in out
    # A checkpoint holds exactly the trained tensors (and the EMA of them), and the base's hash.
    for name in ("model", "ema"):
        assert set(load_file(str(run / "checkpoints" / "step_00000004" / f"{name}.safetensors"))) == trained
    # The export is the merged model, loadable as any export: it computes what the adapted EMA computes.
    exported, _ = load_exported(run / "export")
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([300.0, 700.0])
    cond = {"drop": torch.zeros(2, dtype=torch.bool), "drop_controls": torch.zeros(2, dtype=torch.bool),
            "label": torch.tensor([1, 2]), "orig_hw": torch.tensor([[8, 8], [20, 12]])}
    with torch.no_grad():
        want, got = ema.eval()(x, t, cond), exported.eval()(x, t, cond)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.slow
def test_resume_is_exact_with_adapters_and_refuses_another_base(source, tmp_path):
    whole = fm.main(lora_args(tmp_path, source, "whole"))
    args = lora_args(tmp_path, source, "split", steps=2)
    fm.main(args)
    split = fm.main(args[:] + ["--train.max_steps=4", "--resume", "latest"])
    for name in ("model", "ema"):
        a, b = (load_file(str(r / "checkpoints" / "step_00000004" / f"{name}.safetensors")) for r in (whole, split))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # What reads a whole model from a checkpoint says, in one line, that this one holds adapters: read the export
    with pytest.raises(SystemExit, match="is a LoRA run's checkpoint .* read the run's export instead"):
        sampling.load_model(whole, "latest")
    other = source / "checkpoints" / SOURCE_STEPS[0]  # the same run two steps earlier: another base
    with pytest.raises(SystemExit, match="adapters were trained on a base with sha256"):
        fm.main(args[:] + ["--train.max_steps=6", "--resume", "latest", f"--init_from={other}"])


@pytest.mark.parametrize("option, message", [
    (["--train.optimizer=muon"], "train.optimizer='muon' with train.lora_rank=4"),
    (["--train.sharding=fsdp"], "train.sharding='fsdp' with train.lora_rank=4"),
    (["--ckpt.phema_every=10"], "ckpt.phema_every > 0 with train.lora_rank=4"),
    (["--train.lora_targets", '["conditioner.class_embed"]'], "name at least one transformer module"),
    ([], None),  # no init_from
])
def test_lora_refuses_what_it_cannot_run_at_start_up(option, message, tmp_path):
    (tmp_path / "somewhere").mkdir()
    base = [] if message is None else [f"--init_from={tmp_path / 'somewhere'}"]
    message = message or "train.lora_rank=4 adapts a trained model: set init_from"
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fm.main(tiny_run_args(tmp_path, "bad") + ["--train.lora_rank=4", *base, *option])


DIFFUSERS_ALONE = r"""
import json, sys
import torch
try:
    import training
    sys.exit("this repository is importable here")
except ImportError:
    pass
from diffusers import DiffusionPipeline
adapters, merged, out = sys.argv[1:]
def latents(pipe):
    return pipe(["0", "3"], generator=[torch.Generator().manual_seed(s) for s in (0, 1)], num_inference_steps=3,
                output_type="latent").images
pipe = DiffusionPipeline.from_pretrained(adapters, trust_remote_code=True)
result = {"base": latents(pipe)}
pipe.load_lora_weights(adapters, adapter_name="run")
for scale in (0.0, 1.0):
    pipe.set_adapters(["run"], [scale])
    result[scale] = latents(pipe)
result["merged"] = latents(DiffusionPipeline.from_pretrained(merged, trust_remote_code=True))
torch.save(result, out)
"""


@pytest.mark.slow
def test_the_adapters_load_the_diffusers_way_scale_0_is_the_base_and_merged_equals_unmerged(source, tmp_path,
                                                                                             monkeypatch):
    """The export's adapter file, read by diffusers alone (a process that cannot import this repository): the
    exported pipeline's load_lora_weights and set_adapters; at scale 0 it samples as its base, at scale 1 as the
    merged export (train.lora_merged_export) of the same EMA."""
    models = captured(monkeypatch)
    run = fm.main(lora_args(tmp_path, source, "adapted", steps=4) + ["--train.lora_alpha=8"])  # scale 2
    assert (run / "export" / lora.ADAPTERS).is_file()
    cfg = config.Config(json.loads((run / "config.json").read_text()))
    cfg["train"]["lora_merged_export"] = True
    merged = pipeline_export.write(models[0][1], cfg, tmp_path / "merged", run_dir=run)
    assert not (merged / lora.ADAPTERS).exists()
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-I", "-c", DIFFUSERS_ALONE, str(run / "export"), str(merged),
                           str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out[0.0], out["base"], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1.0], out["merged"], atol=1e-4, rtol=1e-4)
    assert (out[1.0] - out["base"]).abs().max() > 1e-3  # the adapters change what it samples
    # tools/export.py re-exports the run from its export (adapters folded in on reading): one model, the same one
    before = load_exported(run / "export")[0].state_dict()
    export_tool.main(["--run", str(run)])
    after = load_exported(run / "export")[0].state_dict()
    assert not (run / "export" / lora.ADAPTERS).exists() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_lora_exports_card_says_rank_alpha_targets_trainable_parameters_and_the_base(tmp_path):
    """Issue 72 (item 1): a LoRA run's model card said nothing of LoRA, and its loading lines gave the base alone.
    The card names rank, alpha (and scale), targets, the base (init_from, sha256) and the trainable parameters: the
    adapters' count checked against r x (in + out) of every adapted Linear, and the run's own layer; a re-export
    (its model merged) keeps them and says the adapters are folded in."""
    cfg = config.as_config(json.loads(json.dumps(fm.DEFAULTS)))
    run = tmp_path / "adapted"
    (run / "samples").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 0.5, "images_per_s": 1.0}) + "\n")
    cfg["run_dir"], cfg["init_from"], cfg["data"]["num_classes"], cfg["model"]["num_layers"] = \
        str(run), str(tmp_path / "base" / "export"), 9, 1
    cfg["train"]["lora_rank"], cfg["train"]["lora_alpha"] = 4, 8
    model = build_denoiser(cfg, 3, 16)
    linears = {n: m for n, m in model.transformer.named_modules() if any(n.endswith(t) for t in lora.ATTENTION)}
    want = sum(4 * (m.in_features + m.out_features) for m in linears.values())
    ema = copy.deepcopy(model)
    fresh = {"missing": ["conditioner.class_embed.weight"], "reshaped": [], "adapted": []}  # a layer the base lacks
    model, ema = lora.attach(model, ema, fresh, cfg.train, log=lambda *_: None)
    folder = pipeline_export.write(ema, cfg, run / "export", None, run)
    text = (folder / "README.md").read_text()
    base = sum(p.numel() for p in build_denoiser(cfg, 3, 16).parameters()) - 10 * 128
    assert (f"- LoRA (Hu et al. 2022) on a frozen base, `base/export` (sha256 `{ema.lora_base_hash[:12]}`): rank 4, "
            f"alpha 8 (scale 2), dropout 0, on the attention projections") in text
    assert f"trainable parameters: {want + 1280:,} " in text and f"the adapters {want:,}; this run's own " \
        f"`conditioner.class_embed.weight` in full (1,280); the base's {base:,} frozen" in text
    assert "pipe.load_lora_weights('OWNER/NAME')" in text and lora.ADAPTERS in text
    # A re-export (tools/export.py) writes the merged model: the card keeps the counts and says where the adapters went
    folder = pipeline_export.write(lora.without_adapters(ema), cfg, run / "export", None, run)
    text = (folder / "README.md").read_text()
    assert f"trainable parameters: {want + 1280:,} " in text and "folded into this folder's weights" in text
    assert "load_lora_weights" not in text


def adapted_tiny(lora_rank=4):
    """A one-block model with LoRA (rank 4 on the attention) and a fresh class embedding, and its EMA, as attach
    makes them."""
    cfg = config.as_config(json.loads(json.dumps(fm.DEFAULTS)))
    cfg["data"]["num_classes"], cfg["model"]["num_layers"], cfg["train"]["lora_rank"] = 9, 1, lora_rank
    torch.manual_seed(0)
    model = build_denoiser(cfg, 3, 16)
    fresh = {"missing": ["conditioner.class_embed.weight"], "reshaped": [], "adapted": []}
    return (*lora.attach(model, copy.deepcopy(model), fresh, cfg.train, log=lambda *_: None), cfg)


@pytest.mark.parametrize("every, device", [(1, "same"), (2, "same"), (1, "cpu")],
                         ids=["each-step", "every-2", "offloaded"])
def test_the_ema_of_a_lora_run_averages_the_trained_tensors_alone_bit_for_bit_as_before(every, device):
    """Issue 72 (item 1): a LoRA run's EMA lerped every frozen base tensor toward its identical copy in the model at
    every update, the whole base's cost for no change. It averages the trained tensors alone now: after 6 steps of
    changing weights its trained tensors are bitwise what the old code (every parameter averaged: the same EMA
    without lora_trained) gives, on each of the trainer's paths (each step, every k steps, offloaded to the CPU),
    and no frozen tensor was written (its version counter unchanged, its bytes the base's)."""
    from training.run import fit

    model, ema, cfg = adapted_tiny()
    old_ema = copy.deepcopy(ema)
    del old_ema.lora_trained  # what the old code averaged: every parameter
    trained = set(model.lora_trained)
    frozen = {n: (p._version, p.clone()) for n, p in ema.named_parameters() if n not in trained}
    tr = config.Config({**cfg.train, "ema_decay": 0.9, "ema_every": every, "ema_device": device, "max_steps": 6})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    updaters = [fit.EMAUpdater(e, model, optimizer, tr, torch.device("cpu")) for e in (ema, old_ema)]
    for step in range(6):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))
        for update in updaters:
            update(step)
    for update in updaters:
        update.wait()
    new, old = dict(ema.named_parameters()), dict(old_ema.named_parameters())
    assert all(torch.equal(new[n], old[n]) for n in new)
    assert all(not torch.equal(new[n], dict(model.named_parameters())[n]) for n in trained)  # they did average
    assert all(new[n]._version == version and torch.equal(new[n], before) for n, (version, before) in frozen.items())
    assert len(frozen) > 20
