"""One storage helper for every artifact: fsspec URLs (local path, ``memory://``, ``s3://``).

Everything bucketeer reads or writes goes through :func:`open_url`. A path without a scheme is a
local folder. S3-compatible stores (R2, MinIO, moto) take ``{"endpoint_url": ...}`` in
``storage_options``; credentials come from those options or the standard AWS environment and
config files, and never reach an artifact, a log line or an error message (:func:`redact`).

Every storage operation goes through the retry layer of :mod:`manifests.retry`, the only one
(:func:`open_url` turns off s3fs's and botocore's own). The helpers here do that for their
callers: :func:`read_bytes`, :func:`read_json`, :func:`read_all` and :func:`write_bytes_atomic`
for artifacts, :func:`read_many` for many objects or ranges at once (per-item results),
:class:`RangedFile` for a file-like view that fetches only the ranges a reader asks for (one row
group of a parquet part), and :func:`call_storage` for any other filesystem call (listing,
removing). A failure that outlives
the retries (or is not worth one) leaves them as a :class:`~manifests.errors.StorageError` naming
the object, except ``FileNotFoundError``, which callers turn into what is missing and what to do.
"""

from __future__ import annotations

import io
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence, TypeVar

import fsspec
from fsspec import AbstractFileSystem

from manifests.errors import MissingError, StorageError, UsageError
from manifests.retry import (ATTEMPTS_ENV, THROTTLE_ENV, RetryPolicy, is_permanent, is_storage_failure, is_throttled,
                             is_timeout, is_transient, with_retries)  # fmt: skip

__all__ = [
    "StorageError",
    "open_url",
    "join",
    "parse_storage_options",
    "public_options",
    "redact",
    "call_storage",
    "storage_error",
    "endpoint",
    "read_bytes",
    "read_many",
    "read_all",
    "write_bytes_atomic",
    "write_json_atomic",
    "read_json",
    "read_artifact_meta",
    "check_artifact",
    "is_local",
    "RangedFile",
]

T = TypeVar("T")

# keys of storage_options that carry secrets; never written anywhere
_SECRET_KEYS = re.compile(r"(secret|token|password|key|credential|session)", re.IGNORECASE)
# "s3://KEY:SECRET@bucket/x" -> "s3://***@bucket/x"
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
# AWS-style key ids and anything following "secret"/"signature"-like words in free text
_AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{12,}\b")
_KV_SECRET = re.compile(
    r"(?i)((?:aws_)?(?:secret(?:_access)?_key|secret|session_token|token|password|signature|credential)"
    r"[\"']?\s*[:=]\s*[\"']?)[^\s\"',}&]+"
)


_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """Parse ``--storage-options`` JSON into a dict; ``None`` or empty gives ``{}``.

    Raises UsageError naming the option when the text is not a JSON object.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--storage-options is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(value, dict):
        raise UsageError("--storage-options must be a JSON object, e.g. '{\"endpoint_url\": \"https://…\"}'")
    return value


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for a URL or local path; the path has no trailing slash.

    ``storage_options`` go to the filesystem constructor (``endpoint_url`` is moved into
    ``client_kwargs`` for s3fs, which is where botocore expects it). ``s3://`` URLs get an s3fs
    that makes one attempt per call and botocore ``retries={"total_max_attempts": 1}``
    (:mod:`manifests.s3`): :mod:`manifests.retry` is the only retry layer. Every request has
    ``connect_timeout`` and ``read_timeout`` (:func:`manifests.s3.storage_timeouts`), uploads
    included. Entries the user's ``config_kwargs`` give win over these settings (a ``retries``
    entry then adds its tries to ours). Where obstore is installed and can express the options, the
    ``s3://`` filesystem sends its GETs, PUTs and listing pages through obstore
    (:class:`manifests.objstore.ObstoreS3FileSystem`, ``bucketeer_client``/``$BUCKETEER_STORAGE_CLIENT``
    choose). Raises UsageError for a bad timeout variable or client choice.
    """
    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        from manifests.s3 import BOTOCORE_RETRIES, storage_timeouts

        cls = _s3_client(options)
        if "endpoint_url" in options:
            client_kwargs = dict(options.get("client_kwargs") or {})
            client_kwargs.setdefault("endpoint_url", options.pop("endpoint_url"))
            options["client_kwargs"] = client_kwargs
        connect, read = storage_timeouts()
        options["config_kwargs"] = {"retries": BOTOCORE_RETRIES, "connect_timeout": connect, "read_timeout": read,
                                    **(options.get("config_kwargs") or {})}  # fmt: skip
        fs = cls(**options)
        path = fs._strip_protocol(url)
        return fs, path.rstrip("/") or path
    if "://" not in url:
        url = os.path.abspath(os.path.expanduser(url))
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, path.rstrip("/") or path


