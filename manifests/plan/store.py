"""Shard plans on storage: write a plan (all epochs, or a window of them), extend it, read rows by rank.

A plan folder holds one parquet file per epoch, ``epoch-EEEEE.parquet``, with one row group per
rank (:mod:`manifests.plan.parts`), and ``_plan.json``, written last, which makes the folder valid.
Objects grow with epochs, not epochs x ranks; a rank reads its rows of an epoch with two ranged
reads (footer, row group), whose offsets follow from ``_plan.json`` and the footer: no listing, no
HEAD. ``_plan.json`` has one small entry per epoch (steps, padding and drops per bucket, the file's
sha256, size and footer length), never one per rank. The schedule itself is
:mod:`manifests.plan.schedule`; elastic resume is :mod:`manifests.plan.resume`.

``inputs.epochs`` is the length of the run (what a trainer sizes its learning-rate schedule by).
``--window W`` writes only the first W epochs, and :func:`extend_plan` (``bucketeer plan MANIFEST
--extend PLAN``) writes more later; epoch ``e`` is a pure function of the inputs and ``e``, so a plan
extended to its last epoch has the same bytes, ``_plan.json`` included, as one planned at once. The
fingerprint hashes the inputs and the first epoch's file, so it does not change when epochs are
added: a run started on a window resumes on the extended plan.

:func:`read_plan_rows` is the one reader of plan rows: rows of ``(epochs, ranks, columns)``, never
of file paths, so the layout can change under it. The trainer, ``--check``, the resume and the
report all read through it.

Public API::

    meta = read_plan_meta(url, storage_options)            # _plan.json as a dict; PlanError if invalid
    rows = read_plan_rows(url, epochs=[0], ranks=[3], columns=["step", "bucket"])  # a PlanRows
    rows = read_rank_plan(url, rank, storage_options, epoch=None)   # this rank's rows, by (epoch, step)
    meta = write_plan(url, ids, buckets, config, manifest_fingerprint=..., window=10)
    meta = extend_plan(url, ids, buckets, manifest_fingerprint=..., epochs=20)
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa

from manifests import __version__
from manifests.errors import MissingError, UsageError
from manifests.plan.parts import EpochFile, PartProblem, encode_epoch, epoch_part, read_epoch_ranks, read_epoch_whole
from manifests.plan.mix import MixedSamples, combined_fingerprint, mix_epoch
from manifests.plan.schedule import (
    PLAN_SCHEMA,
    BucketedSamples,
    EpochSchedule,
    PlanConfig,
    bucket_batch_sizes,
    group_samples,
    latent_tokens,
    plan_epoch,
    plan_schema,
)
from manifests.progress import Progress
from manifests.storage import (
    call_storage,
    join,
    open_url,
    read_artifact_meta,
    redact,
    write_bytes_atomic,
    write_json_atomic,
)

__all__ = [
    "PLAN_FILE",
    "PLAN_KIND",
    "PLAN_FORMAT_VERSION",
    "PLAN_SCHEMA",
    "PlanError",
    "PlanMissingError",
    "PlanConfig",
    "PlanRows",
    "epoch_part",
    "write_plan",
    "write_mix_plan",
    "extend_plan",
    "extend_mix_plan",
    "plan_columns",
    "read_plan_meta",
    "read_plan_rows",
    "read_rank_plan",
]

PLAN_FILE = "_plan.json"
PLAN_KIND = "bucketeer.plan"
# 2: one file per epoch with a row group per rank (1: a file per epoch and rank), batches in id order
PLAN_FORMAT_VERSION = 2


class PlanError(UsageError):
    """A plan folder is missing, uncommitted, of another format version, or malformed."""


class PlanMissingError(PlanError, MissingError):
    """A folder without ``_plan.json``: no plan there, or `bucketeer plan` never finished."""


# ---------------------------------------------------------------- writing


def epoch_entry(
    schedule: EpochSchedule, file: EpochFile, steps_total: int, tokens: np.ndarray, world_size: int
) -> dict[str, Any]:
    """``_plan.json``'s entry for one epoch. ``tokens``: (k,) latent tokens per sample of each bucket
    of ``schedule.names``."""
    names = schedule.names
    padded = {n: int(c) for n, c in zip(names, schedule.padded) if c}
    dropped = {n: int(c) for n, c in zip(names, schedule.dropped) if c}
    per_step = tokens[schedule.step_buckets] * (schedule.step_sizes // world_size)  # (S,) per rank
    return {
        "epoch": schedule.epoch,
        "first_step": schedule.first_step,
        "steps": schedule.steps,
        "steps_in_epoch": steps_total,
        "padded": padded,
        "dropped": dropped,
        "padded_total": sum(padded.values()),
        "dropped_total": sum(dropped.values()),
        # per rank and step: min, max and sum of latent tokens (the plan's tokens_per_step adds these up)
        "tokens": [int(per_step.min()), int(per_step.max()), int(per_step.sum())] if len(per_step) else [0, 0, 0],
        **file.entry(),
        # mixture plans: sample slots each dataset trains on in the whole epoch (after bucket leftovers)
        **({} if schedule.dataset_counts is None else {"datasets": [int(c) for c in schedule.dataset_counts]}),
    }


def totals(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    padded: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for e in epochs:
        for n, c in e["padded"].items():
            padded[n] = padded.get(n, 0) + c
        for n, c in e["dropped"].items():
            dropped[n] = dropped.get(n, 0) + c
    out = {
        "padded": sum(padded.values()),
        "dropped": sum(dropped.values()),
        "padded_per_bucket": dict(sorted(padded.items())),
        "dropped_per_bucket": dict(sorted(dropped.items())),
    }
    if epochs and "datasets" in epochs[0]:  # mixture plans: slots per dataset over every epoch planned
        out["per_dataset"] = [sum(e["datasets"][d] for e in epochs) for d in range(len(epochs[0]["datasets"]))]
    return out


def tokens_per_step(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank latent tokens per step over every epoch planned: min / mean / max."""
    steps = sum(e["steps"] for e in epochs)
    lo = min((e["tokens"][0] for e in epochs if e["steps"]), default=None)
    hi = max((e["tokens"][1] for e in epochs if e["steps"]), default=None)
    total = sum(e["tokens"][2] for e in epochs)
    return {"min": lo, "mean": round(total / max(steps, 1), 3), "max": hi, "per": "rank"}


