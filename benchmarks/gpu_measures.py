"""The measures of ``gpu_check.py`` that need no Ray and no launcher: GPU busy sampling, encoders alone,
JPEG decode on CPU and GPU, the trainer's loader alone, and the annotate row. Each runs on a CPU too
(``--smoke``); timings on CUDA synchronize the device before the clock stops. A row that runs a model also says
its achieved TFLOP/s and share of the GPU's bf16 dense peak (:mod:`benchmarks.gpu_flops`: the FLOPs counted once,
in the timing's warm-up call)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.gpu_flops import throughput, throughput_text, timed_counted

__all__ = ["Row", "BusySampler", "vae_sweep", "vae_tuned_rows", "captions", "text_vs_pipeline", "decode_rows",
           "loader_rate", "repa_rows", "wan_rows", "clip_rows", "annotate_rows"]


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
    return _timed_output(fn, gpu, iters)[0]


def _timed_output(fn: Callable[[], Any], gpu: bool, iters: int) -> tuple[float, Any]:
    """:func:`_timed`, and what the last call of ``fn`` returned (no extra call to get the output checked)."""
    fn()
    _sync(gpu)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
    _sync(gpu)
    return (time.perf_counter() - t0) / iters, out


def _rates(flops: int, t_ours: float, t_alone: float, gpu: bool) -> tuple[str, dict[str, Any]]:
    """``(phrase, values)`` of a model's FLOPs per call run by bucketeer in ``t_ours`` and alone in ``t_alone``
    seconds: the phrase and ``tflops``/``peak_fraction`` are bucketeer's, ``tflops_alone`` the model's alone."""
    ours = throughput(flops, t_ours, gpu)
    return f"; {throughput_text(ours)}", {**ours, "tflops_alone": throughput(flops, t_alone, gpu)["tflops"]}


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vae_sweep(family: str, folder: str, bucket: tuple[int, int], batches: tuple[int, ...], gpu: bool,
              images_per_size: int) -> list[Row]:  # fmt: skip
    """Images/s of the family's VAE at each batch size: bucketeer's ``LatentEncoder.encode`` (uint8 host pixels
    -> the fp32 latents on the device as the family's denoiser sees them, as the embed worker calls it) against
    the same diffusers VAE's ``encode`` alone (bf16 pixels already on the device, the posterior mean left there;
    a 3D VAE, Qwen-Image's, given 1-frame clips and Qwen-Image 2.1's RGBA, as their pipelines do: :func:`_rgba`,
    :func:`_takes_clips`); the GPU's busy fraction (NVML) over
    bucketeer's calls; the VAE's TFLOP/s in bucketeer's calls. About ``images_per_size`` images per timing (one
    warm-up call before, in which the FLOPs are counted)."""
    import torch

    from pipeline.embed.latents import LatentSpec
    from pipeline.embed.loading import EncoderSource

    ours = LatentSpec(EncoderSource(folder, "vae")).load(use_gpu=gpu, dtype="BF16")
    device, dtype, vae = ours.device, ours.compute_dtype, ours.vae
    clips = _takes_clips(vae)
    rng = np.random.default_rng(0)
    rows = []
    w, h = bucket
    for b in batches:
        pixels = rng.integers(0, 255, (b, h, w, 3), dtype=np.uint8)
        x = _rgba(vae, torch.from_numpy(pixels).to(device).permute(0, 3, 1, 2).float().div(127.5).sub(1).to(dtype))
        x = x.unsqueeze(2) if clips else x
        iters = max(1, images_per_size // b)
        with torch.inference_mode():
            t_alone, _, flops = timed_counted(lambda: vae.encode(x).latent_dist.mean, gpu, iters)
        sampler = BusySampler.start() if gpu else None
        started = time.time()
        try:
            t_ours = _timed(lambda: ours.encode(pixels), gpu, iters)
        finally:
            samples = sampler.stop() if sampler else None
        busy = BusySampler.mean(samples, started, time.time()) if samples else None
        rate, ceiling = b / t_ours, b / t_alone
        said, counted = _rates(flops, t_ours, t_alone, gpu)
        rows.append(Row("vae", f"{family} VAE ({type(vae).__name__}) {w}x{h} {_dtype_name(dtype)}, batch {b}: "
                        f"LatentEncoder.encode (host uint8 in) vs its encode alone (bf16 input on the device)",
                        f"{rate:.1f} vs {ceiling:.1f} images/s ({rate / ceiling:.2f}x); GPU busy "
                        f"{'n/a' if busy is None else f'{busy:.0%}'}{said}",
                        ">= 0.9x alone, busy >= 90%" if gpu else "",
                        values={"batch": b, "images_per_second": rate, "alone": ceiling, "busy": busy,
                                **counted}))  # fmt: skip
    return rows  # the caller frees the device memory (gpu_check: after each section)


def _takes_clips(vae) -> bool:
    """Whether ``vae`` encodes clips ``(B, C, F, H, W)``, an image as a 1-frame one: a 3D VAE (Qwen-Image's,
    Qwen-Image 2.1's, whose convolutions hold 2D weights)."""
    return vae.encoder.conv_in.weight.ndim == 5 or type(vae).__name__ == "AutoencoderKLQwenImage21"


def _rgba(vae, x):
    """``x`` (B, 3, H, W) in [-1, 1] as ``vae`` reads it: Qwen-Image 2.1's VAE takes RGBA, an opaque image's alpha +1
    (what its pipeline hands it, and embed's ``qwen_image21.vae_latents``); the others RGB as it is."""
    import torch

    if getattr(vae.config, "in_channels", 3) != 4:
        return x
    return torch.cat([x, torch.ones_like(x[:, :1])], dim=1)


@contextmanager
def _cudnn_benchmark(on: bool):
    """``torch.backends.cudnn.benchmark`` set to ``on`` inside, as it was after (a process-wide switch)."""
    import torch

    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = was


def vae_tuned_rows(family: str, folder: str, bucket: tuple[int, int], batch: int, gpu: bool, images: int,
                   compile: bool = False) -> list[Row]:  # fmt: skip
    """The VAE encoder as embed runs it on cuda (:func:`pipeline.embed.vae_speed.tune_vae`: NHWC, cuDNN autotuning,
    SDPA) against diffusers' ``vae.encode`` as shipped (``from_pretrained`` in bf16, NCHW input, cuDNN autotuning
    off: PyTorch's default), both on the same bf16 batch on the device, posterior mean out: images/s, the largest
    latent difference (absolute, and over the largest latent), TFLOP/s. With ``compile``, a row of the encoder
    also compiled (``embed --compile-vae``; compiled in a first call timed apart): skipped with the reason where
    torch.compile fails, or for a 3D VAE (not compiled)."""
    import copy

    import torch

    from pipeline.embed.latents import _vae_class
    from pipeline.embed.vae_speed import as_input, tune_vae

    device, dtype = torch.device("cuda" if gpu else "cpu"), torch.bfloat16
    shipped = _vae_class(folder, "vae").from_pretrained(folder, subfolder="vae", torch_dtype=dtype).to(device).eval()
    w, h = bucket
    pixels = np.random.default_rng(0).integers(0, 255, (batch, h, w, 3), dtype=np.uint8)
    x = torch.from_numpy(pixels).to(device).permute(0, 3, 1, 2).float().div(127.5).sub(1).to(dtype)
    x = _rgba(shipped, x).contiguous()
    clips = _takes_clips(shipped)
    iters = max(2, images // batch)
    name = f"{family} VAE ({type(shipped).__name__}) {w}x{h} bf16, batch {batch}"

    def encoder(vae, pixels_in):
        return lambda: vae.encode(pixels_in.unsqueeze(2) if clips else pixels_in).latent_dist.mean

    with torch.inference_mode(), _cudnn_benchmark(False):
        t_shipped, reference, flops = timed_counted(encoder(shipped, x), gpu, iters)
    reference = reference.float()
    tuned = copy.deepcopy(shipped)
    tuning = tune_vae(tuned, channels_last=True)
    with torch.inference_mode(), _cudnn_benchmark(gpu):
        t_tuned, latents = _timed_output(encoder(tuned, as_input(x, tuning)), gpu, iters)
    tuned = None
    applied = ", ".join(k for k, on in (("NHWC", tuning.channels_last), ("cudnn.benchmark", gpu)) if on) or "nothing"
    rows = [_tuned_row(f"{name}: the tuned encoder ({applied}; SDPA) vs diffusers' vae.encode as shipped",
                       batch, t_tuned, t_shipped, latents, reference, flops, gpu,
                       ">= 1.3x as shipped" if gpu and tuning.channels_last else "")]  # fmt: skip
    if not compile:
        return rows
    what = f"{name}: the tuned encoder compiled (embed --compile-vae) vs diffusers' vae.encode as shipped"
    compiled = copy.deepcopy(shipped)
    tuning = tune_vae(compiled, channels_last=True, compile=True)
    if not tuning.compiled:
        return rows + [Row("vae", what, "skipped: a 3D VAE's encoder is not compiled", status="skipped")]
    try:
        with torch.inference_mode(), _cudnn_benchmark(gpu):
            call = encoder(compiled, as_input(x, tuning))
            t0 = time.perf_counter()
            call()  # the compile
            _sync(gpu)
            seconds = time.perf_counter() - t0
            t_compiled, latents = _timed_output(call, gpu, iters)
    except Exception as e:  # inductor needs a compiler (triton, or a C++ one on a CPU): the row says why not
        line = (str(e).strip().splitlines() or [""])[0][:200]
        return rows + [Row("vae", what, f"skipped: torch.compile fails here: {type(e).__name__}: {line}",
                           status="skipped")]  # fmt: skip
    row = _tuned_row(what, batch, t_compiled, t_shipped, latents, reference, flops, gpu,
                     ">= 1.3x as shipped" if gpu else "")  # fmt: skip
    row.result += f"; compiled in {seconds:.0f} s"
    row.values["compile_seconds"] = seconds
    return rows + [row]


def _tuned_row(what: str, batch: int, t_tuned: float, t_shipped: float, latents, reference, flops: int, gpu: bool,
               target: str) -> Row:  # fmt: skip
    """A row of :func:`vae_tuned_rows`: failed when the latents are further apart than bf16 rounding (5% of the
    largest latent: the CPU tests see 1-2%)."""
    diff = float((latents.float() - reference).abs().max())
    rel = diff / max(float(reference.abs().max()), 1e-30)
    rate, ceiling = batch / t_tuned, batch / t_shipped
    counted = throughput(flops, t_tuned, gpu)
    return Row("vae", what, f"{rate:.1f} vs {ceiling:.1f} images/s ({rate / ceiling:.2f}x); latents differ by at most "
               f"{diff:.2e} ({rel:.1%} of the largest); {throughput_text(counted)}", target,
               status="ok" if rel < 0.05 else "failed",
               values={"tuned_batch": batch, "images_per_second": rate, "shipped": ceiling, "speedup": rate / ceiling,
                       "max_abs_diff": diff, "max_rel_diff": rel, **counted})  # fmt: skip


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


CAPTION_WORDS = ("photo of the red cat and a blue dog on a chair near the window in soft light with color shape "
                 "size texture quantity text objects background picture broken circle thing spatial").split()


def captions(batch: int) -> list[str]:
    """``batch`` distinct 40-word captions of one token count in every family's tokenizer: ``a`` and then the
    same 39 words in another order each (every tokenizer splits words apart before it merges or looks them up,
    so an order changes no count). One count means no padding, so a masked family's pipeline batch is exactly
    bucketeer's (which encodes captions of one count together)."""
    rng = np.random.default_rng(0)
    words = (CAPTION_WORDS * 2)[:39]
    out: dict[str, None] = {}
    while len(out) < batch:
        out["a " + " ".join(rng.permutation(words))] = None
    return list(out)


def _prompt(family: str, pipe, captions: list[str], images: list[np.ndarray] | None, device) -> tuple[Any, Any]:
    """``(prompt embeddings, pooled or mask or None)`` of ``family``'s pipeline's own ``encode_prompt`` on the
    captions (Qwen-Image-Edit: each instruction with its reference ``images[i]``, one pair a call, as its
    ``__call__`` encodes one; Z-Image's and ERNIE-Image's lists of real rows zero-padded to a batch; Krea 2's and
    Anima's rows that reach the transformer, as the cache stores them)."""
    import torch
    from PIL import Image

    if family == "sdxl":
        embeds, _, pooled, _ = pipe.encode_prompt(captions, device=device, do_classifier_free_guidance=False)
        return embeds, pooled
    if family == "flux":
        embeds, pooled, _ = pipe.encode_prompt(captions, prompt_2=None, device=device)
        return embeds, pooled
    if family == "chroma":
        embeds, _, mask, *_ = pipe.encode_prompt(captions, device=device, do_classifier_free_guidance=False)
        return embeds, mask
    if family == "z-image":  # a copy: its _encode_prompt writes the templated prompts into the list it is given
        rows, _ = pipe.encode_prompt(list(captions), device=device, do_classifier_free_guidance=False)
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), None
    if family == "qwen-image-edit":
        rows = [pipe.encode_prompt([c], image=Image.fromarray(image), device=device)[0][0]
                for c, image in zip(captions, images)]  # fmt: skip
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), None
    if family == "ernie-image":  # one (n, D) per caption, each run alone
        return torch.nn.utils.rnn.pad_sequence(pipe.encode_prompt(captions, device=device), batch_first=True), None
    if family == "qwen-image-2.1":  # (embeds, mask, image mask); one token count: nothing padded, mask None
        return pipe.encode_prompt(captions, device=device)[0], None
    if family == "krea-2":  # (B, L, 12, D): the rows its mask keeps (caption + suffix), 12 layers side by side
        embeds, mask = pipe.encode_prompt(captions, device=device)
        return torch.stack([e[m].flatten(1) for e, m in zip(embeds, mask)]), None
    if family == "longcat-image":  # all 512 rows; on the pipeline's execution device
        return pipe.encode_prompt(list(captions))[0], None
    if family == "anima":
        return torch.stack([_anima_text(pipe, c, device) for c in captions]), None
    if family == "kandinsky-5":  # (Qwen rows, CLIP-L pooled, cumulative row counts); one token count: no padding
        embeds, pooled, _ = pipe.encode_prompt(captions, device=device)
        return embeds, pooled
    embeds, _ = pipe.encode_prompt(captions, device=device)  # flux2, flux2-klein, qwen-image (no pad: mask None)
    return embeds, None


