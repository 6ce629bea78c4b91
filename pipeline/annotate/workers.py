"""The annotate job's Ray work: two Ray Data stages.

- :func:`read_units` (CPU task, one per manifest row group with work): reads the rows the driver marked
  (where the image is, its size for the decode, its image key) and cuts them into **units** of
  ``unit_rows`` rows, sorted by container, row group and sample id (so a unit of a parquet-sourced
  manifest reads few of the source's row groups); a unit travels as Arrow IPC bytes.
- :class:`AnnotateWriter` (an actor per engine replica, on a GPU or a CPU): fetches a unit's images
  the way embed does (:func:`pipeline.embed.imaging.fetch_images`: loose files whole, tar members by one
  ranged read, parquet bytes by row group), decodes each once (:func:`pipeline.embed.imaging.prepare_views`:
  EXIF orientation, the manifest's pixel limit, JPEG draft decoding), runs every task of the
  :class:`~pipeline.annotate.tasks.TaskPlan` on it (captions and embeddings in batches), and **writes the
  unit's part itself** (and its error part), returning one small summary row (with the unit's times, which
  the driver adds up per actor process: :class:`pipeline.annotate.dataflow.UnitTimes`). An actor runs two
  units at a time, each with its own model passes of ``--torch-threads`` threads.

A unit is what a lost worker costs: Ray Data retries it elsewhere, and the rewrite lands on the same
part name (:func:`manifests.annotations.part_name`).
"""

from __future__ import annotations

import io
import os
import socket
import time
from typing import Any

import numpy as np
import pyarrow as pa

from manifests import faults
from manifests.annotations import TASK_COLUMNS, embedding_type, image_key, part_name, part_schema, write_part
from manifests.manifest import read_row_group
from manifests.throttles import SPANS, throttle_mark, throttle_span
from manifests.storage import open_url, redact
from pipeline.annotate.engines import TransformersCaptioner
from pipeline.annotate.image_stats import STATS, image_stats, phash, sha256_hex
from pipeline.annotate.tasks import TaskPlan
from pipeline.embed.imaging import ImageFailure, fetch_images, prepare_views, read_failure
from pipeline.embed.work import GroupWork
from pipeline.embed.workers import from_ipc, to_ipc

__all__ = ["UNIT_COLUMNS", "read_units", "decode_for_caption", "decode_rows", "write_error_part", "AnnotateWriter"]

# what a unit carries per row: identity, where the image is, its display size
UNIT_COLUMNS = ["sample_id", "filename", "container", "container_size", "member_offset", "row_group", "row_index",
                "size", "etag", "mtime", "width", "height", "codec"]  # fmt: skip (codec: a video's; null for images)


def read_units(batch: pa.Table, *, manifest: str, storage_options: dict | None, unit_rows: int) -> pa.Table:
    """One row group's marked rows (``batch``: one :meth:`GroupWork.item`) as units: ``{"rows": IPC bytes}``."""
    (item,) = batch.to_pylist()
    before = throttle_mark()
    work = GroupWork.from_item(item)
    rows = read_row_group(manifest, work.group, UNIT_COLUMNS, storage_options).take(pa.array(work.rows))
    rows = rows.append_column("source_key", pa.array(image_key(rows), pa.uint64()))
    rows = rows.sort_by([("container", "ascending"), ("row_group", "ascending"), ("sample_id", "ascending")])
    units = [to_ipc(rows.slice(at, unit_rows)) for at in range(0, rows.num_rows, unit_rows)]
    spans = [throttle_span(before)]  # the manifest reads' throttled storage answers: carried to the summary rows
    return pa.table({"rows": pa.array(units, pa.binary()), "throttled": pa.array([spans] * len(units), SPANS)})


def decode_for_caption(data: bytes, width: int, height: int, image_size: int, max_pixels: int, name: str):
    """A PIL RGB image of ``data`` upright (EXIF), its long side at most ``image_size`` pixels (aspect kept).
    ``width``/``height``: the manifest's display size. Raises ImageFailure for bytes that cannot be one."""
    from PIL import Image

    scale = min(1.0, image_size / max(width, height, 1))
    size = (max(1, round(height * scale)), max(1, round(width * scale)))  # (h, w)
    (view,) = prepare_views(data, size, max_pixels=max_pixels, name=name)
    return Image.fromarray(view.pixels)


