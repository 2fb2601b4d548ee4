"""A CLIP made here (tools/clip.py, training/data/clip.py): its tokenizer's round trip and truncation, the pooled
vector at the end token, the empty and the over-long caption through encoders.encode_text as docs/data.md says,
its loss against transformers' own, retrieval among distinct captions, the tool's splits and its folder read back
as encoders.text_encoder; and what the trainers check of any text encoder: encoders.max_tokens within its
positions at start-up, a local text encoder's files in the cache key."""
import json
import shutil

import numpy as np
import pytest
import torch

import train_flow_matching as fm
from conftest import ROOT, tiny_run_args
from tools import clip as clip_tool
from training.config import config
from training.data import cache, clip, encoders

CAPTIONS = ["a small red circle", "a large red circle", "a small blue square", "a large green triangle",
            "a small green square", "a large blue triangle", "grinning face with big eyes", "grinning cat"]
CONTEXT = 16


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A CLIP made as tools/clip.py makes one, untrained (width 32, one layer, 16 px in 4 px patches, 16
    positions), saved in a folder as the tool saves it."""
    tokenizer = clip.build_tokenizer(CAPTIONS, 300, CONTEXT)
    model = clip.build(tokenizer, 16, 4, 32, 1, CONTEXT).eval()
    folder = tmp_path_factory.mktemp("clip")
    model.save_pretrained(folder)
    clip.save_tokenizer(tokenizer, folder)
    clip.image_processor(16).save_pretrained(folder)
    return str(folder)


def normalised(caption):
    return " ".join(caption.split()).lower()


def test_the_tokenizer_round_trips_and_truncates_keeping_the_end_token(tiny_clip):
    """Loaded back offline as any text encoder's tokenizer (AutoTokenizer): every caption, seen or not (unseen
    words, accents, a curly quote), decodes to itself lowercased with its whitespace collapsed, between the start
    and end tokens; truncated to n tokens it keeps the start, the first n - 2 of its tokens and the end token last
    (CLIP's own truncation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_clip)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (clip.BOS, clip.EOS, clip.EOS)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)  # never the legacy pooling id 2
    for caption in CAPTIONS + ["  Grinning   FACE with big eyes ", "flag: Côte d’Ivoire", "piñata", "zebra", ""]:
        ids = tokenizer(caption).input_ids
        assert ids[0] == 0 and ids[-1] == 1 and 0 not in ids[1:] and 1 not in ids[:-1]
        assert tokenizer.decode(ids, skip_special_tokens=True) == normalised(caption)
    full = tokenizer("a large green triangle grinning cat with big eyes").input_ids
    for n in (3, 6, len(full) - 1):
        cut = tokenizer("a large green triangle grinning cat with big eyes", truncation=True, max_length=n).input_ids
        assert cut == full[:n - 1] + [1]


def test_the_pooled_vector_is_the_hidden_state_at_the_end_token(tiny_clip):
    """Through encoders.load_encoders and encode_text (the cache's path): each caption's pooled vector is the
    final hidden state at its end token, whose place is counted from the caption's own token count, not read
    off the ids; and the padding after it changes neither it nor the tokens before it (the text tower is
    causal). The whole CLIP is read as its text tower without transformers' table of the vision weights it
    leaves out (a run's log would open with it)."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)  # what transformers' own handler would print
    try:
        _, tokenizer, encoder = encoders.load_encoders(config.Config(vae=None, text_encoder=tiny_clip), "cpu")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert type(encoder).__name__ == "CLIPTextModel" and not any("UNEXPECTED" in line for line in said), said
    captions = ["a small red circle", "grinning cat", "zebra crossing", "a large blue triangle grinning face"]
    out = encoders.encode_text(tokenizer, encoder, captions, CONTEXT)
    end = [n - 1 for n in clip.token_count(tokenizer, captions)]
    assert len(set(end)) > 1 and max(end) < CONTEXT - 1  # different places, all before the last position
    assert torch.equal(out["text_pooled"], out["text_tokens"][torch.arange(len(captions)), end])
    assert torch.equal(out["text_mask"].sum(1).long() - 1, torch.tensor(end))
    shorter = encoders.encode_text(tokenizer, encoder, captions, max(end) + 1)  # padded less
    torch.testing.assert_close(shorter["text_pooled"], out["text_pooled"], rtol=0, atol=1e-6)
    torch.testing.assert_close(shorter["text_tokens"], out["text_tokens"][:, :max(end) + 1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("terminal", [False, True])
def test_loading_a_model_draws_no_bar_in_a_log_file(tiny_clip, terminal, monkeypatch, capfd):
    """transformers draws a bar for every model it loads ("Loading weights"): in a log file a line of noise each
    time a tool reads the CLIP (tools/tune.py: two a confirmation block), so the loads go through
    encoders.quiet_transformers, which turns it off there and leaves it to a terminal; the switch is put back."""
    from transformers.utils import logging as hf_logging

    from training.evaluation import metrics

    monkeypatch.setattr(encoders.common, "interactive", lambda: terminal)
    monkeypatch.setattr(metrics.load_clip, "cache", (None,), raising=False)
    capfd.readouterr()
    metrics.load_clip(tiny_clip)
    encoders.load_encoders(config.Config(vae=None, text_encoder=tiny_clip), "cpu")
    drawn = capfd.readouterr().err
    assert drawn.count("Loading weights: 100%") == (2 if terminal else 0), drawn
    assert hf_logging.is_progress_bar_enabled()


def test_the_empty_and_an_over_long_caption_do_what_the_docs_say(tiny_clip):
    """docs/data.md, "Captions into tokens": the empty caption (guidance's dropped condition, the model's null
    text) is the start and end tokens, padded with the end token; its pooled vector is the state at position 1.
    A caption longer than encoders.max_tokens is cut to max_tokens with its end token last: its mask is all ones,
    its pooled vector the last position's, and its first max_tokens - 1 token features are the uncut caption's."""
    _, tokenizer, encoder = encoders.load_encoders(config.Config(vae=None, text_encoder=tiny_clip), "cpu")
    max_tokens, long = 8, "a small red circle and a large blue square and a grinning cat"
    ids, mask = encoders.tokenize(tokenizer, ["", long], max_tokens)
    assert ids[0].tolist() == [0] + [1] * (max_tokens - 1) and mask[0].tolist() == [1, 1] + [0] * (max_tokens - 2)
    assert ids[1, -1] == 1 and mask[1].tolist() == [1] * max_tokens
    out = encoders.encode_text(tokenizer, encoder, ["", long], max_tokens)
    assert out["text_tokens"].shape == (2, max_tokens, 32)
    assert torch.equal(out["text_pooled"][0], out["text_tokens"][0, 1])
    assert torch.equal(out["text_pooled"][1], out["text_tokens"][1, -1])
    assert clip.token_count(tokenizer, [long])[0] > max_tokens + 2
    uncut = encoders.encode_text(tokenizer, encoder, [long], CONTEXT)
    torch.testing.assert_close(out["text_tokens"][1, :-1], uncut["text_tokens"][0, :max_tokens - 1], rtol=0, atol=1e-6)


def test_max_tokens_beyond_the_text_encoders_positions_stops_the_run_at_start_up(tmp_path, tiny_text_encoder):
    """encoders.max_tokens above the text encoder's max_position_embeddings (the conftest encoder's 16) is one
    problem naming the key and the limit, raised before any work (no cache folder); at the limit it loads."""
    args = [*tiny_run_args(tmp_path), "--data.caption_column=caption", f"--encoders.text_encoder={tiny_text_encoder}"]
    with pytest.raises(config.ConfigError) as e:
        fm.main([*args, "--encoders.max_tokens=17"])
    assert str(e.value).splitlines()[1:] == [
        f"  encoders.max_tokens=17 is more than the 16 positions of encoders.text_encoder='{tiny_text_encoder}' (its "
        f"max_position_embeddings): set encoders.max_tokens to at most 16"]
    assert not (tmp_path / "cache").exists()
    at_the_limit = config.load_config(fm.DEFAULTS, [*args, "--encoders.max_tokens=16"], schema=fm.CONFIG)
    assert at_the_limit.encoders.max_tokens == 16


def test_the_loss_is_clips_own_with_distinct_captions_and_shares_a_repeated_one(tiny_clip):
    """Distinct captions: CLIPModel's own loss (return_loss=True) on the same pairs, through our image and text
    embeddings. Images 0 and 2 sharing caption 0: image -> text is the cross-entropy over the batch's two
    distinct captions; text 0 -> image puts half its target on each of its two images (hand-written targets)."""
    from transformers import AutoTokenizer, CLIPModel

    model, tokenizer = CLIPModel.from_pretrained(tiny_clip).eval(), AutoTokenizer.from_pretrained(tiny_clip)
    ids, mask = clip.tokenize(tokenizer, CAPTIONS[:4], CONTEXT)
    pixels = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, return_loss=True).loss
        images, texts = clip.image_embeddings(model, pixels), clip.text_embeddings(model, ids, mask)
        torch.testing.assert_close(clip.contrastive_loss(images, texts, torch.arange(4), model.logit_scale), theirs)
    scale = model.logit_scale.detach()
    of = torch.tensor([0, 1, 0, 1])
    logits = scale.exp() * images @ texts[:2].T
    to_text = -logits.log_softmax(1)[torch.arange(4), of].mean()
    target = torch.tensor([[0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5]])
    to_image = -(target * logits.T.log_softmax(1)).sum(1).mean()
    torch.testing.assert_close(clip.contrastive_loss(images, texts[:2], of, scale), (to_text + to_image) / 2)


def test_retrieval_ranks_each_image_among_the_distinct_captions(monkeypatch):
    """Embeddings set by hand: 5 images over 3 distinct captions ("b" twice, "c" twice), each caption embedded once.
    Image 0 ranks its caption first, image 1 second, images 2, 3 and 4 third: top-1 1/5, top-5 1 (3 captions);
    chance 1/3 and 1."""
    text = {"a": [1.0, 0.0, 0.0], "b": [0.0, 1.0, 0.0], "c": [0.0, 0.0, 1.0]}
    images = torch.tensor([[0.9, 0.1, 0.0], [0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.2, 0.1, 0.7], [0.5, 0.4, 0.1]])
    captions = ["a", "b", "c", "b", "c"]
    embedded = []
    monkeypatch.setattr(clip, "tokenize", lambda tokenizer, batch, context: (list(batch), None))
    monkeypatch.setattr(clip, "text_embeddings", lambda model, batch, mask: embedded.extend(batch) or torch.tensor(
        [text[c] for c in batch]))
    monkeypatch.setattr(clip, "image_embeddings", lambda model, pixels: images[:len(pixels)])
    out = clip.retrieval(None, None, np.zeros((5, 2, 2, 3), np.uint8), captions, CONTEXT)
    assert embedded == ["a", "b", "c"]
    assert out == {"images": 5, "captions": 3, "top1": pytest.approx(0.2), "top5": 1.0,
                   "chance_top1": pytest.approx(1 / 3), "chance_top5": 1.0}


def test_the_cache_key_sees_a_local_text_encoders_files(tmp_path, tiny_clip):
    """The cache holds the text encoder's features: a CLIP retrained in place (tools/clip.py again, same folder) is
    a miss, never the old features; a hub id's key is its name alone, as before."""
    folder = tmp_path / "clip"
    shutil.copytree(tiny_clip, folder)
    cfg = config.load_config(fm.DEFAULTS, ["--data.caption_column=caption", f"--encoders.text_encoder={folder}"])

    def key():
        return cache.cache_key(cfg, "train", None, 320)

    first = key()
    assert key() == first
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: a retrained CLIP at the same path
    assert key() != first
    cfg.encoders.text_encoder = "openai/clip-vit-large-patch14"
    assert "text_encoder_identity" not in key()