def _anima_text(pipe, caption: str, device):
    """What ``AnimaModularPipeline`` hands its transformer for ``caption`` (its text encoder step, then its LLM
    adapter's conditioning step, one prompt a call as ``__call__`` runs one), without the zero rows past the
    caption's T5 tokens that pad it to 512 (the trainer's padding, not stored): ``(n, D)``."""
    from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    text = AnimaTextEncoderStep.encode_prompt(pipe, [caption], prepare_unconditional_embeds=False, device=device)
    dtype = pipe.text_conditioner.dtype  # the pipeline's output dtype is its transformer's: the same here
    rows = AnimaTextConditioningStep._condition_prompt_embeds(
        pipe, text["qwen_prompt_embeds"], text["qwen_attention_mask"], text["t5_input_ids"],
        text["t5_attention_mask"], device, dtype, dtype)[0]  # fmt: skip
    return rows[: int(text["t5_attention_mask"][0].sum())]


def _load_pipeline(family: str, folder: str, dtype, device):
    """The family's diffusers pipeline without its VAE and denoiser (Qwen-Image-Edit's and Qwen-Image 2.1's
    processors loaded as bucketeer loads them: transformers 5.x without torchvision cannot build their own; Anima's
    modular pipeline with its text components only)."""
    from diffusers import DiffusionPipeline, ModularPipeline

    from pipeline.embed.families.qwen_image21 import load_processor
    from pipeline.embed.processors import load_qwen2vl_processor

    if family == "anima":
        pipe = ModularPipeline.from_pretrained(folder)
        pipe.load_components(["text_encoder", "tokenizer", "t5_tokenizer", "text_conditioner"], dtype=dtype)
        return pipe.to(device)
    skip = {"vae": None, "unet" if family == "sdxl" else "transformer": None}
    if family == "qwen-image-edit":
        skip["processor"] = load_qwen2vl_processor(folder)
    if family == "qwen-image-2.1":
        skip["processor"] = load_processor(folder)
    return DiffusionPipeline.from_pretrained(folder, dtype=dtype, **skip).to(device)


