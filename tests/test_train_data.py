"""The trainer's parts against a real (tiny) cache and plan: per-rank rows, batches, bad records, config, cursor."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader, read_cache_meta, read_index
from manifests.cache.records import to_float32
from manifests.plan import read_rank_plan
from tests.train_dataset import train_data  # noqa: F401  (session fixture)
from train.checkpoint import Cursor, truncate_records
from train.config import load_config
from train.data import BadRecordError, BatchLoader, PlanStep, rank_steps
from train.model import build_model, flow_matching_loss, model_arguments, step_generator

pytestmark = [pytest.mark.ray]


def corrupt_copy(cache: str, dest, sample: int) -> str:
    """A copy of ``cache`` in which ``sample``'s record has flipped bytes in the middle."""
    shutil.copytree(cache, dest)
    row = next(r for r in read_index(str(dest))["samples"].to_pylist() if r["sample_id"] == sample)
    path = dest / row["shard"]
    data = bytearray(path.read_bytes())
    middle = row["offset"] + row["length"] // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    path.write_bytes(bytes(data))
    return row["shard"]


@pytest.mark.slow
def test_rank_steps_are_exactly_the_plan_rows_from_the_cursor(train_data):
    for rank in (0, 1):
        rows = read_rank_plan(train_data.plan2, rank).to_pylist()
        steps = list(rank_steps(train_data.plan2, rank))
        assert [(s.epoch, s.step, s.bucket, list(s.sample_ids)) for s in steps] == [
            (r["epoch"], r["step"], r["bucket"], r["sample_ids"]) for r in rows
        ]
        later = rank_steps(train_data.plan2, rank, start=(0, 4))
        assert len(later) == 16 and list(later) == steps[4:] and steps[4].step == 4
        assert all(s.epoch == 1 for s in rank_steps(train_data.plan2, rank, start=(0, 10)))
        limited = rank_steps(train_data.plan2, rank, start=(0, 8), limit=5)
        assert len(limited) == 5 and list(limited) == steps[8:13]
        assert [len(epoch) for epoch in limited.epochs()] == [2, 3]  # read one epoch at a time


def test_batches_follow_the_plan_with_padded_text_and_scaled_latents(train_data):
    reader = CacheReader(train_data.cache)
    latent = read_cache_meta(train_data.cache).latent
    steps = list(rank_steps(train_data.plan1, 0, limit=10))  # epoch 0: every bucket
    batches = list(BatchLoader(reader, steps, latent, prefetch=2, read_threads=2))
    assert [b.sample_ids for b in batches] == [list(s.sample_ids) for s in steps]
    assert {b.bucket for b in batches} == {"64x64", "128x32", "32x128"}
    for batch in batches:
        w, h = map(int, batch.bucket.split("x"))
        assert batch.latents.shape == (4, 4, h // 8, w // 8) and batch.latents.dtype == torch.float32
        records = reader.read(batch.sample_ids)
        expected = (np.stack([to_float32(r.latent, r.dtype) for r in records]) - 0.0) * latent.scaling_factor
        np.testing.assert_allclose(batch.latents.numpy(), expected, rtol=1e-6)
        lengths = [r.text.lengths[0] for r in records]
        assert batch.text.shape == (4, max(lengths), 32) and batch.text_mask.sum(1).tolist() == lengths
        for i, (n, r) in enumerate(zip(lengths, records)):
            np.testing.assert_array_equal(batch.text[i, :n].numpy(), to_float32(r.text.tokens[0], r.text.dtype))
            assert not batch.text[i, n:].any()  # padding is zeros, and masked
            assert batch.resolution[i].tolist() == list(r.original_size)
        assert batch.aspect_ratio[:, 0].tolist() == pytest.approx([h / w] * 4)
    assert any(len(set(b.text_mask.sum(1).tolist())) > 1 for b in batches)  # captions of unequal length met


def reading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("bucketeer-read")]


def test_loader_stops_its_reading_threads_when_closed(train_data):
    reader = CacheReader(train_data.cache)
    loader = BatchLoader(reader, rank_steps(train_data.plan1, 0), reader.meta.latent, prefetch=4, read_threads=2)
    assert len(loader) == 60
    it = iter(loader)
    next(it)
    assert reading_threads()
    it.close()  # what a `break` out of the training loop does
    assert not reading_threads()


def same_record(a, b) -> bool:
    return (a.sample_id == b.sample_id and a.bucket == b.bucket and np.array_equal(a.latent, b.latent)
            and a.text.caption_key == b.text.caption_key
            and all(np.array_equal(x, y) for x, y in zip(a.text.tokens, b.text.tokens, strict=True)))  # fmt: skip


