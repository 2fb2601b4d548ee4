"""The campaign scripts of benchmarks/ (the studies run in stages, docs/benchmarks/): each documented stage runs its
own code on a tiny Fashion-MNIST (a few IDX rows written here, read through the real reader) with a tiny model, a
few steps and a few samples, so a change to a helper they share (benchmarks/fashion_mnist.py's `ours`, eval_fid.py,
tools/compare.py, tools/sweep.py) cannot break a documented command unnoticed; and their tables pair arms by seed.

The stages' child processes (`python train_*.py ...`, `python tools/*.py ...`) run in this process as runpy runs a
script (`children_in_process`): the tiny data source reaches them, and no interpreter start-up (3-4 s each) is paid."""
import argparse
import gzip
import json
import os
import re
import resource
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import stats
from scipy.stats import ttest_rel

from benchmarks import buckets
from benchmarks import emoji as emoji_campaign
from benchmarks import fashion_mnist as bench
from benchmarks import lora_digits
from conftest import ROOT
from training.data import emoji, fashion_mnist

# The recipe's runs scaled down: a one-block model of width 16, 8 images a step, 20 held-out rows, 2-step validation
# sampling, no report.md (its plots are most of a tiny run); TINY_BUDGET: 2 steps and a checkpoint at every step (the
# quality curve's). What each campaign passes to every trainer run (TINY_MODEL where the stage sets the budget),
# with the test's own data.cache_dir (`tiny`: the campaigns run from the repository's root, as documented).
TINY_MODEL = ["--model.num_layers=1", "--model.num_attention_heads=2", "--model.attention_head_dim=8",
              "--data.val_holdout=20", "--train.batch_size=8", "--train.warmup_steps=1", "--val.steps=2",
              "--val.num_samples=4", "--val.loss_samples=8", "--log.every=1", "--val.reference_curves=null",
              "--log.report=false"]
TINY_BUDGET = ["--train.max_steps=2", "--val.every=2", "--ckpt.every=1"]
SAMPLES = "10"  # samples a score draws


def write_idx(path, array):
    """An IDX file as upstream writes them (tests/test_fashion_mnist.py's)."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


@pytest.fixture(scope="module")
def tiny_fashion_mnist(tmp_path_factory):
    """A folder of Fashion-MNIST's four IDX files, 100 training and 40 test rows (classes in turn, each class a
    bright bar at its own height on noise), and the evaluation classifier tools/classifier.py trains on them."""
    folder, rng = tmp_path_factory.mktemp("fashion_mnist"), np.random.default_rng(0)
    for split, n in (("train", 100), ("test", 40)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 60, (n, 28, 28))
        for image, label in zip(images, labels):
            image[2 + 2 * label: 5 + 2 * label, 4:24] = 220
        write_idx(folder / fashion_mnist.FILES[split][0], images)
        write_idx(folder / fashion_mnist.FILES[split][1], labels)
    with pytest.MonkeyPatch.context() as patch:
        reads_the_folder(patch, folder)
        from tools import classifier as classifier_tool
        classifier_tool.main(["--config", str(bench.RECIPE), "--out", str(folder / "classifier")])
    return folder


def reads_the_folder(monkeypatch, folder):
    load, split_arrays = fashion_mnist.load, fashion_mnist.split_arrays
    monkeypatch.setattr(fashion_mnist, "load", lambda split, where=folder: load(split, where))
    monkeypatch.setattr(fashion_mnist, "split_arrays", lambda split, where=folder: split_arrays(split, where))


@pytest.fixture
def tiny(tiny_fashion_mnist, monkeypatch, tmp_path):
    """data.source='fashion_mnist' reads the tiny folder. `classifier`: its folder; `model`: TINY_MODEL with a
    data.cache_dir of the test's own (the trainers' default, cache/, is the repository's); `run`: with TINY_BUDGET."""
    reads_the_folder(monkeypatch, tiny_fashion_mnist)
    model = [*TINY_MODEL, f"--data.cache_dir={tmp_path / 'cache'}"]
    return argparse.Namespace(classifier=str(tiny_fashion_mnist / "classifier"), model=model,
                              run=[*model, *TINY_BUDGET])


@pytest.fixture
def children_in_process(monkeypatch):
    """`subprocess.run([sys.executable, SCRIPT, ...])` of a script of this repository runs SCRIPT here, as
    `python SCRIPT ...` would (runpy, run_name "__main__", sys.argv, cwd), with a fresh accelerate state as a new
    process has; its exit code comes back as a process's would, an exception propagates (the test shows its
    traceback). The children's CPU clock (benchmarks' cpu_seconds(RUSAGE_CHILDREN)) counts these children's CPU.
    Other commands run as processes."""
    from accelerate.state import AcceleratorState

    run, clock, spent = subprocess.run, bench.cpu_seconds, [0.0]

    def child(cmd, *args, check=False, cwd=None, env=None, **kwargs):
        script = Path(str(cmd[1])) if len(cmd) > 1 else None
        if cmd[0] != sys.executable or script is None or script.suffix != ".py" or ROOT not in script.resolve().parents:
            return run(cmd, *args, check=check, cwd=cwd, env=env, **kwargs)
        argv, here, started, code = sys.argv, os.getcwd(), time.process_time(), 0
        sys.argv = [str(script), *map(str, cmd[2:])]
        try:
            os.chdir(cwd or here)
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if isinstance(stop.code, str):  # sys.exit("message"): what the interpreter would print
                print(stop.code, file=sys.stderr)
        finally:
            sys.argv = argv
            os.chdir(here)
            spent[0] += time.process_time() - started
            AcceleratorState._reset_state(reset_partial_state=True)
        if check and code:
            raise subprocess.CalledProcessError(code, cmd)
        return subprocess.CompletedProcess(cmd, code)

    def cpu_seconds(who=resource.RUSAGE_SELF):
        return spent[0] if who == resource.RUSAGE_CHILDREN else clock(who)

    monkeypatch.setattr(subprocess, "run", child)
    monkeypatch.setattr(bench, "cpu_seconds", cpu_seconds)
    monkeypatch.setattr(buckets, "cpu_seconds", cpu_seconds)
    monkeypatch.setattr(emoji_campaign, "cpu_seconds", cpu_seconds)
    monkeypatch.setattr(lora_digits, "cpu_seconds", cpu_seconds)


