"""Re-check every invariant of a committed plan (``bucketeer plan --check PLAN MANIFEST ...``).

The invariants (the plan contract of docs/artifacts.md and :mod:`manifests.plan.write`): every
epoch file has the plan's columns and one row group per rank, row group ``r`` holding rank ``r``'s
rows; every rank has the same steps in every epoch, numbered in order; all ranks at a step hold the
same bucket; every batch has the bucket's batch size (exactly B in fixed mode); steps per epoch are
a multiple of grad_accum; the samples of each epoch are the ones the plan counts
(:mod:`manifests.plan.check_samples`: one manifest, or a mixture's rule); the manifests (and caches)
given are the ones recorded; no planned sample is one the plan's selection (``--where``) excludes, re-evaluated
(:mod:`manifests.plan.selection`); the files hash to what ``_plan.json`` records; and (fresh plans)
re-planning from the inputs gives the same bytes. Files are read through
:func:`manifests.plan.read.read_plan_rows`, one epoch at a time; a missing or malformed one is
reported, not raised. A one-manifest plan is checked as a mixture of one: the same call, lists of one.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from manifests.plan.check_samples import bucket_codes, check_mixture_epoch, check_one_manifest_epoch, manifest_index
from manifests.plan.meta import PLAN_FILE, EpochEntry, PlanError, PlanMeta, read_plan_meta
from manifests.plan.mix import DatasetSamples, MixedSamples, PlanSamples, caption_counts, mix_samples, schedule_epoch
from manifests.plan.parts import EpochFile, encode_epoch
from manifests.plan.read import read_plan_rows
from manifests.plan.selection import excluded_problems, selected_rows
from manifests.errors import UsageError
from manifests.plan.schedule import BucketedSamples, bucket_batch_sizes, cached_mask, group_samples, latent_tokens
from manifests.progress import Progress
from manifests.storage import redact

__all__ = ["check_plan"]


def _check_ranks(epoch: int, entry: EpochEntry, tables: list[pa.Table], batch_sizes: dict[str, int]) -> list[str]:
    problems = []
    want_steps = np.arange(entry.first_step, entry.first_step + entry.steps)
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
        want = np.asarray([batch_sizes[n] for n in names], np.int64)[bucket_codes(bucket, names)]  # (steps,)
        bad = np.flatnonzero(lengths != want)
        if len(bad):
            s = int(bad[0])
            problems.append(
                f"epoch {epoch} rank {r}: {len(bad)} batches of a wrong size (step {int(steps[s])}: "
                f"{int(lengths[s])} samples, bucket {bucket[s]} takes {int(want[s])})"
            )
    return problems


def _plan_level(meta: PlanMeta) -> list[str]:
    """What ``_plan.json`` says of itself: the epochs it holds, their steps, the global batch."""
    problems = []
    inputs = meta.inputs
    held = [e.epoch for e in meta.epochs]
    if meta.resumed_from is None and (held != list(range(len(held))) or not 0 < len(held) <= inputs.epochs):
        problems.append(f"{PLAN_FILE} lists epochs {held}, not 0..N-1 with N <= {inputs.epochs} (the run's epochs)")
    if meta.steps_per_epoch % inputs.grad_accum:
        problems.append(f"steps per epoch {meta.steps_per_epoch} is not a multiple of grad_accum {inputs.grad_accum}")
    for e in meta.epochs:
        if e.steps_in_epoch != meta.steps_per_epoch or e.first_step + e.steps != e.steps_in_epoch:
            problems.append(f"epoch {e.epoch}: {e.steps} steps from {e.first_step}, not up to {meta.steps_per_epoch}")
        if meta.mode == "fixed" and meta.global_batch != inputs.world_size * (inputs.batch_size or 0):
            problems.append(f"global batch {meta.global_batch} != world size x batch size")
    batch_sizes = {n: b.batch_size for n, b in meta.buckets.items()}
    if meta.mode == "fixed" and any(b != inputs.batch_size for b in batch_sizes.values()):
        problems.append(f"fixed-batch plan with per-bucket batch sizes {batch_sizes} != {inputs.batch_size}")
    if meta.resumed_from is None:  # a resumed plan re-cuts the global batches for other ranks: batch sizes change
        problems += _bucket_sizes(meta)
    return problems


def _bucket_sizes(meta: PlanMeta) -> list[str]:
    """Each bucket's batch size and latent tokens as the recorded inputs give them (max tokens, the latent,
    patch and temporal factors): a ``WxHxF`` bucket's frames count in its tokens."""
    names, config = sorted(meta.buckets), meta.inputs.config
    try:
        sizes = bucket_batch_sizes(names, config)
        tokens = latent_tokens(names, config.latent_factor, config.patch_size, config.temporal_factor)
    except UsageError as e:
        return [f"{PLAN_FILE}: its inputs give no plan of its buckets ({e})"]
    bad = [n for n, b, t in zip(names, sizes.tolist(), tokens.tolist())
           if (meta.buckets[n].batch_size, meta.buckets[n].latent_tokens) != (b, t)]  # fmt: skip
    if not bad:
        return []
    return [f"buckets {', '.join(bad[:5])}{' …' if len(bad) > 5 else ''}: batch size or latent tokens in {PLAN_FILE} "
            "differ from what its inputs give (edited after planning)"]


