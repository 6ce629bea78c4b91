"""Anima: Qwen3's last hidden states and the caption's T5 token ids through the frozen ``AnimaTextConditioner``.

Mirrors ``AnimaModularPipeline`` (diffusers 0.42.1, a modular pipeline only: ``d/modular_pipelines/anima/``). Its
text encoder step (``encoders.py:119-166``) tokenizes the raw caption twice, ``padding="longest"``,
``max_length`` 512, truncation: with the ``tokenizer`` (Qwen2, no template) for ``Qwen3Model``, whose
``last_hidden_state`` times the mask is kept (pads zeroed; a batch of empty captions becomes one masked zero id,
``:134-136``), and with the ``t5_tokenizer``, whose ids and mask are kept as they are (there is no T5 model). Its
text conditioning step (``before_denoise.py:198-215``) runs the ``text_conditioner`` (``AnimaTextConditioner``,
``d/models/condition_embedders/condition_embedder_anima.py:229-346``: learned T5-id embeddings cross-attending to
the Qwen3 states, both masked) in the conditioner's dtype; its output is zero past each caption's T5 tokens and
zero-padded to ``min_sequence_length`` (512) rows: the ``CosmosTransformer3DModel``'s ``encoder_hidden_states``,
which takes no text mask.

So the conditioner runs here, at embed, with the pipeline's own functions (``AnimaTextEncoderStep.encode_prompt``,
``AnimaTextConditioningStep._condition_prompt_embeds``), and the cache stores its output's real rows, one per T5
token (masked layout, at most 512): the trainer zero-pads them to 512 as the conditioner does, which is exactly
what the pipeline feeds its transformer. The adapter is therefore **frozen** in training (its weights are in the
cache's fingerprint); the T5 ids, integers up to 32,127, never need storing (bf16 holds integers exactly only to
256). The pipeline pads a batch to its longest caption, and even an unpadded batch moves a caption's rows in the last
bits (Qwen3 and the adapter are not batch-invariant in fp32), so each caption is encoded alone, as the pipeline
encodes one prompt: its rows equal the pipeline's bit for bit, whatever captions share the embed batch.
:func:`companions` loads the T5 tokenizer and the conditioner from the pipeline folder.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared
from pipeline.embed.families.qwen_image import pad_parts

__all__ = ["FAMILY", "TOKENS", "companions", "encode_each"]

# 512: AnimaTextEncoderStep's max_sequence_length default (InputParam.template), the conditioner's pad length
TOKENS = spec_of("anima").text.max_tokens(None)


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    _, conditioner = models
    return TextLayout(family="anima", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(int(conditioner.info["hidden_size"]),))  # fmt: skip


def _components(qwen3: TextModel, conditioner: TextModel) -> Any:
    """What the pipeline's encode and conditioning functions read of ``components``."""
    return SimpleNamespace(tokenizer=qwen3.tokenizer, text_encoder=qwen3.model, t5_tokenizer=conditioner.tokenizer,
                           text_conditioner=conditioner.model)  # fmt: skip


def encode_each(qwen3: TextModel, conditioner: TextModel, captions: list[str], max_tokens: int) -> list[Any]:
    """Per caption, its conditioner rows ``(n_t5, D)`` (a ``shapes_only`` run: zeros ``(n_t5, 1)``), each caption
    encoded alone, as the pipeline encodes one prompt: in fp32 on the CPU Qwen3's and the adapter's rows of a caption
    differ in the last bits between a batch of one and a batch of several, even of equal lengths (no padding)."""
    import torch
    from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    components = _components(qwen3, conditioner)
    dtype = torch.float32 if conditioner.model is None else next(qwen3.model.parameters()).dtype
    out = []
    for caption in captions:
        text = AnimaTextEncoderStep.encode_prompt(components, [caption], prepare_unconditional_embeds=False,
                                                  max_sequence_length=max_tokens, device=qwen3.device, dtype=dtype)
        keep = int(text["t5_attention_mask"].sum())  # the T5 tokens' rows: the rest is the conditioner's zero padding
        if conditioner.model is None:  # shapes only: the rows a caption has, no weights
            out.append(torch.zeros(keep, 1))
            continue
        rows = AnimaTextConditioningStep._condition_prompt_embeds(
            components, text["qwen_prompt_embeds"], text["qwen_attention_mask"], text["t5_input_ids"],
            text["t5_attention_mask"], qwen3.device, conditioner.model.dtype, conditioner.model.dtype)  # (1, 512, D)
        out.append(rows[0, :keep])
    return out


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    qwen3, conditioner = models
    return pad_parts(encode_each(qwen3, conditioner, list(captions), int(options.max_tokens)))


def companions(folder: str, ident: str, dtype: Any, device: Any, weights: bool) -> list[TextModel]:
    """The pipeline folder's ``t5_tokenizer`` and ``text_conditioner`` (``AnimaTextConditioner``, loaded in
    ``dtype`` as ``load_components(dtype=)`` loads it) as one :class:`TextModel`; ``weights=False``: the
    tokenizer and the conditioner's config only (its ``model`` None). UsageError when the folder lacks them."""
    from diffusers import AnimaTextConditioner
    from transformers import T5TokenizerFast

    from pipeline.embed.loading import check_local, weights_sha256

    hint = " Anima's T5 tokenizer and text conditioner are read from the pipeline folder (--model)."
    check_local(folder, "t5_tokenizer", "--model", "t5_tokenizer", ("tokenizer_config.json",), hint)
    check_local(folder, "text_conditioner", "--model", "text_conditioner", ("config.json",), hint)
    tokenizer = T5TokenizerFast.from_pretrained(folder, subfolder="t5_tokenizer")
    config = AnimaTextConditioner.load_config(folder, subfolder="text_conditioner")
    info = {"id": ident, "subfolder": "text_conditioner", "class": "AnimaTextConditioner",
            "hidden_size": int(config["target_dim"]), "min_sequence_length": int(config["min_sequence_length"]),
            "max_length": min(int(tokenizer.model_max_length), 4096),  # the pipeline's check_inputs allows 4096
            "t5_tokenizer": "t5_tokenizer"}  # fmt: skip
    if not weights:
        return [TextModel(tokenizer, None, device, info)]
    model = AnimaTextConditioner.from_pretrained(folder, subfolder="text_conditioner")
    info["weights_sha256"] = weights_sha256(model)  # as the checkpoint holds them
    if model.dtype != dtype:  # as the pipeline loads it (from_pretrained(dtype=)), not a cast of ours
        model = AnimaTextConditioner.from_pretrained(folder, subfolder="text_conditioner", dtype=dtype)
    return [TextModel(tokenizer, model.eval().to(device), device, info)]


FAMILY = declared("anima", layout=layout, encode=encode, companions=companions)
