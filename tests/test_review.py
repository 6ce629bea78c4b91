"""bucketeer review: decisions as an annotations folder (read by plan, stats, scan --captions, report), and
the page in a real Chromium (Playwright, the system browser): filter, sort, open, keep, reject, edit a
caption, reload, then plan --where keep; the token and the manifest's rows as the only way in.

One module, one server, one browser: CI runs it in every `make test`, so it stays a few seconds.
"""

from __future__ import annotations

import io
import json
import os
import urllib.error
import urllib.request
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from manifests.annotations import read_annotations
from manifests.errors import UsageError
from manifests.lock import WriterBusyError
from manifests.manifest import read_manifest
from manifests.plan import read_plan_rows
from manifests.select import evaluate
from pipeline import PlanJob, ReportJob, run
from pipeline.review.decisions import DecisionLog
from pipeline.review.job import ReviewJob, session
from pipeline.review.server import image_pass
from pipeline.sources.captions import load_captions
from pipeline.stats import StatsJob
from pipeline.stats import run as run_stats
from tests.test_report import chromium_or_skip, scored  # noqa: F401  (scored: a module fixture)


def planned(url: str) -> set[int]:
    rows = read_plan_rows(url, [0]).table().to_pydict()
    return set(Counter(i for ids in rows["sample_ids"] for i in ids))


def plan_kept(manifest: str, decisions: tuple[str, ...], out: str) -> set[int]:
    run(PlanJob(manifests=(manifest,), out=out, world_size=1, batch_size=1, epochs=1, annotations=decisions,
                where="keep", progress=False))  # fmt: skip
    return planned(out)


def test_decisions_are_annotations_that_plan_stats_captions_and_report_read(scored, tmp_path, capsys):  # noqa: F811
    manifest = read_manifest(scored.manifest)
    ids = manifest.samples.column("sample_id").to_numpy()
    decisions = str(tmp_path / "ana")
    with DecisionLog.open(decisions, manifest, "ana") as log:
        at = log.positions(ids[[0, 1, 2, 3]])
        log.decide(at[:3], keep=True)
        log.decide(at[2:4], keep=False)  # sample 2: kept, then rejected
        log.edit_caption(int(at[0]), "a hand-written caption")
        log.decide(log.positions(ids[[5]]), keep=True)
        assert log.undo() == 1  # takes back sample 5's keep only
        # durable before the call returned: the folder already reads as annotations
        _, rows, _ = read_annotations(decisions)
        assert sorted(rows.column("sample_id").to_pylist()) == sorted(int(i) for i in ids[:4])
        with pytest.raises(WriterBusyError):  # one writer at a time
            with DecisionLog.open(decisions, manifest, "bo"):
                pass
        assert log.positions(np.array([12345], np.uint64))[0] == -1
    _, rows, _ = read_annotations(decisions)
    by_id = {r["sample_id"]: r for r in rows.to_pylist()}
    assert [by_id[int(i)]["keep"] for i in ids[:4]] == [True, True, False, False]
    assert by_id[int(ids[0])]["caption"] == "a hand-written caption" and by_id[int(ids[1])]["caption"] is None
    assert {r["reviewer"] for r in by_id.values()} == {"ana"}

    assert plan_kept(scored.manifest, (decisions,), str(tmp_path / "plan")) == {int(ids[0]), int(ids[1])}
    assert run_stats(StatsJob(manifest=scored.manifest, annotations=(decisions,), where="keep")).selected == 2

    # scan --captions: the edited caption replaces the sample's captions (not added beside them)
    table = load_captions(decisions)
    name = manifest.samples.column("filename")[0].as_py()
    assert table.captions == {name: "a hand-written caption"} and not table.generated
    assert table.merged(name, "the original", ["the original", "another"]) == ("a hand-written caption", None)

    # a second reviewer into another folder: both given to plan, each sample takes the newest decision
    second = str(tmp_path / "bo")
    with DecisionLog.open(second, manifest, "bo") as log:
        log.decide(log.positions(ids[[1, 6]]), keep=False)  # overrules ana's keep of sample 1
        log.decide(log.positions(ids[[3]]), keep=True)  # overrules ana's reject of sample 3
    both = plan_kept(scored.manifest, (decisions, second), str(tmp_path / "plan2"))
    assert both == {int(ids[0]), int(ids[3])}
    ev = evaluate([manifest], [decisions, second], "keep IS NOT NULL")
    assert ev.selections[0].kept == 5  # samples 0, 1, 2, 3, 6

    # resuming a folder loads its decisions; a folder of another task is refused
    with DecisionLog.open(decisions, manifest, "ana") as log:
        assert log.counts() == {"kept": 2, "rejected": 2, "edited": 1, "undoable": 0}
    with pytest.raises(UsageError, match="not review decisions"):
        with DecisionLog.open(scored.scores, manifest, "ana"):
            pass

    out = tmp_path / "report.html"
    run(ReportJob(manifest=scored.manifest, out=str(out), annotations=(decisions,), where="keep", progress=False))
    assert "true 2, false 2, no value 12 (of 16 samples)" in out.read_text()  # the report's counts of `keep`


