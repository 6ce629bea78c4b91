"""SD3 / SD3.5: fine-tune the pretrained ``SD3Transformer2DModel`` with rectified flow.

``SD3Transformer2DModel(hidden_states, encoder_hidden_states, pooled_projections, timestep)``: the
prompt embeddings are CLIP-L | CLIP-G zero-padded to T5's width, then T5 on the sequence
(``(77 + 256, 4096)``), the pooled one both CLIPs' projections. ``x_t = (1 - s) x0 + s eps``, the
model predicts ``eps - x0`` at timestep ``1000 s``; ``s`` is drawn by the config's density and
shifted as its sampler shifts them (``timestep_shift``: auto, the base scheduler's ``shift``, 3.0 for SD3).
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
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    source = pretrained_source(cfg, meta)
    transformer = load_pretrained(SD3Transformer2DModel, source, "transformer")
    layout = meta.text_layout
    check_matches("text width (joint_attention_dim)", transformer.config.joint_attention_dim, layout.width, source)
    check_matches("pooled width (pooled_projection_dim)", transformer.config.pooled_projection_dim,
                  layout.pooled_dim, source)
    check_matches("latent channels", transformer.config.in_channels, int(meta.latent.channels), source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    patch = int(transformer.config.patch_size)
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=patch)  # auto: the scheduler's shift
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        h, w = batch.latents.shape[-2:]
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text, pooled = to_weight_dtype(model, draw.noisy, batch.text, batch.pooled)  # DeepSpeed bf16
        pred = model(hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled,
                     timestep=draw.sigma.flatten() * 1000.0, return_dict=False)[0]  # fmt: skip
        return flow_loss(pred, draw.target, draw.weight, mask_weights(batch, masked))

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(transformer=model, scheduler=scheduler, vae=vae, text_encoder=None,
                                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                        tokenizer_3=None)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": prompts.embeds, "pooled_prompt_embeds": prompts.pooled,
                "negative_prompt_embeds": negative.embeds, "negative_pooled_prompt_embeds": negative.pooled}

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / patch**2, source=source,
                    pipeline_class="StableDiffusion3Pipeline")  # fmt: skip


RECIPE = Recipe("sd3", setup)
