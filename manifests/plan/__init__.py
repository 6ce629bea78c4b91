"""The plan artifact: ``PLAN/_plan.json`` and per-rank rows ``(epoch, step, rank, bucket, sample_ids)``.

:mod:`~manifests.plan.schedule` is the pure planning function (one epoch from samples, world shape,
seed); :mod:`~manifests.plan.parts` encodes an epoch as one parquet file with a row group per rank
and reads it whole or one rank at a time; :mod:`~manifests.plan.store` writes plans (all epochs or
a window, extended later) and reads their rows (``read_plan_rows``, the one reader);
:mod:`~manifests.plan.resume` re-cuts a plan for an elastic resume; :mod:`~manifests.plan.check`
re-verifies every invariant of a committed plan. :mod:`~manifests.plan.mix` plans several manifests
together (weights, repeats, the per-sample dataset and caption choice), checked by
:mod:`~manifests.plan.check_mix`.
"""

from manifests.plan.parts import epoch_part
from manifests.plan.resume import resume_plan
from manifests.plan.schedule import LEFTOVER_POLICIES, PLAN_SCHEMA, PlanConfig
from manifests.plan.store import (
    PLAN_FILE,
    PLAN_FORMAT_VERSION,
    PLAN_KIND,
    PlanError,
    PlanMissingError,
    PlanRows,
    extend_mix_plan,
    extend_plan,
    plan_columns,
    read_plan_meta,
    read_plan_rows,
    read_rank_plan,
    write_mix_plan,
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
    "epoch_part",
    "extend_mix_plan",
    "extend_plan",
    "plan_columns",
    "read_plan_meta",
    "read_plan_rows",
    "read_rank_plan",
    "resume_plan",
    "write_mix_plan",
    "write_plan",
]
