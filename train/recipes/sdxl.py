"""SDXL: fine-tune the pretrained ``UNet2DConditionModel`` with DDPM noise and SDXL's micro-conditioning.

The UNet takes the prompt embeddings (CLIP-L | CLIP-G, ``(77, 2048)``) as ``encoder_hidden_states``
and ``added_cond_kwargs = {"text_embeds": pooled, "time_ids": ...}``; ``time_ids`` are the sample's
recorded ``original_size + crops_coords_top_left + target_size``, exactly what
``StableDiffusionXLPipeline._get_add_time_ids`` builds (:func:`time_ids`). The target is the noise
(``epsilon``) or the velocity (``v_prediction``), as the base model's scheduler config says;
timesteps and noise follow ``DDPMScheduler`` built from that config.
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from train.config import TrainConfig
from train.masks import MaskedLoss, mask_weights, masked_mse
from train.model import ddpm_sample, to_weight_dtype
from train.shift import refuse_shift
from train.recipes.base import Denoiser, PromptEmbeds, Recipe, check_matches, load_pretrained, pretrained_source


def time_ids(original_size: torch.Tensor, crop_top_left: torch.Tensor, target_size: torch.Tensor) -> torch.Tensor:
    """SDXL's ``add_time_ids`` (B, 6): original (h, w), crop (top, left), target (h, w), all (B, 2) pixels."""
    return torch.cat([original_size, crop_top_left, target_size], dim=1)


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import DDPMScheduler, UNet2DConditionModel

    refuse_shift(cfg.timestep_shift, "sdxl")
    source = pretrained_source(cfg, meta)
    unet = load_pretrained(UNet2DConditionModel, source, "unet")
    layout = meta.text_layout
    check_matches("text width (cross_attention_dim)", unet.config.cross_attention_dim, layout.width, source)
    time_width = 6 * int(unet.config.addition_time_embed_dim)
    check_matches("pooled width (projection_class_embeddings_input_dim - 6 time ids)",
                  int(unet.config.projection_class_embeddings_input_dim) - time_width, layout.pooled_dim, source)
    check_matches("latent channels", unet.config.in_channels, int(meta.latent.channels), source)
    scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler")  # keeps prediction_type, betas
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        noisy, timesteps, target = ddpm_sample(scheduler, batch.latents, generator)
        sample, text, pooled = to_weight_dtype(model, noisy, batch.text, batch.pooled)  # DeepSpeed bf16: no autocast
        cond = {"text_embeds": pooled, "time_ids": time_ids(batch.resolution, batch.crop_top_left,
                                                            batch.target_size)}  # fmt: skip
        pred = model(sample, timesteps, encoder_hidden_states=text, added_cond_kwargs=cond, return_dict=False)[0]
        return masked_mse(pred, target, mask_weights(batch, masked))

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        sampler = EulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
        return StableDiffusionXLPipeline(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                         tokenizer_2=None, unet=model, scheduler=sampler,
                                         add_watermarker=False)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": prompts.embeds, "pooled_prompt_embeds": prompts.pooled,
                "negative_prompt_embeds": negative.embeds, "negative_pooled_prompt_embeds": negative.pooled}

    return Denoiser(unet, loss, pipeline, prompt_kwargs, source=source, pipeline_class="StableDiffusionXLPipeline",
                    component="unet")  # fmt: skip


RECIPE = Recipe("sdxl", setup)
