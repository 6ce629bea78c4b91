"""Elastic resume: the rest of a plan, from a position, re-cut for another world size.

``(epoch, step)`` is the position reached: ``step`` is the first step of ``epoch`` that was NOT run
(steps ``< step`` are consumed, under world size N1). :func:`resume_plan` writes a new plan folder
for world size N2 holding steps ``step..end`` of ``epoch`` (original step numbers kept) and every
later epoch the parent holds; earlier epochs are absent. Its ``_plan.json`` names the parent in
``resumed_from`` and lists the epochs it holds with their ``first_step``. The global batch stays
the same (``N1*B1 == N2*B2``, so N2 must divide it): each remaining global batch is cut into N2
slices instead of N1. No consumed sample is seen again in that epoch and none is skipped; later
epochs equal those of a fresh plan with (N2, B2). In packing mode each bucket's global batch is
kept and must split evenly over N2. Only the parent plan is read (no manifest, no cache), one
epoch at a time, so a trainer's rank 0 can call it and the others wait on a barrier.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from manifests.errors import UsageError
from manifests.plan.meta import EpochEntry, PlanError, PlanMeta, ResumedFrom, read_plan_meta
from manifests.plan.parts import EpochFile
from manifests.plan.read import read_plan_rows
from manifests.plan.rows import schedule_from_rank_tables
from manifests.plan.schedule import EpochSchedule
from manifests.plan.write import begin_plan, commit_plan, epoch_entry, with_epochs, write_epochs
from manifests.progress import Progress
from manifests.storage import open_url, redact

__all__ = ["resume_plan"]


def _position(meta: PlanMeta, url: str, epoch: int, step: int) -> tuple[int, int]:
    """``(epoch, step)`` checked against the plan; the end of an epoch becomes the start of the next."""
    entries = {e.epoch: e for e in meta.epochs}
    if epoch not in entries:
        raise PlanError(f"{redact(url)} has no epoch {epoch}; it holds epochs {sorted(entries)}")
    entry = entries[epoch]
    end = entry.first_step + entry.steps
    if not entry.first_step <= step <= end:
        raise PlanError(f"step {step} is outside epoch {epoch} of {redact(url)} (steps {entry.first_step}..{end})")
    if step < end:
        return epoch, step
    later = [e for e in sorted(entries) if e > epoch]
    if not later:
        raise PlanError(f"{redact(url)}: epoch {epoch} step {step} is the end of the plan; nothing is left to train")
    return later[0], entries[later[0]].first_step


def resume_plan(
    plan_url: str,
    out_url: str,
    *,
    epoch: int,
    step: int,
    world_size: int,
    batch_size: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    out_storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> PlanMeta:
    """Write the rest of a plan, from ``(epoch, step)``, for ``world_size`` ranks at ``out_url``.

    ``step`` is the first step of ``epoch`` not yet run. ``batch_size`` (fixed mode, optional) must
    equal the global batch / ``world_size``. Returns the new ``_plan.json``. ``progress``: report
    epochs written. Raises PlanError for a position outside the plan and ValueError when the
    global batch does not split over ``world_size`` ranks. See the module docstring for the guarantees.
    """
    meta = read_plan_meta(plan_url, storage_options)
    old_fs, old_root = open_url(plan_url, dict(storage_options or {}))
    fs, root = open_url(out_url, dict(out_storage_options or {}))
    if old_root == root and type(old_fs) is type(fs):
        raise UsageError(f"--out {redact(out_url)} is the plan being resumed; write the resumed plan to a new folder")
    old_world = meta.inputs.world_size
    if world_size < 1:
        raise UsageError(f"world size must be >= 1 (number of training processes), got {world_size}")
    epoch, step = _position(meta, plan_url, epoch, step)

    for name, b in meta.buckets.items():
        global_size = b.batch_size * old_world
        if global_size % world_size:
            raise UsageError(
                f"bucket {name}: the global batch of {global_size} samples ({old_world} ranks x {b.batch_size}) "
                f"does not split over {world_size} ranks; the world size must divide the global batch"
            )
    buckets = {n: replace(b, batch_size=b.batch_size * old_world // world_size) for n, b in meta.buckets.items()}
    inputs = replace(meta.inputs, world_size=world_size)
    if meta.mode == "fixed":
        new_batch = meta.global_batch // world_size
        if batch_size is not None and batch_size != new_batch:
            raise UsageError(
                f"batch size {batch_size} x {world_size} ranks != the plan's global batch {meta.global_batch} "
                f"({old_world} x {meta.inputs.batch_size}); use batch size {new_batch}"
            )
        inputs = replace(inputs, batch_size=new_batch)

    entries = {e.epoch: e for e in meta.epochs}
    todo = sorted(e for e in entries if e >= epoch)
    names = sorted(buckets)
    tokens = np.asarray([buckets[n].latent_tokens for n in names], np.int64)  # (k,)

    def schedules():  # one epoch of the parent in memory at a time
        for e in todo:
            tables = read_plan_rows(plan_url, [e], storage_options=storage_options, meta=meta).ranks(e)
            schedule = schedule_from_rank_tables(tables, entries[e].padded, entries[e].dropped, entries[e].datasets)
            yield schedule.tail(step) if e == epoch else schedule

    def entry(schedule: EpochSchedule, file: EpochFile) -> EpochEntry:
        index = [names.index(n) for n in schedule.names]  # schedule.names is a subset of the plan's buckets
        return epoch_entry(schedule, file, entries[schedule.epoch].steps_in_epoch, tokens[index], world_size)

    begin_plan(fs, root)
    reporter = Progress("plan --resume", "epochs", total=len(todo), unit="epochs", enabled=progress)
    epochs = write_epochs(fs, root, schedules(), world_size, entry, reporter)
    resumed_from = ResumedFrom(plan_fingerprint=meta.fingerprint, epoch=epoch, step=step, world_size=old_world,
                               batch_size=meta.inputs.batch_size)  # fmt: skip
    new = with_epochs(replace(meta, inputs=inputs, buckets=buckets, resumed_from=resumed_from), epochs)
    commit_plan(fs, root, new)
    return new
