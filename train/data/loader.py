"""This rank's batches: records of its plan rows from the cache by ranged reads, read ahead on threads.

Each plan row (:class:`train.data.steps.PlanStep`) becomes exactly one :class:`~train.data.batch.Batch`
(:func:`~train.data.batch.collate`), in plan order, on this rank only: the :class:`CacheReader` is asked
for each step's sample ids (no listing, no per-sample objects). See :mod:`train.data` for why this is
not a DataLoader.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from manifests.cache.meta import LatentInfo
from manifests.cache import CacheError, CacheReader
from manifests.cache.reader import CHUNK_BYTES
from manifests.cache.records import SampleRecord
from manifests.errors import UsageError
from manifests.storage import redact
from train.data.batch import Batch, collate, latent_normaliser
from train.data.processes import ProcessReads
from train.data.draws import caption_dropout_mask, draw_posterior, variant_choice, variant_text_keys
from train.data.steps import PlanStep, RankSteps

__all__ = ["BadRecordError", "BatchLoader", "READ_AHEAD_MB"]

READ_AHEAD_MB = 256  # default budget of records read ahead of the model, per rank
MAX_AHEAD_STEPS = 256  # never more steps ahead than this, however small the records
MAX_GROUP_STEPS = 32  # steps fetched by one batched read (its ranges merged across the steps)


class BadRecordError(UsageError):
    """A cache record this rank needs is missing or corrupt (and skipping was not asked for)."""


class BatchLoader:
    """Iterate :class:`Batch` es for ``steps`` in plan order, reading ``prefetch`` batches ahead.

    ``steps``: a list, or a :class:`RankSteps` read epoch by epoch (the check that the cache holds
    every planned sample then runs per epoch, when its rows arrive). Up to ``read_threads`` of those
    batches are read at once (each read is a batched ranged read through the shared, thread-safe
    :class:`CacheReader`, then decode and collate); batches are
    handed out in plan order whatever order the reads finish in. ``latent_info`` is
    ``_cache.json["latent"]`` (scaling and shift factors, or a video VAE's per-channel statistics:
    :func:`latent_normaliser`). ``log`` receives one line per skipped
    record. ``skipped`` counts the records dropped from the batches handed out so far.
    ``caption_dropout``: the probability that a sample trains on the empty caption (drawn by
    :func:`caption_dropout_mask` with ``seed``); the empty caption's record is read once, here.
    ``reader``: one cache, or (mixture plans) one per dataset in the plan's order: a sample of
    dataset ``d`` is read from ``reader[d]``. Their encoders must be the same (text layout, latent
    scaling); raises UsageError otherwise.
    ``posterior_sampling``: train on a fresh draw from each latent's VAE posterior (:func:`draw_posterior`)
    when the cache stores ``latent_std``; False, or a cache of means, trains on the mean.
    ``read_processes``: K > 0 reads and decodes in K processes (forked from a fork server) instead of
    ``read_threads`` threads (:mod:`train.data.processes`: out of the training step's GIL; each batch is
    copied once out of shared memory); the batches, errors and log lines are the same.
    """

    def __init__(
        self,
        reader: CacheReader | Sequence[CacheReader],
        steps: Sequence[PlanStep] | RankSteps,
        latent_info: LatentInfo | None,
        *,
        rank: int = 0,
        prefetch: int = 4,
        read_threads: int = 1,
        skip_bad_records: bool = False,
        pin_memory: bool = False,
        log: Callable[[str], None] = print,
        caption_dropout: float = 0.0,
        seed: int = 0,
        posterior_sampling: bool = True,
        widen: bool = True,
        read_ahead_mb: float = READ_AHEAD_MB,
        read_processes: int = 0,
    ):
        if prefetch < 1 or read_threads < 1 or read_ahead_mb < 0 or read_processes < 0:
            raise UsageError(f"prefetch ({prefetch}) and read_threads ({read_threads}) must be >= 1, read_ahead_mb "
                             f"({read_ahead_mb}) and read_processes ({read_processes}) >= 0")  # fmt: skip
        self.readers = [reader] if isinstance(reader, CacheReader) else list(reader)
        self.reader = reader = self.readers[0]
        self.steps = steps if isinstance(steps, RankSteps) else list(steps)
        self.shift_factor, self.scaling_factor = latent_normaliser(latent_info)
        self.layout = reader.meta.text_layout
        for other in self.readers[1:]:  # one batch holds samples of several caches: one encoder for all
            if other.meta.text_layout != self.layout or other.meta.latent != reader.meta.latent:
                raise UsageError(f"cache {redact(other.url)} was made with other encoders (text layout or latent "
                                 f"settings) than {redact(reader.url)}: a mixture's caches must come from one "
                                 "`bucketeer embed` setup")  # fmt: skip
        self.rank = rank
        self.prefetch = prefetch
        self.read_threads = min(read_threads, prefetch)  # more threads than batches ahead would idle
        self.skip_bad_records = skip_bad_records
        self.pin_memory = pin_memory
        self.log = log
        self.skipped = 0
        self.caption_dropout, self.seed = caption_dropout, seed
        self.posterior_sampling = posterior_sampling
        self.widen = widen
        self.read_ahead_bytes = int(read_ahead_mb * (1 << 20))
        self.read_processes = read_processes
        self.latent_info = latent_info
        self.empty_text = None
        if caption_dropout > 0:
            key = reader.meta.text.empty_caption_key if reader.meta.text else None
            if key is None:
                raise UsageError(f"config caption_dropout {caption_dropout}: cache {redact(reader.url)} has no empty "
                                 "caption record (_cache.json text.empty_caption_key; a qwen-image-edit cache has "
                                 "none: its empty instruction's embedding depends on each reference image); set "
                                 "caption_dropout: 0, or re-embed an older cache with this bucketeer")  # fmt: skip
            (self.empty_text,) = reader.read_texts([int(key)])
        self._pool: ThreadPoolExecutor | ProcessReads | None = None
        if isinstance(self.steps, RankSteps) and self.steps.meta.inputs.config.window is not None:
            # a window-shuffled plan's next steps draw on a few runs of contiguous records: fetch them by
            # whole chunks (one GET per CHUNK_BYTES) and hold as many chunks as the read-ahead budget
            for each in self.readers:  # (read processes get them so set: the setting pickles with a reader)
                each.read_in_chunks(CHUNK_BYTES, max(self.read_ahead_bytes, 4 * CHUNK_BYTES))
        if not isinstance(self.steps, RankSteps):
            self._check_ids(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def _check_ids(self, steps: list[PlanStep]) -> None:
        """Fail before the first of ``steps`` when the plan names samples the cache index lacks."""
        if not steps:
            return
        ids = np.concatenate([np.asarray(s.sample_ids, np.uint64) for s in steps])
        sets = np.concatenate([np.zeros(len(s.sample_ids), np.int64) if s.dataset is None
                               else s.dataset.astype(np.int64) for s in steps])  # fmt: skip
        for d in np.unique(sets):
            if d >= len(self.readers):
                raise UsageError(f"the plan names dataset {d} but {len(self.readers)} caches were given: pass one "
                                 "--cache per manifest of the plan, in its order")  # fmt: skip
            self._check_dataset_ids(np.unique(ids[sets == d]), self.readers[d])

    def _check_dataset_ids(self, wanted: np.ndarray, reader: CacheReader) -> None:
        missing = np.setdiff1d(wanted, reader.sample_ids)
        if len(missing) and not self.skip_bad_records:
            url = redact(reader.url)
            raise BadRecordError(
                f"rank {self.rank}: {len(missing)} samples of the plan are not in cache {url} "
                f"(e.g. {missing[:5].tolist()}): the plan was made for another cache, or records were lost. "
                f"Run `bucketeer verify {url}`, re-plan with `bucketeer plan ... --cache {url}`, "
                "or pass --skip-bad-records to train without them."
            )
        if len(missing):
            self.log(f"rank {self.rank}: {len(missing)} planned samples are not in the cache; they will be skipped")

    def _read_group(self, steps: list[PlanStep]) -> list[Batch | BaseException]:
        """The batches of consecutive ``steps`` (runs on a reading thread; touches no loader state): every
        record of the group in one batched read per cache, so the reader merges ranges that fall close
        in a shard across the steps (:func:`manifests.cache.merge_reads`), then each step's batch. A
        step's error is its item, raised by the consumer at that step; a bad record anywhere in the
        group makes each step read its own records, so errors and skips are exactly a lone step's."""
        sizes = [len(s.sample_ids) for s in steps]
        try:
            records = self._fetch([i for s in steps for i in s.sample_ids], self._sets(steps),
                                  self._caption_index(steps)) if len(steps) > 1 else None  # fmt: skip
        except CacheError:
            records = None
        except Exception as e:  # storage: raised at the group's first step
            return [e] * len(steps)
        out: list[Batch | BaseException] = []
        for k, step in enumerate(steps):
            mine = None if records is None else records[sum(sizes[:k]) : sum(sizes[: k + 1])]
            try:
                out.append(self._read(step, mine))
            except Exception as e:
                out.append(e)
        return out

    @staticmethod
    def _sets(steps: list[PlanStep]) -> list[int]:
        return [d for s in steps for d in ([0] * len(s.sample_ids) if s.dataset is None else s.dataset.tolist())]

    @staticmethod
    def _caption_index(steps: list[PlanStep]) -> np.ndarray | None:
        if all(s.caption_index is None for s in steps):
            return None
        return np.concatenate([np.zeros(len(s.sample_ids), np.uint8) if s.caption_index is None else s.caption_index
                               for s in steps])  # fmt: skip

    def _read(self, step: PlanStep, fetched: list[SampleRecord] | None = None) -> Batch:
        """One step's batch from its records (``fetched``, or read now); touches no loader state."""
        sets = self._sets([step])
        try:
            records = fetched if fetched is not None else self._fetch(step.sample_ids, sets, step.caption_index)
            skipped: list[int] = []
        except CacheError as e:
            if not self.skip_bad_records:
                raise BadRecordError(f"rank {self.rank} epoch {step.epoch} step {step.step}: {e}. "
                                     "To train on without bad records, pass --skip-bad-records.") from None  # fmt: skip
            records, skipped, kept = [], [], []
            chosen = step.caption_index if step.caption_index is not None else [None] * len(step.sample_ids)
            for sid, d, index in zip(step.sample_ids, sets, chosen):  # find the bad ones: one read each
                try:
                    records.extend(self.readers[d].read([sid], *([] if index is None else [[index]])))
                    kept.append(d)
                except CacheError as bad:
                    skipped.append(sid)
                    self.log(f"skipping bad record (--skip-bad-records): {bad}")
            sets = kept
            if not records:
                raise BadRecordError(f"rank {self.rank} epoch {step.epoch} step {step.step}: all {len(skipped)} "
                                     "records are bad; ranks cannot stay in step. "
                                     "Run `bucketeer verify`.") from None  # fmt: skip
        chosen = variant_choice(self.seed, step.epoch, [r.sample_id for r in records], [r.variants for r in records],
                                None if step.dataset is None else sets)  # fmt: skip
        records = self._variant_texts([r.variant(int(v)) for r, v in zip(records, chosen)], sets)
        if self.posterior_sampling:
            records = draw_posterior(records, self.seed, step.epoch, None if step.dataset is None else sets)
        dropped: list[int] = []
        if self.empty_text is not None:
            drop = caption_dropout_mask(self.seed, step.epoch, [r.sample_id for r in records], self.caption_dropout,
                                        None if step.dataset is None else sets)  # fmt: skip
            records = [replace(r, text=self.empty_text) if d else r for r, d in zip(records, drop)]
            dropped = [r.sample_id for r, d in zip(records, drop) if d]
        batch = collate(records, step, layout=self.layout, scaling_factor=self.scaling_factor,
                        shift_factor=self.shift_factor, widen=self.widen)
        batch.skipped, batch.dropped, batch.variants = skipped, dropped, chosen.tolist()
        batch.datasets = None if step.dataset is None else [int(d) for d in sets]
        return batch.pin_memory() if self.pin_memory else batch

    def _variant_texts(self, records: list[SampleRecord], sets: list[int]) -> list[SampleRecord]:
        """``records`` (one variant each) whose variant carries its own caption (a clip's shot's,
        :func:`variant_text_keys`) with that caption's text in place of the plan's; the others as they are.
        Raises CacheError for a caption index beyond the sample's captions or a missing text record."""
        try:
            wanted = variant_text_keys(records)
        except ValueError as e:
            raise CacheError(f"{e}: the record and the cache index disagree; run `bucketeer verify`") from None
        swap = [i for i, (r, k) in enumerate(zip(records, wanted)) if k is not None and k != r.caption_key]
        if not swap:
            return records
        out = list(records)
        for d in dict.fromkeys(sets[i] if sets else 0 for i in swap):
            mine = [i for i in swap if (sets[i] if sets else 0) == d]
            for i, text in zip(mine, self.readers[d].read_texts([wanted[i] for i in mine])):
                out[i] = replace(out[i], text=text, caption_key=wanted[i])
        return out

    def _fetch(self, sample_ids: Sequence[int], sets: list[int],
               caption_index: np.ndarray | None) -> list[SampleRecord]:  # fmt: skip
        """Records of ``sample_ids`` in order, each read from its dataset's cache (one batched read per cache),
        with the caption the plan chose (``caption_index``; None: caption 0, read by ids alone)."""
        if not any(sets):
            return self.readers[0].read(sample_ids, *([] if caption_index is None else [caption_index]))
        out: list[SampleRecord | None] = [None] * len(sample_ids)
        where = np.asarray(sets)
        for d in np.unique(where):
            pos = np.flatnonzero(where == d)
            chosen = [] if caption_index is None else [[caption_index[i] for i in pos]]
            for p, record in zip(pos, self.readers[int(d)].read([sample_ids[i] for i in pos], *chosen)):
                out[p] = record
        return out  # type: ignore[return-value]

    def read_ahead(self) -> tuple[int, int]:
        """``(steps ahead, steps per group read)``: as many steps as ``read_ahead_mb`` holds (at least
        ``prefetch``, at most :data:`MAX_AHEAD_STEPS`), in groups of about a ``readers + 1``-th (``readers``:
        the read processes, else threads)."""
        sizes = self.reader.meta.bytes
        per_sample = (sizes.per_sample or 0) + (sizes.per_caption or 0) if sizes else 0
        if isinstance(self.steps, RankSteps):
            batch = self.steps.meta.inputs.batch_size or 16  # a token-budget plan: a typical batch
        else:
            batch = len(self.steps[0].sample_ids) if self.steps else 1
        per_step = 2 * batch * (per_sample or 1 << 20)  # fetched bytes and decoded arrays, held at once
        steps = min(max(self.prefetch, self.read_ahead_bytes // per_step), MAX_AHEAD_STEPS)
        readers = self.read_processes or self.read_threads
        return steps, max(1, min(steps // (readers + 1), MAX_GROUP_STEPS))

    def __iter__(self) -> Iterator[Batch]:
        assert self._pool is None, "a BatchLoader is iterated once"
        submit = self._start()
        todo = iter(self._planned())
        steps_ahead, group = self.read_ahead()
        ahead: deque[tuple[int, Any]] = deque()  # groups in plan order: (steps, a Future or a pending group)
        size, queued = 1, 0  # the first groups grow 1, 2, 4... steps: the first batch waits for one step only

        def read_next() -> None:
            nonlocal size, queued
            while queued < steps_ahead:
                try:
                    steps = list(itertools.islice(todo, size))
                except Exception as e:  # the next epoch's rows: raised after the steps before it
                    failed: Future[list[Batch | BaseException]] = Future()
                    failed.set_result([e])
                    ahead.append((0, failed))
                    queued = steps_ahead
                    return
                if not steps:
                    return
                ahead.append((len(steps), submit(steps)))
                queued += len(steps)
                size = min(2 * size, group)

        try:
            read_next()
            while ahead:
                n, future = ahead.popleft()
                queued -= n
                read_next()
                for batch in future.result():
                    if isinstance(batch, BaseException):
                        raise batch  # a read's error is raised at its step, not before
                    self.skipped += len(batch.skipped)
                    yield batch
        finally:
            self.close()

    def _start(self) -> Callable[[list[PlanStep]], Any]:
        """Start the readers; returns how to hand them a group of steps (its result(): the group's items)."""
        if not self.read_processes:
            pool = self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix=f"bucketeer-read-{self.rank}")
            return lambda steps: pool.submit(self._read_group, steps)
        kwargs = dict(rank=self.rank, prefetch=self.prefetch, skip_bad_records=self.skip_bad_records,
                      caption_dropout=self.caption_dropout, seed=self.seed, posterior_sampling=self.posterior_sampling,
                      widen=self.widen, read_ahead_mb=self.read_ahead_bytes / (1 << 20))  # fmt: skip
        procs = self._pool = ProcessReads(self.read_processes, type(self), self.readers, self.latent_info, kwargs,
                                          self.pin_memory, self.log, f"bucketeer-read-{self.rank}")  # fmt: skip
        return procs.submit

    def _planned(self) -> Iterator[PlanStep]:
        if not isinstance(self.steps, RankSteps):
            yield from self.steps
            return
        for epoch in self.steps.epochs():
            self._check_ids(epoch)
            yield from epoch

    def close(self) -> None:
        """Drop the reads not started, wait for the running ones, stop the threads (safe to call twice)."""
        if isinstance(self._pool, ThreadPoolExecutor):
            self._pool.shutdown(wait=True, cancel_futures=True)
        elif self._pool is not None:
            self._pool.close()
