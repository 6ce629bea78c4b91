"""DINOv2 patch features of the exact pixels the VAE saw, for REPA (``bucketeer embed --features dinov2``).

    bucketeer embed MANIFEST --out CACHE --features dinov2 --features-model facebook/dinov2-base

Each variant's crop (flipped ones included: the same ``(H, W, 3)`` uint8 pixels the VAE encoded) is
resized to the model's input size (``crop_size`` of its image processor, e.g. 224 x 224 for
``facebook/dinov2-base``: a multiple of the patch size) with bicubic antialiased interpolation
(``torch.nn.functional.interpolate``, in float32 on [0, 1]), normalised with the processor's ImageNet
``image_mean`` / ``image_std``, and run through the model (``AutoModel``: ``Dinov2Model``, or
``Dinov2WithRegistersModel``). The record keeps ``last_hidden_state``'s patch tokens (the CLS token and
any register tokens dropped) as ``(gh, gw, D)`` float16, ``gh, gw = input_size / patch_size``.
:func:`preprocess` is that recipe, so anyone can recompute a record's features from its crop.

``--features-model default`` is a tiny random-weight ``Dinov2Model`` (32 wide, patch 8, input 32 x 32,
a 4 x 4 grid), built once under ``$BUCKETEER_HOME/default-encoders/`` like embed's other defaults: for
trying the pipeline, useless for training. What was used (id, weight hash, input size, grid, width)
is fingerprinted in ``_cache.json`` ``settings.features`` and described in ``features``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from manifests.errors import UsageError
from manifests.storage import redact
from pipeline.embed.families.tiny import TINY_VERSION, build_once, tiny_dir
from pipeline.embed.processors import load_image_processor

__all__ = ["FEATURE_KINDS", "FeatureSpec", "FeatureEncoder", "preprocess", "build_tiny_dinov2"]

FEATURE_KINDS = ("dinov2",)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
RESIZE = "bicubic, antialias, float32 [0, 1] (torch.nn.functional.interpolate)"


def build_tiny_dinov2(folder: Path) -> None:
    """A tiny random-weight ``Dinov2Model`` (seeded) and its ``BitImageProcessor`` config in ``folder``."""
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(7)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          mlp_ratio=2, patch_size=8, image_size=64)  # fmt: skip
    # the input size is the processor's crop (32), not the config's image_size (64, as dinov2-base: 518 vs 224)
    Dinov2Model(config).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_mean=IMAGENET_MEAN,
                      image_std=IMAGENET_STD).save_pretrained(folder)  # fmt: skip
    (folder / "README.txt").write_text("bucketeer's default DINOv2: tiny random weights, for trying REPA only\n")


@dataclass(frozen=True)
class FeatureSpec:
    """Which features to compute: ``kind`` (``dinov2``), ``source`` (hub id, folder, or ``default``)."""

    kind: str = "dinov2"
    source: str = "default"
    home: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FEATURE_KINDS:
            raise UsageError(f"--features {self.kind!r}: choose one of {', '.join(FEATURE_KINDS)}")

    @property
    def ident(self) -> str:
        """The id recorded in ``_cache.json`` (credentials redacted; the default names its version)."""
        return f"bucketeer:default-dinov2-{TINY_VERSION}" if self.source == "default" else redact(self.source)

    def path(self) -> str:
        if self.source == "default":
            return str(build_once(tiny_dir("dinov2", self.home), build_tiny_dinov2))
        return self.source

    def load(self, *, use_gpu: bool = False, dtype: str = "BF16") -> "FeatureEncoder":
        return FeatureEncoder(self, use_gpu=use_gpu, dtype=dtype)


def _pair(size: Any) -> tuple[int, int]:
    """``(h, w)`` of an image processor's size: a dict or a ``SizeDict`` (height/width or shortest_edge), an int."""
    if isinstance(size, int):
        return size, size
    get = size.get if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    if get("height") is not None:
        return int(get("height")), int(get("width"))
    if get("shortest_edge") is not None:
        return int(get("shortest_edge")), int(get("shortest_edge"))
    return int(size[0]), int(size[1])


