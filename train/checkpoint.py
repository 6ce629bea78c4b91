"""Checkpoints: ``accelerator.save_state`` plus the plan cursor, a handful of integers in a small JSON.

Layout under ``--output-dir``::

    checkpoints/step-00000120/   accelerate state (model.safetensors, optimizer, scheduler, RNG) + cursor.json
    checkpoints/latest.json      {"checkpoint": "step-00000120", "kept": [...]}, written last
    plans/resume-00000120-w4/    the plan an elastic resume wrote for 4 ranks (see resume_elastic)

Resuming needs no replay: the batches are the plan rows from ``(epoch, step)`` on, and the
noise of a step is a function of its position (:func:`train.model.step_generator`), so a resumed
run sees exactly what an uninterrupted one would have seen. Nothing here lists storage; the
latest checkpoint is named by ``latest.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from manifests import faults
from manifests.errors import UsageError
from manifests.plan import read_plan_meta, resume_plan

__all__ = ["Cursor", "Checkpoint", "find_checkpoint", "save_checkpoint", "resume_elastic", "truncate_records"]

CURSOR_FILE = "cursor.json"
LATEST_FILE = "latest.json"


@dataclass(frozen=True)
class Cursor:
    """Where training stands: ``(epoch, step)`` is the first plan step not yet run.

    ``position``: plan steps run since the start of the root plan (every rank runs the same
    number). ``plan_url``: the plan being followed (an elastic resume writes a new one);
    ``root_fingerprint``: the fingerprint of the plan the run was started with.
    """

    epoch: int
    step: int
    world_size: int
    position: int
    optimizer_steps: int
    plan_url: str
    plan_fingerprint: str
    root_fingerprint: str

    @classmethod
    def start(cls, plan_meta: dict[str, Any], plan_url: str, world_size: int) -> "Cursor":
        first = plan_meta["epochs"][0]
        fp = plan_meta["fingerprint"]
        return cls(first["epoch"], first["first_step"], world_size, 0, 0, plan_url, fp, fp)

    def after(self, epoch: int, step: int, *, optimizer_steps: int) -> "Cursor":
        """The cursor once step ``(epoch, step)`` has run on every rank."""
        return replace(self, epoch=epoch, step=step + 1, position=self.position + 1, optimizer_steps=optimizer_steps)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    cursor: Cursor


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one


def find_checkpoint(output_dir: str | Path) -> Checkpoint | None:
    """The latest checkpoint under ``output_dir``, or None when there is none.

    Raises ValueError when ``latest.json`` names a checkpoint without a readable cursor.
    """
    latest = Path(output_dir) / "checkpoints" / LATEST_FILE
    if not latest.exists():
        return None
    name = json.loads(latest.read_text())["checkpoint"]
    path = latest.parent / name
    try:
        cursor = Cursor(**json.loads((path / CURSOR_FILE).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError) as e:
        raise UsageError(f"checkpoint {path} has no valid {CURSOR_FILE} ({e}); delete {latest} to start over") from None
    return Checkpoint(path, cursor)


def save_checkpoint(accelerator, output_dir: str | Path, cursor: Cursor, keep: int) -> Path:
    """``save_state`` on every rank, then (main process) the cursor and ``latest.json``; keeps ``keep``.

    Call it on every process at the same step (it waits for all of them).
    """
    root = Path(output_dir) / "checkpoints"
    name = f"step-{cursor.position:08d}"
    accelerator.save_state(str(root / name))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_json(root / name / CURSOR_FILE, asdict(cursor))
        latest = root / LATEST_FILE
        kept = json.loads(latest.read_text()).get("kept", []) if latest.exists() else []
        kept = [k for k in kept if k != name] + [name]
        _write_json(latest, {"checkpoint": name, "kept": kept[-keep:]})  # the commit point
        for old in kept[:-keep]:
            shutil.rmtree(root / old, ignore_errors=True)
    accelerator.wait_for_everyone()
    faults.hit("train.checkpoint")  # tests: kill or preempt a run right after a checkpoint
    return root / name


def resume_elastic(
    cursor: Cursor, output_dir: str | Path, world_size: int, storage_options: dict | None, *, write: bool
) -> tuple[str, dict[str, Any]]:
    """The plan to follow from ``cursor`` on ``world_size`` ranks: ``(url, _plan.json)``.

    Same world size: the cursor's plan. Otherwise the rest of that plan re-cut for
    ``world_size`` ranks (``manifests.plan.resume_plan``), written under ``output_dir/plans``
    when ``write`` (one process writes, the others read it after a barrier). Raises ValueError
    when the global batch does not split over ``world_size`` ranks.
    """
    if cursor.world_size == world_size:
        return cursor.plan_url, read_plan_meta(cursor.plan_url, _options(cursor.plan_url, storage_options))
    out = str(Path(output_dir) / "plans" / f"resume-{cursor.position:08d}-w{world_size}")
    if write:
        resume_plan(cursor.plan_url, out, epoch=cursor.epoch, step=cursor.step, world_size=world_size,
                    storage_options=_options(cursor.plan_url, storage_options))  # fmt: skip
    return out, read_plan_meta(out)


def _options(url: str, storage_options: dict | None) -> dict | None:
    """``--storage-options`` apply to URLs; a plan written under --output-dir is a local folder."""
    return storage_options if "://" in url else None


def truncate_records(record_dir: str | Path, ranks: int, cursor: Cursor) -> None:
    """Drop the lines of ``rank-<r>.jsonl`` at or after the cursor: steps a killed run took past its checkpoint.

    After this the files hold exactly the steps the resumed weights were trained on.
    """
    for rank in range(ranks):
        path = Path(record_dir) / f"rank-{rank}.jsonl"
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        keep = [line for line in lines if _before(line, cursor)]
        _write_json_lines(path, keep)


def _before(line: str, cursor: Cursor) -> bool:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:  # the half-written last line of a killed run
        return False
    return (row["epoch"], row["step"]) < (cursor.epoch, cursor.step)


def _write_json_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
