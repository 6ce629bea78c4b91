"""The video annotate tasks: ``scenes`` (shot boundaries) and ``motion``, from one low-resolution decode per video.

    bucketeer annotate VIDEO_MANIFEST --out SCENES --task scenes,motion

:func:`detect_scenes` decodes a video once with PyAV, forward, every frame scaled so that its long side is at
most :data:`SCENE_SIDE` pixels (FFmpeg's scaler, in the decoder's thread), and feeds the frames to
PySceneDetect's detectors through their frame API (no second decode, no OpenCV video reader):

- ``ContentDetector`` (its defaults: threshold 27 on the mean HSV change between frames, ``min_scene_len`` 15
  frames) finds hard cuts;
- ``ThresholdDetector`` (threshold 12: every channel's mean below it is "faded out") finds fades through black,
  one cut in the middle of the dark part.

The detector is one object per video behind a small protocol (:class:`CutDetector`: fed every frame, it reports
cuts): :class:`PySceneDetectCuts` (the default) or TransNetV2's (``--scene-detector transnetv2``,
:class:`pipeline.annotate.transnet.TransNetCuts`, which scales the same decoded frames to 48x27 for its network).

A fade also moves the content score (hue jumps once the picture is nearly black), so the two lists are merged: cuts
closer than ``min_scene_len`` frames are one cut, the fade's (ThresholdDetector) where it has one, else the first.
A fade to black and back is thus one cut, never several. Shots are ``[cut_i, cut_{i+1})``; frames are counted from
the first decoded one, as embed counts them (:mod:`pipeline.embed.clips`), and a shot's ``time`` is its first
frame's presentation time minus the first frame's, in seconds.

``motion``: the mean absolute difference of luma (Rec. 601, 0..255) between consecutive frames at the decoded
size, within a shot (the cut itself is never counted): 0 for a still shot, ~1-5 for slow camera moves, tens for
fast action. A shot's value is the mean over its frame pairs (0 for a 1-frame shot); the video's is the mean over
all its within-shot pairs.

Per-shot frames (``detect_scenes(file, keep=3)``, for the shot tasks ``aesthetic``/``embedding``/``caption``):
the cuts are final only once the video ends (the detectors report a cut late, a fade's up to its whole dark part
later, and :func:`merge_cuts` merges them last), so :class:`ShotFrames` keeps, within the same single decode, a
bounded set of the decoded 256-pixel frames: the first and last frame of every candidate segment (pinned from a
ring of the last :data:`LOOKBACK` frames when a detector reports a cut), and in each segment a stride-halving
reservoir of at most :data:`RESERVOIR` frames (every frame, then every 2nd, 4th, ... as the segment grows). A
final shot is one or more candidate segments; :meth:`ShotFrames.pick` takes the kept frames nearest to ``n``
evenly spaced positions of the shot, its first and last frame exactly wherever the cut came within the lookback.
Every :data:`LOOKBACK` frames the shots whose cuts can no longer change (:func:`final_cuts`) keep only their
picks, so memory is the ``keep`` picks per shot before, at most ``RESERVOIR + 2`` frames per candidate segment of
the last few hundred frames, and the ring (~110 kB a 256x144 frame).
"""

from __future__ import annotations

import io
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["SCENE_SIDE", "SCENE_SETTINGS", "SCENE_DETECTORS", "RESERVOIR", "LOOKBACK", "CutDetector",
           "PySceneDetectCuts", "SceneSpec", "ShotFrames", "VideoScenes", "detect_scenes", "final_cuts",
           "merge_cuts"]  # fmt: skip

SCENE_SIDE = 256  # the decode's long side: PySceneDetect's own CLI downscales to ~256 px wide by default
SCENE_DETECTORS = ("pyscenedetect", "transnetv2")  # --scene-detector: PySceneDetectCuts, transnet.TransNetCuts
SCENE_SETTINGS = {"detectors": "scenedetect ContentDetector(threshold=27) + ThresholdDetector(threshold=12)",
                  "min_scene_len": 15, "decode_side": SCENE_SIDE, "motion": "mean |dY| within shots, 0..255"}
