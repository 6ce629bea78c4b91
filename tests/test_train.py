"""The trainer on one process (in this process): learning, observability, exact resume, no listing, bad records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from manifests.plan import read_rank_plan
from manifests.progress import INTERVAL_ENV
from tests.test_progress import assert_progress
from tests.test_train_data import corrupt_copy
from tests.train_dataset import train_cli, train_data, train_here  # noqa: F401  (train_data: session fixture)
from train import StopReason
from train.config import DEFAULT_CONFIG

pytestmark = [pytest.mark.ray]

LISTING = ("ls", "find", "glob", "info", "exists", "lexists", "isdir", "isfile", "walk", "du", "listdir")


@pytest.fixture
def run():
    """The trainer as ``python -m train ARGS`` would run it, through the library (``run(job)``:
    :func:`tests.train_dataset.train_here`), in this process, on one thread; returns the TrainResult."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: more threads only contend
    yield train_here
    torch.set_num_threads(threads)


@pytest.fixture
def cli(run):
    """``python -m train ARGS`` in this process (:func:`tests.train_dataset.train_cli`): the exit code, errors
    printed as one line; for the tests of what a user sees."""
    return train_cli


def write_config(path: Path, **settings) -> Path:
    """The tiny default config with ``settings`` changed."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text()) | settings
    path.write_text(yaml.safe_dump(config))
    return path


def records(folder: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (folder / f"rank-{rank}.jsonl").read_text().splitlines()]


def plan_rows(plan: str, rank: int = 0) -> list[tuple[int, int, list[int]]]:
    return [(r["epoch"], r["step"], r["sample_ids"]) for r in read_rank_plan(plan, rank).to_pylist()]


def forbid_listing(monkeypatch, cls) -> list[str]:
    """Make every listing / HEAD-like method of ``cls`` (sync and async) raise; returns the calls seen."""
    calls: list[str] = []

    def forbidden(name):
        def method(self, *args, **kwargs):
            calls.append(f"{name}({args[0] if args else ''})")
            raise AssertionError(f"the trainer called {name}() on storage")

        return method

    for name in LISTING:
        for attr in (name, f"_{name}"):
            if hasattr(cls, attr):
                monkeypatch.setattr(cls, attr, forbidden(attr))
    return calls


def test_loss_goes_down_and_the_run_is_observable(run, train_data, tmp_path):
    from diffusers import PixArtTransformer2DModel

    out, rec = tmp_path / "out", tmp_path / "rec"
    cfg = write_config(tmp_path / "c.yaml", checkpoint_every=20, log_every=10)
    result = run("--plan", train_data.plan1, "--cache", train_data.cache, "--config", cfg, "--output-dir", out,
                 "--record-samples", rec)  # fmt: skip
    assert (result.stop, result.exit_code, result.steps, result.position) == (StopReason.PLAN_FINISHED, 0, 60, 60)
    assert (result.optimizer_steps, result.skipped_records, result.output_dir) == (60, 0, str(out))
    assert result.last_loss is not None and result.last_loss > 0 and result.seconds > 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["position"] for r in rows] == [10, 20, 30, 40, 50, 60]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], [r["loss"] for r in rows]
    for r in rows:
        assert r["samples_per_s"] > 0 and 0 <= r["data_wait"] < 1
        assert 0 < r["tokens_per_step_min"] <= r["tokens_per_step_mean"] <= r["tokens_per_step_max"]
    assert list((out / "logs").rglob("events.out.tfevents.*")), "no TensorBoard events written"
    assert [(r["epoch"], r["step"], r["sample_ids"]) for r in records(rec)] == plan_rows(train_data.plan1)

    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert latest == {"checkpoint": "step-00000060", "kept": ["step-00000040", "step-00000060"]}
    assert not (out / "checkpoints" / "step-00000020").exists()  # keep_checkpoints: 2
    cursor = json.loads((out / "checkpoints" / "step-00000060" / "cursor.json").read_text())
    assert (cursor["epoch"], cursor["step"], cursor["position"], cursor["world_size"]) == (5, 10, 60, 1)
    model = PixArtTransformer2DModel.from_pretrained(out / "model")
    assert model.config.in_channels == 4 and model.config.caption_channels == 32


def test_resume_continues_with_the_batches_and_weights_of_an_uninterrupted_run(run, train_data, tmp_path):
    from safetensors.torch import load_file

    cfg = write_config(tmp_path / "c.yaml", checkpoint_every=5)
    common = ["--plan", train_data.plan1, "--cache", train_data.cache, "--config", cfg]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(*common, "--output-dir", straight, "--record-samples", straight / "rec", "--max-steps", 13).steps == 13
    in_processes = write_config(tmp_path / "p.yaml", checkpoint_every=5, read_processes=2)  # the same batches
    assert run(*common[:-1], in_processes, "--output-dir", resumed, "--record-samples", resumed / "rec",
               "--max-steps", 7).steps == 7  # fmt: skip
    cursor = json.loads((resumed / "checkpoints" / "step-00000007" / "cursor.json").read_text())
    assert (cursor["epoch"], cursor["step"]) == (0, 7)
    result = run(*common, "--output-dir", resumed, "--record-samples", resumed / "rec", "--max-steps", 13, "--resume")
    assert (result.stop, result.steps, result.position) == (StopReason.MAX_STEPS, 6, 13)
    assert (result.epoch, result.step) == (1, 3)  # epoch 1's first 3 steps were run

    assert records(resumed / "rec") == records(straight / "rec") and len(records(straight / "rec")) == 13
    a = load_file(straight / "model" / "diffusion_pytorch_model.safetensors")
    b = load_file(resumed / "model" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_training_never_lists_local_storage(run, train_data, tmp_path, monkeypatch):
    from fsspec.implementations.local import LocalFileSystem

    calls = forbid_listing(monkeypatch, LocalFileSystem)
    result = run("--plan", train_data.plan1, "--cache", train_data.cache, "--output-dir", tmp_path / "out",
             "--record-samples", tmp_path / "rec", "--max-steps", 3)  # fmt: skip
    assert calls == [] and result.stop is StopReason.MAX_STEPS
    recorded = [(r["epoch"], r["step"], r["sample_ids"]) for r in records(tmp_path / "rec")]
    assert recorded == plan_rows(train_data.plan1)[:3]


@pytest.mark.s3
def test_training_never_lists_or_heads_s3(run, train_data, tmp_path, monkeypatch, s3):
    import s3fs

    plan, cache = s3.fresh_url("plan"), s3.fresh_url("cache")
    s3.fs.put(train_data.plan1 + "/", plan + "/", recursive=True)
    s3.fs.put(train_data.cache + "/", cache + "/", recursive=True)
    calls = forbid_listing(monkeypatch, s3fs.S3FileSystem)
    s3fs.S3FileSystem.clear_instance_cache()
    result = run("--plan", plan, "--cache", cache, "--storage-options", json.dumps(s3.storage_options),
             "--output-dir", tmp_path / "out", "--record-samples", tmp_path / "rec", "--max-steps", 3)  # fmt: skip
    assert calls == [] and result.stop is StopReason.MAX_STEPS
    recorded = [(r["epoch"], r["step"], r["sample_ids"]) for r in records(tmp_path / "rec")]
    assert recorded == plan_rows(train_data.plan1)[:3]


def test_a_corrupt_record_stops_the_run_or_is_skipped_when_asked(run, cli, train_data, tmp_path, capsys):
    bad = plan_rows(train_data.plan1)[1][2][0]
    shard = corrupt_copy(train_data.cache, tmp_path / "cache", bad)
    args = ["--plan", train_data.plan1, "--cache", tmp_path / "cache", "--max-steps", 3]
    assert cli(*args, "--output-dir", tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert f"sample {bad} in shard {shard}" in err and "bucketeer verify" in err and "--skip-bad-records" in err
    assert not (tmp_path / "a" / "model").exists()

    result = run(*args, "--output-dir", tmp_path / "b", "--record-samples", tmp_path / "rec", "--skip-bad-records")
    assert (result.stop, result.skipped_records) == (StopReason.MAX_STEPS, 1)
    captured = capsys.readouterr()
    assert f"skipping bad record (--skip-bad-records): sample {bad}" in captured.err
    assert "1 bad records skipped" in captured.out
    assert "loader: read_processes: auto -> " in captured.out  # the default, and what it chose, in the log
    step1 = records(tmp_path / "rec")[1]
    assert step1["skipped"] == [bad] and bad not in step1["sample_ids"] and len(step1["sample_ids"]) == 3


def test_refusals_name_the_problem_and_the_fix(run, cli, train_data, tmp_path, capsys):
    assert cli("--plan", train_data.plan2, "--cache", train_data.cache, "--output-dir", tmp_path / "a") == 2
    assert "is for 2 ranks but 1 processes are running: plan with --world-size 1" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.001\nbatch_size: 4\n")
    assert cli("--plan", train_data.plan1, "--cache", train_data.cache, "--config", cfg, "--output-dir", tmp_path) == 2
    assert "unknown keys ['batch_size']" in capsys.readouterr().err
    # a checkpoint made with one plan is not resumed with another
    out = tmp_path / "b"
    assert run("--plan", train_data.plan1, "--cache", train_data.cache, "--output-dir", out, "--max-steps", 1).steps
    other = tmp_path / "plan-copy"
    shutil.copytree(train_data.plan2, other)
    assert cli("--plan", other, "--cache", train_data.cache, "--output-dir", out, "--resume") == 2
    assert "was trained on another plan" in capsys.readouterr().err


def test_max_steps_between_optimizer_steps_stops_at_the_last_whole_one(
    run, cli, train_data, tmp_path, capsys, monkeypatch
):
    cfg = write_config(tmp_path / "c.yaml", grad_accum=2, checkpoint_every=2)
    common = ["--plan", train_data.plan1a, "--cache", train_data.cache, "--config", cfg,
              "--output-dir", tmp_path / "out", "--record-samples", tmp_path / "rec"]  # fmt: skip
    assert cli(*common, "--max-steps", 1) == 2
    assert "--max-steps 1 is less than one optimizer step (grad_accum: 2" in capsys.readouterr().err
    monkeypatch.setenv(INTERVAL_ENV, "0")  # a progress line per step (stderr is not a terminal here)
    result = run(*common, "--max-steps", 5)
    assert (result.stop, result.steps, result.optimizer_steps) == (StopReason.MAX_STEPS, 4, 2)
    captured = capsys.readouterr()
    assert "stopping after 4 plan steps" in captured.out and "done: --max-steps 4 reached" in captured.out
    assert_progress(captured.err, "train steps", "steps", 4)
    cursor = json.loads((tmp_path / "out" / "checkpoints" / "step-00000004" / "cursor.json").read_text())
    assert (cursor["position"], cursor["optimizer_steps"]) == (4, 2)
    assert json.loads((tmp_path / "out" / "checkpoints" / "latest.json").read_text())["checkpoint"] == "step-00000004"
    assert len(records(tmp_path / "rec")) == 4  # step 5 was not taken: its gradients would have been thrown away
    half = tmp_path / "out" / "checkpoints" / "step-00000006"  # a later save killed before its commit
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 10)
    assert run(*common, "--resume").stop is StopReason.PLAN_FINISHED  # the rest, from the optimizer-step boundary
    assert "checkpoints/step-00000004: epoch 0 step 4" in capsys.readouterr().out  # latest.json, not the newest folder
    assert [(r["epoch"], r["step"], r["sample_ids"]) for r in records(tmp_path / "rec")] == plan_rows(train_data.plan1a)
    cursor = json.loads((tmp_path / "out" / "checkpoints" / "step-00000010" / "cursor.json").read_text())
    assert (cursor["position"], cursor["optimizer_steps"]) == (10, 5)


def test_the_config_must_accumulate_as_the_plan_was_made(cli, train_data, tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path / "c.yaml", grad_accum=1)
    assert cli("--plan", train_data.plan1a, "--cache", train_data.cache, "--config", cfg,
               "--output-dir", tmp_path / "a") == 2  # fmt: skip
    assert "was made with --grad-accum 2 but the config says grad_accum: 1" in capsys.readouterr().err
    # an accelerate config's gradient_accumulation_steps (accelerate launch exports it) may not override the plan
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    assert cli("--plan", train_data.plan1a, "--cache", train_data.cache, "--output-dir", tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert "the accelerate config sets gradient_accumulation_steps: 1" in err and "--grad-accum 2" in err


def test_a_non_finite_loss_stops_the_run_without_saving_its_weights(run, train_data, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", lr=1.0e30, warmup_steps=0, checkpoint_every=1)  # diverges at once
    out = tmp_path / "out"
    result = run("--plan", train_data.plan1, "--cache", train_data.cache, "--config", cfg, "--output-dir", out,
                 "--max-steps", 6)  # fmt: skip
    assert (result.stop, result.exit_code) == (StopReason.NON_FINITE_LOSS, 1)
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: non-finite loss at position "), done
    position = int(done[0].split("position ")[1].split(";")[0])
    assert 1 < position < 6
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())["checkpoint"]
    assert latest == f"step-{position - 1:08d}"  # the last finite step's checkpoint, not the diverged one
    assert not (out / "model").exists()


def test_a_plan_written_in_windows_trains_to_its_last_planned_epoch_and_resumes_once_extended(
    run, train_data, tmp_path, capsys
):
    from pipeline.cli import main as bucketeer

    plan = str(tmp_path / "plan")
    argv = [train_data.manifest, "--world-size", "1", "--batch-size", "4", "--epochs", "6", "--seed", "3",
            "--cache", train_data.cache]  # fmt: skip
    assert bucketeer(["plan", *argv[:1], "--out", plan, *argv[1:], "--window", "2"]) == 0
    cfg = write_config(tmp_path / "c.yaml", checkpoint_every=10)
    common = ["--plan", plan, "--cache", train_data.cache, "--config", cfg, "--output-dir", tmp_path / "out",
              "--record-samples", tmp_path / "rec"]  # fmt: skip
    capsys.readouterr()
    assert run(*common).stop is StopReason.WINDOW_FINISHED
    out = capsys.readouterr().out
    assert "the plan holds epochs up to 1 of 6: this run stops there" in out and "60 optimizer steps in the" in out
    assert "done: planned epochs finished" in out and len(records(tmp_path / "rec")) == 20
    assert bucketeer(["plan", *argv[:1], "--extend", plan, *argv[5:]]) == 0  # the rest, same --cache
    assert run(*common, "--resume").stop is StopReason.PLAN_FINISHED
    assert "done: plan finished" in capsys.readouterr().out
    # the same rows as the plan made at once: windows change nothing but when epochs are written
    assert [(r["epoch"], r["step"], r["sample_ids"]) for r in records(tmp_path / "rec")] == plan_rows(train_data.plan1)