def text_vs_pipeline(family: str, folder: str, batch: int, gpu: bool, iters: int,
                     reference: tuple[int, int] | None = None) -> list[Row]:  # fmt: skip
    """Captions/s of bucketeer's ``TextEncoders.encode`` (tokenize, forward, copy to the host: what the embed
    text worker calls) against the family's diffusers pipeline's ``encode_prompt`` (its outputs left on the
    device), on the same batch of :func:`captions`, both in the same compute dtype; and how far the cache's joined
    embeddings (``TextLayout.prompt_embeds`` of the bf16 records) are from ``encode_prompt``'s rounded to bf16
    (relative L2 error: 0 when the records are exactly what the pipeline computes); the TFLOP/s of bucketeer's
    calls (its text models' FLOPs, counted in its warm-up call). ``reference`` (w, h): a
    reference family's (Qwen-Image-Edit) image size: each caption is an instruction with its own reference of that
    size, encoded as the embed worker calls it (``encode(instructions, images=references)``). The two models are
    loaded one after the other (a 24B text encoder twice would not fit one GPU)."""
    import torch

    from benchmarks.gpu_models import TEXT_NAMES
    from manifests.cache import TextLayout
    from manifests.cache.records import TextRecord
    from pipeline.embed.encoders import encoder_specs
    from pipeline.embed.families.qwen_image_edit import reference_pixels
    from pipeline.embed.loading import to_storage

    _, spec = encoder_specs(family=family, model=folder, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    ours = spec.load(use_gpu=gpu, dtype="BF16")
    device, dtype = ours.device, ours.compute_dtype
    texts = captions(batch)
    images = None
    if reference is not None:
        w, h = reference
        noise = np.random.default_rng(1).integers(0, 256, (batch, h, w, 3), dtype=np.uint8)
        images = [reference_pixels(crop, w * h) for crop in noise]  # as the workers resize it (here: unchanged)
    extra = {} if images is None else {"images": images}
    t_ours, encoded, flops = timed_counted(lambda: ours.encode(texts, **extra), gpu, iters)
    layout = TextLayout.from_json(ours.describe()["layout"])
    ours = None  # its models freed before the pipeline's load (the timing's closure holds the name, not them)
    _free()
    pipe = _load_pipeline(family, folder, dtype, device)

    def prompt():
        with torch.inference_mode():
            return _prompt(family, pipe, texts, images, device)

    t_pipe, prompted = _timed_output(prompt, gpu, iters)
    records = [TextRecord(i, tuple(to_storage(t, "BF16") for t in tokens),
                          None if p is None else to_storage(p, "BF16"), "BF16")
               for i, (tokens, p) in enumerate(encoded)]  # fmt: skip
    joined, _, pooled = layout.prompt_embeds(records)
    ref, ref_pooled = (None if t is None else t.to(torch.bfloat16).float().cpu().numpy() for t in prompted)
    pipe = prompted = None
    err = _rel_error(joined, ref)
    err_pooled = None if ref_pooled is None else _rel_error(pooled, ref_pooled)
    rate, ceiling = batch / t_ours, batch / t_pipe
    if reference is None:
        what, unit = f"batch {batch}", "captions/s"
    else:
        what, unit = (f"{batch} (instruction, {reference[0]}x{reference[1]} reference) pairs, encode(instructions, "
                      "images=references)"), "pairs/s"  # fmt: skip
    errors = f"{err:.1e}" + ("" if err_pooled is None else f", {err_pooled:.1e}")
    ok = err < 1e-2 and (err_pooled is None or err_pooled < 1e-2)
    counted = throughput(flops, t_ours, gpu)  # bucketeer's FLOPs: a pruned LLM runs fewer than the pipeline's
    return [Row("text", f"{family} {TEXT_NAMES[family]} {_dtype_name(dtype)}, {what}: TextEncoders.encode vs the "
                "pipeline's encode_prompt", f"{rate:.1f} vs {ceiling:.1f} {unit} ({rate / ceiling:.2f}x); "
                f"{throughput_text(counted)}", ">= 0.9x encode_prompt" if gpu else "",
                values={"captions_per_second": rate, "encode_prompt": ceiling, **counted}),
            Row("text", f"{family}: the cache's joined bf16 text records vs encode_prompt's output in bf16 "
                f"(relative L2 error: embeds{'' if err_pooled is None else ', ' + _pooled_name(family)})", errors,
                "0 (the same numbers)", status="ok" if ok else "failed",
                values={"rel_error": err, "rel_error_pooled": err_pooled})]  # fmt: skip


def _pooled_name(family: str) -> str:
    return "mask" if family == "chroma" else "pooled"


def _rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """Relative L2 error of ``ours`` against ``ref``; RuntimeError when their shapes differ (not the same rows)."""
    if ours.shape != ref.shape:
        raise RuntimeError(f"the cache's joined text is {ours.shape}, encode_prompt's {ref.shape}: not the same rows")
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


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
        t_alone, _, flops = timed_counted(lambda: ours.model(pixel_values=x).last_hidden_state, gpu, iters)
    t_ours = _timed(lambda: ours.encode(pixels), gpu, iters)
    grid, dim = ours.grid, int(ours.model.config.hidden_size)
    rate, ceiling = batch / t_ours, batch / t_alone
    said, counted = _rates(flops, t_ours, t_alone, gpu)
    return [Row("repa", f"DINOv2 ({dim} wide, {grid[0]}x{grid[1]} patches) features of {w}x{h} crops, batch "
                f"{batch}: FeatureEncoder.encode vs the model alone", f"{rate:.1f} vs {ceiling:.1f} images/s "
                f"({rate / ceiling:.2f}x){said}", values={"images_per_second": rate, "alone": ceiling,
                                                          **counted})]  # fmt: skip


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
        t_alone, _, flops = timed_counted(lambda: alone.encode(x).latent_dist.mean, gpu, iters)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t_ours = _timed(lambda: ours.encode(pixels), gpu, iters)
    peak = torch.cuda.max_memory_allocated() / 1e9 if gpu else 0.0
    said, counted = _rates(flops, t_ours, t_alone, gpu)
    return [Row("wan", f"Wan 2.1 VAE {w}x{h}x{f} {_dtype_name(dtype)}, one clip: LatentEncoder.encode vs "
                "AutoencoderKLWan.encode alone", f"{1 / t_ours:.3f} vs {1 / t_alone:.3f} clips/s "
                f"({t_alone / t_ours:.2f}x), {t_ours:.2f} s a clip; peak {peak:.1f} GB{said}",
                values={"clips_per_second": 1 / t_ours, "alone": 1 / t_alone, "peak_gb": peak,
                        **counted})]  # fmt: skip


def clip_rows(folder: str, images: Path, gpu: bool, batch: int, iters: int) -> list[Row]:
    """Images/s of annotate's CLIP embedding (``ImageEmbedder``: on cuda each image sent as uint8 and resized,
    cropped and normalised there by ``device_pixels``, on the CPU the model's image processor; then the vision
    tower and projection) on ``batch`` of the dataset's JPEGs, decoded and downscaled beforehand
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
        t_alone, _, flops = timed_counted(lambda: ours.model(pixel_values=x).image_embeds, gpu, iters)
    t_ours = _timed(lambda: ours(pictures), gpu, iters)
    cfg = ours.model.config
    rate, ceiling = batch / t_ours, batch / t_alone
    how = "pixels prepared on the device" if gpu else "processor on 1 CPU thread"
    said, counted = _rates(flops, t_ours, t_alone, gpu)
    return [Row("annotate", f"CLIP vision ({cfg.hidden_size} wide x {cfg.num_hidden_layers}, patch {cfg.patch_size},"
                f" {cfg.image_size} px) embedding, batch {batch}: ImageEmbedder ({how}) vs the tower alone",
                f"{rate:.1f} vs {ceiling:.1f} images/s ({rate / ceiling:.2f}x){said}",
                values={"images_per_second": rate, "alone": ceiling, **counted})]  # fmt: skip


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
