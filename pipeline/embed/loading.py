"""What every embed encoder shares: where a model comes from, how it is checked and loaded, its weights' hash.

:class:`EncoderSource` names a model (hub id or folder, subfolder; ``default`` is the tiny random-weight model
of a family, built on first use: :mod:`pipeline.embed.families.tiny`); :class:`Encoder` is the protocol the embed
workers use (``describe()``, ``encode(batch)``); :func:`weights_sha256` fingerprints loaded weights;
:func:`to_storage` casts a tensor to a storage dtype tag. The latent encoders are :mod:`pipeline.embed.latents`,
the text encoders and the specs the ``embed`` options make :mod:`pipeline.embed.encoders`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from manifests.errors import UsageError
from manifests.storage import redact
from pipeline.embed.families.tiny import TINY_VERSION, ensure_tiny

__all__ = ["DEFAULT_ID", "STORAGE_DTYPES", "LATENTS", "Encoder", "EncoderSource", "weights_sha256", "to_storage",
           "quiet_loading", "device_and_dtype", "check_local"]

DEFAULT_ID = "default"
STORAGE_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
LATENTS = ("mean", "posterior")  # --latents: the posterior mean, or mean and std (for per-step sampling)


Batch = TypeVar("Batch", contravariant=True)


class Encoder(Protocol[Batch]):
    """What the embed workers need from an encoder, and all they use: ``describe()`` (ids, weight
    hashes and shapes, for the cache's fingerprint) and ``encode(batch)``. :class:`LatentEncoder` is
    an ``Encoder[np.ndarray]`` (pixels), :class:`TextEncoders` an ``Encoder[list[str]]`` (captions)."""

    def describe(self) -> dict[str, Any]: ...

    def encode(self, batch: Batch) -> Any: ...


@dataclass(frozen=True)
class EncoderSource:
    """Where a model comes from: hub id or local folder, and the subfolder inside it.

    ``default`` is the tiny random-weight model of ``family`` (built on first use under ``home``, the
    driver's ``$BUCKETEER_HOME``, so that every worker finds the same one).
    """

    source: str
    subfolder: str | None = None
    home: str | None = None
    family: str = "generic"

    @property
    def is_default(self) -> bool:
        return self.source == DEFAULT_ID

    @property
    def ident(self) -> str:
        """The id recorded in ``_cache.json`` (credentials redacted; the default's names its version)."""
        if self.is_default:
            return f"bucketeer:default-{TINY_VERSION}" if self.family == "generic" else \
                f"bucketeer:default-{self.family}-{TINY_VERSION}"  # fmt: skip
        return redact(self.source)

    def resolve(self, default_subfolder: str | None = None) -> tuple[str, str | None]:
        """``(path_or_id, subfolder)`` to pass to ``from_pretrained``; the default is built on first use."""
        if self.is_default:
            return str(ensure_tiny(self.family, self.home)), self.subfolder or default_subfolder
        return self.source, self.subfolder


def weights_sha256(model: Any) -> str:
    """sha256 over the model's state dict (sorted names, dtypes, shapes, raw bytes): source-independent."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def to_storage(tensor: Any, dtype: str) -> np.ndarray:
    """A torch tensor as numpy in the storage dtype tag (BF16 returned as its uint16 bits)."""
    import torch

    if dtype == "BF16":
        return tensor.to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.to(torch.float16 if dtype == "F16" else torch.float32).cpu().numpy()


def quiet_loading() -> None:
    """Silence per-file progress bars of from_pretrained (one per worker would flood the job log)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


def device_and_dtype(use_gpu: bool, dtype: str, compute: str | None = None):
    """``(device, compute dtype)`` of an encoder: CUDA in bf16 (or fp32) when asked and there, else the CPU in
    fp32. ``compute`` ``"BF16"``/``"F32"``: that compute dtype wherever it runs (the GPU's bf16 path on a CPU, which
    the tests compare with the pipelines run in bf16)."""
    import torch

    if compute is not None:
        device = torch.device("cuda") if use_gpu and torch.cuda.is_available() else torch.device("cpu")
        return device, {"BF16": torch.bfloat16, "F32": torch.float32}[compute]
    if use_gpu and torch.cuda.is_available():
        # fp16 VAEs overflow (SDXL's VAE NaNs in fp16): compute in bf16 or fp32, store in `dtype`
        return torch.device("cuda"), torch.bfloat16 if dtype == "BF16" else torch.float32
    return torch.device("cpu"), torch.float32


def check_local(path: str, subfolder: str | None, option: str, expected: str, files: tuple[str, ...],
                 note: str = "") -> None:
    """Fail early and clearly when a local folder lacks what ``from_pretrained`` will look for.

    Hub ids (not local folders) are left to ``from_pretrained``. Raises ValueError naming the
    option and the folder, with the subfolder to pass when ``path`` is a diffusers pipeline folder.
    """
    if not os.path.isdir(path):
        return
    folder = Path(path, subfolder or "")
    if any((folder / f).is_file() for f in files):
        return
    hint = note
    if not subfolder and (Path(path) / expected / files[0]).is_file():
        hint = f" It looks like a diffusers pipeline folder: pass {option}-subfolder {expected}."
    raise UsageError(f"{option} {path}{f' ({option}-subfolder {subfolder})' if subfolder else ''}: "
                     f"no {' or '.join(files)} in {folder}.{hint}")  # fmt: skip
