"""The measures of ``gpu_check.py`` that need no Ray and no launcher: GPU busy sampling, encoders alone,
JPEG decode on CPU and GPU, the trainer's loader alone, and the annotate row. Each runs on a CPU too
(``--smoke``); timings on CUDA synchronize the device before the clock stops."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["Row", "BusySampler", "vae_sweep", "text_vs_pipeline", "decode_rows", "loader_rate", "repa_rows",
           "wan_rows", "clip_rows", "annotate_rows"]


@dataclass
class Row:
    """One line of the table: ``status`` ok | failed | skipped; ``values``: the numbers, for the JSON."""

    section: str
    measure: str
    result: str
    target: str = ""
    status: str = "ok"
    values: dict[str, Any] = field(default_factory=dict)


def _sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


def _gpu_index() -> int:
    """NVML's index of the device CUDA calls 0 (``CUDA_VISIBLE_DEVICES`` may name another)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class BusySampler:
    """NVML ``utilization.gpu`` of one device, sampled every ``period`` s in a thread: ``(time.time(), percent)``.

    pynvml when it imports, else ``nvidia-smi --query-gpu=utilization.gpu -lms`` (both read NVML).
    """

    def __init__(self, period: float = 0.1):
        self.period, self.samples = period, []
        self.stopped = threading.Event()
        self.proc = None
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(_gpu_index())
            self.read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except Exception:  # no pynvml: the driver's own tool
            smi = shutil.which("nvidia-smi")
            if smi is None:
                raise RuntimeError("no pynvml and no nvidia-smi: cannot sample GPU utilization") from None
            self.proc = subprocess.Popen([smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-i", str(_gpu_index()), f"--loop-ms={int(period * 1000)}"],
                                         stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def start(cls, period: float = 0.1) -> "BusySampler":
        sampler = cls(period)
        sampler.thread.start()
        return sampler

    def _run(self) -> None:
        if self.proc is not None:
            for line in self.proc.stdout:
                if line.strip().isdigit():
                    self.samples.append((time.time(), float(line)))
                if self.stopped.is_set():
                    return
            return
        while not self.stopped.wait(self.period):
            self.samples.append((time.time(), float(self.read())))

    def stop(self) -> list[tuple[float, float]]:
        self.stopped.set()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.thread.join(timeout=10)
        return self.samples

    @staticmethod
    def mean(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
        """The mean busy fraction (0..1) of the samples taken between ``start`` and ``end`` (time.time())."""
        inside = [u for t, u in samples if start <= t <= end]
        return sum(inside) / len(inside) / 100.0 if inside else None


def _timed(fn: Callable[[], Any], gpu: bool, iters: int) -> float:
    """Seconds per call of ``fn`` after one warm-up call, the device synchronized before each clock read."""
    fn()
    _sync(gpu)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(gpu)
    return (time.perf_counter() - t0) / iters


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vae_sweep(family: str, folder: str, bucket: tuple[int, int], batches: tuple[int, ...], gpu: bool,
              images_per_size: int) -> list[Row]:  # fmt: skip
    """Images/s of the family's VAE at each batch size: bucketeer's ``LatentEncoder.encode`` (uint8 host pixels
    -> the fp32 posterior mean on the device, as the embed worker calls it) against diffusers' ``vae.encode``
    alone (bf16 pixels already on the device, the posterior mean left there); the GPU's busy fraction (NVML)
    over bucketeer's calls. About ``images_per_size`` images per timing (one warm-up call before)."""
    import torch
    from diffusers import AutoencoderKL

    from pipeline.embed.loading import EncoderSource

    from pipeline.embed.latents import LatentSpec

    ours = LatentSpec(EncoderSource(folder, "vae")).load(use_gpu=gpu, dtype="BF16")
    device, dtype = ours.device, ours.compute_dtype
    alone = AutoencoderKL.from_pretrained(folder, subfolder="vae", torch_dtype=dtype).to(device).eval()
    rng = np.random.default_rng(0)
    rows = []
    w, h = bucket
    for b in batches:
        pixels = rng.integers(0, 255, (b, h, w, 3), dtype=np.uint8)
        x = torch.from_numpy(pixels).to(device).permute(0, 3, 1, 2).float().div(127.5).sub(1).to(dtype)
        iters = max(1, images_per_size // b)
        with torch.inference_mode():
            t_alone = _timed(lambda: alone.encode(x).latent_dist.mean, gpu, iters)
        sampler = BusySampler.start() if gpu else None
        started = time.time()
        try:
            t_ours = _timed(lambda: ours.encode(pixels), gpu, iters)
        finally:
            samples = sampler.stop() if sampler else None
        busy = BusySampler.mean(samples, started, time.time()) if samples else None
        rate, ceiling = b / t_ours, b / t_alone
        rows.append(Row("vae", f"{family} VAE {w}x{h} {_dtype_name(dtype)}, batch {b}: LatentEncoder.encode (host "
                        "uint8 in) vs diffusers vae.encode alone (bf16 input on the device)",
                        f"{rate:.1f} vs {ceiling:.1f} images/s ({rate / ceiling:.2f}x); GPU busy "
                        f"{'n/a' if busy is None else f'{busy:.0%}'}",
                        ">= 0.9x alone, busy >= 90%" if gpu else "",
                        values={"batch": b, "images_per_second": rate, "alone": ceiling, "busy": busy}))  # fmt: skip
    return rows  # the caller frees the device memory (gpu_check: after each section)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


def text_vs_pipeline(family: str, folder: str, batch: int, gpu: bool, iters: int) -> list[Row]:
    """Captions/s of bucketeer's ``TextEncoders.encode`` (tokenize, forward, copy to the host: what the embed
    text worker calls) against the family's diffusers pipeline's ``encode_prompt`` (its outputs left on the
    device), on the same batch of distinct ~40-word captions, both in the same compute dtype; and how far the
    cache's joined embeddings (``TextLayout.prompt_embeds`` of the bf16 records) are from ``encode_prompt``'s
    rounded to bf16 (relative L2 error: 0 when the records are exactly what the pipeline computes)."""
    import torch
    from diffusers import DiffusionPipeline

    from manifests.cache import TextLayout
    from manifests.cache.records import TextRecord
    from pipeline.embed.loading import to_storage
    from pipeline.embed.encoders import encoder_specs

    _, spec = encoder_specs(family=family, model=folder, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    ours = spec.load(use_gpu=gpu, dtype="BF16")
    device, dtype = ours.device, ours.compute_dtype
    skip = {"vae": None, "unet": None} if family == "sdxl" else {"vae": None, "transformer": None}
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype, **skip).to(device)
    words = "a photo of a red cat on a blue chair near the window in soft morning light".split()
    captions = [" ".join(words[(i + k) % len(words)] for k in range(40)) + f" {i}" for i in range(batch)]

    def prompt():
        with torch.inference_mode():
            if family == "sdxl":
                embeds, _, pooled, _ = pipe.encode_prompt(captions, device=device, do_classifier_free_guidance=False)
            else:
                embeds, pooled, _ = pipe.encode_prompt(captions, prompt_2=None, device=device)
        return embeds, pooled

    t_ours = _timed(lambda: ours.encode(captions), gpu, iters)
    t_pipe = _timed(prompt, gpu, iters)
    encoded = ours.encode(captions)
    records = [TextRecord(i, tuple(to_storage(t, "BF16") for t in tokens), to_storage(p, "BF16"), "BF16")
               for i, (tokens, p) in enumerate(encoded)]  # fmt: skip
    layout = TextLayout.from_json(ours.describe()["layout"])
    joined, _, pooled = layout.prompt_embeds(records)
    ref, ref_pooled = (t.to(torch.bfloat16).float().cpu().numpy() for t in prompt())
    err = float(np.linalg.norm(joined - ref) / max(np.linalg.norm(ref), 1e-30))
    err_pooled = float(np.linalg.norm(pooled - ref_pooled) / max(np.linalg.norm(ref_pooled), 1e-30))
    names = "CLIP-L + CLIP-bigG (77 tokens)" if family == "sdxl" else "CLIP-L + T5-XXL (512 tokens)"
    rate, ceiling = batch / t_ours, batch / t_pipe
    return [Row("text", f"{family} {names} {_dtype_name(dtype)}, batch {batch}: TextEncoders.encode vs the "
                "pipeline's encode_prompt", f"{rate:.1f} vs {ceiling:.1f} captions/s ({rate / ceiling:.2f}x)",
                ">= 0.9x encode_prompt" if gpu else "",
                values={"captions_per_second": rate, "encode_prompt": ceiling}),
            Row("text", f"{family}: the cache's joined bf16 text records vs encode_prompt's output in bf16 "
                "(relative L2 error: embeds, pooled)", f"{err:.1e}, {err_pooled:.1e}", "0 (the same numbers)",
                status="ok" if err < 1e-2 and err_pooled < 1e-2 else "failed",
                values={"rel_error": err, "rel_error_pooled": err_pooled})]  # fmt: skip


def decode_rows(images: Path, bucket: tuple[int, int], gpu: bool, count: int) -> list[Row]:
    """JPEG decode of ``count`` of the dataset's files: Pillow on one CPU thread, embed's ``prepare_views``
    (decode + resize + crop), and ``torchvision.io.decode_jpeg`` on the GPU in batches of 16."""
    from PIL import Image

    from pipeline.embed.imaging import prepare_views

    blobs = [p.read_bytes() for p in sorted(images.glob("*.jpg"))[:count]]
    t0 = time.process_time()
    for blob in blobs:
        np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
    pil = len(blobs) / (time.process_time() - t0)
    t0 = time.process_time()
    for i, blob in enumerate(blobs):
        prepare_views(blob, (bucket[1], bucket[0]), crop="center", seed=0, sample_id=i, max_pixels=1 << 30)
    views = len(blobs) / (time.process_time() - t0)
    size = Image.open(io.BytesIO(blobs[0])).size
    rows = [Row("decode", f"JPEG {size[0]}x{size[1]} decode, Pillow, 1 CPU thread (CPU time)",
                f"{pil:.1f} images/s per core", values={"images_per_second": pil}),
            Row("decode", f"embed's prepare_views (decode + resize + crop to {bucket[0]}x{bucket[1]}), 1 CPU thread",
                f"{views:.1f} images/s per core", values={"images_per_second": views})]  # fmt: skip
    try:
        import torch
        import torchvision.io
    except Exception as e:
        return rows + [Row("decode", "torchvision.io.decode_jpeg on the GPU",
                           f"skipped: torchvision does not import ({type(e).__name__})", status="skipped")]
    if not gpu:
        return rows + [Row("decode", "torchvision.io.decode_jpeg on the GPU", "skipped: no GPU", status="skipped")]
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    torchvision.io.decode_jpeg(data[:16], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start in range(0, len(data), 16):
        torchvision.io.decode_jpeg(data[start : start + 16], device="cuda")
    torch.cuda.synchronize()
    rate = len(data) / (time.perf_counter() - t0)
    return rows + [Row("decode", "torchvision.io.decode_jpeg on the GPU (nvJPEG), batches of 16, synchronized",
                       f"{rate:.1f} images/s ({rate / pil:.1f}x one CPU core)", values={"images_per_second": rate})]


def loader_rate(plan: str, cache: str, device: str, batches: int) -> float:
    """Samples/s of the trainer's ``BatchLoader`` (the trainer's default prefetch and read threads) over
    ``plan``'s rank-0 steps, each batch moved to ``device``; the first two batches (start-up) left out."""
    import torch

    from manifests.cache import CacheReader
    from train.config import TrainConfig
    from train.data import BatchLoader, rank_steps

    cfg = TrainConfig()
    reader = CacheReader(cache, {})
    loader = BatchLoader([reader], rank_steps(plan, 0, None), reader.meta.latent, rank=0, prefetch=cfg.prefetch,
                         read_threads=cfg.read_threads, pin_memory=device == "cuda", log=print)  # fmt: skip
    samples, t0 = 0, None
    try:
        for i, batch in enumerate(loader):
            batch = batch.to(torch.device(device), non_blocking=True)
            if i == 1:
                _sync(device == "cuda")
                t0 = time.perf_counter()
            elif i > 1:
                samples += len(batch.sample_ids)
            if i >= batches + 1:
                break
        _sync(device == "cuda")
    finally:
        loader.close()
    if t0 is None or not samples:
        raise RuntimeError(f"the plan has too few steps to measure the loader ({batches + 2} needed)")
    return samples / (time.perf_counter() - t0)


def repa_rows(folder: str, size: tuple[int, int], batch: int, gpu: bool, iters: int) -> list[Row]:
    """Images/s of REPA's DINOv2 features: bucketeer's ``FeatureEncoder.encode`` (uint8 host crops -> resized,
    normalised, patch tokens back on the host: what ``embed --features dinov2`` runs beside the VAE) against
    the model alone on inputs already resized and normalised on the device."""
    import torch

    from pipeline.embed.features import FeatureSpec, preprocess

    ours = FeatureSpec("dinov2", folder).load(use_gpu=gpu, dtype="BF16")
    w, h = size
    pixels = np.random.default_rng(0).integers(0, 255, (batch, h, w, 3), dtype=np.uint8)
    x = preprocess(torch.from_numpy(pixels).to(ours.device), ours.input_size, ours.mean, ours.std)
    x = x.to(ours.compute_dtype)
    with torch.inference_mode():
        t_alone = _timed(lambda: ours.model(pixel_values=x).last_hidden_state, gpu, iters)
    t_ours = _timed(lambda: ours.encode(pixels), gpu, iters)
    grid, dim = ours.grid, int(ours.model.config.hidden_size)
    rate, ceiling = batch / t_ours, batch / t_alone
    return [Row("repa", f"DINOv2 ({dim} wide, {grid[0]}x{grid[1]} patches) features of {w}x{h} crops, batch "
                f"{batch}: FeatureEncoder.encode vs the model alone", f"{rate:.1f} vs {ceiling:.1f} images/s "
                f"({rate / ceiling:.2f}x)", values={"images_per_second": rate, "alone": ceiling})]  # fmt: skip


def wan_rows(folder: str, clip: tuple[int, int, int], gpu: bool, iters: int) -> list[Row]:
    """Clips/s of the Wan 2.1 VAE on ``clip`` = (frames, height, width): bucketeer's ``LatentEncoder.encode``
    (uint8 host clip -> latents on the host, as embed's clip path calls it) against diffusers'
    ``AutoencoderKLWan.encode`` alone on a bf16 clip on the device; the peak device memory of one encode."""
    import torch
    from diffusers import AutoencoderKLWan

    from pipeline.embed.loading import EncoderSource

    from pipeline.embed.latents import LatentSpec

    ours = LatentSpec(EncoderSource(folder)).load(use_gpu=gpu, dtype="BF16")
    device, dtype = ours.device, ours.compute_dtype
    alone = AutoencoderKLWan.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    f, h, w = clip
    pixels = np.random.default_rng(0).integers(0, 255, (1, f, h, w, 3), dtype=np.uint8)
    x = torch.from_numpy(pixels).to(device).permute(0, 4, 1, 2, 3).float().div(127.5).sub(1).to(dtype)
    with torch.inference_mode():
        t_alone = _timed(lambda: alone.encode(x).latent_dist.mean, gpu, iters)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t_ours = _timed(lambda: ours.encode(pixels), gpu, iters)
    peak = torch.cuda.max_memory_allocated() / 1e9 if gpu else 0.0
    return [Row("wan", f"Wan 2.1 VAE {w}x{h}x{f} {_dtype_name(dtype)}, one clip: LatentEncoder.encode vs "
                "AutoencoderKLWan.encode alone", f"{1 / t_ours:.3f} vs {1 / t_alone:.3f} clips/s "
                f"({t_alone / t_ours:.2f}x), {t_ours:.2f} s a clip; peak {peak:.1f} GB",
                values={"clips_per_second": 1 / t_ours, "alone": 1 / t_alone, "peak_gb": peak})]  # fmt: skip


def clip_rows(folder: str, images: Path, gpu: bool, batch: int, iters: int) -> list[Row]:
    """Images/s of annotate's CLIP embedding (``ImageEmbedder``: the model's image processor on the CPU, then
    the vision tower and projection) on ``batch`` of the dataset's JPEGs, decoded and downscaled beforehand
    as annotate does (long side 768), against the vision tower alone on processed pixels on the device."""
    import torch
    from PIL import Image

    from pipeline.annotate.vision import ImageEmbedder, VisionSpec

    ours = ImageEmbedder(VisionSpec(model=folder), device="cuda" if gpu else "cpu")
    files = sorted(images.glob("*.jpg"))[:batch]
    pictures = []
    for f in files:
        im = Image.open(f).convert("RGB")
        im.thumbnail((768, 768))
        pictures.append(im)
    pictures = (pictures * (batch // len(pictures) + 1))[:batch]
    x = ours.processor(images=pictures, return_tensors="pt")["pixel_values"].to(ours.device, ours.model.dtype)
    with torch.inference_mode():
        t_alone = _timed(lambda: ours.model(pixel_values=x).image_embeds, gpu, iters)
    t_ours = _timed(lambda: ours(pictures), gpu, iters)
    cfg = ours.model.config
    rate, ceiling = batch / t_ours, batch / t_alone
    return [Row("annotate", f"CLIP vision ({cfg.hidden_size} wide x {cfg.num_hidden_layers}, patch {cfg.patch_size},"
                f" {cfg.image_size} px) embedding, batch {batch}: ImageEmbedder (processor on 1 CPU thread) vs the "
                "tower alone", f"{rate:.1f} vs {ceiling:.1f} images/s ({rate / ceiling:.2f}x)",
                values={"images_per_second": rate, "alone": ceiling})]  # fmt: skip


def annotate_rows(work: Path, gpu: bool, images: int = 256) -> list[Row]:
    """VLM captions/s through ``bucketeer annotate --engine vllm`` (Ray Data's vLLM engine, end to end: fetch,
    decode, generate, parts written) vs vLLM alone (``LLM.chat``: the model's chat template, then
    ``LLM.generate``) on the same images decoded beforehand, greedy, 32 new tokens; a random-weight Llava
    (``pipeline.annotate.default_model``, 1024 wide, 8 layers, 336-pixel vision input). A skipped row with
    the reason until ``pipeline.annotate`` and ``vllm`` import and a GPU is there."""
    what = "VLM captions/s: bucketeer annotate (vLLM engine) vs LLM.chat/generate alone, Llava 1024x8, 336 px"
    for module in ("pipeline.annotate", "vllm"):
        try:
            __import__(module)
        except Exception as e:
            return [Row("annotate", what, f"skipped: {module} does not import ({type(e).__name__}: {e})"[:200],
                        status="skipped")]  # fmt: skip
    if not gpu:
        return [Row("annotate", what, "skipped: the vLLM engine needs a GPU", status="skipped")]
    from PIL import Image
    from vllm import LLM, SamplingParams

    from benchmarks.gpu_models import write_jpeg_manifest
    from pipeline import AnnotateJob, run
    from pipeline.annotate.default_model import build_default_model
    from pipeline.annotate.job import DEFAULT_PROMPT

    files = sorted((work / "images").glob("*.jpg"))[:images]
    size = Image.open(files[0]).size
    manifest = str(work / "manifest-annotate")
    write_jpeg_manifest(str(work / "images"), manifest, [f.name for f in files], size, (1024, 1024), 1)
    folder = str(build_default_model(work / "vlm", width=1024, layers=8, image=336))
    result = run(AnnotateJob(manifest=manifest, out=str(work / "annotations"), model=folder, engine="vllm",
                             device="cuda", max_new_tokens=32, image_size=336))  # fmt: skip
    llm = LLM(model=folder, gpu_memory_utilization=0.5)
    pictures = [Image.open(f).convert("RGB").resize((336, 336)) for f in files]
    chats = [[{"role": "user", "content": [{"type": "image_pil", "image_pil": p},
                                           {"type": "text", "text": DEFAULT_PROMPT}]}] for p in pictures]  # fmt: skip
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    llm.chat(chats[:8], greedy)  # warm-up
    t0 = time.perf_counter()
    llm.chat(chats, greedy)
    alone = len(chats) / (time.perf_counter() - t0)
    e2e = result.images_per_second or 0.0
    return [Row("annotate", what, f"{e2e:.1f} vs {alone:.1f} images/s ({e2e / alone:.2f}x)",
                values={"end_to_end": e2e, "alone": alone, "captioned": result.captioned})]
