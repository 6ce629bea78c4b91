"""bucketeer's Ray jobs (scan, embed, plan, ...), the ``bucketeer`` command line, and the Python API.

    from pipeline import ScanJob, EmbedJob, PlanJob, run

    scan = run(ScanJob(source="data/", out="manifest/"))       # a ScanResult: counts, fingerprint, seconds
    cache = run(EmbedJob(manifest=scan.url, out="cache/"))
    plan = run(PlanJob(manifests=(scan.url,), out="plan/", world_size=2, batch_size=4, cache=(cache.url,)))

Each job is a frozen dataclass, validated where it is built (a bad combination raises
:class:`manifests.errors.UsageError`); ``run(job)`` runs it exactly as the command of the same name does
and returns its typed result. The names are imported on first use, so ``import pipeline`` costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it (and that module's ``run(job)``)
API: dict[str, str] = {
    "ScanJob": "pipeline.scan.job",
    "ScanResult": "pipeline.scan.job",
    "RebucketJob": "pipeline.rebucket",
    "RebucketResult": "pipeline.rebucket",
    "StatsJob": "pipeline.stats",
    "StatsResult": "pipeline.stats",
    "EmbedJob": "pipeline.embed.job",
    "EmbedResult": "pipeline.embed.job",
    "AnnotateJob": "pipeline.annotate.job",
    "AnnotateResult": "pipeline.annotate.job",
    "DedupJob": "pipeline.dedup.job",
    "DedupResult": "pipeline.dedup.job",
    "VerifyJob": "pipeline.verify",
    "VerifyResult": "pipeline.verify",
    "PlanJob": "pipeline.plan.job",
    "PlanResult": "pipeline.plan.job",
    "ReportJob": "pipeline.report.job",
    "ReportResult": "pipeline.report.job",
    "DemoJob": "pipeline.demo.job",
    "DemoResult": "pipeline.demo.job",
}

__all__ = [*API, "run"]


def run(job: Any) -> Any:
    """Run ``job`` (any of the ``*Job`` types above) and return its result; raises what the command
    would report: :class:`manifests.errors.BucketeerError` for what the user must fix."""
    name = type(job).__name__
    module = importlib.import_module(API[name]) if name.endswith("Job") and name in API else None
    if module is None or getattr(module, name) is not type(job):  # the job class that module runs (or re-exports)
        raise TypeError(f"run() takes a bucketeer job ({', '.join(n for n in API if n.endswith('Job'))}), not {name}")
    return module.run(job)


def __getattr__(name: str) -> Any:
    if name in API:
        return getattr(importlib.import_module(API[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
