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

# Krea 2 (krea-2). Its text encoder is Qwen/Qwen3-VL-4B-Instruct's config.json (Qwen3VLModel; text 2560 wide, 36
# layers, interleaved M-RoPE 24/20/20; a 24-block vision tower the family never runs), as third-party Krea 2 ports
# quote it verbatim (no hub access here). Its transformer is diffusers 0.42.1's Krea2Transformer2DModel defaults,
# which the class docstring gives as Krea 2's (hidden 48 x 128 = 6144, 28 blocks, 12 KV heads, SwiGLU 16384; text
# fusion of 12 layers of 2560); the pipeline's example loads "a local directory produced by the Krea 2 conversion
# (no hub repo yet)", so no published transformer/config.json was found. Its VAE is Qwen-Image's (diffusers' defaults).
QWEN3_VL_4B = {"text_config": {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
                               "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                               "tie_word_embeddings": True,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 5000000,
                                                   "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
               "vision_config": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                                 "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2,
                                 "temporal_patch_size": 2, "num_position_embeddings": 2304,
                                 "deepstack_visual_indexes": [5, 11, 17]},
               "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
               "vision_end_token_id": 151653, "tie_word_embeddings": True}  # fmt: skip
KREA2_TRANSFORMER = {"in_channels": 64, "num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 48,
                     "num_key_value_heads": 12, "intermediate_size": 16384, "timestep_embed_dim": 256,
                     "text_hidden_dim": 2560, "num_text_layers": 12, "text_num_attention_heads": 20,
                     "text_num_key_value_heads": 20, "text_intermediate_size": 6912, "num_layerwise_text_blocks": 2,
                     "num_refiner_text_blocks": 2, "axes_dims_rope": [32, 48, 48], "rope_theta": 1000.0,
                     "norm_eps": 1e-5}  # fmt: skip
__all__ += ["QWEN3_VL_4B", "KREA2_TRANSFORMER"]

# LongCat-Image (longcat-image), meituan-longcat/LongCat-Image (no hub access here, its transformer/config.json not
# seen): 10 double and 20 single blocks, 24 heads of 128 (3072 wide), text 3584 (Qwen2.5-VL-7B), 64 packed input
# channels, as filipstrand/mflux@9e023107597d07577a73588666f3d13ec359ecc7 src/mflux/models/longcat/model/
# longcat_transformer/longcat_transformer.py states them (6.27B parameters: the model card's "6B"); RoPE axes, patch
# and pooled_projection_dim (stored, never used) are diffusers 0.42.1's class defaults. Text encoder: QWEN_VL_7B (the
# model_index.json a third-party copy shows names Qwen2_5_VLForConditionalGeneration); VAE: FLUX1_VAE (FLUX.1's).
LONGCAT_IMAGE = {"patch_size": 1, "in_channels": 64, "num_layers": 10, "num_single_layers": 20,
                 "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                 "pooled_projection_dim": 3584, "axes_dims_rope": [16, 56, 56]}  # fmt: skip
__all__ += ["LONGCAT_IMAGE"]

# Kandinsky 5 (kandinsky-5, kandinsky-5-video): the DiT sizes of kandinskylab/kandinsky-5's configs (commit 57bcb40
# configs/config_t2i.yaml: Kandinsky-5.0-T2I-Lite; ae7d348 configs/k5_lite_t2v_5s_distil_sd.yaml and its siblings:
# T2V-Lite), as Kandinsky5Transformer3DModel keyword arguments (no hub config.json seen). Its text encoders are
# Qwen2.5-VL-7B-Instruct (QWEN_VL_7B) and openai/clip-vit-large-patch14's text model (768 wide); its T2I VAE is FLUX.1's
# (FLUX1_VAE, applied without its shift_factor), its T2V VAE HunyuanVideo 1.0's: hunyuanvideo-community/HunyuanVideo
# vae/ (AutoencoderKLHunyuanVideo), as kandinskylab/kandinsky-5's comfyui/nodes_kandinsky.py builds it: diffusers'
# defaults (16 latent channels, 8x spatial, 4x temporal, scaling_factor 0.476986)
KANDINSKY5_T2I = {"in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 3584, "in_text_dim2": 768,
                  "time_dim": 512, "patch_size": [1, 2, 2], "model_dim": 2560, "ff_dim": 10240, "num_text_blocks": 2,
                  "num_visual_blocks": 50, "axes_dims": [32, 48, 48], "visual_cond": False}  # fmt: skip
KANDINSKY5_T2V = {**KANDINSKY5_T2I, "model_dim": 1792, "ff_dim": 7168, "num_visual_blocks": 32,
                  "axes_dims": [16, 24, 24], "visual_cond": True}  # fmt: skip
HUNYUAN_VIDEO_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 16,
                     "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
                     "scaling_factor": 0.476986, "spatial_compression_ratio": 8,
                     "temporal_compression_ratio": 4}  # fmt: skip
__all__ += ["KANDINSKY5_T2I", "KANDINSKY5_T2V", "HUNYUAN_VIDEO_VAE"]

