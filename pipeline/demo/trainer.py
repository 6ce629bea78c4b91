"""The demo's training stage: ``accelerate launch -m train`` on 2 CPU processes (gloo), its log echoed,
and every rank stopped with the launcher, also when the demo is interrupted."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from manifests.errors import BucketeerError
from pipeline.demo.local_s3 import free_port

ROOT = Path(__file__).resolve().parent.parent.parent
ACCELERATE_CONFIG = ROOT / "infra" / "accelerate" / "cpu-2proc.yaml"
WORLD_SIZE = 2  # processes of infra/accelerate/cpu-2proc.yaml


def accelerate_launch() -> list[str]:
    """``accelerate launch`` with the 2-process CPU config on a free port (another run may hold 29500)."""
    exe = Path(sys.executable).parent / "accelerate"
    launch = [str(exe), "launch"] if exe.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
    if ACCELERATE_CONFIG.exists():
        config = ["--config_file", str(ACCELERATE_CONFIG)]
    else:  # installed without the repository's infra/: the same settings as flags
        config = ["--multi_gpu", "--num_processes", str(WORLD_SIZE), "--num_machines", "1", "--mixed_precision", "no",
                  "--dynamo_backend", "no"]  # fmt: skip
    return [*launch, *config, "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]


def family_config(family: str, out: Path, *, plan_steps: int, repa: bool = False) -> list[str]:
    """``--config`` for the trainer: none for pixart (the tiny default), else a small fine-tuning config;
    ``repa``: with the REPA term (``repa:``, on the first transformer block)."""
    term = "repa: {weight: 0.5, depth: 0, projector_dim: 64}  # REPA on block 0 (a real model: ~1/3 deep)\n"
    if family == "pixart":
        if not repa:
            return []
        text = "# written by bucketeer demo --repa: the tiny from-scratch transformer with REPA\nlr: 1.0e-3\n" + term
    elif family == "qwen-image-edit":  # its empty instruction and any prompt need a reference image: neither
        text = (f"# written by bucketeer demo --family {family}: the tiny {family} model fine-tuned on the CPU on\n"
                "# (target, reference) pairs; no caption dropout and no validation images (each needs a reference)\n"
                f"family: {family}\nlr: 1.0e-4\nwarmup_steps: 5\nema_decay: 0.99\ncheckpoint_every: 100\n"
                "log_every: 10\n")  # fmt: skip
    else:
        text = (
            f"# written by bucketeer demo --family {family}: the tiny {family} model fine-tuned on the CPU;\n"
            "# validation images after the last step\n"
            f"family: {family}\nlr: 1.0e-4\nwarmup_steps: 5\ncaption_dropout: 0.1\nema_decay: 0.99\n"
            + ("expert: both  # LoRA on both experts, one per optimizer step (expert: high / low: one per run)\n"
               "lora_rank: 8\n" if family == "wan2.2-a14b" else "")
            + ("validation_frames: 9  # 8k + 1, short: the tiny pipeline runs its audio stream too\n"
               if family == "ltx-2" else "")
            + f"checkpoint_every: 100\nlog_every: 10\nvalidation_every: {plan_steps}\nvalidation_steps: 4\n"
            "validation_guidance: 3.0\nvalidation_size: 64\n" + (term if repa else "")
        )  # fmt: skip
    config = out / "train-config.yaml"
    config.write_text(text)
    return ["--config", str(config)]


def train(train_argv: list[str], out: Path) -> None:
    """``accelerate launch -m train TRAIN_ARGV`` on 2 processes; its output goes to ``out/train.log`` (its key
    lines are echoed). Raises BucketeerError with the log's last lines when it fails."""
    argv = [*accelerate_launch(), "-m", "train", *train_argv]
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


