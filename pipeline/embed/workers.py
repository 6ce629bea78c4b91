"""The embed job's Ray work: image preparation tasks, the VAE actor and the text-encoder actor.

``prepare_batch`` (a CPU task) fetches one batch's images concurrently, decodes and crops them to
the batch's bucket, so the pixels stack into one ``(B, H, W, 3)`` array. ``LatentWorker`` (one
per GPU, or one CPU actor) turns a prepared batch into compressed sample records; it runs two
calls at once so that the gzip of one batch overlaps the forward pass of the next.
``TextWorker`` encodes unique captions into compressed text records. ``check_source`` (on the
driver, before any model loads) refuses a dataset whose storage cannot be read at all.

An actor whose encoder fails to load keeps the exception and raises it from its first call,
``describe()``: Ray keeps only the formatted text of an exception raised in ``__init__`` (an
``ActorDiedError``), while one raised by a method reaches the driver as itself (``.cause``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from manifests.buckets import parse_bucket
from manifests.cache.records import SampleRecord, TextRecord, encode_sample, encode_text
from manifests.errors import StorageError
from manifests.retry import is_transient
from manifests.storage import open_url, redact
from pipeline.embed.encoders import Encoder, EncoderSource, LatentEncoder, TextEncoders, quiet_loading, to_storage
from pipeline.embed.imaging import ImageFailure, fetch_images, prepare_image

__all__ = ["prepare_batch", "check_source", "LatentWorker", "TextWorker"]


def _open_source(source: str, storage_options: dict | None, fs=None):
    """``(fs, root)`` of the dataset; a given ``fs`` (tests, benchmarks) takes ``source`` as its path."""
    if fs is not None:
        return fs, fs._strip_protocol(source).rstrip("/")
    return open_url(source, storage_options)


def _read_failure(exc: BaseException, storage_options: dict | None) -> ImageFailure:
    # a transient error here has outlived every retry; a permanent one was never retried
    note = " (still failing after retries)" if is_transient(exc) else ""
    return ImageFailure("read_failed", redact(f"{type(exc).__name__}: {exc}{note}", storage_options))


def prepare_batch(
    source: str,
    storage_options: dict | None,
    bucket: str,
    rows: list[dict[str, Any]],
    crop: str,
    seed: int,
    max_pixels: int,
    fs=None,
) -> dict[str, Any]:
    """Fetch, decode and crop ``rows`` (``sample_id``, ``filename``, ``caption_key``, and where the
    image lies: :data:`manifests.schema.LOCATION_COLUMNS`) to ``bucket``.

    Returns ``{"bucket", "pixels": uint8 (B, H, W, 3), "rows": [geometry per good row],
    "errors": [(sample_id, filename, kind, message)]}``; one bad image never fails the batch.
    Transient storage errors are retried per file (:func:`pipeline.embed.imaging.fetch_images`); a read
    that still fails is a ``read_failed`` error row (credentials redacted), which the next run
    retries. ``fs`` replaces the filesystem of ``source`` (it must be picklable for Ray).
    """
    fs, root = _open_source(source, storage_options, fs)
    bw, bh = parse_bucket(bucket)
    blobs = fetch_images(fs, root, rows)
    good, pixels, errors = [], [], []
    for row, blob in zip(rows, blobs):
        try:
            if isinstance(blob, BaseException):
                raise _read_failure(blob, storage_options)
            p = prepare_image(blob, (bh, bw), crop=crop, seed=seed, sample_id=row["sample_id"], max_pixels=max_pixels)
        except ImageFailure as e:
            errors.append((row["sample_id"], row["filename"], e.kind, e.message))
            continue
        except Exception as e:  # a decoder bug on one file must not kill the job: record it
            message = redact(f"{type(e).__name__}: {e}", storage_options)
            errors.append((row["sample_id"], row["filename"], "decode_failed", message))
            continue
        pixels.append(p.pixels)
        good.append({**row, "original_size": p.original_size, "resized_size": p.resized_size,
                     "crop_top_left": p.crop_top_left})  # fmt: skip
    stacked = np.stack(pixels) if pixels else np.zeros((0, bh, bw, 3), np.uint8)  # (B, H, W, 3)
    return {"bucket": bucket, "pixels": stacked, "rows": good, "errors": errors}


def check_source(source: str, storage_options: dict | None, rows: list[dict], fs=None) -> None:
    """Refuse a dataset whose storage is unusable: raise StorageError when every one of the images
    of ``rows`` (a few manifest rows spread over the job, read with the usual retries) fails to read.

    One unreadable file is that file's error row; all of them failing means the bucket is gone,
    access is denied or the endpoint is down, and a job would only write an error row per
    sample. The message quotes the first failure (credentials redacted) and names the file.
    """
    if not rows:
        return
    fs, root = _open_source(source, storage_options, fs)
    blobs = fetch_images(fs, root, rows)
    failures = [(r["filename"], b) for r, b in zip(rows, blobs) if isinstance(b, BaseException)]
    if len(failures) < len(rows):
        return
    name, first = failures[0]
    raise StorageError(redact(
        f"cannot read the images of {source}: all {len(rows)} probed files failed, e.g. {name}: "
        f"{type(first).__name__}: {first}. Nothing was embedded; check that the dataset is still there "
        "(--source if it moved) and the credentials/--storage-options allow reading it.", storage_options))


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


class LatentWorker:
    """Holds the VAE; ``encode(prepared)`` -> ``{"records": [(sample_id, bytes, caption_key, bucket)], "errors"}``."""

    def __init__(self, vae: EncoderSource, use_gpu: bool, dtype: str, threads: int | None = None):
        _set_threads(threads)
        quiet_loading()
        self.dtype = dtype
        self.load_error: Exception | None = None
        try:
            self.encoder: Encoder[np.ndarray] = LatentEncoder(vae, use_gpu=use_gpu, dtype=dtype)
        except Exception as e:  # raised by describe(), see the module docstring
            self.load_error = e

    def describe(self) -> dict[str, Any]:
        if self.load_error is not None:
            raise self.load_error
        return self.encoder.describe()

    def encode(self, prepared: dict[str, Any]) -> dict[str, Any]:
        records = []
        if prepared["rows"]:
            latents = to_storage(self.encoder.encode(prepared["pixels"]), self.dtype)  # (B, C, h, w)
            bw, bh = parse_bucket(prepared["bucket"])
            for row, latent in zip(prepared["rows"], latents):
                record = SampleRecord(
                    sample_id=row["sample_id"], bucket=prepared["bucket"], latent=latent, dtype=self.dtype,
                    original_size=row["original_size"], resized_size=row["resized_size"],
                    crop_top_left=row["crop_top_left"], target_size=(bh, bw), caption_key=row["caption_key"],
                )  # fmt: skip
                records.append((row["sample_id"], encode_sample(record), row["caption_key"], prepared["bucket"]))
        return {"records": records, "errors": prepared["errors"]}


class TextWorker:
    """Holds the text encoders; ``encode([(caption_key, caption)])`` -> ``[(caption_key, bytes)]``."""

    def __init__(self, sources: list[EncoderSource], use_gpu: bool, dtype: str, layer: str, threads: int | None = None):
        _set_threads(threads)
        quiet_loading()
        self.dtype = dtype
        self.load_error: Exception | None = None
        try:
            self.encoders: Encoder[list[str]] = TextEncoders(sources, use_gpu=use_gpu, dtype=dtype, layer=layer)
        except Exception as e:  # raised by describe(), see the module docstring
            self.load_error = e

    def describe(self) -> dict[str, Any]:
        if self.load_error is not None:
            raise self.load_error
        return self.encoders.describe()

    def encode(self, items: list[tuple[int, str]]) -> list[tuple[int, bytes]]:
        out = []
        for (key, _), (tokens, pooled) in zip(items, self.encoders.encode([c for _, c in items])):
            record = TextRecord(
                caption_key=key,
                tokens=tuple(to_storage(t, self.dtype) for t in tokens),
                pooled=None if pooled is None else to_storage(pooled, self.dtype),
                dtype=self.dtype,
            )
            out.append((key, encode_text(record)))
        return out