def rows_of(printed, first):
    """The markdown rows of a printed table whose first cell is `first`, split into cells."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines()
            if line.startswith(f"| {first} |")]


# ---- benchmarks/fashion_mnist.py and benchmarks/meanflow_fashion_mnist.py -------------------------------------


@pytest.mark.slow
def test_the_meanflow_campaign_runs_each_documented_stage(tmp_path, tiny, children_in_process, capsys):
    """docs/benchmarks/meanflow_fashion_mnist.md's commands, one seed: the baseline (fashion_mnist.py ours), its
    scores at other settings, the meanflow and finetune arms (train, then score), and the table: an arm for the
    recipe's runs, "flow_matching", never one named after their folder ("base"), each MeanFlow row read against the
    recipe's FD of its seed, and the training CPU of the two MeanFlow arms alone."""
    from benchmarks import meanflow_fashion_mnist as mf

    out, base = tmp_path / "bench", tmp_path / "bench" / "base"
    o = ["--out", str(out), "--classifier", tiny.classifier, "--num_samples", SAMPLES]
    bench.main(["ours", "--trainer", "flow_matching", "--seed", "0", "--num_samples", SAMPLES, "--fractions",
                "--out", str(base), "--classifier", tiny.classifier, *tiny.run])
    mf.main(["score", "--run", str(base / "flow_matching_s0"), "--sampler", "euler", "--steps", "1", "--guidance",
             "1", "2", *o])
    mf.main(["train", "--arm", "meanflow", "--seed", "0", *o, *tiny.run, "--val.steps=1"])  # the arm's own: 1 step
    mf.main(["score", "--run", str(out / "meanflow" / "flow_matching_s0"), "--steps", "2", *o])
    mf.main(["train", "--arm", "finetune", "--seed", "0", "--base", str(base), *o, *tiny.run, "--val.steps=1"])
    mf.main(["score", "--run", str(out / "finetune" / "flow_matching_s0"), "--steps", "2", *o])
    capsys.readouterr()
    mf.main(["table", *o, "--base", str(base)])
    printed = capsys.readouterr().out
    rows = {(r[0], r[1]): r for arm in ("flow_matching", "meanflow", "finetune", "base") for r in rows_of(printed, arm)}
    assert sorted(rows) == [("finetune", "meanflow 1, guidance 1 (1 evaluations)"),
                            ("finetune", "meanflow 2, guidance 1 (2 evaluations)"),
                            ("flow_matching", "euler 1, guidance 1 (1 evaluations)"),
                            ("flow_matching", "euler 1, guidance 2 (2 evaluations)"),
                            ("flow_matching", "euler 2, guidance 2 (4 evaluations)"),
                            ("meanflow", "meanflow 1, guidance 1 (1 evaluations)"),
                            ("meanflow", "meanflow 2, guidance 1 (2 evaluations)")]
    assert rows[("flow_matching", "euler 2, guidance 2 (4 evaluations)")][-1] == "1.00"  # the recipe's own score
    assert all(float(r[-1]) > 0 for r in rows.values())  # every row read against the recipe's FD of seed 0
    finetune = json.loads((out / "finetune" / "flow_matching_s0" / "config.json").read_text())
    assert finetune["init_from"] == str(base / "flow_matching_s0" / "export") and finetune["train"]["max_steps"] == 2
    assert [line.split(":")[0] for line in printed.splitlines() if "training steps' CPU" in line] == \
        ["finetune", "meanflow"]


@pytest.mark.slow
def test_ours_scores_its_quality_curve_and_its_first_samples_alone(tmp_path, tiny, children_in_process):
    """fashion_mnist.py ours as docs/benchmarks/fashion_mnist.md first runs it (the default --fractions 0.25 0.5,
    --num_samples above --curve_samples), DDPM, 4 steps: checkpoints 1 and 2 scored at --curve_samples, the export at
    --num_samples and its first --curve_samples alone (the same PNGs, hard links), quality.jsonl one row a score, the
    CPU record; a second call trains and scores nothing again."""
    out = ["--out", str(tmp_path), "--classifier", tiny.classifier]
    bench.main(["ours", "--trainer", "ddpm", "--seed", "0", "--num_samples", "12", "--curve_samples", SAMPLES, *out,
                *tiny.model, "--train.max_steps=4", "--ckpt.every=1", "--val.every=4"])
    run = tmp_path / "ddpm_s0"
    reports = {p.parent.name: json.loads(p.read_text()) for p in (run / "eval").glob("*/report.json")}
    assert {name: r["num_samples"] for name, r in reports.items()} == {
        "test-step1": 10, "test-step2": 10, "test-step4": 12, "test-step4-first": 10}
    assert os.path.samefile(run / "eval" / "test-step4-first" / "samples" / "000009.png",
                            run / "eval" / "test-step4" / "samples" / "000009.png")
    assert [json.loads(r)["step"] for r in (run / "quality.jsonl").read_text().splitlines()] == [1, 2, 4, 4]
    record = json.loads((run / "cpu_seconds.json").read_text())
    assert len(record["processes"]) == 1 and record["train"] > 0 and record["steps"] > 0
    stamps = {p: p.stat().st_mtime_ns for p in (run / "eval").glob("*/report.json")}
    bench.main(["ours", "--trainer", "ddpm", "--seed", "0", "--num_samples", "12", "--curve_samples", SAMPLES, *out,
                *tiny.model, "--train.max_steps=4", "--ckpt.every=1", "--val.every=4"])
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps and len(json.loads(
        (run / "cpu_seconds.json").read_text())["processes"]) == 1


