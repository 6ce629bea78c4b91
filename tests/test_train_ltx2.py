"""The ``ltx-2`` recipe in the one loop: the transformer called as ``LTX2Pipeline``'s denoising step calls it.

A tiny random pipeline (:mod:`pipeline.embed.families.tiny_ltx2`) and a small video cache (tests/ltx2_cache.py).
A batch's loss equals a hand computation from the cached records and the pipeline's own parts: the Gemma rows put
back on the left and run through its ``connectors``, ``_pack_latents``, the dynamic shift of its scheduler over the
video sequence length (``calculate_shift(F h w)``), video/audio coordinates from the transformer's ropes, and the
audio stream as pure noise at ``audio_timestep`` 1000 with the pipeline's length for the clip's duration; the loss
is the video's. Only the video stream trains: every trainable parameter gets a gradient (DDP needs it), the audio
stream's are frozen. The LoRA export loads with ``LTX2Pipeline.load_lora_weights`` and gives the trained outputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader
from manifests.cache.records import to_float32
from manifests.errors import UsageError
from pipeline.embed.families.ltx2 import left_pad
from tests.ltx2_cache import TEXT_TOKENS, build, latent_shape
from tests.test_train_wan22 import _batches, _setup, _trained_with_adapters
from tests.train_dataset import printed_code, recipe_outputs, train_quiet, write_settings
from tests.wan_cache import WanData
from pipeline.embed.families.tiny_ltx2 import connectors_supported

pytestmark = pytest.mark.skipif(not connectors_supported(), reason="LTX-2's tiny pipeline needs the LTX-2 text "
                                "connectors of a newer diffusers than this one (0.42.1 has them; 0.37 does not)")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> WanData:
    return build(tmp_path_factory.mktemp("ltx2"))


@pytest.fixture(scope="module")
def ltx23(tmp_path_factory) -> str:
    """A tiny LTX-2.3 folder (the same classes in 2.3's layout); the cache's Gemma rows and latents fit it too."""
    from pipeline.embed.families.tiny import build_tiny

    return str(build_tiny("ltx-2", tmp_path_factory.mktemp("ltx23") / "ltx-2.3", variant="2.3"))


def _by_hand(data: WanData, batch, model, generator, folder: str | None = None, cross: bool = False) -> torch.Tensor:
    """The loss of ``batch`` from the cached records and the pipeline's parts (see the module docstring); ``folder``:
    the pipeline's (default the cache's model), ``cross``: the pipeline's ``use_cross_timestep``."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    pipe = LTX2Pipeline.from_pretrained(folder or data.model, text_encoder=None, tokenizer=None)
    reader = CacheReader(data.cache)
    records = [r.variant(v) for r, v in zip(reader.read(batch.sample_ids), batch.variants)]
    x0 = torch.from_numpy(np.stack([to_float32(r.latent, r.dtype) for r in records]))  # stored normalised
    b, c, f, h, w = x0.shape
    rows = [torch.from_numpy(to_float32(r.text.tokens[0], r.text.dtype)) for r in records]
    text = torch.zeros(b, max(len(t) for t in rows), rows[0].shape[1])
    mask = torch.zeros(b, text.shape[1])
    for i, t in enumerate(rows):
        text[i, : len(t)], mask[i, : len(t)] = t, 1
    text, mask = left_pad(text, mask, TEXT_TOKENS)
    video_text, audio_text, text_mask = pipe.connectors(text, mask, padding_side="left")
    cfg = pipe.scheduler.config
    s = math.exp(calculate_shift(f * h * w, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"],
                                 cfg["max_shift"]))  # fmt: skip
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(b,), generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    sigma = (s * u / (1 + (s - 1) * u)).view(b, 1, 1, 1, 1)
    frames = (f - 1) * 8 + 1
    steps = round(frames / 24.0 * pipe.audio_sampling_rate / pipe.audio_hop_length / 4)
    audio = torch.randn((b, steps, pipe.transformer.config.audio_in_channels), generator=generator)
    t = 1000.0 * sigma.flatten()
    video, _ = model(hidden_states=pipe._pack_latents((1 - sigma) * x0 + sigma * eps), audio_hidden_states=audio,
                     encoder_hidden_states=video_text, audio_encoder_hidden_states=audio_text, timestep=t, sigma=t,
                     audio_timestep=torch.full_like(t, 1000.0), audio_sigma=torch.full_like(t, 1000.0),
                     encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask, num_frames=f,
                     height=h, width=w, fps=24.0, audio_num_frames=steps,
                     video_coords=pipe.transformer.rope.prepare_video_coords(b, f, h, w, "cpu", fps=24.0),
                     audio_coords=pipe.transformer.audio_rope.prepare_audio_coords(b, steps, "cpu"),
                     use_cross_timestep=cross, return_dict=False)  # fmt: skip
    return ((video - pipe._pack_latents(eps - x0)) ** 2).mean()