# Qwen-Image 2.1 (qwen-image-2.1): Qwen/Qwen-Image-2.1's configs as third-party ports pin them (no hub access here; a
# Rust port's test fixture quotes transformer/, vae/ and text_encoder/config.json; QwenLM/Qwen-Image-2.1's README:
# "32 Single-Stream DiT layers", "7B", "Qwen3-VL 8B", "64-channel RGBA autoencoder with 16x spatial compression").
# The transformer and the VAE are diffusers 0.42.1's QwenImage21Transformer2DModel / AutoencoderKLQwenImage21
# defaults (the VAE's per-channel latents_mean/latents_std: the class defaults, not checked against the hub file);
# the text encoder is Qwen3-VL-8B-Instruct's config.json (text 4096 wide, 36 layers, interleaved M-RoPE 24/20/20;
# a 27-block vision tower the family never runs for text to image)
QWEN_IMAGE21_TRANSFORMER = {"patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 32,
                            "attention_head_dim": 128, "num_attention_heads": 32, "context_in_dim": 4096,
                            "mlp_ratio": 3, "axes_dims_rope": [16, 56, 56], "eps": 1e-6,
                            "causal_condition": True}  # fmt: skip
QWEN_IMAGE21_VAE = {"base_dim": 96, "decoder_base_dim": 144, "z_dim": 64, "dim_mult": [1, 2, 4, 8, 8],
                    "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True, True],
                    "dropout": 0.0, "is_residual": True, "in_channels": 4, "out_channels": 4, "patch_size": None,
                    "scale_factor_temporal": 8, "scale_factor_spatial": 16}  # fmt: skip
QWEN3_VL_8B = {"text_config": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                               "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                               "tie_word_embeddings": False,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 5000000,
                                                   "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
               "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                                 "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
                                 "temporal_patch_size": 2, "num_position_embeddings": 2304,
                                 "deepstack_visual_indexes": [8, 16, 24]},
               "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
               "vision_end_token_id": 151653, "tie_word_embeddings": False}  # fmt: skip
__all__ += ["QWEN_IMAGE21_TRANSFORMER", "QWEN_IMAGE21_VAE", "QWEN3_VL_8B"]

# ERNIE-Image (ernie-image), baidu/ERNIE-Image (no hub access here, its config.json files not seen). Transformer: the
# ErnieImageTransformer2DModel sizes that modelscope/DiffSynth-Studio@099c0ec71b14b6b21db2ff1e111b8efdee6a7700
# diffsynth/models/ernie_image_dit.py gives as "Default parameters from actual checkpoint config.json (baidu/ERNIE-Image
# transformer)" (4096 wide, 32 heads of 128, 36 layers, FFN 12288, 128 patchified channels, text 3072), the hub page's
# figures. Text encoder: the text_config of its Mistral3Model (Ministral 3 3B: 26 layers, 3072 wide, YaRN rope), as
# DiffSynth-Studio@132143f98140e15d2bf917342e88cc4250575f33 diffsynth/models/ernie_image_text_encoder.py copies it
# (the Pixtral vision tower, which the family never runs, is not given there). VAE: FLUX.2's (AutoencoderKLFlux2,
# diffusers' defaults; its config says batch_norm_eps 1e-4, the pipeline normalises with 1e-5)
ERNIE_IMAGE = {"hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36, "ffn_hidden_size": 12288,
               "in_channels": 128, "out_channels": 128, "patch_size": 1, "text_in_dim": 3072, "rope_theta": 256,
               "rope_axes_dim": [32, 48, 48], "eps": 1e-6, "qk_layernorm": True}  # fmt: skip
MINISTRAL3_3B_TEXT = {"model_type": "ministral3", "vocab_size": 131072, "hidden_size": 3072, "intermediate_size": 9216,
                      "num_hidden_layers": 26, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                      "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                      "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11,
                      "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                          "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "llama_4_scaling_beta": 0.1}}  # fmt: skip
__all__ += ["ERNIE_IMAGE", "MINISTRAL3_3B_TEXT"]

# Anima (anima; AnimaModularPipeline), as diffusers' scripts/convert_anima_to_diffusers.py builds it: the transformer
# is convert_cosmos_to_diffusers.py's "Cosmos-2.0-Diffusion-2B-Text2Image" config (Cosmos-Predict2-2B: 16 heads of
# 128, 28 blocks, text 1024, padding mask concatenated, rope_scale (1, 4, 4), no learnable position embedding); the
# text conditioner (the "LLM adapter", net.llm_adapter.* of the DiT file) is inferred from its weights, which give
# AnimaTextConditioner's defaults as its docstring and sd-scripts' Anima docs describe it (6 blocks of 1024, 16
# heads, T5 vocabulary 32128, padded to 512 rows); the text encoder is Qwen3-0.6B(-Base): Qwen3Config as the script
# infers it from qwen_3_06b_base.safetensors (1024 wide, MLP 3072, 28 layers, 16 heads of 128, 8 KV heads, vocabulary
# 151936; max_position_embeddings 32768, rope_theta 1e6, untied); the VAE is Qwen-Image's (diffusers' defaults)
ANIMA_TRANSFORMER = {"in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
                     "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
                     "max_size": [128, 240, 240], "patch_size": [1, 2, 2], "rope_scale": [1.0, 4.0, 4.0],
                     "concat_padding_mask": True, "extra_pos_embed_type": None}  # fmt: skip
ANIMA_TEXT_CONDITIONER = {"source_dim": 1024, "target_dim": 1024, "model_dim": 1024, "num_layers": 6,
                          "num_attention_heads": 16, "mlp_ratio": 4.0, "target_vocab_size": 32128,
                          "use_self_attention": True, "use_layer_norm": False, "min_sequence_length": 512}
QWEN3_06B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False, "tie_word_embeddings": False}
__all__ += ["ANIMA_TRANSFORMER", "ANIMA_TEXT_CONDITIONER", "QWEN3_06B"]
