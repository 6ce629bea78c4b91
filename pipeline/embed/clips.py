"""Video clips for ``bucketeer embed``: which clips of a video are embedded, their frames decoded with PyAV
over ranged reads and cropped to the bucket, and the sample record they become.

A video row of bucket ``WxHxF`` with ``clips = k`` holds k non-overlapping clips of F frames (clip i
starts at frame ``i * F``, :mod:`manifests.frames`). ``--max-clips N`` embeds at most N of them, evenly
spaced (:func:`clip_starts`); each is a **variant** of the sample's record (variant ``v`` = clip
``v // flips``, mirrored when ``v % flips`` with ``--flip``), so the trainer takes a different clip per
epoch with the one ranged read per sample it already does (``train.data.variant_choice``).

Frames are decoded on the CPU workers from the file's bytes through a
:class:`~pipeline.sources.headers.RangeReader` (ranged reads of what FFmpeg asks for; a tar member's
byte range offset into its shard; a parquet value, which has no byte range, read whole): a clip far
into the video starts with a seek to the keyframe before it and a decode forward from there, frame-exact
(:func:`decode_clip_frames`; variable-rate video decodes forward from the start), and each frame is turned
to the bucket right away, so a worker holds the clips' pixels at the bucket's size, never the video:
decoding stops after the last wanted clip's last frame. Frames are counted from the first decoded one
(the scan's ``frames`` is the container's count of the same frames), in display orientation (each
frame's rotation side data applied, as FFmpeg's autorotate does). One crop box for the whole clip, by
the images' cover-and-crop rule (:func:`pipeline.embed.imaging.cover_and_crop`) on the display size.
A video that cannot be decoded, or ends before a wanted clip does, is an error row of the cache
(``decode_failed`` / ``truncated``). An image of a video manifest (bucket ``WxHx1``) is a 1-frame clip.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import numpy as np

from manifests.errors import UsageError
from manifests.frames import parse_video_bucket
from manifests.manifest_meta import ManifestMeta
from manifests.retry import with_retries
from manifests.schema import image_range
from manifests.storage import is_local, join, redact
from pipeline.embed.families.wan import VIDEO_FAMILIES
from pipeline.embed.loading import DEFAULT_ID
from pipeline.embed.parquet_images import is_parquet_row
from pipeline.embed.imaging import ImageFailure, cover_and_crop, crop_resized, prepare_views, read_failure
from pipeline.embed.samples import sample_record

__all__ = ["MAX_CLIPS", "SEEK_GAP", "open_video", "clip_picks", "clip_records", "clip_starts", "clip_variants",
           "decode_clip_frames", "prepare_clips", "refuse_for_video"]

MAX_CLIPS = 4  # --max-clips default: record bytes grow with the clips kept
_FIRST_READ = 256 * 1024  # ranged reads while decoding: sequential misses double from here
_MAX_FETCH = 8 * 1024 * 1024  # ... up to this


def clip_picks(clips: int, max_clips: int, starts: list[int] | None = None) -> list[int]:
    """Which clips of a video of ``clips`` clips (``starts``: its ``clip_starts``, when cut inside shots) are
    embedded: at most ``max_clips`` indices, evenly spaced over the video (the first and, with 2 or more, the
    last)."""
    k = max(1, len(starts) if starts else int(clips))
    return [int(i) for i in np.unique(np.linspace(0, k - 1, min(k, max_clips)).round().astype(int))]


def clip_starts(clips: int, frames: int, max_clips: int, starts: list[int] | None = None) -> list[int]:
    """The first frame of each clip embedded from a video of ``clips`` clips of ``frames`` frames
    (:func:`clip_picks`). ``starts``: the row's ``clip_starts`` (clips cut inside shots,
    :func:`manifests.frames.scene_clips`), else clip i starts at ``i * frames``."""
    return [int(starts[i]) if starts else i * frames for i in clip_picks(clips, max_clips, starts)]


def clip_variants(clips: np.ndarray, flips: int) -> np.ndarray:
    """``(n, F, H, W, 3)`` clips -> ``(n * flips, F, H, W, 3)`` variants: variant ``v`` is clip ``v // flips``,
    every frame mirrored left-right when ``v % flips``."""
    if flips == 1:
        return clips
    return np.stack([clips, clips[:, :, :, ::-1]], axis=1).reshape(-1, *clips.shape[1:])


def _frame_image(frame):
    """A decoded PyAV frame as an RGB PIL image in display orientation (its rotation side data applied)."""
    from PIL import Image

    pixels = frame.to_ndarray(format="rgb24")  # (h, w, 3) as stored
    turns = int(round(getattr(frame, "rotation", 0) or 0) / 90) % 4  # counter-clockwise quarter turns
    if turns:
        pixels = np.ascontiguousarray(np.rot90(pixels, turns))
    return Image.fromarray(pixels)


class _NotSeekable(Exception):
    """A video whose frame numbers cannot be told from timestamps after a seek: decode it forward instead."""


def decode_clip_frames(file: io.RawIOBase | str, starts: list[int], frames: int,
                       on_frame: Callable[[int, int, Any], None]) -> int:
    """Decode the frames ``[s, s + frames)`` of each clip of ``starts`` of the video ``file`` (a path or a
    seekable file) and hand each to ``on_frame(clip index, frame index in the clip, PIL image in display
    orientation)``, in order; stop after the last clip's last frame. Returns the frames decoded.

    A clip :data:`SEEK_GAP` frames or more past where the decoder is starts with a seek to the keyframe at or
    before its first frame, and a decode forward from there (frame-exact: frame numbers from timestamps, counted
    from the first frame's). That needs constant-rate video (the stream's base rate equal to its average rate,
    and every frame after a seek on the grid of that rate); a video that is not decodes forward from frame 0
    instead, the whole of it up to the last clip. PyAV's errors propagate."""
    try:
        return _decode_clips(file, starts, frames, on_frame, seek=True)
    except _NotSeekable:
        if not isinstance(file, str):
            file.seek(0)
        return _decode_clips(file, starts, frames, on_frame, seek=False)


