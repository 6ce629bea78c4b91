"""Property tests of the pure schedule: world sizes 1..64, batch sizes 1..32, skewed buckets.

Each invariant is computed here from the rows, independently of ``manifests.plan.check``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from manifests.plan.rows import rank_table, resplit, schedule_from_rank_tables
from manifests.plan.schedule import PlanConfig, bucket_batch_sizes, group_samples, latent_tokens, plan_epoch

NAMES = ["1024x1024", "1152x896", "896x1152", "1344x768", "768x1344", "512x2048", "2048x512"]
# every property below holds under both shuffles (a window smaller than most buckets, not a batch multiple)
SHUFFLES = ["full", "window:37"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_samples(counts: list[int], seed: int = 0, names: list[str] = NAMES):
    rng = np.random.default_rng(seed)
    ids = rng.choice(2**62, size=sum(counts), replace=False).astype(np.uint64)
    buckets = np.repeat(np.asarray(names[: len(counts)]), counts)
    rng.shuffle(buckets)  # manifest row order is arbitrary
    return ids, buckets


# skew: a bucket of one sample, buckets smaller than a global batch, one giant bucket
bucket_counts = st.lists(
    st.one_of(st.just(1), st.integers(2, 40), st.integers(41, 400), st.integers(2000, 6000)), min_size=1, max_size=6
)


def rows_by_rank(schedule, world):
    return [rank_table(schedule, world, r).to_pydict() for r in range(world)]


def check_epoch(ids, buckets, config: PlanConfig, schedule) -> None:
    """Every invariant of one planned epoch, from the rows."""
    world = config.world_size
    bucket_of = dict(zip(ids.tolist(), buckets.tolist()))
    sizes = dict(zip(sorted(set(buckets.tolist())), bucket_batch_sizes(sorted(set(buckets.tolist())), config).tolist()))
    rows = rows_by_rank(schedule, world)
    steps = len(rows[0]["step"])
    assert steps > 0 and steps % config.grad_accum == 0
    seen: Counter = Counter()
    for r, t in enumerate(rows):
        assert t["step"] == list(range(steps))  # same steps on every rank, in order
        assert set(t["rank"]) == {r} and set(t["epoch"]) == {schedule.epoch}
        assert t["bucket"] == rows[0]["bucket"]  # all ranks at a step share a bucket
        for bucket, batch in zip(t["bucket"], t["sample_ids"]):
            assert len(batch) == sizes[bucket]  # exactly B (or the bucket's packing batch)
            assert {bucket_of[i] for i in batch} == {bucket}  # one bucket per batch, the right one
            seen.update(batch)
    repeats = {b: 0 for b in sizes}
    for i, c in seen.items():
        repeats[bucket_of[i]] += c - 1
    padded = dict(zip(schedule.names, schedule.padded.tolist()))
    dropped = dict(zip(schedule.names, schedule.dropped.tolist()))
    assert repeats == padded  # nothing repeats except the counted padding
    per_bucket = Counter(buckets.tolist())
    distinct = Counter(bucket_of[i] for i in seen)
    for b in sizes:
        assert distinct[b] + dropped[b] == per_bucket[b]  # nothing vanishes uncounted
    if config.leftover == "pad":
        assert set(seen) == set(ids.tolist()) and sum(dropped.values()) == 0  # every sample at least once
    else:
        assert sum(padded.values()) == 0


def trainable(counts, config) -> bool:
    g = config.world_size * config.batch_size
    batches = sum(n // g for n in counts) if config.leftover == "drop" else sum(-(-n // g) for n in counts)
    return batches >= (config.grad_accum if config.leftover == "drop" else 1)


@pytest.mark.parametrize("shuffle", SHUFFLES)
@SETTINGS
@given(
    counts=bucket_counts,
    world=st.integers(1, 64),
    batch=st.integers(1, 32),
    leftover=st.sampled_from(["drop", "pad"]),
    grad_accum=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_every_invariant_holds(shuffle, counts, world, batch, leftover, grad_accum, seed):
    ids, buckets = make_samples(counts, seed % 1000)
    config = PlanConfig(world_size=world, batch_size=batch, seed=seed, leftover=leftover, grad_accum=grad_accum,
                        shuffle=shuffle)
    samples = group_samples(ids, buckets)
    event(f"trainable: {trainable(counts, config)}")
    if not trainable(counts, config):
        with pytest.raises(ValueError, match="nothing to train"):
            plan_epoch(samples, config, 0)
        return
    first = plan_epoch(samples, config, 0)
    for epoch in (0, 1):
        schedule = plan_epoch(samples, config, epoch)
        assert schedule.steps == first.steps  # same steps in every epoch
        check_epoch(ids, buckets, config, schedule)


@pytest.mark.parametrize("shuffle", SHUFFLES)
@settings(max_examples=25, deadline=None)
@given(
    counts=bucket_counts,
    world=st.integers(1, 16),
    max_tokens=st.integers(256, 20000),
    leftover=st.sampled_from(["drop", "pad"]),
    cap=st.one_of(st.none(), st.integers(1, 32)),
)
def test_packing_mode(shuffle, counts, world, max_tokens, leftover, cap):
    ids, buckets = make_samples(counts)
    config = PlanConfig(shuffle=shuffle, world_size=world, batch_size=cap, max_tokens=max_tokens, leftover=leftover)
    names = sorted(set(buckets.tolist()))
    tokens = latent_tokens(names)
    if tokens.max() > max_tokens:
        with pytest.raises(ValueError, match="--max-tokens"):
            bucket_batch_sizes(names, config)
        return
    sizes = bucket_batch_sizes(names, config)
    assert np.all(sizes * tokens <= max_tokens)  # a rank's tokens per step never exceed the budget
    if cap is None:
        assert np.all((sizes + 1) * tokens > max_tokens)  # and the batch is as large as fits
    else:
        assert np.all(sizes <= cap)
    samples = group_samples(ids, buckets)
    try:
        schedule = plan_epoch(samples, config, 0)
    except ValueError as e:
        assert "nothing to train" in str(e) and leftover == "drop"
        return
    check_epoch(ids, buckets, config, schedule)


def test_small_images_get_bigger_batches():
    config = PlanConfig(world_size=2, max_tokens=8192)
    sizes = bucket_batch_sizes(["512x512", "1024x1024", "2048x512"], config)
    # 1024 tokens, 4096 tokens, 4096 tokens (8x upsampled latent, 2x2 patches)
    assert sizes.tolist() == [8, 2, 2]


@pytest.mark.parametrize("shuffle", SHUFFLES)
@SETTINGS
@given(
    counts=bucket_counts,
    world=st.integers(1, 12),
    batch=st.integers(1, 12),
    data=st.data(),
    leftover=st.sampled_from(["drop", "pad"]),
)
def test_elastic_resume_consumes_every_sample_exactly_once(shuffle, counts, world, batch, leftover, data):
    ids, buckets = make_samples(counts)
    config = PlanConfig(shuffle=shuffle, world_size=world, batch_size=batch, leftover=leftover, seed=7)
    samples = group_samples(ids, buckets)
    if not trainable(counts, config):
        return
    schedule = plan_epoch(samples, config, 3)
    global_batch = world * batch
    new_world = data.draw(st.sampled_from([d for d in range(1, global_batch + 1) if global_batch % d == 0]))
    step = data.draw(st.integers(0, schedule.steps))
    old = rows_by_rank(schedule, world)
    consumed = Counter(i for t in old for batch_ in t["sample_ids"][:step] for i in batch_)
    rest_tables = resplit(schedule.tail(step), new_world)
    rest = Counter(i for t in rest_tables for batch_ in t.column("sample_ids").to_pylist() for i in batch_)
    whole = Counter(i for t in old for batch_ in t["sample_ids"] for i in batch_)
    assert consumed + rest == whole  # none skipped, none seen again (beyond the plan's own padding)
    if leftover == "drop":
        assert not set(consumed) & set(rest)
    for t in rest_tables:
        d = t.to_pydict()
        assert d["step"] == list(range(step, schedule.steps))  # original step numbers continue
        assert all(len(b) == global_batch // new_world for b in d["sample_ids"])
    # later epochs: a fresh plan with (N2, B2) has the very same global batches (the full shuffle); the window
    # shuffle deals each rank its own run of the windows, so its global batches depend on the world shape, but
    # the epoch has the same steps per bucket and leaves out as many samples
    fresh = plan_epoch(
        samples, PlanConfig(world_size=new_world, batch_size=global_batch // new_world, leftover=leftover, seed=7,
                            shuffle=shuffle), 4
    )
    later = plan_epoch(samples, config, 4)
    if shuffle == "full" or (world == 1 and new_world == 1):
        assert np.array_equal(fresh.ids, later.ids)
    assert np.array_equal(np.bincount(fresh.step_buckets, minlength=len(counts)),
                          np.bincount(later.step_buckets, minlength=len(counts)))
    assert np.array_equal(fresh.dropped, later.dropped) and np.array_equal(fresh.padded, later.padded)
    # rows -> global batches -> rows is the identity
    back = schedule_from_rank_tables([rank_table(schedule, world, r) for r in range(world)])
    assert np.array_equal(back.ids, schedule.ids) and np.array_equal(back.step_sizes, schedule.step_sizes)


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_pure_function_and_epochs_differ(shuffle):
    ids, buckets = make_samples([500, 300, 7, 1])
    config = PlanConfig(shuffle=shuffle, world_size=4, batch_size=8, seed=3, leftover="drop")
    a = plan_epoch(group_samples(ids, buckets), config, 0)
    order = np.random.default_rng(1).permutation(len(ids))  # another manifest row order
    b = plan_epoch(group_samples(ids[order], buckets[order]), config, 0)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.step_buckets, b.step_buckets)
    c = plan_epoch(group_samples(ids, buckets), config, 1)
    assert not np.array_equal(a.ids, c.ids)
    # drop leaves a different subset out each epoch
    assert set(a.ids.tolist()) != set(c.ids.tolist())
    d = plan_epoch(group_samples(ids, buckets), PlanConfig(shuffle=shuffle, world_size=4, batch_size=8, seed=4), 0)
    assert not np.array_equal(a.ids, d.ids)


def _chunk_fetches(rank_batches: list, per_chunk: int, held: int) -> int:
    """Chunk reads of one rank reading its batches in order (record ``i`` of storage in chunk ``i // per_chunk``),
    through an LRU of ``held`` chunks: what ``CacheReader.read_in_chunks`` fetches."""
    lru: dict[int, None] = {}
    fetched = 0
    for batch in rank_batches:
        for chunk in np.unique(np.asarray(batch, np.int64) // per_chunk).tolist():
            if chunk in lru:
                lru.pop(chunk)
            else:
                fetched += 1
                if len(lru) >= held:
                    lru.pop(next(iter(lru)))
            lru[chunk] = None
    return fetched


@pytest.mark.parametrize("world", [2, 8])
def test_window_shuffle_gives_each_rank_its_own_run_of_the_windows(world):
    """Under --shuffle window each rank's steps of a group draw on its own contiguous run of about a window
    (at most a window boundary inside: <= 2 ranges of storage), so its chunk reads per sample are those of a
    single rank, not ``world`` times more (each rank using 1 / world of every chunk it fetched)."""
    n, batch, window, per_chunk = 8192, 16, 256, 25  # ids 0..n-1 are storage order
    samples = group_samples(np.arange(n), ["1024x1024"] * n)
    per_sample = {}
    for w in (1, world):
        config = PlanConfig(world_size=w, batch_size=batch, seed=5, shuffle=f"window:{window}")
        schedule = plan_epoch(samples, config, 0)
        ranks = [rank_table(schedule, w, r).column("sample_ids").to_pylist() for r in range(w)]
        fetched = sum(_chunk_fetches(steps, per_chunk, held=32) for steps in ranks)
        per_sample[w] = fetched / sum(len(b) for steps in ranks for b in steps)
    assert per_sample[world] <= 1.1 * per_sample[1] and per_sample[world] < 1.5 / per_chunk, per_sample
    m = window // batch  # steps per group: each rank's share of a group is one window's worth
    for steps in ranks:
        for g in range(0, len(steps) - m + 1, m):
            run = np.sort(np.concatenate(steps[g:g + m]))
            assert len(run) == window and np.count_nonzero(np.diff(run) != 1) <= 1  # <= 2 contiguous ranges


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_grad_accum_counts_whole_global_batches(shuffle):
    ids, buckets = make_samples([100, 50])  # global batch 16: 6 + 3 = 9 full batches
    config = PlanConfig(world_size=2, batch_size=8, grad_accum=4, shuffle=shuffle)
    drop = plan_epoch(group_samples(ids, buckets), config, 0)
    assert drop.steps == 8 and drop.dropped.sum() == 150 - 8 * 16
    pad = plan_epoch(
        group_samples(ids, buckets), PlanConfig(world_size=2, batch_size=8, grad_accum=4, leftover="pad",
                                                shuffle=shuffle), 0
    )
    # pad: 7 + 4 = 11 batches (10 padded slots), then one more whole batch repeated -> 12
    assert pad.steps == 12 and pad.padded.sum() == 12 * 16 - 150


def test_bad_inputs_name_the_option():
    with pytest.raises(ValueError, match="--world-size"):
        PlanConfig(world_size=0, batch_size=1)
    with pytest.raises(ValueError, match="--batch-size"):
        PlanConfig(world_size=1, batch_size=0)
    with pytest.raises(ValueError, match="--leftover"):
        PlanConfig(world_size=1, batch_size=1, leftover="wrap")
    with pytest.raises(ValueError, match="'square'"):
        group_samples(np.arange(3, dtype=np.uint64), ["512x512", "square", "512x512"])
    ids, buckets = make_samples([5, 9])
    with pytest.raises(ValueError, match="nothing to train.*--leftover pad"):
        plan_epoch(group_samples(ids, buckets), PlanConfig(world_size=2, batch_size=8), 0)


@pytest.mark.parametrize("shuffle", SHUFFLES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.one_of(st.integers(1, 16), st.integers(17, 1024), st.just(1024)),
    batch=st.integers(1, 4),
    leftover=st.sampled_from(["drop", "pad"]),
    data=st.data(),
)
def test_plan_files_hold_every_invariant_at_up_to_1024_ranks(shuffle, world, batch, leftover, data):
    """Planned, encoded as one file (a row group per rank) and read back whole and rank by rank."""
    import fsspec

    from manifests.plan.parts import encode_epoch, read_epoch_ranks, read_epoch_whole
    from manifests.plan.meta import EpochEntry
    from manifests.plan.rows import PLAN_SCHEMA

    g = world * batch
    counts = data.draw(st.lists(st.integers(1, 3 * g), min_size=1, max_size=4))
    counts[0] = max(counts[0], g)  # at least one global batch
    ids, buckets = make_samples(counts, seed=world)
    config = PlanConfig(shuffle=shuffle, world_size=world, batch_size=batch, leftover=leftover, seed=world)
    schedule = plan_epoch(group_samples(ids, buckets), config, 2)
    check_epoch(ids, buckets, config, schedule)
    file = encode_epoch(schedule, world)
    fs = fsspec.filesystem("memory")
    path = f"/plan-props/{world}-{batch}-{leftover}/{file.path}"
    fs.pipe_file(path, file.data)
    whole, sha = read_epoch_whole(fs, path, "e", world, PLAN_SCHEMA)
    assert sha == file.sha256 and len(whole) == world
    ranks = data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=3, unique=True))
    entry = EpochEntry(epoch=schedule.epoch, first_step=0, steps=schedule.steps, steps_in_epoch=schedule.steps,
                       padded={}, dropped={}, padded_total=0, dropped_total=0, sha256=file.sha256,
                       bytes=len(file.data), footer_bytes=file.footer_bytes)  # fmt: skip
    some = read_epoch_ranks(fs, path, "e", entry, world, ranks, PLAN_SCHEMA)
    for rank in ranks:
        expected = rank_table(schedule, world, rank)
        assert some[rank].equals(expected) and whole[rank].equals(expected)
    # full shuffle: rank r holds the r-th id range of each global batch (a window plan deals each rank its own
    # run instead: test_window_shuffle_gives_each_rank_its_own_run_of_the_windows)
    for step in range(schedule.steps if shuffle == "full" else 0):
        lows = [int(whole[r].column("sample_ids")[step].values[0].as_py()) for r in range(min(world, 3))]
        assert lows == sorted(lows)


# ---------------------------------------------------------------- selection (--where) and weights (--weight-by)


def selected_mixture(counts, keep_seed: int, weighted: bool, zero_share: float):
    """The samples of ``counts`` that a random ``--where`` keeps (about 70%), with random weights (some 0)."""
    from manifests.plan.mix import DatasetSamples, plan_samples

    ids, buckets = make_samples(counts)
    rng = np.random.default_rng(keep_seed)
    keep = rng.random(len(ids)) < 0.7
    keep[rng.integers(len(ids))] = True
    weights = rng.gamma(1.0, 2.0, len(ids)) * (rng.random(len(ids)) >= zero_share) if weighted else None
    if weights is not None:
        weights[np.flatnonzero(keep)[0]] = 1.0  # something to draw
    kept = DatasetSamples(ids[keep], pa.array(buckets[keep]), weights=None if weights is None else weights[keep])
    return ids, buckets, keep, weights, plan_samples([kept])


@pytest.mark.parametrize("shuffle", SHUFFLES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    counts=st.lists(st.one_of(st.just(1), st.integers(2, 40), st.integers(41, 300)), min_size=1, max_size=4),
    world=st.integers(1, 8),
    batch=st.integers(1, 6),
    leftover=st.sampled_from(["drop", "pad"]),
    grad_accum=st.sampled_from([1, 3]),
    weighted=st.booleans(),
    zero_share=st.sampled_from([0.0, 0.3]),
    data=st.data(),
)
def test_every_invariant_holds_under_selection(shuffle, counts, world, batch, leftover, grad_accum, weighted,
                                               zero_share, data):  # fmt: skip
    from manifests.errors import UsageError
    from manifests.plan.mix import draw_limits, schedule_epoch

    ids, buckets, keep, weights, samples = selected_mixture(counts, data.draw(st.integers(0, 99)), weighted,
                                                            zero_share)  # fmt: skip
    config = PlanConfig(world_size=world, batch_size=batch, leftover=leftover, grad_accum=grad_accum, seed=2,
                        shuffle=shuffle)
    try:
        schedule = schedule_epoch(samples, config, 1)
    except UsageError:
        return  # nothing to train (no bucket fills a global batch): refused, not planned
    bucket_of = dict(zip(ids.tolist(), buckets.tolist()))
    rows = rows_by_rank(schedule, world)
    steps = len(rows[0]["step"])
    assert steps % grad_accum == 0
    seen: Counter = Counter()
    for r, t in enumerate(rows):
        assert t["step"] == list(range(steps)) and t["bucket"] == rows[0]["bucket"]  # equal steps, one bucket
        for bucket, batch_ in zip(t["bucket"], t["sample_ids"]):
            assert len(batch_) == batch and {bucket_of[i] for i in batch_} == {bucket}
            seen.update(batch_)
    excluded = set(ids[~keep].tolist())
    assert not excluded & set(seen)  # nothing the selection drops is planned
    names = list(schedule.names)
    slots = Counter(bucket_of[i] for i in seen.elements())
    for b, name in enumerate(names):  # every bucket: its slots per epoch - dropped + padded, exactly
        assert slots[name] == int(samples.counts[b] - schedule.dropped[b] + schedule.padded[b])
    if weighted:
        limits = dict(zip(samples.ids.tolist(), draw_limits(samples).tolist()))
        zero = {i for i, w in zip(ids[keep].tolist(), weights[keep].tolist()) if w == 0}
        assert not zero & set(seen)  # weight 0: never drawn
        if leftover == "drop":  # floor/ceil of the expected draws, never more
            assert all(c <= limits[i] for i, c in seen.items())
    elif leftover == "drop":
        assert max(seen.values()) == 1  # no duplicates beyond counted padding
    # elastic resume: the rest re-cut for another world size consumes every slot exactly once
    g = world * batch
    new_world = data.draw(st.sampled_from([d for d in range(1, g + 1) if g % d == 0]))
    step = data.draw(st.integers(0, schedule.steps))
    consumed = Counter(i for t in rows for b in t["sample_ids"][:step] for i in b)
    rest = Counter(i for t in resplit(schedule.tail(step), new_world) for b in t.column("sample_ids").to_pylist()
                   for i in b)  # fmt: skip
    assert consumed + rest == seen
    assert np.array_equal(schedule_epoch(samples, config, 1).ids, schedule.ids)  # exact resume: a pure function


# ---------------------------------------------------------------- video buckets (WxHxF, manifests/frames.py)

# clips of several frame counts in one pixel bucket, long and short ones, and 1-frame images among them
VIDEO_NAMES = ["832x480x81", "832x480x1", "480x832x33", "832x480x17", "512x512x1", "640x640x49", "832x480x33"]
video_counts = st.lists(st.one_of(st.just(1), st.integers(2, 40), st.integers(41, 400)), min_size=1, max_size=7)


def video_tokens(name: str, t: int) -> int:
    """Latent tokens of one sample of ``name``, written out: 16-pixel patches x ((F - 1) // t + 1) latent frames."""
    w, h, f = (int(x) for x in name.split("x"))
    return -(-w // 16) * -(-h // 16) * ((f - 1) // t + 1)


def test_video_tokens_count_latent_frames():
    names = ["832x480x81", "832x480x17", "832x480x1", "832x480", "832x480x2"]
    assert latent_tokens(names, temporal_factor=4).tolist() == [1560 * 21, 1560 * 5, 1560, 1560, 1560 * 1]
    assert latent_tokens(names, temporal_factor=8).tolist() == [1560 * 11, 1560 * 3, 1560, 1560, 1560]
    sizes = bucket_batch_sizes(names[:3], PlanConfig(world_size=1, max_tokens=1560 * 21, temporal_factor=4))
    assert sizes.tolist() == [1, 4, 21]  # long clips take smaller batches
    with pytest.raises(ValueError, match=r"^bucket 832x480x81 has 32760 latent tokens per sample, above --max-tokens "
                       r"32759; raise --max-tokens to at least 32760 or re-scan with shorter --frames$"):
        bucket_batch_sizes(names, PlanConfig(world_size=1, max_tokens=1560 * 21 - 1))
    assert PlanConfig(world_size=1, batch_size=1).for_buckets(names[:1]).temporal_factor == 4
    assert PlanConfig(world_size=1, batch_size=1, temporal_factor=2).for_buckets(["512x512x1"]).temporal_factor is None
    assert "temporal_factor" not in PlanConfig(world_size=1, batch_size=1).to_json()  # image plans: as before
    with pytest.raises(ValueError, match="--temporal-factor"):
        PlanConfig(world_size=1, batch_size=1, temporal_factor=0)


@pytest.mark.parametrize("shuffle", SHUFFLES)
@SETTINGS
@given(
    counts=video_counts,
    world=st.integers(1, 32),
    batch=st.one_of(st.none(), st.integers(1, 16)),
    max_tokens=st.one_of(st.none(), st.integers(2000, 400_000)),
    temporal=st.sampled_from([1, 4, 8]),
    leftover=st.sampled_from(["drop", "pad"]),
    grad_accum=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_every_invariant_holds_for_video_buckets(shuffle, counts, world, batch, max_tokens, temporal, leftover,
                                                 grad_accum, seed):  # fmt: skip
    """Fixed and token-budget batches over clips of mixed frame counts and 1-frame images: every invariant of
    one epoch (from the rows), steps equal in every epoch, a pure function, other epochs other orders."""
    if batch is None and max_tokens is None:
        batch = 4
    ids, buckets = make_samples(counts, seed % 1000, VIDEO_NAMES)
    config = PlanConfig(world_size=world, batch_size=batch, max_tokens=max_tokens, temporal_factor=temporal,
                        shuffle=shuffle, seed=seed, leftover=leftover, grad_accum=grad_accum)  # fmt: skip
    names = sorted(set(buckets.tolist()))
    tokens = np.asarray([video_tokens(n, temporal) for n in names])
    assert latent_tokens(names, temporal_factor=temporal).tolist() == tokens.tolist()
    if max_tokens is not None and tokens.max() > max_tokens:
        with pytest.raises(ValueError, match=f"latent tokens per sample, above --max-tokens {max_tokens}"):
            bucket_batch_sizes(names, config)
        event("over budget")
        return
    sizes = bucket_batch_sizes(names, config)
    if max_tokens is not None:
        assert np.all(sizes * tokens <= max_tokens) and np.all((sizes >= (batch or 0)) | ((sizes + 1) * tokens >
                                                                                           max_tokens))  # fmt: skip
    samples = group_samples(ids, buckets)
    try:
        first = plan_epoch(samples, config, 0)
    except ValueError as e:
        assert "nothing to train" in str(e)
        event("nothing to train")
        return
    event("planned")
    check_epoch(ids, buckets, config, first)
    again = plan_epoch(group_samples(ids[::-1], buckets[::-1]), config, 0)  # any manifest row order
    assert np.array_equal(again.ids, first.ids) and np.array_equal(again.step_buckets, first.step_buckets)
    second = plan_epoch(samples, config, 1)
    assert second.steps == first.steps
    check_epoch(ids, buckets, config, second)
    if first.steps >= 6:  # 6! orders of the batches at least: two epochs alike by chance is out of the question
        third = plan_epoch(samples, config, 2)
        assert not all(np.array_equal(e.ids, first.ids) and np.array_equal(e.step_buckets, first.step_buckets)
                       for e in (second, third))  # fmt: skip


@pytest.mark.parametrize("shuffle", SHUFFLES)
@SETTINGS
@given(counts=video_counts, world=st.integers(1, 8), max_tokens=st.integers(40_000, 200_000), data=st.data(),
       leftover=st.sampled_from(["drop", "pad"]))  # fmt: skip
def test_video_resume_exact_and_elastic(shuffle, counts, world, max_tokens, data, leftover):
    """A token-budget video plan cut at any step: the same ranks (exact) or any world size that divides every
    global batch (elastic) train the rest, every sample exactly as often as the uninterrupted epoch."""
    ids, buckets = make_samples(counts, 3, VIDEO_NAMES)
    config = PlanConfig(world_size=world, max_tokens=max_tokens, temporal_factor=4, leftover=leftover, seed=11,
                        shuffle=shuffle)
    try:
        schedule = plan_epoch(group_samples(ids, buckets), config, 2)
    except ValueError:
        return  # over budget or nothing to train: covered above
    step = data.draw(st.integers(0, schedule.steps))
    old = rows_by_rank(schedule, world)
    whole = Counter(i for t in old for b in t["sample_ids"] for i in b)
    consumed = Counter(i for t in old for b in t["sample_ids"][:step] for i in b)
    exact = resplit(schedule.tail(step), world)
    assert [t.to_pydict() for t in exact] == [{k: v[step:] for k, v in t.items()} for t in old]  # the same rows
    sizes = set(schedule.step_sizes[step:].tolist())
    new_world = data.draw(st.sampled_from([d for d in range(1, 65) if all(g % d == 0 for g in sizes)]))
    rest = resplit(schedule.tail(step), new_world)
    assert consumed + Counter(i for t in rest for b in t.column("sample_ids").to_pylist() for i in b) == whole
    for t in rest:
        d = t.to_pydict()
        assert d["step"] == list(range(step, schedule.steps))
        assert [len(b) for b in d["sample_ids"]] == [g // new_world for g in schedule.step_sizes[step:].tolist()]


@pytest.mark.parametrize("shuffle", SHUFFLES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.lists(st.integers(1, 120), min_size=1, max_size=7), world=st.integers(1, 8),
       max_tokens=st.integers(30_000, 300_000), leftover=st.sampled_from(["drop", "pad"]), data=st.data())  # fmt: skip
def test_written_video_plans_pass_check_and_a_tampered_one_fails(shuffle, counts, world, max_tokens, leftover, data):
    """A token-budget plan of video buckets written and committed passes ``check_plan``; the same plan with
    another temporal factor in ``_plan.json``, or a sample moved to a batch of another bucket, does not."""
    import json
    import uuid
    from dataclasses import replace

    import fsspec
    import pyarrow.parquet as pq

    from manifests.errors import UsageError
    from manifests.plan import epoch_part, write_plan
    from manifests.plan.check import check_plan
    from manifests.plan.mix import DatasetSamples
    from manifests.plan.parts import encode_epoch
    from manifests.plan.rows import schedule_from_rank_tables

    ids, buckets = make_samples(counts, 5, VIDEO_NAMES)
    url = f"memory://video-plans/{uuid.uuid4().hex}"
    config = PlanConfig(shuffle=shuffle, world_size=world, max_tokens=max_tokens, leftover=leftover, epochs=2, seed=4)
    try:
        meta = write_plan(url, [DatasetSamples(ids, pa.array(buckets), manifest_fingerprint="m")], config)
    except UsageError:
        return  # over budget or nothing to train: refused before anything is written
    assert meta.inputs.temporal_factor == 4 and check_plan(url) == []
    fs = fsspec.filesystem("memory")
    path = f"{url[len('memory://'):]}/_plan.json"
    original = fs.cat_file(path)
    tampered = json.loads(original)
    tampered["inputs"]["temporal_factor"] = data.draw(st.sampled_from([1, 2, 8]))
    fs.pipe_file(path, json.dumps(tampered).encode())
    if any(latent_tokens([n], temporal_factor=tampered["inputs"]["temporal_factor"])[0] != b.latent_tokens
           for n, b in meta.buckets.items()):  # fmt: skip
        assert any("batch size or latent tokens" in p or "give no plan" in p for p in check_plan(url))
    fs.pipe_file(path, original)
    names = list(meta.buckets)
    if len(names) < 2:
        return
    epoch_path = f"{url[len('memory://'):]}/{epoch_part(0)}"
    file = pq.ParquetFile(fs.open(epoch_path))
    schedule = schedule_from_rank_tables([file.read_row_group(r) for r in range(world)])
    first = int(schedule.step_buckets[0])
    other = next((s for s, b in enumerate(schedule.step_buckets.tolist()) if b != first), None)
    if other is None:
        return
    ids_ = schedule.ids.copy()
    ids_[0] = schedule.ids[schedule.offsets[other]]  # a sample of another bucket (and a repeat) in the first batch
    fs.pipe_file(epoch_path, encode_epoch(replace(schedule, ids=ids_), world).data)
    assert check_plan(url) != []
