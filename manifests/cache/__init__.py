"""The cache artifact: ``CACHE/_cache.json``, packed shards of gzip'd safetensors records, their index.

One module a job: :mod:`~manifests.cache.meta` (``_cache.json`` as a typed :class:`CacheMeta`),
:mod:`~manifests.cache.layout` (the folder, index schemas, reading ``_cache.json`` and the index:
what every other module shares), :mod:`~manifests.cache.records` (the record codec),
:mod:`~manifests.cache.text_layout` (how a text record's parts make a model family's prompt embeddings),
:mod:`~manifests.cache.freshness` (is a record still what the manifest row would give),
:mod:`~manifests.cache.writer`, :mod:`~manifests.cache.reader` and :mod:`~manifests.cache.verify`.
The names below are the public API; each module imports only from ``meta``, ``layout``, ``records``
and ``text_layout``.
"""

from manifests.cache.freshness import Freshness, IndexLookup, source_key
from manifests.cache.layout import (
    CACHE_ERRORS_SCHEMA,
    CACHE_FILE,
    CACHE_FORMAT_VERSION,
    SAMPLE_INDEX_SCHEMA,
    SHARD_RECORDS,
    TEXT_INDEX_SCHEMA,
    CacheError,
    CacheMissingError,
    available_sample_ids,
    cache_freshness,
    fingerprint_of,
    index_lookup,
    read_cache_meta,
    read_index,
    settings_diff,
)
from manifests.cache.meta import (
    CacheBytes,
    CacheCounts,
    CacheIndex,
    CacheMeta,
    CacheSettings,
    ComputeInfo,
    EmbedSummary,
    LatentInfo,
    TextEncoderInfo,
    TextEncoderSettings,
    TextInfo,
    TextSettings,
    VaeSettings,
    ValidationPrompt,
    VariantSettings,
    FeaturesInfo,
)
from manifests.cache.reader import CacheReader
from manifests.cache.text_layout import TextLayout
from manifests.cache.writer import CacheCommitter, CacheWriter, KeySet, ShardWriter

__all__ = [
    "CACHE_ERRORS_SCHEMA",
    "CACHE_FILE",
    "CACHE_FORMAT_VERSION",
    "SAMPLE_INDEX_SCHEMA",
    "SHARD_RECORDS",
    "TEXT_INDEX_SCHEMA",
    "CacheBytes",
    "CacheCommitter",
    "CacheCounts",
    "CacheError",
    "CacheIndex",
    "CacheMeta",
    "CacheSettings",
    "ComputeInfo",
    "EmbedSummary",
    "LatentInfo",
    "TextEncoderInfo",
    "TextEncoderSettings",
    "TextInfo",
    "TextSettings",
    "VaeSettings",
    "ValidationPrompt",
    "VariantSettings",
    "FeaturesInfo",
    "CacheMissingError",
    "CacheReader",
    "CacheWriter",
    "Freshness",
    "IndexLookup",
    "KeySet",
    "ShardWriter",
    "TextLayout",
    "available_sample_ids",
    "cache_freshness",
    "fingerprint_of",
    "index_lookup",
    "read_cache_meta",
    "read_index",
    "settings_diff",
    "source_key",
]