def _s3_client(options: dict[str, Any]) -> type[AbstractFileSystem]:
    """The filesystem class for S3 ``options`` (``bucketeer_client`` popped): obstore under the hot
    requests (:mod:`manifests.objstore`) where it can say every option, else s3fs. UsageError when
    obstore is asked for by name and cannot serve."""
    from manifests.objstore import CLIENT_ENV, ObstoreS3FileSystem, client_choice, obstore_refusal
    from manifests.s3 import SingleAttemptS3FileSystem

    choice = client_choice(options)
    if choice == "fsspec":
        return SingleAttemptS3FileSystem
    refusal = obstore_refusal(options)
    if refusal is None:
        return ObstoreS3FileSystem
    if choice == "obstore":
        raise UsageError(f"the obstore client was asked for ({CLIENT_ENV}) but cannot serve: {refusal}")
    return SingleAttemptS3FileSystem


def is_local(fs: AbstractFileSystem) -> bool:
    """True for the local filesystem, where renames are atomic and cheap."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def join(base: str, *parts: str) -> str:
    """Join path parts with ``/`` (object-store style, also valid locally)."""
    out = base.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def public_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The storage options that may be recorded in an artifact: no secrets, only e.g. the endpoint."""
    out: dict[str, Any] = {}
    for k, v in (storage_options or {}).items():
        if _SECRET_KEYS.search(k):
            continue
        if isinstance(v, dict):
            out[k] = public_options(v)
        elif isinstance(v, str):
            out[k] = redact(v)
        elif isinstance(v, (int, float, bool)) or v is None:
            out[k] = v
    return out


def redact(text: str, storage_options: dict[str, Any] | None = None) -> str:
    """Remove credentials from a URL or message.

    Removes userinfo in URLs, AWS key ids and ``secret=…``-style pairs; and, because a storage
    library may echo a credential in a form no pattern knows, the literal secret values found in
    ``storage_options`` and the standard AWS environment variables, wherever they appear.
    """
    secrets = [os.environ.get(k, "") for k in _SECRET_ENV]
    stack = [storage_options or {}]
    while stack:
        for k, v in stack.pop().items():
            if isinstance(v, dict):
                stack.append(v)
            elif isinstance(v, str) and _SECRET_KEYS.search(k):
                secrets.append(v)
    for secret in sorted({x for x in secrets if len(x) >= 4}, key=len, reverse=True):
        text = text.replace(secret, "***")
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    text = _AWS_KEY_ID.sub("***", text)
    return _KV_SECRET.sub(r"\1***", text)


def _url(fs: AbstractFileSystem, path: str) -> str:
    """How a message names an object: the path for a local file, else the full URL (redacted)."""
    return redact(path if is_local(fs) else fs.unstrip_protocol(path), fs.storage_options)


def endpoint(fs: AbstractFileSystem) -> str | None:
    """The endpoint a filesystem talks to, for messages (redacted): an S3 ``endpoint_url``, "AWS S3"
    for s3fs without one, None for a local or in-memory filesystem."""
    if is_local(fs) or "s3" not in fs.protocol:
        return None
    url = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    return redact(url, fs.storage_options) if url else "AWS S3"


