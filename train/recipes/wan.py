"""Wan 2.x text-to-video: fine-tune the pretrained ``WanTransformer3DModel`` with rectified flow on video latents.

As ``WanPipeline`` feeds it: latents ``(B, C, F, h, w)`` (``F`` latent frames; one ``WxHxF`` bucket per batch
makes every clip's shape the same), normalised per channel by the loader, ``(z - latents_mean) / latents_std``
from ``_cache.json``'s ``latent`` (what the pipeline inverts before decoding); the UMT5 states of the caption,
stored as their real tokens only, zero-padded to the layout's length (512, ``max_sequence_length``) as
``WanPipeline._get_t5_prompt_embeds`` pads them, as ``encoder_hidden_states`` ``(B, 512, D)`` with no text
mask. ``x_t = (1 - s) x0 + s eps``, the target ``eps - x0`` at timestep ``1000 s``; ``s`` drawn by the
config's density and shifted as the base scheduler samples (``timestep_shift: auto``: the Wan 2.1 folders'
``UniPCMultistepScheduler`` ``flow_shift``, or a ``FlowMatchEulerDiscreteScheduler``'s ``shift``).

Not yet for video: ``masked_loss`` and ``repa`` are refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
from train.config import TrainConfig
from train.model import flow_sample, to_weight_dtype
from train.shift import timestep_shift
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip

__all__ = ["RECIPE", "setup", "pad_text", "load_flow_scheduler"]


def pad_text(text: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, L, D)`` prompt embeddings zero-padded to ``(B, length, D)`` (``L <= length``): what ``WanPipeline``
    gives its transformer, which takes no text mask (so the pad rows are inputs it was trained with)."""
    return torch.nn.functional.pad(text, (0, 0, 0, length - text.shape[1]))


def load_flow_scheduler(source: str) -> Any:
    """The base model's ``scheduler/`` as its own class (``UniPCMultistepScheduler`` for the Wan 2.1 folders).

    Raises UsageError when it does not sample rectified flow (neither flow matching nor flow sigmas with
    ``prediction_type: flow_prediction``): its shift would not be the noise levels this recipe trains.
    """
    import diffusers

    try:  # any scheduler class reads scheduler/scheduler_config.json; its _class_name says which it is
        config = diffusers.FlowMatchEulerDiscreteScheduler.load_config(source, subfolder="scheduler")
    except (OSError, EnvironmentError) as e:
        raise UsageError(f"pretrained {source!r}: cannot read its scheduler/ ({e}); pass the Wan diffusers pipeline "
                         "folder or hub id") from None  # fmt: skip
    name = config.get("_class_name", "")
    cls = getattr(diffusers, name, None)
    flow = name.startswith("FlowMatch") or (config.get("use_flow_sigmas") and
                                            config.get("prediction_type") == "flow_prediction")  # fmt: skip
    if cls is None or not flow:
        raise UsageError(f"pretrained {source!r}: its scheduler/ is {name or 'unknown'} without flow sigmas; the wan "
                         "recipe trains rectified flow: pass a Wan pipeline folder (UniPC with use_flow_sigmas, or "
                         "FlowMatchEulerDiscreteScheduler)")  # fmt: skip
    return cls.from_config(config)


def _refuse(cfg: TrainConfig, meta: CacheMeta) -> None:
    """One line for what the recipe does not train yet, and for a cache of image latents."""
    if cfg.masked_loss is not None:
        raise UsageError("config masked_loss: the wan recipe does not weight video latents by loss masks yet; "
                         "remove masked_loss:")  # fmt: skip
    if cfg.repa is not None:
        raise UsageError("config repa: the wan recipe has no REPA for video latents yet; remove repa:")
    latent = meta.latent
    if latent is None or latent.temporal_factor is None or latent.latents_mean is None:
        raise UsageError("the cache holds no video latents (_cache.json latent.temporal_factor, latents_mean and "
                         "latents_std): the wan recipe trains clips embedded with `bucketeer embed --family wan` "
                         "from a video manifest")  # fmt: skip


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import WanPipeline, WanTransformer3DModel

    _refuse(cfg, meta)
    source = pretrained_source(cfg, meta)
    transformer = load_pretrained(WanTransformer3DModel, source, "transformer")
    layout = meta.text_layout
    channels = int(meta.latent.channels)
    check_matches("text width (text_dim)", transformer.config.text_dim, layout.width, source)
    check_matches("latent channels (in_channels)", transformer.config.in_channels, channels, source)
    check_matches("latent channels (out_channels)", transformer.config.out_channels, channels, source)
    scheduler = load_flow_scheduler(source)
    pt, ph, pw = (int(p) for p in transformer.config.patch_size)
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=ph)  # auto: the scheduler's flow_shift
    length = layout.length  # what WanPipeline pads every caption to (max_sequence_length)
    factor = int(meta.latent.factor or 8)  # pixels per latent pixel

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        _, _, f, h, w = batch.latents.shape  # (B, C, F, h, w)
        if f % pt or h % ph or w % pw:
            raise UsageError(f"bucket {batch.bucket}: latents of {f}x{h}x{w} (frames x h x w) do not divide into the "
                             f"transformer's {pt}x{ph}x{pw} patches; scan with a --bucket-step that is a multiple "
                             f"of {factor * max(ph, pw)} pixels")  # fmt: skip
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w, f // pt),
                           **flow_options(cfg))  # fmt: skip
        noisy, text = to_weight_dtype(model, draw.noisy, pad_text(batch.text, length))  # DeepSpeed bf16
        pred = model(hidden_states=noisy, timestep=draw.sigma.flatten() * 1000.0, encoder_hidden_states=text,
                     return_dict=False)[0]  # (B, C, F, h, w)  # fmt: skip
        return flow_loss(pred, draw.target, draw.weight)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=model)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": pad_text(prompts.embeds, length),
                "negative_prompt_embeds": pad_text(negative.embeds, length)}  # fmt: skip

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / (pt * ph * pw), source=source,
                    pipeline_class="WanPipeline")  # fmt: skip


RECIPE = Recipe("wan", setup)
