"""The emoji source (training/data/emoji.py; docs/data.md, "Emoji"): two pinned npm packages read straight from
their .tgz files, each image composited on white with its caption (the name, skin tones in words) and category, a
split by caption with its two test parts, and the refusals that keep the test captions out of everything that
learns. Most tests write their own small packages (a few PNGs and an emoji.json fragment in two .tgz files, with
their own integrity); the real packages' test needs them in emoji.DEFAULT_FOLDER (`python tools/fetch_emoji.py`)
and says so when it skips."""
import io
import json
import os
import random
import re
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_ddpm  # noqa: E402
import train_flow_matching  # noqa: E402
from tools import classifier as classifier_tool  # noqa: E402
from tools import fetch_emoji  # noqa: E402
from training.config import config  # noqa: E402
from training.config.config import ConfigError  # noqa: E402
from training.data import emoji, sources  # noqa: E402
from training.data.sources import load_image, open_dataset, open_splits  # noqa: E402

installed = pytest.mark.skipif(not all(emoji.tarball(emoji.DEFAULT_FOLDER, v).is_file() for v in emoji.PINNED),
                               reason=f"the emoji packages are not in {emoji.DEFAULT_FOLDER}: {emoji.FETCH}")
ALL_TONES = list(emoji.TONES)


def entry(name, category, image, short_name=None, tones=()):
    """An emoji.json entry as emoji-datasource writes it (the keys the source reads), with skin-tone variants."""
    stem = image[:-len(".png")]
    return {"name": name, "short_name": short_name or name.lower().replace(" ", "_"), "category": category,
            "subcategory": category.split()[0].lower() + "-sub", "image": image, "has_img_google": True,
            "has_img_twitter": True, "skin_variations": {key: {"image": f"{stem}-{key.lower()}.png",
                                                               "has_img_google": True, "has_img_twitter": True}
                                                         for key in tones}}


# Names whose side the rule fixes (the same on the real packages, docs/data.md): the grinning face is a validation
# caption of its own ("new"), woman mage's medium tone a test recombination, the Brazil flag a new test caption.
FIXTURE = [entry("GRINNING FACE WITH ONE LARGE AND ONE SMALL EYE", "Smileys & Emotion", "1fae8.png"),
           entry("WOMAN MAGE", "People & Body", "1f9d9-200d-2640-fe0f.png", tones=ALL_TONES),
           entry("Brazil Flag", "Flags", "1f1e7-1f1f7.png"),
           entry("Maldives Flag", "Flags", "1f1f2-1f1fb.png"),
           entry("BABY BOTTLE", "Food & Drink", "1f37c.png"),
           entry("HANDSHAKE", "People & Body", "1f91d.png", tones=["1F3FB-1F3FB", "1F3FB-1F3FF"]),
           entry("KISS: MAN, MAN", "People & Body", "1f468-200d-2764-fe0f-200d-1f48b-200d-1f468.png",
                 tones=["1F3FB-1F3FF"]),
           entry("MAN IN TUXEDO", "People & Body", "1f935-200d-2642-fe0f.png", short_name="man_in_tuxedo"),
           entry("MAN IN TUXEDO", "People & Body", "1f935.png", short_name="person_in_tuxedo"),
           {**entry("MOOSE", "Animals & Nature", "1face.png"), "has_img_twitter": False},  # Google's alone
           # a smiley that trains: the text protocol's floor for the validation caption draws training images of
           # its category (tests/test_campaigns.py's emoji campaign tunes on that caption)
           entry("GRINNING FACE", "Smileys & Emotion", "1f600.png")]
CAPTIONS = ["grinning face with one large and one small eye", "woman mage", "woman mage: light skin tone",
            "woman mage: medium-light skin tone", "woman mage: medium skin tone", "woman mage: medium-dark skin tone",
            "woman mage: dark skin tone", "brazil flag", "maldives flag", "baby bottle", "handshake",
            "handshake: light skin tone", "handshake: light skin tone, dark skin tone", "kiss: man, man",
            "kiss: man, man, light skin tone, dark skin tone", "man in tuxedo", "person in tuxedo", "moose",
            "grinning face"]
