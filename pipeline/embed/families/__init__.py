"""Model families: what each diffusers pipeline feeds its model, so the cache holds exactly that.

One module per family (:mod:`.sdxl`, :mod:`.sd3`, :mod:`.flux`, :mod:`.pixart`, :mod:`.wan`, :mod:`.generic`;
:mod:`.flux2` for Flux 2 and Flux 2 Klein, :mod:`.chroma`, :mod:`.qwen_image`, :mod:`.z_image`; Wan 2.2's
two in :mod:`.wan`; HunyuanVideo 1.5 in :mod:`.hunyuan_video15`),
each a :class:`~pipeline.embed.families.base.Family` written next to the pipeline's
``encode_prompt`` it reproduces; :mod:`.tiny` builds tiny random-weight models of each family's
real classes. ``FAMILIES`` is the registry, :func:`get_family` the lookup.
"""

from __future__ import annotations

from manifests.errors import UsageError
from pipeline.embed.families import chroma, flux, flux2, generic, pixart, qwen_image, qwen_image_edit, sd3, sdxl, wan
from pipeline.embed.families import hunyuan_video15, ltx2, z_image
from pipeline.embed.families.base import Family, PromptParts, TextModel, TextOptions

__all__ = ["FAMILIES", "Family", "PromptParts", "TextModel", "TextOptions", "get_family", "family_of_pipeline"]

FAMILIES: dict[str, Family] = {f.name: f for f in (sdxl.FAMILY, sd3.FAMILY, flux.FAMILY, pixart.FAMILY,
                                                   wan.FAMILY, generic.FAMILY)}  # fmt: skip
FAMILIES.update({f.name: f for f in (flux2.FAMILY, flux2.KLEIN, chroma.FAMILY, qwen_image.FAMILY, z_image.FAMILY)})
FAMILIES[qwen_image_edit.FAMILY.name] = qwen_image_edit.FAMILY
FAMILIES.update({f.name: f for f in (wan.A14B, wan.TI2V)})  # docs/families-video.md
FAMILIES[ltx2.FAMILY.name] = ltx2.FAMILY  # docs/families-video.md
FAMILIES[hunyuan_video15.FAMILY.name] = hunyuan_video15.FAMILY  # docs/families-video.md


def get_family(name: str) -> Family:
    """The family called ``name``; UsageError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise UsageError(f"--family {name!r}: bucketeer knows {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_pipeline(pipeline: str) -> str | None:
    """The family whose ``model_index.json`` class is ``pipeline`` (None when no family has it)."""
    return next((f.name for f in FAMILIES.values() if pipeline in f.pipelines), None)
