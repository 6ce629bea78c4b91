"""CLIP's preprocessing on the device (pipeline.annotate.vision.device_pixels) against the processor itself.

On cuda the annotate embedder sends each image as uint8 and resizes, crops and normalises it there instead of in the
processor on one CPU thread (issue 55). Here the same code runs on the CPU against ``CLIPImageProcessor``: PIL's
bicubic resize and torch's antialiased one differ by about one intensity level where they differ at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.annotate.vision import device_pixels

SIZES = [(640, 480), (480, 640), (1024, 768), (300, 300), (224, 500), (1200, 400), (800, 1000), (225, 224)]


def smooth(w: int, h: int, rng) -> Image.Image:
    """A photo-like image: smooth colour fields (what a camera gives), not pixel noise."""
    small = Image.fromarray(rng.integers(0, 256, (max(h // 16, 2), max(w // 16, 2), 3), dtype=np.uint8))
    return small.resize((w, h), Image.Resampling.BICUBIC)


@pytest.fixture(scope="module")
def processor():
    from pipeline.annotate.vision import _quiet
    from transformers import CLIPImageProcessor

    _quiet()
    return CLIPImageProcessor()  # openai/clip-vit-*'s settings: shortest edge 224, crop 224, its mean and std


def levels(a: torch.Tensor, b: torch.Tensor, processor) -> torch.Tensor:
    """``|a - b|`` in 0..255 intensity levels (normalised pixels back through the std)."""
    return (a - b).abs() * torch.tensor(processor.image_std).view(1, 3, 1, 1) * 255


def test_the_device_pixels_are_the_processors_within_a_level(processor):
    rng = np.random.default_rng(0)
    images = [smooth(w, h, rng) for w, h in SIZES]
    ref = processor(images=images, return_tensors="pt")["pixel_values"]
    mine = device_pixels(images, processor, "cpu")
    assert mine.shape == ref.shape == (len(SIZES), 3, 224, 224) and mine.dtype == torch.float32
    diff = levels(mine, ref, processor)
    assert float(diff.max()) <= 1.01  # rounding of the resize: one level at most
    assert float(diff.mean()) <= 0.25


def test_pixel_noise_stays_within_a_few_levels(processor):
    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (500, 700, 3), dtype=np.uint8))
    diff = levels(device_pixels([noise], processor, "cpu"), processor(images=[noise], return_tensors="pt")[
        "pixel_values"], processor)  # fmt: skip
    assert float(diff.max()) <= 8 and float(diff.mean()) <= 0.25


def test_the_embedding_barely_moves(processor, tmp_path):
    from transformers import CLIPVisionModelWithProjection

    from pipeline.annotate.vision import build_default_embedder
    from pipeline.embed.processors import load_image_processor

    build_default_embedder(tmp_path / "clip", image=64)
    model = CLIPVisionModelWithProjection.from_pretrained(tmp_path / "clip").eval()
    tiny = load_image_processor(str(tmp_path / "clip"))
    images = [smooth(w, h, np.random.default_rng(2)) for w, h in SIZES]
    with torch.inference_mode():
        a, b = (torch.nn.functional.normalize(model(pixel_values=p).image_embeds, dim=-1)
                for p in (tiny(images=images, return_tensors="pt")["pixel_values"], device_pixels(images, tiny, "cpu")))
    assert float((a * b).sum(-1).min()) >= 0.999  # cosine of each image's two embeddings


def test_a_processor_of_another_kind_is_left_to_itself(processor):
    other = type(processor)(do_center_crop=False)
    assert device_pixels([smooth(300, 200, np.random.default_rng(3))], other, "cpu") is None
    padded = device_pixels([smooth(100, 80, np.random.default_rng(3))], type(processor)(size={"shortest_edge": 64}),
                           "cpu")  # fmt: skip
    assert padded is None  # smaller than its 224 crop: the processor pads, so it runs itself
