"""The run folder and what a run writes into it: config.json (the resolved config, first), metrics.jsonl
(every logged row, events included), labelled sample grids, wandb (online when logged in, the same wandb run
when resumed) and, at the end, the report (report.py). Main process only; both trainers use it the same way.
"""
import json
import math
import os
from pathlib import Path

import torch
from PIL import Image

import common
from training.config.config import ConfigError
from training.config.sections import size_warnings
from training.data.batching import images_in
from training.run import checkpoints
from training.record import curves

# ----------------------------------------------------------------------------------------------------------
# Image grids: validation samples and sample.py's output, each cell labelled with its class name or prompt.


def save_image_grid(images, path, nrow, labels=None):
    """images in [-1, 1], (N, 3, H, W) -> one PNG grid; returns the PIL image. `labels` (one per image: class
    names or prompts) are written under their cells, shortened to fit, and in full to a text file beside the
    grid (the same name, .txt), one line per labelled cell in grid order."""
    from torchvision.utils import make_grid

    grid = make_grid(images.float().clamp(-1, 1).add(1).mul(127.5).round().byte().cpu(), nrow=nrow, padding=2)
    if len(images) == 1:  # make_grid returns a single image as it is: pad it like any grid's cell
        grid = torch.nn.functional.pad(grid, (2, 2, 2, 2))
    img = Image.fromarray(grid.permute(1, 2, 0).numpy())
    side = min(images.shape[-2:])
    factor = math.ceil(64 / side) if side < 64 else 1
    if factor > 1:  # small images (the demo's 16 px) are enlarged, pixel for pixel, to be seen
        img = img.resize((img.width * factor, img.height * factor), Image.NEAREST)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if labels is not None:
        img = caption_cells(img, labels, nrow, (images.shape[-1] + 2) * factor, (images.shape[-2] + 2) * factor)
        Path(path).with_suffix(".txt").write_text("".join(  # a blank cell (a bucket row's end) has no line
            f"{i}\trow {i // nrow + 1}, column {i % nrow + 1}\t{label}\n" for i, label in enumerate(labels)
            if label != ""))
    img.save(path)
    return img


