"""``bucketeer dedup ANNOTATIONS[,ANNOTATIONS...] --out DUPLICATES [--by sha256,phash,embedding]``

Exact (equal ``sha256``), perceptual (``phash`` within ``--phash-threshold`` bits) and, when asked for,
semantic (``embedding`` cosine >= ``--embedding-threshold``) duplicates across one or more annotations
folders; clusters are the connected components of all the edges, with one keeper each (most pixels, then
best ``aesthetic``, then lowest sample id). The output is an ANNOTATIONS folder (task ``dedup``): one row per
input sample with ``duplicate``, ``cluster_id``, ``keeper_id``, ``similarity``, so that
``bucketeer plan MANIFEST --annotations DUPLICATES --where "NOT duplicate"`` trains on the keepers.

    bucketeer dedup ann/ --out dups/
    python -m pipeline.dedup annA/,annB/ --out dups/ --by sha256,phash,embedding --embedding-threshold 0.95

Defaults, and why: ``--by sha256,phash`` means the same whatever model made the other columns. A 64-bit
pHash moves by 0-4 bits under re-encoding, resizing and mild colour changes, and crops or edits move it
further; two unrelated images agree within 4 bits with probability ~5e-14 for uniform hashes (~0.02
false pairs among a million images), so ``--phash-threshold 4``. ``--embedding-threshold 0.95``: CLIP-like
cosine of resized / re-encoded copies is >= 0.95, while distinct photos of one subject rarely pass 0.9.
``--by embedding`` is refused for embeddings of the random default model (``--embedding-model default``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from manifests.annotations import (AnnotationsCounts, AnnotationsError, AnnotationsMeta, TaskSettings, is_annotations,
                                   listed_parts, part_name, read_annotations_meta, settings_fingerprint,
                                   write_annotations_meta, write_part)  # fmt: skip
from manifests.errors import UsageError
from manifests.lock import writer_lock
from manifests.throttles import counting_throttles, job_throttles
from manifests.storage import join, open_url, parse_storage_options, redact
from pipeline.dedup.clusters import Clusters, cluster
from pipeline.dedup.edges import MAX_PHASH_THRESHOLD, Edges, exact_edges, phash_edges
from pipeline.dedup.inputs import KINDS, DedupInputs, default_kinds, read_inputs
from pipeline.dedup.semantic import INDEXES, embedding_edges

__all__ = ["DedupJob", "DedupResult", "add_arguments", "job_from_args", "run"]

log = logging.getLogger("bucketeer.dedup")

ROWS_PER_PART = 1_000_000


def _split(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


@dataclass(frozen=True, kw_only=True)
class DedupJob:
    """``bucketeer dedup``: duplicates among the samples of ``annotations`` by the ``by`` kinds, into ``out``.
    ``manifests``: where to read image sizes (default: the manifests the annotations name). ``by`` empty: the
    default, exact and perceptual (``sha256``, ``phash``), each where the folders hold it (one at least)."""

    annotations: tuple[str, ...]
    out: str
    by: tuple[str, ...] = ()  # () = DEFAULT_BY, the kinds of it that the folders hold
    phash_threshold: int = 4  # bits of 64
    embedding_threshold: float = 0.95  # cosine
    index: str = "auto"  # semantic index: auto, flat (exact), ivf (approximate)
    manifests: tuple[str, ...] = ()
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options, e.g. an endpoint_url

    def __post_init__(self) -> None:
        if not self.annotations:
            raise UsageError("dedup needs at least one ANNOTATIONS folder")
        unknown = [k for k in self.by if k not in KINDS]
        if unknown or len(set(self.by)) != len(self.by):
            raise UsageError(f"--by {','.join(self.by)}: give one or more of {','.join(KINDS)}, each once")
        if not 0 <= self.phash_threshold <= MAX_PHASH_THRESHOLD:
            raise UsageError(f"--phash-threshold {self.phash_threshold}: give 0..{MAX_PHASH_THRESHOLD} bits")
        if not 0.0 < self.embedding_threshold <= 1.0:
            raise UsageError(f"--embedding-threshold {self.embedding_threshold}: give a cosine in (0, 1]")
        if self.index not in INDEXES:
            raise UsageError(f"--index {self.index}: give one of {', '.join(INDEXES)}")
        if self.out.rstrip("/") in {a.rstrip("/") for a in self.annotations}:
            raise UsageError(f"--out {redact(self.out)} is one of the inputs: write the duplicates to a new folder")


@dataclass(frozen=True, kw_only=True)
class DedupResult:
    url: str
    fingerprint: str
    meta: AnnotationsMeta
    samples: int
    clusters: int  # clusters of two or more samples
    duplicates: int  # samples that are not their cluster's keeper
    edges: dict[str, int]  # --by kind -> edges found
    index: str | None  # the semantic index used (flat, ivf), None without --by embedding
    seconds: float
    throttled: int = 0  # storage answers that asked for fewer requests (503 SlowDown, 429), all retried


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("annotations", help="annotations folder(s), comma-separated (local paths or URLs)")
    parser.add_argument("--out", required=True, help="folder for the duplicates (an annotations folder, task dedup)")
    parser.add_argument("--by", default="",
                        help="duplicate kinds, comma-separated: sha256 (exact bytes), phash (perceptual), "
                             "embedding (semantic; needs embeddings of a real --embedding-model, and faiss). "
                             "Default: sha256,phash, those of them the folders hold")
    parser.add_argument("--phash-threshold", type=int, default=4, help="max Hamming distance of 64 bits (default 4)")
    parser.add_argument("--embedding-threshold", type=float, default=0.95, help="min cosine (default 0.95)")
    parser.add_argument("--index", default="auto", choices=INDEXES,
                        help="semantic search: flat (exact), ivf (approximate), auto (flat below 10k samples)")
    parser.add_argument("--manifest", default=None,
                        help="manifest(s) to read image sizes from, comma-separated "
                             "(default: those the annotations name)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")


def job_from_args(args: argparse.Namespace) -> DedupJob:
    """The :class:`DedupJob` of ``bucketeer dedup``'s options (UsageError for a bad combination)."""
    return DedupJob(annotations=_split(args.annotations), out=args.out, by=_split(args.by),
                    phash_threshold=args.phash_threshold, embedding_threshold=args.embedding_threshold,
                    index=args.index, manifests=_split(args.manifest or ""),
                    storage_options=parse_storage_options(args.storage_options))  # fmt: skip


