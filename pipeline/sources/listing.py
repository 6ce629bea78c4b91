"""List a dataset once: image files (by extension) with size, ETag and mtime, and caption sidecars.

Object stores list keys in pages of 1,000 and each page needs the previous page's last key, so a
million-key prefix is a 1,000-request chain. :func:`list_source` splits the key space instead: each
ListObjectsV2 call covers a key range ``(after, upto]``; when a page comes back truncated, the
rest of the range is cut in two at a key between the last key seen and the range's end, and both
halves are listed in parallel. The split is exact whatever the key distribution (a badly placed
cut only costs one request that finds nothing). A local folder is walked with ``os.scandir``, other
filesystems use ``fs.find``.

What a rescan reuses of the previous manifest is decided apart, from this listing
(:mod:`pipeline.sources.rescan`). An image with numbered sidecars (``img.txt``/``img.0.txt``,
``img.1.txt``, ...: :func:`image_sidecars`) has several captions.

Tar files (``.tar``) are WebDataset shards, scanned by :mod:`pipeline.sources`; ``.tar.gz`` and
``.tgz`` are listed apart so that the scan can refuse them with a reason. ``.parquet`` files are
listed apart too (``Listing.parquet``): ``scan --format parquet`` reads their image column; any
other scan counts them as ignored files, or names the option when they are all the source holds.

Images: the extensions of every format this Pillow (and its installed plugins) can identify and
decode (:data:`pipeline.formats.IMAGE_EXTENSIONS`), in any case. Hidden files and folders (any path
part starting with ``.``, so also macOS ``._*`` AppleDouble files) and other files are skipped and
counted as ``ignored``; the others also by extension (``Listing.ignored_extensions``), so that
200,000 ``.heic`` files without the HEIF plugin are a visible line, not a silent count. A name that
is not valid UTF-8 (possible on a local disk) cannot be a manifest row: it is ignored and counted
under the extension ``(name not UTF-8)``. On a local disk symbolic links are followed; one that leads
to no file (dangling, or a loop) is in ``Listing.link_errors`` when it is named as an image (an error row
``broken_link`` or ``link_loop``), else an ignored file counted as ``(broken link)``/``(link loop)``;
FIFOs, sockets and devices are counted as ``(not a regular file)``.
"""

from __future__ import annotations

import datetime as _dt
import errno
import os
import stat
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pyarrow as pa
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from manifests.errors import MissingError, UsageError
from manifests.manifest import conform
from manifests.schema import ERRORS_SCHEMA, SAMPLES_SCHEMA, sample_ids
from manifests.storage import is_local
from pipeline.formats import IMAGE_EXTENSIONS
from pipeline.sources.captions import SIDECAR_EXTENSIONS, sidecar_number, sidecar_stem
from manifests.retry import with_retries

__all__ = [
    "IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "IMAGE_SCHEMA", "WORK_SCHEMA", "FileEntry", "Listing", "WorkItem",
    "list_source", "classify", "extension", "work_table", "work_items", "image_sidecars", "link_error_rows",
]  # fmt: skip

IMAGE_SCHEMA = pa.schema([f for f in SAMPLES_SCHEMA if f.name != "bucket"])  # a sample before bucketing
PAGE_SIZE = 1000  # the S3 maximum per ListObjectsV2 call
NOT_UTF8 = "(name not UTF-8)"  # the ignored_extensions key of names that cannot be a manifest row
VIDEO_EXTENSIONS = frozenset({"mp4", "mov", "webm", "mkv"})  # scanned with --frames (pipeline/scan/video.py)
NOT_REGULAR = "(not a regular file)"  # the ignored_extensions key of FIFOs, sockets and devices


@dataclass(frozen=True)
class FileEntry:
    """One listed file: ``name`` relative to the root (``/``-separated), size in bytes, ETag, mtime (s)."""

    name: str
    size: int
    etag: str | None
    mtime: float | None


@dataclass
class Listing:
    images: list[FileEntry] = field(default_factory=list)
    shards: list[FileEntry] = field(default_factory=list)  # .tar files: WebDataset shards (pipeline/sources)
    compressed_shards: list[str] = field(default_factory=list)  # .tar.gz/.tgz names: refused by the scan
    parquet: list[FileEntry] = field(default_factory=list)  # .parquet files: scanned with --format parquet
    videos: list[FileEntry] = field(default_factory=list)  # VIDEO_EXTENSIONS: scanned with --frames, else ignored
    sidecars: dict[str, FileEntry] = field(default_factory=dict)  # image stem -> its caption file
    numbered: dict[str, dict[int, FileEntry]] = field(default_factory=dict)  # image stem -> number -> img.N.txt
    link_errors: list[tuple[str, str, str]] = field(default_factory=list)  # image names: (name, kind, message)
    ignored_hidden: int = 0
    ignored_extensions: dict[str, int] = field(default_factory=dict)  # other files by extension ("" for none)
    requests: int = 0
    seconds: float = 0.0

    @property
    def ignored_other(self) -> int:
        return sum(self.ignored_extensions.values())

    @property
    def ignored(self) -> int:
        return self.ignored_hidden + self.ignored_other


