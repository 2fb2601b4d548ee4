"""A CLIP made here for a recipe (tools/clip.py): its tokenizer, built offline with `tokenizers` on the training
captions alone; a transformers CLIPModel small enough for a CPU; its contrastive training on the training pairs;
and image -> caption retrieval, the ceiling a generated image is read against. Saved with save_pretrained beside
its tokenizer and image processor, so that `encoders.text_encoder=FOLDER` loads its text tower through the code
that loads openai/clip-vit-large-patch14 (encoders.load_encoders: CLIPTextModel, AutoTokenizer) and gives the
pooled vector and token features as that model gives them.

The tokenizer is OpenAI's in form: lowercased, whitespace collapsed, <|startoftext|> caption <|endoftext|>, padded
with <|endoftext|>, truncated to the context with the end token kept last. Its model is a byte-level BPE (GPT-2's
bytes, so any caption, emoji names with accents included, encodes without an unknown token, and an unseen word
falls back to sub-words and bytes). CLIPTextTransformer pools the hidden state at the first token equal to
config.eos_token_id, except for the legacy value 2, where it takes the argmax of the ids (right only for OpenAI's
vocabulary, where <|endoftext|> is the highest id): the special tokens here are ids 0 and 1, and the config is
written with the tokenizer's own ids. The text tower is causal, so the pooled vector never sees the padding.
"""
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import common
from training.data.latents import to_pixels

RECORD = "clip.json"  # beside a CLIP made here: its settings, data and retrieval on the test split
BOS, EOS = "<|startoftext|>", "<|endoftext|>"  # OpenAI's names; here ids 0 and 1 (never the legacy 2)

# ----------------------------------------------------------------------------------------------------------
# The tokenizer: a byte-level BPE trained on the training captions, wrapped as a transformers fast tokenizer.


def build_tokenizer(captions, vocab_size, context):
    """A PreTrainedTokenizerFast trained on `captions` (the training split's only): NFC, whitespace runs -> one
    space, stripped, lowercased; byte-level BPE of at most `vocab_size` tokens (merges seen at least twice);
    BOS caption EOS, padded with EOS; `context` tokens at most (model_max_length)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Strip(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(captions, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A {EOS}", special_tokens=[
        (BOS, tok.token_to_id(BOS)), (EOS, tok.token_to_id(EOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   model_max_length=context)


def save_tokenizer(tokenizer, folder):
    """save_pretrained, with tokenizer_class written as PreTrainedTokenizerFast (transformers 5 writes its new
    name, TokenizersBackend, which transformers 4 cannot load; 5 reads the old one as the same class)."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))


def tokenize(tokenizer, captions, context):
    """(input_ids, attention_mask) of `captions`, padded to the longest and truncated to `context` tokens."""
    tok = tokenizer(list(captions), padding=True, truncation=True, max_length=context, return_tensors="pt")
    return tok.input_ids, tok.attention_mask


def token_count(tokenizer, captions):
    """Tokens of each caption, start and end included (untruncated)."""
    return [len(ids) for ids in tokenizer(list(captions), truncation=False).input_ids]

# ----------------------------------------------------------------------------------------------------------
# The model: a CLIPModel whose towers are a small ViT and a small causal text transformer.


def build(tokenizer, resolution, patch_size, width, layers, context, seed=0):
    """A CLIPModel: a ViT on `resolution` px RGB in `patch_size` patches and a text transformer over `context`
    positions, both `width` wide (heads of 64, MLP 4x) and `layers` deep, projected to `width`; the text config
    carries the tokenizer's start, end and pad ids (the end id picks the pooled token)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    tower = {"hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": layers,
             "num_attention_heads": max(1, width // 64)}
    config = CLIPConfig(text_config={**tower, "vocab_size": len(tokenizer), "max_position_embeddings": context,
                                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                                     "pad_token_id": tokenizer.pad_token_id},
                        vision_config={**tower, "image_size": resolution, "patch_size": patch_size},
                        projection_dim=width)
    return CLIPModel(config)


def image_processor(resolution):
    """The image processor saved beside the model (eval_fid.py's CLIP score reads it): RGB, bicubic resize of the
    short side to `resolution`, centre crop, pixels to [-1, 1] (mean = std = 0.5): what preprocess gives the
    trainers at data.resolution with data.crop=center."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": resolution}, crop_size={"height": resolution, "width": resolution},
                              image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def image_embeddings(model, pixels):
    """L2-normalised projected image embeddings of pixels in [-1, 1] (N, 3, R, R)."""
    return F.normalize(model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output), dim=-1)


def text_embeddings(model, input_ids, attention_mask):
    """L2-normalised projected text embeddings: the text tower's pooled vector (the end token's state)."""
    pooled = model.text_model(input_ids=input_ids, attention_mask=attention_mask).pooler_output
    return F.normalize(model.text_projection(pooled), dim=-1)

# ----------------------------------------------------------------------------------------------------------
# Contrastive training on the training pairs (Radford et al. 2021, fig. 3), captions repeated across images.


