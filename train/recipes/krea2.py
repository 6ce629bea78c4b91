"""Krea 2: fine-tune the pretrained ``Krea2Transformer2DModel`` with rectified flow on packed latents.

As ``Krea2Pipeline.__call__`` feeds it (diffusers 0.42.1, ``pipelines/krea2/pipeline_krea2.py:583-668``): latents
``(B, C, h, w)`` stored already normalised per channel (Qwen-Image's VAE and normalisation: ``_cache.json``
``latent.normalised``; the pipeline decodes ``latents * std + mean``, ``:700-709``), packed into ``patch_size``
squares (``_pack_latents``, ``:357-363``: ``(B, h/p * w/p, C p^2)``); ``encoder_hidden_states`` the cached rows
``(B, L, 12 D)`` reshaped to the pipeline's ``(B, L, 12, D)`` (12 hidden states per token) with the boolean
``encoder_attention_mask`` (False past each caption's rows: the transformer masks them as keys and never reads them
back, and text has RoPE position zero, so stored real rows padded at the end are the pipeline's
``[caption | PAD | suffix]`` in another order); ``position_ids`` of ``prepare_position_ids`` (text at the origin,
image ``(0, y, x)``); the timestep the noise level ``sigma`` (the pipeline passes ``t / 1000``). The output is the
velocity ``eps - x0`` that ``FlowMatchEulerDiscreteScheduler.step`` integrates, packed the same way, at
``x_t = (1 - s) x0 + s eps``.

Noise levels are drawn by the config's density and shifted as the pipeline samples (``timestep_shift: auto``, with a
dynamic-shift scheduler): ``mu = calculate_shift(h/p * w/p, base_image_seq_len, max_image_seq_len, base_shift,
max_shift)`` of the scheduler config, **6400** when it lacks ``max_image_seq_len`` (the pipeline's fallback,
``:617-623``; the scheduler class's own default is 4096), or ``mu = 1.15`` whatever the size when ``model_index.json``
says ``is_distilled`` (the few-step turbo checkpoint, ``:614-616``); then ``sigma = exp(mu) t / (1 + (exp(mu) - 1) t)``.
``patch_size`` and ``is_distilled`` are read from the folder's ``model_index.json`` (the pipeline's config).
"""

from __future__ import annotations

from types import SimpleNamespace
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

__all__ = ["RECIPE", "DISTILLED_MU", "pipeline_config", "pack", "model_inputs", "krea2_mu"]

DISTILLED_MU = 1.15  # Krea2Pipeline.__call__'s fixed mu for an is_distilled checkpoint


def pipeline_config(source: str) -> dict[str, Any]:
    """``Krea2Pipeline``'s own settings in ``source``'s ``model_index.json``, with its defaults: ``patch_size``,
    ``is_distilled``, ``text_encoder_select_layers`` (None: the pipeline's default 12)."""
    from diffusers import DiffusionPipeline

    try:
        index = dict(DiffusionPipeline.load_config(source))
    except (OSError, EnvironmentError) as e:
        raise UsageError(f"pretrained {source!r}: cannot read its model_index.json ({e}); pass the Krea 2 diffusers "
                         "pipeline folder or hub id") from None  # fmt: skip
    return {"patch_size": int(index.get("patch_size", 2)), "is_distilled": bool(index.get("is_distilled", False)),
            "text_encoder_select_layers": index.get("text_encoder_select_layers")}  # fmt: skip


