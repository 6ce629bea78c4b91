"""Print a manifest's counts, bucket histogram and errors by kind (``--json`` for machines)."""

from __future__ import annotations

import argparse
import json
import sys

from manifests.manifest import manifest_stats, read_manifest
from manifests.storage import parse_storage_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    stats = manifest_stats(read_manifest(args.manifest, parse_storage_options(args.storage_options)))
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    counts = stats["counts"]
    print("counts:   " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"captions: {stats['captioned']} of {counts['samples']} samples have one")
    total = max(1, counts["samples"])
    print(f"buckets:  {len(stats['buckets'])}")
    for bucket, n in stats["buckets"].items():
        bar = "#" * max(1, round(40 * n / total))
        print(f"  {bucket:>10}  {n:>9}  {100 * n / total:5.1f}%  {bar}")
    print(f"errors:   {sum(stats['errors'].values())}")
    for kind, n in stats["errors"].items():
        print(f"  {kind:>16}  {n:>9}")
    return 0


if __name__ == "__main__":
    from pipeline.cli import module_main

    sys.exit(module_main("stats"))
