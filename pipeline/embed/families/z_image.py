"""Z-Image: Qwen3's second-to-last hidden states of the caption in its chat template, real tokens only.

Mirrors ``ZImagePipeline._encode_prompt`` (diffusers 0.42): the caption becomes one user message through the
tokenizer's chat template with ``add_generation_prompt=True, enable_thinking=True`` (``<|im_start|>user\\n``,
the caption, ``<|im_end|>\\n<|im_start|>assistant\\n``), padded to ``max_sequence_length`` (512) and run through
Qwen3 with the boolean attention mask and ``output_hidden_states=True``; ``hidden_states[-2]`` at the mask's
positions is each caption's embedding, a list of ``(n_i, 2560)`` tensors of different lengths that
``ZImageTransformer2DModel`` takes as they are (it pads each to a multiple of 32 with its own learned pad
token). So the real tokens are stored, nothing else. On the CPU every batch has the same padded shape, so a
caption's rows do not depend on the captions beside it; on a GPU captions are padded by length group
(:func:`count_tokens`: right-padded and causal, a caption's rows do not see the padding after them).
"""

from __future__ import annotations

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared, token_counts
from pipeline.embed.families.qwen_image import pad_parts, width

__all__ = ["FAMILY", "TOKENS", "chat"]

TOKENS = spec_of("z-image").text.max_tokens(None)  # 512: ZImagePipeline's max_sequence_length


def chat(tokenizer, caption: str) -> str:
    """The caption as ``ZImagePipeline._encode_prompt`` puts it through the chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)  # fmt: skip


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (qwen3,) = models
    return TextLayout(family="z-image", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(width(qwen3.model),))  # fmt: skip


def count_tokens(models: list[TextModel], captions: list[str], options: TextOptions) -> list[int]:
    (qwen3,) = models  # right-padded and causal: a caption's rows do not depend on the padding after them
    return token_counts(qwen3.tokenizer, [chat(qwen3.tokenizer, c) for c in captions], int(options.max_tokens))


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    (qwen3,) = models
    enc = qwen3.tokenizer([chat(qwen3.tokenizer, c) for c in captions], padding="max_length",
                          max_length=options.max_tokens, truncation=True, return_tensors="pt")  # fmt: skip
    mask = enc.attention_mask.to(qwen3.device).bool()
    hidden = qwen3(enc.input_ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]  # (B, L, D)
    return pad_parts([h[k] for h, k in zip(hidden, mask)])  # the mask's rows, wherever the tokenizer pads


FAMILY = declared("z-image", layout=layout, encode=encode, count_tokens=count_tokens)
