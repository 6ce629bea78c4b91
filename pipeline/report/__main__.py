"""``python -m pipeline.report …``: the same options as ``bucketeer report …`` (for ``ray job submit``)."""

import sys

from pipeline.cli import module_main

sys.exit(module_main("report"))
