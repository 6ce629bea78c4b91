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
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from manifests.buckets import BucketSpec
from manifests.cache.text_layout import TextLayout
from manifests.errors import MissingError, UsageError
from manifests.jsonrecord import JsonRecord, each, nested, optional
from manifests.storage import check_artifact, redact

__all__ = [
    "CACHE_FILE",
    "CACHE_FORMAT_VERSION",
    "KIND",
    "CacheError",
    "CacheMissingError",
    "CacheMeta",
    "CacheSettings",
    "VaeSettings",
    "VideoSettings",
    "TextSettings",
    "TextEncoderSettings",
    "VariantSettings",
    "FeaturesInfo",
    "LatentInfo",
    "TextInfo",
    "TextEncoderInfo",
    "ValidationPrompt",
    "ComputeInfo",
    "CacheBytes",
    "RecordsInfo",
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


def _section_or_none(cls: type[JsonRecord]) -> Callable[[Any], Any]:
    """Parse a settings section when it has the shape ``embed`` writes (a cache assembled by hand may
    hold anything there: its settings are only hashed)."""
    return lambda v: cls.from_json(v) if isinstance(v, Mapping) else None


# ---------------------------------------------------------------- settings (fingerprinted)


@dataclass(frozen=True, kw_only=True)
class VaeSettings(JsonRecord):
    id: str | None = None
    subfolder: str | None = None
    class_: str | None = field(default=None, metadata={"key": "class"})
    weights_sha256: str | None = None
    factor: int | None = None
    channels: int | None = None
    scaling_factor: float | None = None
    shift_factor: float | None = None


@dataclass(frozen=True, kw_only=True)
class TextEncoderSettings(JsonRecord):
    id: str | None = None
    subfolder: str | None = None
    class_: str | None = field(default=None, metadata={"key": "class"})
    weights_sha256: str | None = None
    max_length: int | None = None
    hidden_size: int | None = None
    processor: dict[str, str] | None = None  # a multimodal family's: class, image_processor, backend


@dataclass(frozen=True, kw_only=True)
class TextSettings(JsonRecord):
    layer: str | None = None
    max_text_tokens: int | None = None
    encoders: tuple[TextEncoderSettings, ...] | None = nested(each(TextEncoderSettings.from_json), default=None)
    pipeline: str | None = None
    pooled_dim: int | None = None
    layout: TextLayout | None = nested(TextLayout.from_json, default=None)


@dataclass(frozen=True, kw_only=True)
class VariantSettings(JsonRecord):
    crops: int | None = None
    flip: bool | None = None


@dataclass(frozen=True, kw_only=True)
class VideoSettings(JsonRecord):
    """A video cache's ``settings.video`` (``embed`` of a ``WxHxF`` manifest): each record holds up to
    ``max_clips`` clips of its video as variants (``clips`` says which), decoded with ``decoder``."""

    max_clips: int | None = None
    clips: str | None = None
    decoder: str | None = None


@dataclass(frozen=True, kw_only=True)
class FeaturesInfo(JsonRecord):
    """The DINOv2 patch features of ``embed --features dinov2`` (REPA): ``settings.features`` (fingerprinted)
    and ``_cache.json`` ``features`` (the same, plus ``dtype`` and ``usage``). ``input_size`` (h, w): the
    pixels the model saw (every variant's crop resized to it); ``grid`` (gh, gw) = input_size / patch_size:
    each record's ``features`` is ``(gh, gw, dim)``. ``weights_sha256``: of the model's state dict."""

    kind: str | None = None  # dinov2
    id: str | None = None
    class_: str | None = field(default=None, metadata={"key": "class"})
    weights_sha256: str | None = None
    input_size: tuple[int, int] | None = None
    patch_size: int | None = None
    grid: tuple[int, int] | None = None
    dim: int | None = None
    resize: str | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    dtype: str | None = None
    usage: str | None = None


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
    features: FeaturesInfo | None = None  # --features; None: records carry no features
    masks: str | None = None  # set when samples may carry a loss mask (scan --masks); how it is stored
    video: VideoSettings | None = None  # a video cache (WxHxF buckets); None: images

    _SCALARS = ("format_version", "family", "dtype", "crop", "seed", "resample", "pixels", "latent", "model",
                "conditioning", "masks")  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "CacheSettings":
        if not isinstance(d, Mapping):
            raise TypeError(f"settings is a JSON object, not {type(d).__name__}")
        scalars = {k: d[k] for k in cls._SCALARS if k in d and not isinstance(d[k], (Mapping, list))}
        spec = d.get("buckets")
        return cls(hashed=copy.deepcopy(dict(d)), **scalars,
                   buckets=BucketSpec.from_json(spec) if isinstance(spec, Mapping) else None,
                   vae=_section_or_none(VaeSettings)(d.get("vae")), text=_section_or_none(TextSettings)(d.get("text")),
                   variants=_section_or_none(VariantSettings)(d.get("variants")),
                   features=_section_or_none(FeaturesInfo)(d.get("features")),
                   video=_section_or_none(VideoSettings)(d.get("video")))  # fmt: skip

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
class LatentInfo(JsonRecord):
    kind: str | None = None  # posterior_mean | posterior_mean_std
    dtype: str | None = None
    channels: int | None = None
    factor: int | None = None
    scaling_factor: float | None = None
    shift_factor: float | None = None
    usage: str | None = None
    # video VAEs (AutoencoderKLWan): latents are stored as the posterior mean, and the trainer normalises them per
    # channel, (z - latents_mean) / latents_std, as WanPipeline inverts it; ``temporal_factor`` frames per latent
    # frame after the first (causal: F frames -> (F - 1) // temporal_factor + 1). Absent from image caches.
    latents_mean: tuple[float, ...] | None = optional()
    latents_std: tuple[float, ...] | None = optional()
    temporal_factor: int | None = optional()


@dataclass(frozen=True, kw_only=True)
class TextEncoderInfo(JsonRecord):
    id: str | None = None
    class_: str | None = field(default=None, metadata={"key": "class"})
    hidden_size: int | None = None
    max_length: int | None = None


@dataclass(frozen=True, kw_only=True)
class ValidationPrompt(JsonRecord):
    prompt: str
    caption_key: int


@dataclass(frozen=True, kw_only=True)
class TextInfo(JsonRecord):
    family: str | None = None
    pipeline: str | None = None
    dtype: str | None = None
    layer: str | None = None
    max_tokens: int | None = None
    pooled_dim: int | None = None
    encoders: tuple[TextEncoderInfo, ...] | None = nested(each(TextEncoderInfo.from_json), default=None)
    layout: TextLayout | None = nested(TextLayout.from_json, default=None)
    empty_caption_key: int | None = None  # its text record: caption dropout, and a null caption's text
    validation_prompts: tuple[ValidationPrompt, ...] | None = nested(each(ValidationPrompt.from_json), default=None)
    compact: str | None = optional()  # embed --text-dtype fp8: float8 codes + scales, read back as float32


@dataclass(frozen=True, kw_only=True)
class ComputeInfo(JsonRecord):
    device: str | None = None
    gpus: int | None = None
    dtype: str | None = None


@dataclass(frozen=True, kw_only=True)
class CacheBytes(JsonRecord):
    """Compressed bytes of the live records: totals, and the means (None when there is no record)."""

    samples: int | None = None
    texts: int | None = None
    per_sample: int | None = None
    per_caption: int | None = None


@dataclass(frozen=True, kw_only=True)
class RecordsInfo(JsonRecord):
    """How the records are stored (``_cache.json`` ``records``; absent: a cache written before it existed,
    every record ``plain``). Readers decode each record by its own header, so this says what to expect:

    - ``layouts``: the record layouts the cache holds (:mod:`manifests.cache.codec`): ``plain``
      (``gzip(safetensors)``), ``planar`` (float tensors as byte planes: a Huffman-only high plane and stored
      low planes, two gzip members); a cache older writers began and newer ones continued holds both;
    - ``layout``: what its writers write now; ``high_plane`` / ``low_planes``: how each is deflated;
    - ``text``: where a caption's text embedding lives: ``inline_when_unique`` (in the record of the one
      sample that has it, index column ``text_inline``; shared captions, the empty caption and validation
      prompts in text records) or ``apart`` (every caption in a text record, as older caches).
    """

    layouts: tuple[str, ...] = ()
    layout: str | None = None
    high_plane: str | None = None
    low_planes: str | None = None
    text: str | None = None


@dataclass(frozen=True, kw_only=True)
class CacheCounts(JsonRecord):
    samples: int = 0
    texts: int = 0
    errors: int = 0


@dataclass(frozen=True, kw_only=True)
class CacheIndex(JsonRecord):
    """The index parts of each kind, paths relative to the cache root, in commit order."""

    samples: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    def parts(self, kind: str) -> tuple[str, ...]:
        """The parts of ``kind`` (``samples``, ``texts`` or ``errors``)."""
        return getattr(self, kind)


@dataclass(frozen=True, kw_only=True)
class EmbedSummary(JsonRecord):
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
    throttled: int | None = None  # storage answers that asked for fewer requests (503 SlowDown, 429), all retried
    # embed --reuse: records copied from other caches instead of encoded (of ``embedded`` and ``new_captions``),
    # records found there that failed a check (encoded instead), and those caches
    reused_samples: int | None = optional()
    reused_texts: int | None = optional()
    refused: int | None = optional()
    reused_from: tuple[str, ...] | None = optional()


# ---------------------------------------------------------------- the file


@dataclass(frozen=True, kw_only=True)
class CacheMeta(JsonRecord):
    """``_cache.json``. Required: ``kind``, ``format_version``, ``fingerprint``, ``settings``, ``index``,
    ``counts``; every other key is None when the file does not have it."""

    kind: str
    format_version: int
    fingerprint: str
    settings: CacheSettings = optional(CacheSettings.from_json)
    index: CacheIndex = optional(CacheIndex.from_json)
    counts: CacheCounts = optional(CacheCounts.from_json)
    manifests: tuple[str, ...] = ()  # fingerprints of the manifests embedded into it
    created_at: str | None = optional()
    updated_at: str | None = optional()
    tool_version: str | None = optional()
    complete: bool | None = optional()
    generation: int | None = optional()  # commits so far; the newest index row of a sample wins
    family: str | None = optional()
    latent: LatentInfo | None = optional(LatentInfo.from_json)
    features: FeaturesInfo | None = optional(FeaturesInfo.from_json)  # embed --features: how records' features are
    text: TextInfo | None = optional(TextInfo.from_json)
    gzip: str | None = optional()
    records: RecordsInfo | None = optional(RecordsInfo.from_json)
    storage_options: dict[str, Any] | None = optional()
    compute: ComputeInfo | None = optional(ComputeInfo.from_json)
    bytes: CacheBytes | None = optional(CacheBytes.from_json)
    superseded_records: int | None = optional()
    summary: EmbedSummary | None = optional(EmbedSummary.from_json)

    @classmethod
    def from_json(cls, d: Any, url: str) -> "CacheMeta":  # type: ignore[override]
        """Parse ``_cache.json`` of the cache at ``url`` (for messages). CacheError when it is not a
        bucketeer cache, of another format version, or malformed."""
        check_artifact(d, url, file=CACHE_FILE, kind=KIND, version=CACHE_FORMAT_VERSION, error=CacheError,
                       version_hint=VERSION_HINT)  # fmt: skip
        try:
            return super().from_json(d)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise CacheError(f"{redact(url)}/{CACHE_FILE} is malformed ({type(e).__name__}: {e}); "
                             "re-embed into a new --out") from None  # fmt: skip

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
