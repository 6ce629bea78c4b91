"""What Ray may print on a user's screen: its real errors, and not its false alarms.

One line is printed by every ``bucketeer embed`` and ``annotate`` (and by any Ray Data job with an actor pool):

    [... E 123 123] core_worker.cc:2465: Actor with class name: 'MapWorker(MapBatches(TextWriter))' and ID: '...'
    has constructor arguments in the object store and max_restarts > 0. If the arguments in the object store go
    out of scope or are lost, the actor restart will fail. See https://github.com/ray-project/ray/issues/53727 ...

Its cause is not ours to change. Ray core logs it (``CoreWorker::CreateActor``, once per process, to the
driver's stderr) for an actor created with ``max_restarts != 0`` whose constructor takes an argument by
reference. Ray Data's actor pool (``ActorPoolMapOperator._start_actor``, Ray 2.60) starts every ``MapWorker``
with ``max_restarts=-1`` and passes it two refs it made with ``ray.put``: its own ``DataContext`` and the map
transformer (which holds ``fn_constructor_kwargs``, whatever they are). So the line comes with an empty
constructor too (``ray.data.range(1).map_batches(Cls, compute=ActorPoolStrategy(size=1))`` prints it:
ray-project/ray#57733, open). What avoids it, ``max_restarts=0``, gives up the actor restarts that let a job
survive a lost node, and a pool whose actor died then waits for it forever (tried). The restart the line
warns about does work here: Ray Data holds both refs, on the driver's node, for the operator's life
(``tests/test_embed_cluster.py`` kills a node mid-job and the job finishes).

So while a Ray Data pipeline runs, :func:`ray_false_alarms_dropped` passes the process's stderr (file
descriptor 2, which Ray's C++ logger writes to) through a thread that drops the lines of
:data:`FALSE_ALARMS` and passes everything else at once, byte for byte: bucketeer's progress, Python
tracebacks, and every other line of Ray's, its real errors included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from typing import Iterator

__all__ = ["FALSE_ALARMS", "ray_false_alarms_dropped", "drop_false_alarms"]

log = logging.getLogger("bucketeer.ray")

# Whole lines (with their newline) that Ray prints and that say nothing true about a bucketeer job (module docstring).
FALSE_ALARMS: tuple[re.Pattern[bytes], ...] = (
    # "[2026-11-27 02:09:46,390 E 19662 19662] core_worker.cc:2465: Actor with class name: 'MapWorker(...)' ..."
    re.compile(rb"\[[^]\r\n]*\] core_worker\.cc:\d+: Actor with class name: 'MapWorker\([^\r\n]*' has constructor "
               rb"arguments in the object store and max_restarts > 0\.[^\r\n]*(\n|$)"),  # fmt: skip
)


def drop_false_alarms(chunk: bytes) -> tuple[bytes, int]:
    """``chunk`` without the lines of :data:`FALSE_ALARMS`, and how many it had (a C++ log line arrives whole:
    it is one write to a pipe)."""
    dropped = 0
    for pattern in FALSE_ALARMS:
        chunk, n = pattern.subn(b"", chunk)
        dropped += n
    return chunk, dropped


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _pump(source: int, target: int, dropped: list[int]) -> None:
    """Copy ``source`` to ``target`` until end of file, as each read arrives, dropping the false alarms
    (counted in ``dropped[0]``)."""
    broken = False
    while True:
        try:
            chunk = os.read(source, 65536)
        except OSError:  # a pseudo-terminal whose other end closed reads as an error (EIO), not as end of file
            chunk = b""
        if not chunk:
            break
        if broken:
            continue  # the reader of stderr went away: keep draining, so writers never block
        kept, n = drop_false_alarms(chunk)
        dropped[0] += n
        try:
            _write_all(target, kept)
        except OSError:
            broken = True
    os.close(source)


@contextlib.contextmanager
def ray_false_alarms_dropped() -> Iterator[None]:
    """Within the block, stderr (fd 2) without Ray's :data:`FALSE_ALARMS` (module docstring).

    A terminal stays a terminal (a pseudo-terminal in between, of the same size, so progress bars stay bars);
    anything else gets a pipe. On the way out everything written is passed on before the block's next line."""
    sys.stderr.flush()
    saved = os.dup(2)
    if os.isatty(saved):
        import fcntl
        import termios
        import tty

        reader, writer = os.openpty()
        tty.setraw(writer)  # bytes pass as written: no "\n" -> "\r\n", no echo
        with contextlib.suppress(OSError):
            fcntl.ioctl(writer, termios.TIOCSWINSZ, fcntl.ioctl(saved, termios.TIOCGWINSZ, b"\0" * 8))
    else:
        reader, writer = os.pipe()
    os.dup2(writer, 2)
    os.close(writer)
    dropped = [0]
    pump = threading.Thread(target=_pump, args=(reader, saved, dropped), name="stderr-filter", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the last reference to the writing end: the pump reads to its end and stops
        pump.join(timeout=10)
        os.close(saved)
        if dropped[0]:
            log.debug("dropped %d line(s) of Ray's that are false alarms (pipeline.ray_output)", dropped[0])
