"""The annotate job's Ray Data pipeline (one per engine; the same input and the same result rows).

    row groups -read_units (task)-> units -AnnotateWriter (actor pool: every task)-> one summary row per unit
    row groups -read_units (task)-> units -vLLM processor (ray.data.llm, one replica per GPU)-> summary rows
                                                                                 (``--task caption`` alone)

Ray Data gives what a cluster run needs, as for embed (:mod:`pipeline.embed.dataflow`): actors request
GPUs as resources (an autoscaler adds nodes for them), bounded queues, work to whichever actor is free,
and retries: an actor or node lost mid-job costs its in-flight units, redone elsewhere.

An actor runs :func:`units_at_once` units at a time (the pool embed's encoders use), each with its own model
passes: on CPU that is ``units x --torch-threads`` threads of compute, and :func:`place_annotators` asks Ray for
those CPUs (:func:`cpu_actor_cpus`), not for one unit's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pipeline.annotate.tasks import TaskPlan
from pipeline.annotate.workers import AnnotateWriter, read_units
from pipeline.embed.work import GroupWork

__all__ = ["annotate_pipeline", "units_at_once", "cpu_actor_cpus", "place_annotators", "UnitTimes", "run_units"]


def units_at_once(placement: Any) -> int:
    """How many units one actor of ``placement``'s pool runs at a time (2 where the Ray has the option)."""
    return int(getattr(placement.pool(1), "max_concurrent_calls_per_actor", None) or 1)


# what a CPU actor leaves of its node: the stage before it (read_units, then Ray Data's streaming repartition,
# which runs as tasks of 1 CPU, its default) must start beside it, or the job waits forever
_STAGE_BEFORE_CPUS = 1.0


def cpu_actor_cpus(threads: int, units: int, node_cpus: float, least: float) -> float:
    """The CPUs a CPU actor asks Ray for: what its ``units`` units at a time compute on (``threads`` torch threads
    each), at most a node of ``node_cpus`` less the CPU the stage before needs beside it, at least ``least`` (what
    embed's sizing gave: :func:`pipeline.embed.dataflow.size_cpus`). Rounded down to 0.05 CPU."""
    room = max(node_cpus - _STAGE_BEFORE_CPUS, 0.0)
    return max(least, int(min(float(threads * units), room) * 20 + 1e-9) / 20)


def place_annotators(ray, job: Any) -> Any:
    """Embed's placement (:func:`pipeline.embed.dataflow.place_encoders`) with a CPU actor's CPUs made what it runs
    on (:func:`cpu_actor_cpus`, on the largest node the cluster has or can add); a GPU placement as it is."""
    from pipeline.embed.dataflow import autoscaler_node_types, cluster_nodes, place_encoders

    placement = place_encoders(ray, job.device, job.workers, job.torch_threads)
    if placement.device != "cpu":
        return placement
    nodes = [n.cpus for n in cluster_nodes(ray) + autoscaler_node_types() if n.cpus >= 1]
    if not nodes:
        return placement
    cpus = cpu_actor_cpus(placement.threads, units_at_once(placement), max(nodes), placement.actor_cpus)
    return dataclasses.replace(placement, actor_cpus=cpus)


class UnitTimes:
    """The times of the units the actors ran: ``cpu_seconds``, the CPU time of each actor process counted once,
    from its first unit's start to its last unit's end (every thread of it: the units', torch's, Ray's; units of
    one actor overlap, :func:`units_at_once`, so a sum of each unit's process CPU would count the same seconds
    twice); ``wall_seconds``, from the first unit's start to the last unit's end (the actors' start and model
    loads left out), None before any unit."""

    def __init__(self) -> None:
        self.spans: dict[tuple[str, int], tuple[float, float]] = {}  # (node, pid) -> process CPU seconds
        self.wall: tuple[float, float] | None = None  # (first start, last end), time.time() of the actors

    def add(self, row: dict[str, Any]) -> None:
        """One summary row (``node``, ``pid``, ``started``, ``seconds``, ``cpu_start``, ``cpu_end``: that
        process's CPU seconds); rows without them (the vLLM engine's) add nothing."""
        if row.get("cpu_start") is None:
            return
        key = (str(row.get("node")), int(row["pid"]))
        start, end = self.spans.get(key, (row["cpu_start"], row["cpu_end"]))
        self.spans[key] = (min(start, row["cpu_start"]), max(end, row["cpu_end"]))
        first, last = self.wall or (row["started"], row["started"])
        self.wall = (min(first, row["started"]), max(last, row["started"] + row["seconds"]))

    @property
    def cpu_seconds(self) -> float:
        return sum(end - start for start, end in self.spans.values())

    @property
    def wall_seconds(self) -> float | None:
        return None if self.wall is None else self.wall[1] - self.wall[0]


