"""Config loading, the embedded data, preprocessing and the cache."""

from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from PIL import Image

import common
from training.config import config
from training.data.batching import iterate_batches
from training.data.cache import build_cache
from training.data.cache_shards import CachedDataset
from training.data.encoders import encode_text, load_encoders
from training.data.sources import DEMO_COLORS, load_image, make_demo_dataset, open_splits, preprocess
from training.run import checkpoints
import train_flow_matching as fm


CENTER = config.Config(crop="center", min_crop_scale=0.5, random_flip=False)


def test_demo_data_is_deterministic_and_labelled():
    a, b = make_demo_dataset(18, seed=0), make_demo_dataset(18, seed=0)
    assert a["label"] == b["label"] == [i % 9 for i in range(18)]
    assert (np.asarray(a[5]["image"]) == np.asarray(b[5]["image"])).all()
    assert a[4]["caption"].endswith("green square")  # label 4 = DEMO_CLASSES[4]
    # The shape is drawn in its class colour: the most common non-background colour is the class colour.
    img = torch.from_numpy(np.asarray(a[3]["image"]).reshape(-1, 3).astype(np.int64))
    assert (img == torch.tensor(DEMO_COLORS["green"])).all(1).sum() > 20
    # data.demo_sizes: drawn natively at sides lo .. hi (the shape in proportion), the default images unchanged.
    sized = make_demo_dataset(90, seed=0, sizes=[8, 32])
    sides = [img.size for img in sized["image"]]
    assert all(w == h and 8 <= w <= 32 for w, h in sides) and len(set(sides)) > 10
    assert sized["label"] == [i % 9 for i in range(90)]
    assert (np.asarray(make_demo_dataset(18, seed=0)[5]["image"]) == np.asarray(a[5]["image"])).all()


def test_preprocess_any_mode_and_crop_metadata():
    rgba = Image.new("RGBA", (60, 40), (255, 0, 0, 0))  # fully transparent: composited on white
    x, meta = preprocess(load_image({"bytes": _png(rgba)}), 20, CENTER)
    assert x.shape == (3, 20, 20) and torch.allclose(x, torch.ones_like(x))
    assert meta["orig_hw"].tolist() == [40, 60] and meta["crop_box"].tolist() == [0, 10, 40, 40]
    assert meta["flip"].tolist() == [0]
    for mode in ("L", "P", "CMYK", "I;16"):
        x, _ = preprocess(load_image({"bytes": _png(Image.new(mode, (30, 30)), mode)}), 16, CENTER)
        assert x.shape == (3, 16, 16) and x.min() >= -1 and x.max() <= 1
    with pytest.raises(ValueError, match="data.crop"):
        preprocess(rgba, 20, config.Config(CENTER, crop="middle"))


def _png(img, mode=None):
    import io

    buf = io.BytesIO()
    img.save(buf, format="TIFF" if mode in ("CMYK", "I;16") else "PNG")
    return buf.getvalue()


def test_cache_hit_miss_invalidation_and_resume(tmp_path):
    cfg = config.load_config(fm.DEFAULTS, ["--data.cache_dir", str(tmp_path), "--data.demo_samples=100",
                                           "--data.val_holdout=10", "--data.shard_size=32"])
    accelerator = Accelerator(cpu=True)
    train, val = open_splits(cfg.data)
    assert len(train) == 90 and len(val) == 10
    calls = []

    def encode(pixels, captions):
        calls.append(len(pixels))
        return {"x": pixels}

    folder = build_cache(train, "train", encode, accelerator, cfg)
    probe = 1  # before a build, the size estimate encodes one blank image (encoding.cache_size)
    assert sum(calls) == 90 + probe and len(list(folder.glob("shard_*.safetensors"))) == 3
    ds = CachedDataset(folder)
    row = ds[40]
    assert len(ds) == 90 and row["x"].shape == (3, 16, 16) and row["label"].item() == train[40]["label"]
    x, _ = preprocess(load_image(train[40]["image"]), 16, CENTER)
    torch.testing.assert_close(row["x"], x, atol=4e-3, rtol=0)  # float16 storage
    # Hit: nothing is encoded again.
    calls.clear()
    assert build_cache(train, "train", encode, accelerator, cfg) == folder and not calls
    # A changed key (resolution) is a miss in a new folder, never a silent reuse.
    cfg16 = config.load_config(fm.DEFAULTS, ["--data.cache_dir", str(tmp_path), "--data.demo_samples=100",
                                             "--data.val_holdout=10", "--data.shard_size=32", "--data.resolution=8"])
    folder16 = build_cache(train, "train", encode, accelerator, cfg16)
    assert folder16 != folder and sum(calls) == 90 + probe and CachedDataset(folder16)[0]["x"].shape == (3, 8, 8)
    # An interrupted extraction (no manifest, one shard missing) re-encodes only the missing shard.
    (folder / "manifest.json").unlink()
    (folder / "shard_00001.safetensors").unlink()
    calls.clear()
    build_cache(train, "train", encode, accelerator, cfg)
    assert sum(calls) == 32 + probe and len(CachedDataset(folder)) == 90


