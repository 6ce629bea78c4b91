"""Typed, frozen records of a JSON object, read once and written back exactly: the one base of
``_manifest.json``, ``_cache.json`` and ``_plan.json`` (:mod:`manifests.manifest_meta`,
:mod:`manifests.cache.meta`, :mod:`manifests.plan.meta`).

    @dataclass(frozen=True, kw_only=True)
    class Counts(JsonRecord):
        samples: int                                  # a key the file must have (no default)
        class_: str | None = field(default=None, metadata={"key": "class"})  # JSON key != attribute
        parts: tuple[Part, ...] = nested(each(Part.from_json), default=())   # parsed by a hook
        listed: int | None = optional()               # None when absent, and never written as null

    Counts.from_json(d).to_json() == d

Attribute names are the JSON keys unless ``metadata={"key": ...}`` says otherwise. A value without a
hook is kept as read, lists as tuples; ``to_json`` turns tuples back into lists and calls ``to_json``
of nested records. Exactness: a key the file lacks is remembered (``_absent``) and left out again
while its field holds the default; a null of an :func:`optional` field, and keys the record does
not know (unless ``_unknown_keys`` says to drop or refuse them), are kept in ``_extra`` as they were.
A null of any other field is its default; of a field without one, what its hook makes of null.
"""

from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping

__all__ = ["JsonRecord", "RecordError", "each", "each_value", "nested", "optional"]


class RecordError(ValueError):
    """A JSON value a strict record (``_unknown_keys = "refuse"``) does not fit; the message names where
    (``counts``, ``parts.samples[]``; ``top-level`` for the record itself)."""

    def __init__(self, problem: str, where: str = "") -> None:
        self.problem, self.where = problem, where
        super().__init__(problem.replace("{where}", where or "top-level"))

    def under(self, key: str) -> "RecordError":
        """The same problem, one level down from ``key`` (``[]``: an element of a list)."""
        return RecordError(self.problem, key + ("." if self.where[:1] not in ("", "[") else "") + self.where)


def nested(parse: Callable[[Any], Any], **kwargs: Any) -> Any:
    """A field whose JSON value ``parse`` turns into its type (``kwargs``: the dataclass field's)."""
    return field(metadata={"parse": parse}, **kwargs)


def optional(parse: Callable[[Any], Any] | None = None) -> Any:
    """A key only some files have: None when absent, and left out of ``to_json`` when None."""
    return field(default=None, metadata={"optional": True, **({"parse": parse} if parse else {})})


def each(parse: Callable[[Any], Any]) -> Callable[[Any], tuple]:
    """A hook parsing every element of a JSON array, into a tuple."""

    def parse_each(values: Any) -> tuple:
        if not isinstance(values, list):
            raise TypeError(f"expected a JSON array, not {type(values).__name__}")
        try:
            return tuple(parse(v) for v in values)
        except RecordError as e:
            raise e.under("[]") from None

    return parse_each


def each_value(parse: Callable[[Any], Any]) -> Callable[[Any], dict]:
    """A hook parsing every value of a JSON object keyed by data (bucket names), into a dict."""
    return lambda values: {k: parse(v) for k, v in values.items()}


def _plain(value: Any) -> Any:
    return tuple(_plain(v) for v in value) if isinstance(value, list) else value


def _to_json(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _key(f: Any) -> str:
    return f.metadata.get("key", f.name)


def _default(f: Any) -> Any:
    return None if f.default is MISSING else f.default


@dataclass(frozen=True, kw_only=True)
class JsonRecord:
    """A JSON object whose keys are the fields (see the module docstring). ``_unknown_keys``: what
    :meth:`from_json` does with keys no field names: ``keep`` them in ``_extra``, ``drop`` them, or
    ``refuse`` them; a refusing record is strict: whatever does not fit raises :class:`RecordError`."""

    _unknown_keys: ClassVar[str] = "keep"
    _absent: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    _extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def _fields(cls) -> list[Any]:
        return [f for f in fields(cls) if not f.name.startswith("_")]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Any:
        """The record of the JSON object ``d``. TypeError when it is not an object or lacks a key that
        has no default (RecordError for a strict record, also for unknown keys)."""
        strict = cls._unknown_keys == "refuse"
        if not isinstance(d, Mapping) and strict:
            raise RecordError("{where} is not a JSON object")
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__} is a JSON object, not {type(d).__name__}")
        values, absent, extra = {}, set(), {}
        for f in cls._fields():
            key = _key(f)
            if key not in d:
                absent.add(f.name)
            elif d[key] is None and (f.default is not MISSING or f.default_factory is not MISSING):
                extra.update({key: None} if f.metadata.get("optional") else {})  # the default stands
            else:
                try:
                    values[f.name] = f.metadata.get("parse", _plain)(d[key])
                except RecordError as e:
                    raise e.under(key) from None
                except (TypeError, ValueError, KeyError, AttributeError) as e:
                    if strict:
                        raise RecordError("{where}: " + str(e), key) from None
                    raise
        unknown = sorted(set(d) - {_key(f) for f in cls._fields()})
        if unknown and strict:
            raise RecordError(f"unknown {{where}} keys {unknown}")
        extra.update({} if cls._unknown_keys == "drop" else {k: copy.deepcopy(d[k]) for k in unknown})
        try:
            return cls(**values, _absent=frozenset(absent), _extra=extra)
        except TypeError as e:  # a key without a default is absent
            if strict:
                raise RecordError(f"{{where}}: {e}") from None
            raise

    def to_json(self) -> dict[str, Any]:
        """The JSON object: every field under its key, except an absent key still at its default and
        an optional field holding None; then ``_extra``."""
        out = {_key(f): _to_json(getattr(self, f.name)) for f in self._fields()
               if not (f.name in self._absent and getattr(self, f.name) == _default(f))
               and not (f.metadata.get("optional") and getattr(self, f.name) is None)}  # fmt: skip
        return {**copy.deepcopy(dict(self._extra)), **out}
