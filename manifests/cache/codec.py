"""The bytes of one cache record: gzip'd tensors (safetensors-shaped), encoded and decoded without pickle.

Two layouts, told apart per record by its header (a cache written partly before this layout existed
holds both, and every reader reads both):

- ``plain`` (what bucketeer wrote before ``planar``): ``gzip(safetensors)``. Safetensors is an 8-byte little-endian
  header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``
  and the raw little-endian tensor bytes.
- ``planar`` (:data:`RECORD_LAYOUT`, what the writers write): float tensors split into **byte planes**.
  A bf16 value's high byte (sign and 7 exponent bits) is highly skewed, its low byte (the last
  exponent bit and the mantissa) close to random: deflate gains little on the pair and spends its
  decode time on the random half. So the record is a two-member gzip (RFC 1952 allows several
  members; ``gzip.decompress`` and ISA-L read them as one stream): member 1 holds the header, the
  small tensors and each float tensor's most significant byte plane, deflated **Huffman-only** (the
  planes have skew but no repeats: LZ matching costs time and gains nothing); member 2 holds the other
  byte planes as **stored** deflate blocks (no compression: inflate copies them). A planar tensor's
  header entry has ``"planes": [high, low]`` (byte offsets into the data after the header: the
  ``n``-byte high plane, and the ``(itemsize - 1) * n`` bytes of the other planes, least
  significant first) instead of ``data_offsets``, so a reader that predates it refuses the record
  (a malformed entry) rather than misreading it. Levels chosen by ``benchmarks/records.py``.
  Byte tensors of a few hundred elements or more (``U8``: loss masks, whose runs LZ matching finds and
  a Huffman code shared with the latents' exponents does not) come last, after the low planes, in a
  third member deflated at the default level and strategy (``benchmarks/cache_bytes.py``); their
  entries keep ``data_offsets`` (a record without such tensors has two members, as before).
  Float8 codes (``F8_E4M3``: compact text records, :mod:`manifests.cache.compact`) of a few hundred elements
  or more come after those, in a member of their own deflated with **run-length** matching only
  (``Z_RLE``): the codes' byte histogram is skewed (Huffman pays), and the zero rows of a left-padded
  prompt (FLUX.2-dev's) are runs that Huffman-only codes at a bit a byte and ``Z_RLE`` at almost nothing:
  deflate -6's bytes in ~57% of its time, inflated fastest (``benchmarks/compact_text.py``). Entries keep
  ``data_offsets``; a reader that predates the tag refuses the record (unsupported dtype).

Tensors come back as numpy arrays (numpy has no bfloat16: a BF16 tensor comes back as its raw
``uint16`` bits with the tag ``"BF16"``), viewing the decompressed buffer where the layout allows
(plain tensors, planar ones with one byte per element) and reassembled from their planes otherwise.

gzip: ISA-L (``isal``, a core dependency where its wheels exist) decodes, else the standard library;
the writers compress with the standard library's zlib (Huffman-only and stored blocks, which ISA-L's
compressor does not offer); the format is RFC 1952 either way.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any, Mapping

import numpy as np

try:  # ISA-L: inflates 2-4x faster than zlib, same format
    from isal import igzip as _gzip
    from isal import isal_zlib as _zlib

    GZIP_BACKEND = "isal"
except ImportError:  # pragma: no cover - platforms without an isal wheel
    import gzip as _gzip

    _zlib = zlib
    GZIP_BACKEND = "zlib"

__all__ = ["GZIP_BACKEND", "RECORD_LAYOUT", "LAYOUTS", "HIGH_LEVEL", "HIGH_STRATEGY", "DTYPES", "PLANAR_TAGS",
           "RecordError", "gzip_compress", "gzip_decompress", "crc32", "encode_tensors", "encode_planar",
           "decode_tensors", "encode_record", "decode_record", "record_layout"]  # fmt: skip

RECORD_LAYOUT = "planar"  # what encode_record writes by default; recorded in _cache.json ``records``
LAYOUTS = ("plain", "planar")
HIGH_LEVEL = 6  # zlib level of the high-plane member (Huffman-only: the level only sizes zlib's buffers)
HIGH_STRATEGY = zlib.Z_HUFFMAN_ONLY
CODES_STRATEGY = zlib.Z_RLE  # float8 codes: Huffman plus runs (a padded prompt's zero rows)

# safetensors dtype tag -> numpy dtype of the stored bits (BF16 has no numpy dtype: raw uint16)
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),  # float8_e4m3fn bits (compact text records: manifests.cache.compact)
}
PLANAR_TAGS = frozenset({"BF16", "F16", "F32"})  # floats whose high byte plane compresses and low ones do not
_PLANAR_MIN = 256  # elements: below this a tensor is stored whole (its planes would gain nothing)
_MAX_HEADER = 1 << 20  # a record header is a few hundred bytes; refuse absurd lengths early


class RecordError(ValueError):
    """Bytes that are not a valid record: bad gzip, bad header, inconsistent offsets."""


def _deflate(data: bytes, level: int, strategy: int = zlib.Z_DEFAULT_STRATEGY) -> bytes:
    """One gzip member of ``data`` (zlib; mtime 0, so equal input gives equal bytes)."""
    c = zlib.compressobj(level, zlib.DEFLATED, 31, 9, strategy)
    return c.compress(data) + c.flush()


def gzip_compress(data: bytes) -> bytes:
    """gzip ``data`` as one member, zlib level 6 (mtime 0: equal input gives equal output)."""
    return _deflate(data, 6)


def gzip_decompress(data: bytes) -> bytes:
    """Decompress every gzip member of ``data`` into one buffer; RecordError on corrupt or truncated input."""
    try:
        return _gzip.decompress(data)
    except (OSError, EOFError, zlib.error, _zlib.error) as e:
        raise RecordError(f"gzip decompression failed: {e}") from None


def crc32(data: bytes) -> int:
    """CRC-32 (the gzip/zlib polynomial) of ``data`` as an unsigned int."""
    return _zlib.crc32(data) & 0xFFFFFFFF


def _header(header: dict[str, Any]) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header so tensor data is 8-byte aligned
    return struct.pack("<Q", len(head)) + head


def _checked(name: str, array: np.ndarray, tag: str) -> np.ndarray:
    array = np.asarray(array, order="C")  # not ascontiguousarray: it turns a 0-d scalar into shape (1,)
    if tag not in DTYPES or array.dtype.newbyteorder("<") != DTYPES[tag].newbyteorder("<"):
        raise ValueError(f"tensor {name!r}: numpy dtype {array.dtype} does not store safetensors {tag}")
    return array.astype(DTYPES[tag], copy=False)


def encode_tensors(tensors: Mapping[str, tuple[np.ndarray, str]], metadata: Mapping[str, str]) -> bytes:
    """Serialize ``{name: (array, dtype_tag)}`` to plain safetensors bytes.

    ``dtype_tag`` is a safetensors tag; for ``"BF16"`` the array holds the bf16 bits as uint16.
    Raises ValueError if an array's numpy dtype does not match its tag.
    """
    assert "__metadata__" not in tensors, "__metadata__ is the safetensors header's own key, not a tensor name"
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        array = _checked(name, *tensors[name])
        raw = array.tobytes()
        header[name] = {"dtype": tensors[name][1], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}  # fmt: skip
        blobs.append(raw)
        offset += len(raw)
    return _header(header) + b"".join(blobs)


def encode_planar(tensors: Mapping[str, tuple[np.ndarray, str]], metadata: Mapping[str, str]) -> tuple[bytes, bytes]:
    """The two sections of a planar record: ``(header + small tensors + high planes, low planes)``.

    Float tensors (:data:`PLANAR_TAGS`) of at least a few hundred elements are split into byte planes;
    offsets in the header count from the end of the header over both sections, concatenated.
    Raises ValueError as :func:`encode_tensors`.
    """
    assert "__metadata__" not in tensors, "__metadata__ is the safetensors header's own key, not a tensor name"
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    arrays = {name: _checked(name, *tensors[name]) for name in sorted(tensors)}
    split = {n for n, a in arrays.items() if tensors[n][1] in PLANAR_TAGS and a.size >= _PLANAR_MIN}
    dense, codes = _dense(tensors), _codes(tensors)
    high, low, offset = [], [], 0
    for name, array in arrays.items():
        entry: dict[str, Any] = {"dtype": tensors[name][1], "shape": list(array.shape)}
        if name in dense or name in codes:
            header[name] = entry  # its bytes go last (below)
            continue
        if name in split:
            planes = array.reshape(-1).view(np.uint8).reshape(array.size, array.itemsize)  # (n, itemsize) LSB first
            high.append(planes[:, -1].tobytes())
            entry["planes"] = [offset, None]
            offset += array.size
        else:
            high.append(array.tobytes())
            entry["data_offsets"] = [offset, offset + array.nbytes]
            offset += array.nbytes
        header[name] = entry
    for name, array in arrays.items():
        if name in split:  # the low planes after every high plane, each tensor's least significant first
            planes = array.reshape(-1).view(np.uint8).reshape(array.size, array.itemsize)
            low.append(np.ascontiguousarray(planes[:, :-1].T).tobytes())  # (itemsize - 1, n)
            header[name]["planes"][1] = offset
            offset += array.size * (array.itemsize - 1)
    for name in [*sorted(dense), *sorted(codes)]:  # byte tensors, then float8 codes: a deflated member each
        low.append(arrays[name].tobytes())
        header[name]["data_offsets"] = [offset, offset + arrays[name].nbytes]
        offset += arrays[name].nbytes
    return _header(header) + b"".join(high), b"".join(low)


def _dense(tensors: Mapping[str, tuple[np.ndarray, str]]) -> set[str]:
    """The byte tensors that :func:`encode_planar` puts last (the third member of a planar record)."""
    return {n for n, (a, tag) in tensors.items() if tag == "U8" and np.asarray(a).size >= _PLANAR_MIN}


def _codes(tensors: Mapping[str, tuple[np.ndarray, str]]) -> set[str]:
    """The float8 code tensors that :func:`encode_planar` puts after the byte tensors (their own member)."""
    return {n for n, (a, tag) in tensors.items() if tag == "F8_E4M3" and np.asarray(a).size >= _PLANAR_MIN}


def _planes(body: memoryview, name: str, tag: str, shape: list[int], where: Any) -> np.ndarray:
    """Reassemble a planar tensor from its high plane and its other planes (one pass each)."""
    dtype = DTYPES[tag]
    n, k = math.prod(shape), dtype.itemsize  # math.prod: np.prod costs ~10x on a short list
    try:
        hi_at, lo_at = (int(x) for x in where)
    except (TypeError, ValueError):
        raise RecordError(f"tensor {name!r} has a malformed planes entry") from None
    if not (0 <= hi_at and hi_at + n <= len(body) and 0 <= lo_at and lo_at + n * (k - 1) <= len(body)):
        raise RecordError(f"tensor {name!r} planes {hi_at}, {lo_at} do not fit the payload")
    hi = np.frombuffer(body, np.uint8, n, hi_at)
    if k == 2:  # bf16 / f16: widen the high plane, shift it up, or the low plane in
        out = hi.astype("<u2")
        out <<= 8
        out |= np.frombuffer(body, np.uint8, n, lo_at)
        return out.view(dtype).reshape(shape)
    out = np.empty((n, k), np.uint8)
    out[:, -1] = hi
    out[:, :-1] = np.frombuffer(body, np.uint8, n * (k - 1), lo_at).reshape(k - 1, n).T
    return out.view(dtype).reshape(shape)


def decode_tensors(data: bytes) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, str]]:
    """Parse decompressed record bytes (either layout) into ``({name: (array, dtype_tag)}, metadata)``;
    no code runs. Raises RecordError for a malformed header or offsets outside the data."""
    if len(data) < 8:
        raise RecordError("safetensors payload shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", data)
    if n > _MAX_HEADER or 8 + n > len(data):
        raise RecordError(f"safetensors header length {n} does not fit the {len(data)}-byte payload")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise RecordError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + n :]
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for name, info in header.items():
        try:
            tag, shape = info["dtype"], [int(s) for s in info["shape"]]
            planar = "planes" in info
            start, end = (0, 0) if planar else info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise RecordError(f"tensor {name!r} has a malformed header entry") from None
        if tag not in DTYPES:
            raise RecordError(f"tensor {name!r} has unsupported dtype {tag!r}")
        if planar:
            tensors[name] = (_planes(body, name, tag, shape, info["planes"]), tag)
            continue
        count = math.prod(shape)
        if not (0 <= start <= end <= len(body)) or end - start != count * DTYPES[tag].itemsize:
            raise RecordError(f"tensor {name!r} offsets {start}..{end} do not match shape {shape} / the payload")
        tensors[name] = (np.frombuffer(body[start:end], dtype=DTYPES[tag]).reshape(shape), tag)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def encode_record(tensors: Mapping[str, tuple[np.ndarray, str]], metadata: Mapping[str, str],
                  layout: str = RECORD_LAYOUT) -> bytes:  # fmt: skip
    """One record in ``layout``: ``planar`` (two or three gzip members, see the module docstring) or ``plain``
    (``gzip(safetensors)``, what bucketeer wrote before; tests of old caches write it)."""
    if layout == "plain":
        return gzip_compress(encode_tensors(tensors, metadata))
    assert layout == "planar", layout
    head, low = encode_planar(tensors, metadata)
    tail = sum(np.asarray(tensors[n][0]).nbytes for n in _codes(tensors))  # float8 codes: last, run-length
    low, codes = low[: len(low) - tail], low[len(low) - tail :]
    tail = sum(np.asarray(tensors[n][0]).nbytes for n in _dense(tensors))  # byte tensors: before, LZ-deflated
    low, dense = low[: len(low) - tail], low[len(low) - tail :]
    return (_deflate(head, HIGH_LEVEL, HIGH_STRATEGY) + (_deflate(low, 0) if low else b"")
            + (_deflate(dense, 6) if dense else b"")
            + (_deflate(codes, HIGH_LEVEL, CODES_STRATEGY) if codes else b""))  # fmt: skip


def decode_record(data: bytes) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, str]]:
    """Inverse of :func:`encode_record` (either layout); raises RecordError for corrupt bytes."""
    return decode_tensors(gzip_decompress(data))


def record_layout(data: bytes) -> str:
    """``planar`` or ``plain``: the layout of a (compressed) record, from its header (RecordError if corrupt)."""
    raw = gzip_decompress(data)
    tensors_header = json.loads(bytes(raw[8 : 8 + struct.unpack_from("<Q", raw)[0]]))
    return "planar" if any(isinstance(v, dict) and "planes" in v for v in tensors_header.values()) else "plain"
