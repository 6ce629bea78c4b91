"""``_plan.json`` as typed, frozen objects: parsed once where it is read, written back byte for byte.

:class:`PlanMeta` mirrors the file: attribute names are its JSON keys (``meta.inputs.world_size``,
``meta.epochs[0].sha256``), maps keyed by data stay maps (``meta.buckets["512x512"].batch_size``).
A key that only some plans have (a mixture's ``mix`` and ``columns``, an epoch's ``datasets``) is an
attribute that is None when absent, and :meth:`PlanMeta.to_json` leaves it out again, so
``PlanMeta.from_json(d, url).to_json() == d`` for every plan this format version writes.
:func:`read_plan_meta` is the one reader; :class:`PlanError` is what a bad plan folder raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from manifests.errors import MissingError, UsageError
from manifests.plan.mix import MixRule
from manifests.plan.schedule import PlanConfig
from manifests.storage import open_url, read_artifact_meta, redact

__all__ = [
    "PLAN_FILE",
    "PLAN_KIND",
    "PLAN_FORMAT_VERSION",
    "PlanError",
    "PlanMissingError",
    "PlanMeta",
    "PlanInputs",
    "MixInputs",
    "BucketInfo",
    "PlanSamplesCount",
    "EpochEntry",
    "PlanCounts",
    "TokensPerStep",
    "ResumedFrom",
    "MixSummary",
    "MixDataset",
    "MixBucket",
    "read_plan_meta",
]

PLAN_FILE = "_plan.json"
PLAN_KIND = "bucketeer.plan"
# 2: one file per epoch with a row group per rank (1: a file per epoch and rank), batches in id order
PLAN_FORMAT_VERSION = 2


class PlanError(UsageError):
    """A plan folder is missing, uncommitted, of another format version, or malformed."""


class PlanMissingError(PlanError, MissingError):
    """A folder without ``_plan.json``: no plan there, or `bucketeer plan` never finished."""


def _absent() -> Any:
    """A field whose key only some plans have: None when absent, and left out of ``to_json`` then."""
    return field(default=None, metadata={"absent_when_none": True})


def _plain(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Record:
    """``to_json``: every field under its own name, in declaration order (nested records as dicts)."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)  # type: ignore[arg-type]
                if not (f.metadata.get("absent_when_none") and getattr(self, f.name) is None)}  # fmt: skip


def _ints(values: Any) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


@dataclass(frozen=True)
class MixInputs(_Record):
    """``inputs.mix``: the rule and the fingerprints of every dataset's manifest and cache, in order."""

    kind: str  # weights | repeats
    values: tuple[str, ...]  # exact decimals or fractions, as MixRule writes them
    manifest_fingerprints: tuple[str, ...]
    cache_fingerprints: tuple[str | None, ...]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MixInputs":
        return cls(d["kind"], tuple(d["values"]), tuple(d["manifest_fingerprints"]), tuple(d["cache_fingerprints"]))

    @property
    def rule(self) -> MixRule:
        return MixRule.from_json(self.to_json())


@dataclass(frozen=True)
class PlanInputs(_Record):
    """``inputs``: what the plan is a pure function of (:class:`PlanConfig` and the data's fingerprints)."""

    world_size: int
    batch_size: int | None
    seed: int
    epochs: int
    leftover: str
    grad_accum: int
    max_tokens: int | None
    latent_factor: int
    patch_size: int
    manifest_fingerprint: str | None
    cache_fingerprint: str | None
    mix: MixInputs | None = _absent()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PlanInputs":
        mix = d.get("mix")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name != "mix"},
                   mix=None if mix is None else MixInputs.from_json(mix))  # fmt: skip

    @classmethod
    def of(cls, config: PlanConfig, manifest_fingerprint: str | None, cache_fingerprint: str | None,
           mix: MixInputs | None = None) -> "PlanInputs":  # fmt: skip
        return cls(**config.to_json(), manifest_fingerprint=manifest_fingerprint,
                   cache_fingerprint=cache_fingerprint, mix=mix)  # fmt: skip

    @property
    def config(self) -> PlanConfig:
        return PlanConfig.from_json(self.to_json())


