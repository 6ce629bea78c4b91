"""Re-assign buckets from a manifest's stored sizes into a new manifest, without reading any image.

Change the training resolution (or bucket list, or min side) without rescanning:
``bucketeer rebucket MANIFEST --out NEW --resolution 512``.
"""

from __future__ import annotations

import argparse
import sys

from manifests.buckets import add_bucket_arguments, spec_from_args
from manifests.manifest import read_manifest, rebucket, write_manifest
from manifests.storage import parse_storage_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="existing manifest folder (local path or URL)")
    parser.add_argument("--out", required=True, help="folder for the new manifest (may equal MANIFEST)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    add_bucket_arguments(parser)


def run(args: argparse.Namespace) -> int:
    options = parse_storage_options(args.storage_options)
    spec = spec_from_args(args)
    old = read_manifest(args.manifest, options)
    samples, errors = rebucket(old, spec)
    meta = write_manifest(
        args.out,
        samples,
        errors,
        source=old.source,
        spec=spec,
        counts={k: v for k, v in old.meta["counts"].items() if k not in ("samples", "errors")},
        summary={**old.meta.get("summary", {}), "rebucketed_from": old.fingerprint},
        max_pixels=old.max_pixels,  # the rows were judged by it; embed decodes up to it
        storage_options=options,
    )
    n_buckets = len(set(samples.column("bucket").to_pylist()))
    print(
        f"rebucketed {samples.num_rows} samples into {n_buckets} buckets "
        f"({errors.num_rows} error rows) -> {args.out} (fingerprint {meta['fingerprint'][:12]})"
    )
    return 0


if __name__ == "__main__":
    from pipeline.cli import module_main

    sys.exit(module_main("rebucket"))
