"""A tiny random-weight LTX-2 pipeline (``LTX2Pipeline``, the real classes, a few dozen channels wide).

- ``text_encoder``: ``Gemma3ForConditionalGeneration`` (text 32 wide, 2 layers, so ``encode_prompt`` stacks 3
  hidden states: 96 features a token; a 1-layer SigLIP tower the pipeline never runs) and a byte-level BPE
  tokenizer with Gemma's special tokens (``<bos>`` prepended, ``<pad>`` on the left as the pipeline pads).
- ``connectors``: ``LTX2TextConnectors`` as LTX-2.0's (one projection of the masked-mean-normalised layers, 128
  learnable registers in place of the padding, 2 connector layers each for video and audio).
- ``vae``: ``AutoencoderKLLTX2Video`` with LTX-2's compression (32x spatial: patch 4 then 3 halvings; 8x temporal,
  causal: ``F = 8k + 1`` frames -> ``k + 1`` latent frames), 8 channels, random per-channel
  ``latents_mean``/``latents_std`` buffers (the real ones ship non-trivial statistics).
- ``audio_vae`` (mel 16 bins, 2 channels: 8 features per audio token), ``vocoder``: tiny, for the pipeline's
  audio stream.
- ``transformer``: ``LTX2VideoTransformer3DModel`` (2 layers, video 16 wide, audio 8 wide), and LTX-2's
  ``FlowMatchEulerDiscreteScheduler`` (dynamic exponential shift, 0.95 at 1024 tokens to 2.05 at 4096, terminal
  0.1).

``variant="2.3"`` builds LTX-2.3's layout of the same pipeline class, as the published 2.3 folders configure it
(diffusers/LTX-2.3-Diffusers): connectors with ``per_modality_projections`` (per-token RMS norm, one projection per
modality, no caption projection in the transformer) and gated attention; a transformer with ``gated_attn`` and
``cross_attn_mod`` (its ``prompt_adaln`` modulates the text cross-attention by sigma); ``LTX2VocoderWithBWE``.

Built by :func:`pipeline.embed.families.tiny.build_tiny` (which seeds it).
"""

from __future__ import annotations

from manifests.errors import UsageError

__all__ = ["GEMMA_WIDTH", "GEMMA_LAYERS", "VARIANTS", "connectors_supported", "ltx2"]

GEMMA_WIDTH, GEMMA_LAYERS = 32, 2  # Gemma 3 12B: 3840 wide, 48 layers
VARIANTS = ("2.0", "2.3")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]


def gemma_tokenizer():
    """A byte-level BPE with Gemma's special tokens, ``<bos>`` first, padding on the left."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from pipeline.embed.families.tiny_flux2 import _byte_bpe

    tokenizer, _ = _byte_bpe(SPECIALS)
    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                             special_tokens=[("<bos>", bos)])  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>", padding_side="left",
                                   model_max_length=1024)  # fmt: skip


def _gemma(tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    vocab = tokenizer.get_vocab()
    text = Gemma3TextConfig(vocab_size=len(vocab), hidden_size=GEMMA_WIDTH, intermediate_size=64,
                            num_hidden_layers=GEMMA_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            sliding_window=64, pad_token_id=vocab["<pad>"], bos_token_id=vocab["<bos>"],
                            eos_token_id=vocab["<eos>"])  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1,
                          boi_token_index=vocab["<start_of_image>"], eoi_token_index=vocab["<end_of_image>"],
                          image_token_index=vocab["<image_soft_token>"])  # fmt: skip
    return Gemma3ForConditionalGeneration(config)


def connectors_supported() -> bool:
    """Whether the installed diffusers' ``LTX2TextConnectors`` has the per-modality configuration this tiny
    pipeline is built with (0.42.1 has it; 0.37, the floor of the other families, does not)."""
    import inspect

    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return "video_hidden_dim" in inspect.signature(LTX2TextConnectors.__init__).parameters


def ltx2(variant: str | None = None):
    """``LTX2Pipeline`` of the module docstring's tiny components (unseeded: the caller seeds); ``variant``: "2.0"
    (None) or "2.3"."""
    import torch
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)  # fmt: skip
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    if not connectors_supported():
        import diffusers

        raise UsageError(f"--family ltx-2 --model default needs a newer diffusers than {diffusers.__version__} "
                         "(its LTX-2 text connectors were reworked after 0.37): pip install -U diffusers")
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    if (variant or "2.0") not in VARIANTS:
        raise ValueError(f"ltx-2 variant {variant!r}: the tiny pipeline has {VARIANTS}")
    v23 = variant == "2.3"
    tokenizer = gemma_tokenizer()
    connectors = LTX2TextConnectors(caption_channels=GEMMA_WIDTH, text_proj_in_factor=GEMMA_LAYERS + 1,
                                    video_connector_num_attention_heads=2, audio_connector_num_attention_heads=2,
                                    # 2.3: the connectors run at the transformer's text widths (video 16, audio 8)
                                    video_connector_attention_head_dim=8 if v23 else 16,
                                    audio_connector_attention_head_dim=4 if v23 else 16,
                                    video_hidden_dim=16, audio_hidden_dim=8, per_modality_projections=v23,
                                    video_gated_attn=v23, audio_gated_attn=v23)  # fmt: skip
    vae = AutoencoderKLLTX2Video(latent_channels=8, block_out_channels=(8, 16, 16, 16),
                                 decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
                                 decoder_layers_per_block=(1, 1, 1, 1), spatial_compression_ratio=32,
                                 temporal_compression_ratio=8)  # fmt: skip (the real folder states them too)
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(8) * 0.3)
        vae.latents_std.copy_(0.5 + torch.rand(8))
    audio_vae = AutoencoderKLLTX2Audio(base_channels=8, ch_mult=(1, 2), num_res_blocks=1, latent_channels=2,
                                       mel_bins=16)  # fmt: skip
    vocoder = LTX2Vocoder(in_channels=32, hidden_channels=16, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                          resnet_kernel_sizes=[3], resnet_dilations=[[1]])  # fmt: skip
    if v23:
        vocoder = LTX2VocoderWithBWE(in_channels=32, hidden_channels=16, upsample_kernel_sizes=[4, 4],
                                     upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                                     bwe_in_channels=32, bwe_hidden_channels=16, bwe_upsample_kernel_sizes=[8, 8, 7],
                                     bwe_upsample_factors=[4, 4, 3], bwe_resnet_kernel_sizes=[3],
                                     bwe_resnet_dilations=[[1]], num_mel_channels=16, filter_length=64, hop_length=16,
                                     window_length=64)  # fmt: skip (BWE: hop 16 x 3 = 4 x 4 x 3 upsampling)
    audio_width = 2 * (16 // audio_vae.mel_compression_ratio)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=audio_width, audio_out_channels=audio_width, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=GEMMA_WIDTH,
        gated_attn=v23, cross_attn_mod=v23, audio_gated_attn=v23, audio_cross_attn_mod=v23,
        use_prompt_embeddings=not v23,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
                                                time_shift_type="exponential")  # fmt: skip
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=_gemma(tokenizer),
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)
