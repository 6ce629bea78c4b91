"""``_manifest.json``, typed: :class:`ManifestMeta`, parsed once where the file is read.

    meta = ManifestMeta.from_json(json.loads(text), url)   # kind and format version checked
    meta.counts.samples, meta.parts.samples[0].sha256, meta.bucket_spec.area, meta.summary.files_read
    meta.to_json() == json.loads(text)                     # exactly the dict that was written

Attribute names are the JSON keys. Keys that older manifests lack (``max_pixels``, ``conditioning``,
``counts.listed``, a part's ``bytes``, most summary figures) are optional attributes that read None,
and :meth:`ManifestMeta.to_json` leaves them out again, so a file read and written back is the same
bytes. The scan's ``summary`` is an audit record that grew with every source kind: the figures code
reads are typed attributes of :class:`ScanSummary`, every other key is kept as it was in ``other``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from manifests.buckets import BucketSpec
from manifests.errors import MissingError, UsageError
from manifests.schema import FORMAT_VERSION
from manifests.storage import redact

__all__ = [
    "MANIFEST_KIND",
    "ManifestError",
    "ManifestMissingError",
    "ManifestCounts",
    "ManifestPart",
    "ManifestParts",
    "ManifestConditioning",
    "ScanSummary",
    "ManifestMeta",
]

MANIFEST_KIND = "bucketeer.manifest"
_FILE = "_manifest.json"
VERSION_HINT = "Rescan with this version, or use the bucketeer that wrote it."


class ManifestError(UsageError):
    """A manifest folder is missing, uncommitted, of another format version, or malformed."""


class ManifestMissingError(ManifestError, MissingError):
    """A folder without ``_manifest.json``: no manifest there, or its scan never committed."""


def _optional_json(obj: Any) -> dict[str, Any]:
    """The dataclass ``obj`` as a dict of its fields, leaving out those that are None (absent in the file)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) is not None}


