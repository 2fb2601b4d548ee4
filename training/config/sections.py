"""The config's keys: the shared sections typed once (pydantic models: each key's type, its range or allowed
values, and its one-line description), a trainer's whole schema from them, and the combinations of values that
cannot work. training/config/config.py reads a config against these; a trainer adds its own section (schema).
"""
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field, create_model

# ----------------------------------------------------------------------------------------------------------
# The shared sections, one key a line: its type, default, range (ge, gt, le, lt) or allowed values (Literal)
# and what it does. Adding a key is adding its line; a trainer's own keys are in its Objective and Sampler.
Str, Int = str | None, int | None  # None: a setting left unset (each key says what that means)


class Data(BaseModel, extra="forbid", strict=True):
    source: str = Field("embedded", description='"embedded" (the demo), "fashion_mnist" (its Debian package), a hub '
                        'id, an imagefolder or parquet path, or webdataset shards '
                        '"/data/cc12m/{00000..01242}.tar" (streamed)')
    streaming: bool = Field(False, description="stream a hub dataset's shards instead of downloading it whole")
    split: str = Field("train", description="the training split")
    val_split: Str = Field(None, description="a held-out split of the source; None: hold out val_holdout rows")
    val_holdout: Int = Field(None, ge=0, description="held-out rows drawn from split; None: 10%, at most 256")
    val_shards: list[Int] | None = Field(None, min_length=2, max_length=2, description="streamed: the held-out "
                                         "shards [first, stop) ([-1, null]: the last); val_holdout rows of them")
    image_column: str = Field("image", description="the column of the images")
    label_column: Str = Field("label", description="the column of the class labels; None for text-only data")
    caption_column: Str = Field(None, description='e.g. "caption" for text-to-image (needs encoders.text_encoder)')
    num_classes: Int = Field(None, ge=0, description="None: the label column's class names (ClassLabel, folders)")
    class_ids: Str = Field(None, description="the labels' WordNet ids (init_from's class mapping): None: the "
                           'ClassLabel names; "imagenet-1k", "imagenet-22k" or a file')
    label_captions: bool = Field(False, description="text-to-image on class data: the caption is the class name")
    resolution: int = Field(16, ge=8, description="training resolution (pixels per side)")
    crop: Literal["center", "random", "random_resized"] = Field("center", description="drawn at cache time, "
                                                                  "data.cache_views of them per training image")
    min_crop_scale: float = Field(0.5, gt=0, le=1, description="random_resized: crop side >= this x the short side")
    buckets: Literal["auto"] | list[Annotated[float, Field(gt=0)]] | None = Field(None, description="aspect-ratio "
        'buckets: aspect ratios (width / height) at about resolution^2 pixels, each image at its nearest; "auto": '
        "diffusers' 11 (1:2 .. 2:1); None: every image cropped square (training/data/buckets.py)")
    bucket_shapes: list[Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=2)]] | None = Field(
        None, description="filled by the run from buckets: the [width, height] it trains at, small ones merged")
    random_flip: bool = Field(False, description="horizontal flip (the flip control): training images are cached both "
                              "ways, one drawn per epoch; held-out images flipped with probability 1/2")
    cache_views: int = Field(1, ge=1, description="crops cached per training image, each both ways with random_flip "
                             "(views = crops x 2); each epoch shows one view per image, every view "
                             "within `views` epochs")
    min_image_side: int = Field(8, ge=1, description="smaller images are reported and skipped at cache time")
    max_samples: Int = Field(None, ge=1, description="use only the first N training rows")
    demo_samples: int = Field(4864, ge=1, description="size of the embedded demo set")
    demo_resolution: int = Field(16, ge=8, description="side of the embedded demo images")
    demo_sizes: list[Annotated[int, Field(ge=4)]] | None = Field(None, min_length=2, max_length=2,
                                                                 description="[lo, hi]: each demo image drawn at a "
                                                                 "side in lo .. hi px (size carries sharpness)")
    demo_render: Literal["native", "band_limited", "colour_by_size"] = Field("native", description="native: drawn at "
        "its side directly; band_limited: drawn at 8x and box-averaged, so a small original is the same scene at lower "
        "resolution; colour_by_size: band_limited, red only at 8-14 px and blue only at 26-32 (the positive control)")
    cache_dir: str = Field("cache", description="where the encoded cache goes (shared storage on a cluster)")
    cache_dtype: Literal["float16", "bfloat16", "float32"] = Field("float16", description="of the cached values")
    cache_text: bool = Field(True, description="cache text features; False: token ids, encoded at each step (lean)")
    shard_size: int = Field(1024, ge=1, description="rows per cache shard (part of the cache key)")
    verify_cache: bool = Field(True, description="verify a shard's values when written and when its file changed; "
                               "False: headers only")
    encode_batch_size: int = Field(64, ge=1, description="images per batch when the cache is built")
    num_workers: int = Field(0, ge=0, description="data loader workers per process")
    prefetch_factor: int = Field(2, ge=1, description="batches each worker loads ahead")


