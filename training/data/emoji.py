"""Emoji: real captioned colour images that install offline, for text-to-image (data.source="emoji"; docs/data.md,
"Emoji"). Two pinned npm packages of iamcal/emoji-data, emoji-datasource-google@16.0.0 and
emoji-datasource-twitter@16.0.0 (packages MIT; Google's images Apache-2.0, Twitter's CC-BY-4.0), read straight
from their .tgz files: no extracted copy, and nothing is downloaded at run time. Fetched once by

    python tools/fetch_emoji.py                      # into ~/.cache/minimal-diffusion/emoji: data.source="emoji"
    python tools/fetch_emoji.py --out /shared/emoji  # data.source="emoji:/shared/emoji"

and checked against the npm registry's sha512 (PINNED) every time they are opened: a wrong or truncated file stops
the run with one line naming the file and the command. Apple's and Facebook's sets are other packages, not read.

Each package holds emoji.json (1,911 emoji: name, category, subcategory, image file, skin-tone variants) and a
64 x 64 RGBA PNG of each emoji and variant: 3,786 images a vendor. A row is one vendor's image composited on white
(64 x 64 RGB PNG bytes) with
    caption      the name in lower case ("grinning face with one large and one small eye", "maldives flag"); a
                 variant adds its tones in Unicode's (CLDR's) words, after a colon ("woman mage: medium skin tone";
                 after a comma where the name has one: "kiss: man, man, light skin tone, dark skin tone"; a
                 two-person emoji names both tones, or one where both are the same: "handshake: light skin tone").
                 The one name emoji.json gives two emoji ("MAN IN TUXEDO", U+1F935 and its ZWJ man form) becomes
                 each one's short name in words ("person in tuxedo", "man in tuxedo"), so a caption is one emoji
    label        the category, a ClassLabel of CATEGORIES (10)
    subcategory, vendor ("google", "twitter"), base (the caption of the emoji a variant is a skin tone of)
    novelty      "trained" in train; in validation and test, "recombination" (a relative, i.e. the same emoji
                 in another tone or untoned, is in train) or "new" (none is: a flag never shown)

The split is by caption, deterministic and fixed by the words (sha256, never Python's hash): a caption's side depends
on its own words and its group's, so both vendors' images of a caption are always on the same side. A group is an
emoji with its skin-tone variants:
    test         ~10% of the captions, never trained on by anything (refuse_test, problems). Two parts, reported
                 apart: "new": every caption of a group whose draw("new", base) < NEW_FRACTION (an emoji none of
                 whose relatives is in training); "recombination": of a group with variants, not new, whose
                 draw("recombination", base) < RECOMBINATION_FRACTION, the one variant with the smallest
                 draw("tone", caption): a skin tone of an emoji whose untoned form and other tones are all in train
    validation   of the groups test leaves whole, each caption whose draw("validation", caption) < VALIDATION_FRACTION
                 (~5% of the training captions; data.val_split, where tools/tune.py chooses guidance, never test)
    train        the rest
"""
import collections
import hashlib
import io
import json
import tarfile
from pathlib import Path

from PIL import Image

from training.config.config import ConfigError
from training.data.npm import integrity

SOURCE = "emoji"  # data.source: "emoji" (DEFAULT_FOLDER) or "emoji:/path/to/folder"
VERSION = "16.0.0"
# The npm registry's integrity of each package (`npm view emoji-datasource-google@16.0.0 dist.integrity`).
PINNED = {"google": "sha512-ZRexfzs7MVoLnmzZmNsO4TKhnAJp5D++Vm6PpUpH/jEQQlemp3l88CjZ+DoZ2faM9R4QxZkOPJCoT8DlPhfQ3A==",
          "twitter": "sha512-7F+uCuHH+7Qnrc15P5tnbvKkg9E6tlzi4MnT2uW1RlN4pLYTza6cP/dstIfSDMtpjFLWuZewWg8jBbuL2eyELQ=="}
