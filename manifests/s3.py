"""s3fs with its own retries off, so that :mod:`manifests.retry` is the only retry layer.

s3fs retries inside every call (``S3FileSystem.retries = 5`` tries, and ``cat_file`` nests two
such loops), and botocore retries again below it; over bucketeer's own loop a throttled read could
be sent ~150 times. :class:`SingleAttemptS3FileSystem` tries once (the class attribute s3fs reads;
it is no constructor option) and :func:`manifests.storage.open_url` sets botocore's
``retries={"total_max_attempts": 1}`` unless the user's ``config_kwargs`` say otherwise.

A class rather than an attribute set on an instance: a filesystem that is pickled (to a Ray task,
a DataLoader worker) is rebuilt from its constructor arguments, and an instance attribute would
be lost on the way. Imported only for ``s3://`` URLs, so ``manifests`` loads without botocore.
"""

from __future__ import annotations

from s3fs import S3FileSystem

__all__ = ["SingleAttemptS3FileSystem", "BOTOCORE_RETRIES"]

# one attempt per request in botocore ("standard" mode; total_max_attempts counts the first try)
BOTOCORE_RETRIES = {"total_max_attempts": 1, "mode": "standard"}


class SingleAttemptS3FileSystem(S3FileSystem):
    """``s3fs.S3FileSystem`` that makes one attempt per call; bucketeer retries above it."""

    retries = 1
