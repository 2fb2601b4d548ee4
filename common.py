"""Small run helpers that both trainers call the same way: config loading and checking, accelerator and
seeds, stop signals, EMA, the LR schedule and its scaling rule, the resolution time shift, image grids,
RNG state, checkpoint save / find / load, and the run's logging sinks.

Nothing here knows about an objective, a sampler, the data or the model: those live in the trainers,
data.py and model.py. What a training step measures is monitor.py's.
"""
import json
import math
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

# ----------------------------------------------------------------------------------------------------------
# Config: defaults (a nested dict in each trainer) <- --config file.json <- --dotted.key=value


class Config(dict):
    """A dict whose keys also read as attributes (cfg.train.lr), so it still dumps to JSON as is."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no key '{key}'") from None

    def __setattr__(self, key, value):  # cfg.run_dir = ... sets the key, so config.json records it
        self[key] = value


def _merge(base, override, where, prefix=""):
    out = Config({k: Config(v) if isinstance(v, dict) else v for k, v in base.items()})
    for key, value in override.items():
        name = prefix + key
        if key not in base:
            close = [k for k in base if k.startswith(key[:3])]
            raise ValueError(f"unknown config key '{name}' ({where}); known keys here: {sorted(base)}"
                             + (f", did you mean {close}?" if close else ""))
        default = base[key]
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ValueError(f"config key '{name}' ({where}) must be a section (dict), got {value!r}")
            out[key] = _merge(default, value, where, name + ".")
            continue
        ok = (default is None or (value is None and type(default) is str)  # a str setting can be switched off
              or (type(default) is bool and type(value) is bool)
              or (type(default) is int and type(value) is int)
              or (type(default) is float and type(value) in (int, float))
              or (type(default) in (str, list) and type(value) is type(default)))
        if not ok:
            raise ValueError(f"config key '{name}' ({where}) must be {type(default).__name__}, "
                             f"got {type(value).__name__} {value!r}")
        out[key] = float(value) if type(default) is float else value
    return out


def load_config(defaults, argv=None, method="run"):
    """Resolve the config: the trainer's DEFAULTS, then `--config file.json`, then `--a.b=value` overrides.

    Unknown keys and wrong types raise ValueError naming the key. Values parse as JSON when they can
    (`--train.lr=3e-4`, `--data.label_column=null`) and as plain strings otherwise. A run_dir left unset
    becomes runs/{method}_{config file name} (runs/flow_matching_demo without a config), so one recipe can
    be run by both trainers side by side; for the same reason "{method}" in init_from becomes the trainer's
    name (configs/imagenet512.json starts from runs/{method}_imagenet256).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = _merge(defaults, {}, "defaults")
    overrides, name = [], "demo"
    while argv:
        arg = argv.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: use --config FILE or --key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if not argv:
                raise ValueError(f"argument --{key} needs a value")
            value = argv.pop(0)
        if key == "config":
            if not Path(value).is_file():
                raise FileNotFoundError(f"config file not found: {value}")
            cfg, name = _merge(cfg, json.loads(Path(value).read_text()), f"from {value}"), Path(value).stem
        else:
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
            for part in reversed(key.split(".")):
                value = {part: value}
            overrides.append((value, arg))
    for value, arg in overrides:
        cfg = _merge(cfg, value, f"from {arg}")
    if "run_dir" in cfg and cfg.run_dir is None:
        cfg.run_dir = f"runs/{method}_{name}"
    if cfg.get("init_from"):
        cfg.init_from = cfg.init_from.replace("{method}", method)
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Run helpers: accelerator, stop signals, config checks, EMA, LR, time shift.


