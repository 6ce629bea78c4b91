"""The errors a user must act on: one base type, a few kinds, and nothing else.

Every error bucketeer raises for a *user* to fix — a bad option, bad input data, a missing or
foreign artifact, storage that refuses us — is a :class:`BucketeerError`. ``bucketeer`` and
``python -m train`` print it as ``<command>: error: <message>`` (credentials redacted) and exit
with code 2; every other exception is a bug (ours, or in torch, Ray, a codec) and keeps its
traceback and Python's exit code 1. Control flow tests these types, never message text.

The kinds, each also a builtin exception so that ``except ValueError`` and
``pytest.raises(ValueError)`` written against the builtins keep working:

- :class:`UsageError` (a ``ValueError``): a bad option, config key or input file, or an artifact
  that is malformed or was made with other settings. The artifact errors of
  :mod:`manifests.manifest`, :mod:`manifests.cache` and :mod:`manifests.plan` subclass it.
- :class:`MissingError` (a ``FileNotFoundError``): something the user named is not there — a
  source folder, a ``--captions`` table, an artifact folder without its committed root JSON
  (``_manifest.json``, ``_cache.json``, ``_plan.json``; each artifact has its own subclass that is
  also its artifact error, e.g. ``CacheMissingError(CacheError, MissingError)``).
- :class:`StorageError`: storage refused or failed an operation (access denied, bad credentials, a
  bucket that is gone, throttling that outlived every retry of :mod:`manifests.retry`). The
  message names the object and says what failed; see :func:`manifests.storage.call_storage`.

``StorageError`` is deliberately not an ``OSError``: the retry layer classifies ``OSError`` by
errno, and a failure that has already been through it must never be retried again.
"""

from __future__ import annotations

__all__ = ["BucketeerError", "UsageError", "MissingError", "StorageError", "user_error"]


class BucketeerError(Exception):
    """An error the user must act on; its message says what is wrong and what to do."""


class UsageError(BucketeerError, ValueError):
    """A bad option, config value or input (file, table, artifact): change the input and re-run."""


class MissingError(BucketeerError, FileNotFoundError):
    """A file, folder or artifact the user named does not exist (or was never committed)."""


class StorageError(BucketeerError):
    """A storage operation failed in a way the user must fix (permissions, missing bucket, an
    endpoint that stays unavailable); the message names the object."""


def user_error(exc: BaseException) -> BucketeerError | None:
    """The :class:`BucketeerError` that ``exc`` is, or carries as ``cause`` (Ray raises a task's or
    actor method's exception wrapped in a ``RayTaskError`` whose text is the remote traceback);
    None for any other exception."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BucketeerError):
        return cause
    return exc if isinstance(exc, BucketeerError) else None
