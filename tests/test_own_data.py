"""A user's own data: held-out rows sized and announced, labels checked before any work, unset
data.num_classes read from the data, every image mode converted with its full range."""
import io
import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from training.config import config
import train_flow_matching as fm
from training.data.sources import load_image, make_demo_dataset, open_splits


def parquet_source(tmp_path, n, labels=None, class_label=True):
    """A parquet folder of n small demo images; `labels` replaces the label column (as plain integers)."""
    ds = make_demo_dataset(n, seed=0, resolution=8)
    if labels is not None or not class_label:
        ds = ds.remove_columns("label").add_column("label", list(labels if labels is not None else range(n)))
    folder = tmp_path / f"parquet{n}"
    folder.mkdir()
    ds.to_parquet(str(folder / "part-0.parquet"))
    return folder


def data_cfg(*args):
    return config.load_config(fm.DEFAULTS, list(args)).data


# ---- Held-out rows -------------------------------------------------------------------------------------


def test_default_holdout_is_a_small_fraction_capped_and_announced(tmp_path):
    lines = []
    for n, held in ((60, 6), (300, 30), (3000, 256)):
        train, val = open_splits(data_cfg(f"--data.source={parquet_source(tmp_path, n)}"), lines.append)
        assert (len(train), len(val)) == (n - held, held)
    assert any(line.startswith("data: ") and line.endswith("270 rows train from split 'train'; 30 rows held out for "
               "validation, drawn from split 'train' (data.val_holdout unset: 10% of the rows, at most 256)")
               for line in lines)


def test_holdout_rows_are_disjoint_from_training_rows(tmp_path):
    source = parquet_source(tmp_path, 300, labels=range(300), class_label=False)
    train, val = open_splits(data_cfg(f"--data.source={source}", "--data.num_classes=300"), print)
    assert sorted(list(train["label"]) + list(val["label"])) == list(range(300))


def test_holdout_leaving_too_little_to_train_on_names_the_key(tmp_path):
    source = parquet_source(tmp_path, 300)
    with pytest.raises(ValueError, match=r"data.val_holdout=256 holds out 256 of the 300 rows .* leaving 44 to "
                                         r"train on.*at most 150"):
        open_splits(data_cfg(f"--data.source={source}", "--data.val_holdout=256"), print)
    with pytest.raises(ValueError, match=r"data.val_holdout=0 must be a whole number"):
        open_splits(data_cfg(f"--data.source={source}", "--data.val_holdout=0"), print)
    train, val = open_splits(data_cfg(f"--data.source={source}", "--data.val_holdout=150"), print)
    assert (len(train), len(val)) == (150, 150)  # exactly half is still allowed


# ---- Labels ---------------------------------------------------------------------------------------------


def test_one_based_labels_are_refused_naming_rows_range_and_fix(tmp_path):
    source = parquet_source(tmp_path, 40, labels=[1 + i % 9 for i in range(40)])
    with pytest.raises(ValueError) as e:
        open_splits(data_cfg(f"--data.source={source}", "--data.num_classes=9"), print)
    msg = str(e.value)
    assert "data.num_classes=9" in msg and "label 9 would train as the guidance null class" in msg
    assert "4 of the 40 rows" in msg and "rows 8 (label 9), 17 (label 9), 26 (label 9), 35 (label 9)" in msg
    assert "run 1 .. 9" in msg and "1-based" in msg and "data.num_classes=10" in msg


def test_labels_beyond_num_classes_and_negative_ones_are_refused(tmp_path):
    source = parquet_source(tmp_path, 20, labels=[0, 1, 2, -1] + [0] * 15 + [7])
    with pytest.raises(ValueError, match=r"2 of the 20 rows .* rows 3 \(label -1\), 19 \(label 7\).*"
                                         r"run -1 .. 7. If there are more classes, set data.num_classes=8"):
        open_splits(data_cfg(f"--data.source={source}", "--data.num_classes=3"), print)


