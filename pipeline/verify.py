"""Verify every record of a CACHE: checksum, decompression, tensor shapes, dtype, finite values.

    bucketeer verify CACHE [--storage-options JSON]

Exit status 0 when every record is good, 1 when any is bad (their sample ids are listed).
"""

from __future__ import annotations

import argparse
import sys

from manifests.storage import parse_storage_options, redact


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("cache", help="cache folder (local path or URL) written by `bucketeer embed`")
    parser.add_argument("--storage-options", default=None, help="JSON fsspec options, e.g. an endpoint_url")
    parser.add_argument("--max-listed", type=int, default=50, help="list at most this many bad samples")


def run(args: argparse.Namespace) -> int:
    from manifests.cache.verify import verify_cache

    result = verify_cache(args.cache, parse_storage_options(args.storage_options), progress=True)
    where = redact(args.cache)
    if not result.complete:
        print(f"note: {where} is not complete (its embed job is running or was killed; rerun it to resume)")
    if result.ok:
        print(f"{where}: OK - {result.checked_samples} sample records and {result.checked_texts} text records "
              f"in {result.shards} shards are good")
        return 0
    bad = result.bad_sample_ids
    print(f"{where}: {len(bad)} bad samples (of {result.checked_samples}) - re-embed them into a new --out, "
          "or exclude them from plans:", file=sys.stderr)
    for item in result.bad[: args.max_listed]:
        print(f"  sample {item.sample_id}  shard {item.shard}: {item.reason}", file=sys.stderr)
    if len(result.bad) > args.max_listed:
        print(f"  ... and {len(result.bad) - args.max_listed} more", file=sys.stderr)
    return 1


if __name__ == "__main__":
    from pipeline.cli import module_main

    sys.exit(module_main("verify"))
