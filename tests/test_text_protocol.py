"""The text protocol (training/evaluation/captions.py; docs/evaluation.md, "Real captions: the text protocol"):
eval_fid.py on a text run against a captioned split samples row i % R's caption for sample i and scores FD in the
evaluation CLIP's features, CLIP score, retrieval among the distinct captions and category accuracy, for each part
(`novelty`) and all together, each beside real images: drawn training images for the Frechet family, the reference
images themselves for the rest. The fixture is an emoji-like captioned folder (train / validation / test, two
images a caption, a category label and a novelty column), so the tests run offline in seconds."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import eval_fid  # noqa: E402
import train_ddpm  # noqa: E402
import train_flow_matching  # noqa: E402
from conftest import TINY_MODEL, trained_for_the_module  # noqa: E402
from training.config import config  # noqa: E402
from training.data import clip  # noqa: E402
from training.evaluation import captions, classifier, generation, metrics, reference  # noqa: E402

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230)}
SHAPES = ["circle", "square", "triangle"]
# train: every colour with circle and square, small and large (12 captions); validation and test hold triangles
# ("recombination": a colour and a shape each trained, together unseen) and the word "large"/"small" swapped in
# ways never trained ("new" here only marks a part: what matters is that the rows say which part they are in).
SPLITS = {
    "train": [(f"a {size} {c} {s}", "trained") for size in ("small", "large") for c in COLOURS for s in SHAPES[:2]],
    "validation": [("a small red triangle", "recombination"), ("a large green triangle", "recombination"),
                   ("a red", "new"), ("a large blue", "new")],
    "test": [("a large red triangle", "recombination"), ("a small green triangle", "recombination"),
             ("a large blue triangle", "recombination"), ("a blue", "new"), ("a green", "new"), ("a red", "new")]}


def draw(caption, vendor, rng):
    """16 px: the caption's colour and size as a shape; vendor 0 flat, vendor 1 with noise."""
    colour = next(v for k, v in COLOURS.items() if k in caption)
    img, r = np.full((16, 16, 3), 235, np.float64), 3 if "small" in caption else 6
    yy, xx = np.mgrid[:16, :16]
    mask = (yy - 8) ** 2 + (xx - 8) ** 2 < r * r if "circle" in caption else (abs(xx - 8) < r) & (abs(yy - 8) < r) \
        if "square" in caption else (yy > 8 - r) & (abs(xx - 8) < (yy - 8 + r) / 1.5)
    img[mask] = colour
    img += rng.normal(0, 25, img.shape) * vendor
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def write_folder(root):
    """train/, validation/, test/ with metadata.jsonl: each caption twice (vendor 0 first, all of them, then vendor
    1, as emoji's rows run), its label (the colour's index) and its novelty."""
    rng = np.random.default_rng(0)
    for split, pairs in SPLITS.items():
        (root / split).mkdir(parents=True)
        lines = []
        for vendor in (0, 1):
            for caption, novelty in pairs:
                name = f"{len(lines):03d}.png"
                draw(caption, vendor, rng).save(root / split / name)
                label = next(i for i, c in enumerate(COLOURS) if c in caption)
                lines.append(json.dumps({"file_name": name, "caption": caption, "label": label, "novelty": novelty}))
        (root / split / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def make_clip(folder, captions_seen):
    """An evaluation CLIP as tools/clip.py saves one (untrained: its numbers are read, not its quality)."""
    tokenizer = clip.build_tokenizer(sorted(set(captions_seen)), 300, 16)
    model = clip.build(tokenizer, 16, 4, 32, 1, 16).eval()
    model.save_pretrained(folder)
    clip.save_tokenizer(tokenizer, folder)
    clip.image_processor(16).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    data = write_folder(root / "data")
    eval_clip = make_clip(root / "clip", [c for c, _ in SPLITS["train"]])
    return root, data, eval_clip


def run_args(root, data, text_encoder, name):
    return [*TINY_MODEL, "--model.num_layers=1", f"--data.source={data}", "--data.val_split=validation",
            "--data.label_column=null", "--data.caption_column=caption", f"--encoders.text_encoder={text_encoder}",
            "--encoders.max_tokens=8", "--data.resolution=16", "--run_dir", str(root / name), "--data.cache_dir",
            str(root / f"cache_{name}"), "--train.max_steps=2", "--train.batch_size=8", "--train.warmup_steps=1",
            "--val.steps=2", "--val.num_samples=2", "--val.loss_samples=4", "--log.wandb=off", "--log.every=1",
            "--val.every=1000", "--ckpt.every=1000", "--val.fid_every=0"]


def rows_of(data, split):
    import datasets

    return datasets.load_dataset("imagefolder", data_files={split: str(Path(data) / split / "**")}, split=split)


# ---- Fast: the pieces, on hand-made numbers ---------------------------------------------------------------------


def test_the_sample_count_is_one_per_reference_image_or_a_multiple():
    rows = list(range(12))
    assert captions.sample_count(None, rows) == 12 and captions.sample_count(36, rows) == 36
    for n in (11, 13, 30):
        with pytest.raises(config.ConfigError, match=f"^--num_samples {n}: the text protocol samples each of the 12 "
                                                     f"reference rows' captions equally often"):
            captions.sample_count(n, rows)


def test_each_part_is_its_samples_against_its_own_reference_images():
    """12 rows (parts a: rows 0-5, b: 6-11), 24 samples (sample i: row i % 12), features far apart by part: each
    part's distances are all_scores of exactly its samples against exactly its reference rows, "" all of them; its
    CLIP score, retrieval and accuracy are means over its samples alone."""
    import datasets

    rows = datasets.Dataset.from_dict({"caption": [f"c{i}" for i in range(12)], "novelty": ["a"] * 6 + ["b"] * 6})
    parts = captions.groups(rows)
    assert list(parts) == ["", "a", "b"] and parts["b"].tolist() == list(range(6, 12))
    rng = np.random.default_rng(0)
    ref_feats = rng.normal(size=(12, 3)) + np.repeat([[0.0] * 3, [10.0] * 3], 6, 0)
    ref = {"mu": ref_feats.mean(0), "sigma": np.cov(ref_feats, rowvar=False), "feats": ref_feats}
    feats = ref_feats[np.arange(24) % 12] + rng.normal(size=(24, 3)) * 0.5
    per = {"clip": np.stack([np.arange(24.0), np.arange(24) % 7], 1), "hits": (np.arange(24) % 3 == 0).astype(float)}
    out = captions.sample_scores(feats, ref, parts, per, "clean", "clip")
    in_b = np.arange(24) % 12 >= 6
    want = metrics.all_scores(feats[in_b], captions.part_statistics(ref_feats, np.arange(6, 12)), "clean", 12, "clip")
    assert out["b"]["fd_clip"] == pytest.approx(want["fd_clip_12"]) and out["b"]["fd_clip"] < 1
    assert out[""]["fd_clip"] == pytest.approx(metrics.all_scores(feats, ref, "clean", 24, "clip")["fd_clip_24"])
    assert out["b"]["clip_score"] == pytest.approx(np.arange(24.0)[in_b].mean())
    assert out["b"]["retrieval_top1"] == pytest.approx(((np.arange(24) % 7 == 0) & in_b).sum() / 12)
    assert out["a"]["class_accuracy"] == pytest.approx((np.arange(24) % 3 == 0)[~in_b].mean())
    names = captions.flat(out, 24, 12, parts)
    assert list(names)[:2] == ["fd_clip_24", "kd_clip_24"] and "fd_clip_12_b" in names  # "all" first: tune reads it


def test_each_image_ranks_the_distinct_captions_once_each():
    """Six rows over three captions, each twice (two vendors); embeddings set by hand: each image ranks the three
    distinct captions, so a caption shared by two rows counts once. Image 0's own caption is second of three."""
    captions_ = ["a", "b", "c", "a", "b", "c"]
    table = {"a": [1.0, 0.0, 0.0], "b": [0.0, 1.0, 0.0], "c": [0.0, 0.0, 1.0]}
    fake = type("Clip", (), {"text": staticmethod(lambda batch: torch.tensor([table[c] for c in batch]))})
    text, own = captions.caption_embeddings(fake, captions_)
    assert len(text) == 3 and own.tolist() == [0, 1, 2, 0, 1, 2]
    image = np.array([[0.3, 0.9, 0.0], [0.0, 1.0, 0.0], [0.1, 0.2, 0.9], [0.1, 0.2, 0.3], [0.9, 0.1, 0.1],
                      [0.0, 0.0, 1.0]])
    out = captions.clip_rows(image, text, own)
    assert out[:, 1].tolist() == [1, 0, 0, 2, 1, 0]
    cos = image[np.arange(6), own.numpy()] / np.linalg.norm(image, axis=1)
    np.testing.assert_allclose(out[:, 0], 100 * cos, rtol=1e-5)


def test_a_clip_that_cannot_be_loaded_is_one_line_naming_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^--clip_model {tmp_path / 'gone'}: no CLIP could be loaded"):
        metrics.clip_features(str(tmp_path / "gone"))


def test_the_floor_draws_training_rows_never_a_reference_image(setup):
    """The floor's key reads images drawn (seed 0) from the trainer's training rows, none of them a test or a held-out
    image, read as the reference's are; per class in the proportions asked (all of a class the training rows have
    when they have fewer); where the held-out rows are drawn from the training split (no data.val_split), they are
    left out of the draw."""
    _, data, _ = setup
    cfg = config.load_config(train_flow_matching.DEFAULTS, [f"--data.source={data}", "--data.val_split=validation",
                                                            "--data.resolution=16"])

    def rows(key):
        ds = reference.bucket_rows(key, cfg)
        return [r["image"]["path"] for r in ds], ds["label"]
    key = reference.reference_key(reference.reference_args(["--reference_split", "test"]), cfg, "clip@x")
    drawn, _ = rows(floor := reference.training_draw_key(key, cfg, 12))
    assert len(set(drawn)) == 12 and {Path(f).parent.name for f in drawn} == {"train"}
    assert np.array_equal(reference.reference_images(floor, cfg)[3](), np.asarray(Image.open(drawn[3])))  # 16 px
    drawn, labels = rows(reference.training_draw_key(key, cfg, 12, 0, "label", [2, 0, 2, 2, 2, 2, 2, 2, 2, 2]))
    assert labels == [0] + [2] * 8 and {Path(f).parent.name for f in drawn} == {"train"}  # 8 blue training rows
    cfg.data.val_split, cfg.data.val_holdout = None, 6  # held-out rows drawn from train
    heldout = reference.reference_key(reference.reference_args([]), cfg, "x")
    held, drawn = rows(heldout)[0], rows(reference.training_draw_key(heldout, cfg, 24))[0]
    assert len(held) == 6 and len(drawn) == 18 and not set(held) & set(drawn)


# ---- End to end: both trainers, on the test split and the validation split ----------------------------------------


@pytest.fixture(scope="module", params=["flow_matching", "ddpm"])
def trained(request, setup, tiny_text_encoder):
    """A two-step text run of each trainer on the folder, and the category classifier of its text recipe (one epoch),
    its classes named on the command line as docs/evaluation.md's emoji steps do (--data.label_column=label)."""
    root, data, eval_clip = setup
    main = {"flow_matching": train_flow_matching.main, "ddpm": train_ddpm.main}[request.param]
    run = trained_for_the_module(main, run_args(root, data, tiny_text_encoder, request.param))
    judge = root / "classifier"
    if not judge.is_dir():
        from tools import classifier as classifier_tool

        recipe = root / "recipe.json"
        recipe.write_text(json.dumps({"data": {"source": str(data), "val_split": "validation", "resolution": 16,
                                               "label_column": None, "caption_column": "caption"},
                                      "encoders": {"text_encoder": tiny_text_encoder, "max_tokens": 8}}))
        classifier_tool.main(["--config", str(recipe), "--out", str(judge), "--epochs", "1",
                              "--data.label_column=label"])
        assert json.loads((judge / classifier.RECORD).read_text())["label_column"] == "label"
    return run, root, data, eval_clip, judge


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def clip_of(folder):
    from transformers import AutoTokenizer, CLIPModel

    return CLIPModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.mark.slow
def test_the_protocol_on_the_test_split_reads_each_row_its_part_and_real_images_beside(trained, monkeypatch):
    """24 samples against the 12 test rows (two a row), FD in the evaluation CLIP's features, with the category
    classifier. Checked against computations of their own: the model was asked row i % 12's caption for sample i;
    prompts.txt and per_sample.jsonl say so, with each row's part and label; each part's FD is its samples against
    its reference images; retrieval ranks the 6 distinct captions; the classifier is read against the row's label;
    the real row's retrieval is tools/clip.py's own on the test images (training/data/clip.py's retrieval), its FD
    that of as many images drawn from the training rows per colour, its accuracy the classifier's on the test
    images."""
    run, root, data, eval_clip, judge = trained
    asked, encode = [], generation.encode_text
    monkeypatch.setattr(generation, "encode_text", lambda tok, enc, batch, n: asked.extend(batch) or encode(
        tok, enc, batch, n))
    out = root / f"eval_{run.name}"
    report = eval_fid.main(["--run", str(run), "--reference_split", "test", "--num_samples", "24", "--steps", "2",
                            "--batch_size", "5", "--features", "clip", "--clip_model", eval_clip, "--classifier",
                            str(judge), "--stats_cache", str(root / "stats"), "--out_dir", str(out)])
    test = rows_of(data, "test")
    caption_of = test["caption"]
    assert asked == [caption_of[i % 12] for i in range(24)]
    assert (out / "prompts.txt").read_text().splitlines() == caption_of
    per = read_jsonl(out / "per_sample.jsonl")
    assert [(p["row"], p["caption"], p["part"], p["label"]) for p in per] == [
        (i % 12, caption_of[i % 12], test["novelty"][i % 12], test["label"][i % 12]) for i in range(24)]
    assert report["conditioning"]["prompts"] == "reference" and report["text_protocol"]["captions"] == 6

    # The samples' CLIP features, read back from the PNGs: each part against its own reference images.
    clip_fn = metrics.clip_features(eval_clip)
    pngs = [np.asarray(Image.open(out / "samples" / f"{i:06d}.png")) for i in range(24)]
    feats = clip_fn(pngs)
    key = reference.reference_key(reference.reference_args(["--reference_split", "test"]), report["config"],
                                  clip_fn.name)
    test_images = np.stack([item() for item in reference.reference_images(key, report["config"])])
    ref_feats = clip_fn(list(test_images))
    m = report["metrics"]
    for part in ("recombination", "new"):
        rows, samples = np.flatnonzero(np.array(test["novelty"]) == part), np.array([p["part"] == part for p in per])
        want = metrics.all_scores(feats[samples], captions.part_statistics(ref_feats, rows), "clean", 12, "clip")
        assert m[f"fd_clip_12_{part}"] == pytest.approx(want["fd_clip_12"], rel=1e-4)
    whole = {"mu": ref_feats.mean(0), "sigma": np.cov(ref_feats, rowvar=False), "feats": ref_feats}
    assert m["fd_clip_24"] == pytest.approx(metrics.all_scores(feats, whole, "clean", 24, "clip")["fd_clip_24"],
                                            rel=1e-4)

    # Retrieval among the distinct captions, and the CLIP score, by the CLIP's own towers.
    model, tokenizer = clip_of(eval_clip)
    distinct = sorted(set(caption_of))
    with torch.no_grad():
        text = clip.text_embeddings(model, *clip.tokenize(tokenizer, distinct, 16))
        image = clip.image_embeddings(model, clip.to_pixels(np.stack(pngs)))
    scores = (image @ text.T).numpy()
    own = np.array([distinct.index(caption_of[i % 12]) for i in range(24)])
    rank = (scores > scores[np.arange(24), own][:, None]).sum(1)
    assert [p["caption_rank"] for p in per] == rank.tolist()
    new = np.array([p["part"] == "new" for p in per])
    assert m["retrieval_top5_12_new"] == pytest.approx((rank[new] < 5).mean())
    assert m["retrieval_top1_24"] == pytest.approx((rank < 1).mean())
    assert m["clip_score_24"] == pytest.approx(100 * np.maximum(scores[np.arange(24), own], 0).mean(), abs=1e-3)
    ceiling = clip.retrieval(model, tokenizer, test_images, caption_of, 16)
    assert report["real"]["retrieval_top1_24"] == pytest.approx(ceiling["top1"])
    assert report["real"]["retrieval_top5_24"] == pytest.approx(ceiling["top5"])

    # The classifier against each row's label, on the samples and on the test images.
    net, _ = classifier.load(judge)
    hits = classifier.hits(net, pngs, [test["label"][i % 12] for i in range(24)])
    assert [p["class_hit"] for p in per] == hits.astype(bool).tolist()
    assert m["class_accuracy_24"] == pytest.approx(hits.mean())
    assert report["real"]["class_accuracy_24"] == pytest.approx(classifier.hits(net, test_images, test["label"]).mean())

    # The floor: as many images as each group has, drawn (seed 0) from the 24 training rows per colour in the
    # group's proportions (a permutation of each colour's rows, colours in order), against the group's test images.
    train = rows_of(data, "train")
    for part, want in (("", "fd_clip_24"), ("new", "fd_clip_12_new")):
        idx = np.arange(12) if not part else np.flatnonzero(np.array(test["novelty"]) == part)
        rng, colours = np.random.default_rng(0), np.array(train["label"])
        picked = [i for c, n in zip(*np.unique(np.array(test["label"])[idx], return_counts=True))
                  for i in rng.permutation(np.flatnonzero(colours == c))[:n]]
        drawn = [np.asarray(train[int(i)]["image"].convert("RGB")) for i in picked]
        ref = whole if not part else captions.part_statistics(ref_feats, idx)
        floor = metrics.all_scores(clip_fn(drawn), ref, "clean", len(idx), "clip")[f"fd_clip_{len(idx)}"]
        assert report["real"][want] == pytest.approx(floor, rel=1e-4)
    assert report["real"]["fd_clip_24"] < m["fd_clip_24"]  # real images nearer the test images than 2-step samples


@pytest.mark.slow
def test_the_validation_split_is_the_default_reference_and_tune_chooses_on_it(trained, capsys):
    """Without --reference_split the reference is the held-out rows, here split 'validation' (data.val_split): the
    protocol samples its 8 rows' captions, one image each by default (tools/rate.py names each by prompts.txt);
    tools/tune.py (which refuses any other
    reference) searches on it, scored by the first distance of the report, fd_clip at 8 samples; a count that is no
    multiple of 8 is refused in one line naming the nearest before any sampling."""
    from tools import tune

    run, root, data, eval_clip, _ = trained
    common = ["--features", "clip", "--clip_model", eval_clip, "--stats_cache", str(root / "stats"),
              "--batch_size", "8"]
    report = eval_fid.main(["--run", str(run), "--steps", "2", *common])
    validation = rows_of(data, "validation")
    assert report["num_samples"] == 8 and report["text_protocol"]["rows"] == 8
    assert (Path(report["samples_dir"]).parent / "prompts.txt").read_text().splitlines() == validation["caption"]
    assert {"fd_clip_8", "retrieval_top1_4_recombination", "clip_score_4_new"} <= set(report["metrics"])
    assert "-ref-" not in report["samples_dir"]  # the default reference's folder
    from tools import rate  # which caption each sample had, for the rating page: prompts.txt's line i % R

    names = rate.condition_names(rate.side_of(Path(report["samples_dir"]).parent))
    assert [names(i) for i in range(16)] == list(validation["caption"]) * 2
    with pytest.raises(config.ConfigError, match=r"^--num_samples 12: the text protocol samples each of the 8 "
                                                 r"reference rows' captions equally often .*\(nearest: 8 or 16\)"):
        tune.main(["--run", str(run), "--num_samples", "12", "--confirm_samples", "0", *common])
    ranked = tune.main(["--run", str(run), "--guidance", "1,3", "--steps", "2", "--num_samples", "8",
                        "--confirm_samples", "0", *common])
    tuned = json.loads((run / "tuned.json").read_text())
    assert tuned["metric"] == "fd_clip_8" and len(ranked) == 2
    assert "tune 2/2: guidance 3" in capsys.readouterr().out


@pytest.mark.slow
def test_what_the_protocol_cannot_read_is_refused_before_sampling(trained, tmp_path):
    """A sample count that is no multiple of the rows; --prompts reference against a plain image folder (no
    captions); a classifier whose column the rows lack: each one line, and no samples folder."""
    run, root, data, eval_clip, judge = trained
    base = ["--run", str(run), "--steps", "2", "--clip_model", "none", "--features", "tests.test_text_protocol:none",
            "--out_dir", str(tmp_path / "e"), "--stats_cache", str(root / "stats")]
    with pytest.raises(config.ConfigError, match="^--num_samples 13: .* a multiple of 12 \\(nearest: 12 or 24\\)"):
        eval_fid.main([*base, "--reference_split", "test", "--num_samples", "13"])
    plain = tmp_path / "plain"
    plain.mkdir()
    for i in range(3):
        Image.new("RGB", (16, 16), (i * 80, 0, 0)).save(plain / f"{i}.png")
    with pytest.raises(config.ConfigError, match=f"^--prompts reference: the reference \\({plain}\\) has no captions"):
        eval_fid.main([*base, "--reference", str(plain), "--prompts", "reference", "--num_samples", "3"])
    other = tmp_path / "other_classifier"
    other.mkdir()
    for f in Path(judge).iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    record = json.loads((other / "classifier.json").read_text())
    (other / "classifier.json").write_text(json.dumps({**record, "label_column": "category"}))
    with pytest.raises(config.ConfigError, match="^--classifier .*other_classifier: a text run's category accuracy "
                                                 "reads each sample's class from its reference row \\(column "
                                                 "'category', the classifier's\\); this reference has no such column"):
        eval_fid.main([*base, "--reference_split", "test", "--classifier", str(other)])
    assert not (tmp_path / "e").exists()


def none():
    """--features module:factory for the refusals: a feature_fn that is never reached."""
    raise AssertionError("a refused evaluation reached its features")


def test_the_model_cards_rows_carry_each_metrics_real_images_value_and_name_the_reference_captions(tmp_path):
    """A text protocol report's rows on the card: each metric, a part's too, with the real images' value beside it,
    conditioned on the reference rows' captions (the card's line: tests/test_export_pipeline.py's text export)."""
    from training.sharing import model_card

    cfg = config.load_config(train_flow_matching.DEFAULTS, [])
    (tmp_path / "eval" / "test").mkdir(parents=True)
    (tmp_path / "eval" / "test" / "report.json").write_text(json.dumps({
        "metrics": {"fd_clip_774": 9.5, "retrieval_top1_364_recombination": 0.25},
        "real": {"fd_clip_774": 1.25, "retrieval_top1_364_recombination": 0.5}, "num_samples": 774,
        "model": {"weights": "ema (export)"}, "sampler": cfg.val.sampler, "steps": cfg.val.steps,
        "guidance_scale": cfg.val.guidance_scale, "written_by": "eval_fid.py", "feature_extractor": "clip@0123",
        "conditioning": {"prompts": "reference", "num_prompts": 774, "prompts_sha256": "ab" * 32},
        "reference": {"source": "emoji", "split": "test"}, "command": "eval_fid.py --run x"}))
    rows, _ = model_card.evaluations(cfg, tmp_path)
    assert [(k, v, real) for k, v, real, *_ in rows] == [("fd_clip_774", 9.5, 1.25),
                                                         ("retrieval_top1_364_recombination", 0.25, 0.5)]
    assert "conditioned on the reference rows' captions (sample i: row i % R) (774, sha256 abababababab)" in rows[0][4]