def test_views_filter_and_sort_as_polars_does(scored, tmp_path):  # noqa: F811
    import polars as pl

    from pipeline.review.data import ReviewData

    manifest = read_manifest(scored.manifest)
    with DecisionLog.open(str(tmp_path / "d"), manifest, "ana") as log:
        data = ReviewData.load(manifest, (scored.scores, scored.dedup), log)
        assert "embedding" not in data.columns and {"aesthetic", "duplicate", "keep"} <= set(data.columns)
        frame = data.frame.with_row_index("at")
        for where, sort, desc in (("aesthetic > 2", "aesthetic", True), (None, "aesthetic", False),
                                  ("NOT duplicate", "filename", False), ("width >= 0", None, False)):  # fmt: skip
            got = data.view(where, sort, desc)
            want = frame if where is None else frame.filter(pl.sql_expr(where))
            if sort is not None:  # ties in manifest order, no value last
                want = want.sort(sort, descending=desc, nulls_last=True, maintain_order=True)
            assert got.tolist() == want.get_column("at").to_list(), (where, sort, desc)
            again = data.view(where, sort, desc)
            assert again is got  # cached
        assert len(data.view("keep")) == 0
        log.decide(np.array([3, 1]), keep=True)
        assert data.view("keep").tolist() == [1, 3]  # the live column follows the decisions
        assert data.view("keep IS NULL", "keep").tolist() == [i for i in range(16) if i not in (1, 3)]
        hist = data.histogram(data.view(None, "aesthetic"), "aesthetic")
        assert sum(hist["counts"]) == 14 and hist["edges"][0] == 0.5 and hist["edges"][-1] == 9.0
        for bad in ("no_such > 1", "aesthetic +", "aesthetic"):
            with pytest.raises(UsageError):
                data.view(bad)
        with pytest.raises(UsageError, match="no such column"):
            data.view(None, "nope")


@pytest.mark.parametrize("descending", [False, True])
def test_float32_order_is_a_stable_sort_with_no_value_last(descending):
    from pipeline.review.data import _float32_order

    rng = np.random.default_rng(1)
    x = rng.choice(np.array([-2.5, -0.0, 0.0, 1e-30, 1.0, 3.5, np.nan, -np.inf, np.inf], np.float32), 5000)
    x[:100] = rng.standard_normal(100)
    nan = np.isnan(x)
    values = np.where(nan, 0, x).astype(np.float64)
    want = np.lexsort((np.arange(len(x)), -values if descending else values, nan))  # last key first
    assert _float32_order(x, descending).tolist() == want.tolist()


def test_review_command_line_refuses_bad_input_in_one_line(scored, tmp_path, capsys):  # noqa: F811
    from pipeline.cli import main

    out = str(tmp_path / "d")
    for args, expected in ((["--where", "aesthetic >"], "filter 'aesthetic >': it ends where a value is expected"),
                           (["--where", "nope > 1", "--annotations", scored.scores], "'nope', which no column is"),
                           (["--annotations", str(tmp_path)], "_annotations.json"),
                           (["--port", "-5"], "--port -5")):  # fmt: skip
        assert main(["review", scored.manifest, "--out", out, *args]) == 2, args
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    # another host than this machine's loopback name is served with a warning (127.0.0.2: still loopback here)
    job = ReviewJob(manifest=scored.manifest, out=out, host="127.0.0.2", port=0, where="aesthetic > 5",
                    annotations=(scored.scores,))  # fmt: skip
    with session(job) as (url, _):
        assert url.startswith("http://127.0.0.2:")
        # the page opens with the filter
        assert '<meta name="bucketeer-where" content="aesthetic &gt; 5">' in _get(url)[1].decode()
    assert "warning: --host 127.0.0.2 serves the dataset's images" in capsys.readouterr().err