def _fingerprint(inputs: dict[str, Any], resumed_from: Any, first_epoch_sha256: str) -> str:
    """The plan's identity: its inputs and its first epoch's bytes (not the epochs planned so far)."""
    blob = json.dumps([PLAN_FORMAT_VERSION, inputs, resumed_from, first_epoch_sha256], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def with_epochs(meta: dict[str, Any], epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """``meta`` holding ``epochs``: the per-epoch entries and the totals derived from them."""
    return dict(meta, epochs=epochs, counts=totals(epochs), tokens_per_step=tokens_per_step(epochs),
                fingerprint=_fingerprint(meta["inputs"], meta["resumed_from"], epochs[0]["sha256"]))  # fmt: skip


def begin_plan(fs, root: str) -> None:
    """Invalidate a plan at ``root`` before writing a new one: a reader must never pair its _plan.json
    with new files."""
    meta = join(root, PLAN_FILE)
    call_storage(fs, "creating", root, lambda: fs.makedirs(root, exist_ok=True))
    if call_storage(fs, "checking", meta, lambda: fs.exists(meta)):
        call_storage(fs, "removing", meta, lambda: fs.rm(meta))


def commit_plan(fs, root: str, meta: dict[str, Any]) -> None:
    """Write ``_plan.json`` (the commit point), then remove plan files it does not name (older plans')."""
    write_json_atomic(fs, join(root, PLAN_FILE), meta)
    keep = {epoch_part(e["epoch"]) for e in meta["epochs"]}
    for path in call_storage(fs, "listing", root, lambda: fs.find(root)):
        rel = path[len(root) :].lstrip("/")
        if rel.startswith("epoch-") and rel.endswith(".parquet") and rel not in keep:
            call_storage(fs, "removing", path, lambda: fs.rm(path))


def write_epochs(
    fs,
    root: str,
    schedules: Iterable[EpochSchedule],
    world_size: int,
    entry: Callable[[EpochSchedule, EpochFile], dict[str, Any]],
    progress: Progress,
) -> list[dict[str, Any]]:
    """Encode and write each epoch (the upload of one overlaps the planning of the next); its entries.

    Memory: two epochs at most. Raises StorageError when storage refuses a write.
    """
    entries: list[dict[str, Any]] = []
    written = 0
    with ThreadPoolExecutor(1, thread_name_prefix="plan-upload") as pool:
        pending: Future | None = None
        for schedule in schedules:
            file = encode_epoch(schedule, world_size)
            if pending is not None:
                pending.result()
            pending = pool.submit(write_bytes_atomic, fs, join(root, file.path), file.data)
            entries.append(entry(schedule, file))
            written += len(file.data)
            progress.update(1, written=f"{written / 1e6:.1f} MB")
        if pending is not None:
            pending.result()
    progress.close()
    return entries


Samples = BucketedSamples | MixedSamples


def _epoch(samples: Samples, config: PlanConfig, epoch: int) -> EpochSchedule:
    """One epoch of a one-manifest plan (:func:`plan_epoch`) or of a mixture (:func:`mix_epoch`)."""
    if isinstance(samples, MixedSamples):
        return mix_epoch(samples, config, epoch)
    return plan_epoch(samples, config, epoch)


def _bucket_inputs(samples: Samples, config: PlanConfig) -> tuple[np.ndarray, np.ndarray]:
    """(per-rank batch size, latent tokens) per bucket: (k,) int64 each. Raises ValueError for --max-tokens."""
    return bucket_batch_sizes(samples.names, config), latent_tokens(samples.names, config.latent_factor,
                                                                    config.patch_size)  # fmt: skip


def _plan_epochs(fs, root: str, samples: Samples, config: PlanConfig, epochs: range, job: str,
                 progress: bool) -> list[dict[str, Any]]:  # fmt: skip
    _, tokens = _bucket_inputs(samples, config)
    steps = _epoch(samples, config, 0).steps if epochs.start else None
    reporter = Progress(job, "epochs", total=len(epochs), unit="epochs", enabled=progress)

    def entry(schedule: EpochSchedule, file: EpochFile) -> dict[str, Any]:
        nonlocal steps
        steps = schedule.steps if steps is None else steps
        assert schedule.steps == steps, "steps per epoch depend only on bucket sizes"
        return epoch_entry(schedule, file, steps, tokens, config.world_size)

    schedules = (_epoch(samples, config, e) for e in epochs)
    return write_epochs(fs, root, schedules, config.world_size, entry, reporter)


def _samples(sample_ids, buckets, sources: dict[str, str | None] | None) -> BucketedSamples:
    samples = group_samples(sample_ids, buckets, source=(sources or {}).get("manifest") or "samples")
    if not len(samples.ids):
        raise UsageError("nothing to train: no sample to plan (empty manifest, or none of its samples is in the cache)")
    return samples


def write_plan(
    url: str,
    sample_ids: Sequence[int] | np.ndarray | pa.Array,
    buckets: Sequence[str] | pa.Array,
    config: PlanConfig,
    *,
    manifest_fingerprint: str,
    cache_fingerprint: str | None = None,
    not_in_cache: int = 0,
    stale: int = 0,
    sources: dict[str, str | None] | None = None,
    storage_options: dict[str, Any] | None = None,
    window: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Plan ``(sample_ids, buckets)`` and commit it at ``url``; returns ``_plan.json``.

    ``window``: write only epochs ``0..window-1`` of ``config.epochs`` (default: all); the rest
    later with :func:`extend_plan`. Files are written epoch by epoch (memory: two epochs),
    ``_plan.json`` last. ``sources`` (e.g. the manifest URL) are recorded redacted, outside the
    fingerprint. ``progress``: report epochs written (on stderr). Raises ValueError for bad inputs
    (see :class:`PlanConfig`, :func:`group_samples`, :func:`plan_epoch`) before anything is written.
    """
    samples = _samples(sample_ids, buckets, sources)
    return _write_new(url, samples, config, {"manifest_fingerprint": manifest_fingerprint,
                      "cache_fingerprint": cache_fingerprint},
                      {"planned": int(len(samples.ids)), "not_in_cache": int(not_in_cache), "stale": int(stale)},
                      {}, sources, storage_options, window, progress)  # fmt: skip


def write_mix_plan(
    url: str,
    mix: MixedSamples,
    config: PlanConfig,
    *,
    manifest_fingerprints: Sequence[str],
    cache_fingerprints: Sequence[str | None],
    datasets: Sequence[dict[str, Any]],
    storage_options: dict[str, Any] | None = None,
    window: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Plan a mixture (:mod:`manifests.plan.mix`) and commit it at ``url``; returns ``_plan.json``.

    ``datasets``: per manifest, ``{"manifest": url, "cache": url | None, "not_in_cache": n, "stale": n}``
    (recorded, URLs redacted). Otherwise like :func:`write_plan`.
    """
    planned = {"planned": int(len(mix.ids)), "per_epoch": int(mix.per_epoch.sum()),
               "not_in_cache": sum(int(d.get("not_in_cache", 0)) for d in datasets),
               "stale": sum(int(d.get("stale", 0)) for d in datasets)}  # fmt: skip
    inputs = {"manifest_fingerprint": combined_fingerprint(manifest_fingerprints),
              "cache_fingerprint": combined_fingerprint(cache_fingerprints),
              "mix": {**mix.rule.to_json(), "manifest_fingerprints": list(manifest_fingerprints),
                      "cache_fingerprints": list(cache_fingerprints)}}  # fmt: skip
    columns = (["dataset"] if mix.strata.shape[1] > 1 else []) + (["caption_index"] if mix.caption_counts is not None
                                                                   else [])  # fmt: skip
    extra = {"columns": columns, "mix": mix_summary(mix, datasets)}
    return _write_new(url, mix, config, inputs, planned, extra, None, storage_options, window, progress)


def mix_summary(mix: MixedSamples, datasets: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``_plan.json["mix"]``: the rule, and per dataset its samples, value, slots per epoch, per bucket."""
    out = []
    for d, info in enumerate(datasets):
        n, k = int(mix.sizes[d]), int(mix.per_epoch[d])
        out.append({
            "manifest": redact(info["manifest"]) if info.get("manifest") else None,
            "cache": redact(info["cache"]) if info.get("cache") else None,
            "samples": n, mix.rule.kind[:-1]: _decimal(mix.rule.values[d]), "per_epoch": k,
            "times": round(k / n, 4),
            **({"share": round(float(mix.rule.values[d] / sum(mix.rule.values)), 6)} if mix.rule.kind == "weights"
               else {}),
            "not_in_cache": int(info.get("not_in_cache", 0)), "stale": int(info.get("stale", 0)),
            "buckets": {name: {"samples": int(mix.strata[b, d]), "per_epoch": int(mix.slots[b, d])}
                        for b, name in enumerate(mix.names) if mix.strata[b, d]},
        })  # fmt: skip
    rule = ("repeats: k = round(r * n), halves up" if mix.rule.kind == "repeats" else
            "weights: epoch = sum of samples, k by largest remainder")  # fmt: skip
    return {"rule": rule + "; per bucket by largest remainder; see manifests/plan/mix.py", "datasets": out}


def _decimal(value: Fraction) -> str:
    """``value`` as the user wrote it when it is a short decimal (0.1), else as a fraction (1/3)."""
    text = f"{float(value):.10g}"
    return text if Fraction(text) == value else str(value)


def _write_new(url: str, samples: Samples, config: PlanConfig, inputs: dict[str, Any], planned: dict[str, Any],
               extra: dict[str, Any], sources: dict[str, str | None] | None, storage_options: dict[str, Any] | None,
               window: int | None, progress: bool) -> dict[str, Any]:  # fmt: skip
    if window is not None and window < 1:
        raise UsageError(f"--window must be >= 1 (epochs to write now), got {window}")
    per_rank, tokens = _bucket_inputs(samples, config)  # raises before anything is written
    first = _epoch(samples, config, 0)  # raises "nothing to train" before anything is written
    fs, root = open_url(url, storage_options)
    begin_plan(fs, root)
    epochs_planned = range(min(window or config.epochs, config.epochs))
    epochs = _plan_epochs(fs, root, samples, config, epochs_planned, "plan", progress)
    meta = {
        "kind": PLAN_KIND,
        "format_version": PLAN_FORMAT_VERSION,
        "tool_version": __version__,
        "mode": "packing" if config.packing else "fixed",
        "inputs": {**config.to_json(), **inputs},
        "sources": {k: (redact(v) if v else None) for k, v in (sources or {}).items()},
        "layout": epoch_part(0).replace("00000", "{epoch:05d}") + ", one row group per rank",
        "buckets": {
            n: {"samples": int(c), "batch_size": int(b), "latent_tokens": int(t)}
            for n, c, b, t in zip(samples.names, samples.counts, per_rank, tokens)
        },
        "samples": planned,
        "global_batch": None if config.packing else config.world_size * config.batch_size,
        "steps_per_epoch": first.steps,
        "resumed_from": None,
        **extra,
    }
    meta = with_epochs(meta, epochs)
    commit_plan(fs, root, meta)
    return meta


def extend_plan(
    url: str,
    sample_ids: Sequence[int] | np.ndarray | pa.Array,
    buckets: Sequence[str] | pa.Array,
    *,
    manifest_fingerprint: str,
    cache_fingerprint: str | None = None,
    epochs: int | None = None,
    window: int | None = None,
    sources: dict[str, str | None] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Write more epochs of the plan at ``url`` (made with ``window``) and commit; returns ``_plan.json``.

    ``epochs``: hold epochs ``0..epochs-1`` afterwards; else ``window`` more; else all of the run's.
    The samples must be the ones the plan was made from (same manifest and cache fingerprints, same
    samples per bucket). The plan stays valid while this runs: new files are written first, the new
    ``_plan.json`` last. Raises PlanError for a plan that cannot be extended or other inputs.
    """
    samples = _samples(sample_ids, buckets, sources)
    return _extend(url, samples, manifest_fingerprint, cache_fingerprint, epochs, window, storage_options, progress)


def extend_mix_plan(
    url: str,
    mix: MixedSamples,
    *,
    manifest_fingerprints: Sequence[str],
    cache_fingerprints: Sequence[str | None],
    epochs: int | None = None,
    window: int | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Write more epochs of the mixture plan at ``url``; like :func:`extend_plan`. Raises PlanError for a
    plan made with another rule or other manifests or caches."""
    meta = read_plan_meta(url, storage_options)
    recorded = meta["inputs"].get("mix") or {}
    if (recorded.get("kind"), recorded.get("values")) != (mix.rule.kind, mix.rule.to_json()["values"]):
        raise PlanError(f"{redact(url)} was not made with --{mix.rule.kind} {','.join(mix.rule.to_json()['values'])}: "
                        "extend it with the manifests, caches and rule it was made from")  # fmt: skip
    return _extend(url, mix, combined_fingerprint(manifest_fingerprints), combined_fingerprint(cache_fingerprints),
                   epochs, window, storage_options, progress, meta)  # fmt: skip


def _extend(url: str, samples: Samples, manifest_fingerprint: str | None, cache_fingerprint: str | None,
            epochs: int | None, window: int | None, storage_options: dict[str, Any] | None, progress: bool,
            meta: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    meta = meta or read_plan_meta(url, storage_options)
    inputs = meta["inputs"]
    where = redact(url)
    if meta.get("resumed_from"):
        raise PlanError(f"{where} is a resumed plan; extend the plan it was resumed from, then resume again")
    if isinstance(samples, MixedSamples) != ("mix" in inputs):
        raise PlanError(f"{where} is {'a mixture' if 'mix' in inputs else 'a one-manifest'} plan: extend it with "
                        "the manifest(s), --cache and rule it was made from")  # fmt: skip
    if inputs["manifest_fingerprint"] != manifest_fingerprint:
        raise PlanError(f"{where} was made from manifest {inputs['manifest_fingerprint'][:16]}…, not this one "
                        f"({(manifest_fingerprint or '')[:16]}…): extend it with the manifest it was made "
                        "from")  # fmt: skip
    if inputs.get("cache_fingerprint") != cache_fingerprint:
        raise PlanError(f"{where} was made with --cache of fingerprint {inputs.get('cache_fingerprint')}, not "
                        f"{cache_fingerprint}: pass the same --cache as when it was made")  # fmt: skip
    counts = dict(zip(samples.names, samples.counts.tolist()))
    if counts != {n: b["samples"] for n, b in meta["buckets"].items()}:
        raise PlanError(f"{where}: the samples per bucket differ from the ones planned (the cache changed since?); "
                        "re-run `bucketeer plan` without --extend")  # fmt: skip
    config = PlanConfig.from_json(inputs)
    held = len(meta["epochs"])
    target = epochs if epochs is not None else (held + window if window is not None else config.epochs)
    if not held < target <= config.epochs:
        raise PlanError(f"{where} holds epochs 0..{held - 1} of a {config.epochs}-epoch run: --epochs must be "
                        f"between {held + 1} and {config.epochs} (got {target})")  # fmt: skip
    fs, root = open_url(url, storage_options)
    added = _plan_epochs(fs, root, samples, config, range(held, target), "plan --extend", progress)
    new = with_epochs(meta, meta["epochs"] + added)
    assert new["fingerprint"] == meta["fingerprint"], "extending keeps the plan's identity"
    commit_plan(fs, root, new)
    return new


# ---------------------------------------------------------------- reading


def read_plan_meta(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``_plan.json`` of a committed plan. Raises PlanError saying what is wrong and what to do."""
    fs, root = open_url(url, storage_options)
    return read_artifact_meta(
        fs, root, url, file=PLAN_FILE, kind=PLAN_KIND, version=PLAN_FORMAT_VERSION, error=PlanError,
        missing=PlanMissingError,
        missing_hint="it is not a plan, or `bucketeer plan` never finished (still running or killed). "
        "Run `bucketeer plan` to (re)build it.",
        version_hint="Re-run `bucketeer plan` with this version.",
    )  # fmt: skip


def plan_columns(meta: dict[str, Any]) -> pa.Schema:
    """The columns of a plan's files: PLAN_SCHEMA, then the mixture columns ``_plan.json["columns"]`` names."""
    return plan_schema(meta.get("columns"))


@dataclass(frozen=True)
class PlanRows:
    """What :func:`read_plan_rows` found: rows per ``(epoch, rank)`` asked for, or per epoch its problem.

    An epoch file that is missing or malformed is in ``problems`` (one line naming the epoch and
    file), not in ``tables``, so ``--check`` can report it; :meth:`table` and :meth:`ranks` raise it.
    """

    url: str
    schema: pa.Schema  # the columns asked for
    tables: dict[tuple[int, int], pa.Table]  # rows sorted by step
    problems: dict[int, str]  # per epoch
    sha256: dict[int, str]  # per epoch read whole (every rank) and intact: comparable with _plan.json's

    def _raise_first_problem(self) -> None:
        if self.problems:
            first = self.problems[min(self.problems)]
            raise PlanError(f"{redact(self.url)}: {first}; re-run `bucketeer plan`")

    def table(self) -> pa.Table:
        """Every row read, by (epoch, rank, step). Raises PlanError for the first unusable file."""
        self._raise_first_problem()
        if not self.tables:
            return self.schema.empty_table()
        return pa.concat_tables([self.tables[k] for k in sorted(self.tables)])

    def ranks(self, epoch: int) -> list[pa.Table]:
        """The rows of ``epoch``, one table per rank read, in rank order. Raises PlanError like :meth:`table`."""
        self._raise_first_problem()
        return [self.tables[k] for k in sorted(self.tables) if k[0] == epoch]


def read_plan_rows(
    url: str,
    epochs: Sequence[int] | None = None,
    ranks: Sequence[int] | None = None,
    *,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> PlanRows:
    """The rows of ``epochs`` x ``ranks`` (default: every epoch the plan holds, every rank) in ``columns``
    (default: all the plan's columns, :func:`plan_columns`).

    Every rank: each epoch file is read whole (one GET). Some ranks: the footer and their row groups
    by ranged reads. ``meta`` is the plan's ``_plan.json`` when the caller has it. A missing or
    malformed file is a problem in the result (see :class:`PlanRows`), never an exception here.
    Raises PlanError for an invalid plan, an epoch it does not hold, a rank outside its world size,
    or an unknown column; a storage failure other than a missing file is a StorageError.
    """
    meta = meta or read_plan_meta(url, storage_options)
    entries = {e["epoch"]: e for e in meta["epochs"]}
    epochs = list(entries) if epochs is None else list(epochs)
    for epoch in epochs:
        if epoch not in entries:
            raise PlanError(f"{redact(url)} has no epoch {epoch}; it holds epochs {_span(list(entries))}")
    world = int(meta["inputs"]["world_size"])
    every_rank = ranks is None
    ranks = list(range(world)) if ranks is None else list(ranks)
    for rank in ranks:
        if not 0 <= rank < world:
            raise PlanError(f"rank {rank} is outside {redact(url)}'s world size {world} (ranks 0..{world - 1})")
    schema = plan_columns(meta)
    columns = list(schema.names if columns is None else columns)
    unknown = [c for c in columns if c not in schema.names]
    if unknown:
        raise PlanError(f"columns {unknown} are not plan columns {schema.names}")
    want = pa.schema([schema.field(c) for c in columns])

    fs, root = open_url(url, storage_options)
    tables, problems, sha256 = {}, {}, {}
    for epoch in epochs:
        path, where = join(root, epoch_part(epoch)), f"epoch {epoch}: {epoch_part(epoch)}"
        try:
            if every_rank:
                found, sha256[epoch] = read_epoch_whole(fs, path, where, world, want)
            else:
                found = read_epoch_ranks(fs, path, where, entries[epoch], world, ranks, want)
        except PartProblem as e:
            problems[epoch] = str(e)
            continue
        tables.update({(epoch, rank): table for rank, table in found.items()})
    return PlanRows(url, want, tables, problems, sha256)


def _span(epochs: list[int]) -> str:
    return f"{epochs[0]}..{epochs[-1]}" if epochs == list(range(epochs[0], epochs[-1] + 1)) else str(epochs)


def read_rank_plan(
    url: str, rank: int, storage_options: dict[str, Any] | None = None, epoch: int | None = None
) -> pa.Table:
    """Rank ``rank``'s rows (all epochs, or one), sorted by (epoch, step), in PLAN_SCHEMA.

    Reads ``_plan.json`` and this rank's row groups only. Raises PlanError for an invalid plan, a
    rank outside the world size, an epoch the plan does not hold, or a missing or malformed file.
    """
    return read_plan_rows(url, None if epoch is None else [epoch], [rank], storage_options=storage_options).table()
