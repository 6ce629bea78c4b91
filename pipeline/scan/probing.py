"""The Ray part of a scan of loose images: batches of files, each probed by one Ray task on its own
filesystem (:func:`pipeline.sources.reading.probe_files`), the tasks' storage options, and the
redaction of the storage errors their rows quote."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pyarrow as pa

from manifests import faults
from manifests.errors import StorageError
from manifests.storage import open_url, redact
from pipeline.formats import register_plugins
from pipeline.scan.conditioning import Pairing, probe_target
from pipeline.scan.config import ScanConfig
from pipeline.sources.listing import WorkItem, work_items, work_table
from pipeline.sources.reading import PROBE_SCHEMA, probe_files
from pipeline.sources.tasks import run_tasks

__all__ = ["scan_batch", "batches", "task_options", "redacted", "conditioning_probe"]


def scan_batch(target: tuple, batch: pa.Table, config: ScanConfig) -> pa.Table:
    """One Ray task: probe the files of ``batch`` (a :func:`~pipeline.sources.listing.work_table`; see
    :func:`pipeline.sources.reading.probe_files`) on its own filesystem."""
    source, storage_options, fs, root = target
    if fs is None:
        fs, root = open_url(source, storage_options)
    register_plugins()
    result = probe_files(fs, root, work_items(batch), max_pixels=config.max_pixels, first_read=config.header_bytes,
                         in_flight=config.reads_in_flight)  # fmt: skip
    faults.hit("scan.task")  # tests: stall or lose this worker mid-scan
    return result


def batches(work: list[WorkItem], config: ScanConfig, cpus: int) -> list[pa.Table]:
    """``work`` cut into one table per Ray task: enough tasks to keep every CPU busy 4 times over."""
    per_task = config.files_per_task or int(np.clip(-(-len(work) // (4 * cpus)), 16, 2000))
    # each batch its own columns: a slice of one big table would ship the whole table's buffers
    return [work_table(work[i : i + per_task]) for i in range(0, len(work), per_task)]


def task_options(source: str, storage_options: dict[str, Any] | None, config: ScanConfig) -> dict[str, Any] | None:
    """The tasks' storage options: on S3, a connection pool as large as the reads in flight
    (botocore's default of 10 connections would queue the rest)."""
    if not source.startswith(("s3://", "s3a://")):
        return storage_options
    options = dict(storage_options or {})
    config_kwargs = dict(options.get("config_kwargs") or {})
    config_kwargs.setdefault("max_pool_connections", max(10, config.reads_in_flight))
    return {**options, "config_kwargs": config_kwargs}


def redacted(probed: pa.Table, storage_options: dict[str, Any] | None) -> pa.Table:
    """Messages of read_failed rows quote storage errors: no credential may stay in them."""
    if not storage_options or probed.column("message").null_count == probed.num_rows:
        return probed
    messages = [redact(m, storage_options) if m else m for m in probed.column("message").to_pylist()]
    return probed.set_column(PROBE_SCHEMA.get_field_index("message"), "message", pa.array(messages, pa.string()))


def conditioning_probe(
    pairing: Pairing, storage_options: dict[str, Any] | None, fs, config: ScanConfig, ray_address: str | None
) -> Callable[[list[WorkItem]], pa.Table]:
    """``probe(items)`` for :func:`pipeline.scan.conditioning.pair`: the conditioning images' headers,
    read by the same Ray tasks as the targets' (:func:`scan_batch`), batched the same way."""
    target = probe_target(pairing, storage_options, fs)
    target = (target[0], task_options(target[0], storage_options, config), *target[2:])

    def probe(items: list[WorkItem]) -> pa.Table:
        try:
            results, _ = run_tasks(scan_batch, target, config, lambda cpus: batches(items, config, cpus), len(items),
                                   progress=config.progress, ray_address=ray_address)  # fmt: skip
        except StorageError as e:
            raise StorageError(redact(str(e), storage_options)) from None
        return redacted(pa.concat_tables(results), storage_options)

    return probe
