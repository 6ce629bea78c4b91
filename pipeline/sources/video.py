"""Read a video's size, frame count, rate, duration and codec from its container header, never its frames.

:func:`probe_video` gives PyAV (``av``, the ``video`` extra) a :class:`~pipeline.sources.headers.RangeReader`
over the file: PyAV demuxes the header (mp4/mov: the ``moov`` box, wherever it is; webm/mkv: the
EBML header, segment info and tracks) through ranged reads of only the bytes it asks for, and
``bytes_read`` counts them. Opening an input also reads the first packet of each stream (FFmpeg's
``avformat_find_stream_info``, which PyAV always calls, limited here to ``probesize=32``): one
compressed frame, not decoded. Nothing is decoded.

- ``width``/``height``: display orientation: the sides are swapped when the track's display matrix
  rotates by 90 or 270 degrees (mp4/mov: the ``tkhd`` matrix, read from the bytes already fetched;
  FFmpeg's ``rotate`` tag, when a demuxer sets one). Matroska rotation (``ProjectionPoseRoll``) is not
  read: webm/mkv sides are the stored ones.
- ``frames`` and ``frame_count_from``: ``index`` where the container has a sample table (mp4/mov:
  ``stream.frames``, exact); else ``tag`` where a muxer wrote ``NUMBER_OF_FRAMES`` (mkvmerge); else
  ``duration*fps``: ``round(duration * fps)`` with the stream's ``DURATION`` tag (or the container's
  duration) and its average rate: exact for constant-rate video, an estimate for variable-rate
  webm/mkv (counting would mean demuxing every packet, i.e. reading the whole file).
- ``fps`` the stream's average frame rate (frames / duration for variable-rate mp4), ``duration``
  in seconds, ``codec`` FFmpeg's decoder name (``h264``, ``hevc``, ``vp9``, ``av1``, ...).

A file PyAV cannot open, or without a video stream, is an error (``not_a_video``); a storage
failure raises :class:`~pipeline.sources.headers.StorageFailure` as for images.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable

from pipeline.sources.headers import RangeReader, StorageFailure

__all__ = ["VIDEO_FIRST_READ", "VideoProbe", "probe_video"]

VIDEO_FIRST_READ = 16 * 1024  # a video header is read in several ranged reads; the first is small
_OPEN_OPTIONS = {"probesize": "32", "analyzeduration": "0"}  # find_stream_info: one packet, no more
_MAX_MESSAGE = 600


@dataclass(frozen=True)
class VideoProbe:
    """One probed video file: its display size and timing, or an error kind and message."""

    width: int | None = None
    height: int | None = None
    frames: int | None = None
    fps: float | None = None
    duration: float | None = None
    codec: str | None = None
    format: str | None = None  # FFmpeg's demuxer name: mov,mp4,m4a,3gp,3g2,mj2 / matroska,webm
    frame_count_from: str | None = None  # index | tag | duration*fps
    error: str | None = None
    message: str | None = None
    bytes_read: int = 0
    requests: int = 0


def probe_video(read_range: Callable[[int, int], bytes], size: int, *,
                first_read: int = VIDEO_FIRST_READ) -> VideoProbe:  # fmt: skip
    """Probe one video of ``size`` bytes through ``read_range(start, end)`` (end exclusive).

    Never raises for the file's content (a broken file is ``empty``, ``not_a_video`` or
    ``invalid_header``); raises :class:`StorageFailure` when storage fails.
    """
    if size <= 0:
        return VideoProbe(error="empty", message="the file is empty (0 bytes)")
    import av  # the `video` extra: only a video scan needs it

    reader = RangeReader(read_range, size, first_read)
    try:
        with av.open(reader, options=_OPEN_OPTIONS, buffer_size=first_read) as container:
            probe = _describe(container, reader)
    except StorageFailure:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # untrusted bytes: any failure is this file's error row
        if reader.failure is not None:
            raise StorageFailure(reader.failure) from None
        probe = VideoProbe(error="not_a_video", message=_text(f"PyAV cannot open it: {type(e).__name__}: {e}"))
    if reader.failure is not None:  # FFmpeg swallowed the storage error
        raise StorageFailure(reader.failure)
    return VideoProbe(**{**probe.__dict__, "bytes_read": reader.bytes_read, "requests": reader.requests})


def _describe(container, reader: RangeReader) -> VideoProbe:
    fmt = container.format.name
    if not container.streams.video:
        return VideoProbe(format=fmt, error="not_a_video", message=f"{fmt} container without a video stream")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    codec = stream.codec_context.name
    if not width or not height or width < 1 or height < 1:
        message = f"declares a size of {width}x{height}"
        return VideoProbe(format=fmt, codec=codec, error="invalid_header", message=message)
    duration = _duration(container, stream)
    frames, source = _frames(stream, duration)
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else (frames / duration if frames and duration else None)
    if frames is None and duration and fps:
        frames, source = int(round(duration * fps)), "duration*fps"
    if not frames or frames < 1:
        return VideoProbe(width=width, height=height, format=fmt, codec=codec, error="invalid_header",
                          message="no frame count in the header: neither an index, a tag nor a duration and rate")
    if _quarter_turns(stream, reader, fmt) % 2:
        width, height = height, width
    return VideoProbe(width=width, height=height, frames=int(frames), fps=fps, duration=duration, codec=codec,
                      format=fmt, frame_count_from=source)  # fmt: skip


def _duration(container, stream) -> float | None:
    """Seconds: the stream's own duration, else its ``DURATION`` tag (Matroska), else the container's."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")
    if tag:
        try:
            h, m, s = tag.split(":")
            return int(h) * 3600 + int(m) * 60 + float(s)
        except ValueError:
            pass
    return container.duration / 1e6 if container.duration else None


