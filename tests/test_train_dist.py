"""The trainer on two real processes (accelerate launch, torch.distributed over gloo on the CPU).

Every run here accumulates gradients over 2 plan steps (a plan made with ``--grad-accum 2``). One
uninterrupted 2-process run; one run SIGKILLed right after its first checkpoint: resumed on 2
processes it must reproduce the uninterrupted run's batches and weights, resumed on 1 process it
must cover the rest of the epoch exactly (the plan is re-cut for 1 rank); one run preempted with
SIGTERM to the launcher: it must finish its optimizer step, checkpoint and stop, and its resume
must reproduce the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from manifests.faults import FAULTS_ENV, pause_marker
from manifests.plan import read_plan_meta, read_rank_plan
from tests.conftest import free_port
from tests.test_train import records, write_config
from tests.train_dataset import train_data  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIG = ROOT / "infra" / "accelerate" / "cpu-2proc.yaml"
PAUSED = pause_marker("train.checkpoint")


def command(processes: int, *argv) -> list[str]:
    """``python -m train`` on one process, ``accelerate launch`` on 127.0.0.1 for more."""
    train = ["-m", "train", *map(str, argv)]
    if processes == 1:
        return [sys.executable, *train]
    config = (["--config_file", str(ACCELERATE_CONFIG)] if ACCELERATE_CONFIG.exists()
              else ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no"])  # fmt: skip
    return [sys.executable, "-m", "accelerate.commands.launch", *config, "--num_processes", str(processes),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), *train]  # fmt: skip


def environment(**extra: str) -> dict[str, str]:
    # ACCELERATE_USE_CPU: the multi-process launcher picks the CPU and gloo; one thread per process (2 cores)
    return {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it: torchrun starts its workers in their own sessions,
    so killing the launcher's process group alone would leave the ranks running."""
    import psutil

    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    os.killpg(proc.pid, signal.SIGKILL)
    for child in victims:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(victims, timeout=10)


def launch(processes: int, *argv, timeout: float = 240) -> str:
    """Run to completion in its own process group; returns the output, fails the test on a non-zero exit."""
    proc = subprocess.Popen(command(processes, *argv), cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        kill_tree(proc)
        shown = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        pytest.fail(f"the run did not finish in {timeout} s; its output:\n{shown[-6000:]}")
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, output[-4000:]
    return output


def rows(plan: str, rank: int) -> list[tuple[int, int, list[int]]]:
    return [(r["epoch"], r["step"], r["sample_ids"]) for r in read_rank_plan(plan, rank).to_pylist()]


def consumed(folder: Path, rank: int) -> list[tuple[int, int, list[int]]]:
    return [(r["epoch"], r["step"], r["sample_ids"]) for r in records(folder, rank)]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("train-dist") / "c.yaml", checkpoint_every=4, log_every=5,
                        grad_accum=2)  # fmt: skip


@pytest.fixture(scope="module")
def straight(train_data, config, tmp_path_factory) -> Path:
    """An uninterrupted 2-process run over plan2a (2 epochs x 10 steps, 5 optimizer steps each)."""
    out = tmp_path_factory.mktemp("straight")
    launch(2, "--plan", train_data.plan2a, "--cache", train_data.cache, "--config", config, "--output-dir", out,
           "--record-samples", out / "rec")  # fmt: skip
    return out


