"""The run's config: a trainer's DEFAULTS <- --config file.json <- --section.key=value, checked at start-up.

Every key's type, range and allowed values are checked in one place (RULES below, plus a trainer's own table
for its method's keys), together with the combinations that cannot work, and every problem is reported at
once, in one ConfigError, before any data is opened or any model is built. `--help` lists every key with its
default and the comment it has in the trainer's DEFAULTS (read from the source, so it cannot drift);
`--print_config` prints the resolved config and exits.
"""
import json
import os
import re
import sys
from pathlib import Path


class ConfigError(ValueError):
    """A config that cannot work; its message lists every problem. The trainers print it without a traceback."""


class Config(dict):
    """A dict whose keys also read as attributes (cfg.train.lr), so it still dumps to JSON as is."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no key '{key}'") from None

    def __setattr__(self, key, value):  # cfg.run_dir = ... sets the key, so config.json records it
        self[key] = value


def shard_range(key, value):
    """data.val_shards: [first, stop) of a streamed source's shards, each a whole number or null (as a slice)."""
    if not (isinstance(value, list) and len(value) == 2 and all(v is None or type(v) is int for v in value)):
        return f"{key}={value!r} must be [first, stop): two whole numbers or null, e.g. [-1, null] (the last shard)"
    return None


def auto_or(rule):
    """A key that also takes "auto" (train.batch_size: found at start-up, training/fit.py)."""
    return lambda key, value: None if value == "auto" else rule_problem(key, value, rule)


AUTO_KEYS = ("train.batch_size",)  # the merge accepts "auto" for these whatever their default's type


# ----------------------------------------------------------------------------------------------------------
# What each key may hold. A string is a numeric range ("int" first: whole numbers only), a tuple the allowed
# values (for a list, of each element), `str` any string, `bool` / `float` any value of the default's type, a
# function a check of its own (shard_range)
# (listed so that every key has its line: tests/test_config.py checks it). The type of a key whose default is not None is
# also enforced by the merge. A trainer passes the same kind of table for its method's keys.

RULES = {
    "run_dir": str, "seed": ">= 0", "resume": str, "init_from": str,
    "data.source": str, "data.split": str, "data.val_split": str, "data.val_holdout": ">= 0",
    "data.image_column": str, "data.label_column": str, "data.caption_column": str, "data.num_classes": ">= 0",
    "data.class_ids": str, "data.label_captions": bool, "data.resolution": ">= 8",
    "data.crop": ("center", "random", "random_resized"), "data.min_crop_scale": "(0, 1]", "data.random_flip": bool,
    "data.min_image_side": ">= 1", "data.max_samples": "int >= 1", "data.demo_samples": ">= 1",
    "data.demo_resolution": ">= 8", "data.cache_dir": str, "data.cache_dtype": ("float16", "bfloat16", "float32"),
    "data.shard_size": ">= 1", "data.verify_cache": bool, "data.streaming": bool, "data.cache_text": bool,
    "data.val_shards": shard_range, "data.encode_batch_size": ">= 1", "data.num_workers": ">= 0",
    "data.prefetch_factor": ">= 1",
    "encoders.vae": str, "encoders.text_encoder": str, "encoders.max_tokens": ">= 1",
    "model.patch_size": ">= 1", "model.num_layers": ">= 1", "model.num_attention_heads": ">= 1",
    "model.attention_head_dim": ">= 1", "model.class_tokens": ">= 1", "model.qk_norm": ("rms_norm", "layer_norm"),
    "model.pos_embed_transfer": ("resample", "extend"),
    "conditioning.mode": ("disentangled", "adanorm"), "conditioning.controls": ("size", "crop", "flip"),
    "conditioning.control_power.size": ">= 0", "conditioning.control_power.crop": ">= 0",
    "conditioning.control_power.flip": ">= 0", "conditioning.semantic_dropout": "[0, 1]",
    "conditioning.control_dropout": "[0, 1]", "conditioning.replicate_padding": bool, "conditioning.padding_noise": ">= 0",
    "objective.time_shift": "> 0", "objective.shift_base_resolution": "int >= 1", "objective.loss_bins": ">= 1",
    "train.max_steps": ">= 1", "train.batch_size": auto_or(">= 1"), "train.grad_accum": ">= 1", "train.lr": ">= 0",
    "train.lr_schedule": ("constant", "cosine", "linear"), "train.lr_scaling": ("none", "sqrt", "linear"),
    "train.lr_reference_batch": ">= 1", "train.betas": "[0, 1)", "train.weight_decay": ">= 0",
    "train.warmup_steps": ">= 0", "train.grad_clip": "> 0", "train.max_nonfinite_steps": ">= 1",
    "train.mixed_precision": ("no", "fp16", "bf16"), "train.ema_decay": "[0, 1]", "train.gradient_checkpointing": bool,
    "train.compile": bool, "train.global_batch": "int >= 1", "train.ema_device": ("same", "cpu"),
    "train.ema_every": "int >= 1",
    "val.every": ">= 1", "val.num_samples": ">= 1", "val.steps": ">= 1", "val.guidance_scale": ">= 0",
    "val.control_guidance_scale": ">= 0", "val.loss_samples": ">= 1", "val.fid_every": ">= 0", "val.fid_samples": ">= 2",
    "val.fid_reference": str, "val.inception_weights": str, "val.prompts": str,
    "log.every": ">= 1", "log.grad_every": ">= 0", "log.grad_flag_ratio": "> 1", "log.spike_threshold": "> 0",
    "log.report": bool, "log.wandb": ("auto", "online", "offline", "off"), "log.project": str,
    "ckpt.every": ">= 1", "ckpt.keep": ">= 1",
}


