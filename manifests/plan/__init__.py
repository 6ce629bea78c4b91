"""The plan artifact: ``PLAN/_plan.json`` and per-rank rows ``(epoch, step, rank, bucket, sample_ids)``.

:mod:`~manifests.plan.schedule` is the pure planning function (one epoch from samples, world shape,
seed); :mod:`~manifests.plan.store` writes plans on storage, reads their rows (``read_plan_rows``,
the one reader) and re-cuts them for an elastic resume; :mod:`~manifests.plan.check` re-verifies
every invariant of a committed plan.
"""

from manifests.plan.schedule import LEFTOVER_POLICIES, PLAN_SCHEMA, PlanConfig
from manifests.plan.store import (
    PLAN_FILE,
    PLAN_FORMAT_VERSION,
    PLAN_KIND,
    PlanError,
    PlanMissingError,
    PlanRows,
    epoch_files,
    rank_part,
    read_plan_meta,
    read_plan_rows,
    read_rank_plan,
    resume_plan,
    write_plan,
)

__all__ = [
    "LEFTOVER_POLICIES",
    "PLAN_FILE",
    "PLAN_FORMAT_VERSION",
    "PLAN_KIND",
    "PLAN_SCHEMA",
    "PlanConfig",
    "PlanError",
    "PlanMissingError",
    "PlanRows",
    "epoch_files",
    "rank_part",
    "read_plan_meta",
    "read_plan_rows",
    "read_rank_plan",
    "resume_plan",
    "write_plan",
]
