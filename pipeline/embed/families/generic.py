"""Generic: any text encoders, each padded only to the batch and masked, real tokens side by side.

What bucketeer's own from-scratch trainer (a PixArt-style transformer that takes a mask) reads,
and what the embedded default encoders make. Each encoder (``--text-encoder``, in order) sees the
captions padded to the batch's longest, truncated at ``min(tokenizer, position limit,
--max-text-tokens)``, with the attention mask; its ``--text-layer`` (last or penultimate) is kept
for the real tokens only. The pooled embedding comes from the last encoder that has one
(``text_embeds`` of a CLIP with projection, ``pooler_output`` of a plain CLIP). This matches no
pretrained model's pipeline: for those, use their family.
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from manifests.errors import UsageError
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

LAYERS = ("last", "penultimate")


def max_length(m: TextModel, options: TextOptions) -> int:
    """Tokens kept of a caption: the tokenizer's limit, the model's positions, ``--max-text-tokens``."""
    limit = getattr(m.model.config, "max_position_embeddings", None) or 512
    return min(int(m.tokenizer.model_max_length), int(limit), options.max_tokens or 1 << 30)


def _pooled_dim(m: TextModel) -> int | None:
    name = type(m.model).__name__
    if name == "CLIPTextModelWithProjection":
        return int(m.model.config.projection_dim)
    if name == "CLIPTextModel":
        return int(m.model.config.hidden_size)
    return None


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    if (options.layer or "last") not in LAYERS:
        raise UsageError(f"--text-layer must be one of {LAYERS}, got {options.layer!r}")
    pooled = [d for d in map(_pooled_dim, models) if d is not None]
    return TextLayout(family="generic", join="features", masked=True,
                      lengths=tuple(max_length(m, options) for m in models),
                      widths=tuple(int(m.model.config.hidden_size) for m in models),
                      pooled_dim=pooled[-1] if pooled else None,
                      pooled_source="the last text encoder with a pooled output" if pooled else None)  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    parts, rows, pooled = [], [], None
    for m in models:
        enc = m.tokenizer(captions, padding="longest", truncation=True, max_length=max_length(m, options),
                          return_tensors="pt")  # fmt: skip
        mask = enc["attention_mask"].to(m.device)
        out = m(enc["input_ids"], attention_mask=mask, output_hidden_states=True)
        parts.append(out.hidden_states[-2] if options.layer == "penultimate" else out.last_hidden_state)  # (B, L, D)
        rows.append(mask.sum(dim=1))
        p = getattr(out, "text_embeds", None)
        if p is None and type(m.model).__name__ == "CLIPTextModel":
            p = out.pooler_output
        pooled = p if p is not None else pooled
    return PromptParts(parts, rows=rows, pooled=pooled)


FAMILY = declared("generic", layout=layout, encode=encode)
