"""The filter language's grammar: text to a tree of :class:`Node`, refusing everything outside the language in
one line that names the construct, within the bounds on size, nesting and text work (:mod:`manifests.filters`
says what the language holds)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from manifests.errors import UsageError

__all__ = ["Node", "parse_tree", "shown", "FUNCTIONS", "MAX_LENGTH", "MAX_NODES", "MAX_DEPTH", "MAX_TEXT_OPS",
           "MAX_LITERAL"]

MAX_LENGTH = 4000  # characters of filter text
MAX_NODES = 500  # tree nodes (columns, literals, operators, calls, list items)
MAX_DEPTH = 40  # nesting: operators inside operators, parentheses included
MAX_TEXT_OPS = 16  # operations that read or make text (LIKE, LOWER, ||, a cast to text, ...)
MAX_LITERAL = 1000  # characters of one text literal (a LIKE or REGEXP_LIKE pattern included)

# name -> (fewest, most arguments, reads or makes text); how each is built: _call
FUNCTIONS: dict[str, tuple[int, int, bool]] = {
    "abs": (1, 1, False), "sign": (1, 1, False), "sqrt": (1, 1, False), "cbrt": (1, 1, False),
    "exp": (1, 1, False), "ln": (1, 1, False), "log10": (1, 1, False), "log2": (1, 1, False),
    "power": (2, 2, False), "pow": (2, 2, False), "mod": (2, 2, False), "round": (1, 2, False),
    "floor": (1, 1, False), "ceil": (1, 1, False), "ceiling": (1, 1, False),
    "greatest": (2, 16, False), "least": (2, 16, False),
    "coalesce": (1, 16, False), "ifnull": (2, 2, False), "nullif": (2, 2, False),
    "lower": (1, 1, True), "upper": (1, 1, True), "length": (1, 1, True), "char_length": (1, 1, True),
    "octet_length": (1, 1, True), "starts_with": (2, 2, True), "ends_with": (2, 2, True),
    "regexp_like": (2, 2, True),
}  # fmt: skip
_PATTERN_ARG = {"starts_with", "ends_with", "regexp_like"}  # whose second argument must be a text literal

_TYPES = {"int": "Int32", "integer": "Int32", "int4": "Int32", "bigint": "Int64", "int8": "Int64",
          "smallint": "Int16", "real": "Float32", "float4": "Float32", "float": "Float64", "double": "Float64",
          "float8": "Float64", "text": "String", "varchar": "String", "string": "String", "boolean": "Boolean",
          "bool": "Boolean"}  # fmt: skip
_WORDS = {"and", "or", "not", "is", "null", "true", "false", "in", "between", "like", "ilike", "case", "when",
          "then", "else", "end", "cast", "try_cast", "as", "distinct", "from"}  # fmt: skip
# words of SQL beyond an expression: each names what the filter tried to do
_REFUSED = {"select": "a subquery", "exists": "a subquery", "with": "a subquery", "union": "a subquery",
            "values": "a subquery", "table": "a table", "where": "a WHERE clause", "order": "ORDER BY",
            "group": "GROUP BY", "limit": "LIMIT", "over": "a window", "interval": "an INTERVAL literal",
            "date": "a DATE literal", "timestamp": "a TIMESTAMP literal", "any": "ANY", "all": "ALL",
            "some": "SOME", "array": "an ARRAY", "escape": "LIKE ... ESCAPE", "similar": "SIMILAR TO",
            "symmetric": "BETWEEN SYMMETRIC", "collate": "COLLATE"}  # fmt: skip
_TOKENS = re.compile(r"""(?P<space>\s+)
    |(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<str>'(?:[^']|'')*')
    |(?P<qid>"(?:[^"]|"")*")
    |(?P<id>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<op><=|>=|<>|!=|==|\|\||::|[=<>+\-*/%(),])""", re.X)
_COMPARE = {"=": "eq", "==": "eq", "!=": "ne", "<>": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
_ARITH = {"+": 30, "-": 30, "*": 40, "/": 40, "%": 40, "||": 40}  # binding power, as SQL's parsers
_OR, _AND, _NOT, _IS, _CMP, _UNARY, _CAST = 5, 10, 15, 17, 20, 40, 50


@dataclass(frozen=True)
class Node:
    """One node of a filter's tree: ``kind`` is column, literal, unary, binary, is, between, in, like, call,
    case or cast; ``value`` the name, literal, operator or flags; ``args`` the operands."""

    kind: str
    value: Any = None
    args: tuple[Node, ...] = ()


def shown(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:117] + "...")


def _refuse(option: str, text: str, what: str) -> UsageError:
    return UsageError(f"{option} {shown(text)}: {what}")


def _tokens(text: str, option: str) -> list[tuple[str, str]]:
    """(kind, text) pairs: num, str, qid, id, op."""
    out, at = [], 0
    while at < len(text):
        if text.startswith(("--", "/*"), at):
            raise _refuse(option, text, "comments (-- and /*) are not part of a filter")
        m = _TOKENS.match(text, at)
        if m is None:
            ch = text[at]
            what = ("a text literal is not closed with '" if ch == "'" else
                    'a quoted column name is not closed with "' if ch == '"' else
                    f"{ch!r} is not part of a filter (a condition over columns: no ;, no * alone, no $ parameters)")
            raise _refuse(option, text, what)
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        at = m.end()
    return out


class _Parser:
    """Precedence climbing over the tokens, with the binding powers of SQL's parsers (sqlparser, which polars
    used): OR < AND < NOT < IS < comparisons, LIKE, IN, BETWEEN < + - < * / % || and unary minus < ``::``."""

    def __init__(self, tokens: list[tuple[str, str]], text: str, option: str):
        self.tokens, self.text, self.option = tokens, text, option
        self.at, self.depth, self.nodes, self.text_ops = 0, 0, 0, 0
        self.columns: list[str] = []

    def fail(self, what: str) -> None:
        raise _refuse(self.option, self.text, what)

    def node(self, kind: str, value: Any = None, args: tuple[Node, ...] = ()) -> Node:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self.fail(f"more than {MAX_NODES} terms; a filter has at most that many")
        return Node(kind, value, args)

    def text_op(self, what: str) -> None:
        self.text_ops += 1
        if self.text_ops > MAX_TEXT_OPS:
            self.fail(f"more than {MAX_TEXT_OPS} operations on text ({what} is one too many)")

    def peek(self, ahead: int = 0) -> tuple[str, str]:
        at = self.at + ahead
        return self.tokens[at] if at < len(self.tokens) else ("end", "")

    def word(self, ahead: int = 0) -> str | None:
        kind, t = self.peek(ahead)
        return t.lower() if kind == "id" else None

    def take(self, kind: str, text: str | None = None, what: str = "") -> str:
        k, t = self.peek()
        if k != kind or (text is not None and (t.lower() if kind == "id" else t) != text):
            found = "the end" if k == "end" else repr(t)
            self.fail(f"expected {what or text or kind}, found {found}")
        self.at += 1
        return t

    def expression(self, power: int) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"nested more than {MAX_DEPTH} deep")
        left = self.prefix()
        while (bound := self.infix_power()) > power:
            left = self.infix(left, bound)
        self.depth -= 1
        return left

    def prefix(self) -> Node:
        kind, t = self.peek()
        word = t.lower() if kind == "id" else None
        if kind == "end":
            self.fail("it ends where a value is expected")
        self.at += 1
        if kind == "num":
            return self.node("literal", _number(t, self))
        if kind == "str":
            return self.node("literal", self.literal_text(t))
        if kind == "qid":
            return self.column(t[1:-1].replace('""', '"'))
        if kind == "op" and t in "-+":
            operand = self.expression(_UNARY)
            if _is_number(operand):  # -1 is one literal: polars compares a literal -1 with an unsigned column
                return Node("literal", -operand.value if t == "-" else operand.value)
            return self.node("unary", t, (operand,))
        if kind == "op" and t == "(":
            if self.word() in _REFUSED:
                self.fail(f"{_REFUSED[self.word()]} ({self.peek()[1].upper()}) is not allowed in a filter")
            inner = self.expression(0)
            self.take("op", ")")
            return inner
        if kind == "op":
            self.fail(f"{t!r} is not expected here")
        if word in ("null", "true", "false"):
            return self.node("literal", {"null": None, "true": True, "false": False}[word])
        if word == "not":
            return self.node("unary", "not", (self.expression(_NOT),))
        if word == "case":
            return self.case()
        if word in ("cast", "try_cast"):
            self.take("op", "(")
            inner = self.expression(0)
            self.take("id", "as")
            node = self.cast(inner, strict=word == "cast")
            self.take("op", ")")
            return node
        if word in _REFUSED:
            self.fail(f"{_REFUSED[word]} ({t.upper()}) is not allowed in a filter: a filter is one condition "
                      "over the columns")  # fmt: skip
        if self.peek() == ("op", "("):
            return self.call(t)
        if word in _WORDS:
            self.fail(f"{t.upper()} is not expected here")
        return self.column(t)

    def column(self, name: str) -> Node:
        # polars reads "*" and "^...$" in a column name as every column / a regex of names
        if not name or name == "*" or (name.startswith("^") and name.endswith("$")) or len(name) > 256:
            self.fail(f"{name!r} is not a column name")
        self.columns.append(name)
        return self.node("column", name)

    def literal_text(self, token: str) -> str:
        value = token[1:-1].replace("''", "'")
        if len(value) > MAX_LITERAL:
            self.fail(f"a text literal of {len(value)} characters; at most {MAX_LITERAL}")
        return value

    def call(self, name: str) -> Node:
        fn = name.lower()
        if fn not in FUNCTIONS:
            self.fail(f"function {name}() is not allowed in a filter; the functions are "
                      f"{', '.join(sorted(FUNCTIONS))}")  # fmt: skip
        fewest, most, text = FUNCTIONS[fn]
        if text:
            self.text_op(f"{fn}()")
        self.take("op", "(")
        args: list[Node] = []
        while self.peek() != ("op", ")"):
            if args:
                self.take("op", ",", "',' or ')'")
            if self.word() in _REFUSED:
                self.fail(f"{_REFUSED[self.word()]} ({self.peek()[1].upper()}) is not allowed in a filter")
            args.append(self.expression(0))
        self.take("op", ")")
        if not fewest <= len(args) <= most:
            count = str(fewest) if fewest == most else f"{fewest} to {most}"
            self.fail(f"{fn}() takes {count} arguments, not {len(args)}")
        if fn in _PATTERN_ARG and not _is_text(args[1]):
            self.fail(f"{fn}()'s second argument must be a text literal")
        if fn == "round" and len(args) == 2 and not (args[1].kind == "literal" and type(args[1].value) is int
                                                     and 0 <= args[1].value <= 15):  # fmt: skip
            self.fail("round()'s second argument must be a whole number from 0 to 15")
        return self.node("call", fn, tuple(args))

    def case(self) -> Node:
        operand = None if self.word() == "when" else self.expression(0)
        arms: list[Node] = []
        while self.word() == "when":
            self.at += 1
            when = self.expression(0)
            self.take("id", "then")
            arms += [when, self.expression(0)]
        if not arms:
            self.fail("CASE needs at least one WHEN ... THEN ...")
        otherwise = None
        if self.word() == "else":
            self.at += 1
            otherwise = self.expression(0)
        self.take("id", "end", "END")
        args = (operand or self.node("literal", None), *arms, otherwise or self.node("literal", None))
        return self.node("case", operand is not None, args)

    def cast(self, inner: Node, strict: bool) -> Node:
        name = (self.word() or "").lower()
        if name not in _TYPES:
            self.fail(f"{self.peek()[1]!r} is not a type a filter casts to; the types are {', '.join(sorted(_TYPES))}")
        self.at += 1
        if name == "double" and self.word() == "precision":
            self.at += 1
        if _TYPES[name] == "String":
            self.text_op("a cast to text")
        return self.node("cast", (_TYPES[name], strict), (inner,))

    def infix_power(self) -> int:
        kind, t = self.peek()
        word = t.lower() if kind == "id" else None
        if kind == "op":
            return _CMP if t in _COMPARE else _ARITH.get(t, _CAST if t == "::" else 0)
        if word == "or":
            return _OR
        if word == "and":
            return _AND
        if word == "is":
            return _IS
        if word in ("in", "between", "like", "ilike") or (word == "not" and self.word(1) in ("in", "between",
                                                                                              "like", "ilike")):
            return _CMP
        if word in _REFUSED:
            self.fail(f"{_REFUSED[word]} ({t.upper()}) is not allowed in a filter")
        return 0

    def infix(self, left: Node, power: int) -> Node:
        kind, t = self.peek()
        self.at += 1
        if kind == "op" and t == "::":
            return self.cast(left, strict=True)
        if kind == "op":
            if t == "||":
                self.text_op("||")
            return self.node("binary", _COMPARE.get(t, t), (left, self.expression(power)))
        word = t.lower()
        if word in ("and", "or"):
            return self.node("binary", word, (left, self.expression(power)))
        if word == "is":
            return self.is_(left)
        negated = word == "not"
        if negated:
            word = self.take("id").lower()
        if word == "between":
            low = self.expression(_CMP)
            self.take("id", "and", "AND of BETWEEN ... AND ...")
            return self.node("between", negated, (left, low, self.expression(_CMP)))
        if word == "in":
            return self.in_list(left, negated)
        self.text_op(word.upper())
        pattern = self.prefix()
        if not _is_text(pattern):
            self.fail(f"{word.upper()} takes a text literal pattern, e.g. caption LIKE '%cat%'")
        return self.node("like", (word == "ilike", negated), (left, pattern))

    def is_(self, left: Node) -> Node:
        negated = self.word() == "not"
        self.at += negated
        what = self.word()
        if what in ("null", "true", "false"):
            self.at += 1
            return self.node("is", (what, negated), (left,))
        if what == "distinct":
            self.at += 1
            self.take("id", "from", "FROM of IS DISTINCT FROM")
            return self.node("is", ("distinct", negated), (left, self.expression(_IS)))
        self.fail("IS takes NULL, TRUE, FALSE or DISTINCT FROM")
        raise AssertionError  # unreachable: fail raises

    def in_list(self, left: Node, negated: bool) -> Node:
        self.take("op", "(", "( after IN")
        if self.word() in _REFUSED:
            self.fail(f"{_REFUSED[self.word()]} ({self.peek()[1].upper()}) is not allowed in a filter")
        items: list[Node] = []
        while True:
            item = self.expression(_CMP)
            if item.kind != "literal":
                self.fail("IN takes a list of literal values, e.g. bucket IN ('1024x1024', '768x1344')")
            items.append(item)
            if self.peek() != ("op", ","):
                break
            self.at += 1
        self.take("op", ")", "',' or ')'")
        return self.node("in", negated, (left, *items))


def _number(t: str, parser: _Parser) -> int | float:
    if re.fullmatch(r"\d+", t):
        value = int(t)
        if value >= 2**64:  # a sample id is a uint64
            parser.fail(f"the number {t} is too large (at most {2**64 - 1})")
        return value
    return float(t)


def _is_text(node: Node) -> bool:
    return node.kind == "literal" and isinstance(node.value, str)


def _is_number(node: Node) -> bool:
    return node.kind == "literal" and type(node.value) in (int, float)


def parse_tree(text: str, option: str) -> tuple[Node, tuple[str, ...]]:
    """``text``'s tree and the columns it reads (in first-use order). Raises UsageError naming ``option`` and the
    construct for text that is empty, too long or too large, not a filter, or outside the language."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"{option} is empty: give a condition, e.g. \"aesthetic > 5.5 AND NOT duplicate\"")
    if len(text) > MAX_LENGTH:
        raise UsageError(f"{option} is {len(text)} characters long; a filter has at most {MAX_LENGTH}")
    parser = _Parser(_tokens(text, option), text, option)
    tree = parser.expression(0)
    if parser.at < len(parser.tokens):
        parser.fail(f"{parser.tokens[parser.at][1]!r} is not expected here")
    return tree, tuple(dict.fromkeys(parser.columns))
