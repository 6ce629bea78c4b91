"""PixArt-alpha / -sigma: T5 over the lower-cased caption, with an attention mask; real tokens only.

Mirrors ``PixArtAlphaPipeline.encode_prompt`` / ``PixArtSigmaPipeline.encode_prompt`` (diffusers,
``clean_caption=False``): the caption is lower-cased and stripped, T5 pads to
``max_sequence_length`` (alpha 120, sigma 300: from ``model_index.json``) and runs **with** the
attention mask, which the transformer also takes. Masked positions never reach the transformer,
so only the real tokens (BOS-less, up to and including ``</s>``) are stored; the trainer pads with
zeros and builds the mask from the stored length. No pooled embedding.
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared, token_counts

T5_TOKENS = dict(spec_of("pixart").text.tokens)  # alpha 120, sigma 300


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (t5,) = models
    return TextLayout(family="pixart", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(int(t5.model.config.d_model),))  # fmt: skip


def count_tokens(models: list[TextModel], captions: list[str], options: TextOptions) -> list[int]:
    (t5,) = models
    return token_counts(t5.tokenizer, [c.lower().strip() for c in captions], int(options.max_tokens),
                        add_special_tokens=True)  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    (t5,) = models
    captions = [c.lower().strip() for c in captions]  # the pipeline's _text_preprocessing without clean_caption
    enc = t5.tokenizer(captions, padding="max_length", max_length=options.max_tokens, truncation=True,
                       add_special_tokens=True, return_tensors="pt")  # fmt: skip
    mask = enc.attention_mask.to(t5.device)
    return PromptParts([t5(enc.input_ids, attention_mask=mask)[0]], rows=[mask.sum(dim=1)])


FAMILY = declared("pixart", layout=layout, encode=encode, count_tokens=count_tokens)