# The terms of what a model trained here learned from, for its card (training/sharing/model_card.py): the packages'
# LICENSE (MIT, Copyright (c) 2013 Cal Henderson) and README.md ("Image Sources": each vendor's source, version and
# licence); the README names no holder of Twemoji's graphics, so theirs is Twemoji's own notice (twitter/twemoji's
# README, "License", of which jdecked/twemoji is the fork the package draws from), which CC-BY 4.0 requires to be kept
# with the images and what is made from them.
LICENCES = [
    f"emoji-datasource-google and emoji-datasource-twitter {VERSION} (iamcal/emoji-data): MIT License, Copyright (c) "
    f"2013 Cal Henderson",
    "Google's images: Noto Emoji v2.048 (https://github.com/googlefonts/noto-emoji), Apache License 2.0",
    "Twitter's images: Twemoji graphics, Copyright 2019 Twitter, Inc and other contributors (the fork "
    "https://github.com/jdecked/twemoji, v16.0.1), licensed under CC-BY 4.0 "
    "(https://creativecommons.org/licenses/by/4.0/); changed: composited on white"]
DEFAULT_FOLDER = Path("~/.cache/minimal-diffusion/emoji").expanduser()
FETCH = "python tools/fetch_emoji.py"
SIDE = 64
# Unicode's category order (emoji-test.txt), which emoji.json's categories.json follows; the label is the index.
CATEGORIES = ["Smileys & Emotion", "People & Body", "Component", "Animals & Nature", "Food & Drink",
              "Travel & Places", "Activities", "Objects", "Symbols", "Flags"]
# The Fitzpatrick modifiers in CLDR's words (the short names of U+1F3FB .. U+1F3FF).
TONES = {"1F3FB": "light skin tone", "1F3FC": "medium-light skin tone", "1F3FD": "medium skin tone",
         "1F3FE": "medium-dark skin tone", "1F3FF": "dark skin tone"}
SPLITS = ("train", "validation", "test")
NOVELTY = ("trained", "recombination", "new")
# Chosen on the pinned packages so that test holds about 10% of the captions (387 of 3,786: 182 recombinations, 205
# new) and validation about 5% of the rest (174 of 3,399); docs/data.md, "Emoji".
NEW_FRACTION, RECOMBINATION_FRACTION, VALIDATION_FRACTION = 0.065, 0.6, 0.075


def is_source(source):
    return source == SOURCE or source.startswith(SOURCE + ":")


def folder_of(source):
    return DEFAULT_FOLDER if source == SOURCE else Path(source[len(SOURCE) + 1:]).expanduser()


def tarball(folder, vendor):
    return Path(folder) / f"emoji-datasource-{vendor}-{VERSION}.tgz"  # the name `npm pack` gives it


def fetch_command(folder):
    return FETCH + ("" if Path(folder) == DEFAULT_FOLDER else f" --out {folder}")


# ----------------------------------------------------------------------------------------------------------
# The packages: checked, then read in one pass (emoji.json and the 64 px PNGs).


def read_package(folder, vendor, pinned=None):
    """(emoji.json's list, {image file name: PNG bytes} of img/<vendor>/64/) of one package, after its integrity is
    checked against `pinned`. A missing, wrong or truncated file is one line naming it and the fetch command."""
    path, pinned = tarball(folder, vendor), pinned or PINNED
    if not path.is_file():
        raise ConfigError(f"data.source='{SOURCE}': {path} not found. Fetch the pinned packages once: "
                          f"{fetch_command(folder)}")
    raw = path.read_bytes()
    if (got := integrity(raw)) != pinned[vendor]:
        raise ConfigError(f"{path}: not emoji-datasource-{vendor}@{VERSION} (its sha512 is {got[:23]}..., the "
                          f"registry's {pinned[vendor][:23]}...: a wrong or truncated file). Fetch it again: "
                          f"{fetch_command(folder)}")
    entries, images, prefix = None, {}, f"package/img/{vendor}/{SIDE}/"
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        for member in tar:
            if member.name == "package/emoji.json":
                entries = json.load(tar.extractfile(member))
            elif member.name.startswith(prefix) and member.name.endswith(".png"):
                images[member.name[len(prefix):]] = tar.extractfile(member).read()
    if entries is None:
        raise ConfigError(f"{path}: holds no package/emoji.json (is it an emoji-datasource package?)")
    return entries, images


def tone_words(key, where):
    """'1F3FB-1F3FF' -> 'light skin tone, dark skin tone'; '1F3FB-1F3FB' -> 'light skin tone' (said once)."""
    codes = key.split("-")
    if unknown := [c for c in codes if c not in TONES]:
        raise ConfigError(f"{where}: skin tone {unknown[0]} is none of the five modifiers {sorted(TONES)}")
    return ", ".join(dict.fromkeys(TONES[c] for c in codes))