def test_bad_labels_of_an_imagefolder_name_their_files(tmp_path):
    folder = tmp_path / "meta" / "train"
    folder.mkdir(parents=True)
    rows = [{"file_name": f"img_{i}.png", "label": [0, 1, 2, 5][i]} for i in range(4)]
    for row in rows:
        Image.fromarray(np.full((12, 12, 3), 90, np.uint8)).save(folder / row["file_name"])
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"1 of the 4 rows .* rows 3 \(label 5, train/img_3.png\)"):
        open_splits(data_cfg(f"--data.source={tmp_path / 'meta'}", "--data.num_classes=3"), print)


def test_a_class_count_other_than_the_class_folders_names_the_folders(tmp_path):
    """4 class folders and data.num_classes 3 or 5: one ConfigError (a line, no traceback) naming the folders and
    the count, not the rows (too few) nor data.class_ids (too many), which the user never set."""
    for c in range(4):
        (tmp_path / "classes" / f"c{c}").mkdir(parents=True)
        Image.fromarray(np.full((12, 12, 3), 90, np.uint8)).save(tmp_path / "classes" / f"c{c}" / "000.png")
    for k in (3, 5):
        with pytest.raises(config.ConfigError, match=rf"data.num_classes={k}, but .*classes has 4 classes \(its class "
                                                     r"folders.*: c0, c1, c2, c3\): set data.num_classes=4, or leave"):
            open_splits(data_cfg(f"--data.source={tmp_path / 'classes'}", f"--data.num_classes={k}",
                                 "--data.val_holdout=1"), print)
    assert open_splits(data_cfg(f"--data.source={tmp_path / 'classes'}", "--data.val_holdout=1"), print)[0]


LAYOUTS = {  # folder -> files: class folders, a split folder of class folders, metadata.jsonl, split folders named val
    "classes": ["cat/0.png", "cat/1.png", "dog/2.png"],
    "split_folders": ["train/cat/0.png", "train/dog/1.png", "test/cat/2.png", "test/dog/3.png", "test/dog/4.png"],
    "metadata": ["train/0.png", "train/1.png", "train/metadata.jsonl"],
    "val_folder": ["train/cat/a.png", "train/dog/d.png", "val/cat/b.png", "val/dog/c.png"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_imagefolder_opens_as_datasets_infers_it_without_its_split_search(tmp_path, layout):
    """Naming the files (the fast path of a large folder's start) reads what datasets' own split inference reads
    from data_dir: the same rows, labels and metadata columns (datasets is the oracle)."""
    import datasets

    from training.data.sources import imagefolder_files, open_dataset

    for i, name in enumerate(LAYOUTS[layout]):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):
            (tmp_path / name).write_text("".join(json.dumps({"file_name": f"{k}.png", "label": k, "caption": f"c{k}"})
                                                 + "\n"
                                                 for k in range(2)))
        else:
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / name)
    splits = {"split_folders": ("train", "test"), "val_folder": ("train", "validation")}.get(layout, ("train",))
    fast = {"classes": True, "split_folders": True, "metadata": True, "val_folder": False}[layout]
    for split in splits:
        assert ("data_files" in imagefolder_files(tmp_path, split)) == (fast or split == "train")
        expected = datasets.load_dataset("imagefolder", data_dir=str(tmp_path), split=split)
        data = config.Config(source=str(tmp_path), image_column="image", label_column=None, caption_column=None)
        got = open_dataset(data, split)
        assert got.features.copy() | {"image": expected.features["image"]} == expected.features, (layout, split)
        pixels = sorted(np.asarray(Image.open(io.BytesIO(r["image"]["bytes"]) if r["image"]["bytes"]
                                              else r["image"]["path"]))[0, 0, 0]
                        for r in got)
        assert pixels == sorted(np.asarray(r["image"])[0, 0, 0] for r in expected), (layout, split)
        if "label" in expected.column_names:
            assert sorted(got["label"]) == sorted(expected["label"]), (layout, split)


PARQUET_LAYOUTS = {  # folder -> files, each of 2 rows: the hub's layout, split names in files, in folders, none
    "hub": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
            "data/test-00000-of-00001.parquet"],
    "file_names": ["train.parquet", "validation.parquet", "my_test-0.parquet"],
    "split_folders": ["train/a.parquet", "train/b.parquet", "dev/c.parquet"],
    "plain": ["part-0.parquet", "part-1.parquet"],
}


