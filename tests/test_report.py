"""report.py on synthetic run folders: every row kind present, and an old run with training rows only."""
import json
import math
import re
import statistics

import pytest
from PIL import Image

from training.record import report

GROUPS = ["patch_embed"] + [f"block_{i:02d}" for i in range(6)] + ["final_layer", "conditioning"]
VAL_LOSS = {100: 0.30, 200: 0.21, 300: 0.24}  # the best is not the last


def config(**objective):
    return {"data": {"source": "embedded", "resolution": 16},
            "model": {"patch_size": 2, "num_layers": 6, "num_attention_heads": 4, "attention_head_dim": 32},
            "objective": objective, "train": {"batch_size": 8, "grad_accum": 2, "lr": 1e-3, "max_steps": 300,
                                              "grad_clip": 1.0}}


def training_row(step, extra=True):
    row = {"step": step, "loss": 1 / step ** 0.5, "loss_smoothed": 1.1 / step ** 0.5, "lr": 1e-3 * min(1, step / 50),
           "grad_norm": 0.5 + 0.1 * math.sin(step), "skipped_steps": 1 if step > 150 else 0,
           "images_per_s": 200.0 + step % 7, "images_per_s_per_device": (200.0 + step % 7) / 2,
           "data_wait_share": 0.05, "peak_memory_gb": 1.25, **{f"loss_t{k}": 0.1 * (k + 1) for k in range(5)}}
    if extra:
        row.update(clip_share=0.5 if step <= 100 else 0.0, clip_excess=1.3, loss_spikes=2 if step >= 120 else 0)
    return row


def write_run(run_dir, rows, cfg, grids=("step_00000100.png", "step_00000300.png")):
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "samples").mkdir()
    for i, name in enumerate(grids):
        Image.new("RGB", (64, 64), (40 * i, 120, 200)).save(run_dir / "samples" / name)


def full_rows():
    rows = [training_row(s) for s in range(10, 301, 10)]
    per_group = {f"{kind}/{g}": scale * (j + 1) * 1.5 ** (j % 3) for j, g in enumerate(GROUPS)
                 for kind, scale in (("grad_norm", 0.1), ("update_ratio", 1e-3))}
    rows += [{"step": s, **per_group} for s in (50, 100, 150, 200, 250, 300)]
    rows += [{"step": s, "val_loss": v, **{f"val_loss_t{k}": v * (k + 1) / 3 for k in range(5)}}
             for s, v in VAL_LOSS.items()]
    rows += [{"step": s, "fid_clean_1000": 90.0 - s / 10, "kid_clean_1000": 0.05 - s / 1e4} for s in (100, 200, 300)]
    rows += [{"step": 70, "event": "loss_spike", "loss": 0.9, "loss_smoothed": 0.12},
             {"step": 110, "event": "loss_spike", "loss": 0.8, "loss_smoothed": 0.1},
             {"step": 150, "event": "grad_vanishing", "group": "block_03", "grad_norm": 1e-9},
             {"step": 250, "event": "grad_exploding", "group": "final_layer", "grad_norm": 40.0}]
    rows.append(training_row(300) | {"loss": 0.0123})  # a resumed run repeats step 300: the later row wins
    return rows


def table_value(md, metric):
    match = re.search(rf"^\| {re.escape(metric)} \| (.*) \|$", md, re.M)
    return match and match.group(1)


