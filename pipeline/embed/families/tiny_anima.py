"""A tiny random-weight Anima pipeline (the real classes, a few dozen channels wide), saved as its modular folder.

``AnimaModularPipeline`` (diffusers 0.42.1 ships Anima as a modular pipeline only, ``d/modular_pipelines/anima/``)
built as ``scripts/convert_anima_to_diffusers.py`` (huggingface/diffusers) builds the real one:
``AnimaAutoBlocks().init_pipeline()`` and ``update_components`` with

- ``text_encoder``: a ``Qwen3Model`` (40 wide, 2 layers; Qwen3-0.6B is 1024 wide, 28 layers) and ``tokenizer`` the
  tiny ``Qwen2Tokenizer`` of :mod:`.tiny_qwen`;
- ``t5_tokenizer``: the tiny T5 tokenizer of :mod:`.tiny` (only its ids are used: there is no T5 model);
- ``text_conditioner``: an ``AnimaTextConditioner`` (the LLM adapter; 2 blocks, 32 wide, T5 vocabulary of the tiny
  tokenizer, ``min_sequence_length`` 512 as the real one: every prompt reaches the transformer as 512 rows);
- ``transformer``: a ``CosmosTransformer3DModel`` in Cosmos-Predict2-2B's layout (padding mask concatenated, patch
  1x2x2, ``rope_scale`` (1, 4, 4), no learnable position embedding) with 2 blocks of 2 heads of 16;
- ``vae``: Qwen-Image's tiny ``AutoencoderKLQwenImage`` (built under Qwen-Image's tiny seed, so its weights are the
  tiny ``qwen-image`` VAE's, and ``embed --reuse`` can take a tiny qwen-image cache's latents, as it can take real
  Qwen-Image latents for real Anima: the same VAE and normalisation);
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=3.0)``, as the conversion script writes it.

``save_pretrained`` writes ``modular_model_index.json`` (no ``model_index.json``), with each component's subfolder.
"""

from __future__ import annotations

__all__ = ["TEXT_WIDTH", "QWEN3_WIDTH", "anima"]

QWEN3_WIDTH = 40  # Qwen3-0.6B's hidden size: 1024 (the conditioner's source_dim)
TEXT_WIDTH = 32  # the conditioner's target_dim = the transformer's text_embed_dim: 1024 in the real model
QWEN_IMAGE_SEED = 7  # tiny.py's seed of the tiny qwen-image pipeline, whose VAE is the first module it builds


def anima():
    """The tiny ``AnimaModularPipeline`` (see the module docstring), components in place."""
    import torch
    from diffusers import (AnimaAutoBlocks, AnimaTextConditioner, AutoencoderKLQwenImage, CosmosTransformer3DModel,
                           FlowMatchEulerDiscreteScheduler)  # fmt: skip
    from transformers import Qwen3Config, Qwen3Model

    from pipeline.embed.families.tiny import t5_tokenizer
    from pipeline.embed.families.tiny_qwen import qwen_tokenizer

    rng = torch.get_rng_state()
    torch.manual_seed(QWEN_IMAGE_SEED)  # the tiny qwen-image VAE, bit for bit (tiny_qwen.qwen_image builds it first)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])  # fmt: skip
    torch.set_rng_state(rng)  # the rest from the family's own seed
    tokenizer, t5 = qwen_tokenizer(), t5_tokenizer()
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=QWEN3_WIDTH, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=10, max_position_embeddings=1024))  # fmt: skip
    conditioner = AnimaTextConditioner(source_dim=QWEN3_WIDTH, target_dim=TEXT_WIDTH, model_dim=TEXT_WIDTH,
                                       num_layers=2, num_attention_heads=2, mlp_ratio=2.0,
                                       target_vocab_size=len(t5.get_vocab()))  # fmt: skip
    transformer = CosmosTransformer3DModel(in_channels=16, out_channels=16, num_attention_heads=2,
                                           attention_head_dim=16, num_layers=2, mlp_ratio=2.0,
                                           text_embed_dim=TEXT_WIDTH, adaln_lora_dim=8, max_size=(4, 64, 64),
                                           patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
                                           concat_padding_mask=True, extra_pos_embed_type=None)  # fmt: skip
    pipe = AnimaAutoBlocks().init_pipeline()
    pipe.update_components(text_encoder=text_encoder, tokenizer=tokenizer, t5_tokenizer=t5,
                           text_conditioner=conditioner, transformer=transformer, vae=vae,
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))  # fmt: skip
    return pipe