RESERVOIR = 16  # kept frames per candidate segment (besides its pinned first and last)
LOOKBACK = 128  # the ring of recent frames a late-reported cut pins its frames from


@dataclass(frozen=True)
class SceneSpec:
    """The shot detector of a video run (``--scene-detector``, :data:`SCENE_DETECTORS`) and, for TransNetV2, its
    ``--scene-weights`` (None: the package's own)."""

    detector: str = "pyscenedetect"
    weights: str | None = None

    @property
    def network(self) -> bool:
        """Whether the shots come from TransNetV2 (:mod:`pipeline.annotate.transnet`)."""
        return self.detector == "transnetv2"


class ShotFrames:
    """The bounded set of decoded frames a video's shots are scored and captioned from (module docstring).
    Feed every frame in order to :meth:`add`, each detector cut to :meth:`cut`, then :meth:`finish`."""

    def __init__(self, picks: int | tuple[int, ...], reservoir: int = RESERVOIR, lookback: int = LOOKBACK):
        self.kept: dict[int, np.ndarray] = {}  # frame number -> (h, w, 3) uint8, BGR as decoded
        self.pinned: set[int] = set()
        # picks: frames a shot keeps once final, or several counts (one per task: the vision tasks' 3, the
        # captioner's --shot-frames), each pick(start, frames, n) of them served from the union
        self.picks = picks if isinstance(picks, tuple) else (picks,)
        self.settled = 0  # frames < settled: only the picks of their final shots are kept
        self.recent: deque[tuple[int, np.ndarray]] = deque(maxlen=lookback)
        self.reservoir, self.start, self.stride = reservoir, 0, 1

    def _pin(self, n: int) -> None:
        frame = self.kept.get(n) if n in self.kept else next((f for i, f in self.recent if i == n), None)
        if frame is not None:
            self.kept[n] = frame
            self.pinned.add(n)

    def add(self, n: int, bgr: np.ndarray) -> None:
        """Frame ``n`` (the next one decoded, ``(h, w, 3)`` uint8 BGR: converted only when picked)."""
        self.recent.append((n, bgr))
        if n == 0:
            self._pin(0)
        if (n - self.start) % self.stride == 0:
            self.kept[n] = bgr
            self._thin()

    def _thin(self) -> None:
        free = [i for i in self.kept if i >= self.start and i not in self.pinned]
        while len(free) > self.reservoir:
            self.stride *= 2
            for i in [i for i in free if (i - self.start) % self.stride]:
                del self.kept[i]
            free = [i for i in free if i in self.kept]

    def cut(self, c: int) -> None:
        """A detector's cut at frame ``c`` (reported now or up to the lookback late): a new segment starts there."""
        self._pin(c - 1)
        self._pin(c)
        if c > self.start:
            self.start, self.stride = c, 1
            self._thin()

    def finish(self) -> None:
        """The video ended: pin its last frame."""
        if self.recent:
            self._pin(self.recent[-1][0])

    def settle(self, start: int, frames: int) -> None:
        """The shot ``[start, start + frames)`` is final (its cuts can no longer change): keep only its picks."""
        chosen = {i for n in self.picks for i in self._nearest(start, frames, n)}
        for i in [i for i in self.kept if start <= i < start + frames and i not in chosen]:
            del self.kept[i]
            self.pinned.discard(i)
        self.pinned |= chosen
        self.settled = start + frames

    def _nearest(self, start: int, frames: int, n: int) -> list[int]:
        inside = np.array(sorted(i for i in self.kept if start <= i < start + frames))  # (k,)
        if not len(inside):  # a cut reported later than the lookback inside a thinned segment: the nearest kept
            inside = np.array(sorted(self.kept))
        if not len(inside):
            return []
        at = np.linspace(start, start + frames - 1, n) if n > 1 else np.array([start + (frames - 1) / 2])
        return [int(inside[np.abs(inside - a).argmin()]) for a in at]

    def pick(self, start: int, frames: int, n: int) -> list[np.ndarray]:
        """``n`` kept frames (RGB) of the shot ``[start, start + frames)`` nearest to ``n`` evenly spaced positions
        (first and last included; one position, the middle, for ``n`` 1); the nearest kept frames outside it when
        none inside was kept; [] when no frame was."""
        return [np.ascontiguousarray(self.kept[i][..., ::-1]) for i in self._nearest(start, frames, n)]


