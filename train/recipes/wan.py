"""Wan 2.x text-to-video: fine-tune the pretrained ``WanTransformer3DModel`` with rectified flow on video latents.

As ``WanPipeline`` feeds it: latents ``(B, C, F, h, w)`` (``F`` latent frames; one ``WxHxF`` bucket per batch
makes every clip's shape the same), normalised per channel by the loader, ``(z - latents_mean) / latents_std``
from ``_cache.json``'s ``latent`` (what the pipeline inverts before decoding); the UMT5 states of the caption,
stored as their real tokens only, zero-padded to the layout's length (512, ``max_sequence_length``) as
``WanPipeline._get_t5_prompt_embeds`` pads them, as ``encoder_hidden_states`` ``(B, 512, D)`` with no text
mask. ``x_t = (1 - s) x0 + s eps``, the target ``eps - x0`` at timestep ``1000 s``; ``s`` drawn by the
config's density and shifted as the base scheduler samples (``timestep_shift: auto``: the Wan 2.1 folders'
``UniPCMultistepScheduler`` ``flow_shift``, or a ``FlowMatchEulerDiscreteScheduler``'s ``shift``).

Wan 2.2 (the pipeline folder's ``model_index.json`` says which): ``wan2.2-a14b`` has two experts, ``transformer``
for timesteps ``t >= boundary_ratio * num_train_timesteps`` (high noise) and ``transformer_2`` below; the config's
``expert: high | low`` picks the one a run trains, and its ``s`` are drawn as above and mapped linearly into that
expert's range (``[boundary, 1]`` or ``[0, boundary)``), so it never trains on the other's noise levels. The
low-noise expert's LoRA export loads with ``load_lora_weights(..., load_into_transformer_2=True)``; validation
clips run both experts (the other one as the base model has it). ``wan2.2-ti2v-5b``'s pipeline
(``expand_timesteps``) gives its transformer one timestep per latent token, ``(B, F h w / 4)``: so does the loss.

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

__all__ = ["RECIPE", "A14B_RECIPE", "TI2V_RECIPE", "setup", "pad_text", "load_flow_scheduler"]


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
    family = meta.family or meta.text_layout.family
    if cfg.masked_loss is not None:
        raise UsageError(f"config masked_loss: the {family} recipe does not weight video latents by loss masks yet; "
                         "remove masked_loss:")  # fmt: skip
    if cfg.repa is not None:
        raise UsageError(f"config repa: the {family} recipe has no REPA for video latents yet; remove repa:")
    latent = meta.latent
    if latent is None or latent.temporal_factor is None or latent.latents_mean is None:
        raise UsageError(f"the cache holds no video latents (_cache.json latent.temporal_factor, latents_mean and "
                         f"latents_std): the {family} recipe trains clips embedded with `bucketeer embed --family "
                         f"{family}` from a video manifest")  # fmt: skip
    if cfg.expert is not None and family != "wan2.2-a14b":
        raise UsageError(f"config expert: {cfg.expert}: family {family} has one transformer; expert is for "
                         "wan2.2-a14b: remove expert:")  # fmt: skip
    if cfg.expert is None and family == "wan2.2-a14b":
        raise UsageError("config: family wan2.2-a14b trains one of its two experts per run: set expert: high "
                         "(transformer, the noisy timesteps) or expert: low (transformer_2)")  # fmt: skip


def _wan22(source: str, family: str) -> tuple[float | None, bool]:
    """``(boundary_ratio, expand_timesteps)`` of the pipeline folder ``source`` (its ``model_index.json``).

    Raises UsageError when they are not the family's: a boundary (and ``transformer_2``) for wan2.2-a14b only,
    ``expand_timesteps`` for wan2.2-ti2v-5b only."""
    from diffusers import DiffusionPipeline

    try:
        index = DiffusionPipeline.load_config(source)
    except (OSError, EnvironmentError) as e:
        if family == "wan":  # Wan 2.1 needs only transformer/ and scheduler/
            return None, False
        raise UsageError(f"pretrained {source!r}: cannot read its model_index.json ({e}); pass the {family} diffusers "
                         "pipeline folder or hub id") from None  # fmt: skip
    ratio, expand = index.get("boundary_ratio"), bool(index.get("expand_timesteps"))
    two = ratio is not None and (index.get("transformer_2") or [None])[0] is not None
    is_a14b, is_ti2v = family == "wan2.2-a14b", family == "wan2.2-ti2v-5b"
    if two != is_a14b or expand != is_ti2v:
        kind = "wan2.2-a14b" if two else "wan2.2-ti2v-5b" if expand else "wan"
        raise UsageError(f"pretrained {source!r} is a {kind} pipeline (boundary_ratio {ratio}, expand_timesteps "
                         f"{expand}), the cache's family is {family}: embed with --family {kind}, or train the "
                         f"{family} model")  # fmt: skip
    return (float(ratio) if two else None), expand


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import WanPipeline, WanTransformer3DModel

    _refuse(cfg, meta)
    family = meta.family or meta.text_layout.family
    source = pretrained_source(cfg, meta)
    boundary, expand = _wan22(source, family)
    low = cfg.expert == "low"
    component = "transformer_2" if low else "transformer"
    transformer = load_pretrained(WanTransformer3DModel, source, component)
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
    # the expert's noise levels: the pipeline runs transformer for t >= boundary_ratio * num_train_timesteps, and
    # this recipe's t is 1000 sigma
    edge = None if boundary is None else boundary * scheduler.config.num_train_timesteps / 1000.0
    span = (0.0, 1.0) if edge is None else (0.0, edge) if low else (edge, 1.0)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, _, f, h, w = batch.latents.shape  # (B, C, F, h, w)
        if f % pt or h % ph or w % pw:
            raise UsageError(f"bucket {batch.bucket}: latents of {f}x{h}x{w} (frames x h x w) do not divide into the "
                             f"transformer's {pt}x{ph}x{pw} patches; scan with a --bucket-step that is a multiple "
                             f"of {factor * max(ph, pw)} pixels")  # fmt: skip
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w, f // pt),
                           sigma_range=span, **flow_options(cfg))  # fmt: skip
        noisy, text = to_weight_dtype(model, draw.noisy, pad_text(batch.text, length))  # DeepSpeed bf16
        timestep = draw.sigma.flatten() * 1000.0  # (B,)
        if expand:  # TI2V: one timestep per latent token, as WanPipeline(expand_timesteps=True) gives it
            timestep = timestep[:, None].expand(b, (f // pt) * (h // ph) * (w // pw))
        pred = model(hidden_states=noisy, timestep=timestep, encoder_hidden_states=text,
                     return_dict=False)[0]  # (B, C, F, h, w)  # fmt: skip
        return flow_loss(pred, draw.target, draw.weight)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        experts = {component: model}
        if boundary is not None:  # the other expert as the base model has it, for whole clips; loaded per validation
            other = "transformer" if low else "transformer_2"  # in the trained one's dtype (no fp32 copy of 14B)
            experts[other] = WanTransformer3DModel.from_pretrained(source, subfolder=other,
                                                                   torch_dtype=model.dtype).to(model.device)
        return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, boundary_ratio=boundary,
                           expand_timesteps=expand, **experts)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": pad_text(prompts.embeds, length),
                "negative_prompt_embeds": pad_text(negative.embeds, length)}  # fmt: skip

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / (pt * ph * pw), source=source,
                    pipeline_class="WanPipeline", component=component,
                    lora_load={"load_into_transformer_2": True} if low else {},
                    lora_component="transformer" if low else None)  # fmt: skip


RECIPE = Recipe("wan", setup)
A14B_RECIPE = Recipe("wan2.2-a14b", setup)
TI2V_RECIPE = Recipe("wan2.2-ti2v-5b", setup)
