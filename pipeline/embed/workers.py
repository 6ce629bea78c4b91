"""The embed job's Ray work: the stages of its Ray Data pipelines, each a function or actor class.

Images (one unit = rows of one bucket that become one shard):

- :func:`plan_units` (CPU task, one per manifest row group) reads the row group's rows that the
  driver marked for embedding and cuts them into units (:func:`pipeline.embed.work.cut_units`);
- :func:`prepare_unit` (CPU task, one per unit) fetches the unit's images concurrently, decodes
  and crops them to the unit's bucket (:func:`prepare_batch`), so the pixels stack into one
  ``(B, H, W, 3)`` array;
- :class:`LatentWriter` (an encoder actor, on a GPU or a CPU) runs the VAE over the unit in
  batches, compresses the records, **writes the unit's shard itself** and returns only its index
  rows. Two calls run at once: one compresses and writes while the other has the encoder.

Captions: :func:`read_captions` (CPU task per row group) reads the first row of each caption the
driver found new; :class:`TextWriter` (encoder actor) encodes a batch of them into one text shard.

Every result is one small row: index rows as Arrow IPC bytes, the shard's size, and a JSON
description of the worker (its encoder's ``describe()``, node, device) that the driver checks and
records. An encoder that fails to load raises from the actor's first call, as a one-line
``UsageError``: Ray keeps only the formatted text of an exception raised in ``__init__``.
Where an actor got a GPU from Ray but torch sees no CUDA (a CPU build of torch; logical GPUs of a
test cluster) it runs on the CPU and says so in its description, which the driver prints loudly,
once per distinct message. :func:`~pipeline.embed.imaging.check_source` (on the driver,
before any model loads) refuses a dataset whose storage cannot be read at all.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import replace
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests import faults
from manifests.buckets import parse_bucket
from manifests.cache import CACHE_ERRORS_SCHEMA, ShardWriter
from manifests.cache.layout import INDEX_SCHEMAS
from manifests.cache.freshness import source_key
from manifests.cache.records import TextRecord, encode_sample, encode_text
from manifests.errors import BucketeerError, UsageError
from manifests.frames import is_video_bucket
from manifests.manifest import read_row_group
from manifests.throttles import SPANS, carry_spans, throttle_mark
from manifests.schema import MASK_COLUMNS
from manifests.storage import is_local, join, open_url, read_many, redact
from pipeline.embed.clips import MAX_CLIPS, clip_records, prepare_clips
from pipeline.embed.encoders import Encoder, quiet_loading, to_storage
from pipeline.embed.imaging import ImageFailure, check_source, conditioning_views, fetch_images, open_source, \
    prepare_views, read_failure
from pipeline.embed.masks import fetch_masks, row_mask, variant_masks
from pipeline.embed.samples import sample_record, variant_pixels
from pipeline.embed.work import MANIFEST_COLUMNS, GroupWork, caption_keys, cut_units, flat_captions, \
    sample_caption_keys

__all__ = ["prepare_batch", "check_source", "describe_encoder", "plan_units", "prepare_unit", "read_captions",
           "LatentWriter", "TextWriter", "to_ipc", "from_ipc", "UNIT_ROWS", "VISIBLE_MARKER"]  # fmt: skip

# the rows of a unit, as plan_units hands them to prepare_unit (conditioning: relative to its root)
UNIT_ROWS = pa.schema([("sample_id", pa.uint64()), ("filename", pa.string()), ("caption_key", pa.uint64()),
                       ("caption_keys", pa.list_(pa.uint64())),  # every caption's key when it has several
                       ("source_key", pa.uint64()),
                       # where the image bytes are (manifests.schema.image_range): null container = a loose file
                       ("container", pa.string()), ("container_size", pa.int64()), ("member_offset", pa.int64()),
                       ("row_group", pa.int32()), ("row_index", pa.int64()), ("size", pa.int64()),
                       ("conditioning", pa.string()),
                       # "alpha", a mask file relative to the source root (a tar member: its byte range), or null
                       ("mask", pa.string()), ("mask_offset", pa.int64()), ("mask_size", pa.int64()),
                       # the caption no other row has: its text goes into the sample's record (caption: its text)
                       ("text_inline", pa.bool_()), ("caption", pa.string()),
                       ("clips", pa.int32())])  # a video's clips (manifests.frames), null for an image  # fmt: skip
_LOCATION = ("container", "container_size", "member_offset", "row_group", "row_index", "size")
# the good rows of a prepared unit, in the order of its pixels
_PREPARED_ROWS = pa.schema([("sample_id", pa.uint64()), ("caption_key", pa.uint64()),
                            ("caption_keys", pa.list_(pa.uint64())), ("source_key", pa.uint64()),
                            *((name, pa.int32()) for name in ("original_h", "original_w", "resized_h", "resized_w",
                                                              "crop_top", "crop_left")),
                            ("crops", pa.list_(pa.int32())),  # every crop's (top, left), flat
                            ("has_mask", pa.bool_()),  # its mask is in the unit's mask_pixels (else all 255 there)
                            ("text_inline", pa.bool_()), ("caption", pa.string()),
                            ("clip_starts", pa.list_(pa.int32()))])  # video: its clips' first frames  # fmt: skip
VISIBLE_MARKER = "_embed-running"  # written by the driver into a local --out; every worker must see it


def to_ipc(table: pa.Table) -> bytes:
    """A table as Arrow IPC stream bytes (how small tables travel inside a Ray Data row; no pickle)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def prepare_batch(
    source: str,
    storage_options: dict | None,
    bucket: str,
    rows: list[dict[str, Any]],
    crop: str,
    seed: int,
    max_pixels: int,
    fs=None,
    *,
    crops: int = 1,
    conditioning: str | None = None,
    image_column: str | None = None,
    max_clips: int = MAX_CLIPS,
) -> dict[str, Any]:
    """Fetch, decode and crop ``rows`` (``sample_id``, ``filename``, ``caption_key``) to ``bucket``.

    Returns ``{"bucket", "pixels": uint8 (B * K, H, W, 3) (the K crops of a good row one after the other),
    "cond_pixels": the same for the conditioning images or None, "mask_pixels": uint8 (B * K, H, W) the loss
    masks cut like the images (255 for a row without one) or None when no row has one, "rows": [geometry per
    good row, ``has_mask``], "errors":
    [(sample_id, filename, kind, message)]}``; one bad image never fails the batch. ``crops``: K crops per image
    (:func:`~pipeline.embed.imaging.prepare_views`). ``conditioning``: the root of the rows' ``conditioning``
    paths: each is cropped exactly like its target (same resized size, same boxes), and a pair that cannot be is
    the sample's error row. Transient storage errors are retried per file
    (:func:`pipeline.embed.imaging.fetch_all`); a read that still fails is a ``read_failed`` error row
    (credentials redacted), which the next run retries. ``fs`` replaces the filesystem of ``source`` (it must be
    picklable for Ray); ``image_column``: a parquet-sourced manifest's (:func:`pipeline.embed.imaging.fetch_images`).
    A video bucket ``WxHxF`` is :func:`pipeline.embed.clips.prepare_clips`' (``max_clips`` clips per video).
    """
    fs, root = open_source(source, storage_options, fs)
    if is_video_bucket(bucket):
        return prepare_clips(fs, root, bucket, rows, crop, seed, max_pixels, max_clips, storage_options,
                             lambda some: fetch_images(fs, root, some, image_column=image_column))  # fmt: skip
    bw, bh = parse_bucket(bucket)
    blobs = fetch_images(fs, root, rows, image_column=image_column)
    paired = conditioning is not None and any(r.get("conditioning") for r in rows)
    if paired:
        cfs, croot = (fs, root) if conditioning == source else open_url(conditioning, storage_options)
        cond_blobs = read_many(cfs, [join(croot, r["conditioning"]) for r in rows])
    masked, mask_blobs = any(r.get("mask") for r in rows), fetch_masks(fs, root, rows)
    good, pixels, cond_pixels, mask_pixels, errors = [], [], [], [], []
    for i, (row, blob) in enumerate(zip(rows, blobs)):
        try:
            if isinstance(blob, BaseException):
                raise read_failure(blob, storage_options)
            views = prepare_views(blob, (bh, bw), crop=crop, seed=seed, sample_id=row["sample_id"],
                                  max_pixels=max_pixels, crops=crops, name=row["filename"])  # fmt: skip
            if paired:
                cond = conditioning_views(row, cond_blobs[i], views, (bh, bw), max_pixels, storage_options)
            if row.get("mask"):
                mask = row_mask(row, mask_blobs.get(i, blob), views, (bh, bw), max_pixels, storage_options)
        except ImageFailure as e:
            errors.append((row["sample_id"], row["filename"], e.kind, e.message))
            continue
        except Exception as e:  # a decoder bug on one file must not kill the job: record it
            message = redact(f"{type(e).__name__}: {e}", storage_options)
            errors.append((row["sample_id"], row["filename"], "decode_failed", message))
            continue
        pixels.extend(v.pixels for v in views)
        if paired:
            cond_pixels.extend(cond)
        if masked:
            mask_pixels.extend(mask if row.get("mask") else np.full((len(views), bh, bw), 255, np.uint8))
        p = views[0]
        good.append({**row, "original_size": p.original_size, "resized_size": p.resized_size,
                     "crop_top_left": p.crop_top_left, "crops": [x for v in views for x in v.crop_top_left],
                     "has_mask": bool(row.get("mask"))})  # fmt: skip
    stacked = np.stack(pixels) if pixels else np.zeros((0, bh, bw, 3), np.uint8)  # (B * K, H, W, 3)
    conds = (np.stack(cond_pixels) if cond_pixels else np.zeros((0, bh, bw, 3), np.uint8)) if paired else None
    masks = (np.stack(mask_pixels) if mask_pixels else np.zeros((0, bh, bw), np.uint8)) if masked else None
    return {"bucket": bucket, "pixels": stacked, "cond_pixels": conds, "mask_pixels": masks, "rows": good,
            "errors": errors}  # fmt: skip