class Encoders(BaseModel, extra="forbid", strict=True):
    vae: Str = Field(None, description='AutoencoderKL id or path ("stabilityai/sd-vae-ft-ema"); None: pixel space')
    text_encoder: Str = Field(None, description="transformers text encoder id or path (CLIP, T5); None: class labels")
    max_tokens: int = Field(77, ge=1, description="text tokens per caption (an SD3-family pipeline: T5's, after its "
                            "CLIPs' 77)")
    sd3_text_encoders: list[Literal["text_encoder", "text_encoder_2", "text_encoder_3"]] | None = Field(
        None, min_length=2, description="an SD3-family pipeline as text_encoder: which of its encoders condition "
        "(both CLIPs, and T5 or not: without it its tokens are zeros, as SD3's pipeline without T5); None: all three")
    latent_check: Literal["stop", "warn"] = Field("stop", description="cached latents far from mean 0 and std 1 "
                                                  "(the VAE's scaling / shift factors): stop the run, or warn and go "
                                                  "on")


class Model(BaseModel, extra="forbid", strict=True):
    patch_size: int = Field(2, ge=1, description="side of a token's patch")
    num_layers: int = Field(4, ge=1, description="MMDiT blocks")
    num_attention_heads: int = Field(4, ge=1, description="attention heads; width = heads x head_dim")
    attention_head_dim: int = Field(32, ge=1, description="width of a head")
    class_tokens: int = Field(1, ge=1, description="context tokens per class label")
    qk_norm: Literal["rms_norm", "layer_norm"] | None = Field(None, description='"rms_norm" for large models')
    pos_embed_transfer: Literal["resample", "extend"] = Field("resample", description="init_from at another token "
                                                              "grid: resample the positions (the paper's) or extend")


class ControlPower(BaseModel, extra="forbid", strict=True):  # docs/paper.md: the sources, and what is our reading
    size: float = Field(1.0, ge=0, description="p in the size control's weight w(t) = cos(pi t / 2)^p: > 0 acts late "
                        "(0 at pure noise, t = 1), 0 from the start (w = 1); size is low-level: late")
    crop: float = Field(0.0, ge=0, description="p of the crop control (high-level: from the start)")
    flip: float = Field(0.0, ge=0, description="p of the flip control (high-level: from the start)")


class Conditioning(BaseModel, extra="forbid", strict=True):
    mode: Literal["disentangled", "both", "adanorm"] = Field("disentangled", description="disentangled: semantics by "
                                                             "attention, controls x w(t) in the adaptive norm (the "
                                                             "paper's); both: the class in attention and the "
                                                             "adaptive norm (MMDiT-native); adanorm: class and "
                                                             "controls in the norm (DiT / SDXL)")
    controls: list[Literal["size", "crop", "flip"]] = Field([], description="the control conditions used")
    control_power: ControlPower = Field(default_factory=ControlPower)
    pooled_text: bool | None = Field(None, description="text: the pooled text vector into the adaptive norm; None: "
                                     "off in disentangled (the paper's reading), on in both and adanorm (SD3)")
    semantic_dropout: float = Field(0.1, ge=0, le=1, description="dropped independently, for guidance on each")
    control_dropout: float = Field(0.1, ge=0, le=1, description="the controls' dropout")
    replicate_padding: bool = Field(True, description="text: noisy replicate padding instead of pad embeddings")
    padding_noise: float = Field(0.02, ge=0, description="its noise std, relative to the real tokens' RMS")
    zero_padding: bool = Field(False, description="text, with replicate_padding false: zeros at the padded positions "
                               "instead of the encoder's pad features (docs/benchmarks/emoji_claims.md's baseline)")


