"""The README's cluster flow, exactly as it is written, against a local S3-compatible server and Ray head.

The ``<!-- test: e2e -->`` blocks of README.md are concatenated and run by bash from the repository
root, with the real-cloud placeholders replaced (:data:`SUBSTITUTIONS`; each must still occur in the
README, so the two cannot drift apart): scan and embed go through ``ray job submit`` to a head
started by ``infra/local/ray-up.sh`` (token auth, 127.0.0.1), plan / verify / report through the
``bucketeer`` CLI, training through ``accelerate launch`` on 2 CPU processes. Then the artifacts
are checked where the flow left them.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from manifests.manifest import read_manifest
from manifests.plan import read_plan_meta
from pipeline.sample_data import make_sample_dataset
from tests.conftest import free_port
from tests.test_infra import kill_group, read_env_file, script_env
from tests.test_readme import ROOT, bash_env, doc_blocks, run_bash

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.ray, pytest.mark.dist]

IMAGES = 48  # + 3 broken files: 3 buckets at 256², a dozen steps per epoch on 2 ranks
KEY_ID, SECRET = "e2e-test-key-id", "e2e-test-secret-key"


def substitutions(prefix: str, endpoint: str, job_api: str, run_dir: Path) -> list[tuple[str, str]]:
    """README placeholder -> what this machine has. Order matters: longer, more specific text first."""
    return [
        ("<access key id>", KEY_ID),
        ("<secret access key>", SECRET),
        ("http://<head-node>:8265", job_api),
        ("https://<account>.r2.cloudflarestorage.com", endpoint),
        ("s3://my-bucket/", f"{prefix}/"),
        # the flow at a size 2 CPU cores train in seconds: no hub downloads, small buckets, 2 processes
        ("--model PixArt-alpha/PixArt-XL-2-1024-MS", "--model default"),  # the tiny random-weight PixArt
        ("--resolution 1024", "--resolution 256"),
        ("--world-size 8 --batch-size 16", "--world-size 2 --batch-size 2"),
        ("infra/accelerate/ddp-1x8.yaml", "infra/accelerate/cpu-2proc.yaml --main_process_port 0"),
        (" --config train/configs/pixart-xl.yaml", ""),  # the tiny default config: grad_accum 1
        ("--grad-accum 2", "--grad-accum 1"),
        ("runs/pixart-xl", str(run_dir)),
    ]


def localised(script: str, table: list[tuple[str, str]]) -> str:
    for placeholder, value in table:
        assert placeholder in script, f"README's cluster flow no longer contains {placeholder!r}: update SUBSTITUTIONS"
        script = script.replace(placeholder, value)
    assert "<" not in re.sub(r"<<|<\(", "", script), f"a placeholder is left: {script}"
    return script


@pytest.fixture(scope="module")
def ray_head(bucketeer_home):
    """One Ray head for this module, started and stopped by the infra/local scripts (its process group)."""
    # Ray puts unix sockets under its temp dir (108-byte limit): a short state folder
    state = Path(tempfile.mkdtemp(prefix="bkt-e2e-", dir="/tmp"))
    ports = [free_port() for _ in range(9)]
    extra = (
        f"--ray-client-server-port {ports[2]} --dashboard-agent-listen-port {ports[3]} "
        f"--dashboard-agent-grpc-port {ports[4]} --node-manager-port {ports[5]} --object-manager-port {ports[6]} "
        f"--runtime-env-agent-port {ports[7]} --metrics-export-port {ports[8]}"
    )  # explicit free ports: another Ray on this machine may hold Ray's defaults
    env = script_env(state, RAY_PORT=str(ports[0]), RAY_DASHBOARD_PORT=str(ports[1]), RAY_NUM_CPUS="2",
                     RAY_START_EXTRA_ARGS=extra, BUCKETEER_HOME=bucketeer_home)  # fmt: skip
    try:
        up = subprocess.run([ROOT / "infra" / "local" / "ray-up.sh"], env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        client = read_env_file(state / "ray.env")
        yield {"auth": {k: v for k, v in client.items() if k.startswith("RAY_") and "ADDRESS" not in k},
               "job_api": client["RAY_API_SERVER_ADDRESS"]}  # fmt: skip
    finally:
        subprocess.run([ROOT / "infra" / "local" / "ray-down.sh"], env=env, capture_output=True, timeout=120)
        kill_group(state / "ray.pid")
        subprocess.run(["rm", "-rf", str(state)], check=False)


def test_readme_cluster_flow_runs_as_written(s3, ray_head, tmp_path):
    prefix = s3.fresh_url("e2e")
    dataset = make_sample_dataset(tmp_path / "dataset", n=IMAGES, seed=5)
    files = sorted(p for p in (tmp_path / "dataset").rglob("*") if p.is_file())
    targets = [f"{prefix}/dataset/{p.relative_to(tmp_path / 'dataset').as_posix()}" for p in files]
    s3.fs.put([str(p) for p in files], targets)
    run_dir = tmp_path / "run"

    script = localised("\n".join(b.code for b in doc_blocks("e2e")), substitutions(
        prefix, s3.endpoint, ray_head["job_api"], run_dir))  # fmt: skip
    # the machine, not the commands: no GPU here, so the multi-process launcher uses the CPU (gloo)
    env = bash_env(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", **ray_head["auth"])
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "AWS_ENDPOINT_URL"):
        env.pop(name, None)  # only what the README sets
    output = run_bash(script, ROOT, env, timeout=900)

    so = s3.storage_options
    # scan and embed really ran as Ray jobs on the head
    assert len(re.findall(r"Job '\w+' succeeded", output)) == 2, output[-4000:]
    manifest = read_manifest(f"{prefix}/manifest", so)
    assert manifest.samples.num_rows == dataset["images"]
    assert sorted(manifest.errors.column("error").to_pylist()) == ["empty", "not_an_image", "truncated"]
    assert set(manifest.samples.column("bucket").to_pylist()) <= {"256x256", "320x192", "192x320"}
    # plan for 2 ranks, checked; the cache verified
    plan = read_plan_meta(f"{prefix}/plan", so)
    assert plan.inputs.world_size == 2 and plan.inputs.epochs == 10
    assert f"{prefix}/plan: ok" in output and f"{prefix}/cache: OK" in output
    # the trainer went through the whole plan on 2 processes and wrote its model
    assert "training " in output and "on 2 process(es)" in output
    assert f"position {plan.steps_per_epoch * plan.inputs.epochs}" in output
    assert "plan finished" in output and (run_dir / "model").is_dir()
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses and all(loss == loss for loss in losses)  # logged, finite
    # the report, with the plan and cache sections
    page = (run_dir / "report.html").read_text()
    assert "Manifest" in page and "Plan" in page and "Cache" in page
    assert len(list((run_dir / "report_figures").glob("*.png"))) >= 7
    # no credential reached an artifact or the output
    for meta in ("manifest/_manifest.json", "cache/_cache.json", "plan/_plan.json"):
        assert SECRET not in s3.fs.cat_file(f"{prefix}/{meta}").decode()
    assert SECRET not in output and SECRET not in page
    # the jobs' output is bucketeer's and Ray's own real lines: not the false alarm of pipeline/ray_output.py
    assert "core_worker" not in output, output[-4000:]
