"""The tuned VAE encoder (pipeline.embed.vae_speed: what ``LatentEncoder`` applies on cuda) gives diffusers' latents.

On this CPU, against diffusers' plain ``vae.encode(x).latent_dist.mean`` on the same weights, for the project's tiny
VAEs of three classes (Flux.1's ``AutoencoderKL``, Flux 2's ``AutoencoderKLFlux2``, Qwen-Image's 3D
``AutoencoderKLQwenImage``). Tolerances: in float32 NHWC changes only the order in which the convolutions sum
(seen: 1.4e-6 on latents of magnitude ~1), so ``atol = rtol = 1e-5``; in bf16 every layer rounds its activations
to 8 bits of mantissa, whichever the layout, so the tuned latents are held to diffusers' own bf16 call: no further
from the float32 latents than 1.25 times what that call is (seen: 0.95-1.02 times, both ~1.7% relative L2).
``--compile-vae`` reaches the encoder and changes no fingerprinted setting; the compiled encoder (inductor, which
builds C++ kernels on a CPU: minutes) is a ``full`` test.
"""

from __future__ import annotations

import copy
import os
import shutil

import numpy as np
import pytest
import torch

from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.loading import EncoderSource, quiet_loading
from pipeline.embed.latents import LatentSpec, _vae_class
from pipeline.embed.vae_speed import VaeTuning, as_input, gpu_tuning, tune_vae

FAMILIES = {"flux": "AutoencoderKL", "flux2": "AutoencoderKLFlux2", "qwen-image": "AutoencoderKLQwenImage"}
FLAT = ("flux", "flux2")  # 2D VAEs: what channels_last and compile take


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-vaes")
    return {f: str(build_tiny(f, base / f)) for f in FAMILIES}


def _plain(folder: str, dtype=torch.float32):
    """The VAE as diffusers ships it: from_pretrained, NCHW, default attention."""
    return _vae_class(folder, "vae").from_pretrained(folder, subfolder="vae", torch_dtype=dtype).eval()


def _pixels(seed: int = 0, batch: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 64, 48, 3), dtype=np.uint8)


def _encode(vae, x: torch.Tensor) -> torch.Tensor:
    """The posterior mean as float32, a clip VAE given 1-frame clips as its pipelines do."""
    clip = vae.encoder.conv_in.weight.ndim == 5
    with torch.inference_mode():
        mean = vae.encode(x.unsqueeze(2) if clip else x).latent_dist.mean
    return (mean[:, :, 0] if clip else mean).float()


def _x(pixels: np.ndarray, dtype=torch.float32) -> torch.Tensor:
    """Pixels in [-1, 1], NCHW and contiguous: what a user hands ``vae.encode``."""
    return (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1).to(dtype).contiguous()


