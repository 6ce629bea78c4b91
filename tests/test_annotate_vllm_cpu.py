"""``bucketeer annotate --engine vllm`` without vLLM or a GPU: everything up to the engine.

The request ``ray.data.llm`` is given (the engine's settings against the model's config, the preprocess and
postprocess) is built by plain functions, checked here against the installed Ray's own config class. Then a
real run on real local Ray with the engine stubbed at its boundary: ``ray.data.llm.build_processor`` is
replaced by a stub that receives what Ray would (the config, the preprocess and postprocess) and applies them
as Ray Data map stages around a fake engine, carrying the columns as ``ray.data.llm`` documents it does.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from manifests.errors import UsageError
from pipeline.annotate.default_model import MAX_HEAD_DIM, attention_heads, build_default_model
from pipeline.annotate.vllm_engine import (ENGINE_ROW, caption_request, caption_row, engine_max_len, model_positions,
                                           processor_config)  # fmt: skip

PROMPT = "Name the colours."


# ---------------------------------------------------------------- the default model's shape


@pytest.mark.parametrize("width", [2, 32, 48, 96, 200, 256, 300, 768, 1024, 4096])
def test_attention_heads_keep_every_head_at_most_128_wide(width):
    heads = attention_heads(width)
    assert heads >= 2 and width % heads == 0 and width // heads <= MAX_HEAD_DIM


def test_a_wide_default_model_has_heads_vllm_takes_the_tiny_one_keeps_its_own(tmp_path):
    """The GPU check's 1024-wide model had 2 heads of 512 (over FlashAttention's 256); a 512-wide one here
    stands for it (same rule, a quarter of the weights). The tiny default keeps its 2 heads of 16."""
    for width, heads in ((512, 4), (32, 2)):
        config = json.loads((build_default_model(tmp_path / str(width), width=width) / "config.json").read_text())
        for tower in ("text_config", "vision_config"):
            assert config[tower]["hidden_size"] == width and config[tower]["num_attention_heads"] == heads
        assert model_positions(config) == 4096


# ---------------------------------------------------------------- the context: the model's, or less


def test_model_positions_read_the_language_model_of_a_llava_like_config_or_the_model_itself():
    assert model_positions({"text_config": {"max_position_embeddings": 4096}, "max_position_embeddings": 77}) == 4096
    assert model_positions({"max_position_embeddings": 32768}) == 32768
    assert model_positions({"text_config": {}, "max_position_embeddings": 2048}) == 2048
    assert model_positions({"model_type": "no_positions"}) is None


def test_max_model_len_is_the_models_unless_asked_for_less_and_more_is_refused_in_one_line():
    assert engine_max_len(4096, None) == 4096
    assert engine_max_len(4096, 2048) == 2048
    assert engine_max_len(None, 2048) == 2048 and engine_max_len(None, None) is None
    with pytest.raises(UsageError, match=r"^--max-model-len 8192: the model has 4096 positions") as e:
        engine_max_len(4096, 8192)
    assert "\n" not in str(e.value)


def test_max_model_len_is_a_vllm_option(monkeypatch):
    from pipeline.annotate import job as job_module
    from pipeline.annotate.job import AnnotateJob, add_arguments, job_from_args

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    job = job_from_args(parser.parse_args(["m", "--out", "o", "--engine", "vllm", "--max-model-len", "2048"]))
    assert job.max_model_len == 2048
    for engine, value in (("transformers", 2048), ("vllm", 0)):
        with pytest.raises(UsageError, match="--max-model-len"):
            AnnotateJob(manifest="m", out="o", engine=engine, max_model_len=value)
    # --engine auto on a machine where it picks transformers: refused too, not ignored
    monkeypatch.setattr(job_module, "vllm_available", lambda: False)
    auto = AnnotateJob(manifest="m", out="o", max_model_len=2048)
    with pytest.raises(UsageError, match="auto picked transformers"):
        job_module._pick_engine(auto, SimpleNamespace(device="cuda"))
    assert job_module._pick_engine(AnnotateJob(manifest="m", out="o"), SimpleNamespace(device="cuda")) == "transformers"


# ---------------------------------------------------------------- what ray.data.llm is given


def test_the_processor_config_is_one_fixed_replica_per_gpu_with_the_models_context_in_ray_own_config():
    """Validated by the installed Ray's ``vLLMEngineProcessorConfig``, which refuses a keyword it does not know."""
    try:
        from ray.data.llm import vLLMEngineProcessorConfig
    except ModuleNotFoundError as exc:  # Ray 2.52 (the core floor) imports Ray Serve's dependencies there
        pytest.skip(f"ray.data.llm does not import beside this Ray ({exc.name} missing): the vllm extra installs "
                    "ray[llm]>=2.53")

    kwargs = processor_config("/models/llava", batch_size=16, replicas=4, max_model_len=4096)
    config = vLLMEngineProcessorConfig(**kwargs)
    assert config.model_source == "/models/llava" and config.batch_size == 16
    assert config.get_concurrency() == {"min_size": 4, "max_size": 4}  # the engine: exactly 4, not 1..4
    assert config.engine_kwargs["max_model_len"] == 4096
    assert config.engine_kwargs["limit_mm_per_prompt"] == {"image": 1}
    for stage in ("prepare_multimodal_stage", "chat_template_stage", "tokenize_stage", "detokenize_stage"):
        assert getattr(config, stage) == {"enabled": True, "concurrency": (1, 4)}, stage
    assert "max_model_len" not in processor_config("m", batch_size=1, replicas=1, max_model_len=None)["engine_kwargs"]
    with pytest.raises(ValueError):  # pydantic's ValidationError: the names above are ones Ray knows
        vLLMEngineProcessorConfig(**kwargs, prepare_image_stage=True, has_image=True)


