"""The export as a diffusers pipeline folder (training/sharing/pipeline_export.py): loaded in a fresh process where this
repository cannot be imported, its samples are sample.py's for the same seeds, classes or prompts and settings (flow
matching, DDPM with a VAE, a text run); its sampling loop is the trainer's at DDPM step counts that do not divide
1000 and for x-prediction; the exported conditioner is the trained one; the model card holds the run's numbers; a
push is refused before any work without a repo name, network or token, and goes private."""
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import diffusers
import torch
from diffusers import SD3Transformer2DModel
from PIL import Image

import eval_fid
import sample
import train_ddpm as ddpm
import train_flow_matching as fm
from conftest import ROOT, tiny_run_args
from training.config import config
from training.data import emoji
from training.data.encoders import encode_text, load_encoders
from training.model.mmdit import Conditioner, build_denoiser
from training.run import hub
from training.evaluation import generation, sampling, tuning
from training.evaluation.metrics import size_tag
from training.sharing import model_card, pipeline_export, public
from training.sharing.exported.conditioner import Conditioner as ExportedConditioner
from training.sharing.exported.pipeline import MinimalDiffusionPipeline

# Loads each folder with diffusers alone (python -I: no PYTHONPATH, no current folder on sys.path) and samples it
# twice, the sampler's output ("latent") and the images, each image's noise from its own seeded generator.
LOAD_AND_SAMPLE = """
import json, sys
import numpy as np, torch
try:
    import training
    sys.exit("this repository is importable here")
except ImportError:
    pass
from diffusers import DiffusionPipeline
jobs, out = json.loads(sys.argv[1]), {}
for job in jobs:
    pipe = DiffusionPipeline.from_pretrained(job["folder"], trust_remote_code=True)
    noise = lambda: [torch.Generator().manual_seed(s) for s in job["seeds"]]
    latent = pipe(job["prompts"], generator=noise(), output_type="latent", **job["kwargs"]).images
    images = pipe(job["prompts"], generator=noise(), **job["kwargs"]).images
    out[job["name"]] = {"latent": latent, "pixels": torch.from_numpy(np.stack([np.asarray(i) for i in images]))}
torch.save(out, sys.argv[2])
"""


def train(trainer, tmp, name, extra):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the last run's is the fixture's to undo (conftest)
    return trainer.main(tiny_run_args(tmp, name, steps=2) + ["--log.report=false", "--model.num_layers=1", *extra])


def repo_latents(run, labels=None, prompts=None, **overrides):
    """The repository's own sampler (the trainer's generate, as sample.py calls it) on sample.py's noise and
    conditions: image i's noise from generation.seed_for(0, 0, i), controls of an uncropped square original."""
    model, cfg, _ = sampling.load_model(run)
    tc, n = model.transformer.config, len(labels or prompts)
    noise = torch.stack([torch.randn((tc.in_channels, tc.sample_size, tc.sample_size),
                                     generator=torch.Generator().manual_seed(generation.seed_for(0, 0, i)))
                         for i in range(n)])
    cond = {"drop": torch.zeros(n, dtype=torch.bool)}
    if prompts:
        text = load_encoders(config.Config({**cfg["encoders"], "vae": None}), torch.device("cpu"))[1:]
        cond.update(encode_text(*text, prompts, cfg["encoders"]["max_tokens"]))
    else:
        cond["label"] = torch.tensor(labels)
    controls = generation.make_controls(cfg, "square")
    if controls is not None:
        meta = [controls(i) for i in range(n)]
        cond.update({k: torch.stack([m[k] for m in meta]) for k in meta[0]})
    with torch.no_grad():
        return eval_fid.method_of(cfg).generate(model, noise, cond, cfg, **overrides)


def pngs(folder):
    return np.stack([np.asarray(Image.open(p)) for p in sorted(folder.glob("0*.png"))])


