"""ERNIE-Image: Ministral 3's second-to-last hidden states of the raw caption, unpadded, real tokens only.

Mirrors ``ErnieImagePipeline.encode_prompt`` (``d/pipelines/ernie_image/pipeline_ernie_image.py:131-171``,
diffusers 0.42.1): **one caption at a time**, the caption as it is (no template, no cleaning), tokenized with
``add_special_tokens=True, truncation=True, padding=False`` (cut only at the tokenizer's ``model_max_length``); an
empty result becomes ``[bos_token_id]`` (``[0]`` without one, ``:152-156``); the ``Mistral3Model`` text encoder runs
on it **without an attention mask** (there is no padding) and ``hidden_states[-2][0]``, the input of the last decoder
layer, is the caption's ``(n, 3072)`` rows. ``__call__`` zero-pads the list (``_pad_text``, ``:189-204``) and gives
the transformer ``text_bth`` with ``text_lens``; the transformer masks the pad rows out and puts every image token's
first RoPE coordinate at ``text_lens`` (``transformer_ernie_image.py:414-428``). So the real rows are stored, nothing
else; the trainer zero-pads them and passes their counts (:mod:`train.recipes.ernie_image`).

Captions run one at a time on the CPU, as ``encode_prompt`` runs them: each caption's rows equal the pipeline's bit
for bit in fp32. On a GPU captions of equal token count run together (no padding, so no mask either way): a
caption's rows never depend on the captions beside it, beyond an ulp of a batch size's kernels.

The one deviation: the pipeline has no length cap (it cuts at its tokenizer's ``model_max_length`` only), a cache
needs one for its layout: :data:`TOKENS` (1024) by default, ``--max-text-tokens`` up to :data:`TOKENS_LIMIT`; a
longer caption is cut there (its rows are the pipeline's with ``tokenizer.model_max_length`` set to the cap, and the
first rows of the uncut caption's to float rounding, the LLM being causal), a shorter one is exact.
The text encoder runs as its language model only, up to the layer read (:func:`prune`: no Pixtral tower, not the last
decoder layer, whose input is the output of the one before).

Latents: ``AutoencoderKLFlux2``'s posterior mean patchified 2x2 and normalised by its batch-norm statistics as
Flux 2's, but with ``eps`` **1e-5** hard-coded (``:377-380``, a TODO saying the hub config's ``batch_norm_eps``,
1e-4, is not the trained value): the family declares it (``Vae.bn_eps``, :mod:`manifests.families.recent`) and
:func:`pipeline.embed.latents.vae_kind` normalises with it. ``_cache.json`` records that eps (``normalised``), so a
Flux 2 cache's latents (eps from the config) are never taken by ``embed --reuse`` for ERNIE, nor the other way round.
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from pipeline.embed.families import flux2
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared
from pipeline.embed.families.qwen_image import pad_parts, width

__all__ = ["FAMILY", "TOKENS", "TOKENS_LIMIT", "token_ids", "prune"]

TOKENS = spec_of("ernie-image").text.max_tokens(None)  # 1024: our default cap (the pipeline has none)
TOKENS_LIMIT = spec_of("ernie-image").text.limit  # 16384: Ministral 3's rope window before YaRN's extension



def token_ids(tokenizer: Any, captions: list[str], max_tokens: int) -> list[list[int]]:
    """Each caption's ids as ``encode_prompt`` tokenizes it (``:145-156``), cut at ``max_tokens`` (or the
    tokenizer's ``model_max_length``, where the pipeline cuts, when lower); empty: ``[bos]``."""
    limit = min(int(max_tokens), int(tokenizer.model_max_length))
    ids = tokenizer(list(captions), add_special_tokens=True, truncation=True, padding=False,
                    max_length=limit).input_ids  # fmt: skip
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    return [list(x) if len(x) else [bos] for x in ids]


def prune(model: Any) -> Any:
    """The language model of a ``Mistral3Model`` without its last decoder layer (nor the vision tower): the output
    of its last layer is the full model's ``hidden_states[-2]``."""
    return flux2.prune(model, (int(model.config.get_text_config().num_hidden_layers) - 1,))


def _second_to_last(m: TextModel, ids: Any) -> Any:
    """``(B, L, D)``: the output of the last layer of :func:`prune`'s decoder on ``ids`` ``(B, L)``, no mask (as
    ``encode_prompt`` runs it); the decoder's final norm is not part of it."""
    captured: list[Any] = []
    hook = m.model.layers[-1].register_forward_hook(
        lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))  # fmt: skip
    try:
        m(ids, use_cache=False)
    finally:
        hook.remove()
    return captured[0]


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (m,) = models
    return TextLayout(family="ernie-image", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(width(m.model),))  # fmt: skip


def count_tokens(models: list[TextModel], captions: list[str], options: TextOptions) -> list[int]:
    (m,) = models  # nothing is padded: a caption's rows are its own tokens
    return [len(x) for x in token_ids(m.tokenizer, captions, int(options.max_tokens))]


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    import torch

    (m,) = models
    ids = token_ids(m.tokenizer, captions, int(options.max_tokens))
    # one caption at a time, as encode_prompt runs them (a batch of two moves rows by an ulp of float32 on the
    # CPU); on a GPU, captions of equal length together: no padding, so no mask, either way
    batched = m.device.type == "cuda"
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        groups.setdefault(len(x) if batched else i, []).append(i)
    rows: list[Any] = [None] * len(captions)
    for group in groups.values():
        for i, h in zip(group, _second_to_last(m, torch.tensor([ids[i] for i in group]))):
            rows[i] = h
    return pad_parts(rows)


# ---------------------------------------------------------------- latents (AutoencoderKLFlux2, ERNIE's eps)


FAMILY = declared("ernie-image", layout=layout, encode=encode, prune=prune, count_tokens=count_tokens)
