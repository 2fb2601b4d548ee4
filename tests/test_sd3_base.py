"""A pretrained Stable Diffusion 3 / 3.5 pipeline as a run's base (issue 72, training/data/sd3_base.py): recognised by
its model_index.json, its VAE with its factors, its three text encoders conditioned as diffusers'
StableDiffusion3Pipeline.encode_prompt conditions them (or the CLIPs alone, T5's tokens zero), its transformer inside
the Denoiser computing what SD3Transformer2DModel computes, the cache keyed on the encoders chosen, the refused
mismatches, and a LoRA run on it that keeps the base, exports adapters diffusers' own pipeline loads, and copies none
of the base. The base is conftest.make_tiny_sd3's, saved with save_pretrained and read through the hub id's code."""
import json
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file

import train_flow_matching as fm
from training.config import config
from training.data import cache, encoders, sd3_base
from training.model import lora
from training.model.mmdit import load_exported
from training.run import start
from conftest import DEMO_WORDS, make_tiny_sd3

WITHOUT_T5 = ["text_encoder", "text_encoder_2"]


def sd3_args(base, *extra):
    return [f"--init_from={base}", f"--encoders.vae={base}", f"--encoders.text_encoder={base}",
            "--encoders.max_tokens=12", "--conditioning.pooled_text=true", "--conditioning.replicate_padding=false",
            "--data.caption_column=caption", "--data.label_column=null", *extra]


def diffusers_pipeline(base, subset=None):
    from diffusers import StableDiffusion3Pipeline

    without = {"text_encoder_3": None, "tokenizer_3": None} if subset == WITHOUT_T5 else {}
    return StableDiffusion3Pipeline.from_pretrained(base, **without)


def test_an_sd3_pipeline_is_recognised_by_its_model_index_and_nothing_else_is(tiny_sd3, tiny_vae, tmp_path):
    assert sd3_base.pipeline_index(tiny_sd3)["_class_name"] == "StableDiffusion3Pipeline"
    (tmp_path / "export").mkdir()  # this repository's export: its own pipeline class, a list
    (tmp_path / "export" / "model_index.json").write_text(json.dumps({"_class_name": ["pipeline", "Minimal"]}))
    for other in (tiny_vae, str(tmp_path / "export"), str(tmp_path / "nowhere"), "./nowhere/x", None,
                  "owner/not-cached"):  # HF_HUB_OFFLINE: a hub id not in the cache is no pipeline here
        assert sd3_base.pipeline_index(other) is None


