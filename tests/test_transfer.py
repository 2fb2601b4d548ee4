"""Resolution and dataset transfer (issue 7): init_from, positional-grid resampling, the resolution shift of
both objectives, the ImageNet-22k -> 1k class mapping, label captions and the transfer recipes."""
import json
import math

import pytest
import torch
from diffusers.models.embeddings import get_1d_sincos_pos_embed_from_grid, get_2d_sincos_pos_embed
from safetensors.torch import load_file

import common
from training.config import config
from training.data.classes import class_names, read_class_ids
from training.data.sources import DEMO_CLASSES, draw_shape, make_demo_dataset, preprocess
from training.model.mmdit import load_exported
from training.model.transfer import adapt_state, grid_positions, map_classes, resample_pos_embed
from training.run import checkpoints
import train_ddpm as ddpm
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args, trained_for_the_module

TINY_MODEL = ["--model.num_layers=1", "--model.num_attention_heads=2", "--model.attention_head_dim=16"]


# ---- positional grid ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["resample", "extend"])
@pytest.mark.parametrize("dim,grid", [(64, 4), (128, 8), (1152, 16)])
def test_resampled_grid_at_the_same_size_is_the_original_exactly(dim, grid, mode):
    pos_embed = get_2d_sincos_pos_embed(dim, grid, base_size=grid).float()[None]  # what SD3's PatchEmbed holds
    assert torch.equal(resample_pos_embed(pos_embed, grid, mode), pos_embed)


