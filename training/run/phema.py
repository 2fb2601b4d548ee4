"""Post-hoc EMA (Karras et al. 2024, "Analyzing and improving the training dynamics of diffusion models",
sec. 3 and appendix C), written from the paper's equations: track two power-function EMAs of the weights
during training, snapshot them now and then, and after training reconstruct the EMA of any length by least
squares over the snapshots, so the EMA length is chosen by a metric instead of guessed before the run.

A power-function EMA at time t (counted in images seen) weights the past trajectory by the profile
    p_{t,g}(tau) = (g + 1) tau^g / t^(g + 1)  on 0 <= tau <= t                                     (eq. 2)
whose width relative to t is sigma_rel = sqrt(g + 1) / ((g + 2) sqrt(g + 3))                     (eq. 3)
(0 < sigma_rel < 12^-1/2 = 0.289; g -> 0 is the uniform average). It is tracked by
    theta_hat <- beta theta_hat + (1 - beta) theta,  beta = (1 - dt / t)^(g + 1)                 (eq. 4)
with t the images seen after this step and dt = images per step. The product of the betas telescopes, so the
weight of step s's weights in the EMA at step T is ((s dt)^(g+1) - ((s-1) dt)^(g+1)) / (T dt)^(g+1): exactly the
integral of p_{T dt, g} over that step's interval. The tracked EMA is therefore the continuous profile applied
to the (piecewise constant) trajectory, and a mix sum_i x_i theta_hat_i of snapshots is the profile
sum_i x_i p_i applied to it: choosing x to make that mix close to a target profile p_r in L2 (appendix C.3)
is a small least-squares problem whose matrix entries are closed-form inner products of power profiles.

The profiles live on the main process only (other ranks count images, so every rank agrees on when a
snapshot is due), or with train.sharding="fsdp" on every rank, sharded like the weights (a snapshot gathers them); they
go into each checkpoint (bitwise resume) and into fp16 snapshots, run_dir/phema/phema_<images>.safetensors, written to
a hidden temporary name and renamed once complete, so a snapshot cut off by a kill is never listed. tools/phema.py
reconstructs and exports; eval_fid.py and sample.py take --phema_std.
"""
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

import common
from training.model.mmdit import TRAINING_ONLY, exported_parameters
from training.run import checkpoints, sharding

MAX_STD = 0.28  # reconstruction targets: sigma_rel in (0, MAX_STD]; the profile family ends at 12^-1/2 = 0.2887
SNAPSHOT_DTYPE = torch.float16  # the paper's storage: half the disk of fp32, and errors of ~1e-3 relative at most


def std_of_gamma(gamma):
    """sigma_rel of the power profile with exponent gamma (eq. 3)."""
    return math.sqrt(gamma + 1) / ((gamma + 2) * math.sqrt(gamma + 3))


def gamma_of_std(std):
    """The exponent gamma of relative std `std`: eq. 3 squared, std^2 (g + 2)^2 (g + 3) = g + 1, is the cubic
    g^3 + 7 g^2 + (16 - std^-2) g + (12 - std^-2) = 0; its largest real root (one root is > 0 for std < 0.289)."""
    if not 0 < std < 12 ** -0.5:
        raise ValueError(f"a power-function EMA's relative std must be in (0, {12 ** -0.5:.4f}), got {std}")
    roots = np.roots([1.0, 7.0, 16.0 - std ** -2, 12.0 - std ** -2])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-6 * max(1.0, abs(r.real))))


def profile_inner_products(t_a, g_a, t_b, g_b):
    """<p_a, p_b> = integral of p_{t_a,g_a}(tau) p_{t_b,g_b}(tau) over tau (appendix C.3), elementwise over
    broadcast arrays: (g_a + 1)(g_b + 1) lo^(g_a + g_b + 1) / ((g_a + g_b + 1) t_a^(g_a + 1) t_b^(g_b + 1)) with
    lo = min(t_a, t_b), written as (lo / hi)^g / hi (g: the exponent of the profile reaching hi = max) so that no
    power of a large t is formed."""
    t_a, g_a, t_b, g_b = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (t_a, g_a, t_b, g_b)))
    lo, hi = np.minimum(t_a, t_b), np.maximum(t_a, t_b)
    g_hi = np.where(t_a < t_b, g_b, g_a)
    return (g_a + 1) * (g_b + 1) / (g_a + g_b + 1) * (lo / hi) ** g_hi / hi


