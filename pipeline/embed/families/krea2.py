"""Krea 2: twelve hidden states of Qwen3-VL-4B per token, the caption in Qwen-Image's template, real rows only.

Mirrors ``Krea2Pipeline.get_text_hidden_states`` / ``encode_prompt`` (diffusers 0.42.1,
``pipelines/krea2/pipeline_krea2.py:214-261``): Qwen-Image's system prefix (``:206-210``, the same text as
``QwenImagePipeline.prompt_template_encode``'s first part) + the caption, tokenized with ``padding="max_length"``
and truncation at ``max_sequence_length + 34 - 5`` tokens (``:229-235``), **then** the 5 closing tokens
``<|im_end|>\\n<|im_start|>assistant\\n`` tokenized alone and appended after the padding (``:236-241``): each row is
``[prefix | caption | PAD | suffix]``. The positions count real tokens only (``cumsum(mask) - 1`` on all three
mRoPE axes, ``:243-249``), so a pad takes no position and the suffix sits right after the caption whatever the
padding. ``Qwen3VLModel`` runs with the boolean mask; the hidden states ``2, 5, ..., 35`` (``hidden_states[0]``
being the embeddings: the outputs of decoder layers 2, 5, ..., 35, never the final norm) are stacked per token to
``(B, L, 12, 2560)`` and the first 34 rows (the prefix) dropped: ``(B, max_sequence_length, 12, 2560)`` and its mask.

``Krea2Transformer2DModel`` masks the pad rows as keys everywhere and never reads them back
(``models/transformers/transformer_krea2.py:497-531``), and gives every text row the RoPE position zero
(``Krea2Pipeline.prepare_position_ids``, ``:381-390``): only the real rows (caption + suffix) matter, in any order.
So the cache stores those rows (masked layout), 12 x 2560 = 30,720 wide, the 12 layers side by side per token
(the trainer reshapes them back to ``(L, 12, 2560)``). On the CPU every batch is padded as the pipeline pads it
(546 tokens), so each record equals ``encode_prompt([caption])``'s rows bit for bit in fp32; on a GPU captions are
grouped by length (:func:`count_tokens`: a pad takes no position and no key, so the real rows do not depend on how
far a row is padded; float32 may differ by an ulp from another summation length).

The text encoder runs as its decoder alone holding its first 35 layers (:func:`pipeline.embed.families.flux2.prune`:
no vision tower, no final layers): the hidden states read are the same tensors.
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.errors import UsageError
from pipeline.embed.families import flux2
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared, token_counts
from pipeline.embed.families.qwen_image import pad_parts, width

__all__ = ["FAMILY", "PREFIX", "SUFFIX", "DROP", "SUFFIX_TOKENS", "TOKENS", "LAYERS", "tokenize"]

TOKENS = spec_of("krea-2").text.max_tokens(None)  # 512: Krea2Pipeline's max_sequence_length (its default)
DROP = 34  # Krea2Pipeline.prompt_template_encode_start_idx: the prefix's tokens
SUFFIX_TOKENS = 5  # Krea2Pipeline.prompt_template_encode_num_suffix_tokens
PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")  # fmt: skip
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# Krea2Pipeline's default text_encoder_select_layers (pipeline_krea2.py:188-189): indices into hidden_states
LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


def tokenize(tokenizer: Any, captions: list[str], length: int) -> tuple[Any, Any]:
    """``(input_ids, mask)`` ``(B, length + 34)`` (mask bool) as ``get_text_hidden_states`` builds them for
    ``max_sequence_length`` ``length``: ``[prefix | caption | PAD]`` to ``length + 34 - 5`` tokens, then the suffix."""
    import torch

    text = tokenizer([PREFIX + c for c in captions], truncation=True, padding="max_length",
                     max_length=length + DROP - SUFFIX_TOKENS, return_tensors="pt")  # fmt: skip
    suffix = tokenizer([SUFFIX] * len(captions), return_tensors="pt")
    ids = torch.cat([text.input_ids, suffix.input_ids], dim=1)
    mask = torch.cat([text.attention_mask, suffix.attention_mask], dim=1).bool()
    return ids, mask


def stacked_states(m: TextModel, ids: Any, mask: Any) -> Any:
    """``(B, L, 12, D)``: the hidden states :data:`LAYERS` of ``m`` (a pruned decoder) on ``ids`` with ``mask``
    and the pipeline's positions (``cumsum(mask) - 1``, clamped at 0, on the 3 mRoPE axes), stacked per token."""
    import torch

    positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)  # (3, B, L)
    captured: dict[int, Any] = {}
    hooks = [m.model.layers[k - 1].register_forward_hook(
        lambda module, args, out, k=k: captured.__setitem__(k, out[0] if isinstance(out, tuple) else out))
        for k in LAYERS]  # fmt: skip
    try:
        m(ids, attention_mask=mask.to(m.device), position_ids=positions.to(m.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([captured[k] for k in LAYERS], dim=2)


def prune(model: Any) -> Any:
    """``model``'s decoder with its first 35 layers (the last hidden state read); UsageError for a shallower one."""
    layers = int(model.config.get_text_config().num_hidden_layers)
    if layers < max(LAYERS):
        raise UsageError(f"krea-2 reads hidden states {LAYERS[0]}, ..., {LAYERS[-1]} of its text encoder, which has "
                         f"{layers} layers: pass a Krea 2 folder (Qwen3-VL-4B, 36 layers)")  # fmt: skip
    return flux2.prune(model, LAYERS)


def _length(options: TextOptions) -> int:
    length = int(options.max_tokens)
    if length <= SUFFIX_TOKENS:
        raise UsageError(f"--max-text-tokens {length}: krea-2 keeps the template's {SUFFIX_TOKENS} closing tokens "
                         f"after the caption; pass more than {SUFFIX_TOKENS}")  # fmt: skip
    return length


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (qwen,) = models
    return TextLayout(family="krea-2", join="features", masked=True, lengths=(_length(options),),
                      widths=(len(LAYERS) * width(qwen.model),))  # fmt: skip


def count_tokens(models: list[TextModel], captions: list[str], options: TextOptions) -> list[int]:
    """The rows each caption keeps: its real tokens after the 34 dropped (the caption's), plus the suffix's 5."""
    (qwen,) = models
    length = _length(options)
    counts = token_counts(qwen.tokenizer, [PREFIX + c for c in captions], length + DROP - SUFFIX_TOKENS)
    return [max(n - DROP, 0) + SUFFIX_TOKENS for n in counts]


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    (qwen,) = models
    ids, mask = tokenize(qwen.tokenizer, captions, _length(options))
    hidden = stacked_states(qwen, ids, mask)[:, DROP:]  # (B, L, 12, D), the prefix dropped
    keep = mask[:, DROP:].to(hidden.device)
    return pad_parts([h[k].flatten(1) for h, k in zip(hidden, keep)])  # per caption (n_i, 12 D): the mask's rows


FAMILY = declared("krea-2", layout=layout, encode=encode, prune=prune, count_tokens=count_tokens)