def catalogue(entries, vendor, where):
    """One dict per image of `vendor` in emoji.json's `entries`: caption, base, category, subcategory, image file."""
    names = [e["name"].lower() for e in entries]
    rows, shared = [], {name for name, n in collections.Counter(names).items() if n > 1}
    for e, name in zip(entries, names):
        base = e["short_name"].replace("_", " ") if name in shared else name
        if e["category"] not in CATEGORIES:
            raise ConfigError(f"{where}: emoji '{base}' has the category {e['category']!r}, none of {CATEGORIES}")
        kept = {"base": base, "category": e["category"], "subcategory": e["subcategory"]}
        if e.get(f"has_img_{vendor}"):
            rows.append({**kept, "caption": base, "image": e["image"]})
        for key, variant in (e.get("skin_variations") or {}).items():
            words = tone_words(key, f"{where}: emoji '{base}'")
            caption = base + (", " if ":" in base else ": ") + words  # CLDR: "kiss: man, man, dark skin tone"
            if variant.get(f"has_img_{vendor}"):
                rows.append({**kept, "caption": caption, "image": variant["image"]})
    return rows


# ----------------------------------------------------------------------------------------------------------
# The split by caption.


def draw(salt, text):
    """A uniform number in [0, 1) fixed by the words: the first 64 bits of sha256("salt:text")."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{text}".encode()).digest()[:8], "big") / 2 ** 64


def split_captions(groups):
    """{caption: (split, novelty)} for `groups` = {base caption: [its captions: the emoji and its variants]}
    (the rule: this module's docstring)."""
    side = {}
    for base, captions in groups.items():
        variants = [c for c in captions if c != base]
        if draw("new", base) < NEW_FRACTION:
            side.update({c: "test" for c in captions})
        elif variants and draw("recombination", base) < RECOMBINATION_FRACTION:
            held = min(variants, key=lambda c: draw("tone", c))
            side.update({c: "test" if c == held else "train" for c in captions})
        else:
            side.update({c: "validation" if draw("validation", c) < VALIDATION_FRACTION else "train" for c in captions})
    out = {}
    for captions in groups.values():  # the novelty is read off the split, not assumed from the draw
        trained = any(side[c] == "train" for c in captions)
        out.update({c: (side[c], "trained" if side[c] == "train" else "recombination" if trained else "new")
                    for c in captions})
    return out


def composite(png):
    """PNG bytes of an image (RGBA, LA, P with transparency: any mode) -> PNG bytes of it composited on white, RGB
    (zlib level 1: 30% faster to write than the default, 8% larger)."""
    img = Image.open(io.BytesIO(png)).convert("RGBA")
    if img.size != (SIDE, SIDE):
        raise ValueError(f"{img.size[0]} x {img.size[1]} pixels, not {SIDE} x {SIDE}")
    out, white = io.BytesIO(), Image.new("RGBA", img.size, (255, 255, 255, 255))
    Image.alpha_composite(white, img).convert("RGB").save(out, "PNG", compress_level=1)
    return out.getvalue()


def table(folder=DEFAULT_FOLDER, pinned=None):
    """Every image of both packages as rows (caption, base, category, subcategory, vendor, image file, split,
    novelty), and {vendor: {image file: PNG bytes}}. The split is drawn over the union of both catalogues, so a
    caption's group is the same for both vendors."""
    rows, pngs = [], {}
    for vendor in PINNED:
        entries, pngs[vendor] = read_package(folder, vendor, pinned)
        rows += [{**row, "vendor": vendor} for row in catalogue(entries, vendor, f"{tarball(folder, vendor)}")]
    groups = {}
    for row in rows:
        groups.setdefault(row["base"], {})[row["caption"]] = None
    split = split_captions({base: list(captions) for base, captions in groups.items()})
    for row in rows:
        row["split"], row["novelty"] = split[row["caption"]]
    return rows, pngs


def counts(rows):
    """{split: {"captions", "images", "recombination" (captions), "new" (captions)}}: what docs/data.md reports."""
    out = {}
    for split in SPLITS:
        part = [r for r in rows if r["split"] == split]
        captions = {r["caption"]: r["novelty"] for r in part}
        out[split] = {"captions": len(captions), "images": len(part),
                      **{kind: sum(v == kind for v in captions.values()) for kind in NOVELTY[1:]}}
    return out


def load(split, folder=DEFAULT_FOLDER, pinned=None):
    """Split `split` as a `datasets.Dataset`: image (PNG bytes, RGB on white), caption, label (a ClassLabel of
    CATEGORIES), subcategory, vendor, base, novelty. Its fingerprint is a digest of the rows themselves, so the
    trainers' cache key follows the packages and the rules that make captions and the split."""
    import datasets

    if split not in SPLITS:
        raise ValueError(f"data.source='{SOURCE}' has the splits {sorted(SPLITS)}, not '{split}'")
    rows, pngs = table(folder, pinned)
    columns = {key: [] for key in ("image", "caption", "label", "subcategory", "vendor", "base", "novelty")}
    digest = hashlib.sha256()
    for row in (r for r in rows if r["split"] == split):
        file = f"{tarball(folder, row['vendor'])}: package/img/{row['vendor']}/{SIDE}/{row['image']}"
        if row["image"] not in pngs[row["vendor"]]:
            raise ConfigError(f"{file} is missing (emoji.json lists it for '{row['caption']}')")
        try:
            image = composite(pngs[row["vendor"]][row["image"]])
        except Exception as e:  # PIL's errors, or our size check
            raise ConfigError(f"{file} ('{row['caption']}'): {e}") from None
        values = {**row, "image": image, "label": CATEGORIES.index(row["category"])}
        for key in columns:
            columns[key].append(values[key])
        digest.update(json.dumps([values[k] for k in columns if k != "image"]).encode())
        digest.update(hashlib.sha256(image).digest())
    strings = {k: datasets.Value("string") for k in ("caption", "subcategory", "vendor", "base", "novelty")}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CATEGORIES), **strings})
    ds = datasets.Dataset.from_dict({k: [{"bytes": v, "path": None} for v in values] if k == "image" else values
                                     for k, values in columns.items()}, features=features)
    ds._fingerprint = f"emoji-{split}-{digest.hexdigest()[:16]}"
    return ds


