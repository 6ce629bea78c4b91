"""Every GPU measure the project names, on random weights of the real architectures at real sizes: one table.

    make gpu-check                                   # on a GPU machine: prints, then runs, the python3 command below
    python3 benchmarks/gpu_check.py --wheels .gpu-wheels [--budget 440] [--families sdxl,flux] [--backends ...]
    python3 benchmarks/gpu_check.py --wheels .gpu-wheels --families qwen-image,z-image --sections setup,vae,text
    python3 benchmarks/gpu_check.py --smoke          # every section's code on the CPU, tiny models, in a minute
    python3 benchmarks/gpu_check.py --wheels .gpu-wheels --sections setup,vae --compile   # + the compiled VAE rows
    make gpu-rehearsal                               # --smoke in a venv holding only what the GPU machine has

Made for the GPU machine we get: its own ``python3`` (CUDA torch and most of what is imported), no network, no
Ray, no vLLM. ``--wheels DIR`` installs the rest from a wheel folder (``make gpu-wheels`` on a networked machine;
:mod:`benchmarks.gpu_env`) into ``.gpu-site/`` and puts it first on the path. Every section runs in this process
through bucketeer's own code (the trainer in ``accelerate launch`` children), none needs Ray; a section that
does says ``skipped: needs ray`` (or ``needs vllm``) in its row. Without CUDA (and without ``--smoke``) it prints
one line and exits 0. Each section is time-boxed, and the whole run keeps to ``--budget`` seconds (late sections
say they were skipped); a failing section prints its error in its row and the others go on (exit code 1 when
any row failed). The models are those of :mod:`benchmarks.gpu_models` (nothing downloaded), the data a local
folder of 1216x1088 JPEGs. In order, so that a cut budget loses the least:

1. **sdxl**: ``vae``: ``LatentEncoder.encode`` (host uint8 in, fp32 posterior mean out) at batch 1..16 against
   diffusers' ``vae.encode`` alone (on-device input), with the GPU's busy fraction (NVML ``utilization.gpu``:
   the share of 100 ms periods with a kernel running) over bucketeer's calls; then at batch 16 the encoder as embed
   tunes it on cuda (:mod:`pipeline.embed.vae_speed`: NHWC, ``cudnn.benchmark``, SDPA) against ``vae.encode`` as
   diffusers ships it (NCHW input, autotuning off), with the largest latent difference between the two (target
   >= 1.3x, the difference within bf16 rounding: over 5% of the largest latent fails the row), and with
   ``--compile`` a row of that encoder also compiled (``embed --compile-vae``; its compile timed apart; skipped
   with the reason where torch.compile fails); ``text``: ``TextEncoders.encode``
   against the pipeline's ``encode_prompt``, and how far the cache's joined bf16 records are from its output;
   ``embed``: ``bucketeer embed --executor local --device cuda`` end to end (read, decode on threads, VAE,
   gzip, shards, commit: images/s steady state, busy fraction over its image phase, captions/s of its text
   phase); ``records``: the records embedded on the GPU against those embedded on the CPU (fp32) of the same
   images; ``loader``: the trainer's ``BatchLoader`` along a plan, batches to the GPU; ``train``: step time,
   data-wait, samples/s and peak memory of the project's trainer (``Trainer.setup`` + ``Trainer.loop`` under
   ``accelerate launch --num_processes 1`` with ``infra/accelerate``'s DDP and FSDP2 configs, full
   fine-tuning, AdamW, bf16 autocast) fed by the real loader from that cache.
2. **vision**: REPA's DINOv2-base features (``FeatureEncoder.encode`` vs the model alone), the Wan 2.1 VAE on a
   480x832x81 clip (clips/s, peak memory), annotate's CLIP ViT-L/14 embedding (``ImageEmbedder`` vs the tower
   alone), JPEG decode (Pillow on one thread vs nvJPEG).
3. **flux** (CLIP-L + T5-XXL at 512 tokens; a Flux-width transformer of 4 + 8 blocks): as sdxl.
4. **the encoder families** (``--families chroma,z-image,flux2-klein,qwen-image,qwen-image-edit,flux2``, those of
   mid-2026 ``anima,ernie-image,krea-2,longcat-image,kandinsky-5,qwen-image-2.1``, or ``all``; not in the default
   run): per family ``setup`` (its folder: the text models and VAE at the published sizes of
   :mod:`benchmarks.real_configs`, random weights, bf16, no denoiser), ``vae`` (the sweep above against that VAE's
   own ``encode``) and ``text`` (against the pipeline's ``encode_prompt``, and the exactness row; Qwen-Image-Edit:
   (instruction, 1024² reference) pairs as the embed worker encodes them). Each section's box grows with the
   folder's size; a folder the disk, the GPU or the budget left cannot hold (Flux 2's is 48 GB) is skipped and its
   rows say why; a family's folder is removed after its rows.
5. DeepSpeed ZeRO-2/3 (sdxl), where its source archive builds offline there; the Ray embed job and the vLLM
   annotate engine (rows that say why they skip where Ray or vLLM is absent).
6. **train-cudnn** (only when named: ``--families flux --sections setup,vae,text,embed,loader,train,train-cudnn``):
   the Flux trainer again with ``cudnn_attention: on`` (torch's own choice of attention backend), against the
   default row's ``auto`` (cuDNN's attention off on sm90/sm100): the lead on its CUDA error confirmed when this one
   fails and the default passes. ``sdpa`` (in the default run, first): :mod:`benchmarks.gpu_sdpa`'s micro-repro,
   the two gradient layouts of Flux's blocks through each SDPA backend.
7. **caption** (only when named: ``--sections caption``; ``--smoke``: the tiny shape): Qwen2.5-VL-7B-Instruct's
   shape, random weights, through annotate's transformers engine, batch 1..64 (:mod:`benchmarks.gpu_caption`).
8. **video** (only when named: ``--sections video --budget 600``; ``--smoke``: the tiny VAEs): the video families'
   VAEs at their published configs and clip sizes, Wan 2.2 TI2V-5B's, LTX-2's and HunyuanVideo 1.5's (121 frames
   at up to 1280x720, untiled, bf16: clips/s, peak memory, TFLOP/s, as the Wan 2.1 row), and TransNetV2's scene
   cuts on cuda against the CPU (frames/s) (:mod:`benchmarks.gpu_video`).

Every row that runs a model (the VAE rows, text, repa, wan, CLIP, train) also says the model's achieved TFLOP/s
and its share of the GPU's bf16 dense peak (:mod:`benchmarks.gpu_flops`: H100 SXM and H200 989, H100 PCIe 756,
A100 312, L40S 362, RTX 4090 165, ...; another GPU's share is ``unknown``, a CPU's ``n/a``): the FLOPs of one call
(matrix products, convolutions, attention) counted by ``FlopCounterMode`` once per model and input shape, in the
timing's warm-up call (the trainer's: its first step, forward and backward, a warm-up step), over the measured
seconds per call (the encoders: bucketeer's calls; ``values`` also hold the model alone's).

accelerate does not wrap a model in DDP at world size 1 (``use_distributed`` needs 2 processes): the ``ddp``
row is the 1-GPU loop the DDP config runs, without all-reduce. Everything is per GPU: on a machine with several
(``make gpu-check`` sets ``CUDA_VISIBLE_DEVICES=0`` unless set) the busy fraction is sampled on the one used.
Writes ``gpu-check.md`` and ``gpu-check.json`` to ``--out-dir`` (default ``$OUT``, else ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_flops import throughput, throughput_text  # noqa: E402
from benchmarks.gpu_measures import (BusySampler, Row, annotate_rows, clip_rows, decode_rows, loader_rate,  # noqa: E402
                                     repa_rows, text_vs_pipeline, vae_sweep, vae_tuned_rows, wan_rows)
from benchmarks.gpu_models import ENCODER_FAMILIES  # noqa: E402
from manifests.families import SPECS  # noqa: E402

RESULT_MARK = "GPU_CHECK_RESULT "
ERROR_MARK = "GPU_CHECK_ERROR "  # a trainer rank's exception, on its stdout
FULL_FAMILIES = ("sdxl", "flux")  # every section; the others (ENCODER_FAMILIES): setup, vae and text only
FAMILIES = FULL_FAMILIES + ENCODER_FAMILIES  # what --families all runs, in this order
DEFAULT_FAMILIES = "sdxl,flux"  # the default run stays under 8 minutes
SECONDS_PER_GB = 3.0  # an encoder family's folder: written once, read twice (bucketeer's, the pipeline's) at ~1 GB/s
CAPTION_SECONDS = 420  # --sections caption: the 7B folder written and loaded, then the batch sweep
BACKENDS: dict[str, list[str]] = {  # accelerate launch flags, 1 process
    "ddp": ["--config_file", "infra/accelerate/ddp-1x8.yaml"],
    "fsdp2": ["--config_file", "infra/accelerate/fsdp2-1x8.yaml"],
    "zero2": ["--config_file", "infra/accelerate/deepspeed-zero1-1x8.yaml", "--zero_stage", "2"],
    "zero3": ["--config_file", "infra/accelerate/deepspeed-zero1-1x8.yaml", "--zero_stage", "3"],
}
NO_CUDA = ("gpu-check: no CUDA device here (torch {torch}): nothing measured. Run `make gpu-check` on a GPU machine, "
           "or `python benchmarks/gpu_check.py --smoke` to run its code on this CPU.")
SITE = ROOT / ".gpu-site"  # where --wheels installs (git-ignored), one folder per Python version


@dataclass(frozen=True)
class Sizes:
    """How big each section's work is: ``REAL`` on a GPU, ``SMOKE`` on a CPU."""

    image: tuple[int, int]  # JPEG (w, h): a little larger than the bucket, so resize and crop do real work
    bucket: tuple[int, int]
    images: int  # embedded end to end
    captions: int  # distinct captions over those images
    vae_batches: tuple[int, ...]  # the batch sweep
    vae_images: int  # images per timing of a batch size
    text_batch: dict[str, int]
    text_iters: int
    train_batch: dict[str, int]
    log_every: int
    train_steps: int  # per trainer run: the first log window is warm-up
    records: tuple[int, tuple[int, int]]  # images and bucket of the GPU-vs-CPU records check
    repa_batch: int
    wan_clip: tuple[int, int, int]  # frames, height, width
    clip_batch: int
    iters: int  # timed calls of the vision sections
    section_seconds: int
    denoisers: dict[str, str]  # what each family trains, for the table


