"""The trainer's loader against LitData and Mosaic Streaming: one shuffled epoch of precomputed latents.

    python benchmarks/loader.py                                # smoke: 128 and 384 samples, 1 round
    python benchmarks/loader.py --sizes 512,2048 --rounds 3 --save   # the comparison (results/loader.json)
    python benchmarks/loader.py --stores local --tools ours    # one side only
    python benchmarks/loader.py --stores s3 --shuffle window --save loader-window  # ours' windowed plan
    python benchmarks/loader.py --litdata-decodes              # why LitData's numpy encoding is slow
    python benchmarks/loader.py --decode-scaling 2             # read+decode: threads vs processes
    python benchmarks/loader.py --local-reads 6 --sizes 1024,4096   # local shards: fsspec vs pread, alternated
    python benchmarks/loader.py --stores local --ours-processes 2   # ours' read processes too (read_processes)

Needs ``pip install -e .[bench]`` (LitData, Mosaic Streaming; benchmark-only, never runtime deps).

The same N SDXL-512 samples (latent 4x64x64 bf16, text 77x2048 bf16 unique per sample, pooled 1280
bf16; sample ``i``'s tensors are a pure function of ``i``) are written by each tool's own writer,
and each tool is compared **at its best**: a sweep of its knobs, the setting with the best median
marginal rate over the rounds is the one compared (:func:`sweep`, :func:`best`; the whole sweep is
printed and recorded):

- **ours**: the real cache writer (``CacheWriter``, gzip records, SDXL's text layout: CLIP-L 768 +
  CLIP-G 1280 parts) and a 1-rank plan of batch 16 (``write_plan``), read by ``BatchLoader`` with the
  trainer's defaults (``TrainConfig``) but ``read_threads`` swept (``--read-threads``); with
  ``--ours-processes K``, also with the trainer's ``read_processes: K`` (K read processes forked from a fork
  server instead of threads, batches handed over through shared memory: :mod:`train.data.processes`);
- **LitData**: ``litdata.optimize`` (64 MB chunks) of torch int16 tensors holding the bf16 bits (its
  tensor serializers; ``numpy()`` has no bfloat16), read by ``StreamingDataset(shuffle=True)`` +
  ``StreamingDataLoader`` (batch 16); swept: workers (``--workers``), then ``compression="zstd"`` and
  the numpy encoding (uint16 arrays) at the most workers;
- **Mosaic**: ``MDSWriter`` (``ndarray:uint16:<shape>`` columns, 64 MB shards) read by
  ``StreamingDataset(shuffle=True, batch_size=16)`` (its default ``py1e`` shuffle) + torch
  ``DataLoader`` (batch 16); swept: workers, then ``compression="zstd"`` and ``bytes`` columns.

bf16 mantissas are near random, so zstd saves little and costs a decompression: it is swept, not assumed.

Each run is a fresh process that reads one shuffled epoch and checks its first batch against the
source tensors (bit for bit, after the tool's own decode). After every batch the loop runs the same
**training step's Python** for every tool (:class:`Consumer`: :data:`STEP_ITERATIONS` iterations of a
pure-Python loop, ~3 ms on this machine quiet), holding the GIL as a step does: ours' reader threads
compete with it, its read processes and the peers' worker processes do not. Rates are **marginal**: (N2 - N1) /
(t(N2) - t(N1)) with t measured from the dataset's construction to the epoch's end, so start-up,
index loading and worker spawn drop out (the tool's modules are imported before the clock starts:
:data:`IMPORTS`; locally its files are read once before the pass, :func:`warm`); the median of
``--rounds`` rounds, the tools interleaved within a round. With ``--repeats R`` each pass runs R times back
to back and the fastest counts (:func:`fastest`, timeit's rule, for every tool alike): this 2-core VM's
CPU speed itself swings by a third over seconds (a fixed Python loop took 0.75-1.35 s in 8 runs, CPU time
equal to wall), and one pass landing in a slow spell otherwise decides a round's ratio. CPU-seconds per
sample are marginal too: ``resource.getrusage`` of the reading process, self + children (the peers'
DataLoader workers are joined at the epoch's end, so counted), plus multiprocessing's fork server and the
children it reaped (ours' read processes are forked from it), less the consumer's steps (their thread time).

Stores: ``local`` (a folder on this disk, its page cache warmed before each pass: :func:`warm`) and ``s3``: a moto S3
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

Last lines: the sweep per store (every round's marginal rate, the median reader CPU-ms per sample,
the best marked), then one line per store: ``loader <store>: ours N/s [setting], litdata N/s
[setting] (Rx), mosaic N/s [setting] (Rx)``, R = ours / theirs; on S3 also each tool's reader + moto
server CPU-ms per sample and its object GETs per sample (counted in moto's request log,
:func:`count_requests`) with their price at S3's $0.40 per 1M GETs. ``--shuffle full|window[:SIZE]``
picks ours' plan (one plan folder per shuffle of the one cache, :func:`ours_plan`). ``--save [NAME]``
writes ``benchmarks/results/NAME.json`` (default ``loader``; ``benchmarks/results.py``) after every round.
"""

