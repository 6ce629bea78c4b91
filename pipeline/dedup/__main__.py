"""``python -m pipeline.dedup …``: the same options as ``bucketeer dedup …``."""


from pipeline.cli import exit_after, module_main

exit_after(module_main, "dedup")
