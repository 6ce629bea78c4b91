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
    lines = [
        "",
        f"bucketeer demo finished in {figures['total_seconds']:.1f} s ({figures['mode']}): {times}",
        "",
        "artifacts",
        f"  dataset   {a['dataset']}",
        f"  manifest  {a['manifest']}   (parquet: filename, width, height, caption, bucket; _manifest.json)",
        f"  cache     {a['cache']}   (gzip'd latents + text embeddings; _cache.json)",
        f"  plan      {a['plan']}   (rows epoch, step, rank, bucket, sample_ids; _plan.json)",
        f"  trainer   {a['train']}   (checkpoints, metrics.jsonl, logs/, model/), log {out / 'train.log'}",
        f"  report    {a['report']}   (PNGs in {a['figures']})",
        "",
        "figures",
        f"  scan      {s['listed']} images listed, {s['samples']} samples, {s['errors']} errors ({errors}); "
        f"{s['files_per_s']:.0f} files/s",
        f"  embed     {e['samples']} latent records, {e['texts']} captions; {rate} on the CPU",
        f"  plan      {p['steps_per_epoch']} steps/epoch x {p['epochs']} epochs on {world_size} ranks; "
        f"{p['planned']} samples planned, {p['padded']} padded, {p['dropped']} dropped sample-epochs",
        f"  train     {t['steps']} steps; " + (
            f"loss {t['loss_first']:.4f} (first 10 steps) -> {t['loss_last']:.4f} (last logged); "
            f"{t['samples_per_s']:.1f} samples/s; `tensorboard --logdir {a['train']}/logs` plots it"
            if t["loss_first"] is not None else "no loss logged"),
        "",
        "the same on a cluster (credentials from AWS_* variables; see README.md and infra/README.md)",
        "  ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline.scan "
        f"s3://my-bucket/dataset --out s3://my-bucket/manifest{opts}",
        "  ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline.embed "
        f"s3://my-bucket/manifest --out s3://my-bucket/cache{opts}",
        "  bucketeer plan s3://my-bucket/manifest --out s3://my-bucket/plan --world-size 8 --batch-size 4 "
        f"--epochs 10 --cache s3://my-bucket/cache{opts}",
        "  accelerate launch --config_file infra/accelerate/ddp-1x8.yaml -m train --plan s3://my-bucket/plan "
        f"--cache s3://my-bucket/cache{opts}",
        "",
        f"open {a['report']} in a browser; figures in {out / 'demo-summary.json'}",
    ]  # fmt: skip
    return "\n".join(lines)
