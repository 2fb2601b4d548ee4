"""The paper's conditioning mechanisms: control schedule, independent dropout, guidance on both, noisy
replicate padding, true control metadata, and the disentangled vs adaptive-norm baseline."""

import numpy as np
import pytest
import torch
from PIL import Image

from training.config import config
from training.data.batching import drop_conditions
from training.data.sources import preprocess
from training.model.mmdit import Conditioner, build_denoiser, control_weight, guided, load_exported, replicate_padding
import train_flow_matching as fm


def tiny_model(mode="disentangled", controls=("size", "crop", "flip")):
    cfg = config.load_config(fm.DEFAULTS, [f"--conditioning.mode={mode}", "--model.num_layers=1",
                                           "--data.num_classes=9",
                                           f"--conditioning.controls={list(controls)}".replace("'", '"')])
    torch.manual_seed(0)
    model = build_denoiser(cfg, 3, 8).eval()
    for mlp in model.conditioner.control_mlp.values():  # trained controls: make their effect visible
        torch.nn.init.normal_(mlp[2].weight, std=0.5)
    return model


def batch(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"label": torch.randint(0, 9, (n,), generator=g), "orig_hw": torch.randint(100, 500, (n, 2), generator=g),
            "crop_box": torch.randint(0, 100, (n, 4), generator=g), "flip": torch.randint(0, 2, (n, 1), generator=g),
            "drop": torch.zeros(n, dtype=torch.bool)}


def test_control_weight_schedule():
    t = torch.linspace(0, 1, 101)
    for p in (0.5, 1.0, 3.0):
        w = control_weight(t, p)
        assert w[0] == 1 and w[-1] == pytest.approx(0, abs=1e-7) and (w.diff() <= 0).all()
    torch.testing.assert_close(control_weight(t, 2.0), torch.cos(torch.pi * t / 2) ** 2)


def test_semantic_and_control_dropout_are_independent():
    torch.manual_seed(0)
    n = 200_000
    sem, ctl = drop_conditions(n, 0.1, "cpu"), drop_conditions(n, 0.3, "cpu")
    assert sem.float().mean().item() == pytest.approx(0.1, abs=0.003)
    assert ctl.float().mean().item() == pytest.approx(0.3, abs=0.003)
    assert (sem & ctl).float().mean().item() == pytest.approx(0.03, abs=0.002)  # P(both) = P(a) P(b)


@pytest.mark.parametrize("mode", ["disentangled", "both", "adanorm"])
def test_each_control_acts_on_its_own_schedule(mode):
    """Size (low-level) under w = cos(pi t / 2): exactly no effect at pure noise, some at data; crop and flip
    (p = 0, the defaults) act at pure noise already. The adanorm baseline (w = 1) lets every control act there."""
    model, x = tiny_model(mode), torch.randn(3, 3, 8, 8)
    assert model.conditioner.controls == {"size": 1.0, "crop": 0.0, "flip": 0.0}  # the defaults
    # size: the original twice as large, the same relative crop (the crop control reads the box / the short side)
    moved = {"size": {"orig_hw": batch()["orig_hw"] * 2, "crop_box": batch()["crop_box"] * 2},
             "crop": {"crop_box": torch.zeros(3, 4, dtype=torch.long)},
             "flip": {"flip": 1 - batch()["flip"]}}
    for name, change in moved.items():
        with torch.no_grad():
            at = {t: (model(x, torch.full((3,), t), batch()), model(x, torch.full((3,), t), {**batch(), **change}))
                  for t in (1000.0, 0.0)}
        assert not torch.allclose(*at[0.0])  # at clean data every control changes the output
        if name == "size" and mode != "adanorm":
            assert torch.equal(*at[1000.0])  # exactly: w(1) = 0
        else:
            assert not torch.allclose(*at[1000.0], rtol=0, atol=1e-4), name


@pytest.mark.parametrize("t,moves", [(1000.0, False), (500.0, True)])
def test_the_crop_carries_no_size(t, moves):
    """Issue 42: the crop control says where and how much of the original is shown, relative to its short side, so
    the original size reaches the model only through its own gated control. In the disentangled mode with the
    paper's schedule (size p = 1, crop p = 0), the whole image of a 32 px and of an 8 px original (the same
    relative crop) give exactly the same output at pure noise (t = 1, the first sampling step); at t = 0.5 the size
    control acts. A crop in original pixels (the old form) says 8 px at t = 1 and fails the first case."""
    model, x = tiny_model("disentangled", ("size", "crop")), torch.randn(3, 3, 8, 8)
    assert model.conditioner.controls == {"size": 1.0, "crop": 0.0}
    big = {**batch(), "orig_hw": torch.tensor([[32, 32]] * 3), "crop_box": torch.tensor([[0, 0, 32, 32]] * 3)}
    small = {**big, "orig_hw": torch.tensor([[8, 8]] * 3), "crop_box": torch.tensor([[0, 0, 8, 8]] * 3)}
    with torch.no_grad():
        a, b = model(x, torch.full((3,), t), big), model(x, torch.full((3,), t), small)
    assert torch.equal(a, b) != moves
    if moves:
        assert (a - b).norm() / a.norm() > 1e-3


