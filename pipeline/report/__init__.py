"""Write a self-contained HTML report with plots of a manifest, and optionally of a plan and a cache.

The job is :mod:`pipeline.report.job` (``bucketeer report``, ``python -m pipeline.report``); the package
holds its parts.
"""

from pipeline.report.job import ReportJob, ReportResult, add_arguments, job_from_args, run, write_report

__all__ = ["ReportJob", "ReportResult", "add_arguments", "job_from_args", "run", "write_report"]
