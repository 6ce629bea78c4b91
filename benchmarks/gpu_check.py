"""Every GPU measure the project names, on random weights of the real architectures at real sizes: one table.

    make gpu-check                                   # = python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py [--out-dir DIR] [--families sdxl,flux] [--backends ddp,fsdp2,zero2,zero3]
    python benchmarks/gpu_check.py --smoke           # every section's code on the CPU, tiny models, in seconds

Without CUDA (and without ``--smoke``) it prints one line and exits 0. With CUDA it builds the models
of :mod:`benchmarks.gpu_models` (nothing downloaded) and a local JPEG dataset, then measures, each
section time-boxed (a failing or late section prints its error in its row and the others go on; the
exit code is 1 when any row failed):

1. **embed** (per family, SDXL and Flux VAE at 1024² bf16): images/s end to end through the real job
   (``pipeline.run(EmbedJob(family=F, model=FOLDER, device="cuda"))``: Ray Data fetch, JPEG decode,
   resize and crop on CPU tasks, the VAE actor, gzip, shard writes; its steady-state rate), against
   the VAE alone (``LatentEncoder.encode`` on pre-decoded uint8 batches, ``torch.cuda.synchronize``
   before the clock stops); the GPU **busy fraction** over the image phase; captions/s of the text phase.
   Busy = NVML's ``utilization.gpu`` (the share of each sample period in which at least one kernel ran)
   sampled every 100 ms from this process (pynvml when it imports, else ``nvidia-smi -lms``), averaged
   over the job's steady image phase (its last ``embedded / images_per_second`` seconds). NVML and not
   CUDA events because the encoder runs in a Ray actor, another process: NVML sees the device whoever
   drives it. It says busy, not how full the SMs are.
2. **text encoders** alone: captions/s of ``TextEncoders.encode`` (tokenize, forward, copy to host) for
   CLIP-L + CLIP-bigG (sdxl) and CLIP-L + T5-XXL at 512 tokens (flux).
3. **decode**: JPEG decode on one CPU thread (Pillow, as embed's prepare tasks do; also the full
   ``prepare_views``: decode + resize + crop) vs ``torchvision.io.decode_jpeg`` on the GPU, batched.
4. **loader**: ``BatchLoader`` samples/s over the embedded cache along the plan, batches moved to the device.
5. **trainer** (per family x backend): step time and data-wait from the trainer's own ``metrics.jsonl``
   (the first log window, warm-up, left out), samples/s, peak GPU memory. Each run is the project's trainer
   (``Trainer.setup`` + ``Trainer.loop``, as ``python -m train`` runs them) under ``accelerate launch
   --num_processes 1`` with ``infra/accelerate``'s DDP, FSDP2 and DeepSpeed (``--zero_stage 2`` / ``3``)
   configs, full fine-tuning with AdamW in bf16 autocast. Not ``python -m train`` itself: its finish
   writes a checkpoint and the final model (30 GB for SDXL with AdamW state) that this check does not
   need. accelerate does not wrap a model in DDP at world size 1 (``use_distributed`` needs 2
   processes): the ``ddp`` row is the 1-GPU loop the DDP config runs, without all-reduce.
6. **annotate**: VLM captions/s through ``bucketeer annotate --engine vllm`` vs vLLM's ``LLM.chat`` alone on a
   random-weight Llava; a row saying why it is skipped until ``pipeline.annotate`` and ``vllm`` import.

Everything is per GPU: on a machine with several, run it on one (``make gpu-check`` sets
``CUDA_VISIBLE_DEVICES=0`` unless it is set), so that Ray's encoder actors get the GPU whose busy fraction
is sampled. Writes ``gpu-check.md`` and ``gpu-check.json`` to ``--out-dir`` (default ``$OUT``, else
``benchmarks/results/``). Meant to take under 10 minutes on one H100 (``--budget``).
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

from benchmarks.gpu_measures import (BusySampler, Row, annotate_rows, decode_rows, loader_rate,  # noqa: E402
                                     text_alone, vae_alone)

RESULT_MARK = "GPU_CHECK_RESULT "
FAMILIES = ("sdxl", "flux")
BACKENDS: dict[str, list[str]] = {  # accelerate launch flags, 1 process
    "ddp": ["--config_file", "infra/accelerate/ddp-1x8.yaml"],
    "fsdp2": ["--config_file", "infra/accelerate/fsdp2-1x8.yaml"],
    "zero2": ["--config_file", "infra/accelerate/deepspeed-zero1-1x8.yaml", "--zero_stage", "2"],
    "zero3": ["--config_file", "infra/accelerate/deepspeed-zero1-1x8.yaml", "--zero_stage", "3"],
}
NO_CUDA = ("gpu-check: no CUDA device here (torch {torch}): nothing measured. Run `make gpu-check` on a GPU machine, "
           "or `python benchmarks/gpu_check.py --smoke` to run its code on this CPU.")


@dataclass(frozen=True)
class Sizes:
    """How big each section's work is: ``REAL`` on a GPU, ``SMOKE`` on a CPU."""

    image: tuple[int, int]  # JPEG (w, h): a little larger than the bucket, so resize and crop do real work
    bucket: tuple[int, int]
    images: int
    captions: int
    vae_batch: int
    text_batch: int
    train_batch: dict[str, int]
    log_every: int
    train_steps: int  # per trainer run: the first log window is warm-up
    section_seconds: int
    denoisers: dict[str, str]  # what each family trains, for the table


