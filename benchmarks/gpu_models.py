"""Random-weight model folders of the real architectures, and a local JPEG dataset, for ``gpu_check.py``.

Nothing is downloaded: every model is built from a config written here and saved with
``save_pretrained`` as the diffusers pipeline folder the embed job and the trainer load
(``--family F --model FOLDER``). ``REAL`` holds the published configs (values as in the hub's
``config.json`` files of stabilityai/stable-diffusion-xl-base-1.0, black-forest-labs/FLUX.1-dev and
google/t5-v1_1-xxl; the VAEs' and T5's in :mod:`benchmarks.real_configs`), ``TINY`` the same classes shrunk
so that ``--smoke`` runs every line of this module on a CPU in seconds. Weights are random: the numbers are
noise, the shapes and the FLOPs are real.

- ``sdxl``: ``AutoencoderKL`` (4 latent channels), ``CLIPTextModel`` (CLIP-L, 768 x 12 layers),
  ``CLIPTextModelWithProjection`` (CLIP-bigG, 1280 x 32 layers, projection 1280),
  ``UNet2DConditionModel`` (2.57B parameters), the Euler scheduler config.
- ``flux``: ``AutoencoderKL`` (16 channels, shift), CLIP-L, ``T5EncoderModel`` (T5-XXL, 4096 x 24
  layers, 4.76B), ``FluxTransformer2DModel`` at Flux's width (24 heads x 128 = 3072, joint attention
  4096, pooled 768, guidance embedding) with **4 double-stream and 8 single-stream blocks** instead of
  19 and 38 (2.5B of 11.9B parameters): the full model with AdamW (16 bytes per parameter: fp32 weights,
  gradients and two moments) needs ~190 GB, more than one 80 GB GPU; these 12 blocks train in ~40 GB
  plus activations, so every block and kernel shape of Flux runs, 12/57 of the depth.

- the encoder families (:data:`ENCODER_FAMILIES`: ``flux2``, ``flux2-klein``, ``chroma``, ``qwen-image``,
  ``qwen-image-edit``, ``z-image``, and those of mid-2026: ``anima``, ``ernie-image``, ``krea-2``,
  ``longcat-image``, ``kandinsky-5``, ``qwen-image-2.1``): their text models and VAE only
  (:func:`build_encoders_folder`), at the published sizes of :mod:`benchmarks.real_configs` (Mistral Small 3.1
  24B, Qwen3-4B, T5-XXL, Qwen2.5-VL-7B, Ministral 3 3B, Qwen3-VL-4B and -8B, Qwen3-0.6B with Anima's LLM adapter,
  Kandinsky 5's CLIP-L; ``AutoencoderKLFlux2``, Flux.1's VAE, ``AutoencoderKLQwenImage``,
  ``AutoencoderKLQwenImage21``), built straight in bf16 (24B in fp32 would not fit one GPU) into the family's tiny
  pipeline in place of its tiny ones, the denoiser left out.

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

from benchmarks.real_configs import (ANIMA_TEXT_CONDITIONER, FLUX1_VAE, MINISTRAL3_3B_TEXT, MISTRAL_SMALL_31, QWEN3_06B,
                                     QWEN3_4B, QWEN3_VL_4B, QWEN3_VL_8B, QWEN_IMAGE21_VAE, QWEN_VL_7B, SDXL_VAE, T5_XXL)
from manifests.families import SPECS

__all__ = ["REAL", "TINY", "VISION", "build_folder", "build_vision", "make_jpegs", "write_jpeg_manifest",
           "FLUX_BLOCKS", "ENCODER_FAMILIES", "TEXT_NAMES", "real_encoders", "real_text_parts", "text_tokenizer",
           "encoders_bytes", "build_encoders_folder"]  # fmt: skip

FLUX_BLOCKS = (4, 8)  # double-stream, single-stream blocks of the Flux-width transformer (real: 19, 38)

_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
           "projection_dim": 768, "hidden_act": "quick_gelu", "vocab_size": 49408, "max_position_embeddings": 77}
_CLIP_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
           "projection_dim": 1280, "hidden_act": "gelu", "vocab_size": 49408, "max_position_embeddings": 77}
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
    "sdxl": {"vae": SDXL_VAE, "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_G, "unet": _SDXL_UNET,
             "scheduler": _SDXL_SCHEDULER},
    "flux": {"vae": FLUX1_VAE, "text_encoder": _CLIP_L, "text_encoder_2": T5_XXL, "transformer": _FLUX_TRANSFORMER,
             "scheduler": _FLUX_SCHEDULER},
}  # fmt: skip

_TINY_VAE = {"block_out_channels": [8, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 8, "sample_size": 64}
_TINY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "projection_dim": 32, "vocab_size": 1000}
TINY: dict[str, dict[str, dict[str, Any]]] = {
    "sdxl": {"vae": {**SDXL_VAE, **_TINY_VAE}, "text_encoder": {**_CLIP_L, **_TINY_CLIP},
             "text_encoder_2": {**_CLIP_G, **_TINY_CLIP, "hidden_size": 48, "projection_dim": 40},
             "unet": {**_SDXL_UNET, "sample_size": 32, "layers_per_block": 1, "block_out_channels": [32, 64],
                      "attention_head_dim": [2, 4], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                      "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "transformer_layers_per_block": [1, 2],
                      "cross_attention_dim": 80, "addition_time_embed_dim": 8,
                      "projection_class_embeddings_input_dim": 40 + 6 * 8},
             "scheduler": _SDXL_SCHEDULER},
    "flux": {"vae": {**FLUX1_VAE, **_TINY_VAE}, "text_encoder": {**_CLIP_L, **_TINY_CLIP},
             "text_encoder_2": {**T5_XXL, "d_model": 48, "d_ff": 64, "d_kv": 16, "num_heads": 3, "num_layers": 2,
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


# ---------------------------------------------------------------- families measured by their encoders alone

# smallest first (what `--families all` runs in this order, so that a cut budget loses the largest)
ENCODER_FAMILIES = ("anima", "ernie-image", "chroma", "z-image", "flux2-klein", "krea-2", "longcat-image", "qwen-image",
                    "qwen-image-edit", "kandinsky-5", "qwen-image-2.1", "flux2")
# ERNIE-Image's Pixtral tower (Ministral 3 3B's), which the family never runs: its config was not found
# (benchmarks/real_configs.py), so transformers' default PixtralVisionConfig (1024 wide, 24 layers: 0.40B) stands in
# for it (with its 0.02B projector); it counts in the folder's bytes and the GPU memory check, never in a row's time
ERNIE_VISION: dict[str, Any] = {}
# what the text rows call each family's text encoder (real size): manifests/families (FamilySpec.sizes)
TEXT_NAMES = {name: spec.sizes.text_name for name, spec in SPECS.items() if spec.sizes is not None}


def real_encoders(family: str, tokenizer) -> tuple[Any, Any]:
    """``(text encoder, VAE)`` of ``family`` (one of :data:`ENCODER_FAMILIES`) at the published sizes
    (:mod:`benchmarks.real_configs`), random weights, built on the current default device in the current default
    dtype: the classes the family's pipeline loads (Mistral 3 with its Pixtral tower, Qwen2.5-VL and Qwen3-VL with
    their vision towers and, where the pipeline loads one, ``lm_head``). Special-token ids are ``tokenizer``'s
    (:func:`text_tokenizer` of the tiny pipeline, whose ids all lie inside the real vocabularies): Qwen2.5-VL finds
    the reference image's tokens by them. The family's other text models: :func:`real_text_parts`."""
    import diffusers
    import transformers as tf

    if family == "flux2":
        image = tokenizer.convert_tokens_to_ids("[IMG]")
        text = tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(**{**MISTRAL_SMALL_31,
                                                                         "image_token_index": image}))
        return text, diffusers.AutoencoderKLFlux2()
    if family == "flux2-klein":
        return _tied(tf.Qwen3ForCausalLM(tf.Qwen3Config(**QWEN3_4B))), diffusers.AutoencoderKLFlux2()
    if family == "z-image":
        return tf.Qwen3Model(tf.Qwen3Config(**QWEN3_4B)), diffusers.AutoencoderKL(**FLUX1_VAE)
    if family == "chroma":
        return _model("flux", "text_encoder_2", T5_XXL), diffusers.AutoencoderKL(**FLUX1_VAE)
    if family in ("qwen-image", "qwen-image-edit", "longcat-image", "kandinsky-5"):  # Kandinsky's CLIP-L: parts
        text = tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(**QWEN_VL_7B, **_vision_ids(tokenizer)))
        flux1 = family in ("longcat-image", "kandinsky-5")
        return text, diffusers.AutoencoderKL(**FLUX1_VAE) if flux1 else diffusers.AutoencoderKLQwenImage()
    if family == "qwen-image-2.1":  # the pipeline loads Qwen3-VL-8B with its (untied) lm_head
        text = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(**{**QWEN3_VL_8B, **_vision_ids(tokenizer)}))
        return text, diffusers.AutoencoderKLQwenImage21(**QWEN_IMAGE21_VAE)
    if family == "krea-2":
        text = tf.Qwen3VLModel(tf.Qwen3VLConfig(**{**QWEN3_VL_4B, **_vision_ids(tokenizer)}))
        return text, diffusers.AutoencoderKLQwenImage()
    if family == "ernie-image":
        config = tf.Mistral3Config(text_config=MINISTRAL3_3B_TEXT, vision_config=tf.PixtralVisionConfig(**ERNIE_VISION),
                                   image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))  # fmt: skip
        return tf.Mistral3Model(config), diffusers.AutoencoderKLFlux2()
    if family == "anima":  # Qwen3-0.6B(-Base) without lm_head; the LLM adapter: real_text_parts
        return tf.Qwen3Model(tf.Qwen3Config(**QWEN3_06B)), diffusers.AutoencoderKLQwenImage()
    raise ValueError(f"no real-size encoders for family {family!r}: {ENCODER_FAMILIES}")


def real_text_parts(family: str, pipe) -> dict[str, Any]:
    """The text models of ``family`` beside its text encoder, at the published sizes, by pipeline component (built
    as :func:`real_encoders` builds): Anima's LLM adapter (``text_conditioner``, run at embed), Kandinsky 5's CLIP-L
    (``text_encoder_2``, its special-token ids those of ``pipe``'s ``tokenizer_2``); {} for the others."""
    if family == "kandinsky-5":
        return {"text_encoder_2": _clip(_CLIP_L, pipe.tokenizer_2, projection=False)}
    if family != "anima":
        return {}
    from diffusers import AnimaTextConditioner

    return {"text_conditioner": AnimaTextConditioner(**ANIMA_TEXT_CONDITIONER)}


def _vision_ids(tokenizer) -> dict[str, int]:
    """Qwen2.5-VL's and Qwen3-VL's image and video token ids, as ``tokenizer`` numbers them."""
    return {f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{token}|>") for name, token in
            (("image", "image_pad"), ("video", "video_pad"), ("vision_start", "vision_start"),
             ("vision_end", "vision_end"))}  # fmt: skip


def text_tokenizer(pipe):
    """The tokenizer of ``pipe``'s text encoder: its ``tokenizer``, or its processor's (Qwen-Image 2.1 has only a
    processor)."""
    tokenizer = getattr(pipe, "tokenizer", None)
    return tokenizer if tokenizer is not None else pipe.processor.tokenizer


def _tied(model):
    """``model`` with its tied embeddings tied: transformers 5.0 leaves Qwen3-4B's ``lm_head`` a second matrix
    when built on the meta device (later releases tie it in ``__init__``)."""
    model.tie_weights()
    return model


def encoders_bytes(family: str) -> int:
    """Bytes of ``family``'s real-size text models and VAE in bf16 (counted on the meta device): its folder."""
    import torch

    from pipeline.embed.families.tiny import tiny_pipeline
    from pipeline.embed.memory import parameter_count

    pipe = tiny_pipeline(family)
    with torch.device("meta"):
        models = (*real_encoders(family, text_tokenizer(pipe)), *real_text_parts(family, pipe).values())
        return 2 * sum(parameter_count(m) for m in models)


def build_encoders_folder(family: str, folder: str | os.PathLike, *, real: bool, device: str = "cpu") -> Path:
    """``family``'s diffusers pipeline folder without its denoiser (the rows of :data:`ENCODER_FAMILIES` need none:
    ``model_index.json`` says ``transformer: [null, null]``, and ``DiffusionPipeline.from_pretrained`` loads the
    rest; Anima's ``modular_model_index.json`` the same): the family's tiny pipeline
    (:func:`pipeline.embed.families.tiny.tiny_pipeline`: its tokenizers, scheduler and processor), with ``real``:
    its text encoder and VAE replaced by :func:`real_encoders` (and its other text models by
    :func:`real_text_parts`) built in bf16 on ``device`` (cuda: 24B parameters in seconds; fp32 would not fit one
    GPU); saved in bf16. A folder already complete is kept."""
    import torch

    from pipeline.embed.families.tiny import save_pipeline, tiny_pipeline

    target = Path(folder)
    if (target / "model_index.json").exists() or (target / "modular_model_index.json").exists():
        return target
    pipe = tiny_pipeline(family)
    replace = getattr(pipe, "update_components", None) or pipe.register_modules  # a ModularPipeline's, or not
    replace(transformer=None)
    if real:
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                text, vae = real_encoders(family, text_tokenizer(pipe))
                parts = real_text_parts(family, pipe)
        finally:
            torch.set_default_dtype(default)
        replace(text_encoder=text, vae=vae, **parts)
    pipe.to(dtype=torch.bfloat16)
    save_pipeline(pipe, target)
    if device == "cuda":
        del pipe
        torch.cuda.empty_cache()
    return target


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
