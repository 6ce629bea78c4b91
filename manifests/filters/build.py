"""A filter's tree as a polars expression, with SQL's NULL rules: the only place a filter meets polars, and it
meets it as expressions, never as SQL text."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from manifests.filters.grammar import Node

if TYPE_CHECKING:  # polars is imported where a filter is built: the trainer reads plans without it
    import polars as pl

__all__ = ["build"]

_INTEGERS = {f"{sign}Int{bits}" for sign in ("", "U") for bits in (8, 16, 32, 64)}
_NARROW = _INTEGERS - {"Int64", "UInt64"}  # integer columns whose arithmetic is done in Int64
_ARITHMETIC = {"+", "-", "*", "/", "%"}


def _like(text: pl.Expr, pattern: str, case_insensitive: bool) -> pl.Expr:
    """``text LIKE pattern``: ``%`` any characters and ``_`` one (newlines included), the rest literal. A pattern
    whose only wildcards are ``%`` at its ends is a plain search (``'%cat%'``: contains ``cat``)."""
    core = pattern.strip("%")
    head, tail = pattern.startswith("%"), pattern.endswith("%") and core != ""
    if not case_insensitive and "%" not in core and "_" not in core:
        if head and tail:
            return text.str.contains(core, literal=True)
        if head or tail:
            return text.str.ends_with(core) if head else text.str.starts_with(core)
        return text == core if core or not pattern else text.is_not_null()
    body = "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in core)
    return text.str.contains(f"(?{'i' if case_insensitive else ''}s){'' if head else '^'}{body}{'' if tail else '$'}")


def _remainder(x: pl.Expr, y: pl.Expr) -> pl.Expr:
    """SQL's ``x % y``: the sign of ``x`` (-7 % 2 is -1), where polars' ``%`` takes the sign of ``y`` (1)."""
    import polars as pl

    r = x % y
    return pl.when((r != 0) & ((x < 0) != (y < 0))).then(r - y).otherwise(r)


def _call(fn: str, a: list[pl.Expr], nodes: tuple[Node, ...]) -> pl.Expr:
    import polars as pl

    unary: dict[str, Callable[[pl.Expr], pl.Expr]] = {
        "abs": lambda x: x.abs(), "sign": lambda x: x.sign(), "sqrt": lambda x: x.sqrt(),
        "cbrt": lambda x: x.cbrt(), "exp": lambda x: x.exp(), "ln": lambda x: x.log(), "log10": lambda x: x.log10(),
        "log2": lambda x: x.log(2), "floor": lambda x: x.floor(), "ceil": lambda x: x.ceil(),
        "ceiling": lambda x: x.ceil(), "lower": lambda x: x.str.to_lowercase(), "upper": lambda x: x.str.to_uppercase(),
        "length": lambda x: x.str.len_chars().cast(pl.Int64), "char_length": lambda x: x.str.len_chars().cast(pl.Int64),
        "octet_length": lambda x: x.str.len_bytes().cast(pl.Int64),  # signed: LENGTH(s) - 5 may be negative
    }  # fmt: skip
    if fn in unary:
        return unary[fn](a[0])
    if fn in ("power", "pow"):
        return a[0].pow(a[1])
    if fn == "mod":
        return _remainder(a[0], a[1])
    if fn == "round":
        return a[0].round(nodes[1].value if len(nodes) == 2 else 0)
    if fn in ("greatest", "least"):
        return (pl.max_horizontal if fn == "greatest" else pl.min_horizontal)(a)
    if fn in ("coalesce", "ifnull"):
        return pl.coalesce(a)
    if fn == "nullif":
        return pl.when(a[0] == a[1]).then(None).otherwise(a[0])
    pattern = nodes[1].value
    if fn == "starts_with":
        return a[0].str.starts_with(pattern)
    if fn == "ends_with":
        return a[0].str.ends_with(pattern)
    return a[0].str.contains(pattern)  # regexp_like: Rust's regex, linear in the text


def _balanced(items: list[pl.Expr], op: Callable[[pl.Expr, pl.Expr], pl.Expr]) -> pl.Expr:
    """``op`` over ``items`` as a balanced tree (a long IN list nests log2(n) deep, not n)."""
    while len(items) > 1:
        items = [op(x, y) for x, y in zip(items[::2], items[1::2])] + items[len(items) - len(items) % 2:]
    return items[0]


def _lookup(node: Node, x: pl.Expr, schema: Mapping[str, Any] | None) -> pl.Expr | None:
    """``x IN (...)`` as one hash lookup (``is_in``) where that is what the OR of equalities gives: a list of more
    than 8 values, none NULL, over a text column with text values or an integer column with whole numbers (those
    outside the column's range cannot match). None where it is not: the caller writes the equalities."""
    import polars as pl

    column, values = node.args[0], [n.value for n in node.args[1:]]
    if len(values) <= 8 or column.kind != "column" or schema is None or column.value not in schema:
        return None
    dtype = schema[column.value]
    if dtype == pl.String and all(isinstance(v, str) for v in values):
        found = x.is_in(values)  # a list, not a Series: polars 2 deprecates is_in with a Series of x's type
    elif str(dtype) in _INTEGERS and all(type(v) is int and v < 2**63 for v in values):  # old polars: int64 lists
        bounds = np.iinfo(str(dtype).lower())
        found = x.is_in([v for v in values if bounds.min <= v <= bounds.max])
    else:
        return None
    return pl.when(x.is_null()).then(None).otherwise(found)


def _widened(expr: pl.Expr, node: Node, schema: Mapping[str, Any] | None) -> pl.Expr:
    """``expr`` as Int64 when ``node`` is a column of a narrower integer type (``schema``'s)."""
    import polars as pl

    if node.kind == "column" and schema is not None and str(schema.get(node.value)) in _NARROW:
        return expr.cast(pl.Int64)
    return expr


def build(node: Node, schema: Mapping[str, Any] | None = None) -> pl.Expr:
    """The polars expression of ``node``, with SQL's NULL semantics. ``schema`` (column -> polars dtype), where
    known, lets a long ``IN`` list over a text or integer column be one hash lookup, and makes arithmetic on an
    integer column of 32 bits or fewer 64-bit (``width * height`` of int32 columns wraps past 2**31 otherwise)."""
    import polars as pl

    if node.kind == "column":
        return pl.col(node.value)
    if node.kind == "literal":
        return pl.lit(node.value)
    a = [build(n, schema) for n in node.args]
    if (node.kind == "binary" and node.value in _ARITHMETIC) or (node.kind == "unary" and node.value == "-"):
        a = [_widened(e, n, schema) for e, n in zip(a, node.args)]
    if node.kind == "unary":
        return {"not": lambda: ~a[0], "-": lambda: -a[0], "+": lambda: a[0]}[node.value]()
    if node.kind == "binary":
        x, y = a
        ops: dict[str, Callable[[], pl.Expr]] = {
            "and": lambda: x & y, "or": lambda: x | y, "eq": lambda: x == y, "ne": lambda: x != y,
            "lt": lambda: x < y, "le": lambda: x <= y, "gt": lambda: x > y, "ge": lambda: x >= y,
            "+": lambda: x + y, "-": lambda: x - y, "*": lambda: x * y, "/": lambda: x / y,
            "%": lambda: _remainder(x, y), "||": lambda: pl.concat_str([x, y]),
        }  # fmt: skip
        return ops[node.value]()
    if node.kind == "is":
        what, negated = node.value
        out = {"null": lambda: a[0].is_null(), "true": lambda: a[0].fill_null(False),
               "false": lambda: (~a[0]).fill_null(False),
               "distinct": lambda: a[0].ne_missing(a[1])}[what]()  # fmt: skip
        return ~out if negated else out
    if node.kind == "between":
        out = (a[0] >= a[1]) & (a[0] <= a[2])
        return ~out if node.value else out
    if node.kind == "in":  # SQL's definition: x = v1 OR x = v2 ..., NULL where nothing matches and a side is NULL
        out = _lookup(node, a[0], schema)
        if out is None:
            out = _balanced([a[0] == v for v in a[1:]], lambda x, y: x | y)
        return ~out if node.value else out
    if node.kind == "like":
        case_insensitive, negated = node.value
        out = _like(a[0], node.args[1].value, case_insensitive)
        return ~out if negated else out
    if node.kind == "call":
        return _call(node.value, a, node.args)
    if node.kind == "case":
        arms, chain = a[1:-1], pl  # CASE x WHEN v: x = v (NULL never matches); a missing ELSE is NULL
        for when, then in zip(arms[::2], arms[1::2]):
            chain = chain.when(a[0] == when if node.value else when).then(then)  # type: ignore[assignment]
        return chain.otherwise(a[-1])  # type: ignore[attr-defined]
    if node.kind == "cast":
        dtype, strict = node.value
        return a[0].cast(getattr(pl, dtype), strict=strict)
    raise AssertionError(f"unknown node kind {node.kind}")