from __future__ import annotations

import argparse
import importlib
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

TOOLS = ("ours", "litdata", "mosaic")
BATCH = 16
LATENT, TEXT, POOLED = (4, 64, 64), (77, 2048), (1280,)
BUCKET = "512x512"
BUCKET_NAME = "bench-loader"
#: per batch, the consumer's pure-Python loop: ~3 ms on this machine quiet, about the Python of a training step
STEP_ITERATIONS = 75_000
SHUFFLE = os.environ.get("BENCH_LOADER_SHUFFLE", "full")  # ours' plan --shuffle (main sets it from --shuffle)
GET_DOLLARS_PER_M = 0.40  # S3 standard: $0.40 per 1M GET requests


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


def _litdata_item(i: int, encoding: str) -> dict:
    """Sample ``i`` as LitData gets it: numpy uint16 arrays, or torch int16 tensors (``encoding="tensor"``).

    Both hold the bf16 bits: LitData's serializers go through ``numpy()``, which has no bfloat16.
    """
    import torch

    arrays = dict(zip(("latent", "text", "pooled"), sample_tensors(i)))
    if encoding == "tensor":
        arrays = {k: torch.from_numpy(v.view(np.int16)) for k, v in arrays.items()}
    return {"index": i, **arrays}


def _as_bf16(sample: dict) -> dict:
    """A peer's decoded sample (bf16 bits: numpy uint16, torch int16 or raw bytes) as torch bf16 (zero-copy views)."""
    import torch

    def bf16(value, shape):
        if isinstance(value, torch.Tensor):
            return value.view(torch.bfloat16)
        bits = np.frombuffer(value, np.uint16) if isinstance(value, bytes) else np.ascontiguousarray(value)
        return torch.from_numpy(bits.view(np.int16).reshape(shape)).view(torch.bfloat16)

    return {"index": sample["index"], **{k: bf16(sample[k], s) for k, s in zip(("latent", "text", "pooled"),
                                                                              (LATENT, TEXT, POOLED))}}


def write_litdata(folder: str, n: int, encoding: str, compression: str) -> None:
    from functools import partial

    from litdata import optimize

    optimize(fn=partial(_litdata_item, encoding=encoding), inputs=list(range(n)), output_dir=folder,
             chunk_bytes="64MB", num_workers=1, mode="overwrite",
             compression=None if compression == "none" else compression)  # fmt: skip


def write_mosaic(folder: str, n: int, encoding: str, compression: str) -> None:
    _import_streaming()
    from streaming.base import MDSWriter

    shapes = {"latent": LATENT, "text": TEXT, "pooled": POOLED}
    columns = {"index": "int", **{k: "bytes" if encoding == "bytes" else f"ndarray:uint16:{','.join(map(str, s))}"
                                  for k, s in shapes.items()}}  # fmt: skip
    with MDSWriter(out=folder, columns=columns, size_limit="64mb",
                   compression=None if compression == "none" else compression) as out:  # fmt: skip
        for i in range(n):
            arrays = dict(zip(shapes, sample_tensors(i)))
            out.write({"index": i, **{k: v.tobytes() if encoding == "bytes" else v for k, v in arrays.items()}})


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


class Consumer:
    """The training step's Python, the same for every tool: :data:`STEP_ITERATIONS` iterations of a
    pure-Python loop per batch, in the loop's thread, holding the GIL as a step's Python does (so
    ours' reader threads compete for it; the peers' worker processes have their own)."""

    def __init__(self) -> None:
        self.cpu = 0.0  # CPU-seconds the steps took (thread time), taken out of the reader's CPU

    def step(self) -> None:
        t = time.thread_time()
        x = 0
        for i in range(STEP_ITERATIONS):
            x += i & 7
        self.cpu += time.thread_time() - t


