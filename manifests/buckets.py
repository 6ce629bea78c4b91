"""Aspect-ratio buckets: the bucket spec, the bucket list it defines, and vectorised assignment.

A bucket is a training resolution ``(width, height)`` in pixels, both multiples of ``step``, with
an area close to (never above) the target area. An image goes to the bucket whose **log aspect
ratio** is nearest its own, so assignment is symmetric under swapping width and height: a 3:2
landscape and a 2:3 portrait land in transposed buckets. Assignment is a pure numpy function of
``(spec, widths, heights)``; 10M rows take seconds (``benchmarks/bucket_assign.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from manifests.errors import UsageError

__all__ = [
    "BucketSpec",
    "PRESETS",
    "SDXL_BUCKETS",
    "bucket_list",
    "assign_buckets",
    "bucket_names",
    "parse_bucket",
    "add_bucket_arguments",
    "spec_from_args",
]

# SDXL's 1024-class training resolutions (the list published with SDXL), landscape and portrait.
SDXL_BUCKETS: tuple[tuple[int, int], ...] = (
    (512, 2048), (512, 1984), (512, 1920), (512, 1856), (576, 1792), (576, 1728), (576, 1664),
    (640, 1600), (640, 1536), (704, 1472), (704, 1408), (704, 1344), (768, 1344), (768, 1280),
    (832, 1216), (832, 1152), (896, 1152), (896, 1088), (960, 1088), (960, 1024), (1024, 1024),
    (1024, 960), (1088, 960), (1088, 896), (1152, 896), (1152, 832), (1216, 832), (1280, 768),
    (1344, 768), (1408, 704), (1472, 704), (1536, 640), (1600, 640), (1664, 576), (1728, 576),
    (1792, 576), (1856, 512), (1920, 512), (1984, 512), (2048, 512),
)  # fmt: skip

PRESETS: dict[str, tuple[tuple[int, int], ...]] = {"sdxl": SDXL_BUCKETS}


@dataclass(frozen=True)
class BucketSpec:
    """How images are bucketed.

    Either generated (``area`` pixels, sides multiples of ``step``, aspect ``w/h`` within
    ``[1/max_aspect, max_aspect]``) or an explicit ``buckets`` list of ``(w, h)``.
    ``no_upscale``: an image smaller than its bucket gets the largest bucket of the same aspect
    that it covers without upscaling. ``min_side``: images whose shorter side is below it are
    rejected (error kind ``too_small``), never dropped.
    """

    area: int = 1024 * 1024
    step: int = 64
    max_aspect: float = 4.0
    buckets: tuple[tuple[int, int], ...] | None = None
    no_upscale: bool = False
    min_side: int = 0
    preset: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.step < 1:
            raise UsageError(f"bucket step must be >= 1, got {self.step}")
        if self.buckets is None and self.area < self.step * self.step:
            raise UsageError(f"bucket area {self.area} is smaller than one step squared ({self.step}^2)")
        if self.max_aspect < 1:
            raise UsageError(f"max aspect must be >= 1 (e.g. 4 for 1:4 .. 4:1), got {self.max_aspect}")
        if self.min_side < 0:
            raise UsageError(f"min_side must be >= 0, got {self.min_side}")
        if self.buckets is not None:
            if not self.buckets:
                raise UsageError("an explicit bucket list must not be empty")
            for w, h in self.buckets:
                if w < 1 or h < 1:
                    raise UsageError(f"bucket {w}x{h} has a side < 1")

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> "BucketSpec":
        """A spec with a shipped bucket list, e.g. ``"sdxl"``; unknown names raise ValueError."""
        if name not in PRESETS:
            raise UsageError(f"unknown bucket preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(buckets=PRESETS[name], preset=name, **kwargs)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (stored in ``_manifest.json``); :meth:`from_json` inverts it."""
        d = asdict(self)
        d["buckets"] = [list(b) for b in self.buckets] if self.buckets is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "BucketSpec":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise UsageError(f"unknown bucket spec keys {sorted(unknown)}")
        d = dict(d)
        if d.get("buckets") is not None:
            d["buckets"] = tuple((int(w), int(h)) for w, h in d["buckets"])
        return cls(**d)


