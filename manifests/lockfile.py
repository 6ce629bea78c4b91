"""The mechanics of an artifact's writer lock file, ``ROOT/_writer.json``, on one filesystem: create it whole or
not at all, read it with its version and its age by the store's clock, take over a version judged dead, renew
it, remove it. Who holds it and when a holder is gone is :mod:`manifests.lock`'s (which says why each step is
as it is); this module knows bytes, versions and clocks only.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import email.utils
import errno
import os
import uuid
from typing import Any, Mapping

from fsspec import AbstractFileSystem

from manifests.storage import call_storage, is_local, join

__all__ = ["LOCK_FILE", "LockFile"]

LOCK_FILE = "_writer.json"
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}  # a filesystem without links


def _answer_date(head: Mapping[str, Any]) -> _dt.datetime | None:
    """The ``Date`` header of an S3 answer (the store's clock when it answered), or None without one."""
    text = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(text) if text else None
    except (TypeError, ValueError):
        return None


def _version(st: os.stat_result) -> str:
    """A local lock file's version: a heartbeat or a take-over writes a new file (inode) with a new mtime."""
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


class LockFile:
    """The mechanics of one artifact's ``_writer.json`` on one filesystem."""

    def __init__(self, fs: AbstractFileSystem, root: str, url: str):
        self.fs, self.root, self.url = fs, root, url
        self.path = join(root, LOCK_FILE)
        self.local = is_local(fs)

    def create(self, data: bytes) -> bool:
        """Create the lock file if there is none; False when there is one."""
        if self.local:
            return call_storage(self.fs, "locking", self.path, lambda: self._create_local(data))

        def create_remote() -> bool:
            return self._put(data, IfNoneMatch="*")

        return call_storage(self.fs, "locking", self.path, create_remote)

    def _create_local(self, data: bytes) -> bool:
        """Write the lock whole to a temporary sibling, then publish it with ``link`` (no-replace): a lock is
        visible whole or not at all. A failed write (ENOSPC) leaves neither file."""
        self.fs.makedirs(self.root, exist_ok=True)
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:  # our temporary was removed by the holder's clean-up (remove_temporaries)
            return False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        return self._create_exclusive(data)

    def _create_exclusive(self, data: bytes) -> bool:
        """``O_EXCL`` create and write, for a filesystem without hard links; a lock not written whole is removed."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise
        return True

    def read(self, with_age: bool = True) -> tuple[bytes | None, str | None, float]:
        """The lock's bytes, a version tag for a conditional take-over (S3: the ETag; a folder: inode, mtime
        and size), and the seconds since the lock was last written by the store's clock (None, None, 0: no
        lock). ``with_age=False`` (a release, a heartbeat): age 0, and nothing is written to learn the store's
        time, so a full disk cannot stop a run from releasing its lock."""

        def read_it() -> tuple[bytes, str | None, float]:
            if self.local:
                with open(self.path, "rb") as f:
                    st = os.fstat(f.fileno())
                    data = f.read()
                return data, _version(st), (self._local_now() - st.st_mtime) if with_age else 0.0
            bucket, key, _ = self.fs.split_path(self.path)
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)  # before the read: a newer object
            etag, written = head.get("ETag"), head["LastModified"]  # fails the If-Match
            age = ((_answer_date(head) or self._remote_now()) - written).total_seconds() if with_age else 0.0
            return self.fs.cat_file(self.path), etag, age

        try:
            self.fs.invalidate_cache(self.path)
            return call_storage(self.fs, "reading", self.path, read_it)
        except FileNotFoundError:
            return None, None, 0.0

    def _local_now(self) -> float:
        """The folder's time now: the mtime of a probe file written here, which a network filesystem's
        server sets as it sets the lock file's."""
        probe = f"{self.path}.clock-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(probe)

    def _remote_now(self) -> _dt.datetime:
        """The store's time now, for an endpoint whose answers carry no ``Date``: a probe object's ``LastModified``."""
        probe = f"{self.path}.clock-{uuid.uuid4().hex}"
        bucket, key, _ = self.fs.split_path(probe)
        self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"")
        try:
            return self.fs.call_s3("head_object", Bucket=bucket, Key=key)["LastModified"]
        finally:
            with contextlib.suppress(OSError):
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key)

    def replace(self, etag: str | None, data: bytes) -> bool:
        """Take over the lock :meth:`read` saw at version ``etag`` (judged dead); False when another writer took
        it first."""
        if self.local:
            aside = f"{self.path}.stale-{uuid.uuid4().hex}"
            try:
                os.rename(self.path, aside)  # atomic: of two writers, one renames it, the other finds none
            except FileNotFoundError:
                return False
            if etag is not None and _version(os.stat(aside)) != etag:
                # between our read and our rename another writer took the dead lock over and published its
                # own: that is what we moved aside, so give it back (no-replace) and leave it theirs
                try:
                    os.link(aside, self.path)
                except OSError as e:
                    if e.errno in _NO_LINKS and not os.path.exists(self.path):
                        os.rename(aside, self.path)
                with contextlib.suppress(OSError):
                    os.remove(aside)
                return False
            with contextlib.suppress(OSError):
                os.remove(aside)
            return self.create(data)

        def put_if_match() -> bool:
            return self._put(data, **({"IfMatch": etag} if etag else {}))

        return call_storage(self.fs, "locking", self.path, put_if_match)

    def renew(self, etag: str | None, data: bytes) -> None:
        """Rewrite our own lock (its heartbeat); on S3 only if it is still the version we read."""
        if self.local:
            tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)
            except BaseException:  # a full disk: the old heartbeat stays, whole
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
        else:
            self._put(data, **({"IfMatch": etag} if etag else {}))

    def _put(self, data: bytes, **condition: str) -> bool:
        """One conditional PUT of the lock object (S3's ``If-None-Match: *`` or ``If-Match: <ETag>``, which AWS,
        R2 and moto honour); False when the condition failed (412, or 404 for an If-Match on a gone object).
        The request is made here rather than through ``pipe_file``, whose conditional modes older s3fs lack."""
        bucket, key, _ = self.fs.split_path(self.path)
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except FileExistsError:  # newer s3fs: a failed If-None-Match
            return False
        except OSError as e:  # older s3fs: 412 Precondition Failed is EINVAL; 404 is FileNotFoundError
            if isinstance(e, FileNotFoundError) or e.errno == errno.EINVAL:
                return False
            raise
        finally:
            self.fs.invalidate_cache(self.path)
        return True

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            call_storage(self.fs, "unlocking", self.path, lambda: self.fs.rm_file(self.path))

    def remove_temporaries(self) -> int:
        """Delete the ``*.tmp-*`` files a killed writer left under the root (local disks only): also a lock's
        unpublished ``_writer.json.tmp-*`` (which is never read as a lock: only ``_writer.json`` is), and a
        ``_writer.json.clock-*`` probe. A ``.stale-*`` lock set aside by a take-over stays: a writer taking over
        at this moment may be about to give it back."""
        if not self.local or not os.path.isdir(self.root):
            return 0
        removed = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                if ".tmp-" in name or name.startswith(f"{LOCK_FILE}.clock-"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(folder, name))
                        removed += 1
        return removed
