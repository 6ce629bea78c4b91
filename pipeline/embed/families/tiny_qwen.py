"""Tiny random-weight Qwen-Image and Z-Image pipelines (the real classes, a few dozen channels wide).

- ``qwen-image``: ``QwenImagePipeline``: a ``Qwen2_5_VLForConditionalGeneration`` (text 40 wide, 2 layers, a
  2-block vision tower), a ``Qwen2Tokenizer``, a ``QwenImageTransformer2DModel`` (2 blocks), an
  ``AutoencoderKLQwenImage`` (Wan-style causal 3D VAE, base width 8, Qwen-Image's per-channel
  ``latents_mean``/``latents_std``) and Qwen-Image's ``FlowMatchEulerDiscreteScheduler`` config (dynamic shift,
  base 0.5 at 256 tokens, max 0.9 at 8192, ``shift_terminal`` 0.02).
- ``qwen-image-edit``: ``QwenImageEditPipeline``: the same models (seeded apart) and a ``processor/`` as the
  pipeline's hub folder has it: the tokenizer and Qwen2.5-VL's image processor config (patch 14, merge 2,
  ``min_pixels`` 3136, ``max_pixels`` 12845056), named ``Qwen2VLProcessor`` in ``model_index.json``.
- ``z-image``: ``ZImagePipeline``: a ``Qwen3Model`` (48 wide, 3 layers) with a Qwen3-style chat template
  (``enable_thinking``), a ``ZImageTransformer2DModel`` (2 layers, 1 refiner layer each), Flux's 16-channel
  VAE scaling and shift, and Z-Image-Turbo's scheduler (fixed ``shift`` 3.0).

The tokenizer is a byte-level BPE trained here on the pipelines' own prompt templates with Qwen2's
pre-tokenizer, so that the templates' system prefixes are one token per word, as in the real vocabulary:
Qwen-Image's prefix is 34 tokens, the pipeline's ``prompt_template_encode_start_idx`` (and Qwen-Image-Edit's
64), so the tokens ``encode_prompt`` drops are exactly the prefix. Any other text falls back to bytes.
"""

from __future__ import annotations

__all__ = ["QWEN_WIDTH", "QWEN3_WIDTH", "qwen_tokenizer", "qwen_vl", "qwen_image", "save_qwen_image_edit", "z_image"]

QWEN_WIDTH = 40  # Qwen2.5-VL's hidden size (3584 in the 7B)
QWEN3_WIDTH = 48  # Qwen3's hidden size (2560 in the 4B)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>", "<think>", "</think>")  # fmt: skip
T2I_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                "<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>"
                 "<|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
WORDS = "a photo of the cat, a red dog and a blue picture: thing 0 1 2 3 shape broken circle background"
# Qwen3's template for one user message and the generation prompt (no tools, no system message)
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                 "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                 "{%- endif %}{%- endif %}")  # fmt: skip


def qwen_tokenizer(chat_template: str | None = None):
    """A ``Qwen2Tokenizer`` (byte-level BPE, Qwen2's pre-tokenizer) with a vocabulary of about 500 tokens."""
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator([T2I_TEMPLATE.format(""), EDIT_TEMPLATE.format(""), WORDS], trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL[1:])})
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def qwen_vl(tokenizer):
    """A 2-layer ``Qwen2_5_VLForConditionalGeneration`` (M-RoPE sections 1/2/2, a 2-block vision tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIAL}
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": QWEN_WIDTH, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 4096, "rope_theta": 1000000.0,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 2, 2]}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                       "out_hidden_size": QWEN_WIDTH, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen_image(cls: str = "QwenImagePipeline", **extra):
    """The tiny ``QwenImagePipeline`` (see the module docstring); ``cls``: another pipeline class of the same models
    (``QwenImageEditPipeline``), ``extra``: its other components."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    tokenizer = qwen_tokenizer()
    # Qwen-Image's layout (3 spatial downsamples, the last two also temporal) at base width 8 instead of 96
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])  # fmt: skip
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=QWEN_WIDTH, axes_dims_rope=(4, 6, 6))  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192,
                                                max_shift=0.9, shift=1.0, shift_terminal=0.02,
                                                time_shift_type="exponential", use_dynamic_shifting=True)  # fmt: skip
    return getattr(diffusers, cls)(scheduler=scheduler, vae=vae, text_encoder=qwen_vl(tokenizer), tokenizer=tokenizer,
                                   transformer=transformer, **extra)  # fmt: skip


def save_qwen_image_edit(folder, pipe) -> None:
    """Write ``pipe`` (a ``QwenImageEditPipeline`` whose processor is None, as :func:`qwen_image` makes it) to
    ``folder``, its ``processor/`` as the hub folder has it (saved from its parts: transformers 5.x cannot build a
    ``Qwen2VLProcessor`` without torchvision). :func:`pipeline.embed.families.tiny.save_pipeline` calls it."""
    import json
    from pathlib import Path

    from pipeline.embed.processors import qwen2vl_image_processor_class

    pipe.save_pretrained(folder)
    processor = Path(folder) / "processor"
    pipe.tokenizer.save_pretrained(processor)
    # Qwen2.5-VL's preprocessor_config.json (saved as image_processor_type Qwen2VLImageProcessor)
    qwen2vl_image_processor_class()(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384},
                             patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(processor)
    index = Path(folder) / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "processor": ["transformers", "Qwen2VLProcessor"]},
                                indent=2, sort_keys=True) + "\n")  # fmt: skip


def z_image():
    """The tiny ``ZImagePipeline`` (see the module docstring)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = qwen_tokenizer(CHAT_TEMPLATE)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=QWEN3_WIDTH, intermediate_size=64,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=12, max_position_embeddings=1024, tie_word_embeddings=True))
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                           cap_feat_dim=QWEN3_WIDTH, axes_dims=[8, 12, 12],
                                           axes_lens=[1024, 128, 128])  # fmt: skip
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=8,
        sample_size=64, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)  # fmt: skip
