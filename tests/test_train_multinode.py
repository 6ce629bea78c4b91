"""Two nodes on one machine, no shared disk, checkpoints on the S3-compatible server.

Each "node" is ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank N --rdzv-endpoint 127.0.0.1:PORT``
started in its own working folder with its own temp folder (gloo on the CPU); plan, cache and
``--output-dir`` are ``s3://`` URLs on the moto server. Both nodes are SIGKILLed right after their
first checkpoint (the ``train.checkpoint`` pause of :mod:`manifests.faults`). The run resumes from
the bucket alone on 1 node x 2 processes, and (elastic) on 1 process; either way the union of the
samples consumed is exactly the plan. A *local* ``--output-dir`` that the two nodes resolve to
different folders is refused before any step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from manifests.faults import FAULTS_ENV
from tests.conftest import free_port
from tests.test_train import records, write_config
from tests.test_train_dist import PAUSED, ROOT, command, environment, kill_tree, rows
from tests.train_dataset import train_data, train_here  # noqa: F401  (train_data: session fixture)

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.ray, pytest.mark.s3, pytest.mark.full]


def start_nodes(base: Path, port: int, *argv, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Two torchrun "nodes" of one process each, each in ``base/node-N`` with its own TMPDIR."""
    procs = []
    for node in (0, 1):
        folder = base / f"node-{node}"
        (folder / "tmp").mkdir(parents=True, exist_ok=True)
        argv_node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                     "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "-m", "train", *map(str, argv)]  # fmt: skip
        procs.append(subprocess.Popen(argv_node, cwd=folder, env=environment(TMPDIR=str(folder / "tmp"), **(env or {})),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))  # fmt: skip
    return procs


def wait_for(procs: list[subprocess.Popen], marker: str, timeout: float = 240) -> None:
    """Read each node's output up to the line with ``marker``; fail the test with the output otherwise."""
    deadline = time.time() + timeout
    for proc in procs:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if marker in line or time.time() > deadline:
                break
        if not seen or marker not in seen[-1]:
            pytest.fail(f"a node did not reach {marker!r}; its output:\n{''.join(seen)[-4000:]}")


@pytest.fixture(scope="module")
def cluster(train_data, s3_server, tmp_path_factory):
    """plan2a and the cache on S3, and a 2-node run killed (both nodes) right after its first checkpoint."""
    base = tmp_path_factory.mktemp("multinode")
    plan, cache, out = (s3_server.fresh_url(n) for n in ("plan", "cache", "run"))
    s3_server.fs.put(train_data.plan2a + "/", plan + "/", recursive=True)
    s3_server.fs.put(train_data.cache + "/", cache + "/", recursive=True)
    config = write_config(base / "c.yaml", checkpoint_every=4, log_every=5)  # grad_accum: the plan's (2)
    common = ["--plan", plan, "--cache", cache, "--config", config,
              "--storage-options", json.dumps(s3_server.storage_options)]  # fmt: skip
    procs = start_nodes(base, free_port(), *common, "--output-dir", out, "--record-samples", "rec",
                        env={FAULTS_ENV: "train.checkpoint=pause:300"})  # fmt: skip
    try:
        wait_for(procs, PAUSED)
    finally:
        for proc in procs:
            kill_tree(proc)
    rec = base / "rec"  # what the killed run recorded, each node in its own folder
    rec.mkdir()
    for node in (0, 1):
        (rec / f"rank-{node}.jsonl").write_bytes((base / f"node-{node}" / "rec" / f"rank-{node}.jsonl").read_bytes())
    return {"base": base, "plan": plan, "cache": cache, "out": out, "common": common, "rec": rec}


def s3_json(s3, url: str) -> dict:
    return json.loads(s3.fs.cat_file(url))


