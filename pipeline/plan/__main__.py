"""``python -m pipeline.plan …``: the same options as ``bucketeer plan …``."""

import sys

from pipeline.cli import module_main

sys.exit(module_main("plan"))
