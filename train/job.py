"""What one training run is: a :class:`TrainJob`, built once from the command line (:func:`job_from_args`).

    python -m train --plan PLAN --cache CACHE [--config FILE] [--output-dir DIR] [--resume] ...

The job holds the run's settings, typed and checked: the plan, its cache(s), the output folder, the
storage options and the :class:`~train.config.TrainConfig` read from ``--config`` (or the cache
family's default config). What the plan and the caches hold is read when the run starts
(:mod:`train.setup`), not here; the one exception is the first cache's family, which picks the
default config.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from manifests.errors import UsageError
from manifests.storage import parse_storage_options
from train.config import TrainConfig, load_config

__all__ = ["TrainJob", "job_from_args", "parse_args", "build_parser"]

DESCRIPTION = "Train a diffusion model from a plan and a cache: the lean Accelerate loop, one for every model family."


@dataclass(frozen=True)
class TrainJob:
    """One training run's settings (the plan and the cache say what it trains on, the config how).

    ``plan``: the plan folder (local path or URL); ``caches``: one cache per manifest of the plan, in the
    plan's order; ``max_steps``: stop once this many plan steps have run in total; ``record_samples``: a
    folder for ``rank-<r>.jsonl`` (the sample ids of every step); ``storage_options``: fsspec options for
    the URLs among the plan, the caches and ``output_dir``. Raises UsageError for a bad combination.
    """

    plan: str
    caches: tuple[str, ...]
    config: TrainConfig
    output_dir: str = "train-output"
    resume: bool = False
    record_samples: str | None = None
    max_steps: int | None = None
    skip_bad_records: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.caches, str):
            raise TypeError("TrainJob.caches is a tuple of cache folders, one per manifest of the plan")
        object.__setattr__(self, "caches", tuple(self.caches))
        if not isinstance(self.config, TrainConfig):
            raise TypeError(f"TrainJob.config must be a TrainConfig, got {type(self.config).__name__}")
        if not self.plan:
            raise UsageError("--plan is empty: pass the plan folder `bucketeer plan` wrote")
        if not self.caches or not all(self.caches):
            raise UsageError(f"--cache {','.join(self.caches)!r} names an empty cache: pass one cache folder per "
                             "manifest of the plan, comma-separated, in the plan's order")  # fmt: skip
        if not self.output_dir:
            raise UsageError("--output-dir is empty: pass a local folder or a URL")
        if self.max_steps is not None and self.max_steps < 1:
            raise UsageError(f"--max-steps {self.max_steps}: pass 1 or more (plan steps), or leave it out to train "
                             "the whole plan")  # fmt: skip

    @property
    def plan_url(self) -> str:
        """The plan as every rank names it: a URL, or an absolute local path."""
        return self.plan if "://" in self.plan else os.path.abspath(self.plan)

    @property
    def read_options(self) -> dict[str, Any]:
        """The storage options the plan and cache readers use (:func:`no_head_options`)."""
        return no_head_options(self.storage_options, self.plan, *self.caches)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line (``python -m train --help``)."""
    p = argparse.ArgumentParser(prog="python -m train", description=DESCRIPTION)
    p.add_argument("--plan", required=True, help="plan folder (local path or URL) from `bucketeer plan`")
    p.add_argument("--cache", required=True, help="cache folder (local path or URL) from `bucketeer embed`; for "
                   "a plan over several manifests one cache per manifest, comma-separated, in the plan's order")
    p.add_argument("--config", default=None, help="YAML/JSON training config (default: train/configs/<family>.yaml "
                   "for an sdxl, sd3, flux, wan or wan2.2-* cache, else train/configs/tiny.yaml)")
    p.add_argument("--output-dir", default="train-output",
                   help="checkpoints, logs, the final model: a local folder, or a URL (s3://bucket/run) that "
                        "every node reaches; several nodes need a URL or a shared filesystem")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    p.add_argument("--record-samples", metavar="DIR", default=None,
                   help="write DIR/rank-<r>.jsonl: the sample ids each rank trained on, one line per step")  # fmt: skip
    p.add_argument("--max-steps", type=int, default=None, help="stop once this many plan steps have run in total")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="drop missing/corrupt cache records (counted, logged) instead of stopping")  # fmt: skip
    p.add_argument("--storage-options", default=None,
                   help="fsspec options as JSON for the plan, cache and --output-dir URLs")  # fmt: skip
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` (default: ``sys.argv[1:]``) parsed; argparse exits 2 on a malformed command line."""
    return build_parser().parse_args(argv)


def job_from_args(argv: list[str] | None = None) -> TrainJob:
    """The job a command line asks for: arguments parsed, ``--storage-options`` and the config read.

    Without ``--config`` the config is the cache family's default (``_cache.json`` of the first
    cache is read for its family). Raises UsageError for bad options or settings, MissingError for a
    missing config file or cache.
    """
    from manifests.cache import read_cache_meta
    from train.config import default_config

    args = parse_args(argv)
    storage_options = parse_storage_options(args.storage_options)
    caches = tuple(c.strip() for c in args.cache.split(","))
    config_file = args.config
    if not config_file:
        reads = no_head_options(storage_options, args.plan, *caches)
        config_file = default_config(read_cache_meta(caches[0], reads).family)
    return TrainJob(
        plan=args.plan,
        caches=caches,
        config=load_config(config_file),
        output_dir=args.output_dir,
        resume=args.resume,
        record_samples=args.record_samples,
        max_steps=args.max_steps,
        skip_bad_records=args.skip_bad_records,
        storage_options=storage_options,
    )


def no_head_options(storage_options: dict, *urls: str) -> dict:
    """Storage options under which s3fs reads a whole object with one GET and no HEAD.

    The plan and cache readers read small files whole with ``fs.cat_file`` / ``fs.cat`` (JSON,
    plan and index parquet). With ``max_concurrency`` > 1 (default 10), s3fs's ``_cat_file`` first
    HEADs the object for its size, only to decide whether to split it into concurrent ranged GETs
    of ``default_block_size`` (50 MiB); below that it then sends the same single GET. So at 1 the
    requests are the same minus the HEAD for every file under 50 MiB (index parts of MBs
    included); a file over 50 MiB (a merged index of several million samples) comes in one stream
    instead of up to 10 parallel ones, a one-off start-up cost. ``max_concurrency`` touches nothing
    else the trainer does: record reads are ``cat_ranges`` (explicit ranges, never a HEAD), and
    the trainer writes nothing to S3 (uploads are what it would slow). A user's own
    ``max_concurrency`` in ``--storage-options`` wins.
    """
    if any(u.startswith(("s3://", "s3a://")) for u in urls):
        return {"max_concurrency": 1, **storage_options}
    return storage_options
