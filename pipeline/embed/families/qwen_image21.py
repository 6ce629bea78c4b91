"""Qwen-Image 2.1: Qwen3-VL's last layer **before its final norm**, of the caption in the pipeline's template, masked.

Mirrors ``QwenImage21Pipeline._get_qwen_prompt_embeds`` / ``encode_prompt`` for text-to-image (diffusers 0.42.1,
``pipelines/qwenimage21/pipeline_qwenimage21.py``):

- an empty caption becomes ``" "`` (``:249``: Qwen has no BOS, so an empty prompt would leave nothing to read);
- the caption goes into a raw template string, not ``apply_chat_template`` (``:212-216``): the system message
  ``"Comprehend and analyze the provided prompt."``, the caption as the user turn, the assistant turn's opening;
- ``processor(text=..., padding=True, padding_side="left")`` (``:282-291``): **no maximum length, no truncation**;
- Qwen3-VL runs with the attention mask (and the processor's ``mm_token_type_ids``, all text) and a forward hook
  that returns the final RMSNorm's input as its output (``:303-316``), so ``hidden_states[-1]`` is the last
  decoder layer's output before the norm (what the transformer was trained on; transformers 5 ties that entry to
  the normed ``last_hidden_state`` otherwise);
- the mask's real rows are kept minus the first ``_drop_idx``: the token count of the system message as the
  processor's chat template renders it (``:229-231``), so what remains starts at ``<|im_start|>user\\n`` and ends
  with the template's 5 closing tokens; the rows are zero-padded on the right to the batch's longest with a mask
  (``:327-337``), the mask dropped when it is all ones (``:390-391``).

The transformer takes those rows with the mask, so only they are stored (a masked layout; the trainer pads on the
right with zeros and masks, as ``:327-337``). The pipeline pads the encoder's batch **on the left**, and in fp32 a
padded prompt's real rows differ in the last bits from the same prompt alone; the cache must not depend on which
captions shared a batch, so captions are encoded in groups of equal token count (no padding at all): each
caption's rows equal ``encode_prompt([caption])`` bit for bit, and ``encode_prompt(captions)`` for any batch the
pipeline does not pad. Since no row depends on padding, a caption's row count comes from the tokenizer alone
(:func:`count_tokens`: what ``bucketeer estimate`` and the GPU's length groups use).

**The one deviation:** the pipeline has no length limit; the cache needs one (``TextLayout.lengths``), so a
caption keeps at most :data:`TOKENS` (1024, as Qwen-Image's limit) rows, its template tokenized up to ``drop +
1024`` tokens. Qwen3-VL is causal: the rows kept are the first 1024 of what the pipeline computes (equal up to
float rounding: the pipeline's attention sums over the longer sequence), and a caption under the cap is exact.

The text encoder is loaded as ``Qwen3VLModel`` (the pipeline's ``Qwen3VLForConditionalGeneration`` without its
``lm_head``, whose logits the pipeline computes and drops): the same hidden states. Latents: the pipeline's
``AutoencoderKLQwenImage21`` reads **RGBA** (``:662-671``: condition images are converted to RGBA; alpha is
+1 for an opaque image): :func:`vae_latents` appends that alpha to the RGB the embed job reads, and normalises
the posterior mode per channel as ``_encode_vae_image`` (``:429-450``) does.
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.errors import UsageError
from pipeline.embed.families import qwen_image
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

__all__ = ["FAMILY", "SYSTEM", "TEMPLATE", "TOKENS", "count_tokens", "drop_count", "load_processor",
           "vae_description", "vae_latents"]

# 1024: our cap on a caption's rows (the pipeline has none): the one deviation, see the module docstring
TOKENS = spec_of("qwen-image-2.1").text.max_tokens(None)
SYSTEM = "Comprehend and analyze the provided prompt."  # QwenImage21Pipeline.sys_prompt
TEMPLATE = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
            "<|im_start|>assistant\n")  # QwenImage21Pipeline.prompt_template_t2i  # fmt: skip
SIDE = 32  # pixels: the transformer's img_mask holds one slot per 2x2 latents of the 16x VAE


def drop_count(tokenizer: Any) -> int:
    """``QwenImage21Pipeline._drop_idx``: the tokens of the system message alone as the chat template renders it
    (``processor.apply_chat_template(..., tokenize=True)``; the processor and its tokenizer read the same
    ``chat_template.jinja`` of the pipeline's ``processor/``). Raises UsageError when the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("the Qwen-Image 2.1 tokenizer has no chat template: pass the pipeline's folder "
                         "(its processor/ holds the template)")  # fmt: skip
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
    text = tokenizer.apply_chat_template(message, tokenize=False)
    return len(tokenizer(text).input_ids)  # Qwen has no BOS: the processor adds no special token either