def test_a_checkpoint_with_the_pixel_crop_fails_to_load():
    """The crop's MLP reads 3 scalars, no longer 4 pixel values: an old checkpoint fails loudly, not silently."""
    model = tiny_model("disentangled", ("size", "crop"))
    state = model.state_dict()
    old = state["conditioner.control_mlp.crop.0.weight"]
    state["conditioner.control_mlp.crop.0.weight"] = torch.zeros(old.shape[0], 64 * 4)
    with pytest.raises(RuntimeError, match="control_mlp.crop"):
        model.load_state_dict(state)


FAIR_RATIO = 10  # the most any arm's class effect at initialisation may exceed another's (see the test)


def semantic_effect(mode, text, seed, pooled_text=None):
    """Relative output change at initialisation when only the semantic condition changes (each label to
    another; or fresh encoder-scale text features), over random inputs at random times."""
    args = [f"--conditioning.mode={mode}", "--model.num_layers=1", "--data.num_classes=9"]
    args += [] if pooled_text is None else [f"--conditioning.pooled_text={str(pooled_text).lower()}"]
    torch.manual_seed(seed)
    model = build_denoiser(config.load_config(fm.DEFAULTS, args), 3, 8, (6, 32, 24) if text else None).eval()
    n, g = 16, torch.Generator().manual_seed(seed)
    x, t, label = torch.randn(n, 3, 8, 8, generator=g), torch.rand(n, generator=g) * 1000, torch.arange(n) % 9

    def cond(i):
        if text:
            return {"text_tokens": torch.randn(n, 6, 32, generator=g), "text_mask": torch.ones(n, 6),
                    "text_pooled": torch.randn(n, 24, generator=g), "drop": torch.zeros(n, dtype=torch.bool)}
        return {"label": (label + i * (1 + torch.arange(n) % 8)) % 9, "drop": torch.zeros(n, dtype=torch.bool)}

    a, b = cond(0), cond(1)
    with torch.no_grad():
        out_a, out_b = model(x, t, a), model(x, t, b)
        pooled_a, pooled_b = model.conditioner(a, t / 1000)[1], model.conditioner(b, t / 1000)[1]
    return ((out_a - out_b).norm() / out_a.norm()).item(), torch.equal(pooled_a, pooled_b)


def test_every_arm_starts_fair():
    """At initialisation, switching the class moves each arm's output by a comparable amount: every class path
    starts at N(0, 0.02) and the context projection without a bias (DiT's initialisation), so the arms differ
    by at most FAIR_RATIO = 10, one order of magnitude. What remains is the architecture's, not the
    initialisation's: the class token is one key among N + 1 (here 16 image tokens + 1) that each image token
    attends to, while a class vector in the adaptive norm modulates every token (measured: about 5x here).
    With nn.Embedding's default N(0, 1) the baseline's class moved the output 300x more, and with the default
    context bias the class token was 12x weaker than the baseline's class vector.
    Text: the tokens always enter through attention; the pooled vector reaches the adaptive norm only where
    conditioning.pooled_text says (off in disentangled, by default): then the adaptive norm's pooled input is
    the same for every caption, and the caption still moves the output (through attention)."""
    effects = {mode: [semantic_effect(mode, False, seed)[0] for seed in range(3)]
               for mode in ("disentangled", "both", "adanorm")}
    means = {mode: np.mean(v) for mode, v in effects.items()}
    assert max(means.values()) / min(means.values()) < FAIR_RATIO, means
    assert all(min(v) > 1e-3 for v in effects.values()), effects  # every arm's class acts from the start
    text = {(mode, pooled): semantic_effect(mode, True, 0, pooled) for mode, pooled in
            (("disentangled", None), ("disentangled", True), ("both", None), ("adanorm", None), ("both", False))}
    for (mode, pooled), (effect, pooled_same) in text.items():
        in_norm = pooled if pooled is not None else mode != "disentangled"
        assert effect > 1e-3 and pooled_same != in_norm, (mode, pooled)
    # Arms with the same text paths start identical (the text's scale is the encoder's, not an initialisation).
    assert text[("disentangled", True)][0] == text[("both", None)][0] == text[("adanorm", None)][0]
    assert text[("disentangled", None)][0] == text[("both", False)][0]