def _frames(stream, duration: float | None) -> tuple[int | None, str | None]:
    if stream.frames:
        return int(stream.frames), "index"
    tag = stream.metadata.get("NUMBER_OF_FRAMES")
    if tag and tag.isdigit():
        return int(tag), "tag"
    return None, None


def _quarter_turns(stream, reader: RangeReader, fmt: str) -> int:
    """Quarter turns of the display rotation: the ``rotate`` tag, else the mp4/mov track's ``tkhd`` matrix."""
    tag = stream.metadata.get("rotate")
    if tag:
        try:
            return int(round(float(tag) / 90)) % 4
        except ValueError:
            return 0
    matrix = _tkhd_matrix(reader, stream.index) if fmt.startswith("mov") else None
    if matrix is None:
        return 0
    a, b = matrix[0], matrix[1]  # 16.16 fixed point: (cos, sin) of the rotation
    return int(round(math.degrees(math.atan2(b, a)) / 90)) % 4


def _tkhd_matrix(reader: RangeReader, track: int) -> tuple[int, ...] | None:
    """The 3x3 matrix of the ``track``-th ``trak``'s ``tkhd`` box, from the ``moov`` bytes FFmpeg read."""
    moov = _find_box(reader, 0, reader.size, b"moov")
    if moov is None:
        return None
    traks = list(_boxes(reader, *moov))
    traks = [(s, e) for kind, s, e in traks if kind == b"trak"]
    if track >= len(traks):
        return None
    tkhd = _find_box(reader, *traks[track], b"tkhd")
    if tkhd is None:
        return None
    start, _ = tkhd
    reader.seek(start)
    version = reader.read(1)
    offset = 40 if version == b"\x00" else 52  # version 1: 64-bit times and duration
    reader.seek(start + offset)
    data = reader.read(36)
    return struct.unpack(">9i", data) if len(data) == 36 else None


def _find_box(reader: RangeReader, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    for k, s, e in _boxes(reader, start, end):
        if k == kind:
            return s, e
    return None


def _boxes(reader: RangeReader, start: int, end: int):
    """``(type, payload start, end)`` of the ISO-BMFF boxes in ``[start, end)``; stops at a bad size."""
    pos = start
    while pos + 8 <= end:
        reader.seek(pos)
        head = reader.read(16)
        if len(head) < 8:
            return
        size, kind = struct.unpack(">I4s", head[:8])
        header = 8
        if size == 1 and len(head) == 16:
            size, header = struct.unpack(">Q", head[8:16])[0], 16
        elif size == 0:
            size = end - pos
        if size < header:
            return
        yield kind, pos + header, min(end, pos + size)
        pos += size


def _text(value: str) -> str:
    text = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."
