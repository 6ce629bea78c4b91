"""LoRA: train low-rank adapters (peft) on a frozen pretrained model, save and load them the diffusers way.

``lora_rank: N`` in the config freezes the model and adds adapters of rank N to the recipe's
attention projections (or ``lora_targets``); only the adapters are optimised. The final adapters are
written with the model's ``save_lora_adapter`` (``pytorch_lora_weights.safetensors``) and load back
with ``load_lora_adapter`` on the same pretrained model. Needs ``peft`` (``pip install 'bucketeer[lora]'``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from manifests.errors import UsageError
from train.config import TrainConfig

__all__ = ["add_lora", "save_lora", "load_lora", "LORA_FILE"]

LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' LoRA loaders look for


def add_lora(model: torch.nn.Module, cfg: TrainConfig, *, targets: tuple[str, ...], supported: bool = True) -> None:
    """Freeze ``model`` and add LoRA adapters (``cfg.lora_rank``, ``lora_alpha``, ``lora_targets`` or ``targets``).

    Raises UsageError when peft is missing or the model class cannot save adapters (``supported``).
    """
    if not supported:
        raise UsageError(f"config lora_rank: {type(model).__name__} has no LoRA loaders in diffusers; "
                         "train it fully (lora_rank: 0)")
    try:
        from peft import LoraConfig
    except ImportError:
        raise UsageError("config lora_rank needs peft: pip install 'bucketeer[lora]'") from None
    model.requires_grad_(False)
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or cfg.lora_rank, init_lora_weights="gaussian",
                        target_modules=list(cfg.lora_targets or targets))  # fmt: skip
    try:
        model.add_adapter(config)
    except ValueError as e:  # peft: none of the target modules is in the model
        raise UsageError(f"config lora_targets {config.target_modules}: {e}") from None


def save_lora(model: torch.nn.Module, directory: Path) -> None:
    """Write ``model``'s (unwrapped) adapters to ``directory`` (``pytorch_lora_weights.safetensors``)."""
    model.save_lora_adapter(str(directory), weight_name=LORA_FILE)


def load_lora(model: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """Load adapters written by :func:`save_lora` into ``model`` (the same pretrained model); returns it."""
    # safetensors only: without use_safetensors diffusers may fall back to a pickled .bin
    model.load_lora_adapter(str(directory), prefix=None, use_safetensors=True, weight_name=LORA_FILE,
                            adapter_name="default")  # peft's name for the adapter trained here
    return model
