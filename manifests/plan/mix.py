"""Mixture plans: several manifests in one plan, each with a weight or a repeat count; caption choice.

    bucketeer plan M1 M2 M3 --out PLAN --weights 0.6,0.3,0.1 ...   # or --repeats 1,3,10

A sample is the pair ``(dataset, sample id)``: the same image in two manifests is two samples. Every
bucket is shared by all datasets (a global batch may hold samples of several), and the plan's
``dataset`` column says which dataset each sample of a row comes from.

**The counting rule** (exact integer arithmetic; values are read as decimal fractions, ``0.1`` is 1/10):

1. samples per epoch of dataset ``d`` with ``n_d`` samples:

   - ``--repeats r_1,...``: ``k_d = round(r_d * n_d)``, halves rounded up (``r_d`` may be fractional:
     0.5 takes half the dataset each epoch, 2.5 every sample 2 or 3 times);
   - ``--weights w_1,...`` (normalised to sum 1): the epoch has ``T = n_1 + ... + n_D`` samples (as
     many as the datasets hold together) and ``k_d`` is ``T * w_d / sum(w)`` rounded by largest
     remainder (the floors, then +1 for the largest fractional parts, ties to the earlier dataset),
     so ``sum(k_d) == T`` exactly;

2. ``k_d`` is spread over the dataset's buckets in proportion to their sizes, by largest remainder
   again (ties to the earlier bucket name): ``k_{d,b}`` is fixed for the whole run, so every epoch
   has the same steps;
3. each epoch, each of the ``n_{d,b}`` samples appears ``floor(k_{d,b} / n_{d,b})`` times, and
   ``k_{d,b} mod n_{d,b}`` of them once more, drawn without replacement anew each epoch (seeded by
   ``(seed, epoch)``): a sample is never repeated while another of its dataset and bucket waits;
4. the buckets' sample slots are then batched exactly like a one-manifest plan's samples
   (:mod:`manifests.plan.schedule`: shuffle, global batches, ``--leftover``, ``--grad-accum``), so
   a bucket's leftover is dropped (or padded) as there; ``_plan.json`` records per epoch the slots
   each dataset trains on after that.

**Per-sample weights** (``--weight-by``, :mod:`manifests.select`): a dataset's weights ``w_i >= 0`` replace
its bucket sizes in step 2 (``k_d`` is spread over buckets in proportion to their total weight ``W_{d,b}``),
and step 3 becomes: each epoch, sample ``i`` of a stratum of ``k`` slots is drawn ``floor(x_i)`` or
``ceil(x_i)`` times with ``x_i = k * w_i / W_{d,b}`` and probability ``frac(x_i)`` of the ceiling
(systematic sampling over the fractional parts, in an order shuffled anew each epoch, seeded by
``(seed, epoch)``): exactly ``k`` slots per stratum per epoch, and in expectation exactly ``x_i`` draws of
each sample. A weight of 0 is never drawn; repeats of a sample are slots like any other (counted in the
per-bucket and per-dataset slots of ``_plan.json``), not padding.

**Caption choice**: when a manifest has a ``captions`` list column, each slot's ``caption_index`` is
``floor(u * len(captions))`` (0 for a sample with one caption) with ``u`` uniform, a pure function of
``(seed, epoch, dataset, sample id)`` (:func:`manifests.draws.uniforms`): the same in every rank and
resume, and changing from epoch to epoch. A one-manifest plan takes this path only when its manifest
has caption lists or ``--repeats``/``--weights`` is given; otherwise it is the plan of
:mod:`manifests.plan.schedule`, byte for byte. With one dataset and ``--repeats 1`` the schedule is
the one-manifest schedule (same rows, plus the columns).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.draws import SALT_CAPTION_CHOICE, uniforms
from manifests.errors import UsageError
from manifests.plan.schedule import BucketedSamples, EpochSchedule, PlanConfig, group_samples, plan_epoch

__all__ = ["MIX_RULES", "RULE_HELP", "MixRule", "DatasetSamples", "MixedSamples", "PlanSamples", "plan_samples",
           "schedule_epoch", "mix_samples", "mix_epoch", "caption_choice", "largest_remainder", "combined_fingerprint",
           "caption_counts", "weighted_counts", "draw_limits"]

MIX_RULES = ("weights", "repeats")
# the counting rule in a few lines: `bucketeer plan --help` shows it (the module docstring has the details)
RULE_HELP = (
    "Samples per epoch of a manifest of n samples: --repeats r gives round(r * n) (halves up; r may be "
    "fractional); --weights w (normalised) splits an epoch of as many samples as all manifests hold together by "
    "largest remainder. Each count k is spread over the manifest's buckets by largest remainder (fixed for the "
    "run); each epoch every sample of a bucket appears floor(k/n) times and a fresh random k mod n of them once "
    "more. Bucket leftovers are then dropped or padded (--leftover). "
    "Decimals are exact fractions; a sample is (manifest, sample id); the summary shows the counts per manifest."
)
MAX_DATASETS = 255  # the dataset column is uint8
MAX_CAPTIONS = 256  # the caption_index column is uint8
_DRAW_STREAM = 0x6D6978  # the per-epoch draw's random stream, apart from the schedule's


def largest_remainder(total: int, shares: Sequence[Fraction] | np.ndarray,
                      denominator: int | None = None) -> np.ndarray:  # fmt: skip
    """(n,) int64 summing to ``total``, proportional to ``shares``: floors, then +1 for the largest remainders
    (ties to the earlier entry).

    ``shares``: Fractions (any sum), or integer numerators over ``denominator`` (vectorised, exact).
    """
    if denominator is None:
        fracs = [Fraction(s) for s in shares]
        whole = sum(fracs)
        exact = [total * f / whole for f in fracs]
        base = np.asarray([e.numerator // e.denominator for e in exact], np.int64)
        rest = [e - int(b) for e, b in zip(exact, base)]
        order = sorted(range(len(rest)), key=lambda i: (-rest[i], i))
    else:
        num = np.asarray(shares, np.int64) * total  # exact: total * n_b < 2**63 for any real dataset
        base, rem = num // denominator, num % denominator
        order = np.lexsort((np.arange(len(rem)), -rem))  # by remainder descending, then index
    out = base.copy()
    out[np.asarray(order[: total - int(base.sum())], np.int64)] += 1
    return out


@dataclass(frozen=True)
class MixRule:
    """``--weights`` or ``--repeats``: one value per dataset, as exact fractions of the decimal given."""

    kind: str
    values: tuple[Fraction, ...]

    @classmethod
    def parse(cls, kind: str, text: str, datasets: int) -> "MixRule":
        """Raises UsageError naming the option for a value that is not a positive number or a wrong count."""
        option = f"--{kind}"
        try:
            values = tuple(Fraction(v.strip()) for v in text.split(","))
        except (ValueError, ZeroDivisionError):
            raise UsageError(f"{option} must be comma-separated numbers, one per manifest, got {text!r}") from None
        if len(values) != datasets:
            raise UsageError(f"{option} has {len(values)} values for {datasets} manifests: give one per manifest, "
                             "in the same order")  # fmt: skip
        if any(v <= 0 for v in values):
            raise UsageError(f"{option} values must be > 0, got {text!r} (leave a manifest out to skip it)")
        return cls(kind, values)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "MixRule":
        return cls(d["kind"], tuple(Fraction(v) for v in d["values"]))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "values": [str(v) for v in self.values]}

    def per_epoch(self, sizes: Sequence[int]) -> np.ndarray:
        """(D,) int64 samples per epoch of each dataset of ``sizes`` samples (the module's rule, step 1)."""
        if self.kind == "repeats":
            return np.asarray([int(Fraction(2 * r * n + 1) // 2) for r, n in zip(self.values, sizes)], np.int64)
        return largest_remainder(int(sum(sizes)), self.values)


@dataclass(frozen=True)
class DatasetSamples:
    """One manifest's samples to plan, what every plan is made from (a one-manifest plan: a list of one).

    ``ids``, ``buckets``: the samples (already filtered by the cache); ``caption_counts``: (n,) captions per
    sample, None when the manifest has no caption lists; ``source``: the name errors give. Recorded in
    ``_plan.json``: the manifest's and cache's fingerprints, their URLs (redacted), and the samples left out
    for the cache (``not_in_cache``: no record; ``stale``: a record of an older version of the row).
    ``weights``: (n,) float64 per-sample draw weights (``--weight-by``), None for none.
    """

    ids: np.ndarray
    buckets: pa.Array
    caption_counts: np.ndarray | None = None
    source: str = "manifest"
    manifest_fingerprint: str | None = None
    cache_fingerprint: str | None = None
    manifest: str | None = None
    cache: str | None = None
    not_in_cache: int = 0
    stale: int = 0
    weights: np.ndarray | None = None


@dataclass(frozen=True)
class MixedSamples:
    """Every dataset's samples, by bucket, then dataset, then id (the global index order).

    ``ids`` / ``datasets`` / ``caption_counts``: (n,) per sample; ``strata``: (k, D) int64 samples
    per (bucket, dataset); ``slots``: (k, D) int64 slots per epoch ``k_{d,b}``; ``per_epoch``: (D,);
    ``weights``: (n,) float64 per-sample draw weights, None when no dataset has any.
    """

    names: tuple[str, ...]
    ids: np.ndarray
    datasets: np.ndarray
    caption_counts: np.ndarray | None
    strata: np.ndarray
    slots: np.ndarray
    per_epoch: np.ndarray
    rule: MixRule
    weights: np.ndarray | None = None

    @property
    def counts(self) -> np.ndarray:
        """(k,) int64 sample slots per bucket per epoch: what the schedule batches."""
        return self.slots.sum(axis=1)

    @property
    def sizes(self) -> np.ndarray:
        """(D,) int64 samples per dataset."""
        return self.strata.sum(axis=0)


def mix_samples(datasets: Sequence[DatasetSamples], rule: MixRule) -> MixedSamples:
    """Group every dataset's samples by bucket and apply the counting rule. Raises UsageError for a dataset
    with no sample, one with a sample listed twice, too many datasets or captions, or a dataset count of 0."""
    if not 1 <= len(datasets) <= MAX_DATASETS:
        raise UsageError(f"a plan mixes 1 to {MAX_DATASETS} manifests, got {len(datasets)}")
    grouped: list[BucketedSamples] = []
    counts: list[np.ndarray | None] = []
    weights: list[np.ndarray | None] = []
    for d in datasets:
        g = group_samples(d.ids, d.buckets, source=d.source)
        if not len(g.ids):
            raise UsageError(f"{d.source}: no sample to plan (empty manifest, none of its samples is in the cache, "
                             "or --where keeps none)")  # fmt: skip
        grouped.append(g)
        weights.append(None if d.weights is None else _in_group_order(d.ids, d.weights.astype(np.float64), g))
        if d.caption_counts is None:
            counts.append(None)
            continue
        c = _in_group_order(d.ids, np.asarray(d.caption_counts, np.int64), g)
        if c.max(initial=1) > MAX_CAPTIONS:
            raise UsageError(f"{d.source}: a sample has {int(c.max())} captions; a plan chooses among at most "
                             f"{MAX_CAPTIONS}")  # fmt: skip
        counts.append(np.maximum(c, 1))
    names = tuple(sorted(set().union(*(g.names for g in grouped))))
    strata = np.zeros((len(names), len(grouped)), np.int64)
    for d, g in enumerate(grouped):
        strata[[names.index(n) for n in g.names], d] = g.counts
    sizes = strata.sum(axis=0)
    per_epoch = rule.per_epoch(sizes.tolist())
    zero = np.flatnonzero(per_epoch == 0)
    if len(zero):
        d = int(zero[0])
        raise UsageError(f"{datasets[d].source}: --{rule.kind} {rule.values[d]} of {int(sizes[d])} samples gives "
                         f"0 samples per epoch; raise its --{rule.kind}")  # fmt: skip
    weighted = any(w is not None for w in weights)
    mass = _stratum_weights(grouped, weights, names, strata) if weighted else None  # (k, D) float64
    for d in range(len(grouped)):
        if mass is not None and not mass[:, d].sum() > 0:
            raise UsageError(f"{datasets[d].source}: every kept sample has --weight-by 0; nothing to draw")
    slots = np.stack([largest_remainder(int(per_epoch[d]), strata[:, d], int(sizes[d])) if mass is None else
                      largest_remainder(int(per_epoch[d]), [Fraction(float(x)) for x in mass[:, d]])
                      for d in range(len(grouped))], axis=1)  # fmt: skip
    ids, dsets, caps, ws = [], [], [], []
    with_captions = any(c is not None for c in counts)
    for b, name in enumerate(names):  # a loop over buckets x datasets (hundreds), never over samples
        for d, g in enumerate(grouped):
            if not strata[b, d]:
                continue
            i = g.names.index(name)
            part = slice(int(g.starts[i]), int(g.starts[i] + g.counts[i]))
            ids.append(g.ids[part])
            dsets.append(np.full(int(g.counts[i]), d, np.uint8))
            if with_captions:
                caps.append(counts[d][part] if counts[d] is not None else np.ones(int(g.counts[i]), np.int64))
            if weighted:
                ws.append(weights[d][part] if weights[d] is not None else np.ones(int(g.counts[i]), np.float64))
    return MixedSamples(names=names, ids=np.concatenate(ids), datasets=np.concatenate(dsets),
                        caption_counts=np.concatenate(caps).astype(np.int64) if with_captions else None,
                        strata=strata, slots=slots, per_epoch=per_epoch, rule=rule,
                        weights=np.concatenate(ws) if weighted else None)  # fmt: skip


def _in_group_order(ids: np.ndarray, values: np.ndarray, g: BucketedSamples) -> np.ndarray:
    """``values`` (one per id of ``ids``) in the order of ``g.ids`` (grouped by bucket, then id)."""
    order = np.argsort(np.asarray(ids, np.uint64))
    return values[order][np.searchsorted(np.asarray(ids, np.uint64)[order], g.ids)]


def _stratum_weights(grouped: Sequence[BucketedSamples], weights: Sequence[np.ndarray | None],
                     names: tuple[str, ...], strata: np.ndarray) -> np.ndarray:  # fmt: skip
    """(k, D) float64 total weight of each (bucket, dataset); a dataset without weights weighs 1 per sample."""
    mass = strata.astype(np.float64)
    for d, (g, w) in enumerate(zip(grouped, weights)):
        if w is not None:
            sums = np.add.reduceat(w, g.starts) if len(w) else np.zeros(0)
            mass[[names.index(n) for n in g.names], d] = np.where(g.counts > 0, sums, 0.0)
    return mass


def _expected(k: int, weights: np.ndarray) -> np.ndarray:
    """(n,) float64 expected draws ``k * w_i / sum(w)`` of a stratum of ``k`` slots (0 for a zero total)."""
    total = float(weights.sum())
    return weights * (k / total) if total > 0 else np.zeros(len(weights))


def weighted_counts(rng: np.random.Generator, k: int, weights: np.ndarray) -> np.ndarray:
    """(n,) int64 draws of each sample of a stratum of ``k`` slots: ``floor(x_i)`` or ``ceil(x_i)`` with
    ``x_i = k * w_i / sum(w)``, summing to ``k`` exactly, ``E = x_i`` (systematic sampling of the fractional
    parts in an order shuffled by ``rng``)."""
    x = _expected(k, weights)
    counts = np.floor(x).astype(np.int64)
    rest = k - int(counts.sum())  # >= 0: the floors never exceed sum(x) < k + 1
    if rest <= 0:
        return counts
    frac = x - counts  # (n,) in [0, 1), summing to `rest` up to rounding
    order = rng.permutation(len(x))
    cum = np.cumsum(frac[order])
    cum *= rest / cum[-1]
    points = rng.random() + np.arange(rest)  # one point per unit of fractional mass
    hits = np.unique(order[np.minimum(np.searchsorted(cum, points, side="right"), len(x) - 1)])
    if len(hits) < rest:  # rounding put two points in one interval (a fraction within 1e-12 of 1): fill up
        free = np.setdiff1d(np.flatnonzero(frac > 0), hits)
        hits = np.concatenate([hits, free[np.argsort(-frac[free], kind="stable")][: rest - len(hits)]])
    counts[hits] += 1
    return counts


def draw_limits(mix: MixedSamples) -> np.ndarray:
    """(n,) int64 the most times each sample of a weighted mixture can be drawn in an epoch: ``ceil(x_i)``."""
    assert mix.weights is not None
    limits = np.zeros(len(mix.ids), np.int64)
    starts = np.concatenate([[0], np.cumsum(mix.strata.reshape(-1))]).astype(np.int64)
    for s, k in enumerate(mix.slots.reshape(-1).tolist()):
        part = slice(int(starts[s]), int(starts[s + 1]))
        x = _expected(k, mix.weights[part])
        limits[part] = np.floor(x).astype(np.int64) + (x > np.floor(x))
    return limits


PlanSamples = BucketedSamples | MixedSamples


def plan_samples(datasets: Sequence[DatasetSamples], rule: MixRule | None = None) -> PlanSamples:
    """What a plan draws from. One dataset without a rule and without caption lists is planned as it is
    (:func:`manifests.plan.schedule.plan_epoch`, the plans of before mixtures, byte for byte); anything else is
    a mixture, by ``rule`` (default: every sample once per epoch). Raises UsageError for no sample to plan, or
    a rule for another number of datasets (see also :func:`mix_samples`)."""
    if rule is None and len(datasets) == 1 and datasets[0].caption_counts is None and datasets[0].weights is None:
        samples = group_samples(datasets[0].ids, datasets[0].buckets, source=datasets[0].source)
        if not len(samples.ids):
            raise UsageError("nothing to train: no sample to plan (empty manifest, none of its samples is in "
                             "the cache, or --where keeps none)")  # fmt: skip
        return samples
    rule = rule or MixRule("repeats", (Fraction(1),) * len(datasets))
    if len(rule.values) != len(datasets):
        raise UsageError(f"the plan mixes {len(rule.values)} manifests, {len(datasets)} given: give the manifests it "
                         "was made from, in the same order")  # fmt: skip
    return mix_samples(datasets, rule)


def schedule_epoch(samples: PlanSamples, config: PlanConfig, epoch: int) -> EpochSchedule:
    """One epoch of a one-manifest plan (:func:`plan_epoch`) or of a mixture (:func:`mix_epoch`)."""
    if isinstance(samples, MixedSamples):
        return mix_epoch(samples, config, epoch)
    return plan_epoch(samples, config, epoch)


def caption_choice(seed: int, epoch: int, sample_ids: np.ndarray, datasets: np.ndarray | None,
                   caption_counts: np.ndarray) -> np.ndarray:  # fmt: skip
    """(n,) uint8: the caption index of each sample this epoch, uniform over its ``caption_counts`` captions.

    A pure function of ``(seed, epoch, dataset, sample id)``; ``datasets`` None means dataset 0.
    """
    salt = np.uint64(SALT_CAPTION_CHOICE) + (np.zeros(1, np.uint64) if datasets is None
                                             else np.asarray(datasets, np.uint64))  # fmt: skip
    u = uniforms(seed, epoch, sample_ids, salt)
    return np.minimum((u * caption_counts).astype(np.int64), caption_counts - 1).astype(np.uint8)


def mix_epoch(mix: MixedSamples, config: PlanConfig, epoch: int) -> EpochSchedule:
    """The global batches of ``epoch`` of a mixture plan (see the module docstring for the rule).

    Raises ValueError like :func:`manifests.plan.schedule.plan_epoch` when the epoch would have no step.
    """
    rng = np.random.default_rng([config.seed, epoch, _DRAW_STREAM])
    starts = np.concatenate([[0], np.cumsum(mix.strata.reshape(-1))]).astype(np.int64)  # stratum (b, d) starts
    pieces = []
    for s, (n, k) in enumerate(zip(mix.strata.reshape(-1).tolist(), mix.slots.reshape(-1).tolist())):
        if not k:
            continue
        if mix.weights is not None:  # per-sample weights: floor or ceil of the expected draws
            counts = weighted_counts(rng, k, mix.weights[int(starts[s]) : int(starts[s]) + n])
            pieces.append(starts[s] + np.repeat(np.arange(n, dtype=np.int64), counts))
            continue
        full, rest = divmod(k, n)
        local = [np.tile(np.arange(n, dtype=np.int64), full)] if full else []
        if rest:
            local.append(_subset(rng, n, rest))
        pieces.append(starts[s] + np.concatenate(local))
    slots = np.concatenate(pieces)  # (K,) global sample index, bucket-major: what the schedule batches
    schedule = plan_epoch(BucketedSamples(mix.names, slots.view(np.uint64), mix.counts), config, epoch)
    index = schedule.ids.view(np.int64)  # batches sorted by global index = by (dataset, id)
    ids, datasets = mix.ids[index], mix.datasets[index]
    several = int(mix.strata.shape[1]) > 1
    captions = None
    if mix.caption_counts is not None:
        captions = caption_choice(config.seed, epoch, ids, datasets if several else None, mix.caption_counts[index])
    counts = [np.count_nonzero(datasets == d) for d in range(mix.strata.shape[1])] if several else [len(ids)]
    return replace(schedule, ids=ids, datasets=datasets if several else None, captions=captions,
                   dataset_counts=np.asarray(counts, np.int64))  # fmt: skip


def _subset(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """(size,) int64: a uniform random subset of ``range(n)`` without replacement, in no particular order (the
    schedule shuffles). More than half: the complement of a drawn subset (fewer draws, ascending indices)."""
    if 2 * size <= n:
        return rng.choice(n, size, replace=False, shuffle=False)
    keep = np.ones(n, bool)
    keep[rng.choice(n, n - size, replace=False, shuffle=False)] = False
    return np.flatnonzero(keep)


def combined_fingerprint(fingerprints: Sequence[str | None]) -> str | None:
    """One fingerprint for the list of the datasets' (manifest or cache) fingerprints; None when all are None."""
    if all(f is None for f in fingerprints):
        return None
    return hashlib.sha256(json.dumps(list(fingerprints)).encode()).hexdigest()


def caption_counts(samples: pa.Table) -> np.ndarray | None:
    """(n,) int64 captions per manifest row (``len(captions)``, 1 where null); None when no row has a list."""
    if "captions" not in samples.column_names:
        return None
    captions = samples.column("captions").combine_chunks()
    if captions.null_count == len(captions):
        return None
    return np.maximum(pc.fill_null(pc.list_value_length(captions), 1).to_numpy().astype(np.int64), 1)
