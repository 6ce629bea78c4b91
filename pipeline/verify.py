"""Verify every record of a CACHE: checksum, decompression, tensor shapes, dtype, finite values.

    bucketeer verify CACHE [--storage-options JSON]

    from pipeline import VerifyJob, run
    result = run(VerifyJob(cache="cache/"))   # result.bad: the bad records; result.exit_code

Exit status 0 when every record is good, 1 when any is bad (their sample ids are listed), 2 with
one line when records are not the ones the index names (a sample id or caption key that differs from
its index row: the index was edited or its rows mixed up, so re-embed into a new --out) or when there
is no cache.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from manifests.cache.verify import VerifyResult as CacheCheck
from manifests.storage import parse_storage_options, redact

__all__ = ["VerifyJob", "VerifyResult", "add_arguments", "job_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("cache", help="cache folder (local path or URL) written by `bucketeer embed`")
    parser.add_argument("--storage-options", default=None, help="JSON fsspec options, e.g. an endpoint_url")
    parser.add_argument("--max-listed", type=int, default=50, help="list at most this many bad samples")


@dataclass(frozen=True, kw_only=True)
class VerifyJob:
    """One ``bucketeer verify``: the cache, its storage options (parsed), how many bad samples to list."""

    cache: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    max_listed: int = 50


@dataclass
class VerifyResult(CacheCheck):
    """What verify found (:class:`manifests.cache.verify.VerifyResult`: records checked, the bad ones, whether
    the cache is ``complete``) and where. ``exit_code``: 0 all good, 1 any bad record."""

    url: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def job_from_args(args: argparse.Namespace) -> VerifyJob:
    """The :class:`VerifyJob` of parsed ``bucketeer verify`` options."""
    return VerifyJob(cache=args.cache, storage_options=parse_storage_options(args.storage_options),
                     max_listed=args.max_listed)  # fmt: skip


def run(job: VerifyJob) -> VerifyResult:
    """Check every record of ``job.cache``; prints what ``bucketeer verify`` prints. CacheError when
    there is no cache there, or when records are not the ones its index names."""
    from manifests.cache.verify import verify_cache

    found = verify_cache(job.cache, dict(job.storage_options), progress=True)
    result = VerifyResult(**vars(found), url=job.cache)
    where = redact(job.cache)
    if not result.complete:
        print(f"note: {where} is not complete (its embed job is running or was killed; rerun it to resume)")
    if result.ok:
        print(f"{where}: OK - {result.checked_samples} sample records and {result.checked_texts} text records "
              f"in {result.shards} shards are good")
        return result
    bad = result.bad_sample_ids
    print(f"{where}: {len(bad)} bad samples (of {result.checked_samples}) - re-embed them into a new --out, "
          "or exclude them from plans:", file=sys.stderr)
    for item in result.bad[: job.max_listed]:
        print(f"  sample {item.sample_id}  shard {item.shard}: {item.reason}", file=sys.stderr)
    if len(result.bad) > job.max_listed:
        print(f"  ... and {len(result.bad) - job.max_listed} more", file=sys.stderr)
    return result


if __name__ == "__main__":
    from pipeline.cli import exit_after, module_main

    exit_after(module_main, "verify")
