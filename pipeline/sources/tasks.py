"""The scan's Ray part: batches of work as Ray tasks, a bounded window of them in flight, progress.

Used by the scan of loose files (:func:`pipeline.scan.probing.scan_batch`, a batch of files) and of
containers (:func:`pipeline.sources.shards.scan_shard_batch`, a batch of tar shards). A task
returns an Arrow table with ``bytes_read`` and ``error`` columns, one row per image, and the throttled
answers its storage reads had (:func:`manifests.retry.throttle_span`), which go to the job's tally.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from manifests.errors import BucketeerError
from manifests.progress import Progress
from manifests.throttles import job_throttles, throttle_mark, throttle_span
from pipeline.ray_setup import ray_session

__all__ = ["run_tasks"]


def _counted(task: Callable[[Any, pa.Table, Any], pa.Table], target: Any, batch: pa.Table,
             config: Any) -> tuple[pa.Table, str]:  # fmt: skip
    """The Ray task: ``task``'s table, and the throttled answers of this worker while it ran."""
    before = throttle_mark()
    return task(target, batch, config), throttle_span(before)


def run_tasks(
    task: Callable[[Any, pa.Table, Any], pa.Table],
    target: Any,
    config: Any,
    batches_for: Callable[[int], list[pa.Table]],
    total: int,
    *,
    progress: bool,
    ray_address: str | None,
    unit: str = "files",
    count: Callable[[pa.Table], int] = lambda table: table.num_rows,
) -> tuple[list[pa.Table], float]:
    """Run ``task(target, batch, config)`` on Ray for every batch of ``batches_for(cpus)``.

    ``total`` is what the progress bar counts to: ``count(result)`` of every task's result
    (default: its rows, one per file). Returns the tasks'
    tables and the seconds Ray took to start. A task's :class:`BucketeerError` (a permanent
    storage error) is raised here as itself and cancels the rest; a lost worker is retried by Ray.
    """
    if total == 0:
        return [], 0.0
    clock = time.perf_counter()
    with ray_session(ray_address) as ray:
        ray_seconds = time.perf_counter() - clock
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        batches = batches_for(cpus)
        # worker loss is retried by Ray; exceptions (a permanent storage error) fail the job at once
        remote = ray.remote(num_cpus=1, max_retries=3, retry_exceptions=False)(_counted)
        tally = job_throttles()
        target_ref = ray.put(target)
        results: list[pa.Table] = []
        pending: dict = {}
        bar = Progress("scan", unit, total=total, unit=unit, enabled=progress)
        mb, errors = 0.0, 0
        try:
            while batches or pending:
                while batches and len(pending) < 4 * cpus:  # a bounded window keeps driver memory flat
                    batch = batches.pop(0)
                    pending[remote.remote(task, target_ref, batch, config)] = batch
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    pending.pop(ref)
                    try:
                        result, throttled = ray.get(ref)
                    except ray.exceptions.RayTaskError as e:
                        if isinstance(e.cause, BucketeerError):  # the task's own error; Ray's wrapper reads as one
                            raise e.cause from None
                        raise
                    results.append(result)
                    if tally is not None:
                        tally.add(throttled)
                    mb += (pc.sum(result.column("bytes_read")).as_py() or 0) / 1e6
                    errors += result.num_rows - result.column("error").null_count
                    bar.update(count(result), read=f"{mb:.1f} MB", errors=errors)
            bar.close()
        finally:
            bar.close(final=False)  # after a failure: no final "done" line
            for ref in pending:
                ray.cancel(ref, force=True)
        return results, ray_seconds
