"""What an embed run has to do, found in one streaming pass over the manifest, and how it is cut.

:func:`find_work` (on the driver) reads the manifest one row group at a time (ranged reads, about
128K rows each) and judges every row against the committed index (:class:`IndexLookup`, built
once): fresh, failed, stale, retry or missing. It keeps, per row group, only the **positions** of
the rows to embed and of the first occurrence of each caption that has no text record yet (captions
are deduplicated over the whole manifest, a sample's several captions included, by a :class:`KeySet`
of caption keys, 8 bytes each; a caption's position is in the row group's :func:`flat_captions`), and a
few rows to probe the storage with. It holds no Python object per row, and no row group
longer than it reads it: the Ray workers read the rows they are given themselves
(:mod:`pipeline.embed.workers`).

:func:`cut_units` (on a worker) cuts the rows of one row group into **units**: rows of one
bucket, sorted by container, row group and sample id (so that a unit of a parquet-sourced manifest
reads few of the source's row groups, each once), at most ``--shard-records`` of them and few enough that their
pixels stay near :data:`UNIT_PIXEL_BYTES`. A unit is what one encoder call turns into one shard
object, so it is also what is redone when a worker or node dies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.errors import UsageError
from manifests.manifest_meta import ManifestMeta
from manifests.buckets import parse_bucket
from manifests.frames import parse_video_bucket
from manifests.cache import IndexLookup, KeySet, source_key
from manifests.cache.records import caption_key
from manifests.manifest import RowGroup, read_row_group, sample_row_groups
from manifests.schema import CONDITIONING_COLUMNS, LOCATION_COLUMNS, MASK_COLUMNS
from manifests.throttles import SPANS, carry_spans, throttle_mark

__all__ = ["MANIFEST_COLUMNS", "PROBE_FILES", "UNIT_PIXEL_BYTES", "GroupWork", "EmbedWork", "find_work",
           "caption_keys", "flat_captions", "sample_caption_keys", "unit_size", "cut_units", "read_captions",
           "prompt_rows"]  # fmt: skip

# what a row's freshness, caption and probe need: the source-key columns, the caption and where the image is; its
# display size (the latent key embed --reuse looks up)
MANIFEST_COLUMNS = ["sample_id", "filename", "caption", "captions", "bucket", "width", "height", "size", "etag",
                    "mtime", "container", "container_size", "member_offset", "row_group", "row_index",
                    *CONDITIONING_COLUMNS, *MASK_COLUMNS,
                    "clips", "clip_starts", "clip_captions"]  # a video's (null in an image manifest)
PROBE_FILES = 8  # images read up front to tell an unusable storage from a few bad files
UNIT_PIXEL_BYTES = 128 << 20  # pixels of one unit in flight: 42 images at 1024x1024, 682 at 256x256


@dataclass(frozen=True)
class GroupWork:
    """Rows of one manifest row group to process, as int32 positions within the row group; ``inline``
    (images only): per position, whether the row's caption is one no other row has, whose text goes
    into the sample's own record (encoded by the image workers, not the captions phase)."""

    group: RowGroup
    rows: np.ndarray  # (k,) int32, ascending
    inline: np.ndarray | None = None  # (k,) bool

    def item(self) -> dict[str, Any]:
        """The row of a Ray Data input dataset that stands for this work (a few bytes per position)."""
        g = self.group
        inline = np.zeros(len(self.rows), bool) if self.inline is None else self.inline
        return {"part": g.part, "part_bytes": g.part_bytes, "row_group": g.index, "group_rows": g.rows,
                "rows": self.rows.astype("<i4").tobytes(), "inline": np.packbits(inline).tobytes()}  # fmt: skip

    @staticmethod
    def from_item(item: dict[str, Any]) -> "GroupWork":
        group = RowGroup(str(item["part"]), int(item["part_bytes"]), int(item["row_group"]), int(item["group_rows"]))
        rows = np.frombuffer(item["rows"], "<i4")
        inline = np.unpackbits(np.frombuffer(item.get("inline") or b"", np.uint8), count=len(rows)).astype(bool)
        return GroupWork(group, rows, inline)


