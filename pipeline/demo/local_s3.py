"""A local S3-compatible server for ``bucketeer demo --s3``: moto on a free 127.0.0.1 port, placeholder
credentials that keep a user's real keys away from it, and the upload of the generated dataset."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from manifests.errors import BucketeerError, StorageError

DEMO_BUCKET = "bucketeer-demo"


def upload_folder(folder: Path, url: str, storage_options: dict) -> None:
    """Copy ``folder`` to ``url``; raises StorageError if a file is missing there."""
    from manifests.storage import call_storage, open_url

    fs, root = open_url(url, storage_options)
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    sources, targets = [str(folder / p) for p in local], [f"{root}/{p}" for p in local]
    call_storage(fs, "uploading to", root, lambda: fs.put(sources, targets))
    fs.invalidate_cache()
    uploaded = len(call_storage(fs, "listing", root, lambda: fs.find(root)))
    if uploaded != len(local):
        raise StorageError(f"uploaded {uploaded} of {len(local)} files to {url}")
    print(f"      {uploaded} files uploaded", flush=True)


@contextlib.contextmanager
def local_credentials() -> Iterator[None]:
    """Placeholder credentials (the local server takes any): a user's real keys never reach it.

    Set before Ray starts and the trainer is launched, so that their workers sign requests too.
    """
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    saved = {n: os.environ.get(n) for n in names}
    for n in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(n, None)
    os.environ.update(AWS_ACCESS_KEY_ID="local-demo-key-id", AWS_SECRET_ACCESS_KEY="local-demo-secret",
                      AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


@contextlib.contextmanager
def local_s3_server(log: Path) -> Iterator[str]:
    """``python -m moto.server`` on a free 127.0.0.1 port with the demo bucket; yields the endpoint.

    A subprocess rather than a thread of this process: Ray workers and the trainer's ranks reach it
    over HTTP while this process waits on them. Its request log goes to ``log`` (a pipe nobody
    reads would fill and stall the server). Stopped by its process group, also on failure.
    """
    import s3fs

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    sink = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _accepts(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BucketeerError(f"the local S3-compatible server (moto) did not start on {endpoint}; see {log} "
                                     "(is moto[server] installed? pip install 'moto[server]')")  # fmt: skip
            time.sleep(0.2)
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(DEMO_BUCKET)
        print(f"      local S3-compatible server on {endpoint} (pid {proc.pid}), bucket s3://{DEMO_BUCKET}", flush=True)
        yield endpoint
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sink.close()
        print(f"      local S3-compatible server (pid {proc.pid}) stopped", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
