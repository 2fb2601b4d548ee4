"""Fetch everything a config needs into the Hugging Face cache, on a machine with network, for nodes without.

    python tools/prefetch.py --config configs/cc12m.json                   # fetch, then say what to copy and set
    python tools/prefetch.py --config configs/cc12m.json --dry_run         # only the plan: what would be fetched
    python tools/prefetch.py --config configs/own_data_256.json --data.source=/data/pets   # overrides as in training
    python tools/prefetch.py --config configs/imagenet256.json --dino                  # and DINOv2 for FD-DINOv2

A config needs: its dataset (data.source, the split and the held-out split), the VAE (encoders.vae), the text
encoder and tokenizer (encoders.text_encoder; of an SD3-family pipeline, those encoders.sd3_text_encoders names), an
SD3-family init_from's transformer/ (configs/sd35_lora_own_data.json), the CLIP model of eval_fid.py's CLIP score
for text-to-image runs, the Inception network of FID, and the DINOv2 model of FD-DINOv2 when asked (--dino [MODEL],
default facebook/dinov2-base, for eval_fid.py --dino; or val.fid_dino in the config). Each is fetched through the
very call that training or evaluation makes (data.open_dataset, encoders.load_encoders, metrics.clip_scores,
metrics.dinov2_features), so the offline node finds exactly the files it will ask for. Then copy the cache folder to
storage the nodes see and run with HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 (launch/slurm.sbatch sets both). Local
folders (an imagefolder, a model saved with save_pretrained) are not fetched: they must be at the same path on the
nodes.

Gated datasets and models (ILSVRC/imagenet-1k, for one) need their terms accepted on the dataset's hub page
and a login (`hf auth login`, or HF_TOKEN) on this machine first; prefetch says so when it meets one.
"""
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the trainers and the package

from training.config import config  # noqa: E402
from training.data import encoders, repa_targets, sd3_base, sources  # noqa: E402
from training.evaluation import metrics, reference  # noqa: E402
import train_ddpm  # noqa: E402
import train_flow_matching  # noqa: E402


def all_defaults(a, b):
    """The union of both trainers' DEFAULTS, so that any key either trainer accepts can be overridden here."""
    out = dict(a)
    for key, value in b.items():
        out[key] = all_defaults(a[key], value) if isinstance(value, dict) and key in a else a.get(key, value)
    return out


def plan(cfg, dino=None):
    """What the config needs: one dict per item with the config key that names it, the name, what it is, the
    split (datasets) and whether it is a local path, which is not fetched but must be copied to the nodes."""
    d, enc = cfg.data, cfg.encoders
    items = []
    if d.source != "embedded":
        items += [{"key": "data.source", "name": d.source, "what": f"dataset, split '{split}'", "split": split}
                  for split in [d.split] + ([d.val_split] if d.val_split else [])]
    items += [{"key": f"encoders.{key}", "name": enc[key], "what": what}
              for key, what in (("vae", "VAE"), ("text_encoder", "text encoder and tokenizer")) if enc[key]]
    if sd3_base.is_base(cfg.init_from):  # a pretrained SD3-family pipeline: its transformer/ (the rest: encoders.*)
        items.append({"key": "init_from", "name": cfg.init_from, "what": "SD3-family base's transformer"})
    if cfg.objective.get("repa_weight"):
        items.append({"key": "objective.repa_encoder", "name": cfg.objective.repa_encoder, "what": "REPA's encoder"})
    if d.caption_column or d.label_captions:
        items.append({"key": "eval_fid.py --clip_model", "name": metrics.CLIP_DEFAULT,
                      "what": "CLIP model of the CLIP score"})
    for name in dict.fromkeys(d for d in (cfg.val.fid_dino, dino) if d):
        items.append({"key": "eval_fid.py --dino", "name": name, "what": "DINOv2 model of FD-DINOv2"})
    for item in items:
        item["local"] = Path(item["name"]).exists()
    local = cfg.val.inception_weights and Path(cfg.val.inception_weights).is_file()
    items.append({"key": "val.inception_weights", "what": "Inception network of FID", "local": bool(local),
                  "name": cfg.val.inception_weights if local else reference.INCEPTION_URL})
    return items