def test_control_guidance_zero_is_standard_cfg_and_both_scales_combine():
    model, x, t = tiny_model(), torch.randn(3, 3, 8, 8), torch.full((3,), 400.0)
    cond = batch()
    with torch.no_grad():
        m = lambda drop, drop_controls: model(x, t, {**cond, "drop": torch.full((3,), drop),
                                                     "drop_controls": torch.full((3,), drop_controls)})
        c, null, c_no_controls = m(False, False), m(True, False), m(False, True)
        torch.testing.assert_close(guided(model, x, t, cond, 4.0, 0.0), null + 4.0 * (c - null))
        torch.testing.assert_close(guided(model, x, t, cond, 1.0, 0.0), c)
        torch.testing.assert_close(guided(model, x, t, cond, 3.0, 2.0),
                                   null + 3.0 * (c - null) + 2.0 * (c - c_no_controls), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(c, c_no_controls)


@pytest.mark.parametrize("mode,controls", [("disentangled", ("size", "crop", "flip")), ("adanorm", ("size",)),
                                           ("both", ("crop",)), ("disentangled", ())])
def test_the_denoiser_is_diffusers_forward_with_the_adanorm_vector_added(mode, controls):
    """The Denoiser writes the MMDiT's forward out to add the conditioner's vector to the time/pooled embedding;
    the oracle is diffusers' own SD3Transformer2DModel.forward, with that vector added to the embedding's output
    by a forward hook (test only). Trained-looking weights, so that every layer passes signal."""
    model = tiny_model(mode, controls)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, t, noise_level = torch.randn(3, 3, 8, 8), torch.tensor([900.0, 400.0, 20.0]), torch.tensor([0.8, 0.5, 0.1])
    cond = dict(batch(), drop_controls=torch.tensor([False, True, False]))
    context, pooled, adanorm = model.conditioner(cond, noise_level)
    hook = model.transformer.time_text_embed.register_forward_hook(lambda module, args, out: out + adanorm)
    with torch.no_grad():
        expected = model.transformer(hidden_states=x, encoder_hidden_states=context, pooled_projections=pooled,
                                     timestep=t).sample
        hook.remove()
        torch.testing.assert_close(model(x, t, cond, noise_level), expected, rtol=0, atol=0)
    assert not torch.is_tensor(adanorm) if mode == "disentangled" and not controls else adanorm.abs().sum() > 0
    assert list(vars(model)["_forward_hooks"]) == [] and not model.transformer.time_text_embed._forward_hooks


def test_noisy_replicate_padding():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0]]).float()
    # Rows of different sizes and pad embeddings larger than any: features of RMS 1 could not tell noise
    # relative to each row's real tokens from noise of a fixed std, or from the RMS of the batch or the padding.
    tokens = torch.randn(3, 7, 64) * torch.tensor([3.0, 0.5, 10.0]).view(3, 1, 1)
    tokens[~mask.bool()] = 100.0
    exact = replicate_padding(tokens, mask, 0.0)
    noisy = replicate_padding(tokens, mask, 0.1)
    real = mask.bool()
    torch.testing.assert_close(noisy[real], tokens[real])  # real tokens untouched
    for j in range(3, 7):  # row 0: 3 real tokens; padded position j is a copy of token j mod 3
        torch.testing.assert_close(exact[0, j], tokens[0, j % 3])
    torch.testing.assert_close(exact[2, 1:], tokens[2, :1].expand(6, 64))
    pad_noise = (noisy - exact)[~real]
    assert (pad_noise.abs() > 0).all(1).all()  # every padded position is filled, with fresh noise
    for row, n in ((0, 3), (2, 1)):  # the noise is relative to the RMS of the row's real tokens
        rms = tokens[row, :n].pow(2).mean().sqrt().item()
        assert (noisy - exact)[row, n:].std().item() == pytest.approx(0.1 * rms, rel=0.15)
    assert not torch.isclose(noisy[~real], tokens[~real]).all(1).any()  # no pad embedding survives


def test_zero_padding_is_the_baseline_of_replicate_padding():
    """conditioning.zero_padding (docs/benchmarks/emoji_claims.md's baseline): the padded positions of the context
    hold zeros, the caption's own tokens are untouched, a dropped caption's padding is the empty caption's (its
    mask); with replicate padding the same positions hold copies, and with neither the encoder's pad features."""
    torch.manual_seed(0)
    arms = {name: Conditioner(0, 1, 8, 8, 16, text_tokens=5, padding_noise=noise, zero_padding=zeros).eval()
            for name, noise, zeros in (("zeros", None, True), ("replicate", 0.0, False), ("encoder", None, False))}
    null = torch.randn(5, 8)
    for c in arms.values():
        c.null_tokens.copy_(null), c.null_mask[:2].fill_(1)
    tokens = torch.randn(2, 5, 8) + 3.0  # no feature is 0 by chance
    cond = {"text_tokens": tokens, "text_mask": torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 0]]),
            "text_pooled": torch.randn(2, 8), "drop": torch.tensor([False, True])}
    level = torch.tensor([0.5, 0.5])
    context = {name: c(cond, level)[0] for name, c in arms.items()}
    torch.testing.assert_close(context["zeros"][0, :3], tokens[0, :3])
    assert (context["zeros"][0, 3:] == 0).all()
    torch.testing.assert_close(context["zeros"][1, :2], null[:2])  # dropped: the empty caption, its mask
    assert (context["zeros"][1, 2:] == 0).all()
    torch.testing.assert_close(context["replicate"][0, 3:], tokens[0, :2])
    torch.testing.assert_close(context["encoder"][0], tokens[0])


