"""``bucketeer report``: a self-contained page (no external URL), PNGs next to it, plan and cache
sections, and the page rendered by a real headless Chromium."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest

from manifests.annotations import (AnnotationsCounts, AnnotationsMeta, TaskSettings, part_name, settings_fingerprint,
                                   write_annotations_meta, write_part)  # fmt: skip
from manifests.cache import CacheWriter, read_cache_meta
from manifests.plan import DatasetSamples, PlanConfig, epoch_part, write_plan
from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest, write_manifest
from pipeline import ReportJob, run
from manifests.storage import open_url
from pipeline.cli import main
from pipeline.report.scores import extremes, score_bins
from tests.embed_data import make_dataset
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
    assert run(ReportJob(manifest=manifest_url, out=str(out))).url == str(out)
    page = out.read_text()
    assert_self_contained(page)
    sources = figure_sources(page)
    assert set(sources) == MANIFEST_FIGURES and 'class="grid"' not in page  # no annotations, no thumbnails
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
    assert run(ReportJob(manifest=manifest_url, out=str(out))).url == str(out)
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


# ---------------------------------------------------------------- plan and cache folders, written by their writers


def write_plan_folder(root, manifest, *, world: int = 2, batch: int = 4) -> dict:
    """A one-epoch plan of ``manifest`` (leftovers padded); returns the totals the report must show."""
    samples = manifest.samples
    config = PlanConfig(world_size=world, batch_size=batch, epochs=1, leftover="pad")
    meta = write_plan(str(root), [DatasetSamples(samples.column("sample_id"), samples.column("bucket"),
                                                 manifest_fingerprint=manifest.fingerprint)], config)  # fmt: skip
    steps, first = meta.steps_per_epoch, meta.epochs[0]
    return {"steps": steps, "padded": first.padded_total, "dropped": first.dropped_total,
            "slots": steps * world * batch}  # fmt: skip


CACHE_SETTINGS = {"vae": "stabilityai/sdxl-vae", "dtype": "bf16"}


def write_cache_folder(root, n_records: int = 120) -> dict:
    """A cache of ``n_records`` records (random bytes: the report reads the index, not records) and
    three error rows, written by the real CacheWriter."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(20_000, 60_000, n_records)
    writer = CacheWriter(str(root), CACHE_SETTINGS)
    for i, n in enumerate(lengths.tolist()):
        writer.add_sample(i, rng.bytes(n), caption_key=0, bucket="1024x1024", source_key=1)
    for i, (name, kind) in enumerate([("a.jpg", "decode_failed"), ("b.jpg", "decode_failed"), ("c.jpg", "truncated")]):
        writer.add_error(n_records + i, name, kind, "broken", source_key=1)
    writer.finish()
    return {"kib_per_sample": lengths.sum() / n_records / 1024}