def final_cuts(content: list[int], fades: list[int], min_gap: int, bound: int) -> list[int]:
    """The merged cuts (:func:`merge_cuts`) that no cut reported later can change: those of the clusters whose
    every cut is at most ``bound`` (a later cut's frame is past it) and no later cut chains to (``min_gap``)."""
    raw = sorted(c for c in content + fades if c <= bound)
    while raw and bound - raw[-1] < min_gap:  # the last cluster may still grow: drop it whole
        last = raw.pop()
        while raw and last - raw[-1] < min_gap:
            last = raw.pop()
    if not raw:
        return []
    return merge_cuts([c for c in content if c <= raw[-1]], [c for c in fades if c <= raw[-1]], min_gap)


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
    kept: ShotFrames | None = None  # with detect_scenes(keep=n): the frames the shot tasks take
    rate: float = 24.0  # the stream's frames per second (its average rate)

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


class CutDetector(Protocol):
    """One video's shot-boundary detector, fed every decoded frame in order by :func:`detect_scenes`. ``lag``:
    the most frames decoded after a cut's frame before :meth:`add` reports it (beyond :data:`LOOKBACK`)."""

    lag: int

    def add(self, n: int, frame: Any, bgr: np.ndarray) -> list[int]:
        """Frame ``n`` (the PyAV frame and its 256-pixel BGR ``(h, w, 3)``): cut frames found now (maybe earlier)."""

    def finish(self) -> list[int]:
        """The video ended: the cuts found at its end."""

    def final(self, bound: int) -> list[int]:
        """The cuts up to ``bound`` that no later report can change (:meth:`cuts` will hold them)."""

    def cuts(self) -> list[int]:
        """Every cut of the video, after :meth:`finish`."""


class PySceneDetectCuts:
    """``ContentDetector`` + ``ThresholdDetector`` on the 256-pixel frames, merged (:func:`merge_cuts`): the
    :class:`CutDetector` of ``--scene-detector pyscenedetect`` (module docstring)."""

    lag = 0

    def __init__(self) -> None:
        from scenedetect import ContentDetector, ThresholdDetector

        self.min_len = SCENE_SETTINGS["min_scene_len"]
        self.content, self.fade = ContentDetector(threshold=27.0, min_scene_len=self.min_len), ThresholdDetector(
            12, self.min_len)  # fmt: skip
        self.content_cuts: list[int] = []
        self.fade_cuts: list[int] = []
        self.rate, self.last = 24.0, -1  # rate: the stream's frames/s (detect_scenes sets it), for the timecodes

    def add(self, n: int, frame: Any, bgr: np.ndarray) -> list[int]:
        from scenedetect import FrameTimecode

        timecode = FrameTimecode(n, self.rate)
        found = [c.frame_num for c in self.content.process_frame(timecode, bgr)], [
            c.frame_num for c in self.fade.process_frame(timecode, bgr)]  # fmt: skip
        self.content_cuts += found[0]
        self.fade_cuts += found[1]
        self.last = n
        return sorted(found[0] + found[1])

    def finish(self) -> list[int]:
        from scenedetect import FrameTimecode

        if self.last < 0:
            return []
        end = FrameTimecode(self.last, self.rate)
        late = [c.frame_num for c in self.content.post_process(end)], [c.frame_num for c in self.fade.post_process(end)]
        self.content_cuts += late[0]
        self.fade_cuts += late[1]
        return sorted(late[0] + late[1])

    def final(self, bound: int) -> list[int]:
        return final_cuts(self.content_cuts, self.fade_cuts, self.min_len, bound)

    def cuts(self) -> list[int]:
        return merge_cuts(self.content_cuts, self.fade_cuts, self.min_len)


