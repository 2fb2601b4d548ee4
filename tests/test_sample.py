"""sample.py: chosen classes (ids or names) or prompts -> a labelled grid and single PNGs, from an export or
a checkpoint, with eval_fid.py's seeds (image i of both is the same image when its condition is)."""
import json

import numpy as np
import pytest
from PIL import Image

import eval_fid
import sample
from training.evaluation import sampling
import train_flow_matching as fm
from conftest import tiny_run_args, trained_for_the_module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sample")
    return trained_for_the_module(fm.main, tiny_run_args(tmp, steps=2) + ["--ckpt.every=2", "--log.report=false",
                                                                       "--model.num_layers=1"])


def pngs(folder):
    return {p.name: np.asarray(Image.open(p)) for p in sorted(folder.glob("0*.png"))}


@pytest.mark.slow
def test_classes_by_name_and_id_give_a_labelled_grid_and_eval_fids_images(run, tmp_path):
    out = sample.main(["--run", str(run), "--classes", "red circle, Blue Square,8", "--per_class", "2",
                       "--steps", "2", "--batch_size", "3", "--out", str(tmp_path / "s")])
    names = sorted(pngs(out))
    assert names == ["0000_red-circle.png", "0001_red-circle.png", "0002_blue-square.png", "0003_blue-square.png",
                     "0004_blue-triangle.png", "0005_blue-triangle.png"]  # class 8 is the demo's blue triangle
    lines = (out / "grid.txt").read_text().splitlines()
    assert [line.split("\t")[2] for line in lines] == ["red circle"] * 2 + ["blue square"] * 2 + ["blue triangle"] * 2
    # 3 rows of 2, labelled
    assert Image.open(out / "grid.png").height > Image.open(out / "grid.png").width * 3 // 2 - 10
    assert json.loads((out / "sample.json").read_text())["steps"] == 2
    # A second call to the same folder replaces it whole: none of the first call's six images stays beside it.
    again = sample.main(["--run", str(run), "--classes", "0", "--per_class", "1", "--steps", "2",
                         "--out", str(tmp_path / "s")])
    assert again == out and sorted(pngs(out)) == ["0000_red-circle.png"]
    assert json.loads((out / "sample.json").read_text())["conditions"] == ["red circle"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no .partial folder left
    # Every class once, in order: image i is class i with noise seed_for(seed, 0, i), as eval_fid.py's sample i.
    every = sample.main(["--run", str(run), "--per_class", "1", "--steps", "2", "--batch_size", "3",
                         "--out", str(tmp_path / "every")])
    eval_fid.main(["--run", str(run), "--num_samples", "9", "--steps", "2", "--batch_size", "3", "--generate_only",
                   "--out_dir", str(tmp_path / "eval")])
    ours, theirs = list(pngs(every).values()), list(pngs(tmp_path / "eval" / "samples").values())
    assert len(ours) == len(theirs) == 9
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    # The checkpoint's EMA weights are the export's: the same images.
    ckpt = sample.main(["--run", str(run), "--checkpoint", "latest", "--per_class", "1", "--steps", "2",
                        "--batch_size", "3", "--out", str(tmp_path / "ckpt")])
    assert all(np.array_equal(a, b) for a, b in zip(ours, pngs(ckpt).values()))


@pytest.mark.slow
def test_unknown_class_and_wrong_kind_of_condition_are_refused(run, tmp_path):
    with pytest.raises(ValueError, match=r"--classes: 'purple hexagon' is not a class of this run \(ids 0 \.\. 8, "
                                         r"or names: 0: red circle, 1: red square"):
        sample.main(["--run", str(run), "--classes", "red circle,purple hexagon", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--classes: '9' is not a class"):
        sample.main(["--run", str(run), "--classes", "9", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--prompts: this is a class-conditional run"):
        sample.main(["--run", str(run), "--prompts", "p.txt", "--out", str(tmp_path)])


def test_a_folder_sample_py_did_not_write_is_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "mine.txt").write_text("not samples")
    (tmp_path / "run").mkdir()  # a run folder that exists (one that does not is refused first)
    monkeypatch.setattr(sampling, "load_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=r"--out .* holds files that sample.py did not write \(no sample.json\)"):
        sample.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path)])
    assert (tmp_path / "mine.txt").exists()
    (tmp_path / "old").mkdir()  # an earlier call's folder (its sample.json) is replaced whole by publish
    for name in ("sample.json", "0000_a.png", "0001_a.png"):
        (tmp_path / "old" / name).write_text("old")
    (tmp_path / "old.partial").mkdir()
    (tmp_path / "old.partial" / "0000_b.png").write_text("new")
    sample.publish(tmp_path / "old.partial", tmp_path / "old")
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["0000_b.png"] and not (tmp_path / "old.partial").exists()


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        sample.parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(opt in out for opt in ("--classes", "--prompts", "--guidance_scale", "--steps", "--seed", "--out",
                                      "--checkpoint"))


@pytest.mark.slow
def test_prompts_file_on_a_text_run_matches_eval_fids_images(tmp_path, tiny_text_encoder):
    from accelerate.state import AcceleratorState

    text_run = fm.main(tiny_run_args(tmp_path, steps=2) + ["--data.caption_column=caption", "--encoders.max_tokens=8",
                       f"--encoders.text_encoder={tiny_text_encoder}", "--log.report=false", "--model.num_layers=1"])
    AcceleratorState._reset_state(reset_partial_state=True)
    (tmp_path / "prompts.txt").write_text("a small red circle\na large blue square\n")
    out = sample.main(["--run", str(text_run), "--prompts", str(tmp_path / "prompts.txt"), "--per_class", "1",
                       "--steps", "2", "--batch_size", "2", "--out", str(tmp_path / "s")])
    assert [line.split("\t")[2] for line in (out / "grid.txt").read_text().splitlines()] == \
        ["a small red circle", "a large blue square"]
    eval_fid.main(["--run", str(text_run), "--prompts", str(tmp_path / "prompts.txt"), "--num_samples", "2",
                   "--steps", "2", "--batch_size", "2", "--generate_only", "--out_dir", str(tmp_path / "eval")])
    ours, theirs = list(pngs(out).values()), list(pngs(tmp_path / "eval" / "samples").values())
    assert len(ours) == 2 and all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert not np.array_equal(ours[0], ours[1])
    with pytest.raises(ValueError, match="--classes: this is a text-to-image run"):
        sample.main(["--run", str(text_run), "--classes", "0", "--out", str(tmp_path / "x")])
