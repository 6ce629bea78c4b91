"""What a model family is, as data: one :class:`FamilySpec` per family, read by embed, train, the demo, the GPU
check and the docs.

A family's facts used to be spread over a dozen registries (the embed module's pipeline classes and lengths, the
tiny builder's seed, the trainer's list of families with their own config, the demo's list of families and video
bucket steps, the GPU check's text names and batches, the docs tables). Here each is said once, in
:mod:`manifests.families.images`, :mod:`.video` and :mod:`.recent`; what stays code is what truly differs between
families: how a caption is encoded (``pipeline.embed.families.<f>.encode``), how the latents are normalised where
no other family does it (``pipeline.embed.latents.VAE_PATHS``), and how the transformer is called
(``train.recipes.<f>``). Standard library only: ``manifests`` is the contract layer both ``pipeline`` and
``train`` import, and a spec names classes and registry keys, never imports them (a test resolves every name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

__all__ = ["Encoder", "Text", "Vae", "Objective", "Sizes", "FamilySpec", "ROWS", "NORMALISE", "SHIFTS"]

ROWS = ("real", "all")  # a masked layout stores each caption's real rows; an unmasked one every row the model sees
# how the cache's latents relate to the VAE's posterior (what the loader or the embed applies); "scale": the config's
# scaling_factor (and its shift_factor where it has one); "scale_no_shift": scaling_factor only, although the
# config has a shift_factor (the pipeline ignores it: Kandinsky 5 on FLUX.1's VAE)
NORMALISE = ("scale", "scale_no_shift", "scale_shift", "per_channel", "bn_patch2", "ltx", "none")
SHIFTS = ("scheduler", "dynamic", "flux2_empirical", "none")  # the timestep shift a recipe applies by default


@dataclass(frozen=True)
class Encoder:
    """One text encoder of the pipeline folder: its ``subfolder`` and the transformers class it loads as (None: the
    one its config names)."""

    subfolder: str
    cls: str | None


@dataclass(frozen=True)
class Text:
    """How the pipeline's ``encode_prompt`` turns a caption into what its denoiser reads.

    ``prompt``: what the encoder is given (the caption as is, a template around it, a chat template, ...).
    ``tokens``: the default ``--max-text-tokens`` per pipeline class (``{"": n}`` for every class; empty: fixed,
    CLIP's 77); ``limit``: the most ``--max-text-tokens`` may ask (None: the default). ``layers``: which hidden
    states are kept. ``mask``: how the denoiser learns each caption's extent (``"mask"``, ``"lengths"``, a
    ``"list"`` of unpadded rows, ``"none"``: it reads the padding too). ``rows``: :data:`ROWS`. ``pooled``: the
    pooled vector, if any. ``processor``: the pipeline subfolder of a multimodal processor the text sees an image
    through (None: none). ``tokenizer``: the tokenizer's subfolder where it is not the text encoder's ``tokenizer*``
    twin (Qwen-Image 2.1: its processor's)."""

    encoders: tuple[Encoder, ...]
    prompt: str
    layers: str
    mask: Literal["mask", "lengths", "list", "none"]
    rows: Literal["real", "all"]
    tokens: Mapping[str, int] = field(default_factory=dict)
    limit: int | None = None
    pooled: str | None = None
    processor: str | None = None
    tokenizer: str | None = None

    def max_tokens(self, pipeline: str | None) -> int | None:
        """The default length for ``pipeline`` (None: the family's first class, or its only length)."""
        if not self.tokens:
            return None
        return self.tokens.get(pipeline or "", self.tokens.get("", next(iter(self.tokens.values()))))


@dataclass(frozen=True)
class Vae:
    """The family's VAE: diffusers class (a ``pipeline.embed.latents.VAE_PATHS`` key), ``normalise``
    (:data:`NORMALISE`: what turns the posterior into what the denoiser reads), ``stored``: whether the cache holds
    latents already normalised (else the loader applies ``normalise`` from ``_cache.json``); ``factor`` /
    ``temporal``: its compression; ``channels``: latent channels of the published VAE; ``bn_eps``: a batch-norm
    eps of the family's own for ``bn_patch2`` (ERNIE-Image's pipeline hard-codes 1e-5; None: the config's)."""

    cls: str
    normalise: str
    factor: int = 8
    channels: int = 4
    stored: Literal["posterior", "normalised"] = "posterior"
    temporal: int | None = None
    subfolder: str = "vae"
    bn_eps: float | None = None


@dataclass(frozen=True)
class Objective:
    """The training recipe: the ``denoiser`` class trained from its ``subfolder``(s), the loss (``objective``), the
    timestep the denoiser is given (``timestep``: of the noise level ``sigma`` in [0, 1]), the default shift
    (:data:`SHIFTS`), ``patch``: latent pixels per token side, ``config``: the family ships its own
    ``train/configs/<family>.yaml`` (fine-tuned from the published weights by default), ``pipeline``: the class
    a LoRA loads into (None: the family's first)."""

    denoiser: str
    objective: Literal["flow", "ddpm", "flow_from_scratch"]
    timestep: str
    shift: str
    subfolders: tuple[str, ...] = ("transformer",)
    patch: int = 1
    config: bool = False
    pipeline: str | None = None


@dataclass(frozen=True)
class Sizes:
    """The published checkpoint's sizes for the GPU check and the docs: ``text_name`` (how its text rows call the
    encoder), ``text_batch`` (captions per encoder call at real size), ``configs``: the
    ``benchmarks/real_configs.py`` names of its real configs (text encoders first)."""

    text_name: str
    text_batch: int
    configs: tuple[str, ...] = ()


@dataclass(frozen=True)
class FamilySpec:
    """One model family, declared once (see the module docstring).

    ``pipelines``: the ``model_index.json`` class names of its folders (the first is what the tiny model writes).
    ``tiny_seed``: the seed of its tiny random-weight pipeline (None: none). ``demo``: ``bucketeer demo --family``
    runs it; ``bucket_step``: the demo's bucket side step where the VAE's factor times the patch is not 16.
    ``video``: trained on clips. ``reference``: its text sees each sample's reference image. ``sizes``: its real
    sizes in the GPU check (None: not there). ``licence``: what the model card says of training and use.
    ``docs``: the page that explains it. ``embed`` / ``recipe``: where its code is, ``"module:NAME"`` of
    ``pipeline.embed.families`` (its ``Family``) and of ``train.recipes`` (its ``Recipe``; empty without an
    objective), imported by those packages' registries; ``tiny``: ``"module:function"`` of
    ``pipeline.embed.families`` building its tiny pipeline (empty: one of ``tiny.py``'s own). ``diffusers``: the
    oldest diffusers whose pipeline its code reproduces (empty: the project's floor), where an older one computes
    otherwise (Kandinsky 5's template changed after 0.37)."""

    name: str
    summary: str
    pipelines: tuple[str, ...]
    text: Text
    vae: Vae
    objective: Objective | None
    tiny_seed: int | None
    docs: str
    licence: str = ""
    demo: bool = True
    bucket_step: int | None = None
    video: bool = False
    reference: bool = False
    sizes: Sizes | None = None
    embed: str = ""
    recipe: str = ""
    tiny: str = ""
    diffusers: str = ""

    def __post_init__(self) -> None:
        for what, where in (("embed", self.embed), ("recipe", self.recipe), ("tiny", self.tiny)):
            if where and where.count(":") != 1:
                raise ValueError(f"family {self.name}: {what} {where!r} is not 'module:NAME'")
        if not self.embed or bool(self.recipe) != (self.objective is not None):
            raise ValueError(f"family {self.name}: it needs its embed code, and a recipe exactly when it has an "
                             "objective")
        if self.text.rows not in ROWS:
            raise ValueError(f"family {self.name}: rows {self.text.rows!r} is not one of {ROWS}")
        if self.vae.normalise not in NORMALISE:
            raise ValueError(f"family {self.name}: normalise {self.vae.normalise!r} is not one of {NORMALISE}")
        if self.objective is not None and self.objective.shift not in SHIFTS:
            raise ValueError(f"family {self.name}: shift {self.objective.shift!r} is not one of {SHIFTS}")