class WorkItem(NamedTuple):
    """One file for a scan task: an image to probe and/or the sidecar caption to read with it."""

    name: str  # the image, relative to the root
    size: int  # its bytes
    probe: bool  # read the image's header (False: only its sidecar, for a reused row)
    sidecar: str | None = None  # the caption file to read, relative to the root
    sidecar_size: int = 0


WORK_SCHEMA = pa.schema([("name", pa.string()), ("size", pa.int64()), ("probe", pa.bool_()),
                         ("sidecar", pa.string()), ("sidecar_size", pa.int64())])  # fmt: skip


def work_table(items: list[WorkItem]) -> pa.Table:
    """``items`` as columns (:data:`WORK_SCHEMA`): what a Ray task is sent, without an object per file."""
    columns = list(zip(*items)) if items else [[] for _ in WORK_SCHEMA]
    return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, WORK_SCHEMA)], schema=WORK_SCHEMA)


def work_items(table: pa.Table) -> list[WorkItem]:
    """The :class:`WorkItem` rows of a :func:`work_table`."""
    return [WorkItem(*row) for row in zip(*(table.column(name).to_pylist() for name in WORK_SCHEMA.names))]


def extension(name: str) -> str:
    """The lower-case extension of a root-relative file name, without the dot ("" for none)."""
    base = name.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""


def _utf8(name: str) -> bool:
    if name.isascii():
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes of a local file name, kept as lone surrogates
        return False
    return True


def classify(name: str) -> str:
    """``image``, ``video``, ``sidecar``, ``shard``, ``compressed_shard``, ``parquet``, ``hidden`` or ``other`` for a
    root-relative name."""
    if name.startswith(".") or "/." in name:  # a hidden file, or one in a hidden folder
        return "hidden"
    ext = extension(name)
    if ext == "tar" and _utf8(name):
        return "shard"
    if ext == "tgz" or name.lower().endswith(".tar.gz"):
        return "compressed_shard"
    if ext == "parquet" and _utf8(name):
        return "parquet"
    if ext in IMAGE_EXTENSIONS:
        return "image" if _utf8(name) else "other"
    if ext in VIDEO_EXTENSIONS and _utf8(name):
        return "video"
    if f".{ext}" in SIDECAR_EXTENSIONS:
        return "sidecar"
    return "other"


def list_source(fs: AbstractFileSystem, root: str, *, page_size: int = PAGE_SIZE, workers: int = 16,
                skip: str | None = None) -> Listing:  # fmt: skip
    """List everything under ``root`` once and sort it into images, sidecars and ignored files. ``skip``: a
    folder under ``root`` (relative) left out entirely, the job's own output when it is written inside the source.

    Raises FileNotFoundError when a local root does not exist; storage errors (403, missing
    bucket) propagate from the filesystem.
    """
    start = time.perf_counter()
    problems: list[tuple[str, str, str]] = []
    special = 0
    if hasattr(fs, "call_s3"):
        entries, requests = _list_s3(fs, root, page_size, workers)
    elif type(fs) is LocalFileSystem:  # a subclass may override its listing: it gets fs.find
        if not os.path.isdir(root):
            raise MissingError(f"source folder {root} does not exist")
        (entries, problems, special), requests = with_retries(lambda: _list_local(root)), 1
    else:
        if is_local(fs) and not fs.isdir(root):
            raise MissingError(f"source folder {root} does not exist")
        found = with_retries(lambda: fs.find(root, detail=True, withdirs=False))
        prefix = fs._strip_protocol(root).rstrip("/") + "/"
        outside = next((p for p in found if not p.startswith(prefix)), None)
        if outside is not None:  # e.g. a relative root on a filesystem that returns absolute paths
            raise UsageError(f"listing {root} returned {outside}, which is not under it; give an absolute path")
        entries = [_entry(path[len(prefix) :], info) for path, info in found.items()]
        requests = 1
    if skip:
        entries = [e for e in entries if e.name != skip and not e.name.startswith(skip + "/")]
    listing = Listing(requests=requests)
    for entry in entries:
        kind = classify(entry.name)
        if kind == "image":
            listing.images.append(entry)
        elif kind == "sidecar":
            stem = sidecar_stem(entry.name)
            _keep_first(listing.sidecars, stem, entry)
            base, number = sidecar_number(stem)
            if base != stem:  # img.N.txt: caption N of img (unless an image img.N.jpg exists: see below)
                _keep_first(listing.numbered.setdefault(base, {}), number, entry)
        elif kind == "shard":
            listing.shards.append(entry)
        elif kind == "compressed_shard":
            listing.compressed_shards.append(entry.name)
        elif kind == "parquet":
            listing.parquet.append(entry)
        elif kind == "video":
            listing.videos.append(entry)
        elif kind == "hidden":
            listing.ignored_hidden += 1
        else:
            ext = extension(entry.name) if _utf8(entry.name) else NOT_UTF8
            listing.ignored_extensions[ext] = listing.ignored_extensions.get(ext, 0) + 1
    _sort_links(listing, problems, special)
    if listing.numbered:  # img.1.txt next to an image img.1.jpg is that image's caption, not img's second
        stems = {sidecar_stem(e.name) for e in listing.images}
        for base, numbered in list(listing.numbered.items()):
            numbered = {n: e for n, e in numbered.items() if sidecar_stem(e.name) not in stems}
            listing.numbered[base] = numbered
    listing.images.sort(key=lambda e: e.name)
    listing.shards.sort(key=lambda e: e.name)
    listing.parquet.sort(key=lambda e: e.name)
    listing.videos.sort(key=lambda e: e.name)
    listing.compressed_shards.sort()
    listing.seconds = time.perf_counter() - start
    return listing