class SlowDict(OrderedDict):
    """An OrderedDict whose lookups yield to other threads first, as a preempted thread would."""

    def __contains__(self, key) -> bool:
        found = super().__contains__(key)
        time.sleep(0.0002)
        return found

    def get(self, key, default=None):
        value = super().get(key, default)
        time.sleep(0.0002)
        return value


def test_reader_gives_concurrent_reads_the_single_threaded_results(train_data):
    ids = CacheReader(train_data.cache).sample_ids.tolist()
    expected = dict(zip(ids, CacheReader(train_data.cache).read(ids)))
    reader = CacheReader(train_data.cache, text_cache_size=2)  # 2 of 5 captions: evictions all the time
    reader._text_lru = SlowDict(reader._text_lru)  # widen the window between looking a caption up and using it
    rng = np.random.default_rng(0)
    # 300 reads of 5 samples: overlapping ids and captions
    jobs = [[ids[i] for i in rng.choice(len(ids), 5, replace=False)] for _ in range(300)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up at once
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(reader.read, jobs))
    finally:
        sys.setswitchinterval(interval)
    for job, records in zip(jobs, results):
        assert [r.sample_id for r in records] == job
        assert all(same_record(r, expected[r.sample_id]) for r in records)
    assert len(reader._text_lru) <= 2
    reader._text_lru = OrderedDict(reader._text_lru)
    assert same_record(pickle.loads(pickle.dumps(reader)).read(ids[:1])[0], expected[ids[0]])  # DataLoader workers


def test_batches_come_in_plan_order_whatever_order_the_reads_finish(train_data):
    reader = CacheReader(train_data.cache)
    steps = list(rank_steps(train_data.plan1, 0, limit=12))
    read = reader.read

    def slow_on_even_steps(sample_ids):  # later reads overtake earlier ones
        if any(s.sample_ids == tuple(sample_ids) for s in steps[::2]):
            time.sleep(0.02)
        return read(sample_ids)

    reader.read = slow_on_even_steps
    loader = BatchLoader(reader, steps, reader.meta.latent, prefetch=4, read_threads=3)
    assert [(b.epoch, b.step, b.sample_ids) for b in loader] == [(s.epoch, s.step, list(s.sample_ids)) for s in steps]
    with pytest.raises(ValueError, match="read_threads"):
        BatchLoader(reader, steps, reader.meta.latent, read_threads=0)


def test_corrupt_record_stops_with_sample_shard_and_fix_or_is_skipped(train_data, tmp_path):
    steps = list(rank_steps(train_data.plan1, 0, limit=3))
    bad = steps[1].sample_ids[2]
    shard = corrupt_copy(train_data.cache, tmp_path / "cache", bad)
    reader = CacheReader(str(tmp_path / "cache"))
    loader = BatchLoader(reader, steps, reader.meta.latent)
    with pytest.raises(BadRecordError) as err:
        list(loader)
    message = str(err.value)
    assert f"sample {bad}" in message and shard in message and "bucketeer verify" in message
    assert "--skip-bad-records" in message and "step 1" in message

    logged: list[str] = []
    loader = BatchLoader(reader, steps, reader.meta.latent, skip_bad_records=True, log=logged.append)
    batches = list(loader)
    assert batches[1].sample_ids == [s for s in steps[1].sample_ids if s != bad] and batches[1].skipped == [bad]
    assert loader.skipped == 1 and len(logged) == 1 and f"sample {bad}" in logged[0]
    assert [b.sample_ids for b in (batches[0], batches[2])] == [list(steps[0].sample_ids), list(steps[2].sample_ids)]


def test_samples_missing_from_the_cache_fail_before_the_first_step(train_data):
    reader = CacheReader(train_data.cache)
    first = reader.read([int(reader.sample_ids[0])])[0]
    steps = [PlanStep(0, 0, first.bucket, (first.sample_id, 12345))]
    with pytest.raises(BadRecordError, match=r"1 samples of the plan are not in cache .*bucketeer plan .*--cache"):
        BatchLoader(reader, steps, reader.meta.latent)
    logged: list[str] = []
    loader = BatchLoader(reader, steps, reader.meta.latent, skip_bad_records=True, log=logged.append)
    assert [b.sample_ids for b in loader] == [[first.sample_id]] and loader.skipped == 1


def test_config_refuses_unknown_keys_and_bad_values(tmp_path):
    cfg = load_config()
    assert cfg.model["num_layers"] == 2 and cfg.lr == 1e-3
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\nwarmup: 3\n")
    with pytest.raises(ValueError, match=r"c.yaml: unknown keys \['warmup'\]"):
        load_config(path)
    path.write_text("lr: 1e-4\n")  # YAML 1.1 reads this as a string
    assert load_config(path).lr == 1e-4
    path.write_text("grad_accum: two\n")
    with pytest.raises(ValueError, match="grad_accum must be a int"):
        load_config(path)
    path.write_text("grad_accum: 2\ncheckpoint_every: 3\n")
    with pytest.raises(ValueError, match="multiple of grad_accum"):
        load_config(path)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"num_layer": 3}}))
    with pytest.raises(ValueError, match=r"unknown keys \['num_layer'\]"):
        model_arguments(load_config(path).model, latent_channels=4, caption_channels=32)
    with pytest.raises(ValueError, match="come from the cache"):
        model_arguments({"in_channels": 8}, latent_channels=4, caption_channels=32)


