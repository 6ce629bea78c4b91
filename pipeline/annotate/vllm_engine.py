"""The vLLM engine: Ray Data's batch LLM inference (``ray.data.llm``) over decoded images, on GPUs.

    units -decode_unit (CPU task)-> one row per image (ids, ``pixels``) -vLLM processor-> captions
          -write_captions (CPU task, ``--unit-rows`` rows a batch)-> one part each -> summary rows

The processor (``build_processor`` with :func:`processor_config`): exactly one vLLM engine replica per GPU (a
fixed pool of the engine actors :func:`pipeline.embed.dataflow.place_encoders` decided: one per GPU the cluster
has or its autoscaler can add), the model's context capped at the positions it has (:func:`engine_max_len`),
the image given as multimodal input in OpenAI chat format (``{"type": "image_pil"}``;
``prepare_multimodal_stage`` turns it into vLLM's multimodal data), the model's own chat template, greedy
sampling of at most ``--max-new-tokens``. ``pip install 'bucketeer[vllm]'`` brings vLLM; the base install
never imports it.

What travels: ``ray.data.llm`` carries every column of the rows it is given through all its stages, to the
postprocess. So the decoded rows hold only the ids and the pixels; :func:`caption_request` builds the request
from them and blanks ``pixels`` (the image then lives only in the request, which vLLM's stages consume), and
:func:`caption_row` keeps the ids and the caption. No column is named ``image``: Ray before 2.58 reads such a
column as the engine's own image input (a second copy of it, or a refusal beside the multimodal stage's).

Differences from the transformers engine, by construction of ``ray.data.llm``: images that fail to decode
are written as the unit's error part by the decode task (the same rows, kinds and part name as the
transformers engine writes, :func:`pipeline.annotate.workers.decode_rows`); they never reach the engine,
so the summary rows do not count them (the run counts them from storage, ``job._annotate``). Captions are
written in batches of ``--unit-rows`` rows as they leave the engine, so a part's rows are whatever batch Ray
Data formed (a redone batch may form differently: the reader keeps the newest row of a sample,
:func:`manifests.annotations.resolve`). It runs only where CUDA and vLLM are present
(``tests/test_annotate_vllm.py``, marked ``gpu``); everything but the engine is tested on the CPU
(``tests/test_annotate_vllm_cpu.py``).
"""

from __future__ import annotations

import os
import socket
import time
from functools import partial
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from manifests.annotations import part_name, write_part
from manifests.errors import UsageError
from manifests.storage import open_url
from pipeline.annotate.engines import CaptionSpec
from pipeline.embed.workers import from_ipc

__all__ = ["ENGINE_ROW", "vllm_pipeline", "decode_unit", "write_captions", "model_positions", "engine_max_len",
           "processor_config", "caption_request", "caption_row"]  # fmt: skip

# what a decoded row carries into the processor: its ids (through to the part) and its pixels (into the request)
ENGINE_ROW = ("sample_id", "filename", "source_key", "pixels")
_IDS = ENGINE_ROW[:3]


def model_positions(config: Mapping[str, Any]) -> int | None:
    """The positions a model's language model has (``max_position_embeddings``), from its ``config.json`` as a
    dict: the nested ``text_config``'s for a Llava-like model, else its own; None when it names none."""
    text = config.get("text_config") or {}
    value = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return int(value) if value else None


def engine_max_len(positions: int | None, asked: int | None) -> int | None:
    """The context vLLM is given (``max_model_len``): ``--max-model-len`` when asked, else the model's
    ``positions`` (None: vLLM's own choice). vLLM refuses a context longer than the model's: a UsageError here."""
    if asked is not None and positions is not None and asked > positions:
        raise UsageError(f"--max-model-len {asked}: the model has {positions} positions (max_position_embeddings of "
                         f"its language model); give at most {positions}, or leave it out")  # fmt: skip
    return asked if asked is not None else positions


def _read_model_config(path: str, model: str) -> dict[str, Any]:
    """``path``'s config (a folder's ``config.json``, or a hub id's) as a dict; UsageError when it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path).to_dict()
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {model}: cannot read its config: {str(e).strip().splitlines()[0]}") from None


def processor_config(model_source: str, *, batch_size: int, replicas: int, max_model_len: int | None
                     ) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of ``ray.data.llm.vLLMEngineProcessorConfig`` (Ray >= 2.53's names): one image per
    prompt, the context ``max_model_len``, and ``replicas`` engine replicas exactly. Ray reads an int
    ``concurrency`` n as an autoscaling pool of 1..n; the tuple (n, n) is a fixed pool. The CPU stages
    (multimodal parsing, chat template, tokenizer, detokenizer) would inherit it; each is given 1..n instead, so
    that they grow with the load rather than each holding n actors (and n CPUs) from the start."""
    engine: dict[str, Any] = {"limit_mm_per_prompt": {"image": 1}}
    if max_model_len is not None:
        engine["max_model_len"] = max_model_len
    cpu_stage = {"enabled": True, "concurrency": (1, replicas)}
    return {"model_source": model_source, "engine_kwargs": engine, "batch_size": batch_size,
            "concurrency": (replicas, replicas), "prepare_multimodal_stage": dict(cpu_stage),
            "chat_template_stage": dict(cpu_stage), "tokenize_stage": dict(cpu_stage),
            "detokenize_stage": dict(cpu_stage)}  # fmt: skip


