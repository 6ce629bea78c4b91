"""Re-assign buckets from a manifest's stored sizes into a new manifest, without reading any image.

Change the training resolution (or bucket list, or min side) without rescanning:
``bucketeer rebucket MANIFEST --out NEW --resolution 512``, or from Python
``run(RebucketJob(manifest="m/", out="m512/", spec=BucketSpec(area=512 * 512)))``. A video manifest
(``scan --frames``) keeps its frame ladder: its rows get the buckets a video scan with the new options gives
(:func:`rebucket_video`). ``--scenes ANNOTATIONS`` (``bucketeer annotate --task scenes``) cuts each video's clips
inside its shots instead of at fixed strides (:func:`cut_at_scenes`), so ``plan`` and ``embed`` of the new manifest
never train on a clip across a cut.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from manifests.lock import writer_lock
from manifests.buckets import BucketSpec, add_bucket_arguments, spec_from_args
from manifests.frames import FrameLadder
from manifests.manifest import Manifest, apply_buckets, conform, read_manifest, rebucket, write_manifest
from manifests.schema import VIDEO_ERRORS_SCHEMA, VIDEO_SAMPLES_SCHEMA
from manifests.manifest_meta import ManifestMeta
from manifests.annotations import read_annotations, read_annotations_meta
from manifests.errors import UsageError
from manifests.storage import parse_storage_options, redact

__all__ = ["RebucketJob", "RebucketResult", "SHOT_SCORES", "add_arguments", "job_from_args", "run", "rebucket_video"]

SHOT_SCORES = ("motion", "aesthetic", "safety", "watermark")  # per-shot scores --shot-where names (scene_<name>)


@dataclass(frozen=True, kw_only=True)
class RebucketJob:
    """``bucketeer rebucket``: the manifest at ``manifest`` bucketed again by ``spec`` into ``out``
    (which may be ``manifest`` itself)."""

    manifest: str
    out: str
    spec: BucketSpec = field(default_factory=BucketSpec)
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options, e.g. an endpoint_url
    scenes: str | None = None  # annotations of --task scenes: clips cut inside shots (video manifests)
    shot_where: str | None = None  # with scenes: only shots for which this condition holds give clips


@dataclass(frozen=True, kw_only=True)
class RebucketResult:
    url: str  # the new manifest
    fingerprint: str
    meta: ManifestMeta
    samples: int
    errors: int
    buckets: int  # distinct buckets the samples fill


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="existing manifest folder (local path or URL)")
    parser.add_argument("--out", required=True, help="folder for the new manifest (may equal MANIFEST)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--scenes", default=None, metavar="ANNOTATIONS",
                        help="video manifests: cut clips inside the shots of these annotations (bucketeer annotate "
                        "--task scenes), never across a cut, instead of at fixed strides")
    parser.add_argument("--shot-where", default=None, metavar="SQL",
                        help="with --scenes: cut clips only from the shots this condition (as plan --where) holds for, "
                        "over each shot's start, frames, time and (annotate --task scenes,motion) motion, e.g. "
                        "\"motion > 0.5 AND frames >= 33\"")
    add_bucket_arguments(parser)


def job_from_args(args: argparse.Namespace) -> RebucketJob:
    """The job of ``bucketeer rebucket``'s options; raises UsageError for bad bucket or storage options."""
    return RebucketJob(manifest=args.manifest, out=args.out, spec=spec_from_args(args),
                       storage_options=parse_storage_options(args.storage_options), scenes=args.scenes,
                       shot_where=args.shot_where)  # fmt: skip


def run(job: RebucketJob) -> RebucketResult:
    """Write the re-bucketed manifest and print one line; raises ManifestError for an unreadable manifest."""
    old = read_manifest(job.manifest, job.storage_options)
    if job.shot_where is not None and not job.scenes:
        raise UsageError("--shot-where selects the shots of --scenes ANNOTATIONS: give both")
    if job.scenes and old.meta.frame_ladder is None:
        raise UsageError(f"--scenes: {redact(job.manifest)} is an image manifest; scenes cut the clips of a video "
                         "manifest (bucketeer scan --frames)")  # fmt: skip
    samples, errors = rebucket(old, job.spec) if old.meta.frame_ladder is None else rebucket_video(old, job.spec)
    if job.scenes:
        shots = _read_scenes(job.scenes, job.storage_options)
        samples, cut = cut_at_scenes(samples, shots, FrameLadder(old.meta.frame_ladder), job.shot_where)
        errors = pa.concat_tables([errors, cut])
    counts = {k: v for k, v in old.meta.counts.to_json().items() if k not in ("samples", "errors")}
    with writer_lock(job.out, job.storage_options, "rebucket"):
        meta = write_manifest(job.out, samples, errors, source=old.source, spec=job.spec, counts=counts,
                              summary=replace(old.meta.summary, rebucketed_from=old.fingerprint),
                              max_pixels=old.max_pixels,  # the rows were judged by it; embed decodes up to it
                              frame_ladder=old.meta.frame_ladder, storage_options=job.storage_options)  # fmt: skip
    n_buckets = len(set(samples.column("bucket").to_pylist()))
    print(
        f"rebucketed {samples.num_rows} samples into {n_buckets} buckets "
        f"({errors.num_rows} error rows) -> {job.out} (fingerprint {meta.fingerprint[:12]})"
    )
    return RebucketResult(url=job.out, fingerprint=meta.fingerprint, meta=meta, samples=samples.num_rows,
                          errors=errors.num_rows, buckets=n_buckets)  # fmt: skip


