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

__all__ = ["DEFAULT_VERSION", "DEFAULT_CAPTION_NOTICE", "MAX_HEAD_DIM", "attention_heads", "build_default_model",
           "default_model_dir", "ensure_default_model"]  # fmt: skip

DEFAULT_VERSION = "llava-tiny-v1"
DEFAULT_CAPTION_NOTICE = (
    "bucketeer annotate: using the embedded DEFAULT captioner (a tiny random-weight Llava): its captions are "
    "NOISE, for trying the pipeline only. Pass --model with a real captioner (docs/annotate.md)."
)
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


def default_model_dir(home: str | None = None) -> Path:
    """``<home>/default-annotators/<version>``; home defaults to ``$BUCKETEER_HOME`` or ``~/.cache/bucketeer``."""
    home = home or os.environ.get("BUCKETEER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "bucketeer")
    return Path(home) / "default-annotators" / DEFAULT_VERSION


def ensure_default_model(home: str | None = None) -> Path:
    """Build the default captioner once (aside, then renamed into place); its folder."""
    return build_once(default_model_dir(home), build_default_model)
