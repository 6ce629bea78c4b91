"""Qwen-Image 2.1: fine-tune the pretrained ``QwenImage21Transformer2DModel`` with rectified flow on unpatched latents.

As ``QwenImage21Pipeline.__call__`` (diffusers 0.42.1, ``pipelines/qwenimage21/pipeline_qwenimage21.py``) feeds it
for text to image: latents ``(B, 64, h, w)`` of the 16x VAE, stored already normalised per channel (``_cache.json``
``latent.normalised``), flattened to ``(B, h*w, 64)`` (``_pack_latents``, ``:416-418``: the transformer has
patch 1); ``img_shapes`` ``[[(1, h, w)]] * B``; ``img_mask`` ``(B, L + h*w/4)``: False on the text, then one True
slot per 2x2 group of target latents (``append_target_slots``, ``:752-755``); the text rows as
``encoder_hidden_states`` with ``encoder_hidden_states_mask`` (None when no caption is padded, as
``encode_prompt`` drops an all-ones mask); the timestep as the noise level ``sigma`` (the pipeline passes
``t / 1000``); the prediction is the output's last ``h*w`` rows (``:796``). ``x_t = (1 - s) x0 + s eps`` and the
target ``eps - x0`` (the velocity ``FlowMatchEulerDiscreteScheduler.step`` integrates); ``s`` drawn by the config's
density and shifted per bucket with the scheduler's dynamic rule (``mu`` of the bucket's ``h*w`` tokens; the
pipeline's fallbacks: base 0.5 at 256 tokens, max 1.15 at 4096, ``:732-745``), as the pipeline samples that size.

**Padding matters here.** The joint sequence is ``[text rows, target latents]`` and ``QwenImage21Rope`` gives the
target image the frame position reached by the text, i.e. the **padded** text length: a caption in a padded
batch sees its image at another position than alone. The pipeline pads a batch's rows on the right to the
longest caption (``:327-337``) and the trainer builds exactly that batch from the cache's real rows
(``TextLayout.prompt_embeds``: zeros past each caption's rows, mask 1 on them, the batch's longest length, never
a fixed length), so a step sees the positions ``pipeline(prompt=captions)`` would; a batch of one caption (or of
equal lengths) sees those of inference on one prompt. The encoder's own left padding is not the transformer's
and leaves nothing behind (the cache holds each caption's unpadded rows).

The transformer is block-causal with ``causal_condition``: text tokens are modulated at t = 0 and see only earlier
text; the KV cache is an inference shortcut and takes no part in training. Validation images come from the
pipeline with the cached prompt embeddings and no guidance (``true_cfg_scale`` 1.0, the pipeline's default: 2.1
is sampled without it; the config's ``validation_guidance`` is not used).
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

__all__ = ["RECIPE", "setup", "model_inputs", "pack"]

FAMILY = "qwen-image-2.1"


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h*w, C)``: ``QwenImage21Pipeline._pack_latents`` (a plain spatial flatten)."""
    from diffusers import QwenImage21Pipeline

    b, c, h, w = latents.shape
    return QwenImage21Pipeline._pack_latents(latents, b, c, h, w)


def model_inputs(latents: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor) -> dict[str, Any]:
    """The transformer's keyword arguments for noisy latents ``(B, C, h, w)`` and a batch's text ``(B, L, D)`` with
    its mask ``(B, L)``, as ``QwenImage21Pipeline.__call__`` builds them for text to image (the timestep apart)."""
    b, _, h, w = latents.shape
    # encode_prompt's image_pad_mask (no image token in a text prompt), then one slot per 2x2 target latents
    img_mask = torch.cat([torch.zeros(b, text.shape[1], dtype=torch.bool, device=text.device),
                          torch.ones(b, h * w // 4, dtype=torch.bool, device=text.device)], dim=1)  # fmt: skip
    return {"hidden_states": pack(latents), "encoder_hidden_states": text, "img_shapes": [[(1, h, w)]] * b,
            "img_mask": img_mask, "encoder_hidden_states_mask": None if bool(text_mask.all()) else text_mask}


class _TextProcessor:
    """What ``QwenImage21Pipeline.__init__`` reads of its ``processor`` (the system message's token count, the
    ``<|image_pad|>`` id), from the folder's tokenizer: sampling from cached prompt embeddings reads nothing else,
    and transformers builds no ``Qwen3VLProcessor`` without torchvision."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def apply_chat_template(self, conversation: Any, tokenize: bool = False, return_dict: bool = False) -> Any:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
        return [self.tokenizer(text).input_ids] if tokenize else text


@functools.cache
def _sampling_class() -> type:
    from diffusers import QwenImage21Pipeline

    class QwenImage21Sampling(QwenImage21Pipeline):
        """``QwenImage21Pipeline`` as validation calls it: ``guidance_scale`` (which it has no use for) dropped."""

        def __call__(self, *args: Any, guidance_scale: float | None = None, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    return QwenImage21Sampling


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    """The Qwen-Image 2.1 denoiser (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    latent = meta.latent
    if latent is None or "normalised" not in latent._extra or latent.factor != 16:
        raise UsageError("the cache's latents are not Qwen-Image 2.1's (16x, normalised per channel: _cache.json "
                         f"latent.normalised): embed with `bucketeer embed --family {FAMILY} --model ID|PATH`")
    source = pretrained_source(cfg, meta)
    check_fits(FAMILY, QwenImage21Transformer2DModel, source, cfg)
    transformer = load_pretrained(QwenImage21Transformer2DModel, source, "transformer")
    check_matches("text width (context_in_dim)", transformer.config.context_in_dim, meta.text_layout.width, source)
    check_matches("latent channels (in_channels)", transformer.config.in_channels, int(latent.channels), source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=1)  # dynamic: per bucket, one token a latent
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = batch.latents.shape
        if h % 2 or w % 2:
            raise UsageError(f"bucket {batch.bucket}: Qwen-Image 2.1 groups latents 2x2, so image sides must be "
                             "multiples of 32 pixels; scan with a --bucket-step that is a multiple of 32")
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text = to_weight_dtype(model, draw.noisy, batch.text)
        pred = model(**model_inputs(noisy, text, batch.text_mask), timestep=draw.sigma.flatten().to(noisy.dtype),
                     return_dict=False)[0][:, -h * w:]  # fmt: skip # (B, h*w, C): the target's rows
        mask = mask_weights(batch, masked)  # (B, 1, h, w) -> packed like the latents
        mask = None if mask is None else pack(mask.expand(b, c, h, w))
        return flow_loss(pred, pack(draw.target), draw.weight.view(b, 1, 1), mask)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        from transformers import AutoTokenizer

        processor = _TextProcessor(AutoTokenizer.from_pretrained(source, subfolder="processor"))
        return _sampling_class()(scheduler=scheduler, vae=vae, text_encoder=None, processor=processor,
                                 transformer=model)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": prompts.embeds, "prompt_embeds_mask": prompts.mask}  # no guidance (see above)

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1.0, source=source,
                    pipeline_class="QwenImage21Pipeline")  # fmt: skip


RECIPE = Recipe(FAMILY, setup)
