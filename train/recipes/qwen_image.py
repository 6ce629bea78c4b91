"""Qwen-Image: fine-tune the pretrained ``QwenImageTransformer2DModel`` with rectified flow on packed latents.

As ``QwenImagePipeline.__call__`` feeds it: latents ``(B, C, h, w)``, stored already normalised per channel
(``_cache.json`` ``latent.normalised``: what the pipeline's denoiser sees), packed into 2x2 patches
(``QwenImagePipeline._pack_latents``: ``(B, h/2 * w/2, 4C)``), ``img_shapes`` ``[[(1, h/2, w/2)]] * B`` for the
image RoPE, the Qwen2.5-VL rows as ``encoder_hidden_states`` with ``encoder_hidden_states_mask`` (zeros past
each caption's rows; None when no caption is padded, as ``encode_prompt`` drops an all-ones mask: the text
RoPE follows the padded length), the timestep as the noise level ``sigma`` (the pipeline passes ``t / 1000``).
``x_t = (1 - s) x0 + s eps`` and the target ``eps - x0`` (the velocity ``FlowMatchEulerDiscreteScheduler.step``
integrates), packed the same way; ``s`` drawn by the config's density and shifted per bucket with the
scheduler's dynamic rule (``mu`` of the bucket's ``h/2 * w/2`` tokens; Qwen-Image: base 0.5 at 256 tokens, max
0.9 at 8192), as the pipeline samples that size.

The last block's text output is discarded by the model, so its ``attn.to_add_out`` and ``txt_mlp`` never get a
gradient; they are frozen (what a single process does to them anyway: AdamW skips a parameter without a
gradient), since DDP refuses a trained parameter that takes no part in the loss.

Qwen-Image-Edit (``qwen-image-edit``): the same transformer called as ``QwenImageEditPipeline.__call__`` calls it:
the packed noisy latents followed on the sequence by the packed reference latents (the record's ``cond_latent``,
stored normalised, at the reference's own grid), ``img_shapes`` ``[(1, h/2, w/2), (1, h'/2, w'/2)]`` per sample,
the text of (instruction, reference) with its mask; the prediction is the output's first ``h/2 * w/2`` tokens
(``noise_pred[:, : latents.size(1)]``), so the loss is on the target's tokens only. The shift is the target's
(the pipeline's ``mu`` is of ``latents.shape[1]``, the noisy tokens). Caption dropout and validation images are
refused: the empty instruction's embedding and a validation prompt both need a reference image.
"""

from __future__ import annotations

import functools
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

__all__ = ["RECIPE", "EDIT_RECIPE", "setup", "model_inputs"]


def model_inputs(latents: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor,
                 reference: torch.Tensor | None = None) -> dict[str, Any]:  # fmt: skip
    """The transformer's keyword arguments for noisy latents ``(B, C, h, w)`` and a batch's text ``(B, L, D)``
    with its mask ``(B, L)``, as ``QwenImagePipeline.__call__`` builds them (the timestep apart); with the
    ``reference`` latents ``(B, C, h', w')``, as ``QwenImageEditPipeline.__call__`` does (packed after them)."""
    from diffusers import QwenImagePipeline

    b, c, h, w = latents.shape
    hidden, shapes = QwenImagePipeline._pack_latents(latents, b, c, h, w), [(1, h // 2, w // 2)]  # (B, h/2 * w/2, 4C)
    if reference is not None:
        rh, rw = reference.shape[-2:]
        hidden = torch.cat([hidden, QwenImagePipeline._pack_latents(reference, b, c, rh, rw)], dim=1)
        shapes.append((1, rh // 2, rw // 2))
    return {"hidden_states": hidden, "encoder_hidden_states": text, "img_shapes": [shapes] * b,
            "encoder_hidden_states_mask": None if bool(text_mask.all()) else text_mask}  # fmt: skip


def _refuse(cfg: TrainConfig, meta: CacheMeta, family: str) -> None:
    latent = meta.latent
    if latent is None or "normalised" not in latent._extra:
        raise UsageError("the cache's latents are not Qwen-Image's normalised ones (_cache.json latent.normalised): "
                         f"embed with `bucketeer embed --family {family} --model ID|PATH`")  # fmt: skip
    if family != "qwen-image-edit":
        return
    if meta.settings.conditioning is None:
        raise UsageError("qwen-image-edit trains on (target, reference) pairs and the cache has no reference "
                         "latents: embed a manifest scanned with --conditioning")  # fmt: skip
    if cfg.validation_every:
        raise UsageError(f"config validation_every {cfg.validation_every}: qwen-image-edit's validation images "
                         "would need a reference image per prompt, which the cache does not hold; set "
                         "validation_every: 0")  # fmt: skip


def setup(cfg: TrainConfig, meta: CacheMeta, family: str = "qwen-image") -> Denoiser:
    """The Qwen-Image (``family`` ``qwen-image-edit``: Qwen-Image-Edit) denoiser (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    _refuse(cfg, meta, family)
    edit = family == "qwen-image-edit"
    source = pretrained_source(cfg, meta)
    check_fits(family, QwenImageTransformer2DModel, source, cfg)
    transformer = load_pretrained(QwenImageTransformer2DModel, source, "transformer")
    last = transformer.transformer_blocks[-1]  # its text stream's output is never read: no gradient reaches
    for module in (last.attn.to_add_out, last.txt_mlp):  # these, and DDP refuses parameters that get none
        module.requires_grad_(False)
    layout, channels = meta.text_layout, int(meta.latent.channels)
    check_matches("text width (joint_attention_dim)", transformer.config.joint_attention_dim, layout.width, source)
    check_matches("packed latent channels (in_channels)", transformer.config.in_channels, 4 * channels, source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=2)  # dynamic: per bucket, 2x2 packed
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = batch.latents.shape
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text, reference = to_weight_dtype(model, draw.noisy, batch.text, batch.cond_latents if edit else None)
        pred = model(**model_inputs(noisy, text, batch.text_mask, reference),
                     timestep=draw.sigma.flatten().to(noisy.dtype), return_dict=False)[0]  # fmt: skip
        pred = pred[:, : (h // 2) * (w // 2)]  # (B, h/2 * w/2, 4C): the target's tokens (edit: the reference's after)
        mask = mask_weights(batch, masked)  # (B, 1, h, w) -> packed like the latents
        mask = None if mask is None else QwenImagePipeline._pack_latents(mask.expand(b, c, h, w), b, c, h, w)
        target = QwenImagePipeline._pack_latents(draw.target, b, c, h, w)
        return flow_loss(pred, target, draw.weight.view(b, 1, 1), mask)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        if edit:
            from diffusers import QwenImageEditPipeline

            return QwenImageEditPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                                         processor=None, transformer=model)  # fmt: skip
        return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=model)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        # true classifier-free guidance with the empty caption (true_cfg_scale: the pipeline's default 4.0)
        return {"prompt_embeds": prompts.embeds, "prompt_embeds_mask": prompts.mask,
                "negative_prompt_embeds": negative.embeds, "negative_prompt_embeds_mask": negative.mask}

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / 4, source=source,
                    pipeline_class="QwenImageEditPipeline" if edit else "QwenImagePipeline")  # fmt: skip


RECIPE = Recipe("qwen-image", setup)
EDIT_RECIPE = Recipe("qwen-image-edit", functools.partial(setup, family="qwen-image-edit"))
