"""Client CPU per object-store request, s3fs vs obstore, against moto on 127.0.0.1 (real HTTP, real signing).

    .venv/bin/python benchmarks/storage.py [--small 1500] [--large 3000] [--scan-small 2000] [--scan-large 12000]

A moto server runs in its own process (its CPU is not counted). Every figure is the **marginal** client
CPU from two sizes, ``(cpu_large - cpu_small) / (large - small)``, so that start-up, connection set-up
and Ray's start drop out; each client goes through bucketeer's storage layer exactly as a job does
(``open_url`` with ``bucketeer_client`` = ``fsspec`` for s3fs, ``obstore`` for obstore):

1. ``get``: 64 KiB ranged GETs through :func:`manifests.storage.read_many` (the embed job's and the
   cache reader's path), CPU of this process, all threads (``time.process_time``);
2. ``list``: :func:`pipeline.sources.listing.list_source` of a prefix of ``small`` and of ``large`` keys, each
   listed :data:`LISTINGS` times;
3. ``put``: 64 KiB :func:`manifests.storage.write_bytes_atomic` calls (one PUT each; shards and artifacts);
4. ``scan``: ``bucketeer scan s3://...`` of ``--scan-small`` and ``--scan-large`` small JPEGs, each with a
   ``.txt`` caption (2 GETs per file), in a child process with its own local Ray. Its CPU is the whole
   process tree's, by role (driver, Ray's task workers, Ray's daemons), read from ``/proc`` while it
   runs (:class:`TreeCPU`; ``getrusage(RUSAGE_CHILDREN)`` misses Ray's workers). Ray's daemons cost CPU
   per second of wall time, not per file: with moto as the bottleneck they are reported apart;
5. ``reader``: :class:`manifests.cache.reader.CacheReader` reading random samples in batches of 16,
   one ranged GET per record (``max_gap=None``), decode included (the same for both clients);
6. ``bodies``: 8 MiB ranged GETs (the chunks a window-shuffled plan's reader fetches), two in flight, through
   :func:`manifests.storage.read_many`: CPU-ms per MiB of body for s3fs, for obstore reading each body in one
   call (the default since the floor's 30 s window is set against obstore's own 30 s limit on a whole
   request), and for obstore reading it as a stream judged by the rate floor (a floor window under that limit;
   every obstore GET before); then obstore's two ways for 1,280 and 3,840 ranged GETs of 64 KiB (of 1 MiB
   objects), 64 at once. Recorded in ``benchmarks/results/storage-bodies.json``.

moto starts once and every part's objects are uploaded once; each round measures both clients on them, and
``benchmarks/results/storage.json`` is written after every round (a run cut short keeps its finished rounds); a
scan child that fails (its own Ray's start, under load) is run once more.

moto's server closes the connection after every response (werkzeug's dev server), so each request here
also pays a TCP connect on both clients; a real S3 or R2 endpoint keeps connections open (and adds TLS).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench-key-id")  # moto accepts any; never a real account
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret-key")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

from manifests.storage import open_url, read_many, write_bytes_atomic  # noqa: E402
from pipeline.sources.listing import list_source  # noqa: E402
from benchmarks.results import Run  # noqa: E402

BUCKET = "bench-storage"
CLIENTS = {"s3fs": "fsspec", "obstore": "obstore"}
MOTO = """
import sys, time
from moto.server import ThreadedMotoServer
ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False).start()
while True:
    time.sleep(3600)
"""


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", MOTO, str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("moto did not start")


def options(endpoint: str, client: str) -> dict:
    return {"endpoint_url": endpoint, "bucketeer_client": CLIENTS[client]}


def upload(endpoint: str, objects: dict[str, bytes]) -> None:
    """PUT many objects fast (16 threads, through the storage layer)."""
    fs, _ = open_url(f"s3://{BUCKET}", options(endpoint, "obstore"))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: write_bytes_atomic(fs, f"{BUCKET}/{kv[0]}", kv[1]), objects.items()))


def cpu(call) -> float:
    start = time.process_time()
    call()
    return time.process_time() - start


def marginal(costs: dict[int, float]) -> float:
    (n1, c1), (n2, c2) = sorted(costs.items())
    return (c2 - c1) / (n2 - n1)


def line(run: Run, what: str, unit: str, figures: dict[str, float], target: str = "") -> None:
    """Print a measure's two clients and their ratio, and add all three to this round of ``run``."""
    s3fs, obstore = figures["s3fs"], figures["obstore"]
    print(f"storage {what}: s3fs {s3fs:.3f} {unit}, obstore {obstore:.3f} {unit} "
          f"(s3fs/obstore = {s3fs / obstore:.1f}x)", flush=True)  # fmt: skip
    run.add(f"{what}: s3fs", s3fs, unit)
    run.add(f"{what}: obstore", obstore, unit, target=target)
    run.add(f"{what}: s3fs / obstore", s3fs / obstore, "x")


