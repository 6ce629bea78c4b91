"""The video families' encoders at real size (issue 55): the ``video`` section of ``gpu_check.py``, run only when named.

    python3 benchmarks/gpu_check.py --wheels .gpu-wheels --sections video --budget 600   # GPU: the published sizes
    python3 benchmarks/gpu_check.py --smoke --sections video                             # this code on the CPU, tiny

**The VAEs** (:data:`VAES`): Wan 2.2's (``AutoencoderKLWan``, 48 channels, 16x spatial, 4x temporal), LTX-2's
(``AutoencoderKLLTX2Video``, 128 channels, 32x, 8x) and HunyuanVideo 1.5's (``AutoencoderKLHunyuanVideo15``, 32
channels, 16x, 4x), each at its published config (:mod:`benchmarks.real_configs`; ``--smoke``: the sizes of the
project's tiny VAEs, ``pipeline/embed/families/tiny_*.py``), random weights, saved in bf16 and loaded back from the
folder. Per clip size, one clip at a time: bucketeer's ``LatentEncoder.encode`` (``LatentSpec(...).load(use_gpu=
True)``: uint8 host clip in, the latents as embed's clip path stores them out) against the class's own ``encode``
alone on a bf16 clip already on the device, as ``wan_rows`` measures Wan 2.1's: clips/s, the peak device memory of
each side (``torch.cuda.max_memory_allocated``), TFLOP/s (:mod:`benchmarks.gpu_flops`: counted in the alone side's
warm-up call), and the latent shape each gives (a row whose shape is not the published compression's fails).
Both sides run with cuDNN autotuning, which ``LatentEncoder`` turns on for the process on cuda.

The clips: Wan 2.2 TI2V-5B's 121 frames at 1280x704 (its model card's 720P at 24 fps; ``WanPipeline.__call__``'s
own defaults, 480x832x81, are Wan 2.1's); ``LTX2Pipeline.__call__``'s 121 frames at 768x512, and 1280x704 (the
Wan 2.2 row's size); ``HunyuanVideo15Pipeline.__call__``'s 121 frames at the 480p folders' default size (their
transformer's ``target_size`` 640 at 16:9: 848x480), and the 720p folders' (``target_size`` 960: 1280x720).

Untiled: none of the three pipelines turns its VAE's tiling or slicing on (``use_tiling`` is False in diffusers
0.42.1; HunyuanVideo 1.5's docstring example calls ``enable_tiling()``, its ``__init__`` does not) and neither does
``LatentEncoder``, so a clip is encoded whole, as embed would encode it. A clip whose work cannot fit is skipped
with the reason: before it runs when the free GPU memory cannot hold the two VAEs' weights and two of the encoder's
largest activation (:func:`largest_activation`, measured on the meta device: a lower bound), or when it runs out
of memory.

**TransNetV2** (:func:`transnet_rows`): ``pipeline.annotate.transnet``'s predictor (``load_transnet`` on cuda,
8 windows a forward, and on the CPU, 1) fed a synthetic video's frames at the network's 48x27 through
``TransNetCuts.add_rgb`` as the scenes decode feeds it (decoding and scaling not included), frames/s after one
warm-up pass; and the network alone on cuda on windows already there. The weights are random (the network's own
initialisation, saved as a ``--scene-weights`` safetensors file); the network is the ``transnetv2-pytorch``
package's, and its row is skipped with the reason where that package is absent (it is not in the GPU machine's
wheel folder: its 32 MB wheel is mostly the trained weights, which these rows do not use).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.gpu_flops import throughput, throughput_text, timed_counted
from benchmarks.gpu_measures import Row
from benchmarks.real_configs import HUNYUAN_VIDEO15_VAE, LTX2_VAE, WAN22_VAE

__all__ = ["VideoVae", "VAES", "TRANSNET_WINDOWS", "video_parts", "build_vae", "largest_activation", "vae_rows",
           "random_transnet", "transnet_rows"]  # fmt: skip


@dataclass(frozen=True)
class VideoVae:
    """One video VAE: its diffusers class, published and tiny configs, the clips measured ``(frames, height,
    width)`` (``--smoke``: ``smoke_clip``), the pipeline it ships in and the section's time box (seconds)."""

    name: str
    cls: str
    real: dict[str, Any]
    tiny: dict[str, Any]
    clips: tuple[tuple[int, int, int], ...]
    smoke_clip: tuple[int, int, int]
    pipeline: str
    seconds: int


