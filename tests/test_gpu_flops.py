"""benchmarks/gpu_flops.py: the FLOPs of a call counted once, the bf16 peak of a GPU by its name, and the phrase a
gpu-check row prints (a CPU: no peak; an unlisted GPU: unknown)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_flops import bf16_peak, count_flops, throughput, throughput_text, timed_counted


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA GeForce RTX 4090", 165.0), ("NVIDIA GeForce RTX 3090", None), (None, None),
])  # fmt: skip
def test_the_bf16_dense_peak_of_a_gpu_by_its_name(name, peak):
    assert bf16_peak(name) == peak


def test_a_call_is_counted_once_as_its_matrix_products():
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    calls = []

    def call():
        calls.append(1)
        return torch.relu(layer(x))  # the relu is element-wise: not counted

    flops, out = count_flops(call)
    assert flops == 2 * 8 * 64 * 32 and out.shape == (8, 32)
    seconds, last, counted = timed_counted(call, gpu=False, iters=3)
    assert counted == flops and len(calls) == 1 + 1 + 3 and seconds > 0 and torch.equal(last, out)


def test_what_a_row_says_of_its_rate():
    cpu = throughput(2_000_000_000, 0.5, gpu=False)
    assert cpu["tflops"] == pytest.approx(0.004) and cpu["peak_fraction"] is None and cpu["device"] == "cpu"
    assert throughput_text(cpu) == "0.004 TFLOP/s, fraction n/a (no GPU peak)"
    h200 = throughput(int(494.5e12), 1.0, gpu=True, device_name="NVIDIA H200")
    assert h200["peak_fraction"] == pytest.approx(0.5)
    assert throughput_text(h200) == "494 TFLOP/s, 50% of the 989 TFLOP/s bf16 dense peak"
    other = throughput(int(1e12), 1.0, gpu=True, device_name="NVIDIA B200")
    assert throughput_text(other) == "1 TFLOP/s, fraction unknown (no bf16 peak listed for NVIDIA B200)"
    assert throughput_text(throughput(None, 1.0, gpu=False)) == "TFLOP/s not counted"
