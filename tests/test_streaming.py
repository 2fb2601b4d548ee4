"""Data at CC12M scale: webdataset tar shards generated here (with broken members) are streamed into the cache
by 1 or 2 processes and 0 or 2 DataLoader workers, hold the same rows either way, resume from finished shards,
size themselves before any work, and train with text encoded on the fly (data.cache_text=false)."""
import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from training.config import config
from training.data import cache
from training.data import encoders
import train_flow_matching as fm
from conftest import DEMO_WORDS, tiny_run_args
from training.data.cache import build_cache
from training.data.cache_shards import CachedDataset
from training.data.encoders import encode_text, make_encode
from training.data.encoding import cache_size, samples_per_shard
from training.data.sources import open_splits
from training.evaluation.reference import heldout

SHARDS, PER_SHARD = 8, 32  # 256 samples
BROKEN = {(1, 5): "jpg", (2, 9): "txt", (4, 0): "empty", (6, 31): "jpg"}  # (shard, index) -> what is wrong


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    """SHARDS tar files of PER_SHARD samples (key.jpg + key.txt) of varied sizes; BROKEN's members are a bad
    JPEG, a missing caption, an empty JPEG."""
    folder, rng = tmp_path_factory.mktemp("wds"), np.random.default_rng(0)
    for s in range(SHARDS):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for i in range(PER_SHARD):
                h, w = (int(v) for v in rng.integers(12, 40, 2))
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
                members = {"jpg": buf.getvalue(), "txt": " ".join(rng.choice(DEMO_WORDS[1:], 3)).encode()}
                broken = BROKEN.get((s, i))
                if broken == "jpg":
                    members["jpg"] = b"not a jpeg"
                elif broken == "empty":
                    members["jpg"] = b""
                elif broken == "txt":
                    del members["txt"]
                for ext, payload in members.items():
                    info = tarfile.TarInfo(f"{s:05d}{i:04d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return str(folder / f"{{00000..{SHARDS - 1:05d}}}.tar")


def stream_args(wds, tmp_path, workers=0, extra=()):
    return ["--data.cache_dir", str(tmp_path / "cache"), "--data.source", wds, "--data.image_column=jpg",
            "--data.caption_column=txt", "--data.label_column=null", "--data.val_shards=[-2,null]",
            "--data.val_holdout=40", "--data.encode_batch_size=8", "--data.crop=random_resized",
            "--data.random_flip=true", f"--data.num_workers={workers}", *extra]


class FakeAccelerator:
    """Rank `rank` of `world` run in this process: build_cache's ranks run one after another, main last."""

    def __init__(self, rank, world):
        self.process_index, self.num_processes = rank, world
        self.is_main_process = self.is_local_main_process = rank == 0

    def print(self, *args):
        print(*args)

    def wait_for_everyone(self):
        pass


def build(cfg, ds, part, world, encode=lambda pixels, captions, text="features": {"x": pixels}):
    for rank in reversed(range(world)):  # rank 0 (which writes the manifest) last
        folder = build_cache(ds, part, encode, FakeAccelerator(rank, world), cfg)
    return folder


def shard_tensors(folder):
    return {p.name: load_file(str(p)) for p in sorted(Path(folder).glob("shard_*.safetensors"))}


def assert_same_shards(a, b):
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys()
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name


@pytest.mark.slow  # about 1.5 s: the fast tier keeps its 60 s on 2 cores
def test_streamed_cache_is_the_same_for_1_and_2_processes_and_workers_and_resumes(wds, tmp_path, capsys):
    cfg1 = config.load_config(fm.DEFAULTS, stream_args(wds, tmp_path / "one", workers=0))
    cfg2 = config.load_config(fm.DEFAULTS, stream_args(wds, tmp_path / "two", workers=2))
    train, _ = open_splits(cfg1.data)
    one, two = build(cfg1, train, "train", 1), build(cfg2, train, "train", 2)
    assert_same_shards(shard_tensors(one), shard_tensors(two))
    # Every usable sample of the 6 training shards exactly once; the broken ones named in the manifest.
    broken_train = [key for key in BROKEN if key[0] < 6]
    assert len(CachedDataset(one)) == (6 * PER_SHARD - len(broken_train)) * 2  # both flips of each image
    skipped = " ".join(json.loads((one / "manifest.json").read_text())["skipped"])
    for s, i in broken_train:
        assert f"{s:05d}{i:04d}" in skipped
    assert "missing caption" in skipped and "UnidentifiedImageError" in skipped and "FileNotFound" not in skipped
    out = capsys.readouterr().out
    assert re.search(r"cache train rank 1: encoded \d+ images, skipped \d+, 3 shards", out)
    # An interrupted build resumes: only the missing shard is encoded again, to the same rows.
    before = shard_tensors(two)
    (two / "shard_00003.safetensors").unlink()
    (two / "manifest.json").unlink()
    build(cfg2, train, "train", 2)
    out = capsys.readouterr().out
    assert "1 of 6 shards to write" in out and "cache train rank 1: encoded 32 images, skipped 0, 1 shards" in out
    assert_same_shards(shard_tensors(two), before)


def test_heldout_rows_are_the_first_of_the_named_shards_for_any_process_count(wds, tmp_path):
    cfg = config.load_config(fm.DEFAULTS, stream_args(wds, tmp_path))
    _, val = open_splits(cfg.data)
    # The first 40 samples of shards 6 and 7, in order (the broken ones among them are skipped in the cache).
    assert val["__key__"] == [f"{6 + n // PER_SHARD:05d}{n % PER_SHARD:04d}" for n in range(40)]
    assert heldout(cfg.data)["__key__"] == val["__key__"]  # eval_fid.py reads the same rows (reference.heldout)
    one = build(config.load_config(fm.DEFAULTS, stream_args(wds, tmp_path / "one")), val, "val", 1)
    two = build(config.load_config(fm.DEFAULTS, stream_args(wds, tmp_path / "two", workers=2)), val, "val", 2)
    assert_same_shards(shard_tensors(one), shard_tensors(two))
    assert len(CachedDataset(one)) == 40 - sum(1 for s, i in BROKEN if 0 <= (s - 6) * PER_SHARD + i < 40)


@pytest.mark.parametrize("args,message", [
    ([], r"data.val_shards=None: a streamed source holds out the source shards \[first, stop\) of its 8"),
    (["--data.val_shards=[0,null]"], "leaving some to train on, e.g. \\[-1, null\\]"),
    (["--data.val_shards=[3,3]"], "data.val_shards=\\[3, 3\\]"),
    (["--data.val_shards=[6,8]", "--data.max_samples=10"], "data.max_samples does not apply to a streamed source"),
    (["--data.val_shards=[6,8]", "--data.caption_column=caption"], r"data.caption_column='caption' is not a column"),
])
def test_bad_stream_configs_are_refused_before_any_work(wds, tmp_path, args, message):
    argv = [a for a in stream_args(wds, tmp_path) if not a.startswith("--data.val_shards")] + args
    with pytest.raises(ValueError, match=message):
        open_splits(config.load_config(fm.DEFAULTS, argv).data)


def write_labelled_shards(folder, labels):
    """Tar shards of key.jpg + key.cls (the webdataset class member), one shard per list of labels."""
    rng = np.random.default_rng(0)
    for s, shard in enumerate(labels):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for i, label in enumerate(shard):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(buf, "JPEG")
                for ext, payload in (("jpg", buf.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{s:05d}{i:04d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return str(folder / f"{{00000..{len(labels) - 1:05d}}}.tar")


def test_streamed_class_labels_are_checked_before_they_are_cached(tmp_path):
    """A stream's labels cannot be read up front: data.num_classes must be given (or named by class ids), the
    held-out rows are checked when they are opened, and a training row whose label is not a class stops the
    cache build at that row, naming it; never cached, never trained on."""
    good = [[0, 1, 2, 0, 1, 2, 0, 1]] * 3
    args = ["--data.image_column=jpg", "--data.label_column=cls", "--data.caption_column=null",
            "--data.val_shards=[-1,null]", "--data.val_holdout=8", "--data.encode_batch_size=4",
            "--data.cache_dir", str(tmp_path / "cache")]
    (tmp_path / "good").mkdir()
    source = write_labelled_shards(tmp_path / "good", good)
    with pytest.raises(ValueError, match="data.num_classes is unset and column 'cls' of the streamed source"):
        open_splits(config.load_config(fm.DEFAULTS, args + ["--data.source", source]).data)
    cfg = config.load_config(fm.DEFAULTS, args + ["--data.source", source, "--data.num_classes=3"])
    train, _ = open_splits(cfg.data)
    assert CachedDataset(build(cfg, train, "train", 1))[list(range(16))]["label"].tolist() == good[0] * 2

    (tmp_path / "bad").mkdir()
    source = write_labelled_shards(tmp_path / "bad", [good[0], [0, 1, 2, 3, 0, 1, 2, 0], good[0]])  # shard 1, row 3
    cfg = config.load_config(fm.DEFAULTS, args + ["--data.source", source, "--data.num_classes=3"])
    train, _ = open_splits(cfg.data)
    with pytest.raises(ValueError, match=r"00001.tar:000010003: label 3 is not a class 0 \.\. 2 \(data.num_classes=3"):
        build(cfg, train, "train", 1)
    # A bad label among the held-out rows (the last shard) is found when they are opened, before any work.
    source = write_labelled_shards(tmp_path / "bad", [good[0], good[0], [0, 1, -1, 0, 1, 2, 0, 1]])
    with pytest.raises(ValueError, match=r"rows 2 \(label -1, 000020002.jpg\)\. The labels found run -1 \.\. 2"):
        open_splits(config.load_config(fm.DEFAULTS, args + ["--data.source", source, "--data.num_classes=3"]).data)


@pytest.mark.parametrize("cache_text", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_size_estimate_matches_the_written_cache(wds, tmp_path, tiny_vae, tiny_text_encoder, cache_text, capsys):
    cfg = config.load_config(fm.DEFAULTS, stream_args(wds, tmp_path, extra=[
        "--encoders.vae", tiny_vae, "--encoders.text_encoder", tiny_text_encoder, "--encoders.max_tokens=8",
        "--data.resolution=16", f"--data.cache_text={str(cache_text).lower()}", "--data.val_shards=[2,8]",
        "--data.encode_batch_size=32", "--data.random_flip=false"]))  # one view per image: rows = samples
    vae, tokenizer, text_encoder = encoders.load_encoders(cfg.encoders, torch.device("cpu"))
    encode = make_encode(vae, tokenizer, text_encoder, cfg.encoders.max_tokens)
    train, _ = open_splits(cfg.data)
    text = "features" if cache_text else "tokens"
    rows = samples_per_shard(train, [0, 1], cfg.data.shard_size)  # shard 1 has a broken member
    per_row, estimate = cache_size(encode, cfg.data, text, list(rows.values()))
    folder = build(cfg, train, "train", 1, encode)
    written = sum(p.stat().st_size for p in folder.glob("shard_*.safetensors"))
    assert abs(estimate - written) / written < 0.05, (estimate, written)
    one_shard = cache_size(encode, cfg.data, text, [PER_SHARD])[1]  # shard 0 has no broken member: its size,
    assert abs(one_shard - (folder / "shard_00000.safetensors").stat().st_size) < 64  # header and all
    assert f"about {2 * PER_SHARD} samples x {per_row} bytes" in capsys.readouterr().out
    keys = CachedDataset(folder).keys
    assert ("text_tokens" in keys) == cache_text and ("input_ids" in keys) == (not cache_text)


def test_a_cache_that_cannot_fit_is_refused_before_any_work(wds, tmp_path, monkeypatch):
    cfg = config.load_config(fm.DEFAULTS, stream_args(wds, tmp_path))
    train, _ = open_splits(cfg.data)
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(SystemExit, match=r"data.cache_dir='.*' has 1.0 KB free, the train cache needs about"):
        build(cfg, train, "train", 1)
    assert not list((tmp_path / "cache").glob("*/shard_*"))


def test_text_features_at_each_step_equal_the_cached_features(tiny_text_encoder):
    # data.cache_text=false: token ids from the cache, encoded at the step, give what encode_text would have cached.
    _, tokenizer, encoder = encoders.load_encoders(config.Config({"vae": None, "text_encoder": tiny_text_encoder}),
                                                      torch.device("cpu"))
    captions = ["a small red circle", "large blue", "green square triangle a"]
    encode = make_encode(None, tokenizer, encoder, 8)
    tokens = encode(torch.zeros(3, 3, 4, 4), captions, text="tokens")
    assert tokens["input_ids"].dtype == torch.int32 and tokens["attention_mask"].dtype == torch.uint8
    batch = encoders.text_features({"x": tokens["x"], "input_ids": tokens["input_ids"],
                                       "attention_mask": tokens["attention_mask"]}, encoder)
    expected = encode_text(tokenizer, encoder, captions, 8)
    assert "input_ids" not in batch and set(expected) <= set(batch)
    for name in expected:
        assert torch.equal(batch[name], expected[name]), name


@pytest.mark.slow
def test_stream_with_cache_text_false_trains_and_samples(wds, tmp_path, tiny_text_encoder):
    run = fm.main(tiny_run_args(tmp_path, "lean", steps=3) + stream_args(wds, tmp_path, workers=2) + [
        "--encoders.text_encoder", tiny_text_encoder, "--encoders.max_tokens=8", "--data.cache_text=false",
        "--data.resolution=8", "--train.batch_size=8", "--conditioning.replicate_padding=false"])
    train_cache = next((tmp_path / "cache").glob("*-train-*"))
    assert {"input_ids", "attention_mask"} <= set(CachedDataset(train_cache).keys)
    assert list((run / "samples").glob("*.png")) and (run / "export" / "transformer").exists()
    losses = [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert losses and all(np.isfinite(losses))


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_exact_resume_on_a_streamed_cache(wds, tmp_path, tiny_text_encoder, processes):
    from test_robustness import assert_same_checkpoint, launch

    def args(name, steps):
        return tiny_run_args(tmp_path, name, steps) + stream_args(wds, tmp_path, workers=2) + [
            "--encoders.text_encoder", tiny_text_encoder, "--encoders.max_tokens=8", "--data.cache_text=false",
            "--data.resolution=8", "--train.batch_size=8", "--train.grad_accum=2", "--log.every=1", "--ckpt.every=2"]
    launch(args("straight", 4), processes, tmp_path)  # builds the cache with `processes` ranks, 2 workers each
    launch(args("resumed", 2), processes, tmp_path)
    launch(args("resumed", 4) + ["--resume=latest"], processes, tmp_path)
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "resumed", 4)
    # The cache those ranks wrote holds the same rows as one built here by one process without workers.
    cfg = config.load_config(fm.DEFAULTS, args("here", 1) + ["--data.cache_dir", str(tmp_path / "here"),
                                                             "--data.num_workers=0"])
    _, tokenizer, text_encoder = encoders.load_encoders(cfg.encoders, torch.device("cpu"))
    train, _ = open_splits(cfg.data)
    here = build(cfg, train, "train", 1, make_encode(None, tokenizer, text_encoder, 8))
    assert_same_shards(shard_tensors(here), shard_tensors(next((tmp_path / "cache").glob("*-train-*"))))