def test_diffusers_vae_attention_already_runs_sdpa(tiny):
    """diffusers 0.42's 2D VAEs attend through AttnProcessor2_0 (SDPA) as shipped: nothing to replace; a model
    holding the classic processor gets SDPA back, with the same latents."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    from pipeline.embed.vae_speed import sdpa_attention

    for family in FLAT:
        vae = _plain(tiny[family])
        assert vae.attn_processors and all(isinstance(p, AttnProcessor2_0) for p in vae.attn_processors.values())
        assert sdpa_attention(vae) == []
        x = _x(_pixels())
        ref = _encode(vae, x)
        vae.set_attn_processor(AttnProcessor())
        assert sdpa_attention(vae) == sorted(vae.attn_processors)
        assert all(isinstance(p, AttnProcessor2_0) for p in vae.attn_processors.values())
        torch.testing.assert_close(_encode(vae, x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FLAT)
def test_channels_last_gives_diffusers_latents_in_fp32(tiny, family):
    plain = _plain(tiny[family])
    tuned = copy.deepcopy(plain)
    tuning = tune_vae(tuned, channels_last=True)
    assert tuning == VaeTuning(channels_last=True)
    assert tuned.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not plain.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    x = _x(_pixels())
    assert as_input(x, tuning).is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(_encode(tuned, as_input(x, tuning)), _encode(plain, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FLAT)
def test_channels_last_in_bf16_is_as_exact_as_diffusers_bf16_call(tiny, family):
    ref = _plain(tiny[family])
    plain = _plain(tiny[family], torch.bfloat16)
    tuned = copy.deepcopy(plain)
    tuning = tune_vae(tuned, channels_last=True)
    for seed in range(2):
        pixels = _pixels(seed, batch=4)
        exact = _encode(ref, _x(pixels))
        shipped = _encode(plain, _x(pixels, torch.bfloat16))
        ours = _encode(tuned, as_input(_x(pixels, torch.bfloat16), tuning))
        err = lambda a: float((a - exact).norm() / exact.norm())  # noqa: E731
        assert 0 < err(ours) <= 1.25 * err(shipped) and err(shipped) < 0.05, (err(ours), err(shipped))


def test_a_3d_vae_keeps_its_layout_and_is_not_compiled(tiny):
    plain = _plain(tiny["qwen-image"])
    tuned = copy.deepcopy(plain)
    tuning = tune_vae(tuned, channels_last=True, compile=True)
    assert tuning == VaeTuning()  # nothing taken: clips convolve in 3D
    assert not hasattr(tuned.encoder, "_compiled_call_impl") or tuned.encoder._compiled_call_impl is None
    x = _x(_pixels())
    assert torch.equal(_encode(tuned, as_input(x, tuning)), _encode(plain, x))


def test_the_encoder_tunes_on_cuda_only_unless_compile_is_asked():
    assert gpu_tuning(torch.device("cuda")) == {"channels_last": True, "cudnn_benchmark": True, "compile": False}
    assert gpu_tuning(torch.device("cpu")) == {"channels_last": False, "cudnn_benchmark": False, "compile": False}
    assert gpu_tuning(torch.device("cpu"), compile=True)["compile"] is True


@pytest.mark.parametrize("family", FLAT)
def test_latent_encoder_on_the_tuned_path_gives_its_plain_latents(tiny, family, monkeypatch):
    """``LatentEncoder.encode`` with the cuda switches (cuDNN's aside) on this CPU: its latents, the family's own
    (Flux 2's patchified and normalised), those of its plain CPU path, and laid out as they are."""
    from pipeline.embed import latents

    spec = LatentSpec(EncoderSource(tiny[family], "vae"), latents="posterior")
    plain = spec.load()
    assert plain.tuning == VaeTuning() and plain.describe()["tuning"]["channels_last"] is False
    monkeypatch.setattr(latents, "gpu_tuning", lambda device, compile: {"channels_last": True, "compile": compile})
    tuned = spec.load()
    assert tuned.tuning.channels_last and tuned.vae.encoder.conv_in.weight.is_contiguous(
        memory_format=torch.channels_last)  # fmt: skip
    pixels = _pixels()
    pixels.flags.writeable = False  # as Ray hands them out
    got, want = tuned.encode(pixels), plain.encode(pixels)
    assert set(got) == set(want) == {"latent", "latent_std"}
    for key in want:
        assert got[key].is_contiguous()
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)


def test_compile_vae_reaches_the_encoder_and_changes_no_fingerprinted_setting(tiny, tmp_path):
    """``--compile-vae`` -> EmbedJob -> the VAE spec the workers load -> its encoder marked for compiling (lazily:
    nothing compiles before the first batch); the settings ``_cache.json`` hashes are those without it."""
    import argparse

    from pipeline.embed import job as embed_job
    from pipeline.embed.options import add_arguments, job_from_args
    from pipeline.embed.settings import vae_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [str(tmp_path / "manifest"), "--out", str(tmp_path / "cache"), "--vae", tiny["flux"], "--vae-subfolder",
            "vae"]  # fmt: skip
    plain, compiled = (job_from_args(parser.parse_args(argv + extra)) for extra in ([], ["--compile-vae"]))
    assert (plain.compile_vae, compiled.compile_vae) == (False, True)
    make_plain, _ = embed_job._factories(plain, "BF16")
    make_compiled, _ = embed_job._factories(compiled, "BF16")
    a, b = make_plain(use_gpu=False), make_compiled(use_gpu=False)
    assert (a.tuning.compiled, b.tuning.compiled) == (False, True)
    assert a.vae.encoder._compiled_call_impl is None and b.vae.encoder._compiled_call_impl is not None
    assert list(a.vae.state_dict()) == list(b.vae.state_dict())  # compiled in place: the same names
    request = {"vae": {"id": tiny["flux"], "subfolder": "vae"}}
    assert vae_settings(request, a.describe()) == vae_settings(request, b.describe())
    assert a.describe()["weights_sha256"] == b.describe()["weights_sha256"]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.skipif(_compiler() is None, reason="torch.compile (inductor) on a CPU builds C++ kernels: no compiler")
@pytest.mark.parametrize("family", FLAT)
def test_the_compiled_encoder_gives_diffusers_latents(tiny, family):
    """Inductor's kernels for the encoder (NHWC and compiled, as on cuda with --compile-vae), float32: the plain
    call's latents within the summation-order tolerance. Compiling takes 1-3 minutes on a CPU."""
    plain = _plain(tiny[family])
    tuned = copy.deepcopy(plain)
    tuning = tune_vae(tuned, channels_last=True, compile=True)
    assert tuning.compiled and tuned.encoder._compiled_call_impl is not None
    x = _x(_pixels())
    torch.testing.assert_close(_encode(tuned, as_input(x, tuning)), _encode(plain, x), atol=1e-5, rtol=1e-5)


def test_features_take_the_vae_batch_where_it_is(tmp_path):
    """``--features``: the DINOv2 features of the VAE's batch (a read-only array, as Ray hands it out) are bit for
    bit those of the numpy crops given to the features model alone, and of the same pixels as a tensor."""
    from pipeline.embed.features import FeatureSpec

    features = FeatureSpec("dinov2", "default", str(tmp_path / "home"))
    spec = LatentSpec(EncoderSource("default", home=str(tmp_path / "home")), features=features)
    encoder = spec.load()
    pixels = _pixels(batch=4)
    alone = encoder.features.encode(pixels[:3])
    pixels.flags.writeable = False
    got = encoder.encode(pixels, features_of=3)
    assert got["features"].shape == alone.shape == (3, 4, 4, 32)
    assert torch.equal(got["features"], alone)
    assert torch.equal(encoder.features.encode(torch.from_numpy(pixels.copy())[:3]), alone)
    assert torch.equal(got["latent"], encoder.encode(pixels.copy())["latent"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the tuned encoder and pinned copies")
def test_on_cuda_the_tuned_encoder_and_one_copy_give_the_cpu_records(tiny, tmp_path):
    """On cuda (tuned, bf16, the batch pinned and copied once): latents within bf16 rounding of the CPU's (fp32),
    the features from the device batch those of the numpy crops on the same device."""
    from pipeline.embed.features import FeatureSpec

    pixels = _pixels(batch=4)
    for family in FLAT:
        spec = LatentSpec(EncoderSource(tiny[family], "vae"))
        cpu, gpu = spec.load(), spec.load(use_gpu=True)
        assert gpu.tuning.channels_last and gpu.tuning.cudnn_benchmark
        torch.testing.assert_close(gpu.encode(pixels)["latent"].cpu(), cpu.encode(pixels)["latent"], atol=0.05,
                                   rtol=0.05)  # fmt: skip
    features = FeatureSpec("dinov2", "default", str(tmp_path / "home"))
    encoder = LatentSpec(EncoderSource("default", home=str(tmp_path / "home")), features=features).load(use_gpu=True)
    assert torch.equal(encoder.encode(pixels, features_of=2)["features"], encoder.features.encode(pixels[:2]))
