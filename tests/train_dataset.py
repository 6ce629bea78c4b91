"""One tiny dataset -> manifest -> cache -> plans, built once per test session for the trainer tests.

``build(base)`` is idempotent: the first caller (any trainer test module) embeds, later callers
reuse the folders (embedding on 2 shared cores is the slow part). 40 smooth random images in three
buckets (64x64: 16, 128x32: 12, 32x128: 12) with repeating captions, some missing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pyarrow as pa
from PIL import Image

from manifests.buckets import BucketSpec
from manifests.manifest import apply_buckets, write_manifest
from manifests.schema import ERRORS_SCHEMA, sample_ids

SPEC = BucketSpec(area=64 * 64, step=32)
# (w, h) -> bucket: 16 x 64x64, 12 x 128x32, 12 x 32x128
SIZES = [(80, 80)] * 16 + [(150, 40)] * 12 + [(40, 150)] * 12


@dataclass(frozen=True)
class TrainData:
    root: str
    manifest: str
    cache: str
    plan2: str  # 2 ranks x 2 samples, 2 epochs: 10 steps per epoch
    plan1: str  # 1 rank x 4 samples, 6 epochs: 10 steps per epoch
    plan2a: str  # plan2 made with --grad-accum 2: 5 optimizer steps per epoch
    plan1a: str  # 1 rank x 4 samples, 1 epoch, --grad-accum 2


def _png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 255, (3, 3, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((w, h), Image.BILINEAR).save(buf, "PNG")  # smooth: something a model can learn
    return buf.getvalue()


def build(base: Path) -> TrainData:
    """Build (or reuse) the dataset under ``base``; needs Ray (the embed job)."""
    from pipeline import EmbedJob, PlanJob, run

    data = TrainData(str(base / "images"), str(base / "manifest"), str(base / "cache"),
                     str(base / "plan2"), str(base / "plan1"), str(base / "plan2a"), str(base / "plan1a"))  # fmt: skip
    if (Path(data.plan1a) / "_plan.json").exists():
        return data
    os.makedirs(data.root, exist_ok=True)
    names, rows = [], []
    for i, (w, h) in enumerate(SIZES):
        name = f"img_{i:03d}.png"
        blob = _png(w, h, i)
        Path(data.root, name).write_bytes(blob)
        names.append(name)
        rows.append((w, h, None if i % 7 == 0 else f"a picture of shape {i % 4}", len(blob)))
    table = pa.table({
        "sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
        "width": pa.array([r[0] for r in rows], pa.int32()), "height": pa.array([r[1] for r in rows], pa.int32()),
        "caption": pa.array([r[2] for r in rows], pa.string()), "size": pa.array([r[3] for r in rows], pa.int64()),
    })  # fmt: skip
    samples, rejects = apply_buckets(table, SPEC)
    assert rejects.num_rows == 0
    write_manifest(data.manifest, samples, ERRORS_SCHEMA.empty_table(), source=data.root, spec=SPEC)
    run(EmbedJob(manifest=data.manifest, out=data.cache, batch_size=8, shard_records=8))
    plans = ((data.plan2, 2, 2, 2, 1), (data.plan1, 1, 4, 6, 1), (data.plan2a, 2, 2, 2, 2), (data.plan1a, 1, 4, 1, 2))
    for out, world, batch, epochs, accum in plans:
        run(PlanJob(manifests=(data.manifest,), out=out, world_size=world, batch_size=batch, epochs=epochs, seed=3,
                    cache=(data.cache,), grad_accum=accum))  # fmt: skip
    return data


@pytest.fixture(scope="session")
def train_data(tmp_path_factory, ray_local) -> TrainData:
    """The session's tiny dataset, cache and plans (embedded with the default tiny encoders)."""
    base = tmp_path_factory.getbasetemp() / "train-data"
    old = os.environ.get("BUCKETEER_HOME")
    os.environ["BUCKETEER_HOME"] = str(base / "home")  # default encoders built here, not in ~/.cache
    try:
        return build(base)
    finally:
        if old is None:
            os.environ.pop("BUCKETEER_HOME", None)
        else:
            os.environ["BUCKETEER_HOME"] = old


def train_here(*argv):
    """Train as ``python -m train ARGV`` would, in this process, through the library: ``run(job_from_args(ARGV))``.

    Returns the :class:`train.TrainResult`; an error a user can fix is raised (a BucketeerError), not printed
    (:func:`train_cli` for the command line's one-line errors and exit codes). Accelerate's process-wide
    state is reset afterwards.
    """
    from train import job_from_args, run

    with _fresh_accelerate():
        return run(job_from_args([str(a) for a in argv]))


def train_cli(*argv) -> int:
    """``python -m train ARGV`` in this process (``train.__main__.main``): the exit code; errors printed as one line."""
    from train.__main__ import main

    with _fresh_accelerate():
        return main([str(a) for a in argv])


def write_settings(path: Path, **settings) -> Path:
    """A training config at ``path``: log and checkpoint every step, no validation, then ``settings``."""
    path.write_text(json.dumps({"lr": 1e-3, "warmup_steps": 0, "log_every": 1, "checkpoint_every": 1,
                                "validation_every": 0, **settings}))  # fmt: skip
    return path


def train_quiet(*argv) -> tuple[Any, str]:
    """The trainer in this process on one thread: its result and what it printed."""
    import torch

    threads, out = torch.get_num_threads(), io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            result = train_here(*map(str, argv))
    finally:
        torch.set_num_threads(threads)
    return result, out.getvalue()


def logged_losses(out: Path) -> list[float]:
    """The loss of every logged step of the run whose output folder is ``out``."""
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def recipe_outputs(denoiser, model: Any, batch) -> Any:
    """``model``'s prediction on ``batch`` with the recipe's inputs and the noise of plan position 0."""
    import torch

    from train.model import step_generator

    outputs = []
    hook = model.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    try:
        with torch.no_grad():
            denoiser.loss(model, batch, step_generator(0, 0, 0, 0))
    finally:
        hook.remove()
    return outputs[0]


def printed_code(printed: str, after: str) -> str:
    """The indented code lines the trainer printed after the line containing ``after``."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) + 1
    code = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        code.append(line[4:])
    return "\n".join(code)


def assert_same_files(first: Path, second: Path, names) -> None:
    """Each safetensors file ``names`` (relative paths) holds the same non-empty tensors, bit for bit, in the
    run folders ``first`` and ``second``: what an exact resume leaves."""
    import torch
    from safetensors.torch import load_file

    for name in names:
        a, b = load_file(first / name), load_file(second / name)
        assert a.keys() == b.keys() and a, name
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


@contextlib.contextmanager
def _fresh_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
