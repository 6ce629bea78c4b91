"""SD3 / SD3.5: two CLIPs side by side, zero-padded to T5's width, then T5 on the sequence; no mask.

Mirrors ``StableDiffusion3Pipeline.encode_prompt`` (diffusers): both CLIP tokenizers pad to the
first tokenizer's ``model_max_length`` (77); both encoders (``CLIPTextModelWithProjection``) run
unmasked with ``output_hidden_states=True``, giving ``hidden_states[-2]`` (penultimate,
``clip_skip=None``) and ``text_embeds`` (pooled). T5 pads to ``max_sequence_length`` (256; up to
512 at inference) and runs **without** an attention mask, so every one of its positions, pads
included, is a computed state the transformer attends to. The prompt embeddings are
``cat([pad(cat([clip_l, clip_g], -1), t5_width), t5], dim=-2)`` (77 + 256 rows) and the pooled one
``cat([pooled_l, pooled_g], -1)`` (768 + 1280). The cache stores the three parts, not the
zero-padded join (the trainer rebuilds it: :class:`manifests.cache.text_layout.TextLayout`).
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

T5_TOKENS = spec_of("sd3").text.max_tokens(None)  # the pipeline's max_sequence_length (256)


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    clip = int(models[0].tokenizer.model_max_length)
    widths = tuple(int(m.model.config.hidden_size if i < 2 else m.model.config.d_model) for i, m in enumerate(models))
    pooled = sum(int(m.model.config.projection_dim) for m in models[:2])
    return TextLayout(family="sd3", join="sequence", masked=False, lengths=(clip, clip, int(options.max_tokens)),
                      widths=widths, pooled_dim=pooled,
                      pooled_source="cat(text_embeds of text_encoder, text_embeds of text_encoder_2)")  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    import torch

    clip_length = models[0].tokenizer.model_max_length  # the pipeline's tokenizer_max_length, for both CLIPs
    parts, pooled = [], []
    for m in models[:2]:
        ids = m.tokenizer(captions, padding="max_length", max_length=clip_length, truncation=True,
                          return_tensors="pt").input_ids  # fmt: skip
        out = m(ids, output_hidden_states=True)
        pooled.append(out[0])
        parts.append(out.hidden_states[-2])
    t5 = models[2]
    ids = t5.tokenizer(captions, padding="max_length", max_length=options.max_tokens, truncation=True,
                       add_special_tokens=True, return_tensors="pt").input_ids  # fmt: skip
    parts.append(t5(ids)[0])
    return PromptParts(parts, pooled=torch.cat(pooled, dim=-1))


FAMILY = declared("sd3", layout=layout, encode=encode)
