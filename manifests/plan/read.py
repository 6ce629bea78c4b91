"""Reading a plan's rows: :func:`read_plan_rows` is the one reader, by epochs, ranks and columns.

Rows come as ``(epochs, ranks, columns)``, never as file paths, so the layout can change under
them. Every rank of an epoch: its file is read whole (one GET) and hashed; the caller compares the
hash (``--check`` reports it with the file's other problems). Some ranks (the trainer's reads): the
footer, then the file streamed and hashed, keeping only their row groups; a file that does not hash
to ``_plan.json``'s sha256 is refused (:func:`manifests.plan.parts.read_epoch_ranks` gives the cost).
Offsets follow from ``_plan.json``: no listing, no HEAD. The trainer, ``--check``, the resume and the
report all read through it.

    rows = read_plan_rows(url, epochs=[0], ranks=[3], columns=["step", "bucket"])  # a PlanRows
    table = read_rank_plan(url, rank, storage_options, epoch=None)   # this rank's rows, by (epoch, step)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pyarrow as pa

from manifests.plan.meta import PlanError, PlanMeta, read_plan_meta
from manifests.plan.parts import PartProblem, epoch_part, read_epoch_ranks, read_epoch_whole
from manifests.plan.rows import plan_schema
from manifests.storage import join, open_url, redact

__all__ = ["PlanRows", "plan_columns", "read_plan_rows", "read_rank_plan"]


def plan_columns(meta: PlanMeta) -> pa.Schema:
    """The columns of a plan's files: PLAN_SCHEMA, then the mixture columns ``meta.columns`` names."""
    return plan_schema(meta.columns)


@dataclass(frozen=True)
class PlanRows:
    """What :func:`read_plan_rows` found: rows per ``(epoch, rank)`` asked for, or per epoch its problem.

    An epoch file that is missing or malformed is in ``problems`` (one line naming the epoch and
    file), not in ``tables``, so ``--check`` can report it; :meth:`table` and :meth:`ranks` raise it.
    """

    url: str
    schema: pa.Schema  # the columns asked for
    tables: dict[tuple[int, int], pa.Table]  # rows sorted by step
    problems: dict[int, str]  # per epoch
    sha256: dict[int, str]  # per epoch read whole (every rank) and intact: comparable with _plan.json's

    def _raise_first_problem(self) -> None:
        if self.problems:
            first = self.problems[min(self.problems)]
            raise PlanError(f"{redact(self.url)}: {first}; re-run `bucketeer plan`")

    def table(self) -> pa.Table:
        """Every row read, by (epoch, rank, step). Raises PlanError for the first unusable file."""
        self._raise_first_problem()
        if not self.tables:
            return self.schema.empty_table()
        return pa.concat_tables([self.tables[k] for k in sorted(self.tables)])

    def ranks(self, epoch: int) -> list[pa.Table]:
        """The rows of ``epoch``, one table per rank read, in rank order. Raises PlanError like :meth:`table`."""
        self._raise_first_problem()
        return [self.tables[k] for k in sorted(self.tables) if k[0] == epoch]


def read_plan_rows(
    url: str,
    epochs: Sequence[int] | None = None,
    ranks: Sequence[int] | None = None,
    *,
    columns: Sequence[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    meta: PlanMeta | None = None,
) -> PlanRows:
    """The rows of ``epochs`` x ``ranks`` (default: every epoch the plan holds, every rank) in ``columns``
    (default: all the plan's columns, :func:`plan_columns`).

    Every rank: each epoch file is read whole (one GET) and its sha256 returned. Some ranks: the footer
    and their row groups by ranged reads, the whole file hashed on the way and compared with
    ``_plan.json``'s sha256. ``meta`` is the plan's parsed ``_plan.json`` when the caller has it. A
    missing or malformed file (or, read by some ranks, an edited one) is a problem in the result (see
    :class:`PlanRows`), never an exception here.
    Raises PlanError for an invalid plan, an epoch it does not hold, a rank outside its world size,
    or an unknown column; a storage failure other than a missing file is a StorageError.
    """
    meta = meta or read_plan_meta(url, storage_options)
    entries = {e.epoch: e for e in meta.epochs}
    epochs = list(entries) if epochs is None else list(epochs)
    for epoch in epochs:
        if epoch not in entries:
            raise PlanError(f"{redact(url)} has no epoch {epoch}; it holds epochs {_span(list(entries))}")
    world = meta.inputs.world_size
    every_rank = ranks is None
    ranks = list(range(world)) if ranks is None else list(ranks)
    for rank in ranks:
        if not 0 <= rank < world:
            raise PlanError(f"rank {rank} is outside {redact(url)}'s world size {world} (ranks 0..{world - 1})")
    schema = plan_columns(meta)
    columns = list(schema.names if columns is None else columns)
    unknown = [c for c in columns if c not in schema.names]
    if unknown:
        raise PlanError(f"columns {unknown} are not plan columns {schema.names}")
    want = pa.schema([schema.field(c) for c in columns])

    fs, root = open_url(url, dict(storage_options or {}))
    tables, problems, sha256 = {}, {}, {}
    for epoch in epochs:
        path, where = join(root, epoch_part(epoch)), f"epoch {epoch}: {epoch_part(epoch)}"
        try:
            if every_rank:
                found, sha256[epoch] = read_epoch_whole(fs, path, where, world, want)
            else:
                found = read_epoch_ranks(fs, path, where, entries[epoch], world, ranks, want)
        except PartProblem as e:
            problems[epoch] = str(e)
            continue
        tables.update({(epoch, rank): table for rank, table in found.items()})
    return PlanRows(url, want, tables, problems, sha256)


def _span(epochs: list[int]) -> str:
    return f"{epochs[0]}..{epochs[-1]}" if epochs == list(range(epochs[0], epochs[-1] + 1)) else str(epochs)


def read_rank_plan(
    url: str, rank: int, storage_options: Mapping[str, Any] | None = None, epoch: int | None = None
) -> pa.Table:
    """Rank ``rank``'s rows (all epochs, or one), sorted by (epoch, step), in PLAN_SCHEMA.

    Reads ``_plan.json`` and streams each epoch file once, keeping this rank's row groups. Raises
    PlanError for an invalid plan, a rank outside the world size, an epoch the plan does not hold, or
    a missing, malformed or edited file (one that does not hash to the sha256 ``_plan.json`` records).
    """
    return read_plan_rows(url, None if epoch is None else [epoch], [rank], storage_options=storage_options).table()
