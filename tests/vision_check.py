"""What the pipelines whose processors need torchvision compute, beside bucketeer's code: run in ``.venv-vision``.

``python -m tests.vision_check OUT.json`` (from the repository root, with a python that has torchvision: the
Makefile's ``.venv-vision``) writes one JSON object of findings, which ``tests/test_qwen2vl_vision.py`` asserts on:

- ``qwen2vl_processor``: per image size, whether ``Qwen2VLProcessor`` as Qwen-Image-Edit's real ``processor/`` folder
  loads it (torchvision backend) and bucketeer's torch-only twin give equal ``input_ids``, ``pixel_values`` and
  ``image_grid_thw``, bit for bit; and how far the PIL twin (what bucketeer used before) is from it.
- ``qwen_edit``: per (instruction, image), whether the text ``QwenImageEditPipeline.__call__`` computes (the real
  processor, the tiny model resized to the real vocabulary) equals bucketeer's ``encode`` with the torch twin.
- ``flux2``: whether FLUX.2-dev's ``tokenizer/`` folder loaded as the pipeline loads it (``PixtralProcessor``) and as
  bucketeer loads it (``AutoTokenizer``) render one chat template, feed the Mistral model the same ids on
  :data:`tests.checkpoint_text.HARD_CAPTIONS`, and give the same cached text, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests import checkpoints
from tests.checkpoint_text import HARD_CAPTIONS, pipeline_text, recorded_inputs, sequences

SIZES = [(1024, 1024), (896, 1152), (512, 768), (333, 1777), (40, 40), (1500, 1000)]
EDITS = [("make it red", (1024, 1024)), ("", (600, 800)),
         ("  Turn the CAT into a naïve café 漢字 🙂 sketch  ", (300, 700))]


def _image(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth random image (a real photo's spectrum more than noise's) ``(h, w, 3)`` uint8."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8))
    noise = rng.integers(-8, 9, (h, w, 3))
    return np.clip(np.asarray(small.resize((w, h), Image.Resampling.BICUBIC), np.int64) + noise, 0, 255).astype(
        np.uint8)


def qwen2vl_processor(folder: Path) -> list[dict]:
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

    from pipeline.embed.families.qwen_image_edit import TEMPLATE
    from pipeline.embed.processors import processor_identity, torch_qwen2vl_processor

    real = Qwen2VLProcessor.from_pretrained(folder, subfolder="processor")
    ours = torch_qwen2vl_processor(str(folder), "processor")
    pil = Qwen2VLImageProcessorPil.from_pretrained(folder, subfolder="processor")
    out = []
    for k, (h, w) in enumerate(SIZES):
        image = Image.fromarray(_image(h, w, k))
        text = [TEMPLATE.format("a caption")]
        a = real(text=text, images=image, padding=True, return_tensors="pt")
        b = ours(text=text, images=image, padding=True, return_tensors="pt")
        c = pil(images=image, return_tensors="pt")["pixel_values"]
        same = all(torch.equal(a[key], b[key]) for key in ("input_ids", "attention_mask", "pixel_values",
                                                            "image_grid_thw"))  # fmt: skip
        pil_diff = (a["pixel_values"] - c).abs() if c.shape == a["pixel_values"].shape else None
        out.append({"size": [h, w], "grid": a["image_grid_thw"][0].tolist(), "equal": same,
                    "real": processor_identity(real), "ours": processor_identity(ours),
                    "pil_max_diff": None if pil_diff is None else float(pil_diff.max()),
                    "pil_fraction_differing": None if pil_diff is None else float((pil_diff > 0).float().mean())})
    return out


def _recorded_call(pipe, image: np.ndarray, instruction: str) -> torch.Tensor:
    """The text ``pipe(image=..., prompt=instruction)``'s ``encode_prompt`` returned (one step, no CFG)."""
    seen = {}
    encode_prompt = pipe.encode_prompt

    def prompt(*args, **kwargs):
        seen["text"], seen["mask"] = encode_prompt(*args, **kwargs)
        return seen["text"], seen["mask"]

    pipe.encode_prompt = prompt
    try:
        pipe(image=Image.fromarray(image), prompt=instruction, num_inference_steps=1, true_cfg_scale=1.0, height=64,
             width=64, output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        pipe.encode_prompt = encode_prompt
    return seen["text"][0]


def qwen_edit(folder: Path) -> list[dict]:
    from diffusers import QwenImageEditPipeline

    from pipeline.embed.encoders import encoder_specs
    from pipeline.embed.families import qwen_image_edit as edit
    from pipeline.embed.processors import torch_qwen2vl_processor

    pipe = QwenImageEditPipeline.from_pretrained(folder)  # its processor: Qwen2VLProcessor, the torchvision backend
    _, spec = encoder_specs(family="qwen-image-edit", model=str(folder), vae=None, vae_subfolder=None,
                            text_encoders=None, text_subfolders=None)  # fmt: skip
    encoders = spec.load(dtype="F32")
    m = encoders.models[0]
    twin = dataclasses.replace(m, processor=torch_qwen2vl_processor(str(folder), "processor"))
    out = []
    for k, (instruction, (h, w)) in enumerate(EDITS):
        image = _image(h, w, 100 + k)
        want = _recorded_call(pipe, image, instruction)
        reference = edit.reference_pixels(image)  # the pipeline's resize of the image it is handed
        with torch.inference_mode():
            (got,) = edit.encode([twin], [instruction], encoders.options, images=[reference]).parts
        got = got[0, : want.shape[0]]
        out.append({"instruction": instruction, "size": [h, w], "rows": int(want.shape[0]),
                    "equal": bool(got.shape == want.shape and torch.equal(got, want))})
    return out


def flux2(folder: Path) -> dict:
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    from pipeline.embed.encoders import encoder_specs

    pipe = Flux2Pipeline.from_pretrained(folder)
    _, spec = encoder_specs(family="flux2", model=str(folder), vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    encoders = spec.load(dtype="F32")
    tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
    with recorded_inputs([encoders.models[0].model]) as ours:
        encoded = encoders.encode(HARD_CAPTIONS)
    with recorded_inputs([pipe.text_encoder]) as theirs:
        want = pipeline_text("flux2", pipe, HARD_CAPTIONS, tuple(encoders.layout.widths))
    texts = [bool(torch.equal(t[0], p[0])) for (t, _), (p, _) in zip(encoded, want)]
    return {"processor": type(pipe.tokenizer).__name__,
            "same_template": tokenizer.chat_template == pipe.tokenizer.chat_template,
            "same_ids": sequences(ours[0]) == sequences(theirs[0]), "same_text": texts}


def main(out: str) -> None:
    from pipeline.embed.loading import quiet_loading

    quiet_loading()
    findings: dict = {"torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for name, family, check in (("qwen2vl_processor", "qwen-image-edit", qwen2vl_processor),
                                    ("qwen_edit", "qwen-image-edit", qwen_edit), ("flux2", "flux2", flux2)):
            try:
                folder = Path(tmp, family)
                if not folder.exists():
                    checkpoints.real_files_pipeline(family, folder)
                findings[name] = check(folder)
            except Exception:  # one check's failure is a finding, the others still run
                findings[name] = {"error": traceback.format_exc(limit=8)}
    Path(out).write_text(json.dumps(findings, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
