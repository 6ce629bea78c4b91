"""ERNIE-Image: fine-tune the ``ErnieImageTransformer2DModel`` with rectified flow, as ``ErnieImagePipeline`` calls it.

The pipeline (``d/pipelines/ernie_image/pipeline_ernie_image.py:336-360``, diffusers 0.42.1) gives its transformer
the latents as they are, **NCHW**: ``(B, 128, h, w)``, the ``AutoencoderKLFlux2`` posterior patchified 2x2 and
normalised by its batch-norm statistics with eps 1e-5 (the cache stores them so:
:func:`pipeline.embed.families.ernie_image.vae_latents`), no token packing (``patch_size`` 1); the captions'
Ministral 3 rows zero-padded to the longest as ``text_bth`` ``(B, T, 3072)`` with their counts ``text_lens`` (the
cache's real rows and the loader's mask: the transformer masks the pad rows out and starts every image token's
first RoPE axis at ``text_lens``); ``timestep`` the scheduler's ``t`` = ``sigma * 1000``. Its output is the
velocity the Euler step integrates, so the loss compares it with ``eps - x0`` at ``x_t = (1 - s) x0 + s eps``,
``s`` drawn by the config's density and shifted by the scheduler's fixed ``shift`` (4.0 in ERNIE's published
config; ``timestep_shift: auto``), as ``__call__``'s ``set_timesteps(sigmas=linspace(1, 0, n + 1)[:-1])`` shifts
its schedule.

Validation images and LoRA: ``ErnieImagePipeline`` around the trained transformer, the cached prompts as the
lists of each caption's rows it takes (``prompt_embeds``, ``negative_prompt_embeds``), no prompt enhancer; its
``load_lora_weights`` (``ErnieImageLoraLoaderMixin``) reads the LoRA export.
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
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


def velocity(model: torch.nn.Module, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The transformer's prediction ``(B, C, h, w)`` for noisy ``latents`` ``(B, C, h, w)`` at timesteps ``t``
    ``(B,)`` (``sigma * 1000``), text ``(B, L, D)`` zero past each caption's ``mask`` ``(B, L)`` rows: as
    ``ErnieImagePipeline.__call__`` calls it (``text_bth``, ``text_lens``)."""
    lens = mask.sum(dim=1).long()  # (B,) real rows: the pipeline's _pad_text lens
    return model(hidden_states=latents, timestep=t, text_bth=text, text_lens=lens, return_dict=False)[0]


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler

    source = pretrained_source(cfg, meta)
    check_fits("ernie-image", ErnieImageTransformer2DModel, source, cfg)
    transformer = load_pretrained(ErnieImageTransformer2DModel, source, "transformer")
    layout, channels = meta.text_layout, int(meta.latent.channels)
    check_matches("text width (text_in_dim)", transformer.config.text_in_dim, layout.width, source)
    check_matches("latent channels (in_channels: 2x2 patches of the VAE's)", transformer.config.in_channels,
                  channels, source)  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    steps = float(scheduler.config.num_train_timesteps)  # the scheduler's timesteps are sigma * this
    # the cached latents are patchified already (patch_size 1): one token per latent position
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=int(transformer.config.patch_size))
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        _, _, h, w = batch.latents.shape  # (B, 4C, h, w)
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text = to_weight_dtype(model, draw.noisy, batch.text)  # DeepSpeed bf16: no autocast
        t = (draw.sigma.flatten() * steps).to(noisy.dtype)  # the pipeline's t_batch, in the model's dtype
        pred = velocity(model, noisy, t, text, batch.text_mask)
        return flow_loss(pred, draw.target, draw.weight, mask_weights(batch, masked))

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        if getattr(vae, "bn", None) is None:
            raise UsageError(f"the cache's VAE is a {type(vae).__name__}; ErnieImagePipeline decodes with an "
                             "AutoencoderKLFlux2 (embed with --family ernie-image)")  # fmt: skip
        return ErnieImagePipeline(transformer=model, vae=vae, text_encoder=None, tokenizer=None, scheduler=scheduler)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": captions(prompts.embeds, prompts.mask),
                "negative_prompt_embeds": captions(negative.embeds, negative.mask)}  # fmt: skip

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1.0, source=source,
                    pipeline_class="ErnieImagePipeline")  # fmt: skip


RECIPE = Recipe("ernie-image", setup)
