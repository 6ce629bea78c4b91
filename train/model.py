"""The from-scratch PixArt-style transformer, and the training objectives every recipe shares.

The transformer is conditioned on the cached text embeddings (padded per batch, with a mask) and,
when ``use_additional_conditions`` is on, on PixArt's micro-conditioning: the original image
size (``resolution``) and the bucket's aspect ratio. Shapes: latents ``(B, C, h, w)``, text
``(B, L, D)`` with mask ``(B, L)``.

Objective (rectified flow, as in SD3): ``x_t = (1 - t) x0 + t eps``, the model predicts the
velocity ``eps - x0`` from ``(x_t, 1000 t, text)``; ``t`` is drawn from
``compute_density_for_timestep_sampling``. Noise and ``t`` come from a generator seeded by the
plan position ``(seed, epoch, step, rank)``, so a resumed run draws exactly what an uninterrupted
run would have drawn, whatever RNG state the checkpoint restored.

The recipes (:mod:`train.recipes`) share the two objectives' sampling: :func:`flow_sample` (rectified
flow, SD3 / Flux / PixArt) and :func:`ddpm_sample` (DDPM noise, epsilon or v-prediction targets, SDXL).
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from manifests.errors import UsageError
from train.masks import masked_mse

__all__ = ["build_model", "model_arguments", "step_generator", "flow_matching_loss", "flow_sample", "ddpm_sample",
           "FlowSample", "to_weight_dtype"]

# PixArt-alpha's layout, shrunk: what trains in seconds on a CPU
TINY = {
    "num_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 24,
    "patch_size": 2,
    "sample_size": 8,
    "use_additional_conditions": True,
}
# set from the cache: a config may not contradict what the records hold
DERIVED = ("in_channels", "out_channels", "caption_channels", "cross_attention_dim")


def model_arguments(model_cfg: dict[str, Any], *, latent_channels: int, caption_channels: int) -> dict[str, Any]:
    """``PixArtTransformer2DModel`` keyword arguments: TINY, then the config, then what the cache fixes.

    Raises ValueError for a key the class does not take or one that the cache determines.
    """
    from diffusers import PixArtTransformer2DModel

    accepted = set(inspect.signature(PixArtTransformer2DModel.__init__).parameters) - {"self"}
    unknown = sorted(set(model_cfg) - accepted)
    if unknown:
        raise UsageError(f"config model: unknown keys {unknown}; PixArtTransformer2DModel takes {sorted(accepted)}")
    fixed = sorted(set(model_cfg) & set(DERIVED))
    if fixed:
        raise UsageError(f"config model: {fixed} come from the cache (latent channels, text width); remove them")
    args = {**TINY, **model_cfg}
    inner = args["num_attention_heads"] * args["attention_head_dim"]
    if args.get("use_additional_conditions") and inner % 3:
        raise UsageError(f"config model: num_attention_heads x attention_head_dim = {inner} must be divisible by 3 "
                         "with use_additional_conditions (timestep, size and aspect embeddings share the width)")
    args.update(
        in_channels=latent_channels,
        out_channels=latent_channels,  # a velocity, not PixArt's learned-sigma pair
        caption_channels=caption_channels,
        cross_attention_dim=inner,
    )
    return args


def build_model(model_cfg: dict[str, Any], *, latent_channels: int, caption_channels: int) -> torch.nn.Module:
    """A freshly initialised PixArt transformer for latents of ``latent_channels`` channels and text
    embeddings ``caption_channels`` wide."""
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(**model_arguments(model_cfg, latent_channels=latent_channels,
                                                      caption_channels=caption_channels))  # fmt: skip


def to_weight_dtype(model: torch.nn.Module, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` in the dtype of ``model``'s weights where those are half precision (integer tensors and None
    pass as they are).

    Under DDP and FSDP2 the weights stay float32 and accelerate autocasts the forward; DeepSpeed with
    ``mixed_precision: bf16`` (or fp16) casts the weights themselves and accelerate autocasts nothing there,
    so the loader's float32 batch would fail the first layer ("mat1 and mat2 must have the same dtype").
    """
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if dtype not in (torch.bfloat16, torch.float16):
        return tensors
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def step_generator(seed: int, epoch: int, step: int, rank: int) -> torch.Generator:
    """A CPU generator that is a pure function of the plan position (see the module docstring)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{step}:{rank}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


@dataclass(frozen=True)
class FlowSample:
    """One rectified-flow draw for a batch: ``noisy = (1 - sigma) x0 + sigma eps``; ``target = eps - x0``.

    ``sigma`` (B, 1, 1, 1) in [0, 1] (one 1 per latent axis: (B, 1, 1, 1, 1) for video latents (B, C, F, h, w));
    ``weight`` of the same shape, the loss weighting of the scheme.
    """

    noisy: torch.Tensor
    sigma: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor


def flow_sample(
    latents: torch.Tensor, generator: torch.Generator, *, weighting_scheme: str = "logit_normal",
    logit_mean: float = 0.0, logit_std: float = 1.0, mode_scale: float = 1.29, shift: float = 1.0,
    sigma_range: tuple[float, float] = (0.0, 1.0),
) -> FlowSample:  # fmt: skip
    """Draw timesteps and noise for ``latents`` (B, C, h, w) or (B, C, F, h, w) on the CPU from ``generator``.

    ``u`` comes from ``compute_density_for_timestep_sampling``; ``shift`` > 1 moves it towards noise as
    ``FlowMatchEulerDiscreteScheduler(shift=...)`` does (SD3: 3.0; 1.0 leaves ``sigma = u``). ``sigma_range``
    ``(lo, hi)``: the shifted sigma mapped linearly into it, ``lo + (hi - lo) sigma`` (one expert's noise levels).
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    b = latents.shape[0]
    u = compute_density_for_timestep_sampling(
        weighting_scheme, b, logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale, generator=generator
    )  # (B,) in [0, 1]
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device)
    u = u.to(latents.device, torch.float32)
    sigma = (shift * u / (1 + (shift - 1) * u)).view(b, *(1,) * (latents.ndim - 1))  # broadcasts over C, (F,) h, w
    if sigma_range != (0.0, 1.0):
        lo, hi = sigma_range
        sigma = lo + (hi - lo) * sigma
    weight = compute_loss_weighting_for_sd3(weighting_scheme, sigmas=sigma)  # ones for logit_normal
    return FlowSample((1.0 - sigma) * latents + sigma * noise, sigma, noise - latents, weight.float())


