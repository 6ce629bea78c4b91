"""This rank's batches: its own plan rows, records from the cache by ranged reads, read ahead on threads.

A rank reads only its own rows of the plan, one epoch at a time (:class:`RankSteps`: memory is one
epoch of this rank's rows, the next epoch read while this one trains), and asks the
:class:`CacheReader` for each step's sample ids: no listing, no per-sample objects. Each plan row becomes exactly one
:class:`Batch`, in plan order, on this rank only. The loader is deliberately NOT a DataLoader
handed to ``accelerator.prepare()``: prepare would re-shard it across ranks (BatchSamplerShard /
IterableDatasetShard), i.e. shard a plan that is already sharded, and it fails on
``batch_size=None``. Reading ahead happens on ``read_threads`` threads of this process by default
(the reader is thread-safe): on an object store a batch read is one round of concurrent ranged GETs,
so its latency, not bandwidth, bounds a single reader; the batches are still handed out in plan order.
Those threads share the GIL with the training step's Python; ``read_processes=K`` reads in K processes
started from multiprocessing's fork server instead (:mod:`train.data.processes`: no fork of a live S3
client; each holds its own copy of the cache index; a batch comes back through shared memory, copied
once), with the same batches, errors and log lines.

A record that is missing, truncated or fails its checksum stops the run with an error naming the
sample, the shard and the fix (``bucketeer verify``), unless ``skip_bad_records`` is set: then the
bad records are dropped from their batch, counted and reported (a batch with no good record left
still stops the run: every rank must take every step).

Caption dropout (classifier-free guidance) replaces a sample's text with the empty caption's record
(``_cache.json["text"]["empty_caption_key"]``, read once) when :func:`caption_dropout_mask` draws it:
a pure function of ``(seed, epoch, sample id)``, so a resumed run (on any number of processes) drops
exactly the captions an uninterrupted run would have dropped.

Variants (a cache embedded with ``--flip`` / ``--crops K``): each sample trains on one of its
variants per epoch, :func:`variant_choice` (the same kind of pure function, another salt), and its
``crop_top_left`` (SDXL's crop conditioning) is that variant's crop box. A cache of pairs
(``scan --conditioning``) gives every batch ``cond_latents`` too, the same variant of the
conditioning image.

Caption lists: a sample embedded with several captions trains on the one the plan chose for it this
epoch (``PlanStep.caption_index``; a plan without that column means caption 0); caption dropout still
replaces the chosen one. A video clip cut inside a captioned shot (its record's ``variant_captions``) trains on
its own shot's caption instead, whatever the plan chose (:func:`~train.data.draws.variant_text_keys`).

Posterior sampling: a cache embedded with ``--latents posterior`` stores each latent's posterior
``latent_std``; the loader trains on a fresh draw ``mean + std * eps`` every epoch (config
``posterior_sampling``, default on), ``eps`` a pure function of ``(seed, epoch, sample id)``
(:func:`posterior_noise`, a counter-based Philox stream), so it does not depend on the rank, the
batch it lands in or any RNG state: a resumed run draws exactly what an uninterrupted one would.
Caches of means only train on the mean, as before.

The parts: :mod:`train.data.steps` (this rank's plan rows), :mod:`train.data.batch` (a step's records
as tensors), :mod:`train.data.loader` (records to batches, read ahead) and :mod:`train.data.draws` (the
per-sample draws, pure functions).
"""

from train.data.draws import caption_dropout_mask, draw_posterior, posterior_noise, variant_choice
from train.data.batch import Batch, collate, latent_normaliser
from train.data.loader import BadRecordError, BatchLoader
from train.data.steps import PlanStep, RankSteps, rank_steps

__all__ = ["PlanStep", "Batch", "BadRecordError", "RankSteps", "rank_steps", "collate", "latent_normaliser",
           "BatchLoader", "caption_dropout_mask", "variant_choice", "posterior_noise", "draw_posterior"]
