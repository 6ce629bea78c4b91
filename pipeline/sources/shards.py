"""Scan WebDataset tar shards: walk the member headers, probe each image where it lies, read its caption.

One shard (:func:`scan_shard`): :func:`pipeline.sources.tar.walk_tar` reads the member headers
with ranged reads of ``window`` bytes at each header (a read also holds the small members after
it, such as ``key.txt`` and ``key.json``, and the first bytes of the next image); members are
grouped by WebDataset key (the member path up to the first dot of its base name); each image's
header is probed by :func:`pipeline.sources.headers.probe_header` over a range reader at the image's
offset in the shard, from the bytes the walk already holds when they suffice (a JPEG's EXIF and
ICC bodies are skipped: :mod:`pipeline.sources.jpeg`). The caption is the
``.txt`` member, else ``.caption``, else the ``caption_field`` of the ``.json`` member (a string, or a
list of strings: several captions). No shard is
read whole: the bytes read are the headers, the captions and each image's first bytes.

A key's outcome, as for a loose file: one image -> a sample (null caption when it has none or an
empty one) or an error row; two images -> a ``duplicate_key`` error row
each; other members are counted by extension (``ignored_members``). A hard or symbolic link to a
file of the same shard is that file's bytes under the link's name (:func:`resolve_links`: its row
points at the target's offset); one leading nowhere in the shard is a ``broken_link`` or
``link_loop`` row when named as an image, else an ignored member. A shard whose walk stops early
(truncated, a header with a bad checksum) gives a ``corrupt_container`` row named after the shard
(a cut image member is also a ``truncated`` row); a shard whose reads fail after the retries one
``read_failed`` row, and it is read again by the next scan.

A Ray task (:func:`scan_shard_batch`) scans a batch of shards, up to ``reads_in_flight`` shards at
once on an object store (one thread each: a shard's reads follow one another), and returns one
table of rows (:data:`SHARD_ROWS`) with its counts in the schema metadata (``stats``, JSON).
"""

from __future__ import annotations

import json
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from manifests.errors import StorageError
from manifests.retry import is_permanent, is_storage_failure, with_retries
from manifests.schema import MASK_ALPHA, MAX_PIXELS
from manifests.storage import join, open_url, redact
from pipeline.formats import IMAGE_EXTENSIONS, register_plugins
from pipeline.sources.captions import caption_list, decode_caption, normalise_caption
from pipeline.sources.headers import StorageFailure, probe_header
from pipeline.sources.listing import FileEntry, extension
from pipeline.sources.masks import is_mask_member
from pipeline.sources.reading import SIDECAR_LIMIT
from pipeline.sources.results import Header, checked
from pipeline.sources.jpeg import sparse_jpeg_header
from pipeline.sources.tar import SHARD_WINDOW, TarLink, TarMember, TarWalk, walk_tar

__all__ = ["SHARD_ROWS", "SHARD_WINDOW", "CountingReads", "ShardScan", "key_caption", "scan_shard", "scan_shards",
           "scan_shard_batch", "shard_key", "shard_read_range", "resolve_links", "open_work"]  # fmt: skip

_HEAD_MIN = 512  # fewer bytes of a non-JPEG image in hand than this: read its first `window` bytes afresh
_CAPTION_EXTENSIONS = ("txt", "caption")  # .txt wins over .caption, both over the .json field

SHARD_ROWS = pa.schema(
    [
        pa.field("filename", pa.string(), nullable=False),  # <shard>/<member name>, or <shard> for its own row
        pa.field("container", pa.string(), nullable=False),
        pa.field("container_size", pa.int64()),
        pa.field("etag", pa.string()),  # the shard's
        pa.field("mtime", pa.float64()),
        pa.field("member_offset", pa.int64()),
        pa.field("size", pa.int64()),  # bytes of the image member
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("format", pa.string()),
        pa.field("orientation", pa.int8()),
        pa.field("error", pa.string()),
        pa.field("message", pa.string()),
        pa.field("bytes_read", pa.int64()),  # of this image: its header bytes the probe looked at
        pa.field("caption", pa.string()),
        pa.field("caption_source", pa.string()),
        pa.field("captions", pa.list_(pa.string())),  # the .json field's list, when it holds several captions
        pa.field("mask", pa.string()),  # scan --masks: "alpha", or <shard>/<key>.mask.<ext> (manifests.schema)
        pa.field("mask_offset", pa.int64()),
        pa.field("mask_size", pa.int64()),
    ]
)


