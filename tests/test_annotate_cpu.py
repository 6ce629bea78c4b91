"""How annotate's CPU actors are sized and how their CPU time is counted (no Ray: a stand-in cluster, and
:class:`~pipeline.annotate.workers.AnnotateWriter` called in this process).

An actor runs two units at a time (the pool embed's encoders use), each with ``--torch-threads`` threads:
it asks Ray for the CPUs of both, leaving the stage before it a CPU; its CPU time is each process's, counted
once over its units (two overlapping units each timing their whole process counted it twice: issue 55)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from manifests.annotations import image_key
from pipeline import AnnotateJob
from pipeline.annotate.dataflow import UnitTimes, cpu_actor_cpus, place_annotators, units_at_once
from pipeline.annotate.job import _placement_line
from pipeline.annotate.tasks import TaskPlan
from pipeline.annotate.workers import UNIT_COLUMNS, AnnotateWriter


@pytest.mark.parametrize("threads, units, node, least, want", [
    (1, 2, 2.0, 1.0, 1.0),  # a 2-CPU machine: one CPU is the stage before's, the actor keeps embed's 1
    (8, 2, 16.0, 8.0, 15.0),  # half a node's threads per unit (the default): the node less one CPU
    (2, 2, 16.0, 2.0, 4.0),  # --torch-threads 2: two units of 2
    (4, 1, 16.0, 4.0, 4.0),  # a Ray without two calls per actor: one unit's threads
    (1, 2, 1.0, 0.5, 0.5),  # a 1-CPU node: nothing beside the stage before, embed's half a CPU
    (3, 2, 6.5, 1.0, 5.5),  # a fractional node, in steps of 0.05 CPU
    (3, 2, 5.33, 1.0, 4.3),
])  # fmt: skip
def test_a_cpu_actor_asks_for_the_cpus_of_its_units(threads, units, node, least, want):
    assert cpu_actor_cpus(threads, units, node, least) == pytest.approx(want)


class _Cluster:
    """What ``place_encoders`` reads of Ray: alive nodes of ``cpus`` each, no GPU."""

    def __init__(self, *cpus: float):
        self.cpus = cpus

    def nodes(self):
        return [{"Alive": True, "Resources": {"CPU": c}} for c in self.cpus]

    def cluster_resources(self):
        return {"CPU": sum(self.cpus)}


@pytest.mark.parametrize("cpus, torch_threads, threads, actor_cpus", [
    ((2.0,), None, 1, {2: 1.0, 1: 1.0}),  # this machine: as before
    ((16.0,), None, 8, {2: 15.0, 1: 8.0}),  # two units of 8 threads: the node less the stage before's CPU
    ((16.0,), 3, 3, {2: 6.0, 1: 3.0}),
    ((4.0, 16.0), None, 8, {2: 15.0, 1: 8.0}),  # sized for the largest node
])  # fmt: skip
def test_placement_of_cpu_actors_and_its_line(cpus, torch_threads, threads, actor_cpus):
    """``actor_cpus``: by the units an actor runs at once (2 on Ray 2.60; 1 on a Ray too old for two calls per
    actor, as pyproject's floor is: ``make test-floors``)."""
    import ray

    job = AnnotateJob(manifest="m", out="o", device="cpu", torch_threads=torch_threads)
    placement = place_annotators(_Cluster(*cpus), job)
    units = units_at_once(placement)
    assert units == (2 if tuple(map(int, ray.__version__.split(".")[:2])) >= (2, 60) else units) and units in (1, 2)
    assert (placement.device, placement.workers, placement.threads) == ("cpu", 1, threads)
    assert placement.actor_cpus == pytest.approx(actor_cpus[units])
    assert placement.actor_options() == {"num_cpus": placement.actor_cpus}
    assert _placement_line("transformers", placement) == (
        f"engine transformers on CPU: 1 actor(s), each {units} unit(s) at a time x {threads} torch thread(s), "
        f"{actor_cpus[units]:g} CPU asked of Ray")  # fmt: skip


def test_each_actor_process_is_counted_once_over_its_units():
    times = UnitTimes()
    rows = [{"node": "a", "pid": 7, "cpu_start": 10.0, "cpu_end": 13.0, "started": 100.0, "seconds": 3.0},
            {"node": "a", "pid": 7, "cpu_start": 11.0, "cpu_end": 14.5, "started": 100.5, "seconds": 4.0},  # overlaps
            {"node": "a", "pid": 7, "cpu_start": 14.5, "cpu_end": 16.0, "started": 104.5, "seconds": 1.5},
            {"node": "b", "pid": 7, "cpu_start": 3.0, "cpu_end": 5.0, "started": 99.0, "seconds": 2.0},  # another host
            {"node": "a", "pid": 8, "cpu_start": 1.0, "cpu_end": 1.5, "started": 101.0, "seconds": 0.5},
            {"node": "a", "pid": 9, "captioned": 4}]  # fmt: skip  (a vLLM summary row: no times)
    for row in rows:
        times.add(row)
    assert times.cpu_seconds == pytest.approx(6.0 + 2.0 + 0.5)
    assert times.wall_seconds == pytest.approx(106.0 - 99.0)
    assert (UnitTimes().cpu_seconds, UnitTimes().wall_seconds) == (0, None)


def _unit_rows(root, n: int) -> pa.Table:
    names = [f"img_{i}.jpg" for i in range(n)]
    rng = np.random.default_rng(0)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(root / name, quality=90)
    cols = {c: pa.nulls(n) for c in UNIT_COLUMNS}
    cols.update(sample_id=pa.array(range(1, n + 1), pa.uint64()), filename=pa.array(names),
                size=pa.array([os.path.getsize(root / f) for f in names], pa.int64()),
                width=pa.array([320] * n, pa.int32()), height=pa.array([240] * n, pa.int32()))  # fmt: skip
    rows = pa.table({c: cols[c] for c in UNIT_COLUMNS})
    return rows.append_column("source_key", pa.array(image_key(rows), pa.uint64()))


def test_two_units_at_once_are_counted_as_the_cpu_their_process_used(tmp_path):
    """Two units run at once in one process, as in an actor: their summary rows' spans, counted once per process,
    come to the process's own CPU time over them; each unit's own span covers the other's work too."""
    (tmp_path / "src").mkdir()
    rows = _unit_rows(tmp_path / "src", 24)
    plan = TaskPlan(tasks=("phash", "stats", "sha256"), caption=None, vision=None, image_size=320)
    writer = AnnotateWriter(plan=plan, device="cpu", threads=1, out=str(tmp_path / "out"), storage_options=None,
                            source=str(tmp_path / "src"), max_pixels=1 << 30, image_column=None, settings="s",
                            batch_size=8)  # fmt: skip
    writer.unit(rows.slice(0, 2))  # imports and first calls out of the way
    together, done = threading.Barrier(2), [None, None]

    def unit(i: int) -> None:
        together.wait()
        done[i] = writer.unit(rows.slice(12 * i, 12))

    threads = [threading.Thread(target=unit, args=(i,)) for i in range(2)]
    before = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used = time.process_time() - before
    times = UnitTimes()
    for row in done:
        assert (row["captioned"], row["pid"]) == (12, os.getpid())
        times.add(row)
    assert 0 < times.cpu_seconds <= used + 1e-6
    summed = sum(r["cpu_end"] - r["cpu_start"] for r in done)  # what the job summed before
    assert summed > 1.2 * times.cpu_seconds
