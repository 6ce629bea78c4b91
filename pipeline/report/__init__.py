"""Write a self-contained HTML report with plots of a manifest, and optionally of a plan and a cache.

The job is :mod:`pipeline.report.job` (``bucketeer report``, ``python -m pipeline.report``); the package
holds its parts.
"""

from pipeline.report.job import add_arguments, run, write_report

__all__ = ["add_arguments", "run", "write_report"]