def shard_key(name: str) -> str:
    """The WebDataset key of a member: ``a/b/x.y.jpg`` -> ``a/b/x`` (up to the first dot of the base name)."""
    head, _, base = name.rpartition("/")
    stem = base.split(".", 1)[0]
    return f"{head}/{stem}" if head else stem


@dataclass
class ShardScan:
    """What scanning one shard found: rows (columns of :data:`SHARD_ROWS`) and counts."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    bytes_read: int = 0  # every byte fetched from the shard: headers, captions, image headers
    images: int = 0
    captions_truncated: int = 0  # caption members over SIDECAR_LIMIT bytes, cut there
    ignored_members: dict[str, int] = field(default_factory=dict)  # by extension
    mask_members: int = 0  # scan --masks files: <key>.mask.<ext> members (not samples)


class CountingReads:
    """``read_range`` that counts requests and bytes, retried by :func:`manifests.retry.with_retries`."""

    def __init__(self, read: Callable[[int, int], bytes]):
        self._read = read
        self.requests = 0
        self.bytes = 0

    def __call__(self, start: int, end: int) -> bytes:
        try:
            data = self._read(start, end)
        except Exception as e:
            if not is_storage_failure(e):
                raise
            failed = [e]  # the retry layer's first attempt (reads that succeed skip its bookkeeping)

            def attempt() -> bytes:
                if failed:
                    raise failed.pop()
                return self._read(start, end)

            data = with_retries(attempt)
        self.requests += 1
        self.bytes += len(data)
        return data


def scan_shard(
    read_range: Callable[[int, int], bytes],
    shard: FileEntry,
    *,
    max_pixels: int = MAX_PIXELS,
    window: int = SHARD_WINDOW,
    caption_field: str = "caption",
    masks: str | None = None,
) -> ShardScan:
    """Scan the shard ``shard`` (name relative to the root, size in bytes) through ``read_range(start, end)``.

    Returns its rows (see the module docstring). ``masks`` (``scan --masks``): with ``files`` a key's
    ``<key>.mask.<ext>`` member is its image's mask, not an image (:mod:`pipeline.sources.masks`); with
    ``alpha`` an image whose header declares alpha is its own mask. Exceptions of ``read_range`` (after its retries)
    propagate: the caller decides between ``read_failed`` and stopping the job.
    """
    reads = CountingReads(read_range)
    walk = walk_tar(reads, shard.size, window=window, keep=window)
    out = ShardScan()
    base = {"container": shard.name, "container_size": shard.size, "etag": shard.etag, "mtime": shard.mtime}
    resolved, broken = resolve_links(walk)
    by_key: dict[str, list[TarMember]] = {}
    for member in [*walk.members, *resolved]:
        by_key.setdefault(shard_key(member.name), []).append(member)
    for key, members in by_key.items():
        images = [m for m in members if extension(m.name) in IMAGE_EXTENSIONS]
        mask_member = None
        if masks and "files" in masks:
            mask_members = [m for m in images if is_mask_member(m.name)]
            images = [m for m in images if m not in mask_members]
            out.mask_members += len(mask_members)
            mask_member = min(mask_members, key=lambda m: m.name) if mask_members else None
            members = [m for m in members if m not in mask_members]
        if not images:
            for m in members:
                ext = extension(m.name)
                out.ignored_members[ext] = out.ignored_members.get(ext, 0) + 1
            continue
        caption, captions, source = key_caption(reads, shard.name, members, caption_field)
        out.captions_truncated += source is not None and _caption_member(members, source).size > SIDECAR_LIMIT
        for m in members:
            ext = extension(m.name)
            if m not in images and ext not in (*_CAPTION_EXTENSIONS, "json"):
                out.ignored_members[ext] = out.ignored_members.get(ext, 0) + 1
        out.images += len(images)
        for image in images:
            row = {**base, "filename": f"{shard.name}/{image.name}", "member_offset": image.offset,
                   "size": image.size, "caption": caption, "captions": captions,
                   "caption_source": source}  # fmt: skip
            if image is walk.cut_member:
                probe = checked(Header(error="truncated", message=walk.problem), max_pixels)
            elif image is walk.suspect_member:
                probe = checked(Header(error="corrupt_container", message=(
                    f"the next header is not where this member's declared size ({image.size:,} bytes) puts it: "
                    f"the size is wrong or the shard is corrupt ({walk.problem})")), max_pixels)  # fmt: skip
            elif len(images) > 1:
                others = ", ".join(m.name for m in images if m is not image)
                probe = checked(Header(error="duplicate_key", message=(
                    f"key {key} of shard {shard.name} has {len(images)} images ({image.name}, {others}); a "
                    "WebDataset sample holds one: rename or remove the others")), max_pixels)  # fmt: skip
            else:
                probe = _probe(reads, image, max_pixels, window)
            row.update(width=probe.width, height=probe.height, format=probe.format, orientation=probe.orientation,
                       error=probe.error, message=probe.message, bytes_read=probe.bytes_read)  # fmt: skip
            if mask_member is not None:
                row.update(mask=f"{shard.name}/{mask_member.name}", mask_offset=mask_member.offset,
                           mask_size=mask_member.size)  # fmt: skip
            elif masks and "alpha" in masks and probe.alpha:
                row["mask"] = MASK_ALPHA
            out.rows.append(row)
    for link, kind, message in broken:  # an image named by a link that leads nowhere in the shard
        if extension(link.name) in IMAGE_EXTENSIONS:
            out.images += 1
            out.rows.append({**base, "filename": f"{shard.name}/{link.name}", "error": kind, "message": message})
        else:
            ext = extension(link.name)
            out.ignored_members[ext] = out.ignored_members.get(ext, 0) + 1
    if walk.special:  # devices, FIFOs: no data to read
        out.ignored_members["(not a file)"] = out.ignored_members.get("(not a file)", 0) + walk.special
    if walk.problem:
        out.rows.append({**base, "filename": shard.name, "error": "corrupt_container", "size": shard.size,
                         "message": f"{walk.problem}; {len(walk.members)} members before it were scanned, "
                         "nothing after it (re-create or re-download the shard)"})  # fmt: skip
    out.requests, out.bytes_read = reads.requests, reads.bytes
    return out


def resolve_links(walk: TarWalk, hops: int = 8) -> tuple[list[TarMember], list[tuple[TarLink, str, str]]]:
    """The link entries of a shard as members holding their target's bytes (same offset and size: a
    ranged read of the row reads the target), and the links that lead to no regular member of the
    shard, each with its error kind (``broken_link``, ``link_loop``) and a message.

    A hard link names its target by archive path; a symbolic one relative to its own folder (an
    absolute target, or one leaving the shard's root, leads outside the shard). Links to links are
    followed up to ``hops`` steps.
    """
    files = {m.name: m for m in walk.members}
    links = {link.name: link for link in walk.links}
    resolved: list[TarMember] = []
    broken: list[tuple[TarLink, str, str]] = []
    for link in walk.links:
        at, seen = link, [link.name]
        while True:
            folder = "" if at.hard else posixpath.dirname(at.name)
            path = posixpath.normpath(posixpath.join(folder, at.target))
            if path in files:
                target = files[path]
                resolved.append(TarMember(link.name, target.offset, target.size, target.head))
                break
            if path in links and path not in seen and len(seen) <= hops:
                at = links[path]
                seen.append(path)
                continue
            if path in seen or len(seen) > hops:
                broken.append((link, "link_loop", f"link loop in the shard: {' -> '.join([*seen, path])}"))
            else:
                where = "outside the shard" if at.target.startswith("/") or path.startswith("..") else "in the shard"
                broken.append((link, "broken_link", f"{'hard' if at.hard else 'symbolic'} link to {at.target}, "
                               f"which is no file {where}"))  # fmt: skip
            break
    return resolved, broken


def _probe(reads: CountingReads, image: TarMember, max_pixels: int, window: int):
    """Probe one image member: a JPEG by its segments (EXIF and ICC bodies skipped), anything else, and
    a JPEG that parse declines, by :func:`~pipeline.sources.headers.probe_header` at the member's offset."""
    fetched = [0, 0]  # bytes, requests of this member beyond the walk's

    def read_member(start: int, end: int) -> bytes:
        data = reads(image.offset + start, image.offset + min(end, image.size))
        fetched[0] += len(data)
        fetched[1] += 1
        return data

    head = image.head
    if len(head) < min(image.size, 16):  # its header came at the end of a walk read
        head = read_member(0, min(image.size, window))
    if head.startswith(b"\xff\xd8\xff"):
        header = sparse_jpeg_header(read_member, image.size, head, window)
        if header is not None:
            return checked(header, max_pixels, bytes_read=len(head) + fetched[0], requests=fetched[1])
    return probe_header(read_member, image.size, max_pixels=max_pixels, first_read=window,
                        head=head if len(head) >= min(image.size, _HEAD_MIN) else None, name=image.name)  # fmt: skip


def _member_bytes(reads: CountingReads, member: TarMember) -> bytes:
    limit = min(member.size, SIDECAR_LIMIT)
    if len(member.head) >= limit:
        return member.head[:limit]
    return reads(member.offset, member.offset + limit)


def _caption_member(members: list[TarMember], source: str) -> TarMember:
    """The member a ``caption_source`` (``member:<shard>:<name>[#field]``) was read from."""
    name = source.split(":", 2)[2].split("#", 1)[0]
    return next(m for m in members if m.name == name)


def key_caption(reads: CountingReads, container: str, members: list[TarMember], caption_field: str):
    """``(caption, captions, caption_source)`` of a key: its .txt, else .caption, else the .json field (a
    string, or a list of strings: :func:`~pipeline.sources.captions.caption_list`); else ``(None, None, None)``.

    A .json that is not JSON, or whose field is neither a string nor a non-empty list of strings, gives
    no caption (the image stays usable, a sample with a null caption), as a .json without the field does.
    """
    by_ext = {extension(m.name): m for m in members}
    for ext in _CAPTION_EXTENSIONS:
        if ext in by_ext:
            member = by_ext[ext]
            return decode_caption(_member_bytes(reads, member)), None, f"member:{container}:{member.name}"
    if "json" in by_ext:
        member = by_ext["json"]
        try:
            value = json.loads(_member_bytes(reads, member))
        except ValueError:  # not JSON (or cut at SIDECAR_LIMIT): the image stays usable, without a caption
            return None, None, None
        text = value.get(caption_field) if isinstance(value, dict) else None
        source = f"member:{container}:{member.name}#{caption_field}"
        if isinstance(text, str):
            return normalise_caption(text), None, source
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            caption, captions, _ = caption_list(text)
            if caption is not None:
                return caption, captions, source
    return None, None, None


# --- a Ray task: a batch of shards ---------------------------------------------------------------


T = TypeVar("T")  # what one shard's scan gives: image or video rows


def shard_read_range(fs, path: str) -> tuple[Callable[[int, int], bytes], Callable[[], None]]:
    """A ``read_range`` over ``path`` and a function closing it: ``os.pread`` on a local disk."""
    if type(fs) is LocalFileSystem:
        fd = os.open(path, os.O_RDONLY)
        return (lambda start, end: os.pread(fd, end - start, start)), (lambda: os.close(fd))
    return (lambda start, end: fs.cat_file(path, start=start, end=end)), (lambda: None)


def read_shard(fs, root: str, shard: FileEntry, scan: Callable[[Callable[[int, int], bytes]], T],
               failed: Callable[[dict[str, Any]], T]) -> T:  # fmt: skip
    """``scan(read_range)`` over one shard's bytes (images or videos). A storage failure inside it is
    ``failed(read_failed_row)``, or a StorageError when permanent on remote storage (denied, missing bucket:
    every shard would fail the same); any other exception keeps its traceback."""
    local = type(fs) is LocalFileSystem
    try:
        read_range, close = shard_read_range(fs, join(root, shard.name))
        try:
            return scan(read_range)
        finally:
            close()
    except StorageFailure as e:  # a read inside a probe
        cause = e.cause
    except Exception as e:
        if not is_storage_failure(e):
            raise  # a bug, not storage: keep its traceback
        cause = e
    if is_permanent(cause) and not local:
        raise StorageError(f"reading {shard.name}: {redact(str(cause))}") from None
    return failed(read_failed_row(shard, cause))


def _scan_one(fs, root: str, shard: FileEntry, config: Any) -> ShardScan:
    return read_shard(fs, root, shard,
                      lambda read_range: scan_shard(read_range, shard, max_pixels=config.max_pixels,
                                                    window=config.shard_window, caption_field=config.caption_field,
                                                    masks=getattr(config, "masks", None)),
                      lambda row: ShardScan(rows=[row]))  # fmt: skip


def read_failed_row(container: FileEntry, cause: BaseException) -> dict[str, Any]:
    """The one error row of a container (tar shard, parquet file) whose reads failed after retries; the
    next scan reads it again. The message is redacted."""
    return {"filename": container.name, "container": container.name, "container_size": container.size,
            "etag": container.etag, "mtime": container.mtime, "size": container.size, "error": "read_failed",
            "message": redact(f"{type(cause).__name__}: {cause}")}  # fmt: skip


def scan_shards(fs, root: str, shards: list[FileEntry], config: Any) -> pa.Table:
    """Scan ``shards`` (names relative to ``root`` on ``fs``), up to ``config.reads_in_flight`` at once.

    Returns a :data:`SHARD_ROWS` table; its schema metadata ``stats`` holds the summed counts
    (requests, bytes_read, images, ignored_members). Raises StorageError for a permanent
    failure of an object store (access denied).
    """
    threads = 1 if type(fs) is LocalFileSystem else max(1, min(config.reads_in_flight, len(shards)))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shard") as pool:
        scans = list(pool.map(lambda s: _scan_one(fs, root, s, config), shards))
    return combine_scans(scans, SHARD_ROWS)


def combine_scans(scans: list, schema: pa.Schema) -> pa.Table:
    """The rows of per-container scans (:class:`ShardScan`, or a parquet file's scan) as one ``schema``
    table whose metadata ``stats`` holds their summed counts: shards (containers), requests, bytes_read,
    images and ignored_members by extension."""
    stats: dict[str, Any] = {"shards": len(scans), "requests": 0, "bytes_read": 0, "images": 0,
                             "captions_truncated": 0, "ignored_members": {}, "mask_members": 0}  # fmt: skip
    rows: list[dict[str, Any]] = []
    for scan in scans:
        rows.extend(scan.rows)
        for name in ("requests", "bytes_read", "images", "captions_truncated", "mask_members"):
            stats[name] += getattr(scan, name, 0)
        for ext, n in getattr(scan, "ignored_members", {}).items():
            stats["ignored_members"][ext] = stats["ignored_members"].get(ext, 0) + n
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    return pa.table(columns, schema=schema).replace_schema_metadata({"stats": json.dumps(stats)})


SHARD_WORK = pa.schema([("name", pa.string()), ("size", pa.int64()), ("etag", pa.string()), ("mtime", pa.float64())])


def shard_work(shards: list[FileEntry]) -> pa.Table:
    """``shards`` as the columns a Ray task is sent (:data:`SHARD_WORK`)."""
    columns = [[getattr(s, f.name) for s in shards] for f in SHARD_WORK]
    return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, SHARD_WORK)], schema=SHARD_WORK)


def open_work(target: tuple, batch: pa.Table) -> tuple[Any, str, list[FileEntry]]:
    """In a Ray task: ``(fs, root, containers)`` for a :func:`shard_work` ``batch`` of ``target``
    (``(source, storage_options, fs or None, root)``), with the image plugins registered."""
    source, storage_options, fs, root = target
    if fs is None:
        fs, root = open_url(source, storage_options)
    register_plugins()
    return fs, root, [FileEntry(*row) for row in zip(*(batch.column(n).to_pylist() for n in SHARD_WORK.names))]


def scan_shard_batch(target: tuple, batch: pa.Table, config: Any) -> pa.Table:
    """One Ray task: :func:`scan_shards` over the shards of ``batch`` (a :func:`shard_work` table)."""
    fs, root, shards = open_work(target, batch)
    return scan_shards(fs, root, shards, config)
