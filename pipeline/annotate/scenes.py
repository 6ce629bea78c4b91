"""The video annotate tasks: ``scenes`` (shot boundaries) and ``motion``, from one low-resolution decode per video.

    bucketeer annotate VIDEO_MANIFEST --out SCENES --task scenes,motion

:func:`detect_scenes` decodes a video once with PyAV, forward, every frame scaled so that its long side is at
most :data:`SCENE_SIDE` pixels (FFmpeg's scaler, in the decoder's thread), and feeds the frames to
PySceneDetect's detectors through their frame API (no second decode, no OpenCV video reader):

- ``ContentDetector`` (its defaults: threshold 27 on the mean HSV change between frames, ``min_scene_len`` 15
  frames) finds hard cuts;
- ``ThresholdDetector`` (threshold 12: every channel's mean below it is "faded out") finds fades through black,
  one cut in the middle of the dark part.

A fade also moves the content score (hue jumps once the picture is nearly black), so the two lists are merged: cuts
closer than ``min_scene_len`` frames are one cut, the fade's (ThresholdDetector) where it has one, else the first.
A fade to black and back is thus one cut, never several. Shots are ``[cut_i, cut_{i+1})``; frames are counted from
the first decoded one, as embed counts them (:mod:`pipeline.embed.clips`), and a shot's ``time`` is its first
frame's presentation time minus the first frame's, in seconds.

``motion``: the mean absolute difference of luma (Rec. 601, 0..255) between consecutive frames at the decoded
size, within a shot (the cut itself is never counted): 0 for a still shot, ~1-5 for slow camera moves, tens for
fast action. A shot's value is the mean over its frame pairs (0 for a 1-frame shot); the video's is the mean over
all its within-shot pairs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SCENE_SIDE", "SCENE_SETTINGS", "VideoScenes", "detect_scenes", "merge_cuts"]

SCENE_SIDE = 256  # the decode's long side: PySceneDetect's own CLI downscales to ~256 px wide by default
SCENE_SETTINGS = {"detectors": "scenedetect ContentDetector(threshold=27) + ThresholdDetector(threshold=12)",
                  "min_scene_len": 15, "decode_side": SCENE_SIDE, "motion": "mean |dY| within shots, 0..255"}


@dataclass(frozen=True)
class VideoScenes:
    """One video's shots (``starts``/``frames``: int32 ``(s,)``, ``times``: float64 seconds, ``motion``: float32,
    each per shot), its decoded ``frame_count`` and its mean within-shot ``video_motion``."""

    starts: np.ndarray
    frames: np.ndarray
    times: np.ndarray
    motion: np.ndarray
    frame_count: int
    video_motion: float

    def rows(self) -> list[dict[str, Any]]:
        """The shots as the ``scenes`` column's structs: ``{"start", "frames", "time"}``."""
        return [{"start": int(s), "frames": int(f), "time": float(t)}
                for s, f, t in zip(self.starts, self.frames, self.times)]  # fmt: skip


def merge_cuts(content: list[int], fades: list[int], min_gap: int) -> list[int]:
    """One cut list from the content and fade detectors' cuts (frame numbers): cuts closer than ``min_gap`` frames
    to the previous one form one cluster, which keeps its fade cut where it has one, else its first cut."""
    tagged = sorted([(c, 1) for c in content] + [(c, 0) for c in fades])
    out: list[int] = []
    cluster: list[tuple[int, int]] = []
    for frame, kind in tagged:
        if cluster and frame - cluster[-1][0] >= min_gap:
            out.append(min(cluster, key=lambda x: (x[1], x[0]))[0])
            cluster = []
        cluster.append((frame, kind))
    if cluster:
        out.append(min(cluster, key=lambda x: (x[1], x[0]))[0])
    return out


def _scaled(width: int, height: int) -> tuple[int, int]:
    scale = min(1.0, SCENE_SIDE / max(width, height, 1))
    return max(2, round(width * scale) // 2 * 2), max(2, round(height * scale) // 2 * 2)


def detect_scenes(file: io.RawIOBase | str) -> VideoScenes:
    """Shots and motion of the video ``file`` (a path or a seekable file), from one forward decode (module
    docstring). PyAV's errors propagate (the caller makes them the video's error row)."""
    import av
    import cv2  # PySceneDetect's own dependency
    from scenedetect import ContentDetector, FrameTimecode, ThresholdDetector

    min_len = SCENE_SETTINGS["min_scene_len"]
    content, fade = ContentDetector(threshold=27.0, min_scene_len=min_len), ThresholdDetector(12, min_len)
    content_cuts: list[int] = []
    fade_cuts: list[int] = []
    diffs: list[float] = []  # diffs[i]: mean |dY| between frame i and i + 1
    times: list[float] = []
    previous = None
    n = 0
    with av.open(file) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = float(stream.average_rate or stream.guessed_rate or 24)
        size = None
        scaler = av.video.reformatter.VideoReformatter()  # one scaler for every frame (FFmpeg's context cached)
        for frame in container.decode(stream):
            if size is None:
                size = _scaled(frame.width, frame.height)
            bgr = scaler.reformat(frame, width=size[0], height=size[1], format="bgr24").to_ndarray()  # (h, w, 3)
            timecode = FrameTimecode(n, rate)
            content_cuts += [c.frame_num for c in content.process_frame(timecode, bgr)]
            fade_cuts += [c.frame_num for c in fade.process_frame(timecode, bgr)]
            luma = cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY)  # (h, w) uint8: Y = 0.299 R + 0.587 G + 0.114 B
            if previous is not None:
                diffs.append(float(cv2.absdiff(luma, previous).mean()))
            previous = luma
            times.append(float(frame.time) if frame.time is not None else n / rate)
            n += 1
        if n:
            end = FrameTimecode(n - 1, rate)
            content_cuts += [c.frame_num for c in content.post_process(end)]
            fade_cuts += [c.frame_num for c in fade.post_process(end)]
    cuts = [c for c in merge_cuts(content_cuts, fade_cuts, min_len) if 0 < c < n]
    starts = np.array([0, *cuts] if n else [], np.int32)  # (s,)
    frames = np.diff(np.append(starts, n)).astype(np.int32)  # (s,)
    d = np.asarray(diffs, np.float64)  # (n - 1,)
    inside = np.ones(len(d), bool)
    inside[starts[1:] - 1] = False  # the pair across each cut is not motion
    motion = np.array([d[s : s + f - 1].mean() if f > 1 else 0.0 for s, f in zip(starts, frames)], np.float32)
    t0 = times[0] if times else 0.0
    return VideoScenes(starts=starts, frames=frames, times=np.asarray([times[s] - t0 for s in starts], np.float64),
                       motion=motion, frame_count=n,
                       video_motion=float(d[inside].mean()) if inside.any() else 0.0)  # fmt: skip
