"""HTML report with plots of a manifest, cache and plan (coming: issue 7)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Not available yet in this version of bucketeer: it arrives with issue 7."


def run(args: argparse.Namespace) -> int:
    print("bucketeer report is not available yet in this version (it arrives with issue 7).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    from pipeline.cli import module_main

    sys.exit(module_main("report"))
