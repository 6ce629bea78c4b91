"""Compact text records: float8 e4m3 codes with per-row or per-channel scales (manifests/cache/compact.py).

The rounding equals torch's ``float8_e4m3fn`` conversion bit for bit; a record written with
``encode_text(..., compact=...)`` decodes to float32 within e4m3's error; records without codes are unchanged
and a reader that predates the ``F8_E4M3`` tag refuses a compact record instead of misreading it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from manifests.cache import codec
from manifests.cache.compact import COMPACT_TEXT, E4M3_MAX, E4M3_VALUES, dequantize_e4m3, e4m3_bits, quantize_e4m3
from manifests.cache.records import (RecordError, TextRecord, decode_record, decode_text, encode_text, to_float32,
                                     to_torch)  # fmt: skip


def _torch_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _bf16(x: np.ndarray) -> np.ndarray:
    return (torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
            .view(np.uint16))  # fmt: skip


def _edges() -> np.ndarray:
    """Zeros of both signs, every subnormal and its midpoints, every normal code and its midpoints, 448."""
    values = E4M3_VALUES[np.isfinite(E4M3_VALUES)]
    values = np.unique(np.abs(values))  # (127,) 0 .. 448
    mids = (values[1:] + values[:-1]) / 2  # ties: round to even
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))])
    one = np.concatenate([values, mids, near, [2.0**-10, 2.0**-11, 2.0**-30, 1e-38, 1e-45, 447.99, 455.0, 463.9]])
    return np.concatenate([one, -one]).astype(np.float32)


def test_the_rounding_is_torchs_on_every_code_its_midpoints_and_random_values():
    edges = _edges()
    assert np.array_equal(e4m3_bits(edges), _torch_bits(edges))
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(200_000) * np.exp(rng.uniform(-14, 6, 200_000))).astype(np.float32)
    wide = np.clip(wide, -460, 460)  # torch turns 464 and beyond into NaN; we saturate (next test)
    assert np.array_equal(e4m3_bits(wide), _torch_bits(wide))
    assert np.array_equal(E4M3_VALUES, torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy(),
                          equal_nan=True)  # fmt: skip


def test_values_past_448_saturate_where_torch_gives_nan():
    big = np.array([464.0, 1e6, 3.4e38, -500.0], np.float32)
    assert list(E4M3_VALUES[e4m3_bits(big)]) == [448.0, 448.0, 448.0, -448.0]


@pytest.mark.parametrize("axis", [0, 1])
def test_codes_equal_torchs_conversion_of_x_over_the_scale(axis):
    rng = np.random.default_rng(axis)
    x = rng.standard_normal((64, 96)).astype(np.float32) * rng.lognormal(0, 2, 96).astype(np.float32)
    x[3] = 0.0  # an all-zero row
    x[:, 5] = 0.0  # and channel
    x[7, 9], x[8, 10] = 1e4, 3e-7  # an outlier, a value that ends up subnormal
    codes, scales = quantize_e4m3(x, axis)
    assert scales.shape == ((64, 1) if axis == 1 else (1, 96)) and scales.dtype == np.float32
    assert np.array_equal(codes, _torch_bits(torch.from_numpy(x) / torch.from_numpy(scales)))
    amax = np.abs(x).max(axis=axis, keepdims=True)
    assert np.array_equal(scales[amax == 0], np.ones(int((amax == 0).sum()), np.float32))
    assert (E4M3_VALUES[codes].__abs__().max(axis=axis) <= E4M3_MAX).all()
    back = dequantize_e4m3(codes, scales, axis)
    assert np.array_equal(back[x == 0], x[x == 0])


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=24),
                  elements=st.floats(-3e4, 3e4, allow_nan=False, width=32)), st.sampled_from([0, 1]))  # fmt: skip
def test_every_value_comes_back_within_e4m3s_error(x, axis):
    codes, scales = quantize_e4m3(x, axis)
    assert np.array_equal(codes, _torch_bits(torch.from_numpy(x) / torch.from_numpy(scales)))
    back = dequantize_e4m3(codes, scales, axis)
    scaled = np.abs(x / scales)
    normal = scaled >= 2.0**-6  # relative 2^-4 in the normal range; half a subnormal step (2^-10) below it
    err = np.abs(back - x)
    assert (err[normal] <= 2.0**-4 * np.abs(x[normal]) * (1 + 1e-6)).all()
    bound = np.broadcast_to(scales, x.shape)[~normal] * 2.0**-10 * (1 + 1e-6)
    assert (err[~normal] <= bound).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_e4m3(np.array([[1.0, np.inf]], np.float32), 1)
    with pytest.raises(ValueError, match="rows, channels"):
        quantize_e4m3(np.zeros(4, np.float32), 1)
    with pytest.raises(ValueError, match="axis"):
        quantize_e4m3(np.zeros((2, 2), np.float32), 2)
    with pytest.raises(ValueError, match="want uint8 codes and scales"):
        dequantize_e4m3(np.zeros((2, 3), np.uint8), np.ones((1, 3), np.float32), 1)


def _record(rng: np.random.Generator, dtype: str = "BF16") -> TextRecord:
    parts = [rng.standard_normal((40, 300)).astype(np.float32), rng.standard_normal((7, 16)).astype(np.float32),
             np.zeros((0, 12), np.float32)]  # fmt: skip
    parts[0][:10] = 0.0  # left padding: zero rows
    pooled = rng.standard_normal(24).astype(np.float32)
    store = _bf16 if dtype == "BF16" else (lambda a: a)
    return TextRecord(77, tuple(store(p) for p in parts), store(pooled), dtype)


@pytest.mark.parametrize("compact", sorted(COMPACT_TEXT))
@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_a_compact_record_decodes_to_float32_within_e4m3s_error(compact, dtype):
    record = _record(np.random.default_rng(1), dtype)
    data = encode_text(record, compact=compact)
    back = decode_text(data)
    assert back.caption_key == 77 and back.dtype == "F32" and back.lengths == record.lengths
    tensors, _ = decode_record(data)
    assert tensors["tokens.0"][1] == "F8_E4M3" and tensors["tokens.0.scale"][1] == "F32"
    axis = COMPACT_TEXT[compact]
    assert tensors["tokens.0.scale"][0].shape == ((40, 1) if axis == 1 else (1, 300))
    for got, want in zip(back.tokens, record.tokens):
        want = to_float32(want, record.dtype)
        codes, scales = quantize_e4m3(want, axis)
        assert got.dtype == np.float32 and np.array_equal(got, dequantize_e4m3(codes, scales, axis))
    np.testing.assert_array_equal(back.pooled, to_float32(record.pooled, record.dtype))  # kept exact
    # what the trainer calls works unchanged on the decoded record
    assert to_torch(back.tokens[0], back.dtype).dtype == torch.float32
    assert np.array_equal(to_float32(back.tokens[0], back.dtype), back.tokens[0])


def test_a_compact_record_is_about_half_a_bf16_one():
    record = _record(np.random.default_rng(2))
    exact, compact = len(encode_text(record)), len(encode_text(record, compact="fp8"))
    assert compact < 0.6 * exact


def test_exact_records_are_unchanged_and_an_unknown_mode_is_refused():
    record = _record(np.random.default_rng(3))
    data = encode_text(record)
    assert encode_text(record, compact=None) == data
    back = decode_text(data)
    assert back.dtype == "BF16" and all(np.array_equal(a, b) for a, b in zip(back.tokens, record.tokens))
    tensors, _ = decode_record(data)
    assert not any(tag == "F8_E4M3" for _, tag in tensors.values())
    with pytest.raises(ValueError, match="compact text 'int4'"):
        encode_text(record, compact="int4")


def test_a_reader_without_the_float8_tag_refuses_a_compact_record(monkeypatch):
    data = encode_text(_record(np.random.default_rng(4)), compact="fp8")
    old = {k: v for k, v in codec.DTYPES.items() if k != "F8_E4M3"}
    monkeypatch.setattr(codec, "DTYPES", old)
    with pytest.raises(RecordError, match="unsupported dtype 'F8_E4M3'"):
        decode_text(data)


def test_float8_codes_take_their_own_member_and_the_other_members_are_as_before():
    record = _record(np.random.default_rng(5))
    tensors = {"tokens.0": (record.tokens[0], "BF16"), "mask": (np.full((40, 40), 255, np.uint8), "U8")}
    plain = codec.encode_record(tensors, {"kind": "x"})
    codes, _ = quantize_e4m3(to_float32(record.tokens[0], "BF16"), 0)
    both = codec.encode_record({**tensors, "codes": (codes, "F8_E4M3")}, {"kind": "x"})
    got, _ = codec.decode_record(both)
    assert np.array_equal(got["codes"][0], codes) and np.array_equal(got["mask"][0], tensors["mask"][0])
    assert np.array_equal(got["tokens.0"][0], record.tokens[0])
    assert codec.decode_record(plain)[0].keys() == {"tokens.0", "mask"}


def test_a_compact_record_with_missing_or_misshapen_scales_is_a_record_error():
    codes, scales = quantize_e4m3(np.ones((4, 8), np.float32), 1)
    meta = {"kind": "text", "caption_key": "1", "encoders": "1"}
    for tensors in ({"tokens.0": (codes, "F8_E4M3")},
                    {"tokens.0": (codes, "F8_E4M3"), "tokens.0.scale": (np.ones((2, 1), np.float32), "F32")},
                    {"tokens.0": (codes, "F8_E4M3"), "tokens.0.scale": (scales.astype("<f2"), "F16")}):  # fmt: skip
        with pytest.raises(RecordError, match="not a text record"):
            decode_text(codec.encode_record(tensors, meta))
