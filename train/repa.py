"""REPA, representation alignment (Yu et al. 2024): a transformer block's hidden states learn to predict the cached
DINOv2 features of the image, through a small trained projector; the denoising loss gains ``weight`` x that term.

    # a train config (the cache embedded with `bucketeer embed ... --features dinov2`)
    repa: {weight: 0.5, depth: 4, projector_dim: 2048}

- ``depth`` N: a forward hook on ``model.transformer_blocks[N]`` (SD3's joint blocks, Flux's double-stream
  blocks, PixArt's blocks) keeps the block's image tokens ``(B, T, H)`` (of a block that returns
  ``(text, image)`` states, the image ones: the last output with the image's token count);
- the projector (Linear-SiLU-Linear-SiLU-Linear, ``H -> projector_dim -> projector_dim -> D``) maps them to the
  features' width D; it is trained with the model (its own parameter group of the optimizer), saved in every
  checkpoint as ``repa.safetensors`` and read back by a resume;
- the batch's features ``(B, gh, gw, D)`` (:class:`train.data.Batch` ``features``, float16 as cached) are
  interpolated bilinearly to the model's token grid ``(h / p, w / p)`` of the ``(h, w)`` latents;
- the term is ``weight * mean over tokens and samples of -cos(projector(hidden), features)`` (:func:`repa_loss`).

The features come from the cache: no DINOv2 runs in the step (``benchmarks/repa.py`` measures what that saves).
A UNet family (sdxl) has no token blocks: refused. Runs on one process or DDP (the projector's gradients are
averaged over ranks by a hook); FSDP and DeepSpeed are refused (the projector is not part of their model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from manifests.errors import UsageError

__all__ = ["RepaConfig", "Repa", "projector", "interpolate_features", "repa_loss", "REPA_FILE"]

REPA_FILE = "repa.safetensors"


@dataclass(frozen=True)
class RepaConfig:
    """The ``repa:`` mapping of a train config: ``depth`` (required), ``weight``, ``projector_dim``."""

    depth: int
    weight: float = 0.5
    projector_dim: int = 2048

    @classmethod
    def from_json(cls, d: Any) -> "RepaConfig":
        """Parse ``repa:``; UsageError naming the key for unknown keys, wrong types or bad values."""
        if not isinstance(d, Mapping):
            raise UsageError(f"config repa: a mapping such as {{weight: 0.5, depth: 4, projector_dim: 2048}}, "
                             f"not {d!r}")
        unknown = sorted(set(d) - {"depth", "weight", "projector_dim"})
        if unknown or "depth" not in d:
            raise UsageError(f"config repa: {'unknown keys ' + str(unknown) if unknown else 'depth is required'}; "
                             "keys: depth (the transformer block whose output is aligned), weight, projector_dim")
        ints = {k: d[k] for k in ("depth", "projector_dim") if k in d}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints.values()):
            raise UsageError(f"config repa: depth and projector_dim are integers, got {ints}")
        weight = d.get("weight", 0.5)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise UsageError(f"config repa: weight must be a number > 0, got {weight!r}")
        config = cls(int(d["depth"]), float(weight), int(d.get("projector_dim", 2048)))
        if config.depth < 0 or config.projector_dim < 1:
            raise UsageError("config repa: depth must be >= 0 and projector_dim >= 1")
        return config


def projector(hidden: int, width: int, features: int) -> torch.nn.Sequential:
    """REPA's projector: Linear-SiLU-Linear-SiLU-Linear, ``hidden -> width -> width -> features``."""
    return torch.nn.Sequential(torch.nn.Linear(hidden, width), torch.nn.SiLU(), torch.nn.Linear(width, width),
                               torch.nn.SiLU(), torch.nn.Linear(width, features))  # fmt: skip


