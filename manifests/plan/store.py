"""Shard plans on storage: write a plan, read one rank's rows, resume elastically on another world size.

A plan folder holds one parquet file per (epoch, rank), ``epoch-EEEEE/rank-RRRRR.parquet``, each
with the columns ``(epoch int32, step int32, rank int32, bucket string, sample_ids list<uint64>)``
sorted by step, and ``_plan.json``, written last, which makes the folder valid. A rank reads only
its own files (their paths follow from ``(epoch, rank)``: no listing), so thousands of ranks each
read a few hundred kilobytes. The schedule itself is :mod:`manifests.plan.schedule`.

:func:`read_plan_rows` is the one reader of plan rows: rows of ``(epochs, ranks, columns)``, never
of file paths, so the layout can change under it. The trainer, ``--check``, the resume and the
report all read through it.

Public API::

    meta = read_plan_meta(url, storage_options)            # _plan.json as a dict; PlanError if invalid
    rows = read_rank_plan(url, rank, storage_options, epoch=None)   # this rank's rows, by (epoch, step)
    rows = read_plan_rows(url, epochs=[0], ranks=None, columns=["step", "bucket"])  # a PlanRows
    meta = resume_plan(plan_url, out_url, epoch=E, step=S, world_size=N2)  # elastic resume

**Elastic resume.** ``(epoch, step)`` is the position reached: ``step`` is the first step of
``epoch`` that was NOT run (steps ``< step`` are consumed, under world size N1). ``resume_plan``
writes a new plan folder at ``out_url`` for world size N2 holding steps ``step..end`` of
``epoch`` (original step numbers kept) and every later epoch; earlier epochs are absent. Its
``_plan.json`` names the parent in ``resumed_from`` and lists the epochs it holds with their
``first_step``. The global batch stays the same (``N1*B1 == N2*B2``, so N2 must divide it): each
remaining global batch is cut into N2 slices instead of N1. No consumed sample is seen again in
that epoch and none is skipped; later epochs equal those of a fresh plan with (N2, B2). In packing
mode each bucket's global batch is kept and must split evenly over N2. Only the parent plan is
read (no manifest, no cache), so a trainer's rank 0 can call it and the others wait on a barrier.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from manifests import __version__
from manifests.plan.schedule import (
    PLAN_SCHEMA,
    EpochSchedule,
    PlanConfig,
    bucket_batch_sizes,
    group_samples,
    latent_tokens,
    plan_epoch,
    rank_table,
    schedule_from_rank_tables,
)
from manifests.errors import MissingError, UsageError
from manifests.progress import Progress
from manifests.storage import (
    call_storage,
    is_local,
    join,
    open_url,
    read_artifact_meta,
    read_many,
    redact,
    storage_error,
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
    "rank_part",
    "write_plan",
    "read_plan_meta",
    "read_plan_rows",
    "read_rank_plan",
    "resume_plan",
    "epoch_files",
]

PLAN_FILE = "_plan.json"
PLAN_KIND = "bucketeer.plan"
PLAN_FORMAT_VERSION = 1
LAYOUT = "epoch-{epoch:05d}/rank-{rank:05d}.parquet"


class PlanError(UsageError):
    """A plan folder is missing, uncommitted, of another format version, or malformed."""


class PlanMissingError(PlanError, MissingError):
    """A folder without ``_plan.json``: no plan there, or `bucketeer plan` never finished."""


def rank_part(epoch: int, rank: int) -> str:
    """Path of one rank's rows of one epoch, relative to the plan folder."""
    return LAYOUT.format(epoch=epoch, rank=rank)


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    # sample ids are random 64-bit values: compression would cost time and save nothing
    pq.write_table(
        table,
        buf,
        compression={"epoch": "zstd", "step": "zstd", "rank": "zstd", "bucket": "zstd", "sample_ids": "none"},
        row_group_size=1 << 20,
    )
    return buf.getvalue()


def _digest(files: dict[str, bytes]) -> str:
    """The sha256 ``_plan.json`` records for an epoch: of its parts' paths and contents, in rank order."""
    digest = hashlib.sha256()
    for path, data in files.items():
        digest.update(f"{path}:{hashlib.sha256(data).hexdigest()}\n".encode())
    return digest.hexdigest()


def epoch_files(schedule: EpochSchedule, world_size: int) -> tuple[dict[str, bytes], str]:
    """Every rank's parquet bytes of one epoch, by relative path, and their combined sha256."""
    files = {
        rank_part(schedule.epoch, r): _parquet_bytes(rank_table(schedule, world_size, r)) for r in range(world_size)
    }
    return files, _digest(files)


