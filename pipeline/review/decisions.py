"""A person's decisions on a manifest's samples, written as an ANNOTATIONS artifact (task ``review``).

    with DecisionLog.open("decisions/", manifest, reviewer="ana") as log:
        log.decide(positions, keep=False)        # rows of the manifest (their order), durable on return
        log.edit_caption(position, "a red fox")
        log.undo()

Every change is written before :meth:`DecisionLog.decide` returns: one part holding every decision so far
(``sample_id, filename, source_key, written_at, keep, caption, reviewer``), then ``_annotations.json``
naming only that part (written last, as every artifact's root JSON). A crash loses no acknowledged
decision. The part before the current one stays on storage (a reader may have read the root JSON that
named it); older ones are deleted, never one a committed root JSON names. The folder's writer lock is
held for the whole session (:func:`manifests.lock.writer_lock`): a second ``bucketeer review`` into the
same folder is refused naming the first; two people review into two folders (``plan`` takes both:
:mod:`manifests.select`). Decisions already in the folder are loaded, so a session resumes.

``written_at`` is when the decision was made; ``caption`` is null unless the caption was edited;
``keep`` is null for a sample whose caption was edited and that was neither kept nor rejected.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from manifests.annotations import (AnnotationsCounts, AnnotationsError, AnnotationsMeta, TaskSettings, image_key,
                                   is_annotations, part_schema, read_annotations, settings_fingerprint, write_part,
                                   write_annotations_meta)  # fmt: skip
from manifests.lock import writer_lock
from manifests.manifest import Manifest
from manifests.storage import join, open_url, redact

__all__ = ["REVIEW_TASK", "Change", "DecisionLog"]

REVIEW_TASK = TaskSettings(task="review", model="person", weight_sha256="")
_SETTINGS = settings_fingerprint((REVIEW_TASK,))
UNDECIDED, REJECT, KEEP = -1, 0, 1  # a row's keep state


@dataclass(frozen=True)
class Change:
    """What one change overwrote (for undo): the rows and their state before it."""

    positions: np.ndarray  # (k,) int64 rows of the manifest
    keep: np.ndarray  # (k,) int8 state before
    written_at: np.ndarray  # (k,) float64 before (NaN: never decided)
    captions: dict[int, str | None]  # row -> edited caption before (absent: none)


class DecisionLog:
    """The decisions of one review session into ``url`` (an annotations folder), in memory and on storage."""

    def __init__(self, url: str, manifest: Manifest, reviewer: str, storage_options: dict[str, Any] | None):
        self.url, self.manifest, self.reviewer = url, manifest, reviewer
        self.storage_options = dict(storage_options or {})
        n = manifest.samples.num_rows
        self.keep = np.full(n, UNDECIDED, np.int8)  # (n,) per manifest row
        self.written_at = np.full(n, np.nan)  # (n,) seconds since the epoch
        self.captions: dict[int, str | None] = {}  # row -> edited caption
        self.version = 0  # bumped on every change (the page's views that read `keep` are recomputed)
        self._history: list[Change] = []
        self._parts: list[str] = []  # written by this session, newest last
        self._lock = threading.Lock()
        self._ids = manifest.samples.column("sample_id").to_numpy()
        self._order = np.argsort(self._ids)  # (n,) for looking ids up

    @classmethod
    @contextlib.contextmanager
    def open(cls, url: str, manifest: Manifest, reviewer: str,
             storage_options: dict[str, Any] | None = None) -> Iterator[DecisionLog]:  # fmt: skip
        """Hold ``url``'s writer lock and load the decisions it holds (a folder of another task is refused)."""
        with writer_lock(url, storage_options, "review"):
            log = cls(url, manifest, reviewer, storage_options)
            if is_annotations(url, storage_options):
                log._load()
            yield log

    @functools.cached_property
    def image_keys(self) -> np.ndarray:
        """(n,) uint64 each manifest row's image key (:func:`manifests.annotations.image_key`; ~8 s a million
        rows: computed once, for the parts and the thumbnail cache alike)."""
        return image_key(self.manifest.samples)

    def positions(self, sample_ids: np.ndarray) -> np.ndarray:
        """(k,) int64 manifest rows of ``sample_ids``; -1 for an id the manifest does not hold."""
        ids = np.asarray(sample_ids, np.uint64)
        at = np.minimum(np.searchsorted(self._ids[self._order], ids), len(self._ids) - 1)
        found = len(self._ids) > 0 and self._ids[self._order][at] == ids
        return np.where(found, self._order[at], -1).astype(np.int64)

    def _load(self) -> None:
        meta, rows, _ = read_annotations(self.url, self.storage_options)
        if meta.task("review") is None:
            raise AnnotationsError(f"{redact(self.url)} holds annotations of tasks "
                                   f"{', '.join(t.task for t in meta.tasks)}, not review decisions: give "
                                   "bucketeer review another --out")  # fmt: skip
        at = self.positions(rows.column("sample_id").to_numpy())
        here = at >= 0  # decisions on samples a rescan removed since are not shown (nor kept)
        keep = rows.column("keep").to_numpy(zero_copy_only=False)
        valid = rows.column("keep").is_valid().to_numpy(zero_copy_only=False)
        self.keep[at[here]] = np.where(valid, keep.astype(bool).astype(np.int8), UNDECIDED)[here]
        self.written_at[at[here]] = rows.column("written_at").to_numpy()[here]
        for p, c in zip(at[here], np.asarray(rows.column("caption").to_pylist(), object)[here]):
            if c is not None:
                self.captions[int(p)] = c
        self._parts = list(meta.parts)

    def decide(self, positions: np.ndarray, keep: bool) -> int:
        """Keep or reject the manifest rows ``positions``; written before it returns. Returns how many (none:
        nothing is written and no undo step is added)."""
        positions = np.unique(np.asarray(positions, np.int64))
        if not len(positions):
            return 0
        with self._lock:
            self._history.append(self._before(positions))
            self.keep[positions] = KEEP if keep else REJECT
            self.written_at[positions] = time.time()
            self._commit()
        return len(positions)

    def edit_caption(self, position: int, caption: str | None) -> None:
        """Replace row ``position``'s caption (None: back to its own); written before it returns."""
        with self._lock:
            self._history.append(self._before(np.array([position], np.int64)))
            if caption is None:
                self.captions.pop(position, None)
            else:
                self.captions[position] = caption
            self.written_at[position] = time.time()
            self._commit()

    def undo(self) -> int:
        """Take back the last change (0: nothing to undo); returns how many rows it restored."""
        with self._lock:
            if not self._history:
                return 0
            change = self._history.pop()
            self.keep[change.positions] = change.keep
            self.written_at[change.positions] = change.written_at
            for p in change.positions.tolist():
                if p in change.captions:
                    self.captions[p] = change.captions[p]
                else:
                    self.captions.pop(p, None)
            self._commit()
            return len(change.positions)

    def counts(self) -> dict[str, int]:
        """``kept``, ``rejected``, ``edited`` (captions) and ``undoable`` changes."""
        return {"kept": int((self.keep == KEEP).sum()), "rejected": int((self.keep == REJECT).sum()),
                "edited": len(self.captions), "undoable": len(self._history)}  # fmt: skip

    def _before(self, positions: np.ndarray) -> Change:
        edited = np.fromiter(self.captions, np.int64, len(self.captions))
        touched = edited[np.isin(edited, positions)].tolist()  # the edited captions among them (few)
        return Change(positions, self.keep[positions].copy(), self.written_at[positions].copy(),
                      {p: self.captions[p] for p in touched})  # fmt: skip

    def table(self) -> pa.Table:
        """Every decided row as a part of task ``review`` (sorted by manifest row)."""
        edited = np.zeros(len(self.keep), bool)
        edited[list(self.captions)] = True
        rows = np.flatnonzero((self.keep != UNDECIDED) | edited)  # (k,)
        samples = self.manifest.samples.select(["sample_id", "filename"]).take(rows)
        keep = self.keep[rows]
        captions = np.full(len(rows), None, object)  # (k,) the few edited ones filled in
        at = np.searchsorted(rows, np.fromiter(self.captions, np.int64, len(self.captions)))
        captions[at] = list(self.captions.values())
        columns = {
            "sample_id": samples.column("sample_id"), "filename": samples.column("filename"),
            "source_key": pa.array(self.image_keys[rows], pa.uint64()),
            "written_at": pa.array(self.written_at[rows]),
            "keep": pa.array(keep == KEEP, mask=keep == UNDECIDED),
            "caption": pa.array(captions, pa.string()),
            "reviewer": pa.DictionaryArray.from_arrays(np.zeros(len(rows), np.int32),
                                                       [self.reviewer]).cast(pa.string()),
        }  # fmt: skip
        schema = pa.schema(part_schema(("review",)))
        return pa.table([columns[f.name] for f in schema], schema=schema)

    def _commit(self) -> None:
        """Write every decision as one new part, then the root JSON naming it; delete parts two back."""
        self.version += 1
        fs, root = open_url(self.url, self.storage_options)
        table = self.table()
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"  # newer sorts later
        write_part(fs, root, "parts", name, table, _SETTINGS)
        n = self.manifest.samples.num_rows
        write_annotations_meta(self.url, self.storage_options, AnnotationsMeta(
            manifest=redact(self.manifest.url), manifest_fingerprint=self.manifest.fingerprint,
            tasks=(REVIEW_TASK,), settings_fingerprint=_SETTINGS, engine="review",
            counts=AnnotationsCounts(samples=n, annotated=table.num_rows, errors=0), parts=(name,),
            fingerprint=""))  # fmt: skip
        self._parts.append(name)
        for old in self._parts[:-2]:  # the one before stays: a reader may have just read the JSON naming it
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(join(root, "parts", old))
        self._parts = self._parts[-2:]