@dataclass(frozen=True)
class BucketInfo(_Record):
    """``buckets[name]``: samples (a mixture: sample slots per epoch), per-rank batch size, latent tokens."""

    samples: int
    batch_size: int
    latent_tokens: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "BucketInfo":
        return cls(d["samples"], d["batch_size"], d["latent_tokens"])


@dataclass(frozen=True)
class PlanSamplesCount(_Record):
    """``samples``: planned, a mixture's slots per epoch, and those left out for the cache."""

    planned: int
    per_epoch: int | None = _absent()
    not_in_cache: int = 0
    stale: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PlanSamplesCount":
        return cls(d["planned"], d.get("per_epoch"), d["not_in_cache"], d["stale"])


@dataclass(frozen=True)
class EpochEntry(_Record):
    """``epochs[i]``: one epoch file: its steps (from ``first_step``), padding and drops per bucket, latent
    tokens per rank and step (min, max, sum), the file's sha256, size and footer length; a mixture's slots
    per dataset."""

    epoch: int
    first_step: int
    steps: int
    steps_in_epoch: int
    padded: dict[str, int]
    dropped: dict[str, int]
    padded_total: int
    dropped_total: int
    tokens: tuple[int, ...] | None = _absent()
    sha256: str = ""
    bytes: int = 0
    footer_bytes: int = 0
    datasets: tuple[int, ...] | None = _absent()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "EpochEntry":
        return cls(d["epoch"], d["first_step"], d["steps"], d["steps_in_epoch"], dict(d["padded"]), dict(d["dropped"]),
                   d["padded_total"], d["dropped_total"], _ints(d.get("tokens")), d["sha256"], d["bytes"],
                   d["footer_bytes"], _ints(d.get("datasets")))  # fmt: skip

    @property
    def full(self) -> bool:
        """Whether the file holds the whole epoch (not the tail a resume starts with)."""
        return self.first_step == 0 and self.steps == self.steps_in_epoch


@dataclass(frozen=True)
class PlanCounts(_Record):
    """``counts``: padded and dropped over every epoch held, per bucket; a mixture's slots per dataset."""

    padded: int
    dropped: int
    padded_per_bucket: dict[str, int]
    dropped_per_bucket: dict[str, int]
    per_dataset: tuple[int, ...] | None = _absent()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PlanCounts":
        return cls(d["padded"], d["dropped"], dict(d["padded_per_bucket"]), dict(d["dropped_per_bucket"]),
                   _ints(d.get("per_dataset")))  # fmt: skip


@dataclass(frozen=True)
class TokensPerStep(_Record):
    """``tokens_per_step``: per-rank latent tokens per step over every epoch held (None: no step)."""

    min: int | None
    mean: float
    max: int | None
    per: str = "rank"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TokensPerStep":
        return cls(d["min"], d["mean"], d["max"], d["per"])


@dataclass(frozen=True)
class ResumedFrom(_Record):
    """``resumed_from``: the parent plan and the position and world shape it was resumed at."""

    plan_fingerprint: str
    epoch: int
    step: int
    world_size: int
    batch_size: int | None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ResumedFrom":
        return cls(d["plan_fingerprint"], d["epoch"], d["step"], d["world_size"], d["batch_size"])


@dataclass(frozen=True)
class MixBucket(_Record):
    samples: int
    per_epoch: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MixBucket":
        return cls(d["samples"], d["per_epoch"])


@dataclass(frozen=True)
class MixDataset(_Record):
    """``mix.datasets[d]``: one dataset of a mixture, its value (``weight`` or ``repeat``, the other None)
    and what the rule gives it per epoch and per bucket."""

    manifest: str | None
    cache: str | None
    samples: int
    weight: str | None = _absent()
    repeat: str | None = _absent()
    per_epoch: int = 0
    times: float = 0.0
    share: float | None = _absent()
    not_in_cache: int = 0
    stale: int = 0
    buckets: dict[str, MixBucket] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MixDataset":
        return cls(d["manifest"], d["cache"], d["samples"], d.get("weight"), d.get("repeat"), d["per_epoch"],
                   d["times"], d.get("share"), d["not_in_cache"], d["stale"],
                   {n: MixBucket.from_json(b) for n, b in d["buckets"].items()})  # fmt: skip


