"""Train a diffusion model from a plan and a cache: the lean Accelerate loop, one for every model family.

    accelerate launch -m train --plan PLAN --cache CACHE [--config FILE] [--output-dir DIR] [--resume]
    ACCELERATE_USE_CPU=true accelerate launch --config_file infra/accelerate/cpu-2proc.yaml -m train --plan P --cache C
    python -m train --plan PLAN --cache CACHE                 # one process (the plan must be for 1 rank)

PLAN is made for as many ranks as there are processes (``bucketeer plan --world-size N``); each rank
trains on exactly its plan rows. ``--resume`` continues from the latest checkpoint in
``--output-dir`` with exactly the batches an uninterrupted run would have seen, on any number of
processes that divides the global batch (the plan is re-cut for it). Nothing is listed: the plan,
the cache's ``_cache.json`` and index are read by name, records by ranged reads. A plan over several
manifests (``bucketeer plan M1 M2 ...``) takes one cache per manifest, ``--cache C1,C2,...`` in the
plan's order; each is checked against the cache fingerprint the plan recorded for its dataset, and
each sample is read from its dataset's cache.

What is trained is the cache's model family's recipe (:mod:`train.recipes`: SDXL's UNet, the SD3
and Flux transformers and Wan's video transformer fine-tuned from their pretrained weights, PixArt's
from-scratch transformer), fully or as LoRA adapters (:mod:`train.lora`), with caption dropout
(:mod:`train.data`), an EMA (:mod:`train.ema`) and validation images or clips (:mod:`train.validation`)
as the config says.

This file is the command line only: the arguments become a :class:`train.job.TrainJob`
(:func:`train.job.job_from_args`), which :func:`train.loop.run` trains (setup in :mod:`train.setup`,
the loop and ``train_step`` in :mod:`train.loop`).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from manifests.errors import user_error
from manifests.storage import redact
from train.job import job_from_args, parse_args

__all__ = ["main", "parse_args"]


def main(argv: list[str] | None = None) -> int:
    """Entry point: errors a user can fix (:class:`manifests.errors.BucketeerError`) are printed as one
    line (credentials redacted), exit code 2; any other exception is a bug and keeps its traceback."""
    try:  # a malformed command line is argparse's usage message and SystemExit(2), not caught here
        from train.loop import run  # torch and the rest first: a broken install is a bug (exit 1), not a user error

        return run(job_from_args(argv)).exit_code
    except Exception as e:
        error = user_error(e)
        if error is None:
            raise
        print(f"error: {redact(str(error))}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # a bug: its traceback, then the same exit without teardown as below
        traceback.print_exc()
        code = 1
    # Everything is written and closed, and every rank has passed the final barrier. Tearing the
    # process group down can still hang, in destroy_process_group (pytorch/pytorch#75097) or in
    # interpreter finalization (gloo/autograd threads racing the GIL's teardown, #190489): seen
    # about once in 8-12 two-process runs here, "done" printed and the rank never exiting. So each
    # rank leaves without either; nothing collective happens after the barrier.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
