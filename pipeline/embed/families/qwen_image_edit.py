"""Qwen-Image-Edit: Qwen2.5-VL's last hidden states of (instruction, reference image), prefix dropped.

Mirrors ``QwenImageEditPipeline`` (diffusers 0.42). Its "text" embedding is a function of the instruction **and**
the reference image: ``encode_prompt(prompt, image)`` puts the instruction in the edit template (a system message,
then the user turn ``<|vision_start|><|image_pad|><|vision_end|>{instruction}``, then the assistant's opening),
runs the template and the image through ``Qwen2VLProcessor`` (the image's ``<|image_pad|>`` becomes one token per
2x2 merged 14-pixel patch: 1,369 for a 1024² reference) and Qwen2.5-VL, and keeps ``hidden_states[-1]`` of the
real tokens minus the first ``prompt_template_encode_start_idx`` (64): the system message and the user turn's
opening. What remains (``<|vision_start|>``, the image's tokens, ``<|vision_end|>``, the instruction and the 5
closing tokens) is what the transformer sees; the edit pipeline cuts nothing (``max_sequence_length`` is not
applied), so neither does the cache.

**The reference.** A sample's reference is its paired conditioning image (``scan --conditioning``), cropped like
its target (the bucket's crop box: :func:`pipeline.embed.imaging.conditioning_views`) and resized **once**, from the
full-resolution decode, to ``calculate_dimensions(1024 * 1024, width / height)`` (the bucket's aspect at about a
megapixel, sides multiples of 32) with Lanczos: what ``QwenImageEditPipeline.__call__`` does to the image it is
handed (``image_processor.resize``), applied to the crop's region (:func:`reference_size`; one ``Image.resize`` with
the crop as its ``box``). A reference cut at the bucket's size first and resized again would be softer than what
inference sees wherever the bucket is under a megapixel. That one image is what Qwen2.5-VL sees (through the
processor) and what the VAE encodes into the record's ``cond_latent`` (the normalised posterior mode,
``_encode_vae_image``). So ``cond_latent`` is at the reference's grid, which differs from the target's for buckets
far from a megapixel, as in the pipeline's ``img_shapes``.

**The key.** A record's text is keyed by :func:`reference_key` (a hash of the instruction and the reference's
pixels), never by the caption alone: two samples with the same instruction and other references get their own
embeddings. Each sample's text is encoded on the image worker, one sample per forward pass (exactly
``encode_prompt([instruction], image)``: no batch padding), and stored inline in its record (~10 MB in bf16 at a
1024² reference): a repeated (instruction, reference) pair is stored per sample, since the key exists only once
the reference is decoded and cropped, on the workers, and such repeats are rare in edit datasets.

**The processor.** Loaded as the pipeline loads it, ``Qwen2VLProcessor.from_pretrained(model, subfolder=
"processor")``, which needs torchvision: its image processor is the torchvision backend (uint8 antialiased bicubic
resize to ``smart_resize``'s 28-pixel grid, float32 normalisation). Without torchvision,
:func:`pipeline.embed.processors.load_qwen2vl_processor` builds the same processor around
:func:`~pipeline.embed.processors.torch_qwen2vl_image_processor`, which computes what the torchvision backend computes
with torch alone (equal bit for bit: ``tests/test_qwen2vl_vision.py`` runs both where torchvision is installed),
never the PIL twin (whose bicubic differs). The encoder fingerprint records the processor's class and backend
(``settings.text.encoders[0].processor``), so caches made through other resize code never mix.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from manifests.cache.text_layout import TextLayout
from manifests.errors import UsageError
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared
from pipeline.embed.families.qwen_image import pad_parts, width

__all__ = ["FAMILY", "TEMPLATE", "DROP", "REFERENCE_AREA", "conditioning_setting", "reference_size", "reference_pixels",
           "reference_key", "check_options", "reference_area"]  # fmt: skip

DROP = 64  # QwenImageEditPipeline.prompt_template_encode_start_idx: the template's tokens before <|vision_start|>
REFERENCE_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__: calculate_dimensions(1024 * 1024, ratio)
TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
            "background), then explain how the user's text instruction should alter or modify the image. Generate a "
            "new image that meets the user's requirements while maintaining consistency with the original input "
            "where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
            "<|im_start|>assistant\n")  # QwenImageEditPipeline.prompt_template_encode  # fmt: skip


def reference_size(height: int, width: int, area: int = REFERENCE_AREA) -> tuple[int, int]:
    """``(height, width)`` the edit pipeline resizes a ``height x width`` reference to: ``calculate_dimensions(area,
    width / height)``, ``area`` the pipeline's 1024² (``embed --reference-resolution`` squared)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / ratio / 32) * 32, round(w / 32) * 32