def test_iterate_batches_resumes_at_any_micro_batch():
    ds = torch.arange(50)  # indexed with a list of rows, as CachedDataset is
    full = iterate_batches(ds, 0, 4, seed=3, rank=0, world=1, loader_kwargs={})
    seq = [next(full).tolist() for _ in range(30)]  # 12 batches per epoch: crosses two epoch boundaries
    assert sorted(sum(seq[:12], [])) == sorted(set(sum(seq[:12], [])))  # no repeats within an epoch
    assert seq[:12] != seq[12:24]  # a new permutation each epoch
    resumed = iterate_batches(ds, 17, 4, seed=3, rank=0, world=1, loader_kwargs={})
    assert [next(resumed).tolist() for _ in range(13)] == seq[17:]
    # Two ranks see disjoint halves of each epoch.
    r0 = iterate_batches(ds, 0, 4, seed=3, rank=0, world=2, loader_kwargs={})
    r1 = iterate_batches(ds, 0, 4, seed=3, rank=1, world=2, loader_kwargs={})
    a, b = sum([next(r0).tolist() for _ in range(6)], []), sum([next(r1).tolist() for _ in range(6)], [])
    assert not set(a) & set(b) and len(a) == len(b) == 24
    with pytest.raises(ValueError, match="fewer than train.batch_size"):
        next(iterate_batches(ds, 0, 64, 0, 0, 1, {}))


def test_ema_warmup_and_lr():
    model, ema = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        ema.weight.zero_(), ema.bias.zero_(), model.weight.fill_(1.0), model.bias.fill_(1.0)
    common.ema_update(ema, model, 0.999, num_updates=0)  # d = min(0.999, 1/10) = 0.1
    torch.testing.assert_close(ema.weight, torch.full((2, 2), 0.9))
    common.ema_update(ema, model, 0.5, num_updates=1000)  # d = 0.5
    torch.testing.assert_close(ema.weight, torch.full((2, 2), 0.95))
    assert [common.lr_at(s, 1e-4, 4) for s in (0, 1, 3, 100)] == [2.5e-5, 5e-5, 1e-4, 1e-4]


def test_parquet_source_and_label_columns(tmp_path):
    demo = make_demo_dataset(20, seed=0, resolution=16).rename_column("label", "cls")
    demo.to_parquet(str(tmp_path / "part-0.parquet"))
    cfg = config.load_config(fm.DEFAULTS, [f"--data.source={tmp_path}", "--data.val_holdout=4",
                                           "--data.label_column=cls"])
    train, val = open_splits(cfg.data)
    assert len(train) == 16 and len(val) == 4 and sorted(list(train["cls"]) + list(val["cls"])) == sorted(demo["cls"])
    x, _ = preprocess(load_image(train[0]["image"]), 16, CENTER)
    assert x.shape == (3, 16, 16)
    bad = config.load_config(fm.DEFAULTS,
                             [f"--data.source={tmp_path}", "--data.label_column=cls", "--data.caption_column=text"])
    with pytest.raises(ValueError, match="data.caption_column='text' is not a column"):
        open_splits(bad.data)


def test_t5_text_encoder_gives_masked_mean_pooling(tmp_path, tiny_text_encoder):
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=16, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                            num_heads=2)).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_text_encoder).save_pretrained(tmp_path)  # any tokenizer will do
    _, tokenizer, encoder = load_encoders(config.Config(vae=None, text_encoder=str(tmp_path)), "cpu")
    assert type(encoder).__name__ == "T5EncoderModel"
    out = encode_text(tokenizer, encoder, ["a red circle", "a large blue square"], max_tokens=8)
    assert out["text_tokens"].shape == (2, 8, 16) and out["text_mask"].sum(1).tolist() == [5, 6]
    n = int(out["text_mask"][0].sum())
    torch.testing.assert_close(out["text_pooled"][0], out["text_tokens"][0, :n].mean(0))


