"""``python -m pipeline.plan …``: the same options as ``bucketeer plan …``."""


from pipeline.cli import exit_after, module_main

exit_after(module_main, "plan")
