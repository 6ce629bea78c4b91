"""Processors as transformers loads them, also where torchvision is missing.

transformers 5.0 to 5.2x refuse an ``AutoImageProcessor`` that needs torchvision when it is absent, while the
class the folder's ``preprocessor_config.json`` names falls back to its PIL twin (:func:`load_image_processor`);
and no 5.x builds a ``Qwen2VLProcessor`` without torchvision, since its video processor needs it
(:func:`load_qwen2vl_processor` builds the same processor without one). With torchvision installed both are
``from_pretrained``, as the pipelines load them.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["load_image_processor", "load_qwen2vl_processor"]


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


def load_qwen2vl_processor(path: str, subfolder: str = "processor") -> Any:
    """``Qwen2VLProcessor.from_pretrained(path, subfolder=subfolder)`` (how ``QwenImageEditPipeline`` loads its
    ``processor``); where transformers cannot build it for lack of torchvision, the same processor without a video
    processor from the folder's image processor and tokenizer."""
    from transformers import AutoTokenizer, Qwen2VLProcessor

    try:
        return Qwen2VLProcessor.from_pretrained(path, subfolder=subfolder)
    except (ImportError, TypeError):  # 5.x: Qwen2VLVideoProcessor requires torchvision (5.0: a TypeError)
        return _image_text_processor()(image_processor=load_image_processor(path, subfolder=subfolder),
                                       tokenizer=AutoTokenizer.from_pretrained(path, subfolder=subfolder))
