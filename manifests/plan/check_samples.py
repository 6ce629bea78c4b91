"""Which samples an epoch of a plan holds: duplicates, coverage and membership, one manifest or a mixture.

:mod:`manifests.plan.check` runs these per epoch, after the checks every plan shares (columns, equal
steps, batch sizes). A one-manifest plan: within a whole epoch no sample appears twice except the
counted padding, and every planned sample appears or is counted as dropped; each sample is in the
manifest, in the bucket the row names. A mixture: each sample's dataset index names one of the
plan's datasets; in a whole epoch each bucket holds exactly its slots per epoch minus its dropped
plus its padded, and each dataset exactly the slots ``_plan.json`` records for it; with ``--leftover
drop`` no ``(dataset, sample id)`` appears more often than the counting rule allows
(``ceil(k_{d,b} / n_{d,b})``; with ``--weight-by``, ``ceil(x_i)`` of each sample's expected draws, beyond
the epoch's padded repeats, checked when the manifests are given); with the manifests given, each
``(dataset, id)`` is a sample of that dataset's manifest (and cache), in the bucket the row names, with the
caption index the caption choice gives. All vectorised: one epoch's rows in memory.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.plan.meta import PLAN_FILE, EpochEntry, PlanMeta
from manifests.plan.mix import MixedSamples, caption_choice, draw_limits
from manifests.plan.schedule import BucketedSamples

__all__ = ["bucket_codes", "manifest_index", "check_one_manifest_epoch", "check_mixture_epoch"]


def bucket_codes(array: pa.Array, names: list[str]) -> np.ndarray:
    """(len(array),) int64 index of each string in ``names``, -1 for one not in it (vectorised)."""
    enc = pc.dictionary_encode(array)
    index = {n: i for i, n in enumerate(names)}
    remap = np.asarray([index.get(x, -1) for x in enc.dictionary.to_pylist()] + [-1], np.int64)
    return remap[enc.indices.to_numpy(zero_copy_only=False)]


def _flat(tables: list[pa.Table], column: str) -> np.ndarray:
    return np.concatenate([t.column(column).combine_chunks().flatten().to_numpy() for t in tables])


def manifest_index(samples: BucketedSamples, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, codes)``: the manifest's sample ids sorted (n,) uint64, and each one's bucket as an index into
    ``names`` (n,) int64 (-2 for a bucket the plan does not have)."""
    order = np.argsort(samples.ids)
    index = {n: i for i, n in enumerate(names)}
    bucket_code = np.asarray([index.get(n, -2) for n in samples.names], np.int64)
    return samples.ids[order], np.repeat(bucket_code, samples.counts)[order]


def check_one_manifest_epoch(epoch: int, entry: EpochEntry, tables: list[pa.Table], meta: PlanMeta,
                             index: tuple[np.ndarray, np.ndarray] | None) -> list[str]:  # fmt: skip
    """Duplicates, coverage and bucket membership of one epoch's samples, vectorised."""
    problems = []
    names = sorted(meta.buckets)
    planned = {n: b.samples for n, b in meta.buckets.items()}
    manifest_ids, manifest_codes = index if index is not None else (None, None)
    ids = np.concatenate([t.column("sample_ids").combine_chunks().flatten().to_numpy() for t in tables])  # (n,)
    row_bucket = pa.concat_arrays([t.column("bucket").combine_chunks() for t in tables])
    lengths = np.concatenate([pc.list_value_length(t.column("sample_ids").combine_chunks()).to_numpy() for t in tables])
    codes = np.repeat(bucket_codes(row_bucket, names), lengths)  # (n,) bucket of each sample slot
    if manifest_ids is not None:
        pos = np.clip(np.searchsorted(manifest_ids, ids), 0, max(len(manifest_ids) - 1, 0))
        known = (manifest_ids[pos] == ids) if len(manifest_ids) else np.zeros(len(ids), bool)
        if not known.all():
            problems.append(
                f"epoch {epoch}: {int((~known).sum())} sample ids are not in the manifest (or not in the cache)"
            )
        wrong = known & (manifest_codes[pos] != codes)
        if wrong.any():
            problems.append(
                f"epoch {epoch}: {int(wrong.sum())} samples sit in a batch of another bucket than their own"
            )
    full = entry.full
    for code, name in enumerate(names):
        mine = ids[codes == code]
        distinct = len(np.unique(mine))
        repeats = len(mine) - distinct
        padded, dropped = entry.padded.get(name, 0), entry.dropped.get(name, 0)
        if (full and repeats != padded) or repeats > padded:
            problems.append(
                f"epoch {epoch} bucket {name}: {repeats} repeated samples, but _plan.json counts {padded} padded "
                "(a sample appears twice that is not padding)"
            )
        if full and distinct + dropped != planned.get(name, 0):
            problems.append(
                f"epoch {epoch} bucket {name}: {distinct} distinct samples + {dropped} dropped != "
                f"{planned.get(name, 0)} planned (samples are missing or foreign)"
            )
    return problems