@pytest.mark.parametrize("layout", sorted(PARQUET_LAYOUTS))
def test_a_parquet_folder_is_split_by_file_name_as_datasets_splits_it(tmp_path, layout):
    """Each split reads its own files, the ones datasets' own inference gives it (the oracle): a hub-style folder's
    'test' is never trained on and --reference_split test never scores the training rows; a split that matches no
    file is refused by name, listing the splits there are. A plain folder is one split, 'train'."""
    import datasets

    from training.data.sources import open_dataset

    folder = tmp_path / "pq"
    for i, name in enumerate(PARQUET_LAYOUTS[layout]):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict({"image": [b"", b""], "row": [2 * i, 2 * i + 1]}).to_parquet(str(folder / name))
    data = config.Config(source=str(folder), image_column="image", label_column=None, caption_column=None)
    expected = datasets.load_dataset(str(folder))
    assert len(expected) == {"hub": 2, "file_names": 3, "split_folders": 2, "plain": 1}[layout]
    for split in expected:
        assert sorted(open_dataset(data, split)["row"]) == sorted(expected[split]["row"]), (layout, split)
    assert sum(len(open_dataset(data, split)) for split in expected) == 2 * len(PARQUET_LAYOUTS[layout])
    missing = "validation" if layout in ("hub", "plain") else "test" if layout == "split_folders" else "dev"
    refusal = f"data.source='{folder}' has no split '{missing}': its parquet files make the splits {sorted(expected)}"
    with pytest.raises(config.ConfigError, match=re.escape(refusal)):
        open_dataset(data, missing)
    single = config.Config(data, source=str(folder / PARQUET_LAYOUTS[layout][-1]))  # a file named: one split, train
    assert sorted(open_dataset(single, "train")["row"]) == [2 * len(PARQUET_LAYOUTS[layout]) - 2,
                                                           2 * len(PARQUET_LAYOUTS[layout]) - 1]
    with pytest.raises(config.ConfigError, match=r"has no split 'test': .* the splits \['train'\] "):
        open_dataset(single, "test")


def test_a_wrong_data_source_names_the_key_what_was_tried_and_why(tmp_path, monkeypatch):
    """One message naming data.source: the local folder (a near name in its folder), then the hub id and why
    it failed; a path (./, absolute) never reaches the hub; no datasets traceback."""
    import datasets

    from training.data.sources import open_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydata").mkdir()
    hub_calls = []
    load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: hub_calls.append(a[0]) or load(*a, **k))
    with pytest.raises(config.ConfigError) as err:
        open_dataset(data_cfg("--data.source=mydat"), "train")
    message = str(err.value)
    assert message.startswith("data.source='mydat' cannot be opened. Tried as a local folder: ")
    assert f"{tmp_path / 'mydat'} does not exist (in its folder: ['mydata'])" in message
    assert "tried as a hub id: ConnectionError: Couldn't reach 'mydat' on the Hub" in message
    assert "\n" not in message  # a ConfigError: the trainers print it alone, without a traceback
    assert hub_calls == ["mydat"]
    for path in ("./mydat", str(tmp_path / "mydat")):
        with pytest.raises(config.ConfigError, match=r"does not exist .*; not tried as a hub id \(it is a path\)"):
            open_dataset(data_cfg(f"--data.source={path}"), "train")
    assert hub_calls == ["mydat"]
    with pytest.raises(config.ConfigError,
                       match=r"data.source='mydata': .*mydata could not be read as an image folder"):
        open_dataset(data_cfg("--data.source=mydata"), "train")  # an empty folder


def test_a_local_folder_opens_without_datasets_download_bars(tmp_path, capfd):
    from datasets.utils.tqdm import are_progress_bars_disabled

    from training.data.sources import open_dataset

    for i in range(20):
        (tmp_path / "pets" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "pets" / f"c{i % 2}" / f"{i}.png")
    was = are_progress_bars_disabled()
    assert len(open_dataset(data_cfg(f"--data.source={tmp_path / 'pets'}"), "train")) == 20
    assert "Downloading data" not in capfd.readouterr().err
    assert are_progress_bars_disabled() == was  # the switch set back