def contrastive_loss(image_emb, text_emb, caption_of, logit_scale):
    """CLIP's symmetric cross-entropy for a batch whose images `caption_of` name their rows of `text_emb` (the
    batch's distinct captions, each once: a caption two images share is no negative of either). Image -> text:
    the right caption among the batch's; text -> image: the images with that caption share the target evenly."""
    logits = logit_scale.exp() * image_emb @ text_emb.T  # (images, distinct captions)
    positives = (caption_of[None, :] == torch.arange(len(text_emb), device=logits.device)[:, None]).float()
    to_text = F.cross_entropy(logits, caption_of)
    to_image = -(positives / positives.sum(1, keepdim=True) * logits.T.log_softmax(1)).sum(1).mean()
    return (to_text + to_image) / 2


def train(model, images, caption_ids, tokens, epochs, batch_size=64, lr=1e-3, seed=0,
          log=lambda line: print(line, flush=True)):
    """`epochs` passes of AdamW (betas 0.9 / 0.98, weight decay 0.1 on matrices; CLIP's) over the pairs (uint8
    images (N, R, R, 3), `caption_ids` (N,) into `tokens` = (input_ids, attention_mask) of the distinct captions),
    LR warmed up linearly over 5% of the steps then cosine to 0, the temperature clamped at 100 (CLIP's). Progress:
    a bar with its ETA on a terminal, else a plain line at every twentieth of the way with the loss and the ETA.
    Returns the last interval's mean loss."""
    g, per_epoch = torch.Generator().manual_seed(seed), max(math.ceil(len(images) / batch_size), 1)
    steps, warmup = epochs * per_epoch, max(1, round(0.05 * epochs * per_epoch))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.98), eps=1e-6)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * max(0, s + 1 - warmup) / max(1, steps - warmup)))))
    marks, total, count, last, start = {math.ceil(steps * k / 20) for k in range(1, 21)}, 0.0, 0, None, time.time()
    bar = tqdm(total=steps, desc="clip", disable=not common.interactive())
    model.train()
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(len(images), generator=g)
        rows = order[(step % per_epoch) * batch_size:][:batch_size]
        captions, caption_of = torch.unique(caption_ids[rows], return_inverse=True)
        input_ids, mask = tokens[0][captions], tokens[1][captions]
        length = int(mask.sum(1).max())  # the batch's longest caption: causal, so the rest is never seen
        loss = contrastive_loss(image_embeddings(model, to_pixels(images[rows.numpy()])),
                                text_embeddings(model, input_ids[:, :length], mask[:, :length]), caption_of,
                                model.logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            model.logit_scale.clamp_(max=math.log(100))
        total, count = total + loss.item(), count + 1
        bar.update(1), bar.set_postfix(loss=f"{total / count:.4f}", refresh=False)
        if step + 1 in marks:
            last, eta = total / count, (time.time() - start) * (steps - step - 1) / (step + 1)
            if bar.disable:
                log(f"clip: step {step + 1}/{steps} (epoch {step // per_epoch + 1}/{epochs}), loss {last:.4f}, "
                    f"temperature 1/{model.logit_scale.exp().item():.1f}, {time.time() - start:.0f} s, ETA {eta:.0f} s")
            total, count = 0.0, 0
    bar.close()
    model.eval()
    return last

# ----------------------------------------------------------------------------------------------------------
# Retrieval: each image against every distinct caption of its split.


def caption_index(captions):
    """(the distinct captions, sorted, each once however many images share it; the index of each of `captions`
    among them)."""
    distinct = sorted(set(captions))
    index = {c: i for i, c in enumerate(distinct)}
    return distinct, torch.tensor([index[c] for c in captions])


def caption_ranks(image, text, own):
    """How many captions score above each image's own: image embeddings (N, D) and the distinct captions' (C, D),
    both L2-normalised, ranked by cosine; `own` (N,) its caption's index among them. 0: ranked first; a tie counts
    for the image."""
    scores = image @ text.T
    return (scores > scores.gather(1, own[:, None])).sum(1)


def retrieval_summary(ranks, captions):
    """{images, captions, top1, top5, chance_top1, chance_top5} of the ranks of images among `captions` distinct
    captions: top-k is the fraction whose own caption ranks within the first k."""
    ranks = torch.as_tensor(ranks)
    return {"images": len(ranks), "captions": captions, "top1": (ranks < 1).float().mean().item(),
            "top5": (ranks < 5).float().mean().item(), "chance_top1": 1 / captions,
            "chance_top5": min(5, captions) / captions}


@torch.no_grad()
def retrieval(model, tokenizer, images, captions, context, batch_size=500):
    """Image -> caption retrieval: each uint8 image (N, R, R, 3) ranks the distinct captions of `captions` (its
    own and every other, each once however many images share it) by cosine; top-1 and top-5 are the fractions
    whose own caption ranks first and within the first five. Chance: 1 / and 5 / the number of captions.
    eval_fid.py ranks generated images the same way (caption_index, caption_ranks)."""
    distinct, own = caption_index(captions)
    text = torch.cat([text_embeddings(model, *tokenize(tokenizer, distinct[i:i + batch_size], context))
                      for i in range(0, len(distinct), batch_size)])
    image = torch.cat([image_embeddings(model, to_pixels(images[i:i + batch_size]))
                       for i in range(0, len(images), batch_size)])
    return retrieval_summary(caption_ranks(image, text, own), len(distinct))
