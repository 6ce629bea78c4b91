"""The embed job's two pipelines in this process, without Ray (``bucketeer embed --executor local``).

For a machine where Ray is absent or unwanted: one GPU box, an offline GPU machine (``make gpu-check``
embeds this way), a notebook. The stages are those of :mod:`pipeline.embed.dataflow`, called as plain
functions in the same order on the same rows (each ``map_batches`` batch of one row is a one-row table
here), so the shards, index rows and ``_cache.json`` are what a Ray run of the same job writes::

    captions: row groups -read_captions-> (key, caption) -TextWriter, text_batch_size at a time-> text index rows
    images:   row groups -plan_units-> units -prepare_unit (decode threads)-> pixels -LatentWriter-> index rows

Decoding a unit (fetch, decode, resize, crop) runs on a thread pool ahead of the encoder: Pillow's decode and
resize and the storage reads release the GIL, so ``decode_threads`` units decode while the encoder encodes,
compresses and writes the one before. The encoder is called on :data:`CALLS` threads, as Ray gives an encoder
actor two concurrent calls: its lock lets one forward pass run at a time, so one call compresses (gzip of its
latent and text records, GIL released) and writes its shard while the other holds the device, which then never
waits for a record's compression; results come back in the order of their units. At most ``2 x decode_threads``
units are decoded ahead (each ~128 MB of pixels at most, :data:`~pipeline.embed.work.UNIT_PIXEL_BYTES`): a slow
encoder never lets pixels pile up. What Ray adds and this does not: several GPUs or nodes, restarts of a failed
worker (here a failure stops the job; a rerun resumes from the last commit, as after a kill).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import pyarrow as pa

from pipeline.embed.dataflow import Placement
from pipeline.embed.work import EmbedWork
from pipeline.embed.prepare import prepare_unit
from pipeline.embed.reuse import ReuseTable
from pipeline.embed.work import prompt_rows, read_captions
from pipeline.embed.workers import LatentWriter, TextWriter, plan_units

__all__ = ["local_placement", "caption_results", "image_results", "CALLS"]

CALLS = 2  # encoder calls in flight, as Ray's max_concurrent_calls_per_actor (pipeline.embed.dataflow)


def local_placement(device: str, threads: int | None) -> Placement:
    """Where the encoders run in this process: ``auto`` is ``cuda`` when torch sees a CUDA device, else ``cpu``;
    ``threads``: torch threads on the CPU (default: half the CPUs). Decode threads: the CPUs (at least 2)."""
    import torch

    use = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cpus = os.cpu_count() or 2
    return Placement(use, workers=1, threads=threads or max(1, cpus // 2), gpus_now=int(use == "cuda"),
                     gpus_max=None, actor_cpus=0.0, task_cpus=0.0, light_cpus=0.0, executor="local",
                     decode_threads=max(2, cpus))  # fmt: skip


def _one(row: dict[str, Any]) -> pa.Table:
    """A one-row table: what a Ray Data ``map_batches`` call of batch size 1 receives."""
    return pa.Table.from_pylist([row])


def caption_results(work: EmbedWork, prompts: dict[int, str], manifest: str, storage_options: dict | None,
                    make_text: Callable, dtype: str, out: str, text_batch_size: int,
                    placement: Placement, reuse: ReuseTable | None = None,
                    compact: str | None = None) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The result rows of the captions pipeline (:func:`pipeline.embed.dataflow.caption_pipeline`), in order."""
    tables = [read_captions(_one(g.item()), manifest, storage_options) for g in work.captions]
    if prompts:
        tables.append(prompt_rows(prompts))
    captions = pa.concat_tables(tables)
    writer = TextWriter(make_text, dtype, out, storage_options, placement.threads, device=placement.device,
                        reuse=reuse, compact=compact)  # fmt: skip
    batches = (captions.slice(start, text_batch_size) for start in range(0, captions.num_rows, text_batch_size))
    for table in in_order(writer, batches):
        yield from table.to_pylist()
    del writer  # the text encoders leave the device to the VAE, as a Ray text actor does when it ends
    _free_device()


def image_results(work: EmbedWork, manifest: str, source: str, storage_options: dict | None, make_vae: Callable,
                  dtype: str, out: str, options: dict[str, Any], placement: Placement,
                  make_text: Callable | None = None) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The result rows of the images pipeline (:func:`pipeline.embed.dataflow.image_pipeline`), one per unit,
    in the order the units were cut."""
    plan = {"manifest": manifest, "storage_options": storage_options, "batch_size": options["batch_size"],
            "shard_records": options["shard_records"], "max_clips": options.get("max_clips") or 1}
    prepare = {"source": source, "storage_options": storage_options, "crop": options["crop"], "seed": options["seed"],
               "max_pixels": options["max_pixels"], "crops": options["crops"],
               "conditioning": options["conditioning"], "image_column": options.get("image_column"),
               "max_clips": options.get("max_clips") or 1, "reference": options.get("reference"),
               "flip": options["flip"], "reuse": options.get("reuse"), "dtype": dtype}  # fmt: skip
    writer = LatentWriter(make_vae, dtype, out, storage_options, options["batch_size"], placement.threads,
                          crops=options["crops"], flip=options["flip"], make_text=make_text,
                          text_batch_size=options.get("text_batch_size", 128), device=placement.device,
                          reference=options.get("reference"), reuse=options.get("reuse"),
                          compact=options.get("compact"))  # fmt: skip

    def units() -> Iterator[pa.Table]:
        for group in work.images:
            for unit in plan_units(_one(group.item()), **plan):
                yield unit

    ahead = 2 * placement.decode_threads
    with ThreadPoolExecutor(placement.decode_threads, thread_name_prefix="bucketeer-decode") as pool:
        pending: deque[Future] = deque()

        def decoded() -> Iterator[pa.Table]:
            try:
                for unit in units():
                    pending.append(pool.submit(prepare_unit, unit, **prepare))
                    if len(pending) >= ahead:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:  # stopped early (an error, a kill): decoded units not yet encoded are dropped, unwritten
                for future in pending:
                    future.cancel()

        for table in in_order(writer, decoded()):
            yield from table.to_pylist()
    del writer
    _free_device()


def in_order(call: Callable[[Any], Any], items: Iterator[Any], calls: int = CALLS) -> Iterator[Any]:
    """``call(item)`` of each item, ``calls`` of them in flight on threads, the results in the items' order. An
    error is raised in its turn, after the results before it; the calls not started then are dropped."""
    with ThreadPoolExecutor(calls, thread_name_prefix="bucketeer-encode") as pool:
        running: deque[Future] = deque()
        try:
            for item in items:
                running.append(pool.submit(call, item))
                if len(running) >= calls:
                    yield running.popleft().result()
            while running:
                yield running.popleft().result()
        finally:
            for future in running:
                future.cancel()


def _free_device() -> None:
    """Give the memory of encoders no longer referenced back to the device (the next phase needs it)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

