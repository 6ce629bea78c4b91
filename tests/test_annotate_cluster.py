"""``bucketeer annotate`` on a simulated 2-node Ray cluster (``ray.cluster_utils``) with one node killed
mid-job: its in-flight units are redone on the other, every sample is annotated once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from manifests.faults import FAULTS_ENV
from manifests.progress import INTERVAL_ENV
from tests.embed_data import make_dataset
from tests.test_annotate import _check_once
from tests.test_embed_cluster import EmbedProcess, simulated_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("bucketeer_home")]


class AnnotateProcess(EmbedProcess):
    """``python -m pipeline.annotate`` against the cluster, its output read as it comes."""

    def __init__(self, cluster, manifest: str, out: str, *extra: str):  # not super().__init__: it starts embed
        cmd = [sys.executable, "-m", "pipeline.annotate", manifest, "--out", out, "--ray-address", cluster.address,
               "--max-new-tokens", "4", "--batch-size", "2", "--unit-rows", "2", *extra]  # fmt: skip
        env = {**os.environ, INTERVAL_ENV: "0"}  # a progress line per unit
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()


def test_two_nodes_one_killed_mid_job(tmp_path, monkeypatch):
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "captions")
    make_dataset(str(tmp_path / "data"), manifest, 16)
    with simulated_cluster(0, 0) as cluster:  # the head runs no work: the two nodes do
        monkeypatch.setenv(FAULTS_ENV, "annotate.unit=sleep:0.5")  # the nodes' workers inherit it
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        monkeypatch.delenv(FAULTS_ENV)
        job = AnnotateProcess(cluster, manifest, out, "--device", "cpu", "--workers", "2", "--torch-threads", "1")
        try:
            job.wait_for(r"annotate caption: [1-9]\d*/16")  # a first unit is written, others are in flight
            cluster.remove_node(nodes[1], allow_graceful=False)
            output = job.finish()
        finally:
            job.kill()
    assert "annotate caption: 16/16 images (100%)" in output
    _check_once(out, manifest)
