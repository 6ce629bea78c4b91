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
from typing import Any

import numpy as np

__all__ = ["Row", "BusySampler", "vae_alone", "text_alone", "decode_rows", "loader_rate", "annotate_rows"]


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


def vae_alone(folder: str, bucket: tuple[int, int], batch: int, gpu: bool, batches: int) -> float:
    """Images/s of the family's VAE alone: ``LatentEncoder.encode`` (uint8 -> bf16 posterior mean on the
    device, as the embed actor calls it) on one pre-decoded random batch, after one warm-up batch."""
    from pipeline.embed.encoders import EncoderSource, LatentSpec

    encoder = LatentSpec(EncoderSource(folder, "vae")).load(use_gpu=gpu, dtype="BF16")
    pixels = np.random.default_rng(0).integers(0, 255, (batch, bucket[1], bucket[0], 3), dtype=np.uint8)
    encoder.encode(pixels)
    _sync(gpu)
    t0 = time.perf_counter()
    for _ in range(batches):
        encoder.encode(pixels)
    _sync(gpu)
    return batches * batch / (time.perf_counter() - t0)


def text_alone(family: str, folder: str, batch: int, gpu: bool, batches: int) -> float:
    """Captions/s of the family's text encoders alone: ``TextEncoders.encode`` (tokenize, forward, copy
    to the host: what the embed text actor calls) on batches of distinct captions, after a warm-up."""
    from pipeline.embed.encoders import EncoderSource, TextSpec

    spec = TextSpec(family, (EncoderSource(folder, "text_encoder"), EncoderSource(folder, "text_encoder_2")),
                    EncoderSource(folder))  # fmt: skip
    encoder = spec.load(use_gpu=gpu, dtype="BF16")
    words = "a photo of a red cat on a blue chair near the window in soft morning light".split()
    captions = [" ".join(words[(i + k) % len(words)] for k in range(40)) + f" {i}" for i in range(batch)]
    encoder.encode(captions)  # returns host tensors: the device is synchronized
    t0 = time.perf_counter()
    for _ in range(batches):
        encoder.encode(captions)
    return batches * batch / (time.perf_counter() - t0)


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