VAES: dict[str, VideoVae] = {
    "wan2.2": VideoVae("Wan 2.2 TI2V-5B VAE", "AutoencoderKLWan", WAN22_VAE,
                       {**WAN22_VAE, "base_dim": 8, "decoder_base_dim": 12, "num_res_blocks": 1},  # tiny_wan22's
                       ((121, 704, 1280),), (5, 32, 32), "WanPipeline", 120),
    "ltx-2": VideoVae("LTX-2 VAE", "AutoencoderKLLTX2Video", LTX2_VAE,
                      {**LTX2_VAE, "latent_channels": 8, "block_out_channels": [8, 16, 16, 16],
                       "decoder_block_out_channels": [8, 16, 32], "layers_per_block": [1, 1, 1, 1, 1],
                       "decoder_layers_per_block": [1, 1, 1, 1]},  # tiny_ltx2's
                      ((121, 512, 768), (121, 704, 1280)), (9, 64, 64), "LTX2Pipeline", 120),
    "hunyuanvideo-1.5": VideoVae("HunyuanVideo 1.5 VAE", "AutoencoderKLHunyuanVideo15", HUNYUAN_VIDEO15_VAE,
                                 {**HUNYUAN_VIDEO15_VAE, "latent_channels": 8, "block_out_channels": [8, 8, 16, 16, 16],
                                  "layers_per_block": 1},  # tiny_hunyuan's
                                 ((121, 480, 848), (121, 720, 1280)), (5, 32, 32), "HunyuanVideo15Pipeline", 150),
}  # fmt: skip
# TransNetV2's work: windows of 50 new frames on the device and on the CPU, timed calls of the network alone
TRANSNET_WINDOWS = {"real": {"windows": 128, "cpu_windows": 16, "iters": 4},
                    "smoke": {"windows": 1, "cpu_windows": 1, "iters": 1}}  # fmt: skip
TRANSNET_SECONDS = 60


def video_parts(work: Path, gpu: bool, smoke: bool) -> list[tuple[int, Callable[[], list[Row]]]]:
    """``(time box in seconds, rows function)`` of each part of the section, in order: each VAE, then TransNetV2."""
    parts: list[tuple[int, Callable[[], list[Row]]]] = [
        (vae.seconds, lambda key=key: vae_rows(key, work, gpu, smoke)) for key, vae in VAES.items()]  # fmt: skip
    work_of = TRANSNET_WINDOWS["smoke" if smoke else "real"]
    return parts + [(TRANSNET_SECONDS, lambda: transnet_rows(work, gpu, **work_of))]


def build_vae(cls: str, config: dict[str, Any], folder: Path, device: str) -> Path:
    """A random-weight ``cls`` (a diffusers class name) of ``config``, built on ``device`` (a GPU initialises a
    billion parameters in seconds) and saved in bf16 with ``save_pretrained`` to ``folder``."""
    import diffusers
    import torch

    torch.manual_seed(0)
    with torch.device(device):
        vae = getattr(diffusers, cls)(**config)
    vae.to(torch.bfloat16).save_pretrained(folder)
    return folder


def largest_activation(cls: str, config: dict[str, Any], clip: tuple[int, int, int], dtype) -> tuple[int, int]:
    """``(bytes of the largest tensor a module of the encoder outputs for one clip in ``dtype``, parameters)``, from
    ``encode`` run on the meta device (nothing allocated, no weights): what untiled work needs at least, besides the
    weights, is a layer's input and output."""
    import diffusers
    import torch

    with torch.device("meta"):
        vae = getattr(diffusers, cls)(**config).to(dtype)
    largest = 0

    def measure(module, args, out) -> None:
        nonlocal largest
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                largest = max(largest, t.numel() * t.element_size())

    for module in vae.encoder.modules():
        module.register_forward_hook(measure)
    f, h, w = clip
    with torch.inference_mode():
        vae.encode(torch.empty((1, 3, f, h, w), dtype=dtype, device="meta"))
    return largest, sum(p.numel() for p in vae.parameters())