# ---------------------------------------------------------------- CPU stages (Ray Data tasks)
# every stage's rows carry ``throttled``, the spans of the stages that made them (manifests.throttles)


def plan_units(batch: pa.Table, manifest: str, storage_options: dict | None, batch_size: int,
               shard_records: int, max_clips: int = 1) -> Iterator[pa.Table]:
    """Ray Data ``map_batches`` (batch size 1): a row group's rows to embed -> one row per unit
    (``unit``, ``bucket``, ``rows``: :data:`UNIT_ROWS` as IPC bytes)."""
    for item in batch.to_pylist():
        before = throttle_mark()
        work = GroupWork.from_item(item)
        rows = read_row_group(manifest, work.group, MANIFEST_COLUMNS, storage_options).take(pa.array(work.rows))
        throttled = pa.array([carry_spans(None, before)], SPANS)
        inline = pa.array(work.inline, pa.bool_())
        caption = pc.if_else(inline, rows.column("caption").cast(pa.string()), pa.scalar(None, pa.string()))
        rows = pa.table({"text_inline": inline, "caption": caption,  # the text of an inline caption only
                         "sample_id": rows.column("sample_id"), "filename": rows.column("filename"),
                         "caption_key": caption_keys(rows.column("caption")),
                         "caption_keys": sample_caption_keys(rows), "source_key": source_key(rows),
                         "conditioning": rows.column("conditioning"),
                         **{name: rows.column(name) for name in (*_LOCATION, *MASK_COLUMNS, "bucket", "clips")}})
        for i, unit in enumerate(cut_units(rows, batch_size, shard_records, max_clips)):
            name = f"{work.group.part}#{work.group.index}.{i}"
            yield pa.table({"unit": [name], "bucket": [unit.column("bucket")[0].as_py()],
                            "rows": pa.array([to_ipc(unit.select(UNIT_ROWS.names).cast(UNIT_ROWS))], pa.binary()),
                            "throttled": throttled})