def ddpm_sample(
    scheduler: Any, latents: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(noisy, timesteps (B,), target)`` of a DDPM step: uniform integer timesteps, Gaussian noise
    (both drawn on the CPU from ``generator``), and the target the scheduler's ``prediction_type``
    asks for: the noise (``epsilon``) or ``scheduler.get_velocity`` (``v_prediction``).

    ``scheduler``: a ``DDPMScheduler``. Raises UsageError for another prediction type.
    """
    b = latents.shape[0]
    kind = scheduler.config.prediction_type
    if kind not in ("epsilon", "v_prediction"):
        raise UsageError(f"the model's scheduler predicts {kind!r}; the trainer trains epsilon or v_prediction")
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (b,), generator=generator)
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device)
    timesteps = timesteps.to(latents.device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    target = noise if kind == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)
    return noisy, timesteps, target


def flow_matching_loss(
    model: torch.nn.Module,
    latents: torch.Tensor,
    text: torch.Tensor,
    text_mask: torch.Tensor,
    added_cond: dict[str, torch.Tensor],
    generator: torch.Generator,
    *,
    weighting_scheme: str = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    shift: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error between predicted and true velocity, a scalar (the from-scratch PixArt model);
    ``mask``: per-pixel loss weights (B, 1, h, w) normalised per sample (:func:`train.masks.masked_mse`).

    ``latents``: (B, C, h, w), already scaled by the VAE's scaling factor. ``added_cond``: PixArt's
    ``resolution`` (B, 2) and ``aspect_ratio`` (B, 1), ignored by a model without micro-conditioning.
    Noise and timesteps are drawn on the CPU from ``generator`` (reproducible on any device); ``shift``: as
    :func:`flow_sample`'s.
    """
    draw = flow_sample(latents, generator, weighting_scheme=weighting_scheme, logit_mean=logit_mean,
                       logit_std=logit_std, mode_scale=mode_scale, shift=shift)  # fmt: skip
    noisy, text, resolution, aspect = to_weight_dtype(model, draw.noisy, text, added_cond.get("resolution"),
                                                      added_cond.get("aspect_ratio"))  # fmt: skip
    added_cond = {**added_cond, "resolution": resolution, "aspect_ratio": aspect}
    pred = model(
        noisy,
        encoder_hidden_states=text,
        encoder_attention_mask=text_mask,
        timestep=draw.sigma.flatten() * 1000.0,  # PixArt embeds timesteps on DDPM's 0..1000 scale
        added_cond_kwargs=added_cond,
        return_dict=False,
    )[0]
    return masked_mse(pred, draw.target, mask, draw.weight)
