"""Kandinsky 5 (``kandinsky-5``, ``kandinsky-5-video``): fine-tune ``Kandinsky5Transformer3DModel`` with rectified
flow, calling it as ``Kandinsky5T2IPipeline.__call__`` / ``Kandinsky5T2VPipeline.__call__`` do (diffusers 0.42.1).

The pipelines' denoising step (t2i ``pipeline_kandinsky_t2i.py:690-733``, t2v ``pipeline_kandinsky.py:880-910``):
``hidden_states`` the latents **channel-last** ``(B, F, h, w, C)`` (an image: ``F = 1``; the video transformer's
``visual_cond`` appends a zero condition and a zero mask, ``(B, F, h, w, 2C + 1)``, ``:647-661``),
``encoder_hidden_states`` the Qwen2.5-VL rows, ``pooled_projections`` CLIP-L's pooled output, ``timestep`` the
scheduler's ``t`` = ``1000 sigma``, ``visual_rope_pos`` ``[arange(F), arange(h/2), arange(w/2)]``, ``text_rope_pos``
``arange(L)``, ``scale_factor`` (1, 1, 1) for images and ``_get_scale_factor(H, W)`` for clips ((1, 2, 2) when both
sides are within 480..854 pixels, else (1, 3.16, 3.16)), ``sparse_params`` None (only the NABLA attention of the
"Pro" configs has any: refused). The output is the velocity ``eps - x0`` (``FlowMatchEulerDiscrete``'s ``step``).

The transformer takes **no text mask**: it attends to every text row it is given. ``encode_prompt([caption])``
gives a caption's real rows and nothing else, so each sample is fed its own real rows (the cache's masked rows,
:mod:`pipeline.embed.families.kandinsky5`) with ``text_rope_pos = arange(its length)``: one transformer call per
sample (a batch of padded rows would condition on the pads; groups of equal length would make the processes of a
DDP run call the model different numbers of times, and its per-call buffer broadcast would hang). Latents: the loader
multiplies ``scaling_factor`` in (images: FLUX.1's VAE, **without** its ``shift_factor``, as the pipeline decodes
``latents / scaling_factor``; clips: HunyuanVideo's). ``sigma`` is drawn by the config's density and shifted by the
scheduler's fixed ``shift`` (``timestep_shift: auto``; the pipelines call ``set_timesteps(n)``).

LoRA: the pipelines have ``KandinskyLoraLoaderMixin``: the export loads with ``pipe.load_lora_weights(folder)``.
"""

from __future__ import annotations

import functools
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

__all__ = ["RECIPE", "VIDEO_RECIPE", "LORA_TARGETS", "setup", "model_inputs", "scale_factor", "velocity"]

SPATIAL = 8  # both pipelines' vae_scale_factor_spatial (FLUX.1's and HunyuanVideo's VAEs)
# the attention projections (Kandinsky5Attention: to_query/to_key/to_value, out_layer) of every block
LORA_TARGETS = ("to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer")


def scale_factor(video: bool, h: int, w: int) -> tuple[float, ...]:
    """The RoPE ``scale_factor`` the pipeline passes for a latent grid ``h x w`` (t2i: (1, 1, 1); t2v its
    ``_get_scale_factor`` of the pixel size)."""
    if not video:
        return (1.0, 1.0, 1.0)
    from diffusers import Kandinsky5T2VPipeline

    return Kandinsky5T2VPipeline._get_scale_factor(None, h * SPATIAL, w * SPATIAL)


