"""``python -m pipeline.scan …``: the same options as ``bucketeer scan …`` (for ``ray job submit``)."""

import sys

from pipeline.cli import module_main

sys.exit(module_main("scan"))