def _ours_loader(root: str, setting: dict, storage_options: dict | None):
    """``(reader, BatchLoader)`` of ours' plan with the trainer's defaults (``{"defaults": True}``: its
    ``read_processes: auto`` resolved as the trainer resolves it for one rank on this machine) or with ``setting``'s
    read threads or read processes."""
    from manifests.cache import CacheReader
    from manifests.storage import is_local
    from train.config import TrainConfig
    from train.data import BatchLoader, rank_steps
    from train.data.processes import choose_readers, usable_cores

    knobs = ("read_threads", "prefetch", "read_processes")
    cfg = replace(TrainConfig(), **{"read_processes": 0, **{k: v for k, v in setting.items() if k in knobs}})
    if setting.get("defaults"):
        cfg = TrainConfig()
    reader = CacheReader(f"{root}/cache", storage_options)
    processes, why = choose_readers(cfg.read_processes, local=is_local(reader.fs), cores=usable_cores(),
                                    ranks=1)  # fmt: skip
    if setting.get("defaults"):
        print(f"ours with the trainer's defaults: {why}", file=sys.stderr, flush=True)
    steps = rank_steps(f"{root}/{ours_plan(SHUFFLE)}", 0, storage_options)
    return reader, BatchLoader(reader, steps, reader.meta.latent, prefetch=cfg.prefetch, read_threads=cfg.read_threads,
                               widen=cfg.loader_float32, read_ahead_mb=cfg.read_ahead_mb,
                               read_processes=processes)  # fmt: skip


def read_ours(root: str, setting: dict, storage_options: dict | None, step: Consumer) -> int:
    reader, loader = _ours_loader(root, setting, storage_options)
    n = 0
    for batch in loader:
        if n == 0:
            batch = batch.to("cpu")  # what the trainer's device gets: widened, scaled
            latents = batch.latents / reader.meta.latent.scaling_factor  # the stored latent, unscaled
            _check([i - 1 for i in batch.sample_ids], latents, batch.text, batch.pooled)
        n += len(batch.sample_ids)
        step.step()
    return n


def read_litdata(folder: str, setting: dict, storage_options: dict | None, step: Consumer) -> int:
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.resolver import Dir

    class Latents(StreamingDataset):  # decode a sample: override __getitem__
        def __getitem__(self, i) -> dict:
            return _as_bf16(super().__getitem__(i))

    if storage_options:
        downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
        source = Dir(path=tempfile.mkdtemp(prefix="litdata-cache-"), url=_bucket_url(folder))
        data = Latents(source, shuffle=True, storage_options=_boto_options(storage_options))
    else:
        data = Latents(folder, shuffle=True)
    n = 0
    for batch in StreamingDataLoader(data, batch_size=BATCH, num_workers=setting["workers"]):
        if n == 0:
            _check(batch["index"].tolist(), batch["latent"], batch["text"], batch["pooled"])
        n += len(batch["index"])
        step.step()
    return n


def read_mosaic(folder: str, setting: dict, storage_options: dict | None, step: Consumer) -> int:
    _import_streaming()
    from streaming.base import StreamingDataset
    from torch.utils.data import DataLoader

    class Latents(StreamingDataset):  # the documented way to decode a sample: override __getitem__
        def __getitem__(self, i: int) -> dict:
            return _as_bf16(super().__getitem__(i))

    if storage_options:
        os.environ["S3_ENDPOINT_URL"] = storage_options["endpoint_url"]
        data = Latents(remote=_bucket_url(folder), local=tempfile.mkdtemp(prefix="mds-"), shuffle=True,
                       batch_size=BATCH)  # fmt: skip
    else:
        data = Latents(local=folder, shuffle=True, batch_size=BATCH)
    n = 0
    for batch in DataLoader(data, batch_size=BATCH, num_workers=setting["workers"]):
        if n == 0:
            _check(batch["index"].tolist(), batch["latent"], batch["text"], batch["pooled"])
        n += len(batch["index"])
        step.step()
    return n


READERS = {"ours": read_ours, "litdata": read_litdata, "mosaic": read_mosaic}


