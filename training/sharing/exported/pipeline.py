"""The sampling pipeline of a model trained with minimal-diffusion: the pipeline.py of an exported folder, which
diffusers loads for custom pipelines (model_index.json names it). It imports nothing from the repository that
trained the model: torch, diffusers and (text models) transformers are all it needs.

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained("user/model", trust_remote_code=True)
    pipe("red circle", num_images_per_prompt=4).images        # a class name (or index, or id), or a prompt

Components: transformer (diffusers' SD3Transformer2DModel), conditioner (conditioner/conditioner.py: classes or
text tokens into attention, controls into the adaptive norm), scheduler (FlowMatchEulerDiscreteScheduler on the
run's shift for flow matching; DDIMScheduler or DDPMScheduler with the run's betas, zero terminal SNR and
prediction type for DDPM, stepped on the trainer's exact trailing grid at any step count); the VAE and the
text encoder with its tokenizer: components of the folder (vae/, text_encoder/, tokenizer/) where the run's were local
folders, else named by hub id in model_index.json (vae_id, text_encoder_id) and loaded from there, or passed to
from_pretrained. A run on a pretrained Stable Diffusion 3 / 3.5 pipeline names that pipeline: its VAE (vae_subfolder),
its text encoders (sd3_text_encoders: CLIP-L, CLIP-G and T5, or the CLIPs alone), encoded by diffusers' own
StableDiffusion3Pipeline.encode_prompt, and, for a LoRA export, its transformer (transformer_id), which
load_lora_weights then adapts. Every sampling setting defaults to the run's
(model_index.json), and this loop is the trainers' sampler step for step: guidance on the semantic and the
control condition, only inside the guidance interval, with DDPM's guidance rescale, so the same noise gives the
images the repository's sample.py gives. A MeanFlow model (sampler "meanflow": it predicts the average velocity u
over [r, t], Geng et al. 2025) steps z_r = z_t - (t - r) u(z_t, r, t) on the same grid, the interval t - r given
to its conditioner: one or two steps make an image.
"""
import math

import numpy as np
import PIL.Image
import torch
from diffusers import (AutoencoderKL, DDPMScheduler, DiffusionPipeline, FlowMatchEulerDiscreteScheduler,
                       ImagePipelineOutput)
from diffusers.loaders import SD3LoraLoaderMixin
from diffusers.utils.torch_utils import randn_tensor

X0_MIN_T = 0.05  # flow matching with x-prediction: the smallest t the velocity conversion divides by (JiT's)


def rescale_guidance(out, out_c, phi):
    """Guidance rescale (Lin et al. 2024, sec. 3.4): phi out std(out_c) / std(out) + (1 - phi) out, per sample."""
    if phi == 0:
        return out
    dims = list(range(1, out.dim()))
    return phi * out * (out_c.std(dim=dims, keepdim=True) / out.std(dim=dims, keepdim=True)) + (1 - phi) * out


def ddpm_noise_level(ab):
    """The flow-matching time of equal SNR (1 = pure noise): what the controls' w(t) and the interval read."""
    return (1 - ab) ** 0.5 / (ab ** 0.5 + (1 - ab) ** 0.5)


def shifted_schedule(alphas_cumprod, shift):
    """DDPM's resolution shift, SNR / a^2 (the run's objective.time_shift): ab / (ab + a^2 (1 - ab))."""
    return alphas_cumprod / (alphas_cumprod + shift ** 2 * (1 - alphas_cumprod))


def trailing_timesteps(num_train_timesteps, steps):
    """The trainer's grid (train_ddpm.timestep_grid): t_i = round(T - i T / steps) - 1, i = 0 .. steps-1, exactly.
    diffusers' timestep_spacing="trailing" takes a float arange, which differs at some counts (48, 61)."""
    return [round(num_train_timesteps * (steps - i) / steps) - 1 for i in range(steps)]