SEEK_GAP = 48  # frames: a clip at least this far ahead seeks (a keyframe earlier than where we are costs a GOP)


def _decode_clips(file, starts: list[int], frames: int, on_frame, *, seek: bool) -> int:
    import av

    decoded = 0
    with av.open(file) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate, base = stream.average_rate, stream.base_rate
        step = 1 / (rate * stream.time_base) if seek and rate and base == rate and stream.time_base else None
        first_pts = None
        position: int | None = 0  # the index of the next frame the decoder gives; None right after a seek
        pending = iter(container.decode(stream))

        def take(frame) -> int:
            """Number ``frame`` (from its timestamp right after a seek), hand it to its clips; its index."""
            nonlocal decoded, first_pts, position, step
            decoded += 1
            if position is None:  # the keyframe a seek landed on: its number from its timestamp
                at = (frame.pts - first_pts) / step if frame.pts is not None else -1
                if at < 0 or abs(at - round(at)) > 0.25:
                    raise _NotSeekable()
                position = round(at)
            elif step is not None and first_pts is not None and frame.pts is not None \
                    and abs(frame.pts - first_pts - position * step) > step / 4:
                raise _NotSeekable()  # off the constant-rate grid: timestamps would not give frame numbers
            if first_pts is None:
                first_pts = frame.pts
                if first_pts is None:
                    step = None
            index, position = position, position + 1
            image = None
            for c, cs in enumerate(starts):
                if cs <= index < cs + frames:
                    image = image or _frame_image(frame)
                    on_frame(c, index - cs, image)
            return index

        for s in sorted(starts):
            if step is not None and first_pts is None:  # frame 0's timestamp numbers the frames after a seek
                first = next(pending, None)
                if first is None:
                    break
                take(first)
            if step is not None and first_pts is not None and position is not None and s - position >= SEEK_GAP:
                target = first_pts + round(s * step)  # in stream.time_base
                container.seek(int(target), backward=True, any_frame=False, stream=stream)  # the keyframe at or before
                pending, position = iter(container.decode(stream)), None
            if position is not None and position > s + frames - 1:
                continue  # this clip is behind us already (frame 0 alone)
            landed = position is None  # the next frame is the keyframe a seek landed on
            for frame in pending:
                index = take(frame)
                if landed and index > s:
                    raise _NotSeekable()  # past the clip's first frame: the timestamps do not number the frames
                landed = False
                if index >= s + frames - 1:
                    break
    return decoded