def storage_error(
    fs: AbstractFileSystem, action: str, path: str, exc: BaseException, waited: float | None = None
) -> StorageError:
    """The one-line :class:`StorageError` for ``exc``, which ``action`` (e.g. ``"reading"``) on
    ``path`` raised after the retry layer, ``waited`` seconds after its first try: names the
    object, the error, the endpoint and the time a transient failure was retried, and what to do;
    redacted."""
    where = endpoint(fs)
    if is_permanent(exc):
        hint = ("; check the file's permissions" if is_local(fs)
                else "; check the credentials and --storage-options (endpoint_url, key/secret) for this bucket")
    elif is_transient(exc) and is_throttled(exc):
        waiting = f" for {waited:.0f} s" if waited is not None else ""
        hint = (f"; storage{' at ' + where if where else ''} kept throttling (asking for fewer requests){waiting}, "
                f"past ${THROTTLE_ENV} ({RetryPolicy.from_env().throttle_seconds:g} s): lower the request rate "
                "(fewer workers or reads in flight) or raise it, and try again")  # fmt: skip
    elif is_transient(exc):
        waiting = f" over {waited:.1f} s" if waited is not None else ""
        knobs = f"${ATTEMPTS_ENV}, $BUCKETEER_STORAGE_CONNECT_TIMEOUT/_READ_TIMEOUT/_MIN_RATE" if is_timeout(exc) \
            else f"${ATTEMPTS_ENV}"  # fmt: skip
        answer = "did not answer in time" if is_timeout(exc) else "still failing"
        hint = (f"; storage{' at ' + where if where else ''} {answer} after {RetryPolicy.from_env().attempts} "
                f"attempts{waiting} ({knobs}), try again later")  # fmt: skip
    else:
        hint = ""
    message = f"{action} {_url(fs, path)}: {type(exc).__name__}: {exc}{hint}"
    return StorageError(redact(" ".join(message.split()), fs.storage_options))


def call_storage(fs: AbstractFileSystem, action: str, path: str, call: Callable[[], T]) -> T:
    """Run one storage operation ``call()`` on ``path`` through the retry layer.

    Raises FileNotFoundError as the filesystem raised it (callers say what is missing), and
    :class:`StorageError` (see :func:`storage_error`) for any other storage failure. Other
    exceptions (bugs) propagate unchanged, traceback and all.
    """
    started = time.monotonic()
    try:
        return with_retries(call)
    except FileNotFoundError:
        raise
    except Exception as e:
        if is_storage_failure(e):
            raise storage_error(fs, action, path, e, time.monotonic() - started) from e
        raise


def read_bytes(fs: AbstractFileSystem, path: str, start: int | None = None, end: int | None = None) -> bytes:
    """An object's bytes, or bytes ``[start, end)`` of it; see :func:`call_storage` for what it raises."""
    return call_storage(fs, "reading", path, lambda: fs.cat_file(path, start=start, end=end))


def read_many(
    fs: AbstractFileSystem,
    paths: Sequence[str],
    starts: Sequence[int | None] | None = None,
    ends: Sequence[int | None] | None = None,
    *,
    threads: int = 16,
    files: Any = None,
) -> list[bytes | Exception]:
    """Read many objects or byte ranges ``[start, end)``, many in flight; per item its bytes or
    the exception its read ended with (the filesystem's own, e.g. ``PermissionError``), in order.

    ``files`` (a :class:`manifests.localfiles.LocalFiles`, for a local ``fs`` only): read through its held
    descriptors instead (one ``pread`` per range, in this thread; a local error is not retried).

    ``starts`` default to 0 and ``ends`` to None (the whole object): a ranged GET each, never a
    HEAD first. All reads go out as one concurrent ``cat_ranges``; the ones that failed are
    retried each on its own through :func:`manifests.retry.with_retries`, the failed first read
    counting as its first attempt, so a throttled moment never fails an item while a permanent
    error (access denied, no such key) comes back after one try.
    """
    if not paths:
        return []
    starts = list(starts) if starts is not None else [0] * len(paths)
    ends = list(ends) if ends is not None else [None] * len(paths)
    if files is not None:
        return [files.read(p, s or 0, e) for p, s, e in zip(paths, starts, ends)]
    results = list(with_retries(lambda: fs.cat_ranges(list(paths), starts, ends, on_error="return")))
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    if not failed:
        return results

    def again(i: int) -> bytes | Exception:
        first = [results[i]]

        def read() -> bytes:
            if first:  # replays the batched read's failure: attempts and backoff are with_retries'
                raise first.pop()
            return fs.cat_file(paths[i], start=starts[i], end=ends[i])

        try:
            return with_retries(read)
        except Exception as e:  # the caller decides per item
            return e

    with ThreadPoolExecutor(max_workers=min(threads, len(failed)), thread_name_prefix="read-retry") as pool:
        for i, result in zip(failed, pool.map(again, failed)):
            results[i] = result
    return results


