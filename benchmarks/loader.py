"""The trainer's loader against LitData and Mosaic Streaming: one shuffled epoch of precomputed latents.

    python benchmarks/loader.py                                # smoke: 128 and 384 samples, 1 round (~2 min)
    python benchmarks/loader.py --sizes 512,2048 --rounds 3    # the comparison of issue 24
    python benchmarks/loader.py --stores local --tools ours    # one side only
    python benchmarks/loader.py --decode-scaling 2             # read+decode: threads vs processes

Needs ``pip install -e .[bench]`` (LitData, Mosaic Streaming; benchmark-only, never runtime deps).

The same N SDXL-512 samples (latent 4x64x64 bf16, text 77x2048 bf16 unique per sample, pooled 1280
bf16; sample ``i``'s tensors are a pure function of ``i``) are written by each tool's own writer:

- **ours**: the real cache writer (``CacheWriter``, gzip records, SDXL's text layout: CLIP-L 768 +
  CLIP-G 1280 parts) and a 1-rank plan of batch 16 (``write_plan``), read by ``BatchLoader`` with the
  trainer's defaults (``TrainConfig``: prefetch, read threads, read-ahead budget);
- **LitData**: ``litdata.optimize`` (64 MB chunks, no compression: bf16 mantissas are near random and
  a decompressor only costs CPU) read by ``StreamingDataset(shuffle=True)`` + ``StreamingDataLoader``
  (batch 16, 4 workers);
- **Mosaic**: ``MDSWriter`` (uint16 ndarray columns, no compression, 64 MB shards) read by
  ``StreamingDataset(shuffle=True, batch_size=16)`` + torch ``DataLoader`` (batch 16, 4 workers).

Each run is a fresh process that reads one shuffled epoch and checks its first batch against the
source tensors (bit for bit, after the tool's own decode). Rates are **marginal**: (N2 - N1) /
(t(N2) - t(N1)) with t measured from the dataset's construction to the epoch's end, so start-up,
index loading and worker spawn drop out; the median of ``--rounds`` rounds, the tools interleaved
within a round. CPU-seconds per sample are marginal too: ``resource.getrusage`` of the reading
process, self + children (the peers' DataLoader workers are joined at the epoch's end, so counted).

Stores: ``local`` (a folder on this disk, page cache warm after the write) and ``s3``: a moto S3
server on 127.0.0.1 in its own process (its CPU is not counted), each tool's folder uploaded as
written. moto's server copies the whole object for every GET, ranged or not, which makes a ranged
read of a 64 MB shard cost as much as a full one; the server here runs with a patch
(:func:`_serve_moto`): a GET with a ``Range`` header gets a lazy body whose ``len`` is the object's
size and whose slice reads only that range from moto's buffer, so a ranged GET costs its range, as on
S3. LitData's S3 chunk downloads go through obstore, which refuses ``http://`` endpoints unless
``allow_http`` is set in its client options: the child sets it in LitData's
``_OBSTORE_CLIENT_OPTIONS``. ``import streaming`` imports ``streaming.vision`` and torchvision, whose
only wheel on the registry is a CUDA build that fails to load with CPU torch; the child imports
``streaming.base`` (everything used here) without running ``streaming/__init__.py`` (it registers the
package's path first), so torchvision is neither needed nor imported.

Last lines, one per store: ``loader <store>: ours N/s, litdata N/s (Rx), mosaic N/s (Rx)``, R =
ours / theirs, then CPU-seconds per sample of each.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.results import Run  # noqa: E402

TOOLS = ("ours", "litdata", "mosaic")
BATCH = 16
LATENT, TEXT, POOLED = (4, 64, 64), (77, 2048), (1280,)
BUCKET = "512x512"
BUCKET_NAME = "bench-loader"
SHUFFLE = os.environ.get("BENCH_LOADER_SHUFFLE", "full")  # ours' plan --shuffle (main sets it from --shuffle)


def ours_plan(shuffle: str) -> str:
    """ours' plan folder for a ``--shuffle``: each shuffle its own plan of the one cache."""
    return "plan" if shuffle == "full" else f"plan-{shuffle.replace(':', '-')}"