@pytest.mark.parametrize("crop,flip", [("center", False), ("random", True), ("random_resized", True)])
def test_control_metadata_matches_the_crop_applied(crop, flip):
    w, h = 240, 160  # red channel = x coordinate, green = y coordinate
    xs, ys = np.meshgrid(np.arange(w), np.arange(h))
    img = Image.fromarray(np.stack([xs, ys, np.zeros_like(xs)], -1).astype(np.uint8))
    data = config.Config(crop=crop, min_crop_scale=0.3, random_flip=flip)
    rng = __import__("random").Random(3)
    boxes, flips = [], set()
    for _ in range(10):
        x, meta = preprocess(img, 32, data, rng)
        top, left, height, width = meta["crop_box"].tolist()
        boxes.append((top, left, height)), flips.add(meta["flip"].item())
        assert meta["orig_hw"].tolist() == [h, w] and height == width
        assert 0 <= top <= h - height and 0 <= left <= w - width
        pixels = (x + 1) * 127.5
        red, green = pixels[0, 16].numpy(), pixels[1, :, 16].numpy()
        if meta["flip"].item():
            red = red[::-1]
        # The sampled coordinates span the recorded box (up to one output pixel of resampling).
        step = width / 32
        assert red[0] == pytest.approx(left + step / 2, abs=step + 1) and red[-1] == \
            pytest.approx(left + width - step / 2, abs=step + 1)
        assert green[0] == pytest.approx(top + step / 2, abs=step + 1) and green[-1] == \
            pytest.approx(top + height - step / 2, abs=step + 1)
        assert (np.diff(pixels[0, 16].numpy()) < 0).all() == bool(meta["flip"].item())
        if crop == "center":
            assert meta["crop_box"].tolist() == [0, 40, 160, 160]
    # Not one draw: the flip is drawn both ways and a random box moves over its whole range (a flip never
    # drawn, or left drawn in the height's range, would pass every check above).
    assert flips == ({0, 1} if flip else {0})
    tops, lefts, sides = zip(*boxes)
    if crop == "random":
        assert set(sides) == {160} and max(lefts) - min(lefts) > 40
    if crop == "random_resized":
        assert min(sides) >= 0.3 * 160 - 1 and max(sides) - min(sides) > 40 and len(set(tops)) > 1
        assert max(left + side for left, side in zip(lefts, sides)) > 160  # boxes beyond the first h columns


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["train_flow_matching", "train_ddpm"])
@pytest.mark.parametrize("recipe", ["imagenet256", "cc12m"])
def test_recipes_load_and_a_tiny_version_runs(recipe, trainer, tmp_path, tiny_vae, tiny_text_encoder):
    from conftest import ROOT, tiny_run_args

    module = __import__(trainer)
    recipe_file = str(ROOT / "configs" / f"{recipe}.json")
    full = config.load_config(module.DEFAULTS, ["--config", recipe_file], trainer[6:])  # one recipe, both trainers
    assert full.train.lr == 1e-4 and full.train.betas == [0.9, 0.999] and full.run_dir.endswith(recipe)
    assert full.train.batch_size * full.train.grad_accum * 16 == 2048  # global batch 2048 on 2 nodes x 8 GPUs
    # The same recipe, shrunk: the embedded data and tiny encoders stand in for the hub's.
    tiny = ["--config", recipe_file, *tiny_run_args(tmp_path, recipe, steps=2), "--data.source=embedded",
            "--data.val_split=null", "--data.image_column=image", "--data.resolution=16", "--data.num_workers=0",
            "--model.num_layers=1", "--model.num_attention_heads=2", "--model.attention_head_dim=16",
            "--encoders.vae", tiny_vae, "--train.compile=false"]  # compiling on 2 CPU cores takes minutes
    if full.encoders.text_encoder:
        tiny += ["--encoders.text_encoder", tiny_text_encoder, "--encoders.max_tokens=8",
                 "--data.caption_column=caption"]
    run = module.main(tiny)
    assert run.name == recipe
    model, cfg = load_exported(run / "export")
    assert cfg["conditioning"]["controls"] == full.conditioning.controls
    assert set(model.conditioner.control_mlp) == set(full.conditioning.controls)