def paused_run(out: Path, *argv) -> tuple[subprocess.Popen, list[str]]:
    """Start a 2-process run that pauses right after its first checkpoint; returns once both ranks have
    paused (a signal sent while one rank is still checkpointing would reach it before its pause)."""
    env = environment(**{FAULTS_ENV: "train.checkpoint=pause:300"})
    proc = subprocess.Popen(command(2, *argv), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    seen = []
    try:
        deadline = time.time() + 240
        for line in proc.stdout:
            seen.append(line)
            if "".join(seen).count(PAUSED) >= 2 or time.time() > deadline:
                break
        assert proc.poll() is None and "".join(seen).count(PAUSED) >= 2, "".join(seen)[-4000:]
    except BaseException:
        kill_tree(proc)
        raise
    return proc, seen


@pytest.fixture(scope="module")
def killed(train_data, config, tmp_path_factory) -> Path:
    """A 2-process run SIGKILLed (launcher and ranks) while paused right after its first checkpoint."""
    out = tmp_path_factory.mktemp("killed")
    proc, _ = paused_run(out, "--plan", train_data.plan2a, "--cache", train_data.cache, "--config", config,
                         "--output-dir", out, "--record-samples", out / "rec")  # fmt: skip
    kill_tree(proc)
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["checkpoint"] == "step-00000004"
    snapshot = tmp_path_factory.mktemp("killed-snapshot") / "out"
    shutil.copytree(out, snapshot)
    return snapshot


def test_each_rank_trains_on_exactly_its_plan_rows(straight, train_data):
    mine = {rank: consumed(straight / "rec", rank) for rank in (0, 1)}
    for rank in (0, 1):
        assert mine[rank] == rows(train_data.plan2a, rank)  # unchanged: no re-sharding, no duplication
        assert {r["rank"] for r in records(straight / "rec", rank)} == {rank}
    assert len(mine[0]) == len(mine[1]) == 20
    for epoch in (0, 1):
        ids = [[i for e, _, batch in mine[rank] if e == epoch for i in batch] for rank in (0, 1)]
        assert not set(ids[0]) & set(ids[1])  # the ranks share no sample within an epoch
        assert len(ids[0]) + len(ids[1]) == len(set(ids[0]) | set(ids[1])) == 40
    metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [m["position"] for m in metrics] == [5, 10, 15, 20]
    assert all(m["tokens_per_step_min"] <= m["tokens_per_step_mean"] <= m["tokens_per_step_max"] for m in metrics)
    cursor = json.loads((straight / "checkpoints" / "step-00000020" / "cursor.json").read_text())
    assert (cursor["epoch"], cursor["step"], cursor["world_size"]) == (1, 10, 2)


def test_accumulation_makes_one_optimizer_step_per_grad_accum_plan_steps(straight, train_data):
    assert read_plan_meta(train_data.plan2a).inputs.grad_accum == 2
    cursor = json.loads((straight / "checkpoints" / "step-00000020" / "cursor.json").read_text())
    assert cursor["optimizer_steps"] == 20 // 2
    scheduler = torch.load(straight / "checkpoints" / "step-00000020" / "scheduler.bin", weights_only=True)
    assert scheduler["last_epoch"] == 10  # stepped once per optimizer step
    # the schedule is as long as the run: 5 warm-up + 5 cosine updates end at lr 0 (a schedule of 20 would not)
    lrs = [json.loads(line)["lr"] for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12) and max(lrs) > 0
    first = json.loads((straight / "checkpoints" / "step-00000016" / "cursor.json").read_text())
    assert first["optimizer_steps"] == 8  # checkpoints fall on optimizer steps


def assert_same_run(straight: Path, out: Path) -> None:
    """Same batches on every rank, weights within float tolerance."""
    from safetensors.torch import load_file

    for rank in (0, 1):
        assert consumed(out / "rec", rank) == consumed(straight / "rec", rank)
    a = load_file(straight / "model" / "diffusion_pytorch_model.safetensors")
    b = load_file(out / "model" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_kill_and_resume_reproduces_the_uninterrupted_run(straight, killed, train_data, config, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(killed, out)
    launch(2, "--plan", train_data.plan2a, "--cache", train_data.cache, "--config", config, "--output-dir", out,
           "--record-samples", out / "rec", "--resume")  # fmt: skip
    assert_same_run(straight, out)


@pytest.mark.full
def test_sigterm_checkpoints_at_the_next_optimizer_step_and_the_resume_completes_the_run(
    straight, train_data, config, tmp_path
):
    """A preemption: SIGTERM to the launcher only (torchrun forwards it to the ranks), mid-run."""
    out = tmp_path / "out"
    argv = ["--plan", train_data.plan2a, "--cache", train_data.cache, "--config", config, "--output-dir", out,
            "--record-samples", out / "rec"]  # fmt: skip
    proc, seen = paused_run(out, *argv)  # paused after the checkpoint at plan step 4
    try:
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    output = "".join(seen) + rest
    assert "done: stop requested (SIGTERM)" in output, output[-4000:]
    # the step under way (5) belongs to the optimizer step ending at 6: finished, then a checkpoint, then the stop
    cursor = json.loads((out / "checkpoints" / "step-00000006" / "cursor.json").read_text())
    assert (cursor["epoch"], cursor["step"], cursor["position"], cursor["optimizer_steps"]) == (0, 6, 6, 3)
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["checkpoint"] == "step-00000006"
    assert [len(records(out / "rec", rank)) for rank in (0, 1)] == [6, 6]

    launch(2, *argv, "--resume")
    assert_same_run(straight, out)


def test_resume_on_one_process_after_two_covers_the_epoch_exactly(killed, train_data, config, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(killed, out)
    launch(1, "--plan", train_data.plan2a, "--cache", train_data.cache, "--config", config, "--output-dir", out,
           "--record-samples", out / "rec", "--resume")  # fmt: skip
    two = {rank: consumed(out / "rec", rank) for rank in (0, 1)}
    before = [r for r in two[0] if (r[0], r[1]) < (0, 4)]
    assert before == rows(train_data.plan2a, 0)[:4] and two[1] == rows(train_data.plan2a, 1)[:4]
    after = two[0][4:]  # rank 0's file continues with the 1-process steps
    assert [(e, s) for e, s, _ in after] == [(0, s) for s in range(4, 10)] + [(1, s) for s in range(10)]

    epoch0 = Counter(i for rank in (0, 1) for e, _, batch in two[rank] if e == 0 for i in batch)
    everything = {i for rank in (0, 1) for _, _, batch in rows(train_data.plan2a, rank) for i in batch}
    assert set(epoch0) == everything and set(epoch0.values()) == {1}  # every sample once: none skipped, none repeated
    planned = {(e, s): set(b0) | set(b1) for (e, s, b0), (_, _, b1) in zip(rows(train_data.plan2a, 0),
                                                                          rows(train_data.plan2a, 1))}  # fmt: skip
    for e, s, batch in after:
        assert len(batch) == 4 and set(batch) == planned[(e, s)]  # the same global batches, now on one rank

    plans = out / "plans" / "resume-00000004-w1"
    assert read_plan_meta(str(plans)).resumed_from.world_size == 2
    cursor = json.loads((out / "checkpoints" / "latest.json").read_text())["checkpoint"]
    final = json.loads((out / "checkpoints" / cursor / "cursor.json").read_text())
    assert (final["epoch"], final["step"], final["world_size"], final["position"]) == (1, 10, 1, 20)
