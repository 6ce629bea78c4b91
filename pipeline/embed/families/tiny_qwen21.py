"""Tiny random-weight Qwen-Image 2.1 pipeline (the real classes, a few dozen channels wide).

``QwenImage21Pipeline``: a ``Qwen3VLForConditionalGeneration`` (text 56 wide, 2 layers, interleaved M-RoPE
sections 2/3/3; a 2-block vision tower, patch 16, one deepstack layer), a ``Qwen3VLProcessor`` (the
:mod:`.tiny_qwen` byte-level tokenizer, Qwen2-VL's image processor at patch 16 as Qwen3-VL's is, and a
Qwen3-VL-style chat template), a ``QwenImage21Transformer2DModel`` (2 blocks, unpatched 64-channel latents,
``causal_condition``), an ``AutoencoderKLQwenImage21`` (RGBA in and out, base width 8, 16x spatial over 4
downsamples, 64 channels with the class's default per-channel ``latents_mean``/``latents_std``) and a
``FlowMatchEulerDiscreteScheduler`` with dynamic shifting (base 0.5 at 256 tokens, max 1.15 at 4096, what
``QwenImage21Pipeline.__call__`` falls back to).

The chat template is **not** Qwen3-VL-8B's file (no copy of it, nor of any Qwen-Image 2.1 ``processor/``, was
reachable): it renders text and image messages as Qwen3-VL's does (``<|im_start|>role\\n`` + the text parts +
``<|im_end|>\\n``), which is all the pipeline reads of it (the system message's token count, ``_drop_idx``).
transformers 5.x builds no ``Qwen3VLProcessor`` without torchvision (its video processor needs it):
:func:`qwen3vl_processor` builds the same processor without a video processor, saved under the real class's name,
and the ``processor/`` holds what ``save_pretrained`` writes of it (tokenizer, image processor config, chat
template; no video processor config).
"""

from __future__ import annotations

__all__ = ["QWEN3VL_WIDTH", "CHAT_TEMPLATE", "qwen3vl_processor", "qwen_image21"]

QWEN3VL_WIDTH = 56  # Qwen3-VL-8B's hidden size is 4096
# Qwen3-VL's rendering of text and image messages (its template's tool and thinking branches left out)
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
                 "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
                 "{%- for content in message['content'] %}{%- if content['type'] == 'image' or 'image' in content %}"
                 "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif 'text' in content %}"
                 "{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")  # fmt: skip


def qwen3vl_processor(tokenizer, image_processor, chat_template: str | None = None):
    """A ``Qwen3VLProcessor`` of ``tokenizer`` and ``image_processor`` without a video processor (what transformers
    5.x builds without torchvision): the same ``__call__`` and ``apply_chat_template`` on text and images."""
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class TextImageProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    # saved (model_index.json, processor_config.json) as the class it stands in for, which loads it with torchvision
    TextImageProcessor.__name__ = TextImageProcessor.__qualname__ = "Qwen3VLProcessor"
    TextImageProcessor.__module__ = Qwen3VLProcessor.__module__
    return TextImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def _image_processor():
    from pipeline.embed.processors import qwen2vl_image_processor_class

    # Qwen3-VL's image processor is Qwen2-VL's at patch 16 (merge 2: 32 px per vision token)
    return qwen2vl_image_processor_class()(size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 1024},
                                           patch_size=16, merge_size=2, temporal_patch_size=2,
                                           image_mean=[0.5] * 3, image_std=[0.5] * 3)  # fmt: skip


def _qwen3vl(tokenizer):
    """A 2-layer ``Qwen3VLForConditionalGeneration`` (interleaved M-RoPE, a 2-block vision tower)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                           "<|vision_end|>")}  # fmt: skip
    config = Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": QWEN3VL_WIDTH, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                       "out_hidden_size": QWEN3VL_WIDTH, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [1]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    return Qwen3VLForConditionalGeneration(config)


def qwen_image21():
    """The tiny ``QwenImage21Pipeline`` (see the module docstring)."""
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                           QwenImage21Transformer2DModel)  # fmt: skip

    from pipeline.embed.families.tiny_qwen import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    processor = qwen3vl_processor(tokenizer, _image_processor(), CHAT_TEMPLATE)
    # Qwen-Image 2.1's layout (4 spatial downsamples, the last three also temporal) at base width 8 instead of 96
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 2, 2, 2, 2],
                                   num_res_blocks=1, temperal_downsample=[False, True, True, True])  # fmt: skip
    transformer = QwenImage21Transformer2DModel(patch_size=1, in_channels=64, out_channels=64, num_layers=2,
                                                attention_head_dim=16, num_attention_heads=2,
                                                context_in_dim=QWEN3VL_WIDTH, axes_dims_rope=(4, 6, 6))  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=1.0, use_dynamic_shifting=True)  # fmt: skip
    return QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=_qwen3vl(tokenizer), processor=processor,
                               transformer=transformer)  # fmt: skip

