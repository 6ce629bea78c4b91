"""``make gpu-check`` (benchmarks/gpu_check.py): one line without CUDA, every section's code on the CPU with
``--smoke``, the real-size configs valid for their classes; and, with CUDA, the encoders on the GPU against
the CPU (``make test-gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def test_without_cuda_it_prints_one_line_and_exits_0():
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=_env(CUDA_VISIBLE_DEVICES=""),
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.splitlines()) == 1 and proc.stdout.startswith("gpu-check: no CUDA device here")


@pytest.mark.slow
@pytest.mark.full
def test_smoke_runs_every_section_on_the_cpu_without_ray_polars_or_s3fs(tmp_path):
    """Every section's code on tiny models (one family: the other differs in configs only, checked below) in a
    process where Ray, polars, s3fs and vLLM do not import, as on the GPU machine: every row but the Ray and vLLM
    ones filled; FSDP/DeepSpeed rows say why they skip on a CPU; the table is written as markdown and JSON."""
    from tests.factories import absent_modules_site

    site = absent_modules_site(tmp_path / "site")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--families", "sdxl", "--backends", "ddp,zero3",
                           "--out-dir", str(out), "--work-dir", str(tmp_path / "work"), "--budget", "1200"],
                          capture_output=True, text=True, env=_env(PYTHONPATH=f"{site}:{ROOT}"),
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu-check.json").read_text())
    rows = result["rows"]
    assert {r["section"] for r in rows} == {"sdpa", "setup", "vae", "text", "embed", "records", "loader", "train",
                                            "repa", "wan", "annotate", "decode", "embed-ray"}  # fmt: skip
    assert [r for r in rows if r["status"] == "failed"] == []
    skipped = {r["section"]: r["result"] for r in rows if r["status"] == "skipped"}
    assert skipped["embed-ray"].startswith("skipped: needs ray") and "vllm does not import" in skipped["annotate"]
    by = {(r["section"], r["values"].get("batch")): r for r in rows}
    assert by[("vae", 1)]["values"]["images_per_second"] > 0 and by[("vae", 2)]["values"]["alone"] > 0
    (tuned,) = [r for r in rows if r["values"].get("tuned_batch")]  # the tuned encoder vs diffusers' as shipped
    assert tuned["values"]["shipped"] > 0 and 0 < tuned["values"]["max_rel_diff"] < 0.05
    # every row that runs a model says its TFLOP/s; on a CPU there is no peak to divide by
    modelled = [r for r in rows if r["section"] in ("vae", "repa", "wan", "train") or "CLIP vision" in r["measure"]
                or "TextEncoders.encode vs" in r["measure"]]  # fmt: skip
    assert len(modelled) == 9 and all(r["values"]["tflops"] > 0 for r in modelled if r["status"] == "ok")
    assert all("fraction n/a (no GPU peak)" in r["result"] for r in modelled if r["status"] == "ok")
    text = [r for r in rows if r["section"] == "text"]
    assert text[1]["values"]["rel_error"] == 0.0  # the cache's text is exactly encode_prompt's
    embed = next(r for r in rows if r["section"] == "embed")
    assert embed["values"]["images_per_second"] > 0 and "--executor local" in embed["measure"]
    records = next(r for r in rows if r["section"] == "records")
    assert records["values"]["latent_rel_error"] == 0.0  # --smoke: the CPU path twice, the same records
    trained = [r for r in rows if r["section"] == "train"]
    assert trained[0]["status"] == "ok" and trained[0]["values"]["steps"] == 4
    assert trained[0]["values"]["stop"] == "--max-steps reached" and 0 <= trained[0]["values"]["data_wait"] <= 1
    assert trained[1]["status"] == "skipped" and "only on GPUs" in trained[1]["result"]
    table = (out / "gpu-check.md").read_text()
    assert table.count("\n| ") == len(rows) + 1  # header + one line per row


@pytest.mark.slow
@pytest.mark.full
def test_smoke_runs_the_encoder_families_rows_without_ray_polars_or_s3fs(tmp_path):
    """The rows of the families measured by their encoders alone (a 2D and a 3D VAE; a text encoder with and
    without a reference image), on their tiny pipelines without a denoiser, where Ray, polars, s3fs and vLLM do
    not import: every row filled, the cache's text exactly encode_prompt's, each folder removed after its rows."""
    from tests.factories import absent_modules_site

    site = absent_modules_site(tmp_path / "site")
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--families", "flux2,qwen-image-edit", "--sections",
                           "setup,vae,text", "--out-dir", str(out), "--work-dir", str(work), "--budget", "600"],
                          capture_output=True, text=True, env=_env(PYTHONPATH=f"{site}:{ROOT}"),
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "gpu-check.json").read_text())["rows"]
    assert [r for r in rows if r["status"] != "ok"] == []
    assert [(r["section"], r["measure"].split(":")[0].split(" ")[0]) for r in rows] == [
        (section, family) for family in ("flux2", "qwen-image-edit")
        for section in ("setup", "vae", "vae", "vae", "text", "text")]  # fmt: skip
    vae = {(r["measure"].split(" ")[0], r["values"]["batch"]): r for r in rows if "batch" in r["values"]}
    assert "AutoencoderKLFlux2" in vae["flux2", 1]["measure"] and "QwenImage" in vae["qwen-image-edit", 2]["measure"]
    assert all(r["values"]["images_per_second"] > 0 and r["values"]["alone"] > 0 for r in vae.values())
    text = [r for r in rows if r["section"] == "text"]
    assert text[0]["values"]["captions_per_second"] > 0 and text[0]["values"]["encode_prompt"] > 0
    assert "2 (instruction, 64x64 reference) pairs" in text[2]["measure"] and "pairs/s" in text[2]["result"]
    assert text[1]["values"]["rel_error"] == 0.0 and text[3]["values"]["rel_error"] == 0.0  # exactly encode_prompt
    assert not list(work.glob("model-*"))  # each family's folder gone once its rows are in


def test_families_all_and_an_unknown_family():
    from benchmarks.gpu_check import FAMILIES, parse_args

    assert parse_args([]).families == "sdxl,flux"  # the default run: under 8 minutes
    assert parse_args(["--families", "all"]).families.split(",") == list(FAMILIES)
    assert {"flux2", "flux2-klein", "chroma", "qwen-image", "qwen-image-edit", "z-image"} < set(FAMILIES)
    with pytest.raises(SystemExit):
        parse_args(["--families", "sdxl,flux3"])


def test_an_encoder_family_that_does_not_fit_is_skipped_with_the_reason():
    """Disk first (the folder and 1 GB), then GPU memory (the text encoder whole), then the budget left (the
    folder written once, read twice at ~1 GB/s, plus a minute); None when it fits."""
    from benchmarks.gpu_check import wont_fit

    gb = 10**9
    assert wont_fit("flux2", 48 * gb, 60 * gb, 79 * gb, 600) is None
    assert "48.0 GB of disk and 40.0 GB are free" in wont_fit("flux2", 48 * gb, 40 * gb, 79 * gb, 600)
    assert "GPU memory" in wont_fit("flux2", 48 * gb, 60 * gb, 40 * gb, 600)
    late = wont_fit("flux2", 48 * gb, 60 * gb, None, 150)
    assert "~204 s" in late and "150 s of the budget" in late and "--families flux2 --sections setup,vae,text" in late


# published parameter counts of the encoder families' text encoders and VAEs (the hub's configs, as
# benchmarks/text_bytes.py counts them)
ENCODER_PARAMS = {"flux2": (24.01e9, 84.05e6), "flux2-klein": (4.022e9, 84.05e6), "chroma": (4.762e9, 83.82e6),
                  "z-image": (4.022e9, 83.82e6), "qwen-image": (8.292e9, 126.89e6),
                  "qwen-image-edit": (8.292e9, 126.89e6), "longcat-image": (8.292e9, 83.82e6),
                  "krea-2": (4.438e9, 126.89e6), "qwen-image-2.1": (8.767e9, 337.74e6),
                  # ERNIE: Ministral 3 3B's text model (3.43B) + transformers' default Pixtral tower (config unknown)
                  "ernie-image": (3.849e9, 84.05e6), "anima": (0.596e9, 126.89e6),
                  "kandinsky-5": (8.292e9, 83.82e6)}  # fmt: skip
# the families' other text models: Anima's LLM adapter, Kandinsky 5's CLIP-L
PART_PARAMS = {"text_conditioner": 134.66e6, "text_encoder_2": 123.06e6}


def test_the_encoder_families_real_size_models_have_the_published_sizes_and_the_tokenizers_ids():
    """On the meta device: each family's text encoder and VAE at the published sizes, the classes its pipeline
    loads, and the special tokens Qwen2.5-VL finds a reference image by those of the tokenizer the folder holds."""
    from benchmarks.gpu_models import ENCODER_FAMILIES, real_encoders, real_text_parts, text_tokenizer
    from pipeline.embed.families.base import missing_classes
    from pipeline.embed.families.tiny import tiny_pipeline

    assert set(ENCODER_FAMILIES) == set(ENCODER_PARAMS)
    for family, (text_params, vae_params) in ENCODER_PARAMS.items():
        if missing_classes(family) is not None:  # an older diffusers (the floors) has not its pipeline
            continue
        pipe = tiny_pipeline(family)
        tok = text_tokenizer(pipe)
        with torch.device("meta"):
            text, vae = real_encoders(family, tok)
            parts = real_text_parts(family, pipe)
        assert (type(text), type(vae)) == (type(pipe.text_encoder), type(pipe.vae)), family
        for model, published in ((text, text_params), (vae, vae_params)):
            assert abs(sum(p.numel() for p in model.parameters()) / published - 1) < 1e-3, (family, type(model))
        for name, model in parts.items():  # the pipeline's class and size; Anima's T5 ids in range
            assert type(model) is type(getattr(pipe, name)), (family, name)
            assert abs(sum(p.numel() for p in model.parameters()) / PART_PARAMS[name] - 1) < 1e-3, (family, name)
            if name == "text_conditioner":
                assert max(pipe.t5_tokenizer.get_vocab().values()) < model.config.target_vocab_size
        if family.startswith("qwen-image") or family in ("krea-2", "longcat-image", "kandinsky-5"):
            assert text.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
            assert text.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
        vocab = text.config.get_text_config().vocab_size
        assert max(tok.get_vocab().values()) < vocab  # every id the tokenizer gives is in the vocabulary


@pytest.mark.slow
@pytest.mark.full
def test_the_real_size_folders_path_on_shrunk_language_models(tmp_path, monkeypatch):
    """What ``gpu_check.py`` runs on a GPU for each encoder family, on the CPU: the folder built from the published
    configs (the VAEs at real size; the language models' widths and depths shrunk, their structure kept) in bf16
    without a denoiser, then the VAE and text rows: the pipeline loads it and the cache's text is exactly its
    ``encode_prompt``'s (Qwen-Image-Edit: with a reference image, its tokens found by the tokenizer's ids)."""
    from safetensors import safe_open

    from benchmarks import gpu_models
    from benchmarks.gpu_measures import text_vs_pipeline, vae_sweep

    from pipeline.embed.families.flux2 import DEV_LAYERS, KLEIN_LAYERS

    # as deep as the hidden states read and one layer more (which embed prunes and the pipeline runs): 512 tokens
    small = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 16, "vocab_size": 1024}  # fmt: skip
    depth = {"flux2-klein": max(KLEIN_LAYERS) + 1, "z-image": 3}  # Z-Image reads hidden_states[-2]
    mistral, qwen_vl, qwen3 = gpu_models.MISTRAL_SMALL_31, gpu_models.QWEN_VL_7B, gpu_models.QWEN3_4B
    monkeypatch.setattr(gpu_models, "MISTRAL_SMALL_31", {**mistral, "text_config": {
        **mistral["text_config"], **small, "num_hidden_layers": max(DEV_LAYERS) + 1}, "vision_config": {
        **mistral["vision_config"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 2}})  # fmt: skip
    monkeypatch.setattr(gpu_models, "QWEN_VL_7B", {**qwen_vl, "text_config": {
        **qwen_vl["text_config"], **small, "num_hidden_layers": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}, "vision_config": {
        **qwen_vl["vision_config"], "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
        "out_hidden_size": 32, "fullatt_block_indexes": [1]}})  # fmt: skip
    monkeypatch.setattr(gpu_models, "T5_XXL", {**gpu_models.T5_XXL, "d_model": 32, "d_ff": 48, "num_heads": 2,
                                               "d_kv": 16, "num_layers": 2})  # fmt: skip
    # the 2026 families: ERNIE reads hidden_states[-2], Krea 2 hidden state 35; Anima's adapter reads Qwen3's width
    monkeypatch.setattr(gpu_models, "MINISTRAL3_3B_TEXT", {**gpu_models.MINISTRAL3_3B_TEXT, **small,
                                                           "num_hidden_layers": 3})  # fmt: skip
    monkeypatch.setattr(gpu_models, "ERNIE_VISION", {"hidden_size": 32, "intermediate_size": 48,
                                                     "num_hidden_layers": 1, "num_attention_heads": 2})  # fmt: skip
    qwen3_vl = {"vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                                  "out_hidden_size": 32, "deepstack_visual_indexes": [1]}}  # fmt: skip
    for name, layers in (("QWEN3_VL_8B", 2), ("QWEN3_VL_4B", 36)):
        config = getattr(gpu_models, name)
        monkeypatch.setattr(gpu_models, name, {**config, "text_config": {
            **config["text_config"], **small, "num_hidden_layers": layers, "rope_parameters": {
                **config["text_config"]["rope_parameters"], "mrope_section": [2, 3, 3]}},
            "vision_config": {**config["vision_config"], **qwen3_vl["vision_config"]}})  # fmt: skip
    monkeypatch.setattr(gpu_models, "QWEN3_06B", {**gpu_models.QWEN3_06B, **small, "num_hidden_layers": 2})
    monkeypatch.setattr(gpu_models, "ANIMA_TEXT_CONDITIONER", {
        **gpu_models.ANIMA_TEXT_CONDITIONER, "source_dim": 32, "target_dim": 32, "model_dim": 32, "num_layers": 1,
        "num_attention_heads": 2})  # fmt: skip
    swept = set()  # VAE classes measured: Chroma's and Z-Image's are Flux.1's, Klein's is Flux 2's
    for family in [f for f in gpu_models.ENCODER_FAMILIES if f != "qwen-image"]:  # its models are the edit's
        monkeypatch.setattr(gpu_models, "QWEN3_4B", {**qwen3, **small, "num_hidden_layers": depth.get(family, 2)})
        folder = gpu_models.build_encoders_folder(family, tmp_path / family, real=True)
        index_file = folder / ("modular_model_index.json" if family == "anima" else "model_index.json")
        index = json.loads(index_file.read_text())
        assert index["transformer"][:2] == [None, None] and not (folder / "transformer").exists()
        weights = next((folder / "vae").glob("*.safetensors"))
        with safe_open(weights, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} - {"I64"} == {"BF16"}, family  # I64: a counter
        if index["vae"][1] not in swept:
            swept.add(index["vae"][1])
            (alone,) = vae_sweep(family, str(folder), (32, 32), (1,), False, 1)
            assert alone.values["images_per_second"] > 0
        reference = (32, 32) if family == "qwen-image-edit" else None
        rate, exact = text_vs_pipeline(family, str(folder), 2, False, 1, reference)
        assert rate.values["captions_per_second"] > 0 and exact.values["rel_error"] == 0.0, family


def _wheel(folder, name: str, version: str, tag: str = "py3-none-any") -> Path:
    """A minimal wheel of a one-module package ``name`` (what pip needs: the module, METADATA, WHEEL, RECORD)."""
    import zipfile

    path = folder / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
    return path


def test_the_wheel_folder_installs_offline_what_fits_this_python(tmp_path):
    """``--wheels``: the wheels that fit the running Python go into the target, offline; a cp312-only one on
    another Python is left out and named; a second call with the same folder installs nothing again."""
    from benchmarks.gpu_env import install

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "bkt_fits", "1.0")
    other = "cp312-cp312-manylinux_2_17_x86_64" if sys.version_info[:2] != (3, 12) else "cp311-cp311-win_amd64"
    _wheel(wheels, "bkt_other", "2.0", other)
    target = tmp_path / "site"
    left_out = install(wheels, target)
    assert left_out == [f"bkt_other-2.0-{other}.whl"]
    assert (target / "bkt_fits.py").exists() and not (target / "bkt_other.py").exists()
    (target / "bkt_fits.py").unlink()
    assert install(wheels, target) == left_out and not (target / "bkt_fits.py").exists()  # done once
    with pytest.raises(SystemExit, match="no such folder.*make gpu-wheels"):
        install(tmp_path / "missing", target)


def test_the_wheel_list_pins_every_line_and_fits_the_limit():
    """infra/gpu/wheels.txt: NAME==VERSION lines (deepspeed a source archive); a line of another form is refused.
    Its size limit is what travels beside the working tree (64 MiB in all)."""
    from benchmarks.gpu_env import LIMIT_BYTES, read_list

    reqs = read_list()
    assert {r.spec.split("==")[0] for r in reqs} >= {"diffusers", "deepspeed", "isal"}
    assert [r.spec for r in reqs if r.sdist] == [r.spec for r in reqs if r.spec.startswith("deepspeed==")]
    assert LIMIT_BYTES <= 40 << 20


def test_a_bad_wheel_list_line_is_refused(tmp_path):
    from benchmarks.gpu_env import read_list

    bad = tmp_path / "wheels.txt"
    bad.write_text("diffusers>=0.42\n")
    with pytest.raises(ValueError, match="write NAME==VERSION"):
        read_list(bad)


# published parameter counts (diffusers / transformers model cards and configs)
REAL_PARAMS = {("sdxl", "vae"): 83.65e6, ("sdxl", "text_encoder"): 123.06e6, ("sdxl", "text_encoder_2"): 694.66e6,
               ("sdxl", "unet"): 2567.46e6, ("flux", "text_encoder_2"): 4762.31e6}  # fmt: skip


def test_the_real_size_configs_build_their_classes_at_the_published_sizes():
    """On the meta device (no memory): every REAL config is valid for its class and has the published size."""
    from benchmarks.gpu_models import REAL, _model
    from pipeline.embed.families.tiny import clip_tokenizer, t5_tokenizer

    tokenizers = {"sdxl": (clip_tokenizer(), clip_tokenizer(pad_token="!")), "flux": (clip_tokenizer(), t5_tokenizer())}
    sizes = {}
    for family, parts in REAL.items():
        for part, config in parts.items():
            if part == "scheduler":
                continue
            tok = tokenizers[family][part == "text_encoder_2"]
            with torch.device("meta"):
                model = _model(family, part, config, tok)
            sizes[family, part] = sum(p.numel() for p in model.parameters())
    for key, published in REAL_PARAMS.items():
        assert abs(sizes[key] / published - 1) < 0.01, (key, sizes[key])
    assert 2.3e9 < sizes["flux", "transformer"] < 2.7e9  # 4 + 8 of Flux's 19 + 38 blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the encoders on the GPU against the CPU")
def test_the_embed_encoders_on_cuda_give_what_they_give_on_the_cpu(tmp_path):
    """The VAE and the text encoders of the sdxl and flux families on cuda (bf16 compute) against the CPU (fp32):
    the same latents and text embeddings within bf16 precision, returned on the host."""
    from benchmarks.gpu_models import TINY, build_folder
    from pipeline.embed.loading import EncoderSource
    from pipeline.embed.latents import LatentSpec
    from pipeline.embed.encoders import TextSpec

    pixels = np.random.default_rng(0).integers(0, 255, (2, 64, 64, 3), dtype=np.uint8)
    for family in ("sdxl", "flux"):
        folder = str(build_folder(family, tmp_path / family, TINY[family]))
        vae = LatentSpec(EncoderSource(folder, "vae"))
        cpu, gpu = (vae.load(use_gpu=g).encode(pixels)["latent"] for g in (False, True))
        assert gpu.device.type == "cuda" and torch.allclose(gpu.cpu(), cpu, atol=0.05, rtol=0.05)
        spec = TextSpec(family, (EncoderSource(folder, "text_encoder"), EncoderSource(folder, "text_encoder_2")),
                        EncoderSource(folder))  # fmt: skip
        cpu_text, gpu_text = (spec.load(use_gpu=g).encode(["a red cat", "a blue dog"]) for g in (False, True))
        for (tokens_c, pooled_c), (tokens_g, pooled_g) in zip(cpu_text, gpu_text):
            for c, g in zip(tokens_c, tokens_g):
                assert g.device.type == "cpu" and torch.allclose(g, c, atol=0.05, rtol=0.05)
            assert torch.allclose(pooled_g, pooled_c, atol=0.05, rtol=0.05)


def test_the_ema_follows_the_model_to_its_device():
    """The EMA is made before accelerator.prepare moves the model to the GPU: its first step follows the weights
    (here to the meta device, which a CPU has) instead of failing on two devices."""
    from train.ema import EMA

    model = torch.nn.Linear(4, 2)
    ema = EMA(model, 0.9)
    model.to("meta")
    ema.step(model)
    assert {p.device.type for p in ema.average.shadow_params} == {"meta"}