REAL = Sizes((1216, 1088), (1024, 1024), 1024, 256, 16, 128, {"sdxl": 1, "flux": 1}, 4, 16, 150,
             {"sdxl": "UNet (2.57B)", "flux": "Flux-width transformer, 4+8 of 19+38 blocks (2.5B)"})
SMOKE = Sizes((80, 72), (64, 64), 16, 8, 4, 8, {"sdxl": 2, "flux": 2}, 2, 4, 300,
              {"sdxl": "tiny UNet", "flux": "tiny Flux transformer"})


class SectionTimeout(Exception):
    pass


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
        self.rows: list[Row] = []
        self.done: dict[str, Any] = {}  # what later sections need: folders, manifests, caches, plans

    def section(self, name: str, fn: Callable[[], list[Row]], seconds: int | None = None) -> None:
        """Run ``fn`` time-boxed (``seconds``, at most the time left); its rows, or one failed row with its error."""
        left = self.deadline - time.monotonic()
        if left <= 5:
            self.rows.append(Row(name, "-", f"skipped: the {self.args.budget:g} s budget is spent", status="skipped"))
            return
        box = min(seconds or self.sizes.section_seconds, left)
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, box)
        started = time.perf_counter()
        try:
            rows = fn()
        except SectionTimeout:
            rows = [Row(name, "-", f"failed: over its time box of {box:.0f} s", status="failed")]
        except Exception as e:  # one section's failure is its row; the others go on
            line = (str(e).strip().splitlines() or [""])[-1][:300]
            rows = [Row(name, "-", f"failed: {type(e).__name__}: {line}", status="failed")]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        for row in rows:
            row.values.setdefault("section_seconds", round(time.perf_counter() - started, 1))
        self.rows.extend(rows)
        print("\n".join(_md_row(r) for r in rows), flush=True)

    # ------------------------------------------------------------------ sections

    def prepare(self, family: str) -> list[Row]:
        from benchmarks.gpu_models import REAL as REAL_MODELS, TINY, build_folder, make_jpegs, write_jpeg_manifest

        s, t0 = self.sizes, time.perf_counter()
        data = self.work / "images"
        if not (self.work / "manifest").exists():
            names = make_jpegs(data, s.images, s.image)
            write_jpeg_manifest(str(data), str(self.work / "manifest"), names, s.image, s.bucket, s.captions)
        t1 = time.perf_counter()
        folder = build_folder(family, self.work / f"model-{family}", (TINY if self.smoke else REAL_MODELS)[family],
                              device=self.device)  # fmt: skip
        self.done[f"model-{family}"] = str(folder)
        gb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9
        size = f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1000:.1f} MB"
        return [Row("setup", f"{family}: random-weight pipeline folder (bf16) + {s.images} JPEGs {s.image[0]}x"
                    f"{s.image[1]}", f"{size} in {time.perf_counter() - t1:.0f} s; JPEGs {t1 - t0:.0f} s",
                    values={"gb": gb})]  # fmt: skip

    def embed(self, family: str) -> list[Row]:
        from pipeline import EmbedJob, run

        s, folder = self.sizes, self.done[f"model-{family}"]
        cache = str(self.work / f"cache-{family}")
        sampler = BusySampler.start() if self.gpu else None
        try:
            result = run(EmbedJob(manifest=str(self.work / "manifest"), out=cache, family=family, model=folder,
                                  device=self.device, batch_size=s.vae_batch, text_batch_size=s.text_batch,
                                  vae_workers=1, torch_threads=1 if self.smoke else None))  # fmt: skip
            ended = time.time()
        finally:
            samples = sampler.stop() if sampler else None
        if result.embedded != s.images or result.errors:
            raise RuntimeError(f"embedded {result.embedded} of {s.images} images, {result.errors} errors")
        self.done[f"cache-{family}"] = cache
        rate, texts = result.images_per_second or 0.0, result.texts_per_second or 0.0
        window = result.embedded / rate if rate else 0.0
        busy = BusySampler.mean(samples, ended - window, ended) if samples else None
        size = f"{s.bucket[0]}x{s.bucket[1]}"
        rows = [Row("embed", f"{family} VAE {size} bf16: end to end (pipeline.embed, {s.images} JPEGs)",
                    f"{rate:.1f} images/s", ">= 60 images/s per H100" if family == "sdxl" else "",
                    values={"images_per_second": rate, "seconds": result.seconds}),
                Row("embed", f"{family}: GPU busy over the image phase (NVML utilization.gpu, 100 ms samples)",
                    "n/a (no GPU)" if busy is None else f"{busy:.0%}", ">= 90%", values={"busy": busy}),
                Row("text", f"{family}: captions/s of pipeline.embed's text phase ({s.captions} captions; actor "
                    "start and model load included)",
                    f"{texts:.1f} captions/s", values={"captions_per_second": texts})]  # fmt: skip
        return rows

    def alone(self, family: str) -> list[Row]:
        s, folder = self.sizes, self.done[f"model-{family}"]
        vae = vae_alone(folder, s.bucket, s.vae_batch, self.gpu, batches=2 if self.smoke else 12)
        e2e = next((r.values.get("images_per_second") for r in self.rows
                    if r.section == "embed" and r.measure.startswith(f"{family} VAE")), None)  # fmt: skip
        ratio = f" (end to end = {e2e / vae:.2f}x)" if e2e else ""
        encoders = "CLIP-L + CLIP-bigG (77 tokens)" if family == "sdxl" else "CLIP-L + T5-XXL (512 tokens)"
        text = text_alone(family, folder, s.text_batch, self.gpu, batches=1 if self.smoke else 4)
        return [Row("embed", f"{family} VAE alone (LatentEncoder.encode, batch {s.vae_batch}, synchronized)",
                    f"{vae:.1f} images/s{ratio}", values={"images_per_second": vae}),
                Row("text", f"{family}: {encoders} alone (TextEncoders.encode, batch {s.text_batch})",
                    f"{text:.1f} captions/s", values={"captions_per_second": text})]  # fmt: skip

    def decode(self) -> list[Row]:
        return decode_rows(self.work / "images", self.sizes.bucket, self.gpu, count=8 if self.smoke else 64)

    def loader(self, family: str) -> list[Row]:
        from pipeline import PlanJob, run

        plan = str(self.work / f"plan-{family}")
        run(PlanJob(manifests=(str(self.work / "manifest"),), out=plan, world_size=1,
                    batch_size=self.sizes.train_batch[family], seed=0, epochs=1,
                    cache=(self.done[f"cache-{family}"],)))  # fmt: skip
        self.done[f"plan-{family}"] = plan
        rate = loader_rate(plan, self.done[f"cache-{family}"], self.device, batches=4 if self.smoke else 64)
        return [Row("loader", f"{family}: BatchLoader along the plan, batch {self.sizes.train_batch[family]}, "
                    f"to {self.device} (trainer defaults: prefetch 4, 2 read threads)", f"{rate:.1f} samples/s",
                    values={"samples_per_second": rate})]  # fmt: skip

    def train(self, family: str, backend: str) -> list[Row]:
        what = f"{family} {self.sizes.denoisers[family]}, {backend}, batch {self.sizes.train_batch[family]}, AdamW"
        if f"plan-{family}" not in self.done:
            return [Row("train", what, "failed: no plan (the embed or loader section failed)", status="failed")]
        if not self.gpu and backend != "ddp":
            return [Row("train", what, "skipped: accelerate runs FSDP and DeepSpeed only on GPUs", status="skipped")]
        if backend.startswith("zero") and self.gpu and not _imports("deepspeed"):
            return [Row("train", what, "skipped: deepspeed is not installed (pip install deepspeed)", status="skipped")]
        out = self.work / f"train-{family}-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        config = self.work / f"train-{family}.yaml"
        config.write_text(json.dumps({"family": family, "mixed_precision": "bf16" if self.gpu else "no", "lr": 1e-5,
                                      "lr_schedule": "constant", "checkpoint_every": 10**9,
                                      "log_every": self.sizes.log_every, "validation_every": 0}))  # fmt: skip
        worker = [str(Path(__file__).resolve()), "--train-worker", "--plan", self.done[f"plan-{family}"],
                  "--cache", self.done[f"cache-{family}"], "--config", str(config), "--output-dir", str(out),
                  "--max-steps", str(self.sizes.train_steps)]  # fmt: skip
        if self.gpu:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", *BACKENDS[backend], "--num_processes", "1",
                   "--num_machines", "1", "--main_process_port", "0", *worker]  # fmt: skip
        else:  # one process, no launcher: accelerate's CPU path (what python -m train does)
            cmd = [sys.executable, *worker]
        box = min(max(10.0, self.deadline - time.monotonic() - 10), 240)
        # its own process group: on a timeout the launcher, torchrun and the rank go together (and the GPU is free)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=box)
        except BaseException as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                return [Row("train", what, f"failed: over its time box of {box:.0f} s", status="failed")]
            raise
        found = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
        if proc.returncode != 0 or not found:
            tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
            return [Row("train", what, f"failed: exit {proc.returncode}: {tail[0][:300]}", status="failed")]
        r = json.loads(found[-1][len(RESULT_MARK):])
        result = (f"step {r['step_time_s'] * 1000:.0f} ms, data-wait {r['data_wait']:.1%}, "
                  f"{r['samples_per_s']:.2f} samples/s, peak {r['peak_gb']:.1f} GB; {r['stop']}")  # fmt: skip
        return [Row("train", what, result, values=r)]

    def annotate(self) -> list[Row]:
        return annotate_rows(self.work, self.gpu, images=8 if self.smoke else 256)


