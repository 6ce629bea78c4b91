"""bucketeer review against hostile requests, on a running server: a page on another port of 127.0.0.1 (which
SameSite does not separate) sending the cookie changes nothing; the cookie is this port's alone and holds an
image pass, not the token (every service on 127.0.0.1 receives it); a foreign Host (DNS rebinding) is
refused; every answer carries the security headers; bodies of the wrong types are a 400 and an empty decision
writes nothing; a huge PNG is refused before it is decoded (peak memory measured) and decodes are bounded.
The filter's own hostile cases (files, URLs, subqueries, padding) are tests/test_filters.py's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.review.job import ReviewJob, session
from pipeline.review.server import cookie_name, image_pass
from tests.test_report import scored  # noqa: F401  (a module fixture)
from tests.test_review import served  # noqa: F401  (a module fixture: one server for this module)


def _call(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, body, headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=20) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _files(folder: str) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in Path(folder).rglob("*") if p.is_file()}


def _port(served) -> int:  # noqa: F811
    return int(served.base.rstrip("/").rsplit(":", 1)[1])


def _page_cookie(url: str) -> dict[str, str]:
    """The Cookie header a browser sends after opening the printed ``url``: what the page's first load set."""
    status, headers, _ = _call(url)
    assert status == 200
    return {"Cookie": headers["set-cookie"].split(";")[0]}


