"""Watching a run: plain log lines when stdout is a file (SLURM), the bar's loss labelled as smoothed,
wandb online when logged in, and the wandb run id kept in the run folder so a resumed run continues it."""
import datetime
import re

import numpy as np

import pytest
import torch

import common
import train_flow_matching as fm
from training.config import config
from training.model.mmdit import build_denoiser
from training.run import monitor
from training.record import runlog

LINE = re.compile(r"^step 2/4 \(50%\) \| loss (\d\.\d{4}) \| smoothed loss (\d\.\d{4}) \| lr 5\.00e-04 \| "
                  r"(\d+\.\d) images/s \| ETA (\d+:\d\d:\d\d.*)$")


def two_logged_steps(interactive, monkeypatch):
    """A Monitor driven through two optimizer steps and one log interval, as the loop drives it."""
    from accelerate import Accelerator

    monkeypatch.setattr(common, "interactive", lambda: interactive)
    cfg = config.load_config(fm.DEFAULTS, ["--train.max_steps=4", "--log.every=2", "--log.grad_every=0",
                                           "--model.num_layers=1", "--data.num_classes=3"])
    rows = []
    mon = monitor.Monitor(cfg, build_denoiser(cfg, 3, 8), Accelerator(cpu=True), rows.append, {"step": 0})
    for step in range(2):
        mon.micro_batch(torch.tensor([0.5, 0.7]), torch.tensor([0, 1]))
        mon.optimizer_step(torch.tensor(0.3), torch.tensor(True))
    mon.t_start -= 10.0  # 2 steps took 10 s: 5 s per step, 2 steps left
    mon.log_interval(2, 5e-4)
    return mon, rows[-1]


def test_log_file_gets_one_plain_line_per_interval(monkeypatch, capsys):
    mon, metrics = two_logged_steps(False, monkeypatch)
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 1 and "\r" not in out + err, (out, err)
    loss, smoothed, _, eta = LINE.match(lines[0]).groups()
    assert float(loss) == pytest.approx(metrics["loss"], abs=1e-4) == 0.6
    assert float(smoothed) == pytest.approx(metrics["loss_smoothed"], abs=1e-4)
    assert eta == "0:00:10 + 1 validation not yet timed + 1 checkpoint not yet timed"  # both at step 4, the last
    mon.close()


def test_the_eta_counts_the_validations_and_checkpoints_still_to_come(monkeypatch, capsys):
    """A run at step 2 of 4 (5 s per step) whose one validation took 54 s: the validation of step 4 is in the ETA,
    the checkpoint not yet timed is named; training time per step leaves the validation out."""
    mon, _ = two_logged_steps(False, monkeypatch)
    mon.pauses = {"validation": [54.0, 1], "snapshot": [1.0, 1]}  # snapshots: not scheduled, stay in the rate
    mon.t_start -= 54.0
    assert mon.eta(2) == "0:01:04 + 1 checkpoint not yet timed"
    mon.pauses["checkpoint"], mon.t_start = [4.0, 2], mon.t_start - 4.0  # 2 s each
    assert mon.eta(2) == "0:01:06"
    mon.close()
    for total, every in ((1000, 300), (1000, 500), (7, 2), (10, 1), (5, 0), (5, 9)):  # the pauses common.due gives
        for step in range(total + 1):
            due = sum(common.due(s, every, total) for s in range(max(step, 1), total + 1))  # step's own too
            text = monitor.eta_of(step, total, 0.0, {"validation": [2.0, 1]}, {"validation": every})
            assert text == str(datetime.timedelta(seconds=2 * due)), (total, every, step)


def test_terminal_gets_the_bar_with_its_loss_labelled_smoothed(monkeypatch, capsys):
    mon, _ = two_logged_steps(True, monkeypatch)
    assert not mon.progress.disable and "smoothed loss" in mon.progress.postfix
    assert "ETA" not in capsys.readouterr().out  # no plain lines on a terminal
    mon.close()


def test_phases_announce_themselves_with_their_duration(capsys):
    with monitor.Phase("step 200: validation"):
        pass
    assert re.fullmatch(r"step 200: validation \.\.\.\nstep 200: validation: done in \d+\.\d s\n",
                        capsys.readouterr().out)
    list(monitor.progress(range(20), "fid samples"))
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out] == [f"fid samples: {k}/20" for k in range(2, 21, 2)]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return tmp_path / "netrc"


