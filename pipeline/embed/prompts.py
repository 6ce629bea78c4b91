"""Texts embedded besides the samples' captions: the empty caption and the validation prompts.

The empty caption's text record (``caption_key("")``, in ``_cache.json``'s ``text.empty_caption_key``)
is what caption dropout trains on, and a null caption's text. ``--validation-prompts FILE`` (one
prompt a line, a local path or URL) are embedded too and listed in
``_cache.json``'s ``text.validation_prompts`` as ``[{"prompt", "caption_key"}]``, so a trainer samples
validation images without loading text encoders. Each is embedded once per cache; a rerun without
the option keeps the listed prompts.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from manifests.cache import CacheMeta
from manifests.cache.records import caption_key
from manifests.errors import UsageError
from manifests.storage import open_url, read_bytes, redact

__all__ = ["committed_prompts", "missing_texts", "prompt_texts", "read_validation_prompts"]


def read_validation_prompts(url: str, storage_options: dict | None = None) -> list[dict[str, Any]]:
    """``[{"prompt", "caption_key"}]`` of the prompts file at ``url``: one a line, stripped, blank
    lines skipped, duplicates once, in file order. UsageError for a missing, non-UTF-8 or empty file."""
    try:
        fs, path = open_url(url, storage_options)
        data = read_bytes(fs, path)
    except FileNotFoundError:
        raise UsageError(f"--validation-prompts {redact(url)}: no such file") from None
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UsageError(f"--validation-prompts {redact(url)} is not UTF-8 text ({e})") from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise UsageError(f"--validation-prompts {redact(url)} has no prompt (one per line)")
    return [{"prompt": p, "caption_key": caption_key(p)} for p in dict.fromkeys(prompts)]


def committed_prompts(meta: CacheMeta | None) -> list[dict[str, Any]]:
    """The validation prompts a cache's ``_cache.json`` lists, as written there ([] without a cache)."""
    prompts = meta.text.validation_prompts if meta is not None and meta.text is not None else None
    return [p.to_json() for p in prompts or ()]


def prompt_texts(validation: list[dict[str, Any]]) -> dict[int, str]:
    """Caption key -> text of everything embedded besides the captions: the empty caption and ``validation``."""
    return {caption_key(""): "", **{int(p["caption_key"]): p["prompt"] for p in validation}}


def missing_texts(texts: dict[int, str], done: Iterable[int]) -> dict[int, str]:
    """The ``texts`` without a committed text record; ``done``: the caption keys that have one
    (:func:`manifests.cache.index_lookup`'s sorted array)."""
    have = {int(k) for k in np.intersect1d(np.asarray(done, np.uint64), np.fromiter(texts, np.uint64, len(texts)))}
    return {k: t for k, t in texts.items() if k not in have}
