"""What ``bucketeer plan`` plans from: each manifest's samples, less those without an up-to-date cache record.

A record is fresh when it was made from the manifest row as it is now (same size, etag or mtime,
caption and bucket); stale ones are left out of the plan, never trained on. A selection (``--where``,
``--weight-by``: :mod:`manifests.select`) keeps only the samples it keeps and gives them its weights. The result
is one
:class:`manifests.plan.DatasetSamples` per manifest, what :func:`manifests.plan.write_plan` and
:func:`manifests.plan.extend_plan` take.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from manifests.errors import UsageError
from manifests.plan import DatasetSamples
from manifests.plan.mix import caption_counts
from manifests.plan.selection import selected_rows
from manifests.plan.schedule import cached_mask
from manifests.cache.meta import CacheMeta
from manifests.storage import redact

__all__ = ["cache_inputs", "load_datasets", "read_manifests"]


def cache_inputs(url: str, options: Mapping[str, Any], manifest: Any = None) -> tuple[np.ndarray, CacheMeta, int]:
    """``(ids with a good record, cache meta, stale count)``; with a manifest only fresh records count."""
    from manifests.cache import available_sample_ids, cache_freshness, read_cache_meta

    options = dict(options)
    meta = read_cache_meta(url, options)
    if manifest is None:
        return np.asarray(available_sample_ids(url, options), dtype=np.uint64), meta, 0
    status = cache_freshness(url, manifest, options)
    return np.unique(status.sample_ids[status.fresh]), meta, int(status.stale.sum())


def _dataset(manifest: Any, cache: str | None, options: Mapping[str, Any], selection: Any) -> DatasetSamples:
    """A manifest's samples to plan. Raises UsageError when no sample has an up-to-date record."""
    url = manifest.url
    ids = manifest.samples.column("sample_id").to_numpy()
    buckets = manifest.samples.column("bucket")
    counts = caption_counts(manifest.samples)
    cache_fp, left_out, stale = None, 0, 0
    if cache:
        available, cache_meta, stale = cache_inputs(cache, options, manifest)
        keep = cached_mask(ids, available)
        left_out = int((~keep).sum()) - stale
        if stale and not keep.any():
            raise UsageError(
                f"none of the {len(ids)} samples of {redact(url)} has an up-to-date record in "
                f"{redact(cache)} ({stale} changed since they were embedded): run "
                f"`bucketeer embed {redact(url)} --out {redact(cache)}` first"
            )
        cache_fp = cache_meta.fingerprint
    else:
        keep = np.ones(len(ids), bool)
    selected, weights = selected_rows(selection, len(ids))
    keep = keep & selected
    ids, buckets = ids[keep], buckets.filter(pa.array(keep))
    counts = None if counts is None else counts[keep]
    return DatasetSamples(ids, buckets, counts, redact(url), manifest_fingerprint=manifest.fingerprint,
                          cache_fingerprint=cache_fp, manifest=url, cache=cache, not_in_cache=left_out, stale=stale,
                          weights=None if weights is None else weights[keep])  # fmt: skip


def read_manifests(urls: Sequence[str], options: Mapping[str, Any]) -> list[Any]:
    """Each manifest read (:func:`manifests.manifest.read_manifest`)."""
    from manifests.manifest import read_manifest

    return [read_manifest(url, dict(options)) for url in urls]


def load_datasets(manifests: Sequence[Any], caches: Sequence[str | None], options: Mapping[str, Any],
                  selections: Sequence[Any] = ()) -> list[DatasetSamples]:  # fmt: skip
    """One :class:`DatasetSamples` per manifest (read, :func:`read_manifests`; ``caches``: one per manifest,
    None for none; ``selections``: one :class:`manifests.select.Selection` per manifest, or none). Raises
    UsageError for the same manifest given twice."""
    chosen = list(selections) or [None] * len(manifests)
    loaded = [(m, _dataset(m, cache, options, s)) for m, cache, s in zip(manifests, caches, chosen)]
    seen: dict[str, int] = {}
    for d, (manifest, _) in enumerate(loaded):
        if manifest.fingerprint in seen:
            first = seen[manifest.fingerprint]
            raise UsageError(f"manifest {redact(manifests[d].url)} is the same as manifest {first} "
                             f"({redact(manifests[first].url)}): give each once and raise its "
                             "--repeats or --weights instead")  # fmt: skip
        seen[manifest.fingerprint] = d
    return [samples for _, samples in loaded]