def vae_rows(key: str, work: Path, gpu: bool, smoke: bool) -> list[Row]:
    """One row per clip of ``VAES[key]`` (module docstring); its folder is removed after them."""
    vae = VAES[key]
    config = vae.tiny if smoke else vae.real
    t0 = time.perf_counter()
    folder = build_vae(vae.cls, config, work / key, "cuda" if gpu else "cpu")
    built = time.perf_counter() - t0
    try:
        rows = [_clip_row(vae, config, folder, clip, gpu) for clip in ((vae.smoke_clip,) if smoke else vae.clips)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for row in rows:
        row.values["build_seconds"] = built
    return rows


def _clip_row(vae: VideoVae, config: dict[str, Any], folder: Path, clip: tuple[int, int, int], gpu: bool) -> Row:
    """One clip's row: skipped when the free GPU memory cannot hold the work (before, or by running out of it);
    failed with the error when the encode fails otherwise, so the VAE's other clips still run."""
    import torch

    f, h, w = clip
    dtype = torch.bfloat16 if gpu else torch.float32  # LatentEncoder's compute dtype: bf16 on cuda, fp32 on a CPU
    what = (f"{vae.name} {w}x{h}x{f} {'bf16' if gpu else 'fp32'}, one clip, untiled: LatentEncoder.encode vs "
            f"{vae.cls}.encode alone")  # fmt: skip
    largest, params = largest_activation(vae.cls, config, clip, dtype)
    weights = params * dtype.itemsize
    need = 2 * weights + 2 * largest  # both VAEs resident, and a layer's input and output at the largest
    free = torch.cuda.mem_get_info()[0] if gpu else None
    memory = {"largest_activation_gb": largest / 1e9, "weights_gb": weights / 1e9, "params": params,
              "free_gb": None if free is None else free / 1e9}  # fmt: skip
    if free is not None and need > free:
        return Row("video", what, f"skipped: needs at least {need / 1e9:.0f} GB (two of its largest activation, "
                   f"{largest / 1e9:.1f} GB, untiled as {vae.pipeline} ships it, and the weights twice) and "
                   f"{free / 1e9:.0f} GB are free", status="skipped", values=memory)  # fmt: skip
    error = None
    try:
        measured = _encode_both(folder, vae.cls, clip, gpu)
    except RuntimeError as e:  # out of memory (cuDNN's too), or a kernel that refuses the size: this clip's row
        error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
    if error is not None:  # out of the handler: its traceback, and the tensors its frames held, are released
        _free()
        if "out of memory" in error or "ALLOC_FAILED" in error:
            return Row("video", what, f"skipped: out of GPU memory untiled ({memory['free_gb'] or 0:.0f} GB free "
                       f"before it; its largest activation alone is {largest / 1e9:.1f} GB); diffusers' "
                       "enable_tiling() would bound it, which neither the pipeline nor LatentEncoder turns on",
                       status="skipped", values={**memory, "error": error})  # fmt: skip
        return Row("video", what, f"failed: {error}", status="failed", values=memory)
    expected = (1, int(config.get("z_dim", config.get("latent_channels"))), (f - 1) // _temporal(config) + 1,
                h // _spatial(config), w // _spatial(config))  # fmt: skip
    same = measured["latent"] == measured["latent_alone"] == expected
    t_ours, t_alone = measured["seconds"], measured["seconds_alone"]
    counted = throughput(measured["flops"], t_ours, gpu)
    peak = f"peak {measured['peak_gb']:.1f} GB (alone {measured['peak_alone_gb']:.1f} GB)" if gpu else "peak n/a (CPU)"
    result = (f"{1 / t_ours:.3g} vs {1 / t_alone:.3g} clips/s ({t_alone / t_ours:.2f}x), {t_ours:.3g} s a clip; "
              f"{peak}; {throughput_text(counted)}")  # fmt: skip
    if not same:
        result = f"failed: latents {measured['latent']} (alone {measured['latent_alone']}), not {expected}; " + result
    return Row("video", what, result, status="ok" if same else "failed",
               values={"clips_per_second": 1 / t_ours, "alone": 1 / t_alone, **measured, **memory, **counted,
                       "tflops_alone": throughput(measured["flops"], t_alone, gpu)["tflops"]})  # fmt: skip


def _spatial(config: dict[str, Any]) -> int:
    return int(config.get("scale_factor_spatial") or config["spatial_compression_ratio"])


def _temporal(config: dict[str, Any]) -> int:
    return int(config.get("scale_factor_temporal") or config["temporal_compression_ratio"])


def _encode_both(folder: Path, cls: str, clip: tuple[int, int, int], gpu: bool, iters: int = 1) -> dict[str, Any]:
    """Seconds per clip of bucketeer's encoder and of the class's ``encode`` alone (after a warm-up call each, the
    alone's counted), the peak memory of each and the latent shapes they give."""
    import diffusers
    import torch

    from pipeline.embed.latents import LatentSpec
    from pipeline.embed.loading import EncoderSource

    ours = LatentSpec(EncoderSource(str(folder))).load(use_gpu=gpu, dtype="BF16")
    device, dtype = ours.device, ours.compute_dtype
    alone = getattr(diffusers, cls).from_pretrained(str(folder), torch_dtype=dtype).to(device).eval()
    f, h, w = clip
    pixels = np.random.default_rng(0).integers(0, 255, (1, f, h, w, 3), dtype=np.uint8)
    x = torch.from_numpy(pixels).to(device).permute(0, 4, 1, 2, 3).float().div(127.5).sub(1).to(dtype)
    _reset_peak(gpu)
    with torch.inference_mode():
        t_alone, latent, flops = timed_counted(lambda: alone.encode(x).latent_dist.mean, gpu, iters)
    peak_alone, shape_alone = _peak(gpu), tuple(latent.shape)
    alone = x = latent = None  # the alone side's memory back before bucketeer's is measured
    _free()
    _reset_peak(gpu)
    ours.encode(pixels)  # warm-up: cuDNN autotunes this shape
    _sync(gpu)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = ours.encode(pixels)
    _sync(gpu)
    t_ours = (time.perf_counter() - t0) / iters
    return {"seconds": t_ours, "seconds_alone": t_alone, "peak_gb": _peak(gpu), "peak_alone_gb": peak_alone,
            "latent": tuple(out["latent"].shape), "latent_alone": shape_alone, "flops": flops}  # fmt: skip


def random_transnet(path: Path) -> Path:
    """A TransNetV2 state dict of random weights (the network's own initialisation, seed 0) saved as safetensors,
    the ``--scene-weights`` file ``load_transnet`` reads (no pickle)."""
    import torch
    from safetensors.torch import save_file

    from pipeline.annotate.transnet import _network  # the package's class without its process-wide side effects

    torch.manual_seed(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in _network().state_dict().items()}, str(path))
    return path


def transnet_rows(work: Path, gpu: bool, windows: int, cpu_windows: int, iters: int) -> list[Row]:
    """TransNetV2's frames/s on the device (cuda; ``--smoke``: the CPU) over a synthetic video of ``windows``
    windows of 50 new frames each and on the CPU over ``cpu_windows``, and the network alone on the device
    (``iters`` timed calls of a batch)."""
    n, n_cpu = windows, cpu_windows
    device = "cuda" if gpu else "cpu"
    on = f"{device}{'' if gpu else ' (--smoke: no GPU)'}"
    what = (f"TransNetV2 (random weights, fp32): TransNetCuts over a synthetic video of {n} x 50 frames at 48x27 on "
            f"{on} vs {n_cpu} x 50 on the cpu; and the network alone on {device}")  # fmt: skip
    try:
        import transnetv2_pytorch  # noqa: F401  (the network's code)
    except ImportError:
        return [Row("video", what, "skipped: needs transnetv2-pytorch (the network's code; these rows use random "
                    "weights, not its trained ones): not installed here, and not in infra/gpu/wheels.txt (its 32 MB "
                    "wheel is mostly those weights)", status="skipped")]  # fmt: skip
    import torch

    from pipeline.annotate.transnet import STEP, WINDOW, load_transnet

    weights = str(random_transnet(work / "transnet-random.safetensors"))
    model = load_transnet(weights, device)
    rng = np.random.default_rng(0)
    batch = torch.from_numpy(rng.integers(0, 255, (model.batch, WINDOW, 27, 48, 3), dtype=np.uint8)).to(model.device)
    with torch.inference_mode():
        t_alone, _, flops = timed_counted(lambda: model.network(batch)[0], gpu, iters)
    per_window = flops / model.batch
    frames = rng.integers(0, 255, (n * STEP, 27, 48, 3), dtype=np.uint8)
    t_device = _cuts_seconds(model, frames, gpu)
    t_cpu = _cuts_seconds(load_transnet(weights, "cpu"), frames[: n_cpu * STEP], False)
    rate, rate_cpu, rate_alone = n * STEP / t_device, n_cpu * STEP / t_cpu, model.batch * STEP / t_alone
    counted = throughput(per_window * n, t_device, gpu)
    result = (f"{rate:.0f} vs {rate_cpu:.0f} frames/s ({rate / rate_cpu:.1f}x the cpu); network alone {rate_alone:.0f} "
              f"frames/s (batch {model.batch}); {throughput_text(counted)} (an fp32 network)")  # fmt: skip
    values = {"frames_per_second": rate, "cpu": rate_cpu, "alone": rate_alone, "batch": model.batch, "windows": n,
              "cpu_windows": n_cpu, "flops_per_window": per_window, **counted,
              "cpu_tflops": throughput(per_window * n_cpu, t_cpu, False)["tflops"]}  # fmt: skip
    return [Row("video", what, result, values=values)]


def _cuts_seconds(model, frames: np.ndarray, gpu: bool) -> float:
    """Seconds for ``TransNetCuts`` over ``frames`` ``(n, 27, 48, 3)``, fed one at a time then finished, after one
    untimed pass (the first forward of each batch size)."""
    from pipeline.annotate.transnet import TransNetCuts

    seconds = 0.0
    for _ in range(2):  # the first pass is the warm-up
        cuts = TransNetCuts(model)
        _sync(gpu)
        t0 = time.perf_counter()
        for frame in frames:
            cuts.add_rgb(frame)
        cuts.finish()
        _sync(gpu)
        seconds = time.perf_counter() - t0
        assert len(cuts.predictions) == len(frames)
    return seconds


def _sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


def _reset_peak(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak(gpu: bool) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if gpu else 0.0


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
