"""Re-check a mixture plan (``bucketeer plan --check PLAN M1 M2 ... [--cache C1,C2,...]``).

Beyond what :mod:`manifests.plan.check` checks of every plan (columns, row groups, equal steps,
same bucket per step, batch sizes, file hashes): each sample's dataset index names one of the
plan's datasets; in a whole epoch each bucket holds exactly its slots per epoch minus its dropped
plus its padded, and each dataset exactly the slots ``_plan.json`` records for it; with ``--leftover
drop`` no ``(dataset, sample id)`` appears more often than the counting rule allows
(``ceil(k_{d,b} / n_{d,b})``); and with the manifests given: their fingerprints are the recorded
ones, each ``(dataset, id)`` is a sample of that dataset's manifest (and cache), in the bucket the
row names, each caption index is the one the caption choice gives, and (fresh plans) re-planning
from the manifests gives the same bytes.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.plan.check import _check_ranks
from manifests.plan.mix import (DatasetSamples, MixedSamples, MixRule, caption_choice, caption_counts, mix_epoch,
                                mix_samples)
from manifests.plan.parts import encode_epoch
from manifests.plan.schedule import PlanConfig, cached_mask
from manifests.plan.store import PLAN_FILE, read_plan_rows
from manifests.progress import Progress
from manifests.storage import redact

__all__ = ["check_mix_plan"]


def _flat(tables: list[pa.Table], column: str) -> np.ndarray:
    return np.concatenate([t.column(column).combine_chunks().flatten().to_numpy() for t in tables])


def _inputs(meta: dict[str, Any], manifests: Sequence[Any], available_ids: Sequence[np.ndarray | None],
            cache_fingerprints: Sequence[str | None]) -> tuple[list[str], MixedSamples | None]:  # fmt: skip
    """Fingerprint problems, and the mixture re-made from the manifests (None when they are not all given/valid)."""
    mix_in = meta["inputs"]["mix"]
    problems = []
    if not manifests:
        return problems, None
    if len(manifests) != len(mix_in["manifest_fingerprints"]):
        return [f"the plan mixes {len(mix_in['manifest_fingerprints'])} manifests, {len(manifests)} given"], None
    for d, (m, want) in enumerate(zip(manifests, mix_in["manifest_fingerprints"])):
        if m.fingerprint != want:
            problems.append(f"dataset {d}: manifest fingerprint mismatch: the plan was made from {want[:16]}…, "
                            f"{redact(m.url)} now has {m.fingerprint[:16]}…; re-run `bucketeer plan`")  # fmt: skip
    for d, (got, want) in enumerate(zip(cache_fingerprints, mix_in["cache_fingerprints"])):
        if got is not None and got != want:
            problems.append(f"dataset {d}: cache fingerprint mismatch: the plan used cache {want}, the cache given "
                            f"has {got}; re-run `bucketeer plan --cache`")  # fmt: skip
    if problems:
        return problems, None
    if any(want is not None and ids is None for ids, want in zip(available_ids, mix_in["cache_fingerprints"])):
        return problems, None  # made with caches, checked without: no exact re-count
    datasets = []
    for m, ids_ok in zip(manifests, available_ids):
        ids, buckets, counts = m.samples.column("sample_id").to_numpy(), m.samples.column("bucket"), None
        counts = caption_counts(m.samples)
        if ids_ok is not None:
            keep = cached_mask(ids, ids_ok)
            ids, buckets = ids[keep], buckets.filter(pa.array(keep))
            counts = None if counts is None else counts[keep]
        datasets.append(DatasetSamples(ids, buckets, counts, redact(m.url)))
    return problems, mix_samples(datasets, MixRule.from_json(mix_in))


def _check_epoch(epoch: int, entry: dict[str, Any], tables: list[pa.Table], meta: dict[str, Any],
                 mix: MixedSamples | None) -> list[str]:  # fmt: skip
    problems = []
    info = meta["mix"]["datasets"]
    n_sets = len(info)
    ids = _flat(tables, "sample_ids")  # (n,)
    datasets = _flat(tables, "dataset").astype(np.int64) if "dataset" in tables[0].column_names \
        else np.zeros(len(ids), np.int64)  # fmt: skip
    rows_bucket = pa.concat_arrays([t.column("bucket").combine_chunks() for t in tables])
    lengths = np.concatenate([pc.list_value_length(t.column("sample_ids").combine_chunks()).to_numpy() for t in tables])
    names = sorted(meta["buckets"])
    enc = pc.dictionary_encode(rows_bucket)
    remap = np.asarray([names.index(x) if x in names else -1 for x in enc.dictionary.to_pylist()] + [-1], np.int64)
    codes = np.repeat(remap[enc.indices.to_numpy(zero_copy_only=False)], lengths)  # (n,) bucket of each slot
    if np.any((datasets < 0) | (datasets >= n_sets)):
        return [f"epoch {epoch}: {int(np.sum(datasets >= n_sets))} samples name a dataset outside 0..{n_sets - 1}"]
    full = entry["first_step"] == 0 and entry["steps"] == entry["steps_in_epoch"]
    if full:
        per_bucket = np.bincount(codes[codes >= 0], minlength=len(names))
        for b, name in enumerate(names):
            want = meta["buckets"][name]["samples"] - entry["dropped"].get(name, 0) + entry["padded"].get(name, 0)
            if per_bucket[b] != want:
                problems.append(f"epoch {epoch} bucket {name}: {int(per_bucket[b])} sample slots, but the rule gives "
                                f"{want} (per epoch - dropped + padded)")  # fmt: skip
        per_set = np.bincount(datasets, minlength=n_sets).tolist()
        if per_set != entry.get("datasets"):
            problems.append(f"epoch {epoch}: sample slots per dataset {per_set} != {entry.get('datasets')} in "
                            f"{PLAN_FILE}")  # fmt: skip
    if meta["inputs"]["leftover"] == "drop":  # a (dataset, id) at most ceil(k_{d,b} / n_{d,b}) times
        order = np.lexsort((ids, datasets))
        key_d, key_i, key_b = datasets[order], ids[order], codes[order]
        new = np.concatenate([[True], (key_d[1:] != key_d[:-1]) | (key_i[1:] != key_i[:-1])])
        starts = np.flatnonzero(new)
        times = np.diff(np.append(starts, len(order)))
        limit = np.zeros((len(names), n_sets), np.int64)
        for d, ds in enumerate(info):
            for name, c in ds["buckets"].items():
                if name in names:
                    limit[names.index(name), d] = -(-c["per_epoch"] // c["samples"])
        bucket_of = key_b[starts]
        allowed = np.where(bucket_of >= 0, limit[np.maximum(bucket_of, 0), key_d[starts]], 0)
        over = times > allowed
        if over.any():
            problems.append(f"epoch {epoch}: {int(over.sum())} (dataset, sample) pairs appear more often than the "
                            "counting rule allows (a sample repeated that was not drawn)")  # fmt: skip
    if mix is not None:
        problems += _check_members(epoch, ids, datasets, codes, tables, meta, mix)
    return problems


def _check_members(epoch: int, ids: np.ndarray, datasets: np.ndarray, codes: np.ndarray, tables: list[pa.Table],
                   meta: dict[str, Any], mix: MixedSamples) -> list[str]:  # fmt: skip
    """Each (dataset, id) is one of that dataset's samples, in its bucket, with the caption index the choice gives."""
    problems = []
    names = sorted(meta["buckets"])
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
        several = len(meta["mix"]["datasets"]) > 1
        want = caption_choice(int(meta["inputs"]["seed"]), epoch, ids, datasets if several else None,
                              mix.caption_counts[order][pos])  # fmt: skip
        bad = known & (got != want)
        if bad.any():
            problems.append(f"epoch {epoch}: {int(bad.sum())} caption indices are not the caption choice of "
                            "(seed, epoch, dataset, sample)")  # fmt: skip
    return problems


