"""``bucketeer embed --executor local``: the embed stages in this process, without Ray (pipeline.embed.local).

The same job on Ray and locally writes the same records; the local run imports no Ray (nor polars or s3fs: an
offline GPU machine has none of them); a broken image is an error row; a rerun embeds only what is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from manifests.cache import read_index
from manifests.errors import UsageError
from tests.embed_data import embed_cache, make_dataset, record_bytes, records_by_id
from tests.factories import absent_modules_site

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("bucketeer_home")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.full
def test_local_and_ray_write_the_same_records(tmp_path, ray_local):
    root, manifest = str(tmp_path / "images"), str(tmp_path / "manifest")
    names = make_dataset(root, manifest, 12, broken=("bad.jpg",), unique_from=9)
    on_ray = embed_cache(manifest, str(tmp_path / "ray"), flip=True)
    local = embed_cache(manifest, str(tmp_path / "local"), flip=True, executor="local")
    assert (local.embedded, local.errors) == (on_ray.embedded, on_ray.errors) == (len(names) - 1, 1)
    assert local.meta.settings.hashed == on_ray.meta.settings.hashed  # one cache, whichever ran it
    assert record_bytes(str(tmp_path / "local")) == record_bytes(str(tmp_path / "ray"))
    texts = [read_index(str(tmp_path / k))["texts"].sort_by("caption_key").column("caption_key")
             for k in ("ray", "local")]
    assert texts[0].equals(texts[1])
    errors = read_index(str(tmp_path / "local"))["errors"].to_pylist()
    assert [(e["filename"], e["error"]) for e in errors] == [("bad.jpg", "not_an_image")]


def test_a_rerun_embeds_only_what_is_new(tmp_path):
    root, manifest, out = str(tmp_path / "images"), str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(root, manifest, 6)
    first = embed_cache(manifest, out, executor="local")
    assert first.embedded == 6 and first.meta.compute.device == "cpu"
    again = embed_cache(manifest, out, executor="local")
    assert again.up_to_date and again.embedded == 0
    make_dataset(root, manifest, 9)  # three more images
    more = embed_cache(manifest, out, executor="local")
    assert (more.embedded, more.skipped) == (3, 6)
    assert len(records_by_id(out)) == 9


def test_local_refuses_what_needs_ray(tmp_path):
    from pipeline import EmbedJob

    for extra in ({"ray_address": "auto"}, {"vae_workers": 2}):
        with pytest.raises(UsageError, match="--executor local runs in this process"):
            EmbedJob(manifest="m", out="o", executor="local", **extra)


def test_local_runs_where_ray_polars_and_s3fs_are_absent(tmp_path):
    root, manifest, out = str(tmp_path / "images"), str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(root, manifest, 5)
    site = absent_modules_site(tmp_path / "site")  # ray, polars, s3fs and vllm do not import there
    proc = subprocess.run([sys.executable, "-m", "pipeline.embed", manifest, "--out", out, "--executor", "local",
                           "--batch-size", "4"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in this process (no Ray)" in proc.stdout and "5 embedded, 0 error rows" in proc.stdout
    meta = json.loads((tmp_path / "cache" / "_cache.json").read_text())
    assert meta["counts"]["samples"] == 5


def test_encoder_calls_overlap_two_at_a_time_and_their_results_keep_the_units_order():
    """As Ray's two concurrent calls per encoder actor: while one call holds the device (the lock), the other
    compresses and writes; a slow first call does not reorder the results, and an error comes in its turn."""
    import threading
    import time

    from pipeline.embed.local import CALLS, in_order

    assert CALLS == 2
    device, spans, seen = threading.Lock(), {}, []

    def call(i: int) -> int:
        start = time.monotonic()
        with device:  # the forward pass: one at a time
            time.sleep(0.01)
        time.sleep(0.2 if i == 0 else 0.05)  # compression and the shard write: outside the lock
        spans[i] = (start, time.monotonic())
        if i == 4:
            raise OSError("storage refused shard 4")
        return i

    with pytest.raises(OSError, match="shard 4"):
        for got in in_order(call, iter(range(8))):
            seen.append(got)
    assert seen == [0, 1, 2, 3]  # in order though 1 finished before 0; the error after the results before it
    assert spans[1][0] < spans[0][1]  # call 1 ran while call 0 compressed
    assert 7 not in spans  # the calls after the error were not started
