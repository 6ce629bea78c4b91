"""Run scan -> embed -> plan -> train -> verify -> report on a generated dataset, on this machine.

    bucketeer demo                        # ./demo-output: ~300 images, 2 training processes, about a minute on 2 cores
    bucketeer demo --s3                   # the same flow against a local S3-compatible server (moto, 127.0.0.1)
    bucketeer demo --images 60 --out-dir demo-small
    bucketeer demo --family sdxl          # the same flow with a tiny random-weight SDXL (sd3, flux alike)

Each stage is the real job, called the way a user calls it: scan, embed, plan, verify and report
through their ``bucketeer`` entry points in this process (they are Ray drivers and share one
local Ray started here), the trainer as ``accelerate launch --config_file
infra/accelerate/cpu-2proc.yaml -m train`` in subprocesses (2 ranks, gloo on the CPU). With
``--s3`` the dataset is uploaded to a moto server started on a free 127.0.0.1 port, every
artifact is an ``s3://`` URL passed with ``--storage-options '{"endpoint_url": ...}'``, and the
server is stopped afterwards, also when a stage fails. The same stage functions serve both modes.

``--family sdxl|sd3|flux`` builds that family's tiny random-weight diffusers folder once (under
``$BUCKETEER_HOME``, :func:`pipeline.embed.families.tiny.ensure_tiny`), embeds with ``--family F --model
<that folder>`` and two validation prompts, and trains the family's recipe from it (fine-tuning the
tiny pretrained weights, with caption dropout, an EMA and validation images at the end: the
settings are in ``train-config.yaml``). ``--family pixart`` (or none) is the default flow: the
embedded default encoders and the from-scratch transformer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from manifests.errors import BucketeerError, StorageError, UsageError

# The demo trains at 256² (not the 1024² default): the CPU VAE's cost grows with pixels, and 256²
# keeps embed well under a minute on 2 cores. Everything else is each command's default.
RESOLUTION = 256
BUCKET_STEP = 32  # at 256² a step of 64 leaves 3 buckets for 9 aspect ratios; 32 keeps them apart
WORLD_SIZE = 2  # processes of infra/accelerate/cpu-2proc.yaml
BATCH_SIZE = 4  # per rank: a global batch of 8
EPOCHS = 2  # ~30 steps per epoch on 300 images: a few dozen steps in all
DEMO_BUCKET = "bucketeer-demo"
MARKER = ".bucketeer-demo"  # marks an --out-dir this demo made (and may clear)
OWNED = ("manifest", "cache", "plan", "train", "report.html", "report_figures", "train.log", "s3-server.log",
         "demo-summary.json", "train-config.yaml", "validation-prompts.txt")
FAMILIES = ("pixart", "sdxl", "sd3", "flux")
VALIDATION_PROMPTS = "a red circle on a blue background\na photo of a cat\n"
ROOT = Path(__file__).resolve().parent.parent
ACCELERATE_CONFIG = ROOT / "infra" / "accelerate" / "cpu-2proc.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="./demo-output",
                        help="where the dataset, artifacts, trainer output and report go "
                        "(default ./demo-output)")  # fmt: skip
    parser.add_argument("--s3", action="store_true",
                        help="run every stage against a local S3-compatible server (moto on 127.0.0.1) started "
                        "and stopped by the demo")  # fmt: skip
    parser.add_argument("--images", type=int, default=300, help="images to generate (default 300; plus 3 broken files)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated dataset and of the plan")
    parser.add_argument("--family", choices=FAMILIES, default="pixart",
                        help="model family: sdxl, sd3 or flux embed and fine-tune a tiny random-weight model of "
                        "the family's real classes; pixart (default) trains the from-scratch transformer")  # fmt: skip


@dataclass(frozen=True)
class Target:
    """Where the artifacts of one demo run live: local paths, or s3:// URLs plus the endpoint."""

    dataset: str
    manifest: str
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


