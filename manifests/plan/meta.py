"""``_plan.json`` as typed, frozen objects: parsed once where it is read, written back byte for byte.

:class:`PlanMeta` mirrors the file: attribute names are its JSON keys (``meta.inputs.world_size``,
``meta.epochs[0].sha256``), maps keyed by data stay maps (``meta.buckets["512x512"].batch_size``).
A key that only some plans have (a mixture's ``mix`` and ``columns``, an epoch's ``datasets``) is an
attribute that is None when absent, and :meth:`PlanMeta.to_json` leaves it out again, so
``PlanMeta.from_json(d, url).to_json() == d`` for every plan this format version writes.
:func:`read_plan_meta` is the one reader; :class:`PlanError` is what a bad plan folder raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from manifests.errors import MissingError, UsageError
from manifests.jsonrecord import JsonRecord, each, each_value, nested, optional
from manifests.plan.mix import MixRule
from manifests.plan.schedule import PlanConfig
from manifests.storage import check_artifact, open_url, read_artifact_meta, redact

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
    "SelectionInputs",
    "SelectionSummary",
    "SelectionAnnotations",
    "SelectionCount",
    "read_plan_meta",
]

PLAN_FILE = "_plan.json"
_VERSION_HINT = "Re-run `bucketeer plan` with this version."
PLAN_KIND = "bucketeer.plan"
# 2: one file per epoch with a row group per rank (1: a file per epoch and rank), batches in id order
PLAN_FORMAT_VERSION = 2


class PlanError(UsageError):
    """A plan folder is missing, uncommitted, of another format version, or malformed."""


class PlanMissingError(PlanError, MissingError):
    """A folder without ``_plan.json``: no plan there, or `bucketeer plan` never finished."""


@dataclass(frozen=True, kw_only=True)
class _PlanRecord(JsonRecord):
    """A record of ``_plan.json``: a field without a default is a key the file must have; keys this
    bucketeer does not know are dropped (a plan is only rewritten by the bucketeer that reads it)."""

    _unknown_keys = "drop"


@dataclass(frozen=True, kw_only=True)
class MixInputs(_PlanRecord):
    """``inputs.mix``: the rule and the fingerprints of every dataset's manifest and cache, in order."""

    kind: str  # weights | repeats
    values: tuple[str, ...]  # exact decimals or fractions, as MixRule writes them
    manifest_fingerprints: tuple[str, ...]
    cache_fingerprints: tuple[str | None, ...]

    @property
    def rule(self) -> MixRule:
        return MixRule.from_json(self.to_json())


@dataclass(frozen=True, kw_only=True)
class SelectionInputs(_PlanRecord):
    """``inputs.selection``: the ``--where`` / ``--weight-by`` expressions (None when not given) and the
    fingerprints of the annotations folders they read, in the ``--annotations`` order (:mod:`manifests.select`)."""

    where: str | None
    weight_by: str | None
    annotations_fingerprints: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class PlanInputs(_PlanRecord):
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
    temporal_factor: int | None = optional()  # video plans only: frames per latent frame (PlanConfig)
    shuffle: str | None = optional()  # "window:SIZE" plans only (PlanConfig); absent: the full shuffle
    manifest_fingerprint: str | None
    cache_fingerprint: str | None
    mix: MixInputs | None = optional(MixInputs.from_json)
    selection: SelectionInputs | None = optional(SelectionInputs.from_json)

    @classmethod
    def of(cls, config: PlanConfig, manifest_fingerprint: str | None, cache_fingerprint: str | None,
           mix: MixInputs | None = None, selection: SelectionInputs | None = None) -> "PlanInputs":  # fmt: skip
        return cls(**config.to_json(), manifest_fingerprint=manifest_fingerprint,
                   cache_fingerprint=cache_fingerprint, mix=mix, selection=selection)  # fmt: skip

    @property
    def config(self) -> PlanConfig:
        return PlanConfig.from_json(self.to_json())


@dataclass(frozen=True, kw_only=True)
class BucketInfo(_PlanRecord):
    """``buckets[name]``: samples (a mixture: sample slots per epoch), per-rank batch size, latent tokens."""

    samples: int
    batch_size: int
    latent_tokens: int


@dataclass(frozen=True, kw_only=True)
class PlanSamplesCount(_PlanRecord):
    """``samples``: planned, a mixture's slots per epoch, and those left out for the cache."""

    planned: int
    per_epoch: int | None = optional()
    not_in_cache: int
    stale: int


@dataclass(frozen=True, kw_only=True)
class EpochEntry(_PlanRecord):
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
    tokens: tuple[int, ...] | None = optional()
    sha256: str
    bytes: int
    footer_bytes: int
    datasets: tuple[int, ...] | None = optional()

    @property
    def full(self) -> bool:
        """Whether the file holds the whole epoch (not the tail a resume starts with)."""
        return self.first_step == 0 and self.steps == self.steps_in_epoch


