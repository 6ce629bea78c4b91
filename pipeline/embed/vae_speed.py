"""The VAE encoder at the GPU's pace, its latents still diffusers' within bf16 rounding (``embed`` on cuda).

:func:`tune_vae` is what :class:`~pipeline.embed.latents.LatentEncoder` applies to its VAE on cuda
(:func:`gpu_tuning`), and what a CPU test applies to compare with the untuned model:

- ``channels_last``: a 2D VAE's weights (and :func:`as_input`: its input) in NHWC, the layout cuDNN's bf16
  tensor-core convolutions run in without a transpose around each call. 3D VAEs (Wan, Qwen-Image, LTX-2,
  HunyuanVideo 1.5) keep theirs: NDHWC's gain on their causal convolutions is not measured. Eager GroupNorm on
  CUDA computes in NCHW, so each one converts the layout back and forth: ``gpu_check.py``'s ``vae`` rows measure
  what this wins, nothing here assumes it.
- ``cudnn.benchmark``: cuDNN times its algorithms once per input shape (a bucket and batch size) and keeps the
  fastest. A process-wide switch: the embed worker owns its process.
- attention through ``torch.nn.functional.scaled_dot_product_attention``: diffusers 0.42's ``AutoencoderKL`` and
  ``AutoencoderKLFlux2`` mid-block attention already uses ``AttnProcessor2_0`` (SDPA) and Qwen-Image's calls SDPA
  itself; :func:`sdpa_attention` sets it where a model holds another processor (none today).
- ``compile`` (``embed --compile-vae``, opt-in, also on a CPU): ``torch.compile`` of a 2D VAE's encoder in place
  (``Module.compile``: its weights and state-dict names stay), compiled at the first batch of each new shape, then
  with dynamic sizes (one recompile). Latents stay within bf16 rounding, so nothing here is fingerprinted: a
  cache made with or without it is the same cache (``_cache.json`` keeps the worker's ``device``, not this).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["VaeTuning", "tune_vae", "gpu_tuning", "is_2d", "sdpa_attention", "as_input"]


@dataclass(frozen=True)
class VaeTuning:
    """What :func:`tune_vae` applied to a VAE (``attention``: ``"sdpa"`` when every attention of the encoder runs
    through SDPA)."""

    channels_last: bool = False
    cudnn_benchmark: bool = False
    compiled: bool = False
    attention: str = "sdpa"

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def gpu_tuning(device: Any, compile: bool = False) -> dict[str, bool]:
    """:func:`tune_vae`'s switches for a VAE on ``device``: all of them on cuda, on a CPU only ``compile`` when asked
    (NHWC convolutions on a CPU are not faster for these VAEs, and a CPU run keeps its plain path)."""
    cuda = getattr(device, "type", str(device)) == "cuda"
    return {"channels_last": cuda, "cudnn_benchmark": cuda, "compile": compile}


def is_2d(vae: Any) -> bool:
    """Whether ``vae``'s encoder convolves images (4-D weights), not clips: what channels_last and compile take.
    Its first convolution's weight: LTX-2's and HunyuanVideo 1.5's causal 3D convolutions hold it in ``.conv``."""
    return next(p for p in vae.encoder.conv_in.parameters() if p.ndim > 1).ndim == 4


def sdpa_attention(vae: Any) -> list[str]:
    """Set diffusers' ``AttnProcessor2_0`` (SDPA) on every attention of ``vae`` that holds another processor; the
    names of those replaced (none with diffusers 0.42's defaults). A VAE without processors (Qwen-Image's calls
    SDPA itself) is left as it is."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    processors = getattr(vae, "attn_processors", None)
    if not processors:
        return []
    other = sorted(name for name, p in processors.items() if not isinstance(p, AttnProcessor2_0))
    if other:
        vae.set_attn_processor({name: p if name not in other else AttnProcessor2_0()
                                for name, p in processors.items()})  # fmt: skip
    return other


def tune_vae(vae: Any, *, channels_last: bool = True, cudnn_benchmark: bool = False,
             compile: bool = False) -> VaeTuning:  # fmt: skip
    """Apply the switches of the module docstring to ``vae`` (in place) and say which took: channels_last and
    compile only on a 2D VAE; ``cudnn_benchmark`` sets ``torch.backends.cudnn.benchmark`` for the process."""
    import torch

    sdpa_attention(vae)
    flat = is_2d(vae)
    if channels_last and flat:
        vae.to(memory_format=torch.channels_last)
    if cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    if compile and flat:
        vae.encoder.compile()
    return VaeTuning(channels_last=channels_last and flat, cudnn_benchmark=cudnn_benchmark,
                     compiled=compile and flat)  # fmt: skip


def as_input(x: Any, tuning: VaeTuning) -> Any:
    """Pixels ``x`` ``(B, 3, H, W)`` in the memory format of the tuned VAE's weights (a no-op otherwise, and for a
    batch already laid out NHWC: the encoder's uint8 batch arrives so)."""
    import torch

    return x.contiguous(memory_format=torch.channels_last) if tuning.channels_last and x.ndim == 4 else x