@pytest.mark.slow
def test_the_peer_trains_for_its_cpu_samples_and_is_scored(tmp_path, tiny, monkeypatch):
    """fashion_mnist.py peer: torchcfm's example (on 8 training images: its batch of 128 holds the split, and one
    step of its U-Net on the whole tiny split costs seconds) until --cpu_seconds, dopri5 samples, the protocol's
    scores against the test split."""
    split_arrays = fashion_mnist.split_arrays
    monkeypatch.setattr(fashion_mnist, "split_arrays", lambda split, *folder: [a[:8] for a in split_arrays(
        split, *folder)] if split == "train" else split_arrays(split, *folder))
    bench.main(["peer", "--seed", "0", "--cpu_seconds", "0.1", "--num_samples", "6", "--out", str(tmp_path),
                "--classifier", tiny.classifier])
    result = json.loads((tmp_path / "torchcfm_s0" / "result.json").read_text())
    assert result["steps"] == 1 and result["num_samples"] == 6 and result["nfe_per_batch"] > 1
    assert {"fd_classifier_6", "class_accuracy_6"} <= set(result["metrics"])
    assert (tmp_path / "torchcfm_s0" / "quality.jsonl").read_text().count("\n") == 1


# ---- benchmarks/control_ablation.py ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_control_ablation_runs_each_documented_stage(tmp_path, tiny, children_in_process, monkeypatch,
                                                          unrendered_figures):
    """docs/benchmarks/control_ablation.md's commands at --steps 2 --seeds 0,1 (each sweep through tools/sweep.py
    --local, each comparison through tools/compare.py), the demo runs made tiny through the overrides every run
    gets (DEMO): positive_control, main's five arms, switch_time on main's runs, real on the tiny Fashion-MNIST."""
    from benchmarks import control_ablation as ca

    for key, value in {"model.num_layers": 1, "model.num_attention_heads": 2, "model.attention_head_dim": 8,
                       "data.demo_samples": 160, "data.val_holdout": 16, "train.batch_size": 8,
                       "train.warmup_steps": 1, "val.steps": 2, "val.loss_samples": 8, "val.num_samples": 4,
                       "val.reference_curves": None, "data.cache_dir": str(tmp_path / "cache")}.items():
        monkeypatch.setitem(ca.DEMO, key, value)
    monkeypatch.setattr(ca, "PER_CLASS", 2)
    out = ["--out", str(tmp_path), "--steps", "2", "--seeds", "0,1"]
    for stage in ca.STAGES:
        ca.main([stage, *out])
    tables = {stage: (tmp_path / f"{stage}.md").read_text() for stage in ca.STAGES}
    assert [r[0] for r in rows_of(tables["positive_control"], "adanorm")] == ["adanorm"]
    assert sorted(r[0] for r in rows_of(tables["main"], "both p=0") + rows_of(tables["main"], "both p=1")
                  + rows_of(tables["main"], "disentangled p=0") + rows_of(tables["main"], "disentangled p=1")
                  + rows_of(tables["main"], "adanorm")) == ["adanorm", "both p=0", "both p=1", "disentangled p=0",
                                                            "disentangled p=1"]
    assert "- interaction ((dis p1 - p0) - (both p1 - p0)): " in tables["main"] and "Verdict: " in tables["real"]
    assert len(rows_of(tables["switch_time"], "disentangled p=1")) == 1
    for stage, metric in (("main", "layout_change"), ("real", "sharpness_ratio")):
        assert (tmp_path / stage / f"compare_{metric}" / "compare.md").is_file()


# ---- benchmarks/paper_claims.py ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_paper_claims_campaign_runs_each_documented_stage(tmp_path, tiny, children_in_process, monkeypatch,
                                                               unrendered_figures):
    """docs/benchmarks/paper_claims.md's commands at --steps 2, two seeds (the report's contrasts and verdicts need
    two): the mixed-size data, the cost (runs of 1 and 2 steps), both conditioning arms, the pre-training and the five
    transfer arms, and the report with its contrasts, verdicts, comparisons, CPU lines and floors."""
    from benchmarks import control_ablation, paper_claims as pc

    monkeypatch.setattr(pc, "SAMPLES", 10)
    monkeypatch.setattr(pc, "TIMING_STEPS", (1, 2))
    monkeypatch.setattr(control_ablation, "PER_CLASS", 2)
    o = ["--out", str(tmp_path), "--classifier", tiny.classifier, *tiny.model]
    pc.main(["data", *o])
    pc.main(["cost", *o])
    for seed in ("0", "1"):
        for arm in pc.CONDITIONING:
            if arm != "both":
                pc.main(["conditioning", arm, seed, "--steps", "2", *o])
        pc.main(["pretrain", seed, "--steps", "2", *o])
        for arm in pc.TRANSFER:
            pc.main(["transfer", arm, seed, "--steps", "2", *o])
    pc.main(["report", *o])
    report = (tmp_path / "report.md").read_text()
    for said in ("Verdict: ", "Secondary, the same at 28 px", "- resample - extend (mean over shift): ",
                 "- resample_shift - scratch: ", "verdict: ", "- mixed sizes (conditioning): FD ",
                 "- plain (transfer): FD ", "conditioning/adanorm/s1: "):
        assert said in report, said
    assert sorted(p.name for p in (tmp_path / "compare").iterdir()) == sorted(
        [f"conditioning_{m}" for m in ("fd_classifier_10", "fd_classifier_10_at28", "class_accuracy_10")]
        + [f"transfer_{m}" for m in ("fd_classifier_10", "class_accuracy_10")])
    scratch = json.loads((tmp_path / "transfer" / "s0" / "scratch" / "config.json").read_text())
    resampled = json.loads((tmp_path / "transfer" / "s0" / "resample" / "config.json").read_text())
    assert scratch["data"]["resolution"] == 28 and resampled["init_from"] == pc.PRETRAIN


