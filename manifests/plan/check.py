"""Re-check every invariant of a committed plan (``bucketeer plan --check PLAN MANIFEST``).

The invariants (the plan contract of README.md "Artifacts" and :mod:`manifests.plan.store`): every
epoch file has the five columns and one row group per rank, row group ``r`` holding rank ``r``'s
rows; every rank has the same steps in every epoch, numbered in order; all
ranks at a step hold the same bucket; every batch has the bucket's batch size (exactly B in fixed
mode); steps per epoch are a multiple of grad_accum; within an epoch no sample appears twice except
the counted padding, and every planned sample appears or is counted as dropped; each sample is in
the manifest, in the bucket the row names; the files hash to what ``_plan.json`` records; and
(fresh plans) re-planning from the inputs gives the same bytes. Files are read through
:func:`manifests.plan.store.read_plan_rows`, one epoch at a time; a missing or malformed one is
reported, not raised.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.plan.parts import encode_epoch
from manifests.plan.store import PLAN_FILE, read_plan_meta, read_plan_rows
from manifests.plan.schedule import PlanConfig, cached_mask, group_samples, plan_epoch
from manifests.progress import Progress
from manifests.storage import redact

__all__ = ["check_plan"]


def _codes(array: pa.Array, names: list[str]) -> np.ndarray:
    """(len(array),) int64 index of each string in ``names``, -1 for one not in it (vectorised)."""
    enc = pc.dictionary_encode(array)
    index = {n: i for i, n in enumerate(names)}
    remap = np.asarray([index.get(x, -1) for x in enc.dictionary.to_pylist()] + [-1], np.int64)
    return remap[enc.indices.to_numpy(zero_copy_only=False)]


def _check_ranks(epoch: int, entry: dict[str, Any], tables: list[pa.Table], batch_sizes: dict[str, int]) -> list[str]:
    problems = []
    want_steps = np.arange(entry["first_step"], entry["first_step"] + entry["steps"])
    bucket0 = tables[0].column("bucket").combine_chunks()
    for r, t in enumerate(tables):
        steps = t.column("step").to_numpy()
        if len(steps) != len(want_steps):
            problems.append(
                f"epoch {epoch} rank {r}: {len(steps)} steps, but _plan.json says {len(want_steps)} "
                "(unequal steps hang a collective)"
            )
            continue
        if not np.array_equal(steps, want_steps):
            problems.append(f"epoch {epoch} rank {r}: steps are not {want_steps[:1]}..{want_steps[-1:]} in order")
        if np.any(t.column("epoch").to_numpy() != epoch) or np.any(t.column("rank").to_numpy() != r):
            problems.append(f"epoch {epoch} rank {r}: rows carry another epoch or rank number")
        bucket = t.column("bucket").combine_chunks()
        if len(bucket) == len(bucket0) and not bucket.equals(bucket0):
            problems.append(f"epoch {epoch} rank {r}: holds another bucket than rank 0 at some step")
        lengths = pc.list_value_length(t.column("sample_ids").combine_chunks()).to_numpy()
        unknown = set(pc.unique(bucket).to_pylist()) - set(batch_sizes)
        if unknown:
            problems.append(f"epoch {epoch} rank {r}: buckets {sorted(unknown)} are not in _plan.json")
            continue
        names = sorted(batch_sizes)
        want = np.asarray([batch_sizes[n] for n in names], np.int64)[_codes(bucket, names)]  # (steps,)
        bad = np.flatnonzero(lengths != want)
        if len(bad):
            s = int(bad[0])
            problems.append(
                f"epoch {epoch} rank {r}: {len(bad)} batches of a wrong size (step {int(steps[s])}: "
                f"{int(lengths[s])} samples, bucket {bucket[s]} takes {int(want[s])})"
            )
    return problems


def _check_samples(
    epoch: int,
    entry: dict[str, Any],
    tables: list[pa.Table],
    planned: dict[str, int],
    manifest_ids: np.ndarray | None,
    manifest_codes: np.ndarray | None,
    names: list[str],
) -> list[str]:
    """Duplicates, coverage and bucket membership of one epoch's samples, vectorised."""
    problems = []
    ids = np.concatenate([t.column("sample_ids").combine_chunks().flatten().to_numpy() for t in tables])  # (n,)
    row_bucket = pa.concat_arrays([t.column("bucket").combine_chunks() for t in tables])
    lengths = np.concatenate([pc.list_value_length(t.column("sample_ids").combine_chunks()).to_numpy() for t in tables])
    codes = np.repeat(_codes(row_bucket, names), lengths)  # (n,) bucket of each sample slot
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
    full = entry["first_step"] == 0 and entry["steps"] == entry["steps_in_epoch"]
    for code, name in enumerate(names):
        mine = ids[codes == code]
        distinct = len(np.unique(mine))
        repeats = len(mine) - distinct
        padded, dropped = entry["padded"].get(name, 0), entry["dropped"].get(name, 0)
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


