"""The captioning engines: what turns decoded images and a prompt into captions.

- ``transformers`` (CPU, and any GPU where vLLM is not installed): ``AutoModelForImageTextToText`` +
  ``AutoProcessor``, the processor's chat template around ``[image, prompt]``, batched greedy
  ``generate`` with left padding; one :class:`TransformersCaptioner` per Ray Data actor.
- ``vllm`` (GPUs with ``pip install 'bucketeer[vllm]'``): Ray Data's batch LLM inference, see
  :mod:`pipeline.annotate.vllm_engine`.

Both give, per image, the caption (special tokens dropped, whitespace collapsed) and the number of
tokens generated (up to and including the end-of-sequence token; padding after it is not counted).
A :class:`CaptionSpec` says which model and how; it travels to the workers (plain data, picklable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from manifests.errors import UsageError

__all__ = ["ENGINES", "QWEN_VL_TYPES", "CaptionSpec", "TransformersCaptioner", "describe_model", "eos_ids",
           "generate_captions", "load_captioner", "load_processor", "vllm_available"]

ENGINES = ("auto", "transformers", "vllm")
DEFAULT_PROMPT = "Describe this image in one detailed sentence: the subject, the setting, the style."
DEFAULT_VIDEO_PROMPT = ("Describe this video clip in one detailed sentence: the subject, what happens, the setting, "
                        "the camera.")  # a video run's --prompt when none is given


@dataclass(frozen=True)
class CaptionSpec:
    """Which captioner and how: ``model`` as the user gave it (hub id, folder, ``default``), the prompt, greedy
    decoding of at most ``max_new_tokens``, images downscaled to at most ``image_size`` pixels on their long side.
    ``home``: the driver's ``$BUCKETEER_HOME``, where each node builds the default model (the same seeded
    weights everywhere) the first time it needs it."""

    model: str
    home: str | None = None
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 64
    image_size: int = 768
    shot_frames: int = 0  # a video run's frames per shot, given as video input (0: an image run)

    @property
    def is_default(self) -> bool:
        return self.model == "default"

    @property
    def video(self) -> bool:
        """Whether this captions shots (frames as video input) rather than images."""
        return self.shot_frames > 0

    def path(self) -> str:
        """What ``from_pretrained`` loads: the model, or the default model's folder (built here once): the tiny
        Llava for images, the tiny Qwen2.5-VL for shots."""
        if self.is_default:
            from pipeline.annotate.default_model import ensure_default_model, ensure_default_video_model

            return str((ensure_default_video_model if self.video else ensure_default_model)(self.home))
        return self.model

    def generation(self) -> dict[str, Any]:
        """The generation settings recorded in ``_annotations.json`` (greedy: the same model, the same captions)."""
        return {"do_sample": False, "image_size": self.image_size}


def vllm_available() -> bool:
    """Whether vLLM and Ray's LLM batch API can be imported here."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("ray.data.llm") is not None


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the models whose video input is built here without torchvision


def load_processor(path: str):
    """``AutoProcessor.from_pretrained(path)``; for a Qwen2-VL or Qwen2.5-VL folder where that needs torchvision
    (its video processor) and it is absent, the same processor without a video processor
    (:func:`pipeline.embed.processors.load_qwen2vl_processor`). Raises what ``from_pretrained`` raises."""
    from transformers import AutoConfig, AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except (ImportError, TypeError):  # transformers 5.0 (the floor) fails on the video processor with a TypeError
        if AutoConfig.from_pretrained(path).model_type not in QWEN_VL_TYPES:
            raise
        from pipeline.embed.processors import load_qwen2vl_processor

        return load_qwen2vl_processor(path, subfolder="")


def load_captioner(spec: CaptionSpec, device: str):
    """``(processor, model)`` of ``spec`` on ``device``; UsageError in one line when it cannot load."""
    import torch
    from transformers import AutoModelForImageTextToText

    _quiet()
    try:
        path = spec.path()
        processor = load_processor(path)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise _unloadable(spec, e) from None
    return processor, model


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def _unloadable(spec: CaptionSpec, e: BaseException) -> UsageError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UsageError(f"--model {spec.model}: cannot load it as an image-text-to-text model "
                      f"(AutoModelForImageTextToText + AutoProcessor): {first}")  # fmt: skip