def interpolate_features(features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``(B, gh, gw, D)`` features -> float32 ``(B, grid_h * grid_w, D)``, bilinear on the 2-D grid (as is when
    equal)."""
    x = features.float().permute(0, 3, 1, 2)  # (B, D, gh, gw)
    if tuple(x.shape[-2:]) != tuple(grid):
        x = F.interpolate(x, size=tuple(grid), mode="bilinear", align_corners=False)
    return x.flatten(2).transpose(1, 2)  # (B, T, D)


def repa_loss(hidden: torch.Tensor, features: torch.Tensor, project: torch.nn.Module, grid: tuple[int, int]):
    """Mean over samples and tokens of ``-cos(project(hidden), features)``: ``hidden`` (B, T, H) with T = grid_h x
    grid_w, ``features`` (B, gh, gw, D). A scalar in [-1, 1]."""
    target = interpolate_features(features, grid)  # (B, T, D)
    return -F.cosine_similarity(project(hidden.float()), target, dim=-1).mean()


class Repa:
    """The hook on block ``depth`` of ``model`` (unwrapped), the projector on ``device``, and :meth:`loss`."""

    def __init__(self, config: RepaConfig, model: torch.nn.Module, feature_dim: int, device: Any, seed: int = 0):
        blocks = getattr(model, "transformer_blocks", None)
        if blocks is None:
            raise UsageError(f"config repa: {type(model).__name__} has no transformer blocks to align (a UNet "
                             "family such as sdxl); REPA works with the transformer families sd3, flux and pixart")
        if config.depth >= len(blocks):
            raise UsageError(f"config repa: depth {config.depth}, but the model has {len(blocks)} transformer blocks "
                             f"(0..{len(blocks) - 1})")  # fmt: skip
        cfg = model.config
        hidden = int(cfg.num_attention_heads) * int(cfg.attention_head_dim)
        self.config, self.output = config, None
        with torch.random.fork_rng(devices=[]):  # the same initial projector on every rank, whatever the RNG state
            torch.manual_seed(seed)
            self.projector = projector(hidden, config.projector_dim, feature_dim).to(device)
        blocks[config.depth].register_forward_hook(self._keep)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            for p in self.projector.parameters():  # DDP's average, for the projector DDP does not wrap
                p.register_hook(lambda g, world=world: _all_mean(g, world))

    def _keep(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.output = output

    def loss(self, batch: Any) -> torch.Tensor:
        """``weight`` x the alignment term of the forward pass just taken on ``batch`` (a :class:`train.data.Batch`
        on the device); call it right after the denoiser's loss."""
        if batch.features is None:
            raise UsageError("config repa: the cache has no DINOv2 features; embed it with --features dinov2")
        # the image tokens: a block that returns (text, image) states gives the image ones last
        kept = self.output if isinstance(self.output, (tuple, list)) else (self.output,)
        self.output = None
        hidden = next(o for o in reversed(kept) if isinstance(o, torch.Tensor) and o.ndim == 3)  # (B, T, H)
        h, w = batch.latents.shape[-2:]
        patch = round(math.sqrt(h * w / hidden.shape[1]))
        grid = (h // patch, w // patch)  # the model's token grid
        assert grid[0] * grid[1] == hidden.shape[1], f"{hidden.shape[1]} tokens are no grid of {h}x{w} latents"
        return self.config.weight * repa_loss(hidden, batch.features, self.projector, grid)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.projector.parameters())

    def register(self, accelerator: Any) -> None:
        """``repa.safetensors`` (the projector) in every checkpoint (main process), read back by ``load_state``."""
        from safetensors.torch import load_file, save_file

        def save(models, weights, folder):
            if accelerator.is_main_process:
                state = {k: v.detach().cpu().contiguous() for k, v in self.projector.state_dict().items()}
                save_file(state, str(Path(folder) / REPA_FILE))

        def load(models, folder):
            path = Path(folder) / REPA_FILE
            if not path.exists():
                raise UsageError(f"{Path(folder).name}: the config asks for repa but the checkpoint has no {REPA_FILE} "
                                 "(it was trained without REPA); resume without repa, or use a new --output-dir")
            try:
                self.projector.load_state_dict(load_file(str(path), device=str(self.parameters()[0].device)))
            except RuntimeError as e:
                raise UsageError(f"{path}: its projector does not fit this run's repa settings ({e}); resume with "
                                 "the settings it was trained with, or use a new --output-dir") from None

        accelerator.register_save_state_pre_hook(save)
        accelerator.register_load_state_pre_hook(load)


def _all_mean(grad: torch.Tensor, world: int) -> torch.Tensor:
    grad = grad.clone()
    torch.distributed.all_reduce(grad)
    return grad / world


def setup_repa(accelerator: Any, settings: Mapping[str, Any], model: torch.nn.Module, meta: Any, seed: int) -> Repa:
    """The :class:`Repa` of a run: ``settings`` (the config's ``repa:``), ``model`` unwrapped, ``meta`` the cache's
    ``_cache.json`` (its ``features``). UsageError for a cache without features, a UNet, FSDP or DeepSpeed."""
    config = RepaConfig.from_json(settings)
    if meta.features is None or not meta.features.dim:
        raise UsageError("config repa: the cache has no DINOv2 features; embed it with `bucketeer embed ... "
                         "--features dinov2` (into a new --out)")  # fmt: skip
    backend = str(getattr(accelerator, "distributed_type", "")).upper()
    if "DEEPSPEED" in backend or "FSDP" in backend:
        raise UsageError("config repa: train with DDP or one process (the projector is not part of the FSDP or "
                         "DeepSpeed model)")  # fmt: skip
    repa = Repa(config, model, int(meta.features.dim), accelerator.device, seed)
    repa.register(accelerator)
    return repa
