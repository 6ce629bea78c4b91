"""``CACHE/_cache.json`` as typed objects: :class:`CacheMeta`, parsed once where it is read
(:func:`manifests.cache.layout.read_meta`) and built by the committer (:class:`~manifests.cache.CacheCommitter`).

Attribute names are the JSON keys (``meta["latent"]["scaling_factor"]`` is ``meta.latent.scaling_factor``;
the one exception is ``class``, a Python keyword: ``class_``). Lists are tuples; maps keyed by data
(``storage_options``) stay dicts. ``to_json()`` gives back exactly the dict that was read or is to be
written, so a rewrite changes no byte and no fingerprint:

- a top-level key is never null in ``_cache.json``: None means the file does not have it (a cache
  assembled by hand, or one whose embed job has not reached that point);
- a nested object writes every field, except those its file did not have (written before the key
  existed, or assembled by hand, as tests and benchmarks do): those are None and stay absent;
- keys this bucketeer does not know are kept as they were (``_extra``) and written back.

``settings`` is what the fingerprint hashes: :class:`CacheSettings` keeps that dict exactly
(``hashed``) beside its typed view, so the fingerprint never depends on how the view is parsed.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Mapping

from manifests.buckets import BucketSpec
from manifests.cache.text_layout import TextLayout
from manifests.errors import MissingError, UsageError
from manifests.storage import redact

__all__ = [
    "CACHE_FILE",
    "CACHE_FORMAT_VERSION",
    "KIND",
    "CacheError",
    "CacheMissingError",
    "CacheMeta",
    "CacheSettings",
    "VaeSettings",
    "TextSettings",
    "TextEncoderSettings",
    "VariantSettings",
    "LatentInfo",
    "TextInfo",
    "TextEncoderInfo",
    "ValidationPrompt",
    "ComputeInfo",
    "CacheBytes",
    "CacheCounts",
    "CacheIndex",
    "EmbedSummary",
    "fingerprint_of",
    "MISSING_HINT",
    "VERSION_HINT",
]

CACHE_FILE = "_cache.json"
# 2: text as the model family's pipeline encodes it (text.layout: padded parts, pooled, masks), optional
# latent_std. A version-1 cache holds unpadded, masked text of any family: it is refused, not misread
CACHE_FORMAT_VERSION = 2
KIND = "bucketeer.cache"
MISSING_HINT = ("it is not a bucketeer cache, or its embed job has not committed a shard yet. "
                "Run `bucketeer embed MANIFEST --out CACHE` to build it.")  # fmt: skip
VERSION_HINT = ("Re-embed into a new --out (format 2 stores text as the model family's pipeline encodes it, "
                "see --family), or use the bucketeer that wrote it.")  # fmt: skip


class CacheError(UsageError):
    """A cache folder that is missing, of another version or settings, or has a bad record."""


class CacheMissingError(CacheError, MissingError):
    """A folder without ``_cache.json``: no cache there yet, or its embed job never committed."""


def fingerprint_of(settings: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of the preprocessing settings (encoders, weights, dtype, crop...)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _plain(value: Any) -> Any:
    """A JSON value as an attribute: lists become tuples, objects stay dicts (maps keyed by data)."""
    return tuple(_plain(v) for v in value) if isinstance(value, list) else value


def _to_json(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _part(parse: Callable[[Any], Any], **kwargs: Any) -> Any:
    """A field holding a nested JSON value that ``parse`` turns into its type."""
    return field(default=None, metadata={"parse": parse, **kwargs})


def _many(parse: Callable[[Any], Any]) -> Callable[[Any], tuple]:
    return lambda values: tuple(parse(v) for v in values)


def _key(f: Any) -> str:
    return f.metadata.get("key", f.name)


def _default(f: Any) -> Any:
    return None if f.default is MISSING else f.default


@dataclass(frozen=True, kw_only=True)
class _Section:
    """A JSON object of ``_cache.json`` whose keys are the fields (see the module docstring)."""

    _absent: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    _extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def _fields(cls) -> list[Any]:
        return [f for f in fields(cls) if not f.name.startswith("_")]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Any:
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__} is a JSON object, not {type(d).__name__}")
        values, absent = {}, set()
        for f in cls._fields():
            if _key(f) not in d:
                absent.add(f.name)
            elif d[_key(f)] is not None:
                values[f.name] = f.metadata.get("parse", _plain)(d[_key(f)])
        known = {_key(f) for f in cls._fields()}
        extra = {k: copy.deepcopy(v) for k, v in d.items() if k not in known}
        return cls(**values, _absent=frozenset(absent), _extra=extra)

    def to_json(self) -> dict[str, Any]:
        out = {_key(f): _to_json(getattr(self, f.name)) for f in self._fields()
               if f.name not in self._absent or getattr(self, f.name) != _default(f)}  # fmt: skip
        return {**out, **copy.deepcopy(dict(self._extra))}


def _section_or_none(cls: type[_Section]) -> Callable[[Any], Any]:
    """Parse a settings section when it has the shape ``embed`` writes (a cache assembled by hand may
    hold anything there: its settings are only hashed)."""
    return lambda v: cls.from_json(v) if isinstance(v, Mapping) else None


# ---------------------------------------------------------------- settings (fingerprinted)


@dataclass(frozen=True, kw_only=True)
class VaeSettings(_Section):
    id: str | None = None
    subfolder: str | None = None
    class_: str | None = field(default=None, metadata={"key": "class"})
    weights_sha256: str | None = None
    factor: int | None = None
    channels: int | None = None
    scaling_factor: float | None = None
    shift_factor: float | None = None


@dataclass(frozen=True, kw_only=True)
class TextEncoderSettings(_Section):
    id: str | None = None
    subfolder: str | None = None
    class_: str | None = field(default=None, metadata={"key": "class"})
    weights_sha256: str | None = None
    max_length: int | None = None
    hidden_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class TextSettings(_Section):
    layer: str | None = None
    max_text_tokens: int | None = None
    encoders: tuple[TextEncoderSettings, ...] | None = _part(_many(TextEncoderSettings.from_json))
    pipeline: str | None = None
    pooled_dim: int | None = None
    layout: TextLayout | None = _part(TextLayout.from_json)


@dataclass(frozen=True, kw_only=True)
class VariantSettings(_Section):
    crops: int | None = None
    flip: bool | None = None


@dataclass(frozen=True, kw_only=True)
class CacheSettings:
    """The preprocessing settings the fingerprint hashes: ``hashed`` exactly as written (what
    :meth:`to_json` returns and :attr:`fingerprint` hashes), and its typed view. A section of
    another shape than ``embed`` writes (a cache assembled by hand) is None in the view."""

    hashed: Mapping[str, Any] = field(repr=False)
    format_version: int | None = None
    family: str | None = None
    dtype: str | None = None
    buckets: BucketSpec | None = None
    crop: str | None = None
    seed: int | None = None
    resample: str | None = None
    pixels: str | None = None
    latent: str | None = None
    model: str | None = None
    vae: VaeSettings | None = None
    text: TextSettings | None = None
    variants: VariantSettings | None = None  # --crops/--flip; None: one crop, no mirror
    conditioning: str | None = None  # set when samples carry a conditioning latent

    _SCALARS = ("format_version", "family", "dtype", "crop", "seed", "resample", "pixels", "latent", "model",
                "conditioning")  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "CacheSettings":
        if not isinstance(d, Mapping):
            raise TypeError(f"settings is a JSON object, not {type(d).__name__}")
        scalars = {k: d[k] for k in cls._SCALARS if k in d and not isinstance(d[k], (Mapping, list))}
        spec = d.get("buckets")
        return cls(hashed=copy.deepcopy(dict(d)), **scalars,
                   buckets=BucketSpec.from_json(spec) if isinstance(spec, Mapping) else None,
                   vae=_section_or_none(VaeSettings)(d.get("vae")), text=_section_or_none(TextSettings)(d.get("text")),
                   variants=_section_or_none(VariantSettings)(d.get("variants")))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.hashed))

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self.hashed)

    @property
    def variant_count(self) -> int:
        """Variants per sample record: crops x (2 with flip)."""
        v = self.variants
        return int(v.crops) * (2 if v.flip else 1) if v else 1


# ---------------------------------------------------------------- how to read the records


@dataclass(frozen=True, kw_only=True)
class LatentInfo(_Section):
    kind: str | None = None  # posterior_mean | posterior_mean_std
    dtype: str | None = None
    channels: int | None = None
    factor: int | None = None
    scaling_factor: float | None = None
    shift_factor: float | None = None
    usage: str | None = None


@dataclass(frozen=True, kw_only=True)
class TextEncoderInfo(_Section):
    id: str | None = None
    class_: str | None = field(default=None, metadata={"key": "class"})
    hidden_size: int | None = None
    max_length: int | None = None


@dataclass(frozen=True, kw_only=True)
class ValidationPrompt(_Section):
    prompt: str
    caption_key: int


@dataclass(frozen=True, kw_only=True)
class TextInfo(_Section):
    family: str | None = None
    pipeline: str | None = None
    dtype: str | None = None
    layer: str | None = None
    max_tokens: int | None = None
    pooled_dim: int | None = None
    encoders: tuple[TextEncoderInfo, ...] | None = _part(_many(TextEncoderInfo.from_json))
    layout: TextLayout | None = _part(TextLayout.from_json)
    empty_caption_key: int | None = None  # its text record: caption dropout, and a null caption's text
    validation_prompts: tuple[ValidationPrompt, ...] | None = _part(_many(ValidationPrompt.from_json))


@dataclass(frozen=True, kw_only=True)
class ComputeInfo(_Section):
    device: str | None = None
    gpus: int | None = None
    dtype: str | None = None


@dataclass(frozen=True, kw_only=True)
class CacheBytes(_Section):
    """Compressed bytes of the live records: totals, and the means (None when there is no record)."""

    samples: int | None = None
    texts: int | None = None
    per_sample: int | None = None
    per_caption: int | None = None


@dataclass(frozen=True, kw_only=True)
class CacheCounts(_Section):
    samples: int = 0
    texts: int = 0
    errors: int = 0


@dataclass(frozen=True, kw_only=True)
class CacheIndex(_Section):
    """The index parts of each kind, paths relative to the cache root, in commit order."""

    samples: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    def parts(self, kind: str) -> tuple[str, ...]:
        """The parts of ``kind`` (``samples``, ``texts`` or ``errors``)."""
        return getattr(self, kind)


@dataclass(frozen=True, kw_only=True)
class EmbedSummary(_Section):
    """What the last embed run did (``{}`` for a cache not written by ``bucketeer embed``)."""

    embedded: int | None = None
    errors: int | None = None
    skipped: int | None = None
    changed: int | None = None
    retried: int | None = None
    new_captions: int | None = None
    bytes_per_caption: int | None = None  # this run's records, compressed
    bytes_per_sample: int | None = None
    seconds: float | None = None
    image_seconds: float | None = None  # steady state: first image result to the last
    images_per_second: float | None = None
    device: str | None = None
    encoder_nodes: int | None = None
    shards: int | None = None
    redone: int | None = None


# ---------------------------------------------------------------- the file


@dataclass(frozen=True, kw_only=True)
class CacheMeta(_Section):
    """``_cache.json``. Required: ``kind``, ``format_version``, ``fingerprint``, ``settings``, ``index``,
    ``counts``; every other key is None when the file does not have it."""

    kind: str
    format_version: int
    fingerprint: str
    settings: CacheSettings = _part(CacheSettings.from_json)
    index: CacheIndex = _part(CacheIndex.from_json)
    counts: CacheCounts = _part(CacheCounts.from_json)
    manifests: tuple[str, ...] = ()  # fingerprints of the manifests embedded into it
    created_at: str | None = None
    updated_at: str | None = None
    tool_version: str | None = None
    complete: bool | None = None
    generation: int | None = None  # commits so far; the newest index row of a sample wins
    family: str | None = None
    latent: LatentInfo | None = _part(LatentInfo.from_json)
    text: TextInfo | None = _part(TextInfo.from_json)
    gzip: str | None = None
    storage_options: dict[str, Any] | None = None
    compute: ComputeInfo | None = _part(ComputeInfo.from_json)
    bytes: CacheBytes | None = _part(CacheBytes.from_json)
    superseded_records: int | None = None
    summary: EmbedSummary | None = _part(EmbedSummary.from_json)

    @classmethod
    def from_json(cls, d: Any, url: str) -> "CacheMeta":  # type: ignore[override]
        """Parse ``_cache.json`` of the cache at ``url`` (for messages). CacheError when it is not a
        bucketeer cache, of another format version, or malformed."""
        found = d.get("kind") if isinstance(d, Mapping) else None
        if found != KIND:
            raise CacheError(f"{redact(url)}/{CACHE_FILE} is not a {KIND} (kind={found!r})")
        if d.get("format_version") != CACHE_FORMAT_VERSION:
            raise CacheError(f"{redact(url)} has {CACHE_FILE} format version {d.get('format_version')!r}; this "
                             f"bucketeer reads version {CACHE_FORMAT_VERSION}. {VERSION_HINT}")  # fmt: skip
        try:
            return super().from_json(d)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise CacheError(f"{redact(url)}/{CACHE_FILE} is malformed ({type(e).__name__}: {e}); "
                             "re-embed into a new --out") from None  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The dict written as ``_cache.json`` (no top-level key is ever null)."""
        return {k: v for k, v in super().to_json().items() if v is not None}

    @property
    def text_layout(self) -> TextLayout:
        """How this cache's text records join into prompt embeddings: ``text.layout``; a ``text``
        section without one (caches assembled by hand, as tests and benchmarks do) is the generic
        layout: one masked part per entry of ``text.encoders``, joined on features. UsageError when
        there is neither."""
        text = self.text or TextInfo()
        if text.layout is not None:
            return text.layout
        if not text.encoders:
            raise UsageError("_cache.json has no text.layout nor text.encoders: not a cache `bucketeer embed` wrote")
        return TextLayout(family="generic", join="features", masked=True,
                          lengths=tuple(int(e.max_length or 0) or 1 << 16 for e in text.encoders),
                          widths=tuple(int(e.hidden_size) for e in text.encoders),
                          pooled_dim=None if text.pooled_dim is None else int(text.pooled_dim))  # fmt: skip