def make_accelerator(mixed_precision):
    """The Accelerator every script uses. cpu=True without CUDA: `accelerate launch --multi_gpu` then forms
    one gloo group of CPU processes; otherwise accelerate 1.x lets each process silently train alone, which
    is also refused here. TF32 matmuls and convolutions on Ampere and newer (fp32 work at tensor-core speed).
    DDP: gradients are views into its all-reduce buckets (no second copy of the gradients in memory). Its
    static_graph stays off: it fails under no_sync accumulation (an internal assert in the reducer), and with
    find_unused_parameters off DDP already skips the per-step search for unused parameters."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available(), kwargs_handlers=[ddp])
    world = accelerator.num_processes
    if world != int(os.environ.get("WORLD_SIZE", world)):
        raise RuntimeError(f"launched {os.environ['WORLD_SIZE']} processes but accelerate formed a group of {world}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return accelerator


REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; the SLURM script in the README requeues on it


def ignore_stop_signals(worker_id=None):
    """DataLoader workers leave SIGTERM / SIGUSR1 to the training process, which checkpoints and exits."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class StopSignals:
    """SIGTERM / SIGUSR1 (preemption) are recorded, not obeyed at once: the loop finishes its step, writes a
    checkpoint and exits with REQUEUE_EXIT_CODE, so the scheduler requeues and --resume latest continues."""

    def __init__(self):
        self.received = []
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: self.received.append(signum))

    def agreed(self, accelerator):
        """Whether to stop now; whichever ranks got the signal, all stop at the same step."""
        stop = torch.tensor(float(bool(self.received)), device=accelerator.device)
        if accelerator.num_processes > 1:
            stop = accelerator.reduce(stop, "sum")
        return bool(stop)


def exit_for_requeue(accelerator, step):
    accelerator.print(f"stopped by a signal at step {step}: checkpoint written; exiting with code "
                      f"{REQUEUE_EXIT_CODE} so the scheduler can requeue (--resume latest continues)")
    accelerator.end_training()
    sys.exit(REQUEUE_EXIT_CODE)


def check_config(cfg):
    """Refuse illegal combinations at start-up, with a message naming the keys (all problems at once)."""
    d, m, tr = cfg["data"], cfg["model"], cfg["train"]
    factor = 1
    if cfg["encoders"]["vae"]:  # only the VAE's config is read here (no weights)
        from diffusers import AutoencoderKL

        factor = 2 ** (len(AutoencoderKL.load_config(cfg["encoders"]["vae"])["block_out_channels"]) - 1)
    errors = []
    if d["resolution"] % (m["patch_size"] * factor):
        errors.append(f"data.resolution={d['resolution']} is not divisible by model.patch_size={m['patch_size']}"
                      f" x the VAE's downsampling factor {factor}")
    if bool(d["caption_column"] or d["label_captions"]) != bool(cfg["encoders"]["text_encoder"]):
        errors.append("encoders.text_encoder goes with data.caption_column (or data.label_captions): set both or neither")
    if d["label_captions"] and (d["caption_column"] or not d["label_column"]):
        errors.append("data.label_captions captions each image with its class name: it needs data.label_column "
                      "and no data.caption_column")
    if m["pos_embed_transfer"] not in ("resample", "extend"):
        errors.append(f"model.pos_embed_transfer={m['pos_embed_transfer']!r} must be 'resample' or 'extend'")
    if not d["label_column"] and not d["caption_column"]:
        errors.append("set data.label_column (class-conditional) or data.caption_column (text-to-image)")
    if d["label_column"] and not d["caption_column"] and d["num_classes"] < 1:
        errors.append(f"data.num_classes={d['num_classes']} must be >= 1 with data.label_column")
    if tr["mixed_precision"] not in ("no", "fp16", "bf16"):
        errors.append(f"train.mixed_precision={tr['mixed_precision']!r} must be 'no', 'fp16' or 'bf16'")
    if tr["lr_schedule"] not in ("constant", "cosine", "linear"):
        errors.append(f"train.lr_schedule={tr['lr_schedule']!r} must be 'constant', 'cosine' or 'linear'")
    if tr["lr_scaling"] not in ("none", "sqrt", "linear"):
        errors.append(f"train.lr_scaling={tr['lr_scaling']!r} must be 'none', 'sqrt' or 'linear'")
    for key in ("batch_size", "grad_accum", "max_steps"):
        if tr[key] < 1:
            errors.append(f"train.{key}={tr[key]} must be >= 1")
    if errors:
        raise ValueError("invalid config:\n  " + "\n  ".join(errors))



def make_optimizer(model, tr):
    """Adam(W) (weight_decay 0 = Adam, as in the paper), fused: one kernel for all weights per step on CUDA, and
    the kernel that takes a skip decision on the device (step_unless_nonfinite). Fused runs on CPU too, so the
    tests exercise the same optimizer as a GPU run."""
    return torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tuple(tr.betas), weight_decay=tr.weight_decay,
                             fused=True)


