"""Aspect-ratio buckets (data.buckets; training/data/buckets.py): the shapes are diffusers' rule; odd sizes (tiny, huge,
1:4) go to the nearest bucket in log aspect ratio and are cropped to it; micro-batches hold one bucket each, every
image comes once an epoch, a resumed run continues the same order, ranks take disjoint slices; a bucket smaller than
a global batch is merged into its neighbours and the table says so; the cache holds each image at its bucket's shape
(the pixels are PIL's crop of the image) and a changed bucket list is another cache; the loader refuses what cannot
work; a non-square run trains, resumes exactly, samples at two shapes, and its export samples non-square with
diffusers alone as sample.py does."""
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from PIL import Image

import eval_fid
import sample
import train_flow_matching as fm
from conftest import ROOT, TINY_MODEL
from training.config import config
from training.data import buckets
from training.data.batching import bucket_order, iterate_batches, same_bucket
from training.data.cache import build_cache
from training.data.cache_shards import CachedDataset
from training.data.sources import preprocess
from training.evaluation import generation, reference
from training.record import runlog


def test_the_shapes_are_diffusers_ladder_and_each_side_a_multiple():
    from diffusers.training_utils import generate_aspect_ratio_buckets

    for resolution, multiple in ((256, 16), (1024, 16), (28, 4)):
        ours = buckets.shapes_for("auto", resolution, multiple)
        assert sorted(ours) == sorted((w, h) for h, w in generate_aspect_ratio_buckets(resolution, multiple))
        assert all(w % multiple == 0 and h % multiple == 0 for w, h in ours)
        assert [w / h for w, h in ours] == sorted(w / h for w, h in ours)  # tallest first
    assert buckets.shapes_for([0.5, 1, 2], 28, 4) == [(20, 40), (28, 28), (40, 20)]


def test_odd_sizes_tiny_huge_and_one_to_four_go_to_the_nearest_bucket_and_are_cropped_to_it():
    shapes = buckets.shapes_for([0.5, 1, 2], 32, 2)  # 22x46, 32x32, 46x22
    sizes = np.array([[2, 2], [100_000, 10], [100, 400], [400, 100], [1, 1], [-1, -1], [33, 48], [48, 33]])
    where = buckets.nearest(np.maximum(sizes, 1), shapes).tolist()
    assert where[:4] == [1, 2, 0, 2]  # tiny: square; huge 10000:1: the widest; 1:4 and 4:1: the tallest and widest
    # log aspect ratio: an image and its mirror (w and h swapped) go to mirrored buckets ( |w/h - r| would send
    # 48x33 (1.45) to the square and 33x48 (0.69) to 1:2)
    assert where[6] == 0 and where[7] == 2
    for (w, h), k in zip(sizes[:4], where[:4]):
        box_w, box_h = buckets.crop_extent(int(w), int(h), *shapes[k])
        assert box_w <= w and box_h <= h and (box_w == w or box_h == h)  # inside; the whole of one side
        assert abs(box_w / box_h - shapes[k][0] / shapes[k][1]) <= 1 / min(box_w, box_h) + 1e-9  # the bucket's aspect
    assert buckets.crop_extent(100_000, 10, 46, 22) == (21, 10)
    kept, fate = buckets.merge_small(shapes, sizes, batch=1, min_side=2)
    lines = "\n".join(buckets.table(kept, sizes, fate, 1, min_side=2))
    assert "1 unreadable, 1 below data.min_image_side=2 px" in lines  # 1x1 and the broken row: said, not dropped
    square = next(line for line in lines.splitlines() if line.split()[0] == "32x32").split()
    assert square[2:6] == ["1", "16.7%", "1", "0"]  # the 2x2 image (1 of the 6 in buckets): upscaled, and said
    wide = next(line for line in lines.splitlines() if line.split()[0] == "46x22").split()
    assert wide[2] == "3" and wide[5] == "1"  # 10000:1 loses more than half its area to the crop (4:1 keeps 52%)
    # preprocess crops the box of the bucket's aspect (centred) and resizes it to the bucket, metadata true to it
    data = SimpleNamespace(crop="center", random_flip=False)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (100, 400, 3), dtype=np.uint8))
    x, meta = preprocess(img, 32, data, shape=(46, 22))
    # 209 = 100 x 46/22
    assert meta["crop_box"].tolist() == [0, 95, 100, 209] and meta["orig_hw"].tolist() == [100, 400]
    expected = img.resize((46, 22), Image.BICUBIC, box=(95, 0, 95 + 209, 100))
    assert torch.equal(x, torch.from_numpy(np.asarray(expected, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1)


class BucketRows:
    """A cache's rows as iterate_batches reads them: `dataset[list of rows]`, each image's bucket, V views a row."""

    def __init__(self, counts, views=1):
        self.buckets = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts)).repeat_interleave(views)
        self.rows, self.views = torch.arange(len(self.buckets)), views

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, rows):
        return self.rows[rows]


def micro_batches(ds, start, n, batch, rank=0, world=1, seed=3):
    it = iterate_batches(ds, start, batch, seed=seed, rank=rank, world=world, loader_kwargs={})
    return [next(it).tolist() for _ in range(n)]


