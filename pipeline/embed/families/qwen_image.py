"""Qwen-Image: Qwen2.5-VL's last hidden states of the caption in the pipeline's template, prefix dropped, masked.

Mirrors ``QwenImagePipeline._get_qwen_prompt_embeds`` / ``encode_prompt`` (diffusers 0.42): the caption is put
in the pipeline's chat template (a system message asking to describe the image, then the caption as the user
turn, then the assistant turn's opening), tokenized up to ``tokenizer_max_length + drop_idx`` (1024 + 34) tokens
and run through Qwen2.5-VL with the attention mask and ``output_hidden_states=True``; ``hidden_states[-1]`` of
the real tokens is kept, minus the first ``prompt_template_encode_start_idx`` (34) rows: the system prefix
and the user turn's opening. What remains is the caption's tokens and the template's 5 closing tokens
(``<|im_end|>``, ``\\n``, ``<|im_start|>``, ``assistant``, ``\\n``), cut to ``max_sequence_length``: **512 by
default, what ``QwenImagePipeline.__call__`` cuts at unless told otherwise**, so a long caption trains on the rows a
default inference call gives (``encode_prompt``'s own default, 1024, is the most ``check_inputs`` allows:
``--max-text-tokens 1024`` for who runs inference with ``max_sequence_length=1024``). The transformer takes
those rows with a mask, so only they are stored; the trainer pads with zeros and masks (the pipeline's
``prompt_embeds_mask``). Qwen2.5-VL is causal, so the first ``n`` rows of a longer caption are those of its
``n``-token cut: lowering the length cuts, it does not change, the rows kept.

The pipeline pads a batch to its longest prompt, and in fp32 the real rows of a padded prompt differ in the
last bits from the same prompt alone. The cache must not depend on which captions shared a batch, so captions
are encoded in groups of equal token count (no padding at all): each caption's rows equal
``encode_prompt([caption])`` bit for bit, and ``encode_prompt(captions)`` for any batch the pipeline does not
pad. The text encoder is loaded as ``Qwen2_5_VLModel`` (the pipeline's ``Qwen2_5_VLForConditionalGeneration``
without its 0.5B-parameter ``lm_head``, whose logits the pipeline computes and drops): the same hidden states.
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

__all__ = ["FAMILY", "TEMPLATE", "DROP", "TOKENS", "CALL_TOKENS", "NORMALISED", "encode_groups", "vae_description",
           "vae_latents"]

# QwenImagePipeline.tokenizer_max_length: encode_prompt's max_sequence_length, check_inputs' most
TOKENS = spec_of("qwen-image").text.limit  # 1024
# 512: QwenImagePipeline.__call__'s max_sequence_length: what a default inference call keeps
CALL_TOKENS = spec_of("qwen-image").text.max_tokens(None)
DROP = 34  # QwenImagePipeline.prompt_template_encode_start_idx: the template's tokens before the caption
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")  # QwenImagePipeline.prompt_template_encode  # fmt: skip


NORMALISED = "(posterior - latents_mean) / latents_std per channel, at embed: what the denoiser sees"


def vae_description(config: Any) -> dict[str, Any]:
    """What ``_cache.json`` records of an ``AutoencoderKLQwenImage`` config: 8x, ``z_dim`` channels, no scaling
    left to do, and the per-channel statistics the stored latents are normalised with."""
    return {"factor": 2 ** len(config.temperal_downsample), "channels": int(config.z_dim), "scaling_factor": 1.0,
            "shift_factor": None, "normalised": {"latents_mean": [float(x) for x in config.latents_mean],
                                                 "latents_std": [float(x) for x in config.latents_std],
                                                 "how": NORMALISED}}  # fmt: skip


def vae_latents(vae: Any, x: Any, *, std: bool) -> dict[str, Any]:
    """Images ``(B, 3, H, W)`` in [-1, 1] through a Qwen-Image VAE as 1-frame clips: ``{"latent"}`` the posterior
    mode normalised per channel with ``QwenImageEditPipeline._encode_vae_image``'s ops, ``(B, C, h, w)``, and
    with ``std`` ``{"latent_std"}``: the posterior std over ``latents_std`` (a draw ``mean + std * eps``,
    normalised, is the normalised mean plus that std times ``eps``)."""
    import torch

    posterior = vae.encode(x.unsqueeze(2)).latent_dist  # (B, 3, 1, H, W) -> (B, C, 1, h, w)
    mode = posterior.mode()  # retrieve_latents(sample_mode="argmax"): the mean
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(mode.device, mode.dtype)
    scale = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(mode.device, mode.dtype)
    out = {"latent": ((mode - mean) / scale).float()[:, :, 0]}
    if std:
        out["latent_std"] = (posterior.std / scale).float()[:, :, 0]
    return out


def width(model: Any) -> int:
    """The hidden size of a (multimodal) text model: its text config's."""
    return int(model.config.get_text_config().hidden_size)


def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
    (qwen,) = models
    return TextLayout(family="qwen-image", join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(width(qwen.model),))  # fmt: skip


def encode_groups(m: TextModel, texts: list[str], run: Any) -> list[Any]:
    """``run(enc)`` (``enc``: the tokenizer's output for one group) on ``texts`` grouped by token count, each
    group tokenized as the pipelines do (``padding=True``: no pad in a group); per text, its ``(L, D)`` rows."""
    lengths = [len(ids) for ids in m.tokenizer(texts, max_length=TOKENS + DROP, truncation=True).input_ids]
    out: list[Any] = [None] * len(texts)
    for n in sorted(set(lengths)):
        group = [i for i, k in enumerate(lengths) if k == n]
        enc = m.tokenizer([texts[i] for i in group], max_length=TOKENS + DROP, padding=True, truncation=True,
                          return_tensors="pt")  # fmt: skip
        for i, rows in zip(group, run(enc)):
            out[i] = rows
    return out


def pad_parts(rows: list[Any]) -> PromptParts:
    """Per-caption ``(L_i, D)`` rows as one zero-padded ``(B, max L_i, D)`` part with its row counts."""
    import torch

    counts = torch.tensor([r.shape[0] for r in rows])
    part = rows[0].new_zeros(len(rows), int(counts.max()), rows[0].shape[-1])
    for i, r in enumerate(rows):
        part[i, : r.shape[0]] = r
    return PromptParts([part], rows=[counts])


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    (qwen,) = models

    def run(enc: Any) -> list[Any]:
        mask = enc.attention_mask.to(qwen.device)
        hidden = qwen(enc.input_ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]  # (g, L, D)
        return [h[k.bool()][DROP:][: options.max_tokens] for h, k in zip(hidden, mask)]

    return pad_parts(encode_groups(qwen, [TEMPLATE.format(c) for c in captions], run))


FAMILY = declared("qwen-image", layout=layout, encode=encode)
