"""Shared fixtures: tiny run arguments and tiny frozen encoders, built offline and saved with save_pretrained
so that the trainers load them through the same code path as hub ids."""
import os
import signal
import sys
from pathlib import Path

import pytest

# One intra-op thread per test process (and per trainer it launches), set before torch loads: the suite runs on
# two xdist workers, and torch's default of a thread per core in each oversubscribes the cores, where OpenMP's
# spinning makes the many tiny ops of these tests several times slower (the fast tier: 69 s -> 47 s on 2 cores).
# A value set outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The trainers the tests launch as subprocesses print every thread's Python stack if they crash in C++ (an
# abort or a segfault), so a failure in CI says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

DEMO_WORDS = ["a", "small", "large", "red", "green", "blue", "circle", "square", "triangle"]


# Two narrow blocks (width 32): the end-to-end tests check the loop's plumbing and bookkeeping, not what a bigger
# model learns, and this halves a run's CPU against the default four blocks of width 128. A test that needs the
# default model names its own --model.* keys after these (later arguments win).
TINY_MODEL = ["--model.num_layers=2", "--model.num_attention_heads=2", "--model.attention_head_dim=16"]


def tiny_run_args(tmp_path, name="run", steps=4):
    """A few-second training run on a small slice of the embedded data, with a two-block narrow model."""
    return [*TINY_MODEL, "--run_dir", str(tmp_path / name), "--data.cache_dir", str(tmp_path / "cache"),
            "--data.demo_samples=320", "--data.val_holdout=64", f"--train.max_steps={steps}",
            "--train.batch_size=16", "--train.warmup_steps=2", "--val.steps=2", "--val.num_samples=4",
            "--val.loss_samples=16", "--log.wandb=off", "--log.every=2", "--val.every=1000", "--ckpt.every=1000"]


# Set by pytest itself, and by libraries once per process: sklearn and inductor's C++ builder set the OpenMP
# duplicate-library switch, inductor a flag for its compiled kernels, wandb the address of its service process
# on its first run. Not a test's doing.
SET_BY_LIBRARIES = {"PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK",
                    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "WANDB_SERVICE"}


# dynamo wraps these once, on its first compilation, to tag modules made inside a compiled forward.
PATCHED_BY_TORCH = {"torch.nn.Module.__init__", "torch.nn.Module.__setstate__"}


NEW_API = ["", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
           "mkldnn.conv", "mkldnn.rnn"]


def backend(path):
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def tf32_switches():
    """TF32 for fp32 matmuls and convolutions, and the fp32 matmul precision (which the first switch sets too),
    read and restored through the legacy switches that common.make_accelerator and inductor use. Once torch's
    per-backend API (fp32_precision) has also been used in the process, the legacy getters raise ("mix of the
    legacy and new APIs"), as they did once in a full suite: the state is then read, and restored, through the
    per-backend switches, which never raise."""
    try:
        return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                torch.get_float32_matmul_precision())
    except RuntimeError:
        return ("fp32_precision", *(backend(path).fp32_precision for path in NEW_API))


def set_tf32_switches(switches):
    if switches[0] == "fp32_precision":
        for path, value in zip(NEW_API, switches[1:]):
            backend(path).fp32_precision = value
        return
    matmul, cudnn, precision = switches
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.set_float32_matmul_precision(precision)  # after allow_tf32, which sets it as well


def trained_for_the_module(main, argv):
    """A trainer run by a module or session fixture: set up before the first test that asks for it, so unseen by
    that test's leak guard. The accelerate state and the TF32 switches the run set are undone here, so that they do
    not reach every later test of the worker (where a test that leaks them would pass or fail by order)."""
    from accelerate.state import AcceleratorState

    switches = tf32_switches()
    out = main(argv)
    AcceleratorState._reset_state(reset_partial_state=True)
    set_tf32_switches(switches)
    return out


