"""An epoch schedule as plan rows ``(epoch, step, rank, bucket, sample_ids[, mixture columns])`` and back.

:mod:`manifests.plan.schedule` decides the global batches; this module cuts them into ranks: step
``s`` of rank ``r`` is the ``r``-th equal slice of global batch ``s``. :func:`epoch_table` is what an
epoch file holds (rank-major, :mod:`manifests.plan.parts`), :func:`rank_table` one rank's rows,
:func:`schedule_from_rank_tables` the inverse (what an elastic resume re-cuts with :func:`resplit`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.errors import UsageError
from manifests.plan.schedule import EpochSchedule, concat_ranges

__all__ = [
    "PLAN_SCHEMA",
    "MIX_FIELDS",
    "plan_schema",
    "rank_slices",
    "rank_table",
    "epoch_table",
    "schedule_from_rank_tables",
    "resplit",
]

# every parquet file under PLAN/ has exactly these columns
PLAN_SCHEMA = pa.schema(
    [
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("bucket", pa.string(), nullable=False),
        pa.field("sample_ids", pa.list_(pa.uint64()), nullable=False),
    ]
)
# mixture plans (:mod:`manifests.plan.mix`) add, parallel to ``sample_ids``: the dataset of each sample
# (index into ``_plan.json["mix"]["datasets"]``, when there are several) and the caption chosen for it
# (index into the manifest's ``captions`` list, when a manifest has one); ``_plan.json["columns"]`` lists them
MIX_FIELDS = {
    "dataset": pa.field("dataset", pa.list_(pa.uint8()), nullable=False),
    "caption_index": pa.field("caption_index", pa.list_(pa.uint8()), nullable=False),
}


def plan_schema(columns: Sequence[str] | None = None) -> pa.Schema:
    """The plan's columns: PLAN_SCHEMA, then the mixture columns named in ``columns`` (``_plan.json["columns"]``)."""
    extra = [MIX_FIELDS[c] for c in (columns or ()) if c in MIX_FIELDS]
    return pa.schema([*PLAN_SCHEMA, *extra])


def _check_split(schedule: EpochSchedule, world_size: int) -> None:
    sizes = schedule.step_sizes
    if np.any(sizes % world_size):
        bad = int(np.flatnonzero(sizes % world_size)[0])
        raise UsageError(
            f"epoch {schedule.epoch} step {schedule.first_step + bad}: a global batch of {int(sizes[bad])} samples "
            f"does not split evenly over {world_size} ranks; pick a world size that divides it"
        )


def _rank_index(schedule: EpochSchedule, world_size: int, rank: int) -> tuple[np.ndarray | None, np.ndarray]:
    """``(slot index of rank's samples (L,) int64, or None for a fixed batch, per-step batch sizes (S,))``."""
    _check_split(schedule, world_size)
    sizes = schedule.step_sizes
    per_rank = sizes // world_size  # (S,)
    if len(sizes) and np.all(sizes == sizes[0]):  # fixed batch: a reshape, no index arrays
        return None, per_rank
    return concat_ranges(schedule.offsets[:-1] + rank * per_rank, per_rank), per_rank


def _take_rank(values: np.ndarray, index: np.ndarray | None, steps: int, world_size: int, rank: int) -> np.ndarray:
    if index is None:
        return values.reshape(steps, world_size, -1)[:, rank, :].reshape(-1)  # (S, W, B) -> (S*B,)
    return values[index]


