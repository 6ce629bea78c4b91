"""Paired conditioning images (``scan --conditioning ROOT_OR_COLUMN``): one per sample, in its manifest row.

Where a sample's conditioning image is (:func:`resolve`):

- a **column** of the ``--captions`` table, when the table has a column of that name: its value is
  the conditioning image's path relative to the source root (a sample the table does not name, or
  names with an empty value, has no pair: ``conditioning_missing``);
- otherwise a **root** (local folder or URL): the conditioning image has the sample's own relative
  path under it (``ds/a/1.jpg`` pairs with ``ROOT/a/1.jpg``).

Conditioning images that lie under the source root are not samples of their own: they are taken out
of the listing before the scan (:meth:`Pairing.exclude`). The pair is checked after the targets are
probed (:func:`pair`): the conditioning image's header is read through the scan's own probe path
(:func:`pipeline.scan.probing.scan_batch` in Ray tasks, batched like the targets), and it must show the
target's size in display orientation (after EXIF orientation). A sample without its conditioning
image is a ``conditioning_missing`` error row, one of another size ``conditioning_mismatch``, one whose
header cannot be read ``conditioning_unusable``. A reused sample whose conditioning image is the listed
version (size and ETag, else mtime) is not probed again; every other pair is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from manifests.errors import StorageError, UsageError
from manifests.retry import is_storage_failure
from manifests.manifest import conform
from manifests.manifest_meta import ManifestConditioning
from manifests.schema import CONDITIONING_COLUMNS, ERRORS_SCHEMA
from manifests.storage import open_url, redact
from pipeline.sources.captions import read_table, table_filenames
from pipeline.sources.listing import IMAGE_SCHEMA, FileEntry, Listing, WorkItem, list_source
from pipeline.sources.rescan import unchanged

__all__ = ["CONDITIONING_ERRORS", "Pairing", "resolve", "pair"]

CONDITIONING_ERRORS = ("conditioning_missing", "conditioning_mismatch", "conditioning_unusable")


@dataclass(frozen=True)
class Pairing:
    """Where each sample's conditioning image is: ``root`` (URL) and, in column mode, ``paths``
    ``{filename: conditioning path relative to the root}``; ``entries`` lists the root's images."""

    option: str  # --conditioning as given
    root: str  # URL of the conditioning root (the source root in column mode)
    column: str | None  # the --captions column, or None: the same relative path under ``root``
    paths: dict[str, str | None] | None
    entries: dict[str, FileEntry]  # conditioning images listed under the root, by relative path
    inside: str | None  # the conditioning root relative to the source root, when it lies under it

    def path_of(self, filename: str) -> str | None:
        """The conditioning image of sample ``filename``, relative to :attr:`root` (None: no pair)."""
        return filename if self.paths is None else self.paths.get(filename)

    def exclude(self, listing: Listing) -> tuple[Listing, int]:
        """``listing`` without the conditioning images that lie under the source root, and their count."""
        if self.paths is not None:
            drop = {p for p in self.paths.values() if p}
            keep = [e for e in listing.images if e.name not in drop]
        elif self.inside is not None:
            prefix = self.inside + "/" if self.inside else ""
            keep = [e for e in listing.images if not e.name.startswith(prefix)] if prefix else []
        else:
            return listing, 0
        return replace(listing, images=keep), len(listing.images) - len(keep)

    def meta(self) -> ManifestConditioning:
        """What ``_manifest.json`` records as ``conditioning``."""
        return ManifestConditioning(root=self.root, column=self.column)


def resolve(option: str, source: str, captions: str | None, storage_options: dict[str, Any] | None,
            fs=None) -> Pairing:  # fmt: skip
    """Resolve ``--conditioning`` (a ``--captions`` column name, else a root URL) and list the
    conditioning images. ``fs`` is the source's filesystem when a caller replaced it (tests).

    Raises UsageError when the root is the source root itself or has no images, StorageError when
    it cannot be listed.
    """
    column, paths = None, None
    if captions and "/" not in option and "://" not in option:
        table = read_table(captions, storage_options)
        if option in table.column_names:
            column = option
            values = table.column(option).cast(pa.string()).to_pylist()
            paths = {n: _clean(v) for n, v in zip(table_filenames(table, captions), values)}
    root_url = source if column else option
    source_fs, source_root = (fs, fs._strip_protocol(source).rstrip("/")) if fs is not None else open_url(
        source, storage_options)
    cfs, root = (source_fs, source_root) if column else open_url(root_url, storage_options)
    root = root.rstrip("/")
    if column is None and root == source_root:
        raise UsageError(f"--conditioning {redact(option)} is the source root itself: give the folder of the "
                         "conditioning images, or a column of the --captions table")
    try:
        listing = list_source(cfs, root)
    except FileNotFoundError:
        raise UsageError(f"--conditioning {redact(option)}: no such folder, and no column of that name in "
                         f"--captions{' ' + redact(captions) if captions else ' (none given)'}") from None
    except Exception as e:
        if is_storage_failure(e):  # retried already: denied, or the endpoint is gone
            raise StorageError(redact(f"cannot list --conditioning {option}: {e}", storage_options)) from None
        raise
    if not listing.images:
        raise UsageError(f"--conditioning {redact(option)}: no images there")
    inside = ""  # column mode: the paths are under the source root
    if column is None:
        under = type(cfs) is type(source_fs) and root.startswith(source_root + "/")
        inside = root[len(source_root) + 1 :] if under else None
    return Pairing(option, root_url, column, paths, {e.name: e for e in listing.images}, inside)