SPECIAL = "1fae8.png"  # google's: a half-transparent red, an opaque blue and a transparent green pixel; twitter's: LA


def files_of(entries):
    return [f for e in entries for f in [e["image"], *(v["image"] for v in e["skin_variations"].values())]]


def colour(file, vendor):
    """The opaque colour of a fixture image: its file's index and its vendor, so a row shows where it came from."""
    return (files_of(FIXTURE).index(file) * 10 % 256, 60 if vendor == "google" else 180, 90)


def png(file, vendor, side=64):
    img = Image.new("RGBA", (side, side), (*colour(file, vendor), 255))
    if file == SPECIAL and vendor == "google":
        for xy, value in (((0, 0), (255, 0, 0, 128)), ((1, 0), (0, 0, 255, 255)), ((2, 0), (0, 255, 0, 0))):
            img.putpixel(xy, value)
    if file == SPECIAL and vendor == "twitter":
        img = Image.new("LA", (side, side), (30, 255))
        img.putpixel((0, 0), (0, 128))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def write_packages(folder, entries=FIXTURE, image=png):
    """Two .tgz files laid out as `npm pack` writes emoji-datasource's: `entries` as emoji.json, the fixture's
    images drawn by `image`, a sprite sheet the source skips. Returns their integrity, as PINNED holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    pinned = {}
    for vendor in emoji.PINNED:
        files = {"package/emoji.json": json.dumps(entries).encode(), "package/LICENSE": b"MIT",
                 **{f"package/img/{vendor}/64/{f}": image(f, vendor) for f in files_of(FIXTURE)},
                 f"package/img/{vendor}/sheets/64.png": png(SPECIAL, vendor, side=8)}
        with tarfile.open(emoji.tarball(folder, vendor), "w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        pinned[vendor] = emoji.integrity(emoji.tarball(folder, vendor).read_bytes())
    return pinned


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("emoji")
    return folder, write_packages(folder)


@pytest.fixture(scope="module")
def splits(packages):
    """{split: its rows as dicts, images decoded}."""
    return {split: list(emoji.load(split, *packages)) for split in emoji.SPLITS}


def pixels(row):
    return np.asarray(row["image"])


# ---- The rows: images, captions, labels ------------------------------------------------------------------------


def test_each_image_is_composited_on_white_as_64_px_rgb(splits):
    """Alpha over white, (1 - a) x 255 + a x colour: a half-transparent red pixel is pink, a transparent one white
    whatever its colour, an opaque one its own; LA (grey and alpha) too. Every row 64 x 64 RGB."""
    rows = [r for split in splits.values() for r in split]
    assert {(r["image"].mode, r["image"].size) for r in rows} == {("RGB", (64, 64))}
    grinning = {r["vendor"]: pixels(r) for r in rows if r["caption"] == CAPTIONS[0]}
    assert np.abs(grinning["google"][0, 0].astype(int) - [255, 127.5, 127.5]).max() <= 1  # pink
    assert grinning["google"][0, 1].tolist() == [0, 0, 255] and grinning["google"][0, 2].tolist() == [255, 255, 255]
    assert np.abs(grinning["twitter"][0, 0].astype(int) - 127.5).max() <= 1  # LA: black at half alpha is grey
    assert grinning["twitter"][5, 5].tolist() == [30] * 3


def test_captions_are_the_names_with_skin_tones_in_words_and_the_label_is_the_category(splits):
    """Every image of both vendors once (where emoji.json says the vendor has one): the name in lower case, a
    variant's tones in CLDR's words (a two-person variant both, one when they are the same), a name two emoji share
    made their short names; the label the category; each image the one emoji.json names for its caption and vendor."""
    rows = [r for split in splits.values() for r in split]
    assert sorted((r["caption"], r["vendor"]) for r in rows) == sorted((c, v) for c in CAPTIONS for v in emoji.PINNED
                                                                       if (c, v) != ("moose", "twitter"))
    by_caption = {(r["caption"], r["vendor"]): r for r in rows}
    files = dict(zip(CAPTIONS, files_of(FIXTURE)))  # the fixture lists its files in CAPTIONS' order
    for (caption, vendor), row in by_caption.items():
        if files[caption] != SPECIAL:
            assert pixels(row)[10, 10].tolist() == list(colour(files[caption], vendor)), (caption, vendor)
    flag, mage = by_caption["brazil flag", "google"], by_caption["woman mage: dark skin tone", "twitter"]
    assert flag["label"] == emoji.CATEGORIES.index("Flags") and flag["subcategory"] == "flags-sub"
    assert mage["label"] == emoji.CATEGORIES.index("People & Body") and mage["base"] == "woman mage"
    assert by_caption["person in tuxedo", "google"]["base"] == "person in tuxedo"


def test_the_label_column_names_the_ten_categories(packages):
    ds = emoji.load("validation", *packages)
    assert ds.features["label"].names == emoji.CATEGORIES and len(emoji.CATEGORIES) == 10
    assert ds.column_names == ["image", "caption", "label", "subcategory", "vendor", "base", "novelty"]


# ---- The split ---------------------------------------------------------------------------------------------


def test_the_split_is_by_caption_both_vendors_together_deterministic_with_both_test_parts(packages, splits):
    """Each caption in one split with both vendors' images; the names whose side the rule fixes where it says
    (test: a recombination and a new caption; validation: the grinning face, a caption with no relative); the
    same rows and fingerprint when loaded again, another fingerprint per split."""
    where = {}
    for split, rows in splits.items():
        for r in rows:
            where.setdefault(r["caption"], []).append((split, r["novelty"], r["vendor"]))
    assert all(sorted(v[2] for v in sides) == ["google", "twitter"] and len({v[:2] for v in sides}) == 1
               for caption, sides in where.items() if caption != "moose")
    side = {caption: sides[0][:2] for caption, sides in where.items()}
    assert side["woman mage: medium skin tone"] == ("test", "recombination")
    assert side["brazil flag"] == ("test", "new")
    assert side[CAPTIONS[0]] == ("validation", "new")
    assert side["woman mage"] == side["woman mage: dark skin tone"] == side["maldives flag"] == ("train", "trained")
    again = emoji.load("test", *packages)
    assert [(r["caption"], r["vendor"]) for r in again] == [(r["caption"], r["vendor"]) for r in splits["test"]]
    prints = {split: emoji.load(split, *packages)._fingerprint for split in emoji.SPLITS}
    assert prints["test"] == again._fingerprint and len(set(prints.values())) == 3


def catalogue_of_groups(n_plain=1500, n_toned=400, n_paired=100):
    """A synthetic catalogue: plain emoji, emoji with five tones, two-person emoji with 25 (base: its captions)."""
    groups = {f"plain {i}": [f"plain {i}"] for i in range(n_plain)}
    groups.update({f"toned {i}": [f"toned {i}"] + [f"toned {i}: {t}" for t in emoji.TONES.values()]
                   for i in range(n_toned)})
    groups.update({f"pair {i}": [f"pair {i}"] + [f"pair {i}: {a}, {b}" for a in emoji.TONES.values()
                                                  for b in emoji.TONES.values()] for i in range(n_paired)})
    return groups


def test_the_rule_holds_out_new_groups_whole_and_one_tone_of_a_recombination():
    """On 2,000 synthetic groups: a new group is in test whole and no relative trains; a recombination is one
    variant, never the untoned emoji, its untoned form and other tones all in train; validation only from groups
    test leaves whole; novelty read off the split; about 10% of captions in test (both parts at least a quarter of
    it), about 5% of the rest in validation; the same sides whatever order the groups and captions come in."""
    groups = catalogue_of_groups()
    side = emoji.split_captions(groups)
    assert set(side) == {c for captions in groups.values() for c in captions}
    tested = 0
    for base, captions in groups.items():
        splits = [side[c][0] for c in captions]
        held = [c for c in captions if side[c][0] == "test"]
        if any(side[c] == ("test", "new") for c in captions):
            assert splits == ["test"] * len(captions) and {side[c][1] for c in captions} == {"new"}
        elif held:
            assert len(held) == 1 and held[0] != base and side[held[0]][1] == "recombination"
            assert [side[c] for c in captions if c != held[0]] == [("train", "trained")] * (len(captions) - 1)
            tested += 1
        for c in captions:
            relatives_train = any(side[o][0] == "train" for o in captions if o != c)
            assert side[c][1] == ("trained" if side[c][0] == "train" else "recombination" if relatives_train else "new")
        assert "validation" not in splits or "test" not in splits
    parts = {kind: sum(v == ("test", kind) for v in side.values()) for kind in ("recombination", "new")}
    test, validation = sum(parts.values()), sum(v[0] == "validation" for v in side.values())
    assert 0.08 < test / len(side) < 0.12 and min(parts.values()) > test / 4 and tested == parts["recombination"]
    assert 0.035 < validation / (len(side) - test) < 0.065
    shuffled = list(groups.items())
    random.Random(0).shuffle(shuffled)
    assert emoji.split_captions({b: random.Random(1).sample(c, len(c)) for b, c in shuffled}) == side


# ---- Refusals: packages that are not the pinned ones, and training on test ----------------------------------------


def one_line(error):
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_missing_wrong_or_truncated_package_is_refused_in_one_line_naming_the_file(packages, tmp_path):
    folder, pinned = packages
    with pytest.raises(ConfigError) as e:
        emoji.load("train", tmp_path, pinned)
    assert one_line(e) == (f"data.source='emoji': {emoji.tarball(tmp_path, 'google')} not found. Fetch the pinned "
                           f"packages once: python tools/fetch_emoji.py --out {tmp_path}")
    for vendor in emoji.PINNED:
        raw = emoji.tarball(folder, vendor).read_bytes()
        emoji.tarball(tmp_path, vendor).write_bytes(raw[:len(raw) // 2] if vendor == "twitter" else raw)
    with pytest.raises(ConfigError) as e:
        emoji.load("train", tmp_path, pinned)
    twitter = emoji.tarball(tmp_path, "twitter")
    assert one_line(e).startswith(f"{twitter}: not emoji-datasource-twitter@16.0.0 (its sha512 is sha512-")
    assert one_line(e).endswith(f"a wrong or truncated file). Fetch it again: {emoji.FETCH} --out {tmp_path}")
    with pytest.raises(ConfigError, match="not emoji-datasource-google@16.0.0"):  # intact, but not the pinned file
        emoji.load("train", folder)
    with pytest.raises(ValueError, match=r"has the splits \['test', 'train', 'validation'\], not 'val'"):
        emoji.load("val", *packages)


@pytest.mark.parametrize("change, message", [
    (lambda es: es[4].update(category="Vehicles"), "emoji 'baby bottle' has the category 'Vehicles', none of"),
    (lambda es: es[1]["skin_variations"].update({"1F3FA": {"image": "x.png", "has_img_google": True}}),
     "emoji 'woman mage': skin tone 1F3FA is none of the five modifiers"),
    (lambda es: es[3].update(image="gone.png"), "package/img/google/64/gone.png is missing (emoji.json lists it for "
                                                "'maldives flag')"),
], ids=["category", "tone", "image"])
def test_an_emoji_json_the_source_cannot_read_is_refused_naming_the_emoji(tmp_path, change, message):
    entries = json.loads(json.dumps(FIXTURE))
    change(entries)
    pinned = write_packages(tmp_path, entries)
    with pytest.raises(ConfigError) as e:
        [emoji.load(split, tmp_path, pinned) for split in emoji.SPLITS]
    assert message in one_line(e) and str(tmp_path) in one_line(e)


def test_an_image_other_than_64_px_is_refused_naming_the_file(tmp_path):
    pinned = write_packages(tmp_path, image=lambda f, v: png(f, v, side=32 if f == "1f37c.png" else 64))
    with pytest.raises(ConfigError) as e:
        emoji.load("train", tmp_path, pinned)
    assert one_line(e) == (f"{emoji.tarball(tmp_path, 'google')}: package/img/google/64/1f37c.png ('baby bottle'): "
                           f"32 x 32 pixels, not 64 x 64")


def emoji_config(folder, *args, trainer=train_flow_matching):
    return config.load_config(trainer.DEFAULTS, [f"--data.source=emoji:{folder}", "--data.val_split=validation",
                                                 "--data.resolution=16", *args], schema=trainer.CONFIG)


@pytest.mark.parametrize("trainer", [train_flow_matching, train_ddpm])
def test_the_trainers_refuse_the_test_split_and_rows_held_out_by_row(packages, tmp_path, trainer):
    """Each a config problem at start-up naming its key: training on test, holding out test (tools/tune.py chooses
    guidance on the held-out rows), held-out rows drawn by row (the other vendor's image of each caption trains),
    streaming, packages not there (the fetch command). A good emoji config loads."""
    folder = packages[0]
    assert emoji_config(folder, trainer=trainer).data.source == f"emoji:{folder}"
    for args, line in ((["--data.split=test"], "data.split='test': the test captions of data.source="),
                       (["--data.val_split=test"], "data.val_split='test': the test captions"),
                       (["--data.val_split=null"], "data.val_split=None draws held-out rows from data.split, and the "
                                                   "other vendor's image of each caption stays in training"),
                       (["--data.streaming=true"], "is read whole from its two packages, never streamed"),
                       ([f"--data.source=emoji:{tmp_path}"], f"{emoji.tarball(tmp_path, 'google')}, "
                                                             f"{emoji.tarball(tmp_path, 'twitter')} not found. Fetch "
                                                             f"the pinned packages once: python tools/fetch_emoji.py "
                                                             f"--out {tmp_path}")):
        with pytest.raises(ConfigError, match="invalid config \\(1 problem\\)") as e:
            emoji_config(folder, *args, trainer=trainer)
        assert line in str(e.value)


def test_the_tools_refuse_to_learn_from_the_test_split(packages, tmp_path):
    """tools/classifier.py and tools/autoencoder.py learn from data.split: its test split is refused by the config
    they load, and by training_and_test before any image is read; refuse_test, which a CLIP tool calls, leaves other
    sources alone."""
    folder = packages[0]
    recipe = tmp_path / "emoji.json"
    recipe.write_text(json.dumps({"data": {"source": f"emoji:{folder}", "split": "test", "val_split": "validation"}}))
    with pytest.raises(ConfigError, match="data.split='test': the test captions"):
        classifier_tool.main(["--config", str(recipe), "--out", str(tmp_path / "c")])
    from tools import autoencoder

    with pytest.raises(ConfigError, match="data.split='test': the test captions"):
        autoencoder.main(["--config", str(recipe), "--out", str(tmp_path / "a")])
    data = config.Config({"source": f"emoji:{folder}", "split": "test"})
    with pytest.raises(ConfigError, match="^data.split='test': the test captions of data.source='emoji:"):
        sources.training_and_test(data, "validation", "tools/autoencoder.py")
    with pytest.raises(SystemExit, match="^tools/clip.py: data.split='test'"):
        emoji.refuse_test("emoji", "test", "tools/clip.py")
    emoji.refuse_test("fashion_mnist", "test", "tools/clip.py")  # another source's test split: not this one's rule
    emoji.refuse_test("emoji", "train", "tools/clip.py")


def test_the_image_tools_read_a_text_recipe_that_names_the_folders_they_build(packages, tmp_path, monkeypatch):
    """A text recipe (captions, a CLIP and an autoencoder named by folders not built yet, as configs/emoji.json is
    before its tools run): tools/classifier.py learns the category with --data.label_column=label, and
    tools/autoencoder.py trains on the same rows; neither reads the recipe's encoders (config.IMAGES_ONLY)."""
    folder, pinned = packages
    monkeypatch.setattr(emoji, "PINNED", pinned)
    recipe = tmp_path / "emoji.json"
    recipe.write_text(json.dumps({"data": {"source": f"emoji:{folder}", "val_split": "validation", "resolution": 16,
                                           "label_column": None, "caption_column": "caption"},
                                  "encoders": {"vae": str(tmp_path / "ae"), "text_encoder": str(tmp_path / "clip")}}))
    with pytest.raises(SystemExit, match="has no data.label_column: .* add --data.label_column=COLUMN"):
        classifier_tool.main(["--config", str(recipe), "--out", str(tmp_path / "c")])
    classifier_tool.main(["--config", str(recipe), "--out", str(tmp_path / "c"), "--epochs", "1",
                          "--data.label_column=label"])
    record = json.loads((tmp_path / "c" / "classifier.json").read_text())
    assert (record["train_rows"], record["test_split"]) == (len(emoji.load("train", folder, pinned)), "test")
    from tools import autoencoder

    autoencoder.main(["--config", str(recipe), "--out", str(tmp_path / "ae"), "--steps", "2", "--channels", "8,8"])
    assert json.loads((tmp_path / "ae" / "autoencoder.json").read_text())["test"]["rows"] == len(
        emoji.load("test", folder, pinned))


def test_a_model_card_names_the_packages_not_the_folder():
    from training.sharing import public

    name = public.data_name("emoji:/home/someone/private/emoji")
    assert name == "`emoji` (the images of emoji-datasource-google and -twitter 16.0.0)" and "someone" not in name


# ---- Through the trainers' path ----------------------------------------------------------------------------------


def test_the_source_opens_through_the_trainers_path(packages, monkeypatch, tiny_text_encoder):
    """open_splits with data.val_split='validation': the training rows are split 'train', the held-out rows split
    'validation', images undecoded and read back by load_image as 64 px RGB; captions and the label go through."""
    folder, pinned = packages
    monkeypatch.setattr(emoji, "PINNED", pinned)
    data = emoji_config(folder, "--data.caption_column=caption", "--data.label_column=null",
                        f"--encoders.text_encoder={tiny_text_encoder}", "--encoders.max_tokens=16").data
    lines = []
    train, val = open_splits(data, lines.append)
    assert set(train["caption"]) == {r["caption"] for r in emoji.load("train", folder, pinned)}
    assert set(val["caption"]) == {CAPTIONS[0]} and len(val) == 2
    assert load_image(train[0]["image"]).size == (64, 64) and set(train[0]["image"]) == {"bytes", "path"}
    assert f"rows held out for validation, split 'validation' (data.val_split)" in lines[-1]
    assert open_dataset(data, "test")._fingerprint == open_dataset(data, "test")._fingerprint  # the cache key


@pytest.mark.slow
def test_a_text_to_image_run_trains_on_the_training_captions_and_validates_on_the_validation_ones(
        packages, monkeypatch, tmp_path, tiny_text_encoder, capsys):
    """Two steps of flow matching from the fixture packages, captions through a text encoder: the run says which
    rows it trains on and holds out; its validation grid is captioned with validation captions."""
    from conftest import TINY_MODEL

    folder, pinned = packages
    monkeypatch.setattr(emoji, "PINNED", pinned)
    run = train_flow_matching.main([
        *TINY_MODEL, f"--data.source=emoji:{folder}", "--data.val_split=validation", "--data.caption_column=caption",
        "--data.label_column=null", f"--encoders.text_encoder={tiny_text_encoder}", "--encoders.max_tokens=16",
        "--data.resolution=16",
        "--run_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"), "--train.max_steps=2",
        "--train.batch_size=8", "--train.warmup_steps=1", "--val.steps=2", "--val.num_samples=2",
        "--val.loss_samples=2", "--log.wandb=off", "--log.every=1", "--val.every=2", "--ckpt.every=1000",
        "--val.fid_every=0"])
    out = capsys.readouterr().out
    train_rows = len(emoji.load("train", folder, pinned))
    assert f"data: emoji:{folder}: {train_rows} rows train from split 'train'; 2 rows held out" in out
    grid = (run / "samples" / "step_00000002.txt").read_text()
    assert CAPTIONS[0] in grid