@dataclass
class EmbedWork:
    """The outcome of :func:`find_work`: counts, per-row-group positions, rows to probe the storage with."""

    samples: int = 0  # rows in the manifest
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("fresh", "failed", "stale", "retry",
                                                                           "missing"), 0))  # fmt: skip
    images: list[GroupWork] = field(default_factory=list)  # rows to (re-)embed
    # first occurrence of each caption without a text record: positions in the row group's flat_captions
    captions: list[GroupWork] = field(default_factory=list)
    probe: list[dict] = field(default_factory=list)  # manifest rows (LOCATION_COLUMNS) to probe

    @property
    def todo(self) -> int:
        return sum(len(w.rows) for w in self.images)

    @property
    def new_captions(self) -> int:
        """Captions the captions phase encodes (shared by several samples, or already embedded apart)."""
        return sum(len(w.rows) for w in self.captions)

    @property
    def inline_captions(self) -> int:
        """Captions encoded by the image workers into their only sample's record."""
        return sum(int(w.inline.sum()) for w in self.images if w.inline is not None)


def caption_keys(captions: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """(n,) uint64 :func:`~manifests.cache.records.caption_key` of each caption (null = empty)."""
    return np.fromiter((caption_key(c) for c in captions.to_pylist()), np.uint64, count=len(captions))


def flat_captions(rows: pa.Table) -> tuple[pa.Array, np.ndarray]:
    """Every caption of ``rows`` (``caption`` and ``captions`` columns), flattened in row order: a row's
    ``captions`` list when it has one, else its ``caption`` (null stays null: the empty caption).
    Returns ``(captions, row)``: (m,) strings and (m,) int32 the row each came from."""
    one = rows.column("caption").combine_chunks().cast(pa.string())
    many = (rows.column("captions").combine_chunks() if "captions" in rows.column_names
            else pa.nulls(rows.num_rows, pa.list_(pa.string())))  # fmt: skip
    if many.null_count == len(many):
        return one, np.arange(rows.num_rows, dtype=np.int32)
    counts = pc.list_value_length(many).fill_null(1).to_numpy(zero_copy_only=False)  # (n,)
    texts = [c for a, b in zip(one.to_pylist(), many.to_pylist()) for c in (b if b is not None else [a])]
    return pa.array(texts, pa.string()), np.repeat(np.arange(rows.num_rows, dtype=np.int32), counts)


def sample_caption_keys(rows: pa.Table) -> pa.Array:
    """Per row, the caption keys of its ``captions`` list (what the cache index records), null without one."""
    many = (rows.column("captions").combine_chunks() if "captions" in rows.column_names
            else pa.nulls(rows.num_rows, pa.list_(pa.string())))  # fmt: skip
    return pa.array([None if m is None else [caption_key(c) for c in m] for m in many.to_pylist()],
                    pa.list_(pa.uint64()))  # fmt: skip


def _spread(n: int, k: int) -> np.ndarray:
    """Up to ``k`` indices spread evenly over ``range(n)`` (deterministic)."""
    return np.unique(np.linspace(0, n - 1, min(k, n)).round().astype(int)) if n else np.zeros(0, int)


def find_work(
    url: str, meta: ManifestMeta, storage_options: dict | None, lookup: IndexLookup, done_texts: np.ndarray,
    inline_text: bool = True, per_sample_text: str | None = None,
) -> EmbedWork:
    """One pass over the manifest at ``url`` (``meta``: its ``_manifest.json``) against a cache's
    committed index (``lookup``; ``done_texts``: caption keys with a text record).

    Rows to embed are the stale, retry and missing ones (:class:`~manifests.cache.Freshness`
    ``todo``); captions to encode are those of these rows (every caption of a sample) without a text
    record, once each. With ``inline_text``, a row to embed whose one caption no other row of the
    manifest has (and that has no text record yet) gets it encoded into its own record by the image
    workers (``GroupWork.inline``), so the trainer reads it with one request; the other captions go
    to the captions phase. Probe files are spread over the rows to embed, leaving out read-failure
    retries (if they still cannot be read, renewing their error rows is the right outcome, not a failed job).
    ``per_sample_text`` (a family whose text depends on each sample's reference image, by name): every row to
    embed gets its text encoded into its own record, and nothing goes to the captions phase; UsageError for a
    manifest without conditioning images (``scan --conditioning``) or a row with several captions (one text per
    record).
    """
    if per_sample_text and meta.conditioning is None:
        raise UsageError(f"--family {per_sample_text} conditions each sample on its reference image, and {url} has "
                         "none: scan with --conditioning ROOT_OR_COLUMN (the references, each the size of its target)")
    work = EmbedWork()
    texts = KeySet(done_texts)
    candidates: list[dict] = []
    every: list[np.ndarray] = []  # every caption key of every row: which captions only one row has
    todo_keys: list[np.ndarray] = []  # per images entry: (t,) the caption key of each row to embed, 0: a list
    caption_keys_new: list[np.ndarray] = []  # per captions entry: (c,) the keys of its captions
    for group in sample_row_groups(url, meta, storage_options):
        rows = read_row_group(url, group, MANIFEST_COLUMNS, storage_options)
        status = lookup.classify(rows, source_key(rows))
        work.samples += rows.num_rows
        for name, value in status.counts().items():
            work.counts[name] += value
        captions, owner = flat_captions(rows)  # (m,), (m,)
        keys = caption_keys(captions)  # (m,)
        every.append(keys)
        todo = np.flatnonzero(status.todo).astype(np.int32)  # (t,)
        if not len(todo):
            continue
        single = np.bincount(owner, minlength=rows.num_rows) == 1  # (n,) rows with one caption, not a list
        if "captions" in rows.column_names:
            single &= np.asarray(rows.column("captions").is_null())
        if per_sample_text:  # every row's text into its record: nothing for the captions phase
            _one_caption_each(rows, todo, single, per_sample_text)
            work.images.append(GroupWork(group, todo, np.ones(len(todo), bool)))
        else:
            work.images.append(GroupWork(group, todo))
            first_of = np.cumsum(np.bincount(owner, minlength=rows.num_rows)) - 1  # (n,) a single-caption row's
            picked = keys[np.clip(first_of[todo], 0, None)] if len(keys) else np.zeros(len(todo), np.uint64)
            todo_keys.append(np.where(single[todo], picked, np.uint64(0)).astype(np.uint64))
            wanted = np.flatnonzero(status.todo[owner]).astype(np.int32)  # (c,) the captions of the rows to embed
            first = texts.add_new(keys[wanted])  # (c,)
            if first.any():
                work.captions.append(GroupWork(group, wanted[first]))
                caption_keys_new.append(keys[wanted[first]])
        probe = np.flatnonzero(status.todo & ~status.retry)
        picks = pa.array([int(probe[i]) for i in _spread(len(probe), PROBE_FILES)], pa.int64())
        candidates += rows.select(list(LOCATION_COLUMNS)).take(picks).to_pylist()
    work.probe = [candidates[i] for i in _spread(len(candidates), PROBE_FILES)]
    if inline_text and work.images and not per_sample_text:
        _mark_inline(work, np.concatenate(every), todo_keys, caption_keys_new, np.asarray(done_texts, np.uint64))
    return work


def _one_caption_each(rows: pa.Table, todo: np.ndarray, single: np.ndarray, family: str) -> None:
    """UsageError naming the first of the rows ``todo`` that has a list of captions (``single`` False)."""
    several = todo[~single[todo]]
    if len(several):
        name = rows.column("filename")[int(several[0])].as_py()
        raise UsageError(f"manifest row {name!r} has several captions; --family {family} stores one text per sample "
                         "(its instruction with its reference image): scan with one caption per image")


def _mark_inline(work: EmbedWork, every: np.ndarray, todo_keys: list[np.ndarray], new_keys: list[np.ndarray],
                 done_texts: np.ndarray) -> None:
    """Set ``inline`` of each images entry (rows whose one caption no other row has and that has no text
    record), and take those captions out of the captions phase."""
    keys, counts = np.unique(every, return_counts=True)
    once = KeySet(keys[counts == 1])
    done = KeySet(done_texts)
    inline_keys = []
    for i, (entry, t) in enumerate(zip(work.images, todo_keys)):
        inline = (t != 0) & once.contains(t) & ~done.contains(t)  # (t,)
        work.images[i] = GroupWork(entry.group, entry.rows, inline)
        inline_keys.append(t[inline])
    moved = KeySet(np.concatenate(inline_keys))
    captions = []
    for entry, k in zip(work.captions, new_keys):
        keep = ~moved.contains(k)
        if keep.any():
            captions.append(GroupWork(entry.group, entry.rows[keep]))
    work.captions = captions


def unit_size(bucket: str, batch_size: int, shard_records: int, max_clips: int = 1) -> int:
    """Images per unit of ``bucket``: up to ``shard_records``, whole batches whose pixels fit
    :data:`UNIT_PIXEL_BYTES` (at least one batch: a batch is never split). A video bucket ``WxHxF``
    counts ``max_clips`` clips of F frames per row."""
    if bucket.lower().count("x") == 2:
        w, h, f = parse_video_bucket(bucket)
        per_row = w * h * 3 * f * (max_clips if f > 1 else 1)
    else:
        w, h = parse_bucket(bucket)
        per_row = w * h * 3
    fit = UNIT_PIXEL_BYTES // per_row
    return max(1, min(shard_records, max(batch_size, fit - fit % batch_size)))


def cut_units(rows: pa.Table, batch_size: int, shard_records: int, max_clips: int = 1) -> Iterator[pa.Table]:
    """Tables of one bucket each, sorted by ``(bucket, container, row_group, sample_id)`` and at most
    :func:`unit_size` rows; ``rows`` needs a ``bucket`` and a ``sample_id`` column (the others ride
    along; ``container`` and ``row_group`` are nulls where absent)."""
    for name, kind in (("container", pa.string()), ("row_group", pa.int32())):
        if name not in rows.column_names:
            rows = rows.append_column(name, pa.nulls(rows.num_rows, kind))
    # a parquet row group is read once per unit that needs it: keep each one's rows together
    rows = rows.sort_by([("bucket", "ascending"), ("container", "ascending"), ("row_group", "ascending"),
                         ("sample_id", "ascending")])  # fmt: skip
    buckets = rows.column("bucket").combine_chunks()
    starts = np.flatnonzero(np.r_[True, pc.not_equal(buckets[1:], buckets[:-1]).to_numpy(zero_copy_only=False)])
    ends = np.r_[starts[1:], rows.num_rows]  # (buckets,) half-open ranges of one bucket each
    for start, end in zip(starts.tolist(), ends.tolist()):
        size = unit_size(buckets[start].as_py(), batch_size, shard_records, max_clips)
        for at in range(start, end, size):
            yield rows.slice(at, min(size, end - at))


def read_captions(batch: pa.Table, manifest: str, storage_options: dict | None) -> pa.Table:
    """Ray Data ``map_batches`` (batch size 1): a row group's new captions (positions in its
    :func:`~pipeline.embed.work.flat_captions`) -> ``(caption_key, caption)`` rows, shortest first (so
    that a text batch pads little)."""
    tables = []
    for item in batch.to_pylist():
        before = throttle_mark()
        work = GroupWork.from_item(item)
        captions, _ = flat_captions(read_row_group(manifest, work.group, ["caption", "captions"], storage_options))
        captions = captions.take(pa.array(work.rows)).fill_null("").cast(pa.string())  # the prompts' type
        order = np.argsort([len(c) for c in captions.to_pylist()], kind="stable")
        captions = captions.take(pa.array(order))
        throttled = pa.array([carry_spans(None, before)] * len(captions), SPANS)
        tables.append(pa.table({"caption_key": caption_keys(captions), "caption": captions, "throttled": throttled}))
    return pa.concat_tables(tables)


def prompt_rows(prompts: dict[int, str]) -> pa.Table:
    """The driver's captions (caption key -> text: the empty caption, validation prompts) as rows of
    :func:`read_captions`' schema, to encode with the manifest's."""
    return pa.table({"caption_key": pa.array(list(prompts), pa.uint64()),
                     "caption": pa.array(list(prompts.values()), pa.string()),
                     "throttled": pa.array([[]] * len(prompts), SPANS)})  # fmt: skip
