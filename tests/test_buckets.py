import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manifests.buckets import (
    SDXL_BUCKETS,
    BucketSpec,
    assign_buckets,
    bucket_list,
    bucket_names,
    parse_bucket,
)

sizes = st.integers(min_value=1, max_value=20000)
specs = st.builds(
    BucketSpec,
    area=st.sampled_from([256 * 256, 512 * 512, 768 * 768, 1024 * 1024, 1536 * 1536]),
    step=st.sampled_from([8, 16, 32, 64]),
    max_aspect=st.floats(min_value=1.0, max_value=8.0),
)


@given(specs)
def test_generated_buckets_are_step_multiples_within_area_and_closed_under_transpose(spec):
    b = bucket_list(spec)
    assert (b % spec.step == 0).all()
    area = b[:, 0] * b[:, 1]
    assert (area <= spec.area).all()
    # the widest multiple of step below the target: within one step of the long side... of the area
    assert (area > spec.area - spec.step * b.max(axis=1)).all()
    aspect = b[:, 0] / b[:, 1]
    assert (aspect <= spec.max_aspect + 1e-9).all() and (aspect >= 1 / spec.max_aspect - 1e-9).all()
    pairs = {tuple(x) for x in b.tolist()}
    assert pairs == {(h, w) for w, h in pairs}


def test_default_spec_has_square_and_4_to_1_buckets():
    pairs = {tuple(x) for x in bucket_list(BucketSpec()).tolist()}
    assert (1024, 1024) in pairs
    assert (2048, 512) in pairs and (512, 2048) in pairs
    assert (1152, 896) in pairs


@settings(max_examples=300)
@given(specs, sizes, sizes)
def test_assignment_is_symmetric_under_swap(spec, w, h):
    bw, bh, _ = assign_buckets(spec, [w], [h])
    sw, sh, _ = assign_buckets(spec, [h], [w])
    assert (bw[0], bh[0]) == (sh[0], sw[0])


@settings(max_examples=300)
@given(specs, sizes, sizes)
def test_assignment_picks_nearest_log_aspect(spec, w, h):
    bw, bh, _ = assign_buckets(spec, [w], [h])
    b = bucket_list(spec)
    best = np.abs(np.log(b[:, 0] / b[:, 1]) - math.log(w / h)).min()
    assert abs(math.log(bw[0] / bh[0]) - math.log(w / h)) == pytest.approx(best, abs=1e-9)


@settings(max_examples=300)
@given(specs, st.integers(64, 20000), st.integers(64, 20000))
def test_no_upscale_never_upscales(spec, w, h):
    spec = BucketSpec(area=spec.area, step=spec.step, max_aspect=spec.max_aspect, no_upscale=True)
    bw, bh, _ = assign_buckets(spec, [w], [h])
    if w >= spec.step and h >= spec.step:
        # resize-to-cover scale factor is at most 1
        assert max(bw[0] / w, bh[0] / h) <= 1 + 1e-9
    assert bw[0] % spec.step == 0 and bh[0] % spec.step == 0
    plain = BucketSpec(area=spec.area, step=spec.step, max_aspect=spec.max_aspect)
    plain_w, plain_h, _ = assign_buckets(plain, [w], [h])
    assert bw[0] <= plain_w[0] and bh[0] <= plain_h[0]
    if w * h >= plain_w[0] * plain_h[0] and w >= plain_w[0] and h >= plain_h[0]:
        assert (bw[0], bh[0]) == (plain_w[0], plain_h[0])  # a big image keeps its full-size bucket


def test_assignment_is_deterministic_and_vectorised():
    rng = np.random.default_rng(0)
    w = rng.integers(16, 8000, 10000)
    h = rng.integers(16, 8000, 10000)
    a = assign_buckets(BucketSpec(), w, h)
    b = assign_buckets(BucketSpec(), w, h)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    one_by_one = [assign_buckets(BucketSpec(), [w[i]], [h[i]])[0][0] for i in range(200)]
    np.testing.assert_array_equal(a[0][:200], one_by_one)


def test_min_side_marks_but_does_not_drop():
    bw, bh, small = assign_buckets(BucketSpec(min_side=256), [100, 300, 1000], [1000, 300, 255])
    assert small.tolist() == [True, False, True]
    assert len(bw) == 3


def test_sdxl_preset_and_names():
    spec = BucketSpec.from_preset("sdxl")
    assert {tuple(x) for x in bucket_list(spec).tolist()} == set(SDXL_BUCKETS)
    bw, bh, _ = assign_buckets(spec, [4000, 3000, 1000], [3000, 4000, 1000])
    assert bucket_names(bw, bh).to_pylist() == ["1152x896", "896x1152", "1024x1024"]
    assert BucketSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="unknown bucket preset"):
        BucketSpec.from_preset("nope")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(BucketSpec(), [0], [10])
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_bucket("1024")
    with pytest.raises(ValueError, match="max aspect"):
        BucketSpec(max_aspect=0.5)
    with pytest.raises(ValueError, match="unknown bucket spec keys"):
        BucketSpec.from_json({"area": 10, "bogus": 1})
