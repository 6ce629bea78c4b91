"""The trainer's data path: records/s the loader sustains, and data-wait with the default model.

    python benchmarks/train.py                        # 1024 records of 512px SD-style latents, local + S3
    python benchmarks/train.py --records 4096 --skip-s3

Builds a synthetic cache with the real writer (``CacheWriter``; 4x64x64 bf16 latents, one unique
caption of 20x768 bf16 tokens per sample, so no text record is shared) and a 1-rank plan, then:

1. **loader**: ``train.data.BatchLoader`` (the trainer's loader: ranged reads through ``CacheReader``,
   decode, collate, read ahead in a thread) over every step, no model: records/s and MB/s, from a
   local folder and from a moto S3 server on 127.0.0.1 (real HTTP; per-request latency is
   loopback, far below a real object store's).
2. **data-wait**: ``python -m train`` with the default tiny config on a cache shaped like the
   default encoders' output (4x8x8 latents, 77x32 text), from the local folder and from S3;
   the fraction of step time blocked on data, from ``metrics.jsonl``, first window excluded.

No GPU on this machine: the model step is a CPU step, so data-wait here is measured against a
tiny model on 2 shared cores, not against an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from manifests.cache import CacheWriter  # noqa: E402
from manifests.cache_format import SampleRecord, TextRecord, encode_sample, encode_text  # noqa: E402
from manifests.plan import write_plan  # noqa: E402
from manifests.plan_schedule import PlanConfig  # noqa: E402


def bf16_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal(0, 1) values as bf16 bits (uint16), as the cache stores them."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def make_cache(url: str, n: int, side: int, text_len: int, text_dim: int, storage_options=None) -> np.ndarray:
    """``n`` samples in one bucket (``side*8`` square), each with its own caption; returns the ids."""
    rng = np.random.default_rng(0)
    bucket = f"{side * 8}x{side * 8}"
    info = {
        "latent": {"channels": 4, "factor": 8, "scaling_factor": 0.18215, "shift_factor": None, "dtype": "BF16"},
        "text": {"dtype": "BF16", "pooled_dim": text_dim, "encoders": [{"id": "synthetic", "hidden_size": text_dim,
                                                                         "max_length": 77}]},
    }  # fmt: skip
    writer = CacheWriter(url, {"synthetic": [n, side, text_len, text_dim]}, info=info, storage_options=storage_options)
    ids = rng.integers(1, 2**63, n, dtype=np.uint64)
    for i, sid in enumerate(ids.tolist()):
        key = 1_000_000 + i
        writer.add_text(key, encode_text(TextRecord(key, (bf16_bits(rng, (text_len, text_dim)),),
                                                    bf16_bits(rng, (text_dim,)), "BF16")))  # fmt: skip
        record = SampleRecord(sid, bucket, bf16_bits(rng, (4, side, side)), "BF16", (side * 8, side * 8),
                              (side * 8, side * 8), (0, 0), (side * 8, side * 8), key)  # fmt: skip
        writer.add_sample(sid, encode_sample(record), key, bucket)
    writer.finish()
    return ids


def make_plan(url: str, ids: np.ndarray, bucket: str, batch: int, epochs: int = 1, storage_options=None) -> None:
    write_plan(url, ids, [bucket] * len(ids), PlanConfig(world_size=1, batch_size=batch, epochs=epochs),
               manifest_fingerprint="benchmark", storage_options=storage_options)  # fmt: skip


def loader_rate(cache: str, plan: str, storage_options=None, prefetch: int = 4) -> dict:
    from manifests.cache import CacheReader
    from train.data import BatchLoader, rank_steps

    reader = CacheReader(cache, storage_options)
    steps = rank_steps(plan, 0, storage_options)
    loader = BatchLoader(reader, steps, reader.meta["latent"], prefetch=prefetch)
    it = iter(loader)
    first = next(it)  # the reading thread's start-up is not the steady state
    t0 = time.perf_counter()
    records = nbytes = 0
    for batch in it:
        records += len(batch.sample_ids)
        nbytes += batch.latents.numel() * 2 + int(batch.text_mask.sum()) * batch.text.shape[2] * 2  # stored bf16
    seconds = time.perf_counter() - t0
    del first
    return {"records": records, "seconds": round(seconds, 3), "records_per_s": round(records / seconds, 1),
            "MB_per_s_decoded": round(nbytes / seconds / 1e6, 1)}  # fmt: skip


def data_wait(cache: str, plan: str, out: str, steps: int, storage_options=None) -> dict:
    cmd = [sys.executable, "-m", "train", "--plan", plan, "--cache", cache, "--output-dir", out,
           "--max-steps", str(steps)]  # fmt: skip
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=os.path.dirname(HERE))  # fmt: skip
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]  # first window: warm-up
    return {
        "steps_measured": 10 * len(rows),
        "data_wait": round(float(np.mean([r["data_wait"] for r in rows])), 4),
        "data_wait_max_window": round(max(r["data_wait"] for r in rows), 4),
        "samples_per_s": round(float(np.mean([r["samples_per_s"] for r in rows])), 1),
        "step_time_ms": round(1000 * float(np.mean([r["step_time_s"] for r in rows])), 1),
    }


def start_s3():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "benchmark")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "benchmark")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}"}
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": options["endpoint_url"]}).mkdir("bench-train")
    return server, options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="records per step in the loader benchmark")
    p.add_argument("--latent", type=int, default=64, help="latent side (64 = 512px SD-style)")
    p.add_argument("--text-len", type=int, default=20)
    p.add_argument("--text-dim", type=int, default=768)
    p.add_argument("--train-steps", type=int, default=160)
    p.add_argument("--skip-s3", action="store_true")
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench-train-")
    results: dict = {"config": vars(args)}
    server = None
    try:
        big, small = os.path.join(tmp, "cache-big"), os.path.join(tmp, "cache-small")
        t0 = time.perf_counter()
        ids = make_cache(big, args.records, args.latent, args.text_len, args.text_dim)
        make_plan(os.path.join(tmp, "plan-big"), ids, f"{args.latent * 8}x{args.latent * 8}", args.batch)
        small_ids = make_cache(small, 256, 8, 12, 32)  # what the default encoders + default model see
        make_plan(os.path.join(tmp, "plan-small"), small_ids, "64x64", 4, epochs=args.train_steps // 64 + 1)
        results["build_s"] = round(time.perf_counter() - t0, 1)
        results["record_kB_compressed"] = round(
            sum(os.path.getsize(os.path.join(big, "shards", f)) for f in os.listdir(os.path.join(big, "shards"))
                if f.startswith("samples")) / args.records / 1e3, 1)  # fmt: skip

        results["loader_local"] = loader_rate(big, os.path.join(tmp, "plan-big"))
        results["train_local"] = data_wait(small, os.path.join(tmp, "plan-small"), os.path.join(tmp, "out-local"),
                                           args.train_steps)  # fmt: skip
        if not args.skip_s3:
            import s3fs

            server, so = start_s3()
            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": so["endpoint_url"]})
            for name in ("cache-big", "plan-big", "cache-small", "plan-small"):
                fs.put(os.path.join(tmp, name) + "/", f"bench-train/{name}/", recursive=True)
            results["loader_s3"] = loader_rate("s3://bench-train/cache-big", "s3://bench-train/plan-big", so)
            results["train_s3"] = data_wait("s3://bench-train/cache-small", "s3://bench-train/plan-small",
                                            os.path.join(tmp, "out-s3"), args.train_steps, so)  # fmt: skip
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
