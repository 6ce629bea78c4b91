"""The tiny random-weight Krea 2 pipeline (the real classes, a few dozen channels wide).

``Krea2Pipeline``: a ``Qwen3VLModel`` whose text model is 32 wide but keeps Qwen3-VL-4B's **36 layers** (the
pipeline reads hidden states 2, 5, ..., 35 of it; its default ``text_encoder_select_layers``), with interleaved
M-RoPE sections 2/1/1 and a 2-block vision tower; the byte-level BPE tokenizer of
:func:`pipeline.embed.families.tiny_qwen.qwen_tokenizer` (Qwen-Image's system prefix is 34 tokens there, as in the
real vocabulary, and the suffix ``<|im_end|>\\n<|im_start|>assistant\\n`` 5); a ``Krea2Transformer2DModel`` (2
blocks, 12 text layers of width 32 fused by 2 layer-wise and 2 refiner blocks, as the real one); the
``AutoencoderKLQwenImage`` of :func:`pipeline.embed.families.tiny_qwen.qwen_image` (Qwen-Image's layout at base width
8); the scheduler the pipeline's docstring asks for (dynamic exponential shift, base 0.5 at 256 tokens, max 1.15 at
6400); ``is_distilled`` False, ``patch_size`` 2.
"""

from __future__ import annotations

__all__ = ["KREA2_TEXT_WIDTH", "krea2"]

KREA2_TEXT_WIDTH = 32  # Qwen3-VL-4B's text hidden size is 2560


def qwen3_vl(tokenizer):
    """A ``Qwen3VLModel``: text 32 wide with 36 layers (head 8, M-RoPE 2/1/1 interleaved), a 2-block vision tower."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from pipeline.embed.families.tiny_qwen import SPECIAL

    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIAL}
    config = Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": KREA2_TEXT_WIDTH, "intermediate_size": 48,
                     "num_hidden_layers": 36, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                     "max_position_embeddings": 4096, "tie_word_embeddings": True,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": KREA2_TEXT_WIDTH, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [1]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3VLModel(config)


def krea2():
    """The tiny ``Krea2Pipeline`` (see the module docstring)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from diffusers import Krea2Transformer2DModel

    from pipeline.embed.families.tiny_qwen import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    # as tiny_qwen.qwen_image builds it: Qwen-Image's layout at base width 8 instead of 96
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])  # fmt: skip
    transformer = Krea2Transformer2DModel(
        in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, timestep_embed_dim=32, text_hidden_dim=KREA2_TEXT_WIDTH, num_text_layers=12,
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=48,
        num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=6400,
                                                max_shift=1.15, shift=1.0, time_shift_type="exponential",
                                                use_dynamic_shifting=True)  # fmt: skip
    return Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=qwen3_vl(tokenizer), tokenizer=tokenizer,
                         transformer=transformer)  # fmt: skip