def bucket_list(spec: BucketSpec) -> np.ndarray:
    """The spec's buckets as an int64 array ``(n, 2)`` of ``(w, h)``, sorted by aspect ``w/h``.

    Generated lists are closed under transposition (``(w, h)`` in it implies ``(h, w)``), which
    makes assignment symmetric.
    """
    if spec.buckets is not None:
        pairs = sorted(set(spec.buckets), key=lambda b: (b[0] / b[1], b[0]))
        return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    s, area = spec.step, spec.area
    landscape: set[tuple[int, int]] = set()
    h = s
    while h * h <= area:
        w = (area // h) // s * s  # widest multiple of step that keeps w*h <= area
        if w >= h and w / h <= spec.max_aspect + 1e-9:
            landscape.add((w, h))
        h += s
    pairs = landscape | {(h, w) for w, h in landscape}
    if not pairs:
        raise UsageError(f"bucket spec {spec} yields no bucket; widen max_aspect or lower step")
    return np.asarray(sorted(pairs, key=lambda b: (b[0] / b[1], b[0])), dtype=np.int64)


def assign_buckets(
    spec: BucketSpec, widths: Sequence[int] | np.ndarray, heights: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Assign each image ``(w, h)`` (display orientation, pixels) to a bucket.

    Returns ``(bucket_w, bucket_h, too_small)``: int32 arrays of the bucket size per image and a
    bool mask of images below ``spec.min_side`` (their bucket is still computed; the caller
    records them as rejects). Raises ValueError for non-positive sizes.
    """
    w = np.asarray(widths, dtype=np.float64)
    h = np.asarray(heights, dtype=np.float64)
    if w.shape != h.shape:
        raise UsageError(f"widths and heights differ in length ({w.shape} vs {h.shape})")
    if w.size and (w.min() <= 0 or h.min() <= 0):
        raise UsageError("image sizes must be positive")
    buckets = bucket_list(spec)  # (n, 2)
    b_log = np.log(buckets[:, 0] / buckets[:, 1])  # (n,), ascending
    x = np.log(w / h)  # (rows,)
    # nearest neighbour on a sorted axis: compare the candidates on both sides of the insert point
    hi = np.clip(np.searchsorted(b_log, x), 1, len(b_log) - 1) if len(b_log) > 1 else np.zeros(x.shape, np.int64)
    lo = hi - 1 if len(b_log) > 1 else hi
    d_lo = np.abs(x - b_log[lo])
    d_hi = np.abs(x - b_log[hi])
    # exact ties go to the squarer bucket, which keeps the choice symmetric under w <-> h
    tie = np.isclose(d_lo, d_hi, rtol=0, atol=1e-12)
    pick_hi = np.where(tie, np.abs(b_log[hi]) < np.abs(b_log[lo]), d_hi < d_lo)
    idx = np.where(pick_hi, hi, lo)  # (rows,)
    bw = buckets[idx, 0].astype(np.int64)
    bh = buckets[idx, 1].astype(np.int64)
    if spec.no_upscale:
        # shrink the bucket, keeping its aspect, until the image covers it: scale = min(w/bw, h/bh)
        scale = np.minimum(1.0, np.minimum(w / bw, h / bh))
        step = spec.step
        bw = np.maximum(step, np.floor(bw * scale / step).astype(np.int64) * step)
        bh = np.maximum(step, np.floor(bh * scale / step).astype(np.int64) * step)
    too_small = np.minimum(w, h) < spec.min_side
    return bw.astype(np.int32), bh.astype(np.int32), too_small


def bucket_names(bucket_w: np.ndarray, bucket_h: np.ndarray) -> pa.Array:
    """Format bucket sizes as a string array of ``"WxH"`` (formatted once per distinct bucket)."""
    pairs = np.stack([np.asarray(bucket_w, np.int64), np.asarray(bucket_h, np.int64)], axis=1)  # (rows, 2)
    if not len(pairs):
        return pa.array([], pa.string())
    # codes of (w, h) pairs: a bucket side never reaches 2^31
    codes = pairs[:, 0] << 32 | pairs[:, 1]
    uniq, inverse = np.unique(codes, return_inverse=True)
    names = pa.array([f"{c >> 32}x{c & 0xFFFFFFFF}" for c in uniq.tolist()], pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(inverse.reshape(-1).astype(np.int32)), names).cast(pa.string())


def parse_bucket(name: str) -> tuple[int, int]:
    """``"1152x896"`` -> ``(1152, 896)``; raises ValueError naming the bad string."""
    try:
        w, h = name.lower().split("x")
        out = int(w), int(h)
    except ValueError:
        raise UsageError(f"bucket name {name!r} is not of the form 'WIDTHxHEIGHT'") from None
    if out[0] < 1 or out[1] < 1:
        raise UsageError(f"bucket name {name!r} has a side < 1")
    return out


def add_bucket_arguments(parser: argparse.ArgumentParser) -> None:
    """The bucket options shared by ``scan`` and ``rebucket``."""
    g = parser.add_argument_group("buckets")
    g.add_argument("--resolution", type=int, default=1024,
                   help="target bucket area is RESOLUTION^2 pixels (default 1024)")
    g.add_argument("--bucket-step", type=int, default=64, help="bucket sides are multiples of this (default 64)")
    g.add_argument("--max-aspect", type=float, default=4.0,
                   help="widest aspect ratio, e.g. 4 for 1:4 .. 4:1 (default 4)")
    g.add_argument("--buckets", default=None,
                   help=f"explicit bucket list 'WxH,WxH,…' or a preset name ({', '.join(PRESETS)})")
    g.add_argument("--no-upscale", action="store_true",
                   help="small images get the largest bucket of their aspect that they cover without upscaling")
    g.add_argument("--min-side", type=int, default=0,
                   help="reject (as 'too_small' error rows) images whose shorter side is below this")


def spec_from_args(args: argparse.Namespace) -> BucketSpec:
    """Build a :class:`BucketSpec` from the options of :func:`add_bucket_arguments`."""
    common = dict(no_upscale=args.no_upscale, min_side=args.min_side, step=args.bucket_step)
    if args.buckets:
        if args.buckets in PRESETS:
            return BucketSpec.from_preset(args.buckets, **common)
        pairs = tuple(parse_bucket(b.strip()) for b in args.buckets.split(",") if b.strip())
        return BucketSpec(buckets=pairs, **common)
    return BucketSpec(area=args.resolution * args.resolution, max_aspect=args.max_aspect, **common)
