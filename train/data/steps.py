"""This rank's plan rows, read one epoch at a time: :class:`PlanStep` and :class:`RankSteps`.

A rank reads only its own rows of the plan (memory is one epoch of this rank's rows, the next epoch
read on a thread while this one trains); ``len()`` comes from ``_plan.json`` alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from manifests.plan import PlanMeta, read_plan_meta, read_plan_rows

__all__ = ["PlanStep", "RankSteps", "rank_steps"]


@dataclass(frozen=True)
class PlanStep:
    """One plan row of this rank: the samples of one step, all of one bucket.

    Mixture plans: ``dataset`` (B,) uint8, the dataset (and cache) of each sample, None for a
    one-manifest plan; ``caption_index`` (B,) uint8, the caption the plan chose from each sample's
    caption list, None for plans without caption lists (caption 0).
    """

    epoch: int
    step: int
    bucket: str
    sample_ids: tuple[int, ...]
    dataset: np.ndarray | None = None  # (B,) mixture plans: the dataset of each sample; None: one manifest
    caption_index: np.ndarray | None = None  # (B,) which caption of each sample the plan chose; None: caption 0


class RankSteps:
    """This rank's plan rows from a position on, in order, read one epoch at a time.

    ``len()`` is known from ``_plan.json`` alone (every rank gets the same). Iterating yields
    :class:`PlanStep` s; :meth:`epochs` yields them epoch by epoch, reading the next epoch's rows
    (two ranged reads) on a thread while the current one is used. Memory: two epochs of this
    rank's rows at most. A plan error (a missing or malformed file) is raised at that epoch.
    """

    def __init__(self, plan_url: str, rank: int, storage_options: dict | None = None, *,
                 meta: PlanMeta | None = None, start: tuple[int, int] = (0, 0),
                 limit: int | None = None):  # fmt: skip
        self.url, self.rank, self.storage_options = plan_url, rank, storage_options
        self.meta = meta or read_plan_meta(plan_url, storage_options)
        self.start = start
        left = limit
        self.parts: list[tuple[int, int, int]] = []  # (epoch, first step to take, steps to take)
        for e in self.meta.epochs:
            first, end = e.first_step, e.first_step + e.steps
            if (e.epoch, end) <= start or (left is not None and left <= 0):
                continue
            skip = max(start[1] - first, 0) if e.epoch == start[0] else 0
            count = end - first - skip if left is None else min(end - first - skip, left)
            self.parts.append((e.epoch, first + skip, count))
            left = None if left is None else left - count

    def __len__(self) -> int:
        return sum(count for _, _, count in self.parts)

    @property
    def last_epoch(self) -> int | None:
        """The last epoch these steps reach (None when there is no step)."""
        return self.parts[-1][0] if self.parts else None

    def _read(self, epoch: int, first: int, count: int) -> list[PlanStep]:
        table = read_plan_rows(self.url, [epoch], [self.rank], storage_options=self.storage_options,
                               meta=self.meta).table()  # fmt: skip
        steps = table.column("step").to_numpy()
        keep = table.filter((steps >= first) & (steps < first + count))
        rows = [keep.column(c).to_pylist() for c in ("step", "bucket", "sample_ids")]
        extra = [[np.asarray(v, np.uint8) for v in keep.column(c).to_pylist()] if c in keep.column_names
                 else [None] * keep.num_rows for c in ("dataset", "caption_index")]  # fmt: skip
        return [PlanStep(epoch, s, b, tuple(i), d, c) for s, b, i, d, c in zip(*rows, *extra)]

    def epochs(self) -> Iterator[list[PlanStep]]:
        with ThreadPoolExecutor(1, thread_name_prefix=f"bucketeer-plan-{self.rank}") as pool:
            ahead = [pool.submit(self._read, *part) for part in self.parts[:1]]
            for i in range(len(self.parts)):
                current = ahead.pop(0).result()
                if i + 1 < len(self.parts):
                    ahead.append(pool.submit(self._read, *self.parts[i + 1]))
                yield current

    def __iter__(self) -> Iterator[PlanStep]:
        for steps in self.epochs():
            yield from steps


def rank_steps(
    plan_url: str, rank: int, storage_options: dict | None = None, *, start: tuple[int, int] = (0, 0),
    limit: int | None = None,
) -> RankSteps:  # fmt: skip
    """This rank's plan rows from position ``start = (epoch, first step not yet run)`` on, in order,
    at most ``limit`` of them (read lazily, epoch by epoch: see :class:`RankSteps`).

    Reads ``_plan.json`` now, this rank's rows as they are iterated. Raises PlanError (a ValueError)
    for a bad plan.
    """
    return RankSteps(plan_url, rank, storage_options, start=start, limit=limit)
