"""What the review page shows, as polars over the manifest and its annotations: filtered and sorted views,
a page of rows, a histogram, one sample's detail.

    data = ReviewData.load(manifest, ["scores/", "dups/"], log)
    rows = data.view("aesthetic > 5", sort="aesthetic", descending=True)   # (k,) manifest rows, cached
    data.page(rows, offset=0, limit=200, sort="aesthetic")

The frame holds every scalar column of the manifest and of the annotations (never the embeddings), read
once at start (:func:`manifests.select.read_columns`, the join ``plan --where`` uses), plus the session's
live ``keep`` (:class:`pipeline.review.decisions.DecisionLog`). A filter is the language of ``plan --where``
(:func:`manifests.filters.parse_filter`): only the columns it and the sort name are touched. Sample ids
travel as decimal strings (a uint64 does not fit a JavaScript number).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import polars as pl
import pyarrow as pa

from manifests.annotations import read_annotations_meta
from manifests.errors import UsageError
from manifests.manifest import Manifest
from manifests.filters import parse_filter
from manifests.select import annotation_sources, read_columns
from manifests.storage import redact
from pipeline.report.annotations import part_columns
from pipeline.review.decisions import KEEP, UNDECIDED, DecisionLog

__all__ = ["ReviewData", "LIVE_COLUMNS"]

LIVE_COLUMNS = ("keep", "edited")  # the session's decisions, as columns the page filters and sorts by
_ROW = "_row"
_VIEWS = 8  # filters and sorted views kept (a page scrolls one view; a few back and forth are cheap)
_FLOAT32 = (pl.Float32, pl.Boolean, pl.Int8, pl.Int16, pl.UInt8, pl.UInt16)  # exact as float32 (the scores)
_FLOATABLE = (pl.Float64, pl.Int32, pl.UInt32)  # exact as float64


def _scalar(t: pa.DataType) -> bool:
    return not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
                or pa.types.is_struct(t) or pa.types.is_binary(t))  # fmt: skip


@dataclass
class ReviewData:
    """The manifest's rows with every scalar annotation column, and the session's decisions."""

    manifest: Manifest
    log: DecisionLog
    frame: pl.DataFrame  # one row per manifest sample (its order); _row is the position
    columns: tuple[str, ...]  # what the page may filter and sort by
    numeric: frozenset[str]  # of which numbers (histograms)

    @classmethod
    def load(cls, manifest: Manifest, annotations: Sequence[str], log: DecisionLog,
             storage_options: dict[str, Any] | None = None) -> ReviewData:  # fmt: skip
        """Read the columns once. Raises UsageError for a review folder among ``annotations`` (its ``keep``
        would hide this session's) and what :func:`manifests.select.read_columns` refuses."""
        sources = annotation_sources(annotations, storage_options)
        wanted: list[str] = []
        for source in sources:
            if source.is_review:
                raise UsageError(f"--annotations {redact(source.url)} holds review decisions: resume them with "
                                 "--out, or give both folders to plan")  # fmt: skip
            meta = read_annotations_meta(source.url, storage_options)
            types = part_columns(source.url, meta, storage_options)
            wanted += [c for c in source.columns if _scalar(types[c]) and c not in wanted]
        frame = read_columns(manifest, sources, wanted, storage_options) if wanted else pl.DataFrame()
        samples = manifest.samples
        own = [f.name for f in samples.schema if _scalar(f.type) and f.name not in wanted]
        base = pl.from_arrow(samples.select(own))
        assert isinstance(base, pl.DataFrame)
        frame = pl.concat([base, frame], how="horizontal") if wanted else base
        # one chunk per column: the manifest's and the annotations' parts are cut at other rows, and a gather over
        # misaligned chunks costs a rechunk of the whole frame each time (~1 s a page at 1M rows)
        frame = frame.with_columns(pl.int_range(pl.len(), dtype=pl.Int64).alias(_ROW)).rechunk()
        columns = tuple(c for c in frame.columns if c != _ROW) + LIVE_COLUMNS
        numeric = frozenset(c for c, t in frame.schema.items() if t.is_numeric() and c not in ("sample_id", _ROW))
        return cls(manifest, log, frame, columns, numeric)

    def __post_init__(self) -> None:
        self._views: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._orders: dict[tuple, np.ndarray] = {}  # (column, descending, version) -> every row sorted
        self._views_lock = threading.Lock()

    def _live(self, name: str) -> pl.Series:
        if name == "keep":
            keep = self.log.keep
            return pl.Series("keep", pa.array(keep == KEEP, mask=keep == UNDECIDED))
        edited = np.zeros(len(self.log.keep), bool)
        edited[list(self.log.captions)] = True
        return pl.Series("edited", edited)

    def _filtered(self, where: str | None) -> np.ndarray:
        """(k,) int64 manifest rows that ``where`` keeps, in manifest order (cached)."""
        parsed = None if where is None else parse_filter(where, "filter")
        used = [] if parsed is None else list(parsed.columns)
        if unknown := [c for c in used if c not in self.columns]:
            raise UsageError(f"the filter uses {', '.join(map(repr, unknown))}, which no column is; the columns are "
                             f"{', '.join(self.columns)}")  # fmt: skip
        live = [c for c in used if c in LIVE_COLUMNS]
        key = ("filter", where, self.log.version if live else -1)
        if (rows := self._cached(key)) is not None:
            return rows
        if parsed is None:
            rows = np.arange(len(self.log.keep), dtype=np.int64)
        else:
            frame = self.frame.select([_ROW, *(c for c in used if c not in LIVE_COLUMNS)])  # projection
            if live:
                frame = frame.with_columns([self._live(c) for c in live])
            mask = parsed.mask(frame)
            rows = frame.get_column(_ROW).to_numpy()[mask]
        return self._store(key, rows)

    def view(self, where: str | None, sort: str | None = None, descending: bool = False) -> np.ndarray:
        """(k,) int64 manifest rows that ``where`` keeps (None: all), in ``sort`` order (None: manifest order;
        ties in manifest order, no value last). Raises UsageError for bad SQL, an unknown column or a
        non-boolean filter. A filter, a column's order and a sorted view are cached apart: a new sort filters
        nothing again, a new filter sorts nothing again (it picks its rows out of the column's order)."""
        where = (where or "").strip() or None
        if sort is not None and sort not in self.columns:
            raise UsageError(f"sort by {sort!r}: no such column; the columns are {', '.join(self.columns)}")
        rows = self._filtered(where)
        if sort is None:
            return rows
        live = sort in LIVE_COLUMNS or any(c in LIVE_COLUMNS for c in self._used(where))
        key = ("view", where, sort, descending, self.log.version if live else -1)
        if (cached := self._cached(key)) is not None:
            return cached
        order = self._order(sort, descending)  # (n,) every row, sorted
        if len(rows) == len(order):
            return self._store(key, order)
        kept = np.zeros(len(order), bool)
        kept[rows] = True
        return self._store(key, order[kept[order]])  # the filter's rows in the sorted order: O(n), no sort

    def _order(self, sort: str, descending: bool) -> np.ndarray:
        """(n,) int64 every manifest row sorted by ``sort`` (ties in manifest order, null and NaN last), kept
        per column and direction (the live columns' until the next decision)."""
        key = (sort, descending, self.log.version if sort in LIVE_COLUMNS else -1)
        with self._views_lock:
            if key in self._orders:
                return self._orders[key]
        values = self._live(sort) if sort in LIVE_COLUMNS else self.frame.get_column(sort)
        if values.dtype in _FLOAT32:
            order = _float32_order(values.cast(pl.Float32).fill_null(np.nan).to_numpy(), descending)
        elif values.dtype in _FLOATABLE:  # numpy's stable sort
            x = values.cast(pl.Float64).fill_null(np.nan).to_numpy()
            order = np.argsort(-x if descending else x, kind="stable")
        else:  # strings, 64-bit integers (ids): polars, order kept among ties
            order = pl.DataFrame({"v": values}).with_row_index("i").sort(
                "v", descending=descending, nulls_last=True, maintain_order=True).get_column("i").to_numpy()
        order = order.astype(np.int64)
        with self._views_lock:
            self._orders = {k: v for k, v in self._orders.items() if k[2] == -1}  # stale live orders go
            self._orders[key] = order
        return order

    @staticmethod
    def _used(where: str | None) -> list[str]:
        return [] if where is None else list(parse_filter(where, "filter").columns)

    def _cached(self, key: tuple) -> np.ndarray | None:
        with self._views_lock:
            if key in self._views:
                self._views.move_to_end(key)
                return self._views[key]
        return None

    def _store(self, key: tuple, rows: np.ndarray) -> np.ndarray:
        with self._views_lock:
            self._views[key] = rows
            while len(self._views) > _VIEWS:
                self._views.popitem(last=False)
        return rows

    def page(self, rows: np.ndarray, offset: int, limit: int, sort: str | None) -> list[dict[str, Any]]:
        """The grid's cells of ``rows[offset:offset + limit]``: id, filename, bucket, decision, sorted value."""
        at = rows[max(0, offset):max(0, offset) + max(0, limit)]
        cells = ["sample_id", "filename", "bucket"]  # a sort by one of these is read once (polars refuses a twice)
        picked = self.frame.select([*cells, *([sort] if sort and sort in self.frame.columns and sort not in cells
                                              else [])])[at]  # fmt: skip
        values = picked.get_column(sort).to_list() if sort and sort in picked.columns else None
        if sort in LIVE_COLUMNS:
            values = self._live(sort)[at].to_list()
        out = []
        for i, (sid, name, bucket) in enumerate(zip(picked["sample_id"].to_list(), picked["filename"].to_list(),
                                                    picked["bucket"].to_list())):  # fmt: skip
            out.append({"id": str(sid), "filename": name, "bucket": bucket, "keep": int(self.log.keep[at[i]]),
                        "value": None if values is None else _plain(values[i])})  # fmt: skip
        return out

    def histogram(self, rows: np.ndarray, column: str | None, bins: int = 24) -> dict[str, Any] | None:
        """Counts of ``column`` over ``rows``: numeric -> ``edges`` and ``counts``; bool -> true/false/null."""
        if column is None:
            return None
        series = self._live(column) if column in LIVE_COLUMNS else self.frame.get_column(column)
        if series.dtype == pl.Boolean:
            values = series[rows]
            return {"kind": "bool", "true": int(values.sum() or 0), "null": int(values.null_count()),
                    "false": int(len(values) - (values.sum() or 0) - values.null_count())}  # fmt: skip
        if column not in self.numeric:
            return None
        values = series[rows].cast(pl.Float64).drop_nulls().to_numpy()
        values = values[np.isfinite(values)]
        if not len(values):
            return {"kind": "numeric", "edges": [], "counts": []}
        counts, edges = np.histogram(values, bins=bins)
        return {"kind": "numeric", "edges": edges.tolist(), "counts": counts.tolist()}

    def sample(self, position: int) -> dict[str, Any]:
        """Everything about one manifest row: its columns, captions, decision and its duplicate cluster."""
        row = self.frame.row(position, named=True)
        captions = self.manifest.samples.column("captions")[position].as_py() if "captions" in \
            self.manifest.samples.column_names else None  # fmt: skip
        out = {"id": str(row["sample_id"]), "filename": row["filename"], "bucket": row["bucket"],
               "captions": captions or ([row["caption"]] if row.get("caption") else []),
               "edited_caption": self.log.captions.get(position), "keep": int(self.log.keep[position]),
               "columns": {k: _plain(v) for k, v in row.items()
                           if k not in (_ROW, "sample_id") and v is not None}}  # fmt: skip
        if "cluster_id" in self.frame.columns and row.get("cluster_id") is not None:
            members = self.frame.filter(pl.col("cluster_id") == row["cluster_id"]).head(24)
            keeper = row.get("keeper_id")
            out["cluster"] = {"keeper": None if keeper is None else str(keeper),
                              "members": [str(s) for s in members["sample_id"].to_list()]}  # fmt: skip
        return out


def _float32_order(x: np.ndarray, descending: bool) -> np.ndarray:
    """(n,) int64 the order of float32 ``x`` (ties by position, NaN last): one sort of unique uint64 keys
    (the value's bits made to sort as the value, then the position), ~4x faster than a stable argsort."""
    bits = (x + np.float32(0)).view(np.uint32)  # -0.0 + 0.0 is 0.0: the two zeros tie
    high = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))  # sorts as x does
    if descending:
        high = ~high
    high[np.isnan(x)] = np.uint32(0xFFFFFFFF)  # no value, either way: last
    key = (high.astype(np.uint64) << np.uint64(32)) | np.arange(len(x), dtype=np.uint64)  # (n,) unique
    key.sort()
    return (key & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _plain(value: Any) -> Any:
    """A JSON-safe value: ids and other big integers as strings, NaN as None."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**53:
        return str(value)
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value