def step_unless_nonfinite(optimizer, finite, fp16=False):
    """optimizer.step(), skipped on the device when `finite` (0-dim bool tensor) is False, so the host never waits
    to read it: the fused AdamW reads `found_inf` (torch's GradScaler mechanism), leaves weights and moments as
    they were and takes back its step-count increment. Under fp16 the grad scaler sets found_inf itself (its own
    check of the unscaled gradients) and lowers its scale; accelerate then reads the scale, a sync fp16 keeps."""
    if not fp16:
        getattr(optimizer, "optimizer", optimizer).found_inf = (~finite).float()  # inside accelerate's wrapper
    optimizer.step()


@torch.no_grad()
def ema_update(ema, model, decay, num_updates, applied=None):
    """ema <- d * ema + (1 - d) * model with the warm-up d = min(decay, (1 + n) / (10 + n)), so a short run
    samples from what it learned rather than from a blend with the random initialisation. `applied` (0-dim bool
    tensor): the step's update happened; when False the EMA moves by 0, decided on the device."""
    d = min(decay, (1 + num_updates) / (10 + num_updates))
    ema_p = list(ema.parameters())
    # A list of device tensors as weights: one tensor alone would be read on the host (a sync) by foreach lerp.
    weight = 1 - d if applied is None else [(1 - d) * applied.float()] * len(ema_p)
    torch._foreach_lerp_(ema_p, [p.detach().float() for p in model.parameters()], weight)


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


def scaled_lr(tr, global_batch):
    """train.lr for train.lr_reference_batch, scaled to this run's global batch: "sqrt" (lr ~ sqrt(batch), the
    rule that keeps Adam's update noise constant; Malladi et al. 2022) or "linear" (Goyal et al. 2017, for
    SGD); "none" keeps train.lr. Returns the LR and a line saying how it was obtained, printed at start."""
    ratio = global_batch / tr["lr_reference_batch"]
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[tr["lr_scaling"]]  # check_config refused other values
    lr = tr["lr"] * ratio ** power
    how = "" if power == 0 else f" = {tr['lr']:g} x ({global_batch} / {tr['lr_reference_batch']})^{power:g}"
    return lr, (f"lr {lr:.3g}{how} ({tr['lr_scaling']} scaling rule), {tr['lr_schedule']} schedule, "
                f"{tr['warmup_steps']} warm-up steps of {tr['max_steps']}")


def shift_of(cfg):
    """The resolution shift a of a run: data.resolution / objective.shift_base_resolution if that is set
    (a = 2 for 512 px against a 256 px base), else objective.time_shift. Both trainers read it from the run's
    config, which is saved with the model, so training and sampling use the same shifted schedule."""
    obj = cfg["objective"]
    return cfg["data"]["resolution"] / obj["shift_base_resolution"] if obj["shift_base_resolution"] else obj["time_shift"]


def time_shift(t, shift):
    """Resolution time shift t' = a t / (1 + (a - 1) t) (SD3, Esser et al. 2024, eq. 23): a > 1 moves
    the same t toward noise, as more pixels need more noise to destroy the same signal. a = 1: identity."""
    return shift * t / (1 + (shift - 1) * t)


# ----------------------------------------------------------------------------------------------------------
# Images and checkpoints.


def save_image_grid(images, path, nrow):
    """images in [-1, 1], (N, 3, H, W) -> one PNG grid; returns the PIL image."""
    from torchvision.utils import make_grid

    grid = make_grid(images.float().clamp(-1, 1).add(1).mul(127.5).round().byte().cpu(), nrow=nrow, padding=2)
    img = Image.fromarray(grid.permute(1, 2, 0).numpy())
    if images.shape[-1] < 64:  # small images (the demo's 16 px) are enlarged, pixel for pixel, to be seen
        factor = math.ceil(64 / images.shape[-1])
        img = img.resize((img.width * factor, img.height * factor), Image.NEAREST)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return img


