"""Session fixtures: a real S3-compatible server on 127.0.0.1 and one local Ray instance.

The S3 server is moto in server mode (the same one s3fs tests against): real HTTP, real
botocore signing, reached through s3fs with an ``endpoint_url`` exactly as a user reaches R2.
"""

from __future__ import annotations

import os
import socket
import uuid

import pytest

# fake credentials for the local server only; never a real account
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing-key-id")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret-key")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# before anything imports ray: every Ray the tests start listens on 127.0.0.1 only, reports nothing
from pipeline.ray_setup import loopback_only  # noqa: E402

loopback_only()


# The longest test files, longest first (from `pytest --durations`, 2026-11-27). `make test` runs files on
# pytest-xdist workers with --dist loadfile --no-loadscope-reorder, which hands files out in collection order:
# started first, the long files run beside the many short ones instead of alone at the end. Order within a file is
# kept. First the files of `make test` (CI), then those whose long tests are all `full` (`make test-full`).
LONGEST_FILES = ("test_embed.py", "test_demo.py", "test_e2e.py", "test_python_api.py", "test_train_dist.py",
                 "test_annotate.py", "test_families.py", "test_encoders.py", "test_masks.py", "test_families_qwen.py",
                 "test_record_identity.py", "test_infra.py", "test_report.py", "test_cache_meta.py", "test_scan.py",
                 "test_repa.py", "test_clip_captions.py", "test_storage_faults.py", "test_train_data.py",
                 "test_train_ema_sharded.py", "test_annotate_tasks.py", "test_plan_properties.py", "test_scan_s3.py",
                 "test_captions_list.py")  # fmt: skip
LONGEST_FILES += ("test_demo_flux2.py", "test_demo_qwen.py", "test_embed_cluster.py", "test_demo_hunyuan.py",
                  "test_embed_fewcpu.py", "test_train_families.py", "test_summary_counts.py", "test_demo_wan22.py",
                  "test_demo_wan.py", "test_demo_ltx2.py", "test_train_multinode.py", "test_video_embed.py",
                  "test_demo_family.py", "test_annotate_cluster.py", "test_sources_tar.py", "test_gpu_check.py",
                  "test_train_qwen.py", "test_families_qwen_edit.py", "test_embed_faults.py",
                  "test_plan.py")  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A running moto server: ``endpoint``, ``storage_options`` and a ``fresh_url()`` per test."""

    def __init__(self, endpoint: str, bucket: str):
        import s3fs

        self.endpoint = endpoint
        self.bucket = bucket
        self.storage_options = {"endpoint_url": endpoint}
        self.fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, use_listings_cache=False)

    def fresh_url(self, name: str = "t") -> str:
        """A new, empty prefix in the test bucket."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3 = S3Server(endpoint, "bucketeer-test")
    s3.fs.mkdir(s3.bucket)
    try:
        yield s3
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server):
    """The session's S3 server, with the filesystem's caches cleared for this test."""
    s3_server.fs.invalidate_cache()
    return s3_server


@pytest.fixture(params=["obstore", "fsspec"])
def s3_client(request, monkeypatch) -> str:
    """Each S3 client in turn (:mod:`manifests.objstore`), for this process by ``$BUCKETEER_STORAGE_CLIENT``;
    a test whose storage calls reach Ray workers puts it in its storage options as ``bucketeer_client``."""
    monkeypatch.setenv("BUCKETEER_STORAGE_CLIENT", request.param)
    return request.param


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session (Ray takes seconds to start)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def bucketeer_home(tmp_path_factory):
    """Embed's default encoders built once per session into a temp home, not ~/.cache.

    Ray workers get the home from the driver (it travels in each ``EncoderSource``).
    """
    home = str(tmp_path_factory.mktemp("bucketeer-home"))
    old = os.environ.get("BUCKETEER_HOME")
    os.environ["BUCKETEER_HOME"] = home
    yield home
    if old is None:
        os.environ.pop("BUCKETEER_HOME", None)
    else:
        os.environ["BUCKETEER_HOME"] = old
