"""Chroma: T5 run with its attention mask, all 512 rows stored, and the mask the transformer is given.

Mirrors ``ChromaPipeline._get_t5_prompt_embeds`` (diffusers 0.42): T5 pads to ``max_sequence_length``
(512), runs **with** the tokenizer's attention mask (unlike Flux.1), and the pipeline hands the transformer
all 512 rows with a mask that is 1 on the caption's tokens and the first pad (``arange(512) <= n``, ``n``
real tokens) and 0 after.

Both are stored: the rows as the one part of an unmasked layout, and the mask as the record's ``pooled``
vector (512 values, 0 or 1; exact in bf16). The rows past the mask are needed: the pipeline's mask is a float
0/1 tensor, which ``scaled_dot_product_attention`` **adds** to the attention scores (``ChromaPipeline.
_prepare_attention_mask`` concatenates it with the image's ones, and the blocks multiply it into a float
(S, S) matrix), so a masked row still weighs ``e^-1`` relative to an unmasked one and changes the
transformer's output (measured: tests/test_families_flux2.py). Storing only the first ``n + 1`` rows would
change what the denoiser sees.
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

T5_TOKENS = spec_of("chroma").text.max_tokens(None)  # 512: ChromaPipeline's max_sequence_length (its maximum too)
MASK_SOURCE = "the transformer's text attention mask (1 on the caption's tokens and the first pad, then 0)"


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (t5,) = models
    return TextLayout(family="chroma", join="features", masked=False, lengths=(int(options.max_tokens),),
                      widths=(int(t5.model.config.d_model),), pooled_dim=int(options.max_tokens),
                      pooled_source=MASK_SOURCE)  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    import torch

    (t5,) = models
    enc = t5.tokenizer(captions, padding="max_length", max_length=options.max_tokens, truncation=True,
                       return_length=False, return_overflowing_tokens=False, return_tensors="pt")  # fmt: skip
    mask = enc.attention_mask.to(t5.device)
    embeds = t5(enc.input_ids, output_hidden_states=False, attention_mask=mask)[0]  # (B, L, D)
    n = mask.sum(dim=1)  # (B,) real tokens
    positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0).expand(len(captions), -1)
    return PromptParts([embeds], pooled=(positions <= n.unsqueeze(1)).to(embeds.dtype))  # (B, L) of 0 and 1


FAMILY = declared("chroma", layout=layout, encode=encode)