def check_plan(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    manifest: Any = None,
    available_ids: np.ndarray | None = None,
    cache_fingerprint: str | None = None,
    manifests: Sequence[Any] = (),
    cache_fingerprints: Sequence[str | None] = (),
    progress: bool = False,
) -> list[str]:
    """Every violated invariant of the plan at ``url``, one line each (empty when the plan is sound).

    ``manifest`` (a :class:`manifests.manifest.Manifest`) adds the fingerprint, membership and
    re-planning checks; ``available_ids`` / ``cache_fingerprint`` those of the cache the plan used.
    ``progress``: report epochs checked (on stderr). A mixture plan is checked against ``manifests``
    (one per dataset, in order), ``available_ids`` (a list, one per dataset, None for no cache) and
    ``cache_fingerprints`` instead (:mod:`manifests.plan.check_mix`). Raises PlanError when ``url``
    is not a readable plan at all.
    """
    meta = read_plan_meta(url, storage_options)
    inputs = meta["inputs"]
    problems: list[str] = []
    if manifest is not None and manifest.fingerprint != inputs["manifest_fingerprint"]:
        problems.append(
            f"manifest fingerprint mismatch: the plan was made from {inputs['manifest_fingerprint'][:16]}…, "
            f"{redact(manifest.url)} now has {manifest.fingerprint[:16]}…; the manifest changed: "
            "re-run `bucketeer plan`"
        )
        manifest = None  # its samples say nothing about this plan
    if cache_fingerprint is not None and cache_fingerprint != inputs.get("cache_fingerprint"):
        problems.append(
            f"cache fingerprint mismatch: the plan used cache {inputs.get('cache_fingerprint')}, "
            f"the cache given has {cache_fingerprint}; re-run `bucketeer plan --cache`"
        )
        available_ids = None
    fresh = meta.get("resumed_from") is None
    epochs = meta["epochs"]
    held = [e["epoch"] for e in epochs]
    if fresh and (held != list(range(len(held))) or not 0 < len(held) <= inputs["epochs"]):
        problems.append(f"{PLAN_FILE} lists epochs {held}, not 0..N-1 with N <= {inputs['epochs']} (the run's epochs)")
    if meta["steps_per_epoch"] % inputs["grad_accum"]:
        problems.append(
            f"steps per epoch {meta['steps_per_epoch']} is not a multiple of grad_accum {inputs['grad_accum']}"
        )
    for e in epochs:
        if e["steps_in_epoch"] != meta["steps_per_epoch"] or e["first_step"] + e["steps"] != e["steps_in_epoch"]:
            problems.append(
                f"epoch {e['epoch']}: {e['steps']} steps from {e['first_step']}, not up to {meta['steps_per_epoch']}"
            )
        if meta["mode"] == "fixed" and meta["global_batch"] != inputs["world_size"] * inputs["batch_size"]:
            problems.append(f"global batch {meta['global_batch']} != world size x batch size")

    if "mix" in inputs:
        from manifests.plan.check_mix import check_mix_plan

        return check_mix_plan(url, meta, problems, manifests=manifests, available_ids=available_ids or (),
                              cache_fingerprints=cache_fingerprints, storage_options=storage_options,
                              progress=progress)  # fmt: skip
    names = sorted(meta["buckets"])
    planned = {n: b["samples"] for n, b in meta["buckets"].items()}
    batch_sizes = {n: b["batch_size"] for n, b in meta["buckets"].items()}
    if meta["mode"] == "fixed" and any(b != inputs["batch_size"] for b in batch_sizes.values()):
        problems.append(f"fixed-batch plan with per-bucket batch sizes {batch_sizes} != {inputs['batch_size']}")
    manifest_ids = manifest_codes = samples = None
    exact = False
    if manifest is not None:
        ids = manifest.samples.column("sample_id").to_numpy()
        buckets = manifest.samples.column("bucket")
        if available_ids is not None:
            keep = cached_mask(ids, available_ids)
            ids, buckets = ids[keep], buckets.filter(pa.array(keep))
        samples = group_samples(ids, buckets, source=redact(manifest.url))
        current = dict(zip(samples.names, samples.counts.tolist()))
        # a plan made with --cache checked without it: membership only (the manifest is a superset)
        exact = inputs.get("cache_fingerprint") is None or available_ids is not None
        if exact and current != planned:
            problems.append(
                "the planned samples per bucket differ from the manifest's (and cache's) now: re-run `bucketeer plan`"
            )
        order = np.argsort(samples.ids)
        manifest_ids = samples.ids[order]
        index = {n: i for i, n in enumerate(names)}
        bucket_code = np.asarray([index.get(n, -2) for n in samples.names], np.int64)
        manifest_codes = np.repeat(bucket_code, samples.counts)[order]
    replan = fresh and samples is not None and exact

    world = int(inputs["world_size"])
    config = PlanConfig.from_json(inputs)
    reporter = Progress("plan --check", "epochs", total=len(epochs), unit="epochs", enabled=progress)
    for entry in epochs:
        epoch = entry["epoch"]
        rows = read_plan_rows(url, [epoch], storage_options=storage_options, meta=meta)  # one epoch in memory
        if rows.problems:  # a missing or malformed file: reported, the epoch's other checks need it
            problems += [rows.problems[k] for k in sorted(rows.problems)]
            reporter.update(1, violations=len(problems))
            continue
        tables = rows.ranks(epoch)
        problems += _check_ranks(epoch, entry, tables, batch_sizes)
        problems += _check_samples(epoch, entry, tables, planned, manifest_ids, manifest_codes, names)
        if rows.sha256[epoch] != entry["sha256"]:
            problems.append(
                f"epoch {epoch}: the file does not hash to the sha256 in {PLAN_FILE} (edited after planning)"
            )
        if replan and samples is not None:
            again = encode_epoch(plan_epoch(samples, config, epoch), world)
            if again.sha256 != entry["sha256"]:
                problems.append(
                    f"epoch {epoch}: re-planning from the recorded inputs gives other rows "
                    "(tampered, or not a pure function)"
                )
        reporter.update(1, violations=len(problems))
    reporter.close()
    return problems
