"""LTX-2 (``ltx-2``): fine-tune the video stream of ``LTX2VideoTransformer3DModel`` with rectified flow; the audio
stream is fed as the pipeline feeds it at its first step (pure noise) and not trained.

As ``LTX2Pipeline.__call__``'s denoising step calls the transformer: the clip's latents ``(B, C, F, h, w)``
(stored normalised by ``_normalize_latents``: nothing to scale) noised, ``x_t = (1 - s) x0 + s eps``, packed to
tokens with ``_pack_latents`` (patch 1: ``(B, F h w, C)``); ``timestep = sigma = 1000 s`` per sample; the text
through the pipeline's own frozen ``LTX2TextConnectors`` (the cached Gemma rows put back on the left of 1024 rows,
:func:`pipeline.embed.families.ltx2.left_pad`) as ``encoder_hidden_states`` / ``audio_encoder_hidden_states`` and
their mask for both; ``video_coords`` / ``audio_coords`` from the transformer's own ``rope.prepare_video_coords``
(at ``FRAME_RATE``, the pipeline's default 24 fps) and ``audio_rope.prepare_audio_coords``; the target is the
velocity ``eps - x0`` (the pipeline turns the output into ``x0 = x_t - s v``), compared on the video tokens only.
``s`` is drawn by the config's density and shifted as the pipeline's scheduler shifts it: ``mu =
calculate_shift(F h w, ...)`` of the scheduler config (its dynamic exponential shift over the **video** sequence
length, frames included).

Audio (docs/families-video.md "LTX-2 and audio"): the transformer takes an audio stream at every call. Its length
is the pipeline's for the clip's duration, ``round(frames / 24 * sample_rate / hop_length / 4)`` latent steps of
``C_a * mel_bins / 4`` features; the recipe gives it Gaussian noise (from the step's generator) at ``audio_timestep
= audio_sigma = 1000``: exactly the audio input of the pipeline's first step, carrying no audio. The loss is the
video's alone, and only the video stream trains (LoRA on the video self-attention ``attn1``, the text
cross-attention ``attn2`` and the audio-to-video ``audio_to_video_attn``; a full fine-tune freezes every
audio-stream parameter: none of them would get a gradient worth the name, and DDP refuses the ones with none).
Training the joint loss on the clip's own audio (decoded, resampled, mel, the audio VAE) is not done.

LTX-2.3 folders (the same ``LTX2Pipeline`` class; connectors with ``per_modality_projections``, a transformer with
``cross_attn_mod``) load as they are: the audio-video cross-attention is modulated by the other stream's sigma
(``use_cross_timestep``, what 2.3 was trained with; 2.0 the legacy own sigma), and validation loads the vocoder class
the folder names (2.3: ``LTX2VocoderWithBWE``).

Not yet: ``masked_loss`` and ``repa`` (refused in one line, as for Wan).
"""

from __future__ import annotations

from typing import Any

import torch

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
from pipeline.embed.families.ltx2 import left_pad
from train.config import TrainConfig
from train.model import flow_sample, to_weight_dtype
from train.recipes.base import (Denoiser, PromptEmbeds, Recipe, check_matches, flow_loss, flow_options,
                                load_pretrained, pretrained_source)  # fmt: skip
from train.shift import timestep_shift

__all__ = ["RECIPE", "FRAME_RATE", "LORA_TARGETS", "setup", "video_stream", "audio_length"]

FRAME_RATE = 24.0  # LTX2Pipeline.__call__'s frame_rate: the video rope's fps and the audio stream's duration
LORA_TARGETS = tuple(f"{a}.{p}" for a in ("attn1", "attn2", "audio_to_video_attn")
                     for p in ("to_q", "to_k", "to_v", "to_out.0"))  # fmt: skip


def video_stream(name: str) -> bool:
    """Whether parameter ``name`` of ``LTX2VideoTransformer3DModel`` is the video stream's (the audio-to-video
    cross-attention, which the video queries, included); the rest is the audio stream, frozen here."""
    part = name.split(".")[2] if name.startswith("transformer_blocks.") else name.split(".")[0]
    return part == "audio_to_video_attn" or "audio" not in part