def in_range(value, rule):
    """Whether a number satisfies a rule such as '>= 1', '> 0', '[0, 1]', '(0, 1]' or 'int >= 1'."""
    if rule.startswith("int ") and not isinstance(value, int):
        return False
    rule = rule.removeprefix("int ")
    if rule[0] in "[(":
        low, high = (float(v) for v in rule[1:-1].split(","))
        return (low <= value if rule[0] == "[" else low < value) and (value <= high if rule[-1] == "]" else value < high)
    op, bound = rule.split()
    return {">=": value >= float(bound), ">": value > float(bound)}[op]


def rule_problem(key, value, rule):
    """What is wrong with `value` for `key` under `rule`, or None."""
    if value is None or rule in (bool, float):  # null: a switched-off setting; bool, float: the merge's check
        return None
    if callable(rule) and rule is not str:  # a check of its own (a list with structure)
        return rule(key, value)
    for item in value if isinstance(value, list) else [value]:
        if rule is str and not isinstance(item, str):
            return f"{key}={value!r} must be a string (or null)"
        if isinstance(rule, tuple) and item not in rule:
            return f"{key}={value!r} must be {' or '.join(map(repr, rule))}" + (" (each)" if isinstance(value, list) else "")
        if isinstance(rule, str) and (isinstance(item, bool) or not isinstance(item, (int, float)) or not in_range(item, rule)):
            what = (rule.replace("int ", "a whole number ") if rule.startswith("int ")
                    else f"in {rule}" if rule[0] in "[(" else f"a number {rule}")
            return f"{key}={value!r} must be {what}"
    return None