# ----------------------------------------------------------------------------------------------------------
# The test captions are never trained on: the trainers' start-up check, and the tools' refusal.


def test_refusal(source, split, key):
    """The line refusing to train on split `split` of `source` (`key`: what named it), or None."""
    if is_source(source) and split == "test":
        return (f"{key}='test': the test captions of data.source='{source}' are held out from everything that "
                f"learns (model, autoencoder, text encoder, classifier, CLIP): train on 'train' "
                f"(docs/data.md, Emoji)")
    return None


def refuse_test(source, split, tool):
    """For a tool that learns from split `split` of `source` (tools/classifier.py, tools/autoencoder.py, a CLIP):
    exits with one line if that is this source's test split."""
    if line := test_refusal(source, split, "data.split"):
        raise SystemExit(f"{tool}: {line}")


def problems(cfg):
    """The trainers' start-up check of an emoji run (config.schema's checks): never trained on test, validation
    rows held out by caption (data.val_split='validation': rows drawn from train would share captions with it, the
    other vendor's image of each), not streamed, the packages present (their integrity is checked when they are
    opened)."""
    d, out = cfg["data"], []
    if not is_source(d["source"]):
        return out
    for key, why in (("data.split", ""), ("data.val_split", " (tools/tune.py chooses guidance on the held-out rows)")):
        if line := test_refusal(d["source"], d[key.split(".")[1]], key):
            out.append(line + why)
    if d["streaming"]:
        out.append(f"data.streaming=true: data.source='{d['source']}' is read whole from its two packages, never "
                   f"streamed: set data.streaming=false")
    if d["val_split"] is None:
        out.append(f"data.val_split=None draws held-out rows from data.split, and the other vendor's image of each "
                   f"caption stays in training: set data.val_split='validation' (data.source='{d['source']}' holds "
                   f"out by caption)")
    folder = folder_of(d["source"])
    if missing := [str(tarball(folder, v)) for v in PINNED if not tarball(folder, v).is_file()]:
        out.append(f"data.source='{d['source']}': {', '.join(missing)} not found. Fetch the pinned packages once: "
                   f"{fetch_command(folder)}")
    return out

