"""``python -m pipeline.review …``: the same options as ``bucketeer review …``."""


from pipeline.cli import exit_after, module_main

exit_after(module_main, "review")