def annotate_pipeline(job: Any, groups: list[GroupWork], plan: TaskPlan, engine: str, placement: Any,
                     options: dict[str, Any], storage_options: dict | None):  # fmt: skip
    """The dataset whose rows are the units' summaries (``captioned``: images annotated, ``errors``,
    ``tokens``, ...), lazily run. ``options``: source, max_pixels, image_column, settings."""
    import ray.data

    units = (
        ray.data.from_items([g.item() for g in groups], override_num_blocks=len(groups))
        .map_batches(read_units, batch_size=1, batch_format="pyarrow", num_cpus=placement.light_cpus,
                     fn_kwargs={"manifest": job.manifest, "storage_options": storage_options,
                                "unit_rows": job.unit_rows})
        .repartition(target_num_rows_per_block=1)  # a unit per block: each goes to whichever actor is free
    )  # fmt: skip
    n_units = sum(-(-len(g.rows) // job.unit_rows) for g in groups)
    if engine == "vllm":
        from pipeline.annotate.vllm_engine import vllm_pipeline

        assert plan.caption is not None and plan.tasks == ("caption",)
        return vllm_pipeline(units, job, plan.caption, placement, options, storage_options)
    return units.map_batches(
        AnnotateWriter, batch_size=1, batch_format="pyarrow", compute=placement.pool(n_units),
        fn_constructor_kwargs={"plan": plan, "device": placement.device, "threads": placement.threads,
                               "out": job.out, "storage_options": storage_options, "source": options["source"],
                               "max_pixels": options["max_pixels"], "image_column": options["image_column"],
                               "settings": options["settings"], "batch_size": job.batch_size},
        **placement.actor_options(),
    )  # fmt: skip


def run_units(job: Any, groups: list[GroupWork], todo: int, plan: TaskPlan, engine: str, placement: Any,
              options: dict[str, Any]) -> tuple[dict[str, int], dict[str, int], float | None, UnitTimes]:  # fmt: skip
    """Run the pipeline of ``engine`` over ``groups`` (``todo`` rows), reporting progress: what it did, what it did
    after its first unit, the seconds that took (None with a single unit), and the units' :class:`UnitTimes`."""
    from manifests.progress import Progress
    from manifests.throttles import ThrottleTally, job_throttles
    from pipeline.embed.dataflow import results

    dataset = annotate_pipeline(job, groups, plan, engine, placement, options, dict(job.storage_options))
    tally, times = job_throttles() or ThrottleTally(), UnitTimes()
    done = {"captioned": 0, "errors": 0, "tokens": 0}
    first: float | None = None
    at_first = dict(done)
    with Progress("annotate", ",".join(plan.tasks), total=todo, unit="images") as progress:
        for row in results(dataset):
            tally.add(*(row.get("throttled") or ()))
            times.add(row)
            now = time.time()
            for k in done:
                done[k] += int(row.get(k, 0))
            if first is None:  # start-up and model loading end with the first unit done
                first, at_first = now, dict(done)
            elapsed = now - first
            extra = ({"tokens/s": round((done["tokens"] - at_first["tokens"]) / elapsed, 1)}
                     if elapsed > 0 and plan.caption else {})  # fmt: skip
            progress.update(int(row["captioned"]) + int(row["errors"]), **extra)
    steady = {k: done[k] - at_first[k] for k in done}
    seconds = (time.time() - first) if first is not None and steady["captioned"] else None
    return done, steady, seconds, times