@pytest.mark.slow
def test_the_folder_samples_as_sample_py_where_this_repository_is_not_importable(tmp_path, tiny_vae, tiny_text_encoder):
    # Flow matching with the settings the pipeline must carry over: a time shift, a guidance interval that leaves
    # the last step unguided (t = 1, 0.8 guided; 0.5 not), control guidance on the size / crop / flip controls.
    runs = {"flow": train(fm, tmp_path, "flow", ["--objective.time_shift=2", "--val.steps=3",
                                                 "--val.guidance_interval=[0.6,1]",
                                                 "--val.control_guidance_scale=1.5",
                                                 '--conditioning.controls=["size","crop","flip"]']),
            # DDPM (v-prediction, zero terminal SNR, DDIM, guidance rescale) in a VAE's latents, with a resolution
            # shift, on 6 steps, which do not divide 1000 (DDIMScheduler's own step would go back 166: 999 -> 833,
            # not 832)
            "ddpm": train(ddpm, tmp_path, "ddpm",
                          [f"--encoders.vae={tiny_vae}", "--objective.time_shift=2", "--val.steps=6"]),
            "text": train(fm, tmp_path, "text", ["--data.caption_column=caption", "--encoders.max_tokens=8",
                                                 f"--encoders.text_encoder={tiny_text_encoder}"])}
    classes, prompts = ["red circle", "8"], ["a small red circle", "a large blue square"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    jobs = [{"name": name, "folder": str(run / "export"), "prompts": prompts if name == "text" else classes,
             "seeds": [generation.seed_for(0, 0, i) for i in range(2)], "kwargs": {}} for name, run in runs.items()]
    jobs.append({**jobs[0], "name": "flow, guidance 2 everywhere",
                 "kwargs": {"guidance_scale": 2.0, "guidance_interval": [0, 1]}})
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-I", "-c", LOAD_AND_SAMPLE, json.dumps(jobs), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(ROOT) not in done.stderr  # no traceback or warning from this repository's files
    theirs = torch.load(tmp_path / "out.pt")

    for name, run in runs.items():
        args = ["--prompts", str(tmp_path / "prompts.txt")] if name == "text" else ["--classes", ",".join(classes)]
        out = sample.main(["--run", str(run), *args, "--per_class", "1", "--out", str(tmp_path / f"sampled_{name}")])
        ours = repo_latents(run, *(([], prompts) if name == "text" else ([0, 8],)))
        torch.testing.assert_close(theirs[name]["latent"], ours, atol=2e-4, rtol=1e-4,
                                   msg=f"{name}: the sampler's output")
        diff = np.abs(theirs[name]["pixels"].numpy().astype(int) - pngs(out).astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, f"{name}: the images differ from sample.py's"
    # Call arguments override the run's settings, as sample.py's flags do.
    torch.testing.assert_close(theirs["flow, guidance 2 everywhere"]["latent"], repo_latents(
        runs["flow"], [0, 8], guidance_scale=2.0, guidance_interval=[0, 1]), atol=2e-4, rtol=1e-4)
    assert not torch.allclose(theirs["flow, guidance 2 everywhere"]["latent"], theirs["flow"]["latent"], atol=1e-2)
    # sample.py, eval_fid.py and init_from read the pipeline folder as they read a run.
    again = sample.main(["--run", str(runs["flow"] / "export"), "--classes", ",".join(classes), "--per_class", "1",
                         "--out", str(tmp_path / "from_folder")])
    assert np.array_equal(pngs(again), pngs(tmp_path / "sampled_flow"))


@pytest.mark.slow
def test_a_text_run_trains_resumes_exactly_and_its_export_carries_the_text_encoder(tmp_path, tiny_text_encoder):
    """Issue 69: a text run's export named its text encoder's local folder (text_encoder_id), and once that folder
    was gone the pipeline failed (OSError: Repo id must be in the form ...). A text run on a local text encoder: 4
    steps straight equal 2 and a resume to 4, bitwise; its export carries the encoder and tokenizer (text_encoder/,
    tokenizer/: components of model_index.json) and the card names the folder, not its path. With the folder gone,
    pipe("a red apple") loads and samples with diffusers alone where this repository cannot be imported, and gives
    sample.py --prompt's image at the same seed, steps and guidance; tools/export.py re-exports it (carrying the old
    export's copy, config.json keeping the run's name) and sample.py on that gives the same image again."""
    import tools.export as export_tool
    from test_robustness import assert_same_checkpoint

    clip = shutil.copytree(tiny_text_encoder, tmp_path / "clip")  # the session's fixture stays where it is
    args = tiny_run_args(tmp_path, steps=4) + [
        "--data.caption_column=caption", "--encoders.max_tokens=8", f"--encoders.text_encoder={clip}",
        "--model.num_layers=1", "--log.report=false", "--log.every=1", "--ckpt.every=2", "--val.guidance_scale=2"]
    straight = train(fm, tmp_path, "straight", args + ["--run_dir", str(tmp_path / "straight")])
    train(fm, tmp_path, "resumed", args + ["--run_dir", str(tmp_path / "resumed"), "--train.max_steps=2"])
    train(fm, tmp_path, "resumed", args + ["--run_dir", str(tmp_path / "resumed"), "--resume=latest"])
    assert_same_checkpoint(straight, tmp_path / "resumed", 4)

    export = straight / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"] and index["text_encoder_id"] is None
    assert index["tokenizer"] == ["transformers", "PreTrainedTokenizerFast"]
    card = (export / "README.md").read_text()
    assert "conditioned on captions encoded by `clip` (this folder's `text_encoder/`)" in card and str(clip) not in card
    assert "the text encoder and its tokenizer are this folder's `text_encoder/` and `tokenizer/`" in card
    shutil.move(clip, tmp_path / "elsewhere")  # the folder it was trained with is gone
    prompt, steps, seed = "a red apple", 4, generation.seed_for(0, 0, 0)  # sample.py --seed 0's noise of image 0
    job = {"name": "text", "folder": str(export), "prompts": [prompt], "seeds": [seed],
           "kwargs": {"num_inference_steps": steps, "guidance_scale": 2.0}}
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-I", "-c", LOAD_AND_SAMPLE, json.dumps([job]), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")["text"]
    out = sample.main(["--run", str(export), "--prompt", prompt, "--per_class", "1", "--steps", str(steps),
                       "--guidance_scale", "2", "--seed", "0", "--out", str(tmp_path / "sampled")])
    ours = repo_latents(export, prompts=[prompt], steps=steps, guidance_scale=2.0)
    torch.testing.assert_close(theirs["latent"], ours, atol=2e-4, rtol=1e-4, msg="the sampler's output")
    diff = np.abs(theirs["pixels"].numpy().astype(int) - pngs(out).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, "the pipeline's image differs from sample.py --prompt's"

    export_tool.main(["--run", str(straight)])  # after an evaluation, say: the folder it was trained with still gone
    assert json.loads((export / "config.json").read_text())["encoders"]["text_encoder"] == str(clip)
    assert "captions encoded by `clip` (this folder's `text_encoder/`)" in (export / "README.md").read_text()
    again = sample.main(["--run", str(export), "--prompt", prompt, "--per_class", "1", "--steps", str(steps),
                         "--guidance_scale", "2", "--seed", "0", "--out", str(tmp_path / "again")])
    assert np.array_equal(pngs(again), pngs(out))


def exported_pipeline(trainer, tmp_path, overrides):
    """A tiny class-conditional model of `trainer` (random weights, large enough to show in the samples), its
    config with `overrides`, and the pipeline its export folder holds, assembled here as diffusers assembles it
    (model_index.json's components and settings; pipeline.py is training/sharing/exported/pipeline.py): the slow test
    above loads a folder where this repository cannot be imported, these compare the sampling loops."""
    cfg = config.load_config(trainer.DEFAULTS, [
        "--model.num_layers=1", "--model.num_attention_heads=2", "--model.attention_head_dim=16",
        "--model.patch_size=2",
        "--data.resolution=8", "--data.num_classes=4", "--run_dir", str(tmp_path / "run"), *overrides])
    cfg = json.loads(json.dumps(cfg))  # as config.json holds it
    torch.manual_seed(0)
    model = build_denoiser(cfg, 3, 8).eval()
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised outputs and adaptive norms would make every sampler agree
            p.add_(0.2 * torch.randn_like(p))
    (tmp_path / "run").mkdir()
    return model, cfg, folder_pipeline(pipeline_export.write(model, cfg, tmp_path / "export"))


def folder_pipeline(folder):
    """The pipeline an export folder holds (no VAE: latents), assembled here as diffusers assembles it."""
    index = json.loads((folder / "model_index.json").read_text())
    settings = {k: v for k, v in index.items() if not k.startswith("_")
                and k not in ("transformer", "conditioner", "scheduler", "vae")}
    pipe = MinimalDiffusionPipeline(
        transformer=SD3Transformer2DModel.from_pretrained(folder / "transformer"),
        conditioner=ExportedConditioner.from_pretrained(folder / "conditioner"),
        scheduler=getattr(diffusers, index["scheduler"][1]).from_pretrained(folder / "scheduler"), **settings)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def assert_samples_as_the_trainer(trainer, model, cfg, pipe, steps):
    """The pipeline's latents against the trainer's generate (what sample.py and eval_fid.py call) on the same
    noise, classes and weights; the ancestral sampler's fresh noise comes from the global RNG in both."""
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    ours = trainer.generate(model, noise, {"label": torch.tensor([0, 3]), "drop": torch.zeros(2, dtype=torch.bool)},
                            cfg, steps=steps)
    torch.manual_seed(5)
    theirs = pipe([0, 3], latents=noise, num_inference_steps=steps, output_type="latent").images
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"{steps or cfg['val']['steps']} steps: {m}")


@pytest.mark.parametrize("sampler,objective", [("ddim", []), ("ddpm", []),
                                               ("ddim",
                                                ["--objective.prediction=eps", "--objective.zero_terminal_snr=false"]),
                                               ("ddim", ["--objective.time_shift=2"]),
                                               ("ddpm",
                                                ["--objective.time_shift=0.5", "--objective.beta_schedule=cosine"])])
def test_the_ddpm_pipeline_steps_on_the_trainers_grid_at_any_step_count(tmp_path, sampler, objective):
    """The trainer steps to the next point of its exact trailing grid (train_ddpm.timestep_grid). diffusers'
    DDIMScheduler steps back T // steps instead, which is that point only when steps divides 1000 (30, 32, 48, 61
    do not), and its trailing spacing rounds a float arange (another grid at 48 and 61): the folder's sampler
    follows the trainer's grid, guided, for DDIM and the ancestral sampler, v and eps prediction, and with a
    resolution shift, whose time input is the trainer's (from its float64 schedule; diffusers' float32 one moved
    samples by up to 4e-2)."""
    model, cfg, pipe = exported_pipeline(ddpm, tmp_path,
                                         [f"--val.sampler={sampler}", "--val.guidance_scale=2", *objective])
    for steps in [7, 20, 30, 32, 48, 61]:
        assert_samples_as_the_trainer(ddpm, model, cfg, pipe, steps)


@pytest.mark.parametrize("trainer,sampler", [(fm, "euler"), (fm, "heun"), (ddpm, "ddim"), (ddpm, "ddpm")])
def test_an_x0_model_samples_as_its_trainer_samples_it(tmp_path, trainer, sampler):
    """x-prediction (objective.prediction=x0), the Fashion-MNIST recipe's and so the shipped reference model's, at
    its 20 steps and guidance 2: flow matching's velocity (x - x0_hat) / max(t, 0.05)
    (training/objectives/xprediction.py; the folder's X0_MIN_T), on Euler's and on both of Heun's evaluations, the last
    three steps' t below 0.2; DDPM's x0 as diffusers' "sample" prediction."""
    model, cfg, pipe = exported_pipeline(trainer, tmp_path, ["--objective.prediction=x0", f"--val.sampler={sampler}",
                                                             "--val.guidance_scale=2", "--val.steps=20"])
    assert pipe.config.prediction == "x0" and pipe.config.num_inference_steps == 20
    assert_samples_as_the_trainer(trainer, model, cfg, pipe, None)


LAST_BLOCK = ["--model.num_layers=3", "--objective.meanflow_interval_blocks=1"]  # the interval in the last block only


@pytest.mark.parametrize("prediction,placed", [("v", []), ("x0", []), ("v", LAST_BLOCK)])
def test_a_meanflow_model_samples_as_its_trainer_samples_it_in_one_and_two_steps(tmp_path, prediction, placed):
    """MeanFlow (objective.meanflow, sampler "meanflow"): z_r = z_t - (t - r) u(z_t, r, t), the interval t - r given to
    the folder's conditioner, in 1 and 2 steps (the run's default 1), with v- and x-prediction, and with guidance 2 on
    top (two evaluations a step); and with the interval in the last of three blocks only
    (objective.meanflow_interval_blocks, Decoupled MeanFlow), which the folder's pipeline places as the trainer."""
    model, cfg, pipe = exported_pipeline(fm, tmp_path, ["--objective.meanflow=true", "--val.sampler=meanflow",
                                                        "--val.steps=1", "--val.guidance_scale=1",
                                                        f"--objective.prediction={prediction}", *placed])
    assert pipe.config.sampler == "meanflow" and pipe.conditioner.config.interval
    assert pipe.conditioner.config.interval_blocks == (1 if placed else None)
    folder = tmp_path / "export"  # the card counts the evaluations at the pipeline's default guidance
    assert "1 step of its `meanflow` sampler: one network evaluation a step" in (folder / "README.md").read_text()
    guided = model_card.card({**cfg, "val": {**cfg["val"], "guidance_scale": 2.0}}, tmp_path / "run", folder, 1)
    assert "two network evaluations a step: classifier-free guidance 2 on top of the 2 in the weights" in guided
    for steps in [None, 2]:
        assert_samples_as_the_trainer(fm, model, cfg, pipe, steps)
    # classifier-free guidance on top of the trained one
    cfg["val"]["guidance_scale"], pipe.config.guidance_scale = 2.0, 2.0
    assert_samples_as_the_trainer(fm, model, cfg, pipe, 2)


@pytest.mark.parametrize("mode,text,controls,interval", [("disentangled", False, ["size", "crop", "flip"], False),
                                                         ("both", False, ["size"], True),
                                                         ("adanorm", False, ["crop", "flip"], False),
                                                         ("disentangled", True, ["size"], True),
                                                         ("disentangled", "zeros", ["size"], False),
                                                         ("adanorm", "encoder", [], False)])
def test_the_exported_conditioner_is_the_trained_one(mode, text, controls, interval):
    """The folder's conditioner.py (no import from here) gives what training/model/mmdit.py's Conditioner gives, in eval
    mode, for every mode, text with each padding (replicate, zeros, the encoder's), each control, dropped or not (crops
    square and not), and MeanFlow's interval t - r (given, and absent: r = t); same weights, strictly."""
    torch.manual_seed(0)
    trained = Conditioner(5, 2, 24, 24, 32, text_tokens=6 if text else 0, controls={c: 1.0 for c in controls},
                          mode=mode, padding_noise=0.1 if text is True else None, pooled_text=True, interval=interval,
                          zero_padding=text == "zeros").eval()
    for p in trained.parameters():
        torch.nn.init.normal_(p)  # controls start as a no-op: give every weight a value that shows
    if text:
        trained.null_tokens.normal_(), trained.null_mask[:2].fill_(1), trained.null_pooled.normal_()
    ids = ["n0", "n1", "n2", "n3", "n4"]
    transformer = SimpleNamespace(config=SimpleNamespace(joint_attention_dim=24, num_attention_heads=2,
                                                         attention_head_dim=16))
    exported = pipeline_export.exported_conditioner(trained, transformer, ids)
    assert isinstance(exported, ExportedConditioner) and exported.config.class_names == ids
    n = 4
    cond = {"drop": torch.tensor([False, True, False, False]),
            "drop_controls": torch.tensor([False, False, True, False]),
            # square crops, and buckets' (data.buckets)
            "orig_hw": torch.tensor([[30, 20]] * n), "flip": torch.tensor([[1]] * n),
            "crop_box": torch.tensor([[5, 0, 20, 20], [0, 4, 30, 12], [0, 0, 30, 20], [8, 0, 10, 20]])}
    if text:
        mask = torch.tensor([[1, 1, 1, 0, 0, 0]] * n, dtype=torch.float)
        cond.update(text_tokens=torch.randn(n, 6, 24), text_mask=mask, text_pooled=torch.randn(n, 24))
    else:
        cond["label"] = torch.tensor([0, 3, 4, 2])
    level = torch.tensor([1.0, 0.7, 0.3, 0.0])
    with torch.no_grad():
        for c in [cond, {**cond, "interval": torch.tensor([1000.0, 350.0, 300.0, 0.0])}][:1 + interval]:
            for a, b in zip(trained(c, level), exported(c, level)):
                torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(a))


