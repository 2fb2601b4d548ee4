"""The Hugging Face Hub: pushing an exported pipeline folder (push_to_hub), and reading one back by its hub id
(eval_fid.py, sample.py and init_from take a folder or a hub id alike).

A push is checked before any work (problems: a malformed repo name, offline, no token), so a run or a post-hoc
EMA export never finishes only to fail at the upload. The repository is created private; make it public on
the Hub once the card reads right.
"""
import difflib
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import HFValidationError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # owner/name, as the Hub spells repositories


def problems(cfg):
    """push_to_hub's start-up check (handed to the config loader by the trainers: sections.schema)."""
    return push_problems(cfg.get("push_to_hub"))


def push_problems(repo, key="push_to_hub"):
    """The reasons `repo` cannot be pushed to from here, one line each (none: it can); nothing is sent."""
    if not repo:
        return []
    if not isinstance(repo, str) or not REPO_ID.fullmatch(repo):
        return [f"{key}={repo!r} is not a Hub repository name: give owner/name (letters, digits, '-', '_', '.'), "
                f"e.g. my-user/flow-matching-demo"]
    try:
        huggingface_hub.utils.validate_repo_id(repo)
    except HFValidationError as e:
        return [f"{key}={repo!r} is not a Hub repository name: {str(e).splitlines()[0]}"]
    if constants.HF_HUB_OFFLINE:
        return [f"{key}={repo}: HF_HUB_OFFLINE is set, so the Hub cannot be reached: unset it on a machine with "
                f"network, or export without {key} and push the folder later with tools/export.py"]
    if not huggingface_hub.get_token():
        return [f"{key}={repo}: no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write access)"]
    return []


def push(folder, repo, message="minimal-diffusion export"):
    """Upload `folder` to the model repository `repo`, created private if it does not exist; returns its URL."""
    api = huggingface_hub.HfApi()
    api.create_repo(repo, repo_type="model", private=True, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model", commit_message=message)
    return f"{constants.ENDPOINT}/{repo}"


def local_folder(source):
    """A local folder as given; a hub id (owner/name that is no local path) as its snapshot in the Hugging Face
    cache, downloaded if need be (offline: the cache alone). A path that does not exist is refused here, in one
    line and before the Hub is asked, where it can only be a local one: not owner/name, starting with '.', '/' or
    '~', or with a first part that is a folder here (runs/flow_matcing_demo beside runs/: a mistyped run, not a
    Hub model); the line names the nearest folders that do exist."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    text = str(source)
    first = text.split("/")[0]
    local = not REPO_ID.fullmatch(text) or text.startswith((".", "/", "~"))
    shadowed = not local and Path(first).expanduser().is_dir()  # owner/name in form, but owner is a folder here
    if local or shadowed:
        parent = next(p for p in path.parents if p.is_dir())  # '.' at worst
        missing = path.relative_to(parent).parts[0]
        near = difflib.get_close_matches(missing, [p.name for p in parent.iterdir() if p.is_dir()], n=3)
        why = f" (read as a local path, not a Hub model id: {first}/ is a folder here)" if shadowed else ""
        hint = f"; did you mean {' or '.join(str(parent / n) for n in near)}?" if near else \
            f"; {parent} holds no folder {missing!r}"
        raise FileNotFoundError(f"{source}: no such folder{why}{hint}")
    try:
        return Path(huggingface_hub.snapshot_download(text, repo_type="model"))
    except Exception as e:  # offline and not cached, unknown, gated: one line, not a traceback of the hub client
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(f"{source}: no such folder, and no Hub model of that name can be read{offline}: "
                                f"{why}") from None