def test_two_nodes_checkpoint_to_s3_and_resume_on_one_node_from_the_bucket(cluster, s3, train_data, tmp_path):
    out = cluster["out"]
    latest = s3_json(s3, f"{out}/checkpoints/latest.json")
    assert latest["checkpoint"] == "step-00000004"
    saved = s3_json(s3, f"{out}/checkpoints/step-00000004/cursor.json")
    assert (saved["epoch"], saved["step"], saved["world_size"]) == (0, 4, 2)
    # each node uploaded what its rank wrote: both ranks' RNG files, the model and optimizer from node 0
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= set(saved["files"])
    for name, size in saved["files"].items():
        assert s3.fs.size(f"{out}/checkpoints/step-00000004/{name}") == size
    for node in (0, 1):  # nothing was written to a folder named "s3:" in a node's working folder
        assert not (cluster["base"] / f"node-{node}" / "s3:").exists()

    rec = tmp_path / "rec"
    rec.mkdir()
    for f in cluster["rec"].iterdir():
        (rec / f.name).write_bytes(f.read_bytes())
    resumed = s3.fresh_url("resumed")
    s3.fs.copy(out + "/", resumed + "/", recursive=True)
    proc = subprocess.run(command(2, *cluster["common"], "--output-dir", resumed, "--record-samples", rec,
                                  "--resume"),
                          cwd=ROOT, env=environment(TMPDIR=str(tmp_path)), capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resuming from" in proc.stdout and "epoch 0 step 4" in proc.stdout
    for rank in (0, 1):  # the same world size: every rank's rows, each exactly once
        assert [(r["epoch"], r["step"], r["sample_ids"]) for r in records(rec, rank)] == rows(train_data.plan2a, rank)
    assert s3_json(s3, f"{resumed}/checkpoints/latest.json")["checkpoint"] == "step-00000020"
    model = tmp_path / "model"
    s3.fs.get(f"{resumed}/model/", str(model) + "/", recursive=True)
    from diffusers import PixArtTransformer2DModel

    assert PixArtTransformer2DModel.from_pretrained(model).config.in_channels == 4
    assert s3.fs.exists(f"{resumed}/metrics.jsonl")


def test_an_elastic_resume_on_one_process_reads_everything_from_the_bucket(cluster, s3, train_data, tmp_path):
    from train import StopReason

    rec = tmp_path / "rec"
    rec.mkdir()
    for f in cluster["rec"].iterdir():
        (rec / f.name).write_bytes(f.read_bytes())
    resumed = s3.fresh_url("elastic")
    s3.fs.copy(cluster["out"] + "/", resumed + "/", recursive=True)
    os.environ["BUCKETEER_SCRATCH"] = str(tmp_path / "scratch")
    try:
        result = train_here(*cluster["common"], "--output-dir", resumed, "--record-samples", rec, "--resume")
    finally:
        os.environ.pop("BUCKETEER_SCRATCH")
    assert result.stop is StopReason.PLAN_FINISHED and result.output_dir == resumed
    meta = s3_json(s3, f"{resumed}/plans/resume-00000004-w1/_plan.json")
    assert meta["resumed_from"]["world_size"] == 2 and meta["inputs"]["world_size"] == 1
    consumed = Counter(i for rank in (0, 1) for r in records(rec, rank) for i in r["sample_ids"])
    planned = Counter(i for rank in (0, 1) for _, _, batch in rows(train_data.plan2a, rank) for i in batch)
    assert consumed == planned  # none skipped, none repeated, across the 2 -> 1 process resume


def test_a_local_output_dir_that_the_nodes_do_not_share_is_refused(cluster, tmp_path):
    procs = start_nodes(tmp_path, free_port(), *cluster["common"], "--output-dir", "run")  # relative: 2 folders
    try:
        outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
    for proc, output in zip(procs, outputs):
        assert proc.returncode != 0
        assert "a local folder that ranks [1] do not see" in output and "--output-dir s3://" in output, output[-3000:]
    assert not list((tmp_path / "node-0" / "run").glob("checkpoints"))  # refused before any step
