"""Every model family bucketeer knows, declared once as data (:mod:`manifests.families.spec`).

``SPECS`` maps a family's name to its :class:`FamilySpec`, in the order the CLI lists them; :func:`spec_of` is the
lookup. The embed families (``pipeline.embed.families``), the recipes (``train.recipes``), the demo, the GPU check
and the docs table (``docs/families.md``, written by ``python -m tests.test_family_specs --write``) read it.
"""

from __future__ import annotations

from manifests.errors import UsageError
from manifests.families import images, recent, video
from manifests.families.spec import Encoder, FamilySpec, Objective, Sizes, Text, Vae

__all__ = ["SPECS", "Encoder", "FamilySpec", "Objective", "Sizes", "Text", "Vae", "spec_of", "demo_families",
           "video_families"]  # fmt: skip

SPECS: dict[str, FamilySpec] = {s.name: s for s in (*images.SPECS, *video.SPECS, *recent.SPECS)}


def spec_of(name: str) -> FamilySpec:
    """The spec of family ``name``; UsageError naming the known ones otherwise."""
    if name not in SPECS:
        raise UsageError(f"--family {name!r}: bucketeer knows {sorted(SPECS)}")
    return SPECS[name]


def demo_families() -> tuple[str, ...]:
    """The families ``bucketeer demo --family`` runs, in the CLI's order."""
    return tuple(n for n, s in SPECS.items() if s.demo)


def video_families() -> tuple[str, ...]:
    """The families trained on clips."""
    return tuple(n for n, s in SPECS.items() if s.video)