def flatten(cfg, prefix=""):
    """{"data.source": ..., ...}: every leaf of a nested config under its dotted name."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


# ----------------------------------------------------------------------------------------------------------
# Loading: merge with type checks (problems collected, not raised one at a time).


def _merge(base, override, where, problems, prefix=""):
    out = Config({k: Config(v) if isinstance(v, dict) else v for k, v in base.items()})
    for key, value in override.items():
        name = prefix + key
        if key not in base:
            close = [k for k in base if k.startswith(key[:3])]
            problems.append(f"unknown config key '{name}' ({where}); known keys here: {sorted(base)}"
                            + (f", did you mean {close}?" if close else ""))
            continue
        default = base[key]
        if isinstance(default, dict):
            if isinstance(value, dict):
                out[key] = _merge(default, value, where, problems, name + ".")
            else:
                problems.append(f"config key '{name}' ({where}) must be a section (dict), got {value!r}")
            continue
        ok = (default is None or (value is None and type(default) is str)  # a str setting can be switched off
              or (type(default) is bool and type(value) is bool)
              or (type(default) is int and type(value) is int)
              or (type(default) is float and type(value) in (int, float))
              or (type(default) in (str, list) and type(value) is type(default))
              or (name in AUTO_KEYS and value == "auto"))
        if ok:
            out[key] = float(value) if type(default) is float else value
        else:
            problems.append(f"config key '{name}' ({where}) must be {type(default).__name__}, got "
                            f"{type(value).__name__} {value!r}")
    return out


def read_config_file(path, problems):
    """A --config file's JSON object; a missing file, malformed JSON (with its line and column) or anything but
    an object is a problem naming the file."""
    if not Path(path).is_file():
        problems.append(f"config file not found: {path}")
        return {}
    try:
        content = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        problems.append(f"{path}: line {e.lineno}, column {e.colno}: malformed JSON ({e.msg})")
        return {}
    if not isinstance(content, dict):
        problems.append(f"{path} must hold a JSON object of config sections, got a {type(content).__name__}")
        return {}
    return content


def load_config(defaults, argv=None, method="run", rules=None, check=None):
    """Resolve the config: the trainer's DEFAULTS, then `--config file.json`, then `--a.b=value` overrides.

    Values parse as JSON when they can (`--train.lr=3e-4`, `--data.label_column=null`) and as plain strings
    otherwise. A run_dir left unset becomes runs/{method}_{config file name} (runs/flow_matching_demo without
    a config), so one recipe can be run by both trainers side by side; for the same reason "{method}" in
    init_from becomes the trainer's name (configs/imagenet512.json starts from runs/{method}_imagenet256).

    Unknown keys and wrong types are always problems. `rules` (a trainer's table for its method's keys) marks
    a trainer's start-up: then every value is checked against RULES and `rules`, with the combinations and
    the files the run needs, and `check(cfg)` adds the method's own problems. All problems raise together as
    one ConfigError. `--help` prints every key and `--print_config` the resolved config; both then exit.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text(defaults, method, {**RULES, **(rules or {})}))
        raise SystemExit(0)
    print_only = "--print_config" in argv
    argv = [a for a in argv if a != "--print_config"]
    problems = []
    cfg = _merge(defaults, {}, "defaults", problems)
    overrides, name = [], "demo"
    while argv:
        arg = argv.pop(0)
        if not arg.startswith("--"):
            problems.append(f"unexpected argument {arg!r}: use --config FILE, --key=value, --help or --print_config")
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if not argv:
                problems.append(f"argument --{key} needs a value")
                continue
            value = argv.pop(0)
        if key == "config":
            cfg, name = _merge(cfg, read_config_file(value, problems), f"from {value}", problems), Path(value).stem
        else:
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
            for part in reversed(key.split(".")):
                value = {part: value}
            overrides.append((value, arg))
    for value, arg in overrides:
        cfg = _merge(cfg, value, f"from {arg}", problems)
    if "run_dir" in cfg and cfg.run_dir is None:
        cfg.run_dir = f"runs/{method}_{name}"
    if cfg.get("init_from"):
        cfg.init_from = cfg.init_from.replace("{method}", method)
    if rules is not None and not problems:  # values are checked once their types are right
        table = {**RULES, **rules}
        flat = flatten(cfg)
        problems += [p for key, rule in table.items() if key in flat for p in [rule_problem(key, flat[key], rule)] if p]
        problems += combination_problems(cfg) if not problems else []
        problems += check(cfg) if check is not None and not problems else []
    if problems:
        raise ConfigError(f"invalid config ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  " + "\n  ".join(problems))
    if print_only:
        print(json.dumps(cfg, indent=2))
        raise SystemExit(0)
    if rules is not None and int(os.environ.get("RANK", 0)) == 0:
        for warning in budget_warnings(cfg):
            print(f"warning: {warning}")
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Combinations that cannot work, the files a run needs, and budgets that cannot work (warnings).


