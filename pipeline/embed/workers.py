"""The embed job's Ray work: the stages of its Ray Data pipelines, each a function or actor class.

Images (one unit = rows of one bucket that become one shard):

- :func:`plan_units` (CPU task, one per manifest row group) reads the row group's rows that the
  driver marked for embedding and cuts them into units (:func:`pipeline.embed.work.cut_units`);
- :func:`~pipeline.embed.prepare.prepare_unit` (CPU task, one per unit) fetches the unit's images concurrently,
  decodes and crops them to the unit's bucket (:mod:`pipeline.embed.prepare`), so the pixels stack into one
  ``(B, H, W, 3)`` array;
- :class:`LatentWriter` (an encoder actor, on a GPU or a CPU) runs the VAE over the unit in
  batches, compresses the records, **writes the unit's shard itself** and returns only its index
  rows. Two calls run at once: one compresses and writes while the other has the encoder.

Captions: :func:`~pipeline.embed.work.read_captions` (CPU task per row group) reads the first row of each caption
the driver found new; :class:`TextWriter` (encoder actor) encodes a batch of them into one text shard.

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
from itertools import chain
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests import faults
from manifests.buckets import parse_bucket
from manifests.cache import ShardWriter
from manifests.cache.layout import INDEX_SCHEMAS
from manifests.cache.freshness import source_key
from manifests.cache.identity import record_latent_key
from manifests.cache.records import TextRecord, encode_sample, encode_text
from manifests.errors import BucketeerError, UsageError
from manifests.frames import is_video_bucket
from manifests.manifest import read_row_group
from manifests.throttles import SPANS, carry_spans, throttle_mark
from manifests.schema import MASK_COLUMNS
from manifests.storage import is_local, join, open_url
from pipeline.embed.clips import clip_records
from pipeline.embed.loading import Encoder, quiet_loading, to_storage
from pipeline.embed.families import qwen_image_edit
from pipeline.embed.imaging import check_source
from pipeline.embed.masks import variant_masks
from pipeline.embed.reuse import ReuseTable, check_text_weights, retarget
from pipeline.embed.samples import sample_record, variant_pixels
from pipeline.embed.work import MANIFEST_COLUMNS, GroupWork, caption_keys, cut_units, sample_caption_keys

__all__ = ["check_source", "describe_encoder", "plan_units", "LatentWriter", "TextWriter", "to_ipc", "from_ipc",
           "UNIT_ROWS", "VISIBLE_MARKER"]  # fmt: skip

# the rows of a unit, as plan_units hands them to prepare_unit (conditioning: relative to its root)
UNIT_ROWS = pa.schema([("sample_id", pa.uint64()), ("filename", pa.string()), ("caption_key", pa.uint64()),
                       ("caption_keys", pa.list_(pa.uint64())),  # every caption's key when it has several
                       ("source_key", pa.uint64()),
                       # where the image bytes are (manifests.schema.image_range): null container = a loose file
                       ("container", pa.string()), ("container_size", pa.int64()), ("member_offset", pa.int64()),
                       ("row_group", pa.int32()), ("row_index", pa.int64()), ("size", pa.int64()),
                       ("conditioning", pa.string()), ("width", pa.int32()), ("height", pa.int32()),  # display size
                       # "alpha", a mask file relative to the source root (a tar member: its byte range), or null
                       ("mask", pa.string()), ("mask_offset", pa.int64()), ("mask_size", pa.int64()),
                       # the caption no other row has: its text goes into the sample's record (caption: its text)
                       ("text_inline", pa.bool_()), ("caption", pa.string()),
                       ("clips", pa.int32()),  # a video's clips (manifests.frames), null for an image
                       ("clip_starts", pa.list_(pa.int32())),  # clips cut at scene changes, else null
                       ("clip_captions", pa.list_(pa.int32()))])  # each clip's shot's caption, else null  # fmt: skip
_LOCATION = ("container", "container_size", "member_offset", "row_group", "row_index", "size")
VISIBLE_MARKER = "_embed-running"  # written by the driver into a local --out; every worker must see it


def to_ipc(table: pa.Table) -> bytes:
    """A table as Arrow IPC stream bytes (how small tables travel inside a Ray Data row; no pickle)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


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
                         **{name: rows.column(name) for name in (*_LOCATION, *MASK_COLUMNS, "bucket", "clips",
                                                                   "clip_starts", "clip_captions", "width",
                                                                   "height")}})
        for i, unit in enumerate(cut_units(rows, batch_size, shard_records, max_clips)):
            name = f"{work.group.part}#{work.group.index}.{i}"
            yield pa.table({"unit": [name], "bucket": [unit.column("bucket")[0].as_py()],
                            "rows": pa.array([to_ipc(unit.select(UNIT_ROWS.names).cast(UNIT_ROWS))], pa.binary()),
                            "throttled": throttled})