BLOB = os.urandom(64 << 10)
LISTINGS = 8  # each prefix listed this many times: 1,500 keys between the sizes are ~0.1 CPU-s, within the noise


def setup_requests(endpoint: str, small: int, large: int) -> None:
    upload(endpoint, {f"objs-{n}/{i:06d}.bin": BLOB for n in (small, large) for i in range(n)})


def bench_requests(run: Run, endpoint: str, small: int, large: int) -> None:
    blob = BLOB
    gets, lists, puts = {}, {}, {}
    for client in CLIENTS:
        fs, _ = open_url(f"s3://{BUCKET}", options(endpoint, client))
        paths = [f"{BUCKET}/objs-{large}/{i:06d}.bin" for i in range(large)]
        read_many(fs, paths[:64], [0] * 64, [len(blob)] * 64)  # warm: connections, credentials
        gets[client] = marginal({n: cpu(lambda: read_many(fs, paths[:n], [0] * n, [len(blob)] * n))
                                 for n in (small, large)})  # fmt: skip
        lists[client] = marginal({n: cpu(lambda: [list_source(fs, f"{BUCKET}/objs-{n}") for _ in range(LISTINGS)])
                                  for n in (small, large)}) / LISTINGS  # fmt: skip
        few, more = small // 4, large // 4
        puts[client] = marginal({n: cpu(lambda: [write_bytes_atomic(fs, f"{BUCKET}/put-{client}/{n}-{i}", blob)
                                                 for i in range(n)]) for n in (few, more)})  # fmt: skip
    line(run, "ranged GET 64 KiB (read_many)", "CPU-ms/request", {k: v * 1e3 for k, v in gets.items()})
    line(run, "listing (list_source)", "CPU-us/key", {k: v * 1e6 for k, v in lists.items()})
    line(run, "PUT 64 KiB (write_bytes_atomic)", "CPU-ms/request", {k: v * 1e3 for k, v in puts.items()})


# --- the scan: a child process and its whole tree ------------------------------------------------


