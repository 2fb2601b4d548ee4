"""Small run helpers that both trainers call the same way (the config is training/config/'s): accelerator and
ranks, whether the output is a terminal, stop signals, EMA and sharded tensors, the LR schedule and its scaling
rule, the resolution time shift.

The ground floor: nothing here imports from the package (training/, tools/), and nothing knows about an
objective, a sampler, the data or the model: those live in the trainers, training/data/ and training/model/.
Checkpoints are training/run/checkpoints.py's; what a training step measures is training/run/monitor.py's; what a
run writes (config.json, metrics.jsonl, sample grids, wandb, the report) is training/record/'s.
"""
import contextlib
import math
import os
import signal
import sys

import numpy as np
import torch


# ----------------------------------------------------------------------------------------------------------
# Accelerator and ranks.


def make_accelerator(mixed_precision, timeout_minutes=30):
    """The Accelerator every script uses. cpu=True without CUDA: `accelerate launch --multi_gpu` then forms
    one gloo group of CPU processes; otherwise accelerate 1.x lets each process silently train alone, which
    is also refused here. TF32 matmuls and convolutions on Ampere and newer (fp32 work at tensor-core speed).
    DDP: gradients are views into its all-reduce buckets (no second copy of the gradients in memory, as long
    as they are zeroed in place, never set to None). Its static_graph stays off: it fails under no_sync
    accumulation (an internal assert in the reducer), and with find_unused_parameters off DDP already skips
    the per-step search for unused parameters. timeout_minutes (train.timeout_minutes): how long a collective
    waits for a slow rank (a checkpoint written to slow shared storage, a cache being built) before the run
    fails; NCCL's own default is 10 minutes."""
    from datetime import timedelta

    from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

    handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True),
                InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))]
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available(),
                              kwargs_handlers=handlers)
    world = accelerator.num_processes
    if world != int(os.environ.get("WORLD_SIZE", world)):
        raise RuntimeError(f"launched {os.environ['WORLD_SIZE']} processes but accelerate formed a group of {world}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return accelerator


def same_on_every_rank(module, accelerator):
    """Rank 0's weights in `module` on every rank. DDP broadcasts the model it wraps; the EMA, copied from each
    rank's own model before that (every rank builds it from its own seed), needs the same, since every rank
    samples its share of validation and FID with it."""
    if accelerator.num_processes > 1:
        for tensor in module.state_dict().values():
            torch.distributed.broadcast(tensor, src=0)


def share_of(n, accelerator, rank=None):
    """This rank's (or `rank`'s) contiguous share of n rows, a slice: ceil(n / world) rows, fewer for the last."""
    per, rank = -(-n // accelerator.num_processes), accelerator.process_index if rank is None else rank
    return slice(min(n, rank * per), min(n, (rank + 1) * per))


def split_over_ranks(work, n, accelerator):
    """work(rows) -> a tensor of len(rows) rows, run by each rank on its share (share_of) of n rows, the shares
    gathered in order on every rank: the result of one process, computed by all (validation samples)."""
    per, rows = -(-n // accelerator.num_processes), share_of(n, accelerator)
    out = work(rows)
    if accelerator.num_processes == 1:
        return out
    padded = torch.cat([out, out.new_zeros(per - len(out), *out.shape[1:])])  # gather wants equal shapes
    return accelerator.gather(padded)[:n]


def my_batches(num_samples, batch_size, rank, world):
    """Sample indices cut into fixed batches [b B, (b + 1) B), dealt to the ranks round robin: this rank's list
    (sampling and feature extraction at scale, whose results do not depend on the process count)."""
    starts = range(0, num_samples, batch_size)
    return [list(range(s, min(s + batch_size, num_samples))) for s in starts][rank::world]


def gathered(pairs):
    """[(index, row)] from every rank -> rows in index order, on every rank (a collective)."""
    from accelerate.utils import gather_object

    return np.stack([row for _, row in sorted(gather_object(pairs), key=lambda p: p[0])])


def interactive():
    """Whether both output streams are a terminal (tqdm draws on stderr, the lines go to stdout); not in SLURM's
    or nohup's log files, nor with `> log.txt`."""
    return sys.stdout.isatty() and sys.stderr.isatty()


# ----------------------------------------------------------------------------------------------------------
# Stop signals, requeue, and the end of a run.

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; launch/slurm.sbatch requeues the job on it


def ignore_stop_signals(worker_id=None):
    """DataLoader workers leave SIGTERM / SIGUSR1, and a terminal's Ctrl-C (SIGINT, sent to the whole foreground
    process group), to the training process, which checkpoints and exits."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class StopSignals:
    """SIGTERM / SIGUSR1 (preemption) and a first Ctrl-C (SIGINT) are recorded, not obeyed at once. Installed on the
    first line of main(), so from there on a signal always ends the run with REQUEUE_EXIT_CODE at the next safe
    point: during the cache build after the shards in progress (the build resumes from finished shards), in the
    loop after the step and its checkpoint, after training once the export is complete. The scheduler then
    requeues, and --resume latest continues (a laptop's relaunch too). A second Ctrl-C stops at once
    (KeyboardInterrupt, no checkpoint). `accelerate launch` forwards one SIGINT to each rank (its workers run in
    their own session, away from the terminal), so every rank stops at the same step, as with SIGTERM."""

    def __init__(self):
        self.received = []
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: self.received.append(signum))
        signal.signal(signal.SIGINT, self.interrupt)

    def interrupt(self, signum, frame):
        """Ctrl-C: the first is a stop like SIGTERM's, said at once on one line (os.write: a print could land
        inside another print of this thread, which Python refuses); the second raises KeyboardInterrupt."""
        if signal.SIGINT in self.received:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt("a second Ctrl-C: stopped at once, without a checkpoint")
        self.received.append(signum)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per machine, not one per rank
            os.write(sys.stderr.fileno(), f"\n{CTRL_C}\n".encode())

    def agreed(self, accelerator):
        """Whether to stop now; whichever ranks got the signal, all stop at the same step."""
        stop = torch.tensor(float(bool(self.received)), device=accelerator.device)
        if accelerator.num_processes > 1:
            stop = accelerator.reduce(stop, "sum")
        return bool(stop)

    def exit_if_agreed(self, accelerator, during):
        """At a safe point outside the loop (nothing to checkpoint): exit for a requeue if any rank got a signal."""
        if self.agreed(accelerator):
            requeue(accelerator, f"during {during}:")


CTRL_C = (f"Ctrl-C: stopping at the next safe point (in training: the next log step, with a checkpoint), exit code "
          f"{REQUEUE_EXIT_CODE}; --resume latest continues. Ctrl-C again stops at once, without a checkpoint")


def stopped_at_once(error):
    """The end of a run that a second Ctrl-C stopped (StopSignals.interrupt's KeyboardInterrupt): one line, not a
    traceback, and the shell's exit code for SIGINT, 128 + 2."""
    print(f"{error}; --resume latest continues from the last one", file=sys.stderr)
    return 128 + signal.SIGINT


def exit_for_requeue(accelerator, step):
    """In the loop, once the checkpoint of `step` is written."""
    requeue(accelerator, f"at step {step}: checkpoint written;")


def requeue(accelerator, when):
    accelerator.print(f"stopped by a signal {when} exiting with code {REQUEUE_EXIT_CODE} so the scheduler can "
                      f"requeue (--resume latest continues)")
    end_processes(accelerator, REQUEUE_EXIT_CODE)
    sys.exit(REQUEUE_EXIT_CODE)


def end_processes(accelerator, exit_code=0):
    """The last step of a run on every rank: wait for the others, then close the process group.

    The barrier makes the ranks leave together (no rank exits while rank 0 still writes the export or report),
    and it is also what keeps a multi-process CPU (gloo) run from aborting at exit. Once torch._dynamo is
    imported the gloo group outlives destroy_process_group, and its worker thread frees each finished
    collective's tensors only after taking the GIL; if the interpreter is already shutting down by then, the
    thread is killed inside a C++ destructor and the process dies with SIGABRT ("terminate called without an
    active exception"; seen in about 1 in 60 two-process test runs on 2 busy cores, core dump in
    docs/tests.md). Waiting in the barrier releases the GIL for that thread, and the barrier's own tensors
    have no Python objects to free. The barrier made it rare, not impossible (1 abort in 3 suites of about 20
    two-process runs each, 2026-12-02, on idle cores), so a process of a multi-process run then leaves at once,
    `exit_code` with its output flushed, without the interpreter's teardown where the abort happens: everything it
    wrote is closed by then (the run's last act is this call), wandb included (finish_wandb)."""
    several = accelerator.num_processes > 1
    accelerator.wait_for_everyone()
    accelerator.end_training()
    finish_wandb(exit_code)
    if several:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(exit_code)


def finish_wandb(exit_code):
    """Close the run log's wandb run if one is open: a finished run's RunLog.finish closed it already, a requeue
    leaves from inside the loop. os._exit skips the interpreter's teardown, which used to flush its last rows to the
    server or the offline file; a requeued segment (exit code 75) is marked preempting, not left to show crashed."""
    wandb = sys.modules.get("wandb")  # never imported here: a run with log.wandb="off" has none
    if getattr(wandb, "run", None) is None:
        return
    if exit_code == REQUEUE_EXIT_CODE:
        wandb.run.mark_preempting()
    wandb.finish(exit_code=exit_code)


# ----------------------------------------------------------------------------------------------------------
# Optimizer, EMA, the LR schedule and the time shift.


@torch.no_grad()
def ema_update(ema, model, decay, num_updates, applied=None):
    """ema <- d * ema + (1 - d) * model with the warm-up d = min(decay, (1 + n) / (10 + n)), so a short run
    samples from what it learned rather than from a blend with the random initialisation. The tensors that
    init_from took from another run's EMA (their names in `ema.inherited`) are already a long average: they get
    d = decay from the first step, so a fine-tuning run keeps that EMA (with the warm-up from n = 0 it would
    weigh 1e-5 after 10 steps); tensors init_from left at their fresh init warm up as usual. `applied` (0-dim
    bool tensor): the step's update happened; when False the EMA moves by 0, decided on the device."""
    warm = min(decay, (1 + num_updates) / (10 + num_updates))
    inherited = getattr(ema, "inherited", ())
    names, ema_p, model_p = averaged(ema, model)
    rates = {True: 1 - decay, False: 1 - warm}  # (1 - d): how far each tensor moves toward the model
    if applied is not None:  # device tensors: a float weight alone would be read on the host (a sync) by lerp
        rates = {k: rate * applied.float() for k, rate in rates.items()}
    weights = [rates[name in inherited] for name in names]
    torch._foreach_lerp_(local(ema_p), local(p.detach().float() for p in model_p), weights)


def averaged(ema, model):
    """(names, EMA tensors, model tensors) that the EMA averages: every parameter, or for a LoRA run
    (ema.lora_trained, training/model/lora.py) the trained ones alone. Its frozen base is bitwise the same in the
    model and the EMA (attach copies the one into the other) and a lerp toward an equal tensor leaves it as it is:
    skipping the base changes no bit, only the cost of each update."""
    trained = getattr(ema, "lora_trained", None)
    trained = None if trained is None else set(trained)
    pairs = [(n, e, p) for (n, e), p in zip(ema.named_parameters(), model.parameters())
             if trained is None or n in trained]
    return tuple(list(column) for column in zip(*pairs))


def local(tensors):
    """This rank's shards of sharded tensors (train.sharding="fsdp": views, so an in-place update of a shard updates
    the DTensor), plain tensors as they are: the EMA and post-hoc EMA update shard by shard, with no communication."""
    return [t.to_local() if is_dtensor(t) else t for t in tensors]


def full(tensor):
    """A DTensor gathered whole (a collective: every rank calls it); a plain tensor as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def is_dtensor(tensor):
    from torch.distributed.tensor import DTensor  # here, not at the top: most runs never shard

    return isinstance(tensor, DTensor)


@contextlib.contextmanager
def counting_evaluations(model):
    """Within: rows[0] = the rows `model` was run on (a guided call batches its 1-3 branches), so rows[0] /
    samples is the number of network evaluations per sample (NFE), measured rather than predicted."""
    rows = [0]
    handle = model.register_forward_pre_hook(lambda module, args: rows.__setitem__(0, rows[0] + len(args[0])))
    try:
        yield rows
    finally:
        handle.remove()


def due(step, every, last):
    """Whether periodic work (log, validation, FID, checkpoint every `every` steps; 0: never) falls on `step`;
    the last step always gets it."""
    return bool(every) and (step % every == 0 or step == last)


def lr_at(step, base_lr, warmup_steps, schedule="constant", max_steps=1):
    """Linear warm-up to base_lr, then constant (the paper trains at a constant 1e-4), or a decay to 0 at
    max_steps: cosine (Loshchilov & Hutter 2017) or linear. A pure function of the optimizer step, so resuming
    needs no scheduler state."""
    warmup = min(1.0, (step + 1) / max(1, warmup_steps))
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, max_steps - warmup_steps)))
    if schedule == "constant":
        return base_lr * warmup
    if schedule == "cosine":
        return base_lr * warmup * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return base_lr * warmup * (1 - progress)
    raise ValueError(f"train.lr_schedule must be 'constant', 'cosine' or 'linear', got {schedule!r}")


def lr_scale(tr, global_batch):
    """The factor that takes train.lr (and train.muon_lr), set for train.lr_reference_batch, to this run's global
    batch: "sqrt" (lr ~ sqrt(batch), the rule that keeps Adam's update noise constant; Malladi et al. 2022) or
    "linear" (Goyal et al. 2017, for SGD); "none": 1. Returns it and a line saying how the LR was obtained,
    printed at start."""
    ratio = global_batch / tr["lr_reference_batch"]
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[tr["lr_scaling"]]  # the typed config refused other values
    scale = ratio ** power
    how = "" if power == 0 else f" = {tr['lr']:g} x ({global_batch} / {tr['lr_reference_batch']})^{power:g}"
    return scale, (f"lr {tr['lr'] * scale:.3g}{how} ({tr['lr_scaling']} scaling rule), {tr['lr_schedule']} schedule, "
                   f"{tr['warmup_steps']} warm-up steps of {tr['max_steps']}")


def shift_of(cfg):
    """The resolution shift a of a run: data.resolution / objective.shift_base_resolution if that is set
    (a = 2 for 512 px against a 256 px base), else objective.time_shift. Both trainers read it from the run's
    config, which is saved with the model, so training and sampling use the same shifted schedule."""
    obj = cfg["objective"]
    return cfg["data"]["resolution"] / obj["shift_base_resolution"] if obj["shift_base_resolution"] else \
        obj["time_shift"]


def time_shift(t, shift):
    """Resolution time shift t' = a t / (1 + (a - 1) t) (SD3, Esser et al. 2024, eq. 23): a > 1 moves
    the same t toward noise, as more pixels need more noise to destroy the same signal. a = 1: identity."""
    return shift * t / (1 + (shift - 1) * t)

