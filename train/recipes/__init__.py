"""Training recipes: one small module per model family, each a function over diffusers models; one loop for all.

A recipe's ``setup(cfg, meta)`` (``meta``: the cache's ``_cache.json``) returns a :class:`Denoiser`:
the model to train (``from_pretrained`` of the family's ``unet`` / ``transformer`` subfolder, or
PixArt's from-scratch transformer), the loss of one :class:`train.data.Batch` (noise drawn from a
generator seeded by the plan position), and how to build the family's diffusers pipeline around it
for validation images (or clips). ``RECIPES`` is the registry (family -> recipe), :func:`recipe_for` picks the
cache's family; the loop (:mod:`train.__main__`) never looks at the family again.

=========  ==================================  ===========================================================
family     model                               objective
=========  ==================================  ===========================================================
sdxl       ``UNet2DConditionModel`` (``unet``)  DDPM, epsilon or v (the base scheduler's prediction_type);
                                               ``time_ids`` = original size + crop top-left + target size
sd3        ``SD3Transformer2DModel``            rectified flow, the scheduler's ``shift``
flux       ``FluxTransformer2DModel``           rectified flow on 2x2-packed latents, image/text ids,
                                               guidance embedding (``guidance``)
pixart     ``PixArtTransformer2DModel``         from scratch: rectified flow (today's); ``pretrained``: DDPM
wan        ``WanTransformer3DModel``            video: rectified flow on (C, F, h, w) latents normalised per
                                               channel, the scheduler's ``flow_shift``; UMT5 zero-padded to 512
qwen-image ``QwenImageTransformer2DModel``      rectified flow on 2x2-packed latents (stored normalised), text
                                               mask, ``img_shapes``; dynamic shift per bucket
qwen-image-edit (the same model)               as qwen-image, the packed reference latents after the noisy
                                               ones (``img_shapes`` of both); the loss on the target's tokens
z-image    ``ZImageTransformer2DModel``        rectified flow on per-image lists, timestep ``1 - sigma``,
                                               output = minus the velocity; the scheduler's fixed ``shift``
generic    (as pixart, from scratch)
=========  ==================================  ===========================================================

Wan 2.2 (``wan2.2-a14b``: one expert per run or LoRA on both, each on its timesteps; ``wan2.2-ti2v-5b``: per-token
timesteps): :mod:`train.recipes.wan`. Flux 2, Flux 2 Klein and Chroma: :mod:`train.recipes.flux2`
(``Flux2Transformer2DModel`` on the cache's patchified, batch-norm-normalised latents, Flux 2's empirical shift) and
:mod:`train.recipes.chroma` (``ChromaTransformer2DModel``, its text mask). HunyuanVideo 1.5 (two masked text
streams, the zero t2v condition): :mod:`train.recipes.hunyuan_video15`.
"""

from __future__ import annotations

import importlib

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
from manifests.families import SPECS
from train.config import TrainConfig
from pipeline.embed.families.base import missing_classes
from train.recipes.base import Denoiser, PromptEmbeds, Recipe

__all__ = ["RECIPES", "Denoiser", "PromptEmbeds", "Recipe", "recipe_for"]


def _code(where: str) -> Recipe:
    """The ``Recipe`` a declaration's ``recipe`` (``"module:NAME"``) names."""
    module, name = where.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


# every declared family with an objective (manifests/families); generic trains as pixart does
RECIPES: dict[str, Recipe] = {name: _code(spec.recipe) for name, spec in SPECS.items() if spec.recipe}


def recipe_for(cfg: TrainConfig, meta: CacheMeta) -> Recipe:
    """The recipe of the cache's family (``meta``: ``_cache.json``). Raises UsageError when the config's
    ``family`` contradicts the cache's, naming both."""
    family = meta.family or meta.text_layout.family
    if cfg.family is not None and cfg.family != family:
        raise UsageError(f"config family {cfg.family!r} but the cache was embedded for family {family!r}: "
                         f"train {family} on this cache, or embed with --family {cfg.family}")
    if family not in RECIPES:
        raise UsageError(f"no training recipe for family {family!r}; recipes: {sorted(RECIPES)}")
    if family in SPECS and (missing := missing_classes(family)) is not None:
        raise UsageError(missing)
    return RECIPES[family]
