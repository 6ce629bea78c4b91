"""What a family's pipeline feeds its text encoders and what its ``encode_prompt`` returns, in the cache's form.

Shared by ``tests/test_checkpoint_files.py`` and ``tests/vision_check.py`` (the families whose pipeline loads a
processor that needs torchvision): :data:`HARD_CAPTIONS`, :func:`recorded_inputs` (every forward call's token ids
and mask, per text encoder) and :func:`pipeline_text` (``encode_prompt``'s output cut into the rows the cache
stores per caption, so that a record compares with it bit for bit).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

_WORDS = ("the quick brown fox jumps over a lazy dog near river bank while golden light falls on old stone "
          "bridge and children play").split()  # fmt: skip
HARD_CAPTIONS = [
    "",
    "cat",
    " ".join(_WORDS[i % len(_WORDS)] for i in range(2000)),  # 2,000 words: past every family's length
    "naïve café 漢字 かな 한국어 🙂👩‍👩‍👧 e\u0301 \u200bzero\u200dwidth",  # unicode, emoji, ZWJ, combining, zero-width
    "مرحبا بالعالم ושלום עולם mixed left to right",  # right-to-left scripts
    # the templates' own special tokens, as text a caption can hold
    "[INST] a [/INST] <|im_start|>system\nx<|im_end|> <image> <|image_pad|> <|vision_start|> [IMG] <s></s> "
    "<|endoftext|> <pad> <start_of_image> [SYSTEM_PROMPT] <think></think>",
    'a sign that says "OPEN 24/7" and “Café” in neon',  # quoted text: HunyuanVideo 1.5's glyph encoder reads it
    "trailing whitespace   \n\t ",
    "  leading\n\nnew lines\r\nand\ttabs",
]


@contextlib.contextmanager
def recorded_inputs(modules: list[Any]) -> Iterator[list[list[tuple[torch.Tensor, torch.Tensor | None]]]]:
    """Record ``(input_ids, attention_mask or None)`` of every forward call of each of ``modules`` (in order)."""
    calls: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = [[] for _ in modules]

    def hook(i: int):
        def pre(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            if ids is not None:
                calls[i].append((ids.detach().cpu().clone(), None if mask is None else mask.detach().cpu().clone()))

        return pre

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def sequences(calls: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[list[int]]:
    """Each row of the recorded calls as a list of ids: the positions its mask keeps (all of them without one)."""
    out = []
    for ids, mask in calls:
        for i in range(ids.shape[0]):
            row = ids[i] if mask is None else ids[i][mask[i].bool()]
            out.append(row.tolist())
    return out


Text = tuple[list[torch.Tensor], torch.Tensor | None]  # per caption: the stored parts (L_i, D_i), the pooled vector


def pipeline_text(family: str, pipe: Any, captions: list[str], widths: tuple[int, ...]) -> list[Text]:
    """Per caption, what ``pipe.encode_prompt(captions)`` (called as the family's ``__call__`` calls it) gives, cut
    into the cache's parts: the rows a record stores (a masked family: the mask's rows only) and the pooled vector
    (Chroma: the transformer's mask). ``widths``: the layout's part widths (SDXL and SD3 join parts on features)."""
    with torch.no_grad():
        return _pipeline_text(family, pipe, captions, widths)


def _pipeline_text(family: str, pipe: Any, captions: list[str], widths: tuple[int, ...]) -> list[Text]:
    n = len(captions)
    if family == "sdxl":
        embeds, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
        return [([embeds[i, :, : widths[0]], embeds[i, :, widths[0]:]], pooled[i]) for i in range(n)]
    if family == "sd3":
        embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, device="cpu",
                                                  do_classifier_free_guidance=False)  # fmt: skip
        lw, gw, tw = widths
        return [([embeds[i, :77, :lw], embeds[i, :77, lw: lw + gw], embeds[i, 77:, :tw]], pooled[i]) for i in range(n)]
    if family == "flux":
        embeds, pooled, _ = pipe.encode_prompt(captions, device="cpu")
        return [([embeds[i]], pooled[i]) for i in range(n)]
    if family in ("flux2", "flux2-klein"):
        embeds, _ = pipe.encode_prompt(captions, device="cpu")
        return [([embeds[i]], None) for i in range(n)]
    if family == "chroma":
        embeds, _, mask, *_ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
        return [([embeds[i]], mask[i].to(embeds.dtype)) for i in range(n)]
    if family == "pixart":
        embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, device="cpu")
        return [([embeds[i][mask[i].bool()]], None) for i in range(n)]
    if family in ("wan", "wan2.2-a14b", "wan2.2-ti2v-5b"):
        # __call__'s length (its encode_prompt's own default is 226); the mask is not returned: zeros after
        embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=512)  # fmt: skip
        real = [int((e.abs().sum(-1) != 0).nonzero().max()) + 1 if e.abs().sum() else 0 for e in embeds]
        return [([embeds[i, : real[i]]], None) for i in range(n)]
    if family == "qwen-image":
        return [([pipe.encode_prompt([c], device="cpu", max_sequence_length=512)[0][0]], None)
                for c in captions]  # fmt: skip # __call__'s length
    if family == "z-image":
        return [([pipe.encode_prompt([c], device="cpu", do_classifier_free_guidance=False)[0][0]], None)
                for c in captions]  # fmt: skip
    if family == "hunyuanvideo-1.5":
        e, m, e2, m2 = pipe.encode_prompt(captions, device="cpu", batch_size=n)
        return [([e[i][m[i].bool()], e2[i][m2[i].bool()]], None) for i in range(n)]
    if family == "ltx-2":
        embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, device="cpu")
        return [([embeds[i][mask[i].bool()]], None) for i in range(n)]
    raise ValueError(f"no encode_prompt call written for {family}")