def test_a_hub_id_in_the_cache_loads_through_the_same_code_as_the_folder(tiny_sd3, tmp_path, monkeypatch):
    """The tiny pipeline as the Hugging Face cache holds a downloaded "owner/name" (HF_HUB_OFFLINE: from the cache
    alone, as on a node after tools/prefetch.py): recognised, and its VAE, text encoding and transformer are the
    folder's."""
    import shutil

    import huggingface_hub

    repo = tmp_path / "hub" / "models--someone--tiny-sd3"
    shutil.copytree(tiny_sd3, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_id = "someone/tiny-sd3"
    assert sd3_base.is_base(hub_id)
    enc = {name: config.Config({"vae": name, "text_encoder": name, "max_tokens": 12}) for name in (hub_id, tiny_sd3)}
    (vae, tokenizer, encoder), (vae_dir, tokenizer_dir, encoder_dir) = (encoders.load_encoders(e, "cpu")
                                                                         for e in enc.values())
    assert vae.config.shift_factor == vae_dir.config.shift_factor == 0.06
    ours, folder = (encoders.encode_text(t, e, ["a red circle"], 12) for t, e in ((tokenizer, encoder),
                                                                                 (tokenizer_dir, encoder_dir)))
    assert all(torch.equal(ours[k], folder[k]) for k in ours)
    base, local = sd3_base.transformer_state(hub_id), sd3_base.transformer_state(tiny_sd3)
    assert base.keys() == local.keys() and all(torch.equal(base[k], local[k]) for k in base)


def test_the_vae_is_the_pipelines_own_with_its_scaling_and_shift_factors(tiny_sd3):
    """encoders.vae naming the pipeline loads its vae/ and the cache's latents are (mean - shift) x scale with the
    pipeline's own factors (1.5 and 0.06 here), as diffusers' SD3 scripts make them."""
    vae, _, _ = encoders.load_encoders(config.Config({"vae": tiny_sd3, "text_encoder": None}), "cpu")
    theirs = diffusers_pipeline(tiny_sd3).vae
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (1.5, 0.06)
    pixels = torch.rand(2, 3, 16, 16) * 2 - 1
    got = encoders.make_encode(vae, None, None, 12)(pixels, None)["x"]
    want = (theirs.encode(pixels).latent_dist.mean - theirs.config.shift_factor) * theirs.config.scaling_factor
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    back = encoders.decode(vae, got)
    torch.testing.assert_close(back, theirs.decode(got / 1.5 + 0.06).sample, rtol=1e-5, atol=1e-6)
    assert encoders.vae_factor(tiny_sd3) == 2 and encoders.vae_identity(tiny_sd3)["shift_factor"] == 0.06


@pytest.mark.parametrize("subset", [None, WITHOUT_T5], ids=["clip_l_clip_g_t5", "without_t5"])
def test_the_text_encoding_is_stable_diffusion_3s_encode_prompt(tiny_sd3, subset):
    """Tokens (77 of the CLIPs' penultimate states side by side, zero-padded to T5's width, then T5's 12) and pooled
    vector (the CLIPs' projections), as StableDiffusion3Pipeline.encode_prompt makes them, for captions, the empty
    prompt (the null text) and a caption longer than T5's 12 tokens; without T5, its tokens are the pipeline's
    zeros. The same through the cache's token ids (data.cache_text=false: tokenize now, encode each step)."""
    enc = config.Config({"vae": None, "text_encoder": tiny_sd3, "max_tokens": 12, "sd3_text_encoders": subset})
    _, tokenizer, encoder = encoders.load_encoders(enc, "cpu")
    captions = ["a red circle", "", " ".join(DEMO_WORDS * 2), "large green triangle"]
    ours = encoders.encode_text(tokenizer, encoder, captions, 12)
    tokens, _, pooled, _ = diffusers_pipeline(tiny_sd3, subset).encode_prompt(
        captions, None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=12)
    assert ours["text_tokens"].shape == (4, 77 + 12, 48) and ours["text_pooled"].shape == (4, 8 + 12)
    torch.testing.assert_close(ours["text_tokens"], tokens.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["text_pooled"], pooled.float(), rtol=0, atol=1e-6)
    assert (ours["text_tokens"][:, 77:].abs().sum() == 0) == (subset == WITHOUT_T5)
    assert ours["text_mask"].shape == (4, 89) and ours["text_mask"][1, :77].sum() == 2  # the empty prompt: start, end
    ids, mask = encoders.tokenize(tokenizer, captions, 12)
    cached = encoders.text_features({"input_ids": ids.int(), "attention_mask": mask.to(torch.uint8)}, encoder)
    assert all(torch.equal(cached[k], ours[k]) for k in ours)


def test_the_cache_keys_on_which_of_the_pipelines_encoders_encode(tiny_sd3):
    cfg = config.load_config(fm.DEFAULTS, sd3_args(tiny_sd3, "--train.lora_rank=4"))

    def key():
        return cache.cache_key(cfg, "train", None, 320)

    every = key()
    cfg.encoders.sd3_text_encoders = WITHOUT_T5
    assert key() != every and key()["sd3_text_encoders"] == WITHOUT_T5
    cfg.encoders.sd3_text_encoders = None
    assert key() == every


def test_the_model_is_the_base_transformer_and_computes_what_it_computes(tiny_sd3):
    """The run's model on an SD3 base: the base's own SD3Transformer2DModel (SD3.5's dual attention and RMS qk norm
    included, whatever model.* says) with all its weights from init_from; its forward on the run's conditions
    equals diffusers' SD3Transformer2DModel.forward on the same embeddings; the null text is the empty prompt as
    the pipeline encodes its negative prompt; the conditioner adds nothing (no controls asked for)."""
    from diffusers import SD3Transformer2DModel

    cfg = config.load_config(fm.DEFAULTS, sd3_args(tiny_sd3, "--model.num_layers=7", "--model.qk_norm=null"))
    _, tokenizer, encoder = encoders.load_encoders(cfg.encoders, "cpu")
    null = encoders.encode_text(tokenizer, encoder, [""], 12)
    model = start.build_for_run(cfg, (4, 8, 8), null)
    ema = start.build_for_run(cfg, (4, 8, 8), null)
    report = start.init_from(tiny_sd3, model, ema, log=lambda *_: None, cfg=cfg)
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").eval()
    assert report["loaded"] == len(base.state_dict()) and not report["missing"] + report["reshaped"]
    blocks = model.transformer.transformer_blocks  # the base's 2 with SD3.5's dual attention, not model.num_layers' 7
    assert list(model.transformer.config.dual_attention_layers) == [0] and len(blocks) == 2
    _, negative, _, negative_pooled = diffusers_pipeline(tiny_sd3).encode_prompt("", None, None, device="cpu",
                                                                               max_sequence_length=12)
    torch.testing.assert_close(model.conditioner.null_tokens, negative[0].float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(model.conditioner.null_pooled, negative_pooled[0].float(), rtol=0, atol=1e-6)
    captions = ["a red circle", "small blue square"]
    cond = {**encoders.encode_text(tokenizer, encoder, captions, 12), "drop": torch.tensor([False, True])}
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([250.0, 900.0])
    with torch.no_grad():
        ours = model.eval()(x, t, cond)
        text = torch.stack([cond["text_tokens"][0], model.conditioner.null_tokens])  # the second: dropped
        pooled = torch.stack([cond["text_pooled"][0], model.conditioner.null_pooled])
        theirs = base(x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t).sample
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("option, message", [
    (["--conditioning.replicate_padding=true"], "conditioning.replicate_padding=true with an SD3-family init_from"),
    (["--conditioning.pooled_text=false"], "conditioning.pooled_text=false with an SD3-family init_from"),
    (["--encoders.vae=null"], "set encoders.vae to it too"),
    (["--encoders.sd3_text_encoders", '["text_encoder", "text_encoder_3"]'], "name both CLIPs"),
    (["--encoders.max_tokens=600"], "at most 512"),
    (["--objective.prediction=x0"], "the base predicts the velocity"),
])
def test_an_sd3_base_refuses_what_it_was_not_trained_with_at_start_up(tiny_sd3, tmp_path, option, message):
    with pytest.raises(config.ConfigError, match=message):
        fm.main(["--run_dir", str(tmp_path / "run"), *sd3_args(tiny_sd3, "--train.lora_rank=4"), *option])


def test_ddpm_refuses_an_sd3_base(tiny_sd3, tmp_path):
    import train_ddpm

    with pytest.raises(config.ConfigError, match="a rectified-flow model .* train_flow_matching.py"):
        train_ddpm.main(["--run_dir", str(tmp_path / "run"), *sd3_args(tiny_sd3, "--train.lora_rank=4")])


# ---- The recipe: configs/sd35_lora_own_data.json ----------------------------------------------------------------

RECIPE = "configs/sd35_lora_own_data.json"
SD35_SHIFT = 3.0  # stabilityai/stable-diffusion-3.5-medium's scheduler/scheduler_config.json: "shift": 3.0


def test_the_sd35_recipe_validates_offline_with_its_ids_pointed_at_the_tiny_base(tiny_sd3, tmp_path):
    """The recipe passes every start-up check of the trainer (the SD3 base's, LoRA's, the encoders': no weights read)
    with its three hub ids pointed at the tiny SD3-layout pipeline, and is SD3's training: the velocity objective on
    SD3.5's time shift (the tiny base's scheduler has SD3.5's 3.0), its padding and pooled text, T5's 256 tokens of
    the SD3.5 pipeline, LoRA on the attention (diffusers' defaults), bf16 with gradient checkpointing. With the real
    id and no network, the one line says what to run (tools/prefetch.py)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    ids = [f"--{key}={tiny_sd3}" for key in ("init_from", "encoders.vae", "encoders.text_encoder")]
    cfg = config.load_config(fm.DEFAULTS, ["--config", RECIPE, *ids, "--run_dir", str(tmp_path / "run")],
                             schema=fm.CONFIG)
    base_shift = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_sd3, subfolder="scheduler").config.shift
    assert cfg.objective.time_shift == base_shift == SD35_SHIFT and cfg.objective.prediction == "v"
    assert (cfg.conditioning.pooled_text, cfg.conditioning.replicate_padding) == (True, False)
    assert cfg.encoders.max_tokens == 256 and cfg.encoders.sd3_text_encoders is None  # all three, T5 included
    tr = cfg.train
    assert 4 <= tr.lora_rank <= 64 and tr.lora_targets is None and tr.optimizer == "adamw" and tr.lr == 1e-4
    assert (tr.mixed_precision, tr.gradient_checkpointing, cfg.data.resolution) == ("bf16", True, 1024)
    recipe = json.loads(open(RECIPE).read())
    assert recipe["init_from"] == recipe["encoders"]["vae"] == recipe["encoders"]["text_encoder"] == \
        "stabilityai/stable-diffusion-3.5-medium"
    with pytest.raises(config.ConfigError, match="encoders.vae='stabilityai/stable-diffusion-3.5-medium' cannot be "
                                                 "loaded.*tools/prefetch.py"):
        config.load_config(fm.DEFAULTS, ["--config", RECIPE, "--run_dir", str(tmp_path / "run2")], schema=fm.CONFIG)


# ---- A LoRA run on the tiny base, on a folder of captioned images -----------------------------------------------


def image_folder(folder, n=12):
    """n 16 x 16 images, each a colour block on a colour, with a caption in metadata.jsonl."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        image = np.full((16, 16, 3), rng.integers(0, 255, 3), np.uint8)
        image[4:12, 4:12] = rng.integers(0, 255, 3)
        PIL.Image.fromarray(image).save(folder / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "caption": f"a {DEMO_WORDS[1 + i % 2]} {DEMO_WORDS[3 + i % 3]} square"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def adapted(tiny_sd3, tmp_path_factory):
    """A 3-step LoRA run (rank 4, alpha 8) on the tiny base and the model object it trained."""
    tmp = tmp_path_factory.mktemp("sd3_lora")
    models, attach = [], lora.attach

    def keep(*args, **kwargs):
        models.append(attach(*args, **kwargs))
        return models[-1]

    lora.attach = keep
    try:
        run = fm.main(["--run_dir", str(tmp / "run"), "--data.cache_dir", str(tmp / "cache"),
                       f"--data.source={image_folder(tmp / 'images')}", "--data.resolution=16",
                       "--data.val_holdout=2", *sd3_args(tiny_sd3), "--encoders.latent_check=warn",
                       "--objective.time_shift=3.0", "--train.lora_rank=4", "--train.lora_alpha=8",
                       "--train.lr=3e-2", "--train.warmup_steps=0", "--train.lr_schedule=constant",
                       "--train.max_steps=3", "--train.batch_size=4", "--train.ema_decay=0", "--val.steps=2",
                       "--val.num_samples=2", "--val.loss_samples=2", "--val.every=1000", "--ckpt.every=1000",
                       "--log.every=1", "--log.wandb=off"])
    finally:
        lora.attach = attach
    return run, models[0]


@pytest.mark.slow
def test_a_lora_run_on_the_base_trains_the_adapters_keeps_the_base_and_exports_no_copy_of_it(tiny_sd3, adapted,
                                                                                              tmp_path):
    from diffusers import SD3Transformer2DModel

    run, (model, ema) = adapted
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").state_dict()
    kept = {n.replace("base_layer.", ""): v for n, v in model.transformer.state_dict().items() if ".lora_" not in n}
    assert kept.keys() == base.keys() and all(torch.equal(v, base[n]) for n, v in kept.items())  # bitwise
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # it trained
    export = run / "export"
    assert sorted(p.name for p in export.iterdir() if p.is_dir()) == ["conditioner", "scheduler"]  # no base copied
    index = json.loads((export / "model_index.json").read_text())
    assert "transformer" not in index and index["transformer_id"] == index["vae_id"] == index["text_encoder_id"]
    assert index["sd3_text_encoders"] == list(sd3_base.TEXT_ENCODERS) and index["vae_subfolder"] == "vae"
    assert set(load_file(str(export / lora.ADAPTERS))) == {
        "transformer." + n.removeprefix("transformer.").replace(".default", "") for n in trained}
    # This repository's tools read the export back, the adapters folded into the base it names
    exported, _ = load_exported(export)
    _, tokenizer, encoder = encoders.load_encoders(config.Config({"vae": None, "text_encoder": tiny_sd3,
                                                                  "max_tokens": 12}), "cpu")
    cond = {**encoders.encode_text(tokenizer, encoder, ["a red square", "a small blue square"], 12),
            "drop": torch.tensor([False, True])}
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([300.0, 800.0])
    with torch.no_grad():
        torch.testing.assert_close(exported(x, t, cond), ema.eval()(x, t, cond), rtol=1e-4, atol=1e-5)


DIFFUSERS_ALONE = r"""
import json, sys
import numpy as np, torch
try:
    import training
    sys.exit("this repository is importable here")
except ImportError:
    pass
from diffusers import DiffusionPipeline, StableDiffusion3Pipeline
base, export, merged, out = sys.argv[1:]
steps, prompts = 3, ["a red square", "a small blue square"]
noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
grid = np.linspace(1.0, 0.0, steps + 1)[:-1]  # the trainer's grid; the exported pipeline's own
def sd3(pipe):
    return pipe(prompts, latents=noise, sigmas=list(grid), num_inference_steps=steps, guidance_scale=2.0,
                max_sequence_length=12, output_type="latent").images
def ours(pipe):
    return pipe(prompts, latents=noise, num_inference_steps=steps, guidance_scale=2.0, output_type="latent").images
pipe = StableDiffusion3Pipeline.from_pretrained(base)
result = {"base": sd3(pipe)}
pipe.load_lora_weights(export, adapter_name="run")
for scale in (0.0, 1.0):
    pipe.set_adapters(["run"], [scale])
    result[scale] = sd3(pipe)
mine = DiffusionPipeline.from_pretrained(export, trust_remote_code=True)
result["ours_base"] = ours(mine)
mine.load_lora_weights(export, adapter_name="run")
result["ours"] = ours(mine)
result["merged"] = ours(DiffusionPipeline.from_pretrained(merged, trust_remote_code=True))
torch.save(result, out)
"""


@pytest.mark.slow
def test_diffusers_own_sd3_pipeline_loads_the_adapters_scale_0_is_the_base_and_1_is_the_exported_pipeline(
        tiny_sd3, adapted, tmp_path):
    """In a process that cannot import this repository: StableDiffusion3Pipeline.from_pretrained(base) with the
    export's load_lora_weights and set_adapters samples at scale 0 as the base and at scale 1 as the exported
    pipeline with the adapters loaded, which samples as the merged export (train.lora_merged_export: transformer/
    written, still no text encoder or VAE copied). Same noise, the trainer's grid, guidance 2 on both."""
    from training.sharing import pipeline_export

    run, (_, ema) = adapted
    cfg = config.Config(json.loads((run / "config.json").read_text()))
    cfg["train"]["lora_merged_export"] = True
    merged = pipeline_export.write(ema, cfg, tmp_path / "merged", run_dir=run)
    assert sorted(p.name for p in merged.iterdir() if p.is_dir()) == ["conditioner", "scheduler", "transformer"]
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-I", "-c", DIFFUSERS_ALONE, tiny_sd3, str(run / "export"), str(merged),
                           str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out[0.0], out["base"], atol=1e-6, rtol=0)
    torch.testing.assert_close(out["ours_base"], out["base"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1.0], out["ours"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["merged"], out["ours"], atol=1e-5, rtol=1e-5)
    assert (out[1.0] - out["base"]).abs().max() > 1e-3  # the adapters change what it samples
