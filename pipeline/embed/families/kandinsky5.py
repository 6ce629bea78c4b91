"""Kandinsky 5 (``kandinsky-5`` images, ``kandinsky-5-video`` clips): Qwen2.5-VL's last hidden states of the
caption in the pipeline's template (prefix dropped, real rows), and CLIP-L's pooled output.

Mirrors ``Kandinsky5T2IPipeline.encode_prompt`` (diffusers 0.42.1, ``pipeline_kandinsky_t2i.py:289-370``) and
``Kandinsky5T2VPipeline.encode_prompt`` (``pipeline_kandinsky.py``), which run, per caption:

- the caption through the pipeline's own ``prompt_clean`` (Wan's: ftfy when installed, HTML unescape, whitespace;
  ``:350``), used by both encoders;
- stream 1 (``_encode_prompt_qwen``, ``:185-251``): the caption in the pipeline's template (T2I: a system message
  asking to describe the image, then the caption as the user turn, closed by ``<|im_end|>``, **no assistant turn**,
  ``:178``; T2V: a 7-line video system message, ``pipeline_kandinsky.py:189-201``), tokenized; a caption longer
  than ``drop + max_sequence_length`` tokens is first cut **by text**: the tokens past the limit are decoded and
  that many characters removed from the end of the templated text (``:212-227``), then it is tokenized with
  ``max_length = drop + max_sequence_length`` and truncation (``:229-236``); Qwen2.5-VL runs **without** an
  attention mask (``:238-242``) and ``hidden_states[-1][drop:]`` is kept: T2I drops 40 (``:179``), T2V 128, the
  system prefix and the user turn's opening, so what remains is the caption's tokens and ``<|im_end|>``.
  ``max_sequence_length`` is 512 (``__call__``'s and ``encode_prompt``'s default), at most 1024 (``check_inputs``);
- pooled (``_encode_prompt_clip``, ``:253-287``): CLIP-L on the cleaned caption padded to 77, with its attention
  mask, ``pooler_output``.

The transformer takes no text mask (``transformer_kandinsky.py:593-605``) and ``text_rope_pos = arange(longest
caption)`` (``:698-704``): in a batch of captions of different lengths the pipeline feeds the shorter ones' pad
rows. A caption alone has none, and its real rows do not depend on padding (right padding, causal attention), so
the cache stores each caption's real rows (a masked layout) and the recipe feeds each caption's rows unpadded
(:mod:`train.recipes.kandinsky5`): what ``encode_prompt([caption])`` gives. Captions are encoded in groups of equal
token count (no padding at all), so a record does not depend on the captions beside it.

The text encoder is loaded as ``Qwen2_5_VLModel`` (the pipeline's ``Qwen2_5_VLForConditionalGeneration`` without
its ``lm_head``): the same hidden states. The tokenizer folder holds a ``Qwen2VLProcessor`` in the hub's folders;
for text its ``__call__`` and ``decode`` are its tokenizer's, which is what is loaded.

The latents: ``Kandinsky5T2IPipeline`` decodes ``latents / scaling_factor`` (``:804``) with FLUX.1's VAE and its
image-to-image sibling encodes ``latent_dist.sample() * scaling_factor`` (``pipeline_kandinsky_i2i.py:538-543``):
**no** ``shift_factor``, although the VAE's config has one. The family declares it (``Vae.normalise``
``"scale_no_shift"``, manifests/families/recent.py), the latent encoder records ``shift_factor`` null
(:mod:`pipeline.embed.latents`) and the loader multiplies by ``scaling_factor`` only. The video pipeline's
``AutoencoderKLHunyuanVideo`` has no shift.
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared
from pipeline.embed.families.qwen_image import pad_parts

__all__ = ["FAMILY", "VIDEO", "TOKENS", "LIMIT", "T2I", "T2V", "Template", "vae_description", "vae_latents"]

TOKENS = 512  # __call__'s and encode_prompt's max_sequence_length
LIMIT = 1024  # check_inputs: max_sequence_length must be at most 1024
CLIP_TOKENS = 77  # _encode_prompt_clip's max_length


class Template:
    """A pipeline's prompt template and the tokens ``_encode_prompt_qwen`` drops (its system prefix and the user
    turn's opening: ``prompt_template_encode_start_idx``)."""

    def __init__(self, text: str, drop: int):
        self.text, self.drop = text, drop


# Kandinsky5T2IPipeline.prompt_template / prompt_template_encode_start_idx (pipeline_kandinsky_t2i.py:178-179)
T2I = Template("<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape, "
               "size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
               "<|im_start|>user\n{}<|im_end|>", 40)  # fmt: skip
# Kandinsky5T2VPipeline.prompt_template / prompt_template_encode_start_idx (pipeline_kandinsky.py:189-201)
T2V = Template("\n".join([
    "<|im_start|>system\nYou are a prompt engineer. Describe the video in detail.",
    "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
    "Describe the location of the video, main characters or objects and their action.",
    "Describe the dynamism of the video and presented actions.",
    "Name the visual style of the video: whether it is a professional footage, user generated content, some kind of "
    "animation, video game or scren content.",
    "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
    "Pay attention to the order of key actions shown in the scene.<|im_end|>",
    "<|im_start|>user\n{}<|im_end|>",
]), 128)  # fmt: skip


