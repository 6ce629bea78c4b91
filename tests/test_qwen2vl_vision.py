"""The pipelines that load a torchvision processor: bucketeer computes what they compute, with or without torchvision.

torchvision cannot be installed beside the CPU torch, so ``make test`` builds ``.venv-vision`` (torch with
torchvision, this project's transformers and diffusers) and passes its python as ``BUCKETEER_VISION_PYTHON``;
``tests/vision_check.py`` runs there on the real checkpoints' files (tests/fixtures/checkpoints) and these tests read
its findings:

- Qwen-Image-Edit's ``Qwen2VLProcessor`` (torchvision backend) and bucketeer's torch-only twin give the same ids,
  pixels and grids for every image size; the pipeline's ``__call__`` and bucketeer's ``encode`` with the twin give
  the same text, bit for bit in fp32; and the two are told apart by the fingerprint's processor record.
- FLUX.2-dev's ``tokenizer/`` loaded as ``PixtralProcessor`` (the pipeline) and ``AutoTokenizer`` (bucketeer) render
  one template, feed the model the same ids on hard captions and give the same cached text.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("BUCKETEER_VISION_PYTHON")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PYTHON, reason="BUCKETEER_VISION_PYTHON is not set: "
                                                   "`make test` builds .venv-vision (torchvision) and sets it")]


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vision") / "findings.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([PYTHON, "-m", "tests.vision_check", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _ok(part):
    assert "error" not in part, part.get("error") if isinstance(part, dict) else part
    return part


def test_the_torch_image_processor_is_the_torchvision_backend_bit_for_bit(findings):
    rows = _ok(findings["qwen2vl_processor"])
    assert [r["size"] for r in rows if not r["equal"]] == []
    assert {r["grid"][1] * 14 for r in rows} >= {1036}  # a 1024² image goes to 1036² (smart_resize's 28 grid)
    real, ours = rows[0]["real"], rows[0]["ours"]
    assert real == {"class": "Qwen2VLProcessor", "image_processor": "Qwen2VLImageProcessor", "backend": "torchvision"}
    assert ours["backend"] == "torch" and ours != real  # equal pixels, and still told apart in the fingerprint
    # the PIL twin bucketeer used before: not the same pixels (why it is no longer used)
    assert any(r["pil_max_diff"] and r["pil_max_diff"] > 0 for r in rows)


def test_qwen_image_edit_text_without_torchvision_equals_the_pipelines_call(findings):
    rows = _ok(findings["qwen_edit"])
    assert len(rows) == 3 and all(r["equal"] for r in rows), rows


def test_flux2_tokenizer_folder_gives_bucketeer_the_pipelines_template_ids_and_text(findings):
    flux2 = _ok(findings["flux2"])
    assert flux2["processor"] == "PixtralProcessor"
    assert flux2["same_template"] and flux2["same_ids"] and all(flux2["same_text"]), flux2
