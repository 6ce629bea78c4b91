"""``bucketeer demo``: the job. What it runs, and how, is in :mod:`pipeline.demo`."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

from manifests.errors import UsageError
from manifests.families import SPECS, demo_families, video_families
from pipeline.demo.local_s3 import DEMO_BUCKET, local_credentials, local_s3_server, upload_folder
from pipeline.demo.summary import summary_text
from pipeline.demo.trainer import WORLD_SIZE, family_config, train

# The demo trains at 256² (not the 1024² default): the CPU VAE's cost grows with pixels, and 256²
# keeps embed well under a minute on 2 cores. Everything else is each command's default.
RESOLUTION = 256
BUCKET_STEP = 32  # at 256² a step of 64 leaves 3 buckets for 9 aspect ratios; 32 keeps them apart
BATCH_SIZE = 4  # per rank: a global batch of 8
EPOCHS = 2  # ~23 steps per epoch on 200 images: a few dozen steps in all
MARKER = ".bucketeer-demo"  # marks an --out-dir this demo made (and may clear)
OWNED = ("manifest", "annotations", "duplicates", "clips", "cache", "plan", "train", "report.html", "report_figures",
         "train.log", "s3-server.log", "demo-summary.json", "train-config.yaml", "validation-prompts.txt")
# What a user decides before training, on the cheap annotations (no model): the duplicates out (one keeper per
# cluster) and the blank frames (contrast 0; a photo's is 0.1 or more). The annotations are taken at 256 pixels
# on the long side: all that a hash and these statistics need, and a quarter of the pixels of 512.
ANNOTATE_TASKS, ANNOTATE_IMAGE_SIZE = "sha256,phash,stats", 256
WHERE = "NOT duplicate AND contrast > 0.02"
CURATION_FROM = 40  # --images from which some of them are planted duplicates and blank frames (9)
# A video demo prepares its clips as people do (docs/video-clips.md): shots (a clip with a known hard cut is
# planted), motion and a caption per shot in one decode of each video (the tiny random Qwen2.5-VL video captioner:
# its captions are noise), clips cut inside the shots with each clip's own shot's caption (rebucket --scenes), and a
# planted still clip left out by the plan's --where (the stills, images of the manifest, are 1-frame samples)
VIDEO_ANNOTATE_TASKS, VIDEO_WHERE = "scenes,motion,caption", "motion > 0.5 OR frames = 1"
# the families a demo runs (manifests/families: FamilySpec.demo), those trained on generated clips (.video);
# qwen-image-edit's are (target, reference) pairs: a grey reference per image, scan --conditioning
FAMILIES, VIDEO = demo_families(), video_families()
# --family wan: short clips at ~128² (the tiny Wan VAE runs each 17-frame clip in about a second on a CPU), frame
# buckets 9 and 17 (4k+1, as Wan's causal VAE takes them), sides in steps of 16 (VAE 8 x patch 2); Wan 2.2's
# TI2V VAE compresses 16x: steps of 32
VIDEO_RESOLUTION, VIDEO_BUCKET_STEP, VIDEO_FRAMES = 128, 16, "9,17"
# LTX-2's VAE is 32x (its 8k + 1 frames: 9 and 17 are), HunyuanVideo 1.5's 16x: FamilySpec.bucket_step
VIDEO_BUCKET_STEPS = {name: SPECS[name].bucket_step for name in VIDEO if SPECS[name].bucket_step}
VALIDATION_PROMPTS = "a red circle on a blue background\na photo of a cat\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="./demo-output",
                        help="where the dataset, artifacts, trainer output and report go "
                        "(default ./demo-output)")  # fmt: skip
    parser.add_argument("--s3", action="store_true",
                        help="run every stage against a local S3-compatible server (moto on 127.0.0.1) started "
                        "and stopped by the demo")  # fmt: skip
    parser.add_argument("--images", type=int, default=200,
                        help="images to generate (default 200; plus 3 broken files); in the default flow 9 of them "
                        "are copies of others and blank frames, for dedup and the selection to find")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated dataset and of the plan")
    parser.add_argument("--family", choices=FAMILIES, default="pixart",
                        help="model family: sdxl, sd3, flux, flux2, flux2-klein, chroma, qwen-image, qwen-image-edit "
                        "(on generated pairs) or z-image embed and fine-tune a tiny random-weight model of the "
                        "family's real classes; wan, wan2.2-a14b, wan2.2-ti2v-5b, ltx-2 and hunyuanvideo-1.5 do so on "
                        "generated video clips "
                        "(scan --frames); pixart "
                        "(default) trains the from-scratch transformer")  # fmt: skip
    parser.add_argument("--clips", type=int, default=24,
                        help="with a video --family (wan, wan2.2-*): clips to generate (default 24; plus 3 stills, a "
                        "too-short clip "
                        "and a broken file)")  # fmt: skip
    parser.add_argument("--repa", action="store_true",
                        help="REPA: embed DINOv2 features (--features dinov2, a tiny random DINOv2) and train with "
                             "the repa: config term (transformer families: pixart, sd3, flux)")


@dataclass(frozen=True, kw_only=True)
class DemoJob:
    """One demo run: ``images`` generated images (plus 3 broken files) under ``out_dir``, through every stage."""

    out_dir: Path = Path("./demo-output")
    s3: bool = False  # every stage against a local S3-compatible server (moto on 127.0.0.1)
    images: int = 200
    seed: int = 0  # of the generated dataset and of the plan
    family: str = "pixart"
    repa: bool = False  # embed --features dinov2, train with repa:
    clips: int = 24  # a video --family (wan, wan2.2-*): generated clips instead of images

    def __post_init__(self) -> None:
        if self.repa and self.family not in ("pixart", "sd3", "flux"):
            raise UsageError(f"--repa needs an image transformer family (pixart, sd3, flux), not {self.family}")
        if self.family in VIDEO and self.clips < 8:
            raise UsageError(f"--clips must be >= 8 (one global batch of {WORLD_SIZE}x{BATCH_SIZE}), got {self.clips}")
        if self.images < 8:
            raise UsageError(f"--images must be >= 8 (one global batch of {WORLD_SIZE}x{BATCH_SIZE}), "
                             f"got {self.images}")
        if self.family not in FAMILIES:
            raise UsageError(f"--family must be one of {', '.join(FAMILIES)}, got {self.family!r}")


def job_from_args(args: argparse.Namespace) -> DemoJob:
    return DemoJob(out_dir=Path(args.out_dir), s3=args.s3, images=args.images, seed=args.seed, family=args.family,
                   repa=args.repa, clips=args.clips)


@dataclass(frozen=True)
class DemoResult:
    """What the demo made: each stage's own result, and the figures written to ``demo-summary.json``."""

    out_dir: Path
    scan: Any  # pipeline.scan.job.ScanResult
    embed: Any  # pipeline.embed.job.EmbedResult
    plan: Any  # pipeline.plan.PlanResult
    figures: dict[str, Any]  # demo-summary.json
    seconds: float