def _filtered(manifest: Any, available_ids: np.ndarray | None, selection: Any = None) -> DatasetSamples:
    """A manifest's samples, only those in ``available_ids`` (a cache's good records) when given, and only those
    ``selection`` keeps (with its weights) when given."""
    ids, buckets = manifest.samples.column("sample_id").to_numpy(), manifest.samples.column("bucket")
    counts = caption_counts(manifest.samples)
    keep, weights = selected_rows(selection, len(ids))
    if available_ids is not None:
        keep = keep & cached_mask(ids, available_ids)
    ids, buckets = ids[keep], buckets.filter(pa.array(keep))
    counts = None if counts is None else counts[keep]
    return DatasetSamples(ids, buckets, counts, redact(manifest.url),
                          weights=None if weights is None else weights[keep])


def _one_manifest(meta: PlanMeta, manifest: Any, available_ids: np.ndarray | None, cache_fingerprint: str | None,
                  selection: Any) -> tuple[list[str], BucketedSamples | None, bool]:  # fmt: skip
    """Fingerprint problems, the manifest's samples now (None when it changed), and whether they must be exactly
    the planned ones (else: membership only, a plan made with --cache checked without it)."""
    inputs, problems = meta.inputs, []
    if manifest is not None and manifest.fingerprint != inputs.manifest_fingerprint:
        problems.append(
            f"manifest fingerprint mismatch: the plan was made from {(inputs.manifest_fingerprint or '')[:16]}…, "
            f"{redact(manifest.url)} now has {manifest.fingerprint[:16]}…; the manifest changed: "
            "re-run `bucketeer plan`"
        )
        manifest = None  # its samples say nothing about this plan
    if cache_fingerprint is not None and cache_fingerprint != inputs.cache_fingerprint:
        problems.append(
            f"cache fingerprint mismatch: the plan used cache {inputs.cache_fingerprint}, "
            f"the cache given has {cache_fingerprint}; re-run `bucketeer plan --cache`"
        )
        available_ids = None
    if manifest is None:
        return problems, None, False
    mine = _filtered(manifest, available_ids, selection)
    samples = group_samples(mine.ids, mine.buckets, source=mine.source)
    # a plan made with --cache checked without it: membership only (the manifest is a superset)
    exact = inputs.cache_fingerprint is None or available_ids is not None
    if exact and dict(zip(samples.names, samples.counts.tolist())) != {n: b.samples for n, b in meta.buckets.items()}:
        problems.append(
            "the planned samples per bucket differ from the manifest's (and cache's) now: re-run `bucketeer plan`"
        )
    return problems, samples, exact


def _mixture(meta: PlanMeta, manifests: Sequence[Any], available_ids: Sequence[np.ndarray | None],
             cache_fingerprints: Sequence[str | None],
             selections: Sequence[Any]) -> tuple[list[str], MixedSamples | None]:  # fmt: skip
    """Fingerprint problems, and the mixture re-made from the manifests (None when they are not all given/valid)."""
    mix_in = meta.inputs.mix
    assert mix_in is not None
    if not manifests:
        return [], None
    if len(manifests) != len(mix_in.manifest_fingerprints):
        return [f"the plan mixes {len(mix_in.manifest_fingerprints)} manifests, {len(manifests)} given"], None
    problems = []
    for d, (m, want) in enumerate(zip(manifests, mix_in.manifest_fingerprints)):
        if m.fingerprint != want:
            problems.append(f"dataset {d}: manifest fingerprint mismatch: the plan was made from {want[:16]}…, "
                            f"{redact(m.url)} now has {m.fingerprint[:16]}…; re-run `bucketeer plan`")  # fmt: skip
    for d, (got, want) in enumerate(zip(cache_fingerprints, mix_in.cache_fingerprints)):
        if got is not None and got != want:
            problems.append(f"dataset {d}: cache fingerprint mismatch: the plan used cache {want}, the cache given "
                            f"has {got}; re-run `bucketeer plan --cache`")  # fmt: skip
    if problems:
        return problems, None
    if any(want is not None and ids is None for ids, want in zip(available_ids, mix_in.cache_fingerprints)):
        return problems, None  # made with caches, checked without: no exact re-count
    mix = mix_samples([_filtered(m, ids, s) for m, ids, s in zip(manifests, available_ids, selections)], mix_in.rule)
    if dict(zip(mix.names, mix.counts.tolist())) != {n: b.samples for n, b in meta.buckets.items()}:
        problems.append("the sample slots per bucket the rule gives for the manifests (and caches) now differ from "
                        "the planned ones: re-run `bucketeer plan`")  # fmt: skip
        return problems, None
    return problems, mix


