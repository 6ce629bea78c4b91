"""One storage helper for every artifact: fsspec URLs (local path, ``memory://``, ``s3://``).

Everything bucketeer reads or writes goes through :func:`open_url`. A path without a scheme is a
local folder. S3-compatible stores (R2, MinIO, moto) take ``{"endpoint_url": ...}`` in
``storage_options``; credentials come from those options or the standard AWS environment and
config files, and never reach an artifact, a log line or an error message (:func:`redact`).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

__all__ = [
    "StorageError",
    "open_url",
    "join",
    "parse_storage_options",
    "public_options",
    "redact",
    "write_bytes_atomic",
    "write_json_atomic",
    "read_json",
    "read_artifact_meta",
    "is_local",
]

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


class StorageError(RuntimeError):
    """A storage operation failed in a way the user must fix (permissions, missing bucket...)."""


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """Parse ``--storage-options`` JSON into a dict; ``None`` or empty gives ``{}``.

    Raises ValueError naming the option when the text is not a JSON object.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--storage-options is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError("--storage-options must be a JSON object, e.g. '{\"endpoint_url\": \"https://…\"}'")
    return value


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for a URL or local path; the path has no trailing slash.

    ``storage_options`` go to the filesystem constructor (``endpoint_url`` is moved into
    ``client_kwargs`` for s3fs, which is where botocore expects it).
    """
    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")) and "endpoint_url" in options:
        client_kwargs = dict(options.get("client_kwargs") or {})
        client_kwargs.setdefault("endpoint_url", options.pop("endpoint_url"))
        options["client_kwargs"] = client_kwargs
    if "://" not in url:
        url = os.path.abspath(os.path.expanduser(url))
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, path.rstrip("/") or path


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


def write_bytes_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` so that a reader sees the old object, or all of the new one, never a part.

    An object-store PUT is already atomic; on a local disk we write a temporary sibling and
    rename it over the target.
    """
    parent = path.rsplit("/", 1)[0]
    if is_local(fs):
        fs.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def write_json_atomic(fs: AbstractFileSystem, path: str, obj: Any) -> None:
    """Write ``obj`` as pretty, key-sorted JSON atomically (see :func:`write_bytes_atomic`)."""
    write_bytes_atomic(fs, path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(fs: AbstractFileSystem, path: str) -> Any:
    """Read a JSON file; FileNotFoundError propagates so callers can say what is missing."""
    # one GET: fs.open() would first HEAD the object for its size (the trainer must not HEAD)
    return json.loads(fs.cat_file(path))


def read_artifact_meta(
    fs: AbstractFileSystem,
    root: str,
    url: str,
    *,
    file: str,
    kind: str,
    version: int,
    error: type[Exception],
    missing_hint: str,
    version_hint: str,
) -> dict[str, Any]:
    """Read and check an artifact's root JSON (``_manifest.json``, ``_plan.json``, ``_cache.json``).

    The file is what makes the folder valid: without it, or of another ``kind`` or format
    ``version``, ``error`` is raised with the URL (redacted) and the hint saying what to do.
    """
    try:
        meta = read_json(fs, join(root, file))
    except FileNotFoundError:
        raise error(f"{redact(url)} has no {file}: {missing_hint}") from None
    except json.JSONDecodeError as e:
        raise error(f"{redact(url)}/{file} is not valid JSON ({e.msg})") from None
    found = meta.get("kind") if isinstance(meta, dict) else None
    if found != kind:
        raise error(f"{redact(url)}/{file} is not a {kind} (kind={found!r})")
    if meta.get("format_version") != version:
        raise error(
            f"{redact(url)} has {file} format version {meta.get('format_version')!r}; this bucketeer reads "
            f"version {version}. {version_hint}"
        )
    return meta
