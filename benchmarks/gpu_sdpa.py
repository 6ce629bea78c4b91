"""The micro-repro of the lead on the Flux-width trainer's CUDA error (``gpu_check.py --sections sdpa``).

The trainer failed on an H100 (torch 2.11) with ``CUBLAS_STATUS_EXECUTION_FAILED``, then an illegal memory access.
torch >= 2.10 prefers cuDNN's attention on sm90/sm100; its backward takes the output gradient with the strides it
arrives with, and Flux hands it two layouts of the same shape (``tests/test_train_attention.py``): the single-stream
blocks' gradient is a slice of a ``(B, L, 5 x dim)`` tensor (row stride 15,360 at Flux's 3,072), the double-stream
blocks' one of ``(B, L, dim)`` (row stride 3,072). Here one q/k/v shape at Flux's heads (24 x 128) runs forward and
backward under ``sdpa_kernel(backend)`` with the gradient in each layout, in both orders (a graph cached on the
first layout replays on the second), each against the math backend in float32. A row per backend and order: the
largest relative gradient error, or the error the backend raised. On the CPU (``--smoke``) only the math backend
runs, at a tiny shape. ``python -m benchmarks.gpu_sdpa``: the rows as JSON lines."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_measures import Row

__all__ = ["sdpa_stride_rows"]

LAYOUTS = ("contiguous (double-stream, row stride dim)", "sliced (single-stream, row stride 5 x dim)")


def _grad_out(shape: tuple[int, int, int, int], sliced: bool, device: Any, dtype: Any):
    """A ``(B, H, L, D)`` output gradient as Flux's blocks hand it: a view of ``(B, L, H * D)`` (double-stream) or of
    the first ``H * D`` columns of ``(B, L, 5 * H * D)`` (single-stream), transposed to ``(B, H, L, D)``."""
    import torch

    b, h, n, d = shape
    width = h * d * (5 if sliced else 1)
    full = torch.randn(b, n, width, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(5))
    return full[:, :, : h * d].view(b, n, h, d).transpose(1, 2)


def _grads(shape, backend: Any, sliced: bool, device: Any, dtype: Any):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    gen = torch.Generator(device).manual_seed(1)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v)
    out.backward(_grad_out(shape, sliced, device, dtype))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [t.grad.float() for t in (q, k, v)]


def sdpa_stride_rows(gpu: bool) -> list[Row]:
    import torch
    from torch.nn.attention import SDPBackend

    device = torch.device("cuda" if gpu else "cpu")
    shape = (1, 24, 4096 + 512, 128) if gpu else (1, 2, 24, 16)  # 1024² image tokens + 512 text tokens
    dtype = torch.bfloat16 if gpu else torch.float32
    reference = {s: _grads(shape, SDPBackend.MATH, s, device, torch.float32) for s in (False, True)}
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if gpu \
        else [SDPBackend.MATH]  # fmt: skip
    rows = []
    for backend in backends:
        for order in ((False, True), (True, False)):
            first, then = (LAYOUTS[sliced].split(" (")[0] for sliced in order)
            name = f"{backend.name}, {shape}, {first} then {then}"
            try:
                errors = []
                for sliced in order:
                    got = _grads(shape, backend, sliced, device, dtype)
                    ref = reference[sliced]
                    errors.append(max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12))
                                      for g, r in zip(got, ref)))  # fmt: skip
                rows.append(Row("sdpa", name, "max relative grad error vs math fp32: " +
                                ", ".join(f"{e:.1e}" for e in errors), "within bf16 (<= 2e-2)" if gpu else "",
                                status="ok" if max(errors) <= (2e-2 if gpu else 1e-5) else "failed",
                                values={"errors": errors}))  # fmt: skip
            except Exception as e:  # the repro's point: the backend's own error, in its row
                rows.append(Row("sdpa", name, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                                status="failed"))  # fmt: skip
                if gpu:
                    torch.cuda.synchronize()
    return rows


def main() -> None:
    """Print each row as one JSON line (``gpu_check.py`` runs this in a child: an illegal memory access would
    leave the CUDA context of its own process unusable for the sections after it)."""
    import json
    from dataclasses import asdict

    import torch

    for row in sdpa_stride_rows(torch.cuda.is_available()):
        print(json.dumps(asdict(row)), flush=True)


if __name__ == "__main__":
    main()
