"""Plan files: one parquet object per epoch, one row group per rank, read whole or one rank by ranged reads.

``epoch-EEEEE.parquet`` holds every row ``(epoch, step, rank, bucket, sample_ids)`` of one epoch,
rank-major: row group ``r`` is rank ``r``'s rows, sorted by step. So a plan is O(epochs) objects,
and a rank reads its rows with two ranged reads: the footer (its byte count is in ``_plan.json``,
so no HEAD is needed to find it) and its row group. Memory: one epoch of one rank's rows.

Integrity: the rows a rank decodes are bytes that hash to the epoch's sha256 in ``_plan.json``, not
only a file of the right size with a valid footer. A sha256 covers the whole file, so a rank streams
the whole file once per epoch (:data:`HASH_CHUNK`-sized ranged reads, hashed in order) and keeps only
its row group; see :func:`read_epoch_ranks` for the cost.

Encoding (measured in ``benchmarks/plan.py``): ``sample_ids`` is a non-nullable ``list<uint64>``
whose values are DELTA_BINARY_PACKED. The ids are 64-bit hashes, incompressible one by one, but a
global batch is in ascending id order (:func:`manifests.plan.schedule.plan_epoch`), so a rank's
ids lie in one narrow id range and their deltas need fewer than 64 bits (about 7.5 bytes per id at
1,024 ranks). ``step`` is delta-encoded, ``epoch``, ``rank``, ``bucket`` (and a mixture plan's
``dataset`` and ``caption_index``, :mod:`manifests.plan.mix`) dictionary/RLE-encoded,
and zstd covers the pages, list levels included. No statistics: nothing filters on them.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from manifests.plan.meta import EpochEntry
from manifests.plan.rows import epoch_table
from manifests.plan.schedule import EpochSchedule
from manifests.storage import read_bytes

__all__ = ["EpochFile", "epoch_part", "encode_epoch", "read_epoch_whole", "read_epoch_ranks", "PartProblem"]

LAYOUT = "epoch-{epoch:05d}.parquet"
HASH_CHUNK = 32 << 20  # bytes per ranged read when a rank hashes its epoch file: one GET for most plans
_WRITE_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "use_dictionary": ["epoch", "rank", "bucket", "dataset", "caption_index"],  # the last two: mixture plans
    "write_statistics": False,
    "column_encoding": {"step": "DELTA_BINARY_PACKED", "sample_ids.list.element": "DELTA_BINARY_PACKED"},
}


class PartProblem(Exception):
    """An epoch file that is missing, not parquet, or not laid out one row group per rank (a line of text)."""


def epoch_part(epoch: int) -> str:
    """Path of one epoch's file, relative to the plan folder."""
    return LAYOUT.format(epoch=epoch)


@dataclass(frozen=True)
class EpochFile:
    """One encoded epoch: its bytes, their sha256 and the footer length (recorded in ``_plan.json``)."""

    epoch: int
    data: bytes

    @property
    def path(self) -> str:
        return epoch_part(self.epoch)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def footer_bytes(self) -> int:
        return int.from_bytes(self.data[-8:-4], "little")


def encode_epoch(schedule: EpochSchedule, world_size: int) -> EpochFile:
    """Every rank's rows of ``schedule`` as one parquet file, row group ``r`` = rank ``r``'s rows.

    Raises ValueError when a global batch does not split over ``world_size`` ranks.
    """
    table = epoch_table(schedule, world_size)  # rank-major, schedule.steps rows per rank
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=max(schedule.steps, 1), **_WRITE_OPTIONS)
    return EpochFile(schedule.epoch, buf.getvalue())


def _columns(want: pa.Schema, schema: pa.Schema, where: str) -> None:
    for name in want.names:
        if name not in schema.names or not _same_type(schema.field(name).type, want.field(name).type):
            found, expected = ([f"{f.name}: {f.type}" for f in s] for s in (schema, want))
            raise PartProblem(f"{where}: columns {found} are not the plan columns {expected}")


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    if pa.types.is_list(a) and pa.types.is_list(b):  # list<element: …> as written, list<item: …> as declared
        return a.value_type.equals(b.value_type)
    return a.equals(b)


def _check_layout(metadata: pq.FileMetaData, world_size: int, steps: int | None, where: str) -> None:
    if metadata.num_row_groups != world_size:
        raise PartProblem(f"{where}: {metadata.num_row_groups} row groups, not one per rank ({world_size})")
    if steps is not None:
        bad = [r for r in range(world_size) if metadata.row_group(r).num_rows != steps]
        if bad:
            raise PartProblem(
                f"{where}: rank {bad[0]} has {metadata.row_group(bad[0]).num_rows} steps, but _plan.json says "
                f"{steps} (unequal steps hang a collective)"
            )


def read_epoch_whole(
    fs, path: str, where: str, world_size: int, want: pa.Schema
) -> tuple[dict[int, pa.Table], str]:
    """Every rank's rows of one epoch file (one GET) in the columns of ``want``, and the file's sha256.

    Raises PartProblem naming ``where`` for a missing or malformed file, StorageError when storage refuses.
    """
    try:
        data = read_bytes(fs, path)
    except FileNotFoundError:
        raise PartProblem(f"{where} named by _plan.json is missing") from None
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as e:
        raise PartProblem(f"{where} is not parquet ({e})") from None
    _columns(want, parquet.schema_arrow, where)
    _check_layout(parquet.metadata, world_size, None, where)
    tables = {r: _row_group(parquet, r, want, where) for r in range(world_size)}
    return tables, hashlib.sha256(data).hexdigest()