def run(args: argparse.Namespace) -> int:
    if args.images < 8:
        raise UsageError(f"--images must be >= 8 (one global batch of {WORLD_SIZE}x{BATCH_SIZE}), got {args.images}")
    out = _prepare_out_dir(Path(args.out_dir))
    s3_server, s3_upload = (["s3 server"], ["s3 upload"]) if args.s3 else ([], [])
    stages = Stages(["generate", *s3_server, "ray", *s3_upload, "scan", "embed", "plan", "train", "verify", "report"])
    started = time.perf_counter()
    with stages.stage("generate", f"{args.images} images in several aspect ratios, captions, 3 broken files"):
        from pipeline.sample_data import make_sample_dataset

        made = make_sample_dataset(out / "dataset", n=args.images, seed=args.seed)
        print(f"      {made['images']} images {made['formats']}, {made['captioned']} captions, "
              f"{made['rotated']} EXIF-rotated, {made['broken']} broken -> {out / 'dataset'}")  # fmt: skip
    with contextlib.ExitStack() as cleanup:  # unwound in reverse: Ray, then the server, then the credentials
        endpoint = None
        if args.s3:
            cleanup.enter_context(_credentials_for_local_s3())
            with stages.stage("s3 server", "a local S3-compatible server (moto) on 127.0.0.1"):
                endpoint = cleanup.enter_context(_local_s3_server(out / "s3-server.log"))
        with stages.stage("ray", "one local Ray for the jobs (scan, embed)"):
            from pipeline.ray_setup import ray_session

            cleanup.enter_context(ray_session(local=True))  # one Ray for every stage
        if endpoint:
            target = Target(*(f"s3://{DEMO_BUCKET}/{n}" for n in ("dataset", "manifest", "cache", "plan")),
                            storage_options={"endpoint_url": endpoint})  # fmt: skip
            with stages.stage("s3 upload", f"the dataset to {target.dataset} on {endpoint}"):
                _upload(out / "dataset", target)
        else:
            target = Target(*(str(out / n) for n in ("dataset", "manifest", "cache", "plan")), storage_options={})
        figures = run_stages(stages, target, out, args.seed, args.family)
    figures["total_seconds"] = round(time.perf_counter() - started, 2)
    figures["stage_seconds"] = stages.seconds
    figures["mode"] = "s3" if args.s3 else "local"
    (out / "demo-summary.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(summary_text(figures, target, out))
    return 0


def run_stages(stages: Stages, target: Target, out: Path, seed: int, family: str = "pixart") -> dict[str, Any]:
    """scan -> embed -> plan -> train -> verify -> report against ``target``; returns the figures.

    ``family``: see the module docstring."""
    from manifests.cache import read_cache_meta
    from manifests.manifest import read_manifest
    from manifests.plan import read_plan_meta

    so, opts = target.storage_options, target.options_argv()
    with stages.stage("scan", f"{target.dataset} -> {target.manifest} (header-only Ray job)"):
        _bucketeer("scan", target.dataset, "--out", target.manifest, "--resolution", str(RESOLUTION),
                   "--bucket-step", str(BUCKET_STEP), *opts)
    models = "embedded default encoders" if family == "pixart" else f"a tiny random-weight {family} model"
    with stages.stage("embed", f"{target.manifest} -> {target.cache} (Ray job, {models})"):
        _bucketeer("embed", target.manifest, "--out", target.cache, *_family_options(family, out), *opts)
    with stages.stage("plan", f"{WORLD_SIZE} ranks x batch {BATCH_SIZE}, {EPOCHS} epochs -> {target.plan}"):
        _bucketeer("plan", target.manifest, "--out", target.plan, "--world-size", str(WORLD_SIZE), "--batch-size",
                   str(BATCH_SIZE), "--seed", str(seed), "--epochs", str(EPOCHS), "--cache", target.cache,
                   *opts)  # fmt: skip
    with stages.stage("train", f"accelerate launch, {WORLD_SIZE} processes on the CPU -> {out / 'train'}"):
        _train(target, out, _family_config(family, out, plan_steps=read_plan_meta(target.plan, so).steps_per_epoch
                                           * EPOCHS))  # fmt: skip
    with stages.stage("verify", f"every record of {target.cache}"):
        _bucketeer("verify", target.cache, *opts)
    with stages.stage("report", f"{out / 'report.html'} and PNG figures"):
        _bucketeer("report", target.manifest, "--plan", target.plan, "--cache", target.cache,
                   "--out", str(out / "report.html"), *opts)  # fmt: skip

    scan = read_manifest(target.manifest, so).meta["summary"]
    cache = read_cache_meta(target.cache, so)
    plan = read_plan_meta(target.plan, so)
    metrics = out / "train" / "metrics.jsonl"
    # one row per log_every (10) steps: none when the plan is shorter (a tiny --images)
    losses = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
    return {
        "scan": {k: scan[k] for k in ("listed", "samples", "errors", "errors_by_kind", "files_per_s", "seconds")},
        "embed": {"samples": cache["counts"]["samples"], "texts": cache["counts"]["texts"],
                  "images_per_s": (cache.get("summary") or {}).get("images_per_second")},
        "plan": {"steps_per_epoch": plan.steps_per_epoch, "epochs": EPOCHS, "planned": plan.samples.planned,
                 "padded": plan.counts.padded, "dropped": plan.counts.dropped},
        "train": {"steps": plan.steps_per_epoch * EPOCHS,
                  "loss_first": round(losses[0]["loss"], 4) if losses else None,
                  "loss_last": round(losses[-1]["loss"], 4) if losses else None,
                  "samples_per_s": round(sum(r["samples_per_s"] for r in losses) / len(losses), 1) if losses else None},
        "artifacts": {"dataset": target.dataset, "manifest": target.manifest, "cache": target.cache,
                      "plan": target.plan, "train": str(out / "train"), "report": str(out / "report.html"),
                      "figures": str(out / "report_figures")},
    }  # fmt: skip


# ---------------------------------------------------------------- the stages' mechanics


def _bucketeer(*argv: str) -> None:
    """``bucketeer ARGV`` in this process (the CLI a user runs); a non-zero exit stops the demo."""
    from pipeline.cli import main

    print(f"      $ bucketeer {shlex.join(argv)}", flush=True)
    code = main(list(argv))
    if code != 0:
        raise BucketeerError(f"`bucketeer {argv[0]}` failed (exit {code}); its error is printed above")


def _accelerate_launch() -> list[str]:
    """``accelerate launch`` with the 2-process CPU config on a free port (another run may hold 29500)."""
    exe = Path(sys.executable).parent / "accelerate"
    launch = [str(exe), "launch"] if exe.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
    if ACCELERATE_CONFIG.exists():
        config = ["--config_file", str(ACCELERATE_CONFIG)]
    else:  # installed without the repository's infra/: the same settings as flags
        config = ["--multi_gpu", "--num_processes", str(WORLD_SIZE), "--num_machines", "1", "--mixed_precision", "no",
                  "--dynamo_backend", "no"]  # fmt: skip
    return [*launch, *config, "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port())]


def _family_options(family: str, out: Path) -> list[str]:
    """``bucketeer embed`` options of a family: its tiny model folder (built once) and validation prompts."""
    if family == "pixart":
        return []
    from pipeline.embed.families.tiny import ensure_tiny

    prompts = out / "validation-prompts.txt"
    prompts.write_text(VALIDATION_PROMPTS)  # read by the embed driver, this process: a local path in --s3 mode too
    return ["--family", family, "--model", str(ensure_tiny(family)), "--validation-prompts", str(prompts)]


def _family_config(family: str, out: Path, *, plan_steps: int) -> list[str]:
    """``--config`` for the trainer: none for pixart (the tiny default), else a small fine-tuning config."""
    if family == "pixart":
        return []
    config = out / "train-config.yaml"
    config.write_text(
        f"# written by bucketeer demo --family {family}: the tiny {family} model fine-tuned on the CPU; validation\n"
        "# images after the last step\n"
        f"family: {family}\nlr: 1.0e-4\nwarmup_steps: 5\ncaption_dropout: 0.1\nema_decay: 0.99\n"
        f"checkpoint_every: 100\nlog_every: 10\nvalidation_every: {plan_steps}\nvalidation_steps: 4\n"
        "validation_guidance: 3.0\nvalidation_size: 64\n"
    )  # fmt: skip
    return ["--config", str(config)]


def _train(target: Target, out: Path, config: list[str] | None = None) -> None:
    """The trainer on 2 processes; its output goes to ``out/train.log`` (its key lines are echoed)."""
    argv = [*_accelerate_launch(), "-m", "train", "--plan", target.plan, "--cache", target.cache,
            "--output-dir", str(out / "train"), *(config or []), *target.options_argv()]  # fmt: skip
    print(f"      $ ACCELERATE_USE_CPU=true {shlex.join(argv)}", flush=True)
    # ACCELERATE_USE_CPU: the multi-process launcher picks the CPU and gloo (see cpu-2proc.yaml);
    # one torch thread per process, since the 2 processes share the cores
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = out / "train.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = _wait_for_trainer(proc, log)
        finally:
            if proc.poll() is None:  # interrupted: no rank may outlive the demo
                _kill_tree(proc)
    lines = log.read_text(errors="replace").splitlines()
    for line in lines:
        if line.startswith(("training ", "done: ")):
            print(f"      {line}", flush=True)
    if code != 0:
        tail = "\n".join(lines[-30:])
        raise BucketeerError(f"the trainer failed (exit {code}); last lines of {log}:\n{tail}")


def _wait_for_trainer(proc: subprocess.Popen, log: Path, exit_grace_s: float = 60) -> int:
    """The launcher's exit code. A rank can hang in torch's gloo teardown after the trainer has
    finished and said so ("done: ..."); past ``exit_grace_s`` after that line, the processes are
    killed and the run counts as finished (the model and checkpoint are written before the line)."""
    done_at = None
    while True:
        try:
            return proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        if done_at is None and any(line.startswith("done: ") for line in log.read_text(errors="replace").splitlines()):
            done_at = time.monotonic()
        if done_at is not None and time.monotonic() - done_at > exit_grace_s:
            print(f"      note: the trainer finished but its processes did not exit within {exit_grace_s:.0f} s "
                  "(torch gloo teardown); stopped them", flush=True)  # fmt: skip
            _kill_tree(proc)
            return 0


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and everything under it (torchrun starts ranks in their own sessions)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()


def _upload(folder: Path, target: Target) -> None:
    """Copy the generated dataset to ``target.dataset``; raises StorageError if a file is missing there."""
    from manifests.storage import call_storage, open_url

    fs, root = open_url(target.dataset, target.storage_options)
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    sources, targets = [str(folder / p) for p in local], [f"{root}/{p}" for p in local]
    call_storage(fs, "uploading to", root, lambda: fs.put(sources, targets))
    fs.invalidate_cache()
    uploaded = len(call_storage(fs, "listing", root, lambda: fs.find(root)))
    if uploaded != len(local):
        raise StorageError(f"uploaded {uploaded} of {len(local)} files to {target.dataset}")
    print(f"      {uploaded} files uploaded", flush=True)


# ---------------------------------------------------------------- what the stages run in


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


@contextlib.contextmanager
def _credentials_for_local_s3() -> Iterator[None]:
    """Placeholder credentials (the local server takes any): a user's real keys never reach it.

    Set before Ray starts and the trainer is launched, so that their workers sign requests too.
    """
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    saved = {n: os.environ.get(n) for n in names}
    for n in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(n, None)
    os.environ.update(AWS_ACCESS_KEY_ID="local-demo-key-id", AWS_SECRET_ACCESS_KEY="local-demo-secret",
                      AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


@contextlib.contextmanager
def _local_s3_server(log: Path) -> Iterator[str]:
    """``python -m moto.server`` on a free 127.0.0.1 port with the demo bucket; yields the endpoint.

    A subprocess rather than a thread of this process: Ray workers and the trainer's ranks reach it
    over HTTP while this process waits on them. Its request log goes to ``log`` (a pipe nobody
    reads would fill and stall the server). Stopped by its process group, also on failure.
    """
    import s3fs

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    sink = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _accepts(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BucketeerError(f"the local S3-compatible server (moto) did not start on {endpoint}; see {log} "
                                     "(is moto[server] installed? pip install 'moto[server]')")  # fmt: skip
            time.sleep(0.2)
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(DEMO_BUCKET)
        print(f"      local S3-compatible server on {endpoint} (pid {proc.pid}), bucket s3://{DEMO_BUCKET}", flush=True)
        yield endpoint
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sink.close()
        print(f"      local S3-compatible server (pid {proc.pid}) stopped", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------- the summary


def summary_text(figures: dict[str, Any], target: Target, out: Path) -> str:
    """What the demo made, its figures, and the same flow as commands for a cluster."""
    s, e, p, t = figures["scan"], figures["embed"], figures["plan"], figures["train"]
    a = figures["artifacts"]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_kind"].items())) or "none"
    times = ", ".join(f"{k} {v:.1f} s" for k, v in figures["stage_seconds"].items())
    rate = f"{e['images_per_s']:.1f} images/s" if e["images_per_s"] else "images/s n/a"
    opts = " --storage-options '{\"endpoint_url\": \"https://<account>.r2.cloudflarestorage.com\"}'"
    lines = [
        "",
        f"bucketeer demo finished in {figures['total_seconds']:.1f} s ({figures['mode']}): {times}",
        "",
        "artifacts",
        f"  dataset   {a['dataset']}",
        f"  manifest  {a['manifest']}   (parquet: filename, width, height, caption, bucket; _manifest.json)",
        f"  cache     {a['cache']}   (gzip'd latents + text embeddings; _cache.json)",
        f"  plan      {a['plan']}   (rows epoch, step, rank, bucket, sample_ids; _plan.json)",
        f"  trainer   {a['train']}   (checkpoints, metrics.jsonl, model/), log {out / 'train.log'}",
        f"  report    {a['report']}   (PNGs in {a['figures']})",
        "",
        "figures",
        f"  scan      {s['listed']} images listed, {s['samples']} samples, {s['errors']} errors ({errors}); "
        f"{s['files_per_s']:.0f} files/s",
        f"  embed     {e['samples']} latent records, {e['texts']} captions; {rate} on the CPU",
        f"  plan      {p['steps_per_epoch']} steps/epoch x {p['epochs']} epochs on {WORLD_SIZE} ranks; "
        f"{p['planned']} samples planned, {p['padded']} padded, {p['dropped']} dropped sample-epochs",
        f"  train     {t['steps']} steps; " + (
            f"loss {t['loss_first']:.4f} (first 10 steps) -> {t['loss_last']:.4f} (last 10); "
            f"{t['samples_per_s']:.1f} samples/s" if t["loss_first"] is not None
            else "fewer than 10 steps: no loss logged"),
        "",
        "the same on a cluster (credentials from AWS_* variables; see README.md and infra/README.md)",
        "  ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline.scan "
        f"s3://my-bucket/dataset --out s3://my-bucket/manifest{opts}",
        "  ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline.embed "
        f"s3://my-bucket/manifest --out s3://my-bucket/cache{opts}",
        "  bucketeer plan s3://my-bucket/manifest --out s3://my-bucket/plan --world-size 8 --batch-size 4 "
        f"--epochs 10 --cache s3://my-bucket/cache{opts}",
        "  accelerate launch --config_file infra/accelerate/ddp-1x8.yaml -m train --plan s3://my-bucket/plan "
        f"--cache s3://my-bucket/cache{opts}",
        "",
        f"open {a['report']} in a browser; figures in {out / 'demo-summary.json'}",
    ]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    from pipeline.cli import module_main

    sys.exit(module_main("demo"))