def _peak_kib() -> int:
    """This process's peak resident memory (KiB) since :func:`_reset_peak` (Linux's VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> bool:
    """Start the peak over at the memory in use now (a whole run's earlier peak would hide a new one); False
    where the kernel does not let a process do that (not Linux, a sandbox's /proc). Memory the allocator holds
    freed (an earlier test's large arrays in this worker) goes back to the system first: a decode that reused it
    would raise no peak, and the measure would miss it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _peak_kib() > 0
    except (OSError, StopIteration):
        return False


def test_a_cookie_only_post_from_another_ports_page_changes_nothing(served):  # noqa: F811
    port, token = _port(served), served.token
    sid = str(served.data.manifest.samples.column("sample_id")[4].as_py())
    cookie = _page_cookie(served.url)
    other = {"Origin": f"http://127.0.0.1:{port + 1}"}
    before, counts = _files(served.decisions), dict(served.data.log.counts())
    for path, body in (("api/decide", {"ids": [sid], "keep": False}), ("api/caption", {"id": sid, "caption": "x"}),
                       ("api/undo", {})):  # fmt: skip
        raw = json.dumps(body).encode()
        # what a form or a no-cors fetch on another port sends: text/plain, the cookie, that page's Origin
        assert _call(served.base + path, raw, {**cookie, **other, "Content-Type": "text/plain"})[0] == 403, path
        assert _call(served.base + path, raw, {**cookie, "Content-Type": "application/json"})[0] == 403, path
        # even a cookie holding the token itself changes nothing
        token_cookie = {"Cookie": f"{cookie_name(port)}={token}", "Content-Type": "application/json"}
        assert _call(served.base + path, raw, token_cookie)[0] == 403, path
        assert _call(served.base + path + f"?token={token}", raw, {"Content-Type": "application/json"})[0] == 403
        status, _, text = _call(served.base + path, raw, {"X-Bucketeer-Token": token, **other,
                                                          "Content-Type": "application/json"})  # fmt: skip
        assert status == 403 and b"another site" in text, path
        assert _call(served.base + path, raw, {"X-Bucketeer-Token": token, "Content-Type": "text/plain"})[0] == 415
    assert _files(served.decisions) == before and served.data.log.counts() == counts, "nothing was written"
    # a GET another site's page makes (an <img> or a fetch from another port) is refused too, though the cookie
    # alone opens the image for the page itself
    assert _call(served.base + f"thumb/{sid}", None, cookie)[0] == 200
    assert _call(served.base + f"thumb/{sid}", None, {**cookie, "Sec-Fetch-Site": "same-site"})[0] == 403
    assert _call(served.base + f"thumb/{sid}", None, {**cookie, **other})[0] == 403
    # following the printed link from another page (a notebook's output) opens the page: a navigation
    navigate = {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate"}
    assert _call(served.url, None, navigate)[0] == 200
    json_type = {"Content-Type": "application/json"}
    assert _call(served.base + "api/decide", b"{}", {**cookie, **navigate, **json_type})[0] == 403
    # the page itself: the header, JSON, its own Origin (or none)
    own = {"X-Bucketeer-Token": token, "Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"}
    status, _, answer = _call(served.base + "api/decide", json.dumps({"ids": [sid], "keep": False}).encode(), own)
    assert status == 200 and json.loads(answer)["changed"] == 1
    status, _, answer = _call(served.base + "api/undo", b"{}", {**own, "Origin": f"http://localhost:{port}"})
    assert status == 403  # an Origin must be the name the request used: here 127.0.0.1
    status, _, answer = _call(served.base + "api/undo", b"{}", own)
    assert status == 200 and json.loads(answer)["undone"] == 1


def test_the_cookie_is_this_ports_alone_and_not_the_token(served, scored, tmp_path):  # noqa: F811
    status, headers, _ = _call(served.url)
    cookie, sid = headers["set-cookie"], served.data.manifest.samples.column("sample_id")[5].as_py()
    assert status == 200 and cookie.startswith(f"{cookie_name(_port(served))}={image_pass(served.token)};"), cookie
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and "Path=/" in cookie
    assert served.token not in cookie
    # every service on 127.0.0.1 receives the cookie: what it holds, sent back as the header, opens no API
    leaked = cookie.split(";")[0].split("=", 1)[1]
    changes = {"X-Bucketeer-Token": leaked, "Content-Type": "application/json"}
    assert _call(served.base + "api/decide", json.dumps({"ids": [str(sid)], "keep": True}).encode(), changes)[0] == 403
    assert _call(served.base + "api/info", None, {"X-Bucketeer-Token": leaked})[0] == 403
    assert _call(served.base + f"api/view?token={leaked}")[0] == 403
    job = ReviewJob(manifest=scored.manifest, out=str(tmp_path / "second"), port=0)
    with session(job) as (url, _):  # a second review on another port: its own cookie, the first one's kept
        base, token = url.split("?token=")
        second = _call(url)[1]["set-cookie"]
        assert second.startswith(f"{cookie_name(int(base.rstrip('/').rsplit(':', 1)[1]))}={image_pass(token)};")
        assert second.split("=")[0] != cookie.split("=")[0]
        both = {"Cookie": f"{cookie.split(';')[0]}; {second.split(';')[0]}"}  # what the browser sends to either
        assert _call(served.base + f"thumb/{sid}", None, both)[0] == 200
        assert _call(base + f"thumb/{sid}", None, both)[0] == 200
        assert _call(served.base + "", None, both)[0] == 200 and _call(base, None, both)[0] == 200  # a reload
    assert served.data.log.counts()["kept"] == 0


def test_a_foreign_host_is_refused_even_with_the_token(served):  # noqa: F811
    port, auth = _port(served), {"X-Bucketeer-Token": served.token}
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.2"):
        assert _call(served.base + "api/info", None, {**auth, "Host": host})[0] == 421, host
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
        assert _call(served.base + "api/info", None, {**auth, "Host": host})[0] == 200, host


def test_every_answer_carries_the_security_headers(served):  # noqa: F811
    sid = served.data.manifest.samples.column("sample_id")[0].as_py()
    auth = {"X-Bucketeer-Token": served.token}
    for path, headers in (("", {}), (f"?token={served.token}", {}), ("api/info", auth), (f"thumb/{sid}", auth),
                          ("static/app.js", auth), ("api/view?where=nope%20%3E", auth), ("thumb/1", auth)):  # fmt: skip
        status, answer, _ = _call(served.base + path, None, headers)
        csp = answer.get("content-security-policy", "")
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, (path, status, answer)
        assert answer.get("x-content-type-options") == "nosniff" and answer.get("referrer-policy") == "no-referrer"


def test_bodies_are_type_checked_and_an_empty_decision_writes_nothing(served):  # noqa: F811
    sid = str(served.data.manifest.samples.column("sample_id")[6].as_py())
    auth = {"X-Bucketeer-Token": served.token, "Content-Type": "application/json"}
    before, counts = _files(served.decisions), dict(served.data.log.counts())
    for path, body in (("api/decide", {"ids": [sid], "keep": "false"}),  # bool("false") would keep
                       ("api/decide", {"ids": [sid], "keep": 0}),
                       ("api/decide", {"ids": sid, "keep": True}), ("api/decide", {"ids": [[sid]], "keep": True}),
                       ("api/decide", {"ids": [True], "keep": True}),
                       ("api/decide", {"where": 5, "expected": 1, "keep": False}),
                       ("api/decide", {"where": "width > 0", "expected": "16", "keep": False}),
                       ("api/caption", {"id": sid, "caption": 5}), ("api/caption", {"id": [sid], "caption": "x"}),
                       ("api/caption", {"id": sid, "caption": "x" * 10_001}),
                       ("api/decide", [sid]), ("api/decide", "keep")):  # fmt: skip
        status, _, text = _call(served.base + path, json.dumps(body).encode(), auth)
        assert status == 400 and json.loads(text)["error"], (body, status, text)
    assert _call(served.base + "api/decide", b"{" + b" " * (1 << 20) + b"}", auth)[0] == 400  # over the limit
    status, _, text = _call(served.base + "api/decide", json.dumps({"ids": [], "keep": True}).encode(), auth)
    assert status == 200 and json.loads(text)["changed"] == 0
    status, _, text = _call(served.base + "api/decide", json.dumps({"where": "width < 0", "expected": 0,
                                                                    "keep": False}).encode(), auth)  # fmt: skip
    assert status == 200 and json.loads(text)["changed"] == 0
    assert _files(served.decisions) == before and served.data.log.counts() == counts, "no part, no undo step"


BIG_PNG = """
import sys
from PIL import Image
for path, side in zip(sys.argv[1::2], sys.argv[2::2]):
    Image.new("RGBA", (int(side), int(side)), (10, 200, 30, 128)).save(path)
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A review server over PNGs: one of 6000x6000 RGBA (36 MP, ~690 MiB at the peak of its decode) and 8 of 3000x3000
    (9 MP), written by a child process so that this process's peak memory is the server's own."""
    import pyarrow as pa

    from manifests.buckets import BucketSpec
    from manifests.manifest import apply_buckets, write_manifest
    from manifests.schema import ERRORS_SCHEMA, sample_ids

    root = tmp_path_factory.mktemp("big")
    (root / "images").mkdir()
    sides = {"huge.png": 6000, **{f"p{i}.png": 3000 for i in range(8)}}
    args = [str(a) for name, side in sides.items() for a in (root / "images" / name, side)]
    subprocess.run([sys.executable, "-c", BIG_PNG, *args], check=True)
    names = list(sides)
    table = pa.table({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
                      "width": pa.array(list(sides.values()), pa.int32()),
                      "height": pa.array(list(sides.values()), pa.int32()),
                      "caption": pa.array([None] * len(names), pa.string()),
                      "size": pa.array([(root / "images" / n).stat().st_size for n in names], pa.int64()),
                      "format": pa.array(["PNG"] * len(names), pa.string())})  # fmt: skip
    samples, rejects = apply_buckets(table, BucketSpec())
    assert rejects.num_rows == 0
    write_manifest(str(root / "manifest"), samples, ERRORS_SCHEMA.empty_table(), source=str(root / "images"),
                   spec=BucketSpec())  # fmt: skip
    job = ReviewJob(manifest=str(root / "manifest"), out=str(root / "decisions"), port=0)
    with session(job) as (url, data):
        base, token = url.split("?token=")
        ids = dict(zip(data.manifest.samples.column("filename").to_pylist(),
                       data.manifest.samples.column("sample_id").to_pylist()))  # fmt: skip
        yield SimpleNamespace(base=base, token=token, ids=ids)


def test_a_huge_png_is_refused_before_it_is_decoded(big):
    auth = {"X-Bucketeer-Token": big.token}  # the server runs in this process: its peak memory is ours
    measured = _reset_peak()
    before, started = _peak_kib() if measured else 0, time.perf_counter()
    status, _, text = _call(f"{big.base}thumb/{big.ids['huge.png']}", None, auth)
    assert status == 422 and b"too large to preview" in text and b"36 MP" in text, (status, text)
    assert time.perf_counter() - started < 1.0  # decoded whole, as before the cap: ~1 s
    if not measured:
        pytest.skip("this system does not let a process reset its peak memory (/proc/self/clear_refs)")
    assert _peak_kib() - before < 50 * 1024  # decoded whole: ~690 MiB
    # the measure sees a decode: a 9 MP PNG (under the cap) decoded whole for its thumbnail costs ~150 MiB
    _reset_peak()
    before = _peak_kib()
    assert _call(f"{big.base}thumb/{big.ids['p0.png']}", None, auth)[0] == 200
    assert _peak_kib() - before > 80 * 1024


def test_at_most_two_rows_are_decoded_at_once(big, monkeypatch):
    from pipeline.review import thumbs as module

    running, most, lock = [0], [0], threading.Lock()
    real = module.thumbnails

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(module, "thumbnails", counted)
    answers: list[int] = []
    requests = [threading.Thread(target=lambda i=i: answers.append(_call(
        f"{big.base}image/{big.ids[f'p{i}.png']}", None, {"X-Bucketeer-Token": big.token})[0])) for i in range(8)]
    for t in requests:
        t.start()
    for t in requests:
        t.join()
    assert answers == [200] * 8 and most[0] == module.DECODES == 2, (answers, most)


def test_bound_to_every_address_the_machines_own_names_are_its_names():
    import socket

    from pipeline.review.server import _machine_names

    assert _machine_names("127.0.0.1") == [] and _machine_names("192.0.2.7") == []
    assert socket.gethostname() in _machine_names("0.0.0.0") and socket.getfqdn() in _machine_names("::")


def test_a_sort_by_a_cells_own_column_is_a_page_not_a_500(served):  # noqa: F811
    auth = {"X-Bucketeer-Token": served.token}
    for column in ("filename", "sample_id", "bucket"):
        status, _, body = _call(f"{served.base}api/view?sort={column}&histogram=1", None, auth)
        rows = json.loads(body)["rows"] if status == 200 else []
        assert status == 200 and len(rows) == 16, (column, status, body[:200])
        if column == "filename":
            assert [r["value"] for r in rows] == sorted(r["filename"] for r in rows)

