"""A VAE's latent space at both ends of a run: the autoencoder made here for a recipe (tools/autoencoder.py: its
size, its training on the recipe's training images, the calibration of its scaling and shift factors), and the
start-up check of any VAE's factors on the latents as the cache holds them (the trainers, once the cache is built
or opened).

Both rest on one measurement: the mean and std of the latents a model trains on. The cache keeps each image's
posterior mean and std, and training draws z = mean + std n (batching.training_inputs), so over the draws
E[z] = E[mean] and Var[z] = Var[mean] + E[std^2]: exact from the cached moments, no draw needed (moments).

The model space is x = (z - shift_factor) * scaling_factor (encoders.make_encode), and the noise it is mixed with
is N(0, I): x should have mean about 0 and std about 1, or the schedule's signal-to-noise ratios are not the ones
it was designed for. LDM (Rombach et al. 2022, sec. 4.3.2 and app. G) scales its KL latents by 1 / std of the
training latents (SD 1.x: 0.18215); SD3's VAE (Esser et al. 2024) also subtracts their mean (shift 0.0609, scale
1.5305). A forgotten shift factor (SD3 / Flux VAEs) or an uncalibrated home-made VAE trains without an error and
samples worse: check_scale stops such a run at start-up, naming the factors that fix it.
"""
import itertools
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import common

RECORD = "autoencoder.json"  # beside an autoencoder made here: how, its factors, its reconstruction quality
LIMITS = (0.5, (0.5, 2.0))  # |mean| at most, std within: about zero mean and unit std
SHARDS = 4  # the cache shards the start-up check reads (4,096 images at the default data.shard_size)

# ----------------------------------------------------------------------------------------------------------
# The measurement: the moments of the posterior's draws.


def moments(mean, std):
    """(mean, std) of the draws z = mean + std n over every element of the posterior moments `mean` and `std`
    (tensors of one shape), in float64: E[z] = E[mean], Var[z] = Var[mean] + E[std^2]."""
    m, s = mean.double(), std.double()
    return m.mean().item(), math.sqrt(m.var(correction=0).item() + s.pow(2).mean().item())


def fixing_factors(mu, sigma, scale, shift):
    """(scaling_factor, shift_factor) that bring latents measured at (mu, sigma) in model space under the factors
    (scale, shift) to mean 0 and std 1: the raw latents z = x / scale + shift have mean mu / scale + shift and
    std sigma / scale."""
    return scale / sigma, shift + mu / scale


def check_scale(dataset, vae, encoders, log=print):
    """The start-up check of a latent run: the mean and std of the training latents in the first SHARDS shards of
    the cache `dataset` (a CachedDataset), printed; far from 0 and 1 (LIMITS) the run stops, or, with
    encoders.latent_check="warn", goes on after the same line as a warning. The line names scaling_factor and
    shift_factor and the values that give mean 0 and std 1. Pixel runs (no VAE) pass unchecked."""
    if vae is None or "x_std" not in dataset.keys:
        return None
    # the first SHARDS non-empty parts (a part: a shard file, or one bucket's rows in it), mapping no more files
    shards = list(itertools.islice((t for t in map(dataset.tensors, range(len(dataset.parts))) if t), SHARDS))
    mu, sigma = moments(*(torch.cat([t[name].flatten() for t in shards]) for name in ("x", "x_std")))
    rows = sum(len(t["x"]) for t in shards)
    log(f"latents (encoders.vae={encoders.vae!r}): mean {mu:.3f}, std {sigma:.3f} over {rows} cached training images")
    if abs(mu) <= LIMITS[0] and LIMITS[1][0] <= sigma <= LIMITS[1][1]:
        return mu, sigma
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor
    new_scale, new_shift = fixing_factors(mu, sigma, scale, shift or 0.0)
    where = (f"{encoders.vae}/config.json" if Path(encoders.vae).is_dir() else
             "a local copy of its config.json (then encoders.vae=that folder)")
    line = (f"encoders.vae={encoders.vae!r}: the cached latents have mean {mu:.3f} and std {sigma:.3f}, not about 0 "
            f"and 1 (|mean| <= {LIMITS[0]}, std in {list(LIMITS[1])}), the noise's scale: set scaling_factor="
            f"{new_scale:.6g} and shift_factor={new_shift:.6g} in {where} (now {scale:g} and {shift}), the values "
            f"that make them 0 and 1 (the cache is encoded again)")
    if encoders.latent_check == "warn":
        log(f"warning: {line}; encoders.latent_check='warn': training on them as they are")
        return mu, sigma
    raise SystemExit(f"{line}; or encoders.latent_check='warn' to train on them as they are")


