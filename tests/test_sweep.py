"""tools/sweep.py: expansion into runs, validation through the trainers' config path before anything runs, the
run folders' state, the SLURM side (submitit's sbatch text and the accelerate command of a task), a tiny sweep
run here end to end (then demo_quality.py --write and compare.py on it), and the submitit path through
submitit's LocalExecutor (its real job code) with a requeue after a planted SIGTERM and after its own
time-limit signal."""
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.nn as nn
from conftest import ROOT

sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "benchmarks")]
import compare  # noqa: E402
import sweep  # noqa: E402

TINY = {"data.demo_samples": 320, "data.val_holdout": 64, "train.batch_size": 16, "train.warmup_steps": 2,
        "val.steps": 2, "val.num_samples": 4, "val.loss_samples": 16, "log.wandb": "off", "log.every": 2,
        "val.every": 2, "ckpt.every": 2, "ckpt.keep": 3,  # conftest.tiny_run_args, with checkpoints to score
        "model.num_layers": 1, "model.num_attention_heads": 2, "model.attention_head_dim": 16}  # a sweep's plumbing


def write_sweep(tmp_path, **spec):
    spec.setdefault("out", str(tmp_path / "out"))
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(spec))
    return path


# ---- expansion ---------------------------------------------------------------------------------------------

def test_grid_times_seeds_expands_into_named_trainer_runs(tmp_path):
    spec = sweep.read_sweep(write_sweep(tmp_path, base=str(ROOT / "configs/demo.json"),
                                        overrides={"train.max_steps": 7},
                                        grid={"conditioning.mode": ["disentangled", "adanorm"],
                                              "train.lr": [1e-3, 3e-4]},
                                        seeds=[0, 1]))
    out, runs = sweep.expand(spec)
    assert out == tmp_path / "out" and len(runs) == 8
    assert [r["name"] for r in runs[:3]] == ["conditioning.mode=disentangled,train.lr=0.001,seed=0",
                                             "conditioning.mode=disentangled,train.lr=0.001,seed=1",
                                             "conditioning.mode=disentangled,train.lr=0.0003,seed=0"]
    run = runs[-1]
    assert run["method"] == "flow_matching" and run["params"] == {"conditioning.mode": "adanorm", "train.lr": 3e-4}
    assert run["argv"] == ["--config", str(ROOT / "configs/demo.json"), "--train.max_steps=7",
                           '--conditioning.mode="adanorm"', "--train.lr=0.0003", "--seed=1",
                           "--run_dir", str(out / run["name"]), "--resume", "latest"]


def test_a_dry_run_prints_pasteable_commands_and_ends_with_a_summary(tmp_path, capsys):
    import shlex

    path = write_sweep(tmp_path, grid={"method": ["flow_matching", "ddpm"]}, seeds=[0], overrides=TINY)
    runs = sweep.main([str(path), "--dry_run"])
    lines = capsys.readouterr().out.splitlines()
    commands = [line.split(": ", 1)[1] for line in lines if line.startswith("new ")]
    assert len(commands) == 2
    for run, command in zip(runs, commands):
        words = shlex.split(command)  # what a shell would run: python, the trainer, its arguments
        assert words[:2] == ["python", str(ROOT / f"train_{run['method']}.py")] and words[2:] == run["argv"]
    assert lines[-1] == "dry run: nothing was run; 2 of 2 runs would run (--local here, or on SLURM without it)"
    assert not (tmp_path / "out").exists()