# captions per text-encoder call at real size ((instruction, reference) pairs for qwen-image-edit): FamilySpec.sizes
_TEXT_BATCH = {name: spec.sizes.text_batch for name, spec in SPECS.items() if spec.sizes is not None}
REAL = Sizes((1216, 1088), (1024, 1024), 384, 96, (1, 4, 8, 16), 32, _TEXT_BATCH, 2,
             {"sdxl": 1, "flux": 1}, 4, 12, (8, (512, 512)), 64, (81, 480, 832), 64, 3, 150,
             {"sdxl": "UNet (2.57B)", "flux": "Flux-width transformer, 4+8 of 19+38 blocks (2.5B)"})  # fmt: skip
# --smoke: the encoder families' tiny text encoders are deep (Flux 2 reads layer 30) at 512 tokens: batches of 2
SMOKE = Sizes((80, 72), (64, 64), 16, 8, (1, 2), 2, {f: 8 if f in FULL_FAMILIES else 2 for f in _TEXT_BATCH}, 1,
              {"sdxl": 2, "flux": 2}, 2, 4, (4, (64, 64)), 4, (9, 32, 48), 4, 1, 300,
              {"sdxl": "tiny UNet", "flux": "tiny Flux transformer"})  # fmt: skip


class SectionTimeout(Exception):
    pass


class SectionSkipped(Exception):
    """A section that cannot run here: its row says why (``skipped: ...``)."""


