"""The annotate tasks: which exist, what each needs, and the settings each records.

    caption                         a vision-language model (pipeline.annotate.engines)
    embedding aesthetic safety      a CLIP embedder and heads on its embedding (pipeline.annotate.vision)
    watermark
    phash stats                     numpy on the decoded image (pipeline.annotate.image_stats)
    sha256                          the bytes read (no decode)
    scenes motion                   video manifests: one low-resolution PyAV decode per video
                                    (pipeline.annotate.scenes), apart from the image tasks
    scenes + caption embedding      the shot tasks: with scenes, in the same decode, per shot on frames the decode
      aesthetic safety watermark    keeps (pipeline.annotate.scenes.ShotFrames); phash, sha256, stats are refused;
                                    caption takes --shot-frames frames as video (pipeline.annotate.video_captions)

Every task of a run works from one fetch and one decode of each image (its long side at most
``--image-size``), in the same actor. A :class:`TaskPlan` says what the workers run (plain data, it travels
to them); :func:`describe_tasks` checks every model before any work; :func:`task_settings` makes the
:class:`~manifests.annotations.TaskSettings` the settings fingerprint covers. The model-free tasks name
their algorithm as ``model`` (weight hash empty); a default model is named ``default``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from manifests.annotations import TaskSettings
from pipeline.annotate.engines import CaptionSpec
from pipeline.annotate.scenes import SceneSpec
from pipeline.annotate.vision import HEAD_TASKS, VisionSpec

__all__ = ["TASKS", "VISION_TASKS", "VIDEO_TASKS", "SHOT_TASKS", "SHOT_FRAMES", "TaskPlan", "describe_tasks",
           "task_settings"]  # fmt: skip

VIDEO_TASKS = ("scenes", "motion")
TASKS = ("caption", "embedding", *HEAD_TASKS, "phash", "sha256", "stats", *VIDEO_TASKS)
VISION_TASKS = ("embedding", *HEAD_TASKS)
SHOT_TASKS = ("caption", *VISION_TASKS)  # run per shot in a video run (with scenes)
SHOT_FRAMES = 3  # the vision tasks' frames of a shot: its first, middle and last
_ALGORITHMS = {"phash": "imagehash-phash-8x8", "sha256": "sha256", "stats": "stats-v1",
               "scenes": "pyscenedetect-content+threshold", "motion": "frame-difference"}


@dataclass(frozen=True)
class TaskPlan:
    """The tasks of one run, in the order asked; ``caption``/``vision`` the specs of those that need a model
    (None when no such task is asked); ``image_size``: the decode's long side, in pixels; ``scenes``: the shot
    detector of a video run."""

    tasks: tuple[str, ...]
    caption: CaptionSpec | None
    vision: VisionSpec | None
    image_size: int
    scenes: SceneSpec = SceneSpec()

    @property
    def decodes(self) -> bool:
        """Whether any task needs pixels (``sha256`` alone reads bytes only)."""
        return any(t != "sha256" for t in self.tasks)

    @property
    def video(self) -> bool:
        """Whether the tasks are the video ones (:data:`VIDEO_TASKS`: each video decoded once, at low resolution)."""
        return any(t in VIDEO_TASKS for t in self.tasks)

    def summary(self) -> str:
        """What runs, for the job's first line."""
        parts = []
        if self.caption:
            parts.append(f"caption with {self.caption.model}")
        if self.vision:
            heads = [t for t, _ in self.vision.heads]
            named = ("embedding" if "embedding" in self.tasks else "") + (f"+{'+'.join(heads)}" if heads else "")
            parts.append(f"{named.lstrip('+')} with CLIP {self.vision.model}")
        parts += [t for t in self.tasks if t in _ALGORITHMS and not (t == "scenes" and self.scenes.network)]
        if "scenes" in self.tasks and self.scenes.network:
            parts.insert(0, f"scenes with TransNetV2 {self.scenes.weights or '(the package weights)'}")
        return ", ".join(parts)