def _imports(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _md_row(r: Row) -> str:
    return f"| {r.section} | {r.measure} | {r.result} | {r.target} |"


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| section | measure | result | target |", "|---|---|---|---|", *map(_md_row, rows)]
    return "\n".join(lines) + "\n"


def run_check(args: argparse.Namespace) -> int:
    """Every section in order; the table printed and written. Returns 1 when any row failed, else 0."""
    import torch

    check = Check(args)
    started = time.perf_counter()
    machine = torch.cuda.get_device_name(0) if check.gpu else f"CPU (--smoke), {os.cpu_count()} cores"
    print(f"gpu-check on {machine}, torch {torch.__version__}; work folder {check.work}", flush=True)
    try:
        for family in check.families:
            check.section("setup", lambda f=family: check.prepare(f), 180)
        ray, started_ray = _start_ray(check.smoke)
        for family in check.families:
            check.section("embed", lambda f=family: check.embed(f))
        if started_ray:
            ray.shutdown()  # its workers' memory back before the trainer runs
        for family in check.families:
            check.section("alone", lambda f=family: check.alone(f))
            _free_gpu()
        check.section("decode", check.decode, 60)
        for family in check.families:
            check.section("loader", lambda f=family: check.loader(f), 90)
        for backend in check.backends:  # every backend once before the next: the budget cuts the last ones
            for family in check.families:
                check.section("train", lambda f=family, b=backend: check.train(f, b), 300)
        check.section("annotate", check.annotate, 120)
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(check.work, ignore_errors=True)
    seconds = time.perf_counter() - started
    header = f"gpu-check on {machine}, torch {torch.__version__}, {seconds:.0f} s{' (--smoke)' if args.smoke else ''}"
    table = markdown(check.rows, header)
    out = Path(args.out_dir or os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.md").write_text(table)
    (out / "gpu-check.json").write_text(json.dumps({"machine": machine, "torch": torch.__version__,
                                                    "smoke": args.smoke, "seconds": round(seconds, 1),
                                                    "rows": [asdict(r) for r in check.rows]}, indent=1))  # fmt: skip
    print("\n" + table + f"written to {out}/gpu-check.md and gpu-check.json", flush=True)
    return 1 if any(r.status == "failed" for r in check.rows) else 0


def _start_ray(smoke: bool):
    """The Ray the embed sections use: a local one with every CPU and GPU; 2 CPUs for --smoke (and tests).
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


def train_worker(args: argparse.Namespace) -> None:
    """One rank of a trainer run (under ``accelerate launch``): the trainer's setup and loop, then one
    result line from its ``metrics.jsonl`` (the first window, warm-up, left out), and exit without the
    final checkpoint and model."""
    import torch

    from train.config import load_config
    from train.job import TrainJob
    from train.loop import Trainer

    job = TrainJob(plan=args.plan, caches=(args.cache,), config=load_config(args.config), output_dir=args.output_dir,
                   max_steps=args.max_steps)  # fmt: skip
    trainer = Trainer.setup(job)
    stop = trainer.loop()
    windows = [json.loads(line) for line in Path(trainer.output.local("metrics.jsonl")).read_text().splitlines()]
    measured = windows[1:] or windows
    mean = lambda key: sum(w[key] for w in measured) / len(measured)  # noqa: E731
    cuda = torch.cuda.is_available()
    result = {"step_time_s": mean("step_time_s"), "data_wait": mean("data_wait"),
              "samples_per_s": mean("samples_per_s"), "steps": trainer.cursor.position, "stop": stop.value,
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
              "distributed_type": str(trainer.accelerator.distributed_type)}  # fmt: skip
    if trainer.accelerator.is_main_process:
        print(RESULT_MARK + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown: see train/__main__.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="run every section on the CPU with tiny models (seconds)")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: sdxl,flux")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: ddp,fsdp2,zero2,zero3")
    p.add_argument("--out-dir", default=None, help="where gpu-check.md/.json go (default $OUT or benchmarks/results)")
    p.add_argument("--work-dir", default=None, help="models, data, caches (default: a temp folder, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temp work folder")
    p.add_argument("--budget", type=float, default=570.0,
                   help="seconds for the whole check (10 minutes with start-up and output); late sections skip")
    w = p.add_argument_group("internal: one trainer rank")
    w.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--plan", "--cache", "--config", "--output-dir"):
        w.add_argument(name, default=None, help=argparse.SUPPRESS)
    w.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted({*args.families.split(",")} - {*FAMILIES, ""}) + sorted({*args.backends.split(",")} -
                                                                              {*BACKENDS, ""})  # fmt: skip
    if unknown:
        p.error(f"unknown families or backends {unknown}: families {FAMILIES}, backends {tuple(BACKENDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.train_worker:
        train_worker(args)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(NO_CUDA.format(torch=torch.__version__), flush=True)
        return 0
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