def test_random_draws_are_reproducible_in_range_and_named_by_their_value(tmp_path):
    keys = {"train.lr": {"log_uniform": [1e-4, 1e-2]}, "objective.logit_std": {"uniform": [0.5, 1.5]},
            "model.num_layers": {"int_uniform": [1, 3]}, "val.sampler": {"choice": ["euler", "heun"]}}
    spec = sweep.read_sweep(write_sweep(tmp_path, grid={"method": ["flow_matching"]},
                                        random={"count": 20, "seed": 3, "keys": keys}))
    first, again = sweep.settings(spec), sweep.settings(spec)
    assert first == again and len(first) == 20
    for s in first:
        assert 1e-4 <= s["train.lr"] <= 1e-2 and s["train.lr"] == float(f"{s['train.lr']:.4g}")
        assert 0.5 <= s["objective.logit_std"] <= 1.5 and s["model.num_layers"] in (1, 2, 3)
        assert s["val.sampler"] in ("euler", "heun")
    assert {s["model.num_layers"] for s in first} == {1, 2, 3}  # both ends included
    runs = sweep.expand(spec)[1]
    assert f"train.lr={first[0]['train.lr']}" in runs[0]["name"] and \
        f"--train.lr={first[0]['train.lr']}" in runs[0]["argv"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("sweep_*.json")), ids=lambda p: p.stem)
