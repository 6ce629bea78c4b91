"""The embed job on GPU nodes with few CPUs and no CPU-only node: what GPU boxes often are (8 GPUs,
8-16 vCPUs). Before the encoder actors' CPUs were sized to the nodes, each reserved a whole CPU
beside its GPU: on 2 nodes of 1 CPU and 2 GPUs they held every CPU and the job waited forever for
decode tasks that could not start, printing nothing.

Each test starts its own cluster (``ray.cluster_utils.Cluster``, every process on 127.0.0.1, the
head one of the GPU nodes) and runs ``python -m pipeline.embed --device cuda`` against it, as
``tests/test_embed_cluster.py`` does; the GPUs are logical (the workers run on the CPU). The
seconds to the first committed shard and to the end are printed (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time

import pytest

from tests.embed_data import make_dataset
from tests.test_embed_cluster import EmbedProcess, assert_every_sample_once, simulated_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("bucketeer_home"), pytest.mark.full]


@contextlib.contextmanager
def gpu_cluster(*nodes: tuple[int, int]):
    """A cluster of ``nodes`` given as (CPUs, GPUs); the first is the head. No CPU-only node."""
    (cpus, gpus), *others = nodes
    with simulated_cluster(cpus, gpus) as cluster:
        for cpus, gpus in others:
            cluster.add_node(num_cpus=cpus, num_gpus=gpus)
        cluster.wait_for_nodes()
        yield cluster


@pytest.mark.parametrize("nodes", [((1, 2), (1, 2)), ((2, 4),)], ids=["2 nodes x 1 CPU 2 GPUs", "1 node 2 CPUs 4 GPUs"])
def test_gpu_nodes_with_few_cpus_make_progress(nodes, tmp_path):
    """Encoders for every GPU (8 images in batches of 2: 4 VAE actors) and decode tasks fit beside each
    other: the job finishes, every sample once, and the cache verifies."""
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 8)
    with gpu_cluster(*nodes) as cluster:
        start = time.time()
        job = EmbedProcess(cluster, manifest, out, "--device", "cuda")
        try:
            job.wait_for(r"embed images: [1-9]\d*/8", timeout=150)
            first = time.time() - start
            output = job.finish(timeout=120)
        finally:
            job.kill()
        total = time.time() - start
    shape = " + ".join(f"({c} CPU, {g} GPU)" for c, g in nodes)
    print(f"\n{shape}: first image shard committed after {first:.1f}s, job done in {total:.1f}s")
    assert re.search(r"encoders on GPU, up to 4 actor\(s\) \(the cluster has 4 GPU\(s\) now\); 0.25 CPU per encoder",
                     output)  # fmt: skip
    meta = assert_every_sample_once(manifest, out)
    assert meta.summary.device == "cuda"
    assert re.search(r"embed images: 8/8 images \(100%\).*done in", output)


def test_a_cluster_without_a_whole_cpu_is_refused(tmp_path):
    """GPUs but no CPU anywhere and no autoscaler: nothing could decode an image. The job says what it
    needs and what the cluster has, in one line, and exits 2 at once instead of waiting forever."""
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 2)
    with gpu_cluster((0, 2)) as cluster:
        start = time.time()
        cmd = [sys.executable, "-m", "pipeline.embed", manifest, "--out", out, "--device", "cuda",
               "--ray-address", cluster.address]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        seconds = time.time() - start
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 2 and seconds < 60, (seconds, done.stdout, done.stderr)
    assert errors == [
        "bucketeer embed: error: embed needs a Ray node with at least 1 CPU (images are decoded on CPUs), but the "
        "cluster has 1 x (0 CPU + 2 GPU) and no autoscaler that can add one: start a node with --num-cpus 1 or more"
    ], done.stderr
    assert not os.path.exists(out)  # refused before anything was written


@pytest.mark.parametrize("cpus", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 64])
def test_encoders_for_every_gpu_leave_a_decode_task_room(cpus, gpus):
    """On a GPU node of any shape (with a CPU-only node beside it or not), the encoder actors of all
    its GPUs and a decode task fit its CPUs; an actor never asks for more than a CPU."""
    from pipeline.embed.dataflow import NodeShape, size_cpus

    for nodes in ([NodeShape(cpus, gpus)], [NodeShape(cpus, gpus), NodeShape(32, 0)]):
        actor, task, light = size_cpus("cuda", 1, nodes)
        assert 0 < actor <= 1 and 0 < light <= task <= 1
        assert gpus * actor + task <= cpus + 1e-9, (nodes, actor, task)
        assert task >= min(1.0, cpus / 2) - 1e-9  # decoding gets at least half the tightest node
