"""bucketeer review on a 1,000,000-sample manifest with its annotations: the page's answers over HTTP, against
the targets (first page <= 1 s, a new filter or sort <= 1 s, a warm thumbnail <= 50 ms) and against what a user
would do without it (a pandas notebook: read and join the parquet parts once, then filter and sort in memory).

    python benchmarks/review.py                     # 1,000,000 samples, 300 real images for the thumbnails
    python benchmarks/review.py --samples 100000    # quicker

The big manifest and its annotations are built as benchmarks/report_scores.py builds them (write_manifest and
the annotations writers: 8 float scores, grayscale, a 64-d float16 embedding the page must not read, dedup
clusters); its images do not exist (the grid, filter and sort need none). The server runs in this process
(:func:`pipeline.review.job.session`, uvicorn on 127.0.0.1) and is asked by HTTP with the token header:

- first page: ``GET /`` + ``static/app.js`` + ``api/info`` + the first ``api/view`` with its histogram, the
  view cache emptied before each round (what a browser does when the URL opens);
- filter: ``api/view?where=aesthetic > T AND NOT duplicate&histogram=1``, a new T each round (never cached);
- sort: ``api/view?sort=C&desc=1&histogram=1``, a new column each round;
- in Chromium (Playwright, the system browser), the URL opened until the grid's first cells are drawn (by the
  page's clock: navigation start to app.js's ``bucketeer-grid`` mark), and a jump to the end of the grid until
  its last cell shows (Playwright's wall clock, with the number of cells in the DOM then);
- thumbnails: a second manifest of real JPEGs (tests/embed_data.py), each read once (cold, encoded and cached
  on disk), then every one again (warm: served from the cache); then the same with the images and manifest
  on a local S3-compatible server (moto on 127.0.0.1, ranged GETs). The 1M-row grid is timed on a local
  folder only (its images need not exist; the manifest's parquet is read once at start either way).

Each of ``--rounds`` rounds (default 3) measures everything once, the pandas notebook included, with the server
of the big manifest started once; every round's figures go to ``benchmarks/results/review.json``
(``benchmarks/results.py``): a thumbnail round is the median of its ``--images`` requests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchmarks.results import Run  # noqa: E402

TARGETS = {"first page": 1.0, "filter": 1.0, "sort": 1.0, "warm thumbnail": 0.050, "warm thumbnail (S3)": 0.050,
           "browser: URL to grid": 1.0}


def fetch(base: str, token: str, path: str) -> bytes:
    request = urllib.request.Request(base + path, headers={"X-Bucketeer-Token": token})
    with urllib.request.urlopen(request, timeout=60) as r:
        return r.read()


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def view(where: str = "", sort: str = "", histogram: bool = True) -> str:
    query = {"where": where, "sort": sort, "desc": "1", "offset": "0", "limit": "200",
             "histogram": "1" if histogram else "0"}  # fmt: skip
    return "api/view?" + urllib.parse.urlencode(query)


SORTS = ["aesthetic", "safety", "watermark", "sharpness", "contrast", "luminance"]


def measure_grid(base: str, token: str, views: dict, i: int) -> dict[str, float]:
    """Round ``i`` over HTTP: the first page (the view cache emptied first), a new filter, a new sort (seconds)."""
    views.clear()  # the first page as a fresh server answers it

    def first_page() -> None:
        for path in ("", "static/app.js", "api/info", view()):
            fetch(base, token, path)
    out = {"first page": timed(first_page)}
    where = f"aesthetic > {0.3 + 0.1 * i:.2f} AND NOT duplicate"
    out["filter"] = timed(lambda: fetch(base, token, view(where)))
    out["sort"] = timed(lambda: fetch(base, token, view(where, SORTS[i % len(SORTS)])))
    return out


def measure_browser(url: str, views: dict) -> dict[str, float]:
    """In Chromium (Playwright, the system browser; nothing when either is missing), one page: the URL opened until
    the grid shows its first cells, and a jump to the end of the grid until its last cell shows (seconds); the cells
    in the page's DOM after the jump (virtual scrolling: the visible rows only, of a million)."""
    import shutil

    exe = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        exe = None
    if exe is None:
        print("  (no chromium or playwright: the browser timings are left out)")
        return {}
    out: dict[str, float] = {}
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"]  # fmt: skip
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=args)
        views.clear()
        page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)  # for wait_for_function
        page.goto(url)
        page.wait_for_function("performance.getEntriesByName('bucketeer-grid').length > 0")
        # the page's own clock, from the navigation's start to the grid drawn (app.js marks it): Playwright's
        # polling for it added 0.5-1 s on the loaded machine, which no user waits
        drawn = page.evaluate("performance.getEntriesByName('bucketeer-grid')[0].startTime")
        out["browser: URL to grid"] = drawn / 1000
        count = int(page.inner_text("#count").split()[0].replace(",", ""))
        started = time.perf_counter()
        page.evaluate("() => { const s = document.getElementById('scroller'); s.scrollTop = s.scrollHeight; }")
        page.wait_for_selector(f".cell[data-index='{count - 1}']")
        out["browser: jump to the end"] = time.perf_counter() - started
        out["browser: cells in the DOM after the jump"] = page.locator(".cell").count()
        page.close()
        browser.close()
    return out


