"""The vLLM engine: Ray Data's batch LLM inference (``ray.data.llm``) over decoded images, on GPUs.

    units -decode_unit (CPU task)-> one row per image (PIL image, ids) -vLLM processor-> captions
          -write_captions (CPU task, ``--unit-rows`` rows a batch)-> one part each -> summary rows

``vLLMEngineProcessorConfig`` + ``build_processor``: one vLLM engine replica per GPU (``concurrency`` =
the engine actors :func:`pipeline.embed.dataflow.place_encoders` decided: one per GPU the cluster has
or its autoscaler can add), the image given as multimodal input in OpenAI chat format (a PIL image,
``{"type": "image_pil"}``; ``prepare_multimodal_stage`` turns it into vLLM's multimodal data), the
model's own chat template, greedy sampling of at most ``--max-new-tokens``. ``pip install
'bucketeer[vllm]'`` brings vLLM; the base install never imports it.

Differences from the transformers engine, by construction of ``ray.data.llm``: images that fail to
decode are written as error parts by the decode task (they never reach the engine); captions are
written in batches of ``--unit-rows`` rows as they leave the engine, so a part's rows are whatever
batch Ray Data formed (a redone batch may form differently: the reader keeps the newest row of a
sample, :func:`manifests.annotations.resolve`). Written from the Ray 2.x documentation; it runs only
where CUDA and vLLM are present (``tests/test_annotate_vllm.py`` is skipped elsewhere).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import numpy as np
import pyarrow as pa

from manifests.annotations import part_name, write_part
from manifests.storage import open_url, redact
from pipeline.annotate.engines import CaptionSpec
from pipeline.embed.imaging import ImageFailure, fetch_images
from pipeline.embed.workers import from_ipc

__all__ = ["vllm_pipeline", "decode_unit", "write_captions"]


def decode_unit(batch: pa.Table, *, source: str, storage_options: dict | None, max_pixels: int,
                image_column: str | None, image_size: int, out: str, settings: str) -> dict[str, list]:  # fmt: skip
    """A unit's images, decoded (one row each: ``sample_id``, ``filename``, ``source_key``, ``image``); its
    images that do not decode are written as the unit's error part here."""
    from pipeline.annotate.workers import decode_for_caption

    fs, root = open_url(source, storage_options)
    out_fs, out_root = open_url(out, storage_options)
    rows: dict[str, list] = {"sample_id": [], "filename": [], "source_key": [], "image": []}
    for blob in batch.column("rows").to_pylist():
        unit = from_ipc(blob)
        listed = unit.to_pylist()
        errors = []
        for row, data in zip(listed, fetch_images(fs, root, listed, image_column=image_column)):
            try:
                if isinstance(data, BaseException):
                    raise ImageFailure("read_failed", redact(f"{type(data).__name__}: {data}", storage_options))
                image = decode_for_caption(data, row["width"], row["height"], image_size, max_pixels, row["filename"])
            except ImageFailure as e:
                errors.append((row, e))
                continue
            for key in ("sample_id", "filename", "source_key"):
                rows[key].append(row[key])
            rows["image"].append(image)
        if errors:
            name = part_name(settings, unit.column("sample_id").to_numpy(), unit.column("source_key").to_numpy())
            write_part(out_fs, out_root, "errors", name, pa.table({
                "sample_id": pa.array([r["sample_id"] for r, _ in errors], pa.uint64()),
                "filename": [r["filename"] for r, _ in errors],
                "source_key": pa.array([r["source_key"] for r, _ in errors], pa.uint64()),
                "written_at": [time.time()] * len(errors), "error": [e.kind for _, e in errors],
                "message": [e.message for _, e in errors]}), settings)  # fmt: skip
    return rows


def write_captions(batch: pa.Table, *, out: str, storage_options: dict | None, settings: str) -> pa.Table:
    """Write a batch of captioned rows as one part; its summary row (as the transformers engine's)."""
    fs, root = open_url(out, storage_options)
    ids, keys = batch.column("sample_id").to_numpy(), batch.column("source_key").to_numpy()
    name = part_name(settings, ids, keys)
    table = pa.table({"sample_id": batch.column("sample_id").cast(pa.uint64()), "filename": batch.column("filename"),
                      "source_key": batch.column("source_key").cast(pa.uint64()),
                      "written_at": pa.array([time.time()] * batch.num_rows, pa.float64()),
                      "caption": batch.column("caption"),
                      "generated_tokens": batch.column("generated_tokens").cast(pa.int32())})  # fmt: skip
    write_part(fs, root, "parts", name, table, settings)
    tokens = int(np.sum(batch.column("generated_tokens").to_numpy())) if batch.num_rows else 0
    return pa.Table.from_pylist([{"part": name, "captioned": batch.num_rows, "errors": 0, "tokens": tokens,
                                  "seconds": 0.0, "node": socket.gethostname(), "pid": os.getpid(),
                                  "device": "cuda"}])  # fmt: skip


def vllm_pipeline(units, job: Any, spec: CaptionSpec, placement: Any, options: dict[str, Any],
                  storage_options: dict | None):  # fmt: skip
    """The vLLM dataset of summary rows for ``units`` (see the module docstring)."""
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    images = units.map_batches(
        decode_unit, batch_size=1, batch_format="pyarrow", num_cpus=placement.task_cpus,
        fn_kwargs={"source": options["source"], "storage_options": storage_options,
                   "max_pixels": options["max_pixels"], "image_column": options["image_column"],
                   "image_size": spec.image_size, "out": job.out, "settings": options["settings"]})  # fmt: skip
    config = vLLMEngineProcessorConfig(
        model_source=spec.path(),  # the default model: built on the driver (a shared home on a cluster)
        engine_kwargs={"limit_mm_per_prompt": {"image": 1}, "max_model_len": 8192},
        batch_size=job.batch_size,
        concurrency=placement.workers,  # one engine replica per GPU
        prepare_multimodal_stage={"enabled": True},
        chat_template_stage={"enabled": True},
        tokenize_stage={"enabled": True},
        detokenize_stage={"enabled": True},
    )  # fmt: skip
    prompt, max_tokens = spec.prompt, spec.max_new_tokens
    processor = build_processor(
        config,
        preprocess=lambda row: {
            "sample_id": row["sample_id"], "filename": row["filename"], "source_key": row["source_key"],
            "messages": [{"role": "user", "content": [{"type": "image_pil", "image_pil": row["image"]},
                                                      {"type": "text", "text": prompt}]}],
            "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens},
        },
        postprocess=lambda row: {
            "sample_id": row["sample_id"], "filename": row["filename"], "source_key": row["source_key"],
            "caption": " ".join(str(row["generated_text"]).split()),
            "generated_tokens": int(row["num_generated_tokens"]),
        },
    )  # fmt: skip
    return processor(images).map_batches(
        write_captions, batch_size=job.unit_rows, batch_format="pyarrow", num_cpus=placement.light_cpus,
        fn_kwargs={"out": job.out, "storage_options": storage_options, "settings": options["settings"]})  # fmt: skip