class RecordingAccelerator:
    """Stands in for an Accelerator at the end of a run: records the calls that close it."""
    is_main_process, num_processes, device = False, 1, torch.device("cpu")

    def __init__(self):
        self.calls = []

    def wait_for_everyone(self):
        self.calls.append("barrier")

    def end_training(self):
        self.calls.append("end_training")

    def print(self, *args):
        pass


def test_a_run_ends_with_a_barrier_before_the_process_group_closes(tmp_path):
    """The barrier before end_training is what keeps a gloo run from aborting at exit (common.end_processes):
    both ways a run ends, the finished run and the requeue, go through it."""
    from training.record.runlog import RunLog

    finished, requeued = RecordingAccelerator(), RecordingAccelerator()
    cfg = config.load_config(fm.DEFAULTS, ["--log.wandb=off"])
    RunLog(cfg, tmp_path, finished).finish(cfg, finished)
    with pytest.raises(SystemExit) as stop:
        common.exit_for_requeue(requeued, 10)
    assert stop.value.code == common.REQUEUE_EXIT_CODE
    assert finished.calls == requeued.calls == ["barrier", "end_training"]


def test_a_first_ctrl_c_stops_like_sigterm_and_a_second_at_once(capfd):
    """Ctrl-C (SIGINT) is recorded as SIGTERM is (the loop stops at its next log step, with a checkpoint, exit 75) and
    said on one line at once; a SIGTERM before it is no first Ctrl-C; the second Ctrl-C raises KeyboardInterrupt,
    which the trainers turn into one line and exit code 130. DataLoader workers ignore it (a terminal sends it to
    the whole process group)."""
    import os
    import signal

    signals = common.StopSignals()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before the next line
    assert signals.received == [signal.SIGTERM, signal.SIGINT]
    assert signals.agreed(RecordingAccelerator()) is True
    err = capfd.readouterr().err
    assert err.count("Ctrl-C") == 2 and err.strip() == common.CTRL_C and "exit code 75" in err
    with pytest.raises(KeyboardInterrupt) as second:
        os.kill(os.getpid(), signal.SIGINT)
    assert common.stopped_at_once(second.value) == 130
    assert capfd.readouterr().err == ("a second Ctrl-C: stopped at once, without a checkpoint; --resume latest "
                                      "continues from the last one\n")
    common.ignore_stop_signals()  # as a DataLoader worker starts
    assert all(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))


def test_a_process_of_a_multi_process_run_leaves_at_once_with_its_exit_code(monkeypatch):
    """After the barrier and end_training, a multi-process run's process leaves with os._exit (no interpreter
    teardown, where gloo's thread can abort): 0 for a finished run, 75 for a requeue."""
    exits = []
    monkeypatch.setattr(common.os, "_exit", lambda code: exits.append(code))
    two = RecordingAccelerator()
    two.num_processes = 2
    common.end_processes(two)
    with pytest.raises(SystemExit):
        common.exit_for_requeue(two, 10)
    assert exits == [0, common.REQUEUE_EXIT_CODE] and two.calls == ["barrier", "end_training"] * 2


def test_the_leak_guard_sees_a_process_group_and_the_tf32_switches(tmp_path):
    """tests/conftest.py's guard (global_state, leaked): a process group left initialised, and each TF32 switch that
    common.make_accelerator sets globally (the test itself puts all back before the guard looks)."""
    import torch.distributed as dist

    from conftest import global_state, leaked, set_tf32_switches, tf32_switches

    before, switches = global_state(), tf32_switches()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert leaked(before, global_state()) == ["a torch.distributed process group left initialised"]
    finally:
        dist.destroy_process_group()
    assert leaked(before, global_state()) == []
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # the legacy switches
    for change in (lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", not matmul),
                   lambda: setattr(torch.backends.cudnn, "allow_tf32", not cudnn),
                   lambda: torch.set_float32_matmul_precision("medium")):  # (the default is "highest")
        try:
            change()
            found = leaked(before, global_state())
            assert len(found) == 1 and found[0].startswith("TF32 switches"), found
        finally:
            set_tf32_switches(switches)
    assert leaked(before, global_state()) == []


# ---- Checkpoints: the layout, loads on the CPU, the intact check on headers ----------------------------------------


