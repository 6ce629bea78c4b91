"""The vLLM engine of ``bucketeer annotate`` (``ray.data.llm``): runs only where CUDA and vLLM are present."""

from __future__ import annotations

import pytest

from pipeline.annotate.engines import vllm_available


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("bucketeer_home"),
              pytest.mark.skipif(not (_cuda() and vllm_available()),
                                 reason="the vLLM engine needs CUDA and `pip install 'bucketeer[vllm]'`")]  # fmt: skip


def test_vllm_engine_captions_every_sample_once(tmp_path, ray_local):
    from manifests.annotations import read_annotations
    from manifests.manifest import read_manifest
    from pipeline import AnnotateJob, run
    from tests.embed_data import make_dataset

    root, manifest, out = str(tmp_path / "images"), str(tmp_path / "manifest"), str(tmp_path / "captions")
    make_dataset(root, manifest, 8)
    result = run(AnnotateJob(manifest=manifest, out=out, engine="vllm", device="cuda", max_new_tokens=8,
                             batch_size=4, unit_rows=4))  # fmt: skip
    assert result.engine == "vllm" and result.captioned == 8
    meta, rows, errors = read_annotations(out)
    assert meta.engine == "vllm" and errors.num_rows == 0
    assert sorted(rows.column("sample_id").to_pylist()) == sorted(read_manifest(manifest).samples.column(
        "sample_id").to_pylist())  # fmt: skip