def fetch(item, cfg, inception_file):
    """Fetch one item through the call that training or evaluation makes; returns what it got, in words."""
    key, name = item["key"], item["name"]
    if key == "data.source" and sources.is_stream(cfg.data):  # nothing to download: shards stream at cache time
        shards = sources.open_stream(cfg.data, item["split"]).num_shards
        return f"streamed, {shards} shards (read when the cache is built)"
    if key == "data.source":
        return f"{len(sources.open_dataset(cfg.data, item['split'])):,} rows"  # downloaded and prepared
    if key.startswith("encoders."):
        only = config.Config({"vae": None, "text_encoder": None, "max_tokens": cfg.encoders.max_tokens,
                              "sd3_text_encoders": cfg.encoders.get("sd3_text_encoders")})  # an SD3 base's subset
        only[key.split(".")[1]] = name
        encoders.load_encoders(only, "cpu")
        return "loaded"
    if key == "init_from":  # the transformer's files alone, into the cache from_pretrained reads
        import huggingface_hub

        huggingface_hub.snapshot_download(name, allow_patterns=["model_index.json", "transformer/*"])
        return "downloaded"
    if key == "objective.repa_encoder":
        repa_targets.load_encoder(name, "cpu")  # the model and its image processor, as training loads them
        return "loaded"
    if key == "eval_fid.py --clip_model":
        from PIL import Image

        metrics.clip_scores(name, [Image.new("RGB", (32, 32))], ["a photo"], "cpu")  # model and processors
        return "loaded"
    if key == "eval_fid.py --dino":
        metrics.dinov2_features(name, "cpu")  # the model and its image processor
        return "loaded"
    if not inception_file.is_file():  # written whole or not at all
        part = inception_file.with_suffix(".part")
        with urllib.request.urlopen(name, timeout=60) as response:
            part.write_bytes(response.read())
        part.replace(inception_file)
    return str(inception_file)


def folder_size(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and not f.is_symlink())


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry_run" in argv
    argv = [a for a in argv if a != "--dry_run"]
    dino = None  # --dino (the default model) or --dino MODEL / --dino=MODEL
    for i, a in enumerate(argv):
        if a == "--dino" or a.startswith("--dino="):
            value = a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--")
                                            else None)
            dino = value or metrics.DINO_DEFAULT
            argv = argv[:i] + argv[i + 1 + (a == "--dino" and value is not None):]
            break
    cfg = config.load_config(all_defaults(train_flow_matching.DEFAULTS, train_ddpm.DEFAULTS), argv, "prefetch")
    from huggingface_hub import constants

    hf_home = Path(constants.HF_HOME)
    inception_file = hf_home / reference.INCEPTION_FILE
    items = plan(cfg, dino)
    print(f"The config needs ({'plan only' if dry_run else 'fetching into ' + str(hf_home)}):")
    for item in items:
        how = "local: the nodes must see this path" if item["local"] else "fetch"
        print(f"  {item['key']:26} {item['name']}  ({item['what']}; {how})")
    if dry_run:
        return items
    if constants.HF_HUB_OFFLINE:
        sys.exit("HF_HUB_OFFLINE is set: prefetch needs the network. Unset it (and HF_DATASETS_OFFLINE) here.")
    hf_home.mkdir(parents=True, exist_ok=True)
    failed = []
    for item in (item for item in items if not item["local"]):
        start = time.time()
        try:
            print(f"{item['key']}: {fetch(item, cfg, inception_file)} ({time.time() - start:.0f} s)")
        except (Exception, SystemExit) as e:  # report each failure, carry on, stop with an error at the end
            text = str(e).strip()
            message = text.splitlines()[0] if text else type(e).__name__
            if any(word in text.lower() for word in ("gated", "401 client error", "403 client error")):
                message += (f" -- {item['name']} looks gated: accept its terms on its hub page "
                            f"(https://huggingface.co/datasets/{item['name']} for a dataset) and log in here "
                            "(`hf auth login`, or HF_TOKEN)")
            print(f"{item['key']}: FAILED: {message}")
            failed.append(item["key"] + (f" (split {item['split']})" if "split" in item else ""))
    import datasets

    folders = [hf_home] + [Path(f) for f in (constants.HF_HUB_CACHE, datasets.config.HF_DATASETS_CACHE)
                           if not Path(f).is_relative_to(hf_home)]  # HF_HUB_CACHE / HF_DATASETS_CACHE set apart
    sizes = ", ".join(f"{f} ({folder_size(f) / 1e9:.1f} GB)" for f in folders)
    print(f"\nCopy {sizes} to storage every node sees, then on the nodes:\n"
          f"    export HF_HOME=/path/to/the/copy HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1\n"
          f"and pass the Inception file: --val.inception_weights=$HF_HOME/{reference.INCEPTION_FILE} to a trainer "
          f"(for val.fid_every), --inception_weights $HF_HOME/{reference.INCEPTION_FILE} to eval_fid.py.")
    local = [f"{item['key']}={item['name']}" for item in items if item["local"]]
    if local:
        print("Not fetched, local paths the nodes must see at the same place: " + ", ".join(local))
    if failed:
        sys.exit(f"prefetch: {len(failed)} of {len(items)} failed: {', '.join(failed)}")
    return items


if __name__ == "__main__":
    main()