def _sort_links(listing: Listing, problems: list[tuple[str, str, str]], special: int) -> None:
    """Links leading to no file: an error row each when named as an image, else an ignored file
    counted as ``(broken link)``/``(link loop)``; FIFOs, sockets, devices as ``(not a regular file)``."""
    for name, kind, message in problems:
        what = classify(name) if _utf8(name) else "other"
        if what == "image":
            listing.link_errors.append((name, kind, message))
        elif what == "hidden":
            listing.ignored_hidden += 1
        else:
            key = f"({kind.replace('_', ' ')})"
            listing.ignored_extensions[key] = listing.ignored_extensions.get(key, 0) + 1
    if special:
        listing.ignored_extensions[NOT_REGULAR] = listing.ignored_extensions.get(NOT_REGULAR, 0) + special
    listing.link_errors.sort()


def link_error_rows(listing: Listing) -> pa.Table:
    """The error rows (:data:`manifests.schema.ERRORS_SCHEMA`) of the image names whose links lead to no file."""
    names = [name for name, _, _ in listing.link_errors]
    return conform(pa.table({
        "sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": pa.array(names, pa.string()),
        "error": pa.array([kind for _, kind, _ in listing.link_errors], pa.string()),
        "message": pa.array([message for _, _, message in listing.link_errors], pa.string()),
    }), ERRORS_SCHEMA)  # fmt: skip


def _keep_first(sidecars: dict, key: Any, entry: FileEntry) -> None:
    """Put ``entry`` at ``key`` unless a sidecar that wins is there: .txt wins over .caption whatever
    order the store lists them in."""
    current = sidecars.get(key)
    rank = SIDECAR_EXTENSIONS.index
    if current is None or rank(_ext(entry.name)) < rank(_ext(current.name)):
        sidecars[key] = entry


def image_sidecars(listing: Listing, name: str) -> list[FileEntry]:
    """The caption files of image ``name`` in caption order: ``img.txt`` (else ``img.0.txt``), then
    ``img.1.txt``, ``img.2.txt``, ... by number (see :func:`pipeline.sources.captions.sidecar_number`)."""
    stem = sidecar_stem(name)
    first = listing.sidecars.get(stem)
    numbered = listing.numbered.get(stem)
    if not numbered:
        return [first] if first else []
    by_number = dict(numbered)
    if first is not None:
        by_number[0] = first  # img.txt wins over img.0.txt
    return [by_number[n] for n in sorted(by_number)]


def _link_problem(path: str, name: str, error: OSError) -> tuple[str, str, str] | None:
    """``(name, kind, message)`` of a symbolic link ``path`` that leads to no file; None when it is no link
    (a file gone since its folder was read)."""
    if not os.path.islink(path):
        return None
    chain, at = [name], path
    for _ in range(8):  # the chain as the user wrote it, for the message
        if not os.path.islink(at):
            break
        target = os.readlink(at)
        chain.append(target)
        at = os.path.join(os.path.dirname(at), target)
    if error.errno == errno.ELOOP:
        return name, "link_loop", f"symbolic link loop: {' -> '.join(chain)} -> ..."
    return name, "broken_link", f"symbolic link to {' -> '.join(chain[1:])}, which does not exist"