def load_processor(path: str, subfolder: str = "processor") -> Any:
    """``Qwen3VLProcessor.from_pretrained(path, subfolder=subfolder)`` (how the pipeline loads its ``processor``);
    where transformers cannot build it for lack of torchvision (its video processor needs it), the same processor
    without a video processor, from the folder's tokenizer, image processor and chat template."""
    from transformers import AutoTokenizer, Qwen3VLProcessor

    from pipeline.embed.families.tiny_qwen21 import qwen3vl_processor
    from pipeline.embed.processors import load_image_processor

    try:
        return Qwen3VLProcessor.from_pretrained(path, subfolder=subfolder)
    except (ImportError, OSError):  # 5.x without torchvision: no video processor (ImportError, or none saved)
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder=subfolder)
        return qwen3vl_processor(tokenizer, load_image_processor(path, subfolder), tokenizer.chat_template)


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (qwen,) = models
    return TextLayout(family="qwen-image-2.1", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(qwen_image.width(qwen.model),))  # fmt: skip


def last_layer_before_norm(m: TextModel, enc: Any) -> Any:
    """``(B, L, D)``: ``hidden_states[-1]`` of the text model on the tokenizer's output ``enc``, run as the
    pipeline runs it: with the mask, all-text ``mm_token_type_ids``, and the final norm made the identity."""
    import torch

    text_model = getattr(m.model, "language_model", m.model)
    handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        ids = enc.input_ids
        out = m(ids, attention_mask=enc.attention_mask.to(m.device), output_hidden_states=True,
                mm_token_type_ids=torch.zeros_like(ids).to(m.device))  # fmt: skip
    finally:
        handle.remove()
    return out.hidden_states[-1]


def _token_counts(tokenizer: Any, texts: list[str], drop: int) -> list[int]:
    """Tokens of each templated text, cut at ``drop`` + :data:`TOKENS` as :func:`encode` cuts it."""
    return [len(ids) for ids in tokenizer(texts, max_length=drop + TOKENS, truncation=True).input_ids]


def count_tokens(models: list[TextModel], captions: list[str], options: TextOptions) -> list[int]:
    """Each caption's rows (its template's tokens past the system message, at most ``max_tokens``), from the
    tokenizer alone: :func:`encode` never pads, so no row depends on the captions beside it."""
    (qwen,) = models
    drop = drop_count(qwen.tokenizer)
    counts = _token_counts(qwen.tokenizer, [TEMPLATE.format(c or " ") for c in captions], drop)
    return [min(n - drop, int(options.max_tokens)) for n in counts]


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    (qwen,) = models
    drop = drop_count(qwen.tokenizer)
    texts = [TEMPLATE.format(c or " ") for c in captions]
    lengths = _token_counts(qwen.tokenizer, texts, drop)
    rows: list[Any] = [None] * len(texts)
    for n in sorted(set(lengths)):  # equal token counts: no padding, so no caption's rows depend on another's
        group = [i for i, k in enumerate(lengths) if k == n]
        enc = qwen.tokenizer([texts[i] for i in group], max_length=drop + TOKENS, truncation=True, padding=True,
                             padding_side="left", return_tensors="pt")  # fmt: skip
        hidden = last_layer_before_norm(qwen, enc)  # (g, n, D)
        for i, h, k in zip(group, hidden, enc.attention_mask):
            rows[i] = h[k.bool().to(h.device)][drop:][: options.max_tokens]
    return qwen_image.pad_parts(rows)


FAMILY = declared("qwen-image-2.1", layout=layout, encode=encode, count_tokens=count_tokens)


# ---------------------------------------------------------------- latents (AutoencoderKLQwenImage21)


def vae_description(config: Any) -> dict[str, Any]:
    """What ``_cache.json`` records of an ``AutoencoderKLQwenImage21`` config: 16x, ``z_dim`` (64) channels,
    stored normalised per channel (:func:`qwen_image.vae_description`'s record), RGBA input."""
    out = qwen_image.vae_description(config)
    out["factor"] = int(config.scale_factor_spatial or 2 ** (len(config.dim_mult) - 1))
    out["normalised"]["how"] += "; the image read as RGBA with alpha +1 (opaque), as QwenImage21Pipeline reads it"
    return out


def vae_latents(vae: Any, x: Any, *, std: bool) -> dict[str, Any]:
    """RGB images ``(B, 3, H, W)`` in [-1, 1] as the pipeline's VAE reads them: RGBA with alpha +1 (an opaque
    image converted to RGBA, ``QwenImage21Pipeline.__call__``), a 1-frame clip, the posterior mode normalised per
    channel (``_encode_vae_image``): ``{"latent"}`` ``(B, 64, H/16, W/16)`` (and ``{"latent_std"}``). Raises
    UsageError for a side that is not a multiple of 32 pixels (the transformer groups latents 2x2)."""
    import torch

    height, width = x.shape[-2:]
    if height % SIDE or width % SIDE:
        raise UsageError(f"a {width}x{height} image: Qwen-Image 2.1 needs sides that are multiples of {SIDE} "
                         f"pixels (a 16x VAE, latents grouped 2x2); scan with a --bucket-step that is a multiple "
                         f"of {SIDE}")  # fmt: skip
    rgba = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)  # (B, 4, H, W): alpha 255 / 127.5 - 1 = +1
    return qwen_image.vae_latents(vae, rgba, std=std)
