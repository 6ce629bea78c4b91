"""What the loop reports: loss, samples/s, data-wait fraction, tokens per step across ranks; the audit trail.

:class:`Window` sums per-rank numbers between two log points; :meth:`Window.reduce` gathers them
from every rank (one ``accelerator.gather`` of a small tensor, at the same step on every rank)
into the logged values. :class:`SampleRecorder` writes ``DIR/rank-<r>.jsonl``, one line per step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["Window", "SampleRecorder", "MetricsFile"]

# per-rank fields gathered at each log point, in this order
_FIELDS = ("loss_sum", "steps", "samples", "tokens_min", "tokens_max", "tokens_sum", "data_wait_s", "step_s")


class Window:
    """Per-rank sums since the last log point (times in seconds, tokens = transformer image tokens)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.values = dict.fromkeys(_FIELDS, 0.0)
        self.values["tokens_min"] = float("inf")
        self.started = time.perf_counter()

    def add(self, loss: float, samples: int, tokens: int, data_wait_s: float, step_s: float) -> None:
        v = self.values
        v["loss_sum"] += loss
        v["steps"] += 1
        v["samples"] += samples
        v["tokens_min"] = min(v["tokens_min"], tokens)
        v["tokens_max"] = max(v["tokens_max"], tokens)
        v["tokens_sum"] += tokens
        v["data_wait_s"] += data_wait_s
        v["step_s"] += step_s

    def reduce(self, accelerator) -> dict[str, float]:
        """Gather every rank's window and return the logged values; then start a new window."""
        local = torch.tensor([self.values[f] for f in _FIELDS], dtype=torch.float64, device=accelerator.device)
        ranks = accelerator.gather(local.unsqueeze(0)).cpu()  # (world, fields)
        col = {f: ranks[:, i] for i, f in enumerate(_FIELDS)}
        wall = time.perf_counter() - self.started
        steps = col["steps"].clamp(min=1)
        out = {
            "loss": float((col["loss_sum"] / steps).mean()),
            "samples_per_s": float(col["samples"].sum() / max(wall, 1e-9)),
            # time blocked on data / step time, averaged over ranks; the worst rank is what stalls DDP
            "data_wait": float((col["data_wait_s"] / col["step_s"].clamp(min=1e-9)).mean()),
            "data_wait_max": float((col["data_wait_s"] / col["step_s"].clamp(min=1e-9)).max()),
            "tokens_per_step_min": float(col["tokens_min"].min()),
            "tokens_per_step_mean": float(col["tokens_sum"].sum() / steps.sum()),
            "tokens_per_step_max": float(col["tokens_max"].max()),
            "step_time_s": float((col["step_s"] / steps).mean()),
        }
        self.reset()
        return out


class SampleRecorder:
    """``DIR/rank-<r>.jsonl``: ``{"epoch", "step", "rank", "sample_ids"}`` per step (+ ``skipped`` if any,
    + ``datasets``, the dataset of each sample, for a plan over several manifests; + what the recipe drew,
    Wan 2.2 A14B ``expert: both``: ``expert`` and ``sigma``, one per sample)."""

    def __init__(self, directory: str | Path | None, rank: int):
        self.file = None
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(directory) / f"rank-{rank}.jsonl", "a", buffering=1)  # a line per write
        self.rank = rank

    def write(self, epoch: int, step: int, sample_ids: list[int], skipped: list[int],
              datasets: list[int] | None = None, drawn: dict[str, Any] | None = None) -> None:  # fmt: skip
        """One step's line; ``drawn``: what the recipe drew for it (:attr:`train.recipes.Denoiser.step_record`)."""
        if self.file is None:
            return
        row: dict[str, Any] = {"epoch": epoch, "step": step, "rank": self.rank, "sample_ids": sample_ids,
                               **(drawn or {})}  # fmt: skip
        if skipped:
            row["skipped"] = skipped
        if datasets is not None:
            row["datasets"] = datasets
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class MetricsFile:
    """``metrics.jsonl`` in the output folder, written by the main process only."""

    def __init__(self, path: Path | None):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1) if path is not None else None

    def write(self, row: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
