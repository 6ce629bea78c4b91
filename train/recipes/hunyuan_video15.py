"""HunyuanVideo 1.5 text-to-video: fine-tune ``HunyuanVideo15Transformer3DModel`` with rectified flow on clips.

As ``HunyuanVideo15Pipeline``'s denoising step calls it: ``hidden_states`` is ``cat([x_t, cond, mask], dim=1)``
``(B, 2C + 1, F, h, w)`` with the image-to-video condition and its mask zeros (t2v), ``image_embeds`` zeros
``(B, 729, image_embed_dim)`` (the transformer then masks the image tokens out), ``timestep`` ``1000 sigma``
``(B,)``, and the two text streams each with its own mask, zero-padded to the pipeline's lengths (Qwen2.5-VL
1000, ByT5 256: :meth:`manifests.cache.text_layout.TextLayout.streams`). Latents ``mean * scaling_factor`` (the
loader scales them); ``x_t = (1 - sigma) x0 + sigma eps``, the target ``eps - x0`` (``FlowMatchEulerDiscrete``'s
``step`` adds ``(sigma_next - sigma) * prediction``); ``sigma`` drawn by the config's density and shifted by the
scheduler's ``shift`` (``timestep_shift: auto``).

LoRA: diffusers 0.42.1's pipeline has no ``load_lora_weights``; the export is written by the transformer's own
``save_lora_adapter`` and loads with ``pipe.transformer.load_lora_adapter(folder, prefix=None, ...)`` (the run
prints the lines). The last block's text-side output layers (``attn.to_add_out``, ``ff_context``) are frozen: the
model drops that block's text states, so they get no gradient (a full fine-tune under DDP would stop on them).
Not yet: ``masked_loss``, ``repa``, image-to-video (refused in one line).
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
from train.config import TrainConfig
from train.model import flow_sample, to_weight_dtype
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip
from train.recipes.wan import load_flow_scheduler
from train.shift import timestep_shift

__all__ = ["RECIPE", "setup", "IMAGE_TOKENS"]

IMAGE_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: the zero image_embeds of t2v


def _refuse(cfg: TrainConfig, meta: CacheMeta) -> None:
    """One line for what the recipe does not train, and for a cache that is not this family's clips."""
    for name, what in (("masked_loss", "weight video latents by loss masks"), ("repa", "have REPA for video"),
                       ("expert", "have two experts (that is wan2.2-a14b)")):  # fmt: skip
        if getattr(cfg, name) is not None:
            raise UsageError(f"config {name}: the hunyuanvideo-1.5 recipe does not {what}; remove {name}:")
    latent, layout = meta.latent, meta.text_layout
    if latent is None or latent.temporal_factor is None:
        raise UsageError("the cache holds no video latents (_cache.json latent.temporal_factor): the "
                         "hunyuanvideo-1.5 recipe trains clips embedded with `bucketeer embed --family "
                         "hunyuanvideo-1.5` from a video manifest")  # fmt: skip
    if layout.join != "streams" or len(layout.widths) != 2:
        raise UsageError(f"the cache's text layout is {layout.family}'s ({layout.join}), not HunyuanVideo 1.5's two "
                         "streams: embed with --family hunyuanvideo-1.5")  # fmt: skip


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    _refuse(cfg, meta)
    source = pretrained_source(cfg, meta)
    transformer = load_pretrained(HunyuanVideo15Transformer3DModel, source, "transformer")
    last = transformer.transformer_blocks[-1]  # its text outputs are dropped: no gradient reaches these (DDP
    for unused in (last.attn.to_add_out, last.ff_context):  # requires every trained parameter to get one)
        unused.requires_grad_(False)
    layout, channels = meta.text_layout, int(meta.latent.channels)
    config = transformer.config
    check_matches("Qwen2.5-VL text width (text_embed_dim)", config.text_embed_dim, layout.widths[0], source)
    check_matches("ByT5 text width (text_embed_2_dim)", config.text_embed_2_dim, layout.widths[1], source)
    check_matches("latent channels (in_channels)", config.in_channels, 2 * channels + 1, source)
    check_matches("latent channels (out_channels)", config.out_channels, channels, source)
    scheduler = load_flow_scheduler(source)
    pt, p = int(config.patch_size_t), int(config.patch_size)
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=p)  # auto: the scheduler's shift

    def inputs(latents: torch.Tensor, text: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        """The transformer's keyword arguments besides ``timestep``, as the pipeline's step gives them."""
        b, _, f, h, w = latents.shape
        (e, m), (e2, m2) = layout.streams(text, mask.to(text.dtype))
        zeros = latents.new_zeros(b, channels + 1, f, h, w)  # the t2v condition latents and their mask
        image = latents.new_zeros(b, IMAGE_TOKENS, config.image_embed_dim)
        return {"hidden_states": torch.cat([latents, zeros], dim=1), "image_embeds": image,
                "encoder_hidden_states": e, "encoder_attention_mask": m, "encoder_hidden_states_2": e2,
                "encoder_attention_mask_2": m2}  # fmt: skip

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        _, _, f, h, w = batch.latents.shape  # (B, C, F, h, w)
        if f % pt or h % p or w % p:
            raise UsageError(f"bucket {batch.bucket}: latents of {f}x{h}x{w} do not divide into the transformer's "
                             f"{pt}x{p}x{p} patches")  # fmt: skip
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w, f // pt),
                           **flow_options(cfg))  # fmt: skip
        noisy, text = to_weight_dtype(model, draw.noisy, batch.text)  # DeepSpeed bf16
        pred = model(timestep=draw.sigma.flatten() * 1000.0, return_dict=False,
                     **inputs(noisy, text, batch.text_mask.to(noisy.device)))[0]  # (B, C, F, h, w)  # fmt: skip
        return flow_loss(pred, draw.target, draw.weight)

    class Pipeline(HunyuanVideo15Pipeline):
        """The pipeline, taking validation's ``guidance_scale`` (it reads its scale from its ``guider``)."""

        def __call__(self, *args: Any, guidance_scale: float | None = None, **kwargs: Any) -> Any:
            if guidance_scale is not None:
                self.guider = ClassifierFreeGuidance.from_config(self.guider.config, guidance_scale=guidance_scale)
            return super().__call__(*args, **kwargs)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        try:
            guider = ClassifierFreeGuidance.from_pretrained(source, subfolder="guider")
        except (OSError, EnvironmentError, ValueError):  # a folder without guider/: the pipeline's default CFG
            guider = ClassifierFreeGuidance()
        return Pipeline(text_encoder=None, tokenizer=None, transformer=model, vae=vae, scheduler=scheduler,
                        text_encoder_2=None, tokenizer_2=None, guider=guider)  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        out = {}
        for prefix, embeds in (("", prompts), ("negative_", negative)):
            (e, m), (e2, m2) = layout.streams(embeds.embeds, embeds.mask.to(embeds.embeds.dtype))
            out.update({f"{prefix}prompt_embeds": e, f"{prefix}prompt_embeds_mask": m,
                        f"{prefix}prompt_embeds_2": e2, f"{prefix}prompt_embeds_mask_2": m2})  # fmt: skip
        return out

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / (pt * p * p), source=source,
                    pipeline_class="HunyuanVideo15Pipeline", component="transformer")  # fmt: skip


RECIPE = Recipe("hunyuanvideo-1.5", setup)