def test_thumbnails_are_cached_by_the_images_source_key(scored, tmp_path):  # noqa: F811
    import pyarrow as pa

    from manifests.manifest import Manifest
    from pipeline.review.thumbs import ThumbCache

    manifest = read_manifest(scored.manifest)
    cache = ThumbCache(manifest, str(tmp_path / "thumbs"))
    first = cache.jpeg(0, 64)
    assert first[:2] == b"\xff\xd8" and os.path.exists(cache.path(0, 64)) and cache.jpeg(0, 64) == first
    assert cache.path(0, 64) != cache.path(0, 256)
    # a rescan that saw the image change (its size here): another key, so the image is read again
    samples = manifest.samples
    at = samples.schema.get_field_index("size")
    sizes = samples.column("size").to_pylist()
    changed = samples.set_column(at, "size", pa.array([sizes[0] + 1, *sizes[1:]], pa.int64()))
    again = ThumbCache(Manifest(url=manifest.url, meta=manifest.meta, samples=changed, errors=manifest.errors),
                       str(tmp_path / "thumbs"))  # fmt: skip
    assert again.path(0, 64) != cache.path(0, 64) and again.path(1, 64) == cache.path(1, 64)
    assert not os.path.exists(again.path(0, 64))
    assert again.jpeg(0, 64) == first and os.path.exists(again.path(0, 64))


def test_a_video_rows_thumbnail_is_its_first_frame(tmp_path):
    pytest.importorskip("av")
    import pyarrow as pa
    from PIL import Image

    from manifests.buckets import BucketSpec
    from manifests.manifest import write_manifest
    from pipeline.review.thumbs import ThumbCache
    from tests.factories import video_manifest_tables
    from tests.test_video_scan import H264, _write

    spec = BucketSpec(area=256 * 256, step=32)
    samples, errors = video_manifest_tables(6, 0, seed=3, frames=(9, 17), spec=spec, max_frames=40)
    assert samples.num_rows > 0
    (tmp_path / "clips" / "clips").mkdir(parents=True)
    sizes = []
    for name, frames in zip(samples.column("filename").to_pylist(), samples.column("frames").to_pylist()):
        _write(tmp_path / "clips" / name, H264, frames, size=(64, 48), seed=frames)
        sizes.append(os.path.getsize(tmp_path / "clips" / name))
    samples = samples.set_column(samples.schema.get_field_index("size"), "size", pa.array(sizes, pa.int64()))
    url = str(tmp_path / "manifest")
    write_manifest(url, samples, errors, source=str(tmp_path / "clips"), spec=spec, frame_ladder=(9, 17))
    cache = ThumbCache(read_manifest(url), str(tmp_path / "thumbs"))
    image = Image.open(io.BytesIO(cache.jpeg(0, 32)))
    assert image.format == "JPEG" and image.size == (32, 24)  # the clip's frame, long side 32


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def served(scored, tmp_path_factory):  # noqa: F811
    """One server for the module: the scored manifest with its scores and clusters, decisions to a fresh folder."""
    decisions = str(tmp_path_factory.mktemp("review") / "decisions")
    job = ReviewJob(manifest=scored.manifest, out=decisions, port=0, reviewer="tester",
                    annotations=(scored.scores, scored.dedup))  # fmt: skip
    with session(job) as (url, data):
        base, token = url.split("?token=")
        yield SimpleNamespace(url=url, base=base, token=token, data=data, decisions=decisions)


