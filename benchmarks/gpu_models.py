"""Random-weight model folders of the real architectures, and a local JPEG dataset, for ``gpu_check.py``.

Nothing is downloaded: every model is built from a config written here and saved with
``save_pretrained`` as the diffusers pipeline folder the embed job and the trainer load
(``--family F --model FOLDER``). ``REAL`` holds the published configs (values as in the hub's
``config.json`` files of stabilityai/stable-diffusion-xl-base-1.0, black-forest-labs/FLUX.1-dev and
google/t5-v1_1-xxl), ``TINY`` the same classes shrunk so that ``--smoke`` runs every line of this
module on a CPU in seconds. Weights are random: the numbers are noise, the shapes and the FLOPs are real.

- ``sdxl``: ``AutoencoderKL`` (4 latent channels), ``CLIPTextModel`` (CLIP-L, 768 x 12 layers),
  ``CLIPTextModelWithProjection`` (CLIP-bigG, 1280 x 32 layers, projection 1280),
  ``UNet2DConditionModel`` (2.57B parameters), the Euler scheduler config.
- ``flux``: ``AutoencoderKL`` (16 channels, shift), CLIP-L, ``T5EncoderModel`` (T5-XXL, 4096 x 24
  layers, 4.76B), ``FluxTransformer2DModel`` at Flux's width (24 heads x 128 = 3072, joint attention
  4096, pooled 768, guidance embedding) with **4 double-stream and 8 single-stream blocks** instead of
  19 and 38 (2.5B of 11.9B parameters): the full model with AdamW (16 bytes per parameter: fp32 weights,
  gradients and two moments) needs ~190 GB, more than one 80 GB GPU; these 12 blocks train in ~40 GB
  plus activations, so every block and kernel shape of Flux runs, 12/57 of the depth.

The tokenizers are the tiny in-memory ones of :mod:`pipeline.embed.families.tiny` (every text
tokenizes; ids fall inside the real vocabularies): sequence lengths (77, 512) are the real ones.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["REAL", "TINY", "VISION", "build_folder", "build_vision", "make_jpegs", "write_jpeg_manifest",
           "FLUX_BLOCKS"]  # fmt: skip

FLUX_BLOCKS = (4, 8)  # double-stream, single-stream blocks of the Flux-width transformer (real: 19, 38)

_SDXL_VAE = {"down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
             "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 4,
             "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
_FLUX_VAE = {**_SDXL_VAE, "latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159,
             "use_quant_conv": False, "use_post_quant_conv": False, "force_upcast": True}
_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
           "projection_dim": 768, "hidden_act": "quick_gelu", "vocab_size": 49408, "max_position_embeddings": 77}
_CLIP_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
           "projection_dim": 1280, "hidden_act": "gelu", "vocab_size": 49408, "max_position_embeddings": 77}
_T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
           "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
           "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False}
_SDXL_UNET = {"sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
              "block_out_channels": [320, 640, 1280], "attention_head_dim": [5, 10, 20],
              "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
              "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
              "transformer_layers_per_block": [1, 2, 10], "cross_attention_dim": 2048, "use_linear_projection": True,
              "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
              "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32}  # 2816 = 1280 + 6 x 256
_FLUX_TRANSFORMER = {"patch_size": 1, "in_channels": 64, "num_layers": FLUX_BLOCKS[0],
                     "num_single_layers": FLUX_BLOCKS[1], "attention_head_dim": 128, "num_attention_heads": 24,
                     "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
                     "axes_dims_rope": [16, 56, 56]}
_SDXL_SCHEDULER = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1,
                   "timestep_spacing": "leading", "prediction_type": "epsilon", "num_train_timesteps": 1000}
_FLUX_SCHEDULER = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                   "base_image_seq_len": 256, "max_image_seq_len": 4096, "num_train_timesteps": 1000}

REAL: dict[str, dict[str, dict[str, Any]]] = {
    "sdxl": {"vae": _SDXL_VAE, "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_G, "unet": _SDXL_UNET,
             "scheduler": _SDXL_SCHEDULER},
    "flux": {"vae": _FLUX_VAE, "text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL, "transformer": _FLUX_TRANSFORMER,
             "scheduler": _FLUX_SCHEDULER},
}  # fmt: skip

_TINY_VAE = {"block_out_channels": [8, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 8, "sample_size": 64}
_TINY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "projection_dim": 32, "vocab_size": 1000}
TINY: dict[str, dict[str, dict[str, Any]]] = {
    "sdxl": {"vae": {**_SDXL_VAE, **_TINY_VAE}, "text_encoder": {**_CLIP_L, **_TINY_CLIP},
             "text_encoder_2": {**_CLIP_G, **_TINY_CLIP, "hidden_size": 48, "projection_dim": 40},
             "unet": {**_SDXL_UNET, "sample_size": 32, "layers_per_block": 1, "block_out_channels": [32, 64],
                      "attention_head_dim": [2, 4], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                      "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "transformer_layers_per_block": [1, 2],
                      "cross_attention_dim": 80, "addition_time_embed_dim": 8,
                      "projection_class_embeddings_input_dim": 40 + 6 * 8},
             "scheduler": _SDXL_SCHEDULER},
    "flux": {"vae": {**_FLUX_VAE, **_TINY_VAE}, "text_encoder": {**_CLIP_L, **_TINY_CLIP},
             "text_encoder_2": {**_T5_XXL, "d_model": 48, "d_ff": 64, "d_kv": 16, "num_heads": 3, "num_layers": 2,
                                "vocab_size": 1000},
             "transformer": {**_FLUX_TRANSFORMER, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                             "num_attention_heads": 2, "joint_attention_dim": 48, "pooled_projection_dim": 32,
                             "axes_dims_rope": [4, 6, 6]},
             "scheduler": _FLUX_SCHEDULER},
}  # fmt: skip
_PIPELINES = {"sdxl": "StableDiffusionXLPipeline", "flux": "FluxPipeline"}

# the other models the check measures, (real, tiny): facebook/dinov2-base (REPA features, 224 crop as its
# processor), openai/clip-vit-large-patch14's vision tower (annotate's embedding), Wan 2.1's VAE (diffusers'
# AutoencoderKLWan defaults are Wan2.1-T2V's vae/config.json)
_DINOV2_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                "patch_size": 14, "image_size": 518, "crop": 224}
_CLIP_L14 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
             "patch_size": 14, "image_size": 224, "projection_dim": 768}
VISION: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dinov2": (_DINOV2_BASE, {**_DINOV2_BASE, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                              "intermediate_size": 64, "patch_size": 8, "image_size": 64, "crop": 32}),
    "clip-vision": (_CLIP_L14, {**_CLIP_L14, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "patch_size": 8, "image_size": 32, "projection_dim": 32}),
    "wan-vae": ({"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                 "temperal_downsample": [False, True, True]},
                {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
                 "temperal_downsample": [False, True, True]}),
}  # fmt: skip


def build_vision(kind: str, folder: str | os.PathLike, config: dict[str, Any], *, device: str = "cpu") -> Path:
    """A random-weight ``kind`` (a key of :data:`VISION`) saved with ``save_pretrained`` in bf16, as its loader
    reads it: ``dinov2`` (``Dinov2Model`` + ``BitImageProcessor``), ``clip-vision``
    (``CLIPVisionModelWithProjection`` + ``CLIPImageProcessor``), ``wan-vae`` (``AutoencoderKLWan``). A folder
    already complete is kept."""
    import torch

    target = Path(folder)
    if (target / "config.json").exists():
        return target
    torch.manual_seed(0)
    config = dict(config)
    with torch.device(device):
        if kind == "dinov2":
            from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

            crop = config.pop("crop")
            model = Dinov2Model(Dinov2Config(**config))
            BitImageProcessor(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop},
                              image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(target)
        elif kind == "clip-vision":
            from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

            model = CLIPVisionModelWithProjection(CLIPVisionConfig(**config))
            size = config["image_size"]
            CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}
                               ).save_pretrained(target)  # fmt: skip
        else:
            from diffusers import AutoencoderKLWan

            model = AutoencoderKLWan(**config)
    model.to(torch.bfloat16).save_pretrained(target)
    return target


def _clip(config: dict[str, Any], tokenizer, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = tokenizer.get_vocab()
    ids = {"bos_token_id": vocab[tokenizer.bos_token], "eos_token_id": vocab[tokenizer.eos_token],
           "pad_token_id": vocab[tokenizer.pad_token]}  # the tokenizer's, so CLIP pools at its end token
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(**config, **ids))


def _model(family: str, part: str, config: dict[str, Any], tokenizer=None):
    """One random-weight component, in fp32, on the current default device."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel, UNet2DConditionModel
    from transformers import T5Config, T5EncoderModel

    if part == "vae":
        return AutoencoderKL(**config)
    if part == "text_encoder":
        return _clip(config, tokenizer, projection=False)
    if part == "text_encoder_2" and family == "sdxl":
        return _clip(config, tokenizer, projection=True)
    if part == "text_encoder_2":
        t5 = T5EncoderModel(T5Config(**config, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
        t5.tie_weights()  # transformers 5.0 leaves the encoder's embedding a second copy of `shared` until asked
        return t5
    if part == "unet":
        return UNet2DConditionModel(**config)
    return FluxTransformer2DModel(**config)


def build_folder(family: str, folder: str | os.PathLike, configs: dict[str, dict[str, Any]], *,
                 device: str = "cpu") -> Path:  # fmt: skip
    """Write ``family``'s diffusers pipeline folder with random weights of ``configs`` (``REAL[family]`` or
    ``TINY[family]``) to ``folder``, each model initialised on ``device`` (cuda: seconds instead of minutes
    at real sizes) and saved in bf16 (half the bytes to write and read; the loaders cast it back).
    Returns the folder; a folder already complete is kept."""
    import torch
    from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    from pipeline.embed.families.tiny import clip_tokenizer, t5_tokenizer

    target = Path(folder)
    if (target / "model_index.json").exists():
        return target
    torch.manual_seed(0)
    tokenizers = {"tokenizer": clip_tokenizer(),
                  "tokenizer_2": clip_tokenizer(pad_token="!") if family == "sdxl" else t5_tokenizer(512)}
    for name, tok in tokenizers.items():
        tok.save_pretrained(target / name)
    for part, config in configs.items():
        if part == "scheduler":
            cls = EulerDiscreteScheduler if family == "sdxl" else FlowMatchEulerDiscreteScheduler
            cls(**config).save_pretrained(target / part)
            continue
        tok = tokenizers.get(part.replace("text_encoder", "tokenizer"))
        with torch.device(device):
            model = _model(family, part, config, tok)
        model.to(torch.bfloat16).save_pretrained(target / part)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    (target / "model_index.json").write_text(json.dumps(_model_index(family, configs, tokenizers), indent=1) + "\n")
    return target


def _model_index(family: str, configs: dict[str, Any], tokenizers: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's ``model_index.json`` as ``save_pretrained`` writes it: each component's library and class
    (``DiffusionPipeline.from_pretrained`` reads them; a component passed as ``None`` is not loaded)."""
    import diffusers

    classes = {"vae": ("diffusers", "AutoencoderKL"), "text_encoder": ("transformers", "CLIPTextModel"),
               "text_encoder_2": ("transformers", "CLIPTextModelWithProjection" if family == "sdxl"
                                  else "T5EncoderModel"),
               "unet": ("diffusers", "UNet2DConditionModel"),
               "transformer": ("diffusers", "FluxTransformer2DModel"),
               "scheduler": ("diffusers", "EulerDiscreteScheduler" if family == "sdxl"
                             else "FlowMatchEulerDiscreteScheduler")}  # fmt: skip
    index: dict[str, Any] = {"_class_name": _PIPELINES[family], "_diffusers_version": diffusers.__version__}
    for part in configs:
        index[part] = list(classes[part])
    for name, tok in tokenizers.items():
        index[name] = ["transformers", type(tok).__name__]
    if family == "sdxl":
        index["force_zeros_for_empty_prompt"] = True
    return index


def make_jpegs(root: str | os.PathLike, n: int, size: tuple[int, int], distinct: int = 16) -> list[str]:
    """``n`` photo-like JPEGs of ``size`` (w, h) under ``root`` (``distinct`` different images, repeated:
    decoding costs the same). Returns the file names."""
    from PIL import Image

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(0)
    blobs = []
    for i in range(min(distinct, n)):
        # smooth gradients + mild noise: photo-like compressibility (and decode cost), unlike pure noise
        base = np.stack([(xx * (i % 7 + 1)) % 256, (yy * (i % 5 + 1)) % 256, (xx + yy + 17 * i) % 256], -1)
        img = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        blobs.append(buf.getvalue())
    names = [f"img_{i:05d}.jpg" for i in range(n)]
    for i, name in enumerate(names):
        (root / name).write_bytes(blobs[i % len(blobs)])
    return names


def write_jpeg_manifest(root: str, manifest: str, names: list[str], size: tuple[int, int], bucket: tuple[int, int],
                        captions: int) -> None:  # fmt: skip
    """The manifest of ``names`` (all ``size``), every image in the one ``bucket`` (w, h), with ``captions``
    distinct captions of ~40 words spread over the images (a caption is embedded once)."""
    import pyarrow as pa

    from manifests.buckets import BucketSpec
    from manifests.manifest import apply_buckets, write_manifest
    from manifests.schema import ERRORS_SCHEMA, sample_ids

    words = "a photo of a red cat on a blue chair near the window in soft morning light with plants".split()
    texts = [" ".join(words[(i + k) % len(words)] for k in range(40)) + f" number {i}" for i in range(captions)]
    n = len(names)
    table = pa.table({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
                      "width": pa.array([size[0]] * n, pa.int32()), "height": pa.array([size[1]] * n, pa.int32()),
                      "caption": [texts[i % captions] for i in range(n)],
                      "size": pa.array([0] * n, pa.int64())})  # fmt: skip
    spec = BucketSpec(buckets=(bucket,))
    samples, _ = apply_buckets(table, spec)
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=spec)
