"""``bucketeer annotate --task embedding,aesthetic,safety,watermark,phash,sha256,stats`` on real Ray with the
tiny default CLIP vision model and heads (real transformers, saved and loaded locally): each task's known
answers (a JPEG re-save keeps its phash, a flat grey image has no colour, sha256 of the bytes read, the
embedding equals the saved model run directly, the heads equal the head on the embedding, a resized copy is
the nearest embedding); settings recorded per task; projection in ``read_annotations``. The multi-task
kill and re-run is tests/test_annotate.py's kill test."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from manifests.annotations import AnnotationsError, read_annotations
from manifests.errors import UsageError
from pipeline import AnnotateJob, ScanJob, run
from pipeline.annotate.image_stats import hamming, image_stats, phash
from pipeline.scan import ScanConfig
from tests.embed_data import SPEC

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("bucketeer_home")]

VISION = ("embedding", "aesthetic", "safety", "watermark")
ALL = (*VISION, "phash", "sha256", "stats")


def picture(seed: int, w: int = 160, h: int = 120) -> np.ndarray:
    """A structured RGB image (gradients, a disc, a bar: a photo's low frequencies, unlike noise), uint8 (h, w, 3)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
    a, b, c = rng.uniform(-3, 3, 3)
    base = np.stack([np.sin(a * xx + b * yy), np.cos(b * xx - c * yy), np.sin(c * (xx + yy) + a)], -1)
    cx, cy, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.6), rng.uniform(0.1, 0.3)
    base[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.uniform(-1, 1, 3)
    base[:, int(rng.uniform(0.1, 0.9) * w) :][:, :8] = rng.uniform(-1, 1, 3)
    return ((base + 1) * 127.5).clip(0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def test_phash_is_imagehash_and_survives_a_jpeg_resave():
    imagehash = pytest.importorskip("imagehash")  # a dev dependency: the reference implementation
    rng = np.random.default_rng(0)
    flat = [np.full((40, 50, 3), v, np.uint8) for v in (0, 128, 255)]
    for pixels in [picture(s) for s in range(12)] + [rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)] + flat:
        img = Image.fromarray(pixels)
        assert phash(img) == int(str(imagehash.phash(img)), 16)
    hashes = [phash(Image.open(io.BytesIO(encoded(picture(s))))) for s in range(12)]
    for s, h in enumerate(hashes):
        resaved = phash(Image.open(io.BytesIO(encoded(np.asarray(Image.open(io.BytesIO(encoded(picture(s))))), 90))))
        assert hamming(h, resaved) <= 4
        assert min(hamming(h, other) for t, other in enumerate(hashes) if t != s) > 12


def test_stats_known_answers():
    grey = image_stats(np.full((40, 60, 3), 128, np.uint8))
    assert grey["colourfulness"] == 0 and grey["grayscale"] and grey["contrast"] == 0 and grey["sharpness"] == 0
    assert grey["luminance"] == pytest.approx(128 / 255) and grey["border_fraction"] == 0
    framed = np.full((100, 100, 3), (200, 40, 40), np.uint8)
    framed[:2], framed[-2:] = 0, 255  # top and bottom rows black / white: the border ring is 2 px wide
    s = image_stats(framed)
    assert not s["grayscale"] and s["colourfulness"] > 50 and s["border_fraction"] == pytest.approx(400 / 784)
    checker = (np.indices((64, 64)).sum(0) % 2 * 255).astype(np.uint8)[..., None].repeat(3, 2)
    assert image_stats(checker)["sharpness"] > 1e5 > image_stats(picture(1))["sharpness"]
    assert image_stats(checker)["contrast"] == pytest.approx(0.5)


@dataclass(frozen=True)
class Annotated:
    root: Path
    manifest: str
    out: str
    names: dict[int, str]  # sample id -> filename


@pytest.fixture(scope="module")
def annotated(tmp_path_factory, ray_local, bucketeer_home) -> Annotated:
    base = tmp_path_factory.mktemp("annotate-tasks")
    root, manifest, out = base / "images", str(base / "manifest"), str(base / "tasks")
    root.mkdir()
    for s in range(6):
        (root / f"img_{s}.jpg").write_bytes(encoded(picture(s)))
    small = Image.fromarray(picture(0)).resize((96, 72), Image.Resampling.LANCZOS)
    (root / "img_0_small.jpg").write_bytes(encoded(np.asarray(small)))
    (root / "grey.png").write_bytes(_png(np.full((48, 64, 3), 90, np.uint8)))
    (root / "zz_cut.jpg").write_bytes(encoded(picture(9, 400, 300))[:3000])
    run(ScanJob(source=str(root), out=manifest, spec=SPEC, config=ScanConfig(progress=False)))
    result = run(AnnotateJob(manifest=manifest, out=out, tasks=ALL, batch_size=4, unit_rows=4))
    assert (result.captioned, result.errors, result.engine) == (8, 1, "transformers")
    _, rows, _ = read_annotations(out, columns=["sha256"])
    return Annotated(root, manifest, out, dict(zip(rows.column("sample_id").to_pylist(),
                                                   rows.column("filename").to_pylist())))  # fmt: skip


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _by_name(annotated: Annotated, columns: list[str] | None = None) -> dict[str, dict]:
    _, rows, errors = read_annotations(annotated.out, columns=columns)
    assert errors.column("filename").to_pylist() == ["zz_cut.jpg"]
    return {r["filename"]: r for r in rows.to_pylist()}


@pytest.mark.slow
def test_columns_types_and_settings(annotated):
    meta, rows, _ = read_annotations(annotated.out)
    types = dict(zip(rows.schema.names, rows.schema.types))
    assert types["embedding"] == pa.list_(pa.float16(), 32) and types["phash"] == pa.uint64()
    assert types["sha256"] == pa.string() and types["grayscale"] == pa.bool_()
    assert all(types[c] == pa.float32() for c in ("aesthetic", "safety", "watermark", "luminance", "contrast",
                                                  "colourfulness", "sharpness", "border_fraction"))  # fmt: skip
    assert [t.task for t in meta.tasks] == list(ALL)
    embedding = meta.task("embedding")
    assert embedding.model == "default" and len(embedding.weight_sha256) == 64 and embedding.generation["dim"] == 32
    assert meta.task("aesthetic").generation["embedding_sha256"] == embedding.weight_sha256
    assert meta.task("phash").model == "imagehash-phash-8x8" and meta.task("sha256").generation == {}
    # projection: the key columns and what was asked; a column the parts lack is refused by name
    _, projected, _ = read_annotations(annotated.out, columns=["phash"])
    assert projected.column_names == ["sample_id", "filename", "source_key", "written_at", "phash"]
    with pytest.raises(AnnotationsError, match="no column caption"):
        read_annotations(annotated.out, columns=["caption"])
    again = run(AnnotateJob(manifest=annotated.manifest, out=annotated.out, tasks=ALL, batch_size=4, unit_rows=4))
    assert again.up_to_date and again.captioned == 0
    with pytest.raises(UsageError, match="other settings .*tasks"):
        run(AnnotateJob(manifest=annotated.manifest, out=annotated.out, tasks=("phash",)))


def test_sha256_phash_and_stats_of_the_images(annotated):
    imagehash = pytest.importorskip("imagehash")
    rows = _by_name(annotated, ["sha256", "phash", "colourfulness", "grayscale", "luminance"])
    for name, row in rows.items():
        data = (annotated.root / name).read_bytes()
        assert row["sha256"] == hashlib.sha256(data).hexdigest()
        assert row["phash"] == int(str(imagehash.phash(Image.open(io.BytesIO(data)).convert("RGB"))), 16)
    assert rows["grey.png"]["colourfulness"] == 0 and rows["grey.png"]["grayscale"]
    assert rows["grey.png"]["luminance"] == pytest.approx(90 / 255, abs=1e-6)
    assert not rows["img_1.jpg"]["grayscale"] and rows["img_1.jpg"]["colourfulness"] > 10


def test_embedding_and_heads_equal_the_models_run_directly(annotated):
    import torch
    from transformers import AutoImageProcessor, CLIPVisionModelWithProjection

    from pipeline.annotate.vision import VisionSpec, load_head

    rows = _by_name(annotated, list(VISION))
    spec = VisionSpec()
    model = CLIPVisionModelWithProjection.from_pretrained(spec.model_path()).eval()
    processor = AutoImageProcessor.from_pretrained(spec.model_path())
    names = sorted(rows)
    images = [Image.open(annotated.root / n).convert("RGB") for n in names]  # small: annotate decodes them as is
    with torch.inference_mode():
        embeds = model(**processor(images=images, return_tensors="pt")).image_embeds  # (n, 32)
        direct = torch.nn.functional.normalize(embeds, dim=-1)
    stored = torch.tensor(np.array([rows[n]["embedding"] for n in names], np.float32))  # (n, 32)
    np.testing.assert_allclose(stored.norm(dim=1), 1, atol=2e-3)
    np.testing.assert_allclose(stored, direct, atol=2e-3)
    for task in ("aesthetic", "safety", "watermark"):
        head = load_head(task, spec.head_path(task, "default", 32))
        np.testing.assert_allclose([rows[n][task] for n in names], head(direct).numpy(), atol=1e-3)
        if task != "aesthetic":
            assert all(0 <= rows[n][task] <= 1 for n in names)
    # the resized copy is img_0's nearest neighbour (at the tiny model's fixed seed, random weights)
    sims = stored @ stored[names.index("img_0.jpg")]
    order = [names[i] for i in torch.argsort(sims, descending=True)]
    assert set(order[:2]) == {"img_0.jpg", "img_0_small.jpg"}  # float16: the two may tie at 1.0


def test_bad_heads_are_one_line_before_any_work(annotated, tmp_path):
    from safetensors.torch import save_file
    import torch

    head = tmp_path / "wide.safetensors"
    save_file({"layers.0.weight": torch.zeros(1, 768), "layers.0.bias": torch.zeros(1)}, str(head))
    out = str(tmp_path / "out")
    with pytest.raises(UsageError, match="--aesthetic-head .*768-wide"):
        run(AnnotateJob(manifest=annotated.manifest, out=out, tasks=("aesthetic",), aesthetic_head=str(head)))
    (tmp_path / "not.safetensors").write_bytes(b"\x80\x04pickle")
    with pytest.raises(UsageError, match="--safety-head .*not a safetensors file"):
        run(AnnotateJob(manifest=annotated.manifest, out=out, tasks=("safety",),
                        safety_head=str(tmp_path / "not.safetensors")))  # fmt: skip
    assert not (tmp_path / "out" / "parts").exists()


def test_command_line_options_make_the_job():
    import argparse

    from pipeline.annotate import add_arguments, job_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job = job_from_args(parser.parse_args(["m", "--out", "o", "--task", "caption, embedding,aesthetic",
                                           "--embedding-model", "openai/clip-vit-large-patch14",
                                           "--aesthetic-head", "org/heads:aesthetic.safetensors"]))  # fmt: skip
    assert job.tasks == ("caption", "embedding", "aesthetic") and job.embedding_model == "openai/clip-vit-large-patch14"
    assert job.aesthetic_head == "org/heads:aesthetic.safetensors" and job.safety_head == "default"
    for bad in ("embedding,clip", "phash,phash", ""):
        with pytest.raises(UsageError, match="--task"):
            job_from_args(parser.parse_args(["m", "--out", "o", "--task", bad]))
