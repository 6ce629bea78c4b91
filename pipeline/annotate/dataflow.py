"""The annotate job's Ray Data pipeline (one per engine; the same input and the same result rows).

    row groups -read_units (task)-> units -AnnotateWriter (actor pool: every task)-> one summary row per unit
    row groups -read_units (task)-> units -vLLM processor (ray.data.llm, one replica per GPU)-> summary rows
                                                                                 (``--task caption`` alone)

Ray Data gives what a cluster run needs, as for embed (:mod:`pipeline.embed.dataflow`): actors request
GPUs as resources (an autoscaler adds nodes for them), bounded queues, work to whichever actor is free,
and retries: an actor or node lost mid-job costs its in-flight units, redone elsewhere.
"""

from __future__ import annotations

from typing import Any

from pipeline.annotate.tasks import TaskPlan
from pipeline.annotate.workers import AnnotateWriter, read_units
from pipeline.embed.work import GroupWork

__all__ = ["annotate_pipeline"]


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