class OneProcess:
    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self):
        pass

    def print(self, *args):
        pass


def tiny_checkpoint(tmp_path):
    """A checkpoint of a small model after two Adam steps, written by save_checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)
    for _ in range(2):
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    state = {"step": 2, "config": {"seed": 0}, "class_ids": ["a", "b"]}
    folder = checkpoints.save_checkpoint(OneProcess(), tmp_path, 2,
                                         {"model": model.state_dict(), "ema": model.state_dict()},
                                    optimizer, state, keep=3)
    return folder, model, optimizer


def fresh_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)


def assert_same_optimizer_state(a, b):
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for p in a["state"]:
        assert a["state"][p].keys() == b["state"][p].keys()
        assert all(torch.equal(a["state"][p][k], b["state"][p][k]) for k in a["state"][p]), p


def test_checkpoint_keeps_the_optimizer_apart_and_resumes_old_and_new_layouts(tmp_path):
    folder, model, optimizer = tiny_checkpoint(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["ema.safetensors", "model.safetensors",
                                                        "optimizer.safetensors", "rng_0.pt", "state.pt"]
    small = torch.load(folder / "state.pt", weights_only=True, map_location="cpu")
    assert "optimizer" not in small and small["step"] == 2 and small["class_ids"] == ["a", "b"]
    # The moments come back bitwise, param_groups included; the small state never carries the optimizer.
    resumed, ema = (torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3)) for _ in range(2))
    again = fresh_optimizer(resumed)
    state = checkpoints.load_checkpoint(folder, resumed, ema, again, OneProcess())
    assert "optimizer" not in state and state["step"] == 2
    assert_same_optimizer_state(again.state_dict(), optimizer.state_dict())
    # A checkpoint written before the optimizer had its own file (all of it in state.pt) still resumes.
    torch.save({**small, "optimizer": optimizer.state_dict()}, folder / "state.pt")
    (folder / "optimizer.safetensors").unlink()
    assert checkpoints.checkpoint_ok(folder) and "optimizer" not in checkpoints.read_state(folder)
    old = fresh_optimizer(resumed)
    assert "optimizer" not in checkpoints.load_checkpoint(folder, resumed, ema, old, OneProcess())
    assert_same_optimizer_state(old.state_dict(), optimizer.state_dict())


def test_the_fp16_gradient_scaler_is_checkpointed_and_restored_at_resume_and_rollback(tmp_path):
    """train.mixed_precision=fp16: the loss scale and its growth tracker go into state.pt and come back through the
    load that resume and rollback share. A rollback after a run of non-finite steps gets the checkpoint's scale
    back, not the one the overflows cut (here 2^-6 of it). torch.amp.GradScaler runs on the CPU."""
    model = torch.nn.Linear(8, 1)
    optimizer = fresh_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=4)

    def steps(n, overflow):
        for _ in range(n):
            loss = model(torch.ones(2, 8)).sum() * (float("inf") if overflow else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    steps(2, overflow=True)  # the scale halves twice
    steps(3, overflow=False)  # and counts 3 of the 4 good steps it needs to grow
    saved = scaler.state_dict()
    assert (saved["scale"], saved["_growth_tracker"]) == (2.0 ** 14, 3)
    accelerator = type("FP16Process", (OneProcess,), {"scaler": scaler})()
    folder = checkpoints.save_checkpoint(accelerator, tmp_path, 5,
                                         {"model": model.state_dict(), "ema": model.state_dict()},
                                    optimizer, {"step": 5}, keep=3)
    steps(6, overflow=True)  # a run of non-finite steps: the scale 2^-6 of the checkpoint's
    assert scaler.get_scale() == 2.0 ** 8
    checkpoints.load_checkpoint(folder, model, torch.nn.Linear(8, 1), optimizer, accelerator)  # the rollback's load
    assert scaler.state_dict() == saved and scaler.get_scale() == 2.0 ** 14
    fresh = torch.amp.GradScaler("cpu")  # a resume: a new scaler, not yet used
    checkpoints.load_checkpoint(folder, model, torch.nn.Linear(8, 1), optimizer, type("FP16Process", (OneProcess,),
                                                                                {"scaler": fresh})())
    assert fresh.state_dict() == saved
    steps(1, overflow=False)  # and it goes on as the saved one would: the 4th good step doubles the scale
    assert scaler.get_scale() == 2.0 ** 15


def test_every_rank_must_pick_the_same_checkpoint_at_resume_and_at_every_load(tmp_path, monkeypatch):
    """Each rank picks its checkpoint from the file system alone (a resume's latest, a rollback's last good one).
    One all-gather of the picks (two ranks here: the other rank's pick injected into gather_object) turns a
    file system that shows one rank a checkpoint late into an error naming each rank's pick, before any load."""
    from training.run.start import prepare_model

    folder, model, _ = tiny_checkpoint(tmp_path)
    two_ranks, other = type("TwoRanks", (OneProcess,), {"num_processes": 2})(), []
    monkeypatch.setattr(checkpoints, "gather_object", lambda picks: picks + other)
    resumed, ema = (torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3)) for _ in range(2))
    other[:] = ["step_00000002"]  # the same pick: loads
    assert checkpoints.load_checkpoint(folder, resumed, ema, fresh_optimizer(resumed), two_ranks)["step"] == 2
    other[:] = ["step_00000001"]  # a rollback whose other rank picked an older checkpoint
    monkeypatch.setattr(checkpoints, "load_file", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(RuntimeError, match=r"different checkpoints to load \(rank 0: step_00000002, rank "
                       r"1: step_00000001\)"):
        checkpoints.load_checkpoint(folder, resumed, ema, fresh_optimizer(resumed), two_ranks)
    other[:] = [None]  # a resume whose other rank sees no checkpoint at all (it would start from step 0)
    cfg = config.load_config(fm.DEFAULTS, ["--resume=latest", f"--run_dir={tmp_path}", "--data.num_classes=9",
                                           "--model.num_layers=1", "--model.num_attention_heads=2",
                                           "--model.attention_head_dim=8"])
    with pytest.raises(RuntimeError, match=r"rank 0: step_00000002, rank 1: none"):
        prepare_model(cfg, (3, 16, 16), None, None, tmp_path, two_ranks)


def test_the_intact_checkpoint_check_reads_only_headers_and_the_small_state(tmp_path, monkeypatch):
    import safetensors
    import safetensors.torch

    folder, _, _ = tiny_checkpoint(tmp_path)
    optimizer_file = str(folder / "optimizer.safetensors")
    opened, real_safe_open = [], checkpoints.safe_open
    real_load, real_load_file = torch.load, safetensors.torch.load_file

    class HeadersOnly:  # safe_open that refuses to hand out the optimizer's tensors
        def __init__(self, path, *args, **kwargs):
            self.path, self.f = str(path), real_safe_open(path, *args, **kwargs)
            opened.append(Path(self.path).name)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def __getattr__(self, name):
            if name in ("get_tensor", "get_slice") and self.path == optimizer_file:
                raise AssertionError(f"the intact check read the optimizer's tensors ({name})")
            return getattr(self.f, name)

    def refuse_optimizer(real):
        def load(path, *args, **kwargs):
            assert str(path) != optimizer_file, "the intact check loaded optimizer.safetensors"
            return real(path, *args, **kwargs)
        return load

    monkeypatch.setattr(checkpoints, "safe_open", HeadersOnly)
    monkeypatch.setattr(safetensors, "safe_open", HeadersOnly)
    monkeypatch.setattr(torch, "load", refuse_optimizer(real_load))
    monkeypatch.setattr(safetensors.torch, "load_file", refuse_optimizer(real_load_file))
    monkeypatch.setattr(checkpoints, "load_file", refuse_optimizer(real_load_file))
    assert checkpoints.checkpoint_ok(folder) and checkpoints.find_checkpoint(tmp_path, "latest") == folder
    assert "optimizer.safetensors" in opened  # its header was checked
    # A truncated optimizer file is caught from its header alone; a missing one too.
    data = Path(optimizer_file).read_bytes()
    Path(optimizer_file).write_bytes(data[:-64])
    assert not checkpoints.checkpoint_ok(folder)
    Path(optimizer_file).unlink()
    assert not checkpoints.checkpoint_ok(folder)


# ---- Augmentations under the cache: data.cache_views crops x 2 flips per image, one view per epoch -------------


class ViewRows(torch.utils.data.Dataset):
    """Rows 0 .. n_images * views - 1, an image's views consecutive (as CachedDataset with data.cache_views)."""

    def __init__(self, images, views):
        self.rows, self.views = torch.arange(images * views), views

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, rows):
        return self.rows[rows]