def combination_problems(cfg):
    """Problems no single key shows: settings that contradict each other or name files that are not there."""
    d, m, tr, enc = cfg["data"], cfg["model"], cfg["train"], cfg["encoders"]
    problems = []
    factor = 1
    if enc["vae"]:  # only the VAE's config is read here (no weights)
        try:
            from diffusers import AutoencoderKL

            from training.data import from_pretrained

            factor = 2 ** (len(from_pretrained("encoders.vae", AutoencoderKL.load_config, enc["vae"])["block_out_channels"]) - 1)
        except SystemExit as e:  # data.from_pretrained: a model that cannot be found, in one line
            problems.append(str(e))
        except Exception as e:
            problems.append(f"encoders.vae={enc['vae']!r}: its config cannot be read ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:200]})")
    if d["resolution"] % (m["patch_size"] * factor):
        problems.append(f"data.resolution={d['resolution']} is not divisible by model.patch_size={m['patch_size']}"
                        f" x the VAE's downsampling factor {factor}")
    if bool(d["caption_column"] or d["label_captions"]) != bool(enc["text_encoder"]):
        problems.append("encoders.text_encoder goes with data.caption_column (or data.label_captions): set both or neither")
    if d["label_captions"] and (d["caption_column"] or not d["label_column"]):
        problems.append("data.label_captions captions each image with its class name: it needs data.label_column "
                        "and no data.caption_column")
    if not d["label_column"] and not d["caption_column"]:
        problems.append("set data.label_column (class-conditional) or data.caption_column (text-to-image)")
    if d["label_column"] and not d["caption_column"] and d["num_classes"] is not None and d["num_classes"] < 1:
        problems.append(f"data.num_classes={d['num_classes']} must be >= 1 with data.label_column")
    if d["class_ids"] and not Path(d["class_ids"]).is_file() and d["class_ids"] not in ("imagenet-1k", "imagenet-22k"):
        problems.append(f"data.class_ids={d['class_ids']!r} must be 'imagenet-1k', 'imagenet-22k' or a file of ids")
    if tr["batch_size"] == "auto" and not tr.get("global_batch"):
        problems.append("train.batch_size='auto' finds the micro-batch that keeps train.global_batch: set "
                        "train.global_batch (e.g. 2048, the paper's), or a number for train.batch_size")
    elif tr.get("global_batch") and tr["batch_size"] != "auto" and tr["global_batch"] % tr["batch_size"]:
        problems.append(f"train.global_batch={tr['global_batch']} is not a multiple of train.batch_size="
                        f"{tr['batch_size']}: the accumulation global / (batch_size x processes) must be whole")
    if len(tr["betas"]) != 2:
        problems.append(f"train.betas={tr['betas']!r} must be two numbers [beta1, beta2] in [0, 1)")
    if tr["mixed_precision"] == "fp16":
        import torch

        if not torch.cuda.is_available():
            problems.append("train.mixed_precision='fp16' needs a CUDA GPU and there is none: use 'bf16' or 'no'")
    if cfg["resume"] not in (None, "latest") and not Path(cfg["resume"]).is_dir():
        problems.append(f"resume={cfg['resume']!r} must be 'latest' or a checkpoint folder; there is no such folder")
    if cfg.get("init_from") and cfg["resume"] is None and not Path(cfg["init_from"]).exists():
        problems.append(f"init_from={cfg['init_from']!r}: no such run, checkpoint or export folder")
    weights = cfg["val"]["inception_weights"]
    if cfg["val"]["fid_every"] and weights and not Path(weights).is_file():
        problems.append(f"val.inception_weights={weights!r}: no such file")
    prompts = cfg["val"].get("prompts")
    if prompts and not Path(prompts).is_file():
        problems.append(f"val.prompts={prompts!r}: no such file (one validation prompt per line)")
    elif prompts and not enc["text_encoder"]:
        problems.append("val.prompts names validation prompts: it needs encoders.text_encoder and data.caption_column")
    return problems