@pytest.mark.slow  # 2-3 s: the fast tier stays under 60 s
def test_full_run_report(tmp_path):
    run_dir = tmp_path / "full"
    write_run(run_dir, full_rows(), config(time_sampling="logit_normal"))
    path = report.write_report(run_dir)
    assert path == run_dir / "report.md"
    md = path.read_text()
    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert pngs == ["grad_norm.png", "loss.png", "lr.png", "quality.png", "resources.png", "samples_final.png",
                    "update_ratio.png", "val_loss_bins.png"]
    for name in pngs:
        assert f"](report/{name})" in md
        with Image.open(run_dir / "report" / name) as img:
            assert img.width >= 64 and img.height >= 64
            if name != "samples_final.png":
                assert img.width >= 600 and len(img.getcolors(2 ** 24)) > 20  # a drawn plot, not a blank canvas
    with Image.open(run_dir / "report" / "samples_final.png") as img:  # the last grid, not the first
        assert img.getpixel((0, 0)) == (40, 120, 200)

    assert md.startswith("# Run report: full")
    assert table_value(md, "method") == "flow_matching"
    assert table_value(md, "global batch") == "8 x 2 processes x 2 accumulation = 32"
    assert table_value(md, "last step") == "300"
    assert table_value(md, "loss") == "0.0123"
    assert table_value(md, "val_loss") == f"{VAL_LOSS[300]:.4g}"
    assert table_value(md, "best val_loss") == f"{min(VAL_LOSS.values()):.4g} at step 200"
    assert table_value(md, "skipped steps (non-finite)") == "1"
    assert table_value(md, "clip share overall") == f"{10 * 0.5 / 30:.4g}"
    assert table_value(md, "loss spikes") == "2"
    assert table_value(md, "median images/s") == f"{statistics.median(200.0 + s % 7 for s in range(10, 301, 10)):.4g}"
    assert "loss_spike: 2" in md and "grad_exploding: 1" in md and "grad_vanishing: 1" in md
    assert re.search(r"^\| 150 \| grad_vanishing \| group block_03, grad_norm 1e-09 \|$", md, re.M)
    assert re.search(r"^\| 70 \| loss_spike \| loss 0.9, loss_smoothed 0.12 \|$", md, re.M)


def test_events_table_is_capped(tmp_path, unrendered_figures):
    rows = [training_row(10)] + [{"step": s, "event": "loss_spike", "loss": 1.0} for s in range(1, 31)]
    write_run(tmp_path / "spiky", rows, config(), grids=())
    md = report.write_report(tmp_path / "spiky").read_text()
    assert "30 in all, the first 20 shown" in md
    assert md.count("| loss_spike |") == report.MAX_EVENT_ROWS


def test_a_meanflow_runs_report_shows_each_kind_of_samples_loss_and_the_clip_event(tmp_path, unrendered_figures):
    """A MeanFlow run's last loss_r_eq_t (flow matching's loss, the one to read) and loss_r_lt_t are final numbers
    beside the loss, and the clip_share_high event is in the events table."""
    rows = [training_row(s) | {"loss_r_eq_t": 0.12 + s / 1e4, "loss_r_lt_t": 13.0 + s / 100} for s in (10, 20)]
    rows.append({"step": 20, "event": "clip_share_high", "clip_share": 1.0, "steps": 50, "clip_excess": 2.4,
                 "clip": 1.0})
    write_run(tmp_path / "mf", rows, config(meanflow=True), grids=())
    md = report.write_report(tmp_path / "mf").read_text()
    assert table_value(md, "loss_r_eq_t") == "0.122" and table_value(md, "loss_r_lt_t") == "13.2"
    assert re.search(r"^\| 20 \| clip_share_high \| clip_share 1, steps 50, clip_excess 2.4, clip 1 \|$", md, re.M)


def test_odd_rows_do_not_break_the_report(tmp_path, unrendered_figures):
    rows = [{"step": 10, "loss": float("nan"), "clip_excess": 2.0, "grad_norm/block_00": 0.0, "note": "text"},
            {"step": 20, "loss": 0.5, "grad_norm/block_00": 1.0, "update_ratio/conditioning": 1e-3},
            [1, 2], {"no_step": 1}, {"step": 30, "event": "grad_exploding"}]
    write_run(tmp_path / "odd", rows, {}, grids=())
    md = report.write_report(tmp_path / "odd").read_text()
    assert "| 30 | grad_exploding |" in md and "| loss | 0.5 |" in md
    assert sorted(p.name for p in (tmp_path / "odd" / "report").glob("*.png")) == [
        "grad_norm.png", "loss.png", "update_ratio.png"]