def find_edges(job: DedupJob, inputs: DedupInputs) -> tuple[dict[str, Edges], str | None]:
    """Each ``--by`` kind's edges over the rows of ``inputs``, and the semantic index used."""
    edges: dict[str, Edges] = {}
    index = None
    for kind in job.by:
        t = time.perf_counter()
        if kind == "sha256":
            edges[kind] = exact_edges(inputs.sha256, inputs.valid[kind])
        elif kind == "phash":
            edges[kind] = phash_edges(inputs.phash, inputs.valid[kind], job.phash_threshold)
        else:
            assert inputs.embedding is not None
            edges[kind], index = embedding_edges(inputs.embedding, inputs.valid[kind], job.embedding_threshold,
                                                 job.index)  # fmt: skip
        log.info("dedup: %d %s edges in %.1f s", len(edges[kind]), kind, time.perf_counter() - t)
    return edges, index


def _settings(job: DedupJob, inputs: DedupInputs, index: str | None) -> TaskSettings:
    model = inputs.embedding_model
    generation = {"by": list(job.by), "phash_threshold": job.phash_threshold, "index": index,
                  "embedding_threshold": job.embedding_threshold if "embedding" in job.by else None,
                  "inputs": [a.to_json() for a in inputs.artifacts]}  # fmt: skip
    return TaskSettings(task="dedup", model=model.model if model else "none",
                        weight_sha256=model.weight_sha256 if model else "", generation=generation)  # fmt: skip


def _table(inputs: DedupInputs, clusters: Clusters) -> pa.Table:
    n = len(inputs)
    return pa.table({
        "sample_id": pa.array(inputs.sample_ids, pa.uint64()), "filename": inputs.filenames,
        "source_key": pa.array(inputs.source_keys, pa.uint64()),
        "written_at": pa.array(np.full(n, time.time()), pa.float64()),
        "duplicate": pa.array(clusters.duplicate, pa.bool_()),
        "cluster_id": pa.array(clusters.cluster_id, pa.uint64()),
        "keeper_id": pa.array(inputs.sample_ids[clusters.keeper], pa.uint64()),
        "similarity": pa.array(clusters.similarity, pa.float32(), mask=np.isnan(clusters.similarity)),
    })  # fmt: skip


