"""Read and decode batches in worker processes (``read_processes``), handed over through shared memory.

:class:`~train.data.loader.BatchLoader` reads ahead on threads of the training process by default. Those
threads share one GIL with the training step's Python, so a loader that decodes (gzip, byte planes, collate)
while the step launches kernels gets about one and a half cores out of two. With ``read_processes=K``, K
processes (:func:`_context`) each run their own loader over the groups of steps they are handed (group g goes to
process g mod K, so the batches come back in plan order) and write each batch's tensors into one of
:data:`SLOTS` shared-memory slots of theirs. The training process copies a batch out of its slot (into
pinned memory when ``pin_memory``: the copy the pinning costs anyway), hands the slot back and yields the
copy: what it yields owns its memory, whatever the consumer keeps.

Messages between the processes are pickled over pipes (steps, batch skeletons, errors): only between the
training process and the workers it started, none of it read back from storage. A worker builds its cache
readers from the training process's readers (they pickle without their open files or held chunks,
:class:`~manifests.cache.CacheReader`); it is forked from multiprocessing's fork server, never from the
training process: an S3 client is not fork-safe. Like a
DataLoader's workers, it imports the main module (a script needs its ``__main__`` guard). A worker that
dies stops the run with an error naming it, and the training process unlinks its slots' segments (named by
loader, worker, slot and generation: :func:`segment_name`), which the dead worker cannot.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
from dataclasses import fields
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import torch

from manifests.errors import UsageError
from train.data.batch import TENSORS, Batch

__all__ = ["ProcessReads", "SLOTS", "choose_readers", "AUTO_PROCESSES", "main_is_safe", "usable_cores"]

AUTO_PROCESSES = 2  # read processes ``read_processes: auto`` starts where it picks processes
SLOTS = 2  # shared-memory batch slots per worker process: one being filled while the other is copied out
ALIGN = 64  # tensor offsets in a slot (bytes)


def _layout(batch: Batch) -> tuple[list[tuple[str, int, str, tuple[int, ...]]], int]:
    """``([(field, offset, dtype name, shape)], bytes)``: where each of the batch's tensors goes in a slot."""
    out, at = [], 0
    for name in TENSORS:
        t = getattr(batch, name)
        if t is None:
            continue
        out.append((name, at, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return out, at


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def segment_name(prefix: str, slot: int, generation: int) -> str:
    """The shared-memory name of a worker's ``slot`` the ``generation``-th time it was made (``prefix``: the
    loader's token and the worker's number), so the training process can unlink a dead worker's segments."""
    return f"{prefix}{slot}g{generation}"


class _Slots:
    """A worker's slots: each one shared-memory segment, replaced by a larger one when a batch outgrows it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.segments: list[SharedMemory | None] = [None] * SLOTS
        self.views: list[torch.Tensor | None] = [None] * SLOTS
        self.generations = [0] * SLOTS

    def put(self, slot: int, batch: Batch) -> tuple[str | None, dict]:
        """Write ``batch``'s tensors into ``slot``; ``(new segment name or None, skeleton)``: the skeleton is
        the batch with each tensor replaced by its place in the slot."""
        layout, size = _layout(batch)
        renamed = None
        seg = self.segments[slot]
        if seg is None or seg.size < size:
            self.views[slot] = None
            if seg is not None:
                seg.close()
                seg.unlink()
            name = segment_name(self.prefix, slot, self.generations[slot])
            self.generations[slot] += 1
            seg = self.segments[slot] = SharedMemory(name, create=True, size=max(size + size // 4, ALIGN))
            self.views[slot] = torch.frombuffer(seg.buf, dtype=torch.uint8)
            renamed = seg.name
        view = self.views[slot]
        for name, at, _, _ in layout:
            src = _bytes(getattr(batch, name))
            view[at : at + src.numel()].copy_(src)
        skeleton = {f.name: getattr(batch, f.name) for f in fields(batch) if f.name not in TENSORS}
        skeleton["_layout"] = layout
        return renamed, skeleton

    def close(self) -> None:
        self.views = [None] * SLOTS
        for seg in self.segments:
            if seg is not None:
                seg.close()
                seg.unlink()
        self.segments = [None] * SLOTS


def _work(conn: Connection, prefix: str, make: Any, readers: list, latent_info: Any, kwargs: dict) -> None:
    """A worker process: build a loader of ``readers`` with ``make`` (the BatchLoader class), read the groups
    of steps ``conn`` hands over and send back each step's batch (in a slot) or error, in order, with the
    lines the loader logged meanwhile; ``None`` ends it. ``("free", slot)``: the training process copied
    that slot out."""
    torch.set_num_threads(1)
    slots, free, waiting, lines = _Slots(prefix), list(range(SLOTS)), [], []
    try:
        try:
            loader = make(readers, [], latent_info, log=lines.append, **kwargs)  # readers: chunked reads as set
            failed = None
        except Exception as e:  # e.g. the empty caption's record unreadable: each step gets the error
            failed = _portable(e)
        while True:
            msg = waiting.pop(0) if waiting else conn.recv()
            if msg is None:
                return
            if msg[0] == "free":
                free.append(msg[1])
                continue
            for item in loader._read_group(msg[1]) if failed is None else [failed] * len(msg[1]):
                said, lines[:] = lines[:], []
                if isinstance(item, BaseException):
                    try:
                        conn.send(("error", said, _portable(item)))
                    except Exception:  # an attribute of it that does not pickle
                        conn.send(("error", said, RuntimeError(f"{type(item).__name__}: {item}")))
                    continue
                while not free:  # the training process has both slots: wait for one, keeping any new work
                    got = conn.recv()
                    if got is None:
                        return
                    (free.append(got[1]) if got[0] == "free" else waiting.append(got))
                slot = free.pop()
                renamed, skeleton = slots.put(slot, item)
                conn.send(("batch", said, slot, renamed, skeleton))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    finally:
        slots.close()


def _portable(e: BaseException) -> BaseException:
    """``e`` if it can be rebuilt from its arguments on the other end (as unpickling an exception does: its type
    called with ``e.args``), else a RuntimeError with its text. Nothing is unpickled here."""
    try:
        type(e)(*e.args)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class _Pending:
    """The batches of one group of steps handed to a worker, received in order by :meth:`result`."""

    def __init__(self, pool: "ProcessReads", worker: int, n: int) -> None:
        self.pool, self.worker, self.n = pool, worker, n

    def result(self) -> list[Batch | BaseException]:
        return [self.pool._receive(self.worker) for _ in range(self.n)]


def _context() -> Any:
    """Where workers start: forked from multiprocessing's fork server, a clean process that imported this module
    (torch, numpy) once, so a worker starts in milliseconds and inherits no thread or S3 client; spawn where
    there is no fork server (not POSIX)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity on Linux; elsewhere, macOS included, the machine's count)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main_is_safe() -> bool:
    """Whether read processes may start beside this process's main module: it is the trainer's own
    (``python -m train``, ``accelerate launch -m train``) or there is no file to run again (a notebook, ``-c``). A
    script of yours is imported again in each read process, and one without the ``__main__`` guard would run."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) in ("train.__main__", "train") or not getattr(main, "__file__", None)


def choose_readers(setting: int | str, *, local: bool, cores: int, ranks: int,
                   safe_main: bool = True) -> tuple[int, str]:  # fmt: skip
    """``(read processes, why)`` of the config's ``read_processes``: a number is taken as it is; ``auto`` picks
    :data:`AUTO_PROCESSES` processes for a cache on a local disk when this node has at least 2 cores per rank
    (reading and decoding then run beside the step's Python instead of taking turns with it for one GIL:
    ``benchmarks/loader.py``'s local table), and threads (0) otherwise: a cache on object storage (its reads wait on
    the network, which threads overlap as well; processes were not measured there) or too few cores (a process per
    reader would only add copies). ``safe_main`` (:func:`main_is_safe`) False: threads, for a script's main module
    would run again in each read process."""
    if setting != "auto":
        return int(setting), f"read_processes: {setting} (config)"
    per_rank = cores // max(ranks, 1)
    where = f"{cores} cores for {ranks} rank{'s' if ranks != 1 else ''} on this node"
    if not local:
        return 0, f"read_processes: auto -> threads (the cache is on object storage; {where})"
    if not safe_main:
        return 0, ("read_processes: auto -> threads (run from a script, which each read process would import "
                   "again: set read_processes: 2 with an `if __name__ == \"__main__\":` guard to read in processes)")
    if per_rank < 2:
        return 0, f"read_processes: auto -> threads ({where}: fewer than 2 cores per rank)"
    return AUTO_PROCESSES, f"read_processes: auto -> {AUTO_PROCESSES} processes (a local cache; {where})"


class ProcessReads:
    """``processes`` workers reading groups of steps with loaders built by ``make`` (the
    :class:`~train.data.loader.BatchLoader` class: its ``_read_group``, with ``kwargs``);
    :meth:`submit` hands the next group to the next worker in turn (the loader takes the results in the
    order it submitted them: plan order)."""

    def __init__(self, processes: int, make: Any, readers: list, latent_info: Any, kwargs: dict,
                 pin_memory: bool = False, log: Any = print, name: str = "bucketeer-read") -> None:  # fmt: skip
        ctx = _context()
        self.pin_memory, self.log = pin_memory, log
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.maps: dict[tuple[int, int], tuple[SharedMemory, np.ndarray]] = {}
        self.turn = 0
        self.token = f"bkt{secrets.token_hex(4)}_"  # this loader's segments: bkt<token>_<worker>s<slot>g<generation>
        self.made: dict[tuple[int, int], int] = {}  # (worker, slot): the generation of the segment mapped last
        for k in range(processes):
            mine, theirs = ctx.Pipe()
            prefix = f"{self.token}{k}s"
            proc = ctx.Process(target=_work, args=(theirs, prefix, make, readers, latent_info, kwargs),
                               name=f"{name}-{k}", daemon=True)  # fmt: skip
            try:
                proc.start()
            except (OSError, RuntimeError) as e:
                self.close()
                raise UsageError(f"read_processes: read process {k} did not start ({type(e).__name__}: {e}). A "
                                 "script that builds a BatchLoader itself needs the `if __name__ == \"__main__\":` "
                                 "guard, as for a DataLoader's workers (each read process imports the main "
                                 "module); or set read_processes: 0") from None  # fmt: skip
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def submit(self, steps: list) -> _Pending:
        worker, self.turn = self.turn, (self.turn + 1) % len(self.conns)
        try:
            self.conns[worker].send(("read", steps))
        except OSError:  # it died: its pending groups, and this one, get the error when their turn comes
            pass
        return _Pending(self, worker, len(steps))

    def _died(self, worker: int) -> RuntimeError:
        proc = self.procs[worker]
        proc.join(timeout=5)
        for key in [k for k in self.maps if k[0] == worker]:
            self._drop(key)
        for slot in range(SLOTS):  # its segments, unlinked here (it cannot): the last one mapped, and one it
            last = self.made.get((worker, slot), -1)  # may have made since without saying so
            for generation in range(max(last, 0), last + 2):
                try:
                    seg = SharedMemory(segment_name(f"{self.token}{worker}s", slot, generation))
                except FileNotFoundError:
                    continue
                seg.close()
                seg.unlink()
        return RuntimeError(f"read process {proc.name} (pid {proc.pid}) exited with code {proc.exitcode} before "
                            "handing over its batches (killed, or out of memory?); resume from the last "
                            "checkpoint")  # fmt: skip

    def _receive(self, worker: int) -> Batch | BaseException:
        try:
            msg = self.conns[worker].recv()
        except (EOFError, OSError):
            return self._died(worker)
        for line in msg[1]:
            self.log(line)
        if msg[0] == "error":
            return msg[2]
        _, _, slot, renamed, skeleton = msg
        if renamed is not None:
            self._drop((worker, slot))
            seg = SharedMemory(name=renamed)
            self.made[(worker, slot)] = int(renamed.rsplit("g", 1)[1])
            self.maps[(worker, slot)] = (seg, np.frombuffer(seg.buf, np.uint8))
        view = self.maps[(worker, slot)][1]
        tensors = {}
        for name, at, dtype, shape in skeleton.pop("_layout"):
            out = torch.empty(shape, dtype=getattr(torch, dtype), pin_memory=self.pin_memory)
            flat = _bytes(out).numpy()  # numpy's copy: one thread, the GIL released (torch's wakes its
            flat[:] = view[at : at + flat.size]  # intra-op threads, which spin on the cores the workers need)
            tensors[name] = out
        try:
            self.conns[worker].send(("free", slot))
        except OSError:
            pass  # it died after handing this batch over: the next receive says so
        return Batch(**skeleton, **{k: tensors.get(k) for k in TENSORS})

    def _drop(self, key: tuple[int, int]) -> None:
        if key in self.maps:
            seg, view = self.maps.pop(key)
            del view
            seg.close()

    def close(self) -> None:
        """Stop the workers (they unlink their segments) and unmap the slots; safe to call twice."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for key in list(self.maps):
            self._drop(key)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