def test_report_plan_and_cache_sections(manifest_url, tmp_path):
    manifest = read_manifest(manifest_url)
    expected = write_plan_folder(tmp_path / "plan", manifest)
    cache = write_cache_folder(tmp_path / "cache")
    out = tmp_path / "r.html"
    argv = ["report", manifest_url, "--plan", str(tmp_path / "plan"), "--cache", str(tmp_path / "cache"),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    page = out.read_text()
    assert_self_contained(page)
    figures = MANIFEST_FIGURES | {"plan_waste", "tokens_per_step", "cache_record_sizes", "cache_errors"}
    assert set(figure_sources(page)) == figures
    # padding and drops of the first epoch, as _plan.json counts them
    assert (
        f"{expected['steps']} steps x 2 ranks, {expected['slots']} sample slots, {expected['padded']} padding repeats"
        in page
    )
    assert f"{expected['dropped']} dropped" in page
    assert "made from this manifest</td><td>yes" in page
    assert f"{cache['kib_per_sample']:.1f} KiB" in page and "samples 120" in page
    assert "errors</td><td>decode_failed 2, truncated 1" in page
    assert len(list((tmp_path / "r_figures").glob("*.png"))) == 9


def test_report_reads_plans_and_caches_through_their_readers(manifest_url, tmp_path, capsys):
    manifest = read_manifest(manifest_url)
    write_plan_folder(tmp_path / "plan", manifest)
    # a file named by _plan.json is gone: refused as by every other reader, never listed around
    (tmp_path / "plan" / epoch_part(0)).unlink()
    argv = ["report", manifest_url, "--plan", str(tmp_path / "plan"), "--out", str(tmp_path / "r.html")]
    assert main(argv) == 2
    missing = "epoch 0: epoch-00000.parquet named by _plan.json is missing"
    assert missing in capsys.readouterr().err

    # a superseded error row (the image was read on a later run) is not counted, even before the
    # job merged its index (killed after a commit)
    cache = tmp_path / "cache"
    writer = CacheWriter(str(cache), CACHE_SETTINGS)
    writer.add_error(1, "a.jpg", "decode_failed", "broken", source_key=1)
    writer.add_error(2, "b.jpg", "read_failed", "timeout", source_key=1)
    writer.finish()
    again = CacheWriter(str(cache), CACHE_SETTINGS)
    again.add_sample(2, b"x" * 100, caption_key=0, bucket="1024x1024", source_key=1)
    again.commit()
    assert len(read_cache_meta(str(cache)).index.errors) == 1 and not read_cache_meta(str(cache)).complete
    assert run(ReportJob(manifest=manifest_url, cache=str(cache), out=str(tmp_path / "c.html"))).figures
    assert "errors</td><td>decode_failed 1</td>" in (tmp_path / "c.html").read_text()


def test_report_flags_a_plan_from_another_manifest(manifest_url, tmp_path):
    manifest = read_manifest(manifest_url)
    write_plan_folder(tmp_path / "plan", manifest)
    meta = json.loads((tmp_path / "plan" / "_plan.json").read_text())
    meta["inputs"]["manifest_fingerprint"] = "0" * 64
    (tmp_path / "plan" / "_plan.json").write_text(json.dumps(meta))
    run(ReportJob(manifest=manifest_url, plan=str(tmp_path / "plan"), out=str(tmp_path / "r.html")))
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


# ---------------------------------------------------------------- annotations: scores and duplicates


@dataclass(frozen=True)
class Scored:
    manifest: str
    scores: str  # aesthetic, luminance (floats), grayscale (bool), an embedding (never read by the report)
    dedup: str  # duplicate, cluster_id, keeper_id, similarity
    captions: str  # caption, generated_tokens of 3 samples: no score
    ids: list[int]  # the manifest's sample ids, in filename order
    names: dict[int, str]  # sample id -> filename


def write_annotations_folder(url: str, manifest, tasks: tuple[str, ...], columns: dict[str, pa.Array],
                             ids: list[int], names: dict[int, str]) -> None:  # fmt: skip
    """An annotations folder of ``columns`` for samples ``ids`` in two parts, written by the real writers
    (as ``bucketeer annotate`` or ``dedup`` would): ``_annotations.json`` last."""
    settings = tuple(TaskSettings(task=t, model="default", weight_sha256="0" * 64) for t in tasks)
    fingerprint = settings_fingerprint(settings)
    fs, root = open_url(url)
    table = pa.table({"sample_id": pa.array(ids, pa.uint64()), "filename": [names[i] for i in ids],
                      "source_key": pa.array([1] * len(ids), pa.uint64()),
                      "written_at": pa.array([1.0] * len(ids), pa.float64()), **columns})  # fmt: skip
    parts = []
    for half in (table.slice(0, len(ids) // 2), table.slice(len(ids) // 2)):
        name = part_name(fingerprint, half.column("sample_id").to_numpy(), np.ones(half.num_rows, np.uint64))
        write_part(fs, root, "parts", name, half, fingerprint)
        parts.append(name)
    counts = AnnotationsCounts(samples=manifest.samples.num_rows, annotated=len(ids), errors=0)
    write_annotations_meta(url, None, AnnotationsMeta(
        manifest=manifest.url, manifest_fingerprint=manifest.fingerprint, tasks=settings,
        settings_fingerprint=fingerprint, engine="transformers", counts=counts, parts=tuple(parts), fingerprint=""))


AESTHETIC = [5.0, 2.0, None, 7.5, 2.0, 9.0, 1.5, 6.0, 3.0, 8.25, 4.0, 0.5, 6.5, 9.0, 1.0]  # 14 scored, ties 2.0, 9.0
GRAYSCALE = [True, False, False, None, True, False, False, False, False, True, False, False, False, False, False]


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> Scored:
    """16 real images and their manifest; scores of 15 of them (one without an aesthetic score, one
    without a grayscale value), and dedup clusters of 4 and 3 samples, keepers not the lowest id."""
    root = tmp_path_factory.mktemp("scored")
    make_dataset(str(root / "images"), str(root / "manifest"), 16)
    manifest = read_manifest(str(root / "manifest"))
    by_name = sorted(zip(manifest.samples.column("filename").to_pylist(),
                         manifest.samples.column("sample_id").to_pylist()))  # fmt: skip
    ids = [i for _, i in by_name]
    names = {i: n for n, i in by_name}
    annotated = ids[:15]
    rng = np.random.default_rng(0)
    write_annotations_folder(str(root / "scores"), manifest, ("aesthetic", "stats"), {
        "aesthetic": pa.array(AESTHETIC, pa.float32()),
        "luminance": pa.array(rng.random(15), pa.float32()),
        "grayscale": pa.array(GRAYSCALE, pa.bool_()),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(15 * 4).astype(np.float16)), 4),
    }, annotated, names)  # fmt: skip
    cluster = {i: i for i in ids}  # every sample its own cluster and keeper
    keeper, similarity = dict(cluster), {i: 1.0 for i in ids}
    for members, sims in ((ids[2:6], [0.91, 0.99, 0.95]), (ids[8:11], [0.97, 0.93])):
        head = members[1]  # the keeper: not the lowest sample id of the cluster
        for member, sim in zip([m for m in members if m != head], sims):
            cluster[member], keeper[member], similarity[member] = head, head, sim
    for single in ids[12:]:  # the other way to write a sample with no duplicate: no cluster, keeper, similarity
        cluster[single] = keeper[single] = similarity[single] = None
    write_annotations_folder(str(root / "dedup"), manifest, ("dedup",), {
        "duplicate": pa.array([keeper[i] not in (i, None) for i in ids], pa.bool_()),
        "cluster_id": pa.array([cluster[i] for i in ids], pa.uint64()),
        "keeper_id": pa.array([keeper[i] for i in ids], pa.uint64()),
        "similarity": pa.array([similarity[i] for i in ids], pa.float32()),
    }, ids, names)  # fmt: skip
    write_annotations_folder(str(root / "captions"), manifest, ("caption",), {
        "caption": [f"generated {i}" for i in range(3)], "generated_tokens": pa.array([2] * 3, pa.int32()),
    }, ids[:3], names)  # fmt: skip
    return Scored(str(root / "manifest"), str(root / "scores"), str(root / "dedup"), str(root / "captions"), ids,
                  names)  # fmt: skip


def grid_ids(page: str, name: str) -> list[int]:
    """The sample ids of grid ``name``'s thumbnails, in page order."""
    found = re.search(rf'<div class="grid" id="grid-{name}">(.*?)</div></div>', page)
    assert found, f"no grid {name}"
    return [int(i) for i in re.findall(r'data-sample-id="(\d+)"', found.group(1))]


def test_report_scores_need_score_columns(scored, tmp_path, capsys):
    out = tmp_path / "r.html"
    run(ReportJob(manifest=scored.manifest, out=str(out), annotations=scored.captions, progress=False))
    page = out.read_text()
    assert "Annotations: " in page and "Scores: " not in page and 'class="grid"' not in page
    assert set(figure_sources(page)) == MANIFEST_FIGURES | {"caption-00", "caption-01", "caption-02"}
    assert f"{scored.names[scored.ids[1]]} | original: a photo of thing 1 | generated: generated 1" in page
    # a folder that is not annotations: one line, exit 2
    assert main(["report", scored.manifest, "--annotations", f"{scored.scores},{tmp_path}", "--out", str(out)]) == 2
    assert "_annotations.json" in capsys.readouterr().err


def test_extremes_and_bins_of_few_or_no_scores():
    ids = np.array([5, 3, 9, 1], np.uint64)
    low, high = extremes(ids, np.array([np.nan, 2.0, 2.0, np.nan]), k=8)
    assert ids[low].tolist() == [3, 9] and ids[high].tolist() == [3, 9]  # ties by sample id, NaN left out
    assert [len(a) for a in extremes(ids, np.full(4, np.nan))] == [0, 0]
    edges, counts, missing = score_bins(np.array([0.25, 0.25, np.nan]))
    assert counts.sum() == 2 and missing == 1 and edges[0] < 0.25 < edges[-1]  # one value: a span around it


def test_report_score_histograms_extremes_and_duplicate_clusters(scored, tmp_path):
    out = tmp_path / "r.html"
    argv = ["report", scored.manifest, "--annotations", f"{scored.scores},{scored.dedup}", "--out", str(out)]
    assert main(argv) == 0
    page = out.read_text()
    assert_self_contained(page)
    scores = {"score_aesthetic", "score_luminance", "score_grayscale", "score_duplicate"}  # not similarity
    assert set(figure_sources(page)) == MANIFEST_FIGURES | scores
    assert {p.stem for p in (tmp_path / "r_figures").glob("*.png")} == MANIFEST_FIGURES | scores
    # the counts: 14 of 16 have an aesthetic score; grayscale 3 true, 11 false, 2 without (one unannotated)
    assert "aesthetic: 14 of 16 samples scored, range 0.5 to 9, median 4.5" in page
    assert "grayscale: true 3, false 11, no value 2 (of 16 samples)" in page
    assert "duplicate: true 5, false 11, no value 0" in page
    edges, counts, missing = score_bins(np.array([np.nan if v is None else v for v in AESTHETIC]))
    assert counts.sum() == 14 and missing == 1 and (edges[0], edges[-1]) == (0.5, 9.0)
    # the lowest ascending, the highest descending, ties by sample id; the unscored sample in neither
    ids = np.array(scored.ids[:15], np.uint64)
    order = sorted((v, i) for v, i in zip(AESTHETIC, ids.tolist()) if v is not None)
    assert grid_ids(page, "aesthetic-lowest") == [i for _, i in order[:8]]
    by_high = sorted(order, key=lambda vi: (-vi[0], vi[1]))
    assert grid_ids(page, "aesthetic-highest") == [i for _, i in by_high[:8]]
    assert 'data-sample-id="%d"' % scored.ids[2] in page  # thumbnails are labelled with the filename
    assert f'alt="{scored.names[order[0][1]]}"' in page and "aesthetic 0.5</figcaption>" in page
    # duplicate clusters: the largest first, keeper first (outlined), then by similarity to it
    ids = scored.ids
    assert grid_ids(page, "cluster-0") == [ids[3], ids[4], ids[5], ids[2]]  # similarity .99, .95, .91
    assert grid_ids(page, "cluster-1") == [ids[9], ids[8], ids[10]]  # .97, .93
    assert f'<figure class="thumb keeper" data-sample-id="{ids[3]}">' in page
    assert re.search(r"similarity 0\.990</figcaption>.*similarity 0\.950</figcaption>", page)
    assert "5 of 16 samples are duplicates, in 2 clusters of 2 or more samples; the largest has 4" in page
    assert "grid-cluster-2" not in page  # singletons are not clusters
    # the thumbnails are the samples' images, upright, the long side at most 128 (JPEG)
    from PIL import Image

    samples = {r["sample_id"]: r for r in read_manifest(scored.manifest).samples.to_pylist()}
    thumbs = re.findall(r'data-sample-id="(\d+)"><img alt="[^"]+" src="data:image/jpeg;base64,([^"]+)"', page)
    assert len(thumbs) == 8 + 8 + 8 + 8 + 4 + 3
    for sample_id, data in thumbs:
        row, size = samples[int(sample_id)], Image.open(io.BytesIO(base64.b64decode(data))).size
        scale = min(1.0, 128 / max(row["width"], row["height"]))
        assert size == (round(row["width"] * scale), round(row["height"] * scale)), row["filename"]


# ---------------------------------------------------------------- a real browser

# appended to a copy of the page only: the report itself has no script
_PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const sizes = imgs.map(i => `${i.alt}:${i.complete ? i.naturalWidth : -1}x${i.naturalHeight}`);
  // per thumbnail grid: how many rows its thumbnails wrap into, and how many it has
  const grids = [...document.querySelectorAll(".grid")].map(g => {
    const tops = new Set([...g.querySelectorAll(".thumb")].map(t => t.offsetTop));
    return `${g.id}:${tops.size}:${g.querySelectorAll(".thumb").length}`;
  });
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = "IMAGES " + imgs.length + " " + sizes.join(" ") + " GRIDS " + grids.join(" ");
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
def test_report_renders_in_headless_chromium(manifest_url, scored, tmp_path):
    from PIL import Image

    exe = chromium_or_skip()
    manifest = read_manifest(manifest_url)
    write_plan_folder(tmp_path / "plan", manifest)
    out = tmp_path / "report.html"
    run(ReportJob(manifest=manifest_url, plan=str(tmp_path / "plan"), out=str(out)))

    # every <img> decoded: naturalWidth > 0 for each, read back from the DOM after the load event; on a
    # report of real images with every section: plan, scores and duplicates (their thumbnail grids)
    write_plan_folder(tmp_path / "scored_plan", read_manifest(scored.manifest))
    full = tmp_path / "full.html"
    run(ReportJob(manifest=scored.manifest, plan=str(tmp_path / "scored_plan"), out=str(full),
                  annotations=(scored.scores, scored.dedup)))  # fmt: skip
    probed = tmp_path / "probed.html"
    probed.write_text(full.read_text().replace("</body>", _PROBE + "</body>"))
    dom = run_chromium(exe, tmp_path, "--dump-dom", probed.as_uri())
    found = re.search(r'<pre id="probe">IMAGES (\d+) ([^<]*) GRIDS ([^<]*)</pre>', dom.stdout)
    assert found, f"probe did not run: {dom.stderr[-2000:]}"
    items = [item.rsplit(":", 1) for item in found.group(2).split()]
    figures = {"plan_waste", "tokens_per_step", "score_aesthetic", "score_luminance", "score_grayscale",
               "score_duplicate"}  # fmt: skip
    assert int(found.group(1)) == len(items) == 11 + 4 * 8 + 4 + 3  # figures, score grids, the two clusters
    assert {name for name, _ in items} == MANIFEST_FIGURES | figures | set(scored.names.values()) - {"img_015.jpg"}
    for name, size in items:
        width, height = (int(v) for v in size.split("x"))
        assert width > 0 and height > 0, f"{name} did not decode in Chromium ({size})"
    grids = dict(item.split(":", 1) for item in found.group(3).split())
    assert grids == {**{f"grid-{s}-{end}": "1:8" for s in ("aesthetic", "luminance") for end in ("lowest", "highest")},
                     "grid-cluster-0": "1:4", "grid-cluster-1": "1:3"}, "each grid: one row of its thumbnails"

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


@pytest.mark.parametrize("sizes", [[(360, 640), (640, 360), (512, 512)], [(4000, 3000)], [(800, 1200)] * 50])
def test_resolution_plot_leaves_room_above_its_largest_points(sizes):
    from pipeline.report import plots

    w, h = np.array(sizes, np.float64).T
    fig = plots.resolution_distribution(w, h)
    fig.canvas.draw()  # constrained layout and the equal aspect settle the axes' size in pixels
    ax, ax_mp = fig.axes[:2]
    marker = next(c for c in ax.collections).get_sizes()[0]  # points²
    radius_px = np.sqrt(marker) / 2 * fig.dpi / 72
    for lo_hi, size_px, largest in ((ax.get_xlim(), ax.bbox.width, w.max()), (ax.get_ylim(), ax.bbox.height, h.max())):
        data_per_px = (lo_hi[1] - lo_hi[0]) / size_px
        assert lo_hi[1] - largest > 2 * radius_px * data_per_px, "a point at the largest side is cut by the frame"
        assert lo_hi[1] >= 1.05 * largest, "the axis ends at (or just past) the largest side"
    tallest = max(p.get_height() for p in ax_mp.patches)
    assert ax_mp.get_ylim()[1] >= 1.05 * tallest, "the tallest megapixel bar touches the frame"