def test_the_request_carries_the_image_once_and_the_postprocess_only_the_caption():
    pixels = np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)  # (h, w, 3)
    row = {"sample_id": 2**64 - 7, "filename": "a.jpg", "source_key": 9, "pixels": pixels}  # as Ray gives them
    request = caption_request(row, prompt=PROMPT, max_tokens=12)
    (message,) = request["messages"]
    image, text = message["content"]
    assert message["role"] == "user" and text == {"type": "text", "text": PROMPT}
    assert image["type"] == "image_pil" and image["image_pil"].size == (80, 48)
    assert np.array_equal(np.asarray(image["image_pil"]), pixels)
    assert request["sampling_params"] == {"temperature": 0.0, "max_tokens": 12}
    carried = {**row, **request}  # what ray.data.llm carries: the row's columns, the preprocess's on top
    assert carried["pixels"] is None  # the image rides only in the request
    done = {**carried, "generated_text": "  a red\n square ", "num_generated_tokens": np.int64(5),
            "prompt": "<image> ...", "tokenized_prompt": [1, 2]}  # fmt: skip
    out = caption_row(done)
    assert out == {"sample_id": 2**64 - 7, "filename": "a.jpg", "source_key": 9, "caption": "a red square",
                   "generated_tokens": 5}  # fmt: skip
    assert pa.array([out["sample_id"]]).type == pa.uint64() == pa.array([out["source_key"]]).type  # not int64


# ---------------------------------------------------------------- a run, the engine stubbed

DATA = "__data"  # ray.data.llm's column that carries a row through its stages


def _preprocess_stage(preprocess):
    """ray.data.llm's preprocess: the row's columns carried, the preprocess's output on top."""

    def stage(row: dict) -> dict:
        assert set(row) == set(ENGINE_ROW), f"the processor was given {sorted(row)}"
        return {DATA: {**row, **preprocess(row)}}

    return stage


def _fake_engine(row: dict) -> dict:
    """vLLM's part: takes the request (the image, the sampling settings), gives text and a token count."""
    data = dict(row[DATA])
    assert data["pixels"] is None, "the decoded pixels rode along beside the request"
    image, text = data.pop("messages")[0]["content"]
    assert text == {"type": "text", "text": PROMPT}
    assert data.pop("sampling_params") == {"temperature": 0.0, "max_tokens": 5}
    width, height = image["image_pil"].size
    return {DATA: {**data, "generated_text": f" {width}x{height}\n", "num_generated_tokens": 3}}