def solve_coefficients(times, gammas, t_target, g_target):
    """x minimising || sum_i x_i p_{times_i, gammas_i} - p_{t_target, g_target} ||^2: the normal equations
    A x = b, A_ij = <p_i, p_j>, b_i = <p_i, p_r> (appendix C.3), solved by least squares (snapshots of equal
    time and gamma make A singular), then normalised to sum 1 so that a constant trajectory is reproduced
    exactly (the mix's profile integrates to 1, as every EMA's does). Times are scaled by t_target first.
    Returns x and the fit's relative L2 error ||q - p_r|| / ||p_r|| (q: the mix's profile), which says how far
    the snapshots can be trusted for this target (small inside the tracked stds, larger far outside)."""
    t = np.asarray(times, dtype=np.float64) / t_target
    g = np.asarray(gammas, dtype=np.float64)
    A = profile_inner_products(t[:, None], g[:, None], t[None, :], g[None, :])
    b = profile_inner_products(t, g, 1.0, g_target)
    x = np.linalg.lstsq(A, b, rcond=None)[0]
    x = x / x.sum()
    p_r = profile_inner_products(1.0, g_target, 1.0, g_target)
    return x, float(np.sqrt(max(x @ A @ x - 2 * x @ b + p_r, 0.0) / p_r))


# ----------------------------------------------------------------------------------------------------------
# Tracking during training.