def global_state():
    """What one test could leave behind for the next: torch's global switches (TF32 included), a process group
    left initialised, dynamo's config, the environment, and the attributes tests patch on torch (a patch not
    undone, or undone into a deleted entry, as pytest's monkeypatch does to torch._dynamo.config on torch 2.14)."""
    import torch._dynamo

    patched = {name: dict(vars(obj)) for name, obj in [("torch", torch), ("torch.nn.Module", torch.nn.Module),
                                                       ("torch.Tensor", torch.Tensor), ("torch.distributed",
                                                       torch.distributed), ("torch.cuda", torch.cuda)]}
    return {"switches": (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
                         torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled()),
            "tf32": tf32_switches(),
            "process_group": torch.distributed.is_available() and torch.distributed.is_initialized(),
            "dynamo": {k: getattr(torch._dynamo.config, k, "<deleted>")
                       for k in torch._dynamo.config.get_config_copy()},
            "environ": {k: v for k, v in os.environ.items() if k not in SET_BY_LIBRARIES}, "patched": patched}


def leaked(before, after):
    """The differences that matter: a changed or deleted entry (new attributes are lazily imported submodules)."""
    found = [f"torch switches {before['switches']} -> {after['switches']}"] \
        if before["switches"] != after["switches"] else []
    found += [f"TF32 switches (cuda.matmul.allow_tf32, cudnn.allow_tf32, float32_matmul_precision) {before['tf32']} -> "
              f"{after['tf32']}"] if before["tf32"] != after["tf32"] else []
    left_group = after["process_group"] and not before["process_group"]
    found += ["a torch.distributed process group left initialised"] if left_group else []
    found += [f"torch._dynamo.config.{k}: {v} -> {after['dynamo'][k]}" for k, v in before["dynamo"].items()
              if after["dynamo"][k] != v]
    found += [f"os.environ[{k!r}]" for k in set(before["environ"]) ^ set(after["environ"])]
    found += [f"os.environ[{k!r}]" for k in before["environ"] if after["environ"].get(k, before["environ"][k])
              != before["environ"][k]]
    for name, attributes in before["patched"].items():
        now = after["patched"][name]
        found += [f"{name}.{k}" for k, v in attributes.items() if (k not in now or now[k] is not v)
                  and f"{name}.{k}" not in PATCHED_BY_TORCH]
    return found


@pytest.fixture(autouse=True)
def no_global_state_left_behind():
    """Every test leaves torch, dynamo and the environment as it found them, so that no test passes or fails
    because of the one that ran before it."""
    before = global_state()
    yield
    found = leaked(before, global_state())
    assert not found, "this test left global state behind: " + "; ".join(found)


@pytest.fixture(autouse=True)
def stop_signal_handlers_put_back():
    """A trainer run in this process installs its stop-signal handlers (common.StopSignals: Ctrl-C then stops at the
    next log step): the test's end puts pytest's back, so a Ctrl-C still stops the suite at once."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    handlers = [signal.getsignal(s) for s in signals]
    yield
    for sig, handler in zip(signals, handlers):
        signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def fresh_accelerate_state(no_global_state_left_behind):
    """Each in-process run starts from a clean accelerate state (mixed precision is set once per process). The TF32
    switches that common.make_accelerator turns on go with it, also where the test reset accelerate's state itself
    (its calls are counted); changed by a test that made no accelerator, they are the leak guard's to report. (Set
    up after the guard, so torn down before it looks.)"""
    from accelerate.state import AcceleratorState, PartialState

    import common

    switches, made, make_accelerator = tf32_switches(), [], common.make_accelerator
    common.make_accelerator = lambda *args, **kwargs: made.append(1) or make_accelerator(*args, **kwargs)
    yield
    common.make_accelerator = make_accelerator
    if made or PartialState._shared_state:
        set_tf32_switches(switches)
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def tiny_vae(tmp_path_factory):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=8, sample_size=32, scaling_factor=0.5, shift_factor=0.1)
    path = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_text_encoder(tmp_path_factory):
    """A 2-layer CLIP text encoder with a word-level tokenizer trained on the demo captions' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]"] + DEMO_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]",
                                                       special_tokens=[("[BOS]", 2), ("[EOS]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                        bos_token="[BOS]", eos_token="[EOS]")
    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=2,
                            eos_token_id=3, projection_dim=32)
    path = tmp_path_factory.mktemp("text_encoder")
    CLIPTextModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)