def _row_group(parquet: pq.ParquetFile, rank: int, want: pa.Schema, where: str) -> pa.Table:
    try:
        return parquet.read_row_group(rank, columns=want.names).cast(want)
    except (pa.ArrowInvalid, OSError) as e:
        raise PartProblem(f"{where}: rank {rank}'s row group is not readable ({e})") from None


class _SparseFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only some ranges were fetched: what pyarrow reads a
    row group through. A read outside them is a bug of the caller (it fetched the wrong range)."""

    def __init__(self, size: int, ranges: dict[int, bytes]):
        self.size, self.ranges, self.pos = size, ranges, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset, io.SEEK_END: self.size + offset}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        for start, data in self.ranges.items():
            if start <= self.pos and self.pos + n <= start + len(data):
                out = data[self.pos - start : self.pos - start + n]
                self.pos += n
                return out
        raise AssertionError(f"read of bytes {self.pos}..{self.pos + n} outside the fetched ranges")


def _group_range(metadata: pq.FileMetaData, rank: int) -> tuple[int, int]:
    """Byte range ``[start, end)`` of row group ``rank``: its column chunks, dictionary pages included."""
    group = metadata.row_group(rank)
    starts, ends = [], []
    for c in range(group.num_columns):
        col = group.column(c)
        first = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
        starts.append(first)
        ends.append(first + col.total_compressed_size)
    return min(starts), max(ends)


def read_epoch_ranks(
    fs, path: str, where: str, entry: EpochEntry, world_size: int, ranks: Sequence[int], want: pa.Schema,
    *, chunk: int = HASH_CHUNK,
) -> dict[int, pa.Table]:  # fmt: skip
    """Rows of ``ranks`` in one epoch file by ranged reads: the footer, then the file in ``chunk``-byte
    reads, hashed and checked against the epoch's sha256 in ``_plan.json``; only the ranks' row groups
    (and the footer, compared with the one read first) are kept.

    Cost per rank and epoch: the footer twice plus the whole file once (``entry.bytes``: about 8 bytes
    per planned sample id, e.g. ~8 MB for an epoch of 1M samples, whatever the world size), in
    ``1 + ceil(bytes / chunk)`` GETs (2 for most plans, as many as the footer and row group alone took),
    against 1/world of the file without the check; memory: one chunk plus the ranks' row groups.
    The trainer reads the next epoch in a background thread, so this is off the step path.

    ``entry`` is the epoch's ``_plan.json`` entry (its ``bytes``, ``footer_bytes``, ``steps`` and
    ``sha256``). Raises PartProblem naming ``where`` for a missing, malformed or edited file (one
    whose bytes do not hash to ``entry.sha256``), StorageError when storage refuses.
    """
    size, footer = entry.bytes, entry.footer_bytes
    try:
        tail = read_bytes(fs, path, size - footer - 8, size)
    except FileNotFoundError:
        raise PartProblem(f"{where} named by _plan.json is missing") from None
    if len(tail) != footer + 8 or tail[-4:] != b"PAR1":
        raise PartProblem(f"{where} does not end in the {footer}-byte parquet footer _plan.json records")
    try:
        metadata = pq.read_metadata(pa.BufferReader(b"PAR1" + tail))  # offsets in it are the file's own
    except (pa.ArrowInvalid, OSError) as e:
        raise PartProblem(f"{where} has no readable parquet footer ({e})") from None
    _columns(want, metadata.schema.to_arrow_schema(), where)
    _check_layout(metadata, world_size, entry.steps, where)
    spans = [_group_range(metadata, r) for r in ranks]
    digest, (*blobs, hashed_tail) = _read_hashed(fs, path, where, size, [*spans, (size - footer - 8, size)], chunk)
    if digest != entry.sha256 or hashed_tail != tail:
        raise PartProblem(f"{where} does not hash to the sha256 that _plan.json records (edited after planning)")
    tables = {}
    for rank, (start, _), data in zip(ranks, spans, blobs):
        parquet = pq.ParquetFile(_SparseFile(size, {start: data}), metadata=metadata)
        tables[rank] = _row_group(parquet, rank, want, where)
    return tables


def _read_hashed(
    fs, path: str, where: str, size: int, spans: Sequence[tuple[int, int]], chunk: int
) -> tuple[str, list[bytes]]:
    """The sha256 of bytes ``[0, size)`` of ``path``, read in ``chunk``-byte ranged reads, and the bytes of
    each ``[start, end)`` of ``spans`` cut from them. PartProblem when the file is missing or shorter."""
    digest, pieces = hashlib.sha256(), [[] for _ in spans]
    for at in range(0, size, chunk):
        end = min(at + chunk, size)
        try:
            data = read_bytes(fs, path, at, end)
        except FileNotFoundError:
            raise PartProblem(f"{where} named by _plan.json is missing") from None
        if len(data) != end - at:
            raise PartProblem(f"{where} is shorter than the {size} bytes _plan.json records")
        digest.update(data)
        for piece, (start, stop) in zip(pieces, spans):
            if start < end and stop > at:
                piece.append(data[max(start, at) - at : min(stop, end) - at])
    return digest.hexdigest(), [b"".join(p) for p in pieces]
