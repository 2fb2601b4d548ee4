"""The run's config: a trainer's DEFAULTS <- --config file.json <- --section.key=value, checked at start-up.

The keys are typed in training/config/sections.py (pydantic models: each key's type, its range or allowed values and
its one-line description); a trainer adds its objective section, its sampler keys and the start-up checks of the
options it runs (schema), and names the defaults it changes (defaults). Every problem is reported at once, one line
each, in one ConfigError, before any data is opened or any model is built. `--help` lists every key with its type,
default and description from the models; `--print_config` prints the resolved config and exits. The rest of the code
reads a `Config`.
"""
import json
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError

from training.config.sections import (Run, budget_warnings, combination_problems, schema,  # noqa: F401 (trainers' API)
                                      size_warnings)


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

    def __getstate__(self):  # pickled or copied without the schema, a class built at run time (load_config's)
        return {k: v for k, v in vars(self).items() if k != "schema"}


def defaults(model, changes):
    """Every key's default as a Config, with the `changes` a trainer makes to them ({"val.steps": 32})."""
    problems, cfg = [], as_config(model().model_dump())
    for key, value in changes.items():
        cfg = _merge(cfg, nest(key, value), "a trainer's changed defaults", problems, {})
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def fields(model, prefix=""):
    """(dotted key, JSON schema) of every key of a model, in order, nested sections walked."""
    props = model.model_json_schema()["properties"]
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from fields(f.annotation, f"{prefix}{name}.")
        else:
            yield prefix + name, props[name]


def allowed(s, whole=True, inner=False):
    """What a key's JSON schema allows, in words: "'a' or 'b'", 'a number >= 0', 'in [0, 1)', 'a string (or null)'
    (`whole`: say "a whole number" for an integer, where the type and not only the range is wrong)."""
    if "anyOf" in s:
        words = " or ".join(allowed(x, whole, True) for x in s["anyOf"] if x.get("type") != "null")
        return words + (" or null" if inner else " (or null)") * any(x.get("type") == "null" for x in s["anyOf"])
    if "enum" in s or "const" in s:
        return " or ".join(map(repr, s.get("enum", [s.get("const")])))
    if s.get("type") == "array":
        each = allowed(s["items"], whole, True)
        return f"a list of {s['minItems']}, each {each}" if s.get("minItems", -1) == s.get("maxItems") else \
            f"a list, each {each}"
    if s.get("type") in ("integer", "number"):
        low = f"[{s['minimum']}" if "minimum" in s else f"({s['exclusiveMinimum']}" if "exclusiveMinimum" in s else ""
        high = f"{s['maximum']}]" if "maximum" in s else f"{s['exclusiveMaximum']})" if "exclusiveMaximum" in s else ""
        noun = "a whole number" if s["type"] == "integer" and whole else "a number"
        bound = f" {'>=' if low[:1] == '[' else '>'} {low[1:]}" if low else ""
        return f"in {low}, {high}" if low and high else noun + bound
    return {"boolean": "true or false", "string": "a string"}.get(s.get("type"), "a section")


# ----------------------------------------------------------------------------------------------------------
# Loading: merge the layers (unknown keys refused, naming the layer), then validate the result against the models.


def as_config(d):
    return Config({k: as_config(v) if isinstance(v, dict) else v for k, v in d.items()})


def nest(key, value):  # "train.lr", 3e-4 -> {"train": {"lr": 3e-4}}
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


# A method's keys given to the other trainer: the line that refuses them says whose they are.
OTHER_TRAINERS = {"objective.meanflow": "MeanFlow is flow matching's option (the average velocity of its straight "
                                        "path): use train_flow_matching.py"}


def _merge(base, override, where, problems, origin, prefix=""):
    out = as_config(base)
    for key, value in override.items():
        name, default = prefix + key, base.get(key)
        if key not in base and (whose := next((w for k, w in OTHER_TRAINERS.items() if name.startswith(k)), None)):
            problems.append(f"unknown config key '{name}' ({where}): {whose}")
        elif key not in base:
            close = [k for k in base if k.startswith(key[:3])]
            problems.append(f"unknown config key '{name}' ({where}); known keys here: {sorted(base)}"
                            + (f", did you mean {close}?" if close else ""))
        elif isinstance(default, dict) and not isinstance(value, dict):
            problems.append(f"config key '{name}' ({where}) must be a section (dict), got {value!r}")
        elif isinstance(default, dict):
            out[key] = _merge(default, value, where, problems, origin, name + ".")
        else:  # a whole number where the default is a float is that float (3 -> 3.0), as JSON means it
            out[key], origin[name] = float(value) if type(default) is float and type(value) is int else value, where
    return out


