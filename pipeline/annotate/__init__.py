"""Annotate a manifest's images with models into an ANNOTATIONS folder (Ray job): generated captions.

The job is :mod:`pipeline.annotate.job` (``bucketeer annotate``, ``python -m pipeline.annotate``); the
package holds its parts: the engines (:mod:`~pipeline.annotate.engines`, :mod:`~pipeline.annotate.vllm_engine`),
the default model (:mod:`~pipeline.annotate.default_model`), the Ray work (:mod:`~pipeline.annotate.workers`,
:mod:`~pipeline.annotate.dataflow`). The artifact's format is :mod:`manifests.annotations`.
"""

from pipeline.annotate.job import AnnotateJob, AnnotateResult, add_arguments, job_from_args, run

__all__ = ["AnnotateJob", "AnnotateResult", "add_arguments", "job_from_args", "run"]
