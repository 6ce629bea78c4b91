"""Header-only Ray scan of a local folder or s3:// prefix into a parquet manifest.

The job is :mod:`pipeline.scan.job` (``bucketeer scan``, ``python -m pipeline.scan``,
``run(ScanJob(...))``); the package holds its parts: :mod:`~pipeline.scan.config` (tuning),
:mod:`~pipeline.scan.probing` (the Ray tasks), :mod:`~pipeline.scan.assemble` (rows),
:mod:`~pipeline.scan.summary` (the summary and its closing line), :mod:`~pipeline.scan.conditioning`.
"""

from pipeline.scan.config import ScanConfig
from pipeline.scan.job import ScanJob, ScanResult, add_arguments, job_from_args, run, scan_dataset
from pipeline.scan.summary import summary_line

__all__ = ["ScanConfig", "ScanJob", "ScanResult", "add_arguments", "job_from_args", "run", "scan_dataset",
           "summary_line"]  # fmt: skip
