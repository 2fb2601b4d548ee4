"""Feeds docs/benchmarks.md, "Numbers kept in other docs": docs/data.md.

How fast is the cache built from local webdataset shards, and how big is it? (docs/data.md)

    python benchmarks/cache_throughput.py [--shards 8] [--per_shard 64] [--workers 0 2 4]

1. Throughput: images/s of build_cache from local tar shards of JPEGs (512 x 384, like CC12M's) with
   data.num_workers = 0, 2, 4: decoding and cropping in DataLoader workers while a small randomly initialised
   AutoencoderKL and a tiny CLIP text encoder encode in the main process, at 64 px.
2. Bytes per sample with and without cached text features (data.cache_text), measured by encoding.cache_size at
   the recipes' real shapes (SD VAE at 256 / 512 px, CLIP-L: randomly initialised, the shapes are what count),
   and the cache sizes of the CC12M and ImageNet recipes.
3. The extra step cost of encoding text on the fly (cache_text=false): CLIP-L's forward FLOPs per sample as a
   share of the recipe's MMDiT training step (forward + backward) FLOPs, counted by torch.utils.flop_counter
   on the meta device (no memory, no time).
"""
import argparse
import io
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.config import config  # noqa: E402
import train_flow_matching as fm  # noqa: E402
from training.data.cache import build_cache  # noqa: E402
from training.data.cache_shards import CachedDataset  # noqa: E402
from training.data.encoders import make_encode  # noqa: E402
from training.data.encoding import cache_size, human_bytes  # noqa: E402
from training.data.sources import open_splits  # noqa: E402
from training.model.mmdit import build_denoiser  # noqa: E402

WORDS = ["a", "photo", "of", "the", "red", "green", "blue", "dog", "cat", "house", "tree", "on", "in", "street"]
RECIPE_SAMPLES = {"CC12M": 12_423_374, "ImageNet-1k": 1_281_167, "ImageNet-22k": 14_197_122}


def write_shards(folder, shards, per_shard):
    rng = np.random.default_rng(0)
    for s in range(shards):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for i in range(per_shard):
                # Smooth random images (not noise) so the JPEGs are of a photo's size and decoding cost.
                small = rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(small).resize((512, 384), Image.BICUBIC).save(buf, "JPEG", quality=90)
                for ext, payload in (("jpg", buf.getvalue()), ("txt", " ".join(rng.choice(WORDS, 8)).encode())):
                    info = tarfile.TarInfo(f"{s:05d}{i:04d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return str(folder / f"{{00000..{shards - 1:05d}}}.tar")


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]",
                                                       special_tokens=[("[BOS]", 2), ("[EOS]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def clip_text(hidden, layers, heads, intermediate, vocab=49408):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
                            pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return CLIPTextModel(config).eval()


def sd_vae(small=False):
    from diffusers import AutoencoderKL

    if small:
        return AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                             layers_per_block=1).eval()
    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, layers_per_block=2,
                         scaling_factor=0.18215).eval()  # stabilityai/sd-vae-ft-ema's architecture


class OneProcess:
    process_index, num_processes, is_main_process, is_local_main_process = 0, 1, True, True

    def print(self, *args):
        pass

    def wait_for_everyone(self):
        pass


def throughput(pattern, workers, tmp):
    torch.manual_seed(0)
    encode = make_encode(sd_vae(small=True), word_tokenizer(), clip_text(64, 2, 2, 128, vocab=32), 16)
    rates = {}
    for w in workers:
        cfg = config.load_config(fm.DEFAULTS, [
            "--data.source", pattern, "--data.cache_dir", f"{tmp}/cache_{w}", "--data.image_column=jpg",
            "--data.caption_column=txt", "--data.label_column=null", "--data.val_shards=[-1,null]",
            "--data.resolution=64", "--data.crop=random_resized", "--data.encode_batch_size=32",
            f"--data.num_workers={w}", "--encoders.max_tokens=16"])
        train, _ = open_splits(cfg.data)
        start = time.perf_counter()
        folder = build_cache(train, "train", encode, OneProcess(), cfg)
        seconds = time.perf_counter() - start
        rows, n = sum(1 for _ in folder.glob("shard_*")), len(CachedDataset(folder))
        rates[w] = n / seconds
        print(f"  data.num_workers={w}: {n} images in {seconds:.1f} s = {rates[w]:.1f} images/s ({rows} shards)")
    return rates


