"""``python -m pipeline.report …``: the same options as ``bucketeer report …`` (for ``ray job submit``)."""


from pipeline.cli import exit_after, module_main

exit_after(module_main, "report")