@dataclass(frozen=True, kw_only=True)
class PlanCounts(_PlanRecord):
    """``counts``: padded and dropped over every epoch held, per bucket; a mixture's slots per dataset."""

    padded: int
    dropped: int
    padded_per_bucket: dict[str, int]
    dropped_per_bucket: dict[str, int]
    per_dataset: tuple[int, ...] | None = optional()


@dataclass(frozen=True, kw_only=True)
class TokensPerStep(_PlanRecord):
    """``tokens_per_step``: per-rank latent tokens per step over every epoch held (None: no step)."""

    min: int | None
    mean: float
    max: int | None
    per: str


@dataclass(frozen=True, kw_only=True)
class ResumedFrom(_PlanRecord):
    """``resumed_from``: the parent plan and the position and world shape it was resumed at."""

    plan_fingerprint: str
    epoch: int
    step: int
    world_size: int
    batch_size: int | None


@dataclass(frozen=True, kw_only=True)
class MixBucket(_PlanRecord):
    samples: int
    per_epoch: int


@dataclass(frozen=True, kw_only=True)
class MixDataset(_PlanRecord):
    """``mix.datasets[d]``: one dataset of a mixture, its value (``weight`` or ``repeat``, the other None)
    and what the rule gives it per epoch and per bucket."""

    manifest: str | None
    cache: str | None
    samples: int
    weight: str | None = optional()
    repeat: str | None = optional()
    per_epoch: int
    times: float
    share: float | None = optional()
    not_in_cache: int
    stale: int
    buckets: dict[str, MixBucket] = nested(each_value(MixBucket.from_json))


@dataclass(frozen=True, kw_only=True)
class MixSummary(_PlanRecord):
    """``mix``: the counting rule in words and per dataset what it gives."""

    rule: str
    datasets: tuple[MixDataset, ...] = nested(each(MixDataset.from_json))


@dataclass(frozen=True, kw_only=True)
class SelectionAnnotations(_PlanRecord):
    """``selection.annotations[i]``: an annotations folder the selection read (URL redacted)."""

    url: str
    fingerprint: str


@dataclass(frozen=True, kw_only=True)
class SelectionCount(_PlanRecord):
    """Samples the selection kept and dropped (of a manifest, or of a bucket over every manifest)."""

    kept: int
    dropped: int
    manifest: str | None = optional()


@dataclass(frozen=True, kw_only=True)
class SelectionSummary(_PlanRecord):
    """``selection``: what ``--where`` / ``--weight-by`` kept of the manifests' samples (before the cache
    filter), per manifest in order and per bucket, and the annotations they read."""

    where: str | None
    weight_by: str | None
    annotations: tuple[SelectionAnnotations, ...] = nested(each(SelectionAnnotations.from_json))
    datasets: tuple[SelectionCount, ...] = nested(each(SelectionCount.from_json))
    buckets: dict[str, SelectionCount] = nested(each_value(SelectionCount.from_json))


@dataclass(frozen=True, kw_only=True)
class PlanMeta(_PlanRecord):
    """``_plan.json`` of a committed plan. ``to_json()`` is the file's dict exactly."""

    kind: str
    format_version: int
    tool_version: str
    mode: str  # fixed | packing
    inputs: PlanInputs = nested(PlanInputs.from_json)
    sources: dict[str, str | None] | None = optional()  # a one-manifest plan's manifest and cache URLs, redacted
    layout: str | None = optional()
    buckets: dict[str, BucketInfo] = nested(each_value(BucketInfo.from_json))
    samples: PlanSamplesCount = nested(PlanSamplesCount.from_json)
    global_batch: int | None
    steps_per_epoch: int
    resumed_from: ResumedFrom | None = nested(ResumedFrom.from_json, default=None)
    columns: tuple[str, ...] | None = optional()  # a mixture's extra plan columns
    mix: MixSummary | None = optional(MixSummary.from_json)
    selection: SelectionSummary | None = optional(SelectionSummary.from_json)
    epochs: tuple[EpochEntry, ...] = nested(each(EpochEntry.from_json))
    counts: PlanCounts | None = nested(PlanCounts.from_json)
    tokens_per_step: TokensPerStep | None = optional(TokensPerStep.from_json)
    fingerprint: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any], url: str) -> "PlanMeta":  # type: ignore[override]
        """Parse ``_plan.json`` read from ``url``. Raises PlanError for another kind or format version, or a
        file that lacks what this version writes."""
        where = f"{redact(url)}/{PLAN_FILE}"
        check_artifact(d, url, file=PLAN_FILE, kind=PLAN_KIND, version=PLAN_FORMAT_VERSION, error=PlanError,
                       version_hint=_VERSION_HINT)  # fmt: skip
        try:
            return super().from_json(d)
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"{where} is malformed ({type(e).__name__}: {e}); re-run `bucketeer plan`") from None

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
        version_hint=_VERSION_HINT,
    )  # fmt: skip
    return PlanMeta.from_json(d, url)