def open_video(fs, root: str, row: dict):
    """A seekable file over the row's video bytes (a manifest row with its location columns): a loose local file as
    itself, else a RangeReader (embed and annotate's video tasks decode through it)."""
    from pipeline.sources.headers import RangeReader

    path, start, end = image_range(row)
    full = join(root, path)
    if start is None and is_local(fs):
        return open(full, "rb")
    offset = start or 0
    size = (end - offset) if end is not None else int(row["size"])
    # a forward decode keeps the last few chunks only: memory bounded by _MAX_FETCH, never the file
    return RangeReader(lambda a, b: with_retries(lambda: fs.cat_file(full, start=offset + a, end=offset + b)), size,
                       _FIRST_READ, max_bytes=1 << 62, max_fetch=_MAX_FETCH, keep_chunks=4)  # fmt: skip


def _video_views(fs, root: str, row: dict, bucket: tuple[int, int], frames: int, crop: str, seed: int,
                 max_clips: int, storage_options: dict | None, blob=None) -> tuple[np.ndarray, dict]:
    """One video row -> ``uint8 (n, F, H, W, 3)`` clips and its geometry; raises ImageFailure. ``blob``: the
    video's bytes (or the exception reading them) when they were read whole (a parquet value), else None."""
    starts = clip_starts(row.get("clips") or 1, frames, max_clips, row.get("clip_starts"))
    on = row.get("clip_captions")  # each clip's caption index (shots captioned): the picked clips' go with them
    captions = None if on is None else [int(on[i]) for i in clip_picks(row.get("clips") or 1, max_clips,
                                                                         row.get("clip_starts"))]  # fmt: skip
    bh, bw = bucket
    out = np.zeros((len(starts), frames, bh, bw, 3), np.uint8)
    seen = np.zeros((len(starts), frames), bool)
    geometry: dict[str, Any] = {}

    def on_frame(c: int, k: int, img) -> None:
        if not geometry:  # the first frame fixes the crop box of every clip
            original = (img.height, img.width)
            resized, top_left = cover_and_crop(original, bucket, crop, seed, row["sample_id"])
            geometry.update(original_size=original, resized_size=resized, crop_top_left=top_left)
        out[c, k] = crop_resized(img, geometry["resized_size"], geometry["crop_top_left"], bucket)
        seen[c, k] = True

    if isinstance(blob, BaseException):
        raise read_failure(blob, storage_options)
    try:
        file = open_video(fs, root, row) if blob is None else io.BytesIO(blob)
    except OSError as e:
        raise read_failure(e, storage_options) from None
    try:
        with file:
            decoded = decode_clip_frames(file, starts, frames, on_frame)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:  # untrusted bytes: this video's error row
        failure = getattr(file, "failure", None)
        if failure is not None:
            raise read_failure(failure, storage_options) from None
        raise ImageFailure("decode_failed", redact(f"PyAV cannot decode it: {type(e).__name__}: {e}",
                                                   storage_options)) from None  # fmt: skip
    if not seen.all():
        raise ImageFailure("truncated", f"decoded {decoded} frames, fewer than its clips need "
                           f"(starts {starts}, {frames} frames each): rescan it")  # fmt: skip
    return out, {**geometry, "clip_starts": starts, "clip_captions": captions}