def trainer_schedule(config):
    """The trainer's alpha_bar in float64 (train_ddpm.make_schedule), from the scheduler's config. diffusers' own is
    float32, whose log-SNR near either end is off by enough that the shifted time input read from it moved samples
    by up to 4e-2 (7-61 steps, tests/test_export_pipeline.py); the time input is the trainer's, from this."""
    T, b0, b1 = config.num_train_timesteps, config.beta_start, config.beta_end
    if config.beta_schedule == "scaled_linear":  # the trainer's "quadratic"
        betas = torch.linspace(b0 ** 0.5, b1 ** 0.5, T, dtype=torch.float64) ** 2
    elif config.beta_schedule == "linear":
        betas = torch.linspace(b0, b1, T, dtype=torch.float64)
    else:  # "squaredcos_cap_v2": the trainer's "cosine" (Nichol & Dhariwal 2021)
        f = [math.cos((i / T + 0.008) / 1.008 * math.pi / 2) ** 2 for i in range(T + 1)]
        betas = torch.tensor([min(1 - f[i + 1] / f[i], 0.999) for i in range(T)], dtype=torch.float64)
    alphas_cumprod = torch.cumprod(1 - betas, dim=0)
    if config.rescale_betas_zero_snr:  # Lin et al. 2024, Algorithm 1
        s = alphas_cumprod.sqrt()
        alphas_cumprod = ((s - s[-1]) * s[0] / (s[0] - s[-1])) ** 2
    return alphas_cumprod


def time_input(alphas_cumprod, shift):
    """The timestep the MMDiT saw in training at each timestep of the shifted schedule: the unshifted schedule's
    fractional timestep with the same log-SNR (pure noise: the last one). shift = 1: 0 .. T-1."""
    base = alphas_cumprod.double()
    log_snr = base.log() - (-base).log1p()
    finite = log_snr[torch.isfinite(log_snr)]
    target = log_snr - 2 * math.log(shift)
    tau = np.interp(-target.numpy(), -finite.numpy(), np.arange(len(finite), dtype=np.float64))
    tau[np.isneginf(target.numpy())] = len(log_snr) - 1
    return torch.from_numpy(tau)