def detect_scenes(file: io.RawIOBase | str, keep: int | tuple[int, ...] = 0,
                  detector: CutDetector | None = None) -> VideoScenes:  # fmt: skip
    """Shots and motion of the video ``file`` (a path or a seekable file), from one forward decode (module
    docstring); ``keep``: also keep that many frames per shot (or each of several counts, :class:`ShotFrames`) to
    score it from (``VideoScenes.kept``);
    ``detector``: a new one per video (default :class:`PySceneDetectCuts`; :class:`pipeline.annotate.transnet.
    TransNetCuts` for TransNetV2). PyAV's errors propagate (the caller makes them the video's error row)."""
    import av
    import cv2  # PySceneDetect's own dependency

    detector = detector if detector is not None else PySceneDetectCuts()
    diffs: list[float] = []  # diffs[i]: mean |dY| between frame i and i + 1
    times: list[float] = []
    previous = None
    kept = ShotFrames(keep, lookback=LOOKBACK + detector.lag) if keep else None
    n = 0
    with av.open(file) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = float(stream.average_rate or stream.guessed_rate or 24)
        if isinstance(detector, PySceneDetectCuts):
            detector.rate = rate
        size = None
        scaler = av.video.reformatter.VideoReformatter()  # one scaler for every frame (FFmpeg's context cached)
        for frame in container.decode(stream):
            if size is None:
                size = _scaled(frame.width, frame.height)
            bgr = scaler.reformat(frame, width=size[0], height=size[1], format="bgr24").to_ndarray()  # (h, w, 3)
            found = detector.add(n, frame, bgr)
            if kept is not None:
                kept.add(n, bgr)
                for c in found:
                    kept.cut(c)
                if n % LOOKBACK == 0:  # shots final by now keep only their picks: memory ~``keep`` frames a shot
                    final = [c for c in detector.final(n - LOOKBACK - detector.lag) if c > 0]
                    for a, b in zip([0, *final], final):
                        if a >= kept.settled:
                            kept.settle(a, b - a)
            luma = cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY)  # (h, w) uint8: Y = 0.299 R + 0.587 G + 0.114 B
            if previous is not None:
                diffs.append(float(cv2.absdiff(luma, previous).mean()))
            previous = luma
            times.append(float(frame.time) if frame.time is not None else n / rate)
            n += 1
        if n:
            late = detector.finish()
            if kept is not None:
                for c in late:
                    kept.cut(c)
                kept.finish()
    cuts = [c for c in detector.cuts() if 0 < c < n]
    starts = np.array([0, *cuts] if n else [], np.int32)  # (s,)
    frames = np.diff(np.append(starts, n)).astype(np.int32)  # (s,)
    d = np.asarray(diffs, np.float64)  # (n - 1,)
    inside = np.ones(len(d), bool)
    inside[starts[1:] - 1] = False  # the pair across each cut is not motion
    motion = np.array([d[s : s + f - 1].mean() if f > 1 else 0.0 for s, f in zip(starts, frames)], np.float32)
    t0 = times[0] if times else 0.0
    return VideoScenes(starts=starts, frames=frames, times=np.asarray([times[s] - t0 for s in starts], np.float64),
                       motion=motion, frame_count=n, video_motion=float(d[inside].mean()) if inside.any() else 0.0,
                       kept=kept, rate=rate)  # fmt: skip
