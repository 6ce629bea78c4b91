"""Embed benchmark: the pipeline against encoder-only compute, the cache against per-file torch.save.

    python benchmarks/embed.py [--images 256] [--size 256] [--rounds 3]    # 1-4, then 5 (results/embed*.json)
    python benchmarks/embed.py --embed-only                                 # 1-4 only
    python benchmarks/embed.py --commit-only [--commit-rows 1000000]       # 5 only

In one run, with the embedded default (tiny random-weight) encoders on this machine's CPU:
1. end-to-end images/s of `bucketeer embed` (fetch, decode, resize, VAE, gzip, shard commits; image
   phase, model loading excluded) vs VAE forward passes alone on pre-decoded tensors, same threads;
2. bytes per sample: cache record vs raw bf16 latent vs one gzip'd ``torch.save`` fp32 file per image;
3. text bytes per caption: unpadded vs padded to 77 tokens;
4. time to read 256 random records: shards (CacheReader, ranged reads) vs one file per record,
   locally and from a moto S3 server started here on 127.0.0.1;
5. committing ``--commit-rows`` (1M) synthetic index rows through the real ShardWriter + CacheCommitter
   (no encoders, a commit after every shard, in a child process): the driver's peak RSS and the
   metadata bytes written, vs the old layout whose ``_cache.json`` listed every shard and was
   rewritten after each one (O(shards^2) bytes).
SDXL's VAE at 1024^2 in bf16 and the GPU's busy fraction need a GPU: not measured here.

Each of ``--rounds`` rounds runs 1-4 once (a fresh cache, a fresh local Ray; the moto server and the images are
made once) and writes every round's figures to ``benchmarks/results/embed.json``; 5 runs once per round in a
fresh child process (its peak RSS is the committer's alone) into ``benchmarks/results/embed-commit.json``
(``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import shutil
import socket
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.results import Run  # noqa: E402


def make_images(root: str, manifest: str, n: int, size: int) -> None:
    import pyarrow as pa
    from PIL import Image

    from manifests.buckets import BucketSpec
    from manifests.manifest import apply_buckets, write_manifest
    from manifests.schema import ERRORS_SCHEMA, sample_ids

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    w, h = size * 5 // 4, size * 9 // 8  # a little larger than the bucket: resize + crop do real work
    yy, xx = np.mgrid[0:h, 0:w]
    names = []
    for i in range(n):
        # smooth gradients + mild noise: photo-like compressibility, unlike pure noise
        base = np.stack([(xx * (i % 7 + 1)) % 256, (yy * (i % 5 + 1)) % 256, (xx + yy + 17 * i) % 256], -1)
        img = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
        name = f"img_{i:05d}.jpg"
        Image.fromarray(img).save(os.path.join(root, name), quality=90)
        names.append(name)
    captions = [f"a synthetic photo of pattern {i % 40} with colours" for i in range(n)]
    table = pa.table({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
                      "width": pa.array([w] * n, pa.int32()), "height": pa.array([h] * n, pa.int32()),
                      "caption": captions, "size": pa.array([0] * n, pa.int64())})  # fmt: skip
    spec = BucketSpec(buckets=((size, size),))
    samples, _ = apply_buckets(table, spec)
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=spec)


def encoder_only(size: int, batch: int, threads: int, n: int) -> float:
    import torch

    from pipeline.embed.loading import EncoderSource, quiet_loading

    from pipeline.embed.latents import LatentSpec

    quiet_loading()
    torch.set_num_threads(threads)
    enc = LatentSpec(EncoderSource("default")).load()
    x = np.random.default_rng(0).integers(0, 255, (batch, size, size, 3), dtype=np.uint8)
    enc.encode(x)  # warm-up
    t = time.perf_counter()
    for _ in range(max(1, n // batch)):
        enc.encode(x)
    return max(1, n // batch) * batch / (time.perf_counter() - t)


def per_file_records(cache: str, out: str, ids: list[int]) -> None:
    """The alternative layout: one gzip'd torch.save (fp32, as trainers write it) per image."""
    import torch

    from manifests.cache import CacheReader
    from manifests.cache.records import to_float32

    os.makedirs(out, exist_ok=True)
    for r in CacheReader(cache).read(ids):
        buf = io.BytesIO()
        torch.save({"latent": torch.from_numpy(to_float32(r.latent, r.dtype).copy()),
                    "original_size": r.original_size, "crop_top_left": r.crop_top_left,
                    "target_size": r.target_size}, buf)  # fmt: skip
        with open(os.path.join(out, f"{r.sample_id}.pt.gz"), "wb") as f:
            f.write(gzip.compress(buf.getvalue()))