def make_tiny_sd3(folder, shift=3.0):
    """A Stable Diffusion 3.5-layout pipeline small enough for CPU tests, built offline from configs and saved with
    StableDiffusion3Pipeline.save_pretrained, so it loads through the same code as "stabilityai/stable-diffusion-
    3.5-medium": two CLIPTextModelWithProjection of different widths (16 and 24, projections 8 and 12, so an order
    or a width mix-up shows), a T5EncoderModel of width 48 (wider than the CLIPs' 40: their zero padding is real), a
    BPE CLIP tokenizer (CLIP-G's padding with "!", as SD3's) and a Unigram T5 tokenizer over the demo's words, an
    AutoencoderKL with scaling and shift factors, and an SD3Transformer2DModel with SD3.5 Medium's features: dual
    attention in its first block and RMS qk norm, and a positional grid larger than its sample (cropped)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, \
        StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel, \
        T5TokenizerFast

    chars = sorted({c for w in DEMO_WORDS for c in w})
    vocab = {"!": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    vocab.update({c + "</w>": len(vocab) + i for i, c in enumerate(chars)})
    merges = []
    for word in DEMO_WORDS:  # BPE merges that spell each word, letter by letter
        part = word[0] + ("</w>" if len(word) == 1 else "")
        for i, c in enumerate(word[1:], 1):
            piece = c + ("</w>" if i == len(word) - 1 else "")
            merges += [(part, piece)] if (part, piece) not in merges else []
            part += piece
            vocab.setdefault(part, len(vocab))
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    clip_l_tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    clip_g_tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, pad_token="!")
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    pieces += [("\u2581" + w, -1.0) for w in DEMO_WORDS] + [(c, -5.0) for c in chars]
    t5_tok = T5TokenizerFast(vocab=pieces, extra_ids=0)
    torch.manual_seed(0)

    def clip(width, projection):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=3,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=projection, hidden_act="gelu",
            bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"], pad_token_id=0))

    t5 = T5EncoderModel(T5Config(vocab_size=len(pieces), d_model=48, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
                                 relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=8, sample_size=16, scaling_factor=1.5, shift_factor=0.06,
                        use_quant_conv=False, use_post_quant_conv=False)
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=48,
                                        caption_projection_dim=16, pooled_projection_dim=20, pos_embed_max_size=6,
                                        dual_attention_layers=(0,), qk_norm="rms_norm")
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                                    vae=vae, text_encoder=clip(16, 8), tokenizer=clip_l_tok,
                                    text_encoder_2=clip(24, 12), tokenizer_2=clip_g_tok, text_encoder_3=t5,
                                    tokenizer_3=t5_tok)
    pipe.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    return make_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipeline")


@pytest.fixture(scope="session")
def tiny_dino(tmp_path_factory):
    """A 1-layer DINOv2 (patch 2, width 16) with random weights, saved with save_pretrained: REPA's encoder,
    loaded through the same path as a hub id (objective.repa_encoder)."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          patch_size=2, image_size=16)
    path = tmp_path_factory.mktemp("dino")
    Dinov2Model(config).save_pretrained(path)
    return str(path)


@pytest.fixture
def unrendered_figures(monkeypatch):
    """For a test that checks a report's text and which figures it names: each figure is drawn as usual but saved
    as an empty file, not rendered to PNG (the rendering is most of such a test's time; the tests that look at
    the images render them)."""
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda self, path, *args, **kwargs: Path(path).write_bytes(b""))


@pytest.fixture
def classifier_rows(monkeypatch):
    """What the evaluation classifier is trained on and measured on: {"trained": the images of the first
    classifier.train call, "measured": those of the first classifier.accuracy call}, filled as they run."""
    from training.evaluation import classifier

    seen, train, accuracy = {}, classifier.train, classifier.accuracy
    monkeypatch.setattr(classifier, "train", lambda model, images, labels, *a, **k: seen.setdefault(
        "trained", images) is None or train(model, images, labels, *a, **k))
    monkeypatch.setattr(classifier, "accuracy", lambda model, images, labels: seen.setdefault(
        "measured", images) is None or accuracy(model, images, labels))
    return seen
