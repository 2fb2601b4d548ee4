"""Launch files: the accelerate configs load through accelerate's own classes and launch parser, and the SLURM
script gives every task its rank and requeues the job exactly when the trainers exit with REQUEUE_EXIT_CODE; the
sharded one (slurm_fsdp.sbatch) is that script with train.sharding=fsdp and the allocator setting added.
SLURM is faked by small stubs on PATH (srun runs the tasks one after another and returns the highest exit code,
as the real one does; scontrol records what it is asked)."""
import json
import os
import stat
import subprocess

import pytest

import common
from conftest import ROOT

LAUNCH = ROOT / "launch"


@pytest.mark.parametrize("name, machines, processes, multi_gpu", [
    ("accelerate_1gpu.yaml", 1, 1, False), ("accelerate_8gpu.yaml", 1, 8, True),
    ("accelerate_2x8gpu.yaml", 2, 16, True)])
def test_accelerate_configs_load_with_accelerates_config_classes(name, machines, processes, multi_gpu):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config = load_config_from_file(str(LAUNCH / name))  # refuses unknown keys
    assert isinstance(config, ClusterConfig)
    assert (config.num_machines, config.num_processes, config.mixed_precision) == (machines, processes, "bf16")
    assert config.distributed_type.value == ("MULTI_GPU" if multi_gpu else "NO") and not config.use_cpu
    # What `accelerate launch --config_file ...` makes of it; command-line options still win (the node's rank).
    args = launch_command_parser().parse_args(["--config_file", str(LAUNCH / name), "--machine_rank", "1",
                                               "train_flow_matching.py", "--config", "configs/imagenet256.json"])
    _validate_launch_command(args)
    assert (args.num_machines, args.num_processes, args.multi_gpu) == (machines, processes, multi_gpu)
    assert args.mixed_precision == "bf16" and args.machine_rank == 1 and not args.use_cpu


SCRIPTS = ["slurm.sbatch", "slurm_fsdp.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_script_is_valid_bash(script):
    subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


STUBS = {
    "scontrol": """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu-node-1\\ngpu-node-2\\n'; exit 0; fi
echo "$*" >> "$STUB_DIR/scontrol.log"
""",
    # 2 nodes x 2 tasks, one after another; exit code: the highest of the tasks (srun's rule).
    "srun": """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
echo $PPID > "$STUB_DIR/srun_parent"  # the shell that runs srun: SLURM's batch shell only if nothing is in between
if [ -n "${STUB_TERM_BATCH:-}" ]; then kill -TERM $PPID; sleep 0.2; fi  # preemption: TERM to the batch shell
highest=0
for node in 0 1; do for local in 0 1; do
    SLURM_PROCID=$((node * 2 + local)) SLURM_LOCALID=$local SLURM_NODEID=$node "$@"
    code=$?; [ $code -gt $highest ] && highest=$code
done; done
exit $highest
""",
    "python": """#!/bin/bash
python3 - "$@" <<'EOF'
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
        "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OMP_NUM_THREADS", "SRUN_CPUS_PER_TASK",
        "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"]
record = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}
with open(os.path.join(os.environ["STUB_DIR"], f"task_{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
EOF
exit $STUB_EXIT
""",
}


def run_sbatch(tmp_path, exit_code, term_batch=False, script="slurm.sbatch"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_DIR": str(tmp_path),
           "STUB_EXIT": str(exit_code), "SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "gpu-node-[1-2]",
           "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "12", "HOME": str(tmp_path),
           "SLURM_SUBMIT_DIR": str(ROOT)}  # sbatch runs a copy of the script; the submit directory is the repository
    for key in ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OMP_NUM_THREADS", "PYTORCH_ALLOC_CONF",
                "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(key, None)
    if term_batch:
        env["STUB_TERM_BATCH"] = "1"
    cmd = ["bash", str(LAUNCH / script), "train_ddpm.py", "--config", "configs/imagenet256.json",
           "--train.grad_accum=2"]
    with subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        stdout, stderr = p.communicate(timeout=60)
    done = subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)
    done.batch_shell_runs_srun = (tmp_path / "srun_parent").read_text().strip() == str(p.pid)
    log = tmp_path / "scontrol.log"
    return done, (log.read_text().splitlines() if log.exists() else [])


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("exit_code, requeued", [(common.REQUEUE_EXIT_CODE, True), (0, False), (1, False)])
def test_sbatch_requeues_exactly_on_the_requeue_exit_code(tmp_path, exit_code, requeued, script):
    done, scontrol = run_sbatch(tmp_path, exit_code, script=script)
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert scontrol == (["requeue 4321"] if requeued else [])


