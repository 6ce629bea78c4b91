"""Checkpoints at any ``--output-dir`` (local or a URL): ``accelerator.save_state``, the plan cursor, a commit;
and the run's final weights (:func:`save_weights`).

Layout under ``--output-dir`` (:mod:`train.output`)::

    checkpoints/step-00000120/   accelerate state (model.safetensors, optimizer.bin, scheduler.bin,
                                 random_states_<rank>.pkl) + cursor.json (the cursor and the files);
                                 a LoRA run: adapters.safetensors + lora.json instead of model.safetensors
                                 (:func:`train.lora.register_adapter_checkpoints`), no frozen base weights;
                                 with ema_decay ema.safetensors, or under FSDP2 ema/ (a shard per rank) and
                                 ema.json (:mod:`train.ema`)
    checkpoints/latest.json      {"checkpoint": "step-00000120", "kept": [...]}, written last
    plans/resume-00000120-w4/    the plan an elastic resume wrote for 4 ranks (see resume_elastic)

Saving: every rank saves into its node's folder, each node uploads what its ranks wrote, a
collective proves every upload finished, then the main process writes ``cursor.json`` and
``latest.json``: the commit point. A folder that ``latest.json`` does not name (a save killed
half-way) is never chosen. Resuming: every node reads ``latest.json`` and downloads the files
``cursor.json`` lists (no listing) into its own folder; nothing needs a shared filesystem.
What is read back is safetensors, JSON, or tensors that accelerate loads with
``torch.load(weights_only=True)``: no pickle.

Resuming needs no replay: the batches are the plan rows from ``(epoch, step)`` on, and the
noise of a step is a function of its position (:func:`train.model.step_generator`), so a resumed
run sees exactly what an uninterrupted one would have seen.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from manifests import faults
from manifests.errors import UsageError
from manifests.plan import PlanMeta, read_plan_meta, resume_plan
from manifests.storage import join, read_json, write_json_atomic
from train.output import OutputDir

if TYPE_CHECKING:
    from train.lora import LoraRecord

__all__ = ["Cursor", "Checkpoint", "find_checkpoint", "fetch_checkpoint", "save_checkpoint", "resume_elastic",
           "truncate_records", "save_weights"]  # fmt: skip

CURSOR_FILE = "cursor.json"
LATEST_FILE = "latest.json"


@dataclass(frozen=True)
class Cursor:
    """Where training stands: ``(epoch, step)`` is the first plan step not yet run.

    ``position``: plan steps run since the start of the root plan (every rank runs the same
    number). ``plan_url``: the plan being followed (an elastic resume writes a new one);
    ``root_fingerprint``: the fingerprint of the plan the run was started with (the same after
    ``bucketeer plan --extend``).
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
    def start(cls, plan_meta: PlanMeta, plan_url: str, world_size: int) -> "Cursor":
        first = plan_meta.epochs[0]
        fp = plan_meta.fingerprint
        return cls(first.epoch, first.first_step, world_size, 0, 0, plan_url, fp, fp)

    def after(self, epoch: int, step: int, *, optimizer_steps: int) -> "Cursor":
        """The cursor once step ``(epoch, step)`` has run on every rank."""
        return replace(self, epoch=epoch, step=step + 1, position=self.position + 1, optimizer_steps=optimizer_steps)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its folder name under ``checkpoints/``, cursor and files (relative path: bytes)."""

    name: str
    cursor: Cursor
    files: dict[str, int]

    @property
    def rel(self) -> str:
        return f"checkpoints/{self.name}"


def find_checkpoint(output: OutputDir) -> Checkpoint | None:
    """The checkpoint ``latest.json`` names, or None when there is none. Reads two small JSON files.

    Raises UsageError when ``latest.json`` names a checkpoint without a readable ``cursor.json``.
    """
    latest = join(output.root, "checkpoints", LATEST_FILE)
    try:
        name = read_json(output.fs, latest)["checkpoint"]
    except FileNotFoundError:
        return None
    path = join(output.root, "checkpoints", name, CURSOR_FILE)
    try:
        saved = read_json(output.fs, path)
        cursor = Cursor(**{f: saved[f] for f in Cursor.__dataclass_fields__})
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"checkpoint {output.name('checkpoints', name)} has no valid {CURSOR_FILE} ({e}); "
                         f"delete {output.name('checkpoints', LATEST_FILE)} to start over") from None  # fmt: skip
    return Checkpoint(name, cursor, {k: int(v) for k, v in saved["files"].items()})


def fetch_checkpoint(accelerator, output: OutputDir, checkpoint: Checkpoint) -> Path:
    """The local folder to ``load_state`` from: each node's local main process downloads the checkpoint's
    files there (a local ``--output-dir`` is used as it is). Call it on every process."""
    with accelerator.local_main_process_first():
        if accelerator.is_local_main_process:
            output.download(checkpoint.rel, checkpoint.files)
    return output.local(checkpoint.rel)


def save_checkpoint(accelerator, output: OutputDir, cursor: Cursor, keep: int) -> str:
    """Save, upload and commit a checkpoint; keep the last ``keep``. Returns its folder name.

    Call it on every process at the same step: ``save_state`` on every rank into its node's
    folder, one upload per node, a gather that proves all uploads finished, then the main process
    writes ``cursor.json`` and ``latest.json`` (the commit point) and removes older checkpoints.
    """
    from accelerate.utils import gather_object

    name = f"step-{cursor.position:08d}"
    rel = f"checkpoints/{name}"
    accelerator.save_state(str(output.local(rel)), safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank of every node has written its files
    files = output.upload(rel) if accelerator.is_local_main_process else {}
    uploaded = gather_object([files])  # a collective: returns once every node has uploaded
    if accelerator.is_main_process:
        merged = {f: size for node in uploaded for f, size in node.items()}
        saved = {**asdict(cursor), "files": merged}
        write_json_atomic(output.fs, join(output.root, rel, CURSOR_FILE), saved)
        latest = join(output.root, "checkpoints", LATEST_FILE)
        try:
            kept = read_json(output.fs, latest).get("kept", [])
        except FileNotFoundError:
            kept = []
        kept = [k for k in kept if k != name] + [name]
        write_json_atomic(output.fs, latest, {"checkpoint": name, "kept": kept[-keep:]})  # the commit point
        for old in kept[:-keep]:
            output.remove(f"checkpoints/{old}")
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process:
        output.drop_local_copy(rel)
    faults.hit("train.checkpoint")  # tests: kill or preempt a run right after a checkpoint
    return name


def save_weights(accelerator, model, output: OutputDir, name: str, lora: LoraRecord | None = None) -> None:
    """The final weights as ``OUTPUT/<name>``: the whole model (``model``, ``model_ema``: ``from_pretrained``
    loads it), or with ``lora`` (the run's record, its ``steps`` set) the adapters (``lora``, ``lora_ema``: the
    family pipeline's ``load_lora_weights`` loads them, :mod:`train.lora`). Call it on every rank (FSDP /
    ZeRO-3 gather the shards of a whole model)."""
    from train.backends import save_model
    from train.lora import export_parts, save_lora

    folders = [name]
    if lora is not None:  # a model of several experts: one export each (lora, lora_2)
        parts = export_parts(accelerator.unwrap_model(model), name)
        folders = [folder for folder, _ in parts]
        if accelerator.is_main_process:
            for folder, part in parts:
                save_lora(part, output.local(folder), lora)
    else:
        save_model(accelerator, model, output.local(name))  # every rank: FSDP / ZeRO-3 gather shards here
    if accelerator.is_main_process:
        for folder in folders:
            output.upload(folder)


def resume_elastic(
    cursor: Cursor, root_url: str, root_meta: PlanMeta, output: OutputDir, world_size: int,
    storage_options: dict | None, *, write: bool,
) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """The plan to follow from ``cursor`` on ``world_size`` ranks: ``(url, _plan.json)``.

    The root plan's world size: the root plan. Otherwise the rest of the root plan from the cursor,
    re-cut for ``world_size`` ranks (``manifests.plan.resume_plan``), written under the output
    folder's ``plans/`` when ``write`` (one process writes, the others read it after a barrier).
    Always from the root plan, so epochs added to it by ``--extend`` since are re-cut too. Raises
    ValueError when the global batch does not split over ``world_size`` ranks.
    """
    if root_meta.inputs.world_size == world_size:
        return root_url, root_meta
    rel = f"plans/resume-{cursor.position:08d}-w{world_size}"
    url, options = output.url_of(rel), (None if output.is_local else output.fs.storage_options)
    if write:
        resume_plan(root_url, url, epoch=cursor.epoch, step=cursor.step, world_size=world_size,
                    storage_options=_options(root_url, storage_options), out_storage_options=options)  # fmt: skip
    return url, read_plan_meta(url, options)


def _options(url: str, storage_options: dict | None) -> dict | None:
    """``--storage-options`` apply to URLs; a plan in a local folder takes none."""
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