def check_plan(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    manifests: Sequence[Any] = (),
    available_ids: Sequence[np.ndarray | None] = (),
    cache_fingerprints: Sequence[str | None] = (),
    progress: bool = False,
    selections: Sequence[Any] = (),
) -> list[str]:
    """Every violated invariant of the plan at ``url``, one line each (empty when the plan is sound).

    ``manifests`` (:class:`manifests.manifest.Manifest`, one per dataset in the plan's order: one for a
    one-manifest plan) add the fingerprint, membership and re-planning checks; ``available_ids`` (per
    manifest: the sample ids with a good record in its cache, or None) and ``cache_fingerprints`` (per
    manifest, None for no cache) those of the caches the plan used; ``selections`` (per manifest, the plan's
    selection evaluated again: :class:`manifests.select.Selection`) the selection checks. ``progress``: report
    epochs checked (on stderr). Raises PlanError when ``url`` is not a readable plan, or for several manifests given for
    a one-manifest plan.
    """
    meta = read_plan_meta(url, storage_options)
    sets = len(meta.mix.datasets) if meta.mix is not None else 1
    if meta.inputs.mix is None and len(manifests) > 1:
        raise PlanError(f"{redact(url)} is a one-manifest plan: check it against its one MANIFEST")
    available = list(available_ids) or [None] * sets
    cache_fps = list(cache_fingerprints) or [None] * sets
    chosen = list(selections) or [None] * sets
    excluded = [None if s is None else s.excluded_ids() for s in chosen]
    problems = _plan_level(meta)
    index = None
    samples: PlanSamples | None
    if meta.inputs.mix is None:
        found, samples, exact = _one_manifest(meta, manifests[0] if manifests else None, available[0], cache_fps[0],
                                              chosen[0])  # fmt: skip
        index = None if samples is None else manifest_index(samples, sorted(meta.buckets))
        samples = samples if exact else None  # re-planning needs exactly the planned samples
    else:
        found, samples = _mixture(meta, manifests, available, cache_fps, chosen)
    problems += found
    replan = samples is not None and meta.resumed_from is None
    batch_sizes = {n: b.batch_size for n, b in meta.buckets.items()}
    config = meta.inputs.config
    reporter = Progress("plan --check", "epochs", total=len(meta.epochs), unit="epochs", enabled=progress)
    for entry in meta.epochs:
        epoch = entry.epoch
        rows = read_plan_rows(url, [epoch], storage_options=storage_options, meta=meta)  # one epoch in memory
        if rows.problems:  # a missing or malformed file: reported, the epoch's other checks need it
            problems += [rows.problems[k] for k in sorted(rows.problems)]
            reporter.update(1, violations=len(problems))
            continue
        tables = rows.ranks(epoch)
        problems += _check_ranks(epoch, entry, tables, batch_sizes)
        if meta.inputs.mix is None:
            problems += check_one_manifest_epoch(epoch, entry, tables, meta, index)
        else:
            problems += check_mixture_epoch(epoch, entry, tables, meta, samples)  # type: ignore[arg-type]
        problems += excluded_problems(epoch, tables, excluded)
        if rows.sha256[epoch] != entry.sha256:
            problems.append(f"epoch {epoch}: the file does not hash to the sha256 in {PLAN_FILE} (edited after "
                            "planning)")  # fmt: skip
        if replan and not _replans_to(encode_epoch(schedule_epoch(samples, config, epoch), config.world_size),  # type: ignore[arg-type]
                                      entry, tables):  # fmt: skip
            problems.append(f"epoch {epoch}: re-planning from the recorded inputs gives other rows (tampered, or not "
                            "a pure function)")  # fmt: skip
        reporter.update(1, violations=len(problems))
    reporter.close()
    return problems


def _replans_to(fresh: EpochFile, entry: EpochEntry, tables: list[pa.Table]) -> bool:
    """Whether the epoch planned again (``fresh``) holds the rows of the file: the same bytes, or, when the file
    was written by another pyarrow (parquet bytes carry the writer's version and layout), the same rows."""
    if fresh.sha256 == entry.sha256:
        return True
    stored = pa.concat_tables(tables) if tables else None
    if stored is None:
        return False
    again = pq.read_table(pa.BufferReader(fresh.data)).select(stored.column_names)
    return again.num_rows == stored.num_rows and again.to_pylist() == stored.to_pylist()