def prepare_clips(fs, root: str, bucket: str, rows: list[dict], crop: str, seed: int, max_pixels: int,
                  max_clips: int, storage_options: dict | None,
                  blobs: Callable[[list[dict]], list]) -> dict[str, Any]:  # fmt: skip
    """:func:`pipeline.embed.prepare.prepare_batch` for a unit of a video bucket ``WxHxF``: ``pixels`` uint8
    ``(n, F, H, W, 3)``, every good row's clips one after the other (``clip_starts`` in its geometry says how
    many); a 1-frame bucket's rows are images (read with ``blobs(rows)``, decoded as images are). One bad file
    never fails the unit: it is an error row ``(sample_id, filename, kind, message)``."""
    bw, bh, frames = parse_video_bucket(bucket)
    pixels, good, errors = [], [], []
    images = blobs(rows) if frames == 1 else [None] * len(rows)
    in_parquet = [i for i, r in enumerate(rows) if frames > 1 and is_parquet_row(r)]  # no byte range: read whole
    for i, blob in zip(in_parquet, blobs([rows[i] for i in in_parquet]) if in_parquet else []):
        images[i] = blob
    for row, blob in zip(rows, images):
        try:
            if frames == 1:
                if isinstance(blob, BaseException):
                    raise read_failure(blob, storage_options)
                view = prepare_views(blob, (bh, bw), crop=crop, seed=seed, sample_id=row["sample_id"],
                                     max_pixels=max_pixels, name=row["filename"])[0]  # fmt: skip
                clips = view.pixels[None, None]  # (1, 1, H, W, 3)
                geometry = {"original_size": view.original_size, "resized_size": view.resized_size,
                            "crop_top_left": view.crop_top_left, "clip_starts": [0]}  # fmt: skip
            else:
                clips, geometry = _video_views(fs, root, row, (bh, bw), frames, crop, seed, max_clips, storage_options,
                                               blob)  # fmt: skip
        except ImageFailure as e:
            errors.append((row["sample_id"], row["filename"], e.kind, e.message))
            continue
        pixels.append(clips)
        good.append({**row, **geometry, "crops": list(geometry["crop_top_left"]) * len(clips), "has_mask": False})
    stacked = np.concatenate(pixels) if pixels else np.zeros((0, frames, bh, bw, 3), np.uint8)
    return {"bucket": bucket, "pixels": stacked, "cond_pixels": None, "mask_pixels": None, "rows": good,
            "errors": errors}  # fmt: skip


def clip_records(item: dict, rows: list[dict], encode: Callable[[np.ndarray], np.ndarray], flips: int,
                 batch_size: int, dtype: str) -> list[tuple[dict, Any]]:
    """A prepared video unit (``pixels`` of :func:`prepare_clips`, its good ``rows``) -> ``(row, SampleRecord)``
    each: every clip (x2 mirrored with ``flips`` 2) through ``encode`` (``(b, F, H, W, 3)`` uint8 -> ``(b, C, F',
    h, w)`` in ``dtype``), ``batch_size`` clips a pass; a row's clips are the variants of its record (with
    ``clip_captions``, each variant's caption index: ``variant_captions``)."""
    bw, bh, frames = parse_video_bucket(item["bucket"])
    pixels = np.frombuffer(item["pixels"], np.uint8).reshape(-1, frames, bh, bw, 3)  # (clips, F, H, W, 3)
    views = clip_variants(pixels, flips)  # (clips * flips, F, H, W, 3): clip-major
    if not rows:
        return []
    latents = np.concatenate([encode(views[at : at + batch_size]) for at in range(0, len(views), batch_size)])
    out, at = [], 0
    for r in rows:
        v = len(r["clip_starts"]) * flips
        out.append((r, sample_record(r, item["bucket"], dtype, latents[at : at + v], None, None, flips,
                                     clip_starts=r["clip_starts"], clip_captions=r.get("clip_captions"))))  # fmt: skip
        at += v
    return out


def refuse_for_video(job: Any, manifest: ManifestMeta) -> None:
    """Raise UsageError (one line) for what a video manifest cannot be embedded with (yet); ``job``: the
    :class:`~pipeline.embed.job.EmbedJob` (not imported here: that module imports this one)."""
    images_only = {"--features (REPA)": job.features is not None, "--crops K": job.crops > 1,
                   "--latents posterior": job.latents == "posterior", "loss masks (scan --masks)": bool(manifest.masks),
                   "conditioning images (scan --conditioning)": manifest.conditioning is not None}  # fmt: skip
    why = next((f"{what} is for images only, for now: embed without it" for what, on in images_only.items() if on), "")
    if job.family not in VIDEO_FAMILIES and job.vae in (None, DEFAULT_ID):  # the tiny AutoencoderKL, or the family's
        why = (f"--family {job.family} encodes images; clips need a video VAE: --family wan (or wan2.2-a14b, "
               "wan2.2-ti2v-5b) --model ID|PATH "
               "('default': a tiny random one), or --vae of an AutoencoderKLWan")  # fmt: skip
    if why:
        raise UsageError(f"bucketeer embed {redact(job.manifest)} (a video manifest, WxHxF buckets): {why}")