@pytest.mark.slow  # about 1.5 s: the fast tier keeps its 60 s on 2 cores
def test_unset_num_classes_is_read_from_class_names_never_the_demo_default(tmp_path):
    lines = []
    open_splits(data_cfg(), lines.append)  # the embedded demo: its 9 ClassLabel names
    folder = tmp_path / "folders" / "train"
    for c, name in enumerate(("cat", "dog", "owl")):
        (folder / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((12, 12, 3), 60 * c + 10 * i, np.uint8)).save(folder / name / f"{i}.png")
    data = data_cfg(f"--data.source={tmp_path / 'folders'}")
    open_splits(data, lines.append)
    assert data.num_classes == 3
    assert lines[0] == "data: data.num_classes=9, read from the ClassLabel names of column 'label'"
    assert any(l == "data: data.num_classes=3, read from the ClassLabel names of column 'label'" for l in lines)
    plain = parquet_source(tmp_path, 20, labels=[i % 4 for i in range(20)])
    with pytest.raises(ValueError, match=r"data.num_classes is unset .* not a ClassLabel .* run from 0 to 3"):
        open_splits(data_cfg(f"--data.source={plain}"), print)


@pytest.mark.slow
def test_own_folder_trains_with_its_own_class_count(tmp_path, capsys):
    folder = tmp_path / "folders" / "train"
    for c, name in enumerate(("cat", "dog")):
        (folder / name).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(np.full((16, 16, 3), 100 * c + 5 * i, np.uint8)).save(folder / name / f"{i}.png")
    run = fm.main(["--run_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"),
                   f"--data.source={tmp_path / 'folders'}", "--train.max_steps=1", "--train.batch_size=8",
                   "--val.steps=1", "--val.num_samples=2", "--val.loss_samples=4", "--log.wandb=off",
                   "--log.report=false", "--model.num_layers=1"])
    assert json.loads((run / "config.json").read_text())["data"]["num_classes"] == 2
    assert json.loads((run / "export" / "config.json").read_text())["data"]["num_classes"] == 2
    assert "36 rows train from split 'train'; 4 rows held out" in capsys.readouterr().out


# ---- Evaluating one's own images offline -----------------------------------------------------------------


