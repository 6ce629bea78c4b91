"""Z-Image: fine-tune the pretrained ``ZImageTransformer2DModel`` with rectified flow, as ``ZImagePipeline`` calls it.

The pipeline hands its transformer lists, one entry per image: latents ``(C, 1, h, w)`` (``(z - shift) * scale``
of Flux's VAE, as the loader scales them) and each caption's Qwen3 rows ``(n_i, D)`` as they are (the cache's
real tokens; the model pads each to a multiple of 32 with its own pad token), and the timestep as
``(1000 - t) / 1000 = 1 - sigma``. Its output is the negative of the velocity the scheduler integrates (the
pipeline negates it before ``scheduler.step``), so the loss compares ``-output`` with ``eps - x0`` at
``x_t = (1 - s) x0 + s eps``; ``s`` drawn by the config's density and shifted by the scheduler's fixed
``shift`` (Z-Image-Turbo: 3.0; a dynamic-shift config shifts per bucket of ``h/2 * w/2`` tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from train.config import TrainConfig
from train.masks import MaskedLoss, mask_weights
from train.model import flow_sample, to_weight_dtype
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip
from train.recipes.memory import check_fits
from train.shift import timestep_shift

__all__ = ["RECIPE", "setup", "captions", "velocity"]


def captions(text: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """A batch's text ``(B, L, D)`` as the pipeline's list of each caption's rows ``(n_i, D)`` (``mask`` ``(B, L)``)."""
    return [t[m.bool()] for t, m in zip(text, mask)]


def velocity(model: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, feats: list[torch.Tensor]):
    """The velocity ``eps - x0`` the pipeline steps with, ``(B, C, h, w)`` float32, for noisy ``latents``
    ``(B, C, h, w)`` at noise levels ``sigma`` ``(B,)``: the transformer's output on the pipeline's lists, negated."""
    out = model(list(latents.unsqueeze(2).unbind(dim=0)), 1.0 - sigma, feats, return_dict=False)[0]
    return -torch.stack([o.float() for o in out], dim=0).squeeze(2)


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    source = pretrained_source(cfg, meta)
    check_fits("z-image", ZImageTransformer2DModel, source, cfg)
    transformer = load_pretrained(ZImageTransformer2DModel, source, "transformer")
    layout, channels = meta.text_layout, int(meta.latent.channels)
    check_matches("text width (cap_feat_dim)", transformer.config.cap_feat_dim, layout.width, source)
    check_matches("latent channels (in_channels)", transformer.config.in_channels, channels, source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    patch = int(transformer.config.all_patch_size[0])
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=patch)  # auto: the fixed shift (3.0)
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        _, _, h, w = batch.latents.shape
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text = to_weight_dtype(model, draw.noisy, batch.text)  # DeepSpeed bf16: no autocast
        pred = velocity(model, noisy, draw.sigma.flatten().to(noisy.dtype), captions(text, batch.text_mask))
        return flow_loss(pred, draw.target, draw.weight, mask_weights(batch, masked))

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=model)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": captions(prompts.embeds, prompts.mask),
                "negative_prompt_embeds": captions(negative.embeds, negative.mask)}  # fmt: skip

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / patch**2, source=source,
                    pipeline_class="ZImagePipeline")  # fmt: skip


RECIPE = Recipe("z-image", setup)
