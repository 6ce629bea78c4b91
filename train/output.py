"""The trainer's ``--output-dir``: a local folder or any fsspec URL (``s3://bucket/run``), seen by every node.

What is written there (checkpoints, the final model, metrics, TensorBoard logs, elastic-resume
plans) is first written by each node into a local folder, then uploaded; for a local
``--output-dir`` that local folder is the output folder itself and nothing is uploaded (one code
path: fsspec's local filesystem). The node-local folder of a URL is
``$BUCKETEER_SCRATCH`` (default: the system temp folder) ``/bucketeer-train/<hash of the URL>/node-<R>``,
``R`` being the first rank of the node.

Several nodes need an output folder they all see: every rank resumes from ``latest.json``, which
the main process writes. A URL is shared by definition; a local path is checked at start
(:func:`check_shared`): the main process writes a marker file, every rank looks for it, and if
some rank does not see it the run stops with a message naming ``--output-dir s3://...``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifests.errors import BucketeerError, UsageError
from manifests.storage import call_storage, is_local, join, open_url, redact

__all__ = ["OutputDir", "open_output", "check_writable", "check_shared", "how_to_load", "SCRATCH_ENV"]

SCRATCH_ENV = "BUCKETEER_SCRATCH"


@dataclass
class OutputDir:
    """``--output-dir`` on storage (``fs``, ``root``) and this node's folder for it (``scratch``)."""

    url: str
    fs: Any
    root: str
    scratch: Path

    @property
    def is_local(self) -> bool:
        return is_local(self.fs)

    def name(self, *parts: str) -> str:
        """How messages name a path under the output folder (credentials redacted)."""
        return redact(join(self.url.rstrip("/"), *parts))

    def url_of(self, *parts: str) -> str:
        """The fsspec URL (or local path) of a path under the output folder."""
        return join(self.root, *parts) if self.is_local else self.fs.unstrip_protocol(join(self.root, *parts))

    def local(self, *parts: str) -> Path:
        """Where this node writes (or has downloaded) a path under the output folder."""
        return Path(self.root if self.is_local else self.scratch, *parts)

    def upload(self, rel: str) -> dict[str, int]:
        """Upload this node's ``local(rel)`` tree to ``rel`` (nothing to do when local); its files and sizes.

        Raises StorageError when storage refuses (after the retries of :mod:`manifests.retry`).
        """
        base = self.local(rel)
        files = {p.relative_to(base).as_posix(): p.stat().st_size for p in sorted(base.rglob("*")) if p.is_file()}
        if files and not self.is_local:
            sources = [str(base / f) for f in files]
            targets = [join(self.root, rel, f) for f in files]
            # one call: s3fs uploads the files concurrently (multipart for large ones); retried as a whole
            call_storage(self.fs, "uploading", join(self.root, rel), lambda: self.fs.put(sources, targets))
        return files

    def download(self, rel: str, files: dict[str, int]) -> Path:
        """Download ``files`` of ``rel`` into this node's folder (nothing to do when local); where they are."""
        base = self.local(rel)
        if not self.is_local:
            todo = [f for f in files if not ((base / f).is_file() and (base / f).stat().st_size == files[f])]
            for f in todo:
                (base / f).parent.mkdir(parents=True, exist_ok=True)
            sources = [join(self.root, rel, f) for f in todo]
            targets = [str(base / f) for f in todo]
            if todo:
                call_storage(self.fs, "downloading", join(self.root, rel), lambda: self.fs.get(sources, targets))
        return base

    def download_file(self, rel: str) -> None:
        """Fetch one file into this node's folder if storage has it (nothing to do when local)."""
        if self.is_local:
            return
        target = self.local(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            call_storage(self.fs, "downloading", join(self.root, rel),
                         lambda: self.fs.get_file(join(self.root, rel), str(target)))  # fmt: skip
        except FileNotFoundError:
            pass

    def upload_logs(self) -> None:
        """Upload ``metrics.jsonl`` and the TensorBoard ``logs/`` (main process; nothing to do when local)."""
        if self.is_local:
            return
        self.upload("logs")
        metrics = self.local("metrics.jsonl")
        if metrics.is_file():
            target = join(self.root, "metrics.jsonl")
            call_storage(self.fs, "uploading", target, lambda: self.fs.put_file(str(metrics), target))

    def remove(self, rel: str) -> None:
        """Remove ``rel`` (a folder) from storage and from this node's folder; a missing one is fine."""
        target = join(self.root, rel)
        if not self.is_local:
            try:
                call_storage(self.fs, "removing", target, lambda: self.fs.rm(target, recursive=True))
            except FileNotFoundError:
                pass
        shutil.rmtree(self.local(rel), ignore_errors=True)

    def drop_local_copy(self, rel: str) -> None:
        """Free this node's disk of an uploaded (or loaded) copy; the output folder keeps it."""
        if not self.is_local:
            shutil.rmtree(self.local(rel), ignore_errors=True)


def open_output(url: str, storage_options: dict[str, Any] | None, node: int) -> OutputDir:
    """``--output-dir`` as an :class:`OutputDir`; ``node``: the first rank of this node (names its scratch)."""
    fs, root = open_url(url, storage_options if "://" in url else None)
    base = Path(os.environ.get(SCRATCH_ENV) or tempfile.gettempdir())
    digest = hashlib.sha256(f"{fs.protocol}:{root}".encode()).hexdigest()[:12]
    scratch = base / "bucketeer-train" / digest / f"node-{node}"
    return OutputDir(url, fs, root, scratch)


def check_writable(output: OutputDir) -> None:
    """Write and remove a probe file in ``--output-dir`` (and this node's scratch folder for a URL), so that a
    read-only, permission-denied or missing output stops the run in one line (UsageError, exit 2) before any
    model loads, not in TensorBoard's first log write after it."""
    probe = f".bucketeer-write-check-{uuid.uuid4().hex}"
    folders = [output.local()] if output.is_local else [output.scratch]
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / probe).write_bytes(b"")
            (folder / probe).unlink()
        except OSError as e:
            where = output.name() if output.is_local else f"{folder} (this node's local copy of {output.name()})"
            raise UsageError(f"--output-dir {where}: cannot write there ({e.strerror or type(e).__name__}); "
                             "choose a folder this user can write, or fix its permissions") from None  # fmt: skip
    if not output.is_local:
        target = join(output.root, probe)
        try:
            call_storage(output.fs, "writing", target, lambda: output.fs.pipe_file(target, b""))
            call_storage(output.fs, "removing", target, lambda: output.fs.rm_file(target))
        except (OSError, BucketeerError) as e:
            raise UsageError(f"--output-dir {output.name()}: cannot write there ({redact(str(e))}); check the "
                             "bucket, the credentials' write permission and --storage-options") from None  # fmt: skip


