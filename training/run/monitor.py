"""What a training step measures, behind one small object the loop calls in a few places (Monitor):

    loss per time bin, per-step losses and gradient norms, clip share, throughput, data wait, memory (every
    log.every steps, in one all-reduce), loss spikes against running statistics, and every log.grad_every
    steps the gradient norm and update / weight ratio per layer group with vanishing / exploding flags.

Nothing here changes what is trained: the loop's forward, loss, accumulation, optimizer step and EMA are the
trainers' own.
"""
import contextlib
import datetime
import math
import re
import resource
import sys
import time

import torch
from tqdm.auto import tqdm

import common

# ----------------------------------------------------------------------------------------------------------
# Monitoring: gradient norm and update size per layer group, vanishing / exploding flags, loss spikes.


def layer_groups(model):
    """{group: parameters} of a Denoiser: patch_embed, block_00 .. block_NN, final_layer, and conditioning
    (class / text / control embeddings, the time and context embedders)."""
    groups = {}
    for name, p in model.named_parameters():
        block = re.match(r"transformer\.transformer_blocks\.(\d+)\.", name)
        group = (f"block_{int(block[1]):02d}" if block else "patch_embed" if name.startswith("transformer.pos_embed.")
                 else "final_layer" if name.startswith(("transformer.norm_out.", "transformer.proj_out."))
                 else "conditioning")
        groups.setdefault(group, []).append(p)
    return groups


def norms(tensor_lists):
    """The norm of each list of tensors, one device tensor; sharded tensors (train.sharding="fsdp") by the sum of
    their shards' squares over the ranks (one all-reduce, every rank calls it)."""
    squares = torch.stack([torch.stack(torch._foreach_norm(common.local(ts))).float().pow(2).sum()
                           for ts in tensor_lists])
    if any(common.is_dtensor(t) for ts in tensor_lists for t in ts):
        torch.distributed.all_reduce(squares)
    return squares.sqrt()


@torch.no_grad()
def group_grad_norms(groups, total_norm, clip):
    """The gradient norm of each group before clipping (the clip scaled every gradient by one factor, undone
    here), so the groups' norms add up in squares to the total norm that clip_grad_norm_ returned."""
    scale = max(1.0, (float(total_norm) + 1e-6) / clip)  # torch's clip_coef = clip / (total + 1e-6), capped at 1
    grads = [[p.grad for p in ps if p.grad is not None] or [torch.zeros(1, device=ps[0].device)]
             for ps in groups.values()]
    return dict(zip(groups, (norms(grads) * scale).tolist()))


@torch.no_grad()
def group_update_ratios(groups, before):
    """||w_after - w_before|| / ||w_before|| per group: the relative step the optimizer took (about 1e-3 per
    step is the usual healthy range for Adam at a sensible LR). `before`: {group: [weights before the step]}."""
    delta = norms([torch._foreach_sub([p.detach() for p in ps], before[g]) for g, ps in groups.items()])
    ratios = delta / norms(list(before.values())).clamp(min=1e-12)
    return dict(zip(groups, ratios.tolist()))