def model_inputs(latents: torch.Tensor, visual_cond: bool, video: bool) -> dict[str, Any]:
    """The transformer's visual keyword arguments for noisy latents ``(B, C, F, h, w)``: channel-last hidden states
    (with the zero condition and mask when ``visual_cond``), ``visual_rope_pos``, ``scale_factor``."""
    b, c, f, h, w = latents.shape
    hidden = latents.permute(0, 2, 3, 4, 1)  # (B, F, h, w, C)
    if visual_cond:
        hidden = torch.cat([hidden, hidden.new_zeros(b, f, h, w, c + 1)], dim=-1)  # (B, F, h, w, 2C + 1)
    rope = [torch.arange(n, device=latents.device) for n in (f, h // 2, w // 2)]
    return {"hidden_states": hidden, "visual_rope_pos": rope, "scale_factor": scale_factor(video, h, w),
            "sparse_params": None}  # fmt: skip


def velocity(model: torch.nn.Module, latents: torch.Tensor, text: torch.Tensor, counts: torch.Tensor,
             pooled: torch.Tensor, timestep: torch.Tensor, visual_cond: bool, video: bool) -> torch.Tensor:  # fmt: skip
    """The model's output ``(B, C, F, h, w)`` for noisy latents ``(B, C, F, h, w)``, each sample with its own
    ``counts[i]`` real text rows of ``text`` ``(B, L, D)`` and no pad: one call per sample, so that every process
    makes as many calls as its batch has samples (DDP broadcasts buffers at each call: ranks calling it a different
    number of times would wait on each other forever). The model's ``return_dict=False`` returns the tensor itself,
    not a tuple: the output object's ``sample`` is read."""
    out = torch.empty_like(latents)
    for i, n in enumerate(counts.tolist()):
        pred = model(encoder_hidden_states=text[i : i + 1, :n], pooled_projections=pooled[i : i + 1],
                     timestep=timestep[i : i + 1], text_rope_pos=torch.arange(n, device=latents.device),
                     **model_inputs(latents[i : i + 1], visual_cond, video)).sample  # (1, F, h, w, C)
        out[i] = pred[0].permute(3, 0, 1, 2).to(out.dtype)
    return out


def _refuse(cfg: TrainConfig, meta: CacheMeta, family: str, video: bool) -> None:
    latent, layout = meta.latent, meta.text_layout
    if layout.family != family or not layout.masked or layout.pooled_dim is None:
        raise UsageError(f"the cache's text layout is {layout.family}'s, not {family}'s (Qwen2.5-VL real rows and a "
                         f"pooled CLIP-L): embed with --family {family}")  # fmt: skip
    is_video = latent is not None and latent.temporal_factor is not None
    if is_video != video:
        raise UsageError(f"the cache holds {'clip' if is_video else 'image'} latents; {family} trains "
                         f"{'clips' if video else 'images'}: embed with --family {family}")  # fmt: skip
    if video:
        for name, what in (("masked_loss", "weight video latents by loss masks"), ("repa", "have REPA for video"),
                           ("expert", "have two experts (that is wan2.2-a14b)")):  # fmt: skip
            if getattr(cfg, name) is not None:
                raise UsageError(f"config {name}: the {family} recipe does not {what}; remove {name}:")


def setup(cfg: TrainConfig, meta: CacheMeta, family: str = "kandinsky-5") -> Denoiser:
    """The Kandinsky 5 denoiser (``family`` ``kandinsky-5-video``: clips; see the module docstring)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5Transformer3DModel

    video = family == "kandinsky-5-video"
    _refuse(cfg, meta, family, video)
    source = pretrained_source(cfg, meta)
    check_fits(family, Kandinsky5Transformer3DModel, source, cfg)
    transformer = load_pretrained(Kandinsky5Transformer3DModel, source, "transformer")
    config, layout, channels = transformer.config, meta.text_layout, int(meta.latent.channels)
    if config.attention_type == "nabla":
        raise UsageError(f"pretrained {source!r}: its transformer uses NABLA sparse attention (a Kandinsky 5 Pro "
                         f"config), which the {family} recipe does not build; train a Lite (attention_type regular)")
    check_matches("Qwen2.5-VL text width (in_text_dim)", config.in_text_dim, layout.widths[0], source)
    check_matches("CLIP pooled width (in_text_dim2)", config.in_text_dim2, layout.pooled_dim, source)
    check_matches("latent channels (in_visual_dim)", config.in_visual_dim, channels, source)
    check_matches("visual condition (visual_cond)", bool(config.visual_cond), video and bool(config.visual_cond),
                  source)  # an image transformer takes the latents alone  # fmt: skip
    visual_cond = bool(config.visual_cond)
    pt, p = (int(x) for x in config.patch_size[:2])
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=p)  # auto: the scheduler's fixed shift
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        latents = batch.latents if video else batch.latents.unsqueeze(2)  # (B, C, F, h, w)
        _, _, f, h, w = latents.shape
        if f % pt or h % p or w % p:
            raise UsageError(f"bucket {batch.bucket}: latents of {f}x{h}x{w} do not divide into the transformer's "
                             f"{pt}x{p}x{p} patches")  # fmt: skip
        draw = flow_sample(latents, generator, shift=shift.for_bucket(batch.bucket, h, w, *((f,) if video else ())),
                           **flow_options(cfg))  # fmt: skip
        noisy, text, pooled = to_weight_dtype(model, draw.noisy, batch.text, batch.pooled)  # DeepSpeed bf16
        counts = batch.text_mask.sum(1).long().cpu()
        pred = velocity(model, noisy, text, counts, pooled, (draw.sigma.flatten() * 1000.0).to(noisy.dtype),
                        visual_cond, video)  # (B, C, F, h, w)  # fmt: skip
        mask = None if video else mask_weights(batch, masked)  # (B, 1, h, w)
        return flow_loss(pred, draw.target, draw.weight, None if mask is None else mask.unsqueeze(2))

    base = getattr(diffusers, "Kandinsky5T2VPipeline" if video else "Kandinsky5T2IPipeline")

    class Pipeline(base):
        """The pipeline, its output with ``images`` as validation reads it (the t2i output calls them ``image``)."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(*args, **kwargs)
            return out if video or not kwargs.get("return_dict", True) else SimpleNamespace(images=out.image)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        return Pipeline(transformer=model, vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, scheduler=scheduler)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        out = {}
        for prefix, embeds in (("", prompts), ("negative_", negative)):  # the real rows: encode_prompt's
            counts = embeds.mask.sum(1).long()
            out.update({f"{prefix}prompt_embeds_qwen": embeds.embeds[:, : int(counts.max())],
                        f"{prefix}prompt_embeds_clip": embeds.pooled,
                        f"{prefix}prompt_cu_seqlens": torch.nn.functional.pad(counts.cumsum(0), (1, 0)).int()})
        return out

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / (pt * p * p), source=source,
                    lora_targets=LORA_TARGETS, pipeline_class=base.__name__)  # fmt: skip


RECIPE = Recipe("kandinsky-5", setup)
VIDEO_RECIPE = Recipe("kandinsky-5-video", functools.partial(setup, family="kandinsky-5-video"))