def pack(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h/p * w/p, C p^2)`` by ``Krea2Pipeline._pack_latents`` itself."""
    from diffusers import Krea2Pipeline

    b, c, h, w = latents.shape
    return Krea2Pipeline._pack_latents(SimpleNamespace(patch_size=patch), latents, b, c, h, w)


def model_inputs(latents: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor, *, patch: int,
                 layers: int) -> dict[str, Any]:  # fmt: skip
    """The transformer's keyword arguments (the timestep apart) for noisy latents ``(B, C, h, w)`` and a batch's text
    ``(B, L, layers * D)`` with its mask ``(B, L)``, as ``Krea2Pipeline.__call__`` builds them."""
    from diffusers import Krea2Pipeline

    b, length, wide = text.shape
    _, _, h, w = latents.shape
    if h % patch or w % patch:
        raise UsageError(f"a {w}x{h} latent: Krea 2 packs {patch}x{patch} latents, so image sides must be multiples "
                         f"of {8 * patch} pixels; scan with a --bucket-step that is a multiple of {8 * patch}")
    positions = Krea2Pipeline.prepare_position_ids(length, h // patch, w // patch, latents.device)  # (L + hw, 3)
    return {"hidden_states": pack(latents, patch), "encoder_attention_mask": text_mask.bool(),
            "encoder_hidden_states": text.view(b, length, layers, wide // layers),  # (B, L, 12, D)
            "position_ids": positions}  # fmt: skip


def krea2_mu(scheduler_config: Any, distilled: bool):
    """``tokens -> mu`` as ``Krea2Pipeline.__call__`` computes it (see the module docstring)."""
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    c = scheduler_config

    def mu(tokens: int) -> float:
        if distilled:
            return DISTILLED_MU
        return calculate_shift(tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 6400),
                               c.get("base_shift", 0.5), c.get("max_shift", 1.15))  # fmt: skip

    return mu


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    """The Krea 2 denoiser (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel

    latent = meta.latent
    if latent is None or "normalised" not in latent._extra:
        raise UsageError("the cache's latents are not Qwen-Image's normalised ones (_cache.json latent.normalised): "
                         "embed with `bucketeer embed --family krea-2 --model ID|PATH` (or reuse a qwen-image "
                         "cache's latents of the same VAE)")  # fmt: skip
    source = pretrained_source(cfg, meta)
    settings = pipeline_config(source)
    check_fits("krea-2", Krea2Transformer2DModel, source, cfg)
    transformer = load_pretrained(Krea2Transformer2DModel, source, "transformer")
    layers, patch = int(transformer.config.num_text_layers), settings["patch_size"]
    check_matches("text width (num_text_layers x text_hidden_dim)", layers * transformer.config.text_hidden_dim,
                  meta.text_layout.width, source)  # fmt: skip
    check_matches(f"packed latent channels (in_channels: {patch}x{patch} patches)", transformer.config.in_channels,
                  patch * patch * int(latent.channels), source)  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=patch,
                           mu_rule=krea2_mu(scheduler.config, settings["is_distilled"]))  # fmt: skip
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = batch.latents.shape
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text = to_weight_dtype(model, draw.noisy, batch.text)  # DeepSpeed bf16: no autocast
        pred = model(**model_inputs(noisy, text, batch.text_mask, patch=patch, layers=layers),
                     timestep=draw.sigma.flatten().to(noisy.dtype), return_dict=False)[0]  # (B, h/p * w/p, C p^2)
        mask = mask_weights(batch, masked)  # (B, 1, h, w) -> packed like the latents
        mask = None if mask is None else pack(mask.expand(b, c, h, w), patch)
        return flow_loss(pred, pack(draw.target, patch), draw.weight.view(b, 1, 1), mask)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        extra = {k: v for k, v in settings.items() if v is not None}
        return Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=model,
                             **extra)  # fmt: skip

    def embeds(p: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor]:
        b, length, wide = p.embeds.shape
        return p.embeds.view(b, length, layers, wide // layers), p.mask.bool()

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        # classifier-free guidance against the empty caption, cond + g (cond - uncond) (guidance_scale > 0)
        (e, m), (ne, nm) = embeds(prompts), embeds(negative)
        return {"prompt_embeds": e, "prompt_embeds_mask": m, "negative_prompt_embeds": ne,
                "negative_prompt_embeds_mask": nm}  # fmt: skip

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / patch**2, source=source,
                    pipeline_class="Krea2Pipeline")  # fmt: skip


RECIPE = Recipe("krea-2", setup)
