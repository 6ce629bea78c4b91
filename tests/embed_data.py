"""Tiny image datasets, their manifests and embed runs, shared by the embed and plan tests."""

from __future__ import annotations

import argparse
import io
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from PIL import Image

from manifests.buckets import BucketSpec
from manifests.cache import CacheReader, read_index
from manifests.manifest import apply_buckets, write_manifest
from manifests.schema import ERRORS_SCHEMA, sample_ids
from manifests.storage import join, open_url

if TYPE_CHECKING:
    from pipeline import EmbedJob, EmbedResult

SPEC = BucketSpec(area=64 * 64, step=32)
SIZES = [(96, 64), (64, 96), (80, 80), (150, 70), (70, 150)]  # (w, h): 64x64, 128x32 and 32x128 buckets


def jpeg(w: int, h: int, seed: int, orientation: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    img.save(buf, "JPEG", quality=85, exif=exif.tobytes())
    return buf.getvalue()


def make_dataset(
    root: str, manifest: str, n: int = 12, *, storage_options=None, broken=(), start: int = 0,
    unique_from: int | None = None,
) -> list[str]:
    """``n`` tiny images under ``root`` (+ ``broken`` names with undecodable bytes) and their manifest.

    Image 1 is stored sideways with EXIF orientation 6 (display 64x96); captions repeat; every
    5th image has none; images from ``unique_from`` on have a caption of their own (``only image <i>``).
    Returns the filenames in the manifest.
    """
    fs, base = open_url(root, storage_options)
    fs.makedirs(base, exist_ok=True)
    rows = []
    for i in range(start, start + n):
        w, h = SIZES[i % len(SIZES)]
        name = f"img_{i:03d}.jpg"
        if i == 1:  # stored 96x64 landscape, displayed as 64x96 portrait
            data, (w, h) = jpeg(96, 64, i, orientation=6), (64, 96)
        else:
            data = jpeg(w, h, i)
        caption = None if i % 5 == 0 else f"a photo of thing {i % 3}"
        rows.append((name, w, h, f"only image {i}" if unique_from is not None and i >= unique_from else caption, data))
    for name in broken:
        rows.append((name, 80, 80, "broken", b"<html>not an image</html>"))
    for name, *_, data in rows:
        fs.pipe_file(join(base, name), data)
    names = [r[0] for r in rows]
    table = pa.table({
        "sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
        "width": pa.array([r[1] for r in rows], pa.int32()), "height": pa.array([r[2] for r in rows], pa.int32()),
        "caption": pa.array([r[3] for r in rows], pa.string()), "size": pa.array([len(r[4]) for r in rows], pa.int64()),
    })  # fmt: skip
    samples, rejects = apply_buckets(table, SPEC)
    assert rejects.num_rows == 0
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=SPEC,
                   storage_options=storage_options)  # fmt: skip
    return names


def embed_cache(manifest: str, out: str, **options: Any) -> EmbedResult:
    """``run(EmbedJob(...))`` with small batches and shards (4), so that a dozen images make several."""
    from pipeline import EmbedJob, run

    return run(EmbedJob(manifest=manifest, out=out, **{"batch_size": 4, "shard_records": 4, **options}))


def family_plan(base, family: str, prompts: str = "a red cat\n", **embed: Any) -> dict[str, str]:
    """A tiny ``family`` pipeline folder under ``base``, a cache of 6 generated images (buckets 64x64: 4 images,
    128x32, 32x128) embedded with it and the validation ``prompts``, and a one-rank plan of 3 epochs of batches of
    2: ``{"model", "cache", "plan", "manifest"}`` (``embed``: more EmbedJob options)."""
    from pathlib import Path

    from pipeline import PlanJob, run
    from pipeline.embed.families.tiny import build_tiny
    from pipeline.embed.loading import quiet_loading

    quiet_loading()
    base = Path(base)
    manifest, prompt_file = str(base / "manifest"), base / "prompts.txt"
    make_dataset(str(base / "data"), manifest, 6)
    prompt_file.write_text(prompts)
    model, cache, plan = str(build_tiny(family, base / family)), str(base / "cache"), str(base / "plan")
    embed_cache(manifest, cache, family=family, model=model, validation_prompts=str(prompt_file), **embed)
    run(PlanJob(manifests=(manifest,), out=plan, world_size=1, batch_size=2, epochs=3, cache=(cache,),
                leftover="pad"))  # fmt: skip
    return {"model": model, "cache": cache, "plan": plan, "manifest": manifest}


def plan_batches(data: dict[str, str]):
    """``(reader, batches)``: the cache of a :func:`family_plan` and rank 0's batches of its plan, as the trainer
    reads them."""
    from train.data import BatchLoader, rank_steps

    reader = CacheReader(data["cache"])
    return reader, list(BatchLoader(reader, list(rank_steps(data["plan"], 0)), reader.meta.latent))


def embed_args(manifest: str, out: str, *extra: str) -> EmbedJob:
    """The :class:`EmbedJob` that ``bucketeer embed MANIFEST --out OUT --batch-size 4 --shard-records 4 *extra``
    parses into (argparse's SystemExit for an unknown option)."""
    from pipeline import embed

    parser = argparse.ArgumentParser()
    embed.add_arguments(parser)
    args = parser.parse_args([manifest, "--out", out, "--batch-size", "4", "--shard-records", "4", *extra])
    return embed.job_from_args(args)


def records_by_id(url: str, storage_options=None) -> dict[int, object]:
    reader = CacheReader(url, storage_options)
    return {r.sample_id: r for r in reader.read(reader.sample_ids.tolist())}


def record_bytes(url: str, storage_options=None) -> dict[int, bytes]:
    """The stored (compressed) bytes of every live sample record, by sample id."""
    fs, root = open_url(url, storage_options)
    rows = read_index(url, storage_options)["samples"].to_pylist()
    shards = {s: fs.cat_file(join(root, s)) for s in {r["shard"] for r in rows}}
    return {r["sample_id"]: shards[r["shard"]][r["offset"] : r["offset"] + r["length"]] for r in rows}