def read_config_file(path, problems):
    """A --config file's JSON object; a missing file, malformed JSON (its line and column) or anything but an
    object is a problem naming the file."""
    try:
        content = json.loads(Path(path).read_text())
    except OSError:
        return problems.append(f"config file not found: {path}") or {}
    except json.JSONDecodeError as e:
        return problems.append(f"{path}: line {e.lineno}, column {e.colno}: malformed JSON ({e.msg})") or {}
    if not isinstance(content, dict):
        problems.append(f"{path} must hold a JSON object of config sections, got a {type(content).__name__}")
    return content if isinstance(content, dict) else {}


def tool_config(trainer, argv):
    """The recipe as a tool that reads its data section reads it (tools/classifier.py, autoencoder.py, clip.py):
    defaults <- --config <- --section.key=value, each key's type and range checked (one ConfigError), but not the
    combinations or the encoders, which the tool does not use: the recipe may name the very folder the tool builds
    (its VAE, its CLIP), and a text recipe serves a classifier of a label column its rows carry."""
    cfg = load_config(trainer.DEFAULTS, argv, "flow_matching")
    if problems := schema_problems(trainer.CONFIG, cfg, cfg.origin):
        raise ConfigError(f"invalid config ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
                          + "\n  ".join(problems))
    return cfg


def schema_problems(model, cfg, origin):
    """pydantic's verdict on the merged config, one line per key: the key, its value, what the model allows
    and the layer that set it."""
    try:
        model.model_validate(cfg)
        return []
    except ValidationError as e:
        specs, out = dict(fields(model)), {}
        for err in e.errors():
            parts, section, value = [], model, cfg
            for part in err["loc"]:  # down the sections to the key (an index into a list stays at the key)
                if section is None or part not in section.model_fields:
                    break
                parts.append(part)
                value, section = value[part], section.model_fields[part].annotation
                section = section if isinstance(section, type) and issubclass(section, BaseModel) else None
            key, whole = ".".join(parts), not err["type"].startswith(("greater", "less"))  # range only: "a number"
            example = f", e.g. [{json.dumps(value)}]" if as_list_works(model, cfg, parts, value) else ""  # buckets=1.5
            out.setdefault(key, f"{key}={value!r} must be {allowed(specs.get(key, {}), whole)}{example}"
                           + (f" ({origin[key]})" if key in origin else ""))
        return list(out.values())


def as_list_works(model, cfg, parts, value):
    """Whether a single value is right for its key as a list of one (--data.buckets=1.5 for [1.5]): then the line
    refusing it shows that list."""
    if isinstance(value, (list, dict)) or not parts:
        return False
    trial = json.loads(json.dumps(cfg))
    section = trial
    for part in parts[:-1]:
        section = section[part]
    section[parts[-1]] = [value]
    try:
        model.model_validate(trial)
    except ValidationError as e:
        return not any(tuple(err["loc"][:len(parts)]) == tuple(parts) for err in e.errors())
    return True


