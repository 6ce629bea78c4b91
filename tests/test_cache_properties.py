"""Property tests for the cache record codec: gzip'd safetensors, decoded without running code."""

from __future__ import annotations

import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from manifests.cache import records as cf

# BF16 travels as raw uint16 bits, so every tag has a numpy dtype to draw from
TAGS = sorted(cf.DTYPES)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


@st.composite
def tensor_maps(draw):
    name = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)
    # "__metadata__" is the safetensors header's own key: never a tensor name
    names = draw(st.lists(name.filter(lambda n: n != "__metadata__"), min_size=1, max_size=4, unique=True))
    out = {}
    for name in names:
        tag = draw(st.sampled_from(TAGS))
        array = draw(hnp.arrays(cf.DTYPES[tag], draw(shapes)))
        out[name] = (array, tag)
    return out


metadata = st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=4)


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for name, (array, tag) in a.items():
        other, other_tag = b[name]
        # compare bits: NaN payloads and -0.0 must survive unchanged too
        if tag != other_tag or array.shape != other.shape or array.tobytes() != other.tobytes():
            return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_maps(), metadata)
def test_record_round_trip_is_bit_exact(tensors, meta):
    data = cf.encode_record(tensors, meta)
    decoded, decoded_meta = cf.decode_record(data)
    assert _same(tensors, decoded)
    assert decoded_meta == meta


@settings(max_examples=100, deadline=None)
@given(tensor_maps())
def test_payload_is_plain_safetensors(tensors):
    """The reference safetensors reader loads what we write (everything but BF16 and F8_E4M3 has a numpy dtype;
    safetensors' numpy reader knows neither)."""
    plain = {k: v for k, v in tensors.items() if v[1] not in ("BF16", "F8_E4M3")}
    if not plain:
        return
    loaded = safetensors.numpy.load(cf.encode_tensors(plain, {}))
    for name, (array, _) in plain.items():
        assert loaded[name].dtype == array.dtype and loaded[name].tobytes() == array.tobytes()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_record_error(data):
    for decode in (cf.decode_record, cf.decode_tensors, cf.decode_sample, cf.decode_text):
        try:
            decode(data)
        except cf.RecordError:
            pass


@settings(max_examples=200, deadline=None)
@given(tensor_maps(), st.data())
def test_a_flipped_byte_is_caught_or_harmless(tensors, data):
    """gzip's CRC and the header checks catch corruption; only bytes that carry no content
    (gzip's header flags, OS byte) may change without an error, and then the content is intact."""
    record = bytearray(cf.encode_record(tensors, {"kind": "x"}))
    i = data.draw(st.integers(0, len(record) - 1))
    record[i] ^= data.draw(st.integers(1, 255))
    try:
        decoded, meta = cf.decode_record(bytes(record))
    except cf.RecordError:
        return
    assert _same(tensors, decoded) and meta == {"kind": "x"}


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=5000))
def test_gzip_backends_agree(data):
    """isal (when installed) and the standard library produce and read the same format."""
    import gzip

    assert gzip.decompress(cf.gzip_compress(data)) == data
    assert cf.gzip_decompress(gzip.compress(data)) == data