def _bucket_url(folder: str) -> str:
    """The bucket path of a peer's local dataset folder ``<work>/n<N>/<name>``: ``s3://bucket/n<N>/<name>``."""
    parts = folder.rstrip("/").split("/")
    return f"s3://{BUCKET_NAME}/{parts[-2]}/{parts[-1]}"


def _boto_options(options: dict) -> dict:
    return {"endpoint_url": options["endpoint_url"], "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"], "region_name": "us-east-1"}  # fmt: skip


def _cpu() -> float:
    """CPU-seconds of this process and its children, and of multiprocessing's fork server with the children it
    forked (ours' read processes: their parent is the fork server, not this process; reaped when they end)."""
    from multiprocessing import forkserver

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + (_process_cpu(server, True) if server else 0)


#: the modules each tool's reader imports, imported before a pass's clock starts (:func:`child`): 0.4-1.2 s
#: each here, that time swings with the page cache by more than the reading between the two sizes takes
IMPORTS = {"ours": ("manifests.cache", "manifests.plan", "train.config", "train.data"),
           "litdata": ("litdata", "litdata.streaming.downloader", "litdata.streaming.resolver"),
           "mosaic": ("streaming.base",)}  # fmt: skip


def child(tool: str, root: str, setting: dict, endpoint: str | None) -> None:
    """One epoch of ``tool`` with ``setting`` in this fresh process; prints one JSON line (``cpu``: the
    reading's CPU-seconds, the consumer's steps taken out; ``step_cpu``: theirs)."""
    options = {"endpoint_url": endpoint} if endpoint else None
    step = Consumer()
    if tool == "mosaic":
        _import_streaming()
    for module in IMPORTS[tool]:  # before the clock: see IMPORTS
        importlib.import_module(module)
    # the peers' download caches (a dataset's size per pass) go in a folder of this pass, removed after it
    tempfile.tempdir = tempfile.mkdtemp(prefix="bench-loader-pass-")
    try:
        cpu0, t0 = _cpu(), time.perf_counter()
        n = READERS[tool](root, setting, options, step)
        seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
    finally:
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)
    print(json.dumps({"samples": n, "seconds": seconds, "cpu": cpu - step.cpu, "step_cpu": step.cpu}))


# ---------------------------------------------------------------- settings: each tool's knobs, swept


def sweep(tool: str, workers: list[int], compressions: list[str], read_threads: list[int],
          processes: list[int] = ()) -> list[dict]:  # fmt: skip
    """The settings of ``tool`` that a run measures: each peer's worker counts in its native tensor
    encoding uncompressed, then each other compression and its other encoding at the most workers
    swept (a run on the shared 2-core machine cannot afford the full grid); ours' read threads
    (with the trainer's prefetch), then ``processes`` read processes (``read_processes``), then the trainer's
    defaults (``read_processes: auto``: what a user who sets nothing gets)."""
    if tool == "ours":
        return ([{"read_threads": t} for t in read_threads] + [{"read_processes": k} for k in processes if k]
                + [{"defaults": True}])  # fmt: skip
    native, other = {"litdata": ("tensor", "numpy"), "mosaic": ("ndarray", "bytes")}[tool]
    most = max(workers)
    return ([{"encoding": native, "compression": compressions[0], "workers": w} for w in workers]
            + [{"encoding": native, "compression": c, "workers": most} for c in compressions[1:]]
            + [{"encoding": other, "compression": compressions[0], "workers": most}])  # fmt: skip


def label(setting: dict) -> str:
    """A setting as the tables name it: ``tensor zstd 4w``, ``2 threads``, ``defaults``."""
    if setting.get("defaults"):
        return "defaults"
    if setting.get("read_processes"):
        return f"{setting['read_processes']} read processes"
    if "read_threads" in setting:
        return f"{setting['read_threads']} read threads"
    return f"{setting['encoding']} {setting['compression']} {setting['workers']}w"


def dataset(tool: str, setting: dict) -> str:
    """The folder (under ``<work>/n<N>``) of the dataset a setting reads: ours' cache + plan are the size's folder."""
    return "." if tool == "ours" else f"{tool}-{setting['encoding']}-{setting['compression']}"