def test_wandb_auto_is_online_when_logged_in_by_key_or_netrc(wandb_env, monkeypatch):
    assert runlog.wandb_mode("auto") == "offline"  # no key, no netrc file
    wandb_env.write_text("machine example.org login me password secret\n")
    assert runlog.wandb_mode("auto") == "offline"  # logged in elsewhere, not to wandb
    wandb_env.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")  # as `wandb login` writes
    assert runlog.wandb_mode("auto") == "online"
    assert runlog.wandb_mode("offline") == "offline" and runlog.wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.mylab.org")  # a self-hosted server: its own entry
    assert runlog.wandb_mode("auto") == "offline"
    monkeypatch.delenv("WANDB_BASE_URL")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment wins over auto
    assert runlog.wandb_mode("auto") == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    wandb_env.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert runlog.wandb_mode("auto") == "online"


@pytest.mark.slow
def test_resumed_run_continues_the_same_wandb_run(tmp_path, wandb_env, monkeypatch):
    from accelerate import Accelerator

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for resume in (None, "latest", None):
        cfg = config.load_config(fm.DEFAULTS, ["--run_dir", str(tmp_path / "run"), "--log.wandb=auto",
                                               *(["--resume", resume] if resume else [])])
        log = runlog.RunLog(cfg, runlog.start_run(cfg, Accelerator(cpu=True)), Accelerator(cpu=True))
        log({"step": 1, "loss": 0.5})
        ids.append(log.wandb.id)
        assert log.wandb.settings.mode == "offline"
        log.wandb.finish()
    assert ids[0] == ids[1] != ids[2]  # resumed: the same run; a fresh start in the folder: a new one
    assert (tmp_path / "run" / "wandb_id.txt").read_text().strip() == ids[2]
    # wandb's own folders, offline-run-<time>-<id>[-<n>], carry the run ids (several starts within one second
    # get a numbered folder each, so folders are not counted)
    logged = {p.name.split("-")[3] for p in (tmp_path / "run" / "wandb").glob("offline-run-*")}
    assert logged == {ids[0], ids[2]}


PREEMPTED = """
import sys
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
import common
import train_flow_matching as fm
from training.config import config
from training.record import runlog

cfg = config.load_config(fm.DEFAULTS, ["--run_dir", sys.argv[2], "--log.wandb=auto"])  # WANDB_MODE=offline
two = SimpleNamespace(num_processes=2, is_main_process=True, wait_for_everyone=lambda: None, end_training=lambda: None,
                      print=print)
log = runlog.RunLog(cfg, runlog.start_run(cfg, two), two)
for step in range(1, 6):
    log({"step": step, "loss": 1000 + step + 0.25})
common.requeue(two, "at step 5: checkpoint written;")  # rank 0 of 2 processes: leaves by os._exit(75)
"""