class Train(BaseModel, extra="forbid", strict=True):
    max_steps: int = Field(600, ge=1, description="optimizer steps")
    batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        64, description='per device and micro-batch; global: x processes x grad_accum; "auto" (with global_batch): '
        "the largest that fits")
    global_batch: Int = Field(None, ge=1, description="images per optimizer step; set: grad_accum = global / "
                              "(batch x processes)")
    grad_accum: int = Field(1, ge=1, description="micro-batches per step (the recipes: 2, to fit an 80 GB A100)")
    lr: float = Field(1e-3, ge=0, description="the paper: 1e-4 at batch 2048; the tiny demo model likes more "
                      "(train.optimizer='muon': the AdamW group's)")
    optimizer: Literal["adamw", "muon"] = Field("adamw", description='"muon": torch.optim.Muon for the blocks\' 2-D '
                                                'weights, AdamW for the rest (training/optimisation/muon.py; '
                                                'torch >= 2.9)')
    muon_lr: float | None = Field(None, ge=0, description="Muon's LR, on AdamW's scale (update RMS matched: Liu et al. "
                                  "2025; PRX: 1e-4, as its AdamW group); None: train.lr")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="after warm-up (decay to 0)")
    lr_scaling: Literal["none", "sqrt", "linear"] = Field("none", description="lr x (global / reference batch)^p")
    lr_reference_batch: int = Field(2048, ge=1, description="the global batch that train.lr was tuned for")
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.999], min_length=2, max_length=2,
                                                             description="AdamW's [beta1, beta2]")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay (0: Adam, the paper's)")
    warmup_steps: int = Field(50, ge=0, description="linear LR warm-up")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clipping (adaptive: the cap)")
    grad_clip_mode: Literal["norm", "adaptive"] = Field("norm", description="adaptive: clip to a "
                                                        "percentile of recent norms")
    grad_clip_percentile: float = Field(95.0, gt=0, le=100, description="adaptive: the percentile ...")
    grad_clip_history: int = Field(1000, ge=1, description="... of the last this many finite norms (TRELLIS's)")
    max_nonfinite_steps: int = Field(20, ge=1,
                                     description="a NaN/inf skips the step; this many in a row: on_divergence")
    on_divergence: Literal["stop", "rollback"] = Field("stop", description="rollback: reload the last good checkpoint, "
                                                        "lower the LR, skip the data window (PaLM)")
    rollback_spikes: int = Field(3, ge=0, description="rollback also after this many loss spikes in "
                                 "rollback_window (0: off)")
    rollback_window: int = Field(200, ge=1, description="steps")
    rollback_lr_factor: float = Field(0.5, gt=0, le=1, description="the LR is multiplied by this at each rollback")
    max_rollbacks: int = Field(3, ge=0, description="a divergence after this many rollbacks stops the run")
    mixed_precision: Literal["no", "fp16", "bf16"] = Field("no", description="autocast (fp32 master weights and EMA)")
    ema_decay: float = Field(0.999, ge=0, le=1, description="EMA of the weights, per optimizer step")
    ema_device: Literal["same", "cpu"] = Field("same", description='"cpu": the fp32 EMA in pinned CPU memory '
                                               '(4 B/param off the GPU)')
    ema_every: int = Field(1, ge=1, description="update the EMA every k steps, the k decays compounded "
                                                "(training/run/fit.py)")
    gradient_checkpointing: bool = Field(False, description="recompute activations: far less memory, ~1/3 more FLOPs")
    compile: bool = Field(False, description="torch.compile the model (on in the recipes; docs/performance.md)")
    sharding: Literal["ddp", "fsdp"] = Field("ddp", description='"fsdp": weights, gradients, Adam and EMA sharded '
                                             'over the GPUs, for models DDP cannot fit (training/run/sharding.py)')
    lora_rank: int = Field(0, ge=0, description="LoRA adapters of this rank on init_from's frozen base (0: off, all "
                           "weights train; training/model/lora.py)")
    lora_alpha: float | None = Field(None, gt=0, description="the adapters' scale alpha / rank; None: alpha = rank")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    lora_targets: list[str] | None = Field(None, min_length=1, description="the transformer's modules adapted (peft "
                                           "target_modules); None: the attention projections (lora.ATTENTION)")
    lora_merged_export: bool = Field(False, description="LoRA: export one model, the adapters folded in; False: the "
                                     "base and diffusers' adapter file (load_lora_weights)")
    timeout_minutes: float = Field(30.0, gt=0, description="how long a collective waits for a slow rank "
                                   "(NCCL's own: 10)")


class Val(BaseModel, extra="forbid", strict=True):  # a trainer adds its sampler keys (schema)
    every: int = Field(200, ge=1, description="validate every this many steps, and at the last step")
    num_samples: int = Field(36, ge=1, description="grid size: classes in order, or the first held-out captions")
    steps: int = Field(50, ge=1, description="sampling steps")
    guidance_scale: float = Field(3.0, ge=0, description="semantic guidance scale (1: none)")
    control_guidance_scale: float = Field(0.0, ge=0, description="control guidance scale (0: none; standard CFG)")
    loss_samples: int = Field(256, ge=1, description="held-out samples of the loss on a fixed grid of loss_bins times")
    slope_window: int = Field(5, ge=3, description="validations the per-bin validation-loss slope is fitted over")
    prompts: Str = Field(None, description="text: a file of validation prompts, one a line; None: held-out captions")
    fid_every: int = Field(0, ge=0, description="small-N FID/KID (eval_fid.py) every this many steps (0: off)")
    fid_samples: int = Field(1000, ge=2, description="samples of that FID")
    fid_reference: Str = Field(None, description="None: the held-out split; else any eval_fid.py --reference")
    reference_curves: Str = Field(None, description="a reference run's curves (tools/curves.py): held-out losses "
                                  "checked against their band, drawn in the report; the recipes name their own")
    inception_weights: Str = Field(None, description="a local inception-2015-12-05.pt (offline clusters)")
    fid_dino: Str = Field(None, description="a DINOv2 id or folder: FD-DINOv2 and its precision / recall with each FID")
    guidance_interval: list[Annotated[float, Field(ge=0, le=1)]] = Field([0.0, 1.0], min_length=2, max_length=2,
                                                                         description="[lo, hi]: guide only at noise "
                                                                         "levels in it (flow t; DDPM noise_level)")


class Log(BaseModel, extra="forbid", strict=True):
    every: int = Field(10, ge=1, description="loss, LR, clipping, throughput, memory (averaged over these steps)")
    grad_every: int = Field(50, ge=0, description="gradient norm and update / weight ratio per layer group (0: off)")
    grad_flag_ratio: float = Field(100.0, gt=1, description="flag a group this far below / above the median group")
    spike_threshold: float = Field(6.0, gt=0, description="a loss spike: this many running stds above the mean")
    report: bool = Field(True, description="report.md and plots in run_dir at the end "
                                           "(python -m training.record.report)")
    wandb: Literal["auto", "online", "offline", "off"] = Field("auto", description="auto: online if logged in")
    project: str = Field("minimal-diffusion", description="the wandb project")


class Ckpt(BaseModel, extra="forbid", strict=True):
    every: int = Field(500, ge=1, description="checkpoint every this many steps")
    keep: int = Field(3, ge=1, description="newest checkpoints kept")
    phema_every: int = Field(0, ge=0,
                             description="post-hoc EMA: images between fp16 snapshots of its profiles (0: off)")
    phema_stds: list[Annotated[float, Field(gt=0, le=0.28)]] = Field([0.05, 0.1],
                                                                     description="relative stds of the "
                                                                     "tracked power EMAs")


class Repa(BaseModel, extra="forbid", strict=True):  # both trainers' objective keys (schema adds them)
    repa_weight: float = Field(0.0, ge=0, description="REPA: weight of the representation-alignment term "
                               "(the paper: 0.5; training/objectives/repa.py); 0: off")
    repa_encoder: str = Field("facebook/dinov2-base", description="REPA: the frozen transformers image model "
                              "(hub id or folder) whose patch tokens are the targets (DINOv2-B: the paper's)")
    repa_block: int = Field(4, ge=1, description="REPA: the block (1-based) whose output tokens are aligned "
                            "(the paper: 4 of 12 for B-sized models, 8 of 28 for XL)")
    repa_projector: Literal["mlp", "conv"] = Field("mlp", description="REPA's 3-layer MLP, or iREPA's 3x3 "
                                                   "convolution with spatially normalised targets")
    repa_projector_dim: int = Field(2048, ge=1, description="REPA: the MLP projector's hidden width (the paper's)")
    repa_off_step: Int = Field(None, ge=0, description="REPA: the term stops at this optimizer step "
                               "(HASTE); None: never")
    repa_targets: Literal["cache", "on_the_fly"] = Field("cache", description="REPA: stored with each cached row, "
                                                         "or encoded from the batch's pixels each step (pixel space)")


class Run(BaseModel, extra="forbid", strict=True):
    # The start-up checks of the options a trainer runs (REPA, sharding, its objective's, ...): functions cfg ->
    # [problem], each in the option's own module, handed over by the trainer (schema); this module imports none.
    checks: ClassVar[tuple] = ()
    # Keys whose default follows another key (objective.meanflow's sampler): functions cfg -> [start-up line] that
    # fill the keys neither a recipe nor the command line chose, each in its option's module (schema).
    resolvers: ClassVar[tuple] = ()
    run_dir: Str = Field(None, description="None: runs/{method}_{config name}, runs/{method}_demo without one")
    seed: int = Field(0, ge=0, description="each rank adds its index")
    resume: Str = Field(None, description='"latest" (this run_dir\'s newest checkpoint) or a checkpoint folder')
    init_from: Str = Field(None, description="a run, checkpoint or export whose weights and EMA start this run "
                           '(256 -> 512 px, 22k -> 1k); "{method}": the trainer')
    push_to_hub: Str = Field(None, description="owner/name: the export, a diffusers pipeline folder, uploaded to "
                             "this Hub repository (private) at the end (docs/evaluation.md, Sharing a model)")
    data: Data = Field(default_factory=Data, description="the source, held-out rows, preprocessing, the cache")
    encoders: Encoders = Field(default_factory=Encoders, description="the frozen VAE and text encoder")
    model: Model = Field(default_factory=Model, description="SD3Transformer2DModel")
    conditioning: Conditioning = Field(default_factory=Conditioning, description="semantic vs control conditions")
    objective: dict = Field({}, description="the method's own section: its trainer's Objective")
    train: Train = Field(default_factory=Train, description="optimizer, budget, precision")
    val: Val = Field(default_factory=Val, description="samples, validation loss and FID during training")
    log: Log = Field(default_factory=Log, description="metrics, gradient analysis, loss spikes, wandb")
    ckpt: Ckpt = Field(default_factory=Ckpt, description="checkpoints")


def schema(objective, sampler, checks=(), resolvers=()):
    """A trainer's whole config: the shared sections with its `objective` section (plus the REPA keys) and its
    `sampler` keys in val, carrying `checks`, the start-up checks of the options it runs (config.load_config runs
    them with combination_problems, every problem at once), and `resolvers`, the defaults that follow another key
    (run once every value is valid, before those checks)."""
    val = create_model("Val", __base__=Val, **{k: (f.annotation, f) for k, f in sampler.model_fields.items()})
    objective = create_model("Objective", __base__=objective, __doc__=objective.__doc__,
                             **{k: (f.annotation, f) for k, f in Repa.model_fields.items()})
    about = Run.model_fields["val"].description
    run = create_model("Run", __base__=Run, val=(val, Field(default_factory=val, description=about)),
                       objective=(objective, Field(default_factory=objective, description=objective.__doc__)))
    run.checks, run.resolvers = tuple(checks), tuple(resolvers)
    return run


# ----------------------------------------------------------------------------------------------------------
# Combinations that cannot work, the files a run needs, and budgets that cannot work (warnings).


def combination_problems(cfg):
    """Problems no single key shows: settings of the shared sections that contradict each other or name files that
    are not there. An option's own combinations are its module's (Run.checks)."""
    d, tr, enc, val = cfg["data"], cfg["train"], cfg["encoders"], cfg["val"]
    problems = []
    if bool(d["caption_column"] or d["label_captions"]) != bool(enc["text_encoder"]):
        problems.append("encoders.text_encoder goes with data.caption_column (or data.label_captions): "
                        "set both or neither")
    if d["demo_render"] != "native" and not d["demo_sizes"]:
        problems.append(f"data.demo_render={d['demo_render']!r} draws each image at a native side: set data.demo_sizes")
    if d["demo_sizes"] and d["demo_sizes"][0] > d["demo_sizes"][1]:
        problems.append(f"data.demo_sizes={d['demo_sizes']} must be [lo, hi] with lo <= hi (pixels per side)")
    if d["demo_render"] == "colour_by_size" and d["demo_sizes"] and \
            not (d["demo_sizes"][0] <= 8 and d["demo_sizes"][1] >= 32):
        problems.append("data.demo_render='colour_by_size' draws red at 8-14 px and blue at 26-32 px "
                        f"(data.COLOUR_SIDES): data.demo_sizes={d['demo_sizes']} must cover [8, 32]")
    if d["cache_views"] > 1 and d["crop"] == "center":
        problems.append(f"data.cache_views={d['cache_views']} caches that many crops per image, and data.crop='center' "
                        f"gives the same centre square each time: set data.crop to 'random' or 'random_resized', or "
                        f"data.cache_views=1")
    if d["buckets"] is not None and \
            (not d["buckets"] or d["source"] != "embedded" and (d["streaming"] or ".tar" in d["source"])):
        problems.append(f"data.buckets={d['buckets']!r} needs at least one aspect ratio and a source whose image sizes "
                        f"can be read before the cache is built: a folder, parquet files or a downloaded hub dataset, "
                        f"not a stream (data.streaming, tar shards)")
    if d["buckets"] is not None and val["fid_every"]:
        problems.append("val.fid_every scores square samples during training; with data.buckets score each bucket "
                        "with eval_fid.py --aspect_ratio after the run (docs/evaluation.md), and set val.fid_every=0")
    if d["label_captions"] and (d["caption_column"] or not d["label_column"]):
        problems.append("data.label_captions captions each image with its class name: it needs data.label_column "
                        "and no data.caption_column")
    if cfg["conditioning"]["zero_padding"] and cfg["conditioning"]["replicate_padding"]:
        problems.append("conditioning.zero_padding=true and conditioning.replicate_padding=true: the padded text "
                        "positions take one of the two; set conditioning.replicate_padding=false for zeros")
    if not d["label_column"] and not d["caption_column"]:
        problems.append("set data.label_column (class-conditional) or data.caption_column (text-to-image)")
    if d["label_column"] and not d["caption_column"] and d["num_classes"] is not None and d["num_classes"] < 1:
        problems.append(f"data.num_classes={d['num_classes']} must be >= 1 with data.label_column")
    if d["class_ids"] and not Path(d["class_ids"]).is_file() and d["class_ids"] not in ("imagenet-1k", "imagenet-22k"):
        problems.append(f"data.class_ids={d['class_ids']!r} must be 'imagenet-1k', 'imagenet-22k' or a file of ids")
    if tr["batch_size"] == "auto" and not tr["global_batch"]:
        problems.append("train.batch_size='auto' finds the micro-batch that keeps train.global_batch: set "
                        "train.global_batch (e.g. 2048, the paper's), or a number for train.batch_size")
    elif tr["global_batch"] and tr["batch_size"] != "auto" and tr["global_batch"] % tr["batch_size"]:
        problems.append(f"train.global_batch={tr['global_batch']} is not a multiple of train.batch_size="
                        f"{tr['batch_size']}: the accumulation global / (batch_size x processes) must be whole")
    if val["guidance_interval"][0] > val["guidance_interval"][1]:
        problems.append(f"val.guidance_interval={val['guidance_interval']!r} must be [lo, hi] with lo <= hi (noise "
                        f"levels: flow-matching t, 1 = pure noise; [0, 1] guides every step)")
    if cfg["ckpt"]["phema_every"] and not cfg["ckpt"]["phema_stds"]:
        problems.append("ckpt.phema_every > 0 tracks the profiles of ckpt.phema_stds: give at least one std, "
                        "e.g. [0.05, 0.1]")
    if tr["mixed_precision"] == "fp16":
        import torch

        if not torch.cuda.is_available():
            problems.append("train.mixed_precision='fp16' needs a CUDA GPU and there is none: use 'bf16' or 'no'")
    if cfg["resume"] not in (None, "latest") and not Path(cfg["resume"]).is_dir():
        problems.append(f"resume={cfg['resume']!r} must be 'latest' or a checkpoint folder; there is no such folder")
    if cfg["init_from"] and cfg["resume"] is None and not Path(cfg["init_from"]).exists():
        problems.append(f"init_from={cfg['init_from']!r}: no such run, checkpoint or export folder")
    if val["fid_every"] and val["inception_weights"] and not Path(val["inception_weights"]).is_file():
        problems.append(f"val.inception_weights={val['inception_weights']!r}: no such file")
    reference = str(val["fid_reference"] or "")
    if val["fid_dino"] and (reference.endswith(".npz") or reference.startswith("cleanfid:")):
        problems.append(f"val.fid_dino needs reference images, and val.fid_reference={reference!r} is precomputed "
                        f"Inception statistics: use a folder or a dataset, or leave it None (the held-out rows)")
    if val.get("reference_curves") and not Path(val["reference_curves"]).is_file():  # .get: configs saved before it
        problems.append(f"val.reference_curves={val['reference_curves']!r}: no such file (tools/curves.py makes one; "
                        f"null runs without)")
    if val["prompts"] and not Path(val["prompts"]).is_file():
        problems.append(f"val.prompts={val['prompts']!r}: no such file (one validation prompt per line)")
    elif val["prompts"] and not enc["text_encoder"]:
        problems.append("val.prompts names validation prompts: it needs encoders.text_encoder and data.caption_column")
    return problems


def budget_warnings(cfg):
    """Budgets that run but cannot work as meant. Warnings, not errors: a smoke test does these on purpose."""
    tr, val, log = cfg["train"], cfg["val"], cfg["log"]
    out = []
    if tr["warmup_steps"] > tr["max_steps"]:
        out.append(f"train.warmup_steps={tr['warmup_steps']} is longer than the run "
                   f"(train.max_steps={tr['max_steps']}): the LR never reaches train.lr, only "
                   f"{tr['max_steps'] / tr['warmup_steps']:.0%} of it")
    for key, every in (("val.every", val["every"]), ("log.every", log["every"]), ("val.fid_every", val["fid_every"])):
        if every > tr["max_steps"]:
            out.append(f"{key}={every} is beyond the run (train.max_steps={tr['max_steps']}): it happens only "
                       "at the last step")
    return out


def size_warnings(cfg, num_params, num_rows, world):
    """A model far larger than its data, or so many epochs that it can only memorise (warnings, once the
    training rows are known)."""
    tr, out = cfg["train"], []
    if num_params > 10_000 * num_rows:
        out.append(f"{num_params / 1e6:.1f}M parameters for {num_rows} training images ({num_params // num_rows:,} "
                   f"per image): the model will memorise them; use a smaller model (model.*) or more data")
    epochs = tr["max_steps"] * tr["batch_size"] * tr["grad_accum"] * world / num_rows
    if epochs > 1000:
        out.append(f"train.max_steps={tr['max_steps']} is {epochs:,.0f} epochs of {num_rows} images: "
                   "expect memorisation")
    return out
