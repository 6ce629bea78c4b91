"""Flux 2 (``flux2``) and Flux 2 Klein (``flux2-klein``): fine-tune the ``Flux2Transformer2DModel`` with rectified flow.

As ``Flux2Pipeline`` / ``Flux2KleinPipeline`` feed it: the cache's latents are already what the pipelines give
their transformer (``AutoencoderKLFlux2``'s posterior mean patchified 2x2 and normalised by its batch-norm
statistics: ``(B, 4C, h, w)``, :func:`pipeline.embed.families.flux2.denoiser_latents`), packed to
``(B, h w, 4C)`` (``_pack_latents``), with 4-axis position ids (``_prepare_latent_ids``: ``(0, y, x, 0)``;
``_prepare_text_ids``: ``(0, 0, 0, l)``), the 512 prompt rows as ``encoder_hidden_states`` (no mask), the
timestep as a fraction (the model scales it by 1000) and, for FLUX.2-dev's guidance-distilled transformer
(``guidance_embeds``), the config's ``guidance``; Klein has no guidance embedding (``guidance=None``) and samples
with classifier-free guidance against the empty caption. The target ``eps - x0`` is packed the same way.

The noise levels are shifted as the pipelines sample (``timestep_shift: auto``): ``mu =
compute_empirical_mu(h w, steps)`` of the bucket's token count (``steps`` = the pipelines' default 50
``num_inference_steps``; above 4300 tokens, from about 1.1 megapixels (1024x1088), ``mu`` does not depend on it), then
``exp(mu) t / (1 + (exp(mu) - 1) t)``.
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
from train.recipes.memory import check_fits
from train.config import TrainConfig
from train.masks import MaskedLoss, mask_weights
from train.model import flow_sample, to_weight_dtype
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip
from train.shift import timestep_shift

__all__ = ["RECIPE", "KLEIN_RECIPE", "SAMPLING_STEPS", "LORA_TARGETS", "empirical_mu"]

SAMPLING_STEPS = 50  # Flux2Pipeline's and Flux2KleinPipeline's default num_inference_steps
# the double-stream blocks' attention projections (image and text), and the single-stream blocks' fused
# q/k/v/MLP input projection (their output projection shares a name with the double blocks' to_out list)
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "to_qkv_mlp_proj")  # fmt: skip


def empirical_mu(tokens: int) -> float:
    """The pipelines' ``mu`` for ``tokens`` image tokens at :data:`SAMPLING_STEPS` steps."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return compute_empirical_mu(image_seq_len=tokens, num_steps=SAMPLING_STEPS)


def _setup(cfg: TrainConfig, meta: CacheMeta, *, pipeline_class: str) -> Denoiser:
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    pipeline_type = getattr(diffusers, pipeline_class)
    source = pretrained_source(cfg, meta)
    # FLUX.2-dev's 32B transformer fits one 80 GB GPU in no mode (fp32 weights): refused before loading
    check_fits("flux2-klein" if "Klein" in pipeline_class else "flux2", Flux2Transformer2DModel, source, cfg)
    transformer = load_pretrained(Flux2Transformer2DModel, source, "transformer")
    layout = meta.text_layout
    check_matches("text width (joint_attention_dim)", transformer.config.joint_attention_dim, layout.width, source)
    check_matches("latent channels (in_channels: 2x2 patches of the VAE's)", transformer.config.in_channels,
                  int(meta.latent.channels), source)  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    # the cached latents are patchified already: one token per latent position
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=1, mu_rule=empirical_mu)
    guidance_embeds = bool(transformer.config.guidance_embeds)
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, h, w = batch.latents.shape  # (B, 4C, h, w)
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        device = batch.latents.device
        img_ids = pipeline_type._prepare_latent_ids(batch.latents).to(device)  # (B, h w, 4)
        txt_ids = pipeline_type._prepare_text_ids(batch.text).to(device)  # (B, L, 4)
        guidance = torch.full((b,), float(cfg.guidance), device=device) if guidance_embeds else None
        packed, text = to_weight_dtype(model, pipeline_type._pack_latents(draw.noisy), batch.text)  # DeepSpeed bf16
        pred = model(hidden_states=packed, timestep=draw.sigma.flatten(), guidance=guidance,
                     encoder_hidden_states=text, txt_ids=txt_ids, img_ids=img_ids,
                     return_dict=False)[0]  # (B, h w, 4C)  # fmt: skip
        mask = mask_weights(batch, masked)  # (B, 1, h, w) -> packed like the latents: (B, h w, 4C)
        mask = None if mask is None else pipeline_type._pack_latents(mask.expand(b, c, h, w))
        return flow_loss(pred, pipeline_type._pack_latents(draw.target), draw.weight.view(b, 1, 1), mask)

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        if getattr(vae, "bn", None) is None:
            raise UsageError(f"the cache's VAE is a {type(vae).__name__}; {pipeline_class} decodes with an "
                             "AutoencoderKLFlux2 (embed with --family flux2 or flux2-klein)")  # fmt: skip
        return pipeline_type(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=model)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        if guidance_embeds:  # FLUX.2-dev: the guidance embedding steers, no negative prompt
            return {"prompt_embeds": prompts.embeds}
        return {"prompt_embeds": prompts.embeds, "negative_prompt_embeds": negative.embeds}

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1.0, lora_targets=LORA_TARGETS,
                    source=source, pipeline_class=pipeline_class)  # fmt: skip


RECIPE = Recipe("flux2", lambda cfg, meta: _setup(cfg, meta, pipeline_class="Flux2Pipeline"))
KLEIN_RECIPE = Recipe("flux2-klein", lambda cfg, meta: _setup(cfg, meta, pipeline_class="Flux2KleinPipeline"))