def rank_slices(schedule: EpochSchedule, world_size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s samples: ``(ids (L,) uint64, per-step batch sizes (S,) int64)``.

    Raises ValueError when a global batch does not split into ``world_size`` equal batches.
    """
    index, per_rank = _rank_index(schedule, world_size, rank)
    return _take_rank(schedule.ids, index, len(per_rank), world_size, rank), per_rank


def _list_columns(values: dict[str, np.ndarray], offsets: np.ndarray) -> list[pa.Array]:
    """The list columns (``sample_ids``, then mixture columns) of rows cut at ``offsets``."""
    types = {"sample_ids": pa.uint64(), "dataset": pa.uint8(), "caption_index": pa.uint8()}
    return [pa.ListArray.from_arrays(pa.array(offsets), pa.array(v, types[c])) for c, v in values.items()]


def _table(columns: list[pa.Array], lists: dict[str, np.ndarray]) -> pa.Table:
    return pa.Table.from_arrays(columns, schema=plan_schema([c for c in lists if c != "sample_ids"]))


def rank_table(schedule: EpochSchedule, world_size: int, rank: int) -> pa.Table:
    """Rank ``rank``'s rows ``(epoch, step, rank, bucket, sample_ids[, mixture columns])`` of one epoch, by step."""
    index, per_rank = _rank_index(schedule, world_size, rank)
    steps = len(per_rank)
    lists = {c: _take_rank(v, index, steps, world_size, rank) for c, v in schedule.slot_arrays().items()}
    offsets = np.concatenate([[0], np.cumsum(per_rank)]).astype(np.int32)
    return _table(
        [
            pa.array(np.full(steps, schedule.epoch, np.int32)),
            pa.array(np.arange(schedule.first_step, schedule.first_step + steps, dtype=np.int32)),
            pa.array(np.full(steps, rank, np.int32)),
            pa.array(schedule.names, pa.string()).take(pa.array(schedule.step_buckets)),
            *_list_columns(lists, offsets),
        ],
        lists,
    )


def epoch_table(schedule: EpochSchedule, world_size: int) -> pa.Table:
    """Every rank's rows of one epoch, rank-major: rank 0's steps, then rank 1's, ... (:func:`plan_schema`).

    Equal to concatenating :func:`rank_table` over the ranks, without a table per rank. Raises
    ValueError when a global batch does not split into ``world_size`` equal batches.
    """
    _check_split(schedule, world_size)
    sizes = schedule.step_sizes
    steps = len(sizes)
    per_rank = sizes // world_size  # (S,)
    index = None
    if not (steps and np.all(sizes == sizes[0])):
        starts = schedule.offsets[:-1][None, :] + np.arange(world_size)[:, None] * per_rank[None, :]  # (W, S)
        index = concat_ranges(starts.reshape(-1), np.tile(per_rank, world_size))

    def rank_major(values: np.ndarray) -> np.ndarray:
        if index is None:
            return values.reshape(steps, world_size, -1).transpose(1, 0, 2).reshape(-1)  # (S, W, B) -> (W*S*B,)
        return values[index]

    lists = {c: rank_major(v) for c, v in schedule.slot_arrays().items()}
    lengths = np.tile(per_rank, world_size)  # (W*S,)
    if int(lengths.sum()) >= 2**31:
        raise UsageError(f"epoch {schedule.epoch}: {int(lengths.sum())} sample slots, more than one plan file holds")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return _table(
        [
            pa.array(np.full(steps * world_size, schedule.epoch, np.int32)),
            pa.array(np.tile(np.arange(schedule.first_step, schedule.first_step + steps, dtype=np.int32), world_size)),
            pa.array(np.repeat(np.arange(world_size, dtype=np.int32), steps)),
            pa.array(schedule.names, pa.string()).take(pa.array(np.tile(schedule.step_buckets, world_size))),
            *_list_columns(lists, offsets),
        ],
        lists,
    )


def schedule_from_rank_tables(
    tables: Sequence[pa.Table], padded: dict[str, int] | None = None, dropped: dict[str, int] | None = None,
    dataset_counts: Sequence[int] | None = None,
) -> EpochSchedule:
    """Rebuild the global batches of one epoch from all ranks' rows (``tables[r]`` is rank r's).

    Inverse of :func:`rank_table` over all ranks. Raises ValueError when the ranks disagree (steps,
    buckets or batch sizes), which a plan written by bucketeer never does.
    """
    world = len(tables)
    first = tables[0]
    steps = first.column("step").to_numpy()
    epoch = int(first.column("epoch")[0].as_py()) if first.num_rows else 0
    bucket = first.column("bucket").combine_chunks()
    lengths = []
    values: dict[str, list[np.ndarray]] = {c: [] for c in ("sample_ids", *MIX_FIELDS) if c in first.column_names}
    for r, t in enumerate(tables):
        if not np.array_equal(t.column("step").to_numpy(), steps):
            raise UsageError(f"epoch {epoch}: rank {r} has other steps than rank 0")
        if not t.column("bucket").combine_chunks().equals(bucket):
            raise UsageError(f"epoch {epoch}: rank {r} holds another bucket than rank 0 at some step")
        ids = t.column("sample_ids").combine_chunks()
        lengths.append(pc.list_value_length(ids).to_numpy().astype(np.int64))
        for c in values:
            values[c].append(t.column(c).combine_chunks().flatten().to_numpy())
    per_rank = lengths[0]  # (S,)
    for r in range(world):
        if not np.array_equal(lengths[r], per_rank):
            raise UsageError(f"epoch {epoch}: rank {r} has other batch sizes than rank 0")
    sizes = per_rank * world  # (S,)
    goff = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)  # (S,)
    merged = {}
    for c, parts in values.items():
        merged[c] = np.empty(int(sizes.sum()), dtype=np.uint64 if c == "sample_ids" else np.uint8)
        for r in range(world):
            merged[c][concat_ranges(goff + r * per_rank, per_rank)] = parts[r]
    enc = pc.dictionary_encode(bucket)
    names = tuple(sorted(set(enc.dictionary.to_pylist()) | set(padded or {}) | set(dropped or {})))
    index = {name: i for i, name in enumerate(names)}
    remap = np.asarray([index[x] for x in enc.dictionary.to_pylist()], dtype=np.int32)
    codes = remap[enc.indices.to_numpy()] if len(remap) else np.zeros(0, np.int32)
    return EpochSchedule(
        epoch=epoch,
        first_step=int(steps[0]) if len(steps) else 0,
        names=names,
        step_buckets=codes.astype(np.int32),
        step_sizes=sizes,
        ids=merged["sample_ids"],
        padded=np.asarray([(padded or {}).get(n, 0) for n in names], np.int64),
        dropped=np.asarray([(dropped or {}).get(n, 0) for n in names], np.int64),
        datasets=merged.get("dataset"),
        captions=merged.get("caption_index"),
        dataset_counts=None if dataset_counts is None else np.asarray(dataset_counts, np.int64),
    )


def resplit(schedule: EpochSchedule, world_size: int) -> list[pa.Table]:
    """All ranks' rows of ``schedule`` for a new world size (the elastic-resume cut)."""
    return [rank_table(schedule, world_size, r) for r in range(world_size)]
