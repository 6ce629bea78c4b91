"""The demo's closing text: what it made, its figures, and the same flow as commands for a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

def summary_text(figures: dict[str, Any], out: Path, world_size: int) -> str:
    """What the demo made, its figures, and the same flow as commands for a cluster."""
    s, e, p, t = figures["scan"], figures["embed"], figures["plan"], figures["train"]
    a = figures["artifacts"]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_kind"].items())) or "none"
    times = ", ".join(f"{k} {v:.1f} s" for k, v in figures["stage_seconds"].items())
    rate = f"{e['images_per_s']:.1f} images/s" if e["images_per_s"] else "images/s n/a"
    opts = " --storage-options '{\"endpoint_url\": \"https://<account>.r2.cloudflarestorage.com\"}'"
    job = "ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline."
    clips = "clips" if "clips" in a else "manifest"  # the manifest embed and plan take
    if "annotate" in figures and "dedup" not in figures:  # a video demo: shots, motion and captions, clips in shots
        an = figures["annotate"]
        curation = [
            f"  annotate  {an['annotated']} videos and stills: {', '.join(an['tasks'])} (one decode each); "
            f"{an['errors']} errors",
            f"  rebucket  clips cut inside the shots, each with its own shot's caption -> {a['clips']}",
            f"  select    --where \"{p['where']}\": {p['kept']} kept, {p['dropped_by_where']} dropped",
        ]
        folders = [f"  annotations {a['annotations']}   (scenes, motion, scene_caption per video; _annotations.json)",
                   f"  clips     {a['clips']}   (the manifest with clip_starts and clip_captions)"]
        select = f" --annotations s3://my-bucket/annotations --where \"{p['where']}\""
        cluster = [f"  {job}annotate s3://my-bucket/manifest --out s3://my-bucket/annotations --task "
                   f"scenes,motion,caption --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda{opts}",
                   f"  bucketeer rebucket s3://my-bucket/manifest --out s3://my-bucket/clips --scenes "
                   f"s3://my-bucket/annotations{opts}"]
    elif "annotate" in figures:
        an, du = figures["annotate"], figures["dedup"]
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(du["edges"].items()))
        curation = [
            f"  annotate  {an['annotated']} images: {', '.join(an['tasks'])}; {an['errors']} errors",
            f"  dedup     {du['clusters']} clusters of duplicates ({kinds} pairs), {du['duplicates']} duplicates "
            f"besides their keepers",
            f"  select    --where \"{p['where']}\": {p['kept']} kept, {p['dropped_by_where']} dropped",
        ]
        folders = [f"  annotations {a['annotations']}   (parquet parts by sample_id: sha256, phash, luminance, "
                   "contrast, ...; _annotations.json)",
                   f"  duplicates  {a['duplicates']}   (duplicate, cluster_id, keeper_id, similarity)"]
        select = (" --annotations s3://my-bucket/annotations,s3://my-bucket/duplicates "
                  f"--where \"{p['where']}\"")
        cluster = [f"  {job}annotate s3://my-bucket/manifest --out s3://my-bucket/annotations --task sha256,phash,stats"
                   f"{opts}",
                   f"  bucketeer dedup s3://my-bucket/annotations --out s3://my-bucket/duplicates{opts}"]
    else:
        curation, folders, select, cluster = [], [], "", []
    lines = [
        "",
        f"bucketeer demo finished in {figures['total_seconds']:.1f} s ({figures['mode']}): {times}",
        "",
        "artifacts",
        f"  dataset   {a['dataset']}",
        f"  manifest  {a['manifest']}   (parquet: filename, width, height, caption, bucket; _manifest.json)",
        *folders,
        f"  cache     {a['cache']}   (gzip'd latents + text embeddings; _cache.json)",
        f"  plan      {a['plan']}   (rows epoch, step, rank, bucket, sample_ids; _plan.json)",
        f"  trainer   {a['train']}   ({_listing(Path(a['train']))}), log {out / 'train.log'}",
        f"  report    {a['report']}   (PNGs in {a['figures']})",
        "",
        "figures",
        f"  scan      {s['listed']} images listed, {s['samples']} samples, {s['errors']} errors ({errors}); "
        f"{s['files_per_s']:.0f} files/s",
        *curation,
        f"  embed     {e['samples']} latent records, {e['texts']} captions; {rate} on the CPU",
        f"  plan      {p['steps_per_epoch']} steps/epoch x {p['epochs']} epochs on {world_size} ranks; "
        f"{p['planned']} samples planned, {p['padded']} padded, {p['dropped']} dropped sample-epochs",
        f"  train     {t['steps']} steps; " + (
            f"loss {t['loss_first']:.4f} (first 10 steps) -> {t['loss_last']:.4f} (last logged); "
            f"{t['samples_per_s']:.1f} samples/s; `tensorboard --logdir {a['train']}/logs` plots it"
            if t["loss_first"] is not None else "no loss logged"),
        "",
        "the same on a cluster (credentials from AWS_* variables; see README.md, docs/ and infra/README.md)",
        f"  {job}scan s3://my-bucket/dataset --out s3://my-bucket/manifest{opts}",
        *cluster,
        f"  {job}embed s3://my-bucket/{clips} --out s3://my-bucket/cache{opts}",
        f"  bucketeer plan s3://my-bucket/{clips} --out s3://my-bucket/plan --world-size 8 --batch-size 4 "
        f"--epochs 10 --cache s3://my-bucket/cache{select}{opts}",
        "  accelerate launch --config_file infra/accelerate/ddp-1x8.yaml -m train --plan s3://my-bucket/plan "
        f"--cache s3://my-bucket/cache{opts}",
        "",
        f"open {a['report']} in a browser; figures in {out / 'demo-summary.json'}",
    ]  # fmt: skip
    return "\n".join(lines)


def _listing(folder: Path) -> str:
    """What the trainer wrote (``model/`` or ``lora/``, ``lora_2/`` for both Wan 2.2 A14B experts, ...)."""
    if not folder.is_dir():
        return "checkpoints/, metrics.jsonl, logs/, model/ or lora/"
    return ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()))
