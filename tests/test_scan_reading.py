"""A scan task's reads: one ranged GET per header and one per sidecar, never a HEAD, counted exactly.

Against an S3 endpoint on 127.0.0.1 (tests/test_retry.py's FakeS3, which records every request)
through s3fs's async API, and on a local disk through ``os.pread``: the same rows either way.
"""

from __future__ import annotations

import io
import threading

import pytest
from PIL import Image

from manifests.storage import open_url
from pipeline.sources.listing import WorkItem
from pipeline.sources.reading import probe_files
from tests.corpus import truth
from tests.test_retry import FakeS3, options

N = 12


def _jpeg(w: int, h: int, icc: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((w, h), 30).convert("RGB").save(buf, "JPEG", **({"icc_profile": b"i" * icc} if icc else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``N`` images with sidecars (one empty), one whose header lies past 64 KiB, one without a sidecar."""
    root = tmp_path_factory.mktemp("store")
    ds = root / "ds"
    ds.mkdir()
    items, images = [], {}
    for i in range(N):
        name = f"img_{i:02d}.jpg"
        images[name] = _jpeg(40 + i, 30, icc=200_000 if i == 0 else 0)
        (ds / name).write_bytes(images[name])
        caption = b"" if i == 1 else f"caption {i}".encode()
        sidecar = None if i == 2 else f"img_{i:02d}.txt"
        if sidecar:
            (ds / sidecar).write_bytes(caption)
        items.append(WorkItem(name, len(images[name]), True, sidecar, len(caption) if sidecar else 0))
    server = FakeS3(root)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, ds, items, images
    server.shutdown()
    server.server_close()


def _rows(table) -> dict[str, dict]:
    return {r["name"]: r for r in table.to_pylist()}


def test_object_store_reads_are_ranged_gets_counted_exactly(store):
    server, ds, items, images = store
    fs, root = open_url("s3://b/ds", options(server))
    server.reset()
    rows = _rows(probe_files(fs, root, items, in_flight=4))
    methods = [method for method, *_ in server.requests]
    assert set(methods) == {"GET"}  # never a HEAD: sizes come from the listing
    assert len(methods) == sum(r["requests"] for r in rows.values())
    # one GET per header (the far one needs a few more) and one per non-empty sidecar
    assert [rows[i.name]["requests"] for i in items[1:]] == [1 if i.sidecar_size == 0 else 2 for i in items[1:]]
    assert 3 <= rows["img_00.jpg"]["requests"] <= 6
    for item in items:
        row = rows[item.name]
        assert row["error"] is None and (row["width"], row["height"]) == truth(images[item.name])
    assert rows["img_01.jpg"]["caption"] is None and rows["img_01.jpg"]["caption_read"] is True  # empty: not read
    assert rows["img_02.jpg"]["caption_read"] is None and rows["img_03.jpg"]["caption"] == "caption 3"


def test_a_local_disk_gives_the_same_rows(store):
    server, ds, items, _ = store
    fs, root = open_url("s3://b/ds", options(server))
    remote = _rows(probe_files(fs, root, items, in_flight=4))
    local_fs, local_root = open_url(str(ds))
    local = _rows(probe_files(local_fs, local_root, items))
    assert local == remote


def test_both_s3_clients_give_the_same_rows_from_the_same_gets(store, monkeypatch):
    """obstore's reads are blocking GETs from the task's threads (``blocking_reads``: an awaited obstore GET costs
    about 4 context switches more, manifests/objstore.py), s3fs's are awaited on its event loop: the same rows from
    the same requests either way, the header past the first read included."""
    import obstore

    server, ds, items, _ = store
    real, awaited = obstore.get_range_async, []
    monkeypatch.setattr(obstore, "get_range_async", lambda *a, **k: awaited.append(a) or real(*a, **k))
    rows, requests = {}, {}
    for client in ("obstore", "fsspec"):
        fs, root = open_url("s3://b/ds", {**options(server), "bucketeer_client": client})
        server.reset()
        rows[client] = _rows(probe_files(fs, root, items, in_flight=4))
        requests[client] = sorted(server.requests)
    assert rows["obstore"] == rows["fsspec"] and requests["obstore"] == requests["fsspec"]
    assert len(requests["obstore"]) == sum(r["requests"] for r in rows["obstore"].values())
    assert not awaited  # no GET went through obstore's event-loop API
