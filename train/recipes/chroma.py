"""Chroma: fine-tune the ``ChromaTransformer2DModel`` with rectified flow on packed latents, with its text mask.

As ``ChromaPipeline`` feeds it: latents ``(B, 16, h, w)`` (Flux.1's VAE: ``(z - shift) * scaling``, done by
the loader) packed into 2x2 patches (``_pack_latents``: ``(B, h/2 w/2, 64)``), ``img_ids`` from
``_prepare_latent_image_ids`` and zero ``txt_ids`` ``(L, 3)``, the 512 T5 rows as ``encoder_hidden_states``,
and the attention mask the pipeline makes (``_prepare_attention_mask``): the cached text mask (the record's
``pooled``: 1 on the caption's tokens and the first pad, 0 after) followed by ones for the image tokens, a
float tensor, as the pipeline passes it (the blocks add it to the attention scores: see
:mod:`pipeline.embed.families.chroma`). No guidance embedding, no pooled text; the timestep as a fraction. The
noise levels are shifted by ``calculate_shift`` of the bucket's token count, as ``ChromaPipeline`` samples
(the FLUX.1 scheduler's dynamic shifting). Sampling uses classifier-free guidance against the empty caption.
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from train.recipes.memory import check_fits
from train.config import TrainConfig
from train.masks import MaskedLoss, mask_weights
from train.model import flow_sample, to_weight_dtype
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip
from train.shift import timestep_shift

__all__ = ["RECIPE", "attention_mask"]


def attention_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """``(B, L + image_tokens)``: ``ChromaPipeline._prepare_attention_mask`` of the text mask ``(B, L)`` (float)."""
    ones = torch.ones(text_mask.shape[0], image_tokens, device=text_mask.device, dtype=torch.bool)
    return torch.cat([text_mask, ones], dim=1)  # the pipeline's own cat: a float mask of 0 and 1


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    source = pretrained_source(cfg, meta)
    check_fits("chroma", ChromaTransformer2DModel, source, cfg)
    transformer = load_pretrained(ChromaTransformer2DModel, source, "transformer")
    layout = meta.text_layout
    channels = int(meta.latent.channels)
    check_matches("text width (joint_attention_dim)", transformer.config.joint_attention_dim, layout.width, source)
    check_matches("text mask length (the cache's pooled: the transformer's text mask)", layout.pooled_dim,
                  layout.length, source)  # fmt: skip
    check_matches("packed latent channels (in_channels)", transformer.config.in_channels, 4 * channels, source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=2)  # packing: a token of 2x2 latents
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = batch.latents.shape
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        device, dtype = batch.latents.device, batch.latents.dtype
        img_ids = ChromaPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)  # (h/2 w/2, 3)
        txt_ids = torch.zeros(batch.text.shape[1], 3, device=device, dtype=dtype)  # (L, 3)
        packed, text, text_mask = to_weight_dtype(model, ChromaPipeline._pack_latents(draw.noisy, b, c, h, w),
                                                  batch.text, batch.pooled)  # DeepSpeed bf16  # fmt: skip
        pred = model(hidden_states=packed, timestep=draw.sigma.flatten(), encoder_hidden_states=text,
                     txt_ids=txt_ids, img_ids=img_ids, attention_mask=attention_mask(text_mask, packed.shape[1]),
                     return_dict=False)[0]  # (B, h/2 w/2, 4C)  # fmt: skip
        mask = mask_weights(batch, masked)  # (B, 1, h, w) -> packed like the latents
        mask = None if mask is None else ChromaPipeline._pack_latents(mask.expand(b, c, h, w), b, c, h, w)
        return flow_loss(pred, ChromaPipeline._pack_latents(draw.target, b, c, h, w), draw.weight.view(b, 1, 1), mask)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=model)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": prompts.embeds, "prompt_attention_mask": prompts.pooled,
                "negative_prompt_embeds": negative.embeds, "negative_prompt_attention_mask": negative.pooled}

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / 4, source=source,
                    pipeline_class="ChromaPipeline")  # fmt: skip


RECIPE = Recipe("chroma", setup)
