"""The vLLM engine of ``bucketeer annotate`` (``ray.data.llm``) for real: runs only where CUDA and vLLM are present
(``make install-vllm``, then ``make test-gpu``). Everything up to the engine is tested on the CPU in
``tests/test_annotate_vllm_cpu.py``."""

from __future__ import annotations

import pytest

from pipeline.annotate.engines import vllm_available


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("bucketeer_home"),
              pytest.mark.skipif(not (_cuda() and vllm_available()),
                                 reason="the vLLM engine needs CUDA and `make install-vllm`")]  # fmt: skip


def test_vllm_engine_captions_every_sample_once_and_counts_what_does_not_decode(tmp_path, ray_local):
    from manifests.annotations import read_annotations
    from manifests.manifest import read_manifest
    from pipeline import AnnotateJob, run
    from tests.embed_data import make_dataset

    root, manifest, out = str(tmp_path / "images"), str(tmp_path / "manifest"), str(tmp_path / "captions")
    make_dataset(root, manifest, 8, broken=("zz_bad.jpg",))
    samples = read_manifest(manifest).samples
    ids = {s["sample_id"]: s["filename"] for s in samples.to_pylist()}
    result = run(AnnotateJob(manifest=manifest, out=out, engine="vllm", device="cuda", max_new_tokens=8,
                             batch_size=4, unit_rows=4))  # fmt: skip
    assert (result.engine, result.captioned, result.errors) == ("vllm", 8, 1)
    meta, rows, errors = read_annotations(out)
    assert meta.engine == "vllm" and (meta.counts.annotated, meta.counts.errors) == (8, 1)
    assert [ids[i] for i in errors.column("sample_id").to_pylist()] == ["zz_bad.jpg"]
    assert sorted(rows.column("sample_id").to_pylist()) == sorted(i for i, f in ids.items() if f != "zz_bad.jpg")
    assert all(0 < n <= 8 for n in rows.column("generated_tokens").to_pylist())