def audio_length(frames: int, audio_vae_config: Any) -> int:
    """Audio latent steps the pipeline makes for a clip of ``frames`` pixel frames at :data:`FRAME_RATE`."""
    per_second = audio_vae_config["sample_rate"] / audio_vae_config["mel_hop_length"] / 4.0  # temporal ratio 4
    return round(frames / FRAME_RATE * per_second)


def _refuse(cfg: TrainConfig, meta: CacheMeta) -> None:
    if cfg.masked_loss is not None:
        raise UsageError("config masked_loss: the ltx-2 recipe does not weight video latents by loss masks yet; "
                         "remove masked_loss:")  # fmt: skip
    if cfg.repa is not None:
        raise UsageError("config repa: the ltx-2 recipe has no REPA for video latents yet; remove repa:")
    latent = meta.latent
    if latent is None or latent.temporal_factor is None or "normalised" not in latent._extra:
        raise UsageError("the cache holds no LTX-2 clip latents (_cache.json latent.temporal_factor and "
                         "latent.normalised): the ltx-2 recipe trains clips embedded with `bucketeer embed --family "
                         "ltx-2` from a video manifest")  # fmt: skip


def _check_folder(source: str) -> None:
    """UsageError when ``source``'s ``model_index.json`` names another pipeline than ``LTX2Pipeline``."""
    from diffusers import DiffusionPipeline

    try:
        name = DiffusionPipeline.load_config(source).get("_class_name")
    except (OSError, EnvironmentError):
        return  # load_pretrained says what is missing
    if name != "LTX2Pipeline":
        raise UsageError(f"pretrained {source!r} is a {name} folder; the ltx-2 recipe trains LTX2Pipeline's "
                         "transformer: pass an LTX-2 diffusers pipeline folder or hub id")  # fmt: skip


