"""Latent encoders: each VAE's path from pixels to what the family's denoiser is given, and what ``_cache.json``
says of it.

Latents are the VAE posterior **mean** (``latent_dist.mean``), unscaled, and with ``--latents posterior`` also its
standard deviation: the trainer draws ``mean + std * noise`` and applies what ``_cache.json`` ``latent`` records
(``scaling_factor`` after ``shift_factor``; Wan's per-channel ``latents_mean``/``latents_std``). Two VAEs store
their latents as the denoiser sees them instead, with nothing left for the trainer to do (``usage`` says so):
Flux 2's (patchified 2x2 and normalised by its batch-norm statistics: :mod:`pipeline.embed.families.flux2`) and
Qwen-Image's (normalised per channel as ``QwenImageEditPipeline._encode_vae_image`` does:
:mod:`pipeline.embed.families.qwen_image`), and LTX-2's clips (as ``LTX2Pipeline._normalize_latents`` does:
:mod:`pipeline.embed.families.ltx2`). Which path a VAE takes is its config's ``_class_name``
(:data:`VAE_PATHS`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from manifests.families import SPECS
from pipeline.embed.families import flux2, hunyuan_video15, kandinsky5, ltx2, qwen_image, qwen_image21
from pipeline.embed.loading import EncoderSource, check_local, device_and_dtype, weights_sha256
from pipeline.embed.vae_speed import as_input, gpu_tuning, tune_vae

if TYPE_CHECKING:  # a diffusers model's .config
    from diffusers.configuration_utils import FrozenDict

__all__ = ["LatentSpec", "LatentEncoder", "VAE_PATHS", "VAE_CLASSES"]


@dataclass(frozen=True)
class LatentSpec:
    """The VAE to load and what to keep of its posterior (``latents``: one of :data:`LATENTS`); ``features``: a
    :class:`pipeline.embed.features.FeatureSpec` run on the same pixels (``--features``), or None; ``compile``:
    ``torch.compile`` its encoder (``--compile-vae``: :mod:`pipeline.embed.vae_speed`, not fingerprinted)."""

    source: EncoderSource
    latents: str = "mean"
    features: Any = None
    compile: bool = False

    def load(self, *, use_gpu: bool = False, dtype: str = "BF16", compute: str | None = None) -> "LatentEncoder":
        """The VAE, loaded (``compute``: :func:`~pipeline.embed.loading.device_and_dtype`'s)."""
        return LatentEncoder(self, use_gpu=use_gpu, dtype=dtype, compute=compute)


def latent_shape(spec: LatentSpec) -> dict[str, Any]:
    """What :meth:`LatentEncoder.describe` says of the latents' shape (``factor``, ``channels``, ...), from the VAE's
    config alone, built on the meta device (no weight read): what ``bucketeer estimate`` counts bytes with."""
    import torch

    path, subfolder = spec.source.resolve("vae")
    check_local(path, subfolder, "--vae", "vae", ("config.json",))
    cls = _vae_class(path, subfolder)
    kind = vae_kind(cls.__name__, spec.source.family)
    with torch.device("meta"):
        vae = cls.from_config(cls.load_config(path, subfolder=subfolder))
    return family_shape(kind.shape(vae if kind.of_model else vae.config), spec.source.family)


def family_shape(shape: dict[str, Any], family: str) -> dict[str, Any]:
    """``shape`` as ``family``'s pipeline normalises its VAE's latents: ``shift_factor`` null where the pipeline
    subtracts none though the config has one (the family declares ``Vae.normalise`` ``"scale_no_shift"``: Kandinsky 5
    with FLUX.1's VAE), so that ``_cache.json`` says so, the loader applies none, and ``embed --reuse`` tells these
    latents from Flux's."""
    spec = SPECS.get(family)
    if spec is None or spec.vae.normalise != "scale_no_shift" or shape.get("shift_factor") is None:
        return shape
    return {**shape, "shift_factor": None,
            "usage": f"z = latent * scaling_factor ({family}'s pipeline applies no shift_factor)"}  # fmt: skip


def _kl_shape(cfg: FrozenDict) -> dict[str, Any]:
    return {"factor": 2 ** (len(cfg.block_out_channels) - 1), "channels": int(cfg.latent_channels),
            "scaling_factor": float(cfg.scaling_factor),
            "shift_factor": None if getattr(cfg, "shift_factor", None) is None else float(cfg.shift_factor)}


def _wan_shape(cfg: FrozenDict) -> dict[str, Any]:  # no scaling factor: the trainer normalises per channel
    return {"factor": int(cfg.scale_factor_spatial), "channels": int(cfg.z_dim), "scaling_factor": 1.0,
            "shift_factor": None, "latents_mean": [float(x) for x in cfg.latents_mean],
            "latents_std": [float(x) for x in cfg.latents_std], "temporal_factor": int(cfg.scale_factor_temporal)}


def _flux2_shape(cfg: FrozenDict, eps: float | None = None) -> dict[str, Any]:
    """Patchified 2x2 and normalised by the batch-norm statistics; ``eps``: a family's own batch-norm eps, recorded
    (so that ``embed --reuse`` tells its latents from Flux 2's), None: the config's."""
    shape = {"factor": 2 ** len(cfg.block_out_channels), "channels": 4 * int(cfg.latent_channels),
             "scaling_factor": 1.0, "shift_factor": None, "usage": flux2.LATENT_USAGE}  # fmt: skip
    if eps is not None:
        shape["usage"] += f"; the batch-norm eps is {eps!r}, the family pipeline's own, not the config's"
        shape["normalised"] = {"batch_norm_eps": eps, "how": flux2.BN_NORMALISED}
    return shape


def _posterior(vae: Any, x: Any, std: bool) -> dict[str, Any]:
    """The posterior's mean ``(B, C, h, w)`` (a clip's ``(B, C, F', h, w)``), and its std with ``std``."""
    posterior = vae.encode(x).latent_dist
    out = {"latent": posterior.mean.float()}
    if std:
        out["latent_std"] = posterior.std.float()  # exp(logvar / 2), logvar clamped
    return out


def _flux2_latents(vae: Any, x: Any, std: bool, eps: float | None = None) -> dict[str, Any]:
    """Flux 2: the posterior as the transformer sees it, ``(B, 4C, h/2, w/2)`` normalised (std likewise), with the
    batch-norm ``eps`` (None: the config's)."""
    out = _posterior(vae, x, std)
    latent, scaled = flux2.denoiser_latents(vae, out["latent"], out.get("latent_std"), eps=eps)
    return {"latent": latent, **({"latent_std": scaled} if scaled is not None else {})}


@dataclass(frozen=True)
class VaeKind:
    """One VAE class's kind: what ``_cache.json`` records of its config (``shape``), pixels in [-1, 1] to latents
    (``latents(vae, x, std)``), and whether it takes clips."""

    shape: Callable[[Any], dict[str, Any]]
    latents: Callable[[Any, Any, bool], dict[str, Any]] = _posterior
    video: bool = False
    of_model: bool = False  # shape() reads the VAE itself (LTX-2's statistics are buffers), not its config


# a VAE config's _class_name -> its path (an unknown or missing one loads as AutoencoderKL, as always)
VAE_PATHS: dict[str, VaeKind] = {
    "AutoencoderKL": VaeKind(_kl_shape),
    "AutoencoderKLWan": VaeKind(_wan_shape, video=True),  # clips (B, 3, F, H, W)
    "AutoencoderKLFlux2": VaeKind(_flux2_shape, _flux2_latents),
    # Wan-style, images as 1-frame clips, stored normalised per channel
    "AutoencoderKLQwenImage": VaeKind(qwen_image.vae_description,
                                      lambda vae, x, std: qwen_image.vae_latents(vae, x, std=std)),
    "AutoencoderKLLTX2Video": VaeKind(ltx2.vae_description, ltx2.vae_latents, video=True, of_model=True),
    # clips one at a time, scaled by scaling_factor in the loader
    "AutoencoderKLHunyuanVideo15": VaeKind(hunyuan_video15.vae_description, hunyuan_video15.vae_latents, video=True),
    # HunyuanVideo 1.0's (Kandinsky 5 video): the posterior, scaled by scaling_factor in the loader
    "AutoencoderKLHunyuanVideo": VaeKind(kandinsky5.vae_description, kandinsky5.vae_latents, video=True),
    # Qwen-Image 2.1's: RGBA in (alpha +1), 16x, 64 channels, stored normalised per channel
    "AutoencoderKLQwenImage21": VaeKind(qwen_image21.vae_description,
                                        lambda vae, x, std: qwen_image21.vae_latents(vae, x, std=std)),
}
VAE_CLASSES = tuple(VAE_PATHS)


def vae_kind(cls_name: str, family: str) -> VaeKind:
    """The path of a ``cls_name`` VAE for ``family``: the class's, with the batch-norm eps the family declares where
    its pipeline has one of its own (``Vae.bn_eps``, manifests/families: ERNIE-Image on FLUX.2's VAE)."""
    spec = SPECS.get(family)
    eps = spec.vae.bn_eps if spec is not None and cls_name == "AutoencoderKLFlux2" else None
    if eps is None:
        return VAE_PATHS[cls_name]
    return VaeKind(functools.partial(_flux2_shape, eps=eps), functools.partial(_flux2_latents, eps=eps))


def _vae_class(path: str, subfolder: str | None):
    """The diffusers VAE class ``path``/``subfolder``'s config names (else ``AutoencoderKL``, as always)."""
    import diffusers

    try:
        name = diffusers.AutoencoderKL.load_config(path, subfolder=subfolder).get("_class_name")
    except (OSError, ValueError):  # let from_pretrained say what is missing, as it always did
        name = None
    return getattr(diffusers, name if name in VAE_PATHS else "AutoencoderKL")


class LatentEncoder:
    """``AutoencoderKL`` latents: uint8 pixels ``(B, H, W, 3)`` -> ``{"latent": posterior mean (B, C, H/f, W/f)}``,
    plus ``"latent_std"`` (same shape) with ``--latents posterior``. A video VAE (``AutoencoderKLWan``, when the
    folder's config names it) takes clips ``(B, F, H, W, 3)`` -> ``(B, C, F', H/f, W/f)``, F' = (F - 1) //
    temporal_factor + 1 (an image is a 1-frame clip). Flux 2 and Qwen-Image VAEs: see the module docstring.
    On cuda the VAE is tuned (:mod:`pipeline.embed.vae_speed`: NHWC, cuDNN autotuning, and with ``compile`` its
    encoder compiled); a batch goes to the device once, pinned, and the features model takes it from there."""

    def __init__(self, spec: LatentSpec, *, use_gpu: bool = False, dtype: str = "BF16", compute: str | None = None):
        path, subfolder = spec.source.resolve("vae")
        self.id, self.latents = spec.source.ident, spec.latents
        check_local(path, subfolder, "--vae", "vae", ("config.json",))
        self.device, self.compute_dtype = device_and_dtype(use_gpu, dtype, compute)
        self.vae = _vae_class(path, subfolder).from_pretrained(path, subfolder=subfolder).eval()
        self.kind = vae_kind(type(self.vae).__name__, spec.source.family)
        self.video = self.kind.video
        self.weights = weights_sha256(self.vae)  # of the weights as published, before any cast
        self.vae.to(self.device)
        if self.compute_dtype != self.vae.dtype:
            self.vae.to(dtype=self.compute_dtype)
        self.tuning = tune_vae(self.vae, **gpu_tuning(self.device, spec.compile))
        self._pinned: dict[tuple[int, ...], Any] = {}  # cuda: host buffers the batches are copied from
        self._copied: Any = None  # the event after the last copy out of one of them
        self.subfolder, self.family = subfolder, spec.source.family
        self.features = None if spec.features is None else spec.features.load(use_gpu=use_gpu, dtype=dtype)

    def describe(self) -> dict[str, Any]:
        shape = family_shape(self.kind.shape(self.vae if self.kind.of_model else self.vae.config), self.family)
        return {
            "id": self.id,
            "subfolder": self.subfolder,
            "class": type(self.vae).__name__,
            "weights_sha256": self.weights,
            **shape,
            "latents": self.latents,
            "device": str(self.device),  # where it runs: recorded in _cache.json, not fingerprinted
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "tuning": self.tuning.describe(),  # how it runs (vae_speed): not fingerprinted either
            "features": None if self.features is None else self.features.describe(),
        }

    def encode(self, batch: np.ndarray, features_of: int | None = None) -> dict[str, Any]:
        """``features_of``: with ``--features``, also ``"features"`` ``(n, gh, gw, D)`` of the first n images."""
        import torch

        with torch.inference_mode():
            pixels = self._to_device(batch)  # (B, H, W, 3) uint8, or a clip (B, F, H, W, 3)
            # the features model takes the batch where it already is: no second copy from the host
            extra = {} if self.features is None else {"features": self.features.encode(pixels[:features_of])}
            # (B, 3, H, W) uint8, or a clip (B, 3, F, H, W)
            x = pixels.permute(0, 4, 1, 2, 3) if pixels.ndim == 5 else pixels.permute(0, 3, 1, 2)
            # [-1, 1] in float32, then the compute dtype, as diffusers' image processor does: in bf16 the division
            # rounds to 1/128 above 1.0 and the subtraction keeps that, up to half a level off for bright pixels
            x = as_input((x.float() / 127.5 - 1.0).to(self.compute_dtype), self.tuning)
            out = self.kind.latents(self.vae, x, self.latents == "posterior")
            if self.tuning.channels_last:  # NHWC latents back in the usual layout, as the untuned path returns them
                out = {k: v.contiguous() for k, v in out.items()}
            return {**out, **extra}

    def _to_device(self, batch: np.ndarray):
        """``batch`` as a uint8 tensor on the device: on cuda copied once into pinned memory, then sent without
        blocking the host (the kernels that read it wait on the stream); on the CPU the array itself."""
        import torch

        if self.device.type == "cuda":
            pinned = self._pinned.get(batch.shape)  # pinning is a slow allocation: one buffer per shape, reused
            if pinned is None:
                if len(self._pinned) >= 4:  # buckets come in runs: a few shapes at a time
                    self._pinned.clear()
                pinned = self._pinned[batch.shape] = torch.empty(batch.shape, dtype=torch.uint8, pin_memory=True)
            if self._copied is not None:
                self._copied.synchronize()  # the last copy out of a buffer has left it
            pinned.numpy()[...] = batch
            on_device = pinned.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            return on_device
        return torch.from_numpy(batch if batch.flags.writeable else batch.copy())  # Ray hands out read-only arrays
