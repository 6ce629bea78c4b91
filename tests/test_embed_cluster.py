"""The embed job on a Ray cluster simulated on this machine: logical GPUs on several nodes, a GPU
node that joins after the job started, a node killed mid-job, S3 (moto) as the cache store.

One cluster for the module (``ray.cluster_utils.Cluster``: a head without GPUs, every process on
127.0.0.1); the tests add and remove GPU nodes. The job runs as a subprocess
(``python -m pipeline.embed --ray-address``, what ``ray job submit`` runs), so this pytest process
never joins the cluster. The GPUs are logical: torch sees no CUDA, and the workers say so and run
on the CPU, which is all a scheduling test needs. Before this job was rebuilt on Ray Data, the
first test hung (a text actor held one GPU while the job waited for a VAE actor per GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from manifests.cache import CacheMeta, read_cache_meta, read_index
from manifests.cache.verify import verify_cache
from manifests.faults import FAULTS_ENV
from manifests.manifest import read_manifest
from manifests.progress import INTERVAL_ENV
from tests.embed_data import make_dataset

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("bucketeer_home"), pytest.mark.full]


@contextlib.contextmanager
def simulated_cluster(cpus: int, gpus: int):
    """A ``ray.cluster_utils.Cluster`` whose head has ``cpus`` CPUs and ``gpus`` logical GPUs, shut down after.

    Cluster() records its address in Ray's "current cluster" file, which a bare ray.init() of any process on
    this machine would follow: what was there is put back."""
    import ray._private.utils as ray_utils
    from ray.cluster_utils import Cluster

    address_file = ray_utils.get_ray_address_file(None)
    before = open(address_file).read() if os.path.exists(address_file) else None
    head = Cluster(initialize_head=True,
                   head_node_args={"num_cpus": cpus, "num_gpus": gpus, "include_dashboard": False})  # fmt: skip
    if before is None:
        os.remove(address_file)
    else:
        with open(address_file, "w") as f:
            f.write(before)
    try:
        yield head
    finally:
        head.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """A head node with 2 CPUs and no GPU; tests add GPU nodes and leave it as they found it."""
    with simulated_cluster(2, 0) as head:
        yield head


class EmbedProcess:
    """``python -m pipeline.embed`` against the cluster; its output (stdout and stderr) read as it comes."""

    def __init__(self, cluster, manifest: str, out: str, *extra: str):
        cmd = [sys.executable, "-m", "pipeline.embed", manifest, "--out", out, "--ray-address", cluster.address,
               "--batch-size", "2", "--shard-records", "2", "--commit-seconds", "0", *extra]  # fmt: skip
        env = {**os.environ, INTERVAL_ENV: "0"}  # a progress line per result
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 180) -> None:
        """Until a line matches ``pattern``; fails if the job ends or the time runs out first."""
        deadline = time.time() + timeout
        with self._changed:
            while not any(re.search(pattern, line) for line in self.lines):
                assert self.proc.poll() is None, f"embed ended before {pattern!r}:\n{self.output[-4000:]}"
                assert time.time() < deadline, f"no {pattern!r} in {timeout}s:\n{self.output[-4000:]}"
                self._changed.wait(0.5)

    def finish(self, timeout: float = 300) -> str:
        try:
            self.proc.wait(timeout)
        finally:
            self.kill()
        assert self.proc.returncode == 0, self.output[-6000:]
        return self.output

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def report_gpu_node_type(cluster, gpus: int) -> None:
    """Tell the GCS what an autoscaler tells it: a node type with ``gpus`` GPUs it can start (0: none)."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    if gpus:
        group = config.node_group_configs.add(name="gpu-workers", max_count=1)
        group.resources.update({"CPU": 1, "GPU": gpus})
    GcsClient(address=cluster.address).report_cluster_config(config.SerializeToString())


def assert_every_sample_once(manifest: str, out: str, storage_options=None) -> CacheMeta:
    meta = read_cache_meta(out, storage_options)
    assert meta.complete and verify_cache(out, storage_options).ok
    ids = read_index(out, storage_options)["samples"].column("sample_id").to_numpy()
    expected = read_manifest(manifest).samples.column("sample_id").to_numpy()
    assert len(ids) == len(np.unique(ids)) and sorted(ids.tolist()) == sorted(expected.tolist())
    return meta


def test_a_gpu_node_that_joins_after_the_start_does_the_work(cluster, tmp_path):
    """The autoscaling start: no GPU at submit, a GPU node type the autoscaler can start; the job
    asks for a GPU, waits, and uses the node that joins: text encoders, then the VAE, on its one GPU."""
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 8)
    report_gpu_node_type(cluster, gpus=1)
    job = EmbedProcess(cluster, manifest, out)  # --device auto
    node = None
    try:
        job.wait_for(r"encoders on GPU, up to 1 actor\(s\) \(the cluster has 0 GPU\(s\) now, up to 1 as its")
        time.sleep(1)
        assert "embed captions:" not in job.output  # nothing can run before a GPU exists
        node = cluster.add_node(num_cpus=1, num_gpus=1)
        output = job.finish()
    finally:
        job.kill()
        report_gpu_node_type(cluster, gpus=0)
        if node is not None:
            cluster.remove_node(node)
    meta = assert_every_sample_once(manifest, out)
    assert meta.summary.device == "cuda" and meta.summary.encoder_nodes == 1
    assert meta.compute.device == "cpu"  # where the VAE really ran: torch sees no CUDA here
    assert output.count("sees no CUDA device") == 1  # said once, by the driver, for all workers alike
    # the shared captions and the empty one: a caption only one sample has is encoded with its image
    assert re.search(r"embed captions: 3/3 captions \(100%\).*done in", output)
    assert re.search(r"embed images: 8/8 images \(100%\).*done in", output)


@pytest.mark.s3
def test_two_gpu_nodes_one_killed_mid_job(cluster, s3, tmp_path, monkeypatch):
    """4 logical GPUs on 2 nodes, the cache on S3; one node's raylet dies while units are in flight.
    Its units are redone on the other node: every sample once, nothing lost, the cache verifies."""
    monkeypatch.setenv(FAULTS_ENV, "embed.unit=sleep:0.5")  # the nodes' workers inherit it: units take a while
    nodes = [cluster.add_node(num_cpus=1, num_gpus=2) for _ in range(2)]
    monkeypatch.delenv(FAULTS_ENV)
    manifest, out, so = str(tmp_path / "manifest"), s3.fresh_url("cache"), s3.storage_options
    make_dataset(str(tmp_path / "data"), manifest, 24)
    job = EmbedProcess(cluster, manifest, out, "--storage-options", json.dumps(so), "--text-batch-size", "2")
    try:
        job.wait_for(r"encoders on GPU, up to 4 actor\(s\) \(the cluster has 4 GPU\(s\) now\)")
        job.wait_for(r"embed images: [1-9]\d*/24")  # a first unit is committed, others are in flight
        cluster.remove_node(nodes[1], allow_graceful=False)
        output = job.finish()
    finally:
        job.kill()
        for node in nodes:
            if node in cluster.worker_nodes:
                cluster.remove_node(node)
    s3.fs.invalidate_cache()
    meta = assert_every_sample_once(manifest, out, so)
    assert meta.summary.embedded + meta.summary.redone >= 24
    assert re.search(r"embed images: 24/24 images \(100%\).*done in", output)