def rng_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as lists: safe to load with weights_only=True
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(ckpt, rank, world):
    """This rank's RNG state from a checkpoint. A checkpoint written by a different number of processes
    still resumes (weights, EMA, optimizer, step), but not exactly: the data order and noise change."""
    saved = len(list(Path(ckpt).glob("rng_*.pt")))
    if saved != world:
        print(f"warning: {ckpt} was written by {saved} processes and is resumed by {world}: weights, EMA, "
              f"optimizer and step continue, but data order and noise differ from an uninterrupted run")
    if (Path(ckpt) / f"rng_{rank}.pt").exists():
        set_rng_state(torch.load(Path(ckpt) / f"rng_{rank}.pt", weights_only=True))


def set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_ok(folder):
    """Every file of a checkpoint opens: safetensors headers match the file sizes, state.pt unpickles."""
    try:
        for path in Path(folder).glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                f.keys()
        torch.load(Path(folder) / "state.pt", weights_only=True, map_location="cpu")
        return (Path(folder) / "model.safetensors").exists()
    except Exception:
        return False


def find_checkpoint(run_dir, resume):
    """`resume` is 'latest' (newest intact checkpoint of this run, or None) or a checkpoint folder. A
    truncated or corrupt newest checkpoint falls back to the previous one, with a warning."""
    if resume != "latest":
        if not checkpoint_ok(resume):
            raise FileNotFoundError(f"resume: no intact checkpoint at {resume} (model.safetensors, state.pt)")
        return Path(resume)
    for folder in sorted((Path(run_dir) / "checkpoints").glob("step_*"), reverse=True):
        if checkpoint_ok(folder):
            return folder
        print(f"warning: checkpoint {folder} is incomplete or corrupt; falling back to an earlier one")
    return None


def save_checkpoint(accelerator, run_dir, step, tensors, state, keep):
    """Write checkpoints/step_N atomically: into a temporary folder, renamed when complete; keep the last
    `keep`. Every rank calls this (each saves its own RNG state); the main process writes the rest."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, sd in tensors.items():
            save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(tmp / f"{name}.safetensors"))
        torch.save(state, tmp / "state.pt")  # written last: its presence marks a finished checkpoint
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final




def load_checkpoint(ckpt, model, ema, optimizer, accelerator):
    """Resume: weights, EMA, optimizer and this rank's RNG from a checkpoint; returns its state (step, ...)."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    ema.load_state_dict(load_file(str(ckpt / "ema.safetensors")))
    state = torch.load(ckpt / "state.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    restore_rng(ckpt, accelerator.process_index, accelerator.num_processes)
    accelerator.print(f"resumed from {ckpt} at step {state['step']}")
    return state


# ----------------------------------------------------------------------------------------------------------
# The run folder and its logging sinks: config.json, metrics.jsonl, sample grids, wandb, the report.


def start_run(cfg, accelerator):
    """The run folder, with the resolved config written first."""
    run_dir = Path(cfg.run_dir)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return run_dir


class RunLog:
    """metrics.jsonl (every row, events included) and wandb (offline when no key), main process only.
    Call it with a dict of metrics that has a "step"."""

    def __init__(self, cfg, run_dir, accelerator):
        self.run_dir, self.main, self.wandb = Path(run_dir), accelerator.is_main_process, None
        if self.main and cfg.log.wandb != "off":
            import wandb

            mode = cfg.log.wandb if cfg.log.wandb != "auto" else ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=cfg.log.project, dir=str(run_dir), config=cfg, mode=mode,
                                    name=self.run_dir.name, resume="allow")

    def __call__(self, metrics):
        if self.main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if self.wandb is not None and "event" not in metrics:  # events: metrics.jsonl and the report
                self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def samples(self, images, step):
        """A labelled grid of validation samples, run_dir/samples/step_N.png (and wandb)."""
        path = self.run_dir / "samples" / f"step_{step:08d}.png"
        grid = save_image_grid(images, path, nrow=math.ceil(math.sqrt(len(images))))
        if self.wandb is not None:
            import wandb

            self.wandb.log({"samples": wandb.Image(grid)}, step=step)
        return path

    def finish(self, cfg, accelerator):
        """The run report (a plotting problem must not fail a finished run), then close the sinks."""
        if self.main and cfg.log.report:
            try:
                import report

                accelerator.print(f"report: {report.write_report(self.run_dir)}")
            except Exception as e:
                accelerator.print(f"warning: the run report failed ({type(e).__name__}: {e}); python report.py {self.run_dir}")
        if self.wandb is not None:
            self.wandb.finish()
        accelerator.end_training()
