"""Tiny random-weight models of real encoder architectures, saved like the hub repos they stand for.

No model hub is reachable in tests, so these are built offline with ``save_pretrained``:

- :func:`sdxl_repo`: a diffusers pipeline folder laid out like ``stabilityai/stable-diffusion-xl-base-1.0``
  (``vae/``, ``text_encoder/`` = ``CLIPTextModel``, ``text_encoder_2/`` = ``CLIPTextModelWithProjection``,
  ``tokenizer/`` padding with ``<|endoftext|>``, ``tokenizer_2/`` padding with ``"!"``). Its VAE is
  SD3/Flux-style (16 latent channels, no quant convs, ``scaling_factor`` 1.5305, ``shift_factor``
  0.0609) so that the shift is exercised too.
- :func:`t5_repo`: a ``T5EncoderModel`` repo laid out like ``google/t5-v1_1-*`` (``config.json``,
  weights and tokenizer files at the top level), with a ``T5Tokenizer`` built from a tiny Unigram vocabulary.

The model families' full pipeline folders (SDXL, SD3, Flux, PixArt) are built by
:func:`pipeline.embed.families.tiny.build_tiny`; these two are bare repos for explicit
``--vae`` / ``--text-encoder`` options.

The two CLIP encoders have different widths (32, 48) and a projection of 40, so a test catches any
mix-up of encoder order, hidden size or pooled source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CLIP1_WIDTH, CLIP2_WIDTH, PROJECTION_DIM, T5_WIDTH = 32, 48, 40, 24
VAE_SCALING, VAE_SHIFT, VAE_CHANNELS = 1.5305, 0.0609, 16
T5_MAX_LENGTH = 16


@dataclass(frozen=True)
class SDXLRepo:
    path: str

    def embed_options(self, layer: str = "penultimate", order: tuple[str, str] = ("text_encoder", "text_encoder_2")):
        """The :class:`~pipeline.EmbedJob` fields that use this folder's VAE and both text encoders in ``order``."""
        return {"vae": self.path, "vae_subfolder": "vae", "text_layer": layer,
                "text_encoders": (self.path,) * len(order), "text_encoder_subfolders": tuple(order)}  # fmt: skip


def _clip(width: int, layers: int, tokenizer, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = tokenizer.get_vocab()
    config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=PROJECTION_DIM, hidden_act="gelu",
        bos_token_id=vocab[tokenizer.bos_token], eos_token_id=vocab[tokenizer.eos_token],
        pad_token_id=vocab[tokenizer.pad_token],
    )  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def sdxl_repo(path: Path) -> SDXLRepo:
    """Build (once) the SDXL-style pipeline folder at ``path``."""
    import torch
    from diffusers import AutoencoderKL

    from pipeline.embed.families.tiny import clip_tokenizer

    if (path / "model_index.json").exists():
        return SDXLRepo(str(path))
    torch.manual_seed(1)
    tok1, tok2 = clip_tokenizer(), clip_tokenizer(pad_token="!")
    tok1.save_pretrained(path / "tokenizer")
    tok2.save_pretrained(path / "tokenizer_2")
    _clip(CLIP1_WIDTH, 3, tok1, projection=False).save_pretrained(path / "text_encoder")
    _clip(CLIP2_WIDTH, 3, tok2, projection=True).save_pretrained(path / "text_encoder_2")
    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=VAE_CHANNELS, norm_num_groups=8,
        sample_size=64, scaling_factor=VAE_SCALING, shift_factor=VAE_SHIFT, use_quant_conv=False,
        use_post_quant_conv=False,
    ).save_pretrained(path / "vae")  # fmt: skip
    (path / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}\n')
    return SDXLRepo(str(path))


def t5_repo(path: Path) -> str:
    """Build (once) the T5 encoder repo at ``path``; returns its path."""
    import torch
    from transformers import T5Config, T5EncoderModel

    from pipeline.embed.families.tiny import t5_tokenizer

    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(2)
    tokenizer = t5_tokenizer(T5_MAX_LENGTH)
    tokenizer.save_pretrained(path)
    config = T5Config(vocab_size=len(tokenizer.get_vocab()), d_model=T5_WIDTH, d_kv=8, d_ff=48, num_layers=2,
                      num_heads=3, feed_forward_proj="gated-gelu", decoder_start_token_id=0)  # fmt: skip
    T5EncoderModel(config).save_pretrained(path)
    return str(path)
