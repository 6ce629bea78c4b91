"""Wan 2.1 and 2.2 (``wan``, ``wan2.2-a14b``, ``wan2.2-ti2v-5b``): UMT5 with an attention mask, real tokens
only; the transformer sees them zero-padded to 512.

Mirrors ``WanPipeline._get_t5_prompt_embeds`` (diffusers): the caption is cleaned with the pipeline's
own ``prompt_clean`` (ftfy when installed, HTML unescape, whitespace), UMT5 pads to
``max_sequence_length`` (512) and runs **with** the attention mask; the pipeline then keeps the
``seq_len`` real rows of each caption and pads them with zeros back to 512. So only the real tokens
(up to and including ``</s>``) are stored, and the trainer pads with zeros: what the pipeline
feeds ``WanTransformer3DModel`` (it takes no text mask). No pooled embedding.

Wan 2.2 encodes text exactly so (the same ``WanPipeline``); its families differ from ``wan`` in the model and
the VAE: ``wan2.2-a14b`` has two experts (``transformer``, ``transformer_2``, split at the pipeline's
``boundary_ratio``), ``wan2.2-ti2v-5b`` one transformer fed per-token timesteps and Wan 2.2's 48-channel VAE
(16x spatial); both VAEs are ``AutoencoderKLWan`` (:data:`pipeline.embed.latents.VAE_PATHS`).
"""

from __future__ import annotations

import functools

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of, video_families
from pipeline.embed.families.base import Family, PromptParts, TextModel, TextOptions, declared, token_counts

T5_TOKENS = spec_of("wan").text.max_tokens(None)  # 512: WanPipeline.__call__'s max_sequence_length


def layout(models: list[TextModel], options: TextOptions, family: str = "wan") -> TextLayout:
    (t5,) = models
    return TextLayout(family=family, join="features", masked=True, lengths=(int(options.max_tokens),),
                      widths=(int(t5.model.config.d_model),))  # fmt: skip


def count_tokens(models: list[TextModel], captions: list[str], options: TextOptions) -> list[int]:
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    (t5,) = models
    return token_counts(t5.tokenizer, [prompt_clean(c) for c in captions], int(options.max_tokens),
                        add_special_tokens=True)  # fmt: skip


def encode(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    (t5,) = models
    enc = t5.tokenizer([prompt_clean(c) for c in captions], padding="max_length", max_length=options.max_tokens,
                       truncation=True, add_special_tokens=True, return_attention_mask=True,
                       return_tensors="pt")  # fmt: skip
    mask = enc.attention_mask.to(t5.device)
    return PromptParts([t5(enc.input_ids, attention_mask=mask).last_hidden_state], rows=[mask.gt(0).sum(dim=1)])


def kind_of(index: dict) -> str:
    """The family of a ``WanPipeline`` folder by its ``model_index.json``: two experts split at ``boundary_ratio``
    (Wan 2.2 A14B), ``expand_timesteps`` (Wan 2.2 TI2V-5B), else Wan 2.1's one transformer."""
    if index.get("boundary_ratio") is not None and (index.get("transformer_2") or [None])[0] is not None:
        return "wan2.2-a14b"
    return "wan2.2-ti2v-5b" if index.get("expand_timesteps") else "wan"


def _family(name: str) -> Family:
    return declared(name, layout=functools.partial(layout, family=name), encode=encode, kind_of=kind_of,
                    count_tokens=count_tokens)


FAMILY = _family("wan")
A14B = _family("wan2.2-a14b")
TI2V = _family("wan2.2-ti2v-5b")
VIDEO_FAMILIES = video_families()  # families whose VAE takes clips (manifests/families: FamilySpec.video)
