"""Fitting a run to its GPU: the micro-batch found at start-up with the global batch kept, gradient
checkpointing chosen by measurement when it matters, and the EMA offloaded to pinned CPU memory.

    plan_batch: train.global_batch -> per process -> (train.batch_size "auto": probe the divisors) -> min over
      ranks -> grad_accum = global / (micro x processes), recorded in the run's config (and so in every
      checkpoint: a resumed run reuses it)
    EMAUpdater: the trainers' EMA step; every train.ema_every steps with the decay compounded over them, on the
      training device or (train.ema_device="cpu") from an asynchronous copy of the weights into pinned memory

Nothing here is a training step: the probe leaves weights, optimizer state, RNG and data position as they were.
"""
import functools
import gc
import json
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import common
from training.config import config
from training.data.batching import COND_FIELDS, images_in, probe_rows
from training.data.encoders import text_features
from training.objectives import contrastive, repa
from training.optimisation import muon
from training.run import sharding

# A micro-batch fits when its probe step succeeds and the memory the allocator reserved at the peak stays under
# this share of the GPU: the rest is for fragmentation over a long run, validation and the CUDA context.
FIT_MARGIN = 0.9
TIMED_REPEATS = 3  # forward + backward passes timed per candidate (after one warm-up pass)

# ----------------------------------------------------------------------------------------------------------
# The search: divisors of the per-process batch, halved, then bisected; the minimum over ranks.


def divisors(n, at_most=None):
    """The divisors of n, largest first (not above `at_most`): the micro-batches that keep the global batch."""
    return [d for d in range(n, 0, -1) if n % d == 0 and (at_most is None or d <= at_most)]