def _build(cls: type, d: Any, what: str, url: str):
    """``cls(**d)`` for a JSON object ``d``; ManifestError naming ``what`` when it is not one, or has
    keys ``cls`` does not know, or lacks one it needs."""
    if not isinstance(d, Mapping):
        raise ManifestError(f"{redact(url)}/{_FILE}: {what} is not a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ManifestError(f"{redact(url)}/{_FILE}: unknown {what} keys {unknown}")
    try:
        return cls(**d)
    except TypeError as e:  # a required key is absent
        raise ManifestError(f"{redact(url)}/{_FILE}: {what}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class ManifestCounts:
    """``counts``: rows of the two tables, and what the scan listed (absent before it counted them)."""

    samples: int
    errors: int
    listed: int | None = None  # image files listed (tar/parquet: images found in the containers)
    ignored: int | None = None  # other files: hidden ones, and by extension in the summary
    shards: int | None = None  # tar shards or parquet files scanned (container sources only)

    def to_json(self) -> dict[str, int]:
        return _optional_json(self)


@dataclass(frozen=True, kw_only=True)
class ManifestPart:
    """One parquet part: ``path`` relative to the manifest root, its rows, sha256 and size in bytes."""

    path: str
    rows: int
    sha256: str
    bytes: int | None = None  # absent in manifests written before it was recorded: ask the store

    def to_json(self) -> dict[str, Any]:
        return _optional_json(self)


@dataclass(frozen=True, kw_only=True)
class ManifestParts:
    """``parts``: the samples and errors parts, in order."""

    samples: tuple[ManifestPart, ...]
    errors: tuple[ManifestPart, ...]

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        return {"samples": [p.to_json() for p in self.samples], "errors": [p.to_json() for p in self.errors]}

    @classmethod
    def from_json(cls, d: Any, url: str) -> ManifestParts:
        if not isinstance(d, Mapping) or set(d) != {"samples", "errors"}:
            raise ManifestError(f"{redact(url)}/{_FILE}: parts must have exactly the keys samples and errors")
        return cls(**{kind: tuple(_build(ManifestPart, p, f"parts.{kind}[]", url) for p in d[kind])
                      for kind in ("samples", "errors")})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ManifestConditioning:
    """``conditioning`` (``scan --conditioning``): the root the ``conditioning`` column's paths are
    relative to, and the ``--captions`` column they came from (None: the sample's own path)."""

    root: str
    column: str | None

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "column": self.column}


@dataclass(frozen=True, kw_only=True)
class ScanSummary:
    """``summary``: the producing job's figures (scan, rebucket). Typed where code reads them; None
    when the file does not have the key (another source kind, an older scan). Every other key, and
    typed keys written as null, stay in ``other`` as they were, so :meth:`to_json` gives the dict back.
    """

    # every scan
    listed: int | None = None
    samples: int | None = None
    errors: int | None = None
    errors_by_kind: dict[str, int] | None = None
    ignored: int | None = None
    ignored_hidden: int | None = None
    ignored_extensions: dict[str, int] | None = None  # other files by extension ("" for none)
    reused: int | None = None
    new: int | None = None
    changed: int | None = None
    deleted: int | None = None
    previous: str | None = None  # the manifest rows were reused from (redacted)
    files_read: int | None = None
    requests: int | None = None  # storage requests of the reads
    bytes_read: int | None = None
    mb_read: float | None = None
    median_bytes_read: int | None = None
    requests_per_file: float | None = None
    captions_read: int | None = None  # sidecars read
    caption_read_failures: int | None = None
    caption_lists: int | None = None  # samples with several captions
    empty_captions_dropped: int | None = None  # empty entries left out of caption lists
    captions_truncated: int | None = None  # captions over 1 MiB (sidecars, caption members), cut there
    seconds: float | None = None  # driver seconds, Ray start-up left out
    files_per_s: float | None = None
    # scan --conditioning
    conditioning_probed: int | None = None
    conditioning_errors: int | None = None
    conditioning_files: int | None = None
    # tar shards and parquet files
    source_format: str | None = None  # webdataset | parquet
    image_column: str | None = None  # parquet: the column of image bytes (embed reads it)
    caption_column: str | None = None
    caption_field: str | None = None  # tar: the .json field captions came from
    shards: int | None = None
    shards_read: int | None = None
    images_read: int | None = None
    shard_bytes: int | None = None  # bytes of the containers read
    no_caption: int | None = None
    ignored_members: dict[str, int] | None = None
    # a mixed folder (loose images and tar shards): how many images came from each, the shards' reuse
    images_loose: int | None = None
    images_in_shards: int | None = None
    shards_reused: int | None = None
    shards_new: int | None = None
    shards_changed: int | None = None
    shards_deleted: int | None = None
    read_fraction: float | None = None
    requests_per_image: float | None = None
    bytes_per_image: float | None = None
    # manifests scanned before ``_manifest.json`` recorded it
    max_pixels: int | None = None
    # bucketeer rebucket: the fingerprint of the manifest it re-bucketed
    rebucketed_from: str | None = None
    other: dict[str, Any] = field(default_factory=dict)  # the keys not typed above, as written

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ScanSummary:
        typed = {f.name for f in fields(cls)} - {"other"}
        return cls(**{k: v for k, v in d.items() if k in typed and v is not None},
                   other={k: v for k, v in d.items() if k not in typed or v is None})  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        out = dict(self.other)
        out.update({k: v for k, v in _optional_json(self).items() if k != "other"})
        return out


@dataclass(frozen=True, kw_only=True)
class ManifestMeta:
    """A committed manifest's ``_manifest.json``. ``fingerprint`` hashes the format version, the source,
    the bucket spec and the parts' digests (:func:`manifests.manifest.write_manifest`)."""

    kind: str = MANIFEST_KIND
    format_version: int = FORMAT_VERSION
    tool_version: str
    created_at: str  # ISO 8601, UTC, seconds
    source: str  # the dataset root the scan listed (redacted)
    bucket_spec: BucketSpec
    counts: ManifestCounts
    max_pixels: int | None = None  # the scan's pixel limit; absent before it was recorded
    fingerprint: str
    parts: ManifestParts
    summary: ScanSummary = field(default_factory=ScanSummary)
    conditioning: ManifestConditioning | None = None  # only with scan --conditioning

    @classmethod
    def from_json(cls, d: Any, url: str) -> ManifestMeta:
        """Parse the JSON of ``url``'s ``_manifest.json``. Raises ManifestError (one line, ``url``
        redacted) for another kind, another format version, or keys that are absent or unknown."""
        found = d.get("kind") if isinstance(d, Mapping) else None
        if found != MANIFEST_KIND:
            raise ManifestError(f"{redact(url)}/{_FILE} is not a {MANIFEST_KIND} (kind={found!r})")
        if d.get("format_version") != FORMAT_VERSION:
            raise ManifestError(
                f"{redact(url)} has {_FILE} format version {d.get('format_version')!r}; this bucketeer reads "
                f"version {FORMAT_VERSION}. {VERSION_HINT}"
            )
        d = dict(d)
        try:
            d["bucket_spec"] = BucketSpec.from_json(d["bucket_spec"]) if "bucket_spec" in d else None
        except (UsageError, TypeError, ValueError) as e:
            raise ManifestError(f"{redact(url)}/{_FILE}: bucket_spec: {e}") from None
        if "counts" in d:
            d["counts"] = _build(ManifestCounts, d["counts"], "counts", url)
        if "parts" in d:
            d["parts"] = ManifestParts.from_json(d["parts"], url)
        if d.get("summary") is not None:
            d["summary"] = ScanSummary.from_json(d["summary"])
        if d.get("conditioning") is not None:
            d["conditioning"] = _build(ManifestConditioning, d["conditioning"], "conditioning", url)
        return _build(cls, {k: v for k, v in d.items() if v is not None}, "top-level", url)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``_manifest.json`` (:meth:`from_json` inverts it)."""
        out: dict[str, Any] = {
            "kind": self.kind, "format_version": self.format_version, "tool_version": self.tool_version,
            "created_at": self.created_at, "source": self.source, "bucket_spec": self.bucket_spec.to_json(),
            "counts": self.counts.to_json(), "fingerprint": self.fingerprint, "parts": self.parts.to_json(),
            "summary": self.summary.to_json(),
        }  # fmt: skip
        if self.max_pixels is not None:
            out["max_pixels"] = self.max_pixels
        if self.conditioning is not None:
            out["conditioning"] = self.conditioning.to_json()
        return out