# ---- benchmarks/latent_space.py ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_latent_space_campaign_runs_each_documented_stage(tmp_path, tiny, children_in_process, capsys):
    """docs/benchmarks/latent_space.md's commands, one seed of each trainer: the autoencoder (tools/autoencoder.py,
    2 steps), each latent run and its pixel peer (fashion_mnist.py ours), and the comparison, at --num_samples."""
    from benchmarks import latent_space

    out, pixel = ["--out", str(tmp_path / "latent"), "--classifier", tiny.classifier], tmp_path / "pixel"
    latent_space.main(["autoencoder", *out, "--steps", "2", "--batch_size", "8"])
    for trainer in latent_space.TRAINERS:
        latent_space.main(["run", "--trainer", trainer, "--seed", "0", *out, "--num_samples", SAMPLES, *tiny.run])
        bench.main(["ours", "--trainer", trainer, "--seed", "0", "--num_samples", SAMPLES, "--fractions", "--out",
                    str(pixel), "--classifier", tiny.classifier, *tiny.run])
    capsys.readouterr()
    latent_space.main(["compare", *out, "--pixel", str(pixel), "--seeds", "0", "--num_samples", SAMPLES])
    printed = capsys.readouterr().out
    vae = json.loads((tmp_path / "latent" / "flow_matching_s0" / "config.json").read_text())["encoders"]["vae"]
    assert vae == str(tmp_path / "latent" / "autoencoder")
    for trainer in latent_space.TRAINERS:
        assert f"| {trainer}, 1 seeds, 10 samples | fd_classifier_10 |" in printed
    assert len(rows_of(printed, "latents")) == 2 and len(rows_of(printed, "latents - pixels, paired by seed")) == 2
    assert "real test images: fd_classifier_40 " in printed and "decoding 10 samples" in printed


# ---- benchmarks/real_options.py ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_real_options_campaign_runs_each_documented_stage(tmp_path, tiny, children_in_process,
                                                              unrendered_figures):
    """docs/benchmarks/real_options.md's commands at --steps 4, one arm, trainer and seed: the equal-steps runs,
    their cost, the equal-CPU runs, and the comparisons (tools/compare.py)."""
    from benchmarks import real_options

    ro = ["--seeds", "0", "--trainers", "ddpm", "--steps", "4", "--num_samples", SAMPLES, "--out", str(tmp_path),
          "--classifier", tiny.classifier, *tiny.model]
    real_options.main(["run", "--budgets", "steps", "--arms", "base,muon", *ro])
    real_options.main(["cost", "--arms", "muon", *ro])
    real_options.main(["run", "--budgets", "cpu", "--arms", "muon", *ro])
    real_options.main(["compare", "--arms", "muon", *ro])
    cost = json.loads((tmp_path / "cost.json").read_text())["ddpm"]
    steps = real_options.steps_for(argparse.Namespace(out=str(tmp_path)), "ddpm", "muon", "cpu", 4)
    assert sorted(cost) == ["base", "muon"] and (tmp_path / f"steps{steps}/muon/ddpm_s0/quality.jsonl").is_file()
    for budget in ("steps", "cpu"):
        compared = tmp_path / "compare" / f"ddpm_steps4_{budget}_fd_classifier_10" / "base_vs_muon"
        assert (compared / "compare.md").is_file()


# ---- benchmarks/buckets.py -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_buckets_campaign_runs_each_documented_stage(tmp_path, tiny, children_in_process, capsys, monkeypatch):
    """docs/benchmarks/buckets.md's commands, one seed an arm: the canvases, each arm trained and scored at its
    shapes, the real images' bounds, the cache layout (--layout_images, micro-batches of 8, 5 of them read), and the
    table."""
    monkeypatch.setattr(buckets, "LAYOUT_READS", 5)
    out = ["--out", str(tmp_path)]
    buckets.main(["data", *out])
    for arm in ("buckets", "square"):
        buckets.main(["run", "--arm", arm, "--seed", "0", *out, "--classifier", tiny.classifier, "--num_samples",
                      SAMPLES, *tiny.run])
    buckets.main(["reals", *out, "--classifier", tiny.classifier])
    buckets.main(["layout", *out, "--layout_images", "40", "--train.batch_size=8"])
    capsys.readouterr()
    buckets.main(["table", *out])
    printed = capsys.readouterr().out
    scores = {arm: json.loads((tmp_path / f"{arm}_s0" / "scores.json").read_text())["scores"] for arm in buckets.SHAPES}
    assert sorted(scores["buckets"]) == ["20x40", "28x28", "40x20"] and list(scores["square"]) == ["28x28"]
    assert sorted(json.loads((tmp_path / "reals.json").read_text())) == ["20x40", "28x28", "40x20", "square crops"]
    assert list(json.loads((tmp_path / "layout.json").read_text())) == ["square", "buckets",
                                                                        "padded to the largest bucket"]
    rows = {(r[0], r[1]): r for shape in ("28x28", "40x20", "20x40") for r in rows_of(printed, shape)}
    assert len(rows) == 9 and rows[("28x28", "fd_classifier")][3] != "cannot draw it"
    assert rows[("40x20", "cut_share")][3] == "cannot draw it"


def test_the_buckets_table_pairs_the_arms_by_seed_and_names_the_unpaired_seeds(tmp_path, capsys):
    """Buckets seeds {0, 1, 2} and square seeds {0, 1, 3}: the paired difference is over seeds 0 and 1 alone (the
    issue's table paired by position: buckets' seed 2 against square's seed 3), and the seeds left out are named.
    Each arm's own column keeps all its seeds; a shape the square arm cannot draw has no difference."""
    fd = {"buckets": {0: 10.0, 1: 12.0, 2: 5.0}, "square": {0: 11.0, 1: 12.5, 3: 20.0}}
    for arm, by_seed in fd.items():
        for seed, value in by_seed.items():
            shapes = {f"{w}x{h}": {"fd_classifier": value + w / 100, "class_accuracy": 0.5, "cut_share": 0.1}
                      for w, h in buckets.SHAPES[arm]}
            (tmp_path / f"{arm}_s{seed}").mkdir()
            (tmp_path / f"{arm}_s{seed}" / "scores.json").write_text(json.dumps({"scores": shapes,
                                                                                 "cpu_s_per_step": 1.0}))
    buckets.table(argparse.Namespace(out=str(tmp_path)))
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("| 28x28 | fd_classifier |")).split(" | ")
    low, high = ttest_rel([10.0, 12.0], [11.0, 12.5]).confidence_interval()
    assert row[4] == f"-0.750 [{low:+.3f}, {high:+.3f}] (seeds 0,1)"
    assert row[2].startswith("9.280 [") and row[3].startswith("14.780 [")  # each arm over all its own seeds
    assert next(line for line in lines if line.startswith("| 40x20 | fd_classifier |")).split(" | ")[3:5] == \
        ["cannot draw it", ""]
    assert "unpaired (in the arm's own column, not in the paired difference): buckets seed(s) 2; square seed(s) 3" \
        in lines


