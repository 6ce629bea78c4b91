"""Achieved TFLOP/s of a measured model, and its fraction of the GPU's bf16 dense peak (``gpu_check.py``'s rows).

A model's FLOPs are counted once per model and input shape, by ``torch.utils.flop_counter.FlopCounterMode`` over
one real call (the timing's warm-up call: nothing extra runs), and divided by the measured seconds per call. The
counter counts the matrix products, convolutions and attention (2 FLOPs a multiply-add); element-wise work
(norms, activations) is not counted, so the fraction is the tensor cores' share, what MFU reports.

The peaks are NVIDIA's datasheet figures for dense bf16 with fp32 accumulation (the sparsity figures halved), in
TFLOP/s: H100 SXM 989, H100 PCIe 756, H100 NVL 835, H200 (SXM) 989, H200 NVL 835, GH200 989, A100 (SXM and PCIe)
312, L40S 362, RTX 4090 165 (its 330 is fp16 accumulation). Another GPU's fraction is ``unknown``; on a CPU
(``--smoke``) ``n/a (no GPU peak)``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["BF16_PEAK_TFLOPS", "bf16_peak", "timed_counted", "count_flops", "throughput", "throughput_text"]

# (what torch.cuda.get_device_name contains, dense bf16 TFLOP/s): the first match wins, so the longer names first
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
    ("H100", 989.0),  # "NVIDIA H100 80GB HBM3": the SXM part
    ("A100", 312.0), ("L40S", 362.0), ("RTX 4090", 165.0),
)  # fmt: skip


def bf16_peak(device_name: str | None) -> float | None:
    """The dense bf16 peak (TFLOP/s) of the GPU named ``device_name``; None for a CPU (None) or a GPU not listed."""
    if not device_name:
        return None
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key.lower() in device_name.lower()), None)


def count_flops(fn: Callable[[], Any]) -> tuple[int, Any]:
    """``(FLOPs, fn's output)`` of one call of ``fn`` under ``FlopCounterMode`` (forward and any backward it runs)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = fn()
    return int(counter.get_total_flops()), out


def timed_counted(fn: Callable[[], Any], gpu: bool, iters: int) -> tuple[float, Any, int]:
    """``(seconds per call, the last call's output, FLOPs of one call)``: the warm-up call counted, then ``iters``
    timed calls, the device synchronized before each clock read."""
    import torch

    flops, _ = count_flops(fn)
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
    if gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters, out, flops


def _device_name(gpu: bool) -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if gpu else None


def throughput(flops: int | None, seconds: float, gpu: bool, device_name: str | None = None) -> dict[str, Any]:
    """What a row's ``values`` keep of a model's FLOPs per call over ``seconds`` per call: ``tflops`` (achieved),
    ``flops`` (per call), ``peak_tflops`` and ``peak_fraction`` (None: not known, or a CPU), ``device``."""
    name = device_name if device_name is not None else _device_name(gpu)
    peak = bf16_peak(name) if gpu else None
    tflops = None if flops is None or seconds <= 0 else flops / seconds / 1e12
    return {"flops": flops, "tflops": tflops, "peak_tflops": peak, "device": name or "cpu",
            "peak_fraction": None if peak is None or tflops is None else tflops / peak}  # fmt: skip


def throughput_text(t: dict[str, Any]) -> str:
    """One phrase of :func:`throughput`'s values: ``"412.0 TFLOP/s, 42% of the 989 TFLOP/s bf16 dense peak"``."""
    if t["tflops"] is None:
        return "TFLOP/s not counted"
    rate = f"{t['tflops']:.3g} TFLOP/s"
    if t["device"] == "cpu":
        return f"{rate}, fraction n/a (no GPU peak)"
    if t["peak_tflops"] is None:
        return f"{rate}, fraction unknown (no bf16 peak listed for {t['device']})"
    return f"{rate}, {t['peak_fraction']:.0%} of the {t['peak_tflops']:g} TFLOP/s bf16 dense peak"
