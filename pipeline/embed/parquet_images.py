"""Fetch the images of manifest rows that live in parquet files (``scan --format parquet``).

A parquet value has no byte range of its own: the smallest read is the column chunk of one row
group. So the rows asked for are grouped by ``(container, row_group)`` and each group is read once:
the file's footer (a ranged read or two, :class:`manifests.storage.RangedFile`, retried), then only
the image column of that row group, from which every asked-for row takes its bytes. The cost is
a row group's image column per (unit, row group), not a ranged read per image; embed's units keep
a bucket's rows ordered by container and row group (:func:`pipeline.embed.work.cut_units`) so that
a unit touches few row groups. An image whose length is not the manifest's ``size`` means the file
changed since the scan: that row fails (``read_failed``, "rescan") rather than embed another image.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from manifests.storage import RangedFile, call_storage, join

__all__ = ["ParquetChanged", "fetch_parquet_images", "is_parquet_row"]


class ParquetChanged(Exception):
    """The parquet file does not hold what the manifest recorded: it changed since the scan."""


def is_parquet_row(row: dict) -> bool:
    """Whether a manifest row's image is a value of a parquet file's column."""
    return row.get("container") is not None and row.get("row_group") is not None


def _values(column: pa.ChunkedArray) -> pa.Array:
    column = column.combine_chunks()
    return column.field("bytes") if pa.types.is_struct(column.type) else column


def _read_group(fs, root: str, container: str, size: int | None, group: int, image_column: str,
                wanted: list[tuple[int, dict]]) -> list[tuple[int, bytes | BaseException]]:  # fmt: skip
    path = join(root, container)
    try:
        if size is None:  # a manifest row without container_size: ask the store (retried)
            size = call_storage(fs, "reading", path, lambda: fs.size(path))
        with RangedFile(fs, path, size) as file:
            parquet = pq.ParquetFile(file)
            if group >= parquet.num_row_groups or image_column not in parquet.schema_arrow.names:
                raise ParquetChanged(f"{container} has no row group {group} with column {image_column!r}: it "
                                     "changed since the scan; rescan the source")  # fmt: skip
            values = _values(parquet.read_row_group(group, columns=[image_column]).column(0))
    except Exception as e:  # every row of the group fails alike; the caller makes them error rows
        return [(at, e) for at, _ in wanted]
    out: list[tuple[int, bytes | BaseException]] = []
    for at, row in wanted:
        index = int(row["row_index"])
        blob = values[index].as_py() if index < len(values) else None
        if blob is None or len(blob) != int(row["size"]):
            got = "no bytes" if blob is None else f"{len(blob):,} bytes"
            out.append((at, ParquetChanged(f"{row['filename']}: row {index} of row group {group} of {container} has "
                                           f"{got}, the manifest {int(row['size']):,}: the file changed since the "
                                           "scan; rescan the source")))  # fmt: skip
        else:
            out.append((at, blob))
    return out


def fetch_parquet_images(fs, root: str, rows: list[dict], image_column: str, *,
                         threads: int = 16) -> list[bytes | BaseException]:  # fmt: skip
    """The image bytes of parquet manifest ``rows`` (``filename``, ``container``, ``container_size``,
    ``row_group``, ``row_index``, ``size``) in order; a row that cannot be read gets its exception.

    One read of ``image_column`` per distinct ``(container, row_group)``, up to ``threads`` at once.
    """
    groups: dict[tuple[str, int], list[tuple[int, dict]]] = {}
    for at, row in enumerate(rows):
        groups.setdefault((row["container"], int(row["row_group"])), []).append((at, row))
    results: list[bytes | BaseException] = [b""] * len(rows)

    def read(key: tuple[str, int]) -> list[tuple[int, bytes | BaseException]]:
        wanted = groups[key]
        return _read_group(fs, root, key[0], wanted[0][1].get("container_size"), key[1], image_column, wanted)

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(groups))), thread_name_prefix="parquet") as pool:
        for found in pool.map(read, list(groups)):
            for at, blob in found:
                results[at] = blob
    return results