def recipe_bytes():
    """Bytes per sample of the recipes' caches, text cached or not, by cache_size at the real shapes."""
    vae, clip_l = sd_vae(), clip_text(768, 12, 12, 3072)
    tok = word_tokenizer()
    out = {}
    for res in (256, 512):
        cfg = config.load_config(fm.DEFAULTS, ["--data.resolution", str(res), "--data.label_column=null",
                                               "--data.caption_column=txt"])
        for text, name in (("features", "text features cached"), ("tokens", "token ids cached")):
            out[(res, name)] = cache_size(make_encode(vae, tok, clip_l, 77), cfg.data, text, [1])[0]
        cfg = config.load_config(fm.DEFAULTS, ["--data.resolution", str(res)])  # class labels, no text
        out[(res, "class labels")] = cache_size(make_encode(vae, None, None, 77), cfg.data, "features", [1])[0]
    return out


def flops(fn):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def text_share():
    """CLIP-L forward FLOPs per sample / the cc12m recipe's MMDiT training-step FLOPs per sample."""
    cfg = config.load_config(fm.DEFAULTS, ["--config", str(Path(__file__).resolve().parents[1] / "configs/cc12m.json")])
    shares = {}
    clip_l, ids = clip_text(768, 12, 12, 3072), torch.zeros(1, 77, dtype=torch.long)  # on the CPU: it calls .item()
    with torch.no_grad():
        text = flops(lambda: clip_l(input_ids=ids, attention_mask=torch.ones(1, 77, dtype=torch.long)))
    with torch.device("meta"):
        for res in (256, 512):
            model = build_denoiser(cfg, 4, res // 8, (77, 768, 768))
            x, cond = torch.zeros(1, 4, res // 8, res // 8), {
                "text_tokens": torch.zeros(1, 77, 768), "text_mask": torch.ones(1, 77),
                "text_pooled": torch.zeros(1, 768), "orig_hw": torch.zeros(1, 2), "crop_box": torch.zeros(1, 4),
                "flip": torch.zeros(1, 1), "drop": torch.zeros(1, dtype=torch.bool),
                "drop_controls": torch.zeros(1, dtype=torch.bool)}
            step = flops(lambda: model(x, torch.zeros(1), cond).float().pow(2).mean().backward())
            shares[res] = (text, step)
    return shares


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per_shard", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        pattern = write_shards(Path(tmp), args.shards + 1, args.per_shard)  # the last shard is held out
        print(f"1. cache building, {args.shards} shards x {args.per_shard} JPEGs (512x384) -> 64 px, "
              "small VAE, tiny CLIP:")
        throughput(pattern, args.workers, tmp)
    print("2. bytes per sample (SD VAE latents mean + std, fp16; CLIP-L 77 tokens; controls):")
    per_sample = recipe_bytes()
    for (res, what), n in per_sample.items():
        print(f"  {res} px, {what}: {n} bytes")
    for name, n in RECIPE_SAMPLES.items():  # ImageNet-22k also as captions (class names, imagenet22k_captions)
        kinds = {"CC12M": [], "ImageNet-1k": ["class labels"]}.get(name, ["class labels"])
        kinds += ["text features cached", "token ids cached"] if name != "ImageNet-1k" else []
        print(f"  {name} ({n} samples): " + "; ".join(
            f"{kind} {human_bytes(n * per_sample[(res, kind)])} at {res} px" for kind in kinds for res in (256, 512)))
    print("3. on-the-fly text encoding (CLIP-L forward) vs the cc12m MMDiT training step (forward + backward):")
    for res, (text, step) in text_share().items():
        print(f"  {res} px: CLIP-L {text / 1e9:.1f} GFLOP/sample, MMDiT step {step / 1e9:.1f} GFLOP/sample, "
              f"share {text / step:.1%} of the step ({text / (text + step):.1%} of the total)")
