"""``--model default``: a tiny random-weight vision-language model of a real architecture, built locally.

A ``LlavaForConditionalGeneration`` (a CLIP vision tower of one layer, a two-layer Qwen2 language
model 32 wide) with its ``LlavaProcessor``: a ``CLIPImageProcessor`` at 28x28 pixels and a byte-level
BPE tokenizer built from scratch with ``tokenizers`` (256 byte symbols plus the chat and image tokens),
a ChatML chat template. It is saved with ``save_pretrained`` and loaded like any hub model
(``AutoModelForImageTextToText`` + ``AutoProcessor``), offline. Llava rather than Qwen2-VL: Qwen2-VL's
processor needs torchvision (its video processor), which the base install does not have.

Its captions are noise (random weights, greedy decoding: a few stray bytes per image); it exists to
run the pipeline, not to describe images. :func:`ensure_default_model` builds it once under
``$BUCKETEER_HOME/default-annotators/``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.embed.families.tiny import build_once

__all__ = ["DEFAULT_VERSION", "DEFAULT_VIDEO_VERSION", "DEFAULT_CAPTION_NOTICE", "DEFAULT_VIDEO_NOTICE", "MAX_HEAD_DIM",
           "attention_heads", "build_default_model", "build_default_video_model", "default_model_dir",
           "ensure_default_model", "ensure_default_video_model"]  # fmt: skip

DEFAULT_VERSION = "llava-tiny-v1"
DEFAULT_VIDEO_VERSION = "qwen2.5-vl-tiny-video-v1"
DEFAULT_CAPTION_NOTICE = (
    "bucketeer annotate: using the embedded DEFAULT captioner (a tiny random-weight Llava): its captions are "
    "NOISE, for trying the pipeline only. Pass --model with a real captioner (docs/annotate.md)."
)
DEFAULT_VIDEO_NOTICE = (
    "bucketeer annotate: captioning shots with the embedded DEFAULT video captioner (a tiny random-weight "
    "Qwen2.5-VL): its captions are NOISE, for trying the pipeline only. Pass --model with a real video captioner "
    "such as Qwen2.5-VL (docs/video-clips.md)."
)
# Qwen2-VL's chat template for one user turn of images, videos and text (the hub models' own renders the same)
_QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the default video captioner's video processor: few pixels a frame (its grids stay small on a CPU)
DEFAULT_VIDEO_PIXELS = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16}
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # every byte a symbol: any text tokenizes
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=4096, extra_special_tokens={"image_token": "<image>"})


# the widest attention head built: vLLM's attention kernels take heads of at most 256 (FlashAttention's limit);
# 128 is the size real models use, and what every kernel is tuned for
MAX_HEAD_DIM = 128


def attention_heads(width: int) -> int:
    """Attention heads of a tower ``width`` wide: the fewest, at least 2, that divide ``width`` into heads of at
    most :data:`MAX_HEAD_DIM`. 2 for the tiny default (32 wide: heads of 16), 8 for the GPU check's 1024.
    Raises ValueError for a width under 2."""
    if width < 2:
        raise ValueError(f"width {width}: a tower needs at least 2 wide (2 heads)")
    return next(h for h in range(max(2, -(-width // MAX_HEAD_DIM)), width + 1) if width % h == 0)


def build_default_model(folder: str | os.PathLike, *, width: int = 32, layers: int = 2, image: int = 28) -> Path:
    """Write the tiny captioner (model, processor, chat template) to ``folder``; seeded, so the same weights.
    ``width``, ``layers``, ``image`` (pixels, a multiple of 14): a larger random one (benchmarks). Both towers
    get :func:`attention_heads` of ``width``."""
    import torch
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "requires torchvision, falling back to the PIL backend": expected here
    tokenizer = _tokenizer()
    images = CLIPImageProcessor(size={"shortest_edge": image}, crop_size={"height": image, "width": image})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=_CHAT_TEMPLATE,
                               patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in _SPECIALS}
    heads = attention_heads(width)
    config = LlavaConfig(
        text_config={"model_type": "qwen2", "vocab_size": len(tokenizer), "hidden_size": width,
                     "intermediate_size": 2 * width, "num_hidden_layers": layers, "num_attention_heads": heads,
                     "num_key_value_heads": 1, "max_position_embeddings": 4096, "bos_token_id": ids["<|endoftext|>"],
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        vision_config={"model_type": "clip_vision_model", "hidden_size": width, "intermediate_size": 2 * width,
                       "num_hidden_layers": max(1, layers // 2), "num_attention_heads": heads, "image_size": image,
                       "patch_size": 14, "projection_dim": width},
        image_token_index=ids["<image>"], vision_feature_select_strategy="default", vision_feature_layer=-1,
    )  # fmt: skip
    torch.manual_seed(25)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    target = Path(folder)
    model.save_pretrained(target)
    processor.save_pretrained(target)
    (target / "README.txt").write_text(DEFAULT_CAPTION_NOTICE + "\n")
    return target


def build_default_video_model(folder: str | os.PathLike) -> Path:
    """Write the tiny video captioner to ``folder``: the tiny Qwen2.5-VL of
    :func:`pipeline.embed.families.tiny_qwen.qwen_vl` (seeded), its tokenizer with Qwen2-VL's chat template, and
    Qwen2.5-VL's image and video processor configs (patch 14, merge 2, temporal patch 2) at
    :data:`DEFAULT_VIDEO_PIXELS`. The video processor's config is written as JSON: building its class needs
    torchvision, loading the folder does not (:func:`pipeline.annotate.engines.load_processor`)."""
    import json

    import torch
    from transformers.utils import logging as hf_logging

    from pipeline.embed.families.tiny_qwen import qwen_tokenizer, qwen_vl
    from pipeline.embed.processors import qwen2vl_image_processor_class

    hf_logging.set_verbosity_error()
    tokenizer = qwen_tokenizer(_QWEN_VL_TEMPLATE)
    torch.manual_seed(39)
    model = qwen_vl(tokenizer)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in ("<|im_end|>", "<|endoftext|>")}
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    target = Path(folder)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    shape = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    qwen2vl_image_processor_class()(size=dict(DEFAULT_VIDEO_PIXELS), **shape).save_pretrained(target)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "size": dict(DEFAULT_VIDEO_PIXELS), **shape,
             "do_sample_frames": False, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "processor_class": "Qwen2_5_VLProcessor"}
    (target / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (target / "chat_template.jinja").write_text(_QWEN_VL_TEMPLATE)
    (target / "README.txt").write_text(DEFAULT_VIDEO_NOTICE + "\n")
    return target


def default_model_dir(home: str | None = None, version: str = DEFAULT_VERSION) -> Path:
    """``<home>/default-annotators/<version>``; home defaults to ``$BUCKETEER_HOME`` or ``~/.cache/bucketeer``."""
    home = home or os.environ.get("BUCKETEER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "bucketeer")
    return Path(home) / "default-annotators" / version


def ensure_default_model(home: str | None = None) -> Path:
    """Build the default captioner once (aside, then renamed into place); its folder."""
    return build_once(default_model_dir(home), build_default_model)


def ensure_default_video_model(home: str | None = None) -> Path:
    """Build the default video captioner once (:func:`build_default_video_model`); its folder."""
    return build_once(default_model_dir(home, DEFAULT_VIDEO_VERSION), build_default_video_model)
