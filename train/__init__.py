"""The lean Accelerate trainer: ``accelerate launch -m train --plan PLAN --cache CACHE``.

As a library: build a :class:`TrainJob` (or :func:`job_from_args` from a command line) and
:func:`run` it; it returns a :class:`TrainResult`. The names are imported on first use, so
``import train`` stays cheap (no torch, no accelerate).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from train.job import TrainJob, job_from_args
    from train.loop import StopReason, TrainResult, run

__all__ = ["TrainJob", "TrainResult", "StopReason", "run", "job_from_args"]

# public name -> the module that defines it
_EXPORTS = {
    "TrainJob": "train.job",
    "job_from_args": "train.job",
    "TrainResult": "train.loop",
    "StopReason": "train.loop",
    "run": "train.loop",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'train' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