def rebucket_video(manifest: Manifest, spec: BucketSpec) -> tuple[pa.Table, pa.Table]:
    """A video manifest's rows bucketed again by ``spec``, with its own frame ladder, as a video scan buckets
    them (:func:`pipeline.scan.video.bucket_videos`): videos ``WxHxF``, images ``WxHx1``; ``too_small`` and
    ``too_short`` rows are judged again, other error rows carried over. Returns new ``(samples, errors)``."""
    from pipeline.scan.video import bucket_videos, one_frame_samples

    redo = pc.is_in(manifest.errors.column("error"), pa.array(["too_small", "too_short"]))
    cut = ("bucket", "clips", "clip_starts", "clip_captions")
    unbucketed = pa.schema([f for f in VIDEO_SAMPLES_SCHEMA if f.name not in cut])  # as probed
    rows = pa.concat_tables([conform(t, unbucketed) for t in (manifest.samples, manifest.errors.filter(redo))])
    image = pc.is_null(rows.column("codec")).combine_chunks()  # a scanned video always has its codec; an image none
    videos, rejects = bucket_videos(rows.filter(pc.invert(image)), spec, FrameLadder(manifest.meta.frame_ladder))
    images, small = apply_buckets(rows.filter(image), spec, video=True)
    return (pa.concat_tables([videos, one_frame_samples(images)]),
            pa.concat_tables([manifest.errors.filter(pc.invert(redo)), rejects, conform(small, VIDEO_ERRORS_SCHEMA)]))


def _read_scenes(url: str, storage_options: dict[str, Any]) -> pa.Table:
    """``sample_id, source_key, scenes`` of a scenes annotations folder; UsageError when it holds no scenes."""
    meta = read_annotations_meta(url, storage_options)
    if meta.task("scenes") is None:
        raise UsageError(f"--scenes {redact(url)} holds {', '.join(t.task for t in meta.tasks)}, no scenes: give the "
                         "--out of bucketeer annotate MANIFEST --task scenes")  # fmt: skip
    scores = [f"scene_{t}" for t in SHOT_SCORES if meta.task(t) is not None]
    scores += ["scene_caption"] if meta.task("caption") is not None else []  # shot captions: each clip its own
    _, rows, _ = read_annotations(url, storage_options, columns=["scenes", *scores])
    return rows.select(["sample_id", "source_key", "scenes", *scores])


def _shot_keep(shots: pa.Table, where: str | None) -> dict[int, list[bool]]:
    """``{sample_id: [keep shot i]}`` of ``where`` (``--shot-where``) over every shot's start, frames, time and
    scores (:data:`SHOT_SCORES`: ``motion``, ``aesthetic``, ...; null where the annotations lack that task)."""
    import polars as pl

    from manifests.select import where_mask

    lists = shots.column("scenes").to_pylist()
    scores = {t: (shots.column(f"scene_{t}").to_pylist() if f"scene_{t}" in shots.column_names else
                  [None] * len(lists)) for t in SHOT_SCORES}  # fmt: skip
    flat = [{**s, **{t: (scores[t][v] or [None] * len(one))[i] for t in SHOT_SCORES}}
            for v, one in enumerate(lists) for i, s in enumerate(one or [])]  # fmt: skip
    frame = pl.DataFrame(flat, schema={"start": pl.Int32, "frames": pl.Int32, "time": pl.Float64,
                                       **dict.fromkeys(SHOT_SCORES, pl.Float32)})  # fmt: skip
    keep = where_mask(frame, where, "--shot-where").tolist()
    out, at = {}, 0
    for sid, one in zip(shots.column("sample_id").to_pylist(), lists):
        out[sid] = keep[at : at + len(one or [])]
        at += len(one or [])
    return out


def _shot_captions(clips: list[int], said: list[str | None], texts: dict) -> tuple[dict, list[int]]:
    """A video's ``{caption, captions}`` from its kept shots' captions ``said`` (``clips``: how many clips each
    shot gives) and each clip's index into them: the distinct captions of the shots that give clips, in shot
    order (a shot without a caption keeps the video's own), ``caption`` the first, ``captions`` null for one."""
    own = texts["caption"]
    distinct: dict[str | None, int] = {}
    on = []
    for n, c in zip(clips, said):
        text = c if c else own
        if n:
            on += [distinct.setdefault(text, len(distinct))] * n
    listed = list(distinct)
    return {"caption": listed[0], "captions": listed if len(listed) > 1 else None}, on


