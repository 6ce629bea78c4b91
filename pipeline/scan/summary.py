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
from pipeline.sources.containers import ScanPart
from pipeline.sources.listing import Listing
from pipeline.sources.rescan import RescanPlan

__all__ = ["scan_summary", "summary_line", "ignored_line", "mixed_part"]

_DECOMPRESS = "compressed shards cannot be read by range: gzip -dc each into a .tar to scan it"
_IGNORED_HINTS = {"tar.gz": _DECOMPRESS, "tgz": _DECOMPRESS, "tar": "--format auto or tar scans them",
                  "parquet": "--format parquet scans their image column",
                  **dict.fromkeys(("mp4", "mov", "webm", "mkv"), "--frames scans videos")}  # fmt: skip


def ignored_line(ignored_extensions: dict[str, int], top: int = 4) -> str:
    """The most common ignored extensions, e.g. ``200,000 .heic (pip install 'bucketeer[heif]'), 3 .md``."""
    ranked = sorted(ignored_extensions.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = []
    for ext, n in ranked[:top]:
        hint = _IGNORED_HINTS.get(ext) or missing_format_hint(ext)
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
        "listed": len(listing.images) + len(listing.link_errors), "ignored": listing.ignored,
        "ignored_hidden": listing.ignored_hidden, "ignored_other": listing.ignored_other,
        "ignored_extensions": dict(sorted(listing.ignored_extensions.items())),
        "list_requests": listing.requests, "list_seconds": round(listing.seconds, 3), "samples": samples.num_rows,
        "errors": errors.num_rows, "errors_by_kind": kinds, "reused": plan.reused, "new": plan.new,
        "changed": plan.changed, "deleted": plan.deleted, "previous": plan.previous, "bytes_read": int(read.sum()),
        "mb_read": round(int(read.sum()) / 1e6, 3), "median_bytes_read": int(np.median(read)) if len(read) else 0,
        "seconds": round(seconds, 3), "files_per_s": round(len(listing.images) / max(seconds, 1e-9), 1),
        "started_at": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(timespec="seconds"),
        "started_at_epoch": started, "header_bytes": config.header_bytes, "plugins": list(register_plugins()),
        "no_caption": samples.column("caption").null_count,  # what a reader of samples/ counts
        "captions": redact(captions) if captions else "sidecars",
        "caption_table_version": table.version if table is not None else None,
    })  # fmt: skip


def mixed_part(loose: ScanPart, shards: ScanPart) -> ScanPart:
    """One part of a mixed folder's loose images and tar shards: their rows, and one summary whose
    totals count both (``images_loose`` and ``images_in_shards`` say how many came from each), the
    loose files' reuse under ``reused``/``new``/..., the shards' under ``shards_reused``/...; the
    shards' settings (``source_format``, ``caption_field``) are recorded so a rescan reuses both."""
    a, b = loose.summary, shards.summary
    kinds = dict(a.errors_by_kind or {})
    for kind, n in (b.errors_by_kind or {}).items():
        kinds[kind] = kinds.get(kind, 0) + n
    read = (a.bytes_read or 0) + (b.bytes_read or 0)
    seconds = (a.seconds or 0.0) + (b.seconds or 0.0)
    summary = {
        **b.to_json(), **a.to_json(),
        "listed": a.listed + b.listed, "samples": a.samples + b.samples, "errors": a.errors + b.errors,
        "errors_by_kind": dict(sorted(kinds.items())), "images_loose": a.listed, "images_in_shards": b.listed,
        "shards_reused": b.reused, "shards_new": b.new, "shards_changed": b.changed, "shards_deleted": b.deleted,
        "no_caption": (a.no_caption or 0) + (b.no_caption or 0),
        "captions_truncated": (a.captions_truncated or 0) + (b.captions_truncated or 0),
        "requests": (a.requests or 0) + (b.requests or 0), "bytes_read": read, "mb_read": round(read / 1e6, 3),
        "seconds": round(seconds, 3),
        "files_per_s": round((a.listed + b.listed) / max(seconds, 1e-9), 1),
        **{k: (getattr(a, k) or 0) + (getattr(b, k) or 0) for k in ("masks_alpha", "masks_files", "mask_files")
           if getattr(a, k) is not None or getattr(b, k) is not None},  # scan --masks
    }  # fmt: skip
    counts = {**loose.counts, "listed": loose.counts["listed"] + shards.counts["listed"],
              "shards": shards.counts["shards"]}  # fmt: skip
    return ScanPart(pa.concat_tables([loose.samples, shards.samples]), pa.concat_tables([loose.errors, shards.errors]),
                    ScanSummary.from_json(summary), counts)  # fmt: skip