def plan_ours(root: str, n: int, shuffle: str) -> None:
    """ours' 1-rank plan of batch 16 of the cache at ``root`` (ids 1..n, written in id order)."""
    from manifests.plan import DatasetSamples, write_plan
    from manifests.plan.schedule import PlanConfig

    write_plan(f"{root}/{ours_plan(shuffle)}", [DatasetSamples(np.arange(1, n + 1, dtype=np.uint64), [BUCKET] * n,
                                                               manifest_fingerprint="benchmark")],
               PlanConfig(world_size=1, batch_size=BATCH, epochs=1, seed=1, shuffle=shuffle))  # fmt: skip


def sample_tensors(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample ``i``'s latent (4, 64, 64), text (77, 2048) and pooled (1280,) as bf16 bits (uint16)."""
    rng = np.random.default_rng([7, i])
    bits = (rng.standard_normal(sum(int(np.prod(s)) for s in (LATENT, TEXT, POOLED)), np.float32).view(np.uint32)
            >> 16).astype(np.uint16)  # fmt: skip
    a, b = int(np.prod(LATENT)), int(np.prod(LATENT)) + int(np.prod(TEXT))
    return bits[:a].reshape(LATENT), bits[a:b].reshape(TEXT), bits[b:]


# ---------------------------------------------------------------- writers (each tool's own)


def write_ours(root: str, n: int) -> None:
    from manifests.cache import CacheWriter
    from manifests.cache.records import SampleRecord, TextRecord, encode_sample, encode_text

    layout = {"family": "sdxl", "join": "features", "masked": False, "lengths": [77, 77], "widths": [768, 1280],
              "pooled_dim": 1280, "pooled_source": "clip_g projection"}  # fmt: skip
    info = {"latent": {"channels": 4, "factor": 8, "scaling_factor": 0.13025, "shift_factor": None, "dtype": "BF16"},
            "text": {"dtype": "BF16", "pooled_dim": 1280, "layout": layout,
                     "encoders": [{"id": "clip-l", "hidden_size": 768, "max_length": 77},
                                  {"id": "clip-g", "hidden_size": 1280, "max_length": 77}]}}  # fmt: skip
    writer = CacheWriter(f"{root}/cache", {"synthetic": [n, *LATENT, *TEXT]}, info=info)
    # a caption of one sample goes inside its record where this bucketeer can (one read per sample), as embed does
    inline = "text_inline" in inspect.signature(writer.add_sample).parameters
    for i in range(n):
        latent, text, pooled = sample_tensors(i)
        key = 1_000_000 + i
        caption = TextRecord(key, (text[:, :768].copy(), text[:, 768:].copy()), pooled, "BF16")
        record = SampleRecord(i + 1, BUCKET, latent, "BF16", (512, 512), (512, 512), (0, 0), (512, 512), key)
        if inline:
            writer.add_sample(i + 1, encode_sample(replace(record, text=caption), inline_text=True), key, BUCKET,
                              text_inline=True)  # fmt: skip
        else:
            writer.add_text(key, encode_text(caption))
            writer.add_sample(i + 1, encode_sample(record), key, BUCKET)
    writer.finish()
    plan_ours(root, n, "full")


def _litdata_item(i: int) -> dict:
    latent, text, pooled = sample_tensors(i)  # bf16 bits: LitData's tensor serializer refuses torch.bfloat16
    return {"index": i, "latent": latent, "text": text, "pooled": pooled}


def _as_bf16(sample: dict) -> dict:
    """A peer's decoded sample (uint16 bf16 bits) as torch bf16 tensors (zero-copy views)."""
    import torch

    out = {k: torch.from_numpy(np.ascontiguousarray(sample[k]).view(np.int16)).view(torch.bfloat16)
           for k in ("latent", "text", "pooled")}  # fmt: skip
    return {"index": sample["index"], **out}


def write_litdata(root: str, n: int) -> None:
    from litdata import optimize

    optimize(fn=_litdata_item, inputs=list(range(n)), output_dir=f"{root}/litdata", chunk_bytes="64MB",
             num_workers=1, mode="overwrite")  # fmt: skip


def write_mosaic(root: str, n: int) -> None:
    _import_streaming()
    from streaming.base import MDSWriter

    columns = {"index": "int", "latent": "ndarray:uint16:4,64,64", "text": "ndarray:uint16:77,2048",
               "pooled": "ndarray:uint16:1280"}  # fmt: skip
    with MDSWriter(out=f"{root}/mosaic", columns=columns, size_limit="64mb") as out:
        for i in range(n):
            latent, text, pooled = sample_tensors(i)
            out.write({"index": i, "latent": latent, "text": text, "pooled": pooled})


WRITERS = {"ours": write_ours, "litdata": write_litdata, "mosaic": write_mosaic}


def _import_streaming() -> None:
    """Make ``streaming.base`` importable without ``streaming/__init__.py`` (which imports torchvision)."""
    import importlib.util
    import types

    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg


# ---------------------------------------------------------------- readers (each tool's documented loader)


def _check(index: list[int], latent, text, pooled) -> None:
    """The first batch equals the source tensors, bit for bit (bf16)."""
    import torch

    for row, i in enumerate(index):
        want = sample_tensors(int(i))
        for name, got, ref in (("latent", latent, want[0]), ("text", text, want[1]), ("pooled", pooled, want[2])):
            got = got[row].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            if not np.array_equal(got, ref):
                raise AssertionError(f"sample {i}: {name} differs from the source")


def read_ours(root: str, storage_options: dict | None) -> int:
    from manifests.cache import CacheReader
    from train.config import TrainConfig
    from train.data import BatchLoader, rank_steps

    cfg = TrainConfig()  # the trainer's defaults, passed as train/setup.py passes them
    reader = CacheReader(f"{root}/cache", storage_options)
    steps = rank_steps(f"{root}/{ours_plan(SHUFFLE)}", 0, storage_options)
    loader = BatchLoader(reader, steps, reader.meta.latent, prefetch=cfg.prefetch, read_threads=cfg.read_threads,
                         widen=cfg.loader_float32, read_ahead_mb=cfg.read_ahead_mb)  # fmt: skip
    n = 0
    for batch in loader:
        if n == 0:
            batch = batch.to("cpu")  # what the trainer's device gets: widened, scaled
            latents = batch.latents / reader.meta.latent.scaling_factor  # the stored latent, unscaled
            _check([i - 1 for i in batch.sample_ids], latents, batch.text, batch.pooled)
        n += len(batch.sample_ids)
    return n


def read_litdata(root: str, storage_options: dict | None) -> int:
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.resolver import Dir

    class Latents(StreamingDataset):  # decode a sample: override __getitem__
        def __getitem__(self, i) -> dict:
            return _as_bf16(super().__getitem__(i))

    if storage_options:
        downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
        source = Dir(path=tempfile.mkdtemp(prefix="litdata-cache-"), url=f"s3://{BUCKET_NAME}/{_key(root)}/litdata")
        data = Latents(source, shuffle=True, storage_options=_boto_options(storage_options))
    else:
        data = Latents(f"{root}/litdata", shuffle=True)
    n = 0
    for batch in StreamingDataLoader(data, batch_size=BATCH, num_workers=4):
        if n == 0:
            _check(batch["index"].tolist(), batch["latent"], batch["text"], batch["pooled"])
        n += len(batch["index"])
    return n


def read_mosaic(root: str, storage_options: dict | None) -> int:
    _import_streaming()
    from streaming.base import StreamingDataset
    from torch.utils.data import DataLoader

    class Latents(StreamingDataset):  # the documented way to decode a sample: override __getitem__
        def __getitem__(self, i: int) -> dict:
            return _as_bf16(super().__getitem__(i))

    if storage_options:
        os.environ["S3_ENDPOINT_URL"] = storage_options["endpoint_url"]
        data = Latents(remote=f"s3://{BUCKET_NAME}/{_key(root)}/mosaic", local=tempfile.mkdtemp(prefix="mds-"),
                       shuffle=True, batch_size=BATCH)  # fmt: skip
    else:
        data = Latents(local=f"{root}/mosaic", shuffle=True, batch_size=BATCH)
    n = 0
    for batch in DataLoader(data, batch_size=BATCH, num_workers=4):
        if n == 0:
            _check(batch["index"].tolist(), batch["latent"], batch["text"], batch["pooled"])
        n += len(batch["index"])
    return n


READERS = {"ours": read_ours, "litdata": read_litdata, "mosaic": read_mosaic}


def _key(root: str) -> str:
    return os.path.basename(root.rstrip("/"))


def _boto_options(options: dict) -> dict:
    return {"endpoint_url": options["endpoint_url"], "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"], "region_name": "us-east-1"}  # fmt: skip


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def child(tool: str, root: str, endpoint: str | None) -> None:
    """One epoch of ``tool`` in this fresh process; prints one JSON line."""
    options = {"endpoint_url": endpoint} if endpoint else None
    cpu0, t0 = _cpu(), time.perf_counter()
    n = READERS[tool](root, options)
    seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
    print(json.dumps({"samples": n, "seconds": seconds, "cpu": cpu}))