def fake_run(tmp_path):
    """A run folder as the trainer leaves it, without training: config, metrics, a validation grid, an
    evaluation report and quality rows; and its model, untrained."""
    cfg = config.as_config(json.loads(json.dumps(fm.DEFAULTS)))
    run = tmp_path / "run"
    cfg["run_dir"], cfg["data"]["num_classes"] = str(run), 9
    cfg["model"]["num_layers"], cfg["train"]["batch_size"] = 1, 16
    cfg["val"]["reference_curves"] = str(tmp_path / "curves.json")
    (tmp_path / "curves.json").write_text(json.dumps({"flow_matching": {"runs": [], "seeds": [0, 1], "settings": {},
                                                      "curves": {"val_loss": [[500, 0.5, 0.52, 0.54],
                                                                              [1000, 0.41, 0.425, 0.44]]}}}))
    (run / "samples").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(run / "samples" / "step_00001000.png")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 500, "loss": 0.6, "images_per_s": 400.0, "images_per_s_per_device": 100.0},
        {"step": 1000, "loss": 0.5, "images_per_s": 400.0, "images_per_s_per_device": 100.0},
        {"step": 1000, "val_loss": 0.4321}]))
    (run / "eval" / "export-ema-euler32-g7-seed0").mkdir(parents=True)
    (run / "eval" / "export-ema-euler32-g7-seed0" / "report.json").write_text(json.dumps({
        "metrics": {"fid_clean_10k": 12.3456}, "num_samples": 10000, "model": {"weights": "ema (export)"},
        "sampler": "euler", "steps": 32, "guidance_scale": 7.0, "guidance_interval": [0, 1],
        "reference": {"source": "embedded", "split": "heldout"}, "feature_extractor": "inception",
        "command": "eval_fid.py --run runs/demo --num_samples 10000"}))
    (run / "eval" / "step500-ema").mkdir()  # a checkpoint's score: not the exported model's
    (run / "eval" / "step500-ema" / "report.json").write_text(json.dumps({"metrics": {"fid_clean_10k": 99.0},
                                                                          "model": {"step": 500}}))
    (run / "quality.jsonl").write_text(json.dumps({"step": 1000, "class_accuracy": 0.8765}) + "\n")
    return build_denoiser(cfg, 3, 16), cfg, run


