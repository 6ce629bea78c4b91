"""Flux.1: fine-tune the pretrained ``FluxTransformer2DModel`` with rectified flow on packed latents.

As ``FluxPipeline`` feeds it: latents ``(B, C, h, w)`` packed into 2x2 patches
(``FluxPipeline._pack_latents``: ``(B, h/2 * w/2, 4C)``), ``img_ids`` from
``_prepare_latent_image_ids`` and zero ``txt_ids`` ``(L, 3)``, the T5 states as
``encoder_hidden_states``, CLIP-L's pooled output as ``pooled_projections``, the timestep as a
fraction (the model scales it by 1000) and, for a guidance-distilled transformer
(``guidance_embeds``), the config's ``guidance`` value. The target ``eps - x0`` is packed the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from train.config import TrainConfig
from train.masks import MaskedLoss, mask_weights
from train.model import flow_sample, to_weight_dtype
from train.shift import timestep_shift
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    source = pretrained_source(cfg, meta)
    transformer = load_pretrained(FluxTransformer2DModel, source, "transformer")
    layout = meta.text_layout
    channels = int(meta.latent.channels)
    check_matches("text width (joint_attention_dim)", transformer.config.joint_attention_dim, layout.width, source)
    check_matches("pooled width (pooled_projection_dim)", transformer.config.pooled_projection_dim,
                  layout.pooled_dim, source)
    check_matches("packed latent channels (in_channels)", transformer.config.in_channels, 4 * channels, source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    # the pipeline shifts by the image's token count at sampling time (use_dynamic_shifting): auto trains each
    # bucket at the shift the pipeline samples it with (train/shift.py); packing makes a token of 2x2 latents
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=2)
    guidance_embeds = bool(transformer.config.guidance_embeds)
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = batch.latents.shape
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        device, dtype = batch.latents.device, batch.latents.dtype
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)  # (h/2 * w/2, 3)
        txt_ids = torch.zeros(batch.text.shape[1], 3, device=device, dtype=dtype)  # (L, 3)
        guidance = torch.full((b,), float(cfg.guidance), device=device) if guidance_embeds else None
        packed, pooled, text = to_weight_dtype(model, FluxPipeline._pack_latents(draw.noisy, b, c, h, w), batch.pooled,
                                               batch.text)  # DeepSpeed bf16: no autocast  # fmt: skip
        pred = model(hidden_states=packed, timestep=draw.sigma.flatten(), guidance=guidance, pooled_projections=pooled,
                     encoder_hidden_states=text, txt_ids=txt_ids, img_ids=img_ids,
                     return_dict=False)[0]  # (B, h/2 * w/2, 4C)  # fmt: skip
        mask = mask_weights(batch, masked)  # (B, 1, h, w) -> packed like the latents: (B, h/2 * w/2, 4C)
        mask = None if mask is None else FluxPipeline._pack_latents(mask.expand(b, c, h, w), b, c, h, w)
        return flow_loss(pred, FluxPipeline._pack_latents(draw.target, b, c, h, w), draw.weight.view(b, 1, 1), mask)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
                            tokenizer_2=None, transformer=model)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        # guidance-distilled: the guidance embedding, not a negative prompt, steers (true_cfg_scale stays 1)
        return {"prompt_embeds": prompts.embeds, "pooled_prompt_embeds": prompts.pooled}

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / 4, source=source,
                    pipeline_class="FluxPipeline")  # fmt: skip


RECIPE = Recipe("flux", setup)