def _descendants(root: int) -> dict[int, int]:
    """pid -> parent pid of every process under ``root`` (from /proc)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parents[int(name)] = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in out:
                out[child] = parent
                frontier.append(child)
    return out


def _role(pid: int, driver: int) -> str:
    if pid == driver:
        return "driver"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "ray daemons"
    task = command.startswith("ray::") and "Agent" not in command  # its title once it runs tasks
    return "ray workers" if task or "default_worker.py" in command else "ray daemons"


class TreeCPU:
    """CPU seconds (user + system) of a process and all its descendants, by role: ``driver``, ``ray
    workers`` (``ray::`` task processes) and ``ray daemons`` (GCS, raylet, agents, dashboard).

    Polls ``/proc/PID/stat`` of every descendant every ``interval`` s and keeps each one's last value.
    ``getrusage(RUSAGE_CHILDREN)`` cannot do this: Ray's raylet ignores SIGCHLD, so its workers are
    reaped without their CPU reaching any parent (it missed 70% of a scan's CPU here). A process's
    last ``interval`` (its shutdown) is missed, the same at every size: it cancels in the marginal."""

    def __init__(self, driver: int, interval: float = 0.1):
        self.driver, self.interval = driver, interval
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.is_set():
            for pid in [self.driver, *_descendants(self.driver)]:
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                # read until it says worker: a worker renames itself (setproctitle), an exiting one has no name
                role = self.last[pid][0] if self.last.get(pid, ("",))[0] == "ray workers" else _role(pid, self.driver)
                self.last[pid] = (role, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        out = {"driver": 0.0, "ray workers": 0.0, "ray daemons": 0.0}
        for role, seconds in self.last.values():
            out[role] += seconds
        return out


def scan_cpu(command: list[str]) -> dict[str, float]:
    """CPU seconds by role (:class:`TreeCPU`) of a scan command run to its end."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    tree = TreeCPU(proc.pid)
    _, err = proc.communicate()
    cpu = tree.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed:\n{err[-3000:]}")
    return cpu


def tiny_jpeg(i: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    w, h = (64, 48) if i % 2 else (48, 64)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def setup_scan(endpoint: str, small: int, large: int) -> None:
    objects = {}
    for n in (small, large):
        for i in range(n):
            objects[f"scan-{n}/{i // 1000:03d}/img_{i:06d}.jpg"] = tiny_jpeg(i)
            objects[f"scan-{n}/{i // 1000:03d}/img_{i:06d}.txt"] = f"caption number {i}".encode()
    upload(endpoint, objects)


def bench_scan(run: Run, endpoint: str, small: int, large: int, tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # a fresh manifest each round: a rescan would skip the files
    tmp.mkdir(parents=True)
    totals, sides = {}, {}
    for client in CLIENTS:
        costs, side = {}, {}
        for n in (small, large):
            out = tmp / f"manifest-{client}-{n}"
            command = [sys.executable, "-m", "pipeline.scan", f"s3://{BUCKET}/scan-{n}", "--out", str(out),
                       "--storage-options", json.dumps(options(endpoint, client))]  # fmt: skip
            started = time.perf_counter()
            try:
                roles = scan_cpu(command)
            except RuntimeError as e:  # a child's Ray start can time out on a loaded machine: once more, fresh
                print(f"  scan {client} {n} files failed, once more: {str(e).splitlines()[-1]}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
                roles = scan_cpu(command)
            wall = time.perf_counter() - started
            costs[n], side[n] = sum(roles.values()), roles["driver"] + roles["ray workers"]
            print(f"  scan {client} {n} files: {costs[n]:.2f} CPU-s in {wall:.1f} s wall (" +
                  ", ".join(f"{k} {v:.2f}" for k, v in roles.items()) + ")", flush=True)  # fmt: skip
        totals[client], sides[client] = marginal(costs) * 1e3, marginal(side) * 1e3
    line(run, "scan over HTTP, driver + Ray workers (2 GETs per file)", "CPU-ms/file", sides, target="<= 1")
    line(run, "scan over HTTP, with Ray's daemons too", "CPU-ms/file", totals, target="<= 1")


def setup_reader(endpoint: str, large: int) -> None:
    from tests.test_cache_format import build_cache  # the test suite's synthetic cache (no Ray, no models)

    build_cache(f"s3://{BUCKET}/cache", {"endpoint_url": endpoint}, n=large, shard_records=512)


def bench_reader(run: Run, endpoint: str, small: int, large: int) -> None:
    from manifests.cache.reader import CacheReader

    url = f"s3://{BUCKET}/cache"
    figures = {}
    rng = np.random.default_rng(0)
    for client in CLIENTS:
        reader = CacheReader(url, options(endpoint, client), max_gap=None)  # one GET per record
        reader.read(reader.sample_ids[:16].tolist())  # warm

        def read(n: int) -> None:
            ids = rng.permutation(reader.sample_ids)[:n].tolist()
            for k in range(0, n, 16):
                reader.read(ids[k : k + 16])

        figures[client] = marginal({n: cpu(lambda: read(n)) for n in (small, large)}) * 1e3
    line(run, "cache reader (CacheReader.read, random batches of 16)", "CPU-ms/sample", figures)


BODY = 8 << 20  # bytes: the cache reader's chunk (manifests.cache.reader.CHUNK_BYTES)
BODY_OBJECT = 64 << 20  # bytes per object read in bodies


def setup_bodies(endpoint: str, large: int) -> None:
    upload(endpoint, {f"bodies/{i}.bin": os.urandom(BODY_OBJECT) for i in range(large)})
    upload(endpoint, {f"bodies/small-{i}.bin": os.urandom(1 << 20) for i in range(64)})  # moto copies an object per GET


@contextlib.contextmanager
def _floor_window(window: str | None):
    """``$BUCKETEER_STORAGE_RATE_WINDOW`` set to ``window`` inside (None: the default, one-call GETs)."""
    if window:
        os.environ["BUCKETEER_STORAGE_RATE_WINDOW"] = window
    try:
        yield
    finally:
        os.environ.pop("BUCKETEER_STORAGE_RATE_WINDOW", None)


def bench_bodies(run: Run, endpoint: str, small: int, large: int) -> None:
    """CPU-ms per MiB of 8 MiB ranged GET bodies, each way a body can come, then per 64 KiB GET (see the module
    docstring)."""
    streamed = "streamed (floor window 10 s)"
    ways = {"s3fs": ("s3fs", None), "obstore, one call": ("obstore", None), f"obstore, {streamed}": ("obstore", "10")}
    figures = {}
    per = BODY_OBJECT // BODY
    for way, (client, window) in ways.items():
        with _floor_window(window):
            fs, _ = open_url(f"s3://{BUCKET}", options(endpoint, client))

            def read(n: int) -> None:  # the first n objects, two bodies in flight, each dropped once read
                for i in range(n * per // 2):
                    at = [(2 * i + k) % per * BODY for k in range(2)]
                    read_many(fs, [f"{BUCKET}/bodies/{2 * i // per}.bin"] * 2, at, [a + BODY for a in at])

            read(1)  # warm: connections, credentials
            figures[way] = marginal({n: cpu(lambda: read(n)) for n in (small, large)}) / (BODY_OBJECT >> 20) * 1e3
    base = figures["obstore, one call"]
    for way, value in figures.items():
        print(f"storage 8 MiB bodies: {way} {value:.3f} CPU-ms/MiB ({value / base:.1f}x obstore in one call)",
              flush=True)  # fmt: skip
        run.add(f"8 MiB GET bodies: {way}", value, "CPU-ms/MiB")
    run.add("8 MiB GET bodies: obstore streamed / one call", figures[f"obstore, {streamed}"] / base, "x")
    run.add("8 MiB GET bodies: s3fs / obstore one call", figures["s3fs"] / base, "x")
    small_gets = {}  # the same two ways for 64 KiB ranged GETs, 64 at once (the embed job's, a full shuffle's)
    paths = [f"{BUCKET}/bodies/small-{j}.bin" for j in range(64)]
    for way, window in (("one call", None), (streamed, "10")):
        with _floor_window(window):
            fs, _ = open_url(f"s3://{BUCKET}", options(endpoint, "obstore"))

            def gets(n: int) -> None:  # 64 KiB ranges of 1 MiB objects
                for i in range(0, n, 64):
                    at = [(j * 7 % 16) << 16 for j in range(i, i + 64)]
                    read_many(fs, paths, at, [a + (64 << 10) for a in at])

            gets(64)
            small_gets[way] = marginal({n: cpu(lambda: gets(n)) for n in (64 * 20, 64 * 60)}) * 1e3
        print(f"storage 64 KiB GETs: obstore {way} {small_gets[way]:.3f} CPU-ms/request", flush=True)
        run.add(f"64 KiB GETs: obstore, {way}", small_gets[way], "CPU-ms/request")
    run.add("64 KiB GETs: obstore streamed / one call", small_gets[streamed] / small_gets["one call"], "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--small", type=int, default=1500)
    parser.add_argument("--large", type=int, default=3000)
    parser.add_argument("--scan-small", type=int, default=2000)
    parser.add_argument("--scan-large", type=int, default=12000)
    parser.add_argument("--parts", default="requests,reader,scan,bodies",
                        help="comma-separated: requests, reader, scan, bodies")
    parser.add_argument("--bodies-small", type=int, default=2, help="64 MiB objects read in bodies' smaller pass")
    parser.add_argument("--bodies-large", type=int, default=10, help="... and in its larger one")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each measures both clients); the median")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    rest = parts - {"bodies"}  # bodies are recorded apart, in storage-bodies.json
    name = "storage" if rest == {"requests", "reader", "scan"} else "storage-" + "-".join(sorted(rest))
    command = "python benchmarks/storage.py" + "".join(f" {a}" for a in sys.argv[1:])
    run = Run(name, command, tools=["s3fs", "obstore", "moto", "ray"])
    bodies = Run("storage-bodies", command, tools=["s3fs", "obstore", "moto"])
    moto, endpoint = start_moto()
    print(f"moto at {endpoint}; load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        import s3fs

        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(BUCKET)
        if "requests" in parts:
            setup_requests(endpoint, args.small, args.large)
        if "reader" in parts:
            setup_reader(endpoint, args.large // 3)
        if "scan" in parts:
            setup_scan(endpoint, args.scan_small, args.scan_large)
        if "bodies" in parts:
            setup_bodies(endpoint, args.bodies_large)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                if rest:
                    with run.round():
                        print(f"round {r + 1}: load average {os.getloadavg()[0]:.2f}", flush=True)
                        if "requests" in parts:
                            bench_requests(run, endpoint, args.small, args.large)
                        if "reader" in parts:
                            bench_reader(run, endpoint, args.small // 3, args.large // 3)
                        if "scan" in parts:
                            bench_scan(run, endpoint, args.scan_small, args.scan_large, Path(tmp) / "scans")
                if "bodies" in parts:
                    with bodies.round():
                        print(f"round {r + 1} bodies: load average {os.getloadavg()[0]:.2f}", flush=True)
                        bench_bodies(bodies, endpoint, args.bodies_small, args.bodies_large)
                if moto.poll() is not None:
                    raise RuntimeError(f"the moto server exited (code {moto.returncode}) during round {r + 1}")
                for done in [run] * bool(rest) + [bodies] * ("bodies" in parts):
                    done.save()  # after every round: a run cut short keeps the rounds it finished
        # a partial run (--parts) is saved under its own name: it does not replace the whole one
    finally:
        moto.kill()
        moto.wait()
    print(f"load average at the end {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