def marginal(small: dict, large: dict) -> dict:
    """Marginal figures between two epochs of one setting: samples/s, CPU-ms per sample (reader, server) and
    object GETs per 1,000 samples (0 where no request log counted them)."""
    extra = large["samples"] - small["samples"]
    return {"rate": extra / (large["seconds"] - small["seconds"]),
            "cpu_ms": (large["cpu"] - small["cpu"]) / extra * 1000,
            "server_ms": (large["server_cpu"] - small["server_cpu"]) / extra * 1000,
            "gets_k": (large.get("gets", 0) - small.get("gets", 0)) / extra * 1000}  # fmt: skip


def fastest(passes: list[dict]) -> dict:
    """The pass (one run of a setting at one size) that took the least wall time, with its own CPU and request
    counts: of ``--repeats`` back-to-back runs, the slower ones measured the machine's interference."""
    return min(passes, key=lambda p: p["seconds"])


def best(rates: dict[str, list[float]]) -> str:
    """The setting with the highest median rate over the rounds (ties: the first listed)."""
    return max(rates, key=lambda k: float(np.median(rates[k])))


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
    its lines with ANSI codes, taken out first. A GET with a query string (a listing) is not an object GET."""
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


def local_reads(root: str, rounds: int) -> None:
    """ours' loader (2 read threads, the step after every batch) on a local cache, its two read paths alternated
    in one process, ``rounds`` rounds, each pass's files warmed: local shards through fsspec's
    ``LocalFileSystem`` (an open, stats, a seek, a read and a close per range) against ``os.pread`` on held
    descriptors (:class:`manifests.localfiles.LocalFiles`, the trainer's). Whole-epoch rates (the same start-up in
    both), reader CPU per sample less the step's, the median of the rounds."""
    from manifests.localfiles import LocalFiles

    rates: dict[str, list[tuple[float, float]]] = {"fsspec": [], "pread": []}
    for r in range(rounds):
        for path in rates:
            LocalFiles.available = path == "pread"  # False: the reader reads through fsspec
            warm("ours", root)
            step, cpu0, t0 = Consumer(), _cpu(), time.perf_counter()
            try:
                n = read_ours(root, {"read_threads": 2}, None, step)
            finally:
                LocalFiles.available = True
            seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0 - step.cpu
            rates[path].append((n / seconds, cpu / n * 1000))
            print(f"round {r + 1} local reads {path}: {n / seconds:,.0f} samples/s, {cpu / n * 1000:.3f} reader "
                  f"CPU-ms/sample (load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    for path, got in rates.items():
        print(f"local reads {path}: median {np.median([g[0] for g in got]):,.0f} samples/s, "
              f"{np.median([g[1] for g in got]):.3f} reader CPU-ms/sample over {rounds} rounds")  # fmt: skip


# ---------------------------------------------------------------- why LitData's numpy encoding is slow


def litdata_decodes(root: str) -> None:
    """Deserializations per item and CPU-ms per item of one shuffled epoch of LitData, one process,
    numpy vs tensor encoding, its default ``batch_decode="auto"`` vs ``0`` (decode the requested item only).

    ``auto`` picks a decode window from the leaf types and the mean sample size: tensor leaves count
    as heavy (8 rows at ~340 kB a sample), numpy leaves do not (16 MB / sample size: ~47 rows); the
    in-chunk shuffle then asks for items across windows, so a window is decoded again and again,
    and ``NumpySerializer`` copies every array it decodes."""
    from collections import Counter

    from litdata import StreamingDataset
    from litdata.streaming import serializers

    calls: Counter = Counter()
    for cls in (serializers.NumpySerializer, serializers.NoHeaderNumpySerializer, serializers.TensorSerializer,
                serializers.NoHeaderTensorSerializer):  # fmt: skip
        def counted(self, data, plain=cls.deserialize):
            calls["arrays"] += 1
            return plain(self, data)

        cls.deserialize = counted
    for encoding in ("numpy", "tensor"):
        for decode in ("auto", 0):
            calls.clear()
            data = StreamingDataset(f"{root}/litdata-{encoding}-none", shuffle=True, batch_decode=decode)
            cpu = time.process_time()
            n = sum(1 for _ in data)
            cpu = time.process_time() - cpu
            print(f"litdata {encoding} batch_decode={decode}: {calls['arrays'] / (3 * n):.1f} decodes per array, "
                  f"{cpu / n * 1000:.2f} CPU-ms per item ({n} items, load {os.getloadavg()[0]:.1f})", flush=True)


# ---------------------------------------------------------------- driver


def _process_cpu(pid: int, children: bool = False) -> float:
    """CPU-seconds (user + system) a live process has used, from ``/proc`` (0.0 where there is none);
    ``children``: with those of its children it has reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11 : 15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def warm(tool: str, folder: str) -> int:
    """Read the local files a pass of ``tool`` reads (under ``folder``) once, before its clock
    (:func:`benchmarks.results.warm`): ours' cache and plan, a peer's dataset folder; returns the bytes read."""
    from benchmarks.results import warm as warm_folder

    tops = [f"{folder}/cache", f"{folder}/{ours_plan(SHUFFLE)}"] if tool == "ours" else [folder]
    return sum(warm_folder(top) for top in tops)


def run_child(tool: str, root: str, setting: dict, endpoint: str | None,
              server: subprocess.Popen | None = None, log: str | None = None) -> dict:  # fmt: skip
    """One epoch in a fresh process; ``server_cpu``: what the moto server spent answering it (its own
    process, not counted in ``cpu``: a real S3 endpoint's cost is not the reader's); ``gets``, ``requests``:
    the object GETs and all requests the server logged meanwhile (``log``: its request log)."""
    cmd = [sys.executable, __file__, "--child", tool, "--root", root, "--setting", json.dumps(setting)]
    cmd += ["--endpoint", endpoint] if endpoint else []
    before, counted = (_process_cpu(server.pid) if server else 0.0), count_requests(log)
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode:
        raise RuntimeError(f"{tool} {label(setting)} {root} {endpoint or 'local'} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["server_cpu"] = (_process_cpu(server.pid) - before) if server else 0.0
    if log:
        time.sleep(0.2)  # the server logs a request after answering it
    got["gets"], got["requests"] = (a - b for a, b in zip(count_requests(log), counted))
    return got


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def record(run, rounds: list[dict], settings: dict[str, list[dict]], stores: list[str]) -> dict:
    """Add every round's figures to ``run`` (results.py) once the best setting of each tool is known (by
    the median over the rounds), each round with the load it was measured under; returns the bests."""
    tools = list(settings)
    bests = {store: {tool: best({label(s): [r["figures"][store][tool][label(s)]["rate"] for r in rounds]
                                 for s in settings[tool]}) for tool in tools} for store in stores}  # fmt: skip
    for r in rounds:
        with run.round() as i:
            for store in stores:
                at = {tool: r["figures"][store][tool][bests[store][tool]] for tool in tools}  # each at its best
                for tool in tools:
                    run.add(f"{store}: {tool} samples/s", at[tool]["rate"], "/s", note=bests[store][tool])
                for peer in (t for t in tools if t != "ours" and "ours" in tools):
                    run.add(f"{store}: ours / {peer}, samples/s", at["ours"]["rate"] / at[peer]["rate"], "x",
                            target=">= 1.2", note="each at its best")  # fmt: skip
                    if "defaults" in r["figures"][store]["ours"]:  # what a user who sets nothing gets
                        ours = r["figures"][store]["ours"]["defaults"]["rate"]
                        run.add(f"{store}: ours with the trainer's defaults / {peer} at its best, samples/s",
                                ours / at[peer]["rate"], "x", target=">= 1.2")  # fmt: skip
                cpu = {t: at[t]["cpu_ms"] + at[t]["server_ms"] for t in tools}  # local: no server, 0
                for tool in tools:
                    what = "reader + moto server CPU-ms/sample" if store == "s3" else "CPU-ms/sample"
                    run.add(f"{store}: {tool} {what}", cpu[tool], "ms")
                if store == "s3":
                    for tool in tools:
                        run.add(f"s3: {tool} GETs per 1,000 samples", at[tool]["gets_k"])
                    peers = [cpu[t] for t in tools if t != "ours"]
                    if "ours" in tools and peers:
                        run.add("s3: ours CPU-ms/sample (reader + server) / the best peer's", cpu["ours"] / min(peers),
                                "x", target="<= 1.0")  # fmt: skip
                for tool in (t for t in tools if len(settings[t]) > 1):
                    for s in settings[tool]:
                        run.add(f"{store} sweep: {tool} {label(s)}", r["figures"][store][tool][label(s)]["rate"], "/s")
        run.rounds[i].update(r["load"])  # the load measured around the round, not around this bookkeeping
    return bests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="128,384", help="two epoch sizes (samples, multiples of 16)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the median is reported")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each pass, back to back, the fastest kept (every tool alike; default 1)")
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--workers", default="1,2,4", help="the peers' DataLoader worker counts swept")
    p.add_argument("--compressions", default="none,zstd", help="the peers' compressions swept")
    p.add_argument("--read-threads", default="1,2,4", help="ours' read threads swept (prefetch: the trainer's)")
    p.add_argument("--ours-processes", default="", help="also ours with K read processes (read_processes; e.g. 2,4)")
    p.add_argument("--save", nargs="?", const="loader", default=None, metavar="NAME",
                   help="record every round in benchmarks/results/NAME.json (results.py; NAME default: loader)")
    p.add_argument("--shuffle", default="full", help="ours' plan: --shuffle full (default) or window[:SIZE]")
    p.add_argument("--work", default=None, help="folder for the datasets (default: a temporary one)")
    p.add_argument("--decode-scaling", type=int, metavar="K", default=0,
                   help="only measure ours' read+decode in 1 thread, K threads, K processes (local, --sizes' larger)")
    p.add_argument("--local-reads", type=int, metavar="ROUNDS", default=0,
                   help="only compare ours' two local read paths (fsspec vs pread), alternated, on --sizes' larger")
    p.add_argument("--litdata-decodes", action="store_true",
                   help="only count LitData's decodes per item, numpy vs tensor (one process, --sizes' smaller)")
    p.add_argument("--child", choices=TOOLS, help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--moto-server", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.moto_server:
        return _serve_moto(args.moto_server)
    if args.child:
        return child(args.child, args.root, json.loads(args.setting), args.endpoint)
    os.environ["BENCH_LOADER_SHUFFLE"] = args.shuffle  # the children read ours' plan of this shuffle

    sizes = [int(s) for s in args.sizes.split(",")]
    assert len(sizes) == 2 and sizes[0] < sizes[1] and all(s % BATCH == 0 for s in sizes), "two sizes, x16"
    tools, stores = args.tools.split(","), args.stores.split(",")
    processes = _ints(args.ours_processes) if args.ours_processes else []
    settings = {t: sweep(t, _ints(args.workers), args.compressions.split(","), _ints(args.read_threads), processes)
                for t in tools}  # fmt: skip
    work = args.work or tempfile.mkdtemp(prefix="bench-loader-")
    server = None
    if args.decode_scaling or args.local_reads:
        tools, stores, sizes = ["ours"], [], sizes[1:]
    if args.litdata_decodes:
        tools, sizes = ["litdata"], sizes[:1]
        settings["litdata"] = [{"encoding": e, "compression": "none", "workers": 0} for e in ("numpy", "tensor")]
    try:
        t = time.perf_counter()
        for n in sizes:
            for tool in tools:
                for s in settings[tool]:
                    folder = os.path.normpath(f"{work}/n{n}/{dataset(tool, s)}")
                    if not os.path.exists(f"{folder}/.done-{tool}"):
                        os.makedirs(folder, exist_ok=True)
                        if tool == "ours":
                            write_ours(folder, n)
                        else:
                            WRITERS[tool](folder, n, s["encoding"], s["compression"])
                        open(f"{folder}/.done-{tool}", "w").close()
                    if tool == "ours" and not os.path.exists(f"{folder}/{ours_plan(args.shuffle)}"):
                        plan_ours(folder, n, args.shuffle)
        print(f"wrote {sizes} samples with {tools} in {time.perf_counter() - t:.0f} s under {work}", flush=True)
        if args.litdata_decodes:
            return litdata_decodes(f"{work}/n{sizes[0]}")
        if args.decode_scaling:
            return decode_scaling(f"{work}/n{sizes[0]}", args.decode_scaling)
        if args.local_reads:
            return local_reads(f"{work}/n{sizes[0]}", args.local_reads)
        step = Consumer()
        for _ in range(20):
            step.step()
        print(f"consumer: {STEP_ITERATIONS:,} Python iterations per batch, {step.cpu / 20 * 1000:.2f} CPU-ms each "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
        endpoint, log = None, f"{work}/moto-requests.log"
        if "s3" in stores:
            server, endpoint = start_s3(log)
            import s3fs

            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
            fs.mkdir(BUCKET_NAME)
            for n in sizes:
                for tool in tools:
                    names = ({"cache", ours_plan(args.shuffle)} if tool == "ours"
                             else {dataset(tool, s) for s in settings[tool]})  # fmt: skip
                    for name in names:
                        fs.put(f"{work}/n{n}/{name}", f"{BUCKET_NAME}/n{n}/", recursive=True)
        from benchmarks.results import Run

        command = " ".join(["python benchmarks/loader.py", *sys.argv[1:]])
        run = Run(args.save or "loader", command=command, tools=["litdata", "mosaicml-streaming"])
        rounds = []
        for r in range(args.rounds):
            load = {"load_before": round(os.getloadavg()[0], 2)}
            raw: dict = {}
            for store in stores:
                for n in sizes:
                    for tool in tools:
                        for s in settings[tool]:
                            folder = os.path.normpath(f"{work}/n{n}/{dataset(tool, s)}")
                            root = f"s3://{BUCKET_NAME}/n{n}" if store == "s3" and tool == "ours" else folder
                            s3 = (endpoint, server, log) if store == "s3" else (None, None, None)
                            passes = []
                            for _ in range(args.repeats):
                                if store == "local":
                                    warm(tool, folder)
                                got = run_child(tool, root, s, *s3)
                                if got["samples"] < n - BATCH:  # a peer's pass that stopped short: once more, said
                                    print(f"round {r + 1} {store} {tool} {label(s)} n={n}: only {got['samples']} "
                                          "samples came back; run again", flush=True)  # fmt: skip
                                    got = run_child(tool, root, s, *s3)
                                assert got["samples"] >= n - BATCH, (tool, store, n, got)
                                passes.append(got)
                                print(f"round {r + 1} {store} {tool} {label(s)} n={n}: {got['samples']} samples "
                                      f"{got['seconds']:.2f} s cpu {got['cpu']:.2f} s server {got['server_cpu']:.2f} s "
                                      f"{got['gets']} GETs (load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
                            raw[(store, tool, label(s), n)] = fastest(passes)
            load["load_after"] = round(os.getloadavg()[0], 2)
            figures = {store: {tool: {label(s): marginal(raw[(store, tool, label(s), sizes[0])],
                                                         raw[(store, tool, label(s), sizes[1])])
                                      for s in settings[tool]} for tool in tools} for store in stores}  # fmt: skip
            rounds.append({"load": load, "figures": figures})
            if args.save:  # after every round, so that a run cut short keeps the rounds it finished
                partial = Run(args.save, command=run.command, tools=["litdata", "mosaicml-streaming"])
                partial.started = run.started
                record(partial, rounds, settings, stores)
                partial.save()
        bests = record(run, rounds, settings, stores)
        for store in stores:
            print(f"sweep {store} (marginal samples/s per round; reader CPU-ms/sample, median):")
            for tool in tools:
                for s in settings[tool]:
                    figs = [r["figures"][store][tool][label(s)] for r in rounds]
                    mark = " <- best" if label(s) == bests[store][tool] else ""
                    print(f"  {tool:8} {label(s):20} " + " ".join(f"{f['rate']:7,.0f}" for f in figs)
                          + f"   {np.median([f['cpu_ms'] for f in figs]):.2f} ms{mark}")
        for store in stores:
            top = bests[store]
            rate = {t: float(np.median([r["figures"][store][t][top[t]]["rate"] for r in rounds])) for t in tools}
            parts = [f"{t} {rate[t]:,.0f}/s [{top[t]}]" + (f" ({rate['ours'] / rate[t]:.2f}x)"
                     if "ours" in tools and t != "ours" else "") for t in tools]  # fmt: skip
            print(f"loader {store}: " + ", ".join(parts))
            if store == "s3":
                figs = {t: [r["figures"][store][t][top[t]] for r in rounds] for t in tools}
                print("loader s3 reader + server CPU-ms/sample: " + ", ".join(
                    f"{t} {np.median([f['cpu_ms'] + f['server_ms'] for f in figs[t]]):.2f} ms" for t in tools))
                gets = {t: float(np.median([f["gets_k"] for f in figs[t]])) / 1000 for t in tools}
                print("loader s3 GETs/sample (marginal): " + ", ".join(
                    f"{t} {gets[t]:.4f} (${gets[t] * GET_DOLLARS_PER_M:.3f} per 1M samples)" for t in tools))
    finally:
        if server is not None:
            server.kill()
            server.wait()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
