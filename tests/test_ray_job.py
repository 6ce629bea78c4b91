"""``ray job submit -- python -m pipeline.scan`` against a Ray head this test starts on 127.0.0.1.

The head runs with token authentication (``RAY_AUTH_MODE=token``), as Ray recommends for any
cluster: the token lives in a file named by ``RAY_AUTH_TOKEN_PATH`` that both the head and the
``ray job submit`` client read, which is how a user hands the token to the CLI. The head is
stopped by killing its process group (never ``ray stop``, which would stop other Rays too).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from manifests.manifest import read_manifest
from tests.conftest import free_port
from tests.corpus import make_corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.full]
REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head on 127.0.0.1 with token auth; yields (dashboard URL, environment for clients)."""
    token_file = tmp_path / "ray-token"
    token_file.write_text(uuid.uuid4().hex)
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file), RAY_USAGE_STATS_ENABLED="0")
    # the job's `python` is the head's: this environment's, as on a cluster built from one image
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    port, dash = free_port(), free_port()
    temp_dir = Path("/tmp") / f"ray-bkt-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths have a length limit
    # every port chosen here: another Ray on this machine may hold a default one (e.g. the agent's 52365)
    names = ("dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export", "runtime-env-agent",
             "ray-client-server")  # fmt: skip
    ports = {f"--{name}-port": str(free_port()) for name in names}
    cmd = [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
           "--port", str(port), "--dashboard-port", str(dash), "--include-dashboard=true", "--num-cpus", "2",
           "--disable-usage-stats", "--temp-dir", str(temp_dir), *[x for kv in ports.items() for x in kv]]  # fmt: skip
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while True:  # ready when the job API answers (with the token)
            probe = subprocess.run([RAY, "job", "list", "--address", address], env=env, capture_output=True, text=True)
            if probe.returncode == 0:
                break
            assert head.poll() is None, (tmp_path / "head.log").read_text()
            assert time.time() < deadline, probe.stderr[-2000:]
            time.sleep(2)
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        _kill_session(head.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_session(sid: int) -> None:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def test_ray_job_submit_scans_a_folder(ray_head, tmp_path):
    address, env = ray_head
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "manifest"
    # --working-dir . uploads the repository (git-ignored paths such as .venv are left out), as
    # on a real cluster; the workers here share this machine's Python environment
    cmd = [RAY, "job", "submit", "--address", address, "--working-dir", ".", "--",
           "python", "-m", "pipeline.scan", str(corpus.root), "--out", str(out), "--no-progress"]  # fmt: skip
    deadline = time.time() + 60
    starting = ("No available agent", "RemoteDisconnected")  # nothing submitted: the job API is still starting
    while True:  # the head's job agent comes up a little after its job API, and on a loaded machine the API
        # may drop its first connections
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        if not any(s in done.stderr for s in starting) or time.time() > deadline:
            break
        time.sleep(2)
    assert done.returncode == 0, "STDOUT" + done.stdout[-3000:] + "STDERR" + done.stderr[-1000:]
    assert "scanned 41 images" in done.stdout
    m = read_manifest(str(out))
    assert {r["filename"]: (r["width"], r["height"]) for r in m.samples.to_pylist()} == corpus.sizes
    assert {r["filename"]: r["error"] for r in m.errors.to_pylist()} == corpus.errors

    # without the token the cluster refuses the job
    no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_TOKEN_PATH",)}
    no_token["HOME"] = str(tmp_path)  # and no ~/.ray/auth_token to fall back on
    refused = subprocess.run([RAY, "job", "list", "--address", address], env=no_token, capture_output=True, text=True)
    assert refused.returncode != 0