def test_sbatch_gives_every_task_its_rank_and_the_environment(tmp_path):
    run_sbatch(tmp_path, 0)
    tasks = [json.loads((tmp_path / f"task_{rank}.json").read_text()) for rank in range(4)]
    for rank, task in enumerate(tasks):
        assert task["argv"] == ["train_ddpm.py", "--config", "configs/imagenet256.json", "--train.grad_accum=2",
                                "--resume", "latest"]
        assert task["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4",
                               "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(rank // 2), "MASTER_ADDR": "gpu-node-1",
                               "MASTER_PORT": str(20000 + 4321 % 10000),
                               "HF_HOME": str(tmp_path / ".cache/huggingface"), "HF_HUB_OFFLINE": "1",
                               "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                               "SRUN_CPUS_PER_TASK": "12", "PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": None}


@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_survives_sigterm_to_the_batch_shell_and_still_requeues(tmp_path, script):
    """Preemption sends TERM to the batch script too, while srun runs; the script must outlive it."""
    done, scontrol = run_sbatch(tmp_path, common.REQUEUE_EXIT_CODE, term_batch=True, script=script)
    assert "SIGTERM to the batch script" in done.stdout
    assert done.returncode == common.REQUEUE_EXIT_CODE and scontrol == ["requeue 4321"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_without_a_command_prints_its_usage(tmp_path, script):
    done = subprocess.run(["bash", str(LAUNCH / script)], capture_output=True, text=True,
                          env={**os.environ, "SLURM_JOB_ID": "1", "SLURM_SUBMIT_DIR": str(ROOT)})
    assert done.returncode == 2 and f"usage: sbatch launch/{script} " in done.stderr


@pytest.mark.slow
def test_the_sharded_script_runs_the_same_tasks_with_sharding_on_and_expandable_segments(tmp_path):
    (tmp_path / "ddp").mkdir(), (tmp_path / "fsdp").mkdir()
    batch_ddp, _ = run_sbatch(tmp_path / "ddp", 0)
    batch_fsdp, _ = run_sbatch(tmp_path / "fsdp", 0, script="slurm_fsdp.sbatch")
    for rank in range(4):
        ddp, fsdp = (json.loads((tmp_path / run / f"task_{rank}.json").read_text()) for run in ("ddp", "fsdp"))
        assert fsdp["argv"] == ["train_ddpm.py", "--config", "configs/imagenet256.json", "--train.grad_accum=2",
                                "--train.sharding=fsdp", "--resume", "latest"]
        # both names: torch 2.6 (requirements.txt's floor) reads only PYTORCH_CUDA_ALLOC_CONF
        assert fsdp["env"]["PYTORCH_ALLOC_CONF"] == fsdp["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        same = lambda env: {k: v for k, v in env.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                                                      "HF_HOME")}
        assert same(fsdp["env"]) == same(ddp["env"]) and fsdp["env"]["RANK"] == str(rank)
    # SLURM's TERM at preemption goes to the batch shell, which must be the one that traps it and requeues: the
    # sharded script hands over with exec, not as a child (whose parent would die on the spot).
    assert batch_ddp.batch_shell_runs_srun and batch_fsdp.batch_shell_runs_srun


def test_the_sharded_script_asks_slurm_for_what_the_plain_one_asks():
    """sbatch reads #SBATCH lines from the file submitted, so the sharded script repeats them: they must agree."""
    directives = lambda name: [l for l in (LAUNCH / name).read_text().splitlines() if l.startswith("#SBATCH")]
    assert directives("slurm_fsdp.sbatch") == directives("slurm.sbatch") and len(directives("slurm.sbatch")) == 10