def check_mix_plan(url: str, meta: dict[str, Any], problems: list[str], *, manifests: Sequence[Any] = (),
                   available_ids: Sequence[np.ndarray | None] = (), cache_fingerprints: Sequence[str | None] = (),
                   storage_options: dict[str, Any] | None = None, progress: bool = False) -> list[str]:  # fmt: skip
    """``problems`` (the plan-level ones found so far) plus every violation of the mixture plan at ``url``."""
    sets = len(meta["mix"]["datasets"])
    available_ids = list(available_ids) or [None] * sets
    cache_fingerprints = list(cache_fingerprints) or [None] * sets
    found, mix = _inputs(meta, manifests, available_ids, cache_fingerprints)
    problems = problems + found
    if mix is not None:
        counts = dict(zip(mix.names, mix.counts.tolist()))
        if counts != {n: b["samples"] for n, b in meta["buckets"].items()}:
            problems.append("the sample slots per bucket the rule gives for the manifests (and caches) now differ from "
                            "the planned ones: re-run `bucketeer plan`")  # fmt: skip
            mix = None
    batch_sizes = {n: b["batch_size"] for n, b in meta["buckets"].items()}
    config = PlanConfig.from_json(meta["inputs"])
    replan = mix is not None and meta.get("resumed_from") is None
    reporter = Progress("plan --check", "epochs", total=len(meta["epochs"]), unit="epochs", enabled=progress)
    for entry in meta["epochs"]:
        epoch = entry["epoch"]
        rows = read_plan_rows(url, [epoch], storage_options=storage_options, meta=meta)
        if rows.problems:
            problems += [rows.problems[k] for k in sorted(rows.problems)]
            reporter.update(1, violations=len(problems))
            continue
        tables = rows.ranks(epoch)
        problems += _check_ranks(epoch, entry, tables, batch_sizes)
        problems += _check_epoch(epoch, entry, tables, meta, mix)
        if rows.sha256[epoch] != entry["sha256"]:
            problems.append(f"epoch {epoch}: the file does not hash to the sha256 in {PLAN_FILE} (edited after "
                            "planning)")  # fmt: skip
        if replan and encode_epoch(mix_epoch(mix, config, epoch), config.world_size).sha256 != entry["sha256"]:
            problems.append(f"epoch {epoch}: re-planning from the recorded inputs gives other rows (tampered, or not "
                            "a pure function)")  # fmt: skip
        reporter.update(1, violations=len(problems))
    reporter.close()
    return problems
