"""``python -m pipeline.scan …``: the same options as ``bucketeer scan …`` (for ``ray job submit``)."""


from pipeline.cli import exit_after, module_main

exit_after(module_main, "scan")
