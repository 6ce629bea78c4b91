"""Demo on a generated dataset, on this machine: generate ~300 images, then scan them into a manifest.

    bucketeer demo [--out-dir ./demo-output] [--images 300]

This interim demo covers the scan; the full scan -> embed -> plan -> train demo replaces it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="./demo-output", help="where the dataset and manifest go (default ./demo-output)")
    parser.add_argument("--images", type=int, default=300, help="how many images to generate (default 300)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from manifests.buckets import BucketSpec
    from manifests.manifest import manifest_stats, read_manifest
    from pipeline.sample_data import make_sample_dataset
    from pipeline.scan import ScanConfig, scan_dataset, summary_line

    if args.images < 1:
        raise ValueError("--images must be >= 1")
    out = Path(args.out_dir)
    dataset, manifest = out / "dataset", out / "manifest"
    start = time.perf_counter()
    if not (dataset / "part0").is_dir():
        made = make_sample_dataset(dataset, n=args.images, seed=args.seed)
        print(f"generated {made['images']} images ({made['formats']}), {made['broken']} broken files, "
              f"{made['captioned']} captions, {made['rotated']} EXIF-rotated -> {dataset} "
              f"in {time.perf_counter() - start:.1f} s")  # fmt: skip
    else:
        print(f"reusing the dataset in {dataset} (delete it to regenerate)")
    meta = scan_dataset(str(dataset), str(manifest), spec=BucketSpec(), config=ScanConfig(progress=sys.stderr.isatty()))
    print(summary_line(meta, str(manifest)))
    stats = manifest_stats(read_manifest(str(manifest)))
    print(f"buckets ({len(stats['buckets'])}): " + ", ".join(f"{b} x{n}" for b, n in stats["buckets"].items()))
    print("errors: " + (", ".join(f"{k} x{n}" for k, n in stats["errors"].items()) or "none"))
    print(f"captions: {stats['captioned']} of {stats['counts']['samples']} samples")
    print(f"demo finished in {time.perf_counter() - start:.1f} s; run it again to see an incremental rescan")
    return 0


if __name__ == "__main__":
    from pipeline.cli import module_main

    sys.exit(module_main("demo"))
