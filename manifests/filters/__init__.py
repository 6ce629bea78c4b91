"""The filter language of every ``--where``, ``--weight-by``, ``--shot-where`` and the review page: a small SQL
expression grammar, parsed here into a tree and built from the tree into a polars expression. No filter text
ever reaches a SQL engine, so a filter cannot read a file, reach the network or run a subquery, and it means
the same thing in every command.

    f = parse_filter("aesthetic > 5.5 AND NOT duplicate", "--where")
    f.columns                                   # ('aesthetic', 'duplicate')
    f.mask(frame)                               # (rows,) bool: the rows for which it is TRUE

What a filter may contain (anything else is refused in one line naming the construct):

- columns: bare names (``aesthetic``) or double-quoted (``"my col"``); literals: numbers, ``'text'`` (``''``
  for a quote), ``TRUE``, ``FALSE``, ``NULL``;
- ``AND OR NOT``, ``= == != <> < <= > >=``, ``+ - * / % ||``, ``IS [NOT] NULL|TRUE|FALSE``,
  ``IS [NOT] DISTINCT FROM``, ``[NOT] BETWEEN a AND b``, ``[NOT] IN (literals)``, ``[NOT] LIKE|ILIKE 'pattern'``,
  ``CASE [x] WHEN ... THEN ... [ELSE ...] END``, ``CAST(x AS type)``, ``TRY_CAST``, ``x::type``;
- the scalar functions of :data:`FUNCTIONS`.

Semantics are SQL's: comparisons with NULL are NULL, ``AND``/``OR`` are three-valued, ``IS [NOT] TRUE`` and
``IS [NOT] FALSE`` are never NULL (``duplicate IS NOT TRUE`` keeps a sample with no annotations row), ``/`` is
true division, ``%`` has the dividend's sign, arithmetic on an integer column of 32 bits or fewer is done in 64
(``width * height`` never wraps), ``LIKE``'s ``%`` and ``_`` match any characters and one character (newlines
included), and ``LENGTH`` is signed.

Work is bounded by the text: at most :data:`MAX_LENGTH` characters, :data:`MAX_NODES` tree nodes nested at most
:data:`MAX_DEPTH` deep, and :data:`MAX_TEXT_OPS` operations on text. Every operation is linear in the rows
(and in a text column's bytes) and none makes a value longer than the sum of its inputs (there is no padding or
repetition), so evaluation costs at most that many passes over the columns it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from manifests.errors import UsageError
from manifests.filters.build import build
from manifests.filters.grammar import (FUNCTIONS, MAX_DEPTH, MAX_LENGTH, MAX_LITERAL, MAX_NODES, MAX_TEXT_OPS, Node,
                                       parse_tree, shown)

if TYPE_CHECKING:  # polars is imported where a filter is built: the trainer reads plans without it
    import polars as pl

__all__ = ["Filter", "Node", "parse_filter", "FUNCTIONS", "MAX_LENGTH", "MAX_NODES", "MAX_DEPTH", "MAX_TEXT_OPS",
           "MAX_LITERAL"]


@dataclass(frozen=True)
class Filter:
    """A parsed filter: its text, the option it came from, its tree and the columns it reads (in first-use order)."""

    text: str
    option: str
    tree: Node
    columns: tuple[str, ...]

    def expr(self, schema: Mapping[str, Any] | None = None) -> pl.Expr:
        """The polars expression the tree builds (no SQL engine involved); ``schema``: the frame's, where known."""
        return build(self.tree, schema)

    def values(self, frame: pl.DataFrame) -> pl.Series:
        """The filter's value for every row of ``frame`` (a constant broadcast to the rows). Raises UsageError
        for a column ``frame`` lacks or an evaluation polars refuses (e.g. text compared with a number)."""
        import polars as pl

        if missing := [c for c in self.columns if c not in frame.columns]:
            raise UsageError(f"{self.option} {shown(self.text)} uses {', '.join(map(repr, missing))}, which no "
                             f"column is; the columns are {', '.join(frame.columns)}")  # fmt: skip
        try:
            out = frame.select(self.expr(frame.schema).alias("_value")).to_series()
        except (Exception, pl.exceptions.PanicException) as e:  # ComputeError, SchemaError, ...; a Rust panic (old
            # polars, on some mixes of types) is a BaseException
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"{self.option} {shown(self.text)} cannot be evaluated ({line[:200]})") from None
        if len(out) == 1 and frame.height != 1:  # a constant expression
            out = pl.Series("_value", [out[0]] * frame.height, dtype=out.dtype)
        return out

    def mask(self, frame: pl.DataFrame) -> np.ndarray:
        """(rows,) bool: the rows of ``frame`` for which the condition is TRUE (NULL: not). Raises UsageError like
        :meth:`values`, and for a filter that gives no true/false."""
        import polars as pl

        values = self.values(frame)
        if values.dtype != pl.Boolean and values.dtype != pl.Null:
            raise UsageError(f"{self.option} {shown(self.text)} gives {values.dtype} values, not true/false: write "
                             "a condition, e.g. \"aesthetic > 5.5\"")  # fmt: skip
        return values.cast(pl.Boolean).fill_null(False).to_numpy().astype(bool)


def parse_filter(text: str, option: str = "--where") -> Filter:
    """``text`` parsed into a :class:`Filter`. Raises UsageError naming ``option`` and the construct for text that
    is empty, too long or too large, not a filter, or uses anything outside the language (a subquery, a table or
    reading function, a function not in :data:`FUNCTIONS`)."""
    tree, columns = parse_tree(text, option)
    return Filter(text, option, tree, columns)