# ---------------------------------------------------------------- S3: moto with ranged GETs that cost their range


def _serve_moto(port: int) -> None:
    """moto's S3 server, patched so that a ranged GET reads only its range (moto copies the whole object).

    ``S3Response.get_object`` reads ``key.value`` (a full copy of the object's buffer); while a GET
    with a ``Range`` header runs, ``FakeKey.value`` returns a lazy body instead: ``len`` is the
    object's size (moto's range check needs it) and slicing reads that range from the buffer. A
    non-ranged GET, and everything else, is unchanged.
    """
    import threading

    from moto.s3 import models, responses
    from moto.server import main as serve

    ranged = threading.local()
    plain_value = models.FakeKey.value

    class RangedBody:
        def __init__(self, key):
            self.key = key

        def __len__(self) -> int:
            return self.key.size

        def __getitem__(self, part: slice) -> bytes:
            with self.key.lock:
                self.key._value_buffer.seek(part.start)
                return self.key._value_buffer.read(part.stop - part.start)

    def value(self):
        return RangedBody(self) if getattr(ranged, "on", False) else plain_value.fget(self)

    models.FakeKey.value = property(value, plain_value.fset)
    plain_get = responses.S3Response.get_object

    def get_object(self):
        ranged.on = bool(self.headers.get("range", "").startswith("bytes=")) and "," not in self.headers["range"]
        try:
            return plain_get(self)
        finally:
            ranged.on = False

    responses.S3Response.get_object = get_object
    serve(["-H", "127.0.0.1", "-p", str(port)])


