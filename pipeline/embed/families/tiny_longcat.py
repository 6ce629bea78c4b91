"""The tiny random-weight ``LongCatImagePipeline`` (the real classes, a few dozen channels wide).

- ``text_encoder``: a ``Qwen2_5_VLForConditionalGeneration`` (:func:`pipeline.embed.families.tiny_qwen.qwen_vl`: text
  40 wide, 2 layers, a 2-block vision tower), as LongCat-Image's Qwen2.5-VL-7B (3584 wide).
- ``tokenizer``: :func:`pipeline.embed.families.tiny_qwen.qwen_tokenizer` (a small byte-level BPE with Qwen2's
  pre-tokenizer and special tokens; LongCat's system prefix falls back to bytes, so it is longer in tokens than with
  the real vocabulary: the pipeline drops it whatever its length). The tests also run the real Qwen2.5-VL tokenizer
  (``tests/fixtures/checkpoints/qwen-image/tokenizer``) in its place.
- ``transformer``: a ``LongCatImageTransformer2DModel`` (1 double and 1 single block, 2 heads of 16, RoPE axes
  4/6/6, ``joint_attention_dim`` the text encoder's width).
- ``vae``: FLUX.1's ``AutoencoderKL`` layout (16 channels, 8x, no quant convs) with FLUX.1's ``scaling_factor``
  0.3611 and ``shift_factor`` 0.1159, as the FLUX.1-based families' tiny VAEs.
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with FLUX.1's dynamic shifting (0.5 at 256 tokens, 1.15 at
  4096): the values ``LongCatImagePipeline.__call__`` falls back to when the config lacks them
  (``pipeline_longcat_image.py:604-610``).
- ``text_processor``: the tokenizer again, in the processor's place (``model_index.json`` then names
  ``Qwen2Tokenizer`` there; the real folder names ``Qwen2_5_VLProcessor``). The pipeline requires the component
  (``_optional_components`` is empty, ``__init__`` ``:214-233``) but uses it only in the optional prompt rewriter
  (``rewire_prompt``, ``:242-272``; ``__call__(enable_prompt_rewrite=False)`` skips it), and transformers 5 builds
  no Qwen2-VL processor without torchvision (:mod:`pipeline.embed.processors`): so the tiny folder loads with
  ``from_pretrained`` where torchvision is missing. Nothing bucketeer computes reads it.
"""

from __future__ import annotations

from pipeline.embed.families.tiny_qwen import QWEN_WIDTH, qwen_tokenizer, qwen_vl

__all__ = ["longcat_image"]


def longcat_image():
    """The tiny ``LongCatImagePipeline`` (see the module docstring); seeded by the caller."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, LongCatImagePipeline
    from diffusers import LongCatImageTransformer2DModel

    tokenizer = qwen_tokenizer()
    transformer = LongCatImageTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=QWEN_WIDTH, pooled_projection_dim=QWEN_WIDTH, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=8,
        sample_size=64, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    return LongCatImagePipeline(scheduler=scheduler, vae=vae, text_encoder=qwen_vl(tokenizer), tokenizer=tokenizer,
                                text_processor=tokenizer, transformer=transformer)  # fmt: skip
