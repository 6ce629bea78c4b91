"""HunyuanVideo 1.5 (``hunyuanvideo-1.5``): two separately masked text streams, Qwen2.5-VL and glyph ByT5.

Mirrors ``HunyuanVideo15Pipeline.encode_prompt`` (diffusers 0.42), which returns ``prompt_embeds`` and its mask
and ``prompt_embeds_2`` and its mask, passed to ``HunyuanVideo15Transformer3DModel`` as two inputs:

- stream 0, ``_get_mllm_prompt_embeds``: the caption as the user turn after the pipeline's system message (an
  empty caption becomes ``" "``), Qwen2.5-VL's chat template with the generation prompt, padded to
  ``tokenizer_max_length + 108`` (1000 + 108) tokens, run with the attention mask; ``hidden_states[-3]`` (two
  layers skipped) minus the first ``prompt_template_encode_start_idx`` (108) positions. The real rows (mask 1)
  are stored, at most 1000.
- stream 1, ``_get_byt5_prompt_embeds``: the quoted text of the caption (``extract_glyph_texts``: ``"..."`` or
  curly quotes, joined as ``Text "x". ``); none: the pipeline gives zeros and mask 0, so 0 rows are stored;
  else ByT5 on it padded to 256 with its float mask, the real rows stored (at most 256).

The transformer puts each stream's real tokens first and zeroes the rest (``torch.zeros_like(text[~mask])``),
and masks them out of attention and of the refiner's pooled mean, so the pad rows the pipeline computes are not
inputs: the trainer pads each stream with zeros to its length and passes its own mask (``TextLayout`` join
``streams``: :class:`manifests.cache.text_layout.TextLayout`). No pooled embedding.

The latents: the pipeline decodes ``latents / vae.config.scaling_factor`` and its image-to-video sibling encodes
``retrieve_latents(vae.encode(x), "argmax") * scaling_factor``; the cache stores the posterior mean (the mode)
and ``_cache.json`` the scaling factor, which the trainer's loader multiplies in (no shift, no per-channel
statistics). Image-to-video conditioning (a SigLIP image embedding and the first frame's latent as a condition)
is not cached: the t2v pipeline passes zeros for both, and so does the recipe.
"""

from __future__ import annotations

import inspect
from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

__all__ = ["FAMILY", "TOKENS", "BYT5_TOKENS", "CROP", "system_message", "vae_description", "vae_latents"]

TOKENS = spec_of("hunyuanvideo-1.5").text.max_tokens(None)  # 1000: HunyuanVideo15Pipeline.tokenizer_max_length
BYT5_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length
CROP = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx
SKIP = 2  # _get_mllm_prompt_embeds' num_hidden_layers_to_skip: hidden_states[-3]


def system_message() -> str:
    """The pipeline's system message (its ``_get_mllm_prompt_embeds`` default, the string ``__init__`` sets)."""
    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def vae_description(config: Any) -> dict[str, Any]:
    """What ``_cache.json`` records of an ``AutoencoderKLHunyuanVideo15`` config: its compression, channels and
    ``scaling_factor`` (the loader multiplies it in; no shift, no per-channel statistics)."""
    return {"factor": int(config.spatial_compression_ratio), "channels": int(config.latent_channels),
            "scaling_factor": float(config.scaling_factor), "shift_factor": None,
            "temporal_factor": int(config.temporal_compression_ratio)}  # fmt: skip


def vae_latents(vae: Any, x: Any, std: bool) -> dict[str, Any]:
    """Clips ``(B, 3, F, H, W)`` through an ``AutoencoderKLHunyuanVideo15`` one at a time: the posterior mean
    ``(B, C, F', h, w)`` (and its std with ``std``). One at a time because its mid-block attention builds a
    ``(B, L, L)`` causal mask that does not broadcast against its ``(B, 1, L, d)`` queries for B > 1 (diffusers
    0.42.1); the pipelines encode one image at a time too, so each clip's latent is theirs."""
    import torch

    outs = [vae.encode(x[i : i + 1]).latent_dist for i in range(x.shape[0])]
    out = {"latent": torch.cat([p.mean for p in outs]).float()}
    if std:
        out["latent_std"] = torch.cat([p.std for p in outs]).float()
    return out


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    qwen, byt5 = models
    return TextLayout(family=FAMILY.name, join="streams", masked=True, lengths=(int(options.max_tokens), BYT5_TOKENS),
                      widths=(int(qwen.model.config.hidden_size), int(byt5.model.config.d_model)))  # fmt: skip


def _pad(rows: list[Any], width: int, like: Any) -> tuple[Any, Any]:
    """Per-caption ``(L_i, D)`` rows as one zero-padded ``(B, max L_i, D)`` part and its row counts."""
    import torch

    counts = torch.tensor([r.shape[0] for r in rows])
    part = like.new_zeros(len(rows), int(counts.max()) if len(rows) else 0, width)
    for i, r in enumerate(rows):
        part[i, : r.shape[0]] = r
    return part, counts


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import (extract_glyph_texts,
                                                                                format_text_input)  # fmt: skip

    qwen, byt5 = models
    enc = qwen.tokenizer.apply_chat_template(format_text_input(captions, system_message()), add_generation_prompt=True,
                                             tokenize=True, return_dict=True, padding="max_length",
                                             max_length=int(options.max_tokens) + CROP, truncation=True,
                                             return_tensors="pt")  # fmt: skip
    mask = enc.attention_mask.to(qwen.device)
    hidden = qwen(enc.input_ids, attention_mask=mask, output_hidden_states=True).hidden_states[-(SKIP + 1)]
    first = [h[CROP:][k[CROP:].bool()] for h, k in zip(hidden, mask)]  # (B, L, D) -> the real rows of each
    second = []
    for glyph in (extract_glyph_texts(c) for c in captions):  # one caption at a time, as the pipeline runs them
        if glyph is None:
            second.append(hidden.new_zeros(0, byt5.model.config.d_model))
            continue
        tok = byt5.tokenizer(glyph, padding="max_length", max_length=BYT5_TOKENS, truncation=True,
                             add_special_tokens=True, return_tensors="pt")  # fmt: skip
        keep = tok.attention_mask.to(byt5.device)
        second.append(byt5(tok.input_ids, attention_mask=keep.float())[0][0][keep[0].bool()])
    (a, na), (b, nb) = _pad(first, hidden.shape[-1], hidden), _pad(second, byt5.model.config.d_model, hidden)
    return PromptParts([a, b], rows=[na, nb])


FAMILY = declared("hunyuanvideo-1.5", layout=layout, encode=encode)
