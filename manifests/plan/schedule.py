"""Epoch schedules for shard plans: a pure numpy function of (samples, world shape, seed, epoch).

An epoch is a sequence of **global batches**. A global batch holds samples of one bucket,
``world_size`` times the per-rank batch of that bucket; step ``s`` of rank ``r`` is the ``r``-th
equal slice of global batch ``s``. So every rank has exactly one batch per step, every rank has
the same number of steps, and all ranks at a step hold the same bucket (same work, no hang).

The sequence of global batches depends on the world shape only through the global batch size.
That is what makes an elastic resume N1 -> N2 with ``N1*B1 == N2*B2`` exact: the remaining global
batches are cut into N2 slices instead of N1 (:func:`manifests.plan.rows.resplit`), and later epochs are the ones a
fresh plan with (N2, B2) gives.

One epoch, with ``rng = np.random.default_rng([seed, epoch])`` (no global random state):

1. shuffle each bucket's samples (canonical order first: by bucket name, then sample id, so the
   manifest's row order does not matter);
2. cut each bucket into global batches. A leftover (fewer than a global batch) is dropped (the
   tail of this epoch's shuffle, so a different subset each epoch), or padded with repeats from
   the start of the same bucket's shuffle (cyclically when the bucket is smaller than the pad);
3. shuffle the order of all global batches across buckets;
4. with gradient accumulation A, make the step count a multiple of A so that no optimizer step
   mixes epochs: ``drop`` drops the last ``S mod A`` global batches, ``pad`` repeats the first
   ``A - S mod A`` global batches of the epoch. Both are counted per bucket;
5. put each global batch in ascending id order. Which rank trains which sample of a global batch
   changes nothing in the update (gradients are averaged over all ranks), and in id order rank
   ``r`` holds the ``r``-th id range of every batch: a rank's ids lie close together, which the
   plan file's delta encoding stores in fewer than 8 bytes each (:mod:`manifests.plan.parts`).

Window shuffle (``shuffle="window:W"``, ``bucketeer plan --shuffle window[:W]``): a full shuffle makes the
trainer read one record per request, scattered over the cache. The window shuffle keeps the steps above and
changes two: in step 1 each bucket is shuffled by :func:`window_order` (windows of ``W`` samples consecutive
in (bucket, sample id) order, which is the cache's record order for loose files: embed cuts each bucket's
rows into shards in that order; the windows' order shuffled; samples shuffled within blocks of about ``W``
that straddle windows), and in step 3 the buckets' global batches are interleaved at random but each
bucket's keep their order. So a run of a rank's steps reads a few contiguous ranges of records, which the
cache reader fetches with few large ranged reads (:func:`manifests.cache.reader.merge_reads`). With several
ranks, dealing each global batch by id range would give each rank ~1 / world of every chunk it fetches; so a
bucket's global batches are taken in groups of ``ceil(W / b)`` steps (``b``: per-rank batch) and rank ``r``
gets the ``r``-th contiguous run of the group's windows (about ``W`` samples, shuffled within the run instead
of the blocks above; :func:`manifests.plan.window.rank_runs`), and step 5 sorts each rank's slice instead
of the global batch.
Every invariant holds (disjoint ranks, equal steps, exact resume, and an elastic resume trains every sample
of the epoch exactly once); unlike the full shuffle, the global batches of a window plan depend on the world
shape, so after an elastic resume later epochs are those of a fresh (N2, B2) plan, not the (N1, B1) ones.
With one rank the order is what it was.

Packing mode (``max_tokens``): the per-rank batch of a bucket is ``max_tokens // tokens(bucket)``
(capped by ``batch_size`` when given), with ``tokens(WxH) = ceil(W/(f*p)) * ceil(H/(f*p))`` for VAE
factor ``f`` and patch size ``p``: small images get bigger batches, and every rank at a step holds
the same bucket and batch size, so tokens are balanced across ranks exactly. A video bucket ``WxHxF``
(:mod:`manifests.frames`) has ``(F - 1) // t + 1`` latent frames of that many tokens each, for the VAE's
temporal factor ``t`` (``temporal_factor``): long clips take smaller batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.errors import UsageError
from manifests.frames import DEFAULT_TEMPORAL_FACTOR, bucket_dims, latent_frames
from manifests.plan.window import concat_ranges, rank_runs, run_of, window_order

__all__ = [
    "LEFTOVER_POLICIES",
    "SHUFFLES",
    "DEFAULT_WINDOW",
    "parse_shuffle",
    "SLOT_COLUMNS",
    "PlanConfig",
    "BucketedSamples",
    "EpochSchedule",
    "group_samples",
    "cached_mask",
    "latent_tokens",
    "bucket_batch_sizes",
    "concat_ranges",
    "plan_epoch",
    "window_order",
]

LEFTOVER_POLICIES = ("drop", "pad")
SHUFFLES = ("full", "window")
DEFAULT_WINDOW = 256  # samples per window: ~85 MB of SDXL-512 records, a few windows fit the read-ahead budget

SLOT_COLUMNS = {"dataset": "datasets", "caption_index": "captions"}  # plan column -> EpochSchedule field


@dataclass(frozen=True)
class PlanConfig:
    """What a plan is made with. ``batch_size`` is per rank (a cap in packing mode).

    Raises ValueError naming the CLI option when a value is out of range.
    """

    world_size: int
    batch_size: int | None = None
    seed: int = 0
    epochs: int = 1
    leftover: str = "drop"
    grad_accum: int = 1
    max_tokens: int | None = None
    latent_factor: int = 8
    patch_size: int = 2
    temporal_factor: int | None = None  # video buckets only (None: DEFAULT_TEMPORAL_FACTOR); absent from image plans
    shuffle: str = "full"  # "full", or "window:SIZE" (samples per window): see plan_epoch; absent when full

    def __post_init__(self) -> None:
        object.__setattr__(self, "shuffle", parse_shuffle(self.shuffle))
        if self.world_size < 1:
            raise UsageError(f"--world-size must be >= 1 (number of training processes), got {self.world_size}")
        if self.batch_size is None and self.max_tokens is None:
            raise UsageError("give --batch-size (samples per rank per step) or --max-tokens (packing mode)")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.epochs < 1:
            raise UsageError(f"--epochs must be >= 1, got {self.epochs}")
        if self.grad_accum < 1:
            raise UsageError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.leftover not in LEFTOVER_POLICIES:
            raise UsageError(f"--leftover must be one of {LEFTOVER_POLICIES}, got {self.leftover!r}")
        if self.latent_factor < 1 or self.patch_size < 1:
            raise UsageError("--latent-factor and --patch-size must be >= 1")
        if self.temporal_factor is not None and self.temporal_factor < 1:
            raise UsageError(f"--temporal-factor must be >= 1 (frames per latent frame), got {self.temporal_factor}")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {self.seed}")

    @property
    def packing(self) -> bool:
        return self.max_tokens is not None

    @property
    def window(self) -> int | None:
        """Samples per window of a window shuffle; None for the full shuffle."""
        return None if self.shuffle == "full" else int(self.shuffle.split(":")[1])

    def for_buckets(self, names: Sequence[str]) -> "PlanConfig":
        """This config as a plan of ``names`` records it: the temporal factor filled in (default
        DEFAULT_TEMPORAL_FACTOR) where a bucket is a video one (``WxHxF``, F > 1), else left out."""
        video = any(bucket_dims(n)[2] > 1 for n in names)
        if video:
            return self if self.temporal_factor is not None else replace(self, temporal_factor=DEFAULT_TEMPORAL_FACTOR)
        return replace(self, temporal_factor=None)

    def to_json(self) -> dict[str, Any]:
        """The fields; ``temporal_factor`` and ``shuffle`` only where set (other plans' ``_plan.json`` stays as
        it was)."""
        out = asdict(self)
        if out["temporal_factor"] is None:
            del out["temporal_factor"]
        if out["shuffle"] == "full":  # plans of the full shuffle keep the _plan.json (and fingerprint) they had
            del out["shuffle"]
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PlanConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def parse_shuffle(text: str) -> str:
    """``--shuffle`` in canonical form: ``full``, or ``window:SIZE`` (``window`` alone: DEFAULT_WINDOW samples).

    Raises UsageError naming the option for another value."""
    kind, _, size = str(text).partition(":")
    if kind == "full" and not size:
        return "full"
    if kind == "window":
        if not size:
            return f"window:{DEFAULT_WINDOW}"
        if size.isdigit() and int(size) >= 1:
            return f"window:{int(size)}"
    raise UsageError(f"--shuffle must be full, window or window:SIZE (SIZE: samples per window, >= 1), got {text!r}")


@dataclass(frozen=True)
class BucketedSamples:
    """The samples to plan, grouped by bucket in canonical order.

    ``names``: bucket names, sorted; ``ids``: (n,) uint64 grouped by bucket in ``names`` order,
    ascending within a bucket; ``counts``: (k,) int64 samples per bucket.
    """

    names: tuple[str, ...]
    ids: np.ndarray
    counts: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)  # (k,)


@dataclass(frozen=True)
class EpochSchedule:
    """One epoch (or its tail, from ``first_step``) as global batches.

    ``step_buckets``: (S,) int32 index into ``names``; ``step_sizes``: (S,) int64 samples per global
    batch; ``ids``: (sum(step_sizes),) uint64, global batch ``i`` at ``offsets[i]:offsets[i+1]``.
    ``padded`` / ``dropped``: (k,) int64 per bucket (of the whole epoch). Mixture plans only:
    ``datasets`` / ``captions`` (like ``ids``) uint8 dataset index and chosen caption index of each
    slot; ``dataset_counts`` (D,) int64 sample slots per dataset in the whole epoch.
    """

    epoch: int
    first_step: int
    names: tuple[str, ...]
    step_buckets: np.ndarray
    step_sizes: np.ndarray
    ids: np.ndarray
    padded: np.ndarray
    dropped: np.ndarray
    datasets: np.ndarray | None = None
    captions: np.ndarray | None = None
    dataset_counts: np.ndarray | None = None

    def slot_arrays(self) -> dict[str, np.ndarray]:
        """Every per-slot array, by plan column: ``sample_ids`` and the mixture columns this schedule has."""
        out = {"sample_ids": self.ids}
        out.update({c: getattr(self, f) for c, f in SLOT_COLUMNS.items() if getattr(self, f) is not None})
        return out

    @property
    def steps(self) -> int:
        return len(self.step_sizes)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.step_sizes)]).astype(np.int64)  # (S+1,)

    def tail(self, step: int) -> "EpochSchedule":
        """The global batches from ``step`` (an absolute step number) to the end of the epoch."""
        if not self.first_step <= step <= self.first_step + self.steps:
            raise UsageError(
                f"step {step} is outside epoch {self.epoch} (steps {self.first_step}..{self.first_step + self.steps})"
            )
        cut = step - self.first_step
        start = int(self.offsets[cut])
        return replace(
            self,
            first_step=step,
            step_buckets=self.step_buckets[cut:],
            step_sizes=self.step_sizes[cut:],
            ids=self.ids[start:],
            datasets=None if self.datasets is None else self.datasets[start:],
            captions=None if self.captions is None else self.captions[start:],
        )


def group_samples(
    sample_ids: Sequence[int] | np.ndarray | pa.Array, buckets: Sequence[str] | pa.Array, *, source: str = "manifest"
) -> BucketedSamples:
    """Group samples by bucket name in canonical order (bucket name, then sample id).

    Raises ValueError naming ``source`` for a bucket name that is not ``"WxH"`` or ``"WxHxF"``, a null bucket, or
    a sample id listed twice in one bucket.
    """
    ids = np.asarray(
        sample_ids.to_numpy() if isinstance(sample_ids, (pa.Array, pa.ChunkedArray)) else sample_ids, dtype=np.uint64
    )
    arr = buckets if isinstance(buckets, (pa.Array, pa.ChunkedArray)) else pa.array(buckets, pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if len(arr) != len(ids):
        raise UsageError(f"{source}: {len(ids)} sample ids but {len(arr)} bucket names")
    if arr.null_count:
        raise UsageError(f"{source}: {arr.null_count} samples have no bucket; rebuild it with `bucketeer scan`")
    enc = pc.dictionary_encode(arr.cast(pa.string()))
    names = enc.dictionary.to_pylist()
    for name in names:
        try:
            bucket_dims(name)
        except ValueError as e:
            raise UsageError(
                f"{source}: unknown bucket {name!r} ({e}); rebucket it with `bucketeer rebucket`"
            ) from None
    rank = np.argsort(np.argsort(np.asarray(names, dtype=object)))  # dictionary index -> sorted position
    codes = rank[enc.indices.to_numpy()].astype(np.int32)  # (n,)
    order = np.argsort(ids)
    # a stable sort of small ints is a radix sort in numpy: cheap even for 10M rows
    small = codes.astype(np.int16) if len(names) < 2**15 else codes
    order = order[np.argsort(small[order], kind="stable")]  # (n,) by bucket, then id
    ids, codes = ids[order], codes[order]
    if len(ids) > 1 and np.any((ids[1:] == ids[:-1]) & (codes[1:] == codes[:-1])):
        raise UsageError(f"{source}: a sample id is listed twice; rebuild it with `bucketeer scan`")
    counts = np.bincount(codes, minlength=len(names)).astype(np.int64)
    return BucketedSamples(names=tuple(sorted(names)), ids=ids, counts=counts)


def cached_mask(sample_ids: np.ndarray, available: Iterable[int] | np.ndarray) -> np.ndarray:
    """(n,) bool: which samples have a good record in the cache (``available`` sample ids)."""
    avail = np.asarray(
        available if isinstance(available, np.ndarray) else np.fromiter(available, np.uint64), dtype=np.uint64
    )
    return np.isin(np.asarray(sample_ids, dtype=np.uint64), avail)


def latent_tokens(names: Sequence[str], latent_factor: int = 8, patch_size: int = 2,
                  temporal_factor: int | None = None) -> np.ndarray:  # fmt: skip
    """(k,) int64 latent tokens per sample of each bucket: ``ceil(W/(f*p)) * ceil(H/(f*p))`` (pixels -> patches),
    times ``(F - 1) // t + 1`` latent frames for a ``WxHxF`` bucket (``t``: ``temporal_factor``, None: 4)."""
    cell = latent_factor * patch_size
    dims = np.asarray([bucket_dims(n) for n in names], dtype=np.int64).reshape(-1, 3)  # (k, 3): W, H, F
    frames = latent_frames(dims[:, 2], temporal_factor or DEFAULT_TEMPORAL_FACTOR)  # (k,)
    return (-(-dims[:, 0] // cell)) * (-(-dims[:, 1] // cell)) * frames


def bucket_batch_sizes(names: Sequence[str], config: PlanConfig) -> np.ndarray:
    """(k,) int64 per-rank batch size of each bucket. Raises UsageError when one sample exceeds --max-tokens."""
    if not config.packing:
        return np.full(len(names), config.batch_size, dtype=np.int64)
    tokens = latent_tokens(names, config.latent_factor, config.patch_size, config.temporal_factor)
    sizes = config.max_tokens // tokens
    if config.batch_size is not None:
        sizes = np.minimum(sizes, config.batch_size)
    if np.any(sizes < 1):
        worst = int(np.argmax(tokens))
        raise UsageError(
            f"bucket {names[worst]} has {tokens[worst]} latent tokens per sample, above --max-tokens "
            f"{config.max_tokens}; raise --max-tokens to at least {tokens.max()}"
            + (" or re-scan with shorter --frames" if bucket_dims(names[worst])[2] > 1 else "")
        )
    return sizes




def _sort_batches(ids: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``ids`` with each batch (consecutive runs of ``sizes``) sorted ascending: (sum(sizes),) uint64."""
    if len(sizes) and np.all(sizes == sizes[0]):  # fixed batch: one reshape
        return np.sort(ids.reshape(len(sizes), -1), axis=1).reshape(-1)  # (S, G) sorted along G
    out = ids.copy()
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)  # (S,)
    for size in np.unique(sizes):  # a loop over distinct batch sizes (at most one per bucket)
        steps = np.flatnonzero(sizes == size)
        slots = concat_ranges(starts[steps], np.full(len(steps), size))  # (len(steps) * size,)
        out[slots] = np.sort(ids[slots].reshape(len(steps), -1), axis=1).reshape(-1)
    return out








def plan_epoch(samples: BucketedSamples, config: PlanConfig, epoch: int) -> EpochSchedule:
    """The global batches of ``epoch``. Raises ValueError when the epoch would have no step."""
    rng = np.random.default_rng([config.seed, epoch])
    n = samples.counts  # (k,)
    k = len(n)
    starts = samples.starts  # (k,)
    global_size = bucket_batch_sizes(samples.names, config) * config.world_size  # (k,)

    # 1. a shuffle per bucket: shuffled[starts[b] + q] is the q-th sample of bucket b this epoch
    batches = n // global_size if config.leftover == "drop" else -(-n // global_size)  # (k,) see step 2
    shuffled = np.empty(len(samples.ids), dtype=np.int64)  # (n_samples,)
    for b in range(k):  # a loop over buckets (tens), never over samples
        part = slice(int(starts[b]), int(starts[b] + n[b]))
        if config.window is None:
            local = rng.permutation(int(n[b]))
        elif config.world_size == 1:
            local = window_order(rng, np.argsort(samples.ids[part], kind="stable"), config.window)
        else:  # each rank's run of the windows shuffled within (the runs rank_runs deals)
            runs = run_of(np.arange(n[b]), int(batches[b]), int(global_size[b]), config.world_size, config.window)
            local = window_order(rng, np.argsort(samples.ids[part], kind="stable"), config.window, runs)
        shuffled[part] = starts[b] + local

    # 2. global batches per bucket
    taken = batches * global_size
    padded = np.maximum(taken - n, 0)
    dropped = np.maximum(n - taken, 0)
    if batches.sum() == 0:
        largest = int(np.argmax(n)) if k else 0
        raise UsageError(
            f"nothing to train: no bucket fills one global batch ({config.world_size} ranks x per-rank batch "
            f"= {int(global_size[largest]) if k else 0}) and --leftover drop drops them all "
            f"(largest bucket {samples.names[largest] if k else '-'} has {int(n[largest]) if k else 0} samples); "
            "lower --batch-size / --world-size, or use --leftover pad"
        )

    # 3. shuffle the global batches across buckets
    batch_bucket = np.repeat(np.arange(k), batches)  # (S,) bucket of each global batch
    batch_index = concat_ranges(np.zeros(k, np.int64), batches)  # (S,) its index within the bucket
    order = rng.permutation(len(batch_bucket))
    batch_bucket, batch_index = batch_bucket[order], batch_index[order]
    if config.window is not None:  # buckets interleaved, each bucket's batches in its window order
        batch_index[np.argsort(batch_bucket, kind="stable")] = concat_ranges(np.zeros(k, np.int64), batches)

    # 4. steps per epoch: a multiple of grad_accum
    rest = len(batch_bucket) % config.grad_accum
    if rest and config.leftover == "drop":
        keep = len(batch_bucket) - rest
        dropped = dropped + np.bincount(
            batch_bucket[keep:], weights=global_size[batch_bucket[keep:]], minlength=k
        ).astype(np.int64)
        batch_bucket, batch_index = batch_bucket[:keep], batch_index[:keep]
        if keep == 0:
            raise UsageError(
                f"nothing to train: the epoch has {rest} global batches, fewer than --grad-accum "
                f"{config.grad_accum}, and --leftover drop drops them; lower --grad-accum or use --leftover pad"
            )
    elif rest:
        repeat = np.arange(config.grad_accum - rest) % len(batch_bucket)
        padded = padded + np.bincount(
            batch_bucket[repeat], weights=global_size[batch_bucket[repeat]], minlength=k
        ).astype(np.int64)
        batch_bucket = np.concatenate([batch_bucket, batch_bucket[repeat]])
        batch_index = np.concatenate([batch_index, batch_index[repeat]])

    # sample ids: position q of bucket b's (cyclic, for padding) shuffle, for every slot
    sizes = global_size[batch_bucket]  # (S,)
    q = concat_ranges(batch_index * sizes, sizes)  # (sum(sizes),) position within the bucket's sequence
    slot_bucket = np.repeat(batch_bucket, sizes)  # (sum(sizes),)
    if config.window is not None and config.world_size > 1:
        q = rank_runs(q, np.repeat(batch_index, sizes), batches[slot_bucket], np.repeat(sizes, sizes),
                       config.world_size, config.window)
    ids = samples.ids[shuffled[starts[slot_bucket] + q % n[slot_bucket]]]

    # 5. each global batch in ascending id order (window shuffle: each rank's slice of it)
    ids = _sort_batches(ids, sizes) if config.window is None else _sort_batches(
        ids, np.repeat(sizes // config.world_size, config.world_size))
    return EpochSchedule(
        epoch=epoch,
        first_step=0,
        names=samples.names,
        step_buckets=batch_bucket.astype(np.int32),
        step_sizes=sizes.astype(np.int64),
        ids=ids,
        padded=padded.astype(np.int64),
        dropped=dropped.astype(np.int64),
    )
