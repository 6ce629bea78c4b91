"""Embed a manifest into a cache: VAE latents and text embeddings, gzip'd safetensors records (Ray job).

The job is :mod:`pipeline.embed.job` (``bucketeer embed``, ``python -m pipeline.embed``); the package
holds its parts.
"""

from pipeline.embed.job import EmbedJob, EmbedResult, add_arguments, job_from_args, run

__all__ = ["EmbedJob", "EmbedResult", "add_arguments", "job_from_args", "run"]