def preprocess(pixels: Any, input_size: tuple[int, int], mean, std):
    """uint8 ``(B, H, W, 3)`` (numpy or torch) -> normalised float32 ``(B, 3, h, w)`` at ``input_size`` (h, w)."""
    import torch
    import torch.nn.functional as F

    x = pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(pixels))
    x = x.permute(0, 3, 1, 2).float() / 255.0  # (B, 3, H, W) in [0, 1]
    if tuple(x.shape[-2:]) != tuple(input_size):
        x = F.interpolate(x, size=tuple(input_size), mode="bicubic", antialias=True, align_corners=False)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    return (x - m) / s


class FeatureEncoder:
    """uint8 pixels ``(B, H, W, 3)`` -> patch features ``(B, gh, gw, D)`` float32 (see the module docstring)."""

    def __init__(self, spec: FeatureSpec, *, use_gpu: bool = False, dtype: str = "BF16"):
        import torch
        from transformers import AutoModel

        from pipeline.embed.loading import weights_sha256

        self.spec, path = spec, spec.path()
        try:
            self.model = AutoModel.from_pretrained(path).eval()
        except (OSError, ValueError) as e:
            raise UsageError(f"--features-model {redact(str(path))}: cannot load a DINOv2 model: {e}") from None
        config = self.model.config
        if not str(config.model_type).startswith("dinov2"):
            raise UsageError(f"--features-model {redact(str(path))} is a {config.model_type!r}, not a DINOv2 model")
        self.weights = weights_sha256(self.model)
        self.mean, self.std, self.input_size = IMAGENET_MEAN, IMAGENET_STD, _pair(config.image_size)
        try:
            processor = load_image_processor(path)
            self.mean, self.std = tuple(map(float, processor.image_mean)), tuple(map(float, processor.image_std))
            self.input_size = _pair(getattr(processor, "crop_size", None) or processor.size)
        except (OSError, ValueError):  # no preprocessor_config.json: ImageNet statistics at the config's image_size
            pass
        self.patch = int(config.patch_size)
        if self.input_size[0] % self.patch or self.input_size[1] % self.patch:
            raise UsageError(f"--features-model {redact(str(path))}: input size {self.input_size} is not a multiple "
                             f"of its patch size {self.patch}")  # fmt: skip
        self.skip = 1 + int(getattr(config, "num_register_tokens", 0) or 0)  # CLS, then registers
        cuda = use_gpu and torch.cuda.is_available()
        self.device = torch.device("cuda" if cuda else "cpu")
        self.compute_dtype = torch.bfloat16 if cuda and dtype == "BF16" else torch.float32
        self.model.to(self.device, self.compute_dtype)

    @property
    def grid(self) -> tuple[int, int]:
        return self.input_size[0] // self.patch, self.input_size[1] // self.patch

    def describe(self) -> dict[str, Any]:
        """What ``settings.features`` fingerprints (:class:`manifests.cache.FeaturesInfo`)."""
        return {"kind": self.spec.kind, "id": self.spec.ident, "class": type(self.model).__name__,
                "weights_sha256": self.weights, "input_size": list(self.input_size), "patch_size": self.patch,
                "grid": list(self.grid), "dim": int(self.model.config.hidden_size), "resize": RESIZE,
                "mean": list(self.mean), "std": list(self.std)}  # fmt: skip

    def encode(self, pixels: Any):
        """``(B, gh, gw, D)`` float32 torch tensor on the CPU of ``pixels`` uint8 ``(B, H, W, 3)``: a numpy array, or
        a torch tensor on any device (the VAE's batch, already on the GPU, is not copied again)."""
        import torch

        with torch.inference_mode():
            x = pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(pixels))
            x = preprocess(x.to(self.device), self.input_size, self.mean, self.std).to(self.compute_dtype)
            tokens = self.model(pixel_values=x).last_hidden_state[:, self.skip :]  # (B, gh * gw, D)
            gh, gw = self.grid
            return tokens.float().reshape(len(x), gh, gw, -1).cpu()
