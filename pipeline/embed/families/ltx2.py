"""LTX-2 (``ltx-2``, video; the audio stream is not trained, see docs/families-video.md): Gemma 3's hidden states
of every layer, real tokens only, and clip latents stored normalised as the pipeline normalises them.

Text mirrors ``LTX2Pipeline.encode_prompt`` (diffusers): the caption is stripped, Gemma's tokenizer pads it **on the
left** to ``max_sequence_length`` (1024) and Gemma runs with the attention mask; ``encode_prompt`` returns the
hidden states of the embeddings and of every layer stacked per token, ``(B, 1024, D * (layers + 1))``, and the
mask. That is what is cached (not the connectors' output): the pipeline then runs ``LTX2TextConnectors`` on it,
which sets the pad rows to zero before anything reads them (``per_layer_masked_mean_norm``) and replaces them
with learned registers, so only the real rows matter. They are stored first-to-last (the pad rows dropped, so a
record's rows are the caption's tokens, ``<bos>`` first) and the recipe (:mod:`train.recipes.ltx2`) puts them
back on the left of 1024 rows and runs the frozen connectors, as the pipeline does before its transformer.

Latents: ``AutoencoderKLLTX2Video`` (32x spatial, 8x temporal, causal: ``8k + 1`` frames -> ``k + 1``), the
posterior mean normalised with ``LTX2Pipeline._normalize_latents`` itself (``(z - latents_mean) *
scaling_factor / latents_std``, the VAE's buffers), so the cache holds what the transformer denoises
(``_cache.json`` ``latent.normalised``) and the trainer does nothing to it: the division is the pipeline's, bit
for bit (a stored mean times ``1 / std`` would round differently).
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

__all__ = ["FAMILY", "TEXT_TOKENS", "LATENT_USAGE", "vae_description", "vae_latents"]

TEXT_TOKENS = spec_of("ltx-2").text.max_tokens(None)  # 1024: LTX2Pipeline.__call__'s max_sequence_length
LATENT_USAGE = ("clip latents (C, F', h, w), F' = (F - 1) // temporal_factor + 1, stored normalised as "
                "LTX2Pipeline._normalize_latents does: z = latent")  # fmt: skip
NORMALISED = "(z - latents_mean) * scaling_factor / latents_std, LTX2Pipeline._normalize_latents"


def _width(model: Any) -> int:
    """Features per token: the hidden size times the hidden states stacked (embeddings + every layer)."""
    cfg = getattr(model.config, "text_config", model.config)
    return int(cfg.hidden_size) * (int(cfg.num_hidden_layers) + 1)


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (gemma,) = models
    return TextLayout(family="ltx-2", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(_width(gemma.model),))  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    """``encode_prompt``'s ``prompt_embeds`` with the real rows moved first (the pipeline pads on the left)."""
    import torch

    (gemma,) = models
    tokenizer = gemma.tokenizer
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer([c.strip() for c in captions], padding="max_length", max_length=options.max_tokens,
                    truncation=True, add_special_tokens=True, return_tensors="pt")  # fmt: skip
    mask = enc.attention_mask.to(gemma.device)
    out = gemma(enc.input_ids, attention_mask=mask, output_hidden_states=True)
    embeds = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)  # (B, L, D * (layers + 1)), as the pipeline
    order = torch.argsort(1 - mask, dim=1, stable=True)  # real rows first, in order
    embeds = torch.gather(embeds, 1, order[:, :, None].expand(-1, -1, embeds.shape[-1]))
    return PromptParts([embeds], rows=[mask.sum(dim=1)])


def left_pad(text: Any, mask: Any, length: int) -> tuple[Any, Any]:
    """Stored rows ``(B, L, D)`` (real rows first, ``mask`` ``(B, L)`` 1 on them) as the pipeline has them:
    ``(B, length, D)`` with each caption's rows last and zeros before, and its left-padded mask ``(B, length)``."""
    import torch

    b, rows, width = text.shape
    counts = mask.sum(dim=1).long()
    out = text.new_zeros(b, length, width)
    left = torch.zeros(b, length, dtype=torch.long, device=text.device)
    for i, n in enumerate(counts.tolist()):
        out[i, length - n :] = text[i, :n]
        left[i, length - n :] = 1
    return out, left


def vae_description(vae: Any) -> dict[str, Any]:
    """What ``_cache.json`` records of an ``AutoencoderKLLTX2Video``: its compression, channels, nothing left
    for the trainer to scale (:data:`LATENT_USAGE`), and the statistics the stored latents are normalised with."""
    return {"factor": int(vae.spatial_compression_ratio), "channels": int(vae.config.latent_channels),
            "scaling_factor": 1.0, "shift_factor": None, "temporal_factor": int(vae.temporal_compression_ratio),
            "usage": LATENT_USAGE,
            "normalised": {"latents_mean": [float(x) for x in vae.latents_mean],
                           "latents_std": [float(x) for x in vae.latents_std],
                           "scaling_factor": float(vae.config.scaling_factor), "how": NORMALISED}}  # fmt: skip


def vae_latents(vae: Any, x: Any, std: bool) -> dict[str, Any]:
    """Clips ``(B, 3, F, H, W)`` in [-1, 1] -> ``{"latent"}``: the posterior mean normalised by
    ``LTX2Pipeline._normalize_latents``, ``(B, C, F', h, w)`` (``--latents posterior`` is refused for clips)."""
    from diffusers import LTX2Pipeline

    mean = vae.encode(x).latent_dist.mean
    latent = LTX2Pipeline._normalize_latents(mean, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    return {"latent": latent.float()}


def _prune(model: Any) -> Any:
    """Gemma 3's language model: the vision tower and LM head are never run for a caption."""
    return model.get_decoder()


FAMILY = declared("ltx-2", layout=layout, encode=encode, prune=_prune)