def test_the_card_holds_the_runs_numbers_and_the_loading_lines(tmp_path):
    model, cfg, run = fake_run(tmp_path)
    folder = pipeline_export.write(model, cfg, run / "export", ["red circle"] * 9, run)
    text = (folder / "README.md").read_text()
    header = text.split("---")[1]
    assert all(line in header.splitlines() for line in ["license: other", "library_name: diffusers", "- diffusers"])
    assert "1,000 optimizer steps of 64 images: 64,000 images seen" in text  # 16 per process x 4 processes logged
    assert "| fid_clean_10k | 12.3456 | the run's own | 10,000 samples" in text and "99.0" not in text
    assert "eval_fid.py --run runs/demo --num_samples 10000" in text and "| class_accuracy | 0.8765 |" in text
    # not pushed: a placeholder
    assert "DiffusionPipeline.from_pretrained('OWNER/NAME', trust_remote_code=True)" in text
    assert ("its path loads it the same way: "
            f"`DiffusionPipeline.from_pretrained({str(folder)!r}, trust_remote_code=True)`") in text
    assert "image = pipe('red circle').images[0]" in text and \
        "`python train_flow_matching.py --config config.json`" in text
    assert "| val_loss | 1000 | 0.4100 .. 0.4400 | 0.4250 | 0.4321 |" in text  # the reference band and this run
    assert (folder / model_card.GRID).is_file() and json.loads((folder / "config.json").read_text()) == \
        json.loads(json.dumps(cfg))
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "class_ids.json", "conditioner", "config.json",
                                                        "model_index.json", "pipeline.py", "samples.png",
                                                        "scheduler", "transformer"]
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler" and scheduler["shift"] == \
        cfg["objective"]["time_shift"]
    # A post-hoc EMA export names its std, and shows only the scores of those weights.
    phema = {"phema_std": 0.08, "gamma": 11.9, "profile_fit_error": 1e-3}
    folder = pipeline_export.write(model, cfg, tmp_path / "phema" / "export", None, run, phema, "me/demo-phema")
    text = (folder / "README.md").read_text()
    assert "post-hoc EMA of relative std 0.08" in text and "12.3456" not in text and "Not evaluated yet" in text
    assert "from_pretrained('me/demo-phema', trust_remote_code=True)" in text
    assert json.loads((folder / "phema.json").read_text())["phema_std"] == 0.08