def clean(caption: str) -> str:
    """The pipeline's ``prompt_clean`` (``encode_prompt`` cleans every caption before both encoders)."""
    from diffusers.pipelines.kandinsky5.pipeline_kandinsky_t2i import prompt_clean

    return prompt_clean(caption)


def cut(tokenizer: Any, text: str, template: Template, max_tokens: int) -> str:
    """The templated ``text`` of one caption as ``_encode_prompt_qwen`` shortens it before tokenizing (a batch of
    one: no pad among its tokens): past ``drop + max_tokens`` tokens, the decoded tokens from caption token
    ``max_tokens - 2`` to the last but two are removed as characters from the end of the text (``:212-227``)."""
    ids = tokenizer(text=[text], return_tensors="pt", padding="longest")["input_ids"]
    if ids.shape[-1] <= template.drop + max_tokens:
        return text
    removed = tokenizer.decode(ids[0][template.drop : -2][max_tokens - 2 :])
    return text[: -len(removed)] if len(removed) > 0 else text


def qwen_rows(qwen: TextModel, captions: list[str], template: Template, max_tokens: int) -> list[Any]:
    """Per cleaned caption, its ``(L, D)`` rows: ``hidden_states[-1][drop:]`` of Qwen2.5-VL run without a mask on
    the cut, templated caption; captions of equal token count run as one batch (no padding)."""
    texts = [cut(qwen.tokenizer, template.text.format(c), template, max_tokens) for c in captions]
    kwargs = {"max_length": template.drop + max_tokens, "truncation": True}
    lengths = [len(ids) for ids in qwen.tokenizer(text=texts, **kwargs)["input_ids"]]
    out: list[Any] = [None] * len(texts)
    for n in sorted(set(lengths)):
        group = [i for i, k in enumerate(lengths) if k == n]
        enc = qwen.tokenizer(text=[texts[i] for i in group], return_tensors="pt", padding=True, **kwargs)
        hidden = qwen(enc["input_ids"], return_dict=True, output_hidden_states=True)["hidden_states"][-1]
        for i, rows in zip(group, hidden[:, template.drop :]):  # (g, n, D) -> (n - drop, D) each
            out[i] = rows
    return out


def clip_pooled(clip: TextModel, captions: list[str]) -> Any:
    """CLIP-L's ``pooler_output`` ``(B, 768)`` of the cleaned captions padded to 77, run with the mask."""
    enc = clip.tokenizer(captions, max_length=CLIP_TOKENS, truncation=True, add_special_tokens=True,
                         padding="max_length", return_tensors="pt")  # fmt: skip
    return clip(enc["input_ids"], attention_mask=enc["attention_mask"].to(clip.device))["pooler_output"]


def _encoder(template: Template):
    def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
        qwen, clip = models
        cleaned = [clean(c) for c in captions]
        parts = pad_parts(qwen_rows(qwen, cleaned, template, int(options.max_tokens)))
        return PromptParts(parts.parts, rows=parts.rows, pooled=clip_pooled(clip, cleaned))

    return encode


def _layout(name: str):
    def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
        qwen, clip = models
        return TextLayout(family=name, join="features", masked=True, lengths=(int(options.max_tokens),),
                          widths=(int(qwen.model.config.get_text_config().hidden_size),),
                          pooled_dim=int(clip.model.config.hidden_size),
                          pooled_source="pooler_output of text_encoder_2 (CLIP-L)")  # fmt: skip

    return layout


def vae_description(config: Any) -> dict[str, Any]:
    """What ``_cache.json`` records of an ``AutoencoderKLHunyuanVideo`` config (HunyuanVideo 1.0's, Kandinsky 5
    video's): 8x spatial, 4x temporal, the loader multiplies ``scaling_factor`` in (no shift, no statistics)."""
    return {"factor": int(config.spatial_compression_ratio), "channels": int(config.latent_channels),
            "scaling_factor": float(config.scaling_factor), "shift_factor": None,
            "temporal_factor": int(config.temporal_compression_ratio)}  # fmt: skip


def vae_latents(vae: Any, x: Any, std: bool) -> dict[str, Any]:
    """Clips ``(B, 3, F, H, W)`` through an ``AutoencoderKLHunyuanVideo`` one at a time: the posterior mean
    ``(B, C, F', h, w)`` (and its std with ``std``); ``Kandinsky5I2VPipeline`` encodes one image at a time,
    ``latent_dist.sample() * scaling_factor`` (``pipeline_kandinsky_i2v.py:699-703``), the t2v one decodes ``latents
    / scaling_factor``. One at a time because a batch's clips come out 1e-6 apart from each alone (its causal
    mid-block attention over the batch), and a record must not depend on the clips beside it."""
    import torch

    outs = [vae.encode(x[i : i + 1]).latent_dist for i in range(x.shape[0])]
    out = {"latent": torch.cat([p.mean for p in outs]).float()}
    if std:
        out["latent_std"] = torch.cat([p.std for p in outs]).float()
    return out


FAMILY = declared("kandinsky-5", layout=_layout("kandinsky-5"), encode=_encoder(T2I))
VIDEO = declared("kandinsky-5-video", layout=_layout("kandinsky-5-video"), encode=_encoder(T2V))