@pytest.mark.slow
def test_a_preempted_multi_process_run_finishes_wandb_before_it_leaves(tmp_path):
    """common.end_processes leaves a multi-process run by os._exit, without the interpreter's teardown that used to
    finish wandb: the offline run file held 7 bytes. Finished first, it holds the last rows (offline mode)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "script.py").write_text(PREEMPTED)
    out = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(ROOT), str(tmp_path / "run")], cwd=tmp_path,
                         env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == common.REQUEUE_EXIT_CODE, out.stderr[-2000:]
    data = b"".join(p.read_bytes() for p in (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert b"1005.25" in data and b"1001.25" in data  # the last row and the first, as JSON values of the history


# ---- Validation grids show what was asked for ----------------------------------------------------------


def test_grid_cells_carry_their_labels_under_them_and_in_a_text_file(tmp_path):
    images = torch.full((5, 3, 16, 16), 1.0)  # white cells: any dark pixel below a cell is its label
    plain = runlog.save_image_grid(images, tmp_path / "plain.png", nrow=3)
    labelled = runlog.save_image_grid(images, tmp_path / "grid.png", nrow=3,
                                      labels=["red circle", "a very long prompt that cannot fit under a cell", "c",
                                              "d", "e"])
    assert not (tmp_path / "plain.txt").exists() and labelled.width == plain.width
    band = (labelled.height - plain.height) // 2  # two rows of cells, one band of text under each
    assert band > 8
    cell = 18 * 4  # 16 px + 2 px padding, enlarged 4x
    ink = np.asarray(labelled.convert("L")) < 128
    under = [ink[r * (cell + band) + cell:(r + 1) * (cell + band), c * cell + 2:(c + 1) * cell].any()
             for r, c in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))]
    assert under == [True] * 5 + [False]  # five labels, the sixth cell empty
    lines = (tmp_path / "grid.txt").read_text().splitlines()
    assert lines[1] == "1\trow 1, column 2\ta very long prompt that cannot fit under a cell" and len(lines) == 5


def test_a_grid_of_one_image_is_padded_and_labelled_like_any_other(tmp_path):
    """make_grid returns one image unpadded; the labelled grid (val.num_samples=1) must still fit its band."""
    one = runlog.save_image_grid(torch.full((1, 3, 16, 16), 1.0), tmp_path / "one.png", nrow=1, labels=["red"])
    cell = 18 * 4
    assert one.width == cell + 2 * 4 and one.height > cell  # 16 px + 2 px padding each side, enlarged 4x
    assert (np.asarray(one.convert("L"))[cell:, 2:cell] < 128).any()  # the label under the cell


@pytest.mark.slow
def test_validation_prompts_are_class_names_captions_or_the_prompts_file(tmp_path):
    from training.data.classes import readable_names
    from training.data.classes import validation_prompts
    from training.data.sources import DEMO_CLASSES, make_demo_dataset
    import datasets

    demo = make_demo_dataset(12, seed=0, resolution=8)
    cfg = config.load_config(fm.DEFAULTS, ["--val.num_samples=11", "--data.num_classes=9"])
    assert validation_prompts(cfg, demo, demo) == DEMO_CLASSES + DEMO_CLASSES[:2]  # classes in order, cycled
    assert readable_names(["n01440764", "n09999999"]) == ["tench, Tinca tinca", "n09999999"]  # unknown: its id
    plain = datasets.Dataset.from_dict({"label": [0, 1, 2]})
    cfg3 = config.load_config(fm.DEFAULTS, ["--val.num_samples=4", "--data.num_classes=3"])
    assert validation_prompts(cfg3, plain, plain) == ["class 0", "class 1", "class 2", "class 0"]
    text = config.load_config(fm.DEFAULTS, ["--val.num_samples=3", "--data.caption_column=caption",
                                            "--encoders.text_encoder=some/encoder"])
    assert validation_prompts(text, demo, demo) == demo["caption"][:3]  # the held-out captions
    (tmp_path / "prompts.txt").write_text("a red circle\n\n  a large blue square \n")
    text.val.prompts = str(tmp_path / "prompts.txt")
    assert validation_prompts(text, demo, demo) == ["a red circle", "a large blue square"]
    text.val.prompts = str(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="val.prompts=.*missing.txt.*one prompt per line"):
        validation_prompts(text, demo, demo)
    cfg.val.prompts = str(tmp_path / "prompts.txt")
    with pytest.raises(ValueError, match="val.prompts=.* is for text-to-image runs"):
        validation_prompts(cfg, demo, demo)


def test_validation_conditions_are_the_encoded_prompts(tiny_text_encoder):
    from training.data.encoders import encode_text, load_encoders
    from training.evaluation.validation import validation_inputs

    _, tokenizer, encoder = load_encoders(config.Config(vae=None, text_encoder=tiny_text_encoder), "cpu")
    text = encode_text(tokenizer, encoder, ["a red circle", "a blue square", "a green triangle"], 8)
    rows = [{"x": torch.zeros(3, 4, 4), "text_tokens": torch.zeros(8, 32), "text_mask": torch.zeros(8),
             "text_pooled": torch.zeros(32), "orig_hw": torch.tensor([16 + i, 16])} for i in range(2)]
    noise, cond = validation_inputs(rows, 3, None, (3, 4, 4), 0, "cpu", text)
    assert noise.shape == (3, 3, 4, 4)
    for key in ("text_tokens", "text_mask", "text_pooled"):
        assert torch.equal(cond[key], text[key])
    assert cond["orig_hw"][:, 0].tolist() == [16, 17, 16]  # controls of the held-out rows, cycled


@pytest.mark.slow
def test_text_run_validates_on_the_prompts_file(tmp_path, tiny_text_encoder):
    from conftest import tiny_run_args

    (tmp_path / "prompts.txt").write_text("a small red circle\na large blue square\n")
    run = fm.main(tiny_run_args(tmp_path, steps=2) + ["--data.caption_column=caption", "--encoders.max_tokens=8",
                  f"--encoders.text_encoder={tiny_text_encoder}", f"--val.prompts={tmp_path / 'prompts.txt'}",
                  "--val.every=2", "--log.report=false"])
    lines = (run / "samples" / "step_00000002.txt").read_text().splitlines()
    assert [line.split("\t")[2] for line in lines] == ["a small red circle", "a large blue square"]
