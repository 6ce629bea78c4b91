"""LongCat-Image: Qwen2.5-VL's last hidden states of 512 padded caption tokens, quoted text spelled out; every row.

Mirrors ``LongCatImagePipeline._encode_prompt`` / ``encode_prompt`` (diffusers 0.42.1,
``pipelines/longcat_image/pipeline_longcat_image.py:274-356``): the caption is split by the pipeline's own
``split_quotation`` (``:75-106``; text between ``'``, ``"``, ``‘’`` or ``“”``, a word-internal apostrophe such as
``don't`` left alone); a quoted part, quotes included, is tokenized **one character at a time**, the rest normally,
each without special tokens; the ids are cut at ``tokenizer_max_length`` (512) and padded to it by
``tokenizer.pad(..., padding="max_length")`` (the tokenizer's side: Qwen2's is the right), then the system prefix
(``"<|im_start|>system\\nAs an image captioning expert, ...<|im_end|>\\n<|im_start|>user\\n"``) and the suffix
(``"<|im_end|>\\n<|im_start|>assistant\\n"``), tokenized apart, are put around the 512 with mask ones
(``:302-322``). Qwen2.5-VL runs **with** that mask and ``output_hidden_states=True``; ``hidden_states[-1]`` rows
``[prefix_len:-suffix_len]`` are the prompt embeddings (``:328-332``): exactly 512 rows, the pads' rows included.

The transformer takes all 512 rows with no text mask (``__call__`` ``:634-641``), and a pad row (it attends to the
prefix and the caption, padded on the right) differs per caption, so every row is stored: an unmasked layout, as
``flux2``'s and ``chroma``'s. The text positions (``text_ids``, ``prepare_pos_ids`` ``:109-129``: modality 0,
``(0, i, i)``) and the image's (modality 1 from ``(512, 512)``, ``:402-408``) are the trainer's to make.

Every caption is run padded to the same length whatever the batch, so its rows do not depend on the captions beside
it. ``--max-text-tokens N`` (at most 512) is the pipeline with ``tokenizer_max_length = N``: ids cut and padded to
N, the image positions from ``(N, N)`` (``prepare_latents`` ``:402-408`` reads the attribute); inference matches it
only with ``pipe.tokenizer_max_length = N``. The text encoder is loaded as ``Qwen2_5_VLModel`` (the pipeline's
``Qwen2_5_VLForConditionalGeneration`` without the language-model head it never reads): the same hidden states.
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared
from pipeline.embed.families.qwen_image import width

__all__ = ["FAMILY", "TOKENS", "PREFIX", "SUFFIX", "caption_ids"]

# 512: LongCatImagePipeline.tokenizer_max_length, the rows it gives the transformer, and its cut
TOKENS = spec_of("longcat-image").text.max_tokens(None)
PREFIX = ("<|im_start|>system\nAs an image captioning expert, generate a descriptive text prompt based on an image "
          "content, suitable for input to a text-to-image model.<|im_end|>\n<|im_start|>user\n")  # fmt: skip
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"  # prompt_template_encode_prefix / _suffix (:237-238)


def caption_ids(tokenizer: Any, caption: str) -> list[int]:
    """``caption``'s token ids as ``_encode_prompt`` makes them (``:277-287``): its quoted parts a character at a
    time, the rest as text, no special tokens; not yet cut."""
    from diffusers.pipelines.longcat_image.pipeline_longcat_image import split_quotation

    ids: list[int] = []
    for part, quoted in split_quotation(caption):
        for piece in part if quoted else (part,):
            ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return ids


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (qwen,) = models
    return TextLayout(family="longcat-image", join="features", masked=False, lengths=(int(options.max_tokens),),
                      widths=(width(qwen.model),))  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    import torch

    (qwen,) = models
    tok, length = qwen.tokenizer, int(options.max_tokens)
    padded = tok.pad({"input_ids": [caption_ids(tok, c)[:length] for c in captions]}, max_length=length,
                     padding="max_length", return_attention_mask=True, return_tensors="pt")  # (B, L) each
    prefix = torch.tensor(tok(PREFIX, add_special_tokens=False)["input_ids"], dtype=padded.input_ids.dtype)
    suffix = torch.tensor(tok(SUFFIX, add_special_tokens=False)["input_ids"], dtype=padded.input_ids.dtype)
    b, mask_dtype = len(captions), padded.attention_mask.dtype
    ids = torch.cat((prefix.expand(b, -1), padded.input_ids, suffix.expand(b, -1)), dim=-1)  # (B, P + L + S)
    mask = torch.cat((torch.ones(b, len(prefix), dtype=mask_dtype), padded.attention_mask,
                      torch.ones(b, len(suffix), dtype=mask_dtype)), dim=-1)  # fmt: skip
    hidden = qwen(ids, attention_mask=mask.to(qwen.device), output_hidden_states=True).hidden_states[-1]
    return PromptParts([hidden[:, len(prefix) : -len(suffix)]])  # (B, L, D): every row, the pads' too


FAMILY = declared("longcat-image", layout=layout, encode=encode)