def test_the_cards_scores_are_the_runs_not_tune_pys_search(tmp_path):
    """Issue 57: after tools/tune.py the card listed every report in eval/, the search's and the confirmation's
    blocks among them, with commands naming tune.py. It shows the scores of the model (at the run's own setting; on
    the test split at tune.py's choice or another setting, each saying which) and counts the reports that chose a
    setting; the reference band's "this run" is the protocol's score (the test split), not a held-out one. Issue 68:
    what chose a setting is told by what wrote the report (written_by, or the program of an older report's command),
    never by its setting: the user's own held-out evaluation at another guidance is shown, tune.py's at the run's
    own setting is not; the command runs on the Hub id (OWNER/NAME until pushed), not the run's path."""
    model, cfg, run = fake_run(tmp_path)  # val: euler, 32 steps, guidance 7; a held-out fid_clean_10k report
    curves_file = json.loads((tmp_path / "curves.json").read_text())
    curves_file["flow_matching"]["curves"]["fd_classifier_10k"] = [[1000, 1.4, 1.5, 1.6]]
    (tmp_path / "curves.json").write_text(json.dumps(curves_file))

    def report(name, program, fd, n, guidance=7.0, steps=32, split="heldout", seed=0, written_by=None):
        args = (f"--run {run} --untuned --num_samples {n} --seed {seed} --guidance_scale {guidance} --steps {steps} "
                f"--guidance_interval 0.0,1.0" + (f" --reference_split {split}" if split != "heldout" else ""))
        (run / "eval" / name).mkdir()
        (run / "eval" / name / "report.json").write_text(json.dumps({
            "metrics": {f"fd_classifier_{size_tag(n)}": fd}, "num_samples": n, "model": {"weights": "ema (export)"},
            "sampler": "euler", "steps": steps, "guidance_scale": guidance, "control_guidance_scale": 0.0,
            "guidance_interval": [0.0, 1.0], "seeds": {"seed": seed}, "feature_extractor": "classifier",
            "reference": {"source": "embedded", "kind": "dataset", "split": split}, "command": f"{program} {args}",
            **({"written_by": written_by} if written_by else {})}))  # none: a report from before issue 68

    for guidance, steps in [(5.0, 32), (7.0, 32), (9.0, 32), (5.0, 16), (7.0, 16), (9.0, 16)]:  # the search
        report(f"search-euler{steps}-g{guidance:g}-seed0", "pytest", 3 + guidance / 10, 2000, guidance, steps,
               written_by="tools/tune.py")  # run in-process: its command names another program
    for seed in range(1, 6):  # the confirmation of the best (guidance 9, 16 steps) and the runner-up, on fresh seeds
        report(f"search-euler16-g9-seed{seed}", "tune.py", 3.1, 400, 9.0, 16, seed=seed)  # older reports
        report(f"search-euler32-g7-seed{seed}", "tune.py", 3.3, 400, 7.0, 32, seed=seed)
    report("heldout-g5", "eval_fid.py", 4.5, 2000, 5.0, written_by="eval_fid.py")  # the user's own, at guidance 5
    pipeline_export.write(model, cfg, run / "export", ["red circle"] * 9, run)  # tune.py chose for these weights:
    best = {"guidance_scale": 9.0, "guidance_interval": [0.0, 1.0], "steps": 16, "phema_std": None}
    (run / "tuned.json").write_text(json.dumps({"best": best, "rows": [best], "num_samples": 2000, "metric":
                                                "fd_classifier_2k", "model": tuning.model_identity(run),
                                                "sampler": cfg["val"]["sampler"]}))
    report("final-test", "eval_fid.py", 1.55, 10_000, split="test")  # the protocol's final scores: the run's own,
    report("final-test-tuned", "eval_fid.py", 1.2, 10_000, 9.0, 16, split="test")  # tune.py's choice,
    report("final-test-g5", "eval_fid.py", 1.3, 10_000, 5.0, split="test")  # another setting
    report("heldout-10k", "eval_fid.py", 9.0, 10_000)  # the run's own on the held-out rows: shown, but not the band's
    text = (pipeline_export.write(model, cfg, run / "export", ["red circle"] * 9, run) / "README.md").read_text()
    table = [line for line in text.split("## Evaluation")[1].split("## Samples")[0].splitlines()
             if line.startswith("| ")]
    assert [line.split(" | ")[:3] for line in table[2:]] == [
        ["| fid_clean_10k", "12.3456", "the run's own"],  # fake_run's
        ["| fd_classifier_10k", "1.5500", "the run's own"],
        ["| fd_classifier_10k", "1.3000", "steps 32, not 16; guidance_scale 5.0, not 9.0 (against tools/tune.py's "
                                          "choice)"],  # the card's defaults are tune.py's: what differs from them
        ["| fd_classifier_10k", "1.2000", "tools/tune.py's choice (tuned.json)"],
        ["| fd_classifier_10k", "9.0000", "the run's own"],
        ["| fd_classifier_2k", "4.5000", "steps 32, not 16; guidance_scale 5.0, not 9.0 (against tools/tune.py's "
                                         "choice)"],  # the user's own, on the held-out rows
        ["| class_accuracy", "0.8765", "not recorded"]]  # quality.jsonl; not the search's point at the run's setting
    assert ("16 more evaluations of these weights, run by tools/tune.py (or tools/phema.py --sweep) on the held-out "
            "rows, chose a setting; they do not score it: not shown.") in text
    assert "`tune.py " not in text and ("`eval_fid.py --run OWNER/NAME --untuned --num_samples 2000 --seed 0 "
                                        "--guidance_scale 5.0 --steps 32 --guidance_interval 0.0,1.0`") in text
    assert "| fd_classifier_10k | 1000 | 1.4000 .. 1.6000 | 1.5000 | 1.5500 |" in text  # the test split's, not 9.0
    with torch.no_grad():  # other weights: the run's tuned.json was not chosen for them, and labels no row
        next(model.parameters()).add_(1.0)
    text = (pipeline_export.write(model, cfg, run / "export", ["red circle"] * 9, run) / "README.md").read_text()
    assert "| fd_classifier_10k | 1.2000 | steps 16, not 32; guidance_scale 9.0, not 7.0 |" in text


def test_the_card_publishes_no_local_path_and_no_task_a_class_model_does_not_do(tmp_path):
    """No pipeline_tag for a class-conditional model (text-to-image for a text one); own data named by its folder's
    name, never its path, and a Hub dataset by its id; the loading lines name the Hub id when there is one."""
    model, cfg, run = fake_run(tmp_path)
    own = tmp_path / "home" / "me" / "my_photos"
    own.mkdir(parents=True)
    cfg["data"]["source"] = str(own)
    text = (pipeline_export.write(model, cfg, run / "export", None, run, repo="me/demo") / "README.md").read_text()
    header, prose = text.split("---")[1], text.split("<details>")[0]
    assert "pipeline_tag" not in header and "- class-conditional" in header and "datasets:" not in header
    assert "on the trainer's own data (a local image folder, `my_photos`) at" in prose and str(own) not in prose
    assert "from_pretrained('me/demo', trust_remote_code=True)" in prose and "OWNER/NAME" not in prose
    assert "pipeline_tag: text-to-image" in model_card.metadata(cfg, True)
    assert public.data_name("/data/cc12m/{00000..01242}.tar") == \
        "the trainer's own data (local webdataset shards, `cc12m`)"
    (tmp_path / "mixed" / "data").mkdir(parents=True)  # a folder of parquet files is named as such
    (tmp_path / "mixed" / "data" / "train-00000-of-00001.parquet").write_bytes(b"")
    assert public.data_name(str(tmp_path / "mixed")) == "the trainer's own data (local parquet files, `mixed`)"
    cfg["data"]["source"] = "someone/their-data"  # a Hub dataset: by its id, and in the header
    text = (pipeline_export.write(model, cfg, run / "export", None, run) / "README.md").read_text()
    assert "datasets:\n- someone/their-data" in text and "on `someone/their-data` at" in text