def cut_at_scenes(samples: pa.Table, shots: pa.Table, ladder: FrameLadder,
                  shot_where: str | None = None) -> tuple[pa.Table, pa.Table]:  # fmt: skip
    """A video manifest's ``samples`` with each video's clips cut inside its shots (``shots``: ``sample_id``,
    ``source_key`` (the image key annotated), ``scenes``, optionally ``scene_motion``), only from the shots
    ``shot_where`` keeps (all with None), by :func:`manifests.frames.scene_clips`: bucket
    ``WxHxF`` with F the longest rung that fits its longest shot, ``clips`` and ``clip_starts``. With
    ``scene_caption`` (shots captioned) a video's captions become its clips' shots' (:func:`_shot_captions`) and
    ``clip_captions`` each clip's index into them. Returns
    ``(samples, errors)``: a video without an up-to-date scenes row is ``no_scenes``, one without a shot as long
    as the shortest rung ``too_short``; images (``WxHx1``) stay as they are."""
    from manifests.annotations import image_key
    from manifests.frames import scene_clips

    found = dict(zip(shots.column("sample_id").to_pylist(), zip(shots.column("source_key").to_pylist(),
                                                                shots.column("scenes").to_pylist())))  # fmt: skip
    captioned = dict(zip(shots.column("sample_id").to_pylist(), shots.column("scene_caption").to_pylist())) \
        if "scene_caption" in shots.column_names else {}  # fmt: skip
    keys = image_key(samples).tolist()
    kept = _shot_keep(shots, shot_where)
    buckets, clips, starts, reasons = [], [], [], []
    texts = samples.select(["caption", "captions"]).to_pylist()
    on = samples.column("clip_captions").to_pylist() if "clip_captions" in samples.column_names else \
        [None] * samples.num_rows  # fmt: skip
    for i, row in enumerate(samples.select(["sample_id", "bucket", "codec", "clips"]).to_pylist()):
        reason, bucket, n, at = None, row["bucket"], row["clips"], None
        if row["codec"] is not None:
            key, scenes = found.get(row["sample_id"], (None, None))
            if scenes is None or key != keys[i]:
                reason = ("no_scenes", "no scenes annotation of it" if scenes is None else "changed since its scenes "
                          "were annotated: run bucketeer annotate --task scenes again")  # fmt: skip
            else:
                chosen = [s for s, keep in zip(scenes, kept[row["sample_id"]]) if keep]
                f, at = scene_clips(ladder, [s["start"] for s in chosen], [s["frames"] for s in chosen])
                longest = max((s["frames"] for s in chosen), default=0)
                if not at:
                    which = f"{len(chosen)} of its {len(scenes)} shots kept by --shot-where" if shot_where else ""
                    reason = ("too_short", f"its longest shot{' of ' + which if which else ''} is {longest} frames, "
                              f"fewer than the shortest frame bucket ({ladder.frames[0]}; --frames)")  # fmt: skip
                else:
                    bucket, n = f"{bucket.rsplit('x', 1)[0]}x{f}", len(at)
                    said = captioned.get(row["sample_id"])
                    if said is not None:
                        said = [c for c, keep in zip(said, kept[row["sample_id"]]) if keep]
                        texts[i], on[i] = _shot_captions([s["frames"] // f for s in chosen], said, texts[i])
        buckets.append(bucket)
        clips.append(n)
        starts.append(at)
        reasons.append(reason)
    samples = samples.set_column(samples.schema.get_field_index("bucket"), "bucket", pa.array(buckets, pa.string()))
    samples = samples.set_column(samples.schema.get_field_index("clips"), "clips", pa.array(clips, pa.int32()))
    samples = samples.set_column(samples.schema.get_field_index("clip_starts"), "clip_starts",
                                 pa.array(starts, pa.list_(pa.int32())))  # fmt: skip
    for name, values, kind in (("caption", [t["caption"] for t in texts], pa.string()),
                               ("captions", [t["captions"] for t in texts], pa.list_(pa.string())),
                               ("clip_captions", on, pa.list_(pa.int32()))):  # fmt: skip
        samples = samples.set_column(samples.schema.get_field_index(name), name, pa.array(values, kind))
    bad = pa.array([r is not None for r in reasons])
    rejects = samples.filter(bad).drop_columns(["bucket"])
    rejects = rejects.append_column("error", pa.array([r[0] for r in reasons if r], pa.string()))
    rejects = rejects.append_column("message", pa.array([r[1] for r in reasons if r], pa.string()))
    return samples.filter(pc.invert(bad)), conform(rejects, VIDEO_ERRORS_SCHEMA)


if __name__ == "__main__":
    from pipeline.cli import exit_after, module_main

    exit_after(module_main, "rebucket")
