"""``python -m pipeline.annotate …``: the same options as ``bucketeer annotate …`` (for ``ray job submit``)."""


from pipeline.cli import exit_after, module_main

exit_after(module_main, "annotate")