# ---- benchmarks/emoji.py -----------------------------------------------------------------------------------------


def scaled_down_emoji(tmp_path, monkeypatch):
    """The emoji campaign on test_emoji's fixture packages (29 training, 2 validation and 4 test images: 2 a test
    part, the fewest a part's distances take; the floor of the 'new' part draws the 2 training flags there are),
    16 px: configs/emoji.json with a one-block model, 2 steps of 8 images, 2 validation samples; its tools in
    TMP/tools made by the campaign's own commands, scaled down (a CLIP of width 32 and one layer, 1 epoch; the
    classifier 1 epoch; the autoencoder 8, 8 channels, 2 steps); 2-step cost runs, seeds 0 and 1, a tune of guidance
    2 and 4 at 3 steps (neither guidance 1 nor the recipe's 3 and 2 steps, so a score at the wrong setting shows),
    the grid to TMP/grid.png. Returns the out folder and the packages' folder."""
    from test_emoji import write_packages

    packages, tools = tmp_path / "emoji", tmp_path / "tools"
    monkeypatch.setattr(emoji, "PINNED", write_packages(packages))
    recipe = json.loads(emoji_campaign.RECIPE.read_text())
    for section, values in {
            "data": {"source": f"emoji:{packages}", "resolution": 16, "cache_dir": str(tmp_path / "cache")},
            "encoders": {"vae": str(tools / emoji_campaign.AUTOENCODER),
                         "text_encoder": str(tools / emoji_campaign.TEXT_CLIP)},
            "model": {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8},
            "train": {"max_steps": 2, "batch_size": 8, "warmup_steps": 1},
            "val": {"every": 2, "num_samples": 2, "steps": 2, "loss_samples": 2, "reference_curves": None},
            "log": {"every": 1, "report": False}, "ckpt": {"every": 2}}.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    (path := tmp_path / "emoji_recipe.json").write_text(json.dumps(recipe))
    clip = ["--epochs", "1", "--width", "32", "--layers", "1", "--patch_size", "4", "--batch_size", "16"]
    scaled = {emoji_campaign.TEXT_CLIP: clip, emoji_campaign.EVAL_CLIP: clip,
              emoji_campaign.CLASSIFIER: ["--epochs", "1"],
              emoji_campaign.AUTOENCODER: ["--channels", "8,8", "--steps", "2", "--batch_size", "8",
                                           "--stats_cache", str(tmp_path / "cache" / "fid_stats")]}
    monkeypatch.setattr(emoji_campaign, "TOOLS", {  # the campaign's commands, its folders (--classifier) in TMP/tools
        str(tools / folder): [*(str(tools / c) if c in emoji_campaign.TOOLS else c for c in command), *scaled[folder]]
        for folder, command in emoji_campaign.TOOLS.items()})
    for name, value in {"RECIPE": path, "EVAL_CLIP": str(tools / emoji_campaign.EVAL_CLIP),
                        "CLASSIFIER": str(tools / emoji_campaign.CLASSIFIER), "COST_STEPS": 2, "SEEDS": (0, 1),
                        "TUNE": ["--guidance", "2,4", "--steps", "3", "--num_samples", "2", "--confirm_samples", "0"],
                        "GRID": tmp_path / "grid.png"}.items():
        monkeypatch.setattr(emoji_campaign, name, value)
    return tmp_path / "out", packages