def largest_fitting(candidates, fits):
    """The largest of `candidates` (descending) for which fits(m) holds, or 0. Halving first (m, then the largest
    candidate <= m / 2, ...: few trials at the top, where a trial is most likely to run out of memory), then a
    bisection between the last that failed and the first that fit, so the result is the largest divisor that
    fits, not only the largest power-of-two fraction. Assumes that what fits at m fits below m."""
    if not candidates:
        return 0
    failed, m = None, candidates[0]
    while not fits(m):
        failed, below = m, [d for d in candidates if d <= m // 2]
        if not below:
            return 0
        m = below[0]
    between = sorted(d for d in candidates if failed is not None and m < d < failed)
    lo, hi = 0, len(between)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(between[mid]):
            m, lo = between[mid], mid + 1
        else:
            hi = mid
    return m


def choose(candidates, fits, images_per_s, all_min, checkpointing="auto", log=print):
    """(micro-batch, checkpointing, timing table) for a run. fits(m, ckpt) -> bool and images_per_s(m, ckpt)
    -> float run the probe on this rank; all_min(list) -> the element-wise minimum over ranks (every rank
    calls it in the same order, so all take the same decisions). checkpointing: True (train.gradient_checkpointing
    set: only with it), or "auto": without, unless no micro-batch fits without it, or with it a larger one fits;
    then every candidate pair is timed and the one with the most images/s (on the slowest rank) is taken."""
    if checkpointing is True:
        return int(all_min([largest_fitting(candidates, lambda m: fits(m, True))])[0]), True, []
    off = int(all_min([largest_fitting(candidates, lambda m: fits(m, False))])[0])
    if off == candidates[0]:
        return off, False, []  # the whole per-process batch in one micro-batch: nothing to gain
    on = int(all_min([largest_fitting([d for d in candidates if d > off], lambda m: fits(m, True))])[0])
    # Checkpointing at a micro-batch no larger than `off` only adds the recompute: the candidates with it are
    # the (at most 3) largest that fit above `off`.
    pairs = [(off, False)] * bool(off) + [(m, True) for m in candidates if off < m <= on][:3]
    if len(pairs) <= 1:
        return (*(pairs[0] if pairs else (0, True)), [])
    speeds = all_min([images_per_s(m, c) for m, c in pairs])
    table = [{"micro_batch": m, "gradient_checkpointing": c, "images_per_s": s} for (m, c), s in zip(pairs, speeds)]
    log("fit: measured (images/s per process, slowest rank):\n" + "\n".join(
        f"  micro-batch {r['micro_batch']:>5}, gradient checkpointing "
        f"{'on ' if r['gradient_checkpointing'] else 'off'}: {r['images_per_s']:.1f}" for r in table))
    best = max(table, key=lambda r: r["images_per_s"])
    return best["micro_batch"], best["gradient_checkpointing"], table


# ----------------------------------------------------------------------------------------------------------
# The probe step: the run's model, precision, compile and optimizer on a worst-case micro-batch, undone.


def is_out_of_memory(error):
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(error, torch.cuda.OutOfMemoryError) or should_reduce_batch_size(error)


def set_checkpointing(model, on):
    if model.transformer.is_gradient_checkpointing != on:
        (model.transformer.enable_gradient_checkpointing if on else model.transformer.disable_gradient_checkpointing)()


def probe_batch(train_set, text_encoder, micro, device):
    """`micro` rows of the cached training set (rows repeat when it is smaller) as the trainers feed them. Every
    cached row has the same shape (latents at data.resolution, text padded to encoders.max_tokens), so any rows
    are the worst case; with buckets, the rows of the bucket with the most values a row (batching.probe_rows).
    The probe's own times and conditions: nothing is drawn from the run's data order. Returns the batch too:
    REPA's targets come from it (its cached "repa", or its pixels through the encoder)."""
    batch = text_features({k: v.to(device) for k, v in train_set[probe_rows(train_set, micro)].items()}, text_encoder)
    cond = {k: v for k, v in batch.items() if k in COND_FIELDS}
    cond["drop"] = cond["drop_controls"] = torch.zeros(micro, dtype=torch.bool, device=device)
    return batch, torch.rand(micro, device=device) * 1000, cond


def probe_step(run, micro, checkpointing, timed=0):
    """Forward and backward of a micro-batch as the loop runs them (compiled or not, the run's autocast; with REPA
    its targets, encoded now when on the fly, and the projector's tokens and term; with `run.loss`, the trainer's
    own step where it takes more than one forward: MeanFlow's target passes and JVP), then the optimizer step
    skipped on the device (found_inf = 1: the fused AdamW allocates its moments, as the first real step will, and
    leaves weights and moments as they were), then the gradients dropped. With `timed`, returns seconds per
    forward + backward over that many passes after the first."""
    set_checkpointing(run.model, checkpointing)
    batch, t, cond = probe_batch(run.train_set, run.text_encoder, micro, run.device)
    seconds = None
    try:
        for i in range(1 + timed):
            if i == 1:
                synchronize(run.device)
                start = time.perf_counter()
            align = run.align(batch, 0) if run.align is not None else None  # REPA (off: None)
            with run.accelerator.autocast():
                if run.loss is not None:
                    error, terms = run.loss(run.forward, run.model, batch["x"], cond, align)
                else:
                    out, tokens = repa.forward(run.forward, align, batch["x"], t, cond)
                    error, terms = out.float().pow(2), repa.terms(tokens, align)  # costs nothing next to the model
                loss = error.mean() + sum(term.mean() for term in terms.values())
            loss.backward()
        if timed:
            synchronize(run.device)
            seconds = (time.perf_counter() - start) / timed
        run.inner.found_inf = torch.ones((), device=run.device)
        run.inner.step()
    finally:
        run.optimizer.zero_grad(set_to_none=True)
    return seconds


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device):
    """What a trial (or its out-of-memory error and traceback) held goes back to the GPU for the next trial."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_share(device):
    """The peak memory the allocator reserved, as a share of the GPU's; 0 on CPU (only an out-of-memory error
    says that a micro-batch does not fit there)."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory


def probe(run, candidates, checkpointing, log):
    """fits / images_per_s for `choose`, on this rank's GPU; the minimum over ranks by one all-reduce each.
    Every rank prints one line of what it tried."""
    tried = []

    def fits(m, ckpt):
        free_memory(run.device)
        try:
            probe_step(run, m, ckpt)
            ok = peak_share(run.device) <= FIT_MARGIN
        except Exception as e:  # noqa: BLE001 (anything but running out of memory is a real error)
            if not is_out_of_memory(e):
                raise
            ok = False
        free_memory(run.device)
        tried.append(f"{m}{' with checkpointing' * ckpt} {'fits' if ok else 'does not fit'}")
        return ok

    def images_per_s(m, ckpt):
        free_memory(run.device)
        try:
            return m / probe_step(run, m, ckpt, timed=TIMED_REPEATS)
        except Exception as e:  # noqa: BLE001
            if not is_out_of_memory(e):
                raise
            return 0.0  # fitted once, not twice: not a candidate
        finally:
            free_memory(run.device)

    def all_min(values):
        out = torch.tensor(values, dtype=torch.float64, device=run.device)
        if run.accelerator.num_processes > 1:
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MIN)
        return out.tolist()

    chosen = choose(candidates, fits, images_per_s, all_min, checkpointing, log)
    print(f"fit: rank {run.accelerator.process_index} tried micro-batch " + ", ".join(tried), flush=True)
    return chosen