def test_the_loss_is_the_pipelines_denoising_step_on_the_video(data):
    from diffusers import LTX2VideoTransformer3DModel

    from train.model import step_generator

    denoiser = _setup(data)
    assert (denoiser.component, denoiser.pipeline_class) == ("transformer", "LTX2Pipeline")
    folder = LTX2VideoTransformer3DModel.from_pretrained(data.model, subfolder="transformer")
    assert all(torch.equal(p, q) for p, q in zip(denoiser.model.parameters(), folder.parameters()))
    batches = _batches(data)
    assert {b.latents.shape[1:] for b in batches} == {latent_shape("64x64x9"), latent_shape("96x64x17")}
    for batch in {b.bucket: b for b in batches}.values():  # one batch of each bucket (1 and 2 x 3 latent grids)
        with torch.no_grad():
            loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
            want = _by_hand(data, batch, folder, step_generator(0, batch.epoch, batch.step, 0))
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_an_ltx23_folder_trains_with_the_cross_modality_sigma_and_validates_with_its_bwe_vocoder(data, ltx23):
    """LTX-2.3 is the same pipeline class in another layout: the loss is its denoising step with
    ``use_cross_timestep=True`` (2.3's behaviour; the legacy False gives another loss), and validation builds the
    pipeline around the folder's ``LTX2VocoderWithBWE``."""
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    from train.model import step_generator

    denoiser = _setup(data, pretrained=ltx23)
    folder = LTX2VideoTransformer3DModel.from_pretrained(ltx23, subfolder="transformer")
    assert folder.prompt_modulation and not hasattr(folder, "caption_projection")  # 2.3's layout indeed
    batch = _batches(data)[0]
    with torch.no_grad():
        loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
        want = _by_hand(data, batch, folder, step_generator(0, batch.epoch, batch.step, 0), ltx23, cross=True)
        legacy = _by_hand(data, batch, folder, step_generator(0, batch.epoch, batch.step, 0), ltx23, cross=False)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert (loss - legacy).abs() > 1e-4  # the flag does change what the model sees
    pipe = denoiser.pipeline(denoiser.model, AutoencoderKLLTX2Video.from_pretrained(ltx23, subfolder="vae"))
    assert isinstance(pipe.vocoder, LTX2VocoderWithBWE)


def test_only_the_video_stream_trains_and_every_trained_parameter_gets_a_gradient(data):
    from train.model import step_generator

    denoiser = _setup(data)
    model = denoiser.model
    batch = _batches(data)[0]
    denoiser.loss(model, batch, step_generator(0, 0, 0, 0)).backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
                           if n in trained)  # fmt: skip
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all("audio" in n for n in frozen)
    assert any(n.startswith("audio_proj_out") for n in frozen) and any(".video_to_audio_attn." in n for n in frozen)
    assert any(".audio_to_video_attn." in n for n in trained) and any(".attn1.to_q" in n for n in trained)


def test_what_does_not_fit_is_refused_in_one_line(data, tmp_path):
    with pytest.raises(UsageError, match="config masked_loss: the ltx-2 recipe"):
        _setup(data, masked_loss={"weight_outside": 0.1})
    wan = str(tmp_path / "wan")
    from pipeline.embed.families.tiny import build_tiny

    build_tiny("wan", wan)
    with pytest.raises(UsageError, match=rf"pretrained '{wan}' is a WanPipeline folder; the ltx-2 recipe "):
        _setup(data, pretrained=wan)


@pytest.mark.slow
def test_the_lora_export_loads_with_load_lora_weights_and_gives_the_trained_outputs(data, tmp_path):
    """Validation at the last step runs the whole pipeline (clips written)."""
    from diffusers import LTX2Pipeline

    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2, validation_every=3,
                         validation_steps=2, validation_size=64, validation_frames=9)  # fmt: skip
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", data.plan, "--cache", data.cache, "--config", cfg, "--output-dir", out,
                                  "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["pipeline"], record["component"]) == ("ltx-2", "LTX2Pipeline", "transformer")
    assert sorted(p.name for p in (out / "validation" / "step-00000003").iterdir()) == [
        "00.mp4", "00.png", "01.mp4", "01.png"]
    code = printed_code(printed, "load them into the base pipeline")

    batch = _batches(data)[0]
    denoiser = _setup(data)
    base = recipe_outputs(denoiser, denoiser.model, batch)
    want = recipe_outputs(denoiser, _trained_with_adapters(denoiser, cfg, out / "checkpoints" / "step-00000003"),
                          batch)  # fmt: skip
    scope: dict[str, Any] = {}
    exec(code, scope)  # the printed lines: LTX2Pipeline.from_pretrained(base), pipe.load_lora_weights(...)
    pipe = scope["pipe"]
    assert isinstance(pipe, LTX2Pipeline) and pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    loaded = recipe_outputs(denoiser, pipe.transformer, batch)
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act
    assert Path(out / "lora").is_dir()