def summary_line(meta: ManifestMeta, out: str) -> str:
    """The closing line of a scan: counts, ignored files by extension, reuse, reads and speed."""
    s = meta.summary
    if s.images_loose is not None:
        return _mixed_line(meta, out)
    if s.shards is not None:
        return _containers_line(meta, out)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.errors_by_kind.items())) or "none"
    pairs = (f" | conditioning: {s.conditioning_probed} probed, {s.conditioning_errors} bad pairs, "
             f"{s.conditioning_files} under the source not counted as samples")  if s.conditioning_probed is not None \
        else ""  # fmt: skip
    return (
        f"scanned {s.listed} images ({_ignored(s)}): "
        f"{s.samples} samples, {s.errors} errors ({kinds}) | reused {s.reused}, new {s.new}, "
        f"changed {s.changed}, deleted {s.deleted}{pairs}{_notes(s)} | read {s.files_read} files, {s.mb_read:.1f} MB "
        f"(median {s.median_bytes_read / 1024:.0f} KiB, {s.requests_per_file:.2f} requests per file) in "
        f"{s.seconds:.1f} s, {s.files_per_s:.0f} files/s -> {redact(out)} "
        f"(fingerprint {meta.fingerprint[:12]})"
    )


def _notes(s: ScanSummary) -> str:
    """What the user should know once: captions cut at 1 MiB; the loss masks found (``--masks``); storage that
    throttled the scan."""
    masks = (f" | masks: {s.masks_alpha} alpha, {s.masks_files} files ({s.mask_files} mask files not counted as "
             "samples)") if s.masks_alpha is not None else ""  # fmt: skip
    throttled = f" | storage throttled {s.throttled:,} requests (retried)" if s.throttled else ""
    if not s.captions_truncated:
        return masks + throttled
    return f" | {s.captions_truncated} captions longer than 1 MiB cut there{masks}{throttled}"


def _ignored(s: ScanSummary) -> str:
    """``N other files ignored: 3 .md, 1 .tar.gz (...)``, hidden files included."""
    ignored = ignored_line(s.ignored_extensions or {})
    hidden = s.ignored_hidden or 0
    others = "; ".join(p for p in (ignored, f"{hidden} hidden" if hidden else "") if p)
    return f"{s.ignored} other files ignored{': ' + others if others else ''}"


def _mixed_line(meta: ManifestMeta, out: str) -> str:
    """The closing line of a scan of loose images and tar shards: each kind's count and reuse, totals."""
    s = meta.summary
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.errors_by_kind.items())) or "none"
    return (
        f"scanned {s.images_loose} loose images and {s.shards} tar shards holding {s.images_in_shards} images "
        f"({_ignored(s)}): {s.samples} samples, {s.errors} errors ({kinds}), {s.no_caption} images without a "
        f"caption{_notes(s)} | files reused {s.reused}, new {s.new}, changed {s.changed}, deleted {s.deleted}; "
        f"shards reused {s.shards_reused}, new {s.shards_new}, changed {s.shards_changed}, deleted "
        f"{s.shards_deleted} | read {s.mb_read:.1f} MB in {s.seconds:.1f} s, {s.files_per_s:.0f} images/s -> "
        f"{redact(out)} (fingerprint {meta.fingerprint[:12]})"
    )


def _containers_line(meta: ManifestMeta, out: str) -> str:
    """The closing line of a container scan: counts, reuse per container, bytes read against their bytes, speed."""
    s = meta.summary
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.errors_by_kind.items())) or "none"
    if s.source_format == "parquet":
        noun, others = "parquet files", ""
    else:
        members = ", ".join(f"{n:,} .{e}" for e, n in sorted(s.ignored_members.items(), key=lambda kv: -kv[1])[:4])
        noun, others = "tar shards", f", other members ignored: {members or 'none'}"
    if s.ignored:
        others += f", {_ignored(s)}"
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
