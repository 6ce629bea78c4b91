"""``bucketeer report``: a self-contained page (no external URL), PNGs next to it, plan and cache
sections, and the page rendered by a real headless Chromium."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.cache import CACHE_FORMAT_VERSION
from manifests.plan import PLAN_FORMAT_VERSION
from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest, write_manifest
from pipeline.cli import main
from tests.factories import manifest_tables

MANIFEST_FIGURES = {"buckets", "aspect_ratio", "resolution", "caption_length", "errors"}


@pytest.fixture(scope="module")
def manifest_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("report") / "manifest")
    samples, errors = manifest_tables(400, seed=7)
    write_manifest(url, samples, errors, source="s3://datasets/photos", spec=BucketSpec())
    return url


def figure_sources(page: str) -> dict[str, str]:
    """``figure id -> img src`` of the report's figures."""
    return dict(re.findall(r'<figure id="fig-([\w-]+)"[^>]*><img alt="[^"]*" src="([^"]+)"', page))


def assert_self_contained(page: str) -> None:
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.IGNORECASE), "external URL"
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page.lower() and "<link" not in page.lower()


def test_report_is_self_contained_with_pngs_next_to_it(manifest_url, tmp_path):
    out = tmp_path / "site" / "report.html"
    assert main(["report", manifest_url, "--out", str(out)]) == 0
    page = out.read_text()
    assert_self_contained(page)
    sources = figure_sources(page)
    assert set(sources) == MANIFEST_FIGURES
    pngs = {p.stem: p.read_bytes() for p in (tmp_path / "site" / "report_figures").glob("*.png")}
    assert set(pngs) == MANIFEST_FIGURES
    for name, src in sources.items():
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == pngs[name], f"{name}: embedded image != PNG file"
    # the summary table: source, fingerprint, counts
    manifest = read_manifest(manifest_url)
    assert "s3://datasets/photos" in page and manifest.fingerprint in page
    assert f"samples {manifest.samples.num_rows}" in page and "truncated 3" in page


def test_report_figures_are_real_images(manifest_url, tmp_path):
    from PIL import Image

    out = tmp_path / "r.html"
    assert main(["report", manifest_url, "--out", str(out)]) == 0
    for png in (tmp_path / "r_figures").glob("*.png"):
        image = Image.open(png).convert("RGB")
        assert image.width >= 500 and image.height >= 200
        colours = len(np.unique(np.asarray(image).reshape(-1, 3), axis=0))
        assert colours > 50, f"{png.name} looks blank ({colours} colours)"