def conditioning_setting(area: int) -> str:
    """What ``_cache.json`` ``settings.conditioning`` says of the references of a cache made at ``area`` pixels."""
    return (f"the reference: the crop's region of the full-resolution image, resized once (Lanczos) to "
            f"calculate_dimensions({area}, w / h) as QwenImageEditPipeline does; its latent is cond_latent and the "
            "text saw it")  # fmt: skip


def reference_pixels(crop: np.ndarray, area: int = REFERENCE_AREA) -> np.ndarray:
    """An image ``(H, W, 3)`` uint8 as the pipeline resizes the image it is handed (``image_processor.resize``:
    Lanczos) to :func:`reference_size` (embed resizes the crop's region of the full image in the same one pass:
    :func:`pipeline.embed.imaging.conditioning_views` with ``out``)."""
    from PIL import Image

    h, w = reference_size(*crop.shape[:2], area)
    if (h, w) == crop.shape[:2]:
        return crop
    return np.asarray(Image.fromarray(crop).resize((w, h), resample=Image.Resampling.LANCZOS))


def reference_key(instruction: str | None, pixels: np.ndarray) -> int:
    """uint64 key of the text of ``instruction`` with reference ``pixels`` ``(h, w, 3)`` uint8 (None: ``""``)."""
    h = hashlib.blake2b(digest_size=8)
    text = (instruction or "").encode("utf-8")
    h.update(b"qwen-image-edit\0%d\0" % len(text) + text + b"%d,%d\0" % pixels.shape[:2])
    h.update(np.ascontiguousarray(pixels, np.uint8).tobytes())
    return int.from_bytes(h.digest(), "big")


def check_options(job: Any) -> None:
    """UsageError naming the ``embed`` option (of an :class:`~pipeline.embed.job.EmbedJob`) that this family cannot
    take, its text needing each sample's reference; ``--reference-resolution`` with another family."""
    family, size = job.family, job.reference_resolution
    if family != FAMILY.name:
        if size is not None:
            raise UsageError(f"--reference-resolution is for --family {FAMILY.name}, not {family}")
        return
    if size is not None and not 32 <= size <= 4096:
        raise UsageError(f"--reference-resolution must be 32 to 4096, got {size}")
    if job.crops > 1 or job.flip:
        raise UsageError(f"--crops/--flip: --family {family}'s text is encoded from each sample's reference crop, "
                         "so every variant would need its own ~10 MB text embedding; drop --crops/--flip")
    if job.validation_prompts is not None:
        raise UsageError(f"--validation-prompts: --family {family} conditions every prompt on a reference image, "
                         "which a prompts file does not give; drop the option")
    if job.max_text_tokens is not None:
        raise UsageError(f"--max-text-tokens {job.max_text_tokens}: --family {family}'s pipeline keeps every token "
                         "of the instruction and its reference image (no max_sequence_length cut); drop the option")


def reference_area(job: Any) -> int | None:
    """Pixels the references of an :class:`~pipeline.embed.job.EmbedJob` are resized to (None: another family)."""
    if job.family != FAMILY.name:
        return None
    return REFERENCE_AREA if job.reference_resolution is None else job.reference_resolution**2


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (qwen,) = models
    limit = int(qwen.model.config.get_text_config().max_position_embeddings) - DROP  # no cut: the positions' bound
    return TextLayout(family="qwen-image-edit", join="features", masked=True, lengths=(limit,),
                      widths=(width(qwen.model),))  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions,
           images: list[np.ndarray] | None = None) -> PromptParts:  # fmt: skip
    """Per instruction and its reference ``images[i]`` (``(h, w, 3)`` uint8, as :func:`reference_pixels` gives it),
    ``encode_prompt([instruction], image)``'s rows, one sample per forward pass."""
    from PIL import Image

    (qwen,) = models
    if images is None or len(images) != len(captions):
        raise ValueError("qwen-image-edit encodes an instruction with its reference image: one image per caption")
    rows = []
    for caption, pixels in zip(captions, images):
        inputs = qwen.processor(text=[TEMPLATE.format(caption)], images=Image.fromarray(pixels), padding=True,
                                return_tensors="pt").to(qwen.device)  # fmt: skip
        mask = inputs["attention_mask"]
        hidden = qwen.model(input_ids=inputs["input_ids"], attention_mask=mask, pixel_values=inputs["pixel_values"],
                            image_grid_thw=inputs["image_grid_thw"], output_hidden_states=True).hidden_states[-1]
        rows.append(hidden[0][mask[0].bool()][DROP:])  # (L, D)
    return pad_parts(rows)


FAMILY = declared("qwen-image-edit", layout=layout, encode=encode)