def test_a_pushed_card_names_no_path_of_the_training_machine_and_the_run_it_started_from(tmp_path):
    """Issue 68: the evaluation rows, their commands and the embedded config held the training machine's paths,
    and a fine-tuned model's card did not say what it started from. Pushed, the card holds no such path: the run's
    own folder in a command is the Hub id, every other absolute path its name (with its run's: base/export); the
    run it was fine-tuned from (init_from) is named by the Hub id its config records beside its name, a checkpoint
    of another run it resumed from by its name. Each row names its bucket and the reference's image count, and
    eval_fid.py's warnings are numbered under the table."""
    model, cfg, run = fake_run(tmp_path)  # run_dir and val.reference_curves are absolute paths
    home = tmp_path / "home" / "me"
    (home / "runs" / "base" / "export").mkdir(parents=True)
    (home / "runs" / "base" / "config.json").write_text(json.dumps({"push_to_hub": "me/base"}))
    cfg["data"]["source"], cfg["init_from"] = str(home / "my_photos"), str(home / "runs" / "base" / "export")
    cfg["resume"] = str(home / "runs" / "other" / "checkpoints" / "step_00000500")
    (run / "init_from.json").write_text(json.dumps({"source": cfg["init_from"], "loaded": 120, "adapted": ["pos_embed"],
                                                    "missing": [], "unexpected": [], "reshaped": []}))
    small = "fd_classifier's covariances have more dimensions (128) than images (the reference has 100): ..."
    for shape, count, warnings in (([40, 20], 100, [small]), ([20, 40], 1234, [])):
        (run / "eval" / f"bucket-{shape[0]}x{shape[1]}").mkdir()
        (run / "eval" / f"bucket-{shape[0]}x{shape[1]}" / "report.json").write_text(json.dumps({
            "metrics": {"fd_classifier_1k": 2.0 + shape[0] / 100}, "num_samples": 1000, "shape": shape,
            "model": {"weights": "ema (export)"}, "sampler": "euler", "steps": 32, "guidance_scale": 7.0,
            "guidance_interval": [0, 1], "feature_extractor": "classifier", "reference_count": count,
            "warnings": warnings, "written_by": "eval_fid.py",
            "reference": {"source": str(home / "real"), "split": None},
            "command": f"eval_fid.py --run {run} --reference {home / 'real'} --classifier={home / 'clf'} --width "
                       f"{shape[0]} --height {shape[1]}"}))
    text = (pipeline_export.write(model, cfg, run / "export", None, run, repo="me/demo") / "README.md").read_text()
    assert str(tmp_path) not in text
    assert "| fd_classifier_1k (40x20 bucket) | 2.4000 |" in text
    assert "| fd_classifier_1k (20x40 bucket) | 2.2000 |" in text
    assert "against real (100 images), classifier features; `eval_fid.py --run me/demo --reference real " \
           "--classifier=clf --width 40 --height 20`; warning 1 |" in text
    assert "against real (1,234 images)" in text
    assert f"eval_fid.py's warnings on these evaluations:\n\n1. {small}" in text
    assert ("- fine-tuned from `me/base` (`base/export`): its weights and EMA (`init_from`; the optimizer, step and "
            "data order started fresh; 120 tensors taken, 1 adapted)") in text
    assert "- continued from `other/checkpoints/step_00000500`, a checkpoint of another run (`resume`" in text
    embedded = json.loads(text.split("```json")[1].split("```")[0])
    assert (embedded["run_dir"], embedded["data"]["source"], embedded["init_from"], embedded["resume"]) == (
        "run", "my_photos", "base/export", "other/checkpoints/step_00000500")
    assert embedded["val"]["reference_curves"] == "curves.json" and embedded["train"] == cfg["train"]
    assert json.loads((run / "export" / "config.json").read_text()) == cfg  # the folder's own, which the tools read
    text = (pipeline_export.write(model, cfg, run / "export", None, run) / "README.md").read_text()  # not pushed
    assert "`eval_fid.py --run OWNER/NAME --reference real" in text
    assert text.count(str(tmp_path)) == 1 and f"from_pretrained({str(run / 'export')!r}" in text  # where it is local
    cfg["init_from"] = "someone/their-model"
    assert "- fine-tuned from `someone/their-model` (the Hub):" in model_card.card(cfg, run, run / "export", 1)