def class_folder(tmp_path, n=60, size=16):
    """n images in 3 class folders and no split folders; image i is told apart by its red level, 4 i."""
    for i in range(n):
        (tmp_path / "own" / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        pixels = np.zeros((size, size, 3), np.uint8)
        pixels[..., 0], pixels[..., 1 + i % 2], pixels[: size // 2, :, 2] = 4 * i, 120, 60 * (i % 3)
        Image.fromarray(pixels).save(tmp_path / "own" / f"c{i % 3}" / f"{i}.png")
    (tmp_path / "recipe.json").write_text(json.dumps({"data": {"source": str(tmp_path / "own"), "resolution": size}}))
    return tmp_path / "recipe.json"


def test_a_folder_without_a_test_split_measures_the_classifier_on_the_trainers_heldout_rows(tmp_path, capsys,
                                                                                           classifier_rows):
    """datasets reads the same 60 images as split 'test' of a folder without split folders: tools/classifier.py
    says so, trains on the trainer's 54 training rows and is measured on the 6 it holds out (never trained on),
    and a set smaller than its batch trains (it stopped with `Expected positive integer total_steps, but got 0`)."""
    from tools import classifier as classifier_tool

    recipe = class_folder(tmp_path)
    classifier_tool.main(["--config", str(recipe), "--out", str(tmp_path / "c")])
    assert "split 'test' of " in capsys.readouterr().out  # said, not silent
    red = lambda images: sorted(images[:, 0, 0, 0].tolist())  # noqa: E731
    levels = lambda rows: sorted(4 * int(Path(v["path"]).stem) for v in rows["image"])  # noqa: E731  (image i: 4 i)
    kept, held = open_splits(data_cfg(f"--data.source={tmp_path / 'own'}", "--data.resolution=16"), print)
    assert red(classifier_rows["measured"]) == levels(held)  # the 6 held out
    assert red(classifier_rows["trained"]) == levels(kept)  # the other 54
    record = json.loads((tmp_path / "c" / "classifier.json").read_text())
    assert (record["train_rows"], record["test_split"], record["test_rows"]) == (54, "heldout", 6)


@pytest.mark.slow
def test_own_images_are_scored_offline_with_the_classifiers_features(tmp_path, monkeypatch):
    """The README's own-data evaluation without the Inception file: a run on a 60-image folder without a test
    split, its classifier (tools/classifier.py), then eval_fid.py --classifier --features classifier against the
    held-out rows; Inception is never asked for."""
    import eval_fid
    from tools import classifier as classifier_tool

    recipe = class_folder(tmp_path)
    run = fm.main(["--config", str(recipe), "--run_dir", str(tmp_path / "run"), "--data.cache_dir",
                   str(tmp_path / "cache"), "--train.max_steps=1", "--train.batch_size=8", "--val.steps=1",
                   "--val.num_samples=2", "--val.loss_samples=4", "--log.wandb=off", "--log.report=false",
                   "--model.num_layers=1"])
    classifier_tool.main(["--config", str(recipe), "--out", str(tmp_path / "c")])
    monkeypatch.setattr(eval_fid, "inception_features", lambda *a, **k: pytest.fail("Inception was asked for"))
    report = eval_fid.main(["--run", str(run), "--num_samples", "12", "--steps", "1", "--batch_size", "6",
                            "--stats_cache", str(tmp_path / "stats"), "--classifier", str(tmp_path / "c"),
                            "--features", "classifier"])
    assert {"fd_classifier_12", "kd_classifier_12", "class_accuracy_12"} <= set(report["metrics"])
    assert report["reference"]["split"] == "heldout" and report["classifier"]["test_split"] == "heldout"
    assert report["classifier"]["test_rows"] == 6 and report["classifier"]["train_rows"] == 54


# ---- Image modes ----------------------------------------------------------------------------------------

RAMP = np.linspace(0, 1, 16)[None, :].repeat(8, 0)  # content: a horizontal ramp from black to white


def encoded(img, fmt="PNG"):
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return {"bytes": buf.getvalue(), "path": None}


def png16(a):
    """A 16-bit PNG (grey (H, W) or RGB (H, W, 3)), written by hand: Pillow cannot write 16-bit RGB."""
    h, w = a.shape[:2]
    raw = b"".join(b"\0" + a[y].astype(">u2").tobytes() for y in range(h))
    chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data +  # noqa: E731
                                struct.pack(">I", zlib.crc32(kind + data)))
    header = struct.pack(">IIBBBBB", w, h, 16, 2 if a.ndim == 3 else 0, 0, 0, 0)
    return {"bytes": b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) +
            chunk(b"IEND", b""), "path": None}


