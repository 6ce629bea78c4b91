"""Wan 2.x: UMT5 with an attention mask, real tokens only; the transformer sees them zero-padded to 512.

Mirrors ``WanPipeline._get_t5_prompt_embeds`` (diffusers): the caption is cleaned with the pipeline's
own ``prompt_clean`` (ftfy when installed, HTML unescape, whitespace), UMT5 pads to
``max_sequence_length`` (512) and runs **with** the attention mask; the pipeline then keeps the
``seq_len`` real rows of each caption and pads them with zeros back to 512. So only the real tokens
(up to and including ``</s>``) are stored, and the trainer pads with zeros: what the pipeline
feeds ``WanTransformer3DModel`` (it takes no text mask). No pooled embedding.
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from pipeline.embed.families.base import Family, PromptParts, TextModel, TextOptions

T5_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (t5,) = models
    return TextLayout(family="wan", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(int(t5.model.config.d_model),))  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    (t5,) = models
    enc = t5.tokenizer([prompt_clean(c) for c in captions], padding="max_length", max_length=options.max_tokens,
                       truncation=True, add_special_tokens=True, return_attention_mask=True,
                       return_tensors="pt")  # fmt: skip
    mask = enc.attention_mask.to(t5.device)
    return PromptParts([t5(enc.input_ids, attention_mask=mask).last_hidden_state], rows=[mask.gt(0).sum(dim=1)])


FAMILY = Family(
    name="wan",
    summary="Wan 2.x (video): UMT5 (512, masked; real tokens stored, zero-padded by the trainer)",
    pipelines=("WanPipeline",),
    text_encoders=("text_encoder",),
    text_classes=("UMT5EncoderModel",),
    layout=layout,
    encode=encode,
    max_text_tokens=lambda pipeline: T5_TOKENS,
)