def report_sections(text):
    """{(arm, setting): {metric: [cell of all, recombination, new]}} of report.md's per-arm tables."""
    out, arm, setting = {}, None, None
    for line in text.splitlines():
        if line.startswith("## ") and ": guidance " in line:
            arm = line[3:].split(":")[0]
        elif line.startswith("### "):
            setting = line[4:].split(" ")[0]
        elif arm and setting and line.startswith("| ") and not line.startswith(("| metric", "| ---")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out.setdefault((arm, setting), {})[cells[0]] = cells[1:]
        if line.startswith("## Contrasts"):
            break
    return out


def t95(values):
    """[mean, low, high]: Student's 95% interval of the mean, mean +- t_0.975(n - 1) s / sqrt(n)."""
    half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / np.sqrt(len(values))
    return [np.mean(values), np.mean(values) - half, np.mean(values) + half]


def numbers(cell):
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+|nan", cell)]


def test_the_emoji_report_reads_each_part_and_pairs_the_arms_by_seed():
    """emoji.py's report on synthetic reports. value(): a metric at a part whatever its sample count ('1k' too), the
    parts' keys listed before all's (a report may order them so), None where missing. contrast(): a planted FD
    effect (A lower by 5, noise 0.3) is recovered with an interval excluding 0 on A's side ("A better"), a higher
    CLIP score on A's side the same; a null effect (differences +1, -1, +0.5) "cannot tell"; seeds {0, 1, 2}
    against {0, 1, 3} paired on 0 and 1 alone (scipy's ttest_rel interval); verdict(): one seed settles nothing."""
    def report(fd, part_fd=(0.0, 0.0), clip=20.0):
        return {"metrics": {"fd_clip_1k_recombination": part_fd[0], "fd_clip_1k_new": part_fd[1],
                            "fd_clip_2k": fd, "clip_score_2k": clip, "clip_score_1k_new": -1.0}}

    r = report(7.0, part_fd=(8.0, 9.0))
    assert [emoji_campaign.value(r, "fd_clip", part) for part in emoji_campaign.PARTS] == [7.0, 8.0, 9.0]
    assert emoji_campaign.value(r, "clip_score", "") == 20.0 and emoji_campaign.value(r, "kd_clip", "") is None
    assert emoji_campaign.value(r, "clip_score", "_recombination") is None

    rng = np.random.default_rng(0)
    b = {seed: report(50.0 + 3 * seed, clip=20.0) for seed in (0, 1, 2)}
    a = {seed: report(b[seed]["metrics"]["fd_clip_2k"] - 5 + rng.normal(0, 0.3), clip=25.0 + seed / 10)
         for seed in (0, 1, 2)}
    row = emoji_campaign.contrast(("fm_latent", "tuned", a), ("ddpm_latent", "tuned", b), "fd_clip").split(" | ")
    d = [a[s]["metrics"]["fd_clip_2k"] - b[s]["metrics"]["fd_clip_2k"] for s in (0, 1, 2)]
    low, high = ttest_rel(d, np.zeros(3)).confidence_interval()
    assert row[2] == f"{np.mean(d):+.4f} [{low:+.4f}, {high:+.4f}]" and high < 0
    assert row[3:] == ["0, 1, 2", "fm_latent tuned better |"]
    row = emoji_campaign.contrast(("fm_latent", "tuned", a), ("ddpm_latent", "tuned", b), "clip_score").split(" | ")
    assert row[4] == "fm_latent tuned better |"  # higher is better: A's side is above 0
    row = emoji_campaign.contrast(("ddpm_latent", "tuned", b), ("fm_latent", "tuned", a), "fd_clip").split(" | ")
    assert row[4] == "fm_latent tuned better |"  # the same contrast the other way round
    null = {seed: report(b[seed]["metrics"]["fd_clip_2k"] + step) for seed, step in zip((0, 1, 2), (1, -1, 0.5))}
    row = emoji_campaign.contrast(("fm_latent", "tuned", null), ("ddpm_latent", "tuned", b), "fd_clip").split(" | ")
    assert row[4] == "cannot tell |"

    unequal = {0: report(10.0), 1: report(12.0), 2: report(5.0)}
    other = {0: report(11.0), 1: report(12.5), 3: report(20.0)}
    row = emoji_campaign.contrast(("fm_latent", "tuned", unequal), ("fm_pixel", "tuned", other), "fd_clip")
    low, high = ttest_rel([10.0, 12.0], [11.0, 12.5]).confidence_interval()
    assert row.split(" | ")[2:4] == [f"-0.7500 [{low:+.4f}, {high:+.4f}]", "0, 1"]
    one = emoji_campaign.contrast(("fm_latent", "tuned", {0: report(1.0)}), ("fm_pixel", "tuned", other), "fd_clip")
    assert one.split(" | ")[2:] == ["-10.0000", "0", "not settled (one seed) |"]
    assert emoji_campaign.verdict({"low": -2.0, "high": -1.0}, False, ("A", "B")) == "B better"


@pytest.mark.slow
def test_the_emoji_campaign_runs_each_documented_stage(tmp_path, children_in_process, monkeypatch, capsys):
    """docs/benchmarks/emoji.md's commands in their order (prepare, cost; per arm: run seed 0, tune, then run and
    score each seed; report, grid), seeds 0 and 1 (fm_pixel seed 0 alone: its contrasts have one seed). The tools
    are made where the recipe names them; the pixel arm trains cost.json's steps; each score is at the arm's tuned
    setting and at guidance 1 (the tuned steps); report.md's cells are the reports' means over the seeds at each part
    with the real images' value, its contrasts the differences paired by seed with their verdicts, its aims the
    latent arms' FD against the floor; the grid puts each test caption's sample beside its own real image; a second
    prepare, run, tune or score does nothing."""
    from test_emoji import CAPTIONS, FIXTURE, colour, files_of

    out, packages = scaled_down_emoji(tmp_path, monkeypatch)
    o, recipe = ["--out", str(out)], json.loads(emoji_campaign.RECIPE.read_text())
    emoji_campaign.main(["prepare", *o])
    assert all((Path(folder) / "cpu_seconds.json").is_file() for folder in emoji_campaign.TOOLS)
    emoji_campaign.main(["cost", *o])
    cost = json.loads((out / "cost.json").read_text())
    per_step = cost["cpu_s_per_step"]
    assert cost["latent_steps"] == 2 and cost["pixel_steps"] == round(2 * per_step["latent"] / per_step["pixel"])
    cost["pixel_steps"] = 3  # what the pixel arm trains, whatever the tiny runs' CPU gave: the recipe's 2 would not do
    (out / "cost.json").write_text(json.dumps(cost))
    seeds = {"fm_latent": (0, 1), "ddpm_latent": (0, 1), "fm_pixel": (0,)}
    for arm in emoji_campaign.ARMS:
        emoji_campaign.main(["run", arm, "0", *o])
        emoji_campaign.main(["tune", arm, *o])
        for seed in seeds[arm]:
            emoji_campaign.main(["run", arm, str(seed), *o])
            emoji_campaign.main(["score", arm, str(seed), *o])
    capsys.readouterr()
    emoji_campaign.main(["report", *o])
    assert capsys.readouterr().out == (out / "report.md").read_text()
    emoji_campaign.main(["grid", *o])

    # The runs: their tools, steps and CPU records; each score at its setting.
    configs = {arm: json.loads((out / f"{arm}_s0" / "config.json").read_text()) for arm in seeds}
    assert {arm: c["train"]["max_steps"] for arm, c in configs.items()} == {"fm_latent": 2, "ddpm_latent": 2,
                                                                            "fm_pixel": 3}
    assert configs["fm_latent"]["encoders"]["vae"] == recipe["encoders"]["vae"] and \
        configs["fm_pixel"]["encoders"]["vae"] is None
    reports, tuned = {}, {}
    for arm, arm_seeds in seeds.items():
        tuned[arm] = json.loads((out / f"{arm}_s0" / "tuned.json").read_text())["best"]
        assert tuned[arm]["guidance_scale"] in (2, 4) and tuned[arm]["steps"] == 3
        for seed in arm_seeds:
            record = json.loads((out / f"{arm}_s{seed}" / "cpu_seconds.json").read_text())
            assert len(record["processes"]) == 1 and record["train"] > 0 and record["steps"] > 0  # seed 0: run twice
            for setting, guidance in (("tuned", tuned[arm]["guidance_scale"]), ("g1", 1.0)):
                r = json.loads((out / f"{arm}_s{seed}" / "eval" / f"test-{setting}" / "report.json").read_text())
                assert (r["guidance_scale"], r["steps"], r["num_samples"]) == (guidance, 3, 4), (arm, seed, setting)
                reports[arm, setting, seed] = r
            card = (out / f"{arm}_s{seed}" / "export" / "README.md").read_text()  # exported again after its scores
            assert f"| fd_clip_4 | {reports[arm, 'tuned', seed]['metrics']['fd_clip_4']:.4f} (real images: " in card

    # report.md: every cell the seeds' mean (with its t-interval) of the reports' own keys, the real images' value.
    text = (out / "report.md").read_text()
    sections = report_sections(text)
    assert sorted(sections) == sorted((arm, s) for arm in seeds for s in ("tuned", "g1"))
    keys = {"": "4", "_recombination": "2_recombination", "_new": "2_new"}  # 4 test images, 2 in each part
    for (arm, setting), rows in sections.items():
        assert list(rows) == list(emoji_campaign.METRICS)
        for metric, cells in rows.items():
            for (part, key), got in zip(keys.items(), cells):
                values = [reports[arm, setting, s]["metrics"].get(f"{metric}_{key}") for s in seeds[arm]]
                values = [v for v in values if v is not None]  # none of precision, recall at 4 samples: no cell
                real = reports[arm, setting, 0]["real"].get(f"{metric}_{key}")
                want = [] if not values else t95(values) if len(values) > 1 else [np.mean(values)]
                want += [] if real is None or not values else [real]
                assert numbers(got) == pytest.approx(want, abs=1e-4), (arm, setting, metric, part, got)
    assert text.count("Training CPU: ") == 6 and "the pixel arm trains 3 steps for the latent arm's 2." in text

    # The contrasts: paired over the seeds both have, their verdicts by the rule; the aims for the latent arms.
    contrasts = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
                 if line.startswith("| ") and " - " in line.split("|")[1]]
    pairs = [("fm_latent", "tuned", "ddpm_latent", "tuned"), ("fm_latent", "tuned", "fm_pixel", "tuned")] + [
        (arm, "tuned", arm, "g1") for arm in seeds]
    assert [row[0] for row in contrasts] == [f"{a} {x} - {b} {y}" for a, x, b, y in pairs for _ in range(5)]
    for (a, x, b, y), row in zip([p for p in pairs for _ in range(5)], contrasts):
        metric, part = {"fd_clip": ("fd_clip", ""), "fd_clip_recombination": ("fd_clip", "_recombination"),
                        "fd_clip_new": ("fd_clip", "_new"), "retrieval_top5_recombination": (
                            "retrieval_top5", "_recombination"), "clip_score": ("clip_score", "")}[row[1]]
        common = sorted(set(seeds[a]) & set(seeds[b]))
        d = [reports[a, x, s]["metrics"][f"{metric}_{keys[part]}"] - reports[b, y, s]["metrics"][
            f"{metric}_{keys[part]}"] for s in common]
        assert row[3] == ", ".join(map(str, common)) and numbers(row[2])[0] == pytest.approx(np.mean(d), abs=1e-4)
        if len(d) < 2:  # one seed: the difference alone
            assert len(numbers(row[2])) == 1 and row[4] == "not settled (one seed)"
            continue
        _, low, high = t95(d)
        assert numbers(row[2])[1:] == pytest.approx([low, high], abs=1e-4)
        first_better = high < 0 if metric == "fd_clip" else low > 0
        second_better = low > 0 if metric == "fd_clip" else high < 0
        assert row[4] == (f"{a} {x} better" if first_better else f"{b} {y} better" if second_better else
                          "cannot tell"), row
    aims = [line for line in text.splitlines() if line.startswith("- ") and "x the floor" in line]
    assert [line.split(":")[0] for line in aims] == ["- fm_latent", "- ddpm_latent"]
    for arm, line in zip(("fm_latent", "ddpm_latent"), aims):
        fd = np.mean([reports[arm, "tuned", s]["metrics"]["fd_clip_4"] for s in seeds[arm]])
        floor = reports[arm, "tuned", 0]["real"]["fd_clip_4"]
        assert line.startswith(f"- {arm}: FD {fd:.3f} = {fd / floor:.2f}x the floor {floor:.3f} (aim <= 3x: ")

    # The grid: the google image of each part's test caption (recombination, then new) beside fm_latent's sample.
    grid, test = np.asarray(Image.open(emoji_campaign.GRID)), emoji.load("test", packages)
    folder = out / "fm_latent_s0" / "eval" / "test-tuned"
    picked = [r for part in ("recombination", "new") for r in map(json.loads, (
        folder / "per_sample.jsonl").read_text().splitlines()) if r["part"] == part and test[r["row"]]["vendor"] ==
        "google"]
    assert grid.shape == (2 * (96 + 30), 2 * 96, 3)
    assert [r["caption"] for r in picked] == ["woman mage: medium skin tone", "brazil flag"]
    files = dict(zip(CAPTIONS, files_of(FIXTURE)))  # the fixture lists its files in CAPTIONS' order
    for k, r in enumerate(picked):
        y = k * (96 + 30)
        sample = np.asarray(Image.open(folder / "samples" / f"{r['sample']:06d}.png").resize((96, 96), Image.NEAREST))
        assert (grid[y:y + 96, :96] == sample).all()
        assert grid[y + 48, 96 + 48].tolist() == list(colour(files[r["caption"]], "google")), r["caption"]

    # Every stage resumes: made tools, trained runs, tuned settings and scores are left as they are.
    written = [*out.glob("*/cpu_seconds.json"), *out.glob("*/tuned.json"), *out.glob("*/eval/*/report.json"),
               *(Path(f) / "cpu_seconds.json" for f in emoji_campaign.TOOLS)]
    stamps = {p: p.stat().st_mtime_ns for p in written}
    emoji_campaign.main(["prepare", *o])
    emoji_campaign.main(["run", "fm_latent", "1", *o])
    emoji_campaign.main(["tune", "fm_latent", *o])
    emoji_campaign.main(["score", "fm_latent", "1", *o])
    assert {p: p.stat().st_mtime_ns for p in written} == stamps