# ---- The real packages, and the fetch tool ------------------------------------------------------------------------


@installed
@pytest.mark.slow
def test_the_real_packages_hold_what_docs_data_md_says():
    """3,786 images a vendor (1,911 emoji, 1,875 variants), 10 categories, the issue's example captions, each
    caption once per vendor; the split's counts as docs/data.md gives them; the test split opens (774 rows)."""
    rows, _ = emoji.table()
    for vendor in emoji.PINNED:
        mine = [r for r in rows if r["vendor"] == vendor]
        assert len(mine) == 3786 and sum(r["caption"] == r["base"] for r in mine) == 1911
        assert len({r["caption"] for r in mine}) == 3786
    assert {r["category"] for r in rows} == set(emoji.CATEGORIES)
    captions = {r["caption"] for r in rows}
    assert {"grinning face with one large and one small eye", "maldives flag", "woman mage", "baby bottle",
            "woman mage: medium skin tone", "handshake: light skin tone, dark skin tone"} <= captions
    assert emoji.counts(rows) == {
        "train": {"captions": 3225, "images": 6450, "recombination": 0, "new": 0},
        "validation": {"captions": 174, "images": 348, "recombination": 73, "new": 101},
        "test": {"captions": 387, "images": 774, "recombination": 182, "new": 205}}
    test = emoji.load("test")
    assert len(test) == 774 and set(test["novelty"]) == {"recombination", "new"}