# ----------------------------------------------------------------------------------------------------------
# The autoencoder made here: diffusers' AutoencoderKL, so that encoders.vae=FOLDER loads it as it loads a hub VAE.


def build(resolution, channels, latent_channels=4, seed=0):
    """An AutoencoderKL for `resolution` px RGB images: one level per entry of `channels` (its width), each level
    but the last halving the side (factor 2^(levels - 1)), one ResNet block a level, `latent_channels` channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    levels = len(channels)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, sample_size=resolution,
                         block_out_channels=tuple(channels), down_block_types=("DownEncoderBlock2D",) * levels,
                         up_block_types=("UpDecoderBlock2D",) * levels, layers_per_block=1,
                         norm_num_groups=math.gcd(32, *channels))


def to_pixels(images, device="cpu"):
    """uint8 (N, H, W, 3) images -> the trainers' pixels: float (N, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1


def train(vae, images, steps, batch_size=128, lr=1e-3, kl_weight=1e-6, seed=0, log=print):
    """`steps` AdamW steps (a one-cycle LR, as the evaluation classifier's) on uint8 images (N, H, W, 3), each of
    a decoded posterior draw: loss = |x - D(z)| + kl_weight KL(q(z|x) || N(0, I)), both as sums over an image's
    pixels and latents, averaged over the batch: LDM's first stage without its perceptual and adversarial terms
    (Rombach et al. 2022, app. G; KL weight 1e-6). Progress: a bar with its ETA on a terminal, else a plain line
    at every twentieth of the way, with the losses and the ETA. Returns the last interval's mean losses."""
    g, per_epoch = torch.Generator().manual_seed(seed), max(len(images) // batch_size, 1)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.05)
    marks, sums = {math.ceil(steps * k / 20) for k in range(1, 21)}, torch.zeros(3, dtype=torch.float64)
    start = time.time()
    bar = tqdm(total=steps, desc="autoencoder", disable=not common.interactive())
    vae.train()
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(len(images), generator=g)
        x = to_pixels(images[order[(step % per_epoch) * batch_size:][:batch_size].numpy()])
        posterior = vae.encode(x).latent_dist
        reconstruction = vae.decode(posterior.sample(generator=g)).sample
        rec, kl = (reconstruction - x).abs().sum((1, 2, 3)).mean(), posterior.kl().mean()
        optimizer.zero_grad()
        (rec + kl_weight * kl).backward()
        optimizer.step()
        schedule.step()
        sums += torch.tensor([rec.item() / x[0].numel(), kl.item(), 1.0], dtype=torch.float64)
        bar.update(1), bar.set_postfix(l1=f"{sums[0] / sums[2]:.4f}", kl=f"{sums[1] / sums[2]:.0f}", refresh=False)
        if step + 1 in marks:
            last = {"l1_per_pixel": (sums[0] / sums[2]).item(), "kl_per_image": (sums[1] / sums[2]).item()}
            eta = (time.time() - start) * (steps - step - 1) / (step + 1)
            if bar.disable:  # flushed: a log file sees each line as it comes
                log(f"autoencoder: step {step + 1}/{steps}, L1 per pixel {last['l1_per_pixel']:.4f}, KL per image "
                    f"{last['kl_per_image']:.0f}, {time.time() - start:.0f} s, ETA {eta:.0f} s")
                sys.stdout.flush()
            sums.zero_()
    bar.close()
    return last


@torch.no_grad()
def calibrate(vae, images, batch_size=500):
    """Set the factors of `vae` from its latents of uint8 `images` (the training images): shift_factor = the mean
    and scaling_factor = 1 / the std of the posterior's draws (moments, accumulated over batches), written in its
    config, so save_pretrained stores them and make_encode applies them. Returns (mean, std) of the raw latents."""
    vae.eval()
    total = torch.zeros(4, dtype=torch.float64)  # elements, sum of means, of squared means, of variances
    for i in range(0, len(images), batch_size):
        posterior = vae.encode(to_pixels(images[i:i + batch_size])).latent_dist
        m = posterior.mean.double()
        total += torch.stack([torch.tensor(m.numel(), dtype=torch.float64), m.sum(), m.pow(2).sum(),
                              posterior.var.double().sum()])
    n, s1, s2, var = total.tolist()
    mu = s1 / n
    sigma = math.sqrt(s2 / n - mu * mu + var / n)
    vae.register_to_config(scaling_factor=1 / sigma, shift_factor=mu)
    return mu, sigma

