"""``bucketeer annotate`` on a simulated 2-node Ray cluster (``ray.cluster_utils``) with one node lost
mid-job, while a unit it was captioning is in flight (its part written, its result not yet returned): the
unit is redone on the other node, every sample is annotated exactly once, no part is named twice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from manifests.annotations import read_annotations_meta
from manifests.faults import FAULTS_ENV, pause_marker
from manifests.progress import INTERVAL_ENV
from tests.embed_data import make_dataset
from tests.test_annotate import _check_once
from tests.test_embed_cluster import EmbedProcess, simulated_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("bucketeer_home"), pytest.mark.full]

PAUSE = 8.0  # seconds each annotate worker holds its first unit after writing its part


class AnnotateProcess(EmbedProcess):
    """``python -m pipeline.annotate`` against the cluster, its output read as it comes (the workers' too:
    a job with ``--ray-address`` gets their lines, each prefixed with its ``pid=``)."""

    def __init__(self, cluster, manifest: str, out: str, *extra: str):  # not super().__init__: it starts embed
        cmd = [sys.executable, "-m", "pipeline.annotate", manifest, "--out", out, "--ray-address", cluster.address,
               "--max-new-tokens", "4", "--batch-size", "2", "--unit-rows", "2", *extra]  # fmt: skip
        env = {**os.environ, INTERVAL_ENV: "0"}  # a progress line per unit
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()


def node_of(cluster, pid: int):
    """The simulated node whose raylet started worker process ``pid``."""
    import psutil

    ancestors = {p.pid for p in psutil.Process(pid).parents()}
    return next(n for n in cluster.worker_nodes if n.all_processes["raylet"][0].process.pid in ancestors)


def written_at(out: str) -> dict[str, float]:
    """Each part file under ``out/parts`` and when its rows were written (their ``written_at``)."""
    return {p.name: max(pq.read_table(p, columns=["written_at"]).column("written_at").to_pylist())
            for p in sorted(Path(out, "parts").glob("*.parquet"))}  # fmt: skip


def test_a_node_lost_while_captioning_has_its_in_flight_unit_redone(tmp_path, monkeypatch):
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "captions")
    make_dataset(str(tmp_path / "data"), manifest, 16)
    with simulated_cluster(0, 0) as cluster:  # the head runs no work: the two nodes do
        monkeypatch.setenv(FAULTS_ENV, f"annotate.unit=pause:{PAUSE}")  # the nodes' workers inherit it
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        monkeypatch.delenv(FAULTS_ENV)
        job = AnnotateProcess(cluster, manifest, out, "--device", "cpu", "--workers", "2", "--torch-threads", "1")
        try:
            job.wait_for(re.escape(pause_marker("annotate.unit")))  # a worker wrote a part and holds its unit
            line = next(x for x in job.lines if pause_marker("annotate.unit") in x)
            lost = node_of(cluster, int(re.search(r"pid=(\d+)", line).group(1)))
            before, removed = written_at(out), time.time()
            cluster.remove_node(lost, allow_graceful=False)
            output = job.finish()
            finished = time.time() - removed
        finally:
            job.kill()
    after = written_at(out)
    redone = sorted(name for name, at in before.items() if after[name] > removed)
    print(f"lost node {nodes.index(lost) + 1} of 2 with {len(before)} part(s) written; {len(redone)} redone; the job "
          f"finished {finished:.0f} s after the loss (a new worker's first unit holds {PAUSE:.0f} s)")  # fmt: skip
    assert redone, "the lost node's in-flight unit was not redone"
    assert "annotate caption: 16/16 images (100%)" in output
    _check_once(out, manifest)  # every sample once in the parts (no unit's samples under two part names)
    meta = read_annotations_meta(out)
    assert len(set(meta.parts)) == len(meta.parts) == len(after) and meta.counts.annotated == 16
