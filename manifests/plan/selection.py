"""A plan's selection (``--annotations A --where SQL --weight-by EXPR``) as ``_plan.json`` records it and as
``plan --check`` re-checks it.

The expressions and the annotations' fingerprints are plan inputs (``inputs.selection``, in the plan's
fingerprint); what they kept per manifest and per bucket is ``selection`` (:class:`SelectionSummary`). The
selection itself is :func:`manifests.select.evaluate`; the planner and the checker apply it to a manifest's
rows the same way (:func:`selected_rows`). The trainer needs nothing: the plan holds only selected samples.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from manifests.plan.meta import (
    PlanMeta,
    SelectionAnnotations,
    SelectionCount,
    SelectionInputs,
    SelectionSummary,
)
from manifests.select import Evaluation, Selection
from manifests.storage import redact

__all__ = ["selection_records", "selected_rows", "fingerprint_problems", "excluded_problems"]


def selection_records(evaluation: Evaluation) -> tuple[SelectionInputs, SelectionSummary]:
    """``(inputs.selection, selection)`` of ``_plan.json`` for ``evaluation``."""
    inputs = SelectionInputs(where=evaluation.where, weight_by=evaluation.weight_by,
                             annotations_fingerprints=tuple(a.fingerprint for a in evaluation.annotations))  # fmt: skip
    buckets: dict[str, list[int]] = {}
    for s in evaluation.selections:
        for name, (kept, dropped) in s.per_bucket().items():
            counts = buckets.setdefault(name, [0, 0])
            counts[0] += kept
            counts[1] += dropped
    summary = SelectionSummary(
        where=evaluation.where, weight_by=evaluation.weight_by,
        annotations=tuple(SelectionAnnotations(url=redact(a.url), fingerprint=a.fingerprint)
                          for a in evaluation.annotations),
        datasets=tuple(SelectionCount(kept=s.kept, dropped=s.dropped, manifest=s.manifest)
                       for s in evaluation.selections),
        buckets={n: SelectionCount(kept=k, dropped=d) for n, (k, d) in sorted(buckets.items())},
    )  # fmt: skip
    return inputs, summary


def selected_rows(selection: Selection | None, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(keep (n,) bool, weights (n,) float64 or None)`` over a manifest's ``n`` rows (all kept without one)."""
    if selection is None:
        return np.ones(n, bool), None
    assert len(selection.keep) == n, "a selection is evaluated over its manifest's rows"
    return selection.keep, selection.weights


def fingerprint_problems(meta: PlanMeta, evaluation: Evaluation) -> list[str]:
    """Violations: the annotations given are not (or no longer) the ones the plan's selection read."""
    recorded = meta.inputs.selection
    assert recorded is not None
    now = tuple(a.fingerprint for a in evaluation.annotations)
    if len(now) != len(recorded.annotations_fingerprints):
        return [f"the plan's selection read {len(recorded.annotations_fingerprints)} annotations folders, "
                f"{len(now)} given: give the ones it was made with (--annotations)"]  # fmt: skip
    problems = []
    for a, want in zip(evaluation.annotations, recorded.annotations_fingerprints):
        if a.fingerprint != want:
            problems.append(f"annotations fingerprint mismatch: the plan's selection read {want}, {redact(a.url)} "
                            f"now has {a.fingerprint}; the annotations changed: re-run `bucketeer plan`")  # fmt: skip
    return problems


def excluded_problems(epoch: int, tables: list[pa.Table], excluded: list[np.ndarray | None]) -> list[str]:
    """Violations: planned samples of epoch ``epoch`` that the selection excludes (``excluded``: per dataset,
    the sorted ids it drops, None for a dataset not checked)."""
    ids = np.concatenate([t.column("sample_ids").combine_chunks().flatten().to_numpy() for t in tables])
    datasets = (np.concatenate([t.column("dataset").combine_chunks().flatten().to_numpy() for t in tables])
                if "dataset" in tables[0].column_names else np.zeros(len(ids), np.int64))  # fmt: skip
    bad = np.zeros(len(ids), bool)
    for d, dropped in enumerate(excluded):
        if dropped is None or not len(dropped):
            continue
        mine = datasets == d
        pos = np.clip(np.searchsorted(dropped, ids[mine]), 0, len(dropped) - 1)
        bad[mine] = dropped[pos] == ids[mine]
    if not bad.any():
        return []
    return [f"epoch {epoch}: {int(bad.sum())} planned samples are excluded by the plan's --where (e.g. sample "
            f"{int(ids[np.flatnonzero(bad)[0]])}): the plan was edited, or the selection changed; re-run "
            "`bucketeer plan`"]  # fmt: skip