class MinimalDiffusionPipeline(DiffusionPipeline, SD3LoraLoaderMixin):
    """Class-conditional or text-to-image sampling from an MMDiT trained by minimal-diffusion. A LoRA run's
    export holds its base and pytorch_lora_weights.safetensors: load_lora_weights(folder) and set_adapters, as
    diffusers' StableDiffusion3Pipeline (whose LoRA loader this is)."""

    model_cpu_offload_seq = "text_encoder->text_encoder_2->text_encoder_3->conditioner->transformer->vae"
    text_encoder_2 = None  # SD3's second text encoder, which its LoRA loader reads: none but on an SD3 base
    _optional_components = ["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                            "text_encoder_3", "tokenizer_3"]

    def __init__(self, conditioner, scheduler, transformer=None, vae=None, text_encoder=None, tokenizer=None,
                 text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None, vae_id=None,
                 text_encoder_id=None, max_tokens=77, num_inference_steps=50, guidance_scale=1.0,
                 control_guidance_scale=0.0, guidance_interval=(0.0, 1.0), guidance_rescale=0.0, sampler="euler",
                 prediction="v", time_shift=1.0, resolution=None, buckets=None, vae_subfolder=None,
                 sd3_text_encoders=None, transformer_id=None):
        super().__init__()
        if transformer is None and transformer_id:  # an SD3 base's LoRA export: the base's transformer
            from diffusers import SD3Transformer2DModel

            transformer = SD3Transformer2DModel.from_pretrained(transformer_id, subfolder="transformer")
        if vae is None and vae_id:  # by reference: the run's VAE from its hub id (or folder)
            vae = AutoencoderKL.from_pretrained(vae_id, subfolder=vae_subfolder)
        sd3 = {}
        if text_encoder is None and sd3_text_encoders:  # an SD3-family pipeline's text encoders, as it loads them
            import transformers

            index = DiffusionPipeline.load_config(text_encoder_id)
            for part in sd3_text_encoders:
                tok = part.replace("text_encoder", "tokenizer")
                sd3[part] = getattr(transformers, index[part][1]).from_pretrained(text_encoder_id, subfolder=part)
                sd3[tok] = getattr(transformers, index[tok][1]).from_pretrained(text_encoder_id, subfolder=tok)
            text_encoder, tokenizer = sd3.pop("text_encoder"), sd3.pop("tokenizer")
        elif text_encoder is None and text_encoder_id:
            from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel, T5EncoderModel

            kind = AutoConfig.from_pretrained(text_encoder_id).model_type
            by_kind = {"clip": CLIPTextModel, "clip_text_model": CLIPTextModel, "t5": T5EncoderModel}
            model_cls = by_kind.get(kind, AutoModel)
            text_encoder = model_cls.from_pretrained(text_encoder_id)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(text_encoder_id)
        self.register_modules(transformer=transformer, conditioner=conditioner, scheduler=scheduler, vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer)
        given = {"text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2, "text_encoder_3": text_encoder_3,
                 "tokenizer_3": tokenizer_3}  # SD3's other two (CLIP-G, T5 unless the run left it out), or None
        self.register_modules(**{name: sd3.get(name, module) for name, module in given.items()})
        self.register_to_config(vae_subfolder=vae_subfolder, sd3_text_encoders=sd3_text_encoders,
                                transformer_id=transformer_id, vae_id=vae_id, text_encoder_id=text_encoder_id,
                                max_tokens=max_tokens,
                                num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                                control_guidance_scale=control_guidance_scale,
                                guidance_interval=list(guidance_interval),
                                guidance_rescale=guidance_rescale, sampler=sampler, prediction=prediction,
                                time_shift=time_shift, resolution=resolution, buckets=buckets)

    @property
    def flow_matching(self):
        return isinstance(self.scheduler, FlowMatchEulerDiscreteScheduler)

    # ---- Conditions -----------------------------------------------------------------------------------------

    def class_index(self, item):
        """A class index from an index, a class id (e.g. a WordNet id) or a name (whole, or its first synonym;
        any case)."""
        c = self.conditioner.config
        if isinstance(item, int) or (isinstance(item, str) and item.strip().isdigit()):
            k = int(item)
            if 0 <= k < c.num_classes:
                return k
        else:
            for k, (cid, name) in enumerate(zip(c.class_ids or [None] * c.num_classes, c.class_names or [])):
                if item.strip().lower() in {(cid or "").lower(), name.lower(), name.split(",")[0].strip().lower()}:
                    return k
        known = ", ".join(f"{k}: {n}" for k, n in enumerate((c.class_names or [])[:12]))
        raise ValueError(f"{item!r} is not a class of this model (indices 0 .. {c.num_classes - 1}"
                         f"{'; names: ' + known + (' ...' if c.num_classes > 12 else '') if known else ''})")

    def encode_prompt(self, prompts, device):
        """Token features, mask and pooled vector of the run's text encoder (CLIP's pooler, else the masked mean); on
        an SD3 base, what StableDiffusion3Pipeline.encode_prompt makes of them (T5 left out: its zeros)."""
        if self.config.sd3_text_encoders:
            from diffusers import StableDiffusion3Pipeline

            sd3 = StableDiffusion3Pipeline(
                transformer=self.transformer, scheduler=self.scheduler, vae=self.vae, text_encoder=self.text_encoder,
                tokenizer=self.tokenizer, text_encoder_2=self.text_encoder_2, tokenizer_2=self.tokenizer_2,
                text_encoder_3=getattr(self, "text_encoder_3", None), tokenizer_3=getattr(self, "tokenizer_3", None))
            tokens, _, pooled, _ = sd3.encode_prompt(prompts, None, None, device=device,
                                                     do_classifier_free_guidance=False,
                                                     max_sequence_length=self.config.max_tokens)
            return {"text_tokens": tokens.float(), "text_mask": torch.ones(tokens.shape[:2], device=device),
                    "text_pooled": pooled.float()}
        tok = self.tokenizer(prompts, padding="max_length", max_length=self.config.max_tokens, truncation=True,
                             return_tensors="pt")
        ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
        with torch.no_grad():
            out = self.text_encoder(input_ids=ids, attention_mask=mask)
        mask = mask.float()
        pooled = getattr(out, "pooler_output", None)
        if pooled is None:
            pooled = (out.last_hidden_state * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return {"text_tokens": out.last_hidden_state.float(), "text_mask": mask, "text_pooled": pooled.float()}

    def controls(self, n, original_size, crop_box, flip, device, shape):
        """The control fields the model was trained with (conditioning.controls): the original image's (h, w)
        (default: the sample's), the crop (top, left, height, width) in its pixels (default: the largest box of the
        sample's aspect, centred: the whole original when their aspects agree) and the flip (0 / 1). The
        conditioner reads the crop relative to the original's short side, so only original_size says its size."""
        h, w = original_size or shape
        box_h, box_w = (h, max(1, min(w, round(h * shape[1] / shape[0])))) if w * shape[0] > h * shape[1] else \
            (max(1, min(h, round(w * shape[0] / shape[1]))), w)
        box = crop_box or ((h - box_h) // 2, (w - box_w) // 2, box_h, box_w)
        return {"orig_hw": torch.tensor([[h, w]] * n, device=device),
                "crop_box": torch.tensor([list(box)] * n, device=device),
                "flip": torch.tensor([[int(bool(flip))]] * n, device=device)}

    # ---- The model and guidance -----------------------------------------------------------------------------

    def sample_shape(self, height, width):
        """(height, width) in model space of samples height x width pixels. Default: the run's data.resolution
        square, or with aspect-ratio buckets (model_index.json's buckets, [width, height] each) the squarest. Any
        shape whose sides are whole patches at the VAE's factor and fit the positional grid (SD3's cropped
        embedding) samples; the buckets are the shapes it was trained at."""
        buckets = self.config.buckets
        if height is None and width is None:
            square = min(buckets, key=lambda s: abs(math.log(s[0] / s[1])))[::-1] if buckets else None
            height, width = square or (self.config.resolution,) * 2
        tc, factor = self.transformer.config, 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae else 1
        side = tc.pos_embed_max_size * tc.patch_size * factor
        if height is None or width is None or height % (tc.patch_size * factor) or width % (tc.patch_size * factor) \
                or min(height, width) < 1 or max(height, width) > side:
            trained = ", ".join(f"{w}x{h}" for w, h in buckets or [(self.config.resolution,) * 2])
            raise ValueError(f"height={height}, width={width}: give both, each a positive multiple of "
                             f"{tc.patch_size * factor} and at most {side} pixels; this model was trained at (width x "
                             f"height) {trained}")
        return height // factor, width // factor

    def denoise(self, x, timestep, cond, noise_level):
        """The MMDiT's forward with the conditioner's adaptive-norm addition added to the vector every block's
        AdaLayerNorm reads (SD3Transformer2DModel.forward, written out with its modules); a MeanFlow model's interval
        placed in the last K blocks (the conditioner's interval_blocks) joins the vector of those and the final norm."""
        context, pooled, adanorm = self.conditioner(cond, noise_level)
        mmdit, (height, width) = self.transformer, x.shape[-2:]
        dtype = mmdit.dtype
        tokens = mmdit.pos_embed(x.to(dtype)).contiguous()
        temb = mmdit.time_text_embed(timestep.to(dtype), pooled.to(dtype))
        if torch.is_tensor(adanorm):
            temb = temb + adanorm.to(temb.dtype)
        late, blocks = self.conditioner.config.interval_blocks, mmdit.transformer_blocks
        late_temb = temb + self.conditioner.interval(cond, noise_level).to(temb.dtype) if late else temb
        context = mmdit.context_embedder(context.to(dtype))
        for i, block in enumerate(blocks, 1):
            vector = late_temb if late and i > len(blocks) - late else temb
            context, tokens = block(hidden_states=tokens, encoder_hidden_states=context, temb=vector)
        tokens = mmdit.proj_out(mmdit.norm_out(tokens, late_temb))
        p, c = mmdit.config.patch_size, mmdit.out_channels
        tokens = tokens.reshape(len(x), height // p, width // p, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", tokens).reshape(len(x), c, height, width)

    def guided(self, x, timestep, cond, noise_level, scale, control_scale, rescale):
        """m(null, k) + s (m(c, k) - m(null, k)) + s_k (m(c, k) - m(c, null_k)), one batched pass (c: the class or
        prompt, k: the controls); s = 1, s_k = 0: the conditional model alone."""
        branches = [(False, False)] + [(True, False)] * (scale != 1) + [(False, True)] * (control_scale != 0)
        n, k = len(x), len(branches)
        if k == 1:
            return self.denoise(x, timestep, cond, noise_level).float()
        batch = {key: torch.cat([v] * k) for key, v in cond.items() if key != "drop"}
        batch["drop"] = torch.cat([cond["drop"] | d for d, _ in branches])
        batch["drop_controls"] = torch.cat([torch.full((n,), dc, device=x.device) for _, dc in branches])
        out = self.denoise(torch.cat([x] * k), torch.cat([timestep] * k), batch, torch.cat([noise_level] * k))
        out = out.float().chunk(k)
        result = out[0] if scale == 1 else out[1] + scale * (out[0] - out[1])
        result = result + control_scale * (out[0] - out[-1]) if control_scale != 0 else result
        return rescale_guidance(result, out[0], rescale)

    # ---- Sampling -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, prompt=None, num_images_per_prompt=1, num_inference_steps=None, guidance_scale=None,
                 control_guidance_scale=None, guidance_interval=None, guidance_rescale=None, original_size=None,
                 crop_box=None, flip=False, generator=None, latents=None, output_type="pil", return_dict=True,
                 height=None, width=None):
        """prompt: class runs, a class (index, id or name) or a list of them (None: every class); text runs, a
        prompt or a list. Each is sampled num_images_per_prompt times. The guidance settings and steps default to
        the run's; guidance_interval (lo, hi) guides only at noise levels lo <= t <= hi (flow-matching t, 1 =
        noise). original_size (h, w), crop_box (top, left, height, width) and flip are the controls of runs
        trained with them (default: an uncropped, unflipped image of the sample's shape). height, width: the
        sample's pixels (default: the run's square, or its squarest bucket; see sample_shape). generator: one, or one
        per image; latents: the starting noise. output_type: "pil", "np" (floats in [0, 1]), "pt" (in [-1, 1]) or
        "latent" (the sampler's output before the VAE)."""
        cfg, device = self.config, self._execution_device
        steps = num_inference_steps or cfg.num_inference_steps
        scale = cfg.guidance_scale if guidance_scale is None else guidance_scale
        control_scale = cfg.control_guidance_scale if control_guidance_scale is None else control_guidance_scale
        lo, hi = cfg.guidance_interval if guidance_interval is None else guidance_interval
        rescale = cfg.guidance_rescale if guidance_rescale is None else guidance_rescale
        text = bool(self.conditioner.config.text_tokens)
        if text:
            if prompt is None or self.text_encoder is None:
                raise ValueError("this is a text-to-image model: give a prompt (or a list of prompts), and the text "
                                 "encoder it was trained with (the folder's text_encoder/, model_index.json's "
                                 "text_encoder_id, or text_encoder= and tokenizer=)")
            items = [prompt] if isinstance(prompt, str) else list(prompt)
        else:
            if prompt is None:
                prompt = list(range(self.conditioner.config.num_classes))
            items = [self.class_index(p) for p in (prompt if isinstance(prompt, (list, tuple)) else [prompt])]
        items = [item for item in items for _ in range(num_images_per_prompt)]
        n = len(items)
        cond = self.encode_prompt(items, device) if text else {"label": torch.tensor(items, device=device)}
        cond["drop"] = torch.zeros(n, dtype=torch.bool, device=device)
        size = self.sample_shape(height, width)  # (height, width) in model space
        if self.conditioner.controls:
            factor = 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae else 1
            cond.update(self.controls(n, original_size, crop_box, flip, device, (size[0] * factor, size[1] * factor)))

        shape = (n, self.transformer.config.in_channels, *size)
        if latents is None:  # a list of generators: image i's noise from generator i alone (as sample.py's seeds)
            latents = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
        x = latents.to(device, torch.float32)

        if self.flow_matching:  # t_i = shift(1 - i / steps), the grid of training's time shift
            self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=device)
            timesteps = self.scheduler.timesteps
        else:  # the trainer's grid: DDPMScheduler steps to its next point, DDIM takes ddim_step (see there)
            timesteps = trailing_timesteps(self.scheduler.config.num_train_timesteps, steps)
            if isinstance(self.scheduler, DDPMScheduler):
                self.scheduler.set_timesteps(timesteps=timesteps, device=device)
            model_time = torch.arange(self.scheduler.config.num_train_timesteps, dtype=torch.float64)
            if cfg.time_shift != 1:  # the run's resolution shift, which diffusers' DDPM schedulers lack
                base = trainer_schedule(self.scheduler.config)  # float64, as the trainer's (each call afresh)
                model_time = time_input(base, cfg.time_shift)
                self.scheduler.alphas_cumprod = shifted_schedule(base, cfg.time_shift).float()
        for i, t in enumerate(self.progress_bar(timesteps)):
            if self.flow_matching:
                sigma, sigma_next = self.scheduler.sigmas[i], self.scheduler.sigmas[i + 1]
                level, timestep = sigma.item(), (sigma * 1000).to(device).expand(n)
                noise_level = timestep / 1000
            else:
                ab = self.scheduler.alphas_cumprod[int(t)].item()
                level = ddpm_noise_level(ab)
                timestep = torch.full((n,), model_time[int(t)].item(), device=device)
                noise_level = torch.full((n,), level, device=device)
            guide = lo <= level <= hi
            if self.flow_matching and cfg.sampler == "meanflow":  # the average velocity over [sigma_next, sigma]
                cond["interval"] = ((sigma - sigma_next) * 1000).to(device).expand(n)
            out = self.guided(x, timestep, cond, noise_level, scale if guide else 1.0,
                              control_scale if guide else 0.0, rescale if guide and not self.flow_matching else 0.0)
            if self.flow_matching:
                out = self.velocity(out, x, sigma)
                if cfg.sampler == "heun" and sigma_next > 0:  # Heun: the slopes at both ends averaged
                    x_next = x + (sigma_next - sigma) * out
                    t_next = (sigma_next * 1000).to(device).expand(n)
                    out2 = self.guided(x_next, t_next, cond, t_next / 1000, scale if guide else 1.0,
                                       control_scale if guide else 0.0, 0.0)
                    out = (out + self.velocity(out2, x_next, sigma_next)) / 2
            if self.flow_matching or isinstance(self.scheduler, DDPMScheduler):
                x = self.scheduler.step(out, t, x, generator=generator, return_dict=False)[0]
            else:
                x = self.ddim_step(out, x, t, timesteps[i + 1] if i + 1 < steps else -1)

        if output_type != "latent" and self.vae is not None:
            vc = self.vae.config
            x = self.vae.decode(x.to(self.vae.dtype) / vc.scaling_factor + (vc.shift_factor or 0.0)).sample
        images = x if output_type == "latent" else x.float().clamp(-1, 1)
        if output_type == "np":
            images = ((images + 1) / 2).permute(0, 2, 3, 1).cpu().numpy()
        elif output_type == "pil":  # rounded as the repository's PNGs: round((x + 1) 127.5)
            pixels = (images + 1).mul(127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()
            images = [PIL.Image.fromarray(p) for p in pixels]
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    def velocity(self, out, x, sigma):
        """Flow matching with prediction "x0" (JiT): the velocity the clean-image estimate implies."""
        return (x - out) / max(float(sigma), X0_MIN_T) if self.config.prediction == "x0" else out

    def ddim_step(self, out, x, t, t_next):
        """DDIM, eta = 0 (Song et al. 2021, eq. 12), from timestep t to the grid's next one t_next (-1: the data,
        alpha_bar 1): x_next = sqrt(ab_next) x0 + sqrt(1 - ab_next) eps, with x0 and eps from the prediction.
        DDIMScheduler.step's formula, on the scheduler's alphas_cumprod; its own step goes back T // steps,
        which is the trainer's next timestep only when steps divides T."""
        ab = self.scheduler.alphas_cumprod[t].item()
        ab_next = self.scheduler.alphas_cumprod[t_next].item() if t_next >= 0 else 1.0
        a, s, kind = ab ** 0.5, (1 - ab) ** 0.5, self.scheduler.config.prediction_type
        if kind == "v_prediction":  # x0 = sqrt(ab) x_t - sqrt(1 - ab) v, eps = sqrt(ab) v + sqrt(1 - ab) x_t
            x0, eps = a * x - s * out, a * out + s * x
        elif kind == "epsilon":
            x0, eps = (x - s * out) / a, out
        else:  # "sample": x0 itself
            x0, eps = out, (x - a * out) / s
        return ab_next ** 0.5 * x0 + (1 - ab_next) ** 0.5 * eps
