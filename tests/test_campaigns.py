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
import resource
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import ttest_rel

from benchmarks import buckets
from benchmarks import fashion_mnist as bench
from conftest import ROOT
from training.data import fashion_mnist

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
