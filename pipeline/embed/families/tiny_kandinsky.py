"""Tiny random-weight Kandinsky 5 pipelines (the real classes, a few dozen channels wide).

- ``kandinsky-5``: ``Kandinsky5T2IPipeline``: a ``Qwen2_5_VLForConditionalGeneration`` (:func:`.tiny_qwen.qwen_vl`:
  text 40 wide, 2 layers) with a ``Qwen2Tokenizer`` trained here on Kandinsky's two templates, so that each system
  prefix is, as in the real vocabulary, exactly the tokens the pipeline drops (40 for T2I, 128 for T2V); a
  ``CLIPTextModel`` (32 wide) and the tiny CLIP tokenizer of :mod:`.tiny`; a ``Kandinsky5Transformer3DModel`` (model
  width 32, heads of 16 = axes 4 + 6 + 6, 1 text block, 2 visual blocks, patch (1, 2, 2); its modulations, which
  the class zero-initialises, drawn at random so that the text and every block act); FLUX.1's VAE layout
  (:func:`.tiny._vae`: 16 channels, ``scaling_factor`` 0.3611, ``shift_factor`` 0.1159, which the pipeline does not
  apply); ``FlowMatchEulerDiscreteScheduler`` with a fixed ``shift`` 3.0.
- ``kandinsky-5-video``: ``Kandinsky5T2VPipeline``: the same text models (seeded apart), a transformer with
  ``visual_cond`` (input ``2 C + 1`` channels: latents, the zero condition, its zero mask, as the pipeline feeds
  it), an ``AutoencoderKLHunyuanVideo`` (HunyuanVideo 1.0's layout: 8x spatial, 4x temporal causal, 16 channels,
  ``scaling_factor`` 0.476986, base width 8), fixed ``shift`` 5.0.

The tokenizer is saved as a ``Qwen2Tokenizer`` (the hub's folders name a ``Qwen2VLProcessor``, which transformers
5 cannot build without torchvision; for text its ``__call__`` and ``decode`` are the tokenizer's).
"""

from __future__ import annotations

__all__ = ["LATENT_CHANNELS", "kandinsky_tokenizer", "kandinsky5", "kandinsky5_video"]

LATENT_CHANNELS = 16  # FLUX.1's and HunyuanVideo's VAEs
# words of the T2V template Qwen2.5's vocabulary splits in two (Ġdynam|ism, Ġscre|n, Ġpost|processing)
UNMERGED = ("Ġdynamism", "Ġscren", "Ġpostprocessing")


def kandinsky_tokenizer():
    """A ``Qwen2Tokenizer`` (byte-level BPE, Qwen2's pre-tokenizer) trained on Kandinsky 5's templates."""
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from pipeline.embed.families.kandinsky5 import T2I, T2V
    from pipeline.embed.families.tiny_qwen import SPECIAL, WORDS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator([T2I.text.format(""), T2V.text.format(""), WORDS], trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    merges = [m for m in merges if "".join(m) not in UNMERGED]  # two tokens each in the real vocabulary
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL[1:])})
    return tokenizer


def _text_models():
    from pipeline.embed.families.tiny import CLIP_L, _clip, clip_tokenizer
    from pipeline.embed.families.tiny_qwen import qwen_vl

    tokenizer, tokenizer_2 = kandinsky_tokenizer(), clip_tokenizer()
    return {"text_encoder": qwen_vl(tokenizer), "tokenizer": tokenizer,
            "text_encoder_2": _clip(tokenizer_2, CLIP_L, projection=None), "tokenizer_2": tokenizer_2}  # fmt: skip


def _transformer(visual_cond: bool):
    from diffusers import Kandinsky5Transformer3DModel

    from pipeline.embed.families.tiny import CLIP_L
    from pipeline.embed.families.tiny_qwen import QWEN_WIDTH

    import torch

    model = Kandinsky5Transformer3DModel(
        in_visual_dim=LATENT_CHANNELS, out_visual_dim=LATENT_CHANNELS, in_text_dim=QWEN_WIDTH, in_text_dim2=CLIP_L,
        time_dim=24, patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2,
        axes_dims=(4, 6, 6), visual_cond=visual_cond,
    )  # fmt: skip
    # the class zero-initialises every modulation (gates 0: each block the identity, the text without effect, as a
    # model before training); a trained model's are not, so the tiny one's are drawn too
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modulation" in name:
                param.normal_(0.0, 0.2)
    return model


def kandinsky5():
    """The tiny ``Kandinsky5T2IPipeline`` (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline

    from pipeline.embed.families.tiny import _vae

    return Kandinsky5T2IPipeline(transformer=_transformer(False), vae=_vae(LATENT_CHANNELS, 0.3611, 0.1159, False),
                                 scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **_text_models())  # fmt: skip


def kandinsky5_video():
    """The tiny ``Kandinsky5T2VPipeline`` (see the module docstring)."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline

    vae = AutoencoderKLHunyuanVideo(latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 16, 16),
                                    layers_per_block=1, norm_num_groups=4, scaling_factor=0.476986)  # fmt: skip
    return Kandinsky5T2VPipeline(transformer=_transformer(True), vae=vae,
                                 scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), **_text_models())  # fmt: skip
