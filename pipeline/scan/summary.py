"""What a scan tells: its ``_manifest.json`` ``summary`` (:class:`~manifests.manifest_meta.ScanSummary`)
built from the listing, the rescan plan and the tasks' figures, and the closing line printed from it."""

from __future__ import annotations

import datetime as _dt

import numpy as np
import pyarrow as pa

from manifests.manifest_meta import ManifestMeta, ScanSummary
from manifests.storage import redact
from pipeline.formats import missing_format_hint, register_plugins
from pipeline.scan.config import ScanConfig
from pipeline.sources.captions import CaptionTable
from pipeline.sources.listing import Listing
from pipeline.sources.rescan import RescanPlan

__all__ = ["scan_summary", "summary_line", "ignored_line"]


def ignored_line(ignored_extensions: dict[str, int], top: int = 4) -> str:
    """The most common ignored extensions, e.g. ``200,000 .heic (pip install 'bucketeer[heif]'), 3 .md``."""
    ranked = sorted(ignored_extensions.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = []
    for ext, n in ranked[:top]:
        hint = missing_format_hint(ext)
        name = f".{ext}" if ext and not ext.startswith("(") else (ext or "(no extension)")
        parts.append(f"{n:,} {name}" + (f" ({hint})" if hint else ""))
    if len(ranked) > top:
        parts.append(f"{sum(n for _, n in ranked[top:]):,} more")
    return ", ".join(parts)


def scan_summary(
    listing: Listing, plan: RescanPlan, stats: dict, samples: pa.Table, errors: pa.Table, seconds: float,
    started: float, config: ScanConfig, captions: str | None, table: CaptionTable | None,
) -> ScanSummary:  # fmt: skip
    """The summary of a scan of loose images: ``stats`` are :func:`pipeline.scan.assemble.assemble`'s
    figures (plus the conditioning pairs'), ``seconds`` the driver's time without Ray's start-up."""
    kinds: dict[str, int] = {}
    for kind in errors.column("error").to_pylist():
        kinds[kind] = kinds.get(kind, 0) + 1
    stats = dict(stats)
    read = stats.pop("bytes_read")
    return ScanSummary.from_json({
        **stats,
        "requests_per_file": round(stats["requests"] / max(1, stats["files_read"]), 4),
        "listed": len(listing.images), "ignored": listing.ignored, "ignored_hidden": listing.ignored_hidden,
        "ignored_other": listing.ignored_other, "ignored_extensions": dict(sorted(listing.ignored_extensions.items())),
        "list_requests": listing.requests, "list_seconds": round(listing.seconds, 3), "samples": samples.num_rows,
        "errors": errors.num_rows, "errors_by_kind": kinds, "reused": plan.reused, "new": plan.new,
        "changed": plan.changed, "deleted": plan.deleted, "previous": plan.previous, "bytes_read": int(read.sum()),
        "mb_read": round(int(read.sum()) / 1e6, 3), "median_bytes_read": int(np.median(read)) if len(read) else 0,
        "seconds": round(seconds, 3), "files_per_s": round(len(listing.images) / max(seconds, 1e-9), 1),
        "started_at": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(timespec="seconds"),
        "started_at_epoch": started, "header_bytes": config.header_bytes, "plugins": list(register_plugins()),
        "captions": redact(captions) if captions else "sidecars",
        "caption_table_version": table.version if table is not None else None,
    })  # fmt: skip


def summary_line(meta: ManifestMeta, out: str) -> str:
    """The closing line of a scan: counts, ignored files by extension, reuse, reads and speed."""
    s = meta.summary
    if s.shards is not None:
        return _containers_line(meta, out)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.errors_by_kind.items())) or "none"
    ignored = ignored_line(s.ignored_extensions or {})
    hidden = s.ignored_hidden or 0
    others = "; ".join(p for p in (ignored, f"{hidden} hidden" if hidden else "") if p)
    pairs = (f" | conditioning: {s.conditioning_probed} probed, {s.conditioning_errors} bad pairs, "
             f"{s.conditioning_files} under the source not counted as samples")  if s.conditioning_probed is not None \
        else ""  # fmt: skip
    return (
        f"scanned {s.listed} images ({s.ignored} other files ignored{': ' + others if others else ''}): "
        f"{s.samples} samples, {s.errors} errors ({kinds}) | reused {s.reused}, new {s.new}, "
        f"changed {s.changed}, deleted {s.deleted}{pairs}{_notes(s)} | read {s.files_read} files, {s.mb_read:.1f} MB "
        f"(median {s.median_bytes_read / 1024:.0f} KiB, {s.requests_per_file:.2f} requests per file) in "
        f"{s.seconds:.1f} s, {s.files_per_s:.0f} files/s -> {redact(out)} "
        f"(fingerprint {meta.fingerprint[:12]})"
    )


def _notes(s: ScanSummary) -> str:
    """What the user should know once: captions cut at 1 MiB."""
    if not s.captions_truncated:
        return ""
    return f" | {s.captions_truncated} captions longer than 1 MiB cut there"


def _containers_line(meta: ManifestMeta, out: str) -> str:
    """The closing line of a container scan: counts, reuse per container, bytes read against their bytes, speed."""
    s = meta.summary
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.errors_by_kind.items())) or "none"
    if s.source_format == "parquet":
        noun, others = "parquet files", ""
    else:
        members = ", ".join(f"{n:,} .{e}" for e, n in sorted(s.ignored_members.items(), key=lambda kv: -kv[1])[:4])
        noun, others = "tar shards", f", other members ignored: {members or 'none'}"
    short = noun.split()[-1]
    return (
        f"scanned {s.shards} {noun}, {s.listed} images: {s.samples} samples, {s.errors} errors "
        f"({kinds}), {s.no_caption} images without a caption{others}{_notes(s)} | "
        f"{short} reused {s.reused}, new {s.new}, changed {s.changed}, deleted {s.deleted} | read "
        f"{s.mb_read:.1f} MB = {100 * s.read_fraction:.2f}% of the {s.shards_read} {short} read "
        f"({s.requests_per_image:.2f} requests, {s.bytes_per_image / 1024:.1f} KiB per image) in "
        f"{s.seconds:.1f} s, {s.files_per_s:.0f} images/s -> {redact(out)} "
        f"(fingerprint {meta.fingerprint[:12]})"
    )