# ----------------------------------------------------------------------------------------------------------
# The plan: what a trainer calls once, after building model and optimizer and before the first step.


def recorded_choice(ckpt):
    """The micro-batch and checkpointing a resumed run chose at its start, from its checkpoint's config (memory-
    mapped: the optimizer state in the same file is not read)."""
    train = torch.load(Path(ckpt) / "state.pt", mmap=True, weights_only=True, map_location="cpu")["config"]["train"]
    return train["batch_size"], train["gradient_checkpointing"]


def resolved_keys(train):
    """The keys of a train section that plan_batch replaces by what it resolved (and config.json then holds):
    with train.global_batch the accumulation, and with batch_size "auto" the micro-batch and, unless forced on,
    gradient checkpointing. What a run asked for is compared with a run folder on the other keys (tools/sweep.py)."""
    if train.get("global_batch") is None:
        return set()
    keys = {"train.grad_accum"}
    if train["batch_size"] == "auto":
        keys |= {"train.batch_size"} | ({"train.gradient_checkpointing"} if not train["gradient_checkpointing"]
                                        else set())
    return keys


def plan_batch(cfg, accelerator, model, optimizer, train_set, text_encoder=None, ckpt=None, align=None, loss=None):
    """train.global_batch: sets train.batch_size (the micro-batch), train.grad_accum and
    train.gradient_checkpointing in `cfg`, and on the model. batch_size "auto": a resumed run reuses the choice
    its checkpoint recorded; a new one probes the divisors of global_batch / processes (largest_fitting, choose)
    with the run's model (moved to the device), precision, compile and optimizer, and takes the minimum over
    ranks. Called before accelerator.prepare: the probe runs the bare model, so no DDP collective (its buffer
    broadcast in every forward) can pair one rank's trial with another's, and its gradients take the memory that
    DDP's buckets take in the run. The probe changes nothing the run keeps (weights, optimizer state, RNG, data
    position), so the run then equals the same run configured by hand; `align` (repa.Alignment, None: off) puts
    REPA's encoder and projector in the probe's step, and `loss(forward, model, x0, cond, align) -> (per-sample
    loss, terms)` the trainer's objective where a step is more than one forward (meanflow.probe_loss). The
    resolved train section is written to config.json and the probe's findings to fit.json in the run folder.
    Without global_batch: nothing (batch_size x processes x grad_accum, as set)."""
    tr, world, device = cfg.train, accelerator.num_processes, accelerator.device
    if tr.global_batch is None:
        return
    per_process, rest = divmod(tr.global_batch, world)
    if rest:
        raise config.ConfigError(f"train.global_batch={tr.global_batch} is not a multiple of the {world} processes:"
                                 f" choose a multiple of {world}, or another process count")
    found = {}
    if tr.batch_size == "auto" and ckpt is not None:
        micro, checkpointing = recorded_choice(ckpt)
        how = f"recorded by the resumed run ({ckpt})"
    elif tr.batch_size == "auto":
        inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer (also inside accelerate's wrapper)
        if any(inner.state.values()):
            raise RuntimeError("fit.plan_batch runs before the optimizer's first step (its state would be dropped)")
        run = SimpleNamespace(accelerator=accelerator, model=model.to(device), optimizer=optimizer, inner=inner,
                              forward=torch.compile(model) if tr.compile else model, train_set=train_set,
                              text_encoder=text_encoder, device=device, align=align, loss=loss)
        candidates = divisors(per_process, at_most=images_in(train_set) // world)  # what iterate_batches allows
        missing = object()
        found_inf = inner.__dict__.get("found_inf", missing)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                micro, checkpointing, table = probe(run, candidates, True if tr.gradient_checkpointing else "auto",
                                                    accelerator.print)
        finally:  # the optimizer as it was: no state, and the grad scaler's found_inf as it was
            inner.state.clear()
            if found_inf is missing:
                inner.__dict__.pop("found_inf", None)
            else:
                inner.found_inf = found_inf
            free_memory(device)
            if tr.compile:
                torch._dynamo.reset()  # the run compiles its own model for its micro-batch, as one configured by hand
        if micro == 0:
            raise config.ConfigError(
                f"train.batch_size='auto': not even a micro-batch of 1 fits on {device} (with gradient checkpointing); "
                f"offload the EMA (train.ema_device='cpu'), lower data.resolution or the model size (model.*)")
        how = f"the largest divisor of {per_process} that fits, {1 - FIT_MARGIN:.0%} of the memory kept free"
        found = {"per_process": per_process, "candidates": candidates, "timed": table}
    else:
        micro, checkpointing, how = tr.batch_size, tr.gradient_checkpointing, "train.batch_size"
    accum, rest = divmod(per_process, micro)
    if rest:
        raise config.ConfigError(f"train.batch_size={micro} x {world} processes does not divide train.global_batch="
                                 f"{tr.global_batch}: choose a divisor of {per_process} ({divisors(per_process)[:8]}"
                                 f"...) or train.batch_size='auto'")
    if tr.batch_size == "auto":  # the start-up check saw "auto": what needs the number is checked on it now
        refused = contrastive.problems({**cfg, "train": {**tr, "batch_size": micro}}, how)
        if refused:
            raise config.ConfigError(refused[0])
    set_checkpointing(model, checkpointing)
    if tr.grad_accum != accum and tr.batch_size != "auto":
        accelerator.print(f"fit: train.grad_accum {tr.grad_accum} -> {accum}, for train.global_batch={tr.global_batch}")
    tr.batch_size, tr.grad_accum, tr.gradient_checkpointing = micro, accum, checkpointing
    accelerator.print(f"fit: micro-batch {micro} ({how}) x {world} processes x {accum} accumulation = "
                      f"{tr.global_batch}; gradient checkpointing {'on' if checkpointing else 'off'}")
    if accelerator.is_main_process:
        run_dir = Path(cfg.run_dir)
        (run_dir / "config.json").write_text(json.dumps(cfg, indent=2))  # the resolved train section
        if found:
            (run_dir / "fit.json").write_text(json.dumps({**found, "micro_batch": micro, "grad_accum": accum,
                                                          "gradient_checkpointing": checkpointing}, indent=1))


# ----------------------------------------------------------------------------------------------------------
# The EMA: every k steps with the compounded decay, on the training device or offloaded to pinned CPU memory.


def set_lr(optimizer, tr, factor):
    """The step's learning rates: train.lr x factor (the schedule, the batch rule, a rollback's cut) in every
    parameter group, train.muon_lr x factor in Muon's (the group with ns_steps; training/optimisation/muon.py),
    both from today's config (a resume that changes either takes it). Returns train.lr's, the LR that is logged."""
    for group in optimizer.param_groups:
        group["lr"] = factor * (muon.lr_of(tr) if "ns_steps" in group else tr["lr"])
    return factor * tr["lr"]

def decay_at(decay, n):
    """common.ema_update's warm-up: d_n = min(decay, (1 + n) / (10 + n)) for the update after step n."""
    return min(decay, (1 + n) / (10 + n))


class EMAUpdater:
    """The trainers' EMA step, called after every optimizer step (step n, 0-based, then counts n + 1).

    train.ema_every = k: the EMA moves only after steps n with (n + 1) % k == 0, toward the weights of that
    moment, with the k per-step decays of the window compounded:
        ema <- D ema + (1 - D) w_{n+1},   D = d_{n-k+1} ... d_{n-1} d_n   (d_n = decay_at(decay, n))
    which is exactly k of today's updates (common.ema_update) when the weights are the same over the window, and
    otherwise gives the window's weight share to its last weights instead of spreading it over the window: an
    error of order k x (per-step weight change) x (1 - d), small for k << 1 / (1 - decay) (10 << 10,000 in the
    recipes). Which steps update is a pure function of the step (no state beyond the EMA: exact resume holds,
    whatever max_steps the run has); the run's last k - 1 steps at most are not in its final EMA. A skipped
    (non-finite) update step moves the EMA only by the window's other k - 1 decays; a skipped step inside a window
    counts as one with unchanged weights. The tensors init_from took from another run's EMA (`ema.inherited`) get
    no warm-up, d_n = decay, as in common.ema_update. k = 1 and the same device: common.ema_update itself.

    train.ema_device = "cpu": the fp32 EMA lives in pinned CPU memory (4 bytes per parameter less on the GPU;
    8 per parameter of pinned host memory with the staging copy). At an update step the weights are copied into
    pinned staging buffers on a side CUDA stream, non-blocking, and the next optimizer step waits for that copy
    on the device (an optimizer pre-hook), so the copy overlaps the next forward and backward; a background
    thread waits for the copy and lerps the EMA on the CPU. Nothing waits on the host on an ordinary step; the
    next update step, a checkpoint (state_dict), validation (on_device) and the end of the loop join the thread
    first. On a CPU-only machine the copy is a plain copy and the lerp runs in the same background thread."""

    def __init__(self, ema, model, optimizer, tr, device):
        self.ema, self.model, self.device = ema, model, device
        self.decay, self.every, self.last = tr.ema_decay, tr.ema_every, tr.max_steps
        self.offload = tr.ema_device == "cpu"
        self.thread, self.error = None, None
        if not self.offload:
            ema.to(device)
            return
        pin = device.type == "cuda"  # pinned memory needs CUDA
        for tensor in (*ema.parameters(), *ema.buffers()):
            tensor.data = tensor.data.to("cpu").pin_memory() if pin else tensor.data.to("cpu")
        self.staged = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in common.averaged(ema, model)[1]]
        self.weight = torch.zeros(2, pin_memory=pin)  # 1 - D of the update in flight: fresh, inherited tensors
        if device.type == "cuda":
            self.stream, self.copied = torch.cuda.Stream(device), torch.cuda.Event()
            inner = getattr(optimizer, "optimizer", optimizer)  # the weights change only in the optimizer step
            inner.register_step_pre_hook(lambda *args: torch.cuda.current_stream(device).wait_event(self.copied))
        ema.register_state_dict_pre_hook(lambda *args: self.wait())  # a checkpoint saves the finished EMA
        ema.register_load_state_dict_pre_hook(lambda *args: self.wait())

    def __call__(self, step, applied=None):
        """After optimizer step `step`; `applied` (0-dim bool tensor): the step's update happened (decided on
        the device, never read on the host)."""
        if self.every == 1 and not self.offload:
            return common.ema_update(self.ema, self.model, self.decay, step, applied)
        if (step + 1) % self.every == 0:
            self.update(step, applied)
        if step + 1 == self.last:
            self.wait()  # the export reads the final EMA

    def update(self, step, applied):
        # 1 - D for the fresh tensors (the warm-up's decays) and for the inherited ones (decay from the first step),
        # as device tensors when `applied` is (for k = 1 each is bitwise common.ema_update's 1 - d)
        weight = []
        fresh = [decay_at(self.decay, n) for n in range(step + 1 - self.every, step + 1)]
        for decays in (fresh, [self.decay] * self.every):
            before, d = math.prod(decays[:-1]), decays[-1]
            weight.append(1 - before * d if applied is None else torch.where(applied, 1 - before * d, 1 - before))
        inherited = getattr(self.ema, "inherited", ())
        names, ema_p, model_p = common.averaged(self.ema, self.model)  # LoRA: the trained tensors alone
        which = [int(name in inherited) for name in names]  # 0: fresh, 1: inherited
        if not self.offload:  # (sharded: shard by shard)
            torch._foreach_lerp_(common.local(ema_p), common.local(p.detach().float() for p in model_p),
                                 [weight[i] for i in which])
            return
        self.wait()  # the previous update, k steps ago, is done with the staging buffers
        self.which, self.averaged = which, ema_p
        weights = [p.detach() for p in model_p]
        weight = torch.tensor(weight) if applied is None else torch.stack(weight)
        if self.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after this step's optimizer step
            with torch.cuda.stream(self.stream):
                torch._foreach_copy_(self.staged, weights, non_blocking=True)
                self.weight.copy_(weight, non_blocking=True)
                self.copied.record(self.stream)
            if applied is not None:
                weight.record_stream(self.stream)  # made on the main stream, read on the side one
        else:
            torch._foreach_copy_(self.staged, weights)
            self.weight.copy_(weight)
        self.thread = threading.Thread(target=self.lerp, name="ema-update", daemon=True)
        self.thread.start()

    def lerp(self):
        try:
            if self.device.type == "cuda":
                self.copied.synchronize()  # this thread waits for the copy, the training loop does not
            torch._foreach_lerp_(self.averaged, self.staged, [self.weight[i] for i in self.which])
        except BaseException as e:  # raised in the training thread by wait()
            self.error = e

    def wait(self):
        """Join the update in flight (a host wait only if it is not done yet)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("the offloaded EMA update failed") from error

    def on_device(self, fn):
        """Decorates validation and FID, fn(*args, ema): they get the whole EMA on the training device. An offloaded
        EMA is copied there for the call (into memory the dropped gradients left free) and its pinned CPU tensors are
        put back after; a sharded one (train.sharding="fsdp") is gathered into a full copy, freed after the call.
        The call does not change the EMA."""
        @functools.wraps(fn)
        def with_ema_on_device(*args, **kwargs):
            self.wait()
            if not self.offload or self.device.type == "cpu":
                return fn(*args, sharding.full_copy(self.ema), **kwargs)
            tensors = [*self.ema.parameters(), *self.ema.buffers()]
            host = [t.data for t in tensors]
            for t in tensors:
                t.data = t.data.to(self.device, non_blocking=True)
            try:
                return fn(*args, self.ema, **kwargs)
            finally:
                for t, h in zip(tensors, host):
                    t.data = h
        return with_ema_on_device