def test_resampled_grid_at_double_size_spans_the_positions_the_model_saw():
    old, new, dim = 8, 16, 128
    pos_embed = get_2d_sincos_pos_embed(dim, old, base_size=old).float()[None]
    resampled = resample_pos_embed(pos_embed, new, "resample")
    assert resampled.shape == (1, new * new, dim)
    # Oracle: sin-cos evaluated at p_i = (i + 0.5) old / new - 0.5 on both axes (diffusers' own formula).
    p = (torch.arange(new) + 0.5) * old / new - 0.5
    col = get_1d_sincos_pos_embed_from_grid(dim // 2, p.repeat(new))
    row = get_1d_sincos_pos_embed_from_grid(dim // 2, p.repeat_interleave(new))
    torch.testing.assert_close(resampled[0], torch.cat([col, row], 1).float(), atol=1e-6, rtol=0)
    positions = grid_positions(resampled)  # read back from the grid's lowest frequency
    assert positions.tolist() == pytest.approx(p.tolist(), abs=1e-5)
    assert positions.min() == pytest.approx(-0.25, abs=1e-5) and positions.max() == pytest.approx(old - 0.75, abs=1e-5)
    assert positions.mean() == pytest.approx((old - 1) / 2) == grid_positions(pos_embed).mean()  # same centre
    # "extend" (diffusers' default) continues the integer grid, centred: positions the model never saw.
    extended = grid_positions(resample_pos_embed(pos_embed, new, "extend"))
    assert extended.tolist() == [i - old / 2 for i in range(new)]
    # Resampling a resampled grid composes: back to the original size gives the original grid.
    torch.testing.assert_close(resample_pos_embed(resampled, old), pos_embed, atol=1e-6, rtol=0)


def test_a_grid_with_buckets_resamples_its_resolution_square_onto_the_old_one():
    """data.buckets: a run's grid is its largest bucket's side and its data.resolution square is the centre (SD3's
    cropped embedding). init_from resamples so that the new square spans the old square (here the whole old grid
    of a square run) and the grid beyond continues at that spacing: the square bucket sees the positions the
    square model saw, resampled, whatever the largest bucket."""
    old, square, grid, dim = 8, 12, 18, 128  # a square 8-token run -> a bucket run: 12-token square in an 18-grid
    pos_embed = get_2d_sincos_pos_embed(dim, old, base_size=old).float()[None]
    bucketed = resample_pos_embed(pos_embed, grid, "resample", squares=(old, square))
    centre = bucketed.view(grid, grid, dim)[3:15, 3:15].reshape(1, -1, dim)  # (18 - 12) / 2 = 3
    torch.testing.assert_close(centre, resample_pos_embed(pos_embed, square, "resample"), atol=1e-6, rtol=0)
    spacing = old / square
    assert grid_positions(bucketed).tolist() == pytest.approx([(i - 3 + 0.5) * spacing - 0.5 for i in range(grid)],
                                                               abs=1e-5)
    # init_from reads each run's square from its config: data.resolution over the largest side, of its grid
    from training.run.start import squares
    square_run, bucket_run = {"data": {"resolution": 16}}, {"data": {"resolution": 24,
                                                                     "bucket_shapes": [[24, 24], [36, 16]]}}
    assert squares(square_run, bucket_run, old, grid) == (old, square) and squares(square_run, square_run, 8, 8) is None
    # and back: the bucket run's square onto a square run's whole grid gives the square run's grid
    torch.testing.assert_close(resample_pos_embed(bucketed, old, "resample", squares=(square, old)), pos_embed,
                               atol=1e-5, rtol=0)



@pytest.mark.parametrize("mode", ["resample", "extend"])
def test_a_square_run_into_a_bucket_grid_of_odd_margin_gives_its_square_bucket_the_old_positions(mode):
    """SD3's cropped embedding takes a shape's tokens at (grid - side) // 2 (diffusers' cropped_pos_embed). When the
    margin is odd (benchmarks/buckets.py's recipe: [0.5, 1, 2] at 28 px, patch 4: a 7-token square in a 10-grid;
    "auto" at 256 px with a VAE: 16 in 23), the square bucket of a run started from a square run must see exactly the
    positions that run trained on, not positions half a token off (what centring at (grid - side) / 2 gives)."""
    from diffusers.models.embeddings import PatchEmbed

    from training.data.buckets import shapes_for

    old, dim, patch = 7, 64, 4
    grid = max(max(s) for s in shapes_for([0.5, 1, 2], 28, patch)) // patch
    assert grid == 10  # the odd margin: (10 - 7) / 2
    pos_embed = get_2d_sincos_pos_embed(dim, old, base_size=old).float()[None]
    embed = PatchEmbed(height=grid * patch, width=grid * patch, patch_size=patch, embed_dim=dim,
                       pos_embed_max_size=grid)
    embed.pos_embed.copy_(resample_pos_embed(pos_embed, grid, mode, squares=(old, old)))
    torch.testing.assert_close(embed.cropped_pos_embed(28, 28), pos_embed, atol=1e-6, rtol=0)
    # and back: the bucket run's square onto a square run's grid is that square
    torch.testing.assert_close(resample_pos_embed(embed.pos_embed, old, mode, squares=(old, old)), pos_embed,
                               atol=1e-6, rtol=0)


# ---- resolution shift -------------------------------------------------------------------------------------


def test_shifted_ddpm_schedule_is_monotone_keeps_zero_terminal_snr_and_matches_the_flow_shift():
    ab = ddpm.make_schedule(1000, "quadratic", 0.00085, 0.012, zero_terminal_snr=True)
    assert torch.equal(ddpm.shift_schedule(ab, 1.0), ab)  # a = 1: identity
    for a in (1.5, 2.0, 4.0):
        shifted = ddpm.shift_schedule(ab, a)
        assert (shifted[1:] < shifted[:-1]).all() and shifted[-1] == 0 and 0 < shifted[0] < 1
        assert (shifted[:-1] < ab[:-1]).all()  # more noise at every step
        snr, snr_shifted = ab / (1 - ab), shifted / (1 - shifted)
        torch.testing.assert_close(snr_shifted[:-1], snr[:-1] / a ** 2)
        # At equal SNR it is flow matching's time shift: noise_level(shifted) = time_shift(noise_level(ab)).
        torch.testing.assert_close(ddpm.noise_level(shifted), common.time_shift(ddpm.noise_level(ab), a))
    cfg = config.load_config(ddpm.DEFAULTS, ["--data.resolution=32", "--objective.shift_base_resolution=16"], "ddpm")
    torch.testing.assert_close(ddpm.schedule_of(cfg), ddpm.shift_schedule(ab, 2.0))  # a = 32 / 16, from the config
    cfg = config.load_config(fm.DEFAULTS, ["--data.resolution=512", "--objective.shift_base_resolution=256"])
    assert common.shift_of(cfg) == 2.0


# ---- class mapping ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_class_embeddings_are_mapped_by_wordnet_id_from_imagenet_22k_to_1k():
    from timm.data import ImageNetInfo

    ids_22k, ids_1k = ImageNetInfo("imagenet-22k").label_names(), ImageNetInfo("imagenet-1k").label_names()
    tokens, dim = 2, 8
    source = torch.randn((len(ids_22k) + 1) * tokens, dim)
    target = torch.randn((len(ids_1k) + 1) * tokens, dim)
    mapped, unmatched = map_classes(source, target, ids_22k, ids_1k)
    src, tgt, out = (t.view(-1, tokens, dim) for t in (source, target, mapped))
    where = {c: i for i, c in enumerate(ids_22k)}
    assert len(unmatched) == 1000 - sum(c in where for c in ids_1k) == 1  # one 1k synset is not in fall11
    for j, c in enumerate(ids_1k):
        assert torch.equal(out[j], src[where[c]] if c in where else tgt[j])
    assert torch.equal(out[-1], src[-1])  # the null class of guidance
    assert out[0].tolist() == src[ids_22k.index("n01440764")].tolist()  # tench


def test_class_ids_and_captions_come_from_the_datasets_metadata(tmp_path):
    import datasets

    cfg = config.load_config(fm.DEFAULTS, ["--data.num_classes=9"])
    ds = make_demo_dataset(9, seed=0, resolution=8)
    assert read_class_ids(cfg.data, ds) == DEMO_CLASSES  # ClassLabel names
    assert class_names(cfg.data, ds) == DEMO_CLASSES
    cfg.data.class_ids, cfg.data.num_classes = "imagenet-1k", 1000  # the synset list the hub's ImageNet copies use
    assert read_class_ids(cfg.data, ds)[:2] == ["n01440764", "n01443537"]
    assert class_names(cfg.data, ds)[0] == "tench, Tinca tinca"
    (tmp_path / "ids.txt").write_text("n02084071\nn02121808\n")
    cfg.data.class_ids, cfg.data.num_classes = str(tmp_path / "ids.txt"), 2
    assert class_names(cfg.data, ds) == ["dog, domestic dog, Canis familiaris", "domestic cat, house cat, "
                                                "Felis domesticus, Felis catus"]
    with pytest.raises(ValueError, match="data.class_ids: 2 class ids .* but data.num_classes=9"):
        read_class_ids(config.load_config(fm.DEFAULTS, ["--data.class_ids", str(tmp_path / "ids.txt"),
                                                       "--data.num_classes=9"]).data, ds)
    cfg.data.class_ids = None
    plain = datasets.Dataset.from_dict({"label": [0, 1]})  # integer labels without names
    assert read_class_ids(cfg.data, plain) is None
    with pytest.raises(ValueError, match="data.class_ids"):
        class_names(cfg.data, plain)


def _wnid_imagefolder(root, wnids, per_class=12, seed=0):
    """An imagefolder whose class folders are WordNet ids, filled with demo shapes (one shape per class)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for c, wnid in enumerate(wnids):
        (root / wnid).mkdir(parents=True)
        for i in range(per_class):
            draw_shape(c % 9, 6, rng, resolution=16).save(root / wnid / f"{i}.png")
    return str(root)


@pytest.mark.slow
def test_init_from_a_22k_run_maps_each_class_to_its_wordnet_id(tmp_path):
    """End to end: a 'pre-training' run on 4 WordNet classes, then a new run on 3 classes (two shared, one
    new); every class embedding of the new run lands where its id says. Ids come from the imagefolders'
    ClassLabel names (the class folders, sorted)."""
    def args(name, wnids):
        return [*tiny_run_args(tmp_path, name, steps=2), *TINY_MODEL, "--data.source",
                _wnid_imagefolder(tmp_path / f"{name}_data", wnids), f"--data.num_classes={len(wnids)}",
                "--data.val_holdout=8", "--data.resolution=8", "--train.batch_size=8", "--ckpt.every=2"]

    source_run = fm.main(args("source", ["n01440764", "n01443537", "n01484850", "n02084071"]))
    target_run = fm.main(args("target", ["n09999999", "n02084071", "n01440764"]) +
                         ["--init_from", str(source_run / "export"), "--train.lr=0"])
    assert json.loads((target_run / "export" / "class_ids.json").read_text()) == ["n01440764", "n02084071", "n09999999"]
    report = json.loads((target_run / "init_from.json").read_text())
    assert any("2 of 3 classes mapped by id from 4" in line and "n09999999" in line for line in report["adapted"])
    source = load_file(str(source_run / "export" / "conditioner" / "diffusion_pytorch_model.safetensors"))
    source = source["class_embed.weight"]
    target = load_file(str(target_run / "checkpoints" / "step_00000002" / "model.safetensors"))
    emb = target["conditioner.class_embed.weight"]  # lr = 0: exactly what init_from loaded
    assert torch.equal(emb[0], source[0]) and torch.equal(emb[1], source[3])  # n01440764, n02084071
    assert torch.equal(emb[3], source[4])  # the null class of guidance
    assert not any(torch.equal(emb[2], source[i]) for i in range(5))  # n09999999 is new: fresh init


# ---- init_from vs resume, across resolutions ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """One 4-step run at 8 x 8 on the one-block model, its last checkpoint step 4: the source the init_from tests
    below load (they only read it), trained once for the module instead of once per test."""
    return trained_for_the_module(fm.main, tiny_run_args(tmp_path_factory.mktemp("source"), "low", steps=4) + TINY_MODEL
                                  + ["--data.resolution=8"])


@pytest.mark.slow
def test_init_from_starts_fresh_and_resume_continues(source_run, tmp_path, capsys):
    """The choice between init_from and resume, the resampled grid and the fresh optimizer are start.prepare_model's
    and start.init_from's, which both trainers call: one trainer here; DDPM's init_from runs in its chain below."""
    trainer, low = fm, source_run
    capsys.readouterr()  # the source's own output, when this test trained it
    high_args = tiny_run_args(tmp_path, "high", steps=3) + TINY_MODEL + [
        "--data.resolution=16", "--objective.shift_base_resolution=8", "--init_from", str(low), "--train.lr=0",
        "--conditioning.controls", '["size"]', "--ckpt.every=3", "--resume", "latest"]
    high = trainer.main(high_args)
    out = capsys.readouterr().out
    assert f"init_from {low}/checkpoints/step_00000004" in out and "resumed from" not in out
    report = json.loads((high / "init_from.json").read_text())
    assert report["adapted"][0].startswith("transformer.pos_embed.pos_embed: resample 4^2 -> 8^2")
    weights = load_file(str(high / "checkpoints/step_00000003/model.safetensors"))
    assert sorted(report["missing"]) == sorted(k for k in weights if k.startswith("conditioner.control_mlp.size"))
    assert report["unexpected"] == [] and report["reshaped"] == []
    # Fresh optimizer and step: the new run counts from 0 (3 steps, not 4 + 3).
    ckpt = high / "checkpoints" / "step_00000003"
    state, moments = checkpoints.read_state(ckpt), checkpoints.read_optimizer_state(ckpt)["state"]
    assert state["step"] == 3 and next(iter(moments.values()))["step"] == 3
    # Weights and EMA came from the source (lr = 0 leaves the weights as loaded); the grid is the resampled one.
    src, dst = (load_file(str(p / "checkpoints" / name / "model.safetensors"))
                for p, name in ((low, "step_00000004"), (high, "step_00000003")))
    assert torch.equal(dst["transformer.transformer_blocks.0.attn.to_q.weight"],
                       src["transformer.transformer_blocks.0.attn.to_q.weight"])
    positions = grid_positions(dst["transformer.pos_embed.pos_embed"])
    assert positions.tolist() == pytest.approx([(i + 0.5) * 4 / 8 - 0.5 for i in range(8)], abs=1e-5)
    # The export carries the resampled grid through from_pretrained, and the shift through its config.
    model, cfg = load_exported(high / "export")
    assert torch.equal(model.transformer.pos_embed.pos_embed, dst["transformer.pos_embed.pos_embed"])
    assert common.shift_of(cfg) == 2.0
    # Resume (same run, longer): continues its own checkpoint; init_from is not applied again.
    trainer.main(high_args[:] + ["--train.max_steps=5"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_00000003 at step 3" in out and f"init_from {low}" not in out


@pytest.mark.slow
def test_init_from_keeps_the_source_ema(source_run, tmp_path):
    """A fine-tuning run keeps the EMA it loads: after 20 steps at ema_decay 0.999 the EMA has moved 2% of the
    way to the weights (d = decay, no warm-up), not restarted from them (the warm-up from n = 0 weighs the
    loaded EMA prod (1 + n) / (10 + n) ~ 1e-7 after 20 steps). Tensors init_from leaves fresh (here the size
    control's MLP) warm up as before. Resuming the fine-tuning run keeps the rule (ema_inherited in state.pt)."""
    source = source_run
    args = tiny_run_args(tmp_path, "tuned", steps=20) + TINY_MODEL + ["--data.resolution=8",
        f"--init_from={source}", "--train.ema_decay=0.999", "--ckpt.every=10", "--conditioning.controls", '["size"]']
    tuned = fm.main(args)
    source_ema = load_file(str(source / "checkpoints" / "step_00000004" / "ema.safetensors"))
    ema, raw = (load_file(str(tuned / "checkpoints" / "step_00000020" / f"{n}.safetensors")) for n in ("ema", "model"))
    shared = [k for k in source_ema if k in ema and ema[k].shape == source_ema[k].shape and k.endswith("weight")]

    def distance(a, b):
        return sum((a[k] - b[k]).double().pow(2).sum() for k in shared).sqrt().item()

    moved = distance(raw, source_ema)  # how far training took the weights
    assert moved > 0.1
    # ema = 0.98 source EMA + 0.02 (recent weights): within about 2% of `moved` of the source's EMA
    assert distance(ema, source_ema) < 0.05 * moved and distance(ema, raw) > 0.9 * moved
    # The fresh tensors' EMA warmed up: it lags the weights by a step or two, where d = 0.999 from the start
    # would have left it near the fresh init, about twice the last 10 steps' movement away.
    fresh = [k for k in ema if k.startswith("conditioner.control_mlp.size")]
    raw10 = load_file(str(tuned / "checkpoints" / "step_00000010" / "model.safetensors"))
    lag = sum((ema[k] - raw[k]).double().pow(2).sum() for k in fresh).sqrt()
    assert fresh and lag < 0.5 * sum((raw10[k] - raw[k]).double().pow(2).sum() for k in fresh).sqrt()
    assert checkpoints.read_state(tuned / "checkpoints" / "step_00000020")["ema_inherited"]


@pytest.mark.slow
def test_init_from_reports_reshaped_tensors_and_rejects_a_wrong_source(source_run, tmp_path, tiny_vae):
    pixels = source_run
    latents = fm.main(tiny_run_args(tmp_path, "latents", steps=2) + TINY_MODEL + [
        "--encoders.vae", tiny_vae, "--init_from", str(pixels / "export")])
    reshaped = json.loads((latents / "init_from.json").read_text())["reshaped"]  # 3 pixel channels -> 4 latent
    assert any(r.startswith("transformer.pos_embed.proj.weight: (32, 3, 2, 2) -> (32, 4, 2, 2)") for r in reshaped)
    assert any(r.startswith("transformer.proj_out.weight") for r in reshaped)
    with pytest.raises(config.ConfigError, match="init_from=.*nowhere': no such run"):  # before any work
        fm.main(tiny_run_args(tmp_path, "bad", steps=2) + ["--init_from", str(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="init_from: .* is not a run folder"):
        fm.main(tiny_run_args(tmp_path, "bad", steps=2) + ["--init_from", str(tmp_path / "empty")])


# ---- crop policy per resolution ------------------------------------------------------------------------------


@pytest.mark.parametrize("crop", ["center", "random", "random_resized"])
def test_crop_metadata_is_in_original_pixels_whatever_the_training_resolution(crop):
    import random

    from PIL import Image

    cfg = config.load_config(fm.DEFAULTS, [f"--data.crop={crop}", "--data.random_flip=true"])
    img = Image.new("RGB", (300, 200))
    metas = [preprocess(img, res, cfg.data, random.Random(7))[1] for res in (8, 16, 64)]
    for meta in metas[1:]:  # the same control values at 256 and 512 px: what the model learned still applies
        assert all(torch.equal(meta[k], metas[0][k]) for k in metas[0])
    top, left, h, w = metas[0]["crop_box"].tolist()
    assert metas[0]["orig_hw"].tolist() == [200, 300] and h == w <= 200 and top + h <= 200 and left + w <= 300


# ---- recipes -----------------------------------------------------------------------------------------------------

TRANSFER_RECIPES = {  # recipe: (the recipe it starts from, resolution of its tiny version)
    "imagenet22k_256": (None, 16), "imagenet256_from22k": ("imagenet22k_256", 16),
    "imagenet512": ("imagenet256_from22k", 32),
    "imagenet22k_captions_256": (None, 16), "cc12m_from22k": ("imagenet22k_captions_256", 16),
    "cc12m_512": ("cc12m_from22k", 32)}
TEXT_CHAIN = {"imagenet22k_captions_256", "cc12m_from22k", "cc12m_512"}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", [fm, ddpm])
def test_transfer_recipes_load_and_their_tiny_versions_run_as_a_chain(trainer, tmp_path, tiny_vae, tiny_text_encoder):
    method = "flow_matching" if trainer is fm else "ddpm"
    runs = {}
    for recipe, (parent, resolution) in TRANSFER_RECIPES.items():
        recipe_file = str(ROOT / "configs" / f"{recipe}.json")
        full = config.load_config(trainer.DEFAULTS, ["--config", recipe_file], method)  # one recipe, both trainers
        assert full.train.lr == 1e-4 and full.run_dir == f"runs/{method}_{recipe}"
        if parent:
            assert full["init_from"].startswith(f"runs/{method}_")  # resolved in the dict: config.json records it
        if full.data.resolution == 512:
            # 16 GPUs; a = 512 / 256
            assert full.train.batch_size * full.train.grad_accum * 16 == 384 and common.shift_of(full) == 2.0
            assert full.model.pos_embed_transfer == "resample"
        if "22k" in recipe and not recipe.endswith("from22k"):
            assert full.data.num_classes == len(read_class_ids(full.data, None)) == 21841
        if (trainer is ddpm) == (recipe in TEXT_CHAIN):  # init_from is run/start.py's, shared by both trainers: each
            continue  # runs one chain (flow matching the text chain, DDPM the class chain 22k -> 1k -> 512 px)
        # The tiny version: embedded data, tiny encoders, initialised from the previous tiny run of the chain.
        tiny = ["--config", recipe_file, *tiny_run_args(tmp_path, recipe, steps=2), *TINY_MODEL,
                "--data.source=embedded", "--data.val_split=null", "--data.image_column=image",
                f"--data.resolution={resolution}", "--data.num_workers=0", "--objective.shift_base_resolution=16",
                "--data.demo_samples=48", "--data.val_holdout=16", "--val.loss_samples=8",  # each link: seconds
                "--log.report=false",
                "--train.compile=false"]  # the recipes compile: inductor's CPU build is half the chain's time
        tiny += ["--encoders.vae", tiny_vae, "--init_from", str(runs[parent]) if parent else "null"]
        if full.data.label_column:
            tiny += ["--data.label_column=label", "--data.class_ids=null", "--data.num_classes=9"]
        if full.encoders.text_encoder:
            tiny += ["--encoders.text_encoder", tiny_text_encoder, "--encoders.max_tokens=8"]
            tiny += ["--data.caption_column=caption"] if full.data.caption_column else []
        runs[recipe] = trainer.main(tiny)
        if parent:
            report = json.loads((runs[recipe] / "init_from.json").read_text())
            assert report["loaded"] > 20 and report["reshaped"] == [] and report["unexpected"] == []
            assert any("pos_embed" in a for a in report["adapted"]) == (resolution == 32)
    # label captions: the text model of the 22k chain was trained on the class names.
    rows = map(json.loads, (runs["imagenet22k_captions_256"] / "metrics.jsonl").read_text().splitlines()) \
        if trainer is fm else []
    assert all(math.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)


def test_class_ids_with_nothing_in_common_keep_a_fresh_init_and_say_why():
    source = {"conditioner.class_embed.weight": torch.randn(3, 4)}
    target = {"conditioner.class_embed.weight": torch.zeros(3, 4)}
    out, report = adapt_state(source, target, ["n01440764", "n01443537"], ["tench", "goldfish"])
    assert torch.equal(out["conditioner.class_embed.weight"][:2], torch.zeros(2, 4))
    assert "0 of 2 classes mapped" in report["adapted"][0] and "set data.class_ids" in report["adapted"][0]