# ---------------------------------------------------------------- encoder actors (Ray Data actor pools)


def _described(make_encoder: Callable[..., Encoder]) -> dict[str, Any]:
    quiet_loading()
    return make_encoder(use_gpu=False).describe()


def describe_encoder(make_encoder: Callable[..., Encoder], ray: Any = None) -> dict[str, Any]:
    """An encoder built on the CPU, its ``describe()`` (what the settings record): in a Ray task (``ray``: the
    module), or in this process (None: ``--executor local``). A bad path fails here, as a one-line UsageError."""
    try:
        if ray is None:
            return _described(make_encoder)
        return ray.get(ray.remote(_described).options(num_cpus=1).remote(make_encoder))
    except Exception as e:
        cause = getattr(e, "cause", e)  # a Ray task's error carries the worker's exception
        if isinstance(cause, (BucketeerError, OSError)):
            raise UsageError(f"an encoder failed to load: {cause}") from None
        raise


class _EncoderActor:
    """What both encoder actors share: the encoder (built on the first call from ``make_encoder``,
    a picklable ``(use_gpu=bool) -> Encoder``), the cache folder they write shards to, the lock
    that lets one call at a time use the device, and the worker description sent with results."""

    def __init__(self, make_encoder: Callable[..., Encoder], dtype: str, cache: str, storage_options: dict | None,
                 threads: int | None = None, device: str | None = None, compact: str | None = None):
        self.make_encoder, self.dtype, self.threads = make_encoder, dtype, threads
        # --text-dtype fp8: text kept in float32 until encode_text quantizes it once (manifests.cache.compact)
        self.compact, self.text_dtype = compact, "F32" if compact else dtype
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
        self._open_out()
        device = "cuda" if gpus and not notice else "cpu"
        self.use_gpu = bool(gpus)
        self.worker = json.dumps({"encoder": encoder.describe(), "host": socket.gethostname(), "gpus": gpus,
                                  "node": node, "device": device,
                                  "notice": notice}, sort_keys=True)  # fmt: skip
        return encoder

    def _text_record(self, key: int, tokens: tuple, pooled: Any) -> TextRecord:
        return TextRecord(caption_key=key, tokens=tuple(to_storage(t, self.text_dtype) for t in tokens),
                          pooled=None if pooled is None else to_storage(pooled, self.text_dtype), dtype=self.text_dtype)

    def _open_out(self) -> None:
        """The cache folder this worker writes its shards to; a local one must be the driver's (its marker seen)."""
        self.fs, self.root = open_url(self.cache, self.storage_options)
        if is_local(self.fs) and not os.path.exists(join(self.root, VISIBLE_MARKER)):
            raise UsageError(f"--out {self.root} is not visible on {socket.gethostname()}: embed workers write "
                             "their shards themselves, so --out must be a folder every node shares (or an "
                             "s3:// URL)")  # fmt: skip

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
    with one request, and the caption's text row names that record.

    ``reference`` (an area in pixels: a ``reference`` family, Qwen-Image-Edit): every row's text is a function of
    its caption and its reference (the conditioning crop as the family resized it); the text encoders are built
    with the VAE (the worker's description carries theirs, ``text``), the reference latents are encoded apart (their
    grid is the reference's), and each row's text is keyed by
    :func:`~pipeline.embed.families.qwen_image_edit.reference_key` (its record's and index row's ``caption_key``)."""

    def __init__(self, make_encoder: Callable[..., Encoder], dtype: str, cache: str, storage_options: dict | None,
                 batch_size: int, threads: int | None = None, crops: int = 1, flip: bool = False,
                 make_text: Callable[..., Encoder] | None = None, text_batch_size: int = 128,
                 device: str | None = None, reference: int | None = None, reuse: ReuseTable | None = None,
                 compact: str | None = None):
        super().__init__(make_encoder, dtype, cache, storage_options, threads, device, compact)
        self.batch_size, self.crops, self.flips = batch_size, crops, 2 if flip else 1
        self.make_text, self.text_batch_size = make_text, text_batch_size
        self.text_encoder: Encoder | None = None
        self.reference = reference
        self.reuse = reuse or ReuseTable()  # embed --reuse: other caches' text records, for inline captions

    def _build(self) -> Encoder:
        encoder = super()._build()
        if self.reference:  # every row needs the text encoders: built now, and described with the VAE
            assert self.make_text is not None, "a reference family's text is encoded by the image workers"
            self.text_encoder = self.make_text(use_gpu=self.use_gpu)
            self.worker = json.dumps({**json.loads(self.worker), "text": self.text_encoder.describe()}, sort_keys=True)
        return encoder

    def _reference_texts(self, rows: list[dict], refs: np.ndarray) -> dict[int, TextRecord]:
        """Each row's text, encoded with its reference ``refs[i]`` ``(h, w, 3)``, by its key; sets the rows'
        ``caption_key`` to that key."""
        out: dict[int, TextRecord] = {}
        for start in range(0, len(rows), self.text_batch_size):
            batch, images = rows[start : start + self.text_batch_size], refs[start : start + self.text_batch_size]
            captions = [r["caption"] or "" for r in batch]  # a null caption: the empty instruction
            with self.lock:
                encoded = self.text_encoder.encode(captions, images=list(images))
                for r, caption, image, (tokens, pooled) in zip(batch, captions, images, encoded):
                    r["caption_key"] = qwen_image_edit.reference_key(caption, image)
                    out[r["caption_key"]] = self._text_record(r["caption_key"], tokens, pooled)
        return out

    def _texts(self, rows: list[dict]) -> tuple[dict[int, TextRecord], int]:
        """The text records of the inline captions of ``rows``, by caption key: taken from a ``--reuse`` cache that
        holds them, the others encoded here; and how many were taken."""
        wanted = [(r["caption_key"], r["caption"]) for r in rows if r.get("text_inline")]
        if not wanted:
            return {}, 0
        out: dict[int, TextRecord] = self.reuse.take_texts([k for k, _ in wanted]) if self.reuse.texts else {}
        taken = len(out)
        wanted = [(k, c) for k, c in wanted if k not in out]  # the rest: encoded here
        if not wanted:
            return out, taken
        assert self.make_text is not None, "inline captions need the text encoders"
        for start in range(0, len(wanted), self.text_batch_size):
            batch = wanted[start : start + self.text_batch_size]
            with self.lock:
                if self.text_encoder is None:
                    self.text_encoder = self.make_text(use_gpu=self.use_gpu)
                    if self.reuse.texts:  # text taken from another cache and text encoded here: the same encoders
                        check_text_weights(self.reuse.text_described, self.text_encoder.describe())
                encoded = self.text_encoder.encode([c for _, c in batch])
                for (key, _), (tokens, pooled) in zip(batch, encoded):
                    out[key] = self._text_record(key, tokens, pooled)
        return out, taken

    def __call__(self, batch: pa.Table) -> pa.Table:
        encoder = self._load()
        out = []
        for item in batch.to_pylist():
            before = throttle_mark()
            rows = from_ipc(item["rows"])
            taken = from_ipc(item["taken"]).to_pylist() if item.get("taken") else []  # embed --reuse: records to copy
            shard = ShardWriter("samples", max_records=rows.num_rows + len(taken) + 1, max_bytes=1 << 62)
            meta = rows.to_pylist()
            texts_taken = 0
            if self.reference:  # the text of (caption, reference): every row's, keyed by both
                texts = self._reference_texts(meta, self._conditioning(item, len(meta))[:, 0])
            else:
                texts, texts_taken = self._texts(meta + taken)
            if is_video_bucket(item["bucket"]):  # WxHxF: pipeline.embed.clips
                records = clip_records(item, meta, self._encode_clips(encoder), self.flips, self.batch_size, self.dtype)
            else:
                records = self._image_records(encoder, item, meta)
            for r, record in chain(records, ((t, retarget(t["record"], t)) for t in taken)):
                inline = bool(r.get("text_inline"))
                if inline:
                    record = replace(record, text=texts[r["caption_key"]])
                shard.append(encode_sample(record, inline_text=inline, compact=self.compact), sample_id=r["sample_id"],
                             caption_key=r["caption_key"], caption_keys=r["caption_keys"], bucket=item["bucket"],
                             source_key=r["source_key"], text_inline=inline,
                             latent_key=record_latent_key(record))  # fmt: skip
            samples, size = self._result("samples", shard)
            out.append({"unit": item["unit"], "samples": samples, "errors": item["errors"], "shard_bytes": size,
                        "worker": self.worker, "throttled": carry_spans(item.get("throttled"), before),
                        "taken": len(taken), "refused": int(item.get("refused") or 0),
                        "texts_taken": texts_taken})  # fmt: skip
        return pa.Table.from_pylist(out, schema=pa.schema([("unit", pa.string()), ("samples", pa.binary()),
                                                          ("errors", pa.binary()), ("shard_bytes", pa.int64()),
                                                          ("worker", pa.string()), ("throttled", SPANS),
                                                          ("taken", pa.int64()), ("refused", pa.int64()),
                                                          ("texts_taken", pa.int64())]))  # fmt: skip

    def _encode_clips(self, encoder: Encoder) -> Callable[[np.ndarray], np.ndarray]:
        """Clips ``(b, F, H, W, 3)`` -> their latents in the storage dtype, one forward pass at a time."""
        def encode(clips: np.ndarray) -> np.ndarray:
            with self.lock:
                return to_storage(encoder.encode(clips)["latent"], self.dtype)  # (b, C, F', h, w)
        return encode

    def _conditioning(self, item: dict, n_rows: int) -> np.ndarray | None:
        """A unit's conditioning pixels ``(B, K, H, W, 3)``: the bucket's size, or the reference's
        (``reference``); None without."""
        if not item.get("cond_pixels"):
            return None
        bw, bh = parse_bucket(item["bucket"])
        h, w = qwen_image_edit.reference_size(bh, bw, self.reference) if self.reference else (bh, bw)
        return np.frombuffer(item["cond_pixels"], np.uint8).reshape(n_rows, self.crops, h, w, 3)

    def _image_records(self, encoder: Encoder, item: dict, meta: list[dict]) -> Iterator[tuple[dict, Any]]:
        """``(row, SampleRecord)`` of each good row of an image unit, ``batch_size`` images a forward pass."""
        k, f, n_rows = self.crops, self.flips, len(meta)
        bw, bh = parse_bucket(item["bucket"])
        pixels = np.frombuffer(item["pixels"], np.uint8).reshape(n_rows, k, bh, bw, 3)  # (B, K, H, W, 3)
        conds = self._conditioning(item, n_rows)  # (B, K, H, W, 3), a reference's (B, K, h', w', 3)
        masks = np.frombuffer(item["mask_pixels"], np.uint8).reshape(n_rows, k, bh, bw) \
            if item.get("mask_pixels") else None  # (B, K, H, W)  # fmt: skip
        for start in range(0, n_rows, self.batch_size):
            views = variant_pixels(pixels[start : start + self.batch_size], f)  # (b * V, H, W, 3)
            n = len(views)
            if conds is not None and not self.reference:
                views = np.concatenate([views, variant_pixels(conds[start : start + self.batch_size], f)])
            with self.lock:
                encoded = encoder.encode(views, features_of=n)  # --features: of the n image variants
                latents = to_storage(encoded["latent"], self.dtype)  # (b * V [* 2 with conditioning], C, h, w)
                if conds is not None and self.reference:  # (b * V, C, h', w'): the reference's own grid, one
                    # image a forward pass as the pipeline's _encode_vae_image (bit for bit: no batch composition)
                    refs = np.concatenate([to_storage(encoder.encode(x[None])["latent"], self.dtype)
                                           for x in variant_pixels(conds[start : start + self.batch_size], f)])
                # --latents posterior: the std too (b, C, h, w), to sample a latent per training step
                stds = to_storage(encoded["latent_std"], self.dtype) if "latent_std" in encoded else None
                feats = to_storage(encoded["features"], "F16") if "features" in encoded else None  # (b * V, ...)
            v = k * f
            grid = None if masks is None else variant_masks(masks[start : start + self.batch_size], f,
                                                            latents.shape[-2:])  # (b * V, h, w)  # fmt: skip
            for j, r in enumerate(meta[start : start + self.batch_size]):
                cond = None if conds is None else (refs[j * v : (j + 1) * v] if self.reference else
                                                   latents[n + j * v : n + (j + 1) * v])  # fmt: skip
                yield r, sample_record(
                    r, item["bucket"], self.dtype, latents[j * v : (j + 1) * v], cond,
                    None if stds is None else stds[j * v], f,
                    grid[j * v : (j + 1) * v] if grid is not None and r.get("has_mask") else None,
                    features=None if feats is None else feats[j * v : (j + 1) * v])  # fmt: skip


class TextWriter(_EncoderActor):
    """Ray Data actor (batch size ``--text-batch-size``): captions -> one shard of text records, written here; returns
    ``texts`` (index rows, IPC), ``shard_bytes``, ``worker``, ``taken``. ``reuse`` (``embed --reuse``): captions another
    cache holds are copied from it, checked (:meth:`~pipeline.embed.reuse.ReuseTable.take_texts`); the text encoders
    load for the first caption left to encode (until then ``worker`` describes those the taken records came from)."""

    def __init__(self, make_encoder: Callable[..., Encoder], dtype: str, cache: str, storage_options: dict | None,
                 threads: int | None = None, device: str | None = None, reuse: ReuseTable | None = None,
                 compact: str | None = None):
        super().__init__(make_encoder, dtype, cache, storage_options, threads, device, compact)
        self.reuse, self.reused_worker = reuse or ReuseTable(), ""

    def _build(self) -> Encoder:
        encoder = super()._build()
        if self.reuse.texts:  # text taken from another cache and text encoded here: the same encoders, checked once
            check_text_weights(self.reuse.text_described, encoder.describe())
        return encoder

    def _reused_worker(self) -> str:  # an actor that has loaded nothing: every caption so far was taken
        if self.reused_worker:
            return self.reused_worker
        gpus, node = self._where()
        self._open_out()
        self.reused_worker = json.dumps({"encoder": self.reuse.text_described, "host": socket.gethostname(),
                                         "gpus": gpus, "node": node, "device": "cuda" if gpus else "cpu",
                                         "notice": None, "reused": True}, sort_keys=True)  # fmt: skip
        return self.reused_worker

    def __call__(self, batch: pa.Table) -> pa.Table:
        before = throttle_mark()
        keys = batch.column("caption_key").to_pylist()
        records = self.reuse.take_texts(keys) if self.reuse.texts else {}
        taken = len(records)
        todo = [i for i, key in enumerate(keys) if key not in records]
        if todo:
            encoder = self._load()
            captions = batch.column("caption").to_pylist()
            with self.lock:
                encoded = encoder.encode([captions[i] for i in todo])
                for i, (tokens, pooled) in zip(todo, encoded):
                    records[keys[i]] = self._text_record(keys[i], tokens, pooled)
        worker = self.worker or self._reused_worker()
        shard = ShardWriter("texts", max_records=len(keys) + 1, max_bytes=1 << 62)
        for key in keys:
            shard.append(encode_text(records[key], compact=self.compact), caption_key=key)
        texts, size = self._result("texts", shard)
        carried = [span for spans in batch.column("throttled").to_pylist() for span in spans] \
            if "throttled" in batch.column_names else []  # fmt: skip
        return pa.table({"texts": pa.array([texts], pa.binary()), "shard_bytes": [size], "worker": [worker],
                         "throttled": pa.array([carry_spans(carried, before)], SPANS), "taken": [taken]})  # fmt: skip