def describe_tasks(plan: TaskPlan) -> dict[str, Any]:
    """Every model of ``plan`` checked without running it (a bad id, folder or head fails here in one line,
    UsageError): ``{"caption": describe_model(...), "vision": describe_vision(...)}`` for those asked."""
    from pipeline.annotate.engines import describe_model
    from pipeline.annotate.vision import describe_vision

    out: dict[str, Any] = {}
    if "scenes" in plan.tasks and plan.scenes.network:
        from pipeline.annotate.transnet import describe_transnet

        out["scenes"] = describe_transnet(plan.scenes.weights)
    if plan.caption:
        out["caption"] = describe_model(plan.caption)
    if plan.vision:
        out["vision"] = describe_vision(plan.vision)
    return out


def task_settings(plan: TaskPlan, described: dict[str, Any]) -> tuple[TaskSettings, ...]:
    """Each task's :class:`TaskSettings` (in ``plan.tasks`` order). The caption task's are what they were
    before the other tasks existed, so a caption-only folder keeps its settings fingerprint."""
    out = []
    for task in plan.tasks:
        if task == "caption":
            spec = plan.caption
            assert spec is not None
            digest = described["caption"]["weight_sha256"]
            generation = spec.generation()
            if spec.video:  # each shot's frames as video input, from the scene decode
                from pipeline.annotate.scenes import SCENE_SIDE

                generation.update(image_size=SCENE_SIDE, shot_frames=spec.shot_frames, input="video")
            out.append(TaskSettings(task="caption", model=spec.model, weight_sha256=digest,
                                    prompt=spec.prompt, max_new_tokens=spec.max_new_tokens,
                                    generation=generation))  # fmt: skip
        elif task in VISION_TASKS:
            vision, v = plan.vision, described["vision"]
            assert vision is not None
            embedder = {"image_size": plan.image_size, "dim": v["dim"], "class": v["class"]}
            if plan.video:  # scored on the scene decode's frames, first/middle/last of each shot
                from pipeline.annotate.scenes import SCENE_SIDE

                embedder.update(image_size=SCENE_SIDE, shot_frames="first, middle, last: mean")
            if task == "embedding":
                out.append(TaskSettings(task=task, model=vision.model, weight_sha256=v["weight_sha256"],
                                        generation={**embedder, "dtype": "float16", "normalised": "l2"}))  # fmt: skip
            else:
                source = dict(vision.heads)[task]
                out.append(TaskSettings(task=task, model=source, weight_sha256=v["heads"][task],
                                        generation={**embedder, "embedding_model": vision.model,
                                                    "embedding_sha256": v["weight_sha256"]}))  # fmt: skip
        elif task in VIDEO_TASKS and plan.scenes.network:  # motion too: within the network's shots
            from pipeline.annotate.scenes import SCENE_SETTINGS
            from pipeline.annotate.transnet import TRANSNET_SETTINGS

            net = described["scenes"]
            generation = {**TRANSNET_SETTINGS, "weights": net["weights"], "decode_side": SCENE_SETTINGS["decode_side"],
                          "motion": SCENE_SETTINGS["motion"]}  # fmt: skip
            out.append(TaskSettings(task=task, model="transnetv2" if task == "scenes" else _ALGORITHMS[task],
                                    weight_sha256=net["weight_sha256"], generation=generation))  # fmt: skip
        elif task in VIDEO_TASKS:
            from pipeline.annotate.scenes import SCENE_SETTINGS

            out.append(TaskSettings(task=task, model=_ALGORITHMS[task], weight_sha256="",
                                    generation=dict(SCENE_SETTINGS)))  # fmt: skip
        else:
            generation = {} if task == "sha256" else {"image_size": plan.image_size}
            out.append(TaskSettings(task=task, model=_ALGORITHMS[task], weight_sha256="", generation=generation))
    return tuple(out)