def test_old_run_with_training_rows_only(tmp_path, unrendered_figures):
    rows = [training_row(s, extra=False) for s in range(10, 101, 10)]
    rows = [{k: v for k, v in r.items() if k != "images_per_s_per_device"} for r in rows]
    write_run(tmp_path / "old", rows, config(num_timesteps=1000), grids=())
    with open(tmp_path / "old" / "metrics.jsonl", "a") as f:
        f.write('{"step": 110, "loss": 0.')  # a run killed mid-write leaves a partial line
    md = report.write_report(tmp_path / "old").read_text()
    pngs = sorted(p.name for p in (tmp_path / "old" / "report").glob("*.png"))
    assert pngs == ["grad_norm.png", "loss.png", "lr.png", "resources.png"]
    assert all(f"](report/{name})" in md for name in pngs)
    for absent in ("| val_loss |", "| best val_loss |", "| clip share overall |", "| loss spikes |"):
        assert absent not in md
    assert table_value(md, "method") == "ddpm"
    assert "process count unknown" in table_value(md, "global batch")
    assert "No events logged." in md
    assert report.write_report(str(tmp_path / "old")).read_text() == md  # deterministic, and a str path works


def test_empty_run_folder(tmp_path):
    md = report.write_report(tmp_path).read_text()  # no config, no metrics: a report that says little
    assert md.startswith("# Run report:") and "![" not in md


def test_command_line_has_help_and_refuses_a_folder_that_is_not_a_run(tmp_path, unrendered_figures, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        report.main(["--help"])
    assert e.value.code == 0 and "RUN_DIR" in capsys.readouterr().out
    write_run(tmp_path / "run", [training_row(s) for s in (10, 20)], config())
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")  # an export folder has a config.json, but it is not a run
    for folder, message in ((export, "is not a run folder: it has no metrics.jsonl"),
                            (tmp_path / "missing", "no such folder")):
        with pytest.raises(SystemExit) as e:
            report.main([str(tmp_path / "run"), str(folder)])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run" / "report.md").exists()  # refused before any report is written
    assert report.main([str(tmp_path / "run")]) == [tmp_path / "run" / "report.md"]


@pytest.mark.slow
def test_quality_beyond_fid_evaluations_and_human_ratings(tmp_path):
    """precision/recall/density/coverage and FD-DINOv2 rows get a plot panel and last values; eval_fid.py's reports
    and the run's votes (tools/rate.py's ratings.jsonl) get their sections, with the tally and interval."""
    run_dir = tmp_path / "rated"
    quality = [{"step": s, "fid_clean_1k": 90.0 - s / 10, "fd_dinov2_1k": 500.0 - s,
                **{f"{m}_inception_1k": 0.2 + s / 1000 for m in ("precision", "recall", "density", "coverage")}}
               for s in (100, 200, 300)]
    write_run(run_dir, [training_row(s) for s in (100, 200, 300)] + quality, config(), grids=())
    (run_dir / "eval" / "export-ema-euler32-g3-seed0").mkdir(parents=True)
    (run_dir / "eval" / "export-ema-euler32-g3-seed0" / "report.json").write_text(json.dumps(
        {"num_samples": 1000, "metrics": {"fid_clean_1k": 12.5, "precision_inception_1k": 0.71}}))
    votes = [{"id": str(i), "kind": "pair", "index": i, "seed": 0, "left": "rated/a", "right": "other/b",
              "choice": c} for i, c in enumerate(["left"] * 6 + ["right"] * 2 + ["tie", "skip"])]
    (run_dir / "ratings.jsonl").write_text("".join(json.dumps(v) + "\n" for v in votes))
    md = report.write_report(run_dir).read_text()
    assert table_value(md, "precision_inception_1k (last)") == "0.5" and table_value(md, "fd_dinov2_1k (last)") == "200"
    assert "quality.png" in md
    with Image.open(run_dir / "report" / "quality.png") as img:  # three panels: FID, FD-DINOv2, precision/...
        assert img.height > 3 * 2.6 * 110
    assert "| `export-ema-euler32-g3-seed0` | 1000 | fid_clean_1k 12.5, precision_inception_1k 0.71 |" in md
    assert "## Human ratings (tools/rate.py, 10 votes)" in md
    assert re.search(r"rated/a vs other/b: win rate 0\.722 \[95% CI 0\.\d+, [01]\.\d+\] over 9 votes \(6 wins, "
                     r"2 losses, 1 ties", md)  # (6 + 1/2) / 9