def fake_npm(tmp_path, source, monkeypatch):
    """An `npm` first on PATH that copies the named packages from `source` into --pack-destination, logging its
    arguments (no network)."""
    log, script = tmp_path / "npm.log", tmp_path / "bin" / "npm"
    script.parent.mkdir()
    script.write_text(f"""#!{sys.executable}
import shutil, sys
args = sys.argv[1:]
open({str(log)!r}, "a").write(" ".join(args))
for name in [a.split("@")[0] for a in args if a.startswith("emoji-datasource-")]:
    shutil.copy(f"{source}/{{name}}-16.0.0.tgz", args[args.index("--pack-destination") + 1])
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_fetch_tool_packs_what_is_missing_checks_it_and_prints_the_counts(packages, tmp_path, monkeypatch, capsys):
    """npm pack for the packages not there or not intact (a truncated one is fetched again), none when both are
    intact; each checked against PINNED; a package npm gives that is not the pinned one stops with one line."""
    folder, pinned = packages
    monkeypatch.setattr(emoji, "PINNED", pinned)
    log = fake_npm(tmp_path, folder, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    emoji.tarball(out, "google").write_bytes(emoji.tarball(folder, "google").read_bytes())
    emoji.tarball(out, "twitter").write_bytes(emoji.tarball(folder, "twitter").read_bytes()[:1000])
    assert fetch_emoji.main(["--out", str(out)]) == out
    assert log.read_text().split() == ["pack", "emoji-datasource-twitter@16.0.0", "--pack-destination", str(out),
                                       "--loglevel=warn"]
    printed = capsys.readouterr().out
    assert f"both packages in {out} are intact: data.source='emoji:{out}'" in printed
    counts = emoji.counts(emoji.table(out, pinned)[0])
    test = counts["test"]
    assert re.search(rf"test +{test['captions']} captions, +{test['images']} images \(both vendors\); recombination "
                     rf"{test['recombination']}, new {test['new']}\n", printed) and test["new"] > 0
    log.unlink()
    fetch_emoji.main(["--out", str(out)])
    assert not log.exists()  # both intact: npm not run
    emoji.tarball(out, "google").unlink()
    monkeypatch.setitem(pinned, "google", "sha512-notthisone")
    with pytest.raises(SystemExit) as e:
        fetch_emoji.main(["--out", str(out)])
    assert one_line(e).startswith(f"tools/fetch_emoji.py: {emoji.tarball(out, 'google')}: not emoji-datasource-google")