def read_all(fs: AbstractFileSystem, paths: Sequence[str]) -> list[bytes]:
    """Whole objects, concurrently (:func:`read_many`), or the first failure: FileNotFoundError
    as raised, any other storage failure as a :class:`StorageError` naming the object."""
    started = time.monotonic()
    results = read_many(fs, paths)
    for path, result in zip(paths, results):
        if isinstance(result, FileNotFoundError):
            raise result
        if isinstance(result, Exception):
            raise storage_error(fs, "reading", path, result, time.monotonic() - started) from result
    return results  # type: ignore[return-value]  # every item is bytes here


def write_bytes_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` so that a reader sees the old object, or all of the new one, never a part.

    An object-store PUT is already atomic; on a local disk we write a temporary sibling and
    rename it over the target. Retried; raises :class:`StorageError` when storage refuses.
    """
    parent = path.rsplit("/", 1)[0]
    if is_local(fs):

        def write() -> None:
            fs.makedirs(parent, exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

        call_storage(fs, "writing", path, write)
    else:
        call_storage(fs, "writing", path, lambda: fs.pipe_file(path, data))


def write_json_atomic(fs: AbstractFileSystem, path: str, obj: Any) -> int:
    """Write ``obj`` as pretty, key-sorted JSON atomically (see :func:`write_bytes_atomic`); returns its bytes."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    write_bytes_atomic(fs, path, data)
    return len(data)


def read_json(fs: AbstractFileSystem, path: str) -> Any:
    """Read a JSON file; FileNotFoundError propagates so callers can say what is missing.

    Raises StorageError for other storage failures, json.JSONDecodeError for bad content.
    """
    # one GET: fs.open() would first HEAD the object for its size (the trainer must not HEAD)
    return json.loads(read_bytes(fs, path))


def read_artifact_meta(
    fs: AbstractFileSystem,
    root: str,
    url: str,
    *,
    file: str,
    kind: str,
    version: int,
    error: type[UsageError],
    missing: type[MissingError],
    missing_hint: str,
    version_hint: str,
) -> dict[str, Any]:
    """Read and check an artifact's root JSON (``_manifest.json``, ``_plan.json``, ``_cache.json``).

    The file is what makes the folder valid: without it ``missing`` is raised (the artifact's
    subclass of both ``error`` and MissingError), of another ``kind`` or format ``version``
    ``error``, each with the URL (redacted) and the hint saying what to do. StorageError when
    storage refuses the read.
    """
    try:
        meta = read_json(fs, join(root, file))
    except FileNotFoundError:
        raise missing(f"{redact(url)} has no {file}: {missing_hint}") from None
    except json.JSONDecodeError as e:
        raise error(f"{redact(url)}/{file} is not valid JSON ({e.msg})") from None
    check_artifact(meta, url, file=file, kind=kind, version=version, error=error, version_hint=version_hint)
    return meta


def check_artifact(meta: Any, url: str, *, file: str, kind: str, version: int, error: type[UsageError],
                   version_hint: str) -> None:  # fmt: skip
    """Refuse an artifact's root JSON of another ``kind`` or format ``version``: ``error`` in one line,
    naming ``url`` (redacted) and saying what to do (``version_hint``)."""
    found = meta.get("kind") if isinstance(meta, Mapping) else None
    if found != kind:
        raise error(f"{redact(url)}/{file} is not a {kind} (kind={found!r})")
    if meta.get("format_version") != version:
        raise error(
            f"{redact(url)} has {file} format version {meta.get('format_version')!r}; this bucketeer reads "
            f"version {version}. {version_hint}"
        )


class RangedFile(io.RawIOBase):
    """A read-only, seekable file over one object of known ``size`` bytes: each ``read`` is one
    ranged GET through :func:`read_bytes` (retried), never a HEAD or a whole-object download.

    For pyarrow's ``ParquetFile``: it reads the footer, then only the column chunks of the row
    groups and columns asked for. ``size`` comes from the artifact's metadata (a manifest part's
    ``bytes``). Failures raise as :func:`read_bytes` raises them.
    """

    def __init__(self, fs: AbstractFileSystem, path: str, size: int):
        super().__init__()
        self.fs, self.path, self.size = fs, path, int(size)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = min(max(base + offset, 0), self.size)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        if end <= self._pos:
            return b""
        data = read_bytes(self.fs, self.path, self._pos, end)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
