"""Anima: fine-tune the pretrained ``CosmosTransformer3DModel`` with rectified flow, as ``AnimaModularPipeline`` runs
it.

The modular pipeline's denoise loop (diffusers 0.42.1, ``d/modular_pipelines/anima/denoise.py:44-50,139-146``) calls
the transformer with ``hidden_states`` the latents as 1-frame clips ``(B, 16, 1, h, w)`` (Qwen-Image's VAE, stored
normalised ``(z - mean) / std`` per channel, as ``encoders.py:encode_vae_image`` and the decoder's inverse
``decoders.py:55-63`` say), ``timestep`` ``t / num_train_timesteps`` = the noise level ``sigma``,
``encoder_hidden_states`` the frozen LLM adapter's output (the cache's rows, zero-padded to the adapter's
``min_sequence_length``, 512, as ``AnimaTextConditioner.forward`` pads them; no text mask) and ``padding_mask`` zeros
``(1, 1, H, W)`` at pixel size (``before_denoise.py:483-485``), which the model resizes to the latent grid and
concatenates as a 17th input channel. Its output is the velocity ``eps - x0`` that ``FlowMatchEulerDiscreteScheduler
.step`` integrates; ``x_t = (1 - s) x0 + s eps``, ``s`` drawn by the config's density and shifted by the
scheduler's fixed ``shift`` (3.0 as the conversion script writes it), as ``set_timesteps(sigmas=...)`` shifts the
pipeline's ``linspace(1, 1/n, n)``.

The adapter (``AnimaTextConditioner``) ran at embed (:mod:`pipeline.embed.families.anima`), so it is frozen here: a
run trains the transformer only, and its LoRA export holds ``transformer.`` keys, which
``AnimaModularPipeline.load_lora_weights`` (``AnimaLoraLoaderMixin``) loads. Validation images run the pipeline's own
blocks from the text input step on (``AnimaTextInputStep`` ... ``AnimaDecodeStep``) with the cached prompt embeddings.

``CosmosTransformer3DModel`` resizes the padding mask with ``torchvision.transforms.functional.resize`` (nearest),
and torchvision is not a bucketeer dependency: :func:`resize_without_torchvision` gives the module torchvision's
tensor path (``torch.nn.functional.interpolate``, mode nearest) where torchvision is absent; the mask is zeros, so
the resized mask is zeros either way.
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

__all__ = ["RECIPE", "setup", "model_inputs", "pad_text", "resize_without_torchvision", "sampler"]

TEXT_ROWS = 512  # AnimaTextConditioner's min_sequence_length default, where the folder's config does not say


def resize_without_torchvision() -> None:
    """Where torchvision is absent, give ``diffusers.models.transformers.transformer_cosmos`` the one piece of it
    that ``CosmosTransformer3DModel.forward`` calls: ``transforms.functional.resize(x, size, InterpolationMode.
    NEAREST)``, computed as torchvision computes it on a tensor (``interpolate(x, size, mode="nearest")``)."""
    import enum

    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"

    def resize(x: torch.Tensor, size: list[int], interpolation: Any = InterpolationMode.NEAREST, **_: Any):
        return torch.nn.functional.interpolate(x, size=list(size), mode=InterpolationMode(interpolation).value)

    transformer_cosmos.transforms = SimpleNamespace(InterpolationMode=InterpolationMode,
                                                    functional=SimpleNamespace(resize=resize))  # fmt: skip


def pad_text(text: torch.Tensor, rows: int) -> torch.Tensor:
    """``(B, L, D)`` cached adapter rows zero-padded to ``(B, max(L, rows), D)``, as ``AnimaTextConditioner`` pads."""
    return torch.nn.functional.pad(text, (0, 0, 0, max(0, rows - text.shape[1])))


def model_inputs(latents: torch.Tensor, text: torch.Tensor, factor: int) -> dict[str, Any]:
    """The transformer's keyword arguments for noisy latents ``(B, C, h, w)`` and the padded text ``(B, L, D)``, the
    timestep apart, as the pipeline's denoise loop builds them (``factor``: the VAE's, for the pixel-size mask)."""
    h, w = latents.shape[-2:]
    return {"hidden_states": latents.unsqueeze(2), "encoder_hidden_states": text,
            "padding_mask": latents.new_zeros(1, 1, h * factor, w * factor)}  # fmt: skip


def _text_rows(source: str) -> int:
    from diffusers import AnimaTextConditioner

    try:
        return int(AnimaTextConditioner.load_config(source, subfolder="text_conditioner").get("min_sequence_length",
                                                                                               TEXT_ROWS))
    except (OSError, EnvironmentError):
        return TEXT_ROWS


def sampler(model: torch.nn.Module, vae: Any, scheduler: Any, rows: int) -> Any:
    """An object that samples as the validation loop calls a pipeline (``set_progress_bar_config``, ``__call__`` with
    ``prompt_embeds``, ``negative_prompt_embeds``, ``guidance_scale``, ``output_type`` -> ``.images``), running
    ``AnimaModularPipeline``'s own blocks after its text conditioning on the cached embeddings."""
    from diffusers import ClassifierFreeGuidance, SequentialPipelineBlocks
    from diffusers.modular_pipelines.anima.before_denoise import (AnimaPrepareLatentsStep, AnimaSetTimestepsStep,
                                                                  AnimaTextInputStep)  # fmt: skip
    from diffusers.modular_pipelines.anima.denoise import AnimaDenoiseStep
    from diffusers.modular_pipelines.anima.modular_blocks_anima import AnimaDecodeStep

    resize_without_torchvision()
    blocks = SequentialPipelineBlocks.from_blocks_dict({"input": AnimaTextInputStep(),
                                                        "prepare_latents": AnimaPrepareLatentsStep(),
                                                        "set_timesteps": AnimaSetTimestepsStep(),
                                                        "denoise": AnimaDenoiseStep(), "decode": AnimaDecodeStep()})
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=model, vae=vae, scheduler=scheduler)

    class Sampler:
        def set_progress_bar_config(self, **kwargs: Any) -> None:
            pipe.set_progress_bar_config(**kwargs)

        def __call__(self, prompt_embeds, negative_prompt_embeds, guidance_scale=4.0, output_type="pil", **kwargs):
            pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
            images = pipe(prompt_embeds=pad_text(prompt_embeds, rows),
                          negative_prompt_embeds=pad_text(negative_prompt_embeds, rows), output_type=output_type,
                          output="images", **kwargs)  # fmt: skip
            return SimpleNamespace(images=images)

    return Sampler()


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    """The Anima denoiser (see the module docstring)."""
    from diffusers import CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler

    if meta.latent is None or "normalised" not in meta.latent._extra:
        raise UsageError("the cache's latents are not Qwen-Image's normalised ones (_cache.json latent.normalised): "
                         "embed with `bucketeer embed --family anima --model ID|PATH`")  # fmt: skip
    resize_without_torchvision()
    source = pretrained_source(cfg, meta)
    check_fits("anima", CosmosTransformer3DModel, source, cfg)
    transformer = load_pretrained(CosmosTransformer3DModel, source, "transformer")
    layout, channels, factor = meta.text_layout, int(meta.latent.channels), int(meta.latent.factor)
    check_matches("text width (text_embed_dim)", transformer.config.text_embed_dim, layout.width, source)
    check_matches("latent channels (in_channels)", transformer.config.in_channels, channels, source)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    patch = int(transformer.config.patch_size[-1])
    shift = timestep_shift(cfg.timestep_shift, scheduler.config, patch=patch)  # auto: the fixed shift (3.0)
    rows = _text_rows(source)
    masked = MaskedLoss.from_config(cfg.masked_loss)

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        _, _, h, w = batch.latents.shape
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, h, w), **flow_options(cfg))
        noisy, text = to_weight_dtype(model, draw.noisy, pad_text(batch.text, rows))  # DeepSpeed bf16: no autocast
        pred = model(**model_inputs(noisy, text, factor), timestep=draw.sigma.flatten().to(noisy.dtype),
                     return_dict=False)[0].squeeze(2)  # (B, C, h, w): the velocity
        return flow_loss(pred, draw.target, draw.weight, mask_weights(batch, masked))

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        return sampler(model, vae, scheduler, rows)

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        return {"prompt_embeds": prompts.embeds, "negative_prompt_embeds": negative.embeds}  # CFG (guider, 4.0)

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / patch**2, source=source,
                    pipeline_class="AnimaModularPipeline")  # fmt: skip


RECIPE = Recipe("anima", setup)