def test_the_sweep_files_in_configs_expand_into_valid_runs(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # their base recipes are named from the repository root
    spec, out, runs = sweep.prepare(path, write=False)
    arms = {json.dumps(r["params"], sort_keys=True) for r in runs}  # sweep_methods: 2 arms, sweep_conditioning: 3
    assert len(runs) == 3 * len(arms) and len(arms) >= 2 and all(r["config"]["seed"] == r["seed"] for r in runs)
    assert len({r["seed"] for r in runs}) == 3 and sweep.executor_parameters(spec, len(runs))["tasks_per_node"] == 1


@pytest.mark.parametrize("spec, message", [
    ({"grid": {"train.lr": [1e-3]}, "sedes": [0]}, "unknown key 'sedes'"),
    ({"grid": {"train.lr": 1e-3}}, "'grid' must map each key to a non-empty list"),
    ({"grid": {"train.lr": [1e-3]}, "seeds": [0, 0]}, "distinct whole numbers"),
    ({"grid": {"seed": [0, 1]}}, "'seed' is set by the sweep for each run; use 'seeds'"),
    ({"random": {"count": 2, "keys": {"train.lr": {"gaussian": [0, 1]}}}}, "random.keys.train.lr"),
    ({"random": {"count": 2, "keys": {"train.lr": {"log_uniform": [0, 1]}}}}, "log_uniform needs low > 0"),
    ({"grid": {"method": ["flow_matching", "edm"]}}, "method='edm' must be one of"),
    ({"grid": {"train.lr": [1e-3]}, "slurm": {"gpus": 8}}, "slurm.gpus is not a SLURM setting"),
    ({"seeds": [0]}, "name what varies"),
])
def test_bad_sweep_files_are_refused_naming_the_key(tmp_path, spec, message):
    with pytest.raises(sweep.SweepError, match=message.replace("(", r"\(").replace(".", r"\.")):
        sweep.read_sweep(write_sweep(tmp_path, **spec))


# ---- validation through the trainers' own config path, before anything runs or is submitted ---------------

@pytest.mark.parametrize("grid, key, message", [
    ({"train.lrr": [1e-3, 1e-4]}, "train.lrr", "unknown config key 'train.lrr'"),
    ({"conditioning.mode": ["disentangled", "film"]}, "conditioning.mode", "conditioning.mode='film' must be"),
    ({"method": ["flow_matching", "ddpm"], "objective.min_snr_gamma": [5.0]}, "objective.min_snr_gamma",
     "unknown config key 'objective.min_snr_gamma'"),  # a DDPM key: the flow-matching runs refuse it
])
def test_an_invalid_run_stops_the_sweep_before_anything_runs_naming_run_and_key(tmp_path, monkeypatch,
                                                                                grid, key, message):
    monkeypatch.setattr(sweep, "make_executor", lambda *a, **k: pytest.fail("an executor was made"))
    monkeypatch.setattr(sweep, "run_local", lambda *a, **k: pytest.fail("a run was started"))
    path = write_sweep(tmp_path, grid=grid, seeds=[0, 1])
    for mode in ([], ["--local"]):
        with pytest.raises(SystemExit) as e:
            sweep.main([str(path), *mode])
        text = str(e.value)
        assert "nothing was run or submitted" in text and message in text and key in text
        bad = [line for line in text.splitlines() if line.strip().startswith("run ")]
        assert bad and all(",seed=" in line for line in bad)  # each bad run named
    assert not (tmp_path / "out").exists()


def test_a_run_folder_made_with_another_config_is_an_error_and_a_finished_one_is_skipped(tmp_path):
    path = write_sweep(tmp_path, grid={"conditioning.mode": ["adanorm"]}, overrides={"train.max_steps": 5})
    spec, out, runs = sweep.prepare(path)
    assert [r["state"] for r in runs] == ["new"] and json.loads((out / "sweep.json").read_text())["swept"] == \
        ["conditioning.mode"]
    run_dir = Path(runs[0]["run_dir"])
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({**runs[0]["config"], "resume": None}))
    (run_dir / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    assert sweep.prepare(path)[2][0]["state"] == "interrupted"
    (run_dir / "export").mkdir()
    (run_dir / "export" / "config.json").write_text(json.dumps(runs[0]["config"]))
    assert sweep.prepare(path)[2][0]["state"] == "interrupted"  # no report yet: the run's last act
    (run_dir / "report.md").write_text("# report\n")
    assert sweep.prepare(path)[2][0]["state"] == "finished"
    assert sweep.run_local(sweep.prepare(path)[2]) == []  # nothing to run
    path = write_sweep(tmp_path, grid={"conditioning.mode": ["adanorm"]}, overrides={"train.max_steps": 9})
    with pytest.raises(sweep.SweepError, match=r"train\.max_steps: 5 there, 9 now"):
        sweep.prepare(path)


def test_a_rerun_compares_keys_left_none_and_keys_added_since(tmp_path):
    """The rerun check skipped every key whose wanted value is None, and every key the folder's config lacks: a run
    from before conditioning.pooled_text (the pooled text on) resumed as one with it off (None). data.num_classes left
    None is still the trainer's to fill."""
    path = write_sweep(tmp_path, grid={"conditioning.mode": ["disentangled"]}, overrides={"train.max_steps": 5})
    run = sweep.prepare(path)[2][0]
    assert run["config"]["conditioning"]["pooled_text"] is None and run["config"]["data"]["num_classes"] is None
    saved = json.loads(json.dumps({**run["config"], "resume": None}))
    saved["data"]["num_classes"] = 9  # read from the data by the trainer
    Path(run["run_dir"]).mkdir(parents=True)
    for pooled, message in (("absent", r"conditioning\.pooled_text: True there, None now"),
                            (False, r"conditioning\.pooled_text: False there, None now"), (None, None)):
        saved["conditioning"].pop("pooled_text", None)
        saved["conditioning"].update({} if pooled == "absent" else {"pooled_text": pooled})
        (Path(run["run_dir"]) / "config.json").write_text(json.dumps(saved))
        if message:
            with pytest.raises(sweep.SweepError, match=message):
                sweep.prepare(path)
        else:
            assert sweep.prepare(path)[2][0]["state"] == "new"


def test_a_rerun_resumes_runs_whose_batch_the_trainer_resolved_from_global_batch(tmp_path):
    """train.global_batch: the trainer writes the resolved micro-batch, accumulation and checkpointing to the run's
    config.json (fit.plan_batch). A rerun compares like with like and resumes those runs; a real change is still an
    error, and its message never advises deleting the folder (its checkpoints)."""
    import torch

    import common
    from training.run import fit
    from training.run.start import build_for_run

    fixed = {"train.global_batch": 32, "train.max_steps": 5, "data.num_classes": 9, "model.num_layers": 2,
             "model.num_attention_heads": 2, "model.attention_head_dim": 16}
    path = write_sweep(tmp_path, grid={"train.batch_size": ["auto", 8]}, overrides=fixed)
    runs = sweep.prepare(path)[2]
    # what each run's trainer wrote at its start (auto: the choice a probe made, 16 with checkpointing)
    for run in runs:
        cfg, run_dir = sweep.resolve_config(run["method"], run["argv"]), Path(run["run_dir"])
        ckpt = run_dir / "checkpoints" / "step_00000002"
        ckpt.mkdir(parents=True)
        torch.save({"step": 2, "config": {"train": {"batch_size": 16, "gradient_checkpointing": True}}},
                   ckpt / "state.pt")
        fit.plan_batch(cfg, common.make_accelerator("no"), build_for_run(cfg, (3, 16, 16)), None, None,
                       ckpt=ckpt if cfg.train.batch_size == "auto" else None)
    saved = [json.loads((Path(r["run_dir"]) / "config.json").read_text())["train"] for r in runs]
    assert [(t["batch_size"], t["grad_accum"], t["gradient_checkpointing"]) for t in saved] == \
        [(16, 2, True), (8, 4, False)]
    assert [r["state"] for r in sweep.prepare(path)[2]] == ["interrupted", "interrupted"]  # resumed, not refused
    path = write_sweep(tmp_path, grid={"train.batch_size": ["auto", 8]}, overrides={**fixed, "train.global_batch": 64})
    with pytest.raises(sweep.SweepError, match=r"train\.global_batch: 32 there, 64 now") as error:
        sweep.prepare(path)
    assert "delete" not in str(error.value) and "another 'out'" in str(error.value)


# ---- the SLURM side --------------------------------------------------------------------------------------

def test_slurm_parameters_reach_submitits_sbatch_file(tmp_path, monkeypatch):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 0\n")  # submitit's SlurmExecutor only checks that srun exists
    (fake_bin / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    spec = {"out": str(tmp_path / "sw"), "slurm": {"nodes": 2, "gpus_per_node": 8, "cpus_per_task": 80,
                                                  "time_min": 120, "partition": "gpu", "account": "lab"}}
    executor = sweep.make_executor(spec, tmp_path / "submitit", num_runs=6)
    text = executor._executor._make_submission_file_text("python -m submitit.core._submit X", "uid")
    for line in ("--nodes=2", "--gpus-per-node=8", "--ntasks-per-node=1", "--cpus-per-task=80", "--time=120",
                 "--partition=gpu", "--account=lab", "--signal=USR2@300", "--job-name=sw"):
        assert f"#SBATCH {line}\n" in text, line
    assert executor._executor.max_num_timeout == 30


def test_a_task_launches_accelerate_over_its_nodes_gpus_or_the_trainer_alone():
    from accelerate.commands.launch import launch_command_parser

    run = {"method": "ddpm", "argv": ["--seed=1", "--run_dir", "/r/x", "--resume", "latest"]}
    env = SimpleNamespace(num_nodes=2, node=1, hostnames=["node-a", "node-b"], raw_job_id="4242")
    cmd = sweep.launch_command(run, env, gpus_per_node=8)
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    args = launch_command_parser().parse_args(cmd[3:])
    assert (args.num_machines, args.num_processes, args.machine_rank) == (2, 16, 1)
    assert (args.main_process_ip, args.main_process_port, args.multi_gpu) == ("node-a", 24242, True)
    assert args.training_script == str(ROOT / "train_ddpm.py") and args.training_script_args == run["argv"]
    alone = sweep.launch_command(run, SimpleNamespace(num_nodes=1, node=0, hostnames=["n"], raw_job_id="1"), 1)
    assert alone == [sys.executable, str(ROOT / "train_ddpm.py"), *run["argv"]]


@pytest.mark.parametrize("code", [1, sweep.REQUEUE_EXIT_CODE])
def test_a_task_whose_run_fails_with_an_ordinary_error_is_not_requeued(tmp_path, monkeypatch, code):
    """RunTask on its node: a trainer that exits 75 (checkpoint written after a stop signal) is requeued through
    submitit's signal; one that fails with any other code (a bug, bad data) fails the task with its exit code
    and is never requeued, so a broken run does not loop on the cluster."""
    import submitit

    class Env:
        USR_SIG, global_rank, num_nodes, node, raw_job_id, hostnames = "USR2", 0, 1, 0, "1", ["localhost"]

    kills = []
    monkeypatch.setattr(submitit, "JobEnvironment", Env)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # RunTask's SIGTERM handler: not in the test process
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(sig))  # submitit's requeue signal, recorded
    monkeypatch.setattr(sweep, "launch_command",
                        lambda run, env, gpus: [sys.executable, "-c", f"raise SystemExit({code})"])
    run = {"name": "r", "run_dir": str(tmp_path / "r"), "max_steps": 5, "report": True}
    with pytest.raises(RuntimeError, match=f"run r failed: exit code {code}"):  # (75: the signal was only recorded)
        sweep.RunTask()(run)
    assert kills == ([signal.SIGUSR2] if code == sweep.REQUEUE_EXIT_CODE else [])


def test_process_tree_finds_descendants_in_other_sessions():
    parent = subprocess.Popen(["sh", "-c", "setsid sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.time() + 10
        while len(sweep.process_tree(parent.pid)) < 3 and time.time() < deadline:
            time.sleep(0.05)
        tree = sweep.process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 3
    finally:
        sweep.signal_tree(parent.pid, signal.SIGKILL)
        parent.wait()


# ---- end to end --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_local_sweep_of_two_values_and_two_seeds_reruns_skip_and_resume_then_compare(tmp_path, capfd, monkeypatch,
                                                                                      unrendered_figures):
    import demo_quality

    overrides = {**TINY, "data.cache_dir": str(tmp_path / "cache"), "train.max_steps": 4}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the trainers inherit it: 2 busy cores, no thread thrashing
    path = write_sweep(tmp_path, grid={"method": ["flow_matching", "ddpm"]}, seeds=[0, 1], overrides=overrides)
    done = sweep.main([str(path), "--local"])
    assert f"sweep: 4 run(s) done here, 0 finished before; compare them: python tools/compare.py {tmp_path / 'out'}" \
        in capfd.readouterr().out
    assert [r["name"] for r in done] == ["method=flow_matching,seed=0", "method=flow_matching,seed=1",
                                         "method=ddpm,seed=0", "method=ddpm,seed=1"]
    for run in done:
        run_dir = Path(run["run_dir"])
        cfg = json.loads((run_dir / "config.json").read_text())
        assert cfg["seed"] == run["seed"] and cfg["train"]["max_steps"] == 4
        assert ("time_sampling" in cfg["objective"]) == (run["method"] == "flow_matching")
        assert sweep.finished(run_dir, 4) and (run_dir / "export" / "transformer").is_dir()
    capfd.readouterr()

    assert sweep.main([str(path), "--local"]) == []  # everything finished: nothing runs
    assert "4 runs in" in capfd.readouterr().out
    resumed = Path(done[2]["run_dir"])
    for name in ("export", "report.md"):  # as if stopped before its export: the rerun resumes, only it
        subprocess.run(["rm", "-r", str(resumed / name)], check=True)
    again = sweep.main([str(path), "--local"])
    assert [r["name"] for r in again] == ["method=ddpm,seed=0"] and sweep.finished(resumed, 4)
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000004'} at step 4" in capfd.readouterr().out

    # Scores per checkpoint, as benchmarks/demo_quality.py --write does (an untrained CNN: fast), then compare.
    monkeypatch.setattr(demo_quality, "train_classifier", lambda steps, resolution: (
        nn.Sequential(nn.Conv2d(3, 9, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval(), 0.5))
    demo_quality.main([r["run_dir"] for r in done] + ["--checkpoints", "--write", "--per_class", "1"])
    scored = [json.loads(line) for line in (resumed / "quality.jsonl").read_text().splitlines()]
    assert [row["step"] for row in scored] == [2, 4] and all(0 <= row["class_accuracy"] <= 1 for row in scored)
    md = compare.main([str(tmp_path / "out")]).read_text()
    assert "Swept: method (method brings val.sampler along)." in md and \
        "**A = method=flow_matching, B = method=ddpm**" in md
    assert "Too few seeds for a verdict: 2 paired seeds" in md and "| class_accuracy | 8 | 4 |" in md
    for plot in ("evolution_val_loss", "evolution_class_accuracy", "sensitivity", "hypothesis",
                 "correlation", "methods"):
        assert (tmp_path / "out" / "compare" / f"{plot}.png").is_file(), plot


def wait_for(condition, what, job=None, timeout=600):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert job is None or not job.done(), \
            f"the job ended before {what}: {Path(job.paths.stderr).read_text()[-2000:]}"
        time.sleep(0.1)


def training_rows(run_dir):
    metrics = Path(run_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if metrics.exists() else []


@pytest.mark.slow
def test_submitit_task_requeues_after_sigterm_and_its_time_limit_signal_and_resumes(tmp_path, monkeypatch):
    """submitit's LocalExecutor runs the real job code (pickle, JobEnvironment, signal handlers, requeue). First a
    SIGTERM to the job, as a preemption: the task passes it on, the trainer checkpoints and exits 75, the task
    requeues through submitit. Then submitit's own time-limit signal (USR2) to the task: checkpoint() stops the
    trainer (USR1) and returns the task to run again. The run ends as one uninterrupted run would."""
    # 400 steps: the tiny model trains about 100 a second, and the second stop must land before the run's end on
    # busy cores too (at 30 steps it once arrived after the export: the run finished instead, as it should)
    overrides = {**TINY, "data.cache_dir": str(tmp_path / "cache"), "train.max_steps": 400, "val.every": 1000,
                 "ckpt.every": 1000}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the job's processes inherit it: 2 busy cores, no thread thrashing
    spec, out, runs = sweep.prepare(write_sweep(tmp_path, grid={"conditioning.mode": ["adanorm"]}, overrides=overrides))
    job = sweep.submit(spec, out, runs, cluster="local")[0]
    run_dir = runs[0]["run_dir"]
    try:
        wait_for(lambda: training_rows(run_dir), "the first training rows", job)
        os.kill(job._process.pid, signal.SIGTERM)  # the controller passes it to the task, as SLURM to every process
        wait_for(lambda: Path(job.paths.stdout).read_text().count("resumed from") == 1,
                 "the requeued task's resume", job)
        first_stop = len(training_rows(run_dir))
        wait_for(lambda: len(training_rows(run_dir)) > first_stop, "training after the resume", job)
        task = next(p for p in sweep.process_tree(job._process.pid)[1:] if "submitit.core._submit" in
                    Path(f"/proc/{p}/cmdline").read_text())
        os.kill(task, signal.SIGUSR2)  # submitit's time-limit signal (signal_delay_s before the limit)
        wait_for(job.done, "the job's end")
    finally:  # a failed wait must not leave the job training
        sweep.signal_tree(job._process.pid, signal.SIGKILL)

    assert job.result() == run_dir and sweep.finished(run_dir, 400)
    log = Path(job.paths.stdout).read_text()
    assert log.count("Requeued job") == 2 and log.count("Calling checkpoint method") == 2
    assert log.count("exiting with code 75") == 2 and log.count("resumed from") == 2
    steps = [r["step"] for r in training_rows(run_dir)]
    assert steps == list(range(2, 401, 2))  # every logged step once: rows past a checkpoint were set aside
