"""The identity of a sample record's latents, whatever dataset, file name or family holds the image.

:func:`latent_key` hashes the image's content (sha256 of its bytes), its bucket and the exact geometry; every other
setting that makes a latent (the VAE, dtype, variants) is the cache's own (``_cache.json``) and compared as a whole.
The cache index stores it per record (``latent_key``); ``embed --reuse`` looks records up by it, ``verify`` checks it
against the record (:func:`record_latent_key`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from manifests.cache.records import SampleRecord

__all__ = ["latent_key", "record_latent_key"]


def latent_key(content: str, bucket: str, original_size: tuple[int, int], resized_size: tuple[int, int],
               crops: Sequence[tuple[int, int]], flips: int) -> int:
    """uint64 identity of a sample record's latents, whatever dataset or file name holds the image: the sha256
    ``content`` (hex) of the image's bytes, the ``bucket``, the ``(h, w)`` ``original_size`` and ``resized_size``,
    each crop's ``(top, left)`` (``embed --crops K``: K of them, before mirroring) and ``flips`` (2 with ``--flip``).
    The VAE and every other setting are the cache's (``_cache.json``), compared as a whole."""
    text = json.dumps([content, bucket, [int(x) for x in original_size], [int(x) for x in resized_size],
                       [[int(t), int(l)] for t, l in crops], int(flips)], separators=(",", ":"))  # fmt: skip
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def record_latent_key(record: SampleRecord) -> int | None:
    """:func:`latent_key` of what ``record`` holds (its own content and geometry), None without ``content``."""
    if record.content is None:
        return None
    if record.variant_crops is None:
        crops, flips = [record.crop_top_left], 1
    else:
        flips = 2 if record.variant_flips is not None and int(np.max(record.variant_flips, initial=0)) else 1
        crops = [tuple(c) for c in np.asarray(record.variant_crops)[::flips]]  # the unmirrored crop of each pair
    return latent_key(record.content, record.bucket, record.original_size, record.resized_size, crops, flips)