def test_noise_is_a_function_of_the_plan_position():
    model = build_model({}, latent_channels=4, caption_channels=32)
    latents, text, mask = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 32), torch.ones(2, 5)
    cond = {"resolution": torch.tensor([[64.0, 64.0]] * 2), "aspect_ratio": torch.ones(2, 1)}
    with torch.no_grad():
        a = flow_matching_loss(model, latents, text, mask, cond, step_generator(0, 1, 7, 0))
        torch.randn(100)  # the global RNG does not matter
        b = flow_matching_loss(model, latents, text, mask, cond, step_generator(0, 1, 7, 0))
        c = flow_matching_loss(model, latents, text, mask, cond, step_generator(0, 1, 7, 1))
    assert a.item() == b.item() and a.item() != c.item() and a.ndim == 0


def test_truncate_records_drops_steps_taken_after_the_checkpoint(tmp_path):
    rows = [{"epoch": e, "step": s, "rank": 0, "sample_ids": [s]} for e in (0, 1) for s in range(3)]
    (tmp_path / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"epoch": 1, "st')
    cursor = Cursor(1, 1, 2, 4, 4, "p", "f", "f")
    truncate_records(tmp_path, 2, cursor)  # rank 1 has no file: nothing to do
    kept = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in kept] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert cursor.after(1, 1, optimizer_steps=5) == Cursor(1, 2, 2, 5, 5, "p", "f", "f")


def test_group_reads_and_stored_dtype_batches_equal_lone_float32_steps_on_the_device(train_data):
    reader = CacheReader(train_data.cache)
    steps = list(rank_steps(train_data.plan1, 0))  # 60 steps, three buckets
    lone = list(BatchLoader(reader, steps, reader.meta.latent, read_ahead_mb=0))  # float32 on the CPU, step by step
    calls: list[int] = []
    grouped = CacheReader(train_data.cache)
    read = grouped.read
    grouped.read = lambda ids, *a: calls.append(len(ids)) or read(ids, *a)
    loader = BatchLoader(grouped, steps, reader.meta.latent, widen=False)
    assert loader.read_ahead() == (256, 32)  # tiny records: the most steps ahead, in the largest groups
    stored = list(loader)
    assert len(calls) < 10 and max(calls) > 4 * len(steps[0].sample_ids)  # records of many steps per read
    assert stored[0].pending is not None and stored[0].latents.dtype == torch.bfloat16
    for a, b in zip(lone, stored, strict=True):
        b = b.to("cpu")  # widened and scaled where the model is: here the CPU
        assert (a.epoch, a.step, a.sample_ids, a.variants) == (b.epoch, b.step, b.sample_ids, b.variants)
        for name in ("latents", "text", "text_mask", "resolution", "aspect_ratio", "crop_top_left", "target_size",
                     "pooled", "cond_latents"):  # fmt: skip
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or (x.dtype == y.dtype == torch.float32 and torch.equal(x, y)), name


def test_a_window_plan_reads_by_chunks_and_gives_the_batches_of_lone_reads(train_data, tmp_path):
    """A --shuffle window plan switches the reader to whole-chunk reads; the batches are the plan's rows and
    their tensors those of one read per record."""
    from pipeline import PlanJob, run

    plan = str(tmp_path / "window-plan")
    run(PlanJob(manifests=(train_data.manifest,), out=plan, world_size=2, batch_size=2, epochs=2, seed=3,
                cache=(train_data.cache,), shuffle="window:8", progress=False))  # fmt: skip
    for rank in (0, 1):
        chunked, direct = CacheReader(train_data.cache), CacheReader(train_data.cache, max_gap=None)
        got = list(BatchLoader(chunked, rank_steps(plan, rank), chunked.meta.latent))
        assert chunked.chunk_bytes and chunked._chunks  # switched on by the plan's inputs.shuffle
        steps = list(rank_steps(plan, rank))
        lone = list(BatchLoader(direct, steps, direct.meta.latent, read_ahead_mb=0))
        assert direct.chunk_bytes is None and [len(b.sample_ids) for b in got] == [len(s.sample_ids) for s in steps]
        for a, b in zip(lone, got, strict=True):
            a, b = a.to("cpu"), b.to("cpu")
            assert list(a.sample_ids) == list(b.sample_ids) and (a.epoch, a.step) == (b.epoch, b.step)
            assert torch.equal(a.latents, b.latents) and torch.equal(a.text, b.text)