def decode_rows(fs, root: str, rows: list[dict], *, image_column: str | None, image_size: int, max_pixels: int,
                storage_options: dict | None, decode: bool = True) -> tuple[list[dict], list[bytes], list, list[dict]]:
    """A unit's ``rows`` fetched from the source ``fs``/``root`` and decoded once (:func:`decode_for_caption`):
    ``(good rows, their bytes, their images (PIL; None where not ``decode``), error rows)``. An image that cannot
    be read (``read_failed``, retried by the next run) or decoded (its :class:`ImageFailure` kind) is an error row:
    the unit's row with ``error`` and ``message``. Both engines decode through here: the same rows, the same kinds."""
    blobs = fetch_images(fs, root, rows, image_column=image_column)
    good, data, images, errors = [], [], [], []
    for row, blob in zip(rows, blobs):
        try:
            if isinstance(blob, BaseException):
                raise ImageFailure("read_failed", redact(f"{type(blob).__name__}: {blob}", storage_options))
            images.append(decode_for_caption(blob, row["width"], row["height"], image_size, max_pixels,
                                             row["filename"]) if decode else None)  # fmt: skip
            good.append(row)
            data.append(blob)
        except ImageFailure as e:
            errors.append({**row, "error": e.kind, "message": e.message})
    return good, data, images, errors


def write_error_part(fs, root: str, name: str, errors: list[dict], settings: str, now: float) -> None:
    """Write a unit's error rows (:func:`decode_rows`) as ``errors/<name>``, the unit's part name: a redone
    unit rewrites it, and a rerun retries or keeps its samples by their ``error`` kind. Nothing when none."""
    if not errors:
        return
    table = pa.table({
        "sample_id": pa.array([r["sample_id"] for r in errors], pa.uint64()),
        "filename": pa.array([r["filename"] for r in errors], pa.string()),
        "source_key": pa.array([r["source_key"] for r in errors], pa.uint64()),
        "written_at": pa.array([now] * len(errors), pa.float64()),
        "error": pa.array([r["error"] for r in errors], pa.string()),
        "message": pa.array([r["message"] for r in errors], pa.string()),
    })  # fmt: skip
    write_part(fs, root, "errors", name, table, settings)