def bucket_rows(groups):
    """Tensors (N_i, 3, H_i, W_i) of several shapes as one (sum N_i, 3, H, W) of the largest sides, each image
    centred on mid-grey (0), so one grid shows them at their own shapes."""
    h, w = max(x.shape[-2] for x in groups), max(x.shape[-1] for x in groups)
    pad = [torch.nn.functional.pad(x, ((w - x.shape[-1]) // 2, -(-(w - x.shape[-1]) // 2), (h - x.shape[-2]) // 2,
                                       -(-(h - x.shape[-2]) // 2))) for x in groups]
    return torch.cat(pad)


def caption_cells(grid, labels, nrow, cell, height=None):
    """The grid with a line of text under each row of cells: each cell's label, cut to the cell's width (`cell`;
    `height`: a cell's height, when the cells are not square)."""
    from PIL import ImageDraw, ImageFont

    width, cell = cell, height or cell
    font = ImageFont.load_default()
    band = font.getbbox("Ag")[3] + 4
    rows = math.ceil(len(labels) / nrow)
    out = Image.new("RGB", (grid.width, grid.height + rows * band), "white")
    draw = ImageDraw.Draw(out)
    for r in range(rows):
        out.paste(grid.crop((0, r * cell, grid.width, (r + 1) * cell)), (0, r * (cell + band)))
        for c, label in enumerate(labels[r * nrow:(r + 1) * nrow]):
            text = str(label)
            while text and draw.textlength(text, font=font) > width - 4:
                text = text[:-1]
            if text != str(label):
                text = text[:-2] + ".."
            draw.text((c * width + 3, r * (cell + band) + cell), text, fill="black", font=font)
    out.paste(grid.crop((0, rows * cell, grid.width, grid.height)), (0, rows * (cell + band)))  # bottom padding
    return out


# ----------------------------------------------------------------------------------------------------------
# The run folder and its sinks.


# What a run leaves in its run_dir (README, "What a run writes"; eval_fid.py's eval/, sample.py's sampled/,
# tools/rate.py's votes). config.json alone is not a run: a start stopped before training (in the cache build) may
# start again.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "samples", "phema", "export", "report.md", "eval", "sampled",
               "ratings.jsonl")


def refuse_earlier_run(cfg):
    """A new run (no resume) into a run_dir that holds one would train beside the old checkpoints (which a later
    --resume latest may pick) and report the old samples, evaluations and votes: stopped before any work. At the
    trainers' start, not in config.load_config, which also reads configs that start no run."""
    found = [name for name in RUN_OUTPUTS if (Path(cfg.run_dir) / name).exists()] if cfg.resume is None else []
    if found:
        raise ConfigError(f"run_dir={cfg.run_dir!r} already holds a run ({', '.join(found)}): continue it with "
                          f"--resume latest, or give this run a new run_dir (a new run there would mix with the old "
                          f"one's checkpoints and outputs)")


def finished_run(cfg):
    """--resume of a run that is done: its checkpoint at train.max_steps (or past it), its export of that step
    (export/config.json's train.max_steps) and, with log.report, its report written after that checkpoint. Then the
    run folder, after saying so and how to train longer: the trainer returns it before any work, writing nothing
    again. Else None. A run stopped after its last checkpoint but before its export or report is not done: the
    resumed run writes them. The report is dated against the checkpoint, not the export: tools/export.py writes
    the export again after the run (the model card's evaluations, tools/tune.py's settings), and that newer export
    is the user's, never the sign of a run stopped before its report."""
    ckpt = checkpoints.find_checkpoint(cfg.run_dir, cfg.resume) if cfg.resume else None
    if ckpt is None:
        return None
    run_dir, step = Path(cfg.run_dir), checkpoints.read_state(ckpt)["step"]
    export, report = run_dir / "export" / "config.json", run_dir / "report.md"
    if step < cfg.train.max_steps or not export.is_file():
        return None
    if json.loads(export.read_text())["train"]["max_steps"] != step:  # the export of a shorter run, trained on since
        return None
    written = (Path(ckpt) / "state.pt").stat().st_mtime  # the checkpoint, then the export, then the report
    if cfg.log.report and not (report.is_file() and report.stat().st_mtime >= written):
        return None
    schedule = (f" (the {cfg.train.lr_schedule} LR schedule is then laid over the N steps)"
                if cfg.train.lr_schedule != "constant" else "")
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"resume: {cfg.run_dir} is done: its checkpoint {ckpt.name} is at step {step} (train.max_steps="
              f"{cfg.train.max_steps}), and its export{' and report are' if cfg.log.report else ' is'} of that step. "
              f"Nothing left to train; nothing was written. To train longer: --resume latest --train.max_steps=N, "
              f"N > {step}{schedule}")
    return run_dir


def start_run(cfg, accelerator):
    """The run folder, with the resolved config written first."""
    run_dir = Path(cfg.run_dir)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return run_dir


def describe_run(accelerator, cfg, model, train_set, lr_rule, method):
    """The run in one line (parameters, global batch, LR rule, the method's own settings in `method`), then a
    warning for a model far larger than its data, counted in images, not cached views (sections.size_warnings)."""
    tr, world, n_params = cfg.train, accelerator.num_processes, sum(p.numel() for p in model.parameters())
    accelerator.print(f"model: {n_params / 1e6:.2f}M parameters; global batch {tr.batch_size} x {world} processes x "
                      f"{tr.grad_accum} accumulation = {tr.batch_size * world * tr.grad_accum}; {lr_rule}; {method}")
    for warning in size_warnings(cfg, n_params, images_in(train_set), world):
        accelerator.print(f"warning: {warning}")

def wandb_mode(setting):
    """log.wandb as wandb.init's mode. "auto": WANDB_MODE if set, else online when the user is logged in (a
    WANDB_API_KEY, or the netrc entry that `wandb login` writes for the wandb host), else offline (sync later
    with `wandb sync`)."""
    import netrc
    from urllib.parse import urlparse

    if setting != "auto":
        return setting
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(os.environ.get("NETRC") or Path.home() / ".netrc").authenticators(host)
    except (OSError, netrc.NetrcParseError):
        entry = None
    return "online" if entry and entry[2] else "offline"


class RunLog:
    """metrics.jsonl (every row, events included) and wandb (offline when no key), main process only.
    Call it with a dict of metrics that has a "step". A run that starts at `start_step` (resumed from that
    checkpoint, or 0) first moves the rows logged past it (by a run killed after its last checkpoint) to
    metrics.after_step_N.jsonl, so metrics.jsonl holds each step once, as an uninterrupted run would."""

    def __init__(self, cfg, run_dir, accelerator, start_step=0):
        self.run_dir, self.main, self.wandb = Path(run_dir), accelerator.is_main_process, None
        self.print, self.reference = accelerator.print, curves.load(cfg)  # val.reference_curves: the recipe's band
        if self.reference and (changed := curves.differences(self.reference, cfg)):
            self.print(f"note: this run differs from the reference curves' runs in {', '.join(changed)}: "
                       f"compared step by step all the same")
        metrics = self.run_dir / "metrics.jsonl"
        if self.main and metrics.exists():
            rows = metrics.read_text().splitlines(keepends=True)
            keep = [r.endswith("\n") and json.loads(r)["step"] <= start_step for r in rows]  # a cut-short line: aside
            later = [r for r, k in zip(rows, keep) if not k]
            if later:
                aside = self.run_dir / f"metrics.after_step_{start_step}.jsonl"
                with open(aside, "a") as f:
                    f.writelines(r if r.endswith("\n") else r + "\n" for r in later)
                metrics.with_suffix(".tmp").write_text("".join(r for r, k in zip(rows, keep) if k))
                os.replace(metrics.with_suffix(".tmp"), metrics)
                accelerator.print(f"metrics: {len(later)} rows logged after step {start_step} (past the checkpoint) "
                                  f"moved to {aside.name}")
        if self.main and cfg.log.wandb != "off":
            import wandb

            # The wandb run id lives in the run folder: --resume continues the same wandb run, a fresh start
            # in the same folder begins a new one.
            id_file = self.run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if cfg.resume and id_file.is_file() else os.urandom(4).hex()
            id_file.write_text(run_id + "\n")
            self.wandb = wandb.init(project=cfg.log.project, dir=str(run_dir), config=cfg,
                                    mode=wandb_mode(cfg.log.wandb),
                                    name=self.run_dir.name, id=run_id, resume="allow")

    def __call__(self, metrics):
        if self.main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if self.wandb is not None and "event" not in metrics:  # events: metrics.jsonl and the report
                self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
        for event in curves.off_band(self.reference, metrics) if self.reference and "event" not in metrics else ():
            self.print(f"warning: {curves.describe(event, self.reference['seeds'])}")
            self(event)

    def samples(self, images, step, labels=None):
        """A grid of validation samples, run_dir/samples/step_N.png (and wandb), each cell labelled with its class
        name or prompt (under the cell, and in full in step_N.txt). A list of tensors (a bucket run's grids, one
        shape each): a row of cells a bucket, each cell its shape centred on grey, its label led by its shape."""
        path = self.run_dir / "samples" / f"step_{step:08d}.png"
        nrow = math.ceil(math.sqrt(len(images)))
        if isinstance(images, list):  # a row a bucket: a shorter one ends in blank grey cells
            nrow, cells = max(len(x) for x in images), []
            for x in images:
                cells += [f"{x.shape[-1]}x{x.shape[-2]}: {label}" for label in (labels or [""] * len(x))[:len(x)]]
                cells += [""] * (nrow - len(x))
            images = bucket_rows([torch.cat([x, x.new_zeros(nrow - len(x), *x.shape[1:])]) for x in images])
            labels = cells
        grid = save_image_grid(images, path, nrow=nrow, labels=labels)
        if self.wandb is not None:
            import wandb

            self.wandb.log({"samples": wandb.Image(grid)}, step=step)
        return path

    def finish(self, cfg, accelerator):
        """The run report (a plotting problem must not fail a finished run), then close the sinks."""
        if self.main and cfg.log.report:
            try:
                from training.record import report  # here: matplotlib takes seconds, and most starts end no run

                accelerator.print(f"report: {report.write_report(self.run_dir)}")
            except Exception as e:
                accelerator.print(f"warning: the run report failed ({type(e).__name__}: {e}); "
                                  f"python -m training.record.report {self.run_dir}")
        if self.wandb is not None:
            self.wandb.finish()
        common.end_processes(accelerator)