def test_server_needs_the_token_and_serves_only_manifest_rows(served):
    base, token = served.base, served.token
    assert base.startswith("http://127.0.0.1:")
    for path in ("", "api/info", "thumb/" + str(served.data.manifest.samples.column("sample_id")[0].as_py())):
        assert _get(base + path)[0] == 403, path  # no token
        assert _get(base + path, {"X-Bucketeer-Token": "wrong"})[0] == 403
        assert _get(base + path, {"Cookie": "bucketeer_review=wrong"})[0] == 403
    status, body = _get(base + "api/info", {"X-Bucketeer-Token": token})
    assert status == 200 and json.loads(body)["samples"] == 16
    # this port's cookie holds the image pass, which opens the page and the images only (never the token)
    port, sid = int(base.rstrip("/").rsplit(":", 1)[1]), served.data.manifest.samples.column("sample_id")[0].as_py()
    cookie = {"Cookie": f"bucketeer_review_{port}={image_pass(token)}"}
    assert _get(base + f"thumb/{sid}", cookie)[0] == 200 and _get(base, cookie)[0] == 200
    assert _get(base + "api/info", cookie)[0] == 403 and _get(base + f"api/sample/{sid}", cookie)[0] == 403
    assert _get(base + f"thumb/{sid}", {"Cookie": f"bucketeer_review_{port + 1}={image_pass(token)}"})[0] == 403
    assert _get(base + f"thumb/{sid}", {"Cookie": f"bucketeer_review_{port}={token}"})[0] == 403  # the token: no
    # only the manifest's rows: a path, an id it does not hold, a static file not in the page's three
    auth = {"X-Bucketeer-Token": token}
    for path in ("thumb/..%2F..%2F..%2Fetc%2Fpasswd", "image/%2Fetc%2Fpasswd", "thumb/12345", "image/-1",
                 "api/sample/..%2F..%2Fetc%2Fpasswd", "static/..%2Fjob.py", "static/job.py", "../etc/passwd"):
        assert _get(base + path, auth)[0] in (400, 404), path
    status, jpeg = _get(base + "thumb/" + str(served.data.manifest.samples.column("sample_id")[0].as_py()), auth)
    assert status == 200 and jpeg[:2] == b"\xff\xd8"
    for body in (b"not json", b'{"keep": true}', b'{"ids": ["nope"], "keep": true}', b'{"ids": 5, "keep": 1}'):
        request = urllib.request.Request(base + "api/decide", body, {**auth, "Content-Type": "application/json"})
        try:
            status = urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as e:
            status = e.code
        assert status in (400, 404), body
    assert served.data.log.counts()["kept"] == 0  # nothing was decided by them
    page = _get(base + "?token=" + token)[1].decode()
    assert "<script" in page and "http://" not in page and "https://" not in page  # nothing from the network


@pytest.mark.s3
def test_review_on_s3_reads_images_by_id_and_writes_decisions_there(s3, bucketeer_home):
    from tests.embed_data import make_dataset

    secret = "review-test-secret-value"
    options = {**s3.storage_options, "key": "review-test-key-id", "secret": secret}
    root = s3.fresh_url("review")
    make_dataset(f"{root}/images", f"{root}/manifest", 6, storage_options=options)
    job = ReviewJob(manifest=f"{root}/manifest", out=f"{root}/decisions", port=0, reviewer="s3",
                    storage_options=options)  # fmt: skip
    with session(job) as (url, data):
        base, token = url.split("?token=")
        auth = {"X-Bucketeer-Token": token}
        sid = str(data.manifest.samples.column("sample_id")[2].as_py())
        status, jpeg = _get(base + "thumb/" + sid, auth)
        assert status == 200 and jpeg[:2] == b"\xff\xd8"
        assert _get(base + "image/" + sid, auth)[0] == 200
        request = urllib.request.Request(base + "api/decide", json.dumps({"ids": [sid], "keep": True}).encode(),
                                         {**auth, "Content-Type": "application/json"})  # fmt: skip
        assert json.loads(urllib.request.urlopen(request, timeout=10).read())["counts"]["kept"] == 1
        answers = [_get(base + p, auth)[1].decode() for p in ("api/info", "api/view?sort=width", f"api/sample/{sid}")]
        for answer in answers:
            assert secret not in answer and "review-test-key-id" not in answer and s3.endpoint not in answer
    (cache,) = os.listdir(os.path.join(bucketeer_home, "review"))  # thumbnails of an S3 --out: on this disk
    assert any(n.endswith("-256.jpg") for n in os.listdir(os.path.join(bucketeer_home, "review", cache)))
    _, rows, _ = read_annotations(f"{root}/decisions", options)
    assert rows.column("sample_id").to_pylist() == [int(sid)] and rows.column("keep").to_pylist() == [True]