def _put_files(fs, root: str, files: dict[str, bytes]) -> None:
    if is_local(fs):
        for path, data in files.items():
            write_bytes_atomic(fs, join(root, path), data)
    else:
        # one call: async stores (s3fs) upload these concurrently
        paths = {join(root, path): data for path, data in files.items()}
        call_storage(fs, f"writing {len(paths)} plan parts under", root, lambda: fs.pipe(paths))


def _epoch_entry(schedule: EpochSchedule, digest: str, steps_total: int) -> dict[str, Any]:
    names = schedule.names
    padded = {n: int(c) for n, c in zip(names, schedule.padded) if c}
    dropped = {n: int(c) for n, c in zip(names, schedule.dropped) if c}
    return {
        "epoch": schedule.epoch,
        "first_step": schedule.first_step,
        "steps": schedule.steps,
        "steps_in_epoch": steps_total,
        "padded": padded,
        "dropped": dropped,
        "padded_total": sum(padded.values()),
        "dropped_total": sum(dropped.values()),
        "sha256": digest,
    }


class _TokenStats:
    """Per-rank latent tokens per step, min / mean / max over all steps written."""

    def __init__(self, tokens: dict[str, int]):
        self.tokens = tokens
        self.lo, self.hi, self.sum, self.n = None, None, 0, 0

    def add(self, schedule: EpochSchedule, world_size: int) -> None:
        if not schedule.steps:
            return
        tok = np.asarray([self.tokens[n] for n in schedule.names], np.int64)[schedule.step_buckets]  # (S,)
        per_step = tok * (schedule.step_sizes // world_size)  # (S,)
        self.lo = int(per_step.min()) if self.lo is None else min(self.lo, int(per_step.min()))
        self.hi = int(per_step.max()) if self.hi is None else max(self.hi, int(per_step.max()))
        self.sum += int(per_step.sum())
        self.n += len(per_step)

    def to_json(self) -> dict[str, Any]:
        return {"min": self.lo, "mean": round(self.sum / max(self.n, 1), 3), "max": self.hi, "per": "rank"}


def _totals(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    padded: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for e in epochs:
        for n, c in e["padded"].items():
            padded[n] = padded.get(n, 0) + c
        for n, c in e["dropped"].items():
            dropped[n] = dropped.get(n, 0) + c
    return {
        "padded": sum(padded.values()),
        "dropped": sum(dropped.values()),
        "padded_per_bucket": padded,
        "dropped_per_bucket": dropped,
    }


class _EpochProgress:
    """Epochs written and their megabytes, through :class:`manifests.progress.Progress`."""

    def __init__(self, job: str, epochs: int, enabled: bool):
        self.progress = Progress(job, "epochs", total=epochs, unit="epochs", enabled=enabled)
        self.bytes = 0

    def written(self, files: dict[str, bytes]) -> None:
        self.bytes += sum(len(data) for data in files.values())
        self.progress.update(1, written=f"{self.bytes / 1e6:.1f} MB")

    def close(self) -> None:
        self.progress.close()


def _fingerprint(inputs: dict[str, Any], resumed_from: Any, epochs: list[dict[str, Any]]) -> str:
    blob = json.dumps([PLAN_FORMAT_VERSION, inputs, resumed_from, [e["sha256"] for e in epochs]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _begin(fs, root: str) -> None:
    # invalidate an older plan here first: a reader must never pair its _plan.json with new parts
    meta = join(root, PLAN_FILE)
    call_storage(fs, "creating", root, lambda: fs.makedirs(root, exist_ok=True))
    if call_storage(fs, "checking", meta, lambda: fs.exists(meta)):
        call_storage(fs, "removing", meta, lambda: fs.rm(meta))


def _commit(fs, root: str, meta: dict[str, Any], keep: set[str]) -> None:
    write_json_atomic(fs, join(root, PLAN_FILE), meta)
    for path in call_storage(fs, "listing", root, lambda: fs.find(root)):
        rel = path[len(root) :].lstrip("/")
        if rel.startswith("epoch-") and rel.endswith(".parquet") and rel not in keep:
            call_storage(fs, "removing", path, lambda: fs.rm(path))


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
    progress: bool = False,
) -> dict[str, Any]:
    """Plan every epoch of ``(sample_ids, buckets)`` and commit it at ``url``; returns ``_plan.json``.

    Parts are written epoch by epoch (memory: one epoch), ``_plan.json`` last. ``sources`` (e.g.
    the manifest URL) are recorded redacted, outside the fingerprint. ``progress``: report epochs
    written (:class:`manifests.progress.Progress`, on stderr). Raises ValueError for bad inputs
    (see :class:`PlanConfig`, :func:`group_samples`, :func:`plan_epoch`).
    """
    samples = group_samples(sample_ids, buckets, source=(sources or {}).get("manifest") or "samples")
    if not len(samples.ids):
        raise UsageError("nothing to train: no sample to plan (empty manifest, or none of its samples is in the cache)")
    per_rank = bucket_batch_sizes(samples.names, config)  # (k,) raises before anything is written
    tokens = latent_tokens(samples.names, config.latent_factor, config.patch_size)
    first = plan_epoch(samples, config, 0)  # raises "nothing to train" before anything is written
    fs, root = open_url(url, storage_options)
    _begin(fs, root)
    stats = _TokenStats(dict(zip(samples.names, tokens.tolist())))
    epochs, keep = [], set()
    reporter = _EpochProgress("plan", config.epochs, progress)
    for epoch in range(config.epochs):
        schedule = first if epoch == 0 else plan_epoch(samples, config, epoch)
        assert schedule.steps == first.steps, "steps per epoch depend only on bucket sizes"
        files, digest = epoch_files(schedule, config.world_size)
        _put_files(fs, root, files)
        keep |= set(files)
        stats.add(schedule, config.world_size)
        epochs.append(_epoch_entry(schedule, digest, first.steps))
        reporter.written(files)
        del files, schedule
    reporter.close()
    inputs = {
        **config.to_json(),
        "manifest_fingerprint": manifest_fingerprint,
        "cache_fingerprint": cache_fingerprint,
    }
    meta = {
        "kind": PLAN_KIND,
        "format_version": PLAN_FORMAT_VERSION,
        "tool_version": __version__,
        "mode": "packing" if config.packing else "fixed",
        "inputs": inputs,
        "sources": {k: (redact(v) if v else None) for k, v in (sources or {}).items()},
        "layout": LAYOUT,
        "buckets": {
            n: {"samples": int(c), "batch_size": int(b), "latent_tokens": int(t)}
            for n, c, b, t in zip(samples.names, samples.counts, per_rank, tokens)
        },
        "samples": {"planned": int(len(samples.ids)), "not_in_cache": int(not_in_cache), "stale": int(stale)},
        "global_batch": None if config.packing else config.world_size * config.batch_size,
        "steps_per_epoch": first.steps,
        "epochs": epochs,
        "counts": _totals(epochs),
        "tokens_per_step": stats.to_json(),
        "resumed_from": None,
        "fingerprint": _fingerprint(inputs, None, epochs),
    }
    _commit(fs, root, meta, keep)
    return meta


def read_plan_meta(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``_plan.json`` of a committed plan. Raises PlanError saying what is wrong and what to do."""
    fs, root = open_url(url, storage_options)
    meta = read_artifact_meta(
        fs, root, url, file=PLAN_FILE, kind=PLAN_KIND, version=PLAN_FORMAT_VERSION, error=PlanError,
        missing=PlanMissingError,
        missing_hint="it is not a plan, or `bucketeer plan` never finished (still running or killed). "
        "Run `bucketeer plan` to (re)build it.",
        version_hint="Re-run `bucketeer plan` with this version.",
    )
    return meta


@dataclass(frozen=True)
class PlanRows:
    """What :func:`read_plan_rows` found, per ``(epoch, rank)`` asked for: its rows, or its problem.

    A part that is missing or malformed is in ``problems`` (one line naming the epoch, rank and
    part), not in ``tables``, so ``--check`` can report it; :meth:`table` and :meth:`ranks` raise it.
    """

    url: str
    schema: pa.Schema  # the columns asked for
    tables: dict[tuple[int, int], pa.Table]  # rows sorted by step
    problems: dict[tuple[int, int], str]
    sha256: dict[int, str]  # per epoch read whole (every rank) and intact: comparable with _plan.json's

    def _raise_first_problem(self) -> None:
        if self.problems:
            first = self.problems[min(self.problems)]
            raise PlanError(f"{redact(self.url)}: {first}; re-run `bucketeer plan`")

    def table(self) -> pa.Table:
        """Every row read, by (epoch, rank, step). Raises PlanError for the first unusable part."""
        self._raise_first_problem()
        if not self.tables:
            return self.schema.empty_table()
        return pa.concat_tables([self.tables[k] for k in sorted(self.tables)])

    def ranks(self, epoch: int) -> list[pa.Table]:
        """The rows of ``epoch``, one table per rank read, in rank order. Raises PlanError like :meth:`table`."""
        self._raise_first_problem()
        return [self.tables[k] for k in sorted(self.tables) if k[0] == epoch]


def _part_rows(data: bytes | None, epoch: int, rank: int, want: pa.Schema) -> tuple[pa.Table | None, str]:
    """One part's rows in the columns of ``want``, or None and the problem (a line naming the epoch,
    rank and part); ``data`` None: the part does not exist."""
    where = f"epoch {epoch} rank {rank}"
    part = rank_part(epoch, rank)
    if data is None:
        return None, f"{where}: part {part} named by {PLAN_FILE} is missing"
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as e:
        return None, f"{where}: part {part} is not parquet ({e})"
    columns = want.names
    schema = parquet.schema_arrow
    if any(c not in schema.names or not schema.field(c).type.equals(want.field(c).type) for c in columns):
        found, expected = ([f"{f.name}: {f.type}" for f in sch] for sch in (schema, want))
        return None, f"{where}: columns {found} are not the plan columns {expected} (part {part})"
    return parquet.read(columns=columns).cast(want), ""


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
    (default: all of PLAN_SCHEMA), with one concurrent read of what they need.

    ``meta`` is the plan's ``_plan.json`` when the caller has it. A missing or malformed part is a
    problem in the result (see :class:`PlanRows`), never an exception here. Raises PlanError for an
    invalid plan, an epoch it does not hold, a rank outside its world size, or an unknown column;
    a storage failure other than a missing part (after the retries) is a StorageError.
    """
    meta = meta or read_plan_meta(url, storage_options)
    held = [e["epoch"] for e in meta["epochs"]]
    epochs = held if epochs is None else list(epochs)
    for epoch in epochs:
        if epoch not in held:
            raise PlanError(f"{redact(url)} has no epoch {epoch}; it holds epochs {held}")
    world = int(meta["inputs"]["world_size"])
    every_rank = ranks is None
    ranks = list(range(world)) if ranks is None else list(ranks)
    for rank in ranks:
        if not 0 <= rank < world:
            raise PlanError(f"rank {rank} is outside {redact(url)}'s world size {world} (ranks 0..{world - 1})")
    columns = list(PLAN_SCHEMA.names if columns is None else columns)
    unknown = [c for c in columns if c not in PLAN_SCHEMA.names]
    if unknown:
        raise PlanError(f"columns {unknown} are not plan columns {PLAN_SCHEMA.names}")
    want = pa.schema([PLAN_SCHEMA.field(c) for c in columns])

    fs, root = open_url(url, storage_options)
    keys = [(e, r) for e in epochs for r in ranks]
    paths = {key: join(root, rank_part(*key)) for key in keys}
    blobs = dict(zip(paths.values(), read_many(fs, list(paths.values()))))  # concurrent GETs, retried
    tables, problems = {}, {}
    for key in keys:
        data = blobs[paths[key]]
        if isinstance(data, BaseException) and not isinstance(data, FileNotFoundError):
            # denied, or still failing after the retries: a storage failure, not a fault of the plan
            raise storage_error(fs, "reading", paths[key], data) from data
        table, problem = _part_rows(None if isinstance(data, BaseException) else data, *key, want)
        if table is None:
            problems[key] = problem
        else:
            tables[key] = table
    sha256 = {}
    if every_rank:
        for epoch in epochs:
            if not any(k[0] == epoch for k in problems):
                sha256[epoch] = _digest({rank_part(epoch, r): blobs[paths[(epoch, r)]] for r in ranks})
    return PlanRows(url, want, tables, problems, sha256)


def read_rank_plan(
    url: str, rank: int, storage_options: dict[str, Any] | None = None, epoch: int | None = None
) -> pa.Table:
    """Rank ``rank``'s rows (all epochs, or one), sorted by (epoch, step), in PLAN_SCHEMA.

    Reads ``_plan.json`` and this rank's rows only. Raises PlanError for an invalid plan, a rank
    outside the world size, an epoch the plan does not hold, or a missing or malformed part.
    """
    return read_plan_rows(url, None if epoch is None else [epoch], [rank], storage_options=storage_options).table()


def resume_plan(
    plan_url: str,
    out_url: str,
    *,
    epoch: int,
    step: int,
    world_size: int,
    batch_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Write the rest of a plan, from ``(epoch, step)``, for ``world_size`` ranks at ``out_url``.

    ``step`` is the first step of ``epoch`` not yet run. ``batch_size`` (fixed mode, optional) must
    equal the global batch / ``world_size``. Returns the new ``_plan.json``. ``progress``: report
    epochs written. Raises PlanError for a position outside the plan and ValueError when the
    global batch does not split over ``world_size`` ranks. See the module docstring for the guarantees.
    """
    meta = read_plan_meta(plan_url, storage_options)
    old_fs, old_root = open_url(plan_url, storage_options)
    new_fs, new_root = open_url(out_url, out_storage_options)
    if old_root == new_root and type(old_fs) is type(new_fs):
        raise UsageError(f"--out {redact(out_url)} is the plan being resumed; write the resumed plan to a new folder")
    old_world = int(meta["inputs"]["world_size"])
    if world_size < 1:
        raise UsageError(f"world size must be >= 1 (number of training processes), got {world_size}")
    entries = {e["epoch"]: e for e in meta["epochs"]}
    if epoch not in entries:
        raise PlanError(f"{redact(plan_url)} has no epoch {epoch}; it holds epochs {sorted(entries)}")
    entry = entries[epoch]
    end = entry["first_step"] + entry["steps"]
    if not entry["first_step"] <= step <= end:
        raise PlanError(
            f"step {step} is outside epoch {epoch} of {redact(plan_url)} (steps {entry['first_step']}..{end})"
        )
    if step == end:  # the epoch is finished: resume at the start of the next one
        later = [e for e in sorted(entries) if e > epoch]
        if not later:
            raise PlanError(
                f"{redact(plan_url)}: epoch {epoch} step {step} is the end of the plan; nothing is left to train"
            )
        epoch, step = later[0], entries[later[0]]["first_step"]

    buckets = {n: dict(b) for n, b in meta["buckets"].items()}
    for name, b in buckets.items():
        global_size = b["batch_size"] * old_world
        if global_size % world_size:
            raise UsageError(
                f"bucket {name}: the global batch of {global_size} samples ({old_world} ranks x {b['batch_size']}) "
                f"does not split over {world_size} ranks; the world size must divide the global batch"
            )
        b["batch_size"] = global_size // world_size
    inputs = dict(meta["inputs"], world_size=world_size)
    if meta["mode"] == "fixed":
        new_batch = meta["global_batch"] // world_size
        if batch_size is not None and batch_size != new_batch:
            raise UsageError(
                f"batch size {batch_size} x {world_size} ranks != the plan's global batch {meta['global_batch']} "
                f"({old_world} x {meta['inputs']['batch_size']}); use batch size {new_batch}"
            )
        inputs["batch_size"] = new_batch

    fs, root = new_fs, new_root
    _begin(fs, root)
    stats = _TokenStats({n: b["latent_tokens"] for n, b in buckets.items()})
    epochs, keep = [], set()
    todo = sorted(x for x in entries if x >= epoch)
    reporter = _EpochProgress("plan --resume", len(todo), progress)
    for e in todo:
        tables = read_plan_rows(plan_url, [e], storage_options=storage_options, meta=meta).ranks(e)
        schedule = schedule_from_rank_tables(tables, entries[e]["padded"], entries[e]["dropped"])
        schedule = schedule.tail(step) if e == epoch else schedule
        files, digest = epoch_files(schedule, world_size)
        _put_files(fs, root, files)
        keep |= set(files)
        stats.add(schedule, world_size)
        epochs.append(_epoch_entry(schedule, digest, entries[e]["steps_in_epoch"]))
        reporter.written(files)
    reporter.close()
    resumed_from = {
        "plan_fingerprint": meta["fingerprint"],
        "epoch": epoch,
        "step": step,
        "world_size": old_world,
        "batch_size": meta["inputs"]["batch_size"],
    }
    new = dict(
        meta,
        inputs=inputs,
        buckets=buckets,
        epochs=epochs,
        counts=_totals(epochs),
        tokens_per_step=stats.to_json(),
        resumed_from=resumed_from,
        fingerprint=_fingerprint(inputs, resumed_from, epochs),
    )
    _commit(fs, root, new, keep)
    return new
