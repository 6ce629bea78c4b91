"""The published configurations of the real models the benchmarks build, in one place.

Each dict holds the keyword arguments of a ``diffusers`` model or a ``transformers`` config, with the values of
the hub's ``config.json`` named beside it. :mod:`benchmarks.text_bytes` and :mod:`benchmarks.sizes_flux2` build
them on the meta device to count parameters and bytes per caption; :mod:`benchmarks.gpu_models` builds them with
random weights on a GPU for ``gpu_check.py``. Nothing here allocates or downloads anything.
"""

from __future__ import annotations

__all__ = ["SDXL_VAE", "FLUX1_VAE", "T5_XXL", "MISTRAL_SMALL_31", "QWEN3_4B", "QWEN3_8B", "QWEN_VL_7B",
           "FLUX2_TRANSFORMER", "QWEN_IMAGE", "Z_IMAGE"]  # fmt: skip

# stabilityai/stable-diffusion-xl-base-1.0 vae/config.json
SDXL_VAE = {"down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 4,
            "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
# black-forest-labs/FLUX.1-dev vae/config.json: also Chroma's and Z-Image's VAE
FLUX1_VAE = {**SDXL_VAE, "latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159,
             "use_quant_conv": False, "use_post_quant_conv": False, "force_upcast": True}
# google/t5-v1_1-xxl (FLUX.1's and Chroma's text_encoder_2 / text_encoder: the encoder only)
T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
          "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False}
# mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json (Mistral3ForConditionalGeneration): FLUX.2-dev's
MISTRAL_SMALL_31 = {
    "text_config": {"model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
                    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 131072, "sliding_window": None, "tie_word_embeddings": False},
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 1540, "patch_size": 14},
    "spatial_merge_size": 2, "multimodal_projector_bias": False, "image_token_index": 10,
    "tie_word_embeddings": False,
}  # fmt: skip
# Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json: 36 layers, 32 heads of 128, 8 KV heads. 4B: FLUX.2 [klein] 4B's
# and Z-Image's text encoder; 8B: FLUX.2 [klein] 9B's
_QWEN3 = {"vocab_size": 151936, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 128, "max_position_embeddings": 40960}  # fmt: skip
QWEN3_4B = {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True}
QWEN3_8B = {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct); the special tokens' ids are the tokenizer's
QWEN_VL_7B = {"text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                              "max_position_embeddings": 128000, "tie_word_embeddings": False,
                              "rope_scaling": {"type": "default", "mrope_section": [16, 24, 24]}},
              "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
              "tie_word_embeddings": False}  # fmt: skip
# diffusers' scripts/convert_flux2_to_diffusers.py: flux2-dev, klein-4b, klein-9b (Flux2Transformer2DModel)
FLUX2_TRANSFORMER = {
    "dev": {"num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48, "joint_attention_dim": 15360,
            "guidance_embeds": True},
    "klein-4b": {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24, "joint_attention_dim": 7680,
                 "guidance_embeds": False},
    "klein-9b": {"num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32, "joint_attention_dim": 12288,
                 "guidance_embeds": False},
}  # fmt: skip
# Qwen/Qwen-Image transformer/config.json (QwenImageTransformer2DModel); Tongyi-MAI/Z-Image-Turbo's
QWEN_IMAGE = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
              "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": [16, 56, 56]}
Z_IMAGE = {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
           "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "cap_feat_dim": 2560, "axes_dims": [32, 48, 48],
           "axes_lens": [1536, 512, 512]}
# The VAEs of FLUX.2 (AutoencoderKLFlux2) and Qwen-Image (AutoencoderKLQwenImage) are diffusers' defaults.
