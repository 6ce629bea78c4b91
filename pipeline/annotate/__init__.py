"""Annotate a manifest's images with models and rules into an ANNOTATIONS folder (Ray job): generated
captions, CLIP embeddings and score heads, perceptual hashes, sha256, image statistics, in one pass.

The job is :mod:`pipeline.annotate.job` (``bucketeer annotate``, ``python -m pipeline.annotate``); the
package holds its parts: the task registry (:mod:`~pipeline.annotate.tasks`), the caption engines
(:mod:`~pipeline.annotate.engines`, :mod:`~pipeline.annotate.vllm_engine`) and default captioner
(:mod:`~pipeline.annotate.default_model`), the embedder and heads (:mod:`~pipeline.annotate.vision`), the
model-free tasks (:mod:`~pipeline.annotate.image_stats`), the Ray work (:mod:`~pipeline.annotate.workers`,
:mod:`~pipeline.annotate.dataflow`). The artifact's format is :mod:`manifests.annotations`.
"""

from pipeline.annotate.job import AnnotateJob, AnnotateResult, add_arguments, job_from_args, run

__all__ = ["AnnotateJob", "AnnotateResult", "add_arguments", "job_from_args", "run"]