def load_config(defaults, argv=None, method="run", schema=None):
    """Resolve the config: the trainer's DEFAULTS, then `--config file.json`, then `--a.b=value` overrides.

    Values parse as JSON when they can (`--train.lr=3e-4`, `--data.label_column=null`), else as strings. An
    unset run_dir becomes runs/{method}_{config name} (runs/{method}_demo without one) and "{method}" in
    init_from the trainer's name, so one recipe runs under both trainers side by side. Unknown keys are always
    problems; `schema` (the trainer's model) marks a trainer's start-up: every value is validated, then, once all
    are valid, the combinations and the files the run needs together with the checks of the options the trainer
    runs (schema.checks: REPA, sharding, its objective's), after the defaults that follow another key are filled
    (schema.resolvers: MeanFlow's sampler), whose lines are printed. All problems raise at once in one ConfigError.
    `--help` prints every key and `--print_config` the resolved config; both then exit.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text(defaults, method, schema))
        raise SystemExit(0)
    print_only = "--print_config" in argv
    argv = [a for a in argv if a != "--print_config"]
    problems, origin, overrides, name, cfg = [], {}, [], "demo", as_config(defaults)
    while argv:
        arg = argv.pop(0)
        key, eq, value = arg[2:].partition("=")
        if not arg.startswith("--") or not (eq or argv):
            problems.append(f"argument {arg} needs a value" if arg.startswith("--") else
                            f"unexpected argument {arg!r}: use --config FILE, --key=value, --help or --print_config")
            continue
        value = value if eq else argv.pop(0)
        if key == "config":
            cfg, name = (_merge(cfg, read_config_file(value, problems), f"from {value}", problems, origin),
                         Path(value).stem)
            continue
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        overrides.append((nest(key, value), arg))
    for value, arg in overrides:
        cfg = _merge(cfg, value, f"from {arg}", problems, origin)
    if "run_dir" in cfg and cfg.run_dir is None:
        cfg.run_dir = f"runs/{method}_{name}"
    if cfg.get("init_from"):
        cfg.init_from = cfg.init_from.replace("{method}", method)
    # the layer that set each key ("from configs/x.json"), for the checks
    object.__setattr__(cfg, "origin", dict(origin))
    notes = []  # the resolvers' lines: the defaults that follow another key, filled once every value is valid
    object.__setattr__(cfg, "schema", schema)  # its keys' descriptions, for the lines that print a value (shown)
    if schema is not None:  # the values beside any unknown key (never merged), combinations once all are right
        problems += schema_problems(schema, cfg, origin)
        if not problems:
            notes = [line for resolve in schema.resolvers for line in resolve(cfg)]
            problems += combination_problems(cfg) + [p for check in schema.checks for p in check(cfg)]
    if problems:
        raise ConfigError(f"invalid config ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
                          + "\n  ".join(problems))
    if print_only:
        print(json.dumps(cfg, indent=2))
        raise SystemExit(0)
    for warning in budget_warnings(cfg) if schema is not None and int(os.environ.get("RANK", 0)) == 0 else []:
        print(f"warning: {warning}")
    for note in notes if int(os.environ.get("RANK", 0)) == 0 else []:
        print(note)
    object.__setattr__(cfg, "explicit", frozenset(origin))  # the keys a --config file or the command line set
    return cfg


# A key added since a run started whose default does not do what that run did: its value from before the key.
# (conditioning.pooled_text: the pooled text vector reached the adaptive norm in every mode before it existed.)
BEFORE_THE_KEY = {"conditioning.pooled_text": True}
# None: the trainer reads it from the data at every start (sources.open_splits, buckets.resolve)
TRAINER_FILLS = {"data.num_classes", "data.bucket_shapes"}
# Of those, what --resume fills anew rather than keeping; the buckets stay (the run's model grid and cache), and
# buckets.resolve refuses a start (another global batch) that would give others
RESUME_REFILLS = TRAINER_FILLS - {"data.bucket_shapes"}


def shown(cfg, key, value):
    """A key's value as a line prints it; None with what None does for that key, from its description's "None: ..."
    ("None, i.e. pixel space"), else "None, i.e. unset": a bare None says nothing to the reader."""
    if value is not None:
        return repr(value)
    about = dict(fields(getattr(cfg, "schema", None) or Run)).get(key, {}).get("description") or ""
    return "None, i.e. " + (about.split("None: ", 1)[1].split("; ")[0] if "None: " in about else "unset")


def recorded(then, key, default):
    """A key's value in a run's recorded config (flattened), what it did before the key existed, else `default`."""
    return then[key] if key in then else BEFORE_THE_KEY.get(key, default)


def help_text(defaults, method, schema):
    """Every key with its default, and, from the models, what it may be and what it does."""
    script = f"train_{method}.py" if schema is not None else f"tools/{method}.py"
    out = [f"usage: python {script} [--config FILE.json] [--section.key=value ...] [--print_config]",
           f"       accelerate launch {script} --config configs/cc12m.json --resume latest" * (schema is not None), "",
           "Every config key: its default, [what it may be] and what it does. A recipe (--config) and --key=value",
           "override the defaults; values parse as JSON (--train.lr=3e-4, --data.label_column=null, "
           "--conditioning.controls='[\"size\"]').", ""]
    specs, section = dict(fields(schema)) if schema is not None else {}, None
    for key, value in flatten(defaults).items():
        if "." in key and key.split(".")[0] != section:
            section = key.split(".")[0]
            about = schema.model_fields[section].description if schema is not None else None
            out.append(f"{section}:" + (f"  ({about})" if about else ""))
        spec = specs.get(key)
        out.append(f"  --{key}={json.dumps(value)}"
                   + (f"  [{allowed(spec)}]\n      {spec['description']}" if spec else ""))
    return "\n".join(out)


def flatten(cfg, prefix=""):
    """{"data.source": ..., ...}: every leaf of a nested config under its dotted name."""
    out = {}
    for key, value in cfg.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out
