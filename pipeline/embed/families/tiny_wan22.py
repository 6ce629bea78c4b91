"""Tiny random-weight Wan 2.2 pipelines (``WanPipeline``, the real classes, a few dozen channels wide).

- ``wan2.2-a14b``: Wan 2.2's mixture of two experts: ``transformer`` (high noise) and ``transformer_2`` (low
  noise), two ``WanTransformer3DModel`` of the tiny Wan 2.1 size seeded apart, with ``boundary_ratio`` 0.875
  (the T2V-A14B folders': the pipeline runs ``transformer`` for timesteps >= 875 of 1000, ``transformer_2``
  below), Wan 2.1's VAE (16 channels, 8x spatial), the tiny UMT5 and a ``UniPCMultistepScheduler`` with flow
  sigmas (``flow_shift`` 3.0 here).
- ``wan2.2-ti2v-5b``: one transformer with ``expand_timesteps`` (the pipeline gives it one timestep per latent
  token), and Wan 2.2's own VAE layout: ``AutoencoderKLWan`` with ``z_dim`` 48, ``patch_size`` 2 (pixels
  patchified 2x2 into 12 channels before the encoder), residual down/up blocks, 16x spatial and 4x temporal
  compression, 48 per-channel ``latents_mean``/``latents_std``; ``flow_shift`` 5.0 as the TI2V-5B folder ships.

Built by :func:`pipeline.embed.families.tiny.build_tiny` (which seeds them and gives them its tiny UMT5).
"""

from __future__ import annotations

__all__ = ["BOUNDARY_RATIO", "wan22_a14b", "wan22_ti2v"]

BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B-Diffusers' model_index.json (its I2V: 0.9)


def _transformer(channels: int, text_dim: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=channels,
        out_channels=channels, text_dim=text_dim, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=1024,
    )  # fmt: skip


def _scheduler(flow_shift: float):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift,
                                   num_train_timesteps=1000)  # fmt: skip


def wan22_a14b(tok, text_encoder):
    """``WanPipeline`` with two experts and ``boundary_ratio`` (see the module docstring) around the tiny UMT5
    ``text_encoder`` and its tokenizer ``tok``."""
    from diffusers import AutoencoderKLWan, WanPipeline

    width = text_encoder.config.d_model
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                           temperal_downsample=[False, True, True])  # fmt: skip
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=_transformer(16, width),
                       transformer_2=_transformer(16, width), scheduler=_scheduler(3.0),
                       boundary_ratio=BOUNDARY_RATIO)  # fmt: skip


def wan22_ti2v(tok, text_encoder):
    """``WanPipeline`` with ``expand_timesteps`` and Wan 2.2's 48-channel VAE (see the module docstring) around the
    tiny UMT5 ``text_encoder`` and its tokenizer ``tok``."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    stats = torch.Generator().manual_seed(48)  # per-channel statistics of the shape Wan 2.2's VAE ships
    mean = (torch.randn(48, generator=stats) * 0.3).tolist()
    std = (0.5 + torch.rand(48, generator=stats)).tolist()
    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=12, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                           temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                           out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                           latents_mean=mean, latents_std=std)  # fmt: skip
    transformer = _transformer(48, text_encoder.config.d_model)
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=_scheduler(5.0), expand_timesteps=True)  # fmt: skip