def start_s3(log: str | None = None) -> tuple[subprocess.Popen, str]:
    """moto's server on a free port of 127.0.0.1; ``log``: a file its request log (werkzeug's, one line per
    request, on stderr) is appended to, which :func:`count_requests` counts."""
    for k, v in (("AWS_ACCESS_KEY_ID", "benchmark"), ("AWS_SECRET_ACCESS_KEY", "benchmark"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = open(log, "ab") if log else subprocess.DEVNULL
    server = subprocess.Popen([sys.executable, __file__, "--moto-server", str(port)], stdout=subprocess.DEVNULL,
                              stderr=err, start_new_session=True)  # fmt: skip
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.2)


def count_requests(log: str | None) -> tuple[int, int]:
    """``(object GETs, all requests)`` the moto server has logged so far (0, 0 without a log); werkzeug colours
    its lines with ANSI codes, taken out first."""
    import re

    if not log or not os.path.exists(log):
        return 0, 0
    gets = total = 0
    request = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+" \d{3}')
    with open(log, errors="replace") as f:
        for line in f:
            hit = request.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
            if hit:
                total += 1
                gets += hit.group(1) == "GET" and "?" not in hit.group(2)
    return gets, total


# ---------------------------------------------------------------- threads or processes


def _decode_share(root: str, share: list[list[int]]) -> int:
    from manifests.cache import CacheReader
    from train.data import PlanStep, collate

    reader = _READER.get(root) or _READER.setdefault(root, CacheReader(f"{root}/cache"))
    for ids in share:
        collate(reader.read(ids), PlanStep(0, 0, BUCKET, tuple(ids)), layout=reader.meta.text_layout,
                scaling_factor=1.0, shift_factor=0.0, widen=False)  # fmt: skip
    return sum(len(ids) for ids in share)


_READER: dict = {}


def decode_scaling(root: str, workers: int) -> None:
    """The loader's read + decode + collate of every sample of a local cache: one thread, ``workers``
    threads, ``workers`` forked processes (each reads its own share: nothing read is pickled)."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    from manifests.cache import CacheReader

    ids = CacheReader(f"{root}/cache").sample_ids.tolist()
    batches = [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]
    shares = [batches[k::workers] for k in range(workers)]
    _decode_share(root, batches)  # warm: page cache, imports
    for name in ("1 thread", f"{workers} threads", f"{workers} processes"):
        _READER.clear()  # a fresh reader per mode: its text LRU would hold every caption read before
        cpu0, t0 = _cpu(), time.perf_counter()
        if name == "1 thread":
            n = _decode_share(root, batches)
        elif "threads" in name:
            with ThreadPoolExecutor(workers) as pool:
                n = sum(pool.map(_decode_share, [root] * workers, shares))
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                n = sum(pool.starmap(_decode_share, [(root, share) for share in shares]))
        seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
        print(f"decode {name}: {n / seconds:,.0f} samples/s, {cpu / n * 1000:.2f} CPU-ms/sample "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip


# ---------------------------------------------------------------- driver


def _process_cpu(pid: int) -> float:
    """CPU-seconds (user + system) a live process has used, from ``/proc`` (0.0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_child(tool: str, root: str, endpoint: str | None, server: subprocess.Popen | None = None,
              log: str | None = None) -> dict:  # fmt: skip
    """One epoch in a fresh process; ``server_cpu``: what the moto server spent answering it (its own
    process, not counted in ``cpu``: a real S3 endpoint's cost is not the reader's); ``gets``, ``requests``:
    the object GETs and all requests it logged (``log``: its request log)."""
    cmd = [sys.executable, __file__, "--child", tool, "--root", root] + (["--endpoint", endpoint] if endpoint else [])
    before, (gets, requests) = (_process_cpu(server.pid) if server else 0.0), count_requests(log)
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode:
        raise RuntimeError(f"{tool} {root} {endpoint or 'local'} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["server_cpu"] = (_process_cpu(server.pid) - before) if server else 0.0
    time.sleep(0.2)  # the server logs a request after answering it
    got["gets"], got["requests"] = (a - b for a, b in zip(count_requests(log), (gets, requests)))
    return got


def record_round(run, results: dict, r: int, sizes: list[int], tools: list[str], stores: list[str]) -> None:
    """Round ``r``'s marginal figures into ``run`` (:class:`benchmarks.results.Run`): per store, each tool's
    samples/s, ours / each peer, CPU-ms per sample (S3: reader + moto server) and GETs per sample."""
    for store in stores:
        marg = {}
        for tool in tools:
            a, b = results[(tool, store, sizes[0])][r], results[(tool, store, sizes[1])][r]
            n = b["samples"] - a["samples"]
            marg[tool] = (n / (b["seconds"] - a["seconds"]),
                          (b["cpu"] + b["server_cpu"] - a["cpu"] - a["server_cpu"]) / n * 1000,
                          (b["gets"] - a["gets"]) / n)  # fmt: skip
        for tool in tools:
            run.add(f"{store}: {tool} samples/s", marg[tool][0], unit="/s")
        for tool in [t for t in tools if t != "ours" and "ours" in tools]:
            run.add(f"{store}: ours / {tool}, samples/s", marg["ours"][0] / marg[tool][0], unit="x", target=">= 1.2")
        for tool in tools:
            what = "reader + moto server CPU-ms/sample" if store == "s3" else "CPU-ms/sample"
            run.add(f"{store}: {tool} {what}", marg[tool][1], unit="ms")
        if store == "s3":
            for tool in tools:
                run.add(f"s3: {tool} GETs per 1,000 samples", marg[tool][2] * 1000)
            peers = [marg[t][1] for t in tools if t != "ours"]
            if "ours" in tools and peers:
                run.add("s3: ours CPU-ms/sample (reader + server) / the best peer's", marg["ours"][1] / min(peers),
                        unit="x", target="<= 1.0")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="128,384", help="two epoch sizes (samples, multiples of 16)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the median is reported")
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--work", default=None, help="folder for the datasets (default: a temporary one)")
    p.add_argument("--decode-scaling", type=int, metavar="K", default=0,
                   help="only measure ours' read+decode in 1 thread, K threads, K processes (local, --sizes' larger)")
    p.add_argument("--results", metavar="NAME", default=None,
                   help="record every round's figures in benchmarks/results/NAME.json (benchmarks/results.py)")
    p.add_argument("--shuffle", default="full", help="ours' plan: --shuffle full (default) or window[:SIZE]")
    p.add_argument("--child", choices=TOOLS, help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--moto-server", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.moto_server:
        return _serve_moto(args.moto_server)
    if args.child:
        return child(args.child, args.root, args.endpoint)
    os.environ["BENCH_LOADER_SHUFFLE"] = args.shuffle  # the children read ours' plan of this shuffle
    run = Run(args.results, command=" ".join(["python benchmarks/loader.py", *sys.argv[1:]]),
              tools=["litdata", "mosaicml-streaming"]) if args.results else None  # fmt: skip

    sizes = [int(s) for s in args.sizes.split(",")]
    assert len(sizes) == 2 and sizes[0] < sizes[1] and all(s % BATCH == 0 for s in sizes), "two sizes, x16"
    tools, stores = args.tools.split(","), args.stores.split(",")
    work = args.work or tempfile.mkdtemp(prefix="bench-loader-")
    server = None
    if args.decode_scaling:
        tools, stores, sizes = ["ours"], [], sizes[1:]
    try:
        t = time.perf_counter()
        for n in sizes:
            for tool in tools:
                if not os.path.exists(f"{work}/n{n}/.{tool}-done"):
                    os.makedirs(f"{work}/n{n}", exist_ok=True)
                    WRITERS[tool](f"{work}/n{n}", n)
                    open(f"{work}/n{n}/.{tool}-done", "w").close()
                if tool == "ours" and not os.path.exists(f"{work}/n{n}/{ours_plan(args.shuffle)}"):
                    plan_ours(f"{work}/n{n}", n, args.shuffle)
        print(f"wrote {sizes} samples with {tools} in {time.perf_counter() - t:.0f} s under {work}", flush=True)
        if args.decode_scaling:
            return decode_scaling(f"{work}/n{sizes[0]}", args.decode_scaling)
        endpoint = None
        if "s3" in stores:
            server, endpoint = start_s3(f"{work}/moto-requests.log")
            import s3fs

            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
            fs.mkdir(BUCKET_NAME)
            for n in sizes:
                for tool in tools:
                    for name in {"ours": ("cache", ours_plan(args.shuffle))}.get(tool, (tool,)):
                        fs.put(f"{work}/n{n}/{name}", f"{BUCKET_NAME}/n{n}/", recursive=True)
        results: dict[tuple[str, str, int], list[dict]] = {}
        for r in range(args.rounds):
            with run.round() if run else contextlib.nullcontext():
                for store in stores:
                    for n in sizes:
                        for tool in tools:
                            root = f"s3://{BUCKET_NAME}/n{n}" if store == "s3" else f"{work}/n{n}"
                            if store == "s3" and tool != "ours":
                                root = f"{work}/n{n}"  # the peers take the bucket path apart from their cache dir
                            got = run_child(tool, root, *((endpoint, server, f"{work}/moto-requests.log")
                                                          if store == "s3" else (None, None, None)))
                            assert got["samples"] >= n - BATCH, (tool, store, n, got)
                            results.setdefault((tool, store, n), []).append(got)
                            print(f"round {r + 1} {store} {tool} n={n}: {got['samples']} samples "
                                  f"{got['seconds']:.2f} s cpu {got['cpu']:.2f} s server {got['server_cpu']:.2f} s, "
                                  f"{got['gets']} GETs "
                                  f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
                if run:
                    record_round(run, results, r, sizes, tools, stores)
        summary = {}
        for store in stores:
            rates, cpus, servers, gets = {}, {}, {}, {}
            for tool in tools:
                pairs = zip(results[(tool, store, sizes[0])], results[(tool, store, sizes[1])])
                marg = [((b["samples"] - a["samples"]) / (b["seconds"] - a["seconds"]),
                         (b["cpu"] - a["cpu"]) / (b["samples"] - a["samples"]),
                         (b["server_cpu"] - a["server_cpu"]) / (b["samples"] - a["samples"]),
                         (b["gets"] - a["gets"]) / (b["samples"] - a["samples"]))
                        for a, b in pairs]  # fmt: skip
                rates[tool] = float(np.median([m[0] for m in marg]))
                cpus[tool] = float(np.median([m[1] for m in marg]))
                servers[tool] = float(np.median([m[2] for m in marg]))
                gets[tool] = float(np.median([m[3] for m in marg]))
            summary[store] = {"samples_per_s": rates, "cpu_s_per_sample": cpus, "server_cpu_s_per_sample": servers,
                              "gets_per_sample": gets}  # fmt: skip
        print(json.dumps(summary))
        for store in stores:
            rates, cpus = summary[store]["samples_per_s"], summary[store]["cpu_s_per_sample"]
            ours = rates.get("ours")
            parts = [f"{tool} {rates[tool]:,.0f}/s" + (f" ({ours / rates[tool]:.2f}x)" if ours and tool != "ours"
                                                       else "") for tool in tools]  # fmt: skip
            print(f"loader {store}: " + ", ".join(parts))
            print(f"loader {store} cpu-s/sample: " + ", ".join(f"{t} {cpus[t] * 1000:.2f} ms" for t in tools))
            if store == "s3":  # the moto server's CPU per sample: a real endpoint's, not the reader's, but here
                servers = summary[store]["server_cpu_s_per_sample"]  # it shares the 2 cores with the reader
                print("loader s3 moto-server cpu-s/sample: "
                      + ", ".join(f"{t} {servers[t] * 1000:.2f} ms" for t in tools))
                print("loader s3 reader + server cpu-s/sample: "
                      + ", ".join(f"{t} {(cpus[t] + servers[t]) * 1000:.2f} ms" for t in tools))
                gets = summary[store]["gets_per_sample"]  # S3 GET: $0.0004 per 1,000 requests
                print("loader s3 GETs/sample (marginal): " + ", ".join(
                    f"{t} {gets[t]:.4f} (${gets[t] * 0.4:.3f} per 1M samples)" for t in tools))
        if run:
            run.save()
    finally:
        if server is not None:
            server.kill()
            server.wait()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
