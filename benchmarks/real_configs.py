"""The published configurations of the real models the benchmarks build, in one place.

Each dict holds the keyword arguments of a ``diffusers`` model or a ``transformers`` config, with the values of
the hub's ``config.json`` named beside it. :mod:`benchmarks.text_bytes` and :mod:`benchmarks.sizes_flux2` build
them on the meta device to count parameters and bytes per caption; :mod:`benchmarks.gpu_models` builds them with
random weights on a GPU for ``gpu_check.py`` (the video VAEs: :mod:`benchmarks.gpu_video`). Nothing here allocates
or downloads anything.
"""

from __future__ import annotations

__all__ = ["SDXL_VAE", "FLUX1_VAE", "T5_XXL", "MISTRAL_SMALL_31", "QWEN3_4B", "QWEN3_8B", "QWEN_VL_7B",
           "FLUX2_TRANSFORMER", "QWEN_IMAGE", "Z_IMAGE", "WAN22_VAE", "LTX2_VAE", "HUNYUAN_VIDEO15_VAE"]  # fmt: skip

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

# The video VAEs (benchmarks/gpu_video.py). Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json (AutoencoderKLWan), as
# diffusers' scripts/convert_wan_to_diffusers.py writes it (vae22_diffusers_config; the rest diffusers' defaults,
# which the hub's file states too: dim_mult [1, 2, 4, 4], num_res_blocks 2, temperal_downsample [F, T, T]): pixels
# patchified 2x2 into 12 channels, 48 latent channels, 16x spatial, 4x temporal. Its "clip_output": false is left
# out: 0.42.1's AutoencoderKLWan takes no such argument (from_config drops it)
WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
             "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
             "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
             "scale_factor_temporal": 4,
             "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542,
                              0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109,
                              0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899,
                              -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
                              0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667],
             "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894,
                             1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146,
                             0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709,
                             0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537,
                             0.5444, 0.4089, 0.7468, 0.7744]}  # fmt: skip
# Lightricks/LTX-2 vae/config.json (AutoencoderKLLTX2Video): diffusers' scripts/convert_ltx2_to_diffusers.py,
# get_ltx2_video_vae_config("2.0"), which wrote it: 128 latent channels, patch 4 then 3 halvings (32x spatial), 8x
# temporal, causal encoder. Not stated there (diffusers' defaults): scaling_factor 1.0, upsample_type; the per-channel
# latents_mean/latents_std are buffers of the weights file (the conversion's per_channel_statistics), not config
LTX2_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": [256, 512, 1024, 2048],
            "down_block_types": ["LTX2VideoDownBlock3D"] * 4, "decoder_block_out_channels": [256, 512, 1024],
            "layers_per_block": [4, 6, 6, 2, 2], "decoder_layers_per_block": [5, 5, 5, 5],
            "spatio_temporal_scaling": [True, True, True, True], "decoder_spatio_temporal_scaling": [True, True, True],
            "decoder_inject_noise": [False, False, False, False],
            "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
            "upsample_residual": [True, True, True], "upsample_factor": [2, 2, 2], "timestep_conditioning": False,
            "patch_size": 4, "patch_size_t": 1, "resnet_norm_eps": 1e-6, "encoder_causal": True,
            "decoder_causal": False, "encoder_spatial_padding_mode": "zeros", "decoder_spatial_padding_mode": "reflect",
            "spatial_compression_ratio": 32, "temporal_compression_ratio": 8}  # fmt: skip
# hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v (and its 720p and i2v siblings) vae/config.json
# (AutoencoderKLHunyuanVideo15, _diffusers_version 0.36.0.dev0): diffusers' scripts/convert_hunyuan_video1_5_to_
# diffusers.py builds AutoencoderKLHunyuanVideo15() with its defaults, and these are they: 32 latent channels, 16x
# spatial, 4x temporal
HUNYUAN_VIDEO15_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 32,
                       "block_out_channels": [128, 256, 512, 1024, 1024], "layers_per_block": 2,
                       "spatial_compression_ratio": 16, "temporal_compression_ratio": 4,
                       "downsample_match_channel": True, "upsample_match_channel": True,
                       "scaling_factor": 1.03682}  # fmt: skip