def _write(job: DedupJob, inputs: DedupInputs, table: pa.Table, settings: TaskSettings) -> AnnotationsMeta:
    """Write the parts, then ``_annotations.json`` (last), then remove parts an earlier run left."""
    so = dict(job.storage_options)
    if is_annotations(job.out, so) and [t.task for t in read_annotations_meta(job.out, so).tasks] != ["dedup"]:
        raise AnnotationsError(f"--out {redact(job.out)} holds other annotations: write the duplicates to a new folder")
    fs, root = open_url(job.out, so)
    fingerprint = settings_fingerprint((settings,))
    names = []
    for start in range(0, max(1, table.num_rows), ROWS_PER_PART):
        part = table.slice(start, ROWS_PER_PART)
        name = part_name(fingerprint, part.column("sample_id").to_numpy(), part.column("source_key").to_numpy())
        write_part(fs, root, "parts", name, part, fingerprint)
        names.append(name)
    manifests = list(dict.fromkeys(a.manifest for a in inputs.artifacts))
    manifest_fps = list(dict.fromkeys(a.manifest_fingerprint for a in inputs.artifacts))
    meta = AnnotationsMeta(manifest=",".join(manifests), manifest_fingerprint=",".join(manifest_fps),
                           tasks=(settings,), settings_fingerprint=fingerprint, engine="dedup",
                           counts=AnnotationsCounts(samples=len(inputs), annotated=len(inputs), errors=0),
                           parts=tuple(names), errors=(), fingerprint="",
                           throttled=job_throttles().total)  # fmt: skip
    meta = write_annotations_meta(job.out, so, meta)
    old_parts, old_errors = listed_parts(job.out, so)
    for kind, old in (("parts", old_parts), ("errors", old_errors)):
        for name in set(old) - set(names):  # no committed root JSON names these any more
            fs.rm(join(root, kind, name))
    return meta


def _summary(job: DedupJob, inputs: DedupInputs, edges: dict[str, Edges], clusters: Clusters,
             meta: AnnotationsMeta, seconds: float) -> tuple[int, int]:  # fmt: skip
    """Print one screen: edges by kind, cluster counts, the largest clusters; returns (clusters, duplicates)."""
    keepers = np.flatnonzero((~clusters.duplicate) & (clusters.size > 1))
    duplicates = int(clusters.duplicate.sum())
    print(f"dedup: {len(inputs)} samples of {len(inputs.artifacts)} annotations folder(s) -> {redact(job.out)} "
          f"(fingerprint {meta.fingerprint[:12]}, {seconds:.1f} s)")  # fmt: skip
    print("edges:    " + ", ".join(f"{k} {len(e)}" for k, e in edges.items()))
    print(f"clusters: {len(keepers)} of two or more samples; {duplicates} duplicates, "
          f"{len(inputs) - duplicates} samples kept")  # fmt: skip
    if meta.throttled:
        print(f"storage:  throttled {meta.throttled:,} requests (retried)")
    largest = keepers[np.argsort(-clusters.size[keepers], kind="stable")][:5]
    for row in largest:
        w = inputs.pixels[row]
        print(f"  {clusters.size[row]:>6} samples, keeper {inputs.sample_ids[row]} {inputs.filenames[row].as_py()}"
              f" ({w} px)")  # fmt: skip
    return len(keepers), duplicates


def run(job: DedupJob) -> DedupResult:
    """Find the duplicates and write ``job.out``; prints a one-screen summary. Raises UsageError for inputs
    that cannot be deduplicated as asked (missing columns, default-model embeddings, another writer)."""
    start = time.perf_counter()
    if not job.by:
        job = replace(job, by=default_kinds(job.annotations, dict(job.storage_options)))
    with writer_lock(job.out, job.storage_options, "dedup"), counting_throttles() as throttles:
        inputs = read_inputs(job.annotations, job.by, job.manifests, dict(job.storage_options))
        edges, index = find_edges(job, inputs)
        clusters = cluster(Edges.concat(list(edges.values())), inputs.sample_ids, inputs.pixels, inputs.aesthetic)
        meta = _write(job, inputs, _table(inputs, clusters), _settings(job, inputs, index))
    seconds = time.perf_counter() - start
    n_clusters, duplicates = _summary(job, inputs, edges, clusters, meta, seconds)
    log.debug("dedup finished at %s", _dt.datetime.now(_dt.timezone.utc).isoformat())
    return DedupResult(url=job.out, fingerprint=meta.fingerprint, meta=meta, samples=len(inputs),
                       clusters=n_clusters, duplicates=duplicates, edges={k: len(e) for k, e in edges.items()},
                       index=index, seconds=seconds, throttled=throttles.total)  # fmt: skip