class AnnotateWriter:
    """A Ray Data actor: annotates units with every task of ``plan`` and writes their parts (module docstring)."""

    def __init__(self, *, plan: TaskPlan, device: str, threads: int, out: str, storage_options: dict | None,
                 source: str, max_pixels: int, image_column: str | None, settings: str, batch_size: int):  # fmt: skip
        network = plan.video and plan.scenes.network
        if threads and (plan.caption or plan.vision or network):  # the model-free tasks need no torch (seconds)
            import torch

            torch.set_num_threads(threads)
        self.captioner = None
        if plan.caption and plan.caption.video:  # shots: their frames as video input
            from pipeline.annotate.video_captions import ShotCaptioner

            self.captioner = ShotCaptioner(plan.caption, device)
        elif plan.caption:
            self.captioner = TransformersCaptioner(plan.caption, device, threads)
        self.embedder = None
        if plan.vision:
            from pipeline.annotate.vision import ImageEmbedder

            self.embedder = ImageEmbedder(plan.vision, device)
        self.transnet = None
        if network:
            from pipeline.annotate.transnet import load_transnet

            self.transnet = load_transnet(plan.scenes.weights, device)
        self.device = next((m.device for m in (self.captioner, self.embedder, self.transnet) if m is not None), "cpu")
        self.plan, self.out, self.storage_options = plan, out, storage_options
        self.source, self.max_pixels, self.image_column = source, max_pixels, image_column
        self.settings, self.batch_size = settings, batch_size
        self.fs, self.root = open_url(out, storage_options)
        self.source_fs, self.source_root = open_url(source, storage_options)
        self.node = socket.gethostname()

    def __call__(self, batch: pa.Table) -> pa.Table:
        carried = batch.column("throttled").to_pylist() if "throttled" in batch.column_names else [[]] * batch.num_rows
        return pa.Table.from_pylist([self.unit(from_ipc(blob), spans)
                                     for blob, spans in zip(batch.column("rows").to_pylist(), carried)])

    def _decode(self, rows: list[dict]) -> tuple[list[dict], list[bytes], list, list[dict]]:
        """``(good rows, their bytes, their images (PIL, or None when no task decodes), error rows)``."""
        return decode_rows(self.source_fs, self.source_root, rows, image_column=self.image_column,
                           image_size=self.plan.image_size, max_pixels=self.max_pixels,
                           storage_options=self.storage_options, decode=self.plan.decodes)  # fmt: skip

    def _columns(self, data: list[bytes], images: list) -> dict[str, pa.Array]:
        """Every task's columns for the decoded images (in order); captions and embeddings in batches."""
        tasks, cols, n = self.plan.tasks, {}, len(images)
        batches = [images[at : at + self.batch_size] for at in range(0, n, self.batch_size)]
        if self.captioner is not None:
            captions = [c for b in batches for c in self.captioner.caption(b)]
            cols["caption"] = pa.array([c for c, _ in captions], pa.string())
            cols["generated_tokens"] = pa.array([k for _, k in captions], pa.int32())
        if self.embedder is not None:
            dim = self.embedder.dim
            done = [self.embedder(b) for b in batches]
            emb = np.concatenate([e for e, _ in done]) if done else np.zeros((0, dim), np.float32)  # (n, D)
            if "embedding" in tasks:
                flat = pa.array(emb.astype(np.float16).reshape(-1), pa.float16())
                cols["embedding"] = pa.FixedSizeListArray.from_arrays(flat, dim).cast(embedding_type(dim))
            for task in self.embedder.heads:
                cols[task] = pa.array(np.concatenate([s[task] for _, s in done]) if done else [], pa.float32())
        if "phash" in tasks:
            cols["phash"] = pa.array([phash(im) for im in images], pa.uint64())
        if "sha256" in tasks:
            cols["sha256"] = pa.array([sha256_hex(d) for d in data], pa.string())
        if "stats" in tasks:
            stats = [image_stats(np.asarray(im)) for im in images]
            for key in STATS:
                cols[key] = pa.array([s[key] for s in stats], pa.bool_() if key == "grayscale" else pa.float32())
        return cols

    def _video_columns(self, rows: list[dict]) -> tuple[list[dict], dict[str, pa.Array], list[dict]]:
        """The video tasks (``scenes``, ``motion``, and the shot tasks) of a unit: ``(good rows, columns, error
        rows)``; each video decoded once (:func:`pipeline.annotate.scenes.detect_scenes`); an image of the manifest
        is one 1-frame still shot, scored on its own decode. A video that cannot be read is ``read_failed``
        (retried by the next run), one that cannot be decoded ``decode_failed``."""
        from pipeline.annotate.scenes import ShotFrames, VideoScenes

        from pipeline.annotate.tasks import SHOT_FRAMES

        caption = self.plan.caption.shot_frames if self.captioner is not None else 0
        keep = tuple(n for n in (SHOT_FRAMES if self.embedder is not None else 0, caption) if n)
        good, found, errors = [], [], []
        for row in rows:
            try:
                if row["codec"] is None:  # an image: one still shot
                    one = np.array([0], np.int32)
                    kept = None
                    if keep:  # as its own 1-frame shot: the frame given as a still video (repeated) to a captioner
                        _, _, images, failed = self._decode([row])
                        if failed:
                            raise ImageFailure(failed[0]["error"], failed[0]["message"])
                        kept = ShotFrames(keep)
                        kept.add(0, np.asarray(images[0])[..., ::-1])  # RGB, kept as the decode's BGR
                    scenes = VideoScenes(starts=one, frames=one + 1, times=np.zeros(1), motion=np.zeros(1, np.float32),
                                         frame_count=1, video_motion=0.0, kept=kept, rate=1.0)  # fmt: skip
                else:
                    scenes = self._scenes(row, keep)
            except ImageFailure as e:
                errors.append({**row, "error": e.kind, "message": e.message})
                continue
            good.append(row)
            found.append(scenes)
        cols = {"scenes": pa.array([s.rows() for s in found], TASK_COLUMNS["scenes"][0][1])}
        if "motion" in self.plan.tasks:
            cols["motion"] = pa.array([s.video_motion for s in found], pa.float32())
            cols["scene_motion"] = pa.array([s.motion.tolist() for s in found], pa.list_(pa.float32()))
        if self.embedder is not None:
            cols.update(self._shot_vision(found))
        if self.captioner is not None:
            cols.update(self._shot_captions(found))
        return good, cols, errors

    def _shot_captions(self, found: list) -> dict[str, pa.Array]:
        """A caption per shot (:class:`~pipeline.annotate.video_captions.ShotCaptioner` on its ``--shot-frames``
        kept frames, in batches of shots): ``scene_caption``; the video's ``caption`` is its longest shot's (the
        first of the longest), ``generated_tokens`` the sum over its shots."""
        n = self.plan.caption.shot_frames
        shots, fps = [], []
        for s in found:
            for start, frames in zip(s.starts, s.frames):
                shots.append(s.kept.pick(int(start), int(frames), n))
                # the picked frames' own rate: n frames over the shot's duration (a 1-frame still: the stream's)
                fps.append(s.rate * n / int(frames) if frames > 1 else s.rate)
        batches = [range(at, min(at + self.batch_size, len(shots))) for at in range(0, len(shots), self.batch_size)]
        done = [c for b in batches for c in self.captioner.caption([shots[i] for i in b], [fps[i] for i in b])]
        counts = np.cumsum([0, *(len(s.starts) for s in found)])  # video v's shots: counts[v]:counts[v + 1]
        per = [[c for c, _ in done[a:b]] for a, b in zip(counts, counts[1:])]
        longest = [int(np.argmax(s.frames)) for s in found]
        return {"caption": pa.array([p[i] for p, i in zip(per, longest)], pa.string()),
                "generated_tokens": pa.array([sum(k for _, k in done[a:b]) for a, b in zip(counts, counts[1:])],
                                             pa.int32()),
                "scene_caption": pa.array(per, pa.list_(pa.string()))}  # fmt: skip

    def _shot_vision(self, found: list) -> dict[str, pa.Array]:
        """The vision tasks per shot, on each shot's first, middle and last kept frame (:data:`SHOT_FRAMES`), in
        batches: a shot's embedding is the L2-normalised mean of its frames', its scores the mean of theirs; the
        video's (``embedding``, ``aesthetic``, ...) the same over its shots, weighted by their frame counts."""
        from PIL import Image

        from pipeline.annotate.tasks import SHOT_FRAMES

        frames = [Image.fromarray(f) for s in found for start, n in zip(s.starts, s.frames)
                  for f in s.kept.pick(int(start), int(n), SHOT_FRAMES)]  # fmt: skip
        batches = [frames[at : at + self.batch_size] for at in range(0, len(frames), self.batch_size)]
        done = [self.embedder(b) for b in batches]
        dim = self.embedder.dim
        emb = np.concatenate([e for e, _ in done]) if done else np.zeros((0, dim), np.float32)  # (3 * shots, D)
        shots = emb.reshape(-1, SHOT_FRAMES, dim).mean(1)  # (shots, D)
        shots /= np.maximum(np.linalg.norm(shots, axis=1, keepdims=True), 1e-12)
        counts = np.cumsum([0, *(len(s.starts) for s in found)])  # video v's shots: counts[v]:counts[v + 1]
        weights = [s.frames.astype(np.float64) for s in found]
        cols: dict[str, pa.Array] = {}
        if "embedding" in self.plan.tasks:
            video = np.stack([(w[:, None] * shots[a:b]).sum(0) for w, a, b in zip(weights, counts, counts[1:])]
                             ) if found else np.zeros((0, dim))  # (v, D)  # fmt: skip
            video /= np.maximum(np.linalg.norm(video, axis=1, keepdims=True), 1e-12)
            kind = embedding_type(dim)
            flat = pa.array(video.astype(np.float16).reshape(-1), pa.float16())
            cols["embedding"] = pa.FixedSizeListArray.from_arrays(flat, dim).cast(kind)
            per = pa.FixedSizeListArray.from_arrays(pa.array(shots.astype(np.float16).reshape(-1), pa.float16()),
                                                    dim).cast(kind)  # fmt: skip
            cols["scene_embedding"] = pa.ListArray.from_arrays(pa.array(counts, pa.int32()), per)
        for task in self.embedder.heads:
            score = np.concatenate([s[task] for _, s in done]) if done else np.zeros(0, np.float32)
            shot = score.reshape(-1, SHOT_FRAMES).mean(1)  # (shots,)
            cols[task] = pa.array([float(np.average(shot[a:b], weights=w))
                                   for w, a, b in zip(weights, counts, counts[1:])], pa.float32())  # fmt: skip
            cols[f"scene_{task}"] = pa.array([shot[a:b].tolist() for a, b in zip(counts, counts[1:])],
                                             pa.list_(pa.float32()))  # fmt: skip
        return cols

    def _scenes(self, row: dict, keep: int = 0):
        """One video row's :class:`~pipeline.annotate.scenes.VideoScenes` (``keep``: with the frames its shots are
        scored from, that many a shot); raises ImageFailure."""
        from pipeline.annotate.scenes import detect_scenes
        from pipeline.annotate.transnet import TransNetCuts, TransNetFailure
        from pipeline.embed.clips import open_video
        from pipeline.embed.parquet_images import is_parquet_row

        try:
            if is_parquet_row(row):  # no byte range of its own: the value read whole
                (blob,) = fetch_images(self.source_fs, self.source_root, [row], image_column=self.image_column)
                if isinstance(blob, BaseException):
                    raise blob
                file = io.BytesIO(blob)
            else:
                file = open_video(self.source_fs, self.source_root, row)
        except OSError as e:
            raise read_failure(e, self.storage_options) from None
        with file:
            try:
                scenes = detect_scenes(file, keep, TransNetCuts(self.transnet) if self.transnet else None)
            except (KeyboardInterrupt, SystemExit, MemoryError, TransNetFailure):
                raise
            except BaseException as e:  # untrusted bytes: this video's error row, unless storage failed under it
                failure = getattr(file, "failure", None)
                if failure is not None:
                    raise read_failure(failure, self.storage_options) from None
                raise ImageFailure("decode_failed", redact(f"PyAV cannot decode it: {type(e).__name__}: {e}",
                                                           self.storage_options)) from None  # fmt: skip
        if not scenes.frame_count:
            raise ImageFailure("decode_failed", "PyAV decoded no frame of it")
        return scenes

    def unit(self, rows: pa.Table, throttled: list[str] = ()) -> dict[str, Any]:
        """Annotate one unit, write its part and error part; its summary row (``throttled``: the spans of the
        stage before, :func:`manifests.retry.throttle_span`, passed on with this one's)."""
        start, cpu, before = time.time(), time.process_time(), throttle_mark()
        if self.plan.video:
            good, cols, errors = self._video_columns(rows.to_pylist())
        else:
            good, data, images, errors = self._decode(rows.to_pylist())
            cols = self._columns(data, images)
        now = time.time()
        name = part_name(self.settings, rows.column("sample_id").to_numpy(), rows.column("source_key").to_numpy())
        keys = {"sample_id": pa.array([r["sample_id"] for r in good], pa.uint64()),
                "filename": pa.array([r["filename"] for r in good], pa.string()),
                "source_key": pa.array([r["source_key"] for r in good], pa.uint64()),
                "written_at": pa.array([now] * len(good), pa.float64())}  # fmt: skip
        if good:
            table = pa.table({**keys, **cols})
            write_part(self.fs, self.root, "parts", name, table.select([n for n, _ in part_schema(self.plan.tasks)]),
                       self.settings)  # fmt: skip
        write_error_part(self.fs, self.root, name, errors, self.settings, now)
        faults.hit("annotate.unit")  # tests: slow units down, or kill the worker after its part is written
        tokens = cols.get("generated_tokens")
        return {"part": name, "captioned": len(good), "errors": len(errors),
                "tokens": int(np.sum(tokens.to_numpy())) if tokens is not None and len(tokens) else 0,
                # this process's CPU seconds (every thread) at the unit's start and end: units of an actor overlap,
                # so the driver counts each process once over its units (pipeline.annotate.dataflow.UnitTimes)
                "started": start, "seconds": time.time() - start, "cpu_start": cpu, "cpu_end": time.process_time(),
                "node": self.node, "pid": os.getpid(), "device": self.device,
                "throttled": [*throttled, throttle_span(before)]}  # fmt: skip