def weight_files_sha256(path: str) -> str:
    """sha256 over the sorted ``(name, sha256 of the file)`` of a model's weight files: of a local folder by
    reading them, of a hub id from the hub's own per-file sha256 (no download); the same files give the
    same hash either way. Raises OSError when neither can be had (no such folder, no hub access)."""
    import hashlib

    digests: list[tuple[str, str]] = []
    if os.path.isdir(path):
        for root, _, names in os.walk(path):
            for name in names:
                if name.endswith(_WEIGHT_FILES):
                    h = hashlib.sha256()
                    with open(os.path.join(root, name), "rb") as f:
                        for block in iter(lambda: f.read(1 << 24), b""):
                            h.update(block)
                    digests.append((os.path.relpath(os.path.join(root, name), path), h.hexdigest()))
    else:
        from huggingface_hub import HfApi

        try:
            info = HfApi().model_info(path, files_metadata=True)
        except Exception as e:  # offline, unknown id, gated: the hub's own error types, all "cannot describe"
            raise OSError(f"cannot read the weights' sha256 of {path!r} from the hub: {e}") from None
        digests = [(f.rfilename, f.lfs.sha256 if f.lfs else (f.blob_id or "")) for f in info.siblings or []
                   if f.rfilename.endswith(_WEIGHT_FILES)]  # fmt: skip
    if not digests:
        raise OSError(f"no weight files ({', '.join(_WEIGHT_FILES)}) in {path!r}")
    return hashlib.sha256("\n".join(f"{n} {d}" for n, d in sorted(digests)).encode()).hexdigest()


def describe_model(spec: CaptionSpec) -> dict[str, Any]:
    """Check ``spec``'s model without loading its weights (a bad id or folder fails here, before any work):
    its config is an image-text-to-text architecture and its processor loads; its class and the sha256 of
    its weight files (:func:`weight_files_sha256`). A video run's model must take video input: a Qwen2-VL or
    Qwen2.5-VL, or any whose processor has a video processor (UsageError naming ``--model`` otherwise)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    _quiet()
    try:
        path = spec.path()
        config = AutoConfig.from_pretrained(path)
        processor = load_processor(path)
        digest = weight_files_sha256(path)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise _unloadable(spec, e) from None
    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise UsageError(f"--model {spec.model}: a {config.model_type!r} model is not an image-text-to-text model "
                         "(AutoModelForImageTextToText has no class for it); pick a vision-language model")
    if spec.video and config.model_type not in QWEN_VL_TYPES and getattr(processor, "video_processor", None) is None:
        raise UsageError(f"--model {spec.model}: a {config.model_type!r} model takes images only (its processor has no "
                         "video processor); shots are captioned from their frames as video input: give a video model "
                         "such as Qwen2.5-VL (docs/video-clips.md)")  # fmt: skip
    return {"class": name, "weight_sha256": digest}


def eos_ids(model: Any) -> set[int]:
    """The token ids that end a generation of ``model`` (its generation config's ``eos_token_id``, one or many)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])


def generate_captions(model: Any, processor: Any, inputs: Any, max_new_tokens: int,
                      eos: set[int]) -> list[tuple[str, int]]:  # fmt: skip
    """One batched greedy ``generate`` on ``inputs`` (left padded, on the model's device): ``(caption, generated
    tokens)`` per row, the caption's special tokens dropped and whitespace collapsed, the tokens counted up to and
    including the first of ``eos``."""
    import torch

    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1]:].cpu().tolist()  # (B, new tokens)
    counts = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in new]
    texts = processor.batch_decode([row[:n] for row, n in zip(new, counts)], skip_special_tokens=True)
    return [(" ".join(t.split()), n) for t, n in zip(texts, counts)]


class TransformersCaptioner:
    """Captions batches of PIL images with ``spec``'s model on ``device`` (``cuda`` or ``cpu``)."""

    def __init__(self, spec: CaptionSpec, device: str = "cpu", threads: int | None = None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        self.spec = spec
        self.processor, self.model = load_captioner(spec, self.device)
        self.processor.tokenizer.padding_side = "left"  # generation continues every row from its end
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": spec.prompt}]}]
        # a Qwen-VL processor built without torchvision (load_processor) has no template: its tokenizer's
        template = self.processor if self.processor.chat_template else self.processor.tokenizer
        self.text = template.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        self.eos = eos_ids(self.model)

    def caption(self, images: list) -> list[tuple[str, int]]:
        """``(caption, generated tokens)`` per image (PIL, RGB), in order; one batched ``generate``."""
        inputs = self.processor(images=images, text=[self.text] * len(images), return_tensors="pt", padding=True)
        return generate_captions(self.model, self.processor, inputs.to(self.device), self.spec.max_new_tokens, self.eos)