def _clean(value: str | None) -> str | None:
    if value is None or not value.strip():
        return None
    value = value.strip().replace("\\", "/")
    while value.startswith("./"):
        value = value[2:]
    return value.lstrip("/")


def pair(images: pa.Table, errors: pa.Table, probed_names: set[str], pairing: Pairing, probe) -> tuple:
    """Pair every image row with its conditioning image; returns ``(images, errors, stats)``.

    ``images`` (IMAGE_SCHEMA) and ``errors`` (ERRORS_SCHEMA) are the scan's rows, reused and new;
    ``probed_names`` the targets read in this scan (the others were reused). Reused error rows of a
    conditioning kind are judged again (their target is fine). ``probe(items)`` probes
    :class:`WorkItem` s under the conditioning root and returns a PROBE_SCHEMA table.
    """
    again = pc.is_in(errors.column("error"), pa.array(CONDITIONING_ERRORS))
    candidates = pa.concat_tables([images, conform(errors.filter(again), IMAGE_SCHEMA)])
    errors = errors.filter(pc.invert(again))
    rows = candidates.select(["filename", *CONDITIONING_COLUMNS]).to_pylist()
    pairs = [pairing.path_of(r["filename"]) for r in rows]
    todo: dict[str, WorkItem] = {}
    for i, (row, path) in enumerate(zip(rows, pairs)):
        entry = pairing.entries.get(path) if path else None
        if entry is None or (i < images.num_rows and _kept(row, path, entry, probed_names)):
            continue
        todo[path] = WorkItem(path, entry.size, True)
    probes = probe(sorted(todo.values())) if todo else None
    found = {} if probes is None else {n: i for i, n in enumerate(probes.column("name").to_pylist())}
    cols = probes.select(["width", "height", "error", "message"]).to_pydict() if probes is not None else {}
    width, height = candidates.column("width").to_pylist(), candidates.column("height").to_pylist()
    kinds, messages = [], []
    for i, (row, path) in enumerate(zip(rows, pairs)):
        entry = pairing.entries.get(path) if path else None
        kind = message = None
        if entry is None:
            kind = "conditioning_missing"
            message = (f"no conditioning image in column {pairing.column!r} of --captions" if path is None else
                       f"conditioning image {path} not found under {redact(pairing.root)}")  # fmt: skip
        elif path in todo:
            at = found[path]
            if cols["error"][at] is not None:
                kind = "conditioning_unusable"
                message = f"conditioning image {path}: {cols['error'][at]}: {cols['message'][at]}"
            elif (cols["width"][at], cols["height"][at]) != (width[i], height[i]):
                kind = "conditioning_mismatch"
                message = (f"conditioning image {path} is {cols['width'][at]}x{cols['height'][at]}, the image is "
                           f"{width[i]}x{height[i]} (display orientation): a pair must be the same size")  # fmt: skip
        kinds.append(kind)
        messages.append(message)
    entries = [pairing.entries.get(p) if p else None for p in pairs]
    candidates = _with_conditioning(candidates, pairs, entries)
    bad = pa.array([k is not None for k in kinds], pa.bool_())
    rejected = candidates.filter(bad)
    rejected = rejected.append_column("error", pa.array([k for k in kinds if k], pa.string()))
    rejected = rejected.append_column("message", pa.array([m for m in messages if m], pa.string()))
    stats = {"conditioning_probed": len(todo), "conditioning_errors": rejected.num_rows}
    return (conform(candidates.filter(pc.invert(bad)), IMAGE_SCHEMA),
            pa.concat_tables([errors, conform(rejected, ERRORS_SCHEMA)]), stats)  # fmt: skip


def _kept(row: dict, path: str, entry: FileEntry, probed_names: set[str]) -> bool:
    """A reused sample whose recorded conditioning image is the one listed now needs no probe."""
    return (row["filename"] not in probed_names and row["conditioning"] == path
            and row["conditioning_size"] is not None
            and unchanged(entry, row["conditioning_size"], row["conditioning_etag"], row["conditioning_mtime"]))


def _with_conditioning(table: pa.Table, paths: list[str | None], entries: list[FileEntry | None]) -> pa.Table:
    columns = {
        "conditioning": pa.array(paths, pa.string()),
        "conditioning_size": pa.array([e and e.size for e in entries], pa.int64()),
        "conditioning_etag": pa.array([e and e.etag for e in entries], pa.string()),
        "conditioning_mtime": pa.array([e and e.mtime for e in entries], pa.float64()),
    }
    for name, values in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, values)
    return table


def probe_target(pairing: Pairing, storage_options: dict[str, Any] | None, fs=None) -> tuple:
    """The ``target`` tuple of :func:`pipeline.scan.probing.scan_batch` for the conditioning root
    (``fs``: the source's replaced filesystem, used in column mode)."""
    if fs is not None and pairing.column is not None:
        return (pairing.root, storage_options, fs, fs._strip_protocol(pairing.root).rstrip("/"))
    return (pairing.root, storage_options, None, open_url(pairing.root, storage_options)[1].rstrip("/"))
