"""This rank's batches: records of its plan rows from the cache by ranged reads, read ahead on threads.

Each plan row (:class:`train.data.steps.PlanStep`) becomes exactly one :class:`Batch`, in plan
order, on this rank only: the :class:`CacheReader` is asked for each step's sample ids (no listing,
no per-sample objects). See :mod:`train.data` for why this is not a DataLoader.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from manifests.cache.meta import LatentInfo
from manifests.cache import CacheError, CacheReader, TextLayout
from manifests.cache.records import SampleRecord, to_float32
from manifests.errors import UsageError
from manifests.storage import redact
from train.masks import stack_masks
from train.data.draws import caption_dropout_mask, draw_posterior, variant_choice
from train.data.steps import PlanStep, RankSteps

__all__ = ["Batch", "BadRecordError", "collate", "BatchLoader", "READ_AHEAD_MB"]

READ_AHEAD_MB = 256  # default budget of records read ahead of the model, per rank
MAX_AHEAD_STEPS = 256  # never more steps ahead than this, however small the records
MAX_GROUP_STEPS = 32  # steps fetched by one batched read (its ranges merged across the steps)

TENSORS = ("latents", "text", "text_mask", "resolution", "aspect_ratio", "crop_top_left", "target_size", "pooled",
           "cond_latents", "features", "mask")


class BadRecordError(UsageError):
    """A cache record this rank needs is missing or corrupt (and skipping was not asked for)."""


@dataclass
class Batch:
    """The tensors of one step. Latents are scaled for the model: ``(latent - shift) * scale``.

    ``latents`` (B, C, h, w); ``text`` (B, L, D): the prompt embeddings as the cache's model
    family joins its text parts (:meth:`manifests.cache.TextLayout.prompt_embeds`: SDXL's two CLIPs
    side by side, SD3's CLIPs then T5 on the sequence, ...); a masked layout (PixArt, generic) is
    padded to the batch's longest caption, zero past each part's tokens; ``text_mask`` (B, L), 1
    where any part has a token (all ones for the unmasked families); ``resolution`` (B, 2)
    original (height, width) in pixels; ``aspect_ratio`` (B, 1) bucket height / width;
    ``crop_top_left`` (B, 2) (top, left) of the crop in resized pixels and ``target_size`` (B, 2) the
    bucket's (height, width): with ``resolution``, SDXL's micro-conditioning; ``pooled`` (B, P) the
    family's pooled text embedding (None when the layout has none). ``cond_latents`` (B, C, h, w): the
    paired conditioning images' latents, scaled like ``latents`` (None for a cache without pairs).
    ``features`` (B, gh, gw, D) float16: the DINOv2 patch features of each sample's variant (``embed
    --features``; REPA, :mod:`train.repa`), as stored whatever ``pending`` says (None for a cache without).
    ``mask`` (B, 1, h, w) float32 in [0, 1]: loss masks at the latent grid (:func:`train.masks.stack_masks`).
    ``variants`` (B,): each sample's variant (:func:`variant_choice`). ``dropped``: ids whose caption was
    replaced by the empty one (caption dropout). ``skipped``: ids dropped as bad records (skip_bad_records).

    ``pending`` ``(shift, scale)``: the batch is as stored (``collate(widen=False)``: latents, text and
    pooled in the cache's dtype, bf16 as ``torch.bfloat16``, latents not yet scaled): :meth:`to`
    widens them to float32 and scales the latents on the target device, where the model is, which
    moves half the bytes and spends no loader CPU. None: already float32 and scaled. Widening is
    exact and the scaling the same float32 ops, so the tensors on the device are identical.
    """

    epoch: int
    step: int
    bucket: str
    sample_ids: list[int]
    latents: torch.Tensor
    text: torch.Tensor
    text_mask: torch.Tensor
    resolution: torch.Tensor
    aspect_ratio: torch.Tensor
    crop_top_left: torch.Tensor
    target_size: torch.Tensor
    pooled: torch.Tensor | None = None
    cond_latents: torch.Tensor | None = None
    features: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    variants: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    datasets: list[int] | None = None  # mixture plans: the dataset of each of sample_ids
    pending: tuple[float, float] | None = None  # (shift, scale) still to apply, with the widening, in to()

    @property
    def latent_positions(self) -> int:
        """B * h * w: latent pixels in the batch (divide by patch_size**2 for transformer tokens)."""
        b, _, h, w = self.latents.shape
        return b * h * w

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """This batch on ``device``, float32 and scaled (a stored-dtype batch is widened there)."""
        move = {k: getattr(self, k).to(device, non_blocking=non_blocking)
                for k in TENSORS if getattr(self, k) is not None}  # fmt: skip
        if self.pending is not None:
            shift, scale = self.pending
            for k in ("latents", "cond_latents"):  # the same float32 ops collate(widen=True) does on the CPU
                if k in move:
                    move[k] = (move[k].float() - shift) * scale
            for k in ("text", "pooled"):
                if k in move:
                    move[k] = move[k].float()
        return replace(self, **move, pending=None)

    def pin_memory(self) -> "Batch":
        return replace(self, **{k: getattr(self, k).pin_memory() for k in TENSORS if getattr(self, k) is not None})


def stored_tensor(array: np.ndarray, tag: str) -> torch.Tensor:
    """A stored array as a torch tensor of its dtype without widening (BF16 bits -> ``torch.bfloat16``)."""
    array = np.ascontiguousarray(array)
    if tag == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def collate(
    records: Sequence[SampleRecord], step: PlanStep, *, layout: TextLayout, scaling_factor: float, shift_factor: float,
    widen: bool = True,
) -> Batch:  # fmt: skip
    """Stack one step's records (one bucket) into a :class:`Batch`; ``layout``: the cache's text layout.

    ``widen=False``: keep the stored dtype and leave widening and scaling to :meth:`Batch.to` (on the
    device); a batch whose records differ in dtype (posterior draws beside means) is widened here.
    Raises ValueError when a record's bucket is not the plan's (plan and cache from different
    manifests) or a record has no text embeddings, or text that does not fit ``layout``.
    """
    for r in records:
        if r.bucket != step.bucket:
            raise UsageError(f"sample {r.sample_id}: the cache says bucket {r.bucket}, the plan (epoch {step.epoch} "
                             f"step {step.step}) says {step.bucket}; "
                             "plan and cache come from different manifests")  # fmt: skip
        if r.text is None:
            raise UsageError(f"sample {r.sample_id} has no text embeddings in the cache; run `bucketeer verify`")
    has_cond = any(r.cond_latent is not None for r in records)
    if has_cond and not all(r.cond_latent is not None for r in records):
        raise UsageError(f"epoch {step.epoch} step {step.step}: some samples have a conditioning latent and "
                         "some not; the cache mixes records of two embeds. Run `bucketeer verify`")  # fmt: skip
    if not widen and len({r.dtype for r in records}) == 1 and len({r.text.dtype for r in records}) == 1:
        return _collate_stored(records, step, layout, has_cond, (shift_factor, scaling_factor))
    latents = np.stack([to_float32(r.latent, r.dtype) for r in records])  # (B, C, h, w)
    latents = (latents - shift_factor) * scaling_factor
    conds = None
    if has_cond:
        conds = (np.stack([to_float32(r.cond_latent, r.dtype) for r in records]) - shift_factor) * scaling_factor
    text, mask, pooled = layout.prompt_embeds([r.text for r in records])  # (B, L, D), (B, L), (B, P) | None
    return _batch(records, step, torch.from_numpy(np.ascontiguousarray(latents, np.float32)), torch.from_numpy(text),
                  mask, None if pooled is None else torch.from_numpy(pooled),
                  None if conds is None else torch.from_numpy(np.ascontiguousarray(conds, np.float32)))  # fmt: skip


def _collate_stored(records: Sequence[SampleRecord], step: PlanStep, layout: TextLayout, has_cond: bool,
                    pending: tuple[float, float]) -> Batch:  # fmt: skip
    """:func:`collate` without widening: tensors in the records' one stored dtype, scaling ``pending``."""
    tag, text_tag = records[0].dtype, records[0].text.dtype
    latents = stored_tensor(np.stack([r.latent for r in records]), tag)  # (B, C, h, w)
    conds = stored_tensor(np.stack([r.cond_latent for r in records]), tag) if has_cond else None
    text, mask, pooled = layout.prompt_embeds([r.text for r in records], widen=False)  # stored dtype
    batch = _batch(records, step, latents, stored_tensor(text, text_tag), mask,
                   None if pooled is None else stored_tensor(pooled, text_tag), conds)  # fmt: skip
    batch.pending = pending
    return batch


def _batch(records: Sequence[SampleRecord], step: PlanStep, latents: torch.Tensor, text: torch.Tensor,
           mask: np.ndarray, pooled: torch.Tensor | None, conds: torch.Tensor | None) -> Batch:  # fmt: skip
    geometry = np.asarray([(*r.original_size, *r.crop_top_left, *r.target_size) for r in records], np.float32)
    aspect = geometry[:, 4:5] / geometry[:, 5:6]  # (B, 1) bucket height / width
    return Batch(
        epoch=step.epoch,
        step=step.step,
        bucket=step.bucket,
        sample_ids=[r.sample_id for r in records],
        latents=latents,
        text=text,
        text_mask=torch.from_numpy(mask),
        resolution=torch.from_numpy(np.ascontiguousarray(geometry[:, 0:2])),  # (B, 2) original (h, w)
        aspect_ratio=torch.from_numpy(np.ascontiguousarray(aspect)),
        crop_top_left=torch.from_numpy(np.ascontiguousarray(geometry[:, 2:4])),
        target_size=torch.from_numpy(np.ascontiguousarray(geometry[:, 4:6])),
        pooled=pooled,
        cond_latents=conds,
        features=None if records[0].features is None else torch.from_numpy(np.stack([r.features for r in records])),
        mask=stack_masks([r.mask for r in records], tuple(latents.shape[-2:])),
    )



class BatchLoader:
    """Iterate :class:`Batch` es for ``steps`` in plan order, reading ``prefetch`` batches ahead.

    ``steps``: a list, or a :class:`RankSteps` read epoch by epoch (the check that the cache holds
    every planned sample then runs per epoch, when its rows arrive). Up to ``read_threads`` of those
    batches are read at once (each read is a batched ranged read through the shared, thread-safe
    :class:`CacheReader`, then decode and collate); batches are
    handed out in plan order whatever order the reads finish in. ``latent_info`` is
    ``_cache.json["latent"]`` (scaling and shift factors). ``log`` receives one line per skipped
    record. ``skipped`` counts the records dropped from the batches handed out so far.
    ``caption_dropout``: the probability that a sample trains on the empty caption (drawn by
    :func:`caption_dropout_mask` with ``seed``); the empty caption's record is read once, here.
    ``reader``: one cache, or (mixture plans) one per dataset in the plan's order: a sample of
    dataset ``d`` is read from ``reader[d]``. Their encoders must be the same (text layout, latent
    scaling); raises UsageError otherwise.
    ``posterior_sampling``: train on a fresh draw from each latent's VAE posterior (:func:`draw_posterior`)
    when the cache stores ``latent_std``; False, or a cache of means, trains on the mean.
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
    ):
        if prefetch < 1 or read_threads < 1 or read_ahead_mb < 0:
            raise UsageError(f"prefetch ({prefetch}) and read_threads ({read_threads}) must be >= 1, read_ahead_mb "
                             f"({read_ahead_mb}) >= 0")  # fmt: skip
        self.readers = [reader] if isinstance(reader, CacheReader) else list(reader)
        self.reader = reader = self.readers[0]
        self.steps = steps if isinstance(steps, RankSteps) else list(steps)
        self.scaling_factor = float(latent_info.scaling_factor or 1.0) if latent_info else 1.0
        self.shift_factor = float(latent_info.shift_factor or 0.0) if latent_info else 0.0
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
        self.empty_text = None
        if caption_dropout > 0:
            key = reader.meta.text.empty_caption_key if reader.meta.text else None
            if key is None:
                raise UsageError(f"config caption_dropout {caption_dropout}: cache {redact(reader.url)} has no empty "
                                 "caption record (_cache.json text.empty_caption_key); re-embed it with this "
                                 "bucketeer, or set caption_dropout: 0")  # fmt: skip
            (self.empty_text,) = reader.read_texts([int(key)])
        self._pool: ThreadPoolExecutor | None = None
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
        records = [r.variant(int(v)) for r, v in zip(records, chosen)]
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
        ``prefetch``, at most :data:`MAX_AHEAD_STEPS`), in groups of about a ``read_threads + 1``-th."""
        sizes = self.reader.meta.bytes
        per_sample = (sizes.per_sample or 0) + (sizes.per_caption or 0) if sizes else 0
        if isinstance(self.steps, RankSteps):
            batch = self.steps.meta.inputs.batch_size or 16  # a token-budget plan: a typical batch
        else:
            batch = len(self.steps[0].sample_ids) if self.steps else 1
        per_step = 2 * batch * (per_sample or 1 << 20)  # fetched bytes and decoded arrays, held at once
        steps = min(max(self.prefetch, self.read_ahead_bytes // per_step), MAX_AHEAD_STEPS)
        return steps, max(1, min(steps // (self.read_threads + 1), MAX_GROUP_STEPS))

    def __iter__(self) -> Iterator[Batch]:
        assert self._pool is None, "a BatchLoader is iterated once"
        self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix=f"bucketeer-read-{self.rank}")
        todo = iter(self._planned())
        steps_ahead, group = self.read_ahead()
        ahead: deque[tuple[int, Future[list[Batch | BaseException]]]] = deque()  # groups in plan order
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
                ahead.append((len(steps), self._pool.submit(self._read_group, steps)))
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

    def _planned(self) -> Iterator[PlanStep]:
        if not isinstance(self.steps, RankSteps):
            yield from self.steps
            return
        for epoch in self.steps.epochs():
            self._check_ids(epoch)
            yield from epoch

    def close(self) -> None:
        """Drop the reads not started, wait for the running ones, stop the threads (safe to call twice)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
