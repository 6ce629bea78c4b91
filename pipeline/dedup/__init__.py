"""Find duplicate images across annotations folders (exact, perceptual, semantic) into an ANNOTATIONS folder.

The job is :mod:`pipeline.dedup.job` (``bucketeer dedup``, ``python -m pipeline.dedup``); the package holds
its parts: reading and merging the inputs (:mod:`~pipeline.dedup.inputs`), the hash edges
(:mod:`~pipeline.dedup.edges`), the embedding edges (:mod:`~pipeline.dedup.semantic`) and the clusters with
their keepers (:mod:`~pipeline.dedup.clusters`). The output's format is :mod:`manifests.annotations`.
"""

from pipeline.dedup.job import DedupJob, DedupResult, add_arguments, job_from_args, run

__all__ = ["DedupJob", "DedupResult", "add_arguments", "job_from_args", "run"]