def setup(cfg: TrainConfig, meta: CacheMeta) -> Denoiser:
    """The LTX-2 denoiser (see the module docstring)."""
    from diffusers import (AutoencoderKLLTX2Audio, FlowMatchEulerDiscreteScheduler, LTX2Pipeline,
                           LTX2VideoTransformer3DModel)  # fmt: skip
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    _refuse(cfg, meta)
    source = pretrained_source(cfg, meta)
    _check_folder(source)
    transformer = load_pretrained(LTX2VideoTransformer3DModel, source, "transformer")
    connectors = load_pretrained(LTX2TextConnectors, source, "connectors").requires_grad_(False).eval()
    audio = AutoencoderKLLTX2Audio.load_config(source, subfolder="audio_vae")
    layout, channels = meta.text_layout, int(meta.latent.channels)
    check_matches("text width (caption_channels x text_proj_in_factor)",
                  connectors.config.caption_channels * connectors.config.text_proj_in_factor, layout.width, source)
    check_matches("latent channels (in_channels)", transformer.config.in_channels, channels, source)
    for name, p in transformer.named_parameters():
        p.requires_grad_(video_stream(name))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler")
    shift = timestep_shift(cfg.timestep_shift, scheduler.config)  # dynamic: per bucket, over F h w tokens
    p, pt = int(transformer.config.patch_size), int(transformer.config.patch_size_t)
    temporal = int(meta.latent.temporal_factor)
    mel = audio["mel_bins"] // 4  # the audio VAE's mel compression
    audio_width = int(audio["latent_channels"]) * mel
    check_matches("audio features (audio_in_channels)", transformer.config.audio_in_channels, audio_width, source)

    # LTX-2.3 (prompt modulation) was trained with the cross-modality sigma modulating audio-video attention: the
    # pipeline's use_cross_timestep=True ("the LTX-2.3/2.5 behavior"); LTX-2.0 the legacy False. At inference both
    # streams share one sigma, so only here (audio fed as pure noise) does the choice matter
    cross_timestep = bool(getattr(transformer, "prompt_modulation", False))

    def text_states(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The connectors' video and audio text states and mask, as the pipeline computes them."""
        text, mask = left_pad(batch.text.float(), batch.text_mask, layout.length)
        connectors.to(device)
        with torch.no_grad():
            return connectors(text.to(device), mask.to(device), padding_side="left")

    def inputs(noisy: torch.Tensor, sigma: torch.Tensor, batch: Any, generator: torch.Generator) -> dict[str, Any]:
        """The transformer's keyword arguments for noisy latents ``(B, C, F, h, w)`` at ``sigma`` ``(B,)``."""
        b, _, f, h, w = noisy.shape
        frames = (f - 1) * temporal + 1
        steps = audio_length(frames, audio)
        audio_noise = torch.randn((b, steps, audio_width), generator=generator).to(noisy.device)
        video_text, audio_text, text_mask = text_states(batch, noisy.device)
        t = 1000.0 * sigma
        return {"hidden_states": LTX2Pipeline._pack_latents(noisy, p, pt), "audio_hidden_states": audio_noise,
                "encoder_hidden_states": video_text, "audio_encoder_hidden_states": audio_text,
                "timestep": t, "sigma": t, "audio_timestep": torch.full_like(t, 1000.0),
                "audio_sigma": torch.full_like(t, 1000.0), "encoder_attention_mask": text_mask,
                "audio_encoder_attention_mask": text_mask, "num_frames": f // pt, "height": h // p,
                "width": w // p, "fps": FRAME_RATE, "audio_num_frames": steps,
                "video_coords": transformer.rope.prepare_video_coords(b, f // pt, h // p, w // p, noisy.device,
                                                                 fps=FRAME_RATE),
                "audio_coords": transformer.audio_rope.prepare_audio_coords(b, steps, noisy.device),
                "use_cross_timestep": cross_timestep, "return_dict": False}  # fmt: skip

    def loss(model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        b, c, f, h, w = batch.latents.shape
        if f % pt or h % p or w % p:
            raise UsageError(f"bucket {batch.bucket}: latents of {f}x{h}x{w} (frames x h x w) do not divide into the "
                             f"transformer's {pt}x{p}x{p} patches")  # fmt: skip
        tokens = (f // pt) * (h // p) * (w // p)
        # the pipeline's mu is of the packed video sequence length F h w: shift as a bucket of (F h) x w tokens
        draw = flow_sample(batch.latents, generator, shift=shift.for_bucket(batch.bucket, tokens, 1),
                           **flow_options(cfg))  # fmt: skip
        (noisy,) = to_weight_dtype(model, draw.noisy)
        kwargs = inputs(noisy, draw.sigma.flatten().to(noisy.dtype), batch, generator)
        pred, _ = model(**kwargs)  # (B, F h w, C) video, the audio prediction discarded
        target = LTX2Pipeline._pack_latents(draw.target, p, pt)
        return flow_loss(pred, target, draw.weight.view(b, 1, 1))

    def pipeline(model: torch.nn.Module, vae: Any) -> Any:
        from diffusers import AutoencoderKLLTX2Audio
        from diffusers.pipelines.ltx2 import vocoder as vocoders

        device, dtype = model.device, model.dtype
        audio_vae = AutoencoderKLLTX2Audio.from_pretrained(source, subfolder="audio_vae", torch_dtype=dtype)
        name = vocoders.LTX2Vocoder.load_config(source, subfolder="vocoder").get("_class_name", "LTX2Vocoder")
        if name not in ("LTX2Vocoder", "LTX2VocoderWithBWE"):  # LTX-2.3 folders ship the BWE one
            raise UsageError(f"{source}: vocoder class {name!r} is neither LTX-2's nor LTX-2.3's; validation needs one")
        vocoder = getattr(vocoders, name).from_pretrained(source, subfolder="vocoder", torch_dtype=dtype)
        return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae.to(device), text_encoder=None,
                            tokenizer=None, connectors=connectors.to(device), transformer=model,
                            vocoder=vocoder.to(device))  # fmt: skip

    def prompt_kwargs(prompts: PromptEmbeds, negative: PromptEmbeds) -> dict[str, Any]:
        text, mask = left_pad(prompts.embeds, prompts.mask, layout.length)
        neg, neg_mask = left_pad(negative.embeds, negative.mask, layout.length)
        return {"prompt_embeds": text, "prompt_attention_mask": mask, "negative_prompt_embeds": neg,
                "negative_prompt_attention_mask": neg_mask, "frame_rate": FRAME_RATE}  # fmt: skip

    return Denoiser(transformer, loss, pipeline, prompt_kwargs, tokens_per_position=1 / (pt * p * p), source=source,
                    pipeline_class="LTX2Pipeline", lora_targets=LORA_TARGETS)  # fmt: skip


RECIPE = Recipe("ltx-2", setup)