@pytest.mark.slow
def test_review_page_in_chromium(served, scored, tmp_path):  # noqa: F811
    exe = chromium_or_skip()
    try:
        from playwright import sync_api
    except ImportError:
        if os.environ.get("BUCKETEER_REQUIRE_CHROMIUM") == "1":
            pytest.fail("BUCKETEER_REQUIRE_CHROMIUM=1 but playwright (the dev extra) is not installed")
        pytest.skip("playwright (the dev extra) is not installed")
    manifest = read_manifest(scored.manifest)
    url, base, decisions = served.url, served.base, served.decisions
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        # under the page's own Content-Security-Policy: the grid draws, its images load, and a decision and its
        # undo go through (the token as a header), with no CSP violation reported
        strict = browser.new_page(viewport={"width": 1280, "height": 900})
        violations: list[str] = []
        strict.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
        strict.goto(url)
        strict.locator(".cell img").nth(15).wait_for()
        assert strict.locator("#count").text_content() == "16 samples"
        strict.locator(".cell").nth(3).click()
        strict.keyboard.press("k")
        strict.locator(".cell.kept").first.wait_for()
        strict.keyboard.press("u")
        strict.locator(".cell.kept").first.wait_for(state="detached")
        assert strict.url == base and not violations, (strict.url, violations)  # the token left the address bar
        strict.close()
        # Playwright's wait_for_function evaluates strings, which that policy forbids: the rest bypasses it
        page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
        page.goto(url)
        page.wait_for_function("document.getElementById('count').textContent === '16 samples'")
        assert page.locator(".cell").count() == 16

        # filter and sort: the page's SQL is plan's; the top cell is the highest aesthetic score
        page.fill("#where", "aesthetic > 5")
        page.select_option("#sort", "aesthetic")
        page.check("#desc")
        page.click("#apply")
        expected = int(np.sum(np.array([a for a in scored_aesthetic() if a is not None]) > 5))
        page.wait_for_function(f"document.getElementById('count').textContent === '{expected} samples'")
        assert page.locator("#hist .bar").count() > 0
        top = page.locator(".cell").first.get_attribute("data-id")
        best = max((a, -i) for i, a in enumerate(scored_aesthetic()) if a is not None)
        assert int(top) in {scored.ids[i] for i, a in enumerate(scored_aesthetic()) if a == best[0]}
        assert page.locator(".cell img").first.evaluate("img => img.complete && img.naturalWidth > 0")

        # open a sample, keep it; the next one: reject it by key; edit its caption
        page.locator(".cell").nth(0).dblclick()
        page.wait_for_selector("#detail:not([hidden])")
        page.click("#detail-keep")
        page.wait_for_function("document.getElementById('detail-state').textContent === 'kept'")
        page.click("#detail-close")
        second = page.locator(".cell").nth(1).get_attribute("data-id")
        page.locator(".cell").nth(1).click()
        page.keyboard.press("x")
        page.wait_for_selector(f".cell.rejected[data-id='{second}']")
        page.locator(".cell").nth(1).dblclick()
        page.wait_for_selector("#detail:not([hidden])")
        page.fill("#caption-edit", "an edited caption")
        page.click("#caption-save")
        page.wait_for_function("document.getElementById('decided').textContent.includes('edited 1')")
        page.keyboard.press("Escape")
        # a keep by key, then undo: not kept
        third = page.locator(".cell").nth(2).get_attribute("data-id")
        page.locator(".cell").nth(2).click()
        page.keyboard.press("k")
        page.wait_for_selector(f".cell.kept[data-id='{third}']")
        page.click("#undo")
        page.wait_for_selector(f".cell[data-id='{third}']:not(.kept)")

        # reload: the decisions are the server's (written), found again
        page.goto(base)  # no token in the URL: the cookie carries it
        page.fill("#where", "keep IS NOT NULL")
        page.click("#apply")
        page.wait_for_function("document.getElementById('count').textContent === '2 samples'")
        assert page.locator(".cell.kept").count() == 1 and page.locator(".cell.rejected").count() == 1
        page.locator(f".cell[data-id='{second}']").dblclick()
        page.wait_for_function("document.getElementById('caption-edit').value === 'an edited caption'")
        page.keyboard.press("Escape")

        # reject all that the filter shows, the count confirmed in a dialog
        low = sum(1 for a in scored_aesthetic() if a is not None and a < 2)
        page.fill("#where", "aesthetic < 2")
        page.click("#apply")
        page.wait_for_function(f"document.getElementById('count').textContent === '{low} samples'")
        asked = []
        page.once("dialog", lambda d: (asked.append(d.message), d.accept()))
        page.click("#reject-all")
        page.wait_for_function(f"document.querySelectorAll('.cell.rejected').length === {low}")
        assert asked == [f"Reject all {low} samples the filter shows?"]
        assert f"rejected {low + 1}" in page.inner_text("#decided")

        # a duplicate's detail: its cluster, and the keeper's image beside its own
        page.fill("#where", f"sample_id = {scored.ids[2]}")  # clustered with ids[2:6], keeper ids[3]
        page.click("#apply")
        page.wait_for_function("document.getElementById('count').textContent === '1 samples'")
        page.locator(".cell").first.dblclick()
        page.wait_for_selector("#keeper-figure:not([hidden])")
        assert page.inner_text("#detail-cluster") == f"4 samples; keeper {scored.ids[3]}"
        assert page.get_attribute("#keeper-image", "src") == f"image/{scored.ids[3]}"
        page.wait_for_function("document.getElementById('keeper-image').naturalWidth > 0 && "
                               "document.getElementById('detail-image').naturalWidth > 0")
        page.keyboard.press("Escape")

        # a bad filter is one line on the page, not a broken page
        page.fill("#where", "no_such_column > 1")
        page.click("#apply")
        page.wait_for_selector("#error:not([hidden])")
        assert "no_such_column" in page.inner_text("#error")
        browser.close()
    assert plan_kept(scored.manifest, (decisions,), str(tmp_path / "plan")) == {int(top)}
    _, rows, _ = read_annotations(decisions)
    edited = {r["sample_id"]: r["caption"] for r in rows.to_pylist()}
    assert edited[int(second)] == "an edited caption" and {int(top), int(second)} <= set(edited)
    low = {scored.ids[i] for i, a in enumerate(scored_aesthetic()) if a is not None and a < 2}
    assert set(edited) == {int(top), int(second)} | low
    assert [c for c in edited.values() if c is not None] == ["an edited caption"]
    assert manifest.samples.num_rows == 16


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip


def screenshot(demo: str, png: str) -> None:
    """docs/review.png: the page on the demo's manifest and annotations, sorted by contrast, a sample open.

        PYTHONPATH=$PWD python -m tests.test_review demo-output docs/review.png
    """
    import shutil
    import tempfile

    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        job = ReviewJob(manifest=f"{demo}/manifest", out=f"{tmp}/decisions", port=0, reviewer="demo",
                        annotations=(f"{demo}/annotations", f"{demo}/duplicates"))  # fmt: skip
        with session(job) as (url, data), sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1200, "height": 720}, bypass_csp=True)  # wait_for_function
            page.goto(url)
            page.wait_for_function("document.getElementById('count').textContent.endsWith('samples')")
            page.fill("#where", "NOT duplicate")
            page.select_option("#sort", "contrast")
            page.check("#desc")
            page.click("#apply")
            page.wait_for_function("document.getElementById('count').textContent.startsWith('192 ')")
            for i, key in ((0, "k"), (1, "k"), (2, "x"), (3, "k")):
                cell = page.locator(".cell").nth(i)
                sid = cell.get_attribute("data-id")
                cell.click()
                page.keyboard.press(key)
                page.wait_for_selector(f".cell.{'kept' if key == 'k' else 'rejected'}[data-id='{sid}']")
            page.wait_for_function("[...document.querySelectorAll('.cell img')].every(i => i.complete)")
            page.screenshot(path=png)
            browser.close()


def scored_aesthetic() -> list[float | None]:
    from tests.test_report import AESTHETIC

    return AESTHETIC


if __name__ == "__main__":
    import sys

    screenshot(sys.argv[1], sys.argv[2])