def _postprocess_stage(postprocess):
    def stage(row: dict) -> dict:
        out = postprocess(row[DATA])
        assert set(out) == {"sample_id", "filename", "source_key", "caption", "generated_tokens"}, sorted(out)
        return out

    return stage


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("bucketeer_home")
@pytest.mark.full
def test_a_broken_image_under_vllm_is_one_error_row_as_the_transformers_engine_writes_it(
        tmp_path, ray_local, monkeypatch):  # fmt: skip
    """One unit per image (``--unit-rows 1``), so that the broken file's unit reaches the engine with no row."""
    import ray.data.llm

    from manifests.annotations import read_annotations, read_parts
    from manifests.manifest import read_manifest
    from pipeline import AnnotateJob, run
    from pipeline.annotate import job as job_module
    from tests.embed_data import make_dataset

    built = []

    def build_processor(config, preprocess=None, postprocess=None, **kwargs):
        built.append(SimpleNamespace(config=config, preprocess=preprocess, postprocess=postprocess, kwargs=kwargs))
        return lambda ds: (ds.map(_preprocess_stage(preprocess)).map(_fake_engine)
                           .map(_postprocess_stage(postprocess)))  # fmt: skip

    monkeypatch.setattr(job_module, "vllm_available", lambda: True)  # vLLM itself is stubbed out below
    monkeypatch.setattr(ray.data.llm, "build_processor", build_processor)
    root, manifest = str(tmp_path / "images"), str(tmp_path / "manifest")
    make_dataset(root, manifest, 6, broken=("zz_bad.jpg",))
    samples = read_manifest(manifest).samples.to_pylist()
    bad = next(s["sample_id"] for s in samples if s["filename"] == "zz_bad.jpg")
    options = {"manifest": manifest, "prompt": PROMPT, "max_new_tokens": 5, "batch_size": 2, "unit_rows": 1}

    result = run(AnnotateJob(out=str(tmp_path / "vllm"), engine="vllm", device="cuda", **options))
    assert (result.engine, result.captioned, result.errors) == ("vllm", 6, 1)
    (seen,) = built
    assert isinstance(seen.config, ray.data.llm.vLLMEngineProcessorConfig) and not seen.kwargs
    assert seen.config.engine_kwargs["max_model_len"] == 4096 and seen.config.concurrency == (1, 1)
    meta, rows, errors = read_annotations(str(tmp_path / "vllm"))
    assert meta.engine == "vllm" and (meta.counts.annotated, meta.counts.errors) == (6, 1)
    raw = read_parts(str(tmp_path / "vllm"), None, "parts").column("sample_id").to_pylist()
    assert sorted(raw) == sorted(s["sample_id"] for s in samples if s["sample_id"] != bad)  # each captioned once
    sizes = {s["sample_id"]: f"{s['width']}x{s['height']}" for s in samples}
    assert {r["sample_id"]: r["caption"] for r in rows.to_pylist()} == {i: sizes[i] for i in raw}  # its own image
    assert set(rows.column("generated_tokens").to_pylist()) == {3}
    assert errors.column("sample_id").to_pylist() == [bad] and errors.column("error").to_pylist() == ["not_an_image"]

    again = run(AnnotateJob(out=str(tmp_path / "vllm"), engine="vllm", device="cuda", **options))
    assert again.up_to_date and (again.captioned, again.errors, again.skipped) == (0, 0, 7)  # not retried
    assert len(built) == 1  # nothing left to do: no processor built

    reference = run(AnnotateJob(out=str(tmp_path / "transformers"), engine="transformers", device="cpu", **options))
    assert (reference.captioned, reference.errors) == (6, 1)
    listed = [sorted(p.name for p in (tmp_path / out / "errors").iterdir()) for out in ("vllm", "transformers")]
    assert listed[0] == listed[1] and len(listed[0]) == 1  # the same part name: a rerun of either sees the same
    tables = [read_parts(str(tmp_path / out), None, "errors").drop_columns(["written_at"])
              for out in ("vllm", "transformers")]  # fmt: skip
    assert tables[0].equals(tables[1]) and tables[0].schema == tables[1].schema
