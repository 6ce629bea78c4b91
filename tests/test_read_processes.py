"""BatchLoader(read_processes=K): the batches, errors and log lines of its threads, read in worker processes."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import fields

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader
from manifests.errors import UsageError
from tests.test_train_data import corrupt_copy
from tests.train_dataset import train_data  # noqa: F401  (session fixture)
from train.data import BadRecordError, Batch, BatchLoader, rank_steps
from train.data.batch import TENSORS

pytestmark = [pytest.mark.ray]


def same_batches(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for f in fields(Batch):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if f.name in TENSORS and u is not None:
                assert u.dtype == v.dtype and torch.equal(u, v), f"step {x.step}: {f.name} differs"
            elif f.name == "pending" and u is not None:
                assert all(np.array_equal(p, q) for p, q in zip(u, v))
            else:
                assert u == v, f"step {x.step}: {f.name} {u} != {v}"


@pytest.mark.parametrize("widen", [False, True])
def test_read_processes_hand_out_the_batches_threads_do_in_plan_order(train_data, widen):
    reader = CacheReader(train_data.cache)
    steps = rank_steps(train_data.plan1, 0)  # 6 epochs, 3 buckets: batches of several sizes through one slot
    kw = dict(prefetch=4, seed=5, widen=widen, read_ahead_mb=0.05)
    threads = list(BatchLoader(reader, steps, reader.meta.latent, read_threads=2, **kw))
    loader = BatchLoader(reader, rank_steps(train_data.plan1, 0), reader.meta.latent, read_processes=2, **kw)
    it = iter(loader)
    first = [next(it)]
    procs = list(loader._pool.procs)
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    processes = first + list(it)
    assert not any(p.is_alive() for p in procs) and loader._pool.procs == []  # stopped at the end
    same_batches(processes, threads)  # batch memory outlives the slots it was copied from
    assert len({b.latents.shape for b in processes}) == 3 and len(processes) == 60
    assert all(b.latents.untyped_storage().data_ptr() != c.latents.untyped_storage().data_ptr()
               for b, c in zip(processes, processes[1:]))  # each batch owns its memory: none is a reused slot


def test_a_bad_record_read_in_a_process_stops_at_its_step_or_is_skipped_and_logged_here(train_data, tmp_path):
    steps = list(rank_steps(train_data.plan1, 0, limit=3))
    bad = steps[1].sample_ids[2]
    shard = corrupt_copy(train_data.cache, tmp_path / "cache", bad)
    reader = CacheReader(str(tmp_path / "cache"))
    got = []
    with pytest.raises(BadRecordError) as err:
        for batch in BatchLoader(reader, steps, reader.meta.latent, read_processes=2):
            got.append(batch.step)
    assert got == [0]  # the steps before the bad one were handed out
    assert f"sample {bad}" in str(err.value) and shard in str(err.value) and "step 1" in str(err.value)

    logged: list[str] = []
    loader = BatchLoader(reader, steps, reader.meta.latent, skip_bad_records=True, log=logged.append,
                         read_processes=2)  # fmt: skip
    batches = list(loader)
    assert batches[1].skipped == [bad] and loader.skipped == 1
    assert len(logged) == 1 and f"sample {bad}" in logged[0]  # the worker's log line, said by this process
    with pytest.raises(UsageError, match="read_processes"):
        BatchLoader(reader, steps, reader.meta.latent, read_processes=-1)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory is listed in /dev/shm on Linux")
def test_a_killed_read_process_stops_the_run_with_its_name_instead_of_hanging(train_data):
    reader = CacheReader(train_data.cache)
    loader = BatchLoader(reader, rank_steps(train_data.plan1, 0), reader.meta.latent, read_processes=2,
                         read_ahead_mb=0)  # fmt: skip
    segments = set(os.listdir("/dev/shm"))
    it = iter(loader)
    next(it)
    victim = loader._pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    t = time.monotonic()
    says = rf"read process bucketeer-read-0-1 \(pid {victim.pid}\) exited with code -9"
    with pytest.raises(RuntimeError, match=says):
        for _ in it:
            pass
    assert time.monotonic() - t < 30 and loader._pool.procs == []
    assert set(os.listdir("/dev/shm")) <= segments  # the dead one's slots unlinked for it, the other's by itself


def test_auto_reads_a_local_cache_in_processes_with_two_cores_per_rank_and_object_storage_on_threads(tmp_path):
    from train.config import TrainConfig, load_config
    from train.data.processes import AUTO_PROCESSES, choose_readers

    assert TrainConfig().read_processes == "auto"  # what a user who sets nothing gets
    assert choose_readers("auto", local=True, cores=2, ranks=1)[0] == AUTO_PROCESSES == 2
    assert choose_readers("auto", local=True, cores=16, ranks=8)[0] == 2
    processes, why = choose_readers("auto", local=True, cores=8, ranks=8)  # 1 core per rank: threads
    assert processes == 0 and "fewer than 2 cores per rank" in why and "8 cores for 8 ranks" in why
    processes, why = choose_readers("auto", local=False, cores=64, ranks=1)
    assert processes == 0 and "object storage" in why
    processes, why = choose_readers("auto", local=True, cores=16, ranks=1, safe_main=False)  # a script of yours
    assert processes == 0 and "__main__" in why and "read_processes: 2" in why
    assert choose_readers(0, local=True, cores=64, ranks=1) == (0, "read_processes: 0 (config)")
    assert choose_readers(3, local=False, cores=1, ranks=1)[0] == 3  # a number is taken as it is
    for value, ok in (("auto", True), (0, True), (4, True), (-1, False), ("two", False), (True, False), (1.5, False)):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"read_processes: {str(value).lower() if isinstance(value, bool) else value}\n")
        if ok:
            assert load_config(cfg).read_processes == value
        else:
            with pytest.raises(UsageError, match="read_processes must be auto or a number >= 0"):
                load_config(cfg)
