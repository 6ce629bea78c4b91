"""The plan artifact: ``PLAN/_plan.json`` and per-rank rows ``(epoch, step, rank, bucket, sample_ids)``.

:mod:`~manifests.plan.schedule` is the pure planning function (one epoch from samples, world shape,
seed) and :mod:`~manifests.plan.rows` cuts it into ranks; :mod:`~manifests.plan.mix` says what a plan
draws from (one manifest, or several with weights or repeats: a one-manifest plan is a mixture of one
in every API); :mod:`~manifests.plan.parts` encodes an epoch as one parquet file with a row group per
rank and reads it whole or one rank at a time; :mod:`~manifests.plan.meta` is ``_plan.json`` as typed
objects (:class:`PlanMeta`, read by :func:`read_plan_meta`); :mod:`~manifests.plan.write` writes plans
(all epochs or a window, extended later); :mod:`~manifests.plan.read` reads their rows
(``read_plan_rows``, the one reader); :mod:`~manifests.plan.resume` re-cuts a plan for an elastic
resume; :mod:`~manifests.plan.check` re-verifies every invariant of a committed plan;
:mod:`~manifests.plan.selection` records and re-checks a selection (``--where``, ``--weight-by``: the samples
themselves are chosen by :mod:`manifests.select`).
"""

from manifests.plan.meta import (
    PLAN_FILE,
    PLAN_FORMAT_VERSION,
    PLAN_KIND,
    BucketInfo,
    EpochEntry,
    PlanError,
    PlanInputs,
    PlanMeta,
    PlanMissingError,
    read_plan_meta,
)
from manifests.plan.mix import DatasetSamples, MixRule
from manifests.plan.parts import epoch_part
from manifests.plan.read import PlanRows, plan_columns, read_plan_rows, read_rank_plan
from manifests.plan.resume import resume_plan
from manifests.plan.rows import PLAN_SCHEMA
from manifests.plan.schedule import LEFTOVER_POLICIES, PlanConfig
from manifests.plan.write import extend_plan, write_plan

__all__ = [
    "LEFTOVER_POLICIES",
    "PLAN_FILE",
    "PLAN_FORMAT_VERSION",
    "PLAN_KIND",
    "PLAN_SCHEMA",
    "BucketInfo",
    "DatasetSamples",
    "EpochEntry",
    "MixRule",
    "PlanConfig",
    "PlanError",
    "PlanInputs",
    "PlanMeta",
    "PlanMissingError",
    "PlanRows",
    "epoch_part",
    "extend_plan",
    "plan_columns",
    "read_plan_meta",
    "read_plan_rows",
    "read_rank_plan",
    "resume_plan",
    "write_plan",
]
