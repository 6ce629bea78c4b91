"""Flux.1: T5 states padded to 512 without a mask; CLIP-L contributes only its pooled output.

Mirrors ``FluxPipeline.encode_prompt`` (diffusers): CLIP pads to its ``model_max_length`` (77)
and runs unmasked; its ``pooler_output`` (768) is the pooled embedding. T5 pads to
``max_sequence_length`` (512; Flux.1-schnell is often run at 256) and runs **without** an attention
mask, so all positions are stored. The text ids (zeros, ``(L, 3)``) are not stored: the trainer
makes them from the length.
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

T5_TOKENS = spec_of("flux").text.max_tokens(None)  # the pipeline's max_sequence_length (512)


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    clip, t5 = models
    return TextLayout(family="flux", join="features", masked=False, lengths=(int(options.max_tokens),),
                      widths=(int(t5.model.config.d_model),), pooled_dim=int(clip.model.config.hidden_size),
                      pooled_source="pooler_output of text_encoder (CLIP-L)")  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    clip, t5 = models
    ids = clip.tokenizer(captions, padding="max_length", max_length=clip.tokenizer.model_max_length, truncation=True,
                         return_overflowing_tokens=False, return_length=False, return_tensors="pt").input_ids
    pooled = clip(ids, output_hidden_states=False).pooler_output
    ids = t5.tokenizer(captions, padding="max_length", max_length=options.max_tokens, truncation=True,
                       return_length=False, return_overflowing_tokens=False, return_tensors="pt").input_ids
    return PromptParts([t5(ids, output_hidden_states=False)[0]], pooled=pooled)


FAMILY = declared("flux", layout=layout, encode=encode)
