"""Scaled float8 (e4m3) codes of text embeddings: the arithmetic of the cache's opt-in compact text records.

A text record's token part ``(L, D)`` float32 becomes ``codes`` ``(L, D)`` uint8 (the bits of
``float8_e4m3fn``: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, ``0x7f`` / ``0xff``
NaN, largest finite 448) and float32 ``scales`` broadcast along one axis:

- ``axis=1`` (**per row**, one scale per token): ``scales`` ``(L, 1)``, the row's ``amax / 448``;
- ``axis=0`` (**per channel**): ``scales`` ``(1, D)``, the channel's ``amax / 448``.

``x ~= e4m3(x / scale) * scale``. The rounding is what ``(x / scale).to(torch.float8_e4m3fn)`` does (round to
nearest, ties to even; subnormals down to 2^-9) except that values past 448 saturate to +-448 where torch
gives NaN (with ``scale = amax / 448`` they are never past 448 by more than an ulp of the division).
A value in e4m3's normal range (``|x / scale| >= 2^-6``) comes back within a relative ``2^-4`` of itself;
below it the error is at most ``2^-10 * scale`` (half the subnormal step). An all-zero row (channel) gets
scale 1 and zero codes. Vectorised numpy on the float32 bits, no per-element Python
(``benchmarks/compact_text.py`` times it on a FLUX.2-dev-sized record).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["COMPACT_TEXT", "E4M3_MAX", "E4M3_VALUES", "quantize_e4m3", "dequantize_e4m3", "e4m3_bits",
           "compact_tokens", "expanded_tokens"]  # fmt: skip

E4M3_MAX = 448.0
# encode_text(compact=...) -> the axis each scale runs along: 1 one scale per row (token), 0 one per channel.
# "fp8" is per row: a lower denoiser error than per channel on all four real-width transformers measured, for up to
# 6% more bytes (benchmarks/compact_text.py); "fp8-channel" stays for that comparison. Readers take either.
COMPACT_TEXT: dict[str, int] = {"fp8": 1, "fp8-row": 1, "fp8-channel": 0}


def e4m3_bits(x: np.ndarray) -> np.ndarray:
    """The ``float8_e4m3fn`` bits (uint8, same shape) of float32 ``x``: round to nearest even, saturating at
    +-448 (torch's conversion gives NaN from 464 on; below it the two agree bit for bit). ``x`` must be
    NaN-free."""
    x = np.asarray(x, np.float32)
    sign = np.signbit(x).view(np.uint8)  # (...) 0 / 1
    sign <<= 7
    q = np.abs(x)  # a copy we own, modified in place below
    np.minimum(q, np.float32(E4M3_MAX), out=q)  # saturate: 448 is the largest finite code
    bits = q.reshape(-1).view(np.uint32)  # (n,) the float32 bits of |x|
    small = np.flatnonzero((bits < np.uint32(121 << 23)) & (bits != 0))  # 0 < |x| < 2^-6: e4m3 subnormals
    # subnormal: adding 2^14 (float32 ulp 2^-9, e4m3's subnormal step) rounds |x| to a multiple of 2^-9 in
    # float32 arithmetic, ties to even; the multiple is what is left in the mantissa
    denorm = np.float32(2.0**14)
    tiny = ((q.reshape(-1)[small] + denorm).view(np.uint32) - denorm.view(np.uint32)).astype(np.uint8)
    zero = bits == 0
    # normal: rebias the exponent 127 -> 7 and round the 23-bit mantissa to 3 bits, ties to even (add 0x7FFFF
    # plus the lowest kept bit, then drop 20 bits); the sum wraps around uint32 as torch's does
    odd = bits >> 20
    odd &= 1
    bits += np.uint32((((7 - 127) << 23) + 0x7FFFF) & 0xFFFFFFFF)
    bits += odd
    bits >>= 20
    out = bits.astype(np.uint8)
    out[zero] = 0
    out[small] = tiny
    out |= sign.reshape(-1)
    return out.reshape(x.shape)


def _values() -> np.ndarray:
    """float32 value of each of the 256 codes (NaN for 0x7f and 0xff)."""
    code = np.arange(256, dtype=np.uint32)
    exp, mant = (code >> 3) & 0xF, code & 0x7
    value = np.where(exp == 0, mant / 8.0 * 2.0**-6, (1 + mant / 8.0) * 2.0 ** (exp.astype(np.int64) - 7))
    value = np.where(code & 0x80, -value, value).astype(np.float32)
    value[[0x7F, 0xFF]] = np.nan
    return value


E4M3_VALUES: np.ndarray = _values()  # (256,) float32: code -> value


def _check_axis(x: np.ndarray, axis: int) -> None:
    if x.ndim != 2:
        raise ValueError(f"e4m3 codes are made of (rows, channels) arrays, not shape {x.shape}")
    if axis not in (0, 1):
        raise ValueError(f"axis {axis}: 1 scales each row (token), 0 each channel")


def quantize_e4m3(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of ``x`` ``(L, D)`` float32: ``codes`` ``(L, D)`` uint8 ``float8_e4m3fn`` bits of
    ``x / scales``, ``scales`` float32 ``(L, 1)`` (``axis=1``, per row) or ``(1, D)`` (``axis=0``, per channel),
    each ``amax / 448`` of its row or channel (1 where that is all zeros).
    Raises ValueError for a non-finite ``x``, a shape that is not 2-D or another axis."""
    x = np.asarray(x, np.float32)
    _check_axis(x, axis)
    if not np.isfinite(x).all():
        raise ValueError("e4m3 codes of non-finite values: the text encoder gave inf or NaN")
    amax = np.abs(x).max(axis=axis, keepdims=True, initial=0.0)  # (L, 1) or (1, D)
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    # the smallest normal float32 guards against a scale that underflows to 0 when amax is subnormal
    scales = np.maximum(scales, np.finfo(np.float32).tiny)
    return e4m3_bits(x / scales), scales


def dequantize_e4m3(codes: np.ndarray, scales: np.ndarray, axis: int) -> np.ndarray:
    """float32 ``(L, D)``: the values of ``codes`` times ``scales`` (shapes as :func:`quantize_e4m3` gives them).
    Raises ValueError when the scales' shape is not ``(L, 1)`` (``axis=1``) or ``(1, D)`` (``axis=0``)."""
    codes = np.asarray(codes)
    _check_axis(codes, axis)
    want = (codes.shape[0], 1) if axis == 1 else (1, codes.shape[1])
    if codes.dtype != np.uint8 or tuple(scales.shape) != want:
        raise ValueError(f"e4m3 codes {codes.dtype} {codes.shape} with scales {tuple(scales.shape)}: "
                         f"want uint8 codes and scales {want}")  # fmt: skip
    out = E4M3_VALUES[codes]  # (L, D) float32
    out *= np.asarray(scales, np.float32)
    return out


def compact_tokens(tokens: Sequence[np.ndarray], prefix: str, mode: str) -> dict[str, tuple[np.ndarray, str]]:
    """The record tensors of a caption's token parts ``tokens[i]`` float32 ``(L_i, D_i)`` in compact ``mode``
    (:data:`COMPACT_TEXT`): ``<prefix>tokens.<i>`` its ``F8_E4M3`` codes, ``<prefix>tokens.<i>.scale`` its float32
    scales. Raises ValueError for another mode or non-finite values."""
    if mode not in COMPACT_TEXT:
        raise ValueError(f"compact text {mode!r}: one of {sorted(COMPACT_TEXT)}")
    out: dict[str, tuple[np.ndarray, str]] = {}
    for i, part in enumerate(tokens):
        codes, scales = quantize_e4m3(part, COMPACT_TEXT[mode])
        out[f"{prefix}tokens.{i}"], out[f"{prefix}tokens.{i}.scale"] = (codes, "F8_E4M3"), (scales, "F32")
    return out


def expanded_tokens(tensors: dict[str, tuple[np.ndarray, str]], prefix: str, count: int) -> tuple[np.ndarray, ...]:
    """The ``count`` token parts of a compact record's tensors (:func:`compact_tokens`), dequantized to float32;
    the scales' shape says the axis. Raises KeyError or ValueError when a part is not codes or its scales are
    missing or do not fit."""
    out = []
    for i in range(count):
        (codes, tag), (scales, scale_tag) = tensors[f"{prefix}tokens.{i}"], tensors[f"{prefix}tokens.{i}.scale"]
        if tag != "F8_E4M3" or scale_tag != "F32" or codes.ndim != 2 or scales.ndim != 2:
            raise ValueError(f"{prefix}tokens.{i}")
        out.append(dequantize_e4m3(codes, scales, 1 if scales.shape == (codes.shape[0], 1) else 0))
    return tuple(out)
