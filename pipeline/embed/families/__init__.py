"""Model families: what each diffusers pipeline feeds its model, so the cache holds exactly that.

One module per family (or a few close ones), each a :class:`~pipeline.embed.families.base.Family` written next to
the pipeline's ``encode_prompt`` it reproduces, its data read from the family's declaration
(:mod:`manifests.families`, whose ``embed`` says which module and name); :mod:`.tiny` builds tiny random-weight
models of each family's real classes. ``FAMILIES`` is the registry (every declared family, in the declarations'
order), :func:`get_family` the lookup.
"""

from __future__ import annotations

import importlib

from manifests.errors import UsageError
from manifests.families import SPECS
from pipeline.embed.families.base import Family, PromptParts, TextModel, TextOptions, missing_classes

__all__ = ["FAMILIES", "Family", "PromptParts", "TextModel", "TextOptions", "get_family", "family_of_pipeline"]


def _code(where: str) -> Family:
    """The ``Family`` a declaration's ``embed`` (``"module:NAME"``) names."""
    module, name = where.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


FAMILIES: dict[str, Family] = {name: _code(spec.embed) for name, spec in SPECS.items()}


def get_family(name: str) -> Family:
    """The family called ``name``; UsageError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise UsageError(f"--family {name!r}: bucketeer knows {sorted(FAMILIES)}")
    if (missing := missing_classes(name)) is not None:
        raise UsageError(missing)
    return FAMILIES[name]


def family_of_pipeline(pipeline: str) -> str | None:
    """The family whose ``model_index.json`` class is ``pipeline`` (None when no family has it)."""
    return next((f.name for f in FAMILIES.values() if pipeline in f.pipelines), None)