def measure_pandas(root: str, i: int) -> tuple[float, float]:
    """A notebook: read the manifest's and the annotations' parts and join them (seconds), then round ``i``'s
    new filter and sort of the frame in memory, the first 200 rows (seconds)."""
    import glob

    import pandas as pd

    started = time.perf_counter()
    samples = pd.read_parquet(f"{root}/manifest/samples", columns=["sample_id", "filename", "bucket"])
    scores = pd.concat([pd.read_parquet(p, columns=["sample_id", "aesthetic", "safety", "watermark", "sharpness",
                                                    "contrast", "luminance"])
                        for p in sorted(glob.glob(f"{root}/scores/parts/*.parquet"))])  # fmt: skip
    dedup = pd.concat([pd.read_parquet(p, columns=["sample_id", "duplicate"])
                       for p in sorted(glob.glob(f"{root}/dedup/parts/*.parquet"))])  # fmt: skip
    df = samples.merge(scores, on="sample_id", how="left").merge(dedup, on="sample_id", how="left")
    load = time.perf_counter() - started

    def once() -> None:
        kept = df[(df["aesthetic"] > 0.3 + 0.1 * i) & ~df["duplicate"].fillna(True).astype(bool)]
        kept.sort_values(SORTS[i % len(SORTS)], ascending=False).head(200)
    return load, timed(once)


def measure_thumbs(root: str, images: int, storage_options: dict | None = None) -> dict[str, list[float]]:
    """Each of ``images`` real JPEGs' thumbnail over HTTP: once cold (read, encoded, cached), once warm.
    ``root``: a local folder, or an s3:// URL (with ``storage_options``) for images read by ranged GETs."""
    from pipeline.review.job import ReviewJob, session
    from tests.embed_data import make_dataset

    make_dataset(f"{root}/images", f"{root}/manifest", images, storage_options=storage_options)
    out = tempfile.mkdtemp(prefix="review-thumbs-")  # decisions (and the thumbnail cache) on this disk
    job = ReviewJob(manifest=f"{root}/manifest", out=f"{out}/decisions", port=0, reviewer="bench",
                    storage_options=dict(storage_options or {}))  # fmt: skip
    with session(job) as (url, data):
        base, token = url.split("?token=")
        ids = [str(i) for i in data.manifest.samples.column("sample_id").to_pylist()]
        cold = [timed(lambda: fetch(base, token, f"thumb/{sid}")) for sid in ids]
        warm = [timed(lambda: fetch(base, token, f"thumb/{sid}")) for sid in ids]
    shutil.rmtree(out, ignore_errors=True)
    return {"cold thumbnail": cold, "warm thumbnail": warm}


def measure_s3_thumbs(images: int, log: str) -> dict[str, list[float]]:
    """:func:`measure_thumbs` with the images and manifest on a local S3-compatible server (moto)."""
    from pathlib import Path

    from pipeline.demo.local_s3 import DEMO_BUCKET, local_credentials, local_s3_server

    with local_credentials(), local_s3_server(Path(log)) as endpoint:
        found = measure_thumbs(f"s3://{DEMO_BUCKET}/small", images, {"endpoint_url": endpoint})
    return {f"{k} (S3)": v for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--images", type=int, default=300, help="real images for the thumbnail timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", default=None, help="keep the generated inputs in this folder (and reuse them)")
    args = parser.parse_args()
    from report_scores import make_inputs

    from pipeline.review.job import ReviewJob, session

    run = Run("review", "python benchmarks/review.py" + "".join(f" {a}" for a in sys.argv[1:]),
              ["pandas", "playwright", "moto"])  # fmt: skip
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.data or tmp
        root = f"{tmp}/big"
        if not os.path.exists(f"{root}/dedup/_annotations.json"):
            started = time.perf_counter()
            make_inputs(root, args.samples)
            print(f"{args.samples:,}-sample manifest + scores + dedup written in {time.perf_counter() - started:.0f} s")
        shutil.rmtree(f"{root}/decisions", ignore_errors=True)
        job = ReviewJob(manifest=f"{root}/manifest", out=f"{root}/decisions", port=0, reviewer="bench",
                        annotations=(f"{root}/scores", f"{root}/dedup"))  # fmt: skip
        started = time.perf_counter()
        with session(job) as (url, data):
            print(f"server ready in {time.perf_counter() - started:.1f} s (reads the manifest and annotations once)")
            base, token = url.split("?token=")
            for i in range(args.rounds):
                with run.round():
                    shutil.rmtree(f"{tmp}/small", ignore_errors=True)
                    found = {**measure_grid(base, token, data._views, i), **measure_browser(url, data._views)}
                    load, in_memory = measure_pandas(root, i)
                    thumbs = measure_thumbs(f"{tmp}/small", args.images)
                    thumbs.update(measure_s3_thumbs(args.images, f"{tmp}/moto.log"))
                    for name, seconds in found.items():
                        if name.startswith("browser: cells"):
                            run.add(name, seconds, f"of {args.samples:,}")
                            continue
                        target = TARGETS.get(name)
                        run.add(name, seconds * 1e3, "ms", f"<= {target * 1e3:g}" if target else "")
                    for name, times in thumbs.items():
                        target = TARGETS.get(name)
                        run.add(f"{name}, median of {args.images}", statistics.median(times) * 1e3, "ms",
                                f"<= {target * 1e3:g}" if target else "")  # fmt: skip
                        run.add(f"{name}, p95 of {args.images}", float(np.quantile(times, 0.95)) * 1e3, "ms")
                    run.add("pandas notebook: read + join the parts", load, "s")
                    run.add("pandas notebook: a new filter + sort in memory", in_memory * 1e3, "ms")
                    run.add("pandas in memory / review's sort over HTTP", in_memory / found["sort"], "x")
                    print(f"round {i + 1}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in found.items()
                                                         if not k.startswith("browser: cells")) +
                          f"; pandas read + join {load:.1f} s, filter + sort {in_memory * 1e3:.0f} ms; " +
                          ", ".join(f"{k} median {statistics.median(v) * 1e3:.1f} ms" for k, v in thumbs.items()),
                          flush=True)  # fmt: skip
    print("load after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    run.save()


if __name__ == "__main__":
    main()
