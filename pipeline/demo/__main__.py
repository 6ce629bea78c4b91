import sys

from pipeline.cli import module_main

sys.exit(module_main("demo"))