def budget_warnings(cfg):
    """Budgets that run but cannot work as meant. Warnings, not errors: a smoke test does these on purpose."""
    tr, val, log = cfg["train"], cfg["val"], cfg["log"]
    out = []
    if tr["warmup_steps"] > tr["max_steps"]:
        out.append(f"train.warmup_steps={tr['warmup_steps']} is longer than the run (train.max_steps={tr['max_steps']}):"
                   f" the LR never reaches train.lr, only {tr['max_steps'] / tr['warmup_steps']:.0%} of it")
    for key, every in (("val.every", val["every"]), ("log.every", log["every"]), ("val.fid_every", val["fid_every"])):
        if every > tr["max_steps"]:
            out.append(f"{key}={every} is beyond the run (train.max_steps={tr['max_steps']}): it happens only at the last step")
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
        out.append(f"train.max_steps={tr['max_steps']} is {epochs:,.0f} epochs of {num_rows} images: expect memorisation")
    return out


# ----------------------------------------------------------------------------------------------------------
# --help: every key, its default and its comment in the trainer's DEFAULTS, read from the trainer's source.


def key_comments(source):
    """{dotted key: comment} from the DEFAULTS block of a trainer's source: the comment on the key's line and
    the comment-only lines that continue it."""
    lines = source[source.index("DEFAULTS = {"):].splitlines()[1:]
    comments, stack, last = {}, [], None
    for line in lines:
        if line.startswith("}"):
            break
        code, _, comment = re.match(r"(.*?)(\s+#\s?(.*))?$", line).group(1, 2, 3)
        key = re.match(r'\s*"(\w+)":\s*(.*)', code)
        if key:
            last = ".".join(stack + [key[1]])
            if key[2].strip() == "{":  # a section over several lines
                stack.append(key[1])
            if comment:
                comments[last] = comment.strip()
        elif code.strip().startswith("}"):
            stack, last = stack[:-1], None
        elif not code.strip() and comment and last:
            comments[last] = comments.get(last, "") + " " + comment.strip()
    return comments


def help_text(defaults, method, rules):
    module = next((m for m in list(sys.modules.values()) if getattr(m, "DEFAULTS", None) is defaults), None)
    try:
        comments = key_comments(Path(module.__file__).read_text())
    except Exception:  # a DEFAULTS without a source file: keys and defaults only
        comments = {}
    script = Path(getattr(module, "__file__", f"train_{method}.py")).name
    out = [f"usage: python {script} [--config FILE.json] [--section.key=value ...] [--print_config]",
           f"       accelerate launch {script} --config configs/cc12m.json --resume latest", "",
           "Every config key, its default and what it does; a recipe (--config) and --key=value override them.",
           "Values parse as JSON (--train.lr=3e-4, --data.label_column=null, --conditioning.controls='[\"size\"]').", ""]
    section = None
    for key, value in flatten(defaults).items():
        top = key.split(".")[0] if "." in key else None
        if top != section and top is not None:
            out.append(f"{top}:" + (f"  ({comments[top]})" if top in comments else ""))
        section = top
        rule = rules.get(key)
        allowed = (" [" + " | ".join(map(str, rule)) + "]" if isinstance(rule, tuple)
                   else f" [{rule}]" if isinstance(rule, str) else "")
        text = comments.get(key) or comments.get(key.rsplit(".", 1)[0], "") if key.count(".") > 1 else comments.get(key, "")
        out.append(f"  --{key}={json.dumps(value)}{allowed}" + (f"\n      {text}" if text else ""))
    return "\n".join(out)