def test_a_text_export_carries_a_local_text_encoder_and_its_card_names_it_the_text_protocol_and_the_licences(
        tmp_path, tiny_text_encoder):
    """A text model whose encoders.text_encoder is a local folder: the export saves the encoder and tokenizer as
    components (text_encoder/, tokenizer/ in model_index.json, no text_encoder_id) whose features are the original's,
    and read back through the trainer's loader (the tokenizer found beside text_encoder/); config.json keeps the
    run's name. The card names the encoder by its folder's name, never its path; its evaluation rows are a text
    report's metrics with the prompts they were conditioned on and the CLIP model; emoji's card gives the licences
    of the packages and of both vendors' images, with Twemoji's attribution. A hub id stays a reference, and a
    folder that is gone is refused in one line before anything is written."""
    _, cfg, run = fake_run(tmp_path)
    clip = shutil.copytree(tiny_text_encoder, tmp_path / "home" / "me" / "clip")
    cfg["data"].update(source=f"emoji:{tmp_path}/emoji", caption_column="caption", num_classes=0)
    cfg["encoders"]["text_encoder"], cfg["encoders"]["max_tokens"] = str(clip), 8
    model = build_denoiser(cfg, 3, 16, (8, 32, 32))
    (run / "eval" / "text").mkdir()
    (run / "eval" / "text" / "report.json").write_text(json.dumps({
        "metrics": {"fd_clip_1k": 5.0, "clip_score_1k": 0.2512}, "real": {"fd_clip_1k": 1.5}, "num_samples": 1000,
        "written_by": "eval_fid.py",
        "model": {"weights": "ema (export)"}, "sampler": "euler", "steps": 32, "guidance_scale": 7.0,
        "guidance_interval": [0, 1],
        "conditioning": {"prompts": "heldout", "num_prompts": 174, "prompts_sha256": "0123456789abcdef"},
        "clip_model": str(tmp_path / "home" / "me" / "eval_clip"), "feature_extractor": "clip",
        "reference": {"source": cfg["data"]["source"], "split": "test"}, "command": f"eval_fid.py --run {run}"}))
    folder = pipeline_export.write(model, cfg, run / "export", None, run, repo="me/emoji")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"] and index["text_encoder_id"] is None
    assert index["tokenizer"] == ["transformers", "PreTrainedTokenizerFast"]
    assert json.loads((folder / "config.json").read_text())["encoders"]["text_encoder"] == str(clip)
    prompts = ["a small red circle", "a red apple"]
    theirs = load_encoders(config.Config({"vae": None, "text_encoder": str(folder / "text_encoder")}), "cpu")[1:]
    ours = load_encoders(config.Config({"vae": None, "text_encoder": str(clip)}), "cpu")[1:]
    for k, v in encode_text(*ours, prompts, 8).items():
        assert torch.equal(encode_text(*theirs, prompts, 8)[k], v), k
    text = (folder / "README.md").read_text()
    assert str(tmp_path) not in text
    assert "conditioned on captions encoded by `clip` (this folder's `text_encoder/`)" in text
    assert "| clip_score_1k | 0.2512 | the run's own | 1,000 samples (ema (export)), euler 32 steps, guidance 7, " \
           "interval [0, 1], conditioned on the held-out captions (174, sha256 0123456789ab), against emoji test, " \
           "clip features, CLIP score by eval_clip; `eval_fid.py --run me/emoji` |" in text
    assert "| fd_clip_1k | 5.0000 (real images: 1.5000) | the run's own |" in text  # the text protocol's real images
    assert "(real images: ...) is what real images score the same way (eval_fid.py's text protocol" in text
    licences = text.split("## Licences of the training images\n\n")[1].split("\n\n")[0].splitlines()
    assert licences == [f"- {line}" for line in emoji.LICENCES] and len(licences) == 3
    assert "MIT License, Copyright (c) 2013 Cal Henderson" in licences[0] and "Apache License 2.0" in licences[1]
    assert "Copyright 2019 Twitter, Inc and other contributors" in licences[2] and "CC-BY 4.0" in licences[2]
    assert public.licence_lines("fashion_mnist")[2].endswith("MIT License, Copyright 2017 Zalando SE")
    assert public.licence_lines("/data/mine") == [] and public.licence_lines("embedded") == []
    own = tmp_path / "own"  # the user's own data says its terms in LICENCES.txt; a pattern or a file finds it
    own.mkdir()
    (own / public.LICENCES).write_text("Photos: CC-BY 4.0, Jane Doe\n\nLogos: used with permission\n")
    terms = ["## Licences of the training images", "", "- Photos: CC-BY 4.0, Jane Doe", "- Logos: used with "
             "permission", ""]
    for source in (str(own), f"{own}/", f"{own}/{{00000..00009}}.tar", f"{own}/train-*.parquet", f"{own}/a.parquet"):
        assert public.licence_lines(source) == terms, source
    assert public.licence_lines(str(tmp_path)) == []  # the folder above says nothing

    cfg["encoders"]["text_encoder"] = "openai/clip-vit-large-patch14"  # a hub id: a reference, nothing copied
    folder = pipeline_export.write(model, cfg, run / "export", None, run)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder_id"] == "openai/clip-vit-large-patch14" and "text_encoder" not in index
    assert not (folder / "text_encoder").exists() and not (folder / "tokenizer").exists()
    card = (folder / "README.md").read_text()
    assert "the text encoder `openai/clip-vit-large-patch14` is loaded by its hub id" in card
    cfg["encoders"]["text_encoder"] = str(tmp_path / "gone")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit, match=r"^encoders.text_encoder='.*gone' is no folder here, so the export cannot "
                                         r"carry it"):
        pipeline_export.write(model, cfg, run / "export", None, run)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_whole_clip_folder_is_exported_as_its_text_tower_alone(tmp_path, tiny_text_encoder):
    """encoders.text_encoder may name a whole CLIPModel folder (tools/clip.py's, both towers), whose text tower the
    trainers load (CLIPTextModel): the export saves that tower alone (no vision weights, a clip_text_model config) and
    its token features, mask and pooled vector are the whole folder's, bitwise."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    text = json.loads((Path(tiny_text_encoder) / "config.json").read_text())
    torch.manual_seed(0)
    whole = CLIPModel(CLIPConfig(text_config=text, projection_dim=16, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8)))
    whole.save_pretrained(tmp_path / "clip")
    AutoTokenizer.from_pretrained(tiny_text_encoder).save_pretrained(tmp_path / "clip")
    entries = pipeline_export.save_text_encoder(tmp_path / "clip", tmp_path / "export")
    assert entries["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert json.loads((tmp_path / "export" / "text_encoder" / "config.json").read_text())["model_type"] == \
        "clip_text_model"
    saved = load_file(str(tmp_path / "export" / "text_encoder" / "model.safetensors"))
    assert saved and not [k for k in saved if "vision" in k or "projection" in k]
    theirs = load_encoders(config.Config({"vae": None, "text_encoder": str(tmp_path / "export" / "text_encoder")}),
                           "cpu")
    ours = load_encoders(config.Config({"vae": None, "text_encoder": str(tmp_path / "clip")}), "cpu")
    for k, v in encode_text(*ours[1:], ["a small red circle", "a red apple"], 8).items():
        assert torch.equal(encode_text(*theirs[1:], ["a small red circle", "a red apple"], 8)[k], v), k


def test_the_export_takes_tune_pys_choice_made_for_its_weights_and_no_other(tmp_path):
    """tuned.json chosen for the export's weights (their digest) becomes the pipeline's defaults, the card says what
    was searched and how it was scored, and the folder keeps the record (eval_fid.py / sample.py on the folder use it);
    other weights (the run trained on), or a choice of post-hoc EMA, leave the run's own settings, the card saying why;
    the post-hoc EMA export of the chosen std takes it."""
    model, cfg, run = fake_run(tmp_path)
    val = cfg["val"]
    folder = pipeline_export.write(model, cfg, run / "export", ["red circle"] * 9, run)
    rows = [{"guidance_scale": g, "guidance_interval": [0.1, 0.9], "steps": 12, "phema_std": None,
             "fd_classifier_2k": g}
            for g in (1.5, 3.0)]
    confirm = {"metric": "fd_classifier_2k", "blocks": 5, "best": {"mean": 4.5, "low": 4.25, "high": 4.75}}
    tuned = {"best": rows[0], "rows": rows, "num_samples": 2000, "confirm_samples": 10000, "confirm": confirm,
             "metric": "fd_classifier_2k", "model": tuning.model_identity(run), "sampler": val["sampler"]}
    (run / "tuned.json").write_text(json.dumps(tuned))

    def exported(target=run / "export", phema=None):
        folder = pipeline_export.write(model, cfg, target, ["red circle"] * 9, run, phema)
        index = json.loads((folder / "model_index.json").read_text())
        return (index["num_inference_steps"], index["guidance_scale"], index["guidance_interval"]), \
            (folder / "README.md").read_text(), folder

    settings, text, folder = exported()  # the same weights, written again
    assert settings == (12, 1.5, [0.1, 0.9])
    assert ("`num_inference_steps=12`, `guidance_scale=1.5`, `guidance_interval=(0.1, 0.9)`, chosen for these weights "
            "by tools/tune.py on the held-out rows of the training split") in text
    assert ("(searched: guidance_scale 1.5, 3, at guidance_interval (0.1, 0.9) and num_inference_steps 12: "
            "2 settings") in text
    assert "fd_classifier_2k 4.5000 (95% interval [4.2500, 4.7500])" in text
    args = tuning.tuned_defaults(eval_fid.parse_args(["--run", str(folder)]))  # the folder's own record
    assert (args.steps, args.guidance_scale) == (12, 1.5)
    with torch.no_grad():  # the run trained on: other weights
        next(model.parameters()).add_(1.0)
    settings, text, folder = exported()
    assert settings == (val["steps"], val["guidance_scale"], list(val["guidance_interval"]))
    assert "the run's own sampling settings (its config's val.*, not tuned; the run's tuned.json was chosen for " \
           "other weights" in text and not (folder / "tuned.json").exists()
    # A post-hoc EMA chosen: not the export's weights, but the post-hoc EMA export of that std.
    tuned.update(model=tuning.model_identity(run), best={**rows[0], "phema_std": 0.08})
    (run / "tuned.json").write_text(json.dumps(tuned))
    settings, text, _ = exported()
    assert settings[0] == val["steps"] and "chose its settings for the post-hoc EMA of std 0.08" in text
    phema = {"phema_std": 0.08, "gamma": 11.9, "profile_fit_error": 1e-3}
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # reconstructed weights: not the export's
    settings, text, folder = exported(tmp_path / "phema" / "export", phema)
    assert settings == (12, 1.5, [0.1, 0.9]) and "chosen for these weights by tools/tune.py" in text
    assert json.loads((folder / "tuned.json").read_text())["best"]["phema_std"] is None  # these weights are that EMA
    phema["phema_std"] = 0.1
    assert exported(tmp_path / "phema" / "export", phema)[0][0] == val["steps"]


@pytest.mark.parametrize("sampler,prediction,expected", [("ddim", "v", ("DDIMScheduler", "v_prediction")),
                                                         ("ddpm", "x0", ("DDPMScheduler", "sample"))])
def test_the_ddpm_scheduler_is_the_runs_schedule(sampler, prediction, expected):
    cfg = json.loads(json.dumps(ddpm.DEFAULTS))
    cfg["val"]["sampler"], cfg["objective"]["prediction"] = sampler, prediction
    scheduler = pipeline_export.make_scheduler(cfg)
    assert (type(scheduler).__name__, scheduler.config.prediction_type) == expected
    assert scheduler.config.rescale_betas_zero_snr and scheduler.config.timestep_spacing == "trailing"
    assert not scheduler.config.clip_sample
    torch.testing.assert_close(scheduler.alphas_cumprod.double(), ddpm.schedule_of(cfg), atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("betas", ["quadratic", "linear", "cosine"])
def test_the_folders_shifted_time_input_is_the_trainers_exactly(betas):
    """pipeline.py cannot import the trainer, so it rebuilds the run's schedule from the scheduler's config: in
    float64, bitwise the trainer's (train_ddpm.make_schedule), with and without zero terminal SNR, and with it the
    time input at a shift is the trainer's exactly (diffusers' float32 schedule gave another, up to 4e-2 apart in
    samples)."""
    from training.sharing.exported.pipeline import time_input, trainer_schedule

    for zero_snr in (True, False):
        cfg = json.loads(json.dumps(ddpm.DEFAULTS))
        cfg["objective"].update(beta_schedule=betas, zero_terminal_snr=zero_snr, time_shift=2.0, prediction="v")
        config = pipeline_export.make_scheduler(cfg).config
        assert torch.equal(trainer_schedule(config), ddpm.base_schedule_of(cfg)), (betas, zero_snr)
        assert torch.equal(time_input(trainer_schedule(config), 2.0), ddpm.time_input_of(cfg)), (betas, zero_snr)


def test_a_push_is_refused_before_any_work(tmp_path, monkeypatch):
    from huggingface_hub import constants

    argv = tiny_run_args(tmp_path)
    with pytest.raises(config.ConfigError, match=r"push_to_hub='not a repo!' is not a Hub repository "
                       r"name: give owner/name"):
        fm.main(argv + ["--push_to_hub", "not a repo!"])
    with pytest.raises(config.ConfigError, match=r"push_to_hub=me/demo: HF_HUB_OFFLINE is set"):
        ddpm.main(argv + ["--push_to_hub", "me/demo"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with pytest.raises(config.ConfigError, match=r"push_to_hub=me/demo: no Hugging Face token: run `hf auth login`"):
        fm.main(argv + ["--push_to_hub", "me/demo"])
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # no work was done
    import tools.phema as phema_tool
    import tools.export as export_tool

    monkeypatch.setattr(phema_tool, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(export_tool, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=r"^tools/phema.py: --push_to_hub=me/demo: no Hugging Face token"):
        phema_tool.main(["--run", str(tmp_path), "--std", "0.1", "--push_to_hub", "me/demo"])
    with pytest.raises(SystemExit, match=r"^tools/export.py: --push_to_hub='me/a/b' is not a Hub repository name"):
        export_tool.main(["--run", str(tmp_path), "--push_to_hub", "me/a/b"])


def test_a_push_creates_a_private_repository_and_uploads_the_folder(tmp_path, monkeypatch):
    calls = []

    class Api:
        def create_repo(self, repo, **kw):
            calls.append(("create", repo, kw))

        def upload_folder(self, **kw):
            calls.append(("upload", kw["repo_id"], kw["folder_path"]))

    monkeypatch.setattr(hub.huggingface_hub, "HfApi", Api)
    assert hub.push(tmp_path, "me/demo").endswith("/me/demo")
    assert calls == [("create", "me/demo", {"repo_type": "model", "private": True, "exist_ok": True}),
                     ("upload", "me/demo", str(tmp_path))]
    with pytest.raises(FileNotFoundError, match=r"me/not-here: no such folder, and no Hub model of that "
                       r"name can be read"):
        hub.local_folder("me/not-here")