@dataclass(frozen=True)
class MixSummary(_Record):
    """``mix``: the counting rule in words and per dataset what it gives."""

    rule: str
    datasets: tuple[MixDataset, ...]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MixSummary":
        return cls(d["rule"], tuple(MixDataset.from_json(x) for x in d["datasets"]))


@dataclass(frozen=True)
class PlanMeta(_Record):
    """``_plan.json`` of a committed plan. ``to_json()`` is the file's dict exactly."""

    kind: str
    format_version: int
    tool_version: str
    mode: str  # fixed | packing
    inputs: PlanInputs
    sources: dict[str, str | None] | None = _absent()  # a one-manifest plan's manifest and cache URLs, redacted
    layout: str | None = _absent()
    buckets: dict[str, BucketInfo] = field(default_factory=dict)
    samples: PlanSamplesCount = PlanSamplesCount(0)
    global_batch: int | None = None
    steps_per_epoch: int = 0
    resumed_from: ResumedFrom | None = None
    columns: tuple[str, ...] | None = _absent()  # a mixture's extra plan columns
    mix: MixSummary | None = _absent()
    epochs: tuple[EpochEntry, ...] = ()
    counts: PlanCounts | None = None
    tokens_per_step: TokensPerStep | None = _absent()
    fingerprint: str = ""

    @classmethod
    def from_json(cls, d: Mapping[str, Any], url: str) -> "PlanMeta":
        """Parse ``_plan.json`` read from ``url``. Raises PlanError for another kind or format version, or a
        file that lacks what this version writes."""
        where = f"{redact(url)}/{PLAN_FILE}"
        found = d.get("kind") if isinstance(d, Mapping) else None
        if found != PLAN_KIND:
            raise PlanError(f"{where} is not a {PLAN_KIND} (kind={found!r})")
        if d.get("format_version") != PLAN_FORMAT_VERSION:
            raise PlanError(f"{redact(url)} has {PLAN_FILE} format version {d.get('format_version')!r}; this "
                            f"bucketeer reads version {PLAN_FORMAT_VERSION}. Re-run `bucketeer plan` with this "
                            "version.")  # fmt: skip
        try:
            return cls._parse(d)
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"{where} is malformed ({type(e).__name__}: {e}); re-run `bucketeer plan`") from None

    @classmethod
    def _parse(cls, d: Mapping[str, Any]) -> "PlanMeta":
        def opt(key: str, parse: Any) -> Any:
            return None if d.get(key) is None else parse(d[key])

        return cls(
            kind=d["kind"], format_version=d["format_version"], tool_version=d["tool_version"], mode=d["mode"],
            inputs=PlanInputs.from_json(d["inputs"]), sources=opt("sources", dict), layout=d.get("layout"),
            buckets={n: BucketInfo.from_json(b) for n, b in d["buckets"].items()},
            samples=PlanSamplesCount.from_json(d["samples"]), global_batch=d["global_batch"],
            steps_per_epoch=d["steps_per_epoch"], resumed_from=opt("resumed_from", ResumedFrom.from_json),
            columns=opt("columns", tuple), mix=opt("mix", MixSummary.from_json),
            epochs=tuple(EpochEntry.from_json(e) for e in d["epochs"]), counts=PlanCounts.from_json(d["counts"]),
            tokens_per_step=opt("tokens_per_step", TokensPerStep.from_json), fingerprint=d["fingerprint"],
        )  # fmt: skip

    def epoch(self, epoch: int) -> EpochEntry | None:
        """The entry of ``epoch``, None when the plan does not hold it."""
        return next((e for e in self.epochs if e.epoch == epoch), None)


def read_plan_meta(url: str, storage_options: Mapping[str, Any] | None = None) -> PlanMeta:
    """``_plan.json`` of a committed plan, parsed. Raises PlanError saying what is wrong and what to do."""
    fs, root = open_url(url, dict(storage_options or {}))
    d = read_artifact_meta(
        fs, root, url, file=PLAN_FILE, kind=PLAN_KIND, version=PLAN_FORMAT_VERSION, error=PlanError,
        missing=PlanMissingError,
        missing_hint="it is not a plan, or `bucketeer plan` never finished (still running or killed). "
        "Run `bucketeer plan` to (re)build it.",
        version_hint="Re-run `bucketeer plan` with this version.",
    )  # fmt: skip
    return PlanMeta.from_json(d, url)
