"""One step's tensors: :class:`Batch`, and :func:`collate`, which makes one from the step's cache records.

A batch holds one bucket, so its records' latents stack: ``(B, C, h, w)`` for images, ``(B, C, F, h, w)`` for
the clips of a video cache. :func:`latent_normaliser` says how a cache's latents become the model's (the
VAE's scaling and shift, or a video VAE's per-channel statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from manifests.cache.meta import LatentInfo
from manifests.cache import TextLayout
from manifests.cache.records import SampleRecord, to_float32
from manifests.errors import UsageError
from train.masks import stack_masks
from train.data.steps import PlanStep

__all__ = ["Batch", "TENSORS", "collate", "latent_normaliser", "stored_tensor"]

TENSORS = ("latents", "text", "text_mask", "resolution", "aspect_ratio", "crop_top_left", "target_size", "pooled",
           "cond_latents", "features", "mask")


@dataclass
class Batch:
    """The tensors of one step. Latents are scaled for the model: ``(latent - shift) * scale``
    (:func:`latent_normaliser`: per channel for a video VAE's latents).

    ``latents`` (B, C, h, w), or (B, C, F, h, w) for a video cache (F latent frames; one bucket per batch
    makes every clip's shape the same); ``text`` (B, L, D): the prompt embeddings as the cache's model
    family joins its text parts (:meth:`manifests.cache.TextLayout.prompt_embeds`: SDXL's two CLIPs
    side by side, SD3's CLIPs then T5 on the sequence, ...); a masked layout (PixArt, generic) is
    padded to the batch's longest caption, zero past each part's tokens; ``text_mask`` (B, L), 1
    where any part has a token (all ones for the unmasked families); ``resolution`` (B, 2)
    original (height, width) in pixels; ``aspect_ratio`` (B, 1) bucket height / width;
    ``crop_top_left`` (B, 2) (top, left) of the crop in resized pixels and ``target_size`` (B, 2) the
    bucket's (height, width): with ``resolution``, SDXL's micro-conditioning; ``pooled`` (B, P) the
    family's pooled text embedding (None when the layout has none). ``cond_latents`` (B, C, h, w): the
    paired conditioning images' latents, scaled like ``latents`` (None for a cache without pairs).
    ``features`` (B, gh, gw, D) float16: the DINOv2 patch features of each sample's variant (``embed
    --features``; REPA, :mod:`train.repa`), as stored whatever ``pending`` says (None for a cache without).
    ``mask`` (B, 1, h, w) float32 in [0, 1]: loss masks at the latent grid (:func:`train.masks.stack_masks`).
    ``variants`` (B,): each sample's variant (:func:`variant_choice`). ``dropped``: ids whose caption was
    replaced by the empty one (caption dropout). ``skipped``: ids dropped as bad records (skip_bad_records).

    ``pending`` ``(shift, scale)`` (floats, or per-channel float32 arrays (C,)): the batch is as stored
    (``collate(widen=False)``: latents, text and pooled in the cache's dtype, bf16 as ``torch.bfloat16``,
    latents not yet scaled): :meth:`to` widens them to float32 and scales the latents on the target device,
    where the model is, which moves half the bytes and spends no loader CPU. None: already float32 and
    scaled. Widening is exact and the scaling the same float32 ops, so the tensors on the device are identical.
    """

    epoch: int
    step: int
    bucket: str
    sample_ids: list[int]
    latents: torch.Tensor
    text: torch.Tensor
    text_mask: torch.Tensor
    resolution: torch.Tensor
    aspect_ratio: torch.Tensor
    crop_top_left: torch.Tensor
    target_size: torch.Tensor
    pooled: torch.Tensor | None = None
    cond_latents: torch.Tensor | None = None
    features: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    variants: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    datasets: list[int] | None = None  # mixture plans: the dataset of each of sample_ids
    pending: tuple[Any, Any] | None = None  # (shift, scale) still to apply, with the widening, in to()

    @property
    def latent_positions(self) -> int:
        """B * h * w (video: B * F * h * w): latent pixels in the batch (divide by the patch's size for
        transformer tokens)."""
        return self.latents.numel() // self.latents.shape[1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """This batch on ``device``, float32 and scaled (a stored-dtype batch is widened there)."""
        move = {k: getattr(self, k).to(device, non_blocking=non_blocking)
                for k in TENSORS if getattr(self, k) is not None}  # fmt: skip
        if self.pending is not None:
            shift, scale = (torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v for v in self.pending)
            for k in ("latents", "cond_latents"):  # the same float32 ops collate(widen=True) does on the CPU
                if k in move:
                    move[k] = (move[k].float() - _per_channel(shift, move[k])) * _per_channel(scale, move[k])
            for k in ("text", "pooled"):
                if k in move:
                    move[k] = move[k].float()
        return replace(self, **move, pending=None)

    def pin_memory(self) -> "Batch":
        return replace(self, **{k: getattr(self, k).pin_memory() for k in TENSORS if getattr(self, k) is not None})


def stored_tensor(array: np.ndarray, tag: str) -> torch.Tensor:
    """A stored array as a torch tensor of its dtype without widening (BF16 bits -> ``torch.bfloat16``)."""
    array = np.ascontiguousarray(array)
    if tag == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def latent_normaliser(info: LatentInfo | None) -> tuple[float | np.ndarray, float | np.ndarray]:
    """``(shift, scale)`` that make a cache's latents the model's, ``(latent - shift) * scale``: the VAE's
    ``shift_factor`` and ``scaling_factor`` (0 and 1 when absent), or for a video VAE with per-channel
    statistics (``latents_mean``, ``latents_std``: Wan) ``latents_mean`` and ``1 / latents_std`` as float32
    arrays (C,) instead (:func:`_per_channel` broadcasts them over the channel axis). Raises UsageError when the
    statistics do not have one value per latent channel."""
    if info is None:
        return 0.0, 1.0
    if info.latents_mean is None and info.latents_std is None:
        return float(info.shift_factor or 0.0), float(info.scaling_factor or 1.0)
    mean, std = np.asarray(info.latents_mean or (), np.float32), np.asarray(info.latents_std or (), np.float32)
    if len(mean) != len(std) or (info.channels is not None and len(mean) != info.channels) or not (std > 0).all():
        raise UsageError(f"_cache.json latent: latents_mean ({len(mean)}) and latents_std ({len(std)}) must hold one "
                         f"value per latent channel ({info.channels}), std > 0; re-embed the cache")  # fmt: skip
    return mean, (1.0 / std).astype(np.float32)


def _per_channel(value: Any, latents: Any) -> Any:
    """A float as it is; a (C,) array or tensor shaped (C, 1, ..., 1) to broadcast over axis 1 of ``latents``
    (B, C, ...)."""
    if isinstance(value, (int, float)):
        return value
    return value.reshape(-1, *(1,) * (latents.ndim - 2))


def collate(
    records: Sequence[SampleRecord], step: PlanStep, *, layout: TextLayout, scaling_factor: float | np.ndarray,
    shift_factor: float | np.ndarray, widen: bool = True,
) -> Batch:  # fmt: skip
    """Stack one step's records (one bucket) into a :class:`Batch`; ``layout``: the cache's text layout;
    ``shift_factor``, ``scaling_factor``: :func:`latent_normaliser`'s.

    ``widen=False``: keep the stored dtype and leave widening and scaling to :meth:`Batch.to` (on the
    device); a batch whose records differ in dtype (posterior draws beside means) is widened here.
    Raises ValueError when a record's bucket is not the plan's (plan and cache from different
    manifests) or a record has no text embeddings, or text that does not fit ``layout``.
    """
    for r in records:
        if r.bucket != step.bucket:
            raise UsageError(f"sample {r.sample_id}: the cache says bucket {r.bucket}, the plan (epoch {step.epoch} "
                             f"step {step.step}) says {step.bucket}; "
                             "plan and cache come from different manifests")  # fmt: skip
        if r.text is None:
            raise UsageError(f"sample {r.sample_id} has no text embeddings in the cache; run `bucketeer verify`")
    has_cond = any(r.cond_latent is not None for r in records)
    if has_cond and not all(r.cond_latent is not None for r in records):
        raise UsageError(f"epoch {step.epoch} step {step.step}: some samples have a conditioning latent and "
                         "some not; the cache mixes records of two embeds. Run `bucketeer verify`")  # fmt: skip
    if not widen and len({r.dtype for r in records}) == 1 and len({r.text.dtype for r in records}) == 1:
        return _collate_stored(records, step, layout, has_cond, (shift_factor, scaling_factor))
    latents = np.stack([to_float32(r.latent, r.dtype) for r in records])  # (B, C, h, w) or (B, C, F, h, w)
    latents = (latents - _per_channel(shift_factor, latents)) * _per_channel(scaling_factor, latents)
    conds = None
    if has_cond:
        conds = np.stack([to_float32(r.cond_latent, r.dtype) for r in records])
        conds = (conds - _per_channel(shift_factor, conds)) * _per_channel(scaling_factor, conds)
    text, mask, pooled = layout.prompt_embeds([r.text for r in records])  # (B, L, D), (B, L), (B, P) | None
    return _batch(records, step, torch.from_numpy(np.ascontiguousarray(latents, np.float32)), torch.from_numpy(text),
                  mask, None if pooled is None else torch.from_numpy(pooled),
                  None if conds is None else torch.from_numpy(np.ascontiguousarray(conds, np.float32)))  # fmt: skip


def _collate_stored(records: Sequence[SampleRecord], step: PlanStep, layout: TextLayout, has_cond: bool,
                    pending: tuple[float | np.ndarray, float | np.ndarray]) -> Batch:  # fmt: skip
    """:func:`collate` without widening: tensors in the records' one stored dtype, scaling ``pending``."""
    tag, text_tag = records[0].dtype, records[0].text.dtype
    latents = stored_tensor(np.stack([r.latent for r in records]), tag)  # (B, C, h, w) or (B, C, F, h, w)
    conds = stored_tensor(np.stack([r.cond_latent for r in records]), tag) if has_cond else None
    text, mask, pooled = layout.prompt_embeds([r.text for r in records], widen=False)  # stored dtype
    batch = _batch(records, step, latents, stored_tensor(text, text_tag), mask,
                   None if pooled is None else stored_tensor(pooled, text_tag), conds)  # fmt: skip
    batch.pending = pending
    return batch


def _batch(records: Sequence[SampleRecord], step: PlanStep, latents: torch.Tensor, text: torch.Tensor,
           mask: np.ndarray, pooled: torch.Tensor | None, conds: torch.Tensor | None) -> Batch:  # fmt: skip
    geometry = np.asarray([(*r.original_size, *r.crop_top_left, *r.target_size) for r in records], np.float32)
    aspect = geometry[:, 4:5] / geometry[:, 5:6]  # (B, 1) bucket height / width
    return Batch(
        epoch=step.epoch,
        step=step.step,
        bucket=step.bucket,
        sample_ids=[r.sample_id for r in records],
        latents=latents,
        text=text,
        text_mask=torch.from_numpy(mask),
        resolution=torch.from_numpy(np.ascontiguousarray(geometry[:, 0:2])),  # (B, 2) original (h, w)
        aspect_ratio=torch.from_numpy(np.ascontiguousarray(aspect)),
        crop_top_left=torch.from_numpy(np.ascontiguousarray(geometry[:, 2:4])),
        target_size=torch.from_numpy(np.ascontiguousarray(geometry[:, 4:6])),
        pooled=pooled,
        cond_latents=conds,
        features=None if records[0].features is None else torch.from_numpy(np.stack([r.features for r in records])),
        mask=stack_masks([r.mask for r in records], tuple(latents.shape[-2:])),
    )
