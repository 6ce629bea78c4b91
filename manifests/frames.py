"""Frame buckets of video manifests: the frame-count ladder beside the pixel ladder of :mod:`manifests.buckets`.

    bucketeer scan ./clips --out ./manifest --frames 17,33,49,81
    bucketeer scan ./clips --out ./manifest --frame-ladder 4k+1:min=17:max=81   # 17, 21, 25, ..., 81

A video sample's bucket is ``WxHxF``: the pixel bucket of its display size (``manifests.buckets``) and
``F``, the longest rung of the ladder that fits in its frame count. Causal video VAEs (Wan,
HunyuanVideo) encode ``4k+1`` frames; ``--frame-ladder 4k+1`` gives exactly those (``4k+1`` only
with a ``max``; ``min`` defaults to 5, the first that is a clip rather than an image). A video
of at least twice the longest rung is several clips: ``clips = frames // F`` non-overlapping
windows of ``F`` consecutive frames, clip ``i`` starting at frame ``i * F`` (frame stride 1); ``embed``
stores up to ``--max-clips`` of them as variants of the sample's record, and the trainer takes one per
epoch. A video shorter than the shortest rung is an error row ``too_short``. An image in a video
manifest is a 1-frame sample: bucket ``WxHx1``, ``frames`` 1, ``clips`` 1. The ladder is recorded in
``_manifest.json`` (``frame_ladder``); a manifest without it is an image manifest, whatever it holds.

Whatever reads bucket names of either kind (the plan) reads them with :func:`bucket_dims`; a clip of ``F`` frames is
``latent_frames(F, t)`` latent frames for a causal VAE of temporal factor ``t``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from manifests.buckets import parse_bucket
from manifests.errors import UsageError

__all__ = ["FrameLadder", "assign_frames", "video_bucket_names", "parse_video_bucket", "add_frame_arguments",
           "ladder_from_args", "is_video_bucket", "bucket_dims", "latent_frames",
           "DEFAULT_TEMPORAL_FACTOR", "scene_clips"]  # fmt: skip

_LADDER = re.compile(r"^\s*(\d+)k\s*\+\s*(\d+)\s*((?::\s*(?:min|max)\s*=\s*\d+\s*)*)$")
_MAX_FRAMES = 100_000  # a rung beyond this is a typo, not a clip length
DEFAULT_TEMPORAL_FACTOR = 4  # frames per latent frame after the first: Wan 2.x and HunyuanVideo's causal VAEs


@dataclass(frozen=True)
class FrameLadder:
    """The frame counts a video clip may have, ascending, each >= 2 (1 is the image rung, always there)."""

    frames: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.frames:
            raise UsageError("the frame ladder is empty: give --frames 17,33,... or --frame-ladder 4k+1:max=81")
        if any(f < 2 or f > _MAX_FRAMES for f in self.frames):
            raise UsageError(f"frame buckets must be 2..{_MAX_FRAMES:,} frames (1 is the images' own), got "
                             f"{list(self.frames)}")  # fmt: skip
        if list(self.frames) != sorted(set(self.frames)):
            object.__setattr__(self, "frames", tuple(sorted(set(self.frames))))

    @classmethod
    def parse_list(cls, text: str) -> FrameLadder:
        """``"17,33,49,81"`` -> a ladder; raises UsageError naming ``--frames``."""
        try:
            frames = tuple(int(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise UsageError(f"--frames {text!r}: give frame counts separated by commas, e.g. 17,33,49,81") from None
        return cls(frames)

    @classmethod
    def parse_rule(cls, text: str) -> FrameLadder:
        """``"4k+1:max=81"`` (``min`` default: the first rung >= 5) -> a ladder; raises UsageError."""
        m = _LADDER.match(text)
        if m is None:
            raise UsageError(f"--frame-ladder {text!r}: write it as Ak+B:max=N (optionally :min=M), e.g. 4k+1:max=81")
        a, b = int(m.group(1)), int(m.group(2))
        bounds = dict(re.findall(r"(min|max)\s*=\s*(\d+)", m.group(3)))
        if a < 1 or "max" not in bounds:
            raise UsageError(f"--frame-ladder {text!r}: needs a step A >= 1 and a max, e.g. 4k+1:max=81")
        lo, hi = int(bounds.get("min", 5)), int(bounds["max"])
        return cls(tuple(f for f in range(b, hi + 1, a) if f >= max(lo, 2)))

    def to_json(self) -> list[int]:
        return list(self.frames)


def assign_frames(ladder: FrameLadder, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The frame bucket and clip count of each video of ``frames`` frames.

    Returns ``(bucket_frames, clips, too_short)``: int32 arrays and a bool mask. ``bucket_frames`` is
    the longest rung <= the video's frames (0 where too short), ``clips = frames // bucket_frames``
    (non-overlapping windows, clip ``i`` starts at frame ``i * bucket_frames``), 0 where too short.
    """
    f = np.asarray(frames, dtype=np.int64)  # (rows,)
    rungs = np.asarray(ladder.frames, dtype=np.int64)  # (k,) ascending
    idx = np.searchsorted(rungs, f, side="right") - 1  # (rows,): index of the longest rung <= f, -1 if none
    too_short = idx < 0
    bucket = np.where(too_short, 0, rungs[np.maximum(idx, 0)])
    clips = np.where(too_short, 0, f // np.maximum(bucket, 1))
    return bucket.astype(np.int32), clips.astype(np.int32), too_short


def scene_clips(ladder: FrameLadder, starts: np.ndarray, frames: np.ndarray) -> tuple[int, list[int]]:
    """A video's clips cut inside its shots (``starts``/``frames``: each shot's first frame and length), never
    across a cut: ``(F, clip starts)``. ``F`` is the longest rung of ``ladder`` that fits in the longest shot; a
    shot of ``n`` frames holds ``n // F`` non-overlapping clips from its first frame (a shot longer than the
    longest rung gives several). ``(0, [])`` when no shot reaches the shortest rung."""
    starts, frames = np.asarray(starts, np.int64), np.asarray(frames, np.int64)  # (shots,)
    if not len(frames):
        return 0, []
    bucket, _, too_short = assign_frames(ladder, frames[[int(np.argmax(frames))]])
    if too_short[0]:
        return 0, []
    f = int(bucket[0])
    return f, [int(s + i * f) for s, n in zip(starts, frames) for i in range(int(n) // f)]


def video_bucket_names(pixel_buckets: pa.Array, bucket_frames: np.ndarray) -> pa.Array:
    """``"WxH"`` names and frame counts -> ``"WxHxF"`` names."""
    names = pixel_buckets.to_pylist()
    return pa.array([f"{n}x{int(f)}" for n, f in zip(names, np.asarray(bucket_frames).tolist())], pa.string())


def parse_video_bucket(name: str) -> tuple[int, int, int]:
    """``"832x480x81"`` -> ``(832, 480, 81)``; raises UsageError naming the bad string."""
    try:
        w, h, f = (int(x) for x in name.lower().split("x"))
    except ValueError:
        raise UsageError(f"bucket name {name!r} is not of the form 'WIDTHxHEIGHTxFRAMES'") from None
    if min(w, h, f) < 1:
        raise UsageError(f"bucket name {name!r} has a side or frame count < 1")
    return w, h, f


def is_video_bucket(name: str) -> bool:
    """Whether ``name`` is a video manifest's ``WxHxF`` (an image manifest's is ``WxH``)."""
    return name.lower().count("x") == 2


def bucket_dims(name: str) -> tuple[int, int, int]:
    """``"832x480x81"`` -> ``(832, 480, 81)``; an image bucket ``"1152x896"`` -> ``(1152, 896, 1)``.

    Raises UsageError naming the bad string for anything else.
    """
    if is_video_bucket(name):
        return parse_video_bucket(name)
    return (*parse_bucket(name), 1)


def latent_frames(frames: np.ndarray, temporal_factor: int) -> np.ndarray:
    """Latent frames of clips of ``frames`` frames for a causal VAE: ``(F - 1) // t + 1`` (1 frame -> 1)."""
    return (np.asarray(frames, np.int64) - 1) // temporal_factor + 1


def add_frame_arguments(parser: argparse.ArgumentParser) -> None:
    """``--frames`` / ``--frame-ladder`` of ``bucketeer scan``: either makes it a video scan."""
    g = parser.add_argument_group("video (frame buckets; see docs/video.md)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--frames", default=None, metavar="F,F,...",
                   help="scan videos (.mp4 .mov .webm .mkv) too: frame buckets, e.g. 17,33,49,81; buckets become "
                   "WxHxF, images join as 1-frame samples (WxHx1), videos shorter than the shortest are too_short")
    x.add_argument("--frame-ladder", default=None, metavar="AK+B:max=N",
                   help="as --frames, a rule: 4k+1:max=81 is 5, 9, ..., 81 (add :min=17 to start higher)")


def ladder_from_args(args: argparse.Namespace) -> FrameLadder | None:
    """The ladder of ``--frames``/``--frame-ladder``, or None for an image scan."""
    if getattr(args, "frames", None):
        return FrameLadder.parse_list(args.frames)
    if getattr(args, "frame_ladder", None):
        return FrameLadder.parse_rule(args.frame_ladder)
    return None