def prepare_unit(batch: pa.Table, source: str, storage_options: dict | None, crop: str, seed: int,
                 max_pixels: int, crops: int = 1, conditioning: str | None = None,
                 image_column: str | None = None, max_clips: int = MAX_CLIPS) -> pa.Table:
    """Ray Data ``map_batches`` (batch size 1): a unit -> its pixels (``uint8 (B * K, H, W, 3)`` bytes;
    ``cond_pixels`` the same for the conditioning images, empty without), the geometry of its good
    rows and its error rows (IPC bytes), via :func:`prepare_batch`."""
    out = []
    for item in batch.to_pylist():
        before = throttle_mark()
        rows = from_ipc(item["rows"]).to_pylist()
        keys = {r["sample_id"]: r["source_key"] for r in rows}
        prepared = prepare_batch(source, storage_options, item["bucket"], rows, crop, seed, max_pixels, crops=crops,
                                 conditioning=conditioning, image_column=image_column,
                                 max_clips=max_clips)  # fmt: skip
        good = pa.table({
            "sample_id": [r["sample_id"] for r in prepared["rows"]],
            "caption_key": [r["caption_key"] for r in prepared["rows"]],
            "caption_keys": [r["caption_keys"] for r in prepared["rows"]],
            "source_key": [r["source_key"] for r in prepared["rows"]],
            **{name: [r[key][i] for r in prepared["rows"]] for name, key, i in (
                ("original_h", "original_size", 0), ("original_w", "original_size", 1),
                ("resized_h", "resized_size", 0), ("resized_w", "resized_size", 1),
                ("crop_top", "crop_top_left", 0), ("crop_left", "crop_top_left", 1))},
            "crops": [r["crops"] for r in prepared["rows"]],
            "has_mask": [r["has_mask"] for r in prepared["rows"]],
            "text_inline": [r["text_inline"] for r in prepared["rows"]],
            "caption": [r["caption"] for r in prepared["rows"]],
            "clip_starts": [r.get("clip_starts") for r in prepared["rows"]],
        }, schema=_PREPARED_ROWS)  # fmt: skip
        errors = pa.Table.from_pylist([{"sample_id": sid, "filename": name, "error": kind, "message": message,
                                        "source_key": keys[sid]} for sid, name, kind, message in prepared["errors"]],
                                      schema=CACHE_ERRORS_SCHEMA)  # fmt: skip
        cond, masks = prepared["cond_pixels"], prepared["mask_pixels"]
        out.append({"unit": item["unit"], "bucket": item["bucket"], "pixels": prepared["pixels"].tobytes(),
                    "cond_pixels": b"" if cond is None else cond.tobytes(),
                    "mask_pixels": b"" if masks is None else masks.tobytes(), "rows": to_ipc(good),
                    "errors": to_ipc(errors), "throttled": carry_spans(item.get("throttled"), before)})  # fmt: skip
    return pa.Table.from_pylist(out, schema=pa.schema([("unit", pa.string()), ("bucket", pa.string()),
                                                      ("pixels", pa.large_binary()), ("cond_pixels", pa.large_binary()),
                                                      ("mask_pixels", pa.large_binary()), ("rows", pa.binary()),
                                                      ("errors", pa.binary()), ("throttled", SPANS)]))  # fmt: skip


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