def check_mixture_epoch(epoch: int, entry: EpochEntry, tables: list[pa.Table], meta: PlanMeta,
                        mix: MixedSamples | None) -> list[str]:  # fmt: skip
    """Violations of the mixture rule in one epoch; with ``mix`` (re-made from the manifests) membership too."""
    problems = []
    info = meta.mix.datasets  # type: ignore[union-attr]
    n_sets = len(info)
    ids = _flat(tables, "sample_ids")  # (n,)
    datasets = _flat(tables, "dataset").astype(np.int64) if "dataset" in tables[0].column_names \
        else np.zeros(len(ids), np.int64)  # fmt: skip
    rows_bucket = pa.concat_arrays([t.column("bucket").combine_chunks() for t in tables])
    lengths = np.concatenate([pc.list_value_length(t.column("sample_ids").combine_chunks()).to_numpy() for t in tables])
    names = sorted(meta.buckets)
    codes = np.repeat(bucket_codes(rows_bucket, names), lengths)  # (n,) bucket of each slot
    if np.any((datasets < 0) | (datasets >= n_sets)):
        return [f"epoch {epoch}: {int(np.sum(datasets >= n_sets))} samples name a dataset outside 0..{n_sets - 1}"]
    full = entry.full
    if full:
        per_bucket = np.bincount(codes[codes >= 0], minlength=len(names))
        for b, name in enumerate(names):
            want = meta.buckets[name].samples - entry.dropped.get(name, 0) + entry.padded.get(name, 0)
            if per_bucket[b] != want:
                problems.append(f"epoch {epoch} bucket {name}: {int(per_bucket[b])} sample slots, but the rule gives "
                                f"{want} (per epoch - dropped + padded)")  # fmt: skip
        per_set = np.bincount(datasets, minlength=n_sets).tolist()
        if per_set != list(entry.datasets or ()):
            problems.append(f"epoch {epoch}: sample slots per dataset {per_set} != {_listed(entry.datasets)} in "
                            f"{PLAN_FILE}")  # fmt: skip
    weighted = meta.inputs.selection is not None and meta.inputs.selection.weight_by is not None
    if weighted and mix is not None and mix.weights is not None:
        problems += _weighted_limits(epoch, ids, datasets, mix, entry.padded_total)
    if meta.inputs.leftover == "drop" and not weighted:  # a (dataset, id) at most ceil(k_{d,b} / n_{d,b}) times
        order = np.lexsort((ids, datasets))
        key_d, key_i, key_b = datasets[order], ids[order], codes[order]
        new = np.concatenate([[True], (key_d[1:] != key_d[:-1]) | (key_i[1:] != key_i[:-1])])
        starts = np.flatnonzero(new)
        times = np.diff(np.append(starts, len(order)))
        limit = np.zeros((len(names), n_sets), np.int64)
        for d, ds in enumerate(info):
            for name, c in ds.buckets.items():
                if name in names:
                    limit[names.index(name), d] = -(-c.per_epoch // c.samples)
        bucket_of = key_b[starts]
        allowed = np.where(bucket_of >= 0, limit[np.maximum(bucket_of, 0), key_d[starts]], 0)
        over = times > allowed
        if over.any():
            problems.append(f"epoch {epoch}: {int(over.sum())} (dataset, sample) pairs appear more often than the "
                            "counting rule allows (a sample repeated that was not drawn)")  # fmt: skip
    if mix is not None:
        problems += _check_members(epoch, ids, datasets, codes, tables, meta, mix)
    return problems


def _weighted_limits(epoch: int, ids: np.ndarray, datasets: np.ndarray, mix: MixedSamples, padded: int) -> list[str]:
    """Weighted samples drawn more than ``ceil(x_i)`` times (their expected draws, rounded up) in one epoch,
    beyond the epoch's ``padded`` repeats (``--leftover pad`` fills a bucket's last global batch with repeats)."""
    limits = draw_limits(mix)  # (n,) in the mixture's order
    over = excess = 0
    for d in np.unique(datasets):  # a loop over datasets
        mine = mix.datasets == d
        order = np.argsort(mix.ids[mine])
        known_ids, limit = mix.ids[mine][order], limits[mine][order]
        drawn, times = np.unique(ids[datasets == d], return_counts=True)
        if not len(known_ids):
            continue
        pos = np.clip(np.searchsorted(known_ids, drawn), 0, len(known_ids) - 1)
        beyond = np.where(known_ids[pos] == drawn, np.maximum(times - limit[pos], 0), 0)
        over += int((beyond > 0).sum())
        excess += int(beyond.sum())
    if excess <= padded:
        return []
    return [f"epoch {epoch}: {over} weighted samples are drawn more often than ceil(their expected draws), "
            f"{excess} draws in all beyond the {padded} padded (a sample repeated that its --weight-by does not give)"]


def _listed(values: tuple[int, ...] | None) -> list[int] | None:
    return None if values is None else list(values)


def _check_members(epoch: int, ids: np.ndarray, datasets: np.ndarray, codes: np.ndarray, tables: list[pa.Table],
                   meta: PlanMeta, mix: MixedSamples) -> list[str]:  # fmt: skip
    """Each (dataset, id) is one of that dataset's samples, in its bucket, with the caption index the choice gives."""
    problems = []
    names = sorted(meta.buckets)
    # the mixture's samples by (dataset, id): their bucket (in names) and caption count
    order = np.lexsort((mix.ids, mix.datasets))
    m_sets, m_ids = mix.datasets[order].astype(np.int64), mix.ids[order]
    m_bucket = np.repeat(np.asarray([names.index(n) if n in names else -2 for n in mix.names]),
                         mix.strata.sum(axis=1))[order]  # fmt: skip
    lo = np.searchsorted(m_sets, datasets, "left")
    hi = np.searchsorted(m_sets, datasets, "right")
    pos = np.empty(len(ids), np.int64)
    for d in np.unique(datasets):  # a loop over datasets
        mine = datasets == d
        pos[mine] = lo[mine] + np.searchsorted(m_ids[lo[mine][0]:hi[mine][0]], ids[mine])
    pos = np.minimum(pos, len(m_ids) - 1)
    known = (m_ids[pos] == ids) & (m_sets[pos] == datasets)
    if not known.all():
        problems.append(f"epoch {epoch}: {int((~known).sum())} samples are not in their dataset's manifest "
                        "(or cache)")  # fmt: skip
    wrong = known & (m_bucket[pos] != codes)
    if wrong.any():
        problems.append(f"epoch {epoch}: {int(wrong.sum())} samples sit in a batch of another bucket than their own")
    if "caption_index" in tables[0].column_names and mix.caption_counts is not None:
        got = _flat(tables, "caption_index")
        several = len(meta.mix.datasets) > 1  # type: ignore[union-attr]
        want = caption_choice(meta.inputs.seed, epoch, ids, datasets if several else None,
                              mix.caption_counts[order][pos])  # fmt: skip
        bad = known & (got != want)
        if bad.any():
            problems.append(f"epoch {epoch}: {int(bad.sum())} caption indices are not the caption choice of "
                            "(seed, epoch, dataset, sample)")  # fmt: skip
    return problems