@dataclass(frozen=True)
class Target:
    """Where the artifacts of one demo run live: local paths, or s3:// URLs plus the endpoint."""

    NAMES: ClassVar[tuple[str, ...]] = ("dataset", "manifest", "annotations", "duplicates", "clips", "cache", "plan")
    dataset: str
    manifest: str
    annotations: str
    duplicates: str
    clips: str  # a video demo's manifest with its clips cut inside shots (rebucket --scenes)
    cache: str
    plan: str
    storage_options: dict[str, Any]

    def options_argv(self) -> list[str]:
        return ["--storage-options", json.dumps(self.storage_options)] if self.storage_options else []


class Stages:
    """Runs named stages in order: a progress line before each, its wall time after."""

    def __init__(self, names: list[str]):
        self.names = names
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, what: str) -> Iterator[None]:
        print(f"[{self.names.index(name) + 1}/{len(self.names)}] {name}: {what}", flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 2)
        print(f"      {name} done in {self.seconds[name]:.1f} s", flush=True)


def run(job: DemoJob) -> DemoResult:
    out = _prepare_out_dir(job.out_dir)
    s3_server, s3_upload = (["s3 server"], ["s3 upload"]) if job.s3 else ([], [])
    curation = ["annotate", "dedup"] if _curates(job) else ["annotate", "rebucket"] if job.family in VIDEO else []
    stages = Stages(["generate", *s3_server, "ray", *s3_upload, "scan", *curation, "embed", "plan", "train", "verify",
                     "report"])  # fmt: skip
    started = time.perf_counter()
    what = (f"{job.clips} short clips in 3 aspect ratios, a clip with a hard cut, a still clip, stills, captions, a "
            "broken file" if job.family in VIDEO
            else f"{job.images} images in several aspect ratios, captions, 3 broken files"
            + (", duplicates, blank frames" if _curates(job) else ""))  # fmt: skip
    with stages.stage("generate", what):
        print(f"      {_generate(job, out / 'dataset')}")
    with contextlib.ExitStack() as cleanup:  # unwound in reverse: Ray, then the server, then the credentials
        endpoint = None
        if job.s3:
            cleanup.enter_context(local_credentials())
            with stages.stage("s3 server", "a local S3-compatible server (moto) on 127.0.0.1"):
                endpoint = cleanup.enter_context(local_s3_server(out / "s3-server.log"))
        with stages.stage("ray", "one local Ray for the jobs (scan, annotate, embed)"):
            from pipeline.ray_setup import ray_session

            cleanup.enter_context(ray_session(local=True))  # one Ray for every stage
        if endpoint:
            target = Target(*(f"s3://{DEMO_BUCKET}/{n}" for n in Target.NAMES),
                            storage_options={"endpoint_url": endpoint})  # fmt: skip
            with stages.stage("s3 upload", f"the dataset to {target.dataset} on {endpoint}"):
                upload_folder(out / "dataset", target.dataset, target.storage_options)
        else:
            target = Target(*(str(out / n) for n in Target.NAMES), storage_options={})
        results = run_stages(stages, target, out, job.seed, job.family, repa=job.repa)
    figures = demo_figures(results, target=target, out=out)
    figures["total_seconds"] = round(time.perf_counter() - started, 2)
    figures["stage_seconds"] = stages.seconds
    figures["mode"] = "s3" if job.s3 else "local"
    (out / "demo-summary.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(summary_text(figures, out, WORLD_SIZE))
    return DemoResult(out, results.scan, results.embed, results.plan, figures=figures,
                      seconds=figures["total_seconds"])  # fmt: skip


def _curates(job: DemoJob) -> bool:
    """Whether the demo runs annotate and dedup, and plans with --where: the default flow does (``--s3`` too); a
    ``--family`` demo shows that family's embed and training (and a video manifest has no image tasks)."""
    return job.family == "pixart"


def _generate(job: DemoJob, folder: Path) -> str:
    """Write the demo's dataset (images, or clips for a video family); a line saying what it wrote."""
    from pipeline import sample_data

    if job.family in VIDEO:
        try:
            made = sample_data.make_sample_clips(folder, n=job.clips, seed=job.seed)
            cases = sample_data.add_video_cases(folder, seed=job.seed)
        except ImportError:
            raise UsageError(f"bucketeer demo --family {job.family} writes and reads clips with PyAV: "
                             "pip install 'bucketeer[video]'") from None  # fmt: skip
        return (f"{made['clips']} clips {made['codecs']} ({made['rotated']} rotated), {made['captioned']} captions, "
                f"{made['images']} stills, {made['short']} too short, {made['broken']} broken; planted: a clip with a "
                f"hard cut at frame {cases['cut']}, a still clip -> {folder}")
    planted = {"duplicates": 6, "blanks": 3} if _curates(job) and job.images >= CURATION_FROM else {}
    made = sample_data.make_sample_dataset(folder, n=job.images - sum(planted.values()), seed=job.seed)
    line = (f"{made['images']} images {made['formats']}, {made['captioned']} captions, "
            f"{made['rotated']} EXIF-rotated, {made['broken']} broken")
    if planted:
        cases = sample_data.add_curation_cases(folder, **planted)
        line += (f"; planted: {cases['exact']} exact copies, {cases['resaved']} re-saved copies, "
                 f"{cases['blanks']} blank frames")  # fmt: skip
    if job.family == "qwen-image-edit":  # its captions are the instructions: a reference to edit per image
        line += f", {sample_data.make_references(folder)} references in {sample_data.REFERENCES}/"
    return f"{line} -> {folder}"


def _scan_options(family: str, dataset: str) -> list[str]:
    """``bucketeer scan`` bucket options: images at RESOLUTION, or (wan) clips in frame buckets; (qwen-image-edit)
    the references under ``dataset`` paired with their images."""
    if family in VIDEO:
        step = VIDEO_BUCKET_STEPS.get(family, VIDEO_BUCKET_STEP)
        return ["--resolution", str(VIDEO_RESOLUTION), "--bucket-step", str(step),
                "--frames", VIDEO_FRAMES]  # fmt: skip
    from pipeline.sample_data import REFERENCES

    pairs = ["--conditioning", f"{dataset}/{REFERENCES}"] if family == "qwen-image-edit" else []
    return ["--resolution", str(RESOLUTION), "--bucket-step", str(BUCKET_STEP), *pairs]


@dataclass(frozen=True)
class StageResults:
    """Each job's own result; ``annotate`` and ``dedup`` None where the demo skips them (``--family wan``)."""

    scan: Any
    annotate: Any
    dedup: Any
    embed: Any
    plan: Any


def run_stages(stages: Stages, target: Target, out: Path, seed: int, family: str = "pixart", *,
               repa: bool = False) -> StageResults:  # fmt: skip
    """scan -> annotate -> dedup -> embed -> plan --where -> train -> verify -> report against ``target``
    (``stages`` names the ones to run: a video demo has no annotate and dedup); returns the jobs' results.
    ``family``: see :mod:`pipeline.demo`; ``repa``: DINOv2 features in the cache, REPA in training."""
    features = ["--features", "dinov2"] if repa else []
    opts = target.options_argv()
    with stages.stage("scan", f"{target.dataset} -> {target.manifest} (header-only Ray job)"):
        scan = _bucketeer("scan", target.dataset, "--out", target.manifest, *_scan_options(family, target.dataset),
                          *opts)  # fmt: skip
    annotate = dedup = None
    selection: list[str] = []
    manifest = target.manifest  # what embed, plan and the report take
    if "rebucket" in stages.names:  # a video demo (see VIDEO_WHERE)
        with stages.stage("annotate", f"{VIDEO_ANNOTATE_TASKS} of every video -> {target.annotations} (Ray job, one "
                          "decode per video, a tiny random video captioner)"):  # fmt: skip
            annotate = _bucketeer("annotate", target.manifest, "--out", target.annotations, "--task",
                                  VIDEO_ANNOTATE_TASKS, "--model", "default", *opts)  # fmt: skip
        with stages.stage("rebucket", f"clips inside the shots, each with its shot's caption -> {target.clips}"):
            _bucketeer("rebucket", target.manifest, "--out", target.clips, "--scenes", target.annotations,
                       *_scan_options(family, target.dataset)[:4], *opts)  # fmt: skip
        manifest = target.clips
        selection = ["--annotations", target.annotations, "--where", VIDEO_WHERE]
    elif "annotate" in stages.names:
        with stages.stage("annotate", f"{ANNOTATE_TASKS} of every image -> {target.annotations} (Ray job, no model)"):
            annotate = _bucketeer("annotate", target.manifest, "--out", target.annotations, "--task", ANNOTATE_TASKS,
                                  "--image-size", str(ANNOTATE_IMAGE_SIZE), *opts)  # fmt: skip
        with stages.stage("dedup", f"exact and perceptual duplicates -> {target.duplicates}"):
            dedup = _bucketeer("dedup", target.annotations, "--out", target.duplicates, *opts)
        selection = ["--annotations", f"{target.annotations},{target.duplicates}", "--where", WHERE]
    models = "embedded default encoders" if family == "pixart" else f"a tiny random-weight {family} model"
    with stages.stage("embed", f"{target.manifest} -> {target.cache} (Ray job, {models})"):
        embed = _bucketeer("embed", manifest, "--out", target.cache, *_family_options(family, out), *features,
                           *opts)  # fmt: skip
    keeps = f", keeping {selection[-1]}" if selection else ""
    with stages.stage("plan", f"{WORLD_SIZE} ranks x batch {BATCH_SIZE}, {EPOCHS} epochs{keeps} -> {target.plan}"):
        plan = _bucketeer("plan", manifest, "--out", target.plan, "--world-size", str(WORLD_SIZE),
                          "--batch-size", str(BATCH_SIZE), "--seed", str(seed), "--epochs", str(EPOCHS), "--cache",
                          target.cache, *selection, *opts)  # fmt: skip
    with stages.stage("train", f"accelerate launch, {WORLD_SIZE} processes on the CPU -> {out / 'train'}"):
        config = family_config(family, out, plan_steps=plan.meta.steps_per_epoch * EPOCHS, repa=repa)
        train(["--plan", target.plan, "--cache", target.cache, "--output-dir", str(out / "train"), *config, *opts],
              out)  # fmt: skip
    with stages.stage("verify", f"every record of {target.cache}"):
        _bucketeer("verify", target.cache, *opts)
    with stages.stage("report", f"{out / 'report.html'} and PNG figures"):
        _bucketeer("report", manifest, "--plan", target.plan, "--cache", target.cache, *selection[:2],
                   "--out", str(out / "report.html"), *opts)  # fmt: skip
    return StageResults(scan, annotate, dedup, embed, plan)


def demo_figures(results: StageResults, *, target: Target, out: Path) -> dict[str, Any]:
    """The figures of ``demo-summary.json``, from the stages' results and the trainer's metrics."""
    s, cache, p = results.scan.meta.summary, results.embed.meta, results.plan.meta
    metrics = out / "train" / "metrics.jsonl"
    # one row per log_every (10) steps, and one for the last step (also of a plan shorter than 10 steps)
    losses = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
    figures: dict[str, Any] = {
        "scan": {"listed": s.listed, "samples": s.samples, "errors": s.errors, "errors_by_kind": dict(s.errors_by_kind),
                 "files_per_s": s.files_per_s, "seconds": s.seconds},
        "embed": {"samples": cache.counts.samples, "texts": cache.counts.texts,
                  "images_per_s": cache.summary.images_per_second if cache.summary else None},
        "plan": {"steps_per_epoch": p.steps_per_epoch, "epochs": EPOCHS, "planned": p.samples.planned,
                 "padded": p.counts.padded, "dropped": p.counts.dropped},
        "train": {"steps": p.steps_per_epoch * EPOCHS,
                  "loss_first": round(losses[0]["loss"], 4) if losses else None,
                  "loss_last": round(losses[-1]["loss"], 4) if losses else None,
                  "samples_per_s": round(sum(r["samples_per_s"] for r in losses) / len(losses), 1) if losses else None},
        "artifacts": {"dataset": target.dataset, "manifest": target.manifest, "cache": target.cache,
                      "plan": target.plan, "train": str(out / "train"), "report": str(out / "report.html"),
                      "figures": str(out / "report_figures")},
    }  # fmt: skip
    a, d = results.annotate, results.dedup
    if a is not None:
        figures["annotate"] = {"tasks": [t.task for t in a.meta.tasks], "annotated": a.meta.counts.annotated,
                               "errors": a.meta.counts.errors, "images_per_s": a.images_per_second}  # fmt: skip
        if d is not None:
            figures["dedup"] = {"samples": d.samples, "clusters": d.clusters, "duplicates": d.duplicates,
                                "edges": dict(d.edges)}  # fmt: skip
            figures["artifacts"].update(duplicates=target.duplicates)
        else:  # a video demo: its clips cut inside the shots
            figures["artifacts"].update(clips=target.clips)
        kept = p.selection.datasets[0] if p.selection else None
        figures["plan"]["where"] = p.selection.where if p.selection else None
        figures["plan"]["kept"] = kept.kept if kept else None
        figures["plan"]["dropped_by_where"] = kept.dropped if kept else None
        figures["artifacts"].update(annotations=target.annotations)
    return figures


def _bucketeer(*argv: str) -> Any:
    """``bucketeer ARGV`` in this process: the command a user would type, printed, then its job run; returns the
    job's result. A job that fails raises, and the demo stops with its error."""
    from pipeline import run
    from pipeline.cli import job_from_argv

    print(f"      $ bucketeer {shlex.join(argv)}", flush=True)
    return run(job_from_argv(argv))


def _family_options(family: str, out: Path) -> list[str]:
    """``bucketeer embed`` options of a family: its tiny model folder (built once) and validation prompts."""
    if family == "pixart":
        return []
    from pipeline.embed.families.tiny import ensure_tiny

    model = ["--family", family, "--model", str(ensure_tiny(family))]
    if family == "qwen-image-edit":  # no prompt without its reference; references at the demo's resolution (the
        return [*model, "--reference-resolution", str(RESOLUTION)]  # pipeline's 1024² costs the CPU 16x the VAE)
    prompts = out / "validation-prompts.txt"
    prompts.write_text(VALIDATION_PROMPTS)  # read by the embed driver, this process: a local path in --s3 mode too
    return [*model, "--validation-prompts", str(prompts)]


def _prepare_out_dir(out: Path) -> Path:
    """Create ``out``, or clear what a previous demo wrote there; refuse a folder the demo did not make."""
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise UsageError(f"--out-dir {out} exists and was not made by `bucketeer demo`; choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by `bucketeer demo`; the demo clears this folder's artifacts on each run\n")
    for name in (*OWNED, "dataset"):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return out.resolve()
