"""SDXL: two CLIP text encoders, penultimate layers side by side, 77 positions each, no mask.

Mirrors ``StableDiffusionXLPipeline.encode_prompt`` (diffusers): each tokenizer pads to its
``model_max_length`` (77) and truncates; each encoder runs without an attention mask with
``output_hidden_states=True``; ``hidden_states[-2]`` (the penultimate layer: ``clip_skip=None``) of
both are concatenated on features, ``(77, 768 + 1280)``; the pooled embedding is the first 2-D
output, i.e. ``text_embeds`` of ``text_encoder_2`` (``CLIPTextModelWithProjection``, 1280). All
77 positions are stored: CLIP is causal, so the states at the pad positions depend on the caption
and the UNet attends to them. The UNet's ``time_ids`` come from the sample records' sizes.
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from manifests.errors import UsageError
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    if options.max_tokens is not None:
        raise UsageError("--max-text-tokens does not apply to --family sdxl: its CLIP encoders always produce "
                         "77 positions, and the UNet was trained on all of them")  # fmt: skip
    lengths = tuple(int(m.tokenizer.model_max_length) for m in models)
    if len(set(lengths)) != 1:
        raise UsageError(f"the SDXL tokenizers disagree on the sequence length ({lengths}); they must pad alike")
    return TextLayout(family="sdxl", join="features", masked=False, lengths=lengths,
                      widths=tuple(int(m.model.config.hidden_size) for m in models),
                      pooled_dim=int(models[1].model.config.projection_dim),
                      pooled_source="text_embeds of text_encoder_2")  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    parts, pooled = [], None
    for m in models:
        ids = m.tokenizer(captions, padding="max_length", max_length=m.tokenizer.model_max_length, truncation=True,
                          return_tensors="pt").input_ids  # fmt: skip
        out = m(ids, output_hidden_states=True)
        if pooled is None and out[0].ndim == 2:  # the pipeline's rule: the first encoder with a 2-D output
            pooled = out[0]
        parts.append(out.hidden_states[-2])
    return PromptParts(parts, pooled=pooled)


FAMILY = declared("sdxl", layout=layout, encode=encode)