def check_shared(accelerator, output: OutputDir) -> None:
    """Stop (on every rank) when some rank does not see a local ``--output-dir`` the main process sees.

    A collective: call it on every rank. Nothing to check for a URL or a single process.
    """
    from accelerate.utils import broadcast_object_list, gather_object

    if not output.is_local or accelerator.num_processes == 1:
        return
    token = [uuid.uuid4().hex if accelerator.is_main_process else None]
    broadcast_object_list(token)
    marker = output.local(f".shared-{token[0]}")
    if accelerator.is_main_process:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("written by the main process to check that every rank sees this folder\n")
    accelerator.wait_for_everyone()
    seen = gather_object([marker.exists()])  # every rank's answer, on every rank
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink(missing_ok=True)
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        raise UsageError(
            f"--output-dir {output.url} is a local folder that ranks {blind} do not see (other nodes, or another "
            "working folder): checkpoints and latest.json written by rank 0 would be invisible to them. Give every "
            "node the same --output-dir they can all reach, e.g. --output-dir s3://bucket/run (with "
            "--storage-options), or a shared filesystem path"
        )


def how_to_load(output: OutputDir, *, model_class: str, pipeline: str | None, component: str, base: str | None,
                lora: bool, ema: bool, lora_load: dict | None = None,
                more_lora_loads: tuple[dict, ...] = ()) -> list[str]:  # fmt: skip
    """The lines a finished run ends with: its folders and the diffusers code that loads them (``pipeline``:
    the family's pipeline class, ``component``: the model's name in it, ``base``: the pretrained model;
    ``lora``: adapters were trained, ``lora_load`` the extra arguments of ``load_lora_weights``,
    ``more_lora_loads`` those of the further exports ``lora_2``, ... (:func:`train.lora.export_parts`); ``ema``: an
    EMA was kept)."""
    kind = "lora" if lora else "model"
    folder = output.name(kind)
    also = f" (the EMA's: {output.name(f'{kind}_ema')})" if ema else ""
    lines = [f"metrics: {output.name('metrics.jsonl')}; `tensorboard --logdir {output.name('logs')}` plots them"]
    local = "" if output.is_local else " (download the folder first: diffusers reads local folders and hub ids)"
    if lora and pipeline is not None and not _has_lora_loaders(pipeline):  # the component loads its own format
        from train.lora import LORA_FILE

        lines += [f"LoRA adapters in {folder}{also}; load them into the base pipeline's {component}{local}:",
                  f"    from diffusers import {pipeline}",
                  f"    pipe = {pipeline}.from_pretrained({redact(str(base))!r})",
                  f"    pipe.{component}.load_lora_adapter({folder!r}, prefix=None, weight_name={LORA_FILE!r}, "
                  "use_safetensors=True)"]  # fmt: skip
    elif lora:
        from train.lora import export_folder

        exports = [(output.name(export_folder(kind, i)), load)
                   for i, load in enumerate((lora_load, *more_lora_loads))]  # fmt: skip
        if more_lora_loads:
            ema_names = ", ".join(output.name(export_folder(f"{kind}_ema", i)) for i in range(len(exports)))
            also = f" (the EMA's: {ema_names})" if ema else ""
        lines += [f"LoRA adapters in {', '.join(f for f, _ in exports)}{also}; load them into the base "
                  f"pipeline{local}:",
                  f"    from diffusers import {pipeline}",
                  f"    pipe = {pipeline}.from_pretrained({redact(str(base))!r})",
                  *_modular_components(pipeline)]  # fmt: skip
        for folder, load in exports:
            into = "".join(f", {k}={v!r}" for k, v in (load or {}).items())  # e.g. load_into_transformer_2=True
            lines.append(f"    pipe.load_lora_weights({folder!r}{into})")
    elif pipeline is not None and base is not None and pipeline.endswith("ModularPipeline"):
        lines += [f"the trained {component} in {folder}{also}; load it into the base pipeline{local}:",
                  f"    from diffusers import {model_class}, {pipeline}",
                  f"    {component} = {model_class}.from_pretrained({folder!r})",
                  f"    pipe = {pipeline}.from_pretrained({redact(str(base))!r})",
                  *_modular_components(pipeline), f"    pipe.update_components({component}={component})"]  # fmt: skip
    elif pipeline is not None and base is not None:
        lines += [f"the trained {component} in {folder}{also}; load it into the base pipeline{local}:",
                  f"    from diffusers import {model_class}, {pipeline}",
                  f"    {component} = {model_class}.from_pretrained({folder!r})",
                  f"    pipe = {pipeline}.from_pretrained({redact(str(base))!r}, {component}={component})"]  # fmt: skip
    else:
        lines += [f"the trained model in {folder}{also}{local}:",
                  "    from diffusers import " + model_class,
                  f"    model = {model_class}.from_pretrained({folder!r})"]  # fmt: skip
    return lines


def _modular_components(pipeline: str) -> list[str]:
    """A modular pipeline's (``AnimaModularPipeline``) ``from_pretrained`` reads its index only: the line that loads
    its components; none for a ``DiffusionPipeline``."""
    return ["    pipe.load_components()"] if pipeline.endswith("ModularPipeline") else []


def _has_lora_loaders(pipeline: str) -> bool:
    """Whether the diffusers pipeline class ``pipeline`` has ``load_lora_weights`` (unknown names: assume so)."""
    import diffusers

    cls = getattr(diffusers, pipeline, None)
    return cls is None or hasattr(cls, "load_lora_weights")