def _alarm(signum, frame):
    raise SectionTimeout


class Check:
    """One run of the check: its settings, work folder, deadline and the rows so far."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args, self.smoke = args, args.smoke
        self.sizes = SMOKE if args.smoke else REAL
        self.gpu = torch.cuda.is_available() and not args.smoke
        self.device = "cuda" if self.gpu else "cpu"
        self.families = [f for f in args.families.split(",") if f]
        self.backends = [b for b in args.backends.split(",") if b]
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-"))
        self.deadline = time.monotonic() + args.budget
        self.out_dir = Path(args.out_dir or os.environ.get("OUT") or ROOT / "benchmarks" / "results")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.sections = {x for x in args.sections.split(",") if x}
        self.rows: list[Row] = []
        self.done: dict[str, Any] = {}  # what later sections need: folders, manifests, caches, plans
        self.skipped: dict[str, str] = {}  # what a section left out on purpose (a key of done), and why

    def section(self, name: str, fn: Callable[[], list[Row]], seconds: int | None = None) -> None:
        """Run ``fn`` time-boxed (``seconds``, at most the time left); its rows, or one failed row with its error.
        A section ``--sections`` leaves out is not run (and has no row)."""
        if self.sections and name not in self.sections:
            return
        left = self.deadline - time.monotonic()
        if left <= 5:
            self._add([Row(name, "-", f"skipped: the {self.args.budget:g} s budget is spent", status="skipped")])
            return
        box = min(seconds or self.sizes.section_seconds, left)
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, box)
        started = time.perf_counter()
        try:
            rows = fn()
        except SectionTimeout:
            rows = [Row(name, "-", f"failed: over its time box of {box:.0f} s", status="failed")]
        except SectionSkipped as e:
            rows = [Row(name, "-", f"skipped: {e}", status="skipped")]
        except Exception as e:  # one section's failure is its row (its traceback in the JSON); the others go on
            import traceback

            line = (str(e).strip().splitlines() or [""])[-1][:300]
            rows = [Row(name, "-", f"failed: {type(e).__name__}: {line}", status="failed",
                        values={"traceback": traceback.format_exc().splitlines()[-30:]})]  # fmt: skip
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            _free_gpu()
        for row in rows:
            row.values.setdefault("section_seconds", round(time.perf_counter() - started, 1))
        self._add(rows)

    def _add(self, rows: list[Row]) -> None:
        self.rows.extend(rows)
        print("\n".join(_md_row(r) for r in rows), flush=True)

    def _needs(self, *keys: str) -> None:
        missing = [k for k in keys if k not in self.done]
        for key in missing:
            if key in self.skipped:
                raise SectionSkipped(f"no {key} ({self.skipped[key]})")
        if missing:
            raise RuntimeError(f"no {', '.join(missing)}: an earlier section failed")

    # ------------------------------------------------------------------ sections

    def prepare(self, family: str) -> list[Row]:
        from benchmarks.gpu_models import REAL as REAL_MODELS, TINY, build_folder, make_jpegs, write_jpeg_manifest

        s, t0 = self.sizes, time.perf_counter()
        data = self.work / "images"
        if not (self.work / "manifest").exists():
            names = make_jpegs(data, s.images, s.image)
            write_jpeg_manifest(str(data), str(self.work / "manifest"), names, s.image, s.bucket, s.captions)
            n, bucket = s.records
            write_jpeg_manifest(str(data), str(self.work / "manifest-records"), names[:n], s.image, bucket, n)
        t1 = time.perf_counter()
        folder = build_folder(family, self.work / f"model-{family}", (TINY if self.smoke else REAL_MODELS)[family],
                              device=self.device)  # fmt: skip
        self.done[f"model-{family}"] = str(folder)
        return [Row("setup", f"{family}: random-weight pipeline folder (bf16) + {s.images} JPEGs {s.image[0]}x"
                    f"{s.image[1]}", f"{_size(folder)} in {time.perf_counter() - t1:.0f} s; JPEGs {t1 - t0:.0f} s",
                    values={"seconds": time.perf_counter() - t1})]  # fmt: skip

    def prepare_vision(self) -> list[Row]:
        from benchmarks.gpu_models import VISION, build_vision

        t0, sizes = time.perf_counter(), []
        for kind, (real, tiny) in VISION.items():
            folder = build_vision(kind, self.work / kind, tiny if self.smoke else real, device=self.device)
            self.done[kind] = str(folder)
            sizes.append(f"{kind} {_size(folder)}")
        return [Row("setup", "vision: DINOv2-base, CLIP ViT-L/14 vision, Wan 2.1 VAE (random weights, bf16)",
                    f"{', '.join(sizes)} in {time.perf_counter() - t0:.0f} s")]  # fmt: skip

    def prepare_encoders(self, family: str, need: int | None) -> list[Row]:
        """An encoder family's folder (:func:`benchmarks.gpu_models.build_encoders_folder`): its text encoder and VAE
        at real size (``--smoke``: the tiny pipeline's), no denoiser. ``need``: its bytes (None: not checked);
        skipped, with the reason in the row and in ``skipped`` for its later sections, when the disk, the GPU or
        the budget left cannot hold it."""
        from benchmarks.gpu_models import build_encoders_folder

        size = "tiny" if self.smoke else "published sizes"
        what = f"{family}: text encoder + VAE ({size}, random weights, bf16; no denoiser: these rows need none)"
        key = f"model-{family}"
        if need is not None:
            import torch

            gpu_free = torch.cuda.mem_get_info()[0] if self.gpu else None
            why = wont_fit(family, need, shutil.disk_usage(self.work).free, gpu_free, self.deadline - time.monotonic())
            if why:
                self.skipped[key] = why
                return [Row("setup", what, f"skipped: {why}", status="skipped", values={"bytes": need})]
        t0 = time.perf_counter()
        folder = build_encoders_folder(family, self.work / key, real=not self.smoke, device=self.device)
        self.done[key] = str(folder)
        seconds = time.perf_counter() - t0
        return [Row("setup", what, f"{_size(folder)} in {seconds:.0f} s", values={"seconds": seconds, "bytes": need})]

    def vae(self, family: str) -> list[Row]:
        self._needs(f"model-{family}")
        s = self.sizes
        return vae_sweep(family, self.done[f"model-{family}"], s.bucket, s.vae_batches, self.gpu, s.vae_images)

    def vae_tuned(self, family: str) -> list[Row]:
        """The encoder as embed tunes it on cuda against diffusers' as shipped, at the sweep's largest batch (and,
        with ``--compile``, compiled)."""
        self._needs(f"model-{family}")
        s = self.sizes
        return vae_tuned_rows(family, self.done[f"model-{family}"], s.bucket, max(s.vae_batches), self.gpu,
                              s.vae_images, compile=self.args.compile)  # fmt: skip

    def text(self, family: str) -> list[Row]:
        self._needs(f"model-{family}")
        s = self.sizes
        from pipeline.embed.families import get_family

        reference = s.bucket if get_family(family).reference else None  # Qwen-Image-Edit: at the bucket's size
        return text_vs_pipeline(family, self.done[f"model-{family}"], s.text_batch[family], self.gpu, s.text_iters,
                                reference)  # fmt: skip

    def _embed_job(self, family: str, manifest: str, out: str, device: str):
        from pipeline import EmbedJob

        s = self.sizes
        return EmbedJob(manifest=manifest, out=out, family=family, model=self.done[f"model-{family}"], device=device,
                        executor="local", batch_size=max(s.vae_batches), text_batch_size=s.text_batch[family],
                        torch_threads=2 if self.smoke else None)  # fmt: skip

    def embed(self, family: str) -> list[Row]:
        from pipeline import run

        self._needs(f"model-{family}")
        s = self.sizes
        cache = str(self.work / f"cache-{family}")
        sampler = BusySampler.start() if self.gpu else None
        try:
            result = run(self._embed_job(family, str(self.work / "manifest"), cache, self.device))
            ended = time.time()
        finally:
            samples = sampler.stop() if sampler else None
        if result.embedded != s.images or result.errors:
            raise RuntimeError(f"embedded {result.embedded} of {s.images} images, {result.errors} errors")
        self.done[f"cache-{family}"] = cache
        rate, texts = result.images_per_second or 0.0, result.texts_per_second or 0.0
        window = result.embedded / rate if rate else 0.0
        busy = BusySampler.mean(samples, ended - window, ended) if samples else None
        size, batch = f"{s.bucket[0]}x{s.bucket[1]}", max(s.vae_batches)
        alone = next((r.values["alone"] for r in self.rows if r.section == "vae" and r.measure.startswith(family)
                      and r.values.get("batch") == batch), None)  # the VAE alone at embed's batch size  # fmt: skip
        ratio = f" ({rate / alone:.2f}x the VAE alone at batch {batch})" if alone else ""
        return [Row("embed", f"{family} {size} bf16: bucketeer embed --executor local end to end ({s.images} JPEGs "
                    f"{s.image[0]}x{s.image[1]}: read, decode and crop on threads, VAE, gzip, shards)",
                    f"{rate:.1f} images/s{ratio}; GPU busy {'n/a' if busy is None else f'{busy:.0%}'}",
                    ">= 0.9x the VAE alone, busy >= 90%" if self.gpu else "",
                    values={"images_per_second": rate, "vae_alone": alone, "busy": busy,
                            "seconds": result.seconds}),
                Row("embed", f"{family}: captions/s of that run's text phase ({result.new_captions} captions, model "
                    "load included)", f"{texts:.1f} captions/s", values={"captions_per_second": texts})]  # fmt: skip

    def records(self, family: str) -> list[Row]:
        """The same images embedded on the GPU (bf16 compute) and on the CPU (fp32): every record's identity and
        geometry equal, its latent and text within bf16 rounding (relative L2 error)."""
        import numpy as np

        from manifests.cache import CacheReader
        from manifests.cache.records import to_float32
        from pipeline import run

        self._needs(f"model-{family}")
        manifest = str(self.work / "manifest-records")
        caches = {d: str(self.work / f"records-{family}-{d}") for d in (self.device, "cpu")}
        if self.gpu:
            run(self._embed_job(family, manifest, caches["cuda"], "cuda"))
        run(self._embed_job(family, manifest, caches["cpu"], "cpu"))
        readers = {d: CacheReader(url, {}) for d, url in caches.items()}
        ids = readers["cpu"].sample_ids.tolist()
        got = {d: {r.sample_id: r for r in reader.read(ids)} for d, reader in readers.items()}
        latent_err = text_err = 0.0
        for sid in ids:
            a, b = got[self.device][sid], got["cpu"][sid]
            same = (a.original_size, a.crop_top_left, a.target_size) == (b.original_size, b.crop_top_left,
                                                                           b.target_size)  # fmt: skip
            if not same:
                raise RuntimeError(f"sample {sid}: GPU and CPU records differ in geometry")
            latent_err = max(latent_err, _rel(to_float32(a.latent, a.dtype), to_float32(b.latent, b.dtype)))
            for x, y in zip(_text_tensors(a.text), _text_tensors(b.text), strict=True):
                text_err = max(text_err, _rel(x, y))
        ok = latent_err < 5e-2 and text_err < 5e-2 and np.isfinite([latent_err, text_err]).all()
        what = "GPU (bf16 compute)" if self.gpu else "CPU (--smoke: the same CPU path twice)"
        return [Row("records", f"{family}: {len(ids)} records embedded on the {what} vs on the CPU (fp32), "
                    f"{self.sizes.records[1][0]}px: largest relative L2 error (latent, text); geometry equal",
                    f"{latent_err:.1e}, {text_err:.1e}", "< 5e-2 (bf16 rounding)", status="ok" if ok else "failed",
                    values={"latent_rel_error": latent_err, "text_rel_error": text_err})]  # fmt: skip

    def loader(self, family: str) -> list[Row]:
        from pipeline import PlanJob, run

        self._needs(f"cache-{family}")
        plan = str(self.work / f"plan-{family}")
        run(PlanJob(manifests=(str(self.work / "manifest"),), out=plan, world_size=1,
                    batch_size=self.sizes.train_batch[family], seed=0, epochs=1,
                    cache=(self.done[f"cache-{family}"],)))  # fmt: skip
        self.done[f"plan-{family}"] = plan
        rate = loader_rate(plan, self.done[f"cache-{family}"], self.device, batches=4 if self.smoke else 64)
        return [Row("loader", f"{family}: BatchLoader along the plan, batch {self.sizes.train_batch[family]}, "
                    f"to {self.device} (trainer defaults: prefetch 4, 2 read threads)", f"{rate:.1f} samples/s",
                    values={"samples_per_second": rate})]  # fmt: skip

    def train(self, family: str, backend: str, cudnn_attention: str = "auto") -> list[Row]:
        """The trainer's row; ``cudnn_attention``: the config's (``train.backends.choose_attention``; ``on`` for the
        ``train-cudnn`` section, which runs Flux with torch's own choice to confirm or rule out the lead)."""
        what = f"{family} {self.sizes.denoisers[family]}, {backend}, batch {self.sizes.train_batch[family]}, AdamW"
        what += "" if cudnn_attention == "auto" else f", cudnn_attention: {cudnn_attention}"
        if f"plan-{family}" not in self.done:
            return [Row("train", what, "failed: no plan (the embed or loader section failed)", status="failed")]
        if not self.gpu and backend != "ddp":
            return [Row("train", what, "skipped: accelerate runs FSDP and DeepSpeed only on GPUs", status="skipped")]
        if backend.startswith("zero") and self.gpu:
            why = self._deepspeed()
            if why:
                return [Row("train", what, f"skipped: {why}", status="skipped")]
        out = self.work / f"train-{family}-{backend}-{cudnn_attention}"
        shutil.rmtree(out, ignore_errors=True)
        config = self.work / f"train-{family}-{cudnn_attention}.yaml"
        config.write_text(json.dumps({"family": family, "mixed_precision": "bf16" if self.gpu else "no", "lr": 1e-5,
                                      "lr_schedule": "constant", "checkpoint_every": 10**9,
                                      "log_every": self.sizes.log_every, "validation_every": 0,
                                      "cudnn_attention": cudnn_attention}))  # fmt: skip
        worker = [str(Path(__file__).resolve()), "--train-worker", "--plan", self.done[f"plan-{family}"],
                  "--cache", self.done[f"cache-{family}"], "--config", str(config), "--output-dir", str(out),
                  "--max-steps", str(self.sizes.train_steps)]  # fmt: skip
        if self.gpu:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", *BACKENDS[backend], "--num_processes", "1",
                   "--num_machines", "1", "--main_process_port", str(_free_port()), *worker]  # fmt: skip
        else:  # one process, no launcher: accelerate's CPU path (what python -m train does)
            cmd = [sys.executable, *worker]
        code, stdout, stderr = self._launch(cmd, {})
        if code is None:
            return [Row("train", what, f"failed: over its time box ({stderr})", status="failed")]
        found = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
        if code != 0 or not found:
            row = self._train_failed(what, f"{family}-{backend}", code, stdout, stderr)
            if "CUDA error" in row.result and self.deadline - time.monotonic() > 120:
                # kernels run asynchronously: the failing call named is often not the failing kernel; once more,
                # synchronously, to name it (its output is appended to the log too)
                code, stdout, stderr = self._launch(cmd, {"CUDA_LAUNCH_BLOCKING": "1"})
                again = self._train_failed(what, f"{family}-{backend} CUDA_LAUNCH_BLOCKING=1", code or 0, stdout,
                                           stderr) if code != 0 else None  # fmt: skip
                row.values["launch_blocking"] = "passed" if again is None else again.values.get("traceback")
            return [row]
        r = json.loads(found[-1][len(RESULT_MARK):])
        counted = throughput(r.get("flops_per_step"), r["step_time_s"], self.gpu)  # forward + backward, one step
        result = (f"step {r['step_time_s'] * 1000:.0f} ms, data-wait {r['data_wait']:.1%}, {r['samples_per_s']:.2f} "
                  f"samples/s, peak {r['peak_gb']:.1f} GB; {throughput_text(counted)}; {r['distributed_type']}, "
                  f"{r['stop']}")  # fmt: skip
        return [Row("train", what, result, values={**r, **counted})]

    def _launch(self, cmd: list[str], env: dict[str, str]) -> tuple[int | None, str, str]:
        """Run a trainer command, time-boxed by the budget (240 s at most): ``(exit code, stdout, stderr)``;
        the code is None when it ran over (stderr then says the box)."""
        box = min(max(10.0, self.deadline - time.monotonic() - 10), 240)
        # its own process group: on a timeout the launcher, torchrun and the rank go together (and the GPU is free)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, **env})  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=box)
        except BaseException as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                return None, "", f"{box:.0f} s"
            raise
        return proc.returncode, stdout, stderr

    def _train_failed(self, what: str, run: str, code: int, stdout: str, stderr: str) -> Row:
        """The row of a failed trainer run: the rank's own error when it printed one (the launcher's last line
        says only that a child failed), else its last line; its whole output appended to gpu-check-train.log."""
        errors = [json.loads(line[len(ERROR_MARK):]) for line in stdout.splitlines() if line.startswith(ERROR_MARK)]
        lines = [line for line in stderr.strip().splitlines() if line.strip()] or ["(no output)"]
        aborted = [line for line in lines if "Fatal Python error" in line or "exitcode" in line]
        why = errors[0]["error"] if errors else (aborted[0].strip() if aborted else lines[-1])
        log = self.out_dir / "gpu-check-train.log"
        with open(log, "a") as f:
            f.write(f"===== {run}: exit {code}\n--- stdout\n{stdout[-20000:]}\n--- stderr\n{stderr[-60000:]}\n")
        return Row("train", what, f"failed: exit {code}: {why[:300]} (output: {log.name})", status="failed",
                   values={"traceback": errors[0]["traceback"] if errors else lines[-60:]})

    def _deepspeed(self) -> str | None:
        """Why the ZeRO rows cannot run (None: deepspeed imports, built from the wheel folder's archive if needed)."""
        if "deepspeed" not in self.done:
            why = None
            if not _imports("deepspeed"):
                from benchmarks.gpu_env import build_sdist

                why = "no --wheels folder to build deepspeed from" if not self.args.wheels else \
                    build_sdist(Path(self.args.wheels), "deepspeed", _site(), timeout=120)  # fmt: skip
            self.done["deepspeed"] = why
        return self.done["deepspeed"]

    def repa(self) -> list[Row]:
        self._needs("dinov2")
        return repa_rows(self.done["dinov2"], self.sizes.bucket, self.sizes.repa_batch, self.gpu, self.sizes.iters)

    def wan(self) -> list[Row]:
        self._needs("wan-vae")
        return wan_rows(self.done["wan-vae"], self.sizes.wan_clip, self.gpu, 1)

    def clip(self) -> list[Row]:
        self._needs("clip-vision")
        return clip_rows(self.done["clip-vision"], self.work / "images", self.gpu, self.sizes.clip_batch,
                         self.sizes.iters)  # fmt: skip

    def decode(self) -> list[Row]:
        return decode_rows(self.work / "images", self.sizes.bucket, self.gpu, count=8 if self.smoke else 64)

    def embed_ray(self, family: str) -> list[Row]:
        """The Ray embed job on the same manifest, when Ray is there (the other rows need none)."""
        what = f"{family}: bucketeer embed on Ray (Ray Data, VAE actor) end to end"
        if not _imports("ray"):
            return [Row("embed-ray", what, "skipped: needs ray (not installed here; the rows above need none)",
                        status="skipped")]  # fmt: skip
        from pipeline import EmbedJob, run

        self._needs(f"model-{family}")
        ray, started = _start_ray(self.smoke)
        try:
            result = run(EmbedJob(manifest=str(self.work / "manifest"), out=str(self.work / f"cache-ray-{family}"),
                                  family=family, model=self.done[f"model-{family}"], device=self.device,
                                  batch_size=max(self.sizes.vae_batches), vae_workers=1,
                                  torch_threads=1 if self.smoke else None))  # fmt: skip
        finally:
            if started:
                ray.shutdown()
        return [Row("embed-ray", what, f"{result.images_per_second or 0:.1f} images/s",
                    values={"images_per_second": result.images_per_second})]  # fmt: skip

    def annotate_vllm(self) -> list[Row]:
        return annotate_rows(self.work, self.gpu, images=8 if self.smoke else 256)

    def sdpa(self) -> list[Row]:
        """:mod:`benchmarks.gpu_sdpa` in a child process: a backend that faults takes its CUDA context with it."""
        code, stdout, stderr = self._launch([sys.executable, "-m", "benchmarks.gpu_sdpa"], {})
        rows = [Row(**json.loads(line)) for line in stdout.splitlines() if line.startswith("{")]
        if code != 0:
            last = (stderr.strip().splitlines() or ["(no error output)"])[-1][:300]
            rows.append(Row("sdpa", "the micro-repro's process", f"failed: exit {code}: {last}", status="failed"))
        return rows

    def caption(self) -> list[Row]:
        from benchmarks.gpu_caption import REAL_SWEEP, SMOKE_SWEEP, caption_rows

        seconds = min(CAPTION_SECONDS, self.deadline - time.monotonic()) - 10  # its rows before the section's box
        return caption_rows(self.work / "caption", self.device, SMOKE_SWEEP if self.smoke else REAL_SWEEP, seconds)


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the launcher's rendezvous (one trainer run at a time)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _text_tensors(text) -> list:
    """A text record's tensors as float32: every part's tokens, then the pooled vector (if any)."""
    from manifests.cache.records import to_float32

    return [to_float32(t, text.dtype) for t in (*text.tokens, *(() if text.pooled is None else (text.pooled,)))]


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _size(folder: Path) -> str:
    gb = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) / 1e9
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1000:.1f} MB"