def gradient_flags(norms, ratio):
    """Groups whose gradient norm is `ratio` times below (vanishing: a dead or disconnected part) or above
    (exploding) the median group's, or not finite."""
    finite = sorted(v for v in norms.values() if math.isfinite(v))
    median = finite[len(finite) // 2] if finite else float("nan")
    return [(g, "grad_vanishing" if v < median / ratio else "grad_exploding") for g, v in norms.items()
            if not math.isfinite(v) or v < median / ratio or v > median * ratio]


def find_spikes(losses, state, threshold, warmup=100, decay=0.99):
    """(index, running mean) of each loss spike in a run of per-step losses: a loss more than `threshold`
    running standard deviations above the running mean, both EMAs over about 1 / (1 - decay) steps, after
    `warmup` steps.
    `state` ({"mean", "var", "n"}, saved in checkpoints) carries the EMAs across calls; its mean is the
    smoothed loss. Both are bias-corrected like Adam's moments (Kingma & Ba 2015, sec. 3): the n-th update
    moves by a = (1 - d) / (1 - d^n), so the mean is sum_i d^(n-i) x_i / sum_i d^(n-i), a weighted mean of the
    losses so far (the first is x_1, and the first loss does not linger for hundreds of steps as it would
    as the EMA's start), and the variance is the same weighting's (West 1979's incremental form)."""
    spikes = []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            continue
        limit = state["mean"] + threshold * math.sqrt(state["var"])
        if state["n"] >= warmup and x > limit:
            spikes.append((i, state["mean"]))
            x = limit  # a spike enters the statistics clipped, so it does not hide the next one
        delta, step = x - state["mean"], (1 - decay) / (1 - decay ** (state["n"] + 1))
        state["mean"] += step * delta
        state["var"] = (1 - step) * (state["var"] + step * delta ** 2)
        state["n"] += 1
    return spikes




# ----------------------------------------------------------------------------------------------------------
# The object the loop talks to: batches (the data wait), micro_batch (losses), optimizer_step (gradients, skipped
# steps), log_interval (one all-reduce per log.every steps), state_dict (what a checkpoint keeps). It only
# records: nothing it does changes what is trained.


# The clip_share_high event: the clip acted on at least this share of the steps of a window of at least this many
# (consecutive log intervals), so that a short log.every judges as many steps as a long one.
CLIP_WATCH_SHARE, CLIP_WATCH_STEPS = 0.5, 50

PEAK_MEMORY = {True: "the CUDA allocator's peak of each log interval (reset after each log)",
               False: "the process's peak resident memory since it started (CPU: the kernel's peak RSS, no reset)"}


def peak_memory(device):
    """GiB: on CUDA the allocator's peak since the previous call, whose peak statistics it resets (so each log
    interval reports its own peak, validation and checkpoints in it included); elsewhere the process's peak RSS
    so far (getrusage keeps one peak per process and cannot reset it). PEAK_MEMORY says which, in words."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


class Monitor:
    """Interval statistics of a training run. The per-step losses, gradient norms and skip flags stay on the
    device and come over in one all-reduce per log interval, so an ordinary step adds no host-device sync."""

    def __init__(self, cfg, model, accelerator, log, state=None):
        self.cfg, self.accelerator, self.log = cfg, accelerator, log
        self.world, self.k_bins = accelerator.num_processes, cfg.objective.loss_bins
        self.groups = layer_groups(model)  # for the gradient analysis
        device = accelerator.device
        self.stats = torch.zeros(2 * self.k_bins, device=device)  # loss sums and counts per time bin
        # loss sum, count, grad norm, skipped, clip threshold, per step
        self.per_step = torch.zeros(cfg.log.every, 5, device=device)
        state = state or {}
        # A progress bar on a terminal; in a log file (SLURM) a bar's carriage returns become one huge line, so
        # there log_interval prints one plain line per interval instead.
        self.start_step, self.t_start = state.get("step", 0), time.perf_counter()
        self.pauses = {}  # kind -> [seconds, count] of validation, FID and checkpoints in this process, for the ETA
        self.show_lines = accelerator.is_local_main_process and not common.interactive()
        self.progress = tqdm(total=cfg.train.max_steps, initial=self.start_step, desc="train",
                             disable=not accelerator.is_local_main_process or self.show_lines)
        peak_memory(device)  # CUDA: the first interval's peak counts from here (not the cache build's encoders)
        accelerator.print(f"peak_memory_gb: {PEAK_MEMORY[device.type == 'cuda']}")
        self.load_state_dict(state)

    def load_state_dict(self, state):
        """A checkpoint's counters, smoothed-loss statistics and interval in progress (at start, and on a
        rollback: training/run/stability.py)."""
        self.skipped, self.bad_in_row = state.get("skipped_steps", 0), state.get("bad_in_row", 0)
        # smoothed loss, spikes
        self.loss_state = state.get("loss_state", {"mean": 0.0, "var": 0.0, "n": 0, "spikes": 0})
        self.clip_watch = dict(state.get("clip_watch", {"steps": 0, "clipped": 0, "excess": 0.0, "high": False}))
        self.since_log, self.micro_batches, self.before = 0, 0, None  # `before`: weights kept for the update ratio
        self.steps_done, self.diverged_at, self.progress.n = state.get("step", 0), None, state.get("step", 0)
        self.stats.zero_(), self.per_step.zero_()
        self.terms = {}  # the options' loss terms (REPA, contrastive): their interval sums, by name
        self.parts = {}  # the loss of a part of each batch (MeanFlow's r = t): its interval [sum, count], by name
        self.restart_clock()
        interval = state.get("interval")
        if interval and len(interval["totals"]) == len(self.stats) + self.per_step.numel():
            # The interval in progress at the checkpoint, summed over ranks: restored on the main process only,
            # so the next log's all-reduce sums it once, and that row is the one an uninterrupted run logs.
            if self.accelerator.is_main_process:
                totals = torch.tensor(interval["totals"], device=self.stats.device)
                self.stats.copy_(totals[:len(self.stats)]), self.per_step.view(-1).copy_(totals[len(self.stats):])
            self.terms = {k: torch.tensor(v if self.accelerator.is_main_process else 0.0, device=self.stats.device)
                          for k, v in interval.get("terms", {}).items()}
            self.parts = {k: torch.tensor(v if self.accelerator.is_main_process else [0.0, 0.0],
                                          device=self.stats.device) for k, v in interval.get("parts", {}).items()}
            self.since_log, self.waited = interval["steps"], interval["waited"]
            self.t_last -= interval["seconds"]
            self.cpu_last -= interval.get("cpu_seconds", 0.0)  # (absent in checkpoints from before issue 57)

    def state_dict(self):
        """What a checkpoint keeps: counters, the smoothed-loss statistics and the log interval in progress (its
        per-step sums over all ranks: a collective, every rank calls it)."""
        totals = self.accelerator.reduce(torch.cat([self.stats, self.per_step.flatten(), *self.term_sums()]), "sum")
        n, terms = len(self.stats) + self.per_step.numel(), len(self.terms)
        parts = totals[n + terms:].view(-1, 2).tolist()
        return {"skipped_steps": self.skipped, "bad_in_row": self.bad_in_row, "loss_state": self.loss_state,
                "clip_watch": dict(self.clip_watch),
                "interval": {"steps": self.since_log, "totals": totals[:n].tolist(), "waited": self.waited,
                             "seconds": time.perf_counter() - self.t_last,
                             "cpu_seconds": time.process_time() - self.cpu_last,
                             "terms": dict(zip(sorted(self.terms), totals[n:n + terms].tolist())),
                             "parts": dict(zip(sorted(self.parts), parts))}}

    def term_sums(self):
        """The options' term sums, then the parts' loss sums and counts, as 1-D tensors in name order (every rank has
        the same names)."""
        return [self.terms[k].view(1) for k in sorted(self.terms)] + [self.parts[k].view(2) for k in sorted(self.parts)]

    def restart_clock(self):
        """Throughput and CPU per step count training only: the clocks start at each interval (and at start)."""
        self.waited, self.t_last, self.cpu_last = 0.0, time.perf_counter(), time.process_time()

    def batches(self, loader, device):
        """The micro-batches of `loader` on the device; the host's wait for each (the loader, then the copy, which
        is asynchronous from pinned memory) is the data-wait share. Reads nothing back from the device."""
        loader = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}
            except StopIteration:
                return
            self.waited += time.perf_counter() - t0
            yield batch

    def analysing(self):
        """Whether the step in progress is a gradient-analysis step (every log.grad_every, main process only)."""
        every = self.cfg.log.grad_every  # sharded: every rank takes part in the norms (their all-reduce)
        return bool(every) and (self.steps_done + 1) % every == 0 and (self.accelerator.is_main_process or
                                                                       self.cfg.train.get("sharding") == "fsdp")

    def micro_batch(self, loss, bins, weight=1.0, terms=None, parts=None):
        """After a micro-batch's backward: its per-sample losses and the time bin (0 .. loss_bins - 1) of each.
        `weight`: the adaptive time density's importance weights; the step's loss is the weighted one (what is
        trained, an unbiased estimate of the base objective), the per-bin losses the unweighted ones. After the
        step's last micro-batch, on an analysis step, the weights are kept for the update ratio (once the
        activations are freed, so the copy does not raise the step's peak memory). `terms`: the options' own
        per-sample loss terms (REPA, contrastive), logged as loss_<name>, weighted as the loss is. `parts`: {name:
        per-sample mask}, each logged as loss_<name>, the mean (unweighted, as the per-bin losses) of its samples' loss
        (MeanFlow's r = t and r < t samples: objectives/meanflow.py, parts)."""
        loss = loss.detach()
        for name, value in (terms or {}).items():
            self.terms[name] = self.terms.get(name, 0) + (weight * value.detach()).sum()
        for name, mask in (parts or {}).items():
            mask = mask.to(loss.dtype)
            self.parts[name] = self.parts.get(name, 0) + torch.stack([(loss * mask).sum(), mask.sum()])
        self.per_step[self.since_log, 0] += (weight * loss).sum()
        self.per_step[self.since_log, 1] += len(loss)
        self.stats[:self.k_bins].index_add_(0, bins, loss)
        self.stats[self.k_bins:].index_add_(0, bins, torch.ones_like(loss))
        self.micro_batches += 1
        if self.micro_batches == self.cfg.train.grad_accum and self.analysing():
            self.before = {g: [p.detach().clone() for p in ps] for g, ps in self.groups.items()}

    def optimizer_step(self, grad_norm, finite, clip=None):
        """After optimizer.step(), before the gradients are zeroed: the step's gradient norm, whether it was
        skipped (`finite`: 0-dim bool tensor) and its clip threshold (a float or a device tensor; None:
        train.grad_clip), recorded on the device. On an analysis step (it syncs, an
        ordinary step does not): the gradient norm per layer group before clipping, the update / weight ratio
        for an update that happened, and vanishing / exploding flags."""
        self.per_step[self.since_log, 2] = grad_norm.detach().float()
        self.per_step[self.since_log, 3] = ~finite
        clip = self.cfg.train.grad_clip if clip is None else clip
        self.per_step[self.since_log, 4] = clip
        step = self.steps_done + 1
        if self.analysing():
            norms = group_grad_norms(self.groups, grad_norm, float(clip))
            metrics = {"step": step, "grad_norm_step": float(grad_norm),
                       **{f"grad_norm/{g}": v for g, v in norms.items()}}
            if bool(finite) and not self.accelerator.optimizer_step_was_skipped:  # fp16: the scaler skipped it
                ratios = group_update_ratios(self.groups, self.before)
                metrics.update({f"update_ratio/{g}": v for g, v in ratios.items()})
            self.log(metrics)
            for g, kind in gradient_flags(norms, self.cfg.log.grad_flag_ratio):
                self.log({"step": step, "event": kind, "group": g, "grad_norm": norms[g]})
                self.accelerator.print(f"step {step}: {kind.replace('_', ' ')} in {g} (norm {norms[g]:.3g})")
        self.steps_done, self.micro_batches, self.before = step, 0, None
        self.since_log += 1
        self.progress.update(1)

    def log_interval(self, step, lr):
        """Average the interval's statistics over steps and processes (the one sync), count skipped steps (too
        many non-finite steps in a row stop the run, train.max_nonfinite_steps, or mark where a divergence began
        for a rollback), find loss spikes, log."""
        tr, k_bins = self.cfg.train, self.k_bins
        totals = self.accelerator.reduce(torch.cat([self.stats, self.per_step.flatten(), *self.term_sums()]), "sum")
        n, terms = len(self.stats) + self.per_step.numel(), len(self.terms)
        totals, term_totals, part_totals = totals[:n], totals[n:n + terms], totals[n + terms:].view(-1, 2).tolist()
        n_steps, self.since_log = self.since_log, 0
        elapsed = time.perf_counter() - self.t_last
        steps = totals[len(self.stats):].view(-1, 5)[:n_steps].tolist()
        for i, s in enumerate(steps):  # the skip flag is the same on every rank: s[3] is 0 or world
            self.skipped, self.bad_in_row = self.skipped + (s[3] > 0), self.bad_in_row + 1 if s[3] > 0 else 0
            if self.bad_in_row >= tr.max_nonfinite_steps and tr.on_divergence == "rollback":
                first_bad = step - n_steps + 2 + i - self.bad_in_row  # stability.Rollback reloads from before it
                self.diverged_at = first_bad if self.diverged_at is None else min(self.diverged_at, first_bad)
            elif self.bad_in_row >= tr.max_nonfinite_steps:
                raise FloatingPointError(f"{self.bad_in_row} optimizer steps in a row had a non-finite loss or "
                                         f"gradient (last at step {step - n_steps + 1 + i}); the last good checkpoint "
                                         f"is in {self.cfg.run_dir}/checkpoints (train.max_nonfinite_steps)")
        loss_avg = sum(s[0] for s in steps) / sum(s[1] for s in steps)
        losses = [s[0] / max(s[1], 1) for s in steps]
        norms = [s[2] / self.world for s in steps]  # the same all-reduced norm on every rank
        clips = [s[4] / self.world for s in steps]  # and the same threshold
        # Stability: spikes against the running mean and std of the per-step loss; how often the clip acts.
        for i, mean in find_spikes(losses, self.loss_state, self.cfg.log.spike_threshold):
            self.loss_state["spikes"] += 1
            self.log({"step": step - n_steps + 1 + i, "event": "loss_spike", "loss": losses[i], "loss_smoothed": mean})
        clipped = [n / c for n, c in zip(norms, clips) if math.isfinite(n) and n > c]
        self.watch_clipping(step, n_steps, clipped, clips[-1])
        peak = peak_memory(self.accelerator.device)
        metrics = {"step": step, "loss": loss_avg, "loss_smoothed": self.loss_state["mean"], "lr": lr,
                   "grad_norm": sum(n for n in norms if math.isfinite(n)) / n_steps, "skipped_steps": self.skipped,
                   "clip_share": len(clipped) / n_steps, "loss_spikes": self.loss_state["spikes"],
                   "images_per_s": n_steps * tr.batch_size * tr.grad_accum * self.world / elapsed,
                   "data_wait_share": self.waited / elapsed, "peak_memory_gb": peak,
                   # this process's CPU (all its threads; not data.num_workers' loader processes) per training step:
                   # what an equal-CPU comparison divides by, start-up, validation, checkpoints and export left out
                   "cpu_s_per_step": (time.process_time() - self.cpu_last) / n_steps}
        counts = totals[k_bins:len(self.stats)].clamp(min=1)
        metrics.update({f"loss_t{k}": (totals[k] / counts[k]).item() for k in range(k_bins)})
        metrics["images_per_s_per_device"] = metrics["images_per_s"] / self.world
        count = sum(s[1] for s in steps)
        metrics.update({f"loss_{k}": v / count for k, v in zip(sorted(self.terms), term_totals.tolist())})
        metrics.update({f"loss_{k}": total / n for k, (total, n) in zip(sorted(self.parts), part_totals) if n})
        if clipped:  # by how much the clip acted, on the steps where it did
            metrics["clip_excess"] = sum(clipped) / len(clipped)
        self.log(metrics)
        self.progress.set_postfix({"smoothed loss": f"{self.loss_state['mean']:.4f}", "lr": f"{lr:.1e}",
                                   "ETA": self.eta(step)})  # tqdm's own remaining time leaves validation out
        if self.show_lines:
            print(self.line(step, metrics), flush=True)
        self.stats.zero_(), self.per_step.zero_()
        self.terms, self.parts = {}, {}
        self.restart_clock()
        return metrics

    def watch_clipping(self, step, n_steps, clipped, clip):
        """The clip_share_high event, logged and printed once when the clip acts on CLIP_WATCH_SHARE or more of a
        window's steps, and again only after a window below it: a clip acting on most steps scales every update to
        the clip, so it sets the update's size in place of the LR, which neither the loss nor the LR shows.
        `clipped`: norm / clip of this interval's clipped steps; `clip`: the last step's threshold."""
        watch = self.clip_watch
        watch["steps"], watch["clipped"] = watch["steps"] + n_steps, watch["clipped"] + len(clipped)
        watch["excess"] += sum(clipped)
        if watch["steps"] < CLIP_WATCH_STEPS:
            return
        share = watch["clipped"] / watch["steps"]
        if share >= CLIP_WATCH_SHARE and not watch["high"]:
            excess = watch["excess"] / watch["clipped"]
            self.log({"step": step, "event": "clip_share_high", "clip_share": share, "steps": watch["steps"],
                      "clip_excess": excess, "clip": clip})
            self.accelerator.print(f"step {step}: the gradient clip ({clip:.3g}) acted on {share:.0%} of the last "
                                   f"{watch['steps']} steps, at {excess:.2f} x the clip on average: it, not the LR, "
                                   f"sets the size of those updates (docs/training.md, clip_share_high)")
        self.clip_watch = {"steps": 0, "clipped": 0, "excess": 0.0, "high": share >= CLIP_WATCH_SHARE}

    def eta(self, step):
        """The time left, in words: see eta_of."""
        every = {"validation": self.cfg.val.every, "FID": self.cfg.val.fid_every, "checkpoint": self.cfg.ckpt.every}
        paused = sum(self.pauses.get(kind, [0])[0] for kind in every)
        per_step = (time.perf_counter() - self.t_start - paused) / max(1, step - self.start_step)
        return eta_of(step, self.cfg.train.max_steps, per_step, self.pauses, every)

    def line(self, step, metrics):
        """The plain log line of an interval, with the ETA (eta_of)."""
        total = self.cfg.train.max_steps
        return (f"step {step}/{total} ({100 * step / total:.0f}%) | loss {metrics['loss']:.4f} | smoothed loss "
                f"{metrics['loss_smoothed']:.4f} | lr {metrics['lr']:.2e} | {metrics['images_per_s']:.1f} images/s | "
                f"ETA {self.eta(step)}")

    def pause(self, work, step, name=None):
        """Validation, FID or a checkpoint at `step`: `work(step)` on every rank, announced in the log when named,
        kept out of the training throughput and timed for the ETA (its kind: the name's first word, else the
        work's name)."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        with self.phase(name, step) if name else contextlib.nullcontext():
            work(step)
        kind = self.pauses.setdefault(name.split()[0] if name else work.__name__, [0.0, 0])
        kind[0], kind[1] = kind[0] + time.perf_counter() - t0, kind[1] + 1
        # The interval's clocks skip the pause: its steps before the pause keep their time, its own is not counted
        self.t_last, self.cpu_last = self.t_last + time.perf_counter() - t0, self.cpu_last + time.process_time() - cpu0

    def phase(self, name, step):
        """A pause of training (validation, FID) announced in the log, with its duration when done."""
        return Phase(f"step {step}: {name}", self.accelerator.is_main_process)

    def close(self):
        self.progress.close()


def eta_of(step, total, per_step, pauses, every):
    """Time left at `step` of `total`, in words: the training steps left at `per_step` seconds (training only),
    plus each periodic pause still to come (every[kind] steps, and at the last step, as common.due; those of
    `step` itself too, which follow its log line) at its mean measured duration (pauses[kind] = [seconds,
    count]); one not yet timed is named, not guessed: "0:00:11 + 1 validation not yet timed"."""
    seconds, untimed, done = per_step * (total - step), [], max(step, 1) - 1
    for kind, k in every.items():
        to_come = (total // k - done // k + (total % k != 0)) if k and step <= total else 0
        spent, count = pauses.get(kind, [0.0, 0])
        if to_come and count:
            seconds += to_come * spent / count
        elif to_come:
            untimed.append(f"{to_come} {kind}")
    return str(datetime.timedelta(seconds=round(seconds))) + "".join(f" + {u} not yet timed" for u in untimed)


class Phase:
    """with Phase(name): print 'name ...' and, at the end, 'name: done in 12.3 s'."""

    def __init__(self, name, enabled=True):
        self.name, self.enabled = name, enabled

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.enabled:
            tqdm.write(f"{self.name} ...", file=sys.stdout)
        return self

    def __exit__(self, *exc):
        if self.enabled and exc[0] is None:
            tqdm.write(f"{self.name}: done in {time.perf_counter() - self.t0:.1f} s", file=sys.stdout)


def progress(iterable, desc, enabled=True, total=None):
    """tqdm on a terminal; in a log file, a plain line at every tenth of the way (FID, sampling at scale)."""
    if not enabled or common.interactive():
        yield from tqdm(iterable, desc=desc, total=total, disable=not enabled)
        return
    total = len(iterable) if total is None else total
    t0, marks = time.perf_counter(), {math.ceil(total * k / 10) for k in range(1, 11)}
    for i, item in enumerate(iterable, 1):
        yield item
        if i in marks:
            print(f"{desc}: {i}/{total} ({time.perf_counter() - t0:.0f} s)", flush=True)