def _list_local(root: str) -> tuple[list[FileEntry], list[tuple[str, str, str]], int]:
    """Every regular file under the local folder ``root``: one ``stat`` each (fsspec's ``find`` builds
    an info dict per file, several times the cost). Symbolic links are followed, each folder once.
    Also returns the links that lead to no file (``(name, kind, message)``) and how many entries are
    neither files nor folders (FIFOs, sockets, devices)."""
    entries = []
    problems: list[tuple[str, str, str]] = []
    special = 0
    seen: set[tuple[int, int]] = set()
    folders = [("", root)]
    while folders:
        prefix, folder = folders.pop()
        info = os.stat(folder)
        if (info.st_dev, info.st_ino) in seen:  # a link back up the tree
            continue
        seen.add((info.st_dev, info.st_ino))
        with os.scandir(folder) as found:
            for item in found:
                try:
                    if item.is_dir():
                        folders.append((f"{prefix}{item.name}/", item.path))
                        continue
                    info = item.stat()
                except OSError as e:  # a dangling link or a loop; or a file gone since the folder was read
                    problem = _link_problem(item.path, prefix + item.name, e)
                    problems += [problem] if problem else []
                    continue
                if stat.S_ISREG(info.st_mode):
                    entries.append(FileEntry(prefix + item.name, info.st_size, None, info.st_mtime))
                else:
                    special += 1
    return entries, problems, special


def _ext(name: str) -> str:
    return "." + name.rsplit(".", 1)[-1].lower()


def _mtime(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, _dt.datetime):
        return value.timestamp()
    return None


def _entry(name: str, info: dict[str, Any]) -> FileEntry:
    etag = info.get("ETag") or info.get("etag")
    mtime = _mtime(info.get("mtime", info.get("LastModified", info.get("created"))))
    return FileEntry(name, int(info.get("size") or 0), etag.strip('"') if etag else None, mtime)


def _list_s3(fs: AbstractFileSystem, root: str, page_size: int, workers: int) -> tuple[list[FileEntry], int]:
    bucket, _, key_prefix = root.partition("/")
    prefix = f"{key_prefix.rstrip('/')}/" if key_prefix else ""

    def page(after: str | None, upto: str | None) -> tuple[list[FileEntry], str | None, bool]:
        """One ListObjectsV2 call over keys in (after, upto]: entries, last key, more to come."""
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": page_size}
        if after is not None:
            kwargs["StartAfter"] = after
        if hasattr(fs, "list_page"):  # manifests.objstore: the page through obstore
            response = with_retries(lambda: fs.list_page(bucket, prefix, page_size, after))
        else:
            response = with_retries(lambda: fs.call_s3("list_objects_v2", **kwargs))
        out = []
        contents = response.get("Contents", [])
        for obj in contents:
            if upto is not None and obj["Key"] > upto:
                return out, None, False
            if not obj["Key"].endswith("/"):  # folder markers are not files
                out.append(_entry(obj["Key"][len(prefix) :], {**obj, "size": obj["Size"]}))
        more = bool(response.get("IsTruncated")) and bool(contents)
        return out, (contents[-1]["Key"] if contents else None), more

    entries: list[FileEntry] = []
    requests = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="list") as pool:
        pending = {pool.submit(page, None, None): None}  # future -> its range's upper bound
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                upto = pending.pop(future)
                found, last, more = future.result()
                requests += 1
                entries.extend(found)
                if not more or last is None:
                    continue
                mid = _between(last, upto, prefix) if len(pending) < workers else None
                if mid is None:
                    pending[pool.submit(page, last, upto)] = upto
                else:
                    pending[pool.submit(page, last, mid)] = mid
                    pending[pool.submit(page, mid, upto)] = upto
    return entries, requests


def _between(lo: str, hi: str | None, prefix: str, digits: int = 6) -> str | None:
    """A key strictly between ``lo`` and ``hi`` (``None``: no upper bound), or None if none is found.

    Keys are compared as code points (S3 orders by UTF-8 bytes, which is the same order). The
    midpoint is taken in base 96 over printable ASCII after the common prefix; any key works as a
    cut, so a non-ASCII key space only makes the cut less even, never wrong.
    """
    common = prefix
    if hi is not None:
        n = 0
        while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
            n += 1
        common = lo[:n]
    base, first = 96, 0x20

    def value(s: str | None) -> int:
        rest = s[len(common) :] if s is not None else ""
        out = 0
        for i in range(digits):
            d = base - 1 if s is None else (min(max(ord(rest[i]) - first, 0), base - 1) if i < len(rest) else 0)
            out = out * base + d
        return out

    mid = (value(lo) + value(hi)) // 2
    chars = []
    for _ in range(digits):
        mid, d = divmod(mid, base)
        chars.append(chr(first + d))
    candidate = common + "".join(reversed(chars)).rstrip(" ")
    if candidate > lo and (hi is None or candidate < hi):
        return candidate
    return None