# ---------------------------------------------------------------- encoder actors (Ray Data actor pools)


def describe_encoder(make_encoder: Callable[..., Encoder]) -> dict[str, Any]:
    """Ray task: build an encoder on the CPU and return its ``describe()`` (what the settings record)."""
    quiet_loading()
    return make_encoder(use_gpu=False).describe()


class _EncoderActor:
    """What both encoder actors share: the encoder (built on the first call from ``make_encoder``,
    a picklable ``(use_gpu=bool) -> Encoder``), the cache folder they write shards to, the lock
    that lets one call at a time use the device, and the worker description sent with results."""

    def __init__(self, make_encoder: Callable[..., Encoder], dtype: str, cache: str, storage_options: dict | None,
                 threads: int | None = None, device: str | None = None):
        self.make_encoder, self.dtype, self.threads = make_encoder, dtype, threads
        self.cache, self.storage_options = cache, storage_options
        self.device = device  # None: a Ray actor, on the GPUs Ray gave it; cuda | cpu: in this process, no Ray
        self.encoder: Encoder | None = None
        self.lock = threading.Lock()  # one forward pass at a time: compression and writes overlap it
        self.worker = ""

    def _load(self) -> Encoder:
        with self.lock:
            if self.encoder is None:
                self.encoder = self._build()
            return self.encoder

    def _where(self) -> tuple[list[str], str]:
        """The GPUs this worker may use and the node it runs on: Ray's, in a Ray actor; else this process's."""
        if self.device is not None:  # pipeline.embed.local: no Ray
            return (["0"] if self.device == "cuda" else []), socket.gethostname()
        import ray

        return [str(g) for g in ray.get_gpu_ids()], ray.get_runtime_context().get_node_id()

    def _build(self) -> Encoder:
        import torch

        gpus, node = self._where()
        notice = None
        if gpus and not torch.cuda.is_available():  # logical GPUs of a test cluster, or a CPU-only torch
            notice = (f"Ray gave this encoder worker GPU {','.join(gpus)} on {socket.gethostname()}, but torch "
                      f"{torch.__version__} sees no CUDA device: it runs on the CPU (install a CUDA build of torch "
                      "on the GPU nodes, or pass --device cpu)")  # fmt: skip
        if not gpus or notice:
            torch.set_num_threads(self.threads or max(1, (os.cpu_count() or 2) // 2))
        quiet_loading()
        try:
            encoder = self.make_encoder(use_gpu=bool(gpus))
        except (BucketeerError, OSError) as e:  # a bad path or subfolder, a file from_pretrained cannot get
            raise UsageError(f"an encoder failed to load: {e}") from None
        self.fs, self.root = open_url(self.cache, self.storage_options)
        if is_local(self.fs) and not os.path.exists(join(self.root, VISIBLE_MARKER)):
            raise UsageError(f"--out {self.root} is not visible on {socket.gethostname()}: embed workers write "
                             "their shards themselves, so --out must be a folder every node shares (or an "
                             "s3:// URL)")  # fmt: skip
        device = "cuda" if gpus and not notice else "cpu"
        self.use_gpu = bool(gpus)
        self.worker = json.dumps({"encoder": encoder.describe(), "host": socket.gethostname(), "gpus": gpus,
                                  "node": node, "device": device,
                                  "notice": notice}, sort_keys=True)  # fmt: skip
        return encoder

    def release(self) -> None:
        """Drop the encoders and give their device memory back (in-process runs: the next phase needs the GPU)."""
        self.encoder = None
        if getattr(self, "text_encoder", None) is not None:
            self.text_encoder = None
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _result(self, kind: str, shard: ShardWriter) -> tuple[bytes, int]:
        if not len(shard):
            return to_ipc(INDEX_SCHEMAS[kind].empty_table()), 0
        rows, size = shard.write(self.fs, self.root)
        faults.hit("embed.unit")  # tests: slow every unit down, or kill the worker after its shard is written
        return to_ipc(rows), size


class LatentWriter(_EncoderActor):
    """Ray Data actor (batch size 1): a prepared unit -> its shard of sample records, written here;
    returns ``unit``, ``samples`` and ``errors`` (index rows, IPC), ``shard_bytes``, ``worker``.

    Each image's variants (``crops`` crops, each also mirrored with ``flip``) and its conditioning
    image's same variants are encoded in the same forward passes (:func:`sample_record`). A row whose
    caption no other row has (``text_inline``) gets that caption encoded here, by the text encoders of
    ``make_text`` (built on the first such row), into its own record: the trainer then reads the sample
    with one request, and the caption's text row names that record."""

    def __init__(self, make_encoder: Callable[..., Encoder], dtype: str, cache: str, storage_options: dict | None,
                 batch_size: int, threads: int | None = None, crops: int = 1, flip: bool = False,
                 make_text: Callable[..., Encoder] | None = None, text_batch_size: int = 128,
                 device: str | None = None):
        super().__init__(make_encoder, dtype, cache, storage_options, threads, device)
        self.batch_size, self.crops, self.flips = batch_size, crops, 2 if flip else 1
        self.make_text, self.text_batch_size = make_text, text_batch_size
        self.text_encoder: Encoder | None = None

    def _texts(self, rows: list[dict]) -> dict[int, TextRecord]:
        """The text records of the inline captions of ``rows``, by caption key (encoded here)."""
        wanted = [(r["caption_key"], r["caption"]) for r in rows if r.get("text_inline")]
        if not wanted:
            return {}
        assert self.make_text is not None, "inline captions need the text encoders"
        out: dict[int, TextRecord] = {}
        for start in range(0, len(wanted), self.text_batch_size):
            batch = wanted[start : start + self.text_batch_size]
            with self.lock:
                if self.text_encoder is None:
                    self.text_encoder = self.make_text(use_gpu=self.use_gpu)
                encoded = self.text_encoder.encode([c for _, c in batch])
                for (key, _), (tokens, pooled) in zip(batch, encoded):
                    out[key] = TextRecord(caption_key=key, tokens=tuple(to_storage(t, self.dtype) for t in tokens),
                                          pooled=None if pooled is None else to_storage(pooled, self.dtype),
                                          dtype=self.dtype)  # fmt: skip
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        encoder = self._load()
        out = []
        for item in batch.to_pylist():
            before = throttle_mark()
            rows = from_ipc(item["rows"])
            shard = ShardWriter("samples", max_records=rows.num_rows + 1, max_bytes=1 << 62)
            meta = rows.to_pylist()
            texts = self._texts(meta)
            if is_video_bucket(item["bucket"]):  # WxHxF: pipeline.embed.clips
                records = clip_records(item, meta, self._encode_clips(encoder), self.flips, self.batch_size, self.dtype)
            else:
                records = self._image_records(encoder, item, meta)
            for r, record in records:
                inline = bool(r.get("text_inline"))
                if inline:
                    record = replace(record, text=texts[r["caption_key"]])
                shard.append(encode_sample(record, inline_text=inline), sample_id=r["sample_id"],
                             caption_key=r["caption_key"], caption_keys=r["caption_keys"], bucket=item["bucket"],
                             source_key=r["source_key"], text_inline=inline)  # fmt: skip
            samples, size = self._result("samples", shard)
            out.append({"unit": item["unit"], "samples": samples, "errors": item["errors"], "shard_bytes": size,
                        "worker": self.worker, "throttled": carry_spans(item.get("throttled"), before)})  # fmt: skip
        return pa.Table.from_pylist(out, schema=pa.schema([("unit", pa.string()), ("samples", pa.binary()),
                                                          ("errors", pa.binary()), ("shard_bytes", pa.int64()),
                                                          ("worker", pa.string()),
                                                          ("throttled", SPANS)]))  # fmt: skip

    def _encode_clips(self, encoder: Encoder) -> Callable[[np.ndarray], np.ndarray]:
        """Clips ``(b, F, H, W, 3)`` -> their latents in the storage dtype, one forward pass at a time."""
        def encode(clips: np.ndarray) -> np.ndarray:
            with self.lock:
                return to_storage(encoder.encode(clips)["latent"], self.dtype)  # (b, C, F', h, w)
        return encode

    def _image_records(self, encoder: Encoder, item: dict, meta: list[dict]) -> Iterator[tuple[dict, Any]]:
        """``(row, SampleRecord)`` of each good row of an image unit, ``batch_size`` images a forward pass."""
        k, f, n_rows = self.crops, self.flips, len(meta)
        bw, bh = parse_bucket(item["bucket"])
        pixels = np.frombuffer(item["pixels"], np.uint8).reshape(n_rows, k, bh, bw, 3)  # (B, K, H, W, 3)
        conds = (np.frombuffer(item["cond_pixels"], np.uint8).reshape(n_rows, k, bh, bw, 3)
                 if item.get("cond_pixels") else None)  # fmt: skip
        masks = np.frombuffer(item["mask_pixels"], np.uint8).reshape(n_rows, k, bh, bw) \
            if item.get("mask_pixels") else None  # (B, K, H, W)  # fmt: skip
        for start in range(0, n_rows, self.batch_size):
            views = variant_pixels(pixels[start : start + self.batch_size], f)  # (b * V, H, W, 3)
            n = len(views)
            if conds is not None:
                views = np.concatenate([views, variant_pixels(conds[start : start + self.batch_size], f)])
            with self.lock:
                encoded = encoder.encode(views, features_of=n)  # --features: of the n image variants
                latents = to_storage(encoded["latent"], self.dtype)  # (b * V [* 2 with conditioning], C, h, w)
                # --latents posterior: the std too (b, C, h, w), to sample a latent per training step
                stds = to_storage(encoded["latent_std"], self.dtype) if "latent_std" in encoded else None
                feats = to_storage(encoded["features"], "F16") if "features" in encoded else None  # (b * V, ...)
            v = k * f
            grid = None if masks is None else variant_masks(masks[start : start + self.batch_size], f,
                                                            latents.shape[-2:])  # (b * V, h, w)  # fmt: skip
            for j, r in enumerate(meta[start : start + self.batch_size]):
                yield r, sample_record(
                    r, item["bucket"], self.dtype, latents[j * v : (j + 1) * v],
                    None if conds is None else latents[n + j * v : n + (j + 1) * v],
                    None if stds is None else stds[j * v], f,
                    grid[j * v : (j + 1) * v] if grid is not None and r.get("has_mask") else None,
                    features=None if feats is None else feats[j * v : (j + 1) * v])  # fmt: skip


class TextWriter(_EncoderActor):
    """Ray Data actor (batch size ``--text-batch-size``): captions -> one shard of text records,
    written here; returns ``texts`` (index rows, IPC), ``shard_bytes``, ``worker``."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        before = throttle_mark()
        encoder = self._load()
        keys = batch.column("caption_key").to_pylist()
        with self.lock:
            encoded = encoder.encode(batch.column("caption").to_pylist())
            tensors = [(tuple(to_storage(t, self.dtype) for t in tokens),
                        None if pooled is None else to_storage(pooled, self.dtype)) for tokens, pooled in encoded]
        shard = ShardWriter("texts", max_records=len(keys) + 1, max_bytes=1 << 62)
        for key, (tokens, pooled) in zip(keys, tensors):
            shard.append(encode_text(TextRecord(caption_key=key, tokens=tokens, pooled=pooled, dtype=self.dtype)),
                         caption_key=key)  # fmt: skip
        texts, size = self._result("texts", shard)
        carried = [span for spans in batch.column("throttled").to_pylist() for span in spans] \
            if "throttled" in batch.column_names else []  # fmt: skip
        return pa.table({"texts": pa.array([texts], pa.binary()), "shard_bytes": [size], "worker": [self.worker],
                         "throttled": pa.array([carry_spans(carried, before)], SPANS)})  # fmt: skip
