"""PixArt (and the generic cache): the from-scratch transformer of :mod:`train.model`, or a pretrained one.

Without ``pretrained`` (the default): a fresh ``PixArtTransformer2DModel`` sized by the config's
``model`` and the cache (latent channels, text width), trained with rectified flow
(:func:`train.model.flow_matching_loss`), sampled with ``FlowMatchEulerDiscreteScheduler``. With
``pretrained``: its ``transformer`` subfolder, fine-tuned with DDPM noise as PixArt was trained
(epsilon; a learned-sigma model's variance half is not trained), sampled with its own scheduler.
Both take the masked T5 states and, with ``use_additional_conditions``, the original resolution
and the bucket's aspect ratio.
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from train.config import TrainConfig
from train.masks import MaskedLoss, mask_weights, masked_mse
from train.model import build_model, ddpm_sample, flow_matching_loss, to_weight_dtype
from train.shift import refuse_shift, timestep_shift
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_options, load_pretrained,
                                pretrained_source)  # fmt: skip


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler, PixArtTransformer2DModel

    layout, channels = meta.text_layout, int(meta.latent.channels)
    masked = MaskedLoss.from_config(cfg.masked_loss)
    if cfg.pretrained is None:
        model = build_model(cfg.model, latent_channels=channels, caption_channels=layout.width)
        shift = timestep_shift(cfg.timestep_shift, None)  # auto: unshifted (no pretrained scheduler)
        sampler = FlowMatchEulerDiscreteScheduler(shift=shift.fixed)

        def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
            cond = {"resolution": batch.resolution, "aspect_ratio": batch.aspect_ratio}
            s = shift.for_bucket(batch.bucket, *batch.latents.shape[-2:])
            return flow_matching_loss(model, batch.latents, batch.text, batch.text_mask, cond, generator,
                                      shift=s, mask=mask_weights(batch, masked), **flow_options(cfg))  # fmt: skip
    else:
        refuse_shift(cfg.timestep_shift, "a pretrained pixart")
        source = pretrained_source(cfg, meta)
        model = load_pretrained(PixArtTransformer2DModel, source, "transformer")
        check_matches("text width (caption_channels)", model.config.caption_channels, layout.width, source)
        check_matches("latent channels", model.config.in_channels, channels, source)
        scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler")
        sampler = _pipeline_scheduler(source)

        def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
            noisy, timesteps, target = ddpm_sample(scheduler, batch.latents, generator)
            noisy, text, resolution, aspect = to_weight_dtype(model, noisy, batch.text, batch.resolution,
                                                              batch.aspect_ratio)  # DeepSpeed bf16  # fmt: skip
            cond = {"resolution": resolution, "aspect_ratio": aspect}
            pred = model(noisy, encoder_hidden_states=text, encoder_attention_mask=batch.text_mask,
                         timestep=timesteps, added_cond_kwargs=cond, return_dict=False)[0]  # fmt: skip
            # learned sigma: the mean half
            return masked_mse(pred[:, :channels], target, mask_weights(batch, masked))

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        from diffusers import PixArtAlphaPipeline

        return PixArtAlphaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=model, scheduler=sampler)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": prompts.embeds, "prompt_attention_mask": prompts.mask,
                "negative_prompt_embeds": negative.embeds, "negative_prompt_attention_mask": negative.mask,
                "use_resolution_binning": False}  # binning knows PixArt's 256..2048 sample sizes only

    patch = int(model.config.patch_size)
    # no pipeline_class: PixArt's pipelines have no LoRA loaders (load_lora_weights) in diffusers
    return Denoiser(model, loss, pipeline, prompt_kwargs, tokens_per_position=1 / patch**2, source=cfg.pretrained)


RECIPE = Recipe("pixart", setup)


def _pipeline_scheduler(source: str) -> Any:
    """The pretrained pipeline's own scheduler (PixArt: DPMSolverMultistepScheduler), for sampling."""
    import diffusers
    from diffusers import DDPMScheduler

    config = DDPMScheduler.load_config(source, subfolder="scheduler")  # any scheduler's config: a dict
    return getattr(diffusers, config["_class_name"]).from_config(config)
