"""Header-only Ray scan of a local folder or s3:// prefix into a parquet manifest.

The job is :mod:`pipeline.scan.job` (``bucketeer scan``, ``python -m pipeline.scan``); the package
holds its parts.
"""

from pipeline.scan.job import ScanConfig, add_arguments, run, scan_dataset, summary_line

__all__ = ["ScanConfig", "add_arguments", "run", "scan_dataset", "summary_line"]
