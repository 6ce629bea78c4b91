"""LongCat-Image: fine-tune the ``LongCatImageTransformer2DModel`` with rectified flow on packed latents.

As ``LongCatImagePipeline.__call__`` feeds it (diffusers 0.42.1, ``pipelines/longcat_image/pipeline_longcat_image.py
:631-655``): latents ``(B, 16, h, w)`` (FLUX.1's VAE: ``(z - shift_factor) * scaling_factor``, done by the loader, the
inverse of the pipeline's decode ``:687``) packed into 2x2 patches (``_pack_latents`` ``:358-363``, Flux's order:
``(B, h/2 w/2, 64)``); the cached 512 Qwen2.5-VL rows as ``encoder_hidden_states`` with **no text mask**;
``txt_ids`` ``prepare_pos_ids(modality_id=0, type="text", num_token=L)`` (``(0, i, i)``, ``:352``) and ``img_ids``
``prepare_pos_ids(modality_id=1, type="image", start=(L, L), ...)`` (``(1, L + y, L + x)``, ``:402-408``), L the
text's rows (``tokenizer_max_length``: 512); ``guidance=None`` (no guidance embedding); the timestep as the noise
level ``sigma`` (the pipeline passes ``t / 1000``; the model scales it by 1000). ``x_t = (1 - s) x0 + s eps`` and
the target ``eps - x0`` (the velocity ``FlowMatchEulerDiscreteScheduler.step`` integrates), packed the same way;
``s`` drawn by the config's density and shifted per bucket by the scheduler's dynamic rule, as ``__call__`` samples
(``calculate_shift`` of ``h/2 * w/2`` tokens, ``:602-614``).

Validation images run the pipeline on the cached embeddings with ``enable_prompt_rewrite=False`` (the rewriter needs
the text encoder and its processor, which a cache replaces) and classifier-free guidance against the empty caption;
its ``encode_prompt`` is wrapped so that ``prompt_embeds`` alone work (0.42.1 takes ``len(None)`` there,
``:341-342``; huggingface/diffusers#13636). LoRA: ``LongCatImagePipeline`` has no ``load_lora_weights`` in diffusers
0.42.1 (``DiffusionPipeline, FromSingleFileMixin`` only, ``:205``; huggingface/diffusers#12859); the export is the
transformer's own format (``save_lora_adapter``) and loads with ``pipe.transformer.load_lora_adapter(folder,
prefix=None, ...)`` (``PeftAdapterMixin``), as the run prints it.
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

__all__ = ["RECIPE", "model_inputs"]


def model_inputs(latents: torch.Tensor, text: torch.Tensor) -> dict[str, Any]:
    """The transformer's keyword arguments for noisy latents ``(B, C, h, w)`` and a batch's text ``(B, L, D)``, as
    ``LongCatImagePipeline.__call__`` builds them (the timestep apart): packed latents, the text and image ids."""
    from diffusers import LongCatImagePipeline
    from diffusers.pipelines.longcat_image.pipeline_longcat_image import prepare_pos_ids

    b, c, h, w = latents.shape
    length = text.shape[1]  # the pipeline's tokenizer_max_length: the image's positions start after the text's
    txt_ids = prepare_pos_ids(modality_id=0, type="text", start=(0, 0), num_token=length)  # (L, 3)
    img_ids = prepare_pos_ids(modality_id=1, type="image", start=(length, length), height=h // 2, width=w // 2)
    return {"hidden_states": LongCatImagePipeline._pack_latents(latents, b, c, h, w), "encoder_hidden_states": text,
            "txt_ids": txt_ids.to(latents.device), "img_ids": img_ids.to(latents.device),
            "guidance": None}  # fmt: skip


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import FlowMatchEulerDiscreteScheduler, LongCatImagePipeline, LongCatImageTransformer2DModel

    layout = meta.text_layout
    if layout.masked or len(layout.lengths) != 1:
        raise UsageError(f"the cache's text is a {layout.family} layout, not LongCat-Image's 512 rows: embed with "
                         "`bucketeer embed --family longcat-image --model ID|PATH`")  # fmt: skip
    source = pretrained_source(cfg, meta)
    check_fits("longcat-image", LongCatImageTransformer2DModel, source, cfg)
    transformer = load_pretrained(LongCatImageTransformer2DModel, source, "transformer")
    channels = int(meta.latent.channels)
    check_matches("text width (joint_attention_dim)", transformer.config.joint_attention_dim, layout.width, source)
    check_matches("packed latent channels (in_channels)", transformer.config.in_channels, 4 * channels, source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=2)  # dynamic: per bucket, 2x2 packed
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = batch.latents.shape
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text = to_weight_dtype(model, draw.noisy, batch.text)  # DeepSpeed bf16: no autocast
        pred = model(**model_inputs(noisy, text), timestep=draw.sigma.flatten().to(noisy.dtype),
                     return_dict=False)[0]  # (B, h/2 w/2, 4C)  # fmt: skip
        mask = mask_weights(batch, masked)  # (B, 1, h, w) -> packed like the latents
        mask = None if mask is None else LongCatImagePipeline._pack_latents(mask.expand(b, c, h, w), b, c, h, w)
        target = LongCatImagePipeline._pack_latents(draw.target, b, c, h, w)
        return flow_loss(pred, target, draw.weight.view(b, 1, 1), mask)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        pipe = LongCatImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                                    text_processor=None, transformer=model)  # fmt: skip
        pipe.tokenizer_max_length = layout.length  # the image ids' start (a cache embedded with --max-text-tokens)
        encode = pipe.encode_prompt

        def encode_cached(prompt: Any = None, num_images_per_prompt: int = 1, prompt_embeds: Any = None) -> Any:
            # 0.42.1's encode_prompt takes len(prompt) even when given prompt_embeds alone (:341-342), which
            # __call__ then does (check_inputs refuses both): a batch of placeholders it never encodes
            if prompt is None and prompt_embeds is not None:
                prompt = [""] * prompt_embeds.shape[0]
            return encode(prompt, num_images_per_prompt, prompt_embeds)

        pipe.encode_prompt = encode_cached
        return pipe

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": prompts.embeds, "negative_prompt_embeds": negative.embeds,
                "enable_prompt_rewrite": False}  # fmt: skip

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / 4, source=source,
                    pipeline_class="LongCatImagePipeline")  # fmt: skip


RECIPE = Recipe("longcat-image", setup)
