"""``python -m pipeline.embed …``: the same options as ``bucketeer embed …`` (for ``ray job submit``)."""


from pipeline.cli import exit_after, module_main

exit_after(module_main, "embed")
