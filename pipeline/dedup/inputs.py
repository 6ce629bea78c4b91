"""What ``bucketeer dedup`` reads: the hash and embedding columns of one or more ANNOTATIONS folders, merged
by sample id, and each sample's pixels from its manifest (for the keeper rule).

A ``--by`` kind reads the column of the same name, written by the annotate task of the same name
(``sha256``, ``phash``, ``embedding``); ``aesthetic`` is read where a folder has it. Sample ids are unique
across manifests, so several folders (of several manifests, or of one manifest's tasks annotated into
separate folders) merge into one table: a sample's value comes from the first folder that has one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.annotations import AnnotationsMeta, TaskSettings, read_annotations, read_annotations_meta
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from manifests.manifest_meta import ManifestError
from manifests.storage import redact

__all__ = ["DEFAULT_BY", "KINDS", "InputArtifact", "DedupInputs", "default_kinds", "read_inputs"]

log = logging.getLogger("bucketeer.dedup")

KINDS = ("sha256", "phash", "embedding")  # --by kinds, each the name of its column and of the task that writes it
DEFAULT_MODEL = "default"  # TaskSettings.model of the tiny random-weight default models


@dataclass(frozen=True)
class InputArtifact:
    """One input annotations folder, as recorded in the output."""

    url: str  # redacted
    fingerprint: str
    manifest: str
    manifest_fingerprint: str
    rows: int

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "fingerprint": self.fingerprint, "manifest": self.manifest,
                "manifest_fingerprint": self.manifest_fingerprint, "rows": self.rows}  # fmt: skip


@dataclass(frozen=True)
class DedupInputs:
    """The merged inputs, one row per sample, sorted by sample id. ``valid[kind]``: rows that have that column."""

    sample_ids: np.ndarray  # (n,) uint64
    filenames: pa.Array  # (n,) string
    source_keys: np.ndarray  # (n,) uint64
    sha256: np.ndarray  # (n,) int64 dictionary codes of the hex strings
    phash: np.ndarray  # (n,) uint64
    embedding: np.ndarray | None  # (n, D) float16, L2-normalised
    aesthetic: np.ndarray  # (n,) float32, NaN where absent
    pixels: np.ndarray  # (n,) int64 width * height, 0 where the manifest lacks the sample
    valid: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> (n,) bool
    artifacts: tuple[InputArtifact, ...] = ()
    embedding_model: TaskSettings | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)


def _check_embedding_models(metas: list[tuple[str, AnnotationsMeta]]) -> TaskSettings:
    """The one embedding model of the folders; UsageError for the random default model or for several."""
    models = {}
    for url, meta in metas:
        task = meta.task("embedding")
        if task is None:
            continue
        if task.model == DEFAULT_MODEL:
            raise UsageError(f"--by embedding: {redact(url)} has embeddings of the random default model, whose "
                             "similarities mean nothing; annotate with `--task embedding --embedding-model ID|PATH` "
                             "(a real image encoder), or dedup --by sha256,phash")  # fmt: skip
        models.setdefault((task.model, task.weight_sha256), task)
    if len(models) > 1:
        named = ", ".join(sorted(m for m, _ in models))
        raise UsageError(f"--by embedding: the annotations hold embeddings of different models ({named}); "
                         "cosine similarity across models means nothing: dedup each model's folders apart")  # fmt: skip
    return next(iter(models.values()))


def _embedding_matrix(column: pa.ChunkedArray, valid: np.ndarray, url: str) -> np.ndarray:
    """(rows, D) float16 of a list column; null rows are zeros."""
    array = column.combine_chunks()
    present = array.filter(pa.array(valid))
    values = present.flatten().to_numpy(zero_copy_only=False)
    dim = len(values) // max(1, len(present))
    lengths = pc.list_value_length(present).to_numpy(zero_copy_only=False)
    if len(present) and (lengths != dim).any():
        raise UsageError(f"{redact(url)}: embeddings of different lengths; re-annotate into a new folder")
    out = np.zeros((len(array), dim), np.float16)
    out[valid] = values.reshape(len(present), dim)
    return out


def _pixels(manifests: list[str], metas: list[tuple[str, AnnotationsMeta]], ids: np.ndarray,
            storage_options: dict[str, Any]) -> np.ndarray:  # fmt: skip
    """(n,) width * height of each of ``ids`` in ``manifests`` (0 where none has it)."""
    fingerprints = {meta.manifest: meta.manifest_fingerprint for _, meta in metas}
    pixels = np.zeros(len(ids), np.int64)
    for url in manifests:
        try:
            manifest = read_manifest(url, storage_options)
        except ManifestError as e:
            raise UsageError(f"{e} (dedup reads image sizes from the manifests the annotations name; "
                             "pass --manifest URL[,URL...] where they moved)") from None  # fmt: skip
        if url in fingerprints and manifest.fingerprint != fingerprints[url]:
            log.warning("dedup: %s changed since it was annotated (fingerprint %s, annotated %s): sizes are "
                        "today's", redact(url), manifest.fingerprint[:12], fingerprints[url][:12])  # fmt: skip
        samples = manifest.samples.select(["sample_id", "width", "height"])
        sid = samples.column("sample_id").to_numpy()
        area = samples.column("width").to_numpy().astype(np.int64) * samples.column("height").to_numpy()
        pos = np.clip(np.searchsorted(ids, sid), 0, max(0, len(ids) - 1))
        hit = (ids[pos] == sid) if len(ids) else np.zeros(len(sid), bool)
        pixels[pos[hit]] = np.maximum(pixels[pos[hit]], area[hit])
    return pixels


DEFAULT_BY = ("sha256", "phash")  # they mean the same with any model


def default_kinds(urls: tuple[str, ...], storage_options: dict[str, Any]) -> tuple[str, ...]:
    """The kinds of :data:`DEFAULT_BY` that some folder of ``urls`` holds; UsageError when none does."""
    metas = [read_annotations_meta(url, storage_options) for url in urls]
    kinds = tuple(k for k in DEFAULT_BY if any(meta.task(k) for meta in metas))
    if not kinds:
        raise UsageError(f"{', '.join(redact(u) for u in urls)}: no sha256 or phash task to find duplicates by; run "
                         "`bucketeer annotate MANIFEST --task sha256,phash --out ...` first (or give --by embedding)")
    return kinds


def read_inputs(urls: tuple[str, ...], by: tuple[str, ...], manifests: tuple[str, ...],
                storage_options: dict[str, Any]) -> DedupInputs:  # fmt: skip
    """Read and merge the annotations folders ``urls`` for the ``by`` kinds; UsageError for a folder that
    lacks every one of them, a kind no folder has, or embeddings that cannot be compared."""
    metas = [(url, read_annotations_meta(url, storage_options)) for url in urls]
    for kind in by:
        if not any(meta.task(kind) for _, meta in metas):
            raise UsageError(f"--by {kind}: none of {', '.join(redact(u) for u in urls)} has the {kind} task; "
                             f"run `bucketeer annotate MANIFEST --task {kind} --out ...` first")  # fmt: skip
    model = _check_embedding_models(metas) if "embedding" in by else None
    tables = []
    for url, meta in metas:
        columns = [c for c in (*by, "aesthetic") if meta.task(c)]
        _, rows, _ = read_annotations(url, storage_options, columns=columns)
        tables.append((url, meta, rows))
    # 1. the merged sample ids; each folder's rows land at their positions
    ids = np.unique(np.concatenate([np.empty(0, np.uint64), *(t.column("sample_id").to_numpy() for _, _, t in tables)]))
    n = len(ids)
    filenames: list[Any] = [None] * n
    source_keys = np.zeros(n, np.uint64)
    have = np.zeros(n, bool)
    phash, sha = np.zeros(n, np.uint64), np.full(n, None, object)
    aesthetic = np.full(n, np.nan, np.float32)
    embedding = None
    valid = {kind: np.zeros(n, bool) for kind in by}
    artifacts = []
    for url, meta, rows in tables:
        pos = np.searchsorted(ids, rows.column("sample_id").to_numpy())
        new = ~have[pos]
        names = rows.column("filename").to_pylist()
        for p, name in zip(pos[new], (nm for nm, fresh in zip(names, new) if fresh)):
            filenames[p] = name
        source_keys[pos[new]] = rows.column("source_key").to_numpy()[new]
        have[pos] = True
        for column in rows.column_names:
            mask = rows.column(column).is_valid().to_numpy(zero_copy_only=False)
            if column in valid:
                mask &= ~valid[column][pos]  # the first folder with a value wins
                valid[column][pos[mask]] = True
            if column == "phash":
                phash[pos[mask]] = rows.column(column).fill_null(0).to_numpy()[mask]
            elif column == "sha256":
                sha[pos[mask]] = np.asarray(rows.column(column).to_pylist(), object)[mask]
            elif column == "aesthetic":
                aesthetic[pos[mask]] = rows.column(column).fill_null(np.nan).to_numpy()[mask]
            elif column == "embedding":
                matrix = _embedding_matrix(rows.column(column), mask, url)
                embedding = np.zeros((n, matrix.shape[1]), np.float16) if embedding is None else embedding
                if embedding.shape[1] != matrix.shape[1]:
                    raise UsageError(f"{redact(url)}: {matrix.shape[1]}-d embeddings, another folder's are "
                                     f"{embedding.shape[1]}-d")  # fmt: skip
                embedding[pos[mask]] = matrix[mask]
        artifacts.append(InputArtifact(url=redact(url), fingerprint=meta.fingerprint, manifest=meta.manifest,
                                       manifest_fingerprint=meta.manifest_fingerprint, rows=rows.num_rows))  # fmt: skip
    # 2. sha256 strings as dictionary codes (equal code: equal bytes)
    sha_codes = pc.dictionary_encode(pa.array(sha, pa.string())).indices.fill_null(-1).to_numpy()
    pixels = _pixels(list(manifests) or list(dict.fromkeys(m.manifest for _, m in metas)), metas, ids,
                     storage_options)  # fmt: skip
    return DedupInputs(sample_ids=ids, filenames=pa.array(filenames, pa.string()), source_keys=source_keys,
                       sha256=sha_codes.astype(np.int64), phash=phash,
                       embedding=embedding, aesthetic=aesthetic, pixels=pixels, valid=valid,
                       artifacts=tuple(artifacts), embedding_model=model)  # fmt: skip
