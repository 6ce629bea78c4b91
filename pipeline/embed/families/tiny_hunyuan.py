"""A tiny random-weight HunyuanVideo 1.5 text-to-video pipeline (``HunyuanVideo15Pipeline``, the real classes).

- ``text_encoder``: a ``Qwen2_5_VLTextModel`` (40 wide, 3 layers: the pipeline reads ``hidden_states[-3]``) with
  the tiny ``Qwen2Tokenizer`` of :mod:`.tiny_qwen` and a Qwen2.5-style chat template (system, user, the assistant
  turn's opening), as ``_get_mllm_prompt_embeds`` applies it.
- ``text_encoder_2``: a ``T5EncoderModel`` over ByT5's 384 byte ids (24 wide, 1 layer) and a ``ByT5Tokenizer``
  (needs no vocabulary file): the glyph stream, quoted text in the caption.
- ``transformer``: a ``HunyuanVideo15Transformer3DModel`` (2 heads of 12, 2 blocks, 1 refiner layer,
  ``task_type`` t2v) taking ``2 C + 1`` input channels (latents, the zero i2v condition, its zero mask).
- ``vae``: an ``AutoencoderKLHunyuanVideo15`` of HunyuanVideo 1.5's layout (16x spatial, 4x temporal, 8 latent
  channels here instead of 32, ``scaling_factor`` 1.03682 as the 480p folders ship it).
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with ``shift`` 5.0; ``guider``: ``ClassifierFreeGuidance``.

Built by :func:`pipeline.embed.families.tiny.build_tiny` (which seeds it).
"""

from __future__ import annotations

__all__ = ["HUNYUAN_WIDTH", "BYT5_WIDTH", "LATENT_CHANNELS", "hunyuan_video15"]

HUNYUAN_WIDTH = 40  # Qwen2.5-VL's hidden size (3584 in the 7B)
BYT5_WIDTH = 24  # ByT5's d_model (1472 in the glyph ByT5)
LATENT_CHANNELS = 8  # HunyuanVideo 1.5's VAE: 32
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                 "{%- endif %}")  # Qwen2.5-VL's for plain-text messages  # fmt: skip


def hunyuan_video15():
    """The tiny ``HunyuanVideo15Pipeline`` (see the module docstring)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)  # fmt: skip
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from pipeline.embed.families.tiny_qwen import qwen_tokenizer

    tokenizer = qwen_tokenizer(CHAT_TEMPLATE)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=HUNYUAN_WIDTH, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": [1, 2, 2]}, bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id))  # fmt: skip
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=384, d_model=BYT5_WIDTH, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=3, feed_forward_proj="gated-gelu"))  # fmt: skip
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2,
        attention_head_dim=12, num_layers=2, num_refiner_layers=1, text_embed_dim=HUNYUAN_WIDTH,
        text_embed_2_dim=BYT5_WIDTH, image_embed_dim=16, rope_axes_dim=(4, 4, 4), target_size=64, task_type="t2v",
    )  # fmt: skip
    vae = AutoencoderKLHunyuanVideo15(latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 16, 16, 16),
                                      layers_per_block=1, scaling_factor=1.03682)  # fmt: skip
    scheduler, guider = FlowMatchEulerDiscreteScheduler(shift=5.0), ClassifierFreeGuidance(guidance_scale=6.0)
    return HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                  scheduler=scheduler, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                  guider=guider)  # fmt: skip