def grey_of(value):
    rgb = np.asarray(load_image(value)).astype(int)
    assert rgb.shape == (8, 16, 3) and (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()
    return rgb[..., 0]


@pytest.mark.parametrize("name,value", [
    ("I;16 png", png16(np.round(RAMP * 65535).astype(np.uint16))),
    ("16-bit RGB png", png16(np.round(RAMP * 65535).astype(np.uint16)[..., None].repeat(3, 2))),
    ("I;16 tiff", encoded(Image.fromarray(np.round(RAMP * 65535).astype(np.uint16)), "TIFF")),
    ("I 32-bit, 16-bit values", encoded(Image.fromarray(np.round(RAMP * 65535).astype(np.int32)), "TIFF")),
    ("I 32-bit, 8-bit values", encoded(Image.fromarray(np.round(RAMP * 255).astype(np.int32)), "TIFF")),
    ("F in 0..1", encoded(Image.fromarray(RAMP.astype(np.float32)), "TIFF")),
    ("F in 0..255", encoded(Image.fromarray((RAMP * 255).astype(np.float32)), "TIFF")),
    ("L", encoded(Image.fromarray(np.round(RAMP * 255).astype(np.uint8)))),
])
def test_high_depth_grey_modes_keep_their_full_range(name, value):
    assert Image.open(io.BytesIO(value["bytes"])).mode in ("I;16", "I;16B", "I", "F", "RGB", "L")
    np.testing.assert_allclose(grey_of(value), np.round(RAMP * 255), atol=1)  # black to white, not clipped


def test_sixteen_bit_is_scaled_by_its_type_not_by_its_content():
    half = png16(np.round(RAMP * 32767).astype(np.uint16))  # a dark 16-bit image stays dark (not stretched)
    np.testing.assert_allclose(grey_of(half), np.round(RAMP * 32767 / 257), atol=1)


def test_float_and_int_images_out_of_range_are_stretched():
    value = encoded(Image.fromarray((RAMP * 4 - 2).astype(np.float32)), "TIFF")  # -2 .. 2
    np.testing.assert_allclose(grey_of(value), np.round(RAMP * 255), atol=1)
    value = encoded(Image.fromarray((RAMP * 200_000).astype(np.int32)), "TIFF")
    np.testing.assert_allclose(grey_of(value), np.round(RAMP * 255), atol=1)


def test_colour_modes_palette_cmyk_and_alpha():
    rgb = np.zeros((8, 16, 3), np.uint8)
    rgb[:, :8] = (200, 30, 40)
    rgb[:, 8:] = (20, 180, 90)
    out = np.asarray(load_image(encoded(Image.fromarray(rgb).convert("P", palette=Image.ADAPTIVE, colors=4))))
    np.testing.assert_array_equal(out, rgb)  # palette: its colours, exactly
    cmyk = Image.new("CMYK", (16, 8), (0, 255, 255, 0))  # full magenta + yellow = red
    cmyk.paste((255, 0, 0, 0), (8, 0, 16, 8))  # cyan
    out = np.asarray(load_image(encoded(cmyk, "TIFF")))
    np.testing.assert_array_equal(out[0, 0], (255, 0, 0))
    np.testing.assert_array_equal(out[0, 15], (0, 255, 255))
    rgba = np.concatenate([rgb, np.zeros((8, 16, 1), np.uint8)], 2)
    rgba[:, :4, 3], rgba[:, 4:, 3] = 255, 128  # opaque, then half transparent over white
    out = np.asarray(load_image(encoded(Image.fromarray(rgba, "RGBA")))).astype(int)
    np.testing.assert_array_equal(out[:, :4], rgb[:, :4])
    np.testing.assert_allclose(out[:, 8:], (rgb[:, 8:].astype(int) * 128 + 255 * 127) / 255, atol=1)
    alpha = np.full((8, 16), 255, np.uint8)
    alpha[:, 8:] = 0  # the right half transparent: white
    la = Image.fromarray(np.stack([np.round(RAMP * 255).astype(np.uint8), alpha], 2), "LA")
    np.testing.assert_allclose(grey_of(encoded(la))[:, :8], np.round(RAMP * 255)[:, :8], atol=1)
    assert (grey_of(encoded(la))[:, 8:] == 255).all()


# ---- The cache folder every rank must share --------------------------------------------------------------

NODE_LOCAL = '''
import os, sys
sys.path.insert(0, sys.argv[1])
import common, train_flow_matching
from training.data import cache
accelerator = common.make_accelerator("no")
cache.check_cache_shared(sys.argv[2], accelerator)  # one folder that both ranks see: passes
print(f"rank {accelerator.process_index}: shared cache seen", flush=True)
os.chdir(os.path.join(sys.argv[3], f"node{accelerator.process_index}"))  # node-local disks: one path, two folders
train_flow_matching.main(sys.argv[4:])
'''


@pytest.mark.xdist_group("gloo")
@pytest.mark.slow
def test_ranks_that_see_different_cache_folders_stop_at_once_naming_the_key(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT, tiny_run_args

    (tmp_path / "script.py").write_text(NODE_LOCAL)
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    args = [a for a in tiny_run_args(tmp_path) if a != str(tmp_path / "cache")]
    args[args.index("--data.cache_dir") + 1:args.index("--data.cache_dir") + 1] = ["cache"]  # relative: per node
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           str(tmp_path / "script.py"), str(ROOT), str(tmp_path / "shared"), str(tmp_path), *args],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert "rank 0: shared cache seen" in proc.stdout and "rank 1: shared cache seen" in proc.stdout
    assert proc.returncode != 0
    assert "data.cache_dir='cache' is not shared: rank(s) [1] of 2 do not see the marker" in proc.stderr
    assert "node-local disk" in proc.stderr
    assert not list(tmp_path.glob("node*/cache/*/shard_*"))  # it stopped before encoding anything
    assert not list(tmp_path.glob("node*/cache/.rank0_marker_*")) and not list(tmp_path.glob("shared/.rank0_*"))
