"""Loss masks: weight the per-pixel loss by each sample's mask (config ``masked_loss``).

A sample whose manifest has a mask (``bucketeer scan --masks``) carries it in its cache record at the
latent grid (``SampleRecord.mask``, uint8 0..255); the loader stacks a batch's masks into ``Batch.mask``
``(B, 1, h, w)`` float32 in [0, 1] (1 for every pixel of a sample without one), or None when no sample
of the batch has one. With ``masked_loss: {weight_outside: 0.0}`` in the config, the squared error at
latent pixel ``p`` of sample ``b`` is weighted by ``w = m + weight_outside * (1 - m)`` (``m`` the mask:
1 inside, ``weight_outside`` outside), and each sample's loss is normalised by its own weights::

    loss_b = sum_p w_p * se_p / (C * sum_p w_p)          loss = mean_b loss_b

so a small mask counts as much as a large one (a sample with no weight at all counts 0). Without
masks, or without ``masked_loss``, that is the plain mean squared error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:  # torch is imported where a tensor is made: train/config.py reads MaskedLoss without it
    import torch

from manifests.errors import UsageError

__all__ = ["MaskedLoss", "stack_masks", "mask_weights", "masked_mse"]


@dataclass(frozen=True)
class MaskedLoss:
    """The config's ``masked_loss`` section: the loss weight of pixels outside the mask (0..1)."""

    weight_outside: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight_outside <= 1.0:
            raise UsageError(f"config: masked_loss.weight_outside must be in [0, 1], got {self.weight_outside}")

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> MaskedLoss | None:
        """Parse ``masked_loss`` (None: masks are not used); raises UsageError naming an unknown or bad key."""
        if section is None:
            return None
        unknown = sorted(set(section) - {"weight_outside"})
        if unknown:
            raise UsageError(f"config: masked_loss has unknown keys {unknown}; valid: ['weight_outside']")
        value = section.get("weight_outside", 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"config: masked_loss.weight_outside must be a number, got {value!r}")
        return cls(weight_outside=float(value))


def stack_masks(masks: list[np.ndarray | None], grid: tuple[int, int]) -> torch.Tensor | None:
    """A batch's ``Batch.mask``: its records' ``(h, w)`` uint8 masks (None: the sample has none) as ``(B, 1, h, w)``
    float32 in [0, 1], 1 everywhere for a sample without one; None when no sample has one."""
    import torch

    if all(m is None for m in masks):
        return None
    ones = np.ones(grid, np.float32)
    return torch.from_numpy(np.stack([ones if m is None else m.astype(np.float32) / 255.0 for m in masks])[:, None])


def mask_weights(batch: Any, settings: MaskedLoss | None) -> torch.Tensor | None:
    """``(B, 1, h, w)`` loss weights of ``batch`` (``m + weight_outside * (1 - m)``), or None when the run
    has no ``masked_loss`` or no sample of the batch has a mask (every weight would be 1)."""
    mask = getattr(batch, "mask", None)
    if settings is None or mask is None:
        return None
    mask = mask.float()
    return mask + settings.weight_outside * (1.0 - mask)


def masked_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None,
               weight: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Mean squared error in fp32, per-pixel ``weights`` (broadcast to ``pred``; None: unmasked) normalised
    per sample (module docstring); ``weight``: a per-sample factor (a flow-matching timestep weight)."""
    se = (pred.float() - target.float()) ** 2
    if weight is not None:
        se = weight.float() * se
    if weights is None:
        return se.mean()
    w = weights.to(se.device, se.dtype).expand_as(se)
    per_sample = (se * w).flatten(1).sum(1) / w.flatten(1).sum(1).clamp_min(1e-12)  # no weight at all: 0
    return per_sample.mean()
