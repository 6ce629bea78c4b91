"""A tiny random-weight ERNIE-Image pipeline: the real classes, a few dozen channels wide.

What :func:`pipeline.embed.families.tiny.build_tiny` writes for ``ernie-image``: an ``ErnieImagePipeline``
(``d/pipelines/ernie_image/pipeline_ernie_image.py:58-77``, diffusers 0.42.1) of

- ``text_encoder``: a ``Mistral3Model`` (Ministral 3's class): a 1-layer Pixtral vision tower and a 4-layer
  ``Ministral3Model`` language model 48 wide with Ministral 3's YaRN rope and its Llama-4 attention scaling (the
  real one: 26 layers, 3072 wide), so that ``hidden_states[-2]`` is an intermediate layer's output;
- ``tokenizer``: the byte-level BPE with Mistral's special tokens of :mod:`.tiny_flux2`, which adds no ``<s>``
  (an empty caption tokenizes to nothing, and the pipeline feeds ``[bos]`` instead: ``:152-156``);
- ``transformer``: an ``ErnieImageTransformer2DModel`` 32 wide (2 heads of 16, rope axes 4/6/6), 2 layers, taking
  the 128 channels of 2x2-patchified latents and 48-wide text; the adaLN modulation and the output projection,
  which the class initialises to zero (a fresh model predicts 0), drawn at random so that outputs differ;
- ``vae``: the ``AutoencoderKLFlux2`` of :mod:`.tiny_flux2` (32 latent channels, random batch-norm statistics,
  its config's ``batch_norm_eps`` 1e-4 as FLUX.2's and ERNIE's configs say, which ERNIE's pipeline does not read);
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with ERNIE's published fixed ``shift`` 4.0, no dynamic
  shifting; no prompt enhancer (``pe``, ``pe_tokenizer``: optional, inference only).
"""

from __future__ import annotations

__all__ = ["ernie_image", "TEXT_WIDTH", "TEXT_LAYERS"]

TEXT_WIDTH, TEXT_LAYERS = 48, 4
SHIFT = 4.0  # baidu/ERNIE-Image scheduler/scheduler_config.json


def _ministral3(tokenizer):
    """``Mistral3Model`` with a ``ministral3`` text model: Ministral 3's rope (YaRN, Llama-4 scaling), shrunk."""
    from transformers import Ministral3Config, Mistral3Config, Mistral3Model, PixtralVisionConfig

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 256,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    text = Ministral3Config(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=64,
                            num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                            max_position_embeddings=4096, sliding_window=None, rope_parameters=rope,
                            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=56, patch_size=14)  # fmt: skip
    config = Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))  # fmt: skip
    return Mistral3Model(config)


def _transformer():
    import torch
    from diffusers import ErnieImageTransformer2DModel

    model = ErnieImageTransformer2DModel(hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64,
                                         in_channels=128, out_channels=128, patch_size=1, text_in_dim=TEXT_WIDTH,
                                         rope_theta=256, rope_axes_dim=(4, 6, 6))  # fmt: skip
    with torch.no_grad():  # zero at init in the class: a trained model's are not
        for layer in (model.adaLN_modulation[-1], model.final_linear):
            layer.weight.normal_(0.0, 0.05)
            layer.bias.normal_(0.0, 0.05)
    return model


def ernie_image():
    """The tiny ``ErnieImagePipeline`` (see the module docstring); seeded by the caller."""
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    from pipeline.embed.families.tiny_flux2 import _flux2_vae, mistral_tokenizer

    tok = mistral_tokenizer()
    return ErnieImagePipeline(transformer=_transformer(), vae=_flux2_vae(), text_encoder=_ministral3(tok),
                              tokenizer=tok, scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT))  # fmt: skip
