"""What a recipe is (:class:`Recipe`, :class:`Denoiser`) and the helpers recipes share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from manifests.cache.meta import CacheMeta
from manifests.errors import UsageError
from train.config import TrainConfig
from train.masks import masked_mse

__all__ = ["Denoiser", "LossFn", "PromptEmbeds", "Recipe", "pretrained_source", "load_pretrained", "check_matches",
           "flow_options", "flow_loss"]


class LossFn(Protocol):
    def __call__(self, model: torch.nn.Module, batch: Any, generator: torch.Generator) -> torch.Tensor:
        """The scalar loss of one batch; ``model`` may be wrapped (DDP); noise comes from ``generator``."""
        ...


@dataclass(frozen=True)
class PromptEmbeds:
    """Cached prompts joined for a pipeline: ``embeds`` (B, L, D), ``mask`` (B, L), ``pooled`` (B, P) or None."""

    embeds: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None


@dataclass
class Denoiser:
    """What a recipe's setup gives the loop.

    ``pipeline(model, vae)``: the family's diffusers pipeline around the (unwrapped) model, no text
    encoder; ``prompt_kwargs(prompts, negative)``: its ``__call__`` arguments for cached prompts.
    ``tokens_per_position``: transformer tokens per latent pixel (for throughput), ``lora_targets``:
    the modules LoRA adapts by default. ``source``: the pretrained model id or folder (None: from
    scratch); ``pipeline_class``: the diffusers pipeline a user loads the results into (its
    ``load_lora_weights`` reads the LoRA export; None: no LoRA loaders), ``component``: the model's
    name in it; ``lora_load``: the extra ``load_lora_weights`` arguments that load the export into it, and
    ``lora_component`` the key prefix its export then has (Wan 2.2's low-noise expert ``transformer_2``:
    ``load_into_transformer_2=True``, keys ``transformer.``; None: ``component``). ``more_lora_loads``: for a
    model that holds several (``experts``, Wan 2.2 A14B's ``expert: both``), the ``load_lora_weights`` arguments of
    the further experts' exports (``OUTPUT/lora_2``, ...). ``step_record``: what the last loss call drew that the
    run's ``--record-samples`` lines keep (``expert: both``: the expert and each sample's sigma); the recipe
    updates it.
    """

    model: torch.nn.Module
    loss: LossFn
    pipeline: Callable[[torch.nn.Module, Any], Any]
    prompt_kwargs: Callable[[PromptEmbeds, PromptEmbeds], dict[str, Any]]
    tokens_per_position: float = 1.0
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    source: str | None = None
    pipeline_class: str | None = None
    component: str = "transformer"
    lora_load: dict[str, Any] = field(default_factory=dict)
    lora_component: str | None = None
    more_lora_loads: tuple[dict[str, Any], ...] = ()
    step_record: dict[str, Any] = field(default_factory=dict)

    @property
    def lora(self) -> bool:
        """The model class can save and load LoRA adapters (a pipeline with LoRA loaders)."""
        return self.pipeline_class is not None


@dataclass(frozen=True)
class Recipe:
    family: str
    setup: Callable[[TrainConfig, dict[str, Any]], Denoiser]


def pretrained_source(cfg: TrainConfig, meta: CacheMeta, *, required: bool = True) -> str | None:
    """The model to start from: the config's ``pretrained``, else the ``--model`` the cache was embedded with
    (``--model default``: the family's tiny random-weight model, built here as embed built it).

    Raises UsageError when neither names one and ``required``, or when the config also sizes a fresh
    model (``model:``, for the from-scratch PixArt transformer only).
    """
    if cfg.model:
        raise UsageError(f"config model: {sorted(cfg.model)} sizes the from-scratch PixArt transformer; a run that "
                         "fine-tunes a pretrained model takes its architecture from it: remove model:")
    source = cfg.pretrained or meta.settings.model
    if source is not None and source.startswith("bucketeer:default-"):  # embedded with --model default
        from pipeline.embed.families.tiny import TINY_VERSION, ensure_tiny

        if source == f"bucketeer:default-{meta.family}-{TINY_VERSION}":  # the same seeded build embed used
            return str(ensure_tiny(meta.family))
    if source is None and required:
        raise UsageError(f"config: family {meta.family!r} fine-tunes a pretrained model, and the cache was "
                         "embedded without --model: set pretrained: ID_OR_PATH (a diffusers pipeline folder)")
    return source


def load_pretrained(cls: type, source: str, subfolder: str) -> torch.nn.Module:
    """``cls.from_pretrained(source, subfolder=subfolder)`` in fp32; UsageError naming the folder when absent."""
    try:
        return cls.from_pretrained(source, subfolder=subfolder, torch_dtype=torch.float32)
    except (OSError, EnvironmentError) as e:
        raise UsageError(f"pretrained {source!r}: cannot load {cls.__name__} from its {subfolder}/ ({e}); "
                         "pass the family's diffusers pipeline folder or hub id") from None


def check_matches(what: str, model_value: Any, cache_value: Any, source: str) -> None:
    """UsageError when the model's ``what`` differs from what the cache holds (a cache of another model)."""
    if model_value != cache_value:
        raise UsageError(f"pretrained {source!r}: the model's {what} is {model_value}, the cache's is {cache_value}; "
                         "train with the model the cache was embedded with (bucketeer embed --model)")


def flow_options(cfg: TrainConfig) -> dict[str, Any]:
    """The config's timestep-density settings, as :func:`train.model.flow_sample` takes them."""
    return {"weighting_scheme": cfg.weighting_scheme, "logit_mean": cfg.logit_mean, "logit_std": cfg.logit_std,
            "mode_scale": cfg.mode_scale}  # fmt: skip


def flow_loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Weighted mean squared error, in fp32 (autocast may have made ``pred`` half precision); ``mask``: per-pixel
    loss weights (:func:`train.masks.mask_weights`, broadcast to ``pred``), normalised per sample."""
    return masked_mse(pred, target, mask, weight)