def test_each_epoch_shows_one_view_per_image_every_view_within_v_epochs_and_resumes_exactly():
    ds, views = ViewRows(24, 4), 4
    full = iterate_batches(ds, 0, 4, seed=5, rank=0, world=1, loader_kwargs={})
    epochs = [sum([next(full).tolist() for _ in range(6)], []) for _ in range(8)]  # 6 batches of 4 = 24 images
    for rows in epochs:  # every image once per epoch, under one of its views
        assert sorted(r // views for r in rows) == list(range(24))
    seen = {i: [] for i in range(24)}
    for rows in epochs:
        for r in rows:
            seen[r // views].append(r % views)
    for i, v in seen.items():  # every view within the first 4 epochs, then the same cycle again
        assert sorted(v[:4]) == [0, 1, 2, 3] and v[4:] == v[:4], (i, v)
    assert len({tuple(v) for v in seen.values()}) > 1  # images start their cycles at different views
    flat = sum(epochs, [])
    resumed = iterate_batches(ds, 17, 4, seed=5, rank=0, world=1, loader_kwargs={})
    assert sum([next(resumed).tolist() for _ in range(13)], []) == flat[17 * 4:30 * 4]
    other = iterate_batches(ds, 0, 4, seed=6, rank=0, world=1, loader_kwargs={})
    assert sum([next(other).tolist() for _ in range(6)], []) != epochs[0]


def asymmetric_images(n):
    """Left-right asymmetric images of several sizes: red = the column (0 .. 255 across), green = the row, blue
    marks each image."""
    images = []
    for i in range(n):
        w, h = 40 + 8 * i, 32 + 4 * i
        xs, ys = np.meshgrid(np.linspace(0, 255, w), np.linspace(0, 255, h))
        images.append(Image.fromarray(np.stack([xs, ys, np.full_like(xs, 10 * i)], -1).round().astype(np.uint8)))
    return images


def test_cached_views_hold_several_crops_both_flips_and_metadata_true_to_the_pixels(tmp_path, capsys):
    import datasets

    images = asymmetric_images(5)
    ds = datasets.Dataset.from_dict({"image": images, "label": list(range(5))},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    ds = ds.cast_column("image", datasets.Image(decode=False))
    args = ["--data.cache_dir", str(tmp_path), "--data.crop=random_resized", "--data.min_crop_scale=0.4",
            "--data.random_flip=true", "--data.shard_size=2", "--data.resolution=16", "--data.num_classes=5"]
    cfg = config.load_config(fm.DEFAULTS, args + ["--data.cache_views=3"])
    accelerator = Accelerator(cpu=True)
    folder = build_cache(ds, "train", lambda pixels, captions: {"x": pixels}, accelerator, cfg)
    assert "about 30 samples (3 crops x 2 flips per image)" in capsys.readouterr().out  # the cost, before caching
    cached = CachedDataset(folder)
    assert len(cached) == 5 * 6 and cached.views == 6
    for i, img in enumerate(images):
        rows = cached[list(range(6 * i, 6 * i + 6))]
        assert (rows["label"] == i).all()
        boxes = {tuple(b) for b in rows["crop_box"].tolist()}
        assert len(boxes) == 3 and rows["flip"].flatten().tolist() == [0, 1] * 3
        for x, box, flip in zip(rows["x"], rows["crop_box"].tolist(), rows["flip"].flatten().tolist()):
            top, left, side, _ = box
            expected = img.resize((16, 16), Image.BICUBIC, box=(left, top, left + side, top + side))
            expected = torch.from_numpy(np.asarray(expected, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1
            torch.testing.assert_close(x, expected.flip(-1) if flip else expected, atol=4e-3, rtol=0)
            red = x[0].mean(0)  # the column gradient runs right-to-left exactly when the view is mirrored
            assert (red[-1] < red[0]) == bool(flip)
    # Another view setting is another cache (a miss that names it), never a silent reuse.
    other = build_cache(ds, "train", lambda pixels, captions: {"x": pixels}, accelerator,
                        config.load_config(fm.DEFAULTS, args + ["--data.cache_views=2"]))
    assert other != folder and CachedDataset(other).views == 4
    assert "changed views: [3, True] -> [2, True]" in capsys.readouterr().out
    held_out = build_cache(ds, "val", lambda pixels, captions: {"x": pixels}, accelerator, cfg)
    assert CachedDataset(held_out).views == 1 and len(CachedDataset(held_out)) == 5  # held-out rows: one view
