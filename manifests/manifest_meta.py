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

from dataclasses import dataclass, field
from typing import Any, Mapping

from manifests.buckets import BucketSpec
from manifests.errors import MissingError, UsageError
from manifests.jsonrecord import JsonRecord, RecordError, each, nested, optional
from manifests.schema import FORMAT_VERSION
from manifests.storage import check_artifact, redact

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


@dataclass(frozen=True, kw_only=True)
class _ManifestRecord(JsonRecord):
    """A record of ``_manifest.json``: a key it does not know, or a field without a default that the file
    lacks, is refused (RecordError saying where, which :meth:`ManifestMeta.from_json` turns into a
    ManifestError)."""

    _unknown_keys = "refuse"


@dataclass(frozen=True, kw_only=True)
class ManifestCounts(_ManifestRecord):
    """``counts``: rows of the two tables, and what the scan listed (absent before it counted them)."""

    samples: int
    errors: int
    listed: int | None = optional()  # image files listed (tar/parquet: images found in the containers)
    ignored: int | None = optional()  # other files: hidden ones, and by extension in the summary
    shards: int | None = optional()  # tar shards or parquet files scanned (container sources only)


@dataclass(frozen=True, kw_only=True)
class ManifestPart(_ManifestRecord):
    """One parquet part: ``path`` relative to the manifest root, its rows, sha256 and size in bytes."""

    path: str
    rows: int
    sha256: str
    bytes: int | None = optional()  # absent in manifests written before it was recorded: ask the store


@dataclass(frozen=True, kw_only=True)
class ManifestParts(_ManifestRecord):
    """``parts``: the samples and errors parts, in order."""

    samples: tuple[ManifestPart, ...] = nested(each(ManifestPart.from_json))
    errors: tuple[ManifestPart, ...] = nested(each(ManifestPart.from_json))

    @classmethod
    def from_json(cls, d: Any) -> ManifestParts:
        if not isinstance(d, Mapping) or set(d) != {"samples", "errors"}:
            raise RecordError("parts must have exactly the keys samples and errors")
        return super().from_json(d)


@dataclass(frozen=True, kw_only=True)
class ManifestConditioning(_ManifestRecord):
    """``conditioning`` (``scan --conditioning``): the root the ``conditioning`` column's paths are
    relative to, and the ``--captions`` column they came from (None: the sample's own path)."""

    root: str
    column: str | None


@dataclass(frozen=True, kw_only=True)
class ScanSummary(JsonRecord):
    """``summary``: the producing job's figures (scan, rebucket). Typed where code reads them; None
    when the file does not have the key (another source kind, an older scan). Every other key, and
    typed keys written as null, stay in ``other`` as they were, so :meth:`to_json` gives the dict back.
    """

    # every scan
    listed: int | None = optional()
    samples: int | None = optional()
    errors: int | None = optional()
    errors_by_kind: dict[str, int] | None = optional()
    ignored: int | None = optional()
    ignored_hidden: int | None = optional()
    ignored_extensions: dict[str, int] | None = optional()  # other files by extension ("" for none)
    reused: int | None = optional()
    new: int | None = optional()
    changed: int | None = optional()
    deleted: int | None = optional()
    previous: str | None = optional()  # the manifest rows were reused from (redacted)
    files_read: int | None = optional()
    requests: int | None = optional()  # storage requests of the reads
    bytes_read: int | None = optional()
    mb_read: float | None = optional()
    median_bytes_read: int | None = optional()
    requests_per_file: float | None = optional()
    captions_read: int | None = optional()  # sidecars read
    caption_read_failures: int | None = optional()
    caption_lists: int | None = optional()  # samples with several captions
    empty_captions_dropped: int | None = optional()  # empty entries left out of caption lists
    captions_truncated: int | None = optional()  # captions over 1 MiB (sidecars, caption members), cut there
    seconds: float | None = optional()  # driver seconds, Ray start-up left out
    files_per_s: float | None = optional()
    throttled: int | None = optional()  # storage answers that asked for fewer requests (503 SlowDown, 429)
    # scan --conditioning
    conditioning_probed: int | None = optional()
    conditioning_errors: int | None = optional()
    conditioning_files: int | None = optional()
    # scan --masks: samples whose mask is their alpha channel / a mask file, mask files not counted as samples
    masks_alpha: int | None = optional()
    masks_files: int | None = optional()
    mask_files: int | None = optional()
    # tar shards and parquet files
    source_format: str | None = optional()  # webdataset | parquet
    image_column: str | None = optional()  # parquet: the column of image bytes (embed reads it)
    caption_column: str | None = optional()
    caption_field: str | None = optional()  # tar: the .json field captions came from
    shards: int | None = optional()
    masks: str | None = optional()  # tar: the --masks the shards were read with (a change reads them again)
    shards_read: int | None = optional()
    images_read: int | None = optional()
    shard_bytes: int | None = optional()  # bytes of the containers read
    no_caption: int | None = optional()
    ignored_members: dict[str, int] | None = optional()
    # a mixed folder (loose images and tar shards): how many images came from each, the shards' reuse
    images_loose: int | None = optional()
    images_in_shards: int | None = optional()
    shards_reused: int | None = optional()
    shards_new: int | None = optional()
    shards_changed: int | None = optional()
    shards_deleted: int | None = optional()
    read_fraction: float | None = optional()
    requests_per_image: float | None = optional()
    bytes_per_image: float | None = optional()
    # manifests scanned before ``_manifest.json`` recorded it
    max_pixels: int | None = optional()
    # bucketeer rebucket: the fingerprint of the manifest it re-bucketed
    rebucketed_from: str | None = optional()
    # the keys not typed above and typed keys written as null, as they were; they count in ==
    _extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def other(self) -> Mapping[str, Any]:
        return self._extra


@dataclass(frozen=True, kw_only=True)
class ManifestMeta(_ManifestRecord):
    """A committed manifest's ``_manifest.json``. ``fingerprint`` hashes the format version, the source,
    the bucket spec and the parts' digests (:func:`manifests.manifest.write_manifest`)."""

    kind: str = MANIFEST_KIND
    format_version: int = FORMAT_VERSION
    tool_version: str
    created_at: str  # ISO 8601, UTC, seconds
    source: str  # the dataset root the scan listed (redacted)
    bucket_spec: BucketSpec = nested(BucketSpec.from_json)
    counts: ManifestCounts = nested(ManifestCounts.from_json)
    max_pixels: int | None = optional()  # the scan's pixel limit; absent before it was recorded
    fingerprint: str
    parts: ManifestParts = nested(ManifestParts.from_json)
    summary: ScanSummary = nested(ScanSummary.from_json, default_factory=ScanSummary)
    conditioning: ManifestConditioning | None = optional(ManifestConditioning.from_json)  # scan --conditioning
    masks: str | None = optional()  # scan --masks as given ("alpha", "files" or both): the `mask` column is filled
    frame_ladder: tuple[int, ...] | None = optional(tuple)  # scan --frames: a video manifest (manifests/frames.py)

    @classmethod
    def from_json(cls, d: Any, url: str) -> ManifestMeta:  # type: ignore[override]
        """Parse the JSON of ``url``'s ``_manifest.json``. Raises ManifestError (one line, ``url``
        redacted) for another kind, another format version, or keys that are absent or unknown."""
        check_artifact(d, url, file=_FILE, kind=MANIFEST_KIND, version=FORMAT_VERSION, error=ManifestError,
                       version_hint=VERSION_HINT)  # fmt: skip
        try:
            return super().from_json(d)
        except RecordError as e:
            raise ManifestError(f"{redact(url)}/{_FILE}: {e}") from None