def test_report_rejects_bad_arguments(manifest_url, tmp_path, capsys):
    assert main(["report", manifest_url, "--out", str(tmp_path / "r.txt")]) == 2
    assert "must name an .html file" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "r.html")]) == 2
    assert "_manifest.json" in capsys.readouterr().err
    assert main(["report", manifest_url, "--plan", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 2
    assert "has no _plan.json" in capsys.readouterr().err


# ---------------------------------------------------------------- plan and cache folders, written by hand
# in the shape of manifests/plan.py and manifests/cache.py: only what the report reads.


def write_plan_folder(root, manifest, *, world: int = 2, batch: int = 4, full_meta: bool = True) -> dict:
    """A one-epoch plan: per bucket, global batches of world*batch; a leftover >= batch is padded
    with repeats of the bucket's first samples, a smaller one dropped. Returns the expected totals."""
    df = manifest.samples_df().sort("sample_id")
    rows, padded, dropped, step = [], {}, {}, 0
    for bucket in sorted(set(df["bucket"])):
        ids = df.filter(df["bucket"] == bucket)["sample_id"].to_list()
        full, rest = divmod(len(ids), world * batch)
        batches = [ids[i * world * batch : (i + 1) * world * batch] for i in range(full)]
        if rest >= batch:
            pad = world * batch - rest
            batches.append(ids[full * world * batch :] + ids[:pad])
            padded[bucket] = pad
        elif rest:
            dropped[bucket] = rest
        for b in batches:
            for rank in range(world):
                rows.append((0, step, rank, bucket, b[rank * batch : (rank + 1) * batch]))
            step += 1
    os.makedirs(root / "epoch-00000")
    for rank in range(world):
        mine = [r for r in rows if r[2] == rank]
        table = pa.table(
            {
                "epoch": pa.array([r[0] for r in mine], pa.int32()),
                "step": pa.array([r[1] for r in mine], pa.int32()),
                "rank": pa.array([r[2] for r in mine], pa.int32()),
                "bucket": [r[3] for r in mine],
                "sample_ids": pa.array([r[4] for r in mine], pa.list_(pa.uint64())),
            }
        )
        pq.write_table(table, root / "epoch-00000" / f"rank-{rank:05d}.parquet")
    meta = {"kind": "bucketeer.plan", "format_version": PLAN_FORMAT_VERSION, "inputs": {"world_size": world, "batch_size": batch, "seed": 0}}
    if full_meta:
        counts = df.group_by("bucket").len()
        meta.update(
            inputs={**meta["inputs"], "epochs": 1, "manifest_fingerprint": manifest.fingerprint},
            buckets={r["bucket"]: {"samples": r["len"], "batch_size": batch, "latent_tokens": 4096} for r in counts.iter_rows(named=True)},
            layout="epoch-{epoch:05d}/rank-{rank:05d}.parquet",  # read by name; the minimal variant is listed
            steps_per_epoch=step,
            epochs=[{"epoch": 0, "first_step": 0, "steps": step, "padded": padded, "dropped": dropped}],
            counts={"padded": sum(padded.values()), "dropped": sum(dropped.values())},
            tokens_per_step={"min": 4096 * batch, "mean": 4096 * batch, "max": 4096 * batch, "per": "rank"},
            fingerprint="f" * 64,
        )  # fmt: skip
    (root / "_plan.json").write_text(json.dumps(meta))
    return {"steps": step, "padded": sum(padded.values()), "dropped": sum(dropped.values()), "slots": step * world * batch}


def write_cache_folder(root, n_records: int = 120) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(20_000, 60_000, n_records)
    os.makedirs(root / "index")
    pq.write_table(pa.table({"sample_id": pa.array(np.arange(n_records), pa.uint64()), "length": lengths}),
                   root / "index" / "samples-aa.parquet")  # fmt: skip
    pq.write_table(pa.table({"filename": ["a.jpg", "b.jpg", "c.jpg"], "error": ["decode_failed", "decode_failed", "truncated"]}),
                   root / "index" / "errors-bb.parquet")  # fmt: skip
    meta = {
        "kind": "bucketeer.cache",
        "format_version": CACHE_FORMAT_VERSION,
        "fingerprint": "c" * 64,
        "settings": {"vae": "stabilityai/sdxl-vae", "dtype": "bf16"},
        "counts": {"samples": n_records, "texts": 80, "errors": 3},
        "shards": [{"path": "shards/samples-x.bin", "kind": "samples", "records": n_records, "bytes": int(lengths.sum())}],
        "index": {"samples": ["index/samples-aa.parquet"], "texts": [], "errors": ["index/errors-bb.parquet"]},
    }
    (root / "_cache.json").write_text(json.dumps(meta))
    return {"kib_per_sample": lengths.sum() / n_records / 1024}


@pytest.mark.parametrize("full_meta", [True, False], ids=["full-plan-json", "minimal-plan-json"])
def test_report_plan_and_cache_sections(manifest_url, tmp_path, full_meta):
    manifest = read_manifest(manifest_url)
    expected = write_plan_folder(tmp_path / "plan", manifest, full_meta=full_meta)
    cache = write_cache_folder(tmp_path / "cache")
    out = tmp_path / "r.html"
    argv = ["report", manifest_url, "--plan", str(tmp_path / "plan"), "--cache", str(tmp_path / "cache"), "--out", str(out)]
    assert main(argv) == 0
    page = out.read_text()
    assert_self_contained(page)
    assert set(figure_sources(page)) == MANIFEST_FIGURES | {"plan_waste", "tokens_per_step", "cache_record_sizes", "cache_errors"}
    # padding and drops: from _plan.json when it has them, recomputed from the rows when not: the same
    assert (
        f"{expected['steps']} steps x 2 ranks, {expected['slots']} sample slots, {expected['padded']} padding repeats"
        in page
    )
    assert f"{expected['dropped']} dropped" in page
    assert ("made from this manifest</td><td>yes" in page) == full_meta
    assert f"{cache['kib_per_sample']:.1f} KiB" in page and "samples 120" in page
    assert len(list((tmp_path / "r_figures").glob("*.png"))) == 9


def test_report_flags_a_plan_from_another_manifest(manifest_url, tmp_path):
    manifest = read_manifest(manifest_url)
    write_plan_folder(tmp_path / "plan", manifest)
    meta = json.loads((tmp_path / "plan" / "_plan.json").read_text())
    meta["inputs"]["manifest_fingerprint"] = "0" * 64
    (tmp_path / "plan" / "_plan.json").write_text(json.dumps(meta))
    assert main(["report", manifest_url, "--plan", str(tmp_path / "plan"), "--out", str(tmp_path / "r.html")]) == 0
    assert "made from this manifest</td><td>NO: plan made from 0000" in (tmp_path / "r.html").read_text()


@pytest.mark.s3
def test_report_reads_and_writes_s3(manifest_url, s3, tmp_path):
    samples, errors = manifest_tables(60, seed=2)
    url = s3.fresh_url("manifest")
    write_manifest(url, samples, errors, source="s3://x/y", spec=BucketSpec(), storage_options=s3.storage_options)
    out = s3.fresh_url("site") + "/report.html"
    options = json.dumps(s3.storage_options)
    assert main(["report", url, "--out", out, "--storage-options", options]) == 0
    page = s3.fs.cat_file(out).decode()
    assert_self_contained(page)
    assert len(s3.fs.ls(out.rsplit(".", 1)[0].removeprefix("s3://") + "_figures")) == len(MANIFEST_FIGURES)


# ---------------------------------------------------------------- a real browser

# appended to a copy of the page only: the report itself has no script
_PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const sizes = imgs.map(i => `${i.alt}:${i.complete ? i.naturalWidth : -1}x${i.naturalHeight}`);
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = "IMAGES " + imgs.length + " " + sizes.join(" ");
  document.body.appendChild(probe);
});
</script>"""


def chromium_or_skip() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe:
        return exe
    if os.environ.get("BUCKETEER_REQUIRE_CHROMIUM") == "1":
        pytest.fail("BUCKETEER_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install -y chromium)")
    pytest.skip("no chromium on PATH: install Debian's `chromium` package to run the browser test")


def run_chromium(exe: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,2000",
    ]  # fmt: skip
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_report_renders_in_headless_chromium(manifest_url, tmp_path):
    from PIL import Image

    exe = chromium_or_skip()
    manifest = read_manifest(manifest_url)
    write_plan_folder(tmp_path / "plan", manifest)
    out = tmp_path / "report.html"
    assert main(["report", manifest_url, "--plan", str(tmp_path / "plan"), "--out", str(out)]) == 0

    # every <img> decoded: naturalWidth > 0 for each, read back from the DOM after the load event
    probed = tmp_path / "probed.html"
    probed.write_text(out.read_text().replace("</body>", _PROBE + "</body>"))
    dom = run_chromium(exe, tmp_path, "--dump-dom", probed.as_uri())
    found = re.search(r'<pre id="probe">IMAGES (\d+) ([^<]*)</pre>', dom.stdout)
    assert found, f"probe did not run: {dom.stderr[-2000:]}"
    sizes = dict(item.split(":") for item in found.group(2).split())
    assert int(found.group(1)) == 7 and set(sizes) == MANIFEST_FIGURES | {"plan_waste", "tokens_per_step"}
    for name, size in sizes.items():
        width, height = (int(v) for v in size.split("x"))
        assert width > 0 and height > 0, f"{name} did not decode in Chromium ({size})"

    # the unmodified page, as a user opens it: the screenshot shows plots, not a blank page
    shot = tmp_path / "shot.png"
    result = run_chromium(exe, tmp_path, f"--screenshot={shot}", out.as_uri())
    assert shot.exists(), result.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2000)
    pixels = np.asarray(image)  # (H, W, 3)
    plots_area = pixels[450:1900]  # below the summary table: the figure grid
    background = np.all(plots_area >= 240, axis=-1)  # white figure cards and the light page background
    # thresholds: the real page gives ~0.14 / ~3000 / ~80000 here, the page with empty <img>s 0.04 / 914 / 4864
    assert 1 - background.mean() > 0.08, "the figure area is (nearly) empty"
    colours = len(np.unique(plots_area.reshape(-1, 3), axis=0))
    assert colours > 1500, f"only {colours} colours in the figure area: plots did not render"
    blue = np.all(np.abs(plots_area.astype(int) - (0x3B, 0x6F, 0xB6)) < 12, axis=-1)  # the bars' colour
    assert blue.sum() > 20000, "no histogram bars visible"