def test_the_tool_refuses_the_training_split_as_its_test_split(tmp_path):
    with pytest.raises(config.ConfigError, match="^--test_split 'train' is the training split"):
        clip_tool.main(["--config", str(ROOT / "configs/demo.json"), "--out", str(tmp_path / "clip"),
                        "--data.caption_column=caption", "--test_split", "train", "--data.demo_samples=64",
                        "--epochs=1", "--width=32", "--layers=1"])
    assert not (tmp_path / "clip").exists()


def captioned_folder(root):
    """An imagefolder with train/ and test/ and metadata.jsonl: 24 training images of 8 captions, 6 test images
    of 3 other captions (two images each), each caption a colour's flat square with noise."""
    from PIL import Image

    rng = np.random.default_rng(0)
    colours = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (230, 220, 40)}
    splits = {"train": [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("square", "blob")],
              "test": ["a red tile", "a blue tile", "a green tile"]}
    for split, captions in splits.items():
        (root / split).mkdir(parents=True)
        rows = []
        for i in range(24 if split == "train" else 6):
            caption = captions[i % len(captions)]
            pixels = np.clip(np.array(colours[caption.split()[1]]) + rng.normal(0, 20, (20, 20, 3)), 0, 255)
            Image.fromarray(pixels.astype(np.uint8)).save(root / split / f"{i}.png")
            rows.append(json.dumps({"file_name": f"{i}.png", "caption": caption}))
        (root / split / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return splits


@pytest.mark.slow
def test_the_tool_learns_from_the_training_pairs_alone_and_its_folder_loads_as_a_text_encoder(tmp_path, monkeypatch):
    """tools/clip.py on a captioned folder through the generic data path (open_dataset, load_image, preprocess):
    the tokenizer sees the training captions alone, training sees the training images alone; clip.json counts
    the test split's distinct captions; the folder loads through encoders.text_encoder and gives the features
    of the saved CLIPModel's own text tower, its image processor gives preprocess's pixels, eval_fid.py's CLIP
    score reads it, and a trainer's start-up check passes with encoders.max_tokens at its context."""
    from transformers import AutoImageProcessor, CLIPModel

    splits, seen = captioned_folder(tmp_path / "data"), {}
    build_tokenizer, train = clip.build_tokenizer, clip.train
    monkeypatch.setattr(clip, "build_tokenizer", lambda captions, *a, **k: seen.setdefault("captions",
                        list(captions)) and build_tokenizer(captions, *a, **k))
    monkeypatch.setattr(clip, "train", lambda model, images, *a: seen.setdefault("images", images) is None
                        or train(model, images, *a))
    out = clip_tool.main(["--config", str(ROOT / "configs/demo.json"), "--out", str(tmp_path / "clip"),
                          f"--data.source={tmp_path / 'data'}", "--data.label_column=null",
                          "--data.caption_column=caption", "--encoders.max_tokens=12", "--epochs=2",
                          "--batch_size=8", "--width=32", "--layers=1", "--vocab_size=300"])
    record = json.loads((out / clip.RECORD).read_text())
    assert seen["captions"] == sorted(set(splits["train"]))
    assert len(seen["images"]) == 24 and record["train_rows"] == 24 and record["test_rows"] == 6
    assert record["test_split"] == "test" and record["test_captions_also_in_training"] == 0
    test = record["retrieval"]["test"]
    assert (test["images"], test["captions"], test["chance_top1"]) == (6, 3, pytest.approx(1 / 3))
    assert 0 <= test["top1"] <= test["top5"] == 1.0  # 3 captions: the right one is always within 5
    assert record["tokenizer"]["context"] == 12 and record["model"]["patch_size"] == 4  # 16 px / 8, at least 4

    _, tokenizer, encoder = encoders.load_encoders(config.Config(vae=None, text_encoder=str(out)), "cpu")
    model = CLIPModel.from_pretrained(out).eval()
    captions = splits["test"] + ["", "a yellow blob"]
    features = encoders.encode_text(tokenizer, encoder, captions, 12)
    ids, mask = encoders.tokenize(tokenizer, captions, 12)
    with torch.no_grad():
        own = model.text_model(input_ids=ids, attention_mask=mask)
    assert torch.equal(features["text_tokens"], own.last_hidden_state)
    assert torch.equal(features["text_pooled"], own.pooler_output)

    images = np.random.default_rng(1).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    pixels = AutoImageProcessor.from_pretrained(out)(images=list(images), return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels, clip.to_pixels(images), rtol=0, atol=1e-5)
    from training.evaluation.metrics import clip_scores

    with torch.no_grad():
        cos = (clip.image_embeddings(model, clip.to_pixels(images)) *
               clip.text_embeddings(model, *clip.tokenize(tokenizer, splits["test"], 12))).sum(1)
    np.testing.assert_allclose(clip_scores(str(out), list(images), splits["test"], "cpu"),
                               100 * cos.clamp(min=0).double().numpy(), rtol=0, atol=1e-3)
    assert config.load_config(fm.DEFAULTS, ["--data.caption_column=caption", f"--encoders.text_encoder={out}",
                                            "--encoders.max_tokens=12"], schema=fm.CONFIG)
