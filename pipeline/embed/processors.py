"""Processors as transformers loads them, also where torchvision is missing.

transformers 5.0 to 5.2x refuse an ``AutoImageProcessor`` that needs torchvision when it is absent, while the
class the folder's ``preprocessor_config.json`` names falls back to its PIL twin (:func:`load_image_processor`);
and no 5.x builds a ``Qwen2VLProcessor`` without torchvision, since its video processor needs it
(:func:`load_qwen2vl_processor` builds the same processor without one). With torchvision installed both are
``from_pretrained``, as the pipelines load them.

The PIL twin of Qwen2-VL's image processor is **not** what inference runs: ``QwenImageEditPipeline`` can only load
``Qwen2VLProcessor`` with torchvision installed, whose image processor resizes with torch's antialiased bicubic
interpolation of the uint8 image (PIL's bicubic differs in every pixel it touches) and normalises in float32 with
the rescale folded into the mean and std. Without torchvision the processor gets :func:`torch_qwen2vl_image_processor`,
which computes exactly that with torch alone (``tests/test_qwen2vl_vision.py`` compares it, bit for bit, with the
torchvision backend in a venv that has torchvision). :func:`processor_identity` names the class and backend, which
the encoder fingerprint records.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["load_image_processor", "load_qwen2vl_processor", "processor_identity", "torch_qwen2vl_image_processor",
           "torch_qwen2vl_processor"]


def load_image_processor(path: str, subfolder: str = ""):
    """``AutoImageProcessor.from_pretrained(path, subfolder=subfolder)``; where that needs torchvision and it is
    absent (transformers 5.0 to 5.2x refuse the Auto class without torchvision while the class named in the
    folder's ``preprocessor_config.json`` falls back to its PIL twin), that class. Raises what ``from_pretrained``
    raises."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, subfolder=subfolder)
    except ImportError:
        import transformers
        from transformers.image_processing_utils import ImageProcessingMixin

        config, _ = ImageProcessingMixin.get_image_processor_dict(path, subfolder=subfolder)
        name = str(config.get("image_processor_type") or "")
        cls = getattr(transformers, name.removesuffix("Fast"), None) if name else None
        if cls is None:
            raise
        return cls.from_pretrained(path, subfolder=subfolder)


def qwen2vl_image_processor_class() -> type:
    """Qwen2-VL's image processor on PIL: ``Qwen2VLImageProcessorPil`` where transformers has it (the
    ``Qwen2VLImageProcessor`` of those releases needs torchvision), else ``Qwen2VLImageProcessor`` (5.0's, on
    PIL and numpy)."""
    import transformers

    return getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor


@functools.cache
def _image_text_processor() -> type:
    """The class ``ImageTextProcessor`` (defined in a function: transformers is imported only when it is needed)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without a video processor (what transformers 5.x without torchvision can build):
        the same ``__call__`` on text and images."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageTextProcessor


TORCH_BACKEND = "torch"  # torch_qwen2vl_image_processor's backend name in the fingerprint


@functools.cache
def _torch_image_processor() -> type:
    """The class behind :func:`torch_qwen2vl_image_processor` (defined when transformers is imported)."""
    import numpy as np
    import torch
    from transformers.image_processing_utils import BatchFeature

    try:  # 5.2x: the torchvision module imports torchvision; the PIL module carries the same smart_resize
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:  # 5.0: one module, on PIL and numpy
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    class TorchQwen2VLImageProcessor(qwen2vl_image_processor_class()):
        """Qwen2-VL's image processor computed as its torchvision backend computes it, with torch alone."""

        def preprocess(self, images: Any, return_tensors: Any = None, **kwargs: Any) -> Any:
            unknown = {k: v for k, v in kwargs.items() if v is not None and k not in _IGNORED_IMAGE_KWARGS}
            if unknown:
                raise ValueError(f"the torch Qwen2-VL image processor takes the folder's settings only, not {unknown}")
            size = self.size if isinstance(self.size, dict) else vars(self.size)
            factor = self.patch_size * self.merge_size
            mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)  # folded as the torchvision backend
            std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
            patches, grids = [], []
            for image in images if isinstance(images, (list, tuple)) else [images]:
                pixels = np.array(image.convert("RGB") if hasattr(image, "convert") else image, np.uint8)  # writable
                x = torch.from_numpy(pixels).permute(2, 0, 1)[None]  # (1, 3, H, W), channels last as torchvision
                height, width = x.shape[-2:]
                h, w = smart_resize(height, width, factor=factor, min_pixels=size["shortest_edge"],
                                    max_pixels=size["longest_edge"])  # fmt: skip
                if (h, w) != (height, width):  # torchvision returns the image itself at its own size
                    x = torch.nn.functional.interpolate(x, size=[h, w], mode="bicubic", align_corners=False,
                                                        antialias=True)  # fmt: skip # uint8 in, uint8 out
                x = (x.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)  # (1, 3, h, w)
                grid_h, grid_w = h // self.patch_size, w // self.patch_size
                m, p, t = self.merge_size, self.patch_size, self.temporal_patch_size
                x = x.reshape(1, 3, grid_h // m, m, p, grid_w // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
                x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
                patches.append(x.reshape(grid_h * grid_w, 3 * t * p * p))  # (patches, C * T * P * P)
                grids.append([1, grid_h, grid_w])
            data = {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}
            return BatchFeature(data=data, tensor_type=return_tensors)

    return TorchQwen2VLImageProcessor


# what Qwen2VLProcessor passes an image processor besides the images: formatting, not settings
_IGNORED_IMAGE_KWARGS = {"data_format", "input_data_format", "device", "do_convert_rgb", "return_tensors"}


def torch_qwen2vl_image_processor(path: str, subfolder: str = "") -> Any:
    """Qwen2-VL's image processor of the folder's ``preprocessor_config.json``, computing what its torchvision
    backend computes (antialiased bicubic resize of the uint8 image to ``smart_resize``'s size, float32
    ``(x - 255 mean) / (255 std)``, the same patches) without torchvision. Raises what ``from_pretrained`` raises."""
    return _torch_image_processor().from_pretrained(path, subfolder=subfolder)


def processor_identity(processor: Any) -> dict[str, str]:
    """``{"class", "image_processor", "backend"}`` of a multimodal processor: what the encoder fingerprint records,
    so that caches whose images went through other resize code never mix."""
    image = getattr(processor, "image_processor", None)
    name = type(image).__name__
    if isinstance(image, _torch_image_processor()):
        backend = TORCH_BACKEND
    else:  # 5.2x image processors say their backend; 5.0's torchvision classes end in Fast
        backend = getattr(image, "backend", None) or ("torchvision" if name.endswith("Fast") else "pil")
    return {"class": type(processor).__name__, "image_processor": name, "backend": str(backend)}


def load_qwen2vl_processor(path: str, subfolder: str = "processor") -> Any:
    """``Qwen2VLProcessor.from_pretrained(path, subfolder=subfolder)`` (how ``QwenImageEditPipeline`` loads its
    ``processor``); where transformers cannot build it for lack of torchvision, the same processor without a video
    processor, from the folder's tokenizer and :func:`torch_qwen2vl_image_processor` (equal to the torchvision
    backend the pipeline's processor has)."""
    from transformers import Qwen2VLProcessor

    try:
        return Qwen2VLProcessor.from_pretrained(path, subfolder=subfolder)
    except (ImportError, TypeError):  # 5.x: Qwen2VLVideoProcessor requires torchvision (5.0: a TypeError)
        return torch_qwen2vl_processor(path, subfolder)


def torch_qwen2vl_processor(path: str, subfolder: str = "processor") -> Any:
    """The folder's ``Qwen2VLProcessor`` without its video processor, its images through
    :func:`torch_qwen2vl_image_processor`: what :func:`load_qwen2vl_processor` gives without torchvision."""
    from transformers import AutoTokenizer

    return _image_text_processor()(image_processor=torch_qwen2vl_image_processor(path, subfolder=subfolder),
                                   tokenizer=AutoTokenizer.from_pretrained(path, subfolder=subfolder))
