"""What a model family is: its pipeline classes, its text encoders, how it encodes a caption.

A :class:`Family` is data plus two small functions, one module per family (``sdxl``, ``sd3``,
``flux``, ``pixart``, ``generic``), each written next to the diffusers pipeline's ``encode_prompt``
it reproduces: ``layout(models, options)`` says what the cache's text records hold
(:class:`manifests.cache.text_layout.TextLayout`), ``encode(models, captions, options)`` computes
them for a batch of captions as :class:`PromptParts` (a ``reference`` family's takes ``images=`` too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of

__all__ = ["Family", "PromptParts", "TextModel", "TextOptions", "PAD_STEP", "declared", "missing_classes",
           "token_counts"]  # fmt: skip

PAD_STEP = 64  # a length group's padding: its longest caption's tokens, rounded up to this


def token_counts(tokenizer: Any, texts: list[str], max_tokens: int, **kwargs: Any) -> list[int]:
    """The tokens ``tokenizer`` gives each text, truncated at ``max_tokens`` as the family's encode truncates it
    (``kwargs``: the rest of that call's tokenizer arguments, e.g. ``add_special_tokens``)."""
    ids = tokenizer(texts, truncation=True, max_length=max_tokens, **kwargs).input_ids
    return [len(x) for x in ids]


@dataclass(frozen=True)
class TextModel:
    """One loaded text encoder: its tokenizer, the model (eval mode, on ``device``), where it came from, and the
    pipeline's multimodal processor (a family whose text sees an image; else None)."""

    tokenizer: Any
    model: Any
    device: Any
    info: dict[str, Any]
    processor: Any = None

    def __call__(self, input_ids: Any, **kwargs: Any) -> Any:
        """The model's forward on ``input_ids`` moved to its device (as the pipelines call it)."""
        return self.model(input_ids.to(self.device), **kwargs)


class TextOptions(Protocol):
    """The options a family's functions read (a :class:`pipeline.embed.encoders.TextSpec` has them)."""

    @property
    def max_tokens(self) -> int | None: ...

    @property
    def layer(self) -> str | None: ...


@dataclass
class PromptParts:
    """A batch's text, as a family computes it: ``parts[i]`` ``(B, L_i, D_i)``; ``rows[i]`` ``(B,)``
    real-token counts of part ``i`` for a masked layout (None: every row is kept); ``pooled`` ``(B, P)``."""

    parts: list[Any]
    rows: list[Any] | None = None
    pooled: Any = None


@dataclass(frozen=True)
class Family:
    """A model family: which diffusers pipeline folders it reads, and how it encodes text.

    ``pipelines``: ``model_index.json`` class names of this family (the first is written by the tiny
    model). ``text_encoders``: the diffusers subfolders of its text encoders, in the pipeline's order,
    ``text_classes`` the transformers class each loads as (None: the one its config names).
    ``max_text_tokens(pipeline)``: the default T5 length for a pipeline class (None: no T5, CLIP's
    77 positions are fixed); ``text_tokens_limit``: the most ``--max-text-tokens`` may ask (None: that
    default). ``vae``: the subfolder of its VAE. ``prune(model)``: the part of a loaded text
    encoder that ``encode`` runs (None: all of it), taken before the weights are hashed and moved to the device.
    ``reference``: its text is a function of the caption and the sample's reference image (the paired
    conditioning image, ``scan --conditioning``): ``encode`` takes ``images=`` too, and the image workers encode
    each sample's text into its record
    (:mod:`.qwen_image_edit`). ``processor``: the pipeline subfolder of its multimodal processor (None: none).
    ``kind_of(model_index)``: the family a folder of one of its pipeline classes is, where one class serves
    several (``WanPipeline``: ``wan``, ``wan2.2-a14b``, ``wan2.2-ti2v-5b``); None: this family.
    ``count_tokens(models, captions, options)``: each caption's real tokens (its rows in a masked layout), from
    the tokenizer alone, for a family whose rows do not depend on how far the batch is padded (T5 with its mask, a
    causal LM padded on the right): its captions are then encoded in groups by length, each padded to a multiple
    of :data:`PAD_STEP` instead of ``max_tokens`` (:meth:`pipeline.embed.encoders.TextEncoders.encode`). None:
    every batch is padded as the pipeline pads it.
    """

    name: str
    summary: str
    pipelines: tuple[str, ...]
    text_encoders: tuple[str, ...]
    text_classes: tuple[str | None, ...]
    layout: Callable[[list[TextModel], TextOptions], TextLayout]
    encode: Callable[[list[TextModel], list[str], TextOptions], PromptParts]
    max_text_tokens: Callable[[str | None], int | None] = lambda pipeline: None
    text_tokens_limit: int | None = None
    vae: str = "vae"
    prune: Callable[[Any], Any] | None = None
    reference: bool = False
    processor: str | None = None
    kind_of: Callable[[dict[str, Any]], str] | None = None
    count_tokens: Callable[[list[TextModel], list[str], TextOptions], list[int]] | None = None
    tokenizer: str | None = None  # the tokenizer's pipeline subfolder where it is no tokenizer* twin of the
    # text encoder's (Qwen-Image 2.1: processor, the Qwen3VLProcessor's folder); None: that twin
    # companions(folder, ident, dtype, device, weights): what encode runs besides the text encoders, loaded from the
    # pipeline folder and appended to its models, their info in the fingerprint (Anima: T5 tokenizer + LLM adapter)
    companions: Callable[[str, str, Any, Any, bool], list[TextModel]] | None = None


def missing_classes(name: str) -> str | None:
    """Why family ``name`` cannot run with the installed diffusers, in one line: the classes its declaration names
    (pipeline, VAE, denoiser) that this diffusers lacks, or a diffusers older than the one its code reproduces
    (``FamilySpec.diffusers``). None: it can."""
    import diffusers

    spec = spec_of(name)
    wanted = [*spec.pipelines, spec.vae.cls, *((spec.objective.denoiser,) if spec.objective else ())]
    lacking = [cls for cls in wanted if not hasattr(diffusers, cls)]
    if lacking:
        return (f"--family {name} needs diffusers' {', '.join(lacking)}, which diffusers {diffusers.__version__} "
                f"does not have: pip install -U diffusers (0.42.1 has them)")
    if spec.diffusers and _release(diffusers.__version__) < _release(spec.diffusers):
        return (f"--family {name} reproduces diffusers {spec.diffusers}'s {spec.pipelines[0]}, which diffusers "
                f"{diffusers.__version__} computes otherwise: pip install -U diffusers (0.42.1 has them)")
    return None


def _release(version: str) -> tuple[int, ...]:
    """``"0.42.1"`` -> ``(0, 42, 1)`` (a pre-release or local suffix ignored)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def declared(name: str, **code: Any) -> Family:
    """Family ``name`` as :mod:`manifests.families` declares it (pipeline classes, text encoders and their
    classes, lengths, tokenizer and processor subfolders, VAE subfolder, reference), with ``code``: the functions
    that are its own (``layout``, ``encode``, and ``prune``, ``count_tokens``, ``kind_of``, ``companions`` where it
    has them)."""
    spec = spec_of(name)
    text = spec.text
    data = dict(name=name, summary=spec.summary, pipelines=spec.pipelines,
                text_encoders=tuple(e.subfolder for e in text.encoders),
                text_classes=tuple(e.cls for e in text.encoders), max_text_tokens=text.max_tokens,
                text_tokens_limit=text.limit, vae=spec.vae.subfolder, reference=spec.reference,
                processor=text.processor, tokenizer=text.tokenizer)  # fmt: skip
    return Family(**{**data, **code})
