"""The trainer's data path: records/s the loader sustains, and data-wait with the default model.

    python benchmarks/train.py                        # 1024 records of 512px SD-style latents, local + S3
    python benchmarks/train.py --records 4096 --skip-s3
    python benchmarks/train.py --read-threads 1,2,4 --rounds 3   # loader variants, interleaved

Builds a synthetic cache with the real writer (``CacheWriter``; 4x64x64 bf16 latents, one unique
caption of 20x768 bf16 tokens per sample, so no text record is shared) and a 1-rank plan, then:

1. **loader**: ``train.data.BatchLoader`` (the trainer's loader: ranged reads through ``CacheReader``,
   decode, collate, ``--read-threads`` batches read at once) over every step, no model: records/s
   and MB/s, from a local folder, from the local folder with ``--latency-ms`` added to every
   batched read (what concurrent reads are for: an object store's latency), and from a
   moto S3 server on 127.0.0.1 in its own process (real HTTP; per-request
   latency is loopback, far below a real object store's; moto reads the whole object for every
   ranged GET, so big shards cost it more than they would cost S3: see ``--shard-records``).
2. **data-wait**: ``python -m train`` with the default tiny config on a cache shaped like the
   default encoders' output (4x8x8 latents, 77x32 text), from the local folder and from S3;
   the fraction of step time blocked on data, from ``metrics.jsonl``, first window excluded.

Each of ``--rounds`` rounds runs every measure once per ``--read-threads`` variant (variants interleaved) and
writes its figures to ``benchmarks/results/train.json`` (``benchmarks/results.py``); the caches and the moto
server are made once.

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

from benchmarks.results import Run  # noqa: E402

from manifests.cache import CacheWriter  # noqa: E402
from manifests.cache.records import SampleRecord, TextRecord, encode_sample, encode_text  # noqa: E402
from manifests.plan import DatasetSamples, write_plan  # noqa: E402
from manifests.plan.schedule import PlanConfig  # noqa: E402


def bf16_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal(0, 1) values as bf16 bits (uint16), as the cache stores them."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def make_cache(
    url: str, n: int, side: int, text_len: int, text_dim: int, storage_options=None, shard_records: int = 1024
) -> np.ndarray:
    """``n`` samples in one bucket (``side*8`` square), each with its own caption; returns the ids."""
    rng = np.random.default_rng(0)
    bucket = f"{side * 8}x{side * 8}"
    info = {
        "latent": {"channels": 4, "factor": 8, "scaling_factor": 0.18215, "shift_factor": None, "dtype": "BF16"},
        "text": {"dtype": "BF16", "pooled_dim": text_dim, "encoders": [{"id": "synthetic", "hidden_size": text_dim,
                                                                         "max_length": 77}]},
    }  # fmt: skip
    writer = CacheWriter(url, {"synthetic": [n, side, text_len, text_dim]}, info=info, storage_options=storage_options,
                         shard_records=shard_records)  # fmt: skip
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
    write_plan(url, [DatasetSamples(ids, [bucket] * len(ids), manifest_fingerprint="benchmark")],
               PlanConfig(world_size=1, batch_size=batch, epochs=epochs), storage_options=storage_options)


class SlowStorage:
    """The reader's filesystem with ``latency_s`` added to every batched ranged read (``cat_ranges``), as an
    object store far from the trainer adds it: a sleep, which releases the GIL as waiting on a socket does."""

    def __init__(self, fs, latency_s: float):
        self.fs, self.latency_s = fs, latency_s

    def cat_ranges(self, *args, **kwargs):
        time.sleep(self.latency_s)
        return self.fs.cat_ranges(*args, **kwargs)


def loader_rate(
    cache: str, plan: str, storage_options=None, prefetch: int = 4, read_threads: int = 1, latency_s: float = 0.0
) -> dict:
    from manifests.cache import CacheReader
    from train.data import BatchLoader, rank_steps

    reader = CacheReader(cache, storage_options)
    if latency_s:
        reader.fs = SlowStorage(reader.fs, latency_s)
    steps = rank_steps(plan, 0, storage_options)
    loader = BatchLoader(reader, steps, reader.meta.latent, prefetch=prefetch, read_threads=read_threads)
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


def data_wait(cache: str, plan: str, out: str, steps: int, storage_options=None, read_threads: int = 1) -> dict:
    import yaml

    from train.config import DEFAULT_CONFIG

    os.makedirs(out)
    config = os.path.join(out, "config.yaml")  # the default config, with this run's read_threads
    with open(config, "w") as f:
        yaml.safe_dump(yaml.safe_load(DEFAULT_CONFIG.read_text()) | {"read_threads": read_threads}, f)
    cmd = [sys.executable, "-m", "train", "--plan", plan, "--cache", cache, "--output-dir", out,
           "--config", config, "--max-steps", str(steps)]  # fmt: skip
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


def start_s3() -> tuple[subprocess.Popen, dict]:
    """A moto S3 server in its own process on 127.0.0.1 (in this process it would share the loader's GIL)."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "benchmark")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "benchmark")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)  # fmt: skip
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.1)
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
    p.add_argument("--shard-records", type=int, default=1024, help="records per shard of the big cache")
    p.add_argument("--train-steps", type=int, default=160)
    p.add_argument("--read-threads", default="1,2", help="loader variants to compare: batches read at once")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the variants interleaved in each")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added per batched read in the latency variant")
    p.add_argument("--skip-s3", action="store_true")
    args = p.parse_args()
    variants = [int(t) for t in args.read_threads.split(",")]

    tmp = tempfile.mkdtemp(prefix="bench-train-")
    results: dict = {"config": vars(args)}
    server = None
    bench = Run("train", "python benchmarks/train.py" + "".join(f" {a}" for a in sys.argv[1:]), ["moto"])
    try:
        big, small = os.path.join(tmp, "cache-big"), os.path.join(tmp, "cache-small")
        t0 = time.perf_counter()
        ids = make_cache(big, args.records, args.latent, args.text_len, args.text_dim, shard_records=args.shard_records)
        make_plan(os.path.join(tmp, "plan-big"), ids, f"{args.latent * 8}x{args.latent * 8}", args.batch)
        small_ids = make_cache(small, 256, 8, 12, 32)  # what the default encoders + default model see
        make_plan(os.path.join(tmp, "plan-small"), small_ids, "64x64", 4, epochs=args.train_steps // 64 + 1)
        results["build_s"] = round(time.perf_counter() - t0, 1)
        results["record_kB_compressed"] = round(
            sum(os.path.getsize(os.path.join(big, "shards", f)) for f in os.listdir(os.path.join(big, "shards"))
                if f.startswith("samples")) / args.records / 1e3, 1)  # fmt: skip
        plan_big, plan_small = os.path.join(tmp, "plan-big"), os.path.join(tmp, "plan-small")
        latency = f"{args.latency_ms:g} ms added per batch read"
        loaders = {"local cache": lambda t, _: loader_rate(big, plan_big, read_threads=t),
                   latency: lambda t, _: loader_rate(big, plan_big, read_threads=t, latency_s=args.latency_ms / 1000)}
        trains = {"local cache": lambda t, label: data_wait(small, plan_small, os.path.join(tmp, label),
                                                            args.train_steps, read_threads=t)}  # fmt: skip
        if not args.skip_s3:
            import s3fs

            server, so = start_s3()
            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": so["endpoint_url"]})
            for name in ("cache-big", "plan-big", "cache-small", "plan-small"):
                fs.put(os.path.join(tmp, name) + "/", f"bench-train/{name}/", recursive=True)
            loaders["moto S3"] = lambda t, _: loader_rate("s3://bench-train/cache-big", "s3://bench-train/plan-big",
                                                          so, read_threads=t)  # fmt: skip
            cache_s3, plan_s3 = "s3://bench-train/cache-small", "s3://bench-train/plan-small"
            trains["moto S3"] = lambda t, label: data_wait(cache_s3, plan_s3, os.path.join(tmp, label),
                                                           args.train_steps, so, read_threads=t)  # fmt: skip
        for r in range(args.rounds):
            with bench.round():
                for where, measure in loaders.items():
                    for threads in variants:
                        got = measure(threads, "")
                        results.setdefault(f"loader {where}", {}).setdefault(threads, []).append(got)
                        bench.add(f"loader records/s, {where}, {threads} read thread(s)", got["records_per_s"],
                                  "records/s")  # fmt: skip
                for where, measure in trains.items():
                    for threads in variants:
                        got = measure(threads, f"train-{where.replace(' ', '-')}-{threads}-{r}")
                        results.setdefault(f"train {where}", {}).setdefault(threads, []).append(got)
                        bench.add(f"data-wait, {where}, {threads} read thread(s)", 100 * got["data_wait"], "%",
                                  "<= 5")  # fmt: skip
                        bench.add(f"step time, {where}, {threads} read thread(s)", got["step_time_ms"], "ms")
                print(f"round {r + 1} done (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        if server is not None:
            server.terminate()  # our own child, by its handle
            server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=2))
    bench.save()


if __name__ == "__main__":
    main()