def test_batches_hold_one_bucket_every_image_once_an_epoch_same_after_resume_disjoint_across_ranks():
    ds = BucketRows([13, 8, 20])  # a global micro-batch of 4 x 2 ranks: 2 + 1 + 3 = 6 an epoch
    per_epoch = len(bucket_order(ds.buckets, 8, 3, 0))
    assert per_epoch == 6
    ranks = [micro_batches(ds, 0, 3 * per_epoch, 4, rank, 2) for rank in range(2)]
    for j, (a, b) in enumerate(zip(*ranks)):
        both = a + b
        assert len(set(ds.buckets[both].tolist())) == 1, j  # one bucket per micro-batch, on every rank
        assert not set(a) & set(b), j  # the ranks' slices are disjoint
    for e in range(3):
        seen = sum((a + b for a, b in list(zip(*ranks))[e * per_epoch:(e + 1) * per_epoch]), [])
        assert sorted(set(seen)) == list(range(41))  # every image, every epoch
        assert len(seen) - 41 == (-13 % 8) + (-20 % 8)  # only the buckets' last micro-batches repeat images
        assert max(seen.count(i) for i in seen) == 2
    assert ranks[0][:per_epoch] != ranks[0][per_epoch:2 * per_epoch]  # another order each epoch
    for rank in range(2):  # resumed at any micro-batch: the same data, on each rank
        assert micro_batches(ds, 7, 11, 4, rank, 2) == ranks[rank][7:]
    # views: one view of each image an epoch, as without buckets
    views = BucketRows([6, 10], views=2)
    rows = sum(micro_batches(views, 0, 5, 4), [])  # 2 + 3 micro-batches an epoch
    assert sorted({r // 2 for r in rows}) == list(range(16)) and all(views.buckets[r] == views.buckets[r // 2 * 2]
                                                                        for r in rows)
    assert same_bucket(ds, [0, 20, 1, 40, 14], 2) == [[0, 1], [20, 14], [40]]  # held-out rows: batches of one bucket


@pytest.mark.slow
def test_a_bucket_smaller_than_a_global_batch_is_merged_into_its_neighbours(tmp_path, capsys):
    import datasets

    sizes = [(48, 24)] * 3 + [(24, 48)] * 12 + [(32, 32)] * 12 + [(60, 24)] * 2  # 2:1 holds 3 + 2 < 8 images
    images = [Image.new("RGB", s, (i, 0, 0)) for i, s in enumerate(sizes)]
    ds = datasets.Dataset.from_dict({"image": images, "label": [0] * len(images)},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    ds = ds.cast_column("image", datasets.Image(decode=False))
    cfg = config.load_config(fm.DEFAULTS, ["--data.resolution=32", "--data.buckets=[0.5,1,2]", "--data.num_classes=1",
                                           "--train.batch_size=4", "--train.grad_accum=2",
                                           "--data.cache_dir", str(tmp_path)])
    buckets.resolve(cfg, ds, Accelerator(cpu=True))
    out = capsys.readouterr().out
    assert cfg.data.bucket_shapes == [[22, 46], [32, 32]]  # 46x22 is gone: its 5 images went to the square
    assert "46x22  2.09: 5 images, fewer than a global batch of 8: merged into 32x32 (5)" in out
    # nothing dropped: 12 + 5 = 17, the 5 cropped square and upscaled (24 px short sides), the 60x24 ones lose 60%
    assert "32x32  1.00      17  58.6%        5        2   16%" in out  # lost: (3 x 50% + 2 x 60%) / 17 of the area
    assert "5 micro-batches of 4, the last filled with 3 of its images seen again" in out
    # The merged images are cached in the square bucket, cropped square.
    cached = CachedDataset(build_cache(ds, "train", lambda pixels, captions: {"x": pixels}, Accelerator(cpu=True), cfg))
    assert len(cached) == len(images) and cached.buckets.bincount().tolist() == [12, 17]
    # What is left after merging holds a global batch, unless the whole data is smaller than one micro-batch: refused.
    with pytest.raises(ValueError, match="the dataset has 3 samples, fewer than train.batch_size"):
        micro_batches(BucketRows([3]), 0, 1, 4)


def image_rows(sizes):
    import datasets

    ds = datasets.Dataset.from_dict({"image": [Image.new("RGB", s) for s in sizes], "label": [0] * len(sizes)},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    return ds.cast_column("image", datasets.Image(decode=False))


@pytest.mark.slow
def test_the_heldout_images_crops_are_counted_beside_the_training_images(capsys):
    """The held-out rows (validation's, and eval_fid.py's reference images) are cropped to their nearest kept bucket
    too, so the start-up prints their table: here the square bucket merged into 22x46 (3 images under a global batch
    of 8), so the two held-out squares lose 53% of their area each (a 15 x 32 box of 32 x 32) and are upscaled, a 4:1
    panorama in 46x22 loses 48% (a 209 x 100 box of 400 x 100) and a 48 x 24 image 4% (one row): by hand."""
    cfg = config.load_config(fm.DEFAULTS, ["--data.resolution=32", "--data.buckets=[0.5,1,2]", "--data.num_classes=1",
                                           "--train.batch_size=4", "--train.grad_accum=2"])
    train = image_rows([(24, 48)] * 12 + [(48, 24)] * 12 + [(32, 32)] * 3)
    buckets.resolve(cfg, train, Accelerator(cpu=True), image_rows([(32, 32)] * 2 + [(400, 100), (48, 24)]))
    out = capsys.readouterr().out
    assert cfg.data.bucket_shapes == [[22, 46], [46, 22]]
    # (12 x 4% + 3 x 53%) / 15
    assert "22x46  0.48      15  55.6%        3        3   14%  1.9 global batches of 8" in out
    held = out[out.index("held-out images (the hold-out"):].splitlines()
    assert held[0].endswith(": 4, each cropped to its nearest kept bucket")
    assert held[2].split() == ["22x46", "0.48", "2", "50.0%", "2", "2", "53%"]
    assert held[3].split() == ["46x22", "2.09", "2", "50.0%", "0", "0", "26%"]  # (48% + 4%) / 2


def test_the_cache_holds_each_image_at_its_bucket_and_a_changed_bucket_list_is_another_cache(tmp_path, capsys):
    import datasets

    rng = np.random.default_rng(0)
    sizes = [(64, 30), (30, 64), (40, 40), (70, 30), (30, 70), (45, 40)] * 2
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    ds = datasets.Dataset.from_dict({"image": images, "label": list(range(len(images)))},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    ds = ds.cast_column("image", datasets.Image(decode=False))
    args = ["--data.cache_dir", str(tmp_path), "--data.resolution=16", "--data.num_classes=12", "--data.crop=random",
            "--data.random_flip=true", "--data.cache_views=2", "--data.shard_size=5", "--train.batch_size=1"]
    accelerator, encode = Accelerator(cpu=True), (lambda pixels, captions: {"x": pixels})
    cfg = config.load_config(fm.DEFAULTS, args + ["--data.buckets=[0.5,1,2]"])
    buckets.resolve(cfg, ds, accelerator)
    folder = build_cache(ds, "train", encode, accelerator, cfg)
    cached = CachedDataset(folder)
    assert len(cached) == 12 * 4 and cached.views == 4 and cached.shapes == [[12, 22], [16, 16], [22, 12]]
    assert cached.x_shape == (3, 22, 22)  # the positional grid covers the largest side
    for r in range(0, len(cached), 4):  # an image's 4 views: consecutive rows of one bucket
        rows = cached[list(range(r, r + 4))]
        i = int(rows["label"][0])
        (w, h), img = cached.shapes[int(cached.buckets[r])], images[i]
        assert (rows["label"] == i).all() and rows["x"].shape == (4, 3, h, w)
        assert int(cached.buckets[r]) == buckets.nearest([img.size], cached.shapes)[0]
        assert rows["flip"].flatten().tolist() == [0, 1, 0, 1]
        for x, (top, left, box_h, box_w), flip in zip(rows["x"], rows["crop_box"].tolist(), rows["flip"].flatten()):
            assert (box_w, box_h) == buckets.crop_extent(*img.size, w, h)
            expected = img.resize((w, h), Image.BICUBIC, box=(left, top, left + box_w, top + box_h))
            expected = torch.from_numpy(np.asarray(expected, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1
            torch.testing.assert_close(x, expected.flip(-1) if flip else expected, atol=4e-3, rtol=0)
    with pytest.raises(ValueError, match="rows of buckets"):
        cached[list(range(len(cached)))]  # a batch holds one bucket
    capsys.readouterr()
    # Another bucket list is another cache, whose miss names it; the first is a hit again.
    other = config.load_config(fm.DEFAULTS, args + ["--data.buckets=[0.5,1]"])
    buckets.resolve(other, ds, accelerator)
    assert build_cache(ds, "train", encode, accelerator, other) != folder
    assert "changed buckets: [[12, 22], [16, 16], [22, 12]] -> [[12, 22], [16, 16]]" in capsys.readouterr().out
    assert CachedDataset(build_cache(ds, "train", encode, accelerator, other)).shapes == [[12, 22], [16, 16]]
    assert build_cache(ds, "train", encode, accelerator, cfg) == folder and "cache hit" in capsys.readouterr().out


class HeldOutBuckets:
    """A bucket cache's held-out rows as validation reads them: `val_set[list of rows]` of one bucket, with buckets
    and shapes (width, height)."""

    def __init__(self, buckets_of_rows, shapes):
        self.buckets, self.shapes = torch.tensor(buckets_of_rows), shapes

    def __getitem__(self, rows):
        w, h = self.shapes[int(self.buckets[rows[0]])]
        return {"x": torch.zeros(len(rows), 3, h, w), "label": torch.zeros(len(rows), dtype=torch.long)}


@pytest.mark.parametrize("present,num_samples,cells", [([0, 1, 2], 9, [3, 3, 3]), ([0, 1, 2], 7, [3, 2, 2]),
                                                        ([0, 2], 9, [5, 4]), ([0, 1, 2], 2, [1, 1])])
def test_the_validation_grid_has_val_num_samples_cells_a_row_a_bucket(tmp_path, present, num_samples, cells):
    """A bucket run's validation grid: the squarest, widest and tallest buckets with held-out rows (up to three), a row
    each, val.num_samples cells in all (9 in 2 buckets: 5 + 4, not 10), each bucket's cells classes 0, 1, 2, ... at
    its shape; a shorter row ends in blank cells, so every row is one bucket, and the labels file names each sample's
    row and column and no blank cell."""
    from training.evaluation.validation import validation_inputs

    shapes = [[12, 22], [16, 16], [22, 12]]
    val_set = HeldOutBuckets([b for b in present for _ in range(2)], shapes)
    noise, cond = validation_inputs(val_set, num_samples, 10, (3, 22, 22), 0, "cpu")
    assert [len(n) for n in noise] == cells and [c["label"].tolist() for c in cond] == [list(range(n)) for n in cells]
    labels = [f"class {k}" for k in range(num_samples)]
    runlog.RunLog.samples(SimpleNamespace(run_dir=tmp_path, wandb=None), [n.clamp(-1, 1) for n in noise], 1, labels)
    lines = (tmp_path / "samples" / "step_00000001.txt").read_text().splitlines()
    assert len(lines) == num_samples
    for row, (n, x) in enumerate(zip(cells, noise)):
        mine = [line.split("\t") for line in lines if line.split("\t")[1].startswith(f"row {row + 1},")]
        assert [m[1] for m in mine] == [f"row {row + 1}, column {c + 1}" for c in range(n)]
        assert [m[2] for m in mine] == [f"{x.shape[-1]}x{x.shape[-2]}: class {c}" for c in range(n)]
    w, h = max(x.shape[-1] for x in noise), max(x.shape[-2] for x in noise)  # every cell: the largest sides
    factor = -(-64 // min(w, h))  # small cells enlarged to be seen
    assert Image.open(tmp_path / "samples" / "step_00000001.png").width == (max(cells) * (w + 2) + 2) * factor


def test_the_loader_refuses_what_buckets_cannot_do(tmp_path):
    base = ["--data.buckets=[0.5,1,2]", "--run_dir", str(tmp_path / "run")]
    for extra, says in ((["--objective.repa_weight=0.5"], "REPA's targets are one square grid"),
                        (["--data.source=/data/{00000..00002}.tar", "--data.val_shards=[-1,null]"], "not a stream"),
                        (["--val.fid_every=10"], "val.fid_every scores square samples")):
        with pytest.raises(config.ConfigError, match=says):
            config.load_config(fm.DEFAULTS, base + extra, method="flow_matching", schema=fm.CONFIG)
    with pytest.raises(config.ConfigError, match="data.buckets"):
        config.load_config(fm.DEFAULTS, ["--data.buckets=[0]"], method="flow_matching", schema=fm.CONFIG)



def test_a_sampling_shape_that_means_nothing_is_refused_in_one_line():
    """sample.py / eval_fid.py's --aspect_ratio and --width / --height (buckets.shape_arg): a square run has no bucket
    to pick (its one "nearest" shape, a square, would come back for 2:1 without a word), and a ratio or side that is
    not a positive number is refused, not sent to the tallest bucket or to the sampler."""
    square = {"data": {"resolution": 16}}
    bucketed = {"data": {"resolution": 16, "bucket_shapes": [[12, 22], [16, 16], [22, 12]]}}
    assert buckets.shape_arg(bucketed, aspect_ratio="2:1") == (22, 12)
    assert buckets.shape_arg(bucketed, aspect_ratio="0.5") == (12, 22)
    assert buckets.shape_arg(square) == (16, 16) and buckets.shape_arg(square, 8, 12) == (8, 12)
    with pytest.raises(config.ConfigError, match="trained square at 16x16 px: give --width and --height"):
        buckets.shape_arg(square, aspect_ratio="2:1")
    for ratio in ("0", "-2", "3:0", "wide"):
        with pytest.raises(config.ConfigError, match="a width / height above 0"):
            buckets.shape_arg(bucketed, aspect_ratio=ratio)
    with pytest.raises(config.ConfigError, match="each at least 1"):
        buckets.shape_arg(bucketed, 0, 16)


MERGED = {"data": {"resolution": 16, "buckets": "auto", "bucket_shapes": [[12, 18], [18, 12]]}}  # the square merged


def test_the_shape_sampled_is_said_with_its_bucket_and_why():
    """buckets.shape_note, sample.py's line: a run with data.buckets=auto whose square bucket was merged away keeps
    12x18 and 18x12, so --aspect_ratio 1:1 gets a 3:2 or 2:3 bucket: the line names it width x height and says the
    run kept no 1:1 bucket; a ratio whose bucket is there, the default and --width / --height (a bucket or not) are
    said without that clause; a square run at its square says nothing."""
    said = buckets.shape_note(MERGED, buckets.shape_arg(MERGED, aspect_ratio="1:1"), aspect_ratio="1:1")
    assert said.startswith("sampling the bucket 18x12 (width x height, aspect 1.50): of this run's buckets (12x18, "
                           "18x12) the nearest to --aspect_ratio 1:1; it kept no bucket for data.buckets' 1 (merged")
    said = buckets.shape_note(MERGED, (12, 18), aspect_ratio="2:3")
    assert "nearest to --aspect_ratio 2:3" in said and "kept no bucket" not in said
    listed = {"data": {**MERGED["data"], "buckets": [0.5, 1, 1.5]}}  # data.buckets as a list: the same reading
    assert "kept no bucket for data.buckets' 1 (" in buckets.shape_note(listed, (18, 12), aspect_ratio="1")
    assert "kept no bucket" not in buckets.shape_note(listed, (18, 12), aspect_ratio="1.4")
    assert "the squarest of this run's buckets (12x18, 18x12)" in buckets.shape_note(MERGED, (18, 12))
    assert buckets.shape_note(MERGED, (12, 18), 12, 18).endswith("as --width and --height give: one of this run's "
                                                                  "buckets (12x18, 18x12)")
    assert "a shape it was not trained at" in buckets.shape_note(MERGED, (16, 16), 16, 16)
    assert buckets.shape_note({"data": {"resolution": 16}}, (16, 16)) is None
    assert "trained square at 16 px" in buckets.shape_note({"data": {"resolution": 16}}, (16, 8), 16, 8)


@pytest.mark.slow
def test_sample_says_which_bucket_it_samples_and_records_width_and_height_by_name(tmp_path, capsys):
    """sample.py --aspect_ratio 1:1 on that run (an untrained export): images of the bucket its line names, which
    sample.json records as width and height by name, beside the line."""
    from training.model.mmdit import build_denoiser
    from training.sharing import pipeline_export

    cfg = config.load_config(fm.DEFAULTS, [*TINY_MODEL, "--model.num_layers=1", "--data.resolution=16",
                                           "--data.num_classes=2", "--data.buckets=auto", "--run_dir",
                                           str(tmp_path / "run")])
    cfg.data.bucket_shapes = MERGED["data"]["bucket_shapes"]
    cfg = json.loads(json.dumps(cfg))
    (tmp_path / "run").mkdir()
    pipeline_export.write(build_denoiser(cfg, 3, 18).eval(), cfg, tmp_path / "run" / "export", run_dir=tmp_path / "run")
    capsys.readouterr()
    out = sample.main(["--run", str(tmp_path / "run"), "--classes", "0", "--per_class", "1", "--steps", "1",
                       "--aspect_ratio", "1:1", "--out", str(tmp_path / "out")])
    said = [line for line in capsys.readouterr().out.splitlines() if "(width x height" in line]
    settings = json.loads((out / "sample.json").read_text())
    assert len(said) == 1 and settings["shape_chosen"] == said[0] and "kept no bucket for data.buckets' 1" in said[0]
    assert said[0].startswith(f"sampling the bucket {settings['width']}x{settings['height']} (width x height")
    png = np.asarray(Image.open(next(out.glob("0000_*.png"))))
    assert png.shape[:2] == (settings["height"], settings["width"]) and "shape" not in settings


def test_eval_fid_refuses_a_square_reference_for_a_non_square_bucket():
    """clean-fid's named statistics are of square images: scoring a 22 x 12 bucket against them counts the shape as
    a difference, so reference.scored_bucket refuses it before loading anything; a square bucket may use them, and
    a statistics file (one shape, no images to count) is taken at the bucket asked for."""
    bucketed = {"data": {"resolution": 16, "bucket_shapes": [[12, 22], [16, 16], [22, 12]]}}
    args = SimpleNamespace(run="RUN", width=22, height=12, aspect_ratio=None, reference="cleanfid:cifar10:32:train")
    with pytest.raises(config.ConfigError, match="--reference cleanfid:cifar10:32:train: .* square images.*22x12"):
        reference.scored_bucket(bucketed, args)
    square, npz = (SimpleNamespace(**{**vars(args), **change}) for change in ({"width": 16, "height": 16},
                                                                              {"reference": "s.npz"}))
    assert reference.scored_bucket(bucketed, square) == ((16, 16), None)
    assert reference.scored_bucket(bucketed, npz) == ((22, 12), None)


def bucket_reference(args, cfg, shape=None):
    """A reference's key at `shape` (args as eval_fid.py's with a bucket run's cfg)."""
    return reference.reference_key(SimpleNamespace(**{**vars(args), "shape": shape}), cfg, "f")


def test_eval_fid_scores_the_bucket_with_the_most_reference_images_and_a_folder_by_its_buckets(tmp_path):
    """Issue 68: the default bucket was the squarest, even with one reference image (a traceback followed), and
    --reference FOLDER scored the folder's images of every shape at any bucket. Now the default is the bucket with
    the most reference images, a bucket with fewer than 2 is refused in one line naming each bucket's count (but
    for --generate_only, which scores nothing), and a folder reference at a bucket is its images of that bucket,
    each cropped to it as the cache crops them."""
    folder = tmp_path / "real"
    folder.mkdir()
    for i, size in enumerate([(16, 16)] + [(32, 16)] * 5 + [(16, 32)] * 2):  # 1 square, 5 wide, 2 tall
        Image.new("RGB", size, (30 * i, 90, 200)).save(folder / f"{i}.png")
    cfg = config.load_config(fm.DEFAULTS, ["--data.resolution=16", f"--data.source={tmp_path / 'own'}"])
    cfg.data.bucket_shapes = [[12, 22], [16, 16], [22, 12]]
    args = eval_fid.parse_args(["--run", "RUN", "--reference", str(folder)])
    assert reference.bucket_counts(args, cfg) == {(12, 22): 2, (16, 16): 1, (22, 12): 5}
    shape, note = reference.scored_bucket(cfg, args)
    assert shape == (22, 12) and "12x22: 2, 16x16: 1, 22x12: 5" in note
    images = [load() for load in reference.reference_images(bucket_reference(args, cfg, shape), cfg)]
    assert [img.shape for img in images] == [(12, 22, 3)] * 5  # the 5 wide ones, cropped to the bucket
    wide = np.asarray(Image.open(folder / "1.png").convert("RGB"))
    x, _ = preprocess(Image.fromarray(wide), 16, config.Config({**cfg.data, "random_flip": False}), shape=(22, 12))
    assert np.array_equal(images[0], reference.to_uint8(x[None])[0])  # as the cache crops it
    square = eval_fid.parse_args(["--run", "RUN", "--reference", str(folder), "--width", "16", "--height", "16"])
    with pytest.raises(config.ConfigError, match=r"the 16x16 bucket has 1 reference image\(s\) \(of each bucket: "
                                                 r"12x22: 2, 16x16: 1, 22x12: 5\): FD needs at least 2") as e:
        reference.scored_bucket(cfg, square)
    assert "\n" not in str(e.value)
    square.generate_only = True  # nothing is scored: the samples are made
    assert reference.scored_bucket(cfg, square) == ((16, 16), None)
    for f in list(folder.glob("*.png"))[2:]:
        f.unlink()
    with pytest.raises(config.ConfigError, match="FD needs at least 2.*--reference FOLDER"):
        reference.scored_bucket(cfg, args)  # no bucket has two: one line, not a traceback
    square_run = {"data": {"resolution": 16, "bucket_shapes": None}}
    assert reference.scored_bucket(square_run, args) == (None, None)


def test_a_bucket_runs_default_reference_counts_the_held_out_rows_of_each_bucket(tmp_path):
    """The run's own held-out rows, counted per bucket from their headers: the counts of the rows open_splits holds
    out, each at its nearest bucket; --reference naming the run's own source at 'heldout' (which changed nothing)
    is refused in one line that names --reference_split train."""
    from training.data.sources import open_splits

    source = shapes_folder(tmp_path / "shapes")
    cfg = config.load_config(fm.DEFAULTS, [f"--data.source={source}", "--data.resolution=16", "--data.val_holdout=9"])
    cfg.data.bucket_shapes = [[12, 22], [16, 16], [22, 12]]
    held = open_splits(config.Config({**cfg.data}), lambda line: None)[1]
    sizes = [Image.open(row["image"]["path"]).size for row in held]
    expected = {(12, 22): sizes.count((16, 32)), (16, 16): sizes.count((24, 24)), (22, 12): sizes.count((32, 16))}
    args = eval_fid.parse_args(["--run", "RUN"])
    assert reference.bucket_counts(args, cfg) == expected and sum(expected.values()) == 9
    shape, _ = reference.scored_bucket(cfg, args)
    assert expected[shape] == max(expected.values())
    assert len(reference.reference_images(bucket_reference(args, cfg, shape), cfg)) == expected[shape]
    mine = eval_fid.parse_args(["--run", "RUN", "--reference", str(source)])
    with pytest.raises(config.ConfigError, match=r"is the run's own data.source.*add --reference_split train"):
        reference.reference_split(mine, cfg)


def test_the_pipelines_shape_and_controls_are_the_trainers():
    """The exported pipeline (MinimalDiffusionPipeline, model_index.json's buckets): its default shape is the squarest
    bucket, as sample.py's; a side that is not a positive whole patch in the grid is refused; its default size and
    crop controls for a non-square sample, and for an original_size of another aspect, are what preprocess records
    for such an image cropped to that shape (the trainer's cache, generation.make_controls)."""
    from training.sharing.exported.pipeline import MinimalDiffusionPipeline as Pipe

    shapes = [[12, 22], [16, 16], [22, 12]]
    pipe = SimpleNamespace(config=SimpleNamespace(buckets=shapes, resolution=16), vae=None,
                           transformer=SimpleNamespace(config=SimpleNamespace(pos_embed_max_size=11, patch_size=2)))
    assert Pipe.sample_shape(pipe, None, None) == (16, 16)
    assert buckets.default_shape({"data": {"resolution": 16, "bucket_shapes": shapes}}) == (16, 16)
    assert Pipe.sample_shape(pipe, 12, 22) == (12, 22)
    for height, width in ((0, 22), (-2, 22), (13, 22), (12, 24), (12, None)):
        with pytest.raises(ValueError, match="each a positive multiple of 2 and at most 22 pixels"):
            Pipe.sample_shape(pipe, height, width)
    data = config.Config({"crop": "center", "random_flip": False})
    for original in (None, (300, 100), (100, 300), (100, 100), (100, 150), (12, 22)):
        h, w = original or (12, 22)
        ours = Pipe.controls(pipe, 1, original, None, False, "cpu", (12, 22))
        _, meta = preprocess(Image.new("RGB", (w, h)), 16, data, shape=(22, 12))
        assert ours["orig_hw"][0].tolist() == meta["orig_hw"].tolist(), original
        assert ours["crop_box"][0].tolist() == meta["crop_box"].tolist(), original


def shapes_folder(root):
    """3 classes of coloured discs on wide (32 x 16), tall (16 x 32) and square (24 x 24) grey canvases."""
    rng = np.random.default_rng(0)
    for name, fill in (("blue", (50, 80, 230)), ("green", (40, 190, 60)), ("red", (220, 40, 40))):
        (root / name).mkdir(parents=True)
        for i in range(30):
            w, h = [(32, 16), (16, 32), (24, 24)][i % 3]
            img, x, y = Image.new("RGB", (w, h), (230, 230, 230)), rng.integers(0, w - 10), rng.integers(0, h - 10)
            img.paste(Image.new("RGB", (10, 10), fill), (int(x), int(y)))
            img.save(root / name / f"{i:03d}.png")
    return root


class ChannelJudge(torch.nn.Module):
    """A stand-in evaluation classifier for shapes_folder's discs: class c's logit is the mean of channel (B, G, R)[c]
    (blue, green, red, the folders' sorted names), so it is right on every disc; `wrong` reads red's logit off the
    blue channel too, so a red disc ties with blue and is called blue: 2/3 right on the three classes in equal
    numbers."""

    def __init__(self, wrong=False):
        super().__init__()
        self.order = [2, 1, 0] if not wrong else [2, 1, 2]

    def forward(self, x, output_hidden_states=False):
        return SimpleNamespace(logits=20 * x.mean((2, 3))[:, self.order])


def test_the_classifiers_accuracy_on_a_buckets_real_reference_images(tmp_path):
    """classifier.reference_accuracy, eval_fid.py's bound beside a bucket's class accuracy: the reference images of
    that bucket alone (the 30 wide canvases of 90, 10 a class), cropped to it as eval_fid.py scores them and read as
    its samples are (square windows), against their own labels: 1 for a judge right on every disc, 2/3 for one that
    calls red blue; a folder of images given as --reference has no labels: None."""
    from training.evaluation import classifier
    from training.evaluation.reference import reference_key

    source = shapes_folder(tmp_path / "shapes")
    cfg = {"data": {**config.load_config(fm.DEFAULTS, ["--data.resolution=16"]).data, "source": str(source),
                    "num_classes": 3, "bucket_shapes": [[12, 22], [16, 16], [22, 12]]}}
    args = SimpleNamespace(reference=None, reference_num=None, reference_split="train", reference_crop="center",
                           reference_resolution=None, reference_image_column=None, shape=(22, 12))
    key = reference_key(args, cfg, "classifier")
    assert classifier.reference_accuracy(ChannelJudge(), key, cfg) == {"images": 30, "accuracy": 1.0}
    wrong = classifier.reference_accuracy(ChannelJudge(wrong=True), key, cfg, batch_size=7)  # batches of 7: the same
    assert wrong["images"] == 30 and wrong["accuracy"] == pytest.approx(2 / 3)
    assert classifier.reference_accuracy(ChannelJudge(), {**key, "kind": "folder"}, cfg) is None


# Loads the export with diffusers alone (python -I: this repository is not importable) and samples it wide.
LOAD_AND_SAMPLE = """
import json, sys
import numpy as np, torch
try:
    import training
    sys.exit("this repository is importable here")
except ImportError:
    pass
from diffusers import DiffusionPipeline
job = json.loads(sys.argv[1])
pipe = DiffusionPipeline.from_pretrained(job["folder"], trust_remote_code=True)
images = pipe(job["classes"], generator=[torch.Generator().manual_seed(s) for s in job["seeds"]],
              height=12, width=22).images
np.save(sys.argv[2], np.stack([np.asarray(i) for i in images]))
"""


@pytest.mark.slow
def test_a_non_square_run_trains_resumes_exactly_samples_two_shapes_and_its_export_samples_wide(tmp_path, capsys):
    from accelerate.state import AcceleratorState

    source = shapes_folder(tmp_path / "shapes")
    args = [*TINY_MODEL, "--model.num_layers=1", f"--data.source={source}", "--data.resolution=16",
            "--data.buckets=[0.5,1,2]", "--data.cache_dir", str(tmp_path / "cache"), "--train.batch_size=4",
            "--train.grad_accum=2", "--train.warmup_steps=1", "--val.steps=2", "--val.num_samples=6",
            "--val.loss_samples=8", "--log.wandb=off", "--log.every=1", "--val.every=2", "--ckpt.every=2",
            "--log.report=false", '--conditioning.controls=["size","crop"]', "--objective.contrastive_weight=0.05"]

    def train(name, steps, *more):
        AcceleratorState._reset_state(reset_partial_state=True)
        return fm.main(args + ["--run_dir", str(tmp_path / name), f"--train.max_steps={steps}", *more])

    full = train("full", 4)
    assert "held-out images (the hold-out" in capsys.readouterr().out  # the trainer hands its held-out rows over
    train("part", 2)
    part = train("part", 4, "--resume", "latest")
    weights = "transformer/diffusion_pytorch_model.safetensors"
    from safetensors.torch import load_file

    a, b = load_file(str(full / "export" / weights)), load_file(str(part / "export" / weights))
    assert all(torch.equal(a[k], b[k]) for k in a)  # resumed at step 2 = uninterrupted, bitwise
    losses = [[json.loads(r).get("loss") for r in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (full, part)]
    assert losses[0] == losses[1]
    cfg = json.loads((full / "config.json").read_text())
    assert cfg["data"]["bucket_shapes"] == [[12, 22], [16, 16], [22, 12]]
    grid = (full / "samples" / "step_00000004.txt").read_text()
    assert all(f"{w}x{h}:" in grid for w, h in cfg["data"]["bucket_shapes"])  # the grid shows the buckets
    # sample.py at two shapes: a bucket by its aspect ratio, and a width x height
    wide = sample.main(["--run", str(full), "--classes", "blue,red", "--per_class", "1", "--aspect_ratio", "2:1",
                        "--out", str(tmp_path / "wide")])
    tall = sample.main(["--run", str(full), "--classes", "blue", "--per_class", "1", "--width", "12", "--height", "22",
                        "--out", str(tmp_path / "tall")])
    pngs = {name: np.stack([np.asarray(Image.open(p)) for p in sorted(out.glob("0*.png"))])
            for name, out in (("wide", wide), ("tall", tall))}
    assert pngs["wide"].shape == (2, 12, 22, 3) and pngs["tall"].shape == (1, 22, 12, 3)
    # eval_fid.py at the wide bucket with --classifier: beside the samples' class accuracy, the classifier's on that
    # bucket's 30 real reference images (of 90), in the table and the report
    from training.evaluation import classifier

    judge = tmp_path / "judge"
    classifier.build(3, ["blue", "green", "red"]).save_pretrained(judge)
    (judge / classifier.RECORD).write_text(json.dumps({"test_accuracy": 0.5, "test_split": "test", "resolution": 16}))
    capsys.readouterr()
    report = eval_fid.main(["--run", str(full), "--aspect_ratio", "2:1", "--num_samples", "3", "--steps", "1",
                            "--classifier", str(judge), "--features", "classifier", "--reference_split", "train",
                            "--stats_cache", str(tmp_path / "stats"), "--clip_model", "none"])
    real = report["classifier"]["bucket_reference"]
    key = {k: v for k, v in report["reference"].items() if k not in ("stats", "key_sha256", "stats_sha256")}
    assert real == classifier.reference_accuracy(classifier.load(judge)[0], key, cfg, side=16) and real["images"] == 30
    assert (f"on the 30 real reference images of the 22x12 bucket, read as its samples are" in capsys.readouterr().out
            and "class_accuracy_3" in report["metrics"])
    # the export, with diffusers alone, at height 12 x width 22: sample.py's images for the same seeds
    job = {"folder": str(full / "export"), "classes": ["blue", "red"],
           "seeds": [generation.seed_for(0, 0, i) for i in range(2)]}
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-I", "-c", LOAD_AND_SAMPLE, json.dumps(job), str(tmp_path / "out.npy")],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(ROOT) not in done.stderr
    theirs = np.load(tmp_path / "out.npy")
    diff = np.abs(theirs.astype(int) - pngs["wide"].astype(int))
    assert theirs.shape == (2, 12, 22, 3) and diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_a_resumed_bucket_run_keeps_its_buckets_and_another_global_batch_is_refused_in_one_line(tmp_path, capsys):
    """--resume keeps the recorded data.bucket_shapes (the model's grid and the cache follow them). The same run on
    two processes has a global batch of 16, under which the 22x46 bucket (12 images) would merge away: refused
    before any work, naming train.global_batch, instead of a new grid failing at the checkpoint's load; with
    train.global_batch=8 (the run's) it resumes with its buckets."""
    import datasets
    from safetensors.torch import save_file

    from training.run import checkpoints

    sizes = [(48, 24)] * 3 + [(24, 48)] * 12 + [(32, 32)] * 12 + [(60, 24)] * 2
    ds = datasets.Dataset.from_dict({"image": [Image.new("RGB", s) for s in sizes], "label": [0] * len(sizes)},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    ds = ds.cast_column("image", datasets.Image(decode=False))
    args = ["--run_dir", str(tmp_path / "run"), "--data.resolution=32", "--data.buckets=[0.5,1,2]",
            "--data.num_classes=1", "--train.batch_size=4", "--train.grad_accum=2"]
    started = config.load_config(fm.DEFAULTS, args, method="flow_matching", schema=fm.CONFIG)
    buckets.resolve(started, ds, Accelerator(cpu=True))
    assert started.data.bucket_shapes == [[22, 46], [32, 32]]
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    for name in ("model", "ema", "optimizer"):
        save_file({}, str(ckpt / f"{name}.safetensors"))
    torch.save({"step": 4, "config": json.loads(json.dumps(started))}, ckpt / "state.pt")

    def resumed(*extra):
        cfg = config.load_config(fm.DEFAULTS, [*args, *extra, "--resume", "latest"],
                                 method="flow_matching", schema=fm.CONFIG)
        checkpoints.keep_recorded(cfg, log=lambda line: None)
        assert cfg.data.bucket_shapes == [[22, 46], [32, 32]]
        return cfg

    two_processes = SimpleNamespace(num_processes=2, print=lambda *a: None)
    with pytest.raises(config.ConfigError, match=r"at a global batch of 16 \(\[\[32, 32\]\]\): a resumed run needs the "
                                                 r"global batch it started with \(set train.global_batch"):
        buckets.resolve(resumed(), ds, two_processes)
    cfg = resumed("--train.global_batch=8")
    buckets.resolve(cfg, ds, two_processes)
    assert cfg.data.bucket_shapes == [[22, 46], [32, 32]]
