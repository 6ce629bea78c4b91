"""Shot captions: a video-capable vision-language model captions each shot from its frames as **video input**.

    bucketeer annotate VIDEO_MANIFEST --out CAPTIONED --task scenes,caption [--model ID|PATH] [--shot-frames 8]

The frames are the ``--shot-frames`` (an even number, 8 by default) evenly spaced frames of the shot that the
scene decode kept (:meth:`pipeline.annotate.scenes.ShotFrames.pick`: 256 pixels on the long side, its first and
last frame included), so a shot is decoded once for every task. :class:`ShotCaptioner` gives them to the model
the way transformers documents video input for image-text-to-text models: the chat template's ``{"type":
"video"}`` and one batched greedy ``generate``. Two ways to the model's tensors:

- the processor has a video processor (torchvision installed, e.g. a GPU box): ``processor(text=...,
  videos=[frames], do_sample_frames=False, video_metadata=...)``: the frames we picked are the frames it takes;
  the metadata's ``fps`` is the picked frames' own rate (``n`` frames over the shot's duration), from which
  Qwen2.5-VL's processor derives ``second_per_grid_ts``;
- a Qwen2-VL or Qwen2.5-VL whose processor has none (transformers builds the video processor only with
  torchvision): :func:`video_inputs` computes ``pixel_values_videos`` and ``video_grid_thw`` (and
  ``second_per_grid_ts``) with numpy and PIL as ``Qwen2VLVideoProcessor`` does: ``smart_resize`` to multiples of
  ``patch_size * merge_size`` within the video processor's pixel bounds, bicubic resize, rescale by 1/255,
  normalise by the CLIP mean and std, the last frame repeated to a multiple of ``temporal_patch_size``, and its
  temporal patchify; the text's video token is expanded to ``t * h * w / merge_size**2`` tokens as the processor
  does. The one difference: PIL's bicubic resize instead of torchvision's (antialiased bicubic on tensors), so
  pixel values differ in the low bits; grids, token counts and layout are the same.

Image-only captioners (the default Llava, any model without video input) are refused in one line naming
``--model`` (:func:`pipeline.annotate.engines.describe_model`): a shot's caption is meant to say what happens in
it, which one frame cannot. ``--model default`` in a video run is a tiny random Qwen2.5-VL
(:func:`pipeline.annotate.default_model.build_default_video_model`): its captions are noise.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.annotate.engines import QWEN_VL_TYPES, CaptionSpec, eos_ids, generate_captions, load_captioner

__all__ = ["VideoGrid", "video_patches", "video_inputs", "ShotCaptioner"]

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoGrid:
    """Qwen2-VL's video processor settings: pixel bounds per frame, patch, merge and temporal patch sizes, the
    normalisation. :meth:`of` reads them from a model folder."""

    min_pixels: int = 128 * 28 * 28  # Qwen2VLVideoProcessor's defaults
    max_pixels: int = 28 * 28 * 768
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple[float, ...] = _CLIP_MEAN
    std: tuple[float, ...] = _CLIP_STD

    @classmethod
    def of(cls, path: str, image_processor: Any) -> "VideoGrid":
        """The folder's ``video_preprocessor_config.json`` where it has one, else the image processor's patch
        sizes and normalisation with the video processor's default pixel bounds."""
        file = os.path.join(path, "video_preprocessor_config.json")
        if os.path.isfile(file):
            with open(file) as f:
                c = json.load(f)
        else:
            c = {k: getattr(image_processor, k) for k in ("patch_size", "merge_size", "temporal_patch_size",
                                                          "image_mean", "image_std") if hasattr(image_processor, k)}
        size = c.get("size") or {}
        d = cls()
        return cls(min_pixels=int(c.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
                   max_pixels=int(c.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
                   patch_size=int(c.get("patch_size", d.patch_size)), merge_size=int(c.get("merge_size", d.merge_size)),
                   temporal_patch_size=int(c.get("temporal_patch_size", d.temporal_patch_size)),
                   mean=tuple(c.get("image_mean", d.mean)), std=tuple(c.get("image_std", d.std)))  # fmt: skip


def video_patches(frames: list[np.ndarray], grid: VideoGrid) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One video's ``(patches, (t, h, w))`` as ``Qwen2VLVideoProcessor`` computes them (module docstring):
    ``frames`` RGB uint8 ``(H, W, 3)``, all one size; ``patches`` float32 ``(t * h * w, 3 * T * P * P)``."""
    from PIL import Image
    try:  # transformers 5.2x: the PIL backend's module (its torchvision one needs torchvision)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:  # 5.0, the floor: the slow processor's module, on PIL and numpy
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    p, m, tp = grid.patch_size, grid.merge_size, grid.temporal_patch_size
    height, width = frames[0].shape[:2]
    rh, rw = smart_resize(height, width, factor=p * m, min_pixels=grid.min_pixels, max_pixels=grid.max_pixels)
    resized = [np.asarray(Image.fromarray(f).resize((rw, rh), Image.BICUBIC)) for f in frames]
    mean, std = np.asarray(grid.mean, np.float32), np.asarray(grid.std, np.float32)
    video = (np.stack(resized).astype(np.float32) / 255.0 - mean) / std  # (F, rh, rw, 3)
    video = video.transpose(0, 3, 1, 2)  # (F, 3, rh, rw)
    if pad := -len(video) % tp:  # the last frame repeated to a whole temporal patch
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    gt, gh, gw = len(video) // tp, rh // p, rw // p
    patches = video.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, 3, tp, p, p)
    return np.ascontiguousarray(patches.reshape(gt * gh * gw, 3 * tp * p * p)), (gt, gh, gw)


def video_inputs(processor: Any, grid: VideoGrid, texts: list[str], videos: list[list[np.ndarray]],
                 fps: list[float], second_per_grid: bool) -> dict[str, Any]:  # fmt: skip
    """The model inputs of ``texts`` (each with one video token) and ``videos`` (RGB frames) for a Qwen2-VL
    family model without a video processor: the tokens (left padded), ``mm_token_type_ids`` (2 on video tokens;
    transformers releases whose models take them, 5.2x: :class:`ShotCaptioner` drops them for older ones),
    ``pixel_values_videos``, ``video_grid_thw`` and, with ``second_per_grid``, Qwen2.5-VL's ``second_per_grid_ts``
    (``temporal_patch_size / fps``)."""
    import torch

    token = processor.video_token
    done = [video_patches(v, grid) for v in videos]
    expanded = [t.replace(token, token * (int(np.prod(g)) // grid.merge_size**2), 1) for t, (_, g) in zip(texts, done)]
    inputs = dict(processor.tokenizer(expanded, return_tensors="pt", padding=True))
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == processor.video_token_id).long() * 2
    inputs["pixel_values_videos"] = torch.from_numpy(np.concatenate([x for x, _ in done]))
    inputs["video_grid_thw"] = torch.tensor([g for _, g in done], dtype=torch.long)
    if second_per_grid:
        inputs["second_per_grid_ts"] = torch.tensor([grid.temporal_patch_size / f for f in fps], dtype=torch.float32)
    return inputs


class ShotCaptioner:
    """Captions shots (lists of RGB frames) with ``spec``'s video-capable model on ``device`` (module docstring)."""

    def __init__(self, spec: CaptionSpec, device: str = "cpu"):
        import torch

        self.device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        self.spec = spec
        self.processor, self.model = load_captioner(spec, self.device)
        self.processor.tokenizer.padding_side = "left"  # generation continues every row from its end
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": spec.prompt}]}]
        template = self.processor if self.processor.chat_template else self.processor.tokenizer
        self.text = template.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        self.native = getattr(self.processor, "video_processor", None) is not None
        model_type = self.model.config.model_type
        self.grid = None if self.native else VideoGrid.of(spec.path(), self.processor.image_processor)
        self.second_per_grid = model_type == "qwen2_5_vl"
        self.token_types = "mm_token_type_ids" in inspect.signature(self.model.forward).parameters  # 5.0: absent
        assert self.native or model_type in QWEN_VL_TYPES  # describe_model refused the others
        self.eos = eos_ids(self.model)

    def _inputs(self, shots: list[list[np.ndarray]], fps: list[float]) -> dict[str, Any]:
        texts = [self.text] * len(shots)
        if not self.native:
            inputs = video_inputs(self.processor, self.grid, texts, shots, fps, self.second_per_grid)
            return inputs if self.token_types else {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
        from PIL import Image
        from transformers.video_utils import VideoMetadata

        metadata = [VideoMetadata(total_num_frames=len(s), fps=f, frames_indices=list(range(len(s))))
                    for s, f in zip(shots, fps)]  # fmt: skip
        return dict(self.processor(text=texts, videos=[[Image.fromarray(f) for f in s] for s in shots],
                                   video_metadata=metadata, do_sample_frames=False, return_tensors="pt",
                                   padding=True))  # fmt: skip

    def caption(self, shots: list[list[np.ndarray]], fps: list[float]) -> list[tuple[str, int]]:
        """``(caption, generated tokens)`` per shot, in order: ``shots`` each ``--shot-frames`` RGB uint8 frames,
        ``fps`` the rate of each shot's picked frames (frames per second); one batched greedy ``generate``."""
        inputs = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in self._inputs(shots, fps).items()}
        return generate_captions(self.model, self.processor, inputs, self.spec.max_new_tokens, self.eos)