def _imports(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _md_row(r: Row) -> str:
    return f"| {r.section} | {r.measure} | {r.result} | {r.target} |"


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| section | measure | result | target |", "|---|---|---|---|", *map(_md_row, rows)]
    return "\n".join(lines) + "\n"


def run_check(args: argparse.Namespace) -> int:
    """Every section in order; the table printed and written. Returns 1 when any row failed, else 0."""
    import torch

    from pipeline.embed.loading import quiet_loading

    quiet_loading()  # the libraries' load bars and truncation notices would bury the table
    if args.rehearsal:
        present = [m for m in ("ray", "vllm") if _imports(m)]
        if present:
            raise SystemExit(f"gpu-check --rehearsal: {', '.join(present)} is installed here; the rehearsal is of a "
                             "machine without them (make gpu-rehearsal builds such a venv)")  # fmt: skip
    check = Check(args)
    started = time.perf_counter()
    machine = torch.cuda.get_device_name(0) if check.gpu else f"CPU (--smoke), {os.cpu_count()} cores"
    print(f"gpu-check on {machine}, torch {torch.__version__}; budget {args.budget:g} s; work folder {check.work}",
          flush=True)  # fmt: skip
    print(f"versions: {_versions()}", flush=True)
    try:
        full = [f for f in check.families if f in FULL_FAMILIES]
        first = full[0] if full else None
        check.section("sdpa", check.sdpa, 60)  # the lead on the Flux trainer's CUDA error, before any trainer runs
        if first:
            _family_sections(check, first, first)
        check.section("setup-vision", check.prepare_vision, 90)
        check.section("repa", check.repa, 45)
        check.section("wan", check.wan, 120)
        check.section("annotate", check.clip, 60)
        check.section("decode", check.decode, 45)
        for family in full[1:]:
            _family_sections(check, family, first)
        for family in [f for f in check.families if f not in FULL_FAMILIES]:
            _encoder_sections(check, family)
        if first:
            for backend in [b for b in check.backends if b.startswith("zero")]:
                check.section("train", lambda b=backend: check.train(first, b), 240)
            check.section("embed-ray", lambda: check.embed_ray(first), 120)
        check.section("annotate", check.annotate_vllm, 120)
        if "train-cudnn" in check.sections and "flux" in full:  # opt-in: Flux trained with cuDNN's attention allowed
            check.section("train-cudnn", lambda: check.train("flux", "ddp", cudnn_attention="on"), 240)
        if "caption" in check.sections:  # opt-in: a 17 GB folder and minutes, beyond the default run's 8
            check.section("caption", check.caption, CAPTION_SECONDS)
        if "video" in check.sections:  # opt-in: three 0.7-1.3B VAEs on 121-frame clips, beyond the default run
            from benchmarks.gpu_video import video_parts

            for seconds, part in video_parts(check.work / "video", check.gpu, check.smoke):
                check.section("video", part, seconds)
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(check.work, ignore_errors=True)
    seconds = time.perf_counter() - started
    header = f"gpu-check on {machine}, torch {torch.__version__}, {seconds:.0f} s{' (--smoke)' if args.smoke else ''}"
    table = markdown(check.rows, header)
    out = check.out_dir
    (out / "gpu-check.md").write_text(table)
    (out / "gpu-check.json").write_text(json.dumps({"machine": machine, "torch": torch.__version__,
                                                    "versions": _versions(), "smoke": args.smoke,
                                                    "budget": args.budget, "seconds": round(seconds, 1),
                                                    "rows": [asdict(r) for r in check.rows]}, indent=1))  # fmt: skip
    print("\n" + table + f"written to {out}/gpu-check.md and gpu-check.json", flush=True)
    failed = [r for r in check.rows if r.status == "failed"]
    if args.rehearsal:
        skipped = [f"{r.section}: {r.result}" for r in check.rows if r.status == "skipped"]
        filled = len(check.rows) - len(skipped) - len(failed)
        print(f"gpu-check --rehearsal: {filled} rows filled, {len(failed)} failed, {len(skipped)} skipped in "
              f"{seconds:.0f} s:\n  " + "\n  ".join(skipped), flush=True)  # fmt: skip
    return 1 if failed else 0


def _family_sections(check: Check, family: str, first: str) -> None:
    """One of FULL_FAMILIES's sections, in order: what the later ones need first (``records``: ``first``'s)."""
    check.section("setup", lambda: check.prepare(family), 180)
    check.section("vae", lambda: check.vae(family), 90)
    check.section("vae", lambda: check.vae_tuned(family), 300 if check.args.compile else 60)
    check.section("text", lambda: check.text(family), 120)
    check.section("embed", lambda: check.embed(family), 150)
    if family == first:
        check.section("records", lambda: check.records(family), 120)
    check.section("loader", lambda: check.loader(family), 60)
    for backend in [b for b in check.backends if not b.startswith("zero")]:
        check.section("train", lambda b=backend: check.train(family, b), 240)


def _encoder_sections(check: Check, family: str) -> None:
    """An encoder family's sections (one of ENCODER_FAMILIES): ``setup`` (its folder, when it fits), ``vae`` and
    ``text``, each time-boxed by the folder's size (a 48 GB Flux 2 folder is written once and read twice); then
    the folder is removed, leaving the disk to the next family."""
    need = None
    if not check.smoke and (not check.sections or "setup" in check.sections):
        from benchmarks.gpu_models import encoders_bytes

        need = encoders_bytes(family)
    gb = (need or 0) / 1e9
    check.section("setup", lambda: check.prepare_encoders(family, need), int(120 + SECONDS_PER_GB * gb))
    check.section("vae", lambda: check.vae(family), 90)
    check.section("vae", lambda: check.vae_tuned(family), 300 if check.args.compile else 60)
    check.section("text", lambda: check.text(family), int(120 + 1.5 * SECONDS_PER_GB * gb))
    shutil.rmtree(check.work / f"model-{family}", ignore_errors=True)
    check.done.pop(f"model-{family}", None)


def wont_fit(family: str, need: int, disk_free: int, gpu_free: int | None, seconds_left: float) -> str | None:
    """Why ``family``'s folder of ``need`` bytes (an encoder family's) cannot be measured here (None: it can): the
    disk (the folder, 1 GB to spare), the GPU (its text encoder whole, as the pipeline loads it; None: not checked)
    or the budget left (the folder written once and read twice at ~1 GB/s, an estimate, and a minute of work)."""
    gb = need / 1e9
    if need + (1 << 30) > disk_free:
        return f"its folder needs {gb:.1f} GB of disk and {disk_free / 1e9:.1f} GB are free"
    if gpu_free is not None and need > gpu_free:
        return f"its text encoder needs {gb:.1f} GB of GPU memory and {gpu_free / 1e9:.1f} GB are free"
    seconds = SECONDS_PER_GB * gb + 60
    if seconds > seconds_left:
        return (f"its {gb:.1f} GB folder needs ~{seconds:.0f} s (written once, read twice at ~1 GB/s), and "
                f"{seconds_left:.0f} s of the budget are left: run it alone (--families {family} --sections "
                "setup,vae,text) or raise --budget")
    return None


def _versions() -> dict[str, str]:
    """The versions of what the check ran with (the GPU machine's own packages and the wheel folder's)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "diffusers", "transformers", "accelerate", "numpy", "pyarrow", "deepspeed", "ray", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


def _start_ray(smoke: bool):
    """The Ray the embed-ray section uses: a local one with every CPU and GPU; 2 CPUs for --smoke (and tests).
    Returns ``(ray, started here)``; one already running (a test session's) is reused."""
    from pipeline.ray_setup import init_ray, loopback_only

    if not smoke:
        return init_ray(local=True)
    loopback_only()
    import ray

    if ray.is_initialized():
        return ray, False
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray, True


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _site() -> Path:
    return SITE / f"py{sys.version_info.major}{sys.version_info.minor}"


def use_wheels(folder: str) -> None:
    """Install the wheel folder's packages that this Python lacks into ``.gpu-site/`` and put it first on the
    path, for this process and its children (``PYTHONPATH``). Prints what it did in one line."""
    from benchmarks.gpu_env import install

    site = _site()
    t0 = time.perf_counter()
    left_out = install(Path(folder), site)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    note = f"; not for this Python: {', '.join(left_out)}" if left_out else ""
    print(f"gpu-check: wheels of {folder} in {site} ({time.perf_counter() - t0:.1f} s){note}", flush=True)


def train_worker(args: argparse.Namespace) -> None:
    """One rank of a trainer run (under ``accelerate launch``): the trainer's setup and loop, then one
    result line from its ``metrics.jsonl`` (the first window, warm-up, left out), and exit without the
    final checkpoint and model."""
    import faulthandler

    import torch

    from train.config import load_config
    from train.job import TrainJob
    from train.loop import Trainer

    faulthandler.enable()  # a native abort (CUDA, NCCL) still prints the Python stack
    try:
        _train_rank(args, torch, TrainJob, Trainer, load_config)
    except BaseException as e:
        import traceback

        print(ERROR_MARK + json.dumps({"error": f"{type(e).__name__}: {e}"[:500],
                                       "traceback": traceback.format_exc().splitlines()[-30:]}), flush=True)
        raise


def _count_first_step(trainer) -> dict[str, Any]:
    """Make ``trainer``'s first ``train_step`` (a warm-up step, left out of the timings) count its FLOPs (forward,
    backward; the optimizer's element-wise work is not counted); the dict gets ``flops`` or ``error``."""
    from benchmarks.gpu_flops import count_flops

    counted: dict[str, Any] = {}
    step = trainer.train_step

    def counting_step(batch):
        if counted:
            return step(batch)
        try:
            counted["flops"], loss = count_flops(lambda: step(batch))
        except Exception as e:  # the counter failed mid-step: the step again without it, from zeroed gradients
            counted["error"] = f"{type(e).__name__}: {e}"[:200]
            trainer.parts.optimizer.zero_grad(set_to_none=True)
            loss = step(batch)
        return loss

    trainer.train_step = counting_step  # the loop calls self.train_step
    return counted


def _train_rank(args: argparse.Namespace, torch, TrainJob, Trainer, load_config) -> None:
    job = TrainJob(plan=args.plan, caches=(args.cache,), config=load_config(args.config), output_dir=args.output_dir,
                   max_steps=args.max_steps)  # fmt: skip
    trainer = Trainer.setup(job)
    counted = _count_first_step(trainer)
    stop = trainer.loop()
    windows = [json.loads(line) for line in Path(trainer.output.local("metrics.jsonl")).read_text().splitlines()]
    measured = windows[1:] or windows
    mean = lambda key: sum(w[key] for w in measured) / len(measured)  # noqa: E731
    cuda = torch.cuda.is_available()
    result = {"step_time_s": mean("step_time_s"), "data_wait": mean("data_wait"),
              "samples_per_s": mean("samples_per_s"), "steps": trainer.cursor.position, "stop": stop.value,
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
              "distributed_type": str(trainer.accelerator.distributed_type), "flops_per_step": counted.get("flops"),
              "flops_error": counted.get("error")}  # fmt: skip
    if trainer.accelerator.is_main_process:
        print(RESULT_MARK + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown: see train/__main__.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="run every section on the CPU with tiny models (seconds)")
    p.add_argument("--families", default=DEFAULT_FAMILIES,
                   help=f"comma-separated, or all: {','.join(FAMILIES)} (default {DEFAULT_FAMILIES}: every section; "
                        "the others: their text encoder and VAE rows)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: ddp,fsdp2,zero2,zero3")
    p.add_argument("--out-dir", default=None, help="where gpu-check.md/.json go (default $OUT or benchmarks/results)")
    p.add_argument("--work-dir", default=None, help="models, data, caches (default: a temp folder, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temp work folder")
    p.add_argument("--budget", type=float, default=440.0,
                   help="seconds for the sections (under 8 minutes with set-up, teardown and output); late ones skip")
    p.add_argument("--sections", default="", metavar="A,B",
                   help="run only these sections (e.g. setup,embed,loader,train: what a trainer row needs); "
                        "default: all but caption (Qwen2.5-VL-7B through the caption engine) and video (the video "
                        "VAEs and TransNetV2), run only when named")
    p.add_argument("--compile", action="store_true",
                   help="also time each VAE's encoder compiled (embed --compile-vae): a row of its own per family, "
                        "its compile (a minute or more each) timed apart")
    p.add_argument("--rehearsal", action="store_true",
                   help="with --smoke: refuse to run where Ray or vLLM is installed; a summary of what was filled")
    p.add_argument("--wheels", default=None, metavar="DIR",
                   help="a wheel folder (make gpu-wheels) to install what this python3 lacks from, offline")
    w = p.add_argument_group("internal: one trainer rank")
    w.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--plan", "--cache", "--config", "--output-dir"):
        w.add_argument(name, default=None, help=argparse.SUPPRESS)
    w.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.families == "all":
        args.families = ",".join(FAMILIES)
    unknown = sorted({*args.families.split(",")} - {*FAMILIES, ""}) + sorted({*args.backends.split(",")} -
                                                                              {*BACKENDS, ""})  # fmt: skip
    if unknown:
        p.error(f"unknown families or backends {unknown}: families {FAMILIES}, backends {tuple(BACKENDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wheels and not args.train_worker:  # a trainer rank finds them on PYTHONPATH
        use_wheels(args.wheels)
    if args.train_worker:
        train_worker(args)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(NO_CUDA.format(torch=torch.__version__), flush=True)
        return 0
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
