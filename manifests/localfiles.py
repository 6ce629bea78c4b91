"""Files of the local disk held open for positional reads: :class:`LocalFiles`, the cache reader's local path."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

__all__ = ["LocalFiles"]


class LocalFiles:
    """Files of the local disk held open for positional reads, shared by threads.

    A range costs one ``os.pread`` on a held descriptor, where fsspec's ``LocalFileSystem`` opens,
    stats, seeks, reads and closes the file for each (about a dozen system calls, each one a GIL
    release that a reading thread then waits to take back while the training step runs; see
    ``benchmarks/README.md``, the loader). At most ``keep`` descriptors stay open,
    the least recently used closed first, never one a read is using. A file replaced (renamed over)
    after its descriptor was opened is read as it was: for files that do not change once written,
    such as a cache's shards. Needs ``os.pread`` (POSIX): :attr:`available`.
    """

    available = hasattr(os, "pread")  # False on Windows: read through fsspec there

    def __init__(self, keep: int = 64):
        self.keep = keep
        self._held: OrderedDict[str, list[int]] = OrderedDict()  # path -> [descriptor, reads using it]
        self._lock = threading.Lock()

    def read(self, path: str, start: int, end: int | None) -> bytes | Exception:
        """Bytes ``[start, end)`` of ``path`` (to its end for None; fewer where the file ends first, as a
        ranged GET), or the error the read ended with (``FileNotFoundError``, ``PermissionError``...)."""
        try:
            entry = self._take(path)
        except OSError as e:
            return e
        try:
            size = (os.fstat(entry[0]).st_size if end is None else end) - start
            parts, done = [], 0
            while done < size:  # pread may return less than asked (a signal, > 2 GiB): read on to the end
                part = os.pread(entry[0], size - done, start + done)
                if not part:
                    break
                parts.append(part)
                done += len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        except OSError as e:
            return e
        finally:
            with self._lock:
                entry[1] -= 1

    def _take(self, path: str) -> list[int]:
        with self._lock:
            entry = self._held.get(path)
            if entry is not None:
                self._held.move_to_end(path)
                entry[1] += 1
                return entry
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        with self._lock:
            entry = self._held.get(path)
            if entry is not None:  # another thread opened it meanwhile: use theirs
                os.close(fd)
                entry[1] += 1
                return entry
            entry = self._held[path] = [fd, 1]
            idle = [p for p, (_, users) in self._held.items() if users == 0]  # least recently used first
            for old in idle[: max(0, len(self._held) - self.keep)]:
                os.close(self._held.pop(old)[0])
            return entry

    def close(self) -> None:
        """Close every descriptor no read is using (all of them once the reads are done)."""
        with self._lock:
            for path in [p for p, (_, users) in self._held.items() if users == 0]:
                os.close(self._held.pop(path)[0])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: os may be gone
            pass
