
from pipeline.cli import exit_after, module_main

exit_after(module_main, "demo")
