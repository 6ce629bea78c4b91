"""``python -m pipeline.embed …``: the same options as ``bucketeer embed …`` (for ``ray job submit``)."""

import sys

from pipeline.cli import module_main

sys.exit(module_main("embed"))