def caption_request(row: Mapping[str, Any], *, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The preprocess: a decoded row's vLLM request (the image, then the prompt, as one user message; greedy
    sampling of at most ``max_tokens``). ``pixels`` comes back None: ``ray.data.llm`` carries the row's own
    columns to the postprocess, and the image should ride only in the request, which its stages consume."""
    from PIL import Image

    picture = Image.fromarray(np.asarray(row["pixels"], dtype=np.uint8))
    return {"pixels": None,
            "messages": [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                                      {"type": "text", "text": prompt}]}],
            "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens}}  # fmt: skip


def caption_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The postprocess: the ids and the caption (whitespace collapsed) with the tokens generated; nothing else
    of what ``ray.data.llm`` carried (the request, the prompt's tokens) goes on. The ids come back typed
    uint64: as the plain ints they are by then, Ray Data infers int64 for the column, and a sample id or key
    of 2**63 or more does not fit it (the column would fall back to pickled objects)."""
    return {"sample_id": np.uint64(row["sample_id"]), "filename": str(row["filename"]),
            "source_key": np.uint64(row["source_key"]), "caption": " ".join(str(row["generated_text"]).split()),
            "generated_tokens": int(row["num_generated_tokens"])}  # fmt: skip


def decode_unit(batch: pa.Table, *, source: str, storage_options: dict | None, max_pixels: int,
                image_column: str | None, image_size: int, out: str, settings: str) -> dict[str, list]:  # fmt: skip
    """A unit's images, decoded: one :data:`ENGINE_ROW` each (``pixels``: (h, w, 3) uint8, upright, the long
    side at most ``image_size``); its images that do not decode are written as the unit's error part here."""
    from pipeline.annotate.workers import decode_rows, write_error_part

    fs, root = open_url(source, storage_options)
    out_fs, out_root = open_url(out, storage_options)
    rows: dict[str, list] = {k: [] for k in ENGINE_ROW}
    for blob in batch.column("rows").to_pylist():
        unit = from_ipc(blob)
        good, _, images, errors = decode_rows(fs, root, unit.to_pylist(), image_column=image_column,
                                              image_size=image_size, max_pixels=max_pixels,
                                              storage_options=storage_options)  # fmt: skip
        name = part_name(settings, unit.column("sample_id").to_numpy(), unit.column("source_key").to_numpy())
        write_error_part(out_fs, out_root, name, errors, settings, time.time())
        for row, image in zip(good, images):
            for key in _IDS:
                rows[key].append(row[key])
            rows["pixels"].append(np.asarray(image))
    return rows


def write_captions(batch: pa.Table, *, out: str, storage_options: dict | None, settings: str) -> pa.Table:
    """Write a batch of captioned rows as one part; its summary row (as the transformers engine's; ``errors``
    0: decode failures never reach the engine, see the module docstring)."""
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
    """The vLLM dataset of summary rows for ``units`` (see the module docstring). Raises UsageError for a
    ``--max-model-len`` longer than the model's context, before any work."""
    import ray.data.llm

    path = spec.path()  # the default model: built on the driver (a shared home on a cluster)
    max_len = engine_max_len(model_positions(_read_model_config(path, spec.model)), job.max_model_len)
    images = units.map_batches(
        decode_unit, batch_size=1, batch_format="pyarrow", num_cpus=placement.task_cpus,
        fn_kwargs={"source": options["source"], "storage_options": storage_options,
                   "max_pixels": options["max_pixels"], "image_column": options["image_column"],
                   "image_size": spec.image_size, "out": job.out, "settings": options["settings"]})  # fmt: skip
    config = ray.data.llm.vLLMEngineProcessorConfig(**processor_config(
        path, batch_size=job.batch_size, replicas=placement.workers, max_model_len=max_len))  # fmt: skip
    processor = ray.data.llm.build_processor(
        config, preprocess=partial(caption_request, prompt=spec.prompt, max_tokens=spec.max_new_tokens),
        postprocess=caption_row)  # fmt: skip
    return processor(images).map_batches(
        write_captions, batch_size=job.unit_rows, batch_format="pyarrow", num_cpus=placement.light_cpus,
        fn_kwargs={"out": job.out, "storage_options": storage_options, "settings": options["settings"]})  # fmt: skip
