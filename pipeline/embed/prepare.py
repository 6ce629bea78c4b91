"""The embed job's CPU stage: a unit's rows -> its images fetched, decoded and cropped (:func:`prepare_unit`).

:func:`prepare_batch` is the work of one unit as a plain function (the tests call it directly): every image
fetched concurrently, decoded (display orientation, up to the manifest's ``max_pixels``) and cropped to the
unit's bucket, its conditioning image and loss mask cut like it; a video bucket's clips are
:func:`pipeline.embed.clips.prepare_clips`'. :func:`prepare_unit` is the Ray Data task around it
(:mod:`pipeline.embed.workers` has the stages before and after).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from manifests.buckets import parse_bucket
from manifests.cache import CACHE_ERRORS_SCHEMA
from manifests.frames import is_video_bucket
from manifests.storage import join, open_url, read_many, redact
from manifests.throttles import SPANS, carry_spans, throttle_mark
from pipeline.embed.clips import MAX_CLIPS, prepare_clips
from pipeline.embed.families import qwen_image_edit
from pipeline.embed.imaging import ImageFailure, conditioning_views, fetch_images, open_source, prepare_views, \
    read_failure
from pipeline.embed.masks import fetch_masks, row_mask
from pipeline.embed.reuse import ReuseTable, take_latents
from pipeline.embed.workers import from_ipc, to_ipc

__all__ = ["prepare_batch", "prepare_unit"]

# the good rows of a prepared unit, in the order of its pixels
_PREPARED_ROWS = pa.schema([("sample_id", pa.uint64()), ("caption_key", pa.uint64()),
                            ("caption_keys", pa.list_(pa.uint64())), ("source_key", pa.uint64()),
                            *((name, pa.int32()) for name in ("original_h", "original_w", "resized_h", "resized_w",
                                                              "crop_top", "crop_left")),
                            ("crops", pa.list_(pa.int32())),  # every crop's (top, left), flat
                            ("has_mask", pa.bool_()),  # its mask is in the unit's mask_pixels (else all 255 there)
                            ("text_inline", pa.bool_()), ("caption", pa.string()),
                            ("clip_starts", pa.list_(pa.int32())),  # video: its clips' first frames
                            ("clip_captions", pa.list_(pa.int32())),  # their captions (shots captioned)
                            ("content", pa.string())])  # sha256 of the image's bytes (null: a video's)  # fmt: skip
# the rows of a prepared unit that take another cache's record (embed --reuse) instead of pixels
_TAKEN_ROWS = pa.schema([("sample_id", pa.uint64()), ("caption_key", pa.uint64()),
                         ("caption_keys", pa.list_(pa.uint64())), ("source_key", pa.uint64()),
                         ("text_inline", pa.bool_()), ("caption", pa.string()),
                         ("record", pa.binary()), ("source", pa.int32())])  # fmt: skip
_TAKEN_COLUMNS = ("sample_id", "caption_key", "caption_keys", "source_key", "text_inline", "caption")


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
    reference: int | None = None,
    flip: bool = False,
    reuse: ReuseTable | None = None,
    dtype: str = "BF16",
) -> dict[str, Any]:
    """Fetch, decode and crop ``rows`` (``sample_id``, ``filename``, ``caption_key``) to ``bucket``.

    Returns ``{"bucket", "pixels": uint8 (B * K, H, W, 3) (the K crops of a good row one after the other),
    "cond_pixels": the same for the conditioning images or None, "mask_pixels": uint8 (B * K, H, W) the loss
    masks cut like the images (255 for a row without one) or None when no row has one, "rows": [geometry per
    good row, ``has_mask``], "errors":
    [(sample_id, filename, kind, message)]}``; one bad image never fails the batch. ``crops``: K crops per image
    (:func:`~pipeline.embed.imaging.prepare_views`). ``conditioning``: the root of the rows' ``conditioning``
    paths: each is cropped exactly like its target (same resized size, same boxes), and a pair that cannot be is
    the sample's error row; ``reference`` (an area in pixels, a ``reference`` family's): each crop is then resized as
    that family's pipeline resizes its reference: the crop's region of the full-resolution conditioning image, resized
    once (Lanczos) to :func:`~pipeline.embed.families.qwen_image_edit.reference_size`,
    so ``cond_pixels`` are ``(B * K, h, w, 3)`` at that size. Transient storage errors are retried per file
    (:func:`pipeline.embed.imaging.fetch_all`); a read that still fails is a ``read_failed`` error row
    (credentials redacted), which the next run retries. ``fs`` replaces the filesystem of ``source`` (it must be
    picklable for Ray); ``image_column``: a parquet-sourced manifest's (:func:`pipeline.embed.imaging.fetch_images`).
    A video bucket ``WxHxF`` is :func:`pipeline.embed.clips.prepare_clips`' (``max_clips`` clips per video).
    Every good image row gets ``content``, the sha256 of its bytes. ``reuse`` (``embed --reuse``): a row whose
    record another cache holds (:func:`pipeline.embed.reuse.take_latents`: same content, geometry and latent settings,
    the ``flip`` and ``dtype`` of this run) is not decoded; it comes back in ``taken`` as ``(row, record bytes,
    source)``, and ``refused`` counts records found that failed a check.
    """
    fs, root = open_source(source, storage_options, fs)
    if is_video_bucket(bucket):
        return prepare_clips(fs, root, bucket, rows, crop, seed, max_pixels, max_clips, storage_options,
                             lambda some: fetch_images(fs, root, some, image_column=image_column))  # fmt: skip
    bw, bh = parse_bucket(bucket)
    blobs = fetch_images(fs, root, rows, image_column=image_column)
    contents, taken, refused = take_latents(reuse or ReuseTable(), bucket, rows, blobs, crop=crop, seed=seed,
                                            crops=crops, flip=flip, max_pixels=max_pixels, dtype=dtype)  # fmt: skip
    paired = conditioning is not None and any(r.get("conditioning") for r in rows)
    if paired:
        cfs, croot = (fs, root) if conditioning == source else open_url(conditioning, storage_options)
        cond_blobs = read_many(cfs, [join(croot, r["conditioning"]) for r in rows])
    masked, mask_blobs = any(r.get("mask") for r in rows), fetch_masks(fs, root, rows)
    good, pixels, cond_pixels, mask_pixels, errors = [], [], [], [], []
    for i, (row, blob) in enumerate(zip(rows, blobs)):
        if i in taken:
            continue
        try:
            if isinstance(blob, BaseException):
                raise read_failure(blob, storage_options)
            views = prepare_views(blob, (bh, bw), crop=crop, seed=seed, sample_id=row["sample_id"],
                                  max_pixels=max_pixels, crops=crops, name=row["filename"])  # fmt: skip
            if paired:
                out = qwen_image_edit.reference_size(bh, bw, reference) if reference else None
                cond = conditioning_views(row, cond_blobs[i], views, (bh, bw), max_pixels, storage_options, out)
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
                     "has_mask": bool(row.get("mask")), "content": contents[i]})  # fmt: skip
    stacked = np.stack(pixels) if pixels else np.zeros((0, bh, bw, 3), np.uint8)  # (B * K, H, W, 3)
    conds = (np.stack(cond_pixels) if cond_pixels else np.zeros((0, bh, bw, 3), np.uint8)) if paired else None
    masks = (np.stack(mask_pixels) if mask_pixels else np.zeros((0, bh, bw), np.uint8)) if masked else None
    return {"bucket": bucket, "pixels": stacked, "cond_pixels": conds, "mask_pixels": masks, "rows": good,
            "errors": errors, "taken": [(rows[i], *taken[i]) for i in sorted(taken)], "refused": refused}  # fmt: skip


def prepare_unit(batch: pa.Table, source: str, storage_options: dict | None, crop: str, seed: int,
                 max_pixels: int, crops: int = 1, conditioning: str | None = None,
                 image_column: str | None = None, max_clips: int = MAX_CLIPS, reference: int | None = None,
                 flip: bool = False, reuse: ReuseTable | None = None, dtype: str = "BF16") -> pa.Table:
    """Ray Data ``map_batches`` (batch size 1): a unit -> its pixels (``uint8 (B * K, H, W, 3)`` bytes;
    ``cond_pixels`` the same for the conditioning images, empty without), the geometry of its good
    rows, its error rows and the rows that take another cache's record (``taken``, ``refused``; IPC bytes), via
    :func:`prepare_batch`."""
    out = []
    for item in batch.to_pylist():
        before = throttle_mark()
        rows = from_ipc(item["rows"]).to_pylist()
        keys = {r["sample_id"]: r["source_key"] for r in rows}
        prepared = prepare_batch(source, storage_options, item["bucket"], rows, crop, seed, max_pixels, crops=crops,
                                 conditioning=conditioning, image_column=image_column,
                                 max_clips=max_clips, reference=reference, flip=flip, reuse=reuse,
                                 dtype=dtype)  # fmt: skip
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
            "clip_captions": [r.get("clip_captions") for r in prepared["rows"]],
            "content": [r.get("content") for r in prepared["rows"]],
        }, schema=_PREPARED_ROWS)  # fmt: skip
        taken = pa.Table.from_pylist([{**{k: row.get(k) for k in _TAKEN_COLUMNS}, "record": data, "source": s}
                                      for row, data, s in prepared.get("taken", ())], schema=_TAKEN_ROWS)
        errors = pa.Table.from_pylist([{"sample_id": sid, "filename": name, "error": kind, "message": message,
                                        "source_key": keys[sid]} for sid, name, kind, message in prepared["errors"]],
                                      schema=CACHE_ERRORS_SCHEMA)  # fmt: skip
        cond, masks = prepared["cond_pixels"], prepared["mask_pixels"]
        out.append({"unit": item["unit"], "bucket": item["bucket"], "pixels": prepared["pixels"].tobytes(),
                    "cond_pixels": b"" if cond is None else cond.tobytes(),
                    "mask_pixels": b"" if masks is None else masks.tobytes(), "rows": to_ipc(good),
                    "errors": to_ipc(errors), "taken": to_ipc(taken), "refused": prepared.get("refused", 0),
                    "throttled": carry_spans(item.get("throttled"), before)})  # fmt: skip
    return pa.Table.from_pylist(out, schema=pa.schema([("unit", pa.string()), ("bucket", pa.string()),
                                                      ("pixels", pa.large_binary()), ("cond_pixels", pa.large_binary()),
                                                      ("mask_pixels", pa.large_binary()), ("rows", pa.binary()),
                                                      ("errors", pa.binary()), ("taken", pa.large_binary()),
                                                      ("refused", pa.int64()), ("throttled", SPANS)]))  # fmt: skip