# ---- benchmarks/lora_digits.py -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_lora_digits_campaign_runs_each_documented_stage(tmp_path, tiny, children_in_process, monkeypatch,
                                                            capsys):
    """docs/benchmarks/lora_digits.md's commands in their order, one seed, on the tiny Fashion-MNIST and a tiny
    digits package (test_lora_digits's): prepare trains the base (2 steps), makes the digits' classifier and scores
    the base on Fashion-MNIST; cost gives each arm the reference arm's training CPU; each arm trains cost.json's
    steps from the base (scratch from nothing) and is scored: the digits' test split, the forgetting probe on
    Fashion-MNIST's, and what it cost (a LoRA run trains and stores fewer parameters than full fine-tuning); the
    report reads them; a second prepare, run or score does nothing."""
    from safetensors.torch import load_file
    from test_lora_digits import write_package

    from training.data import digits

    packages, out = tmp_path / "mnist", tmp_path / "out"
    monkeypatch.setattr(digits, "PINNED", write_package(packages))
    for name, value in {"DIGITS_CLASSIFIER": str(tmp_path / "classifiers" / "digits"),
                        "FASHION_CLASSIFIER": tiny.classifier, "COST_STEPS": 2, "REFERENCE_STEPS": 2,
                        "SEEDS": (0,), "DIGIT_SAMPLES": 10, "FASHION_SAMPLES": 10}.items():
        monkeypatch.setattr(lora_digits, name, value)
    o = ["--out", str(out), "--source", f"mnist_digits:{packages}"]
    lora_digits.main(["prepare", *o, *tiny.model, "--train.max_steps=2", "--val.every=2", "--ckpt.every=2"])
    base = json.loads((out / "base.json").read_text())["export"]
    assert base == str(out / "base" / "export") and (tmp_path / "classifiers" / "digits" / "classifier.json").is_file()
    before = json.loads((out / "base_fashion" / "report.json").read_text())
    assert before["num_samples"] == 10 and before["reference"]["source"] == "fashion_mnist"
    lora_digits.main(["cost", *o, *tiny.model])
    cost = json.loads((out / "cost.json").read_text())
    assert cost["steps"] == lora_digits.equal_cpu_steps(cost["cpu_s_per_step"], "full", 2)
    assert cost["steps"]["full"] == 2
    for arm in lora_digits.ARMS:
        lora_digits.main(["run", arm, "0", *o, *tiny.model])
        lora_digits.main(["score", arm, "0", *o, *tiny.model])
    capsys.readouterr()
    lora_digits.main(["report", *o])
    assert capsys.readouterr().out == (out / "report.md").read_text()

    scores = {arm: json.loads((out / f"{arm}_s0" / "scores.json").read_text()) for arm in lora_digits.ARMS}
    for arm in lora_digits.ARMS:
        run = out / f"{arm}_s0"
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["train"]["max_steps"] == scores[arm]["steps"] == cost["steps"][arm]
        assert cfg["init_from"] == (None if arm == "scratch" else base)
        assert cfg["train"]["lora_rank"] == lora_digits.RANKS.get(arm, 0)
        assert cfg["data"]["source"] == f"mnist_digits:{packages}"
        digits_report = json.loads((run / "eval" / "digits-test" / "report.json").read_text())
        assert (digits_report["num_samples"], digits_report["reference"]["split"]) == (10, "test")
        assert scores[arm]["fd_digits"] == lora_digits.metric(digits_report, "fd_classifier")
        fashion_report = json.loads((run / "eval" / "fashion-test" / "report.json").read_text())
        assert fashion_report["reference"]["source"] == "fashion_mnist"
        assert scores[arm]["accuracy_fashion"] == lora_digits.metric(fashion_report, "class_accuracy")
        assert scores[arm]["peak_memory_gb"] > 0 and scores[arm]["cpu_s_per_step"] > 0
        assert f"| {arm} | 0 | " in (out / "report.md").read_text()
    # LoRA trains the adapters and the digits' fresh class rows; its checkpoint holds them alone
    last = f"step_{cost['steps']['lora4']:08d}"
    lora4 = load_file(str(out / "lora4_s0" / "checkpoints" / last / "model.safetensors"))
    assert scores["lora4"]["trainable_parameters"] == sum(t.numel() for t in lora4.values())
    assert "conditioner.class_embed.weight" in lora4 and all(".lora_" in k for k in lora4 if "class_embed" not in k)
    assert scores["lora4"]["trainable_parameters"] < scores["full"]["trainable_parameters"] == \
        scores["scratch"]["trainable_parameters"]  # (rank 64 has more than this width-16 model: not compared)
    assert scores["lora4"]["trainable_parameters"] < scores["lora16"]["trainable_parameters"]
    assert scores["lora4"]["checkpoint_mb"] < scores["full"]["checkpoint_mb"]
    # The probe: the adapted model with the base's Fashion-MNIST class rows
    probe = load_file(str(out / "full_s0" / "fashion_probe" / "conditioner" / "diffusion_pytorch_model.safetensors"))
    theirs = load_file(str(Path(base) / "conditioner" / "diffusion_pytorch_model.safetensors"))
    assert np.array_equal(probe["class_embed.weight"][:10].numpy(), theirs["class_embed.weight"][:10].numpy())

    written = [*out.glob("*/cpu_seconds.json"), *out.glob("*/scores.json"), *out.glob("*/eval/*/report.json")]
    stamps = {p: p.stat().st_mtime_ns for p in written}
    lora_digits.main(["prepare", *o])
    lora_digits.main(["run", "lora4", "0", *o])
    lora_digits.main(["score", "lora4", "0", *o])
    assert {p: p.stat().st_mtime_ns for p in written if p.name != "scores.json"} == \
        {p: t for p, t in stamps.items() if p.name != "scores.json"}
