"""Video members of WebDataset tar shards (``scan --frames``): each probed from its container header where it lies.

A shard is walked as for images (:func:`pipeline.sources.tar.walk_tar`: its member headers, by ranged
reads of a few KiB at each header); members are grouped by WebDataset key
(:func:`pipeline.sources.shards.shard_key`), and each ``.mp4 .mov .webm .mkv`` member is probed by
:func:`pipeline.sources.video.probe_video` over ranged reads of its own byte range
``[member_offset, member_offset + size)`` of the shard: the video's header, never its frames, and
never the shard. Its caption is the key's ``.txt``, else ``.caption``, else the ``.json`` field, as
for images (:func:`pipeline.sources.shards.key_caption`). A row's ``filename`` is
``<shard>/<member>``, its ``container``/``member_offset``/``size`` where one ranged read fetches the
clip (``manifests/schema.py`` CONTAINER_FIELDS).

A key with two videos gives a ``duplicate_key`` row each; image members of the shards are counted as
ignored members (a video scan of tar shards reads their videos; loose images join as 1-frame samples);
a walk that stops early gives a ``corrupt_container`` row named after the shard (a cut video member a
``truncated`` row), and a shard whose reads fail after the retries one ``read_failed`` row.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from pipeline.sources.listing import VIDEO_EXTENSIONS, FileEntry, extension
from pipeline.sources.shards import (SHARD_WINDOW, CountingReads, key_caption, open_work, read_shard,
                                     resolve_links, shard_key)  # fmt: skip
from pipeline.sources.tar import TarMember, walk_tar
from pipeline.sources.video import probe_video

__all__ = ["VIDEO_SHARD_ROWS", "scan_video_shard", "scan_video_shard_batch"]

VIDEO_SHARD_ROWS = pa.schema([
    pa.field("filename", pa.string()), pa.field("container", pa.string()), pa.field("container_size", pa.int64()),
    pa.field("etag", pa.string()), pa.field("mtime", pa.float64()), pa.field("member_offset", pa.int64()),
    pa.field("size", pa.int64()), pa.field("width", pa.int32()), pa.field("height", pa.int32()),
    pa.field("frames", pa.int32()), pa.field("fps", pa.float64()), pa.field("duration", pa.float64()),
    pa.field("codec", pa.string()), pa.field("format", pa.string()), pa.field("frame_count_from", pa.string()),
    pa.field("error", pa.string()), pa.field("message", pa.string()), pa.field("bytes_read", pa.int64()),
    pa.field("requests", pa.int32()), pa.field("caption", pa.string()), pa.field("caption_source", pa.string()),
])  # fmt: skip


def scan_video_shard(read_range, shard: FileEntry, *, caption_field: str = "caption",
                     window: int = SHARD_WINDOW) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """The video rows of one shard (see the module docstring) and its counts: ``requests``, ``bytes_read``
    (every byte fetched: headers, captions, video headers), ``videos``, ``ignored_members`` by extension.

    Exceptions of ``read_range`` (after its retries) propagate, as :class:`StorageFailure` from a probe.
    """
    reads = CountingReads(read_range)
    walk = walk_tar(reads, shard.size, window=window, keep=window)
    base = {"container": shard.name, "container_size": shard.size, "etag": shard.etag, "mtime": shard.mtime}
    resolved, _ = resolve_links(walk)  # a link leading nowhere is an ignored member here
    by_key: dict[str, list[TarMember]] = {}
    for member in [*walk.members, *resolved]:
        by_key.setdefault(shard_key(member.name), []).append(member)
    rows: list[dict[str, Any]] = []
    ignored: dict[str, int] = {}
    for key, members in by_key.items():
        videos = [m for m in members if extension(m.name) in VIDEO_EXTENSIONS]
        caption = key_caption(reads, shard.name, members, caption_field) if videos else (None, None, None)
        for m in members:
            ext = extension(m.name)
            if m not in videos and not (videos and ext in ("txt", "caption", "json")):
                ignored[ext] = ignored.get(ext, 0) + 1
        for video in videos:
            row = {**base, "filename": f"{shard.name}/{video.name}", "member_offset": video.offset,
                   "size": video.size, "caption": caption[0], "caption_source": caption[2]}  # fmt: skip
            if video is walk.cut_member:
                row.update(error="truncated", message=walk.problem)
            elif len(videos) > 1:
                row.update(error="duplicate_key", message=f"key {key} of shard {shard.name} has {len(videos)} videos; "
                           "a WebDataset sample holds one: rename or remove the others")  # fmt: skip
            else:
                probe = probe_video(lambda a, b, m=video: reads(m.offset + a, m.offset + min(b, m.size)), video.size)
                row.update({k: v for k, v in probe.__dict__.items() if k in VIDEO_SHARD_ROWS.names})
                row["format"] = probe.format.split(",")[0] if probe.format else None
            rows.append(row)
    if walk.problem:
        rows.append({**base, "filename": shard.name, "error": "corrupt_container", "size": shard.size,
                     "message": f"{walk.problem}; {len(walk.members)} members before it were scanned, nothing after "
                     "it (re-create or re-download the shard)"})  # fmt: skip
    counts = {"requests": reads.requests, "bytes_read": reads.bytes, "ignored_members": ignored,
              "videos": sum(1 for r in rows if r["filename"] != shard.name)}  # fmt: skip
    return rows, counts


def _scan_one(fs, root: str, shard: FileEntry, config: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return read_shard(fs, root, shard,
                      lambda read_range: scan_video_shard(read_range, shard, caption_field=config.caption_field,
                                                          window=config.shard_window),
                      lambda row: ([row], {"requests": 0, "bytes_read": 0, "ignored_members": {}, "videos": 0}))


def scan_video_shard_batch(target: tuple, batch: pa.Table, config: Any) -> pa.Table:
    """One Ray task: the video members of the shards of ``batch`` (a ``shard_work`` table), up to
    ``reads_in_flight`` shards at once; a :data:`VIDEO_SHARD_ROWS` table, its counts summed in the
    schema metadata ``stats`` (JSON)."""
    fs, root, shards = open_work(target, batch)
    with ThreadPoolExecutor(max(1, min(config.reads_in_flight, len(shards), 32))) as pool:
        scans = list(pool.map(lambda s: _scan_one(fs, root, s, config), shards))
    rows = [row for found, _ in scans for row in found]
    stats: dict[str, Any] = {"shards": len(shards), "requests": 0, "bytes_read": 0, "videos": 0, "ignored_members": {}}
    for _, counts in scans:
        for name in ("requests", "bytes_read", "videos"):
            stats[name] += counts[name]
        for ext, n in counts["ignored_members"].items():
            stats["ignored_members"][ext] = stats["ignored_members"].get(ext, 0) + n
    columns = {name: [row.get(name) for row in rows] for name in VIDEO_SHARD_ROWS.names}
    return pa.table(columns, schema=VIDEO_SHARD_ROWS).replace_schema_metadata({"stats": json.dumps(stats)})