def time_reads(cache: str, per_file: str, ids: list[int], so: dict | None) -> tuple[float, float, float]:
    """(open reader s, read 256 from shards s, read 256 per-file s incl. torch.load)."""
    import torch

    from manifests.cache import CacheReader
    from manifests.storage import join, open_url

    t = time.perf_counter()
    reader = CacheReader(cache, so)
    t_open = time.perf_counter() - t
    t = time.perf_counter()
    reader.read(ids)
    t_shards = time.perf_counter() - t
    fs, root = open_url(per_file, so)
    t = time.perf_counter()
    paths = [join(root, f"{i}.pt.gz") for i in ids]
    blobs = fs.cat(paths)
    for p in paths:
        torch.load(io.BytesIO(gzip.decompress(blobs[p])), weights_only=True)
    return t_open, t_shards, time.perf_counter() - t


def commit_scale(rows: int, shard_records: int) -> dict:
    """Commit ``rows`` synthetic sample index rows, one shard of ``shard_records`` at a time (what the
    embed driver does with its workers' results); print and return peak RSS and metadata bytes of both layouts."""
    import json
    import resource


    from manifests.cache import CacheCommitter, ShardWriter

    work = tempfile.mkdtemp(prefix="bucketeer-bench-commit-")
    cache = os.path.join(work, "cache")
    settings = {"bench": "commit-scale"}
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB, after the imports
    committer = CacheCommitter(cache, settings, commit_seconds=0)
    fs, root = committer.fs, committer.root
    shards = -(-rows // shard_records)
    ids = np.random.default_rng(0).permutation(np.arange(1, rows + 1, dtype=np.uint64))
    record = b"x" * 64
    old_meta: dict = {"shards": []}
    old_bytes = 0
    t = time.perf_counter()
    for s in range(shards):
        shard = ShardWriter("samples", max_records=shard_records + 1)
        for sid in ids[s * shard_records : (s + 1) * shard_records].tolist():
            shard.append(record, sample_id=sid, caption_key=sid % 997, bucket="256x256", source_key=sid)
        index, size = shard.write(fs, root)  # what a worker does; only ``index`` reaches the driver
        committer.add("samples", index)
        committer.commit()
        # the old layout: every shard listed in _cache.json, rewritten after each shard
        old_meta["shards"].append({"path": index.column("shard")[0].as_py(), "kind": "samples",
                                   "records": index.num_rows, "bytes": size, "generation": s + 1})  # fmt: skip
        old_bytes += len((json.dumps(old_meta, indent=2, sort_keys=True) + "\n").encode())
    committer.finish()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    parts = len(committer.meta.index.samples)
    print(f"\n## committing {rows:,} index rows in {shards:,} shards of {shard_records} ({seconds:.1f} s)")
    print(f"driver peak RSS                     : {peak:8.0f} MiB ({base_rss:.0f} MiB after imports)")
    print(f"_cache.json bytes written           : {committer.metadata_bytes:12,d}  ({shards + 1} commits, "
          f"{committer.metadata_bytes / (shards + 1):,.0f} B each)")
    print(f"index part bytes written (w/ merges): {committer.index_bytes:12,d}  ({parts} part at the end)")
    print(f"old layout, _cache.json bytes       : {old_bytes:12,d}  ratio {old_bytes / committer.metadata_bytes:.0f}x")
    shutil.rmtree(work, ignore_errors=True)
    return {"seconds": seconds, "peak_mib": peak, "base_mib": base_rss, "meta_bytes": committer.metadata_bytes,
            "commits": shards + 1, "index_bytes": committer.index_bytes, "old_bytes": old_bytes}


def commit_rounds(rows: int, rounds: int) -> None:
    """:func:`commit_scale` once per round in a fresh child process, into results/embed-commit.json."""
    import json
    import subprocess

    run = Run("embed-commit", f"python benchmarks/embed.py --commit-only --commit-rows {rows} --rounds {rounds}")
    for _ in range(rounds):
        with run.round():
            out = subprocess.run([sys.executable, __file__, "--commit-child", "--commit-rows", str(rows)],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            print(out.rsplit("\n", 2)[0], flush=True)
            got = json.loads(out.strip().splitlines()[-1])
            run.add(f"_cache.json bytes written, {got['commits']:,} commits", got["meta_bytes"], "B")
            run.add("_cache.json bytes per commit", got["meta_bytes"] / got["commits"], "B")
            run.add("before (every shard in _cache.json): bytes written", got["old_bytes"], "B")
            run.add("before / bucketeer, _cache.json bytes", got["old_bytes"] / got["meta_bytes"], "x")
            run.add("index part bytes written (merges included)", got["index_bytes"] / 1e6, "MB")
            run.add("driver peak RSS", got["peak_mib"], "MiB", "<= 1024")
            run.add("driver RSS after imports", got["base_mib"], "MiB")
            run.add("wall time", got["seconds"], "s")
    run.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--commit-rows", type=int, default=1_000_000, help="index rows of the commit benchmark")
    ap.add_argument("--commit-only", action="store_true", help="run only the commit benchmark (5)")
    ap.add_argument("--embed-only", action="store_true", help="run only 1-4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--commit-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.commit_child:
        import json

        print(json.dumps(commit_scale(args.commit_rows, 1024)))
        return
    if not args.commit_only:
        embed_rounds(args)
    if not args.embed_only:
        commit_rounds(args.commit_rows, args.rounds)


def embed_rounds(args: argparse.Namespace) -> None:
    """1-4, once per round, into results/embed.json."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    work = tempfile.mkdtemp(prefix="bucketeer-bench-")
    os.environ.setdefault("BUCKETEER_HOME", os.path.join(work, "home"))
    root, manifest = os.path.join(work, "images"), os.path.join(work, "manifest")
    make_images(root, manifest, args.images, args.size)

    from pipeline.ray_setup import loopback_only

    loopback_only()  # before ray is imported: the local Ray listens on 127.0.0.1 only
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    flags = "".join(f" {a}" for a in sys.argv[1:] if a != "--embed-only")
    run = Run("embed", f"python benchmarks/embed.py --embed-only{flags}", ["ray", "moto"])
    try:
        so = {"endpoint_url": f"http://127.0.0.1:{port}"}
        fs = s3fs.S3FileSystem(client_kwargs=so)
        fs.mkdir("bench")
        for r in range(args.rounds):
            with run.round():
                embed_round(run, args, work, manifest, r, fs, so)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    run.save()


def embed_round(run: Run, args: argparse.Namespace, work: str, manifest: str, r: int, fs, so: dict) -> None:
    """Round ``r`` of 1-4: embed into a fresh cache, the VAE alone, bytes, reads local and from moto."""
    import ray

    from manifests.cache import CacheReader, read_cache_meta, read_index
    from pipeline import EmbedJob, run as run_job

    cache = os.path.join(work, f"cache-{r}")
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    # a unit (one encoder call, one shard) per batch: enough results for a steady-state rate
    result = run_job(EmbedJob(manifest=manifest, out=cache, batch_size=args.batch_size,
                              shard_records=args.batch_size))  # fmt: skip
    ray.shutdown()
    meta = read_cache_meta(cache)
    e2e = result.images_per_second
    enc1 = encoder_only(args.size, args.batch_size, 1, 64)
    enc2 = encoder_only(args.size, args.batch_size, 2, 64)
    print(f"\n## round {r + 1}: images/s at {args.size}x{args.size}, default tiny VAE, CPU ({os.cpu_count()} cores)")
    print(f"end-to-end embed (image phase)      : {e2e:8.1f} img/s")
    print(f"VAE forward only, 1 thread (= actor): {enc1:8.1f} img/s   ratio {e2e / enc1:.2f}")
    print(f"VAE forward only, 2 threads         : {enc2:8.1f} img/s   ratio {e2e / enc2:.2f}")
    run.add("images/s end to end (embed, image phase)", e2e, "img/s")
    run.add("images/s, VAE forward alone, 1 thread (the actor's setting)", enc1, "img/s")
    run.add("end to end / VAE alone, 1 thread", e2e / enc1, "x", ">= 0.9")
    run.add("images/s, VAE forward alone, 2 threads", enc2, "img/s")
    run.add("end to end / VAE alone, 2 threads", e2e / enc2, "x")

    index = read_index(cache)
    samples = index["samples"].to_pylist()
    lat = meta.latent
    raw = lat.channels * (args.size // lat.factor) ** 2 * 2
    ids = [r["sample_id"] for r in samples]
    rng = np.random.default_rng(1)
    pick = [int(i) for i in rng.choice(np.asarray(ids, dtype=np.uint64), size=min(256, len(ids)), replace=False)]
    per_file = os.path.join(work, f"per_file-{r}")
    per_file_records(cache, per_file, ids)
    pf = float(np.mean([os.path.getsize(os.path.join(per_file, f)) for f in os.listdir(per_file)]))
    record = float(np.mean([s["length"] for s in samples]))
    print(f"bytes per sample: cache record {record:.0f}, raw bf16 latent {raw}, gzip'd torch.save fp32 {pf:.0f}")
    run.add("bytes per sample: cache record (gzip safetensors bf16)", record, "B")
    run.add("bytes per sample: raw bf16 latent", raw, "B")
    run.add("bytes per sample: one gzip'd fp32 torch.save file per image", pf, "B")
    run.add("cache record / raw bf16 latent", record / raw, "x")

    texts = CacheReader(cache).read(pick[:64])
    uniq = {t.text.caption_key: t.text for t in texts}
    d = meta.text.encoders[0].hidden_size
    unpadded = float(np.mean([t.tokens[0].shape[0] * d * 2 for t in uniq.values()]))
    print(f"text bytes per caption: unpadded {unpadded:.0f} (mean length {unpadded / d / 2:.1f}), padded to 77 "
          f"{77 * d * 2}; {len(uniq)} captions sampled")  # fmt: skip
    run.add(f"text bytes per caption, unpadded (bf16, D={d})", unpadded, "B")
    run.add("text bytes per caption, padded to 77 tokens", 77 * d * 2, "B")
    run.add("text: padded / unpadded", 77 * d * 2 / unpadded, "x")

    local = time_reads(cache, per_file, pick, None)
    fs.put(cache + "/", f"bench/cache-{r}", recursive=True)
    fs.put(per_file + "/", f"bench/per_file-{r}", recursive=True)
    remote = time_reads(f"s3://bench/cache-{r}", f"s3://bench/per_file-{r}", pick, so)
    print(f"read {len(pick)} random records (s): local shards {local[1]:.3f}, per file {local[2]:.3f}; "
          f"moto S3 shards {remote[1]:.3f}, per object {remote[2]:.3f}", flush=True)  # fmt: skip
    for where, got in (("local folder", local), ("moto S3 (HTTP)", remote)):
        run.add(f"read {len(pick)} random records, {where}: shards (ranged reads)", got[1], "s")
        run.add(f"read {len(pick)} random records, {where}: one file per record", got[2], "s")
        run.add(f"read {len(pick)} random records, {where}: per file / shards", got[2] / got[1], "x")
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(per_file, ignore_errors=True)


if __name__ == "__main__":
    main()