class PowerEMA:
    """The power-function EMA profiles of one run (ckpt.phema_stds), tracked on the main process when
    ckpt.phema_every > 0; with 0 (the default) every method does nothing. Every rank counts images, so
    due() is the same everywhere."""

    def __init__(self, model, stds, every, images_per_step, run_dir, main_process):
        self.stds, self.gammas = list(stds), [gamma_of_std(s) for s in stds]
        self.every, self.images_per_step, self.images = every, images_per_step, 0
        self.folder = Path(run_dir) / "phema"
        # the exported model's parameters only (not REPA's projector): the snapshots load into what consumers rebuild
        self.names, self.main = [name for name, _ in exported_parameters(model)], main_process
        # train.sharding="fsdp": every rank holds its shards of every profile (DTensors, sharded like the weights)
        sharded = sharding.is_sharded(model)
        self.profiles = [[p.detach().float().clone() for _, p in exported_parameters(model)] for _ in self.stds] \
            if every and (main_process or sharded) else []

    @classmethod
    def of_run(cls, model, cfg, world, run_dir, main_process):
        """A trainer's profiles: ckpt.phema_stds, a snapshot every ckpt.phema_every images, each optimizer step
        train.global_batch images (else batch_size x processes x grad_accum)."""
        tr = cfg.train
        return cls(model, cfg.ckpt.phema_stds, cfg.ckpt.phema_every,
                   tr.global_batch or tr.batch_size * world * tr.grad_accum, run_dir, main_process)

    @torch.no_grad()
    def update(self, model):
        """Once per optimizer step, after the weights moved: eq. 4 with t = images seen after this step. A
        skipped non-finite step left the weights as they were, and averaging them again is the right profile of
        the trajectory (which stood still). beta is a Python float: no host sync."""
        if not self.every:
            return
        self.images += self.images_per_step
        params = common.local(p.detach().float() for _, p in exported_parameters(model))  # sharded: shard by shard
        for gamma, profile in zip(self.gammas, self.profiles):
            torch._foreach_lerp_(common.local(profile), params,
                                 1 - (1 - self.images_per_step / self.images) ** (gamma + 1))

    def due(self, step, last_step):
        """A snapshot falls on this step: the images seen crossed a multiple of ckpt.phema_every, or the run
        ends (the reconstruction's target time is the last snapshot)."""
        return bool(self.every) and (self.images // self.every > (self.images - self.images_per_step) // self.every
                                     or step == last_step)

    def snapshot(self, step):
        """run_dir/phema/phema_<images>.safetensors: every profile in fp16 (the paper's storage), written to a
        hidden .tmp name, flushed to disk and renamed, so only complete snapshots ever carry the real name."""
        if not self.profiles:
            return None
        from safetensors.torch import save_file

        # sharded: every rank takes part in gathering each profile whole (one tensor at a time, a collective); only
        # the main one, which writes, keeps a CPU copy (the others' would be the whole snapshot per rank, dropped)
        tensors = {}
        for std, profile in zip(self.stds, self.profiles):
            for name, p in zip(self.names, profile):
                whole = common.full(p)
                if self.main:
                    tensors[f"{std:g}/{name}"] = whole.to(SNAPSHOT_DTYPE).cpu()
        if not self.main:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"phema_{self.images:012d}.safetensors"
        tmp = self.folder / f".{final.name}.tmp"
        save_file(tensors, str(tmp), metadata={"images": str(self.images), "step": str(step),
                                               "stds": json.dumps(self.stds), "gammas": json.dumps(self.gammas)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final

    def checkpoint_tensors(self):
        """{"phema": tensors} for the checkpoint (fp32 profiles and the image count), {} when off."""
        if not self.every:
            return {}
        tensors = {f"{std:g}/{name}": p for std, profile in zip(self.stds, self.profiles)
                   for name, p in zip(self.names, profile)}
        return {"phema": {**tensors, "images": torch.tensor(self.images, dtype=torch.int64)}}

    def load(self, ckpt):
        """Continue the profiles of a checkpoint; one written without them (post-hoc EMA switched on mid-run)
        starts them from the current weights, i.e. as if the whole past had been these weights (warned). Every
        rank reads the image count (8 bytes); only the main process, which holds the profiles, reads them, one
        tensor at a time (two fp32 copies of the weights: 10 GB for the recipe model)."""
        if not self.every or ckpt is None:
            return
        if (Path(ckpt) / sharding.SHARDED).is_dir():  # a sharded checkpoint: every rank loads its shards
            keys = sharding.saved_keys(ckpt, "phema")
            if keys and self.profiles:  # before the loader, which would only say "missing key"
                self.check_stds(keys, ckpt)
            images = torch.zeros((), dtype=torch.int64)
            tensors = {**self.checkpoint_tensors()["phema"], "images": images} if self.profiles else {"images": images}
            if sharding.load_tensors(ckpt, {"phema": tensors}):
                self.images = int(images)
            else:
                print(f"warning: {ckpt} has no post-hoc EMA profiles: they start now, from the current weights")
            return
        path = Path(ckpt) / "phema.safetensors"
        if not path.exists():
            print(f"warning: {ckpt} has no post-hoc EMA profiles: they start now, from the current weights")
            return
        from safetensors import safe_open

        with safe_open(str(path), "pt", device="cpu") as f:
            self.images = int(f.get_tensor("images"))
            if self.profiles:  # no profiles off the main process: nothing more read
                self.check_stds(set(f.keys()), path)
            for std, profile in zip(self.stds, self.profiles):
                for name, p in zip(self.names, profile):
                    p.copy_(f.get_tensor(f"{std:g}/{name}"))

    def check_stds(self, keys, where):
        """A checkpoint's profile `keys` ("std/name") hold every std tracked now, else a ValueError naming the std
        (ckpt.phema_stds changed since the checkpoint), both layouts alike."""
        for std in self.stds:
            if any(f"{std:g}/{n}" not in keys for n in self.names):
                raise ValueError(f"{where} has no profile of std {std:g} (ckpt.phema_stds changed on resume?)")


# ----------------------------------------------------------------------------------------------------------
# Reconstruction after training.


def list_snapshots(folder):
    """[(path, images, stds, gammas)] of the complete snapshots in `folder`, by time. Temporary files (a
    write cut off by a kill) never match; a file whose header cannot be read is reported and left out."""
    from safetensors import safe_open

    out = []
    for path in sorted(Path(folder).glob("phema_*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            out.append((path, int(meta["images"]), json.loads(meta["stds"]), json.loads(meta["gammas"])))
        except Exception as e:  # noqa: BLE001 (any unreadable file is skipped, with its reason)
            print(f"warning: {path} is not a readable post-hoc EMA snapshot ({type(e).__name__}); left out")
    return sorted(out, key=lambda s: s[1])


def snapshot_folder(run):
    """run/phema, for a run folder or its export folder."""
    run = Path(run)
    return run / "phema" if (run / "phema").is_dir() or not (run.parent / "phema").is_dir() else run.parent / "phema"


def checkpoint_profiles(ckpt):
    """(path, images, stds, gammas) of a training checkpoint's profiles, phema.safetensors (fp32, ending exactly at
    the checkpoint's time), read from its header and the checkpoint's small state only."""
    from safetensors import safe_open

    path = Path(ckpt) / "phema.safetensors"
    if (Path(ckpt) / sharding.SHARDED).is_dir():  # train.sharding="fsdp": the profiles are read from the shards
        path, images = Path(ckpt), int(sharding.read_whole(ckpt, "phema", keys=["images"])["images"])
    elif not path.is_file():
        raise FileNotFoundError(f"{ckpt} holds no post-hoc EMA profiles (phema.safetensors): the run did not track "
                                f"them at that step (ckpt.phema_every was 0)")
    else:
        with safe_open(str(path), "pt", device="cpu") as f:
            images = int(f.get_tensor("images"))
    state = torch.load(Path(ckpt) / "state.pt", weights_only=True, map_location="cpu")
    stds = list(state["config"]["ckpt"]["phema_stds"])
    return path, images, stds, [gamma_of_std(s) for s in stds]


def reconstruct(folder, std, max_images=None, checkpoint=None):
    """The weights of the power EMA of relative std `std` at the time of the last snapshot (or the last at
    or before max_images), as {parameter name: fp32 tensor}, and a description: sum_ij x_ij theta_hat_ij over
    every profile j of every snapshot i up to then, accumulated in fp32 one snapshot at a time. With `checkpoint`
    (a training checkpoint folder): at that checkpoint's time, from the snapshots before it and the checkpoint's
    own fp32 profiles, which end exactly there (eval_fid.py / sample.py --checkpoint X --phema_std s)."""
    from safetensors.torch import load_file

    if not 0 < std <= MAX_STD:
        raise ValueError(f"--phema_std must be in (0, {MAX_STD}], got {std}")
    snaps = [s for s in list_snapshots(folder) if max_images is None or s[1] <= max_images]
    if checkpoint is not None:
        own = checkpoint_profiles(checkpoint)
        snaps = [s for s in snaps if s[1] < own[1]] + [own]
    if not snaps:
        raise FileNotFoundError(f"no post-hoc EMA snapshots in {folder}: train with ckpt.phema_every > 0")
    terms = [(path, t, s, g) for path, t, stds, gammas in snaps for s, g in zip(stds, gammas)]
    t_target = snaps[-1][1]
    x, fit_error = solve_coefficients([t for _, t, _, _ in terms], [g for *_, g in terms], t_target, gamma_of_std(std))
    weights, k = {}, 0
    for path, _, stds, _ in snaps:
        # (sharded: a folder)
        tensors = load_file(str(path)) if path.is_file() else checkpoints.read_tensors(path, "phema")
        for s in stds:
            prefix = f"{s:g}/"
            for key, value in tensors.items():
                if key.startswith(prefix):
                    name = key[len(prefix):]
                    weights[name] = weights.get(name, 0) + float(x[k]) * value.float()
            k += 1
    return weights, {"phema_std": std, "gamma": gamma_of_std(std), "images": t_target,
                     "snapshots": len(snaps), "profiles": len(terms), "profile_fit_error": fit_error,
                     "folder": str(folder), **({"checkpoint": str(checkpoint)} if checkpoint is not None else {})}


def apply_reconstruction(model, run, std, checkpoint=None):
    """Replace `model`'s parameters by the reconstructed EMA of std `std` from run's snapshots (at `checkpoint`'s
    time when given; buffers are constants and stay); returns the description."""
    weights, info = reconstruct(snapshot_folder(run), std, checkpoint=checkpoint)
    # snapshots written before they held the exported parameters only still carry REPA's projector: left out
    weights = {name: value for name, value in weights.items() if not name.startswith(TRAINING_ONLY)}
    params = dict(model.named_parameters())
    if set(weights) != set(params):
        raise ValueError(f"the snapshots in {snapshot_folder(run)} do not match this model's parameters "
                         f"({len(set(weights) ^ set(params))} names differ)")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    return info
