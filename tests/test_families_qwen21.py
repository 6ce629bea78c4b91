"""Qwen-Image 2.1: the cached text equals ``QwenImage21Pipeline.encode_prompt``, the latents its RGBA VAE path.

A tiny random-weight pipeline of the real classes (:mod:`pipeline.embed.families.tiny_qwen21`, saved and loaded
with ``from_pretrained``, its ``processor`` passed in: transformers builds no ``Qwen3VLProcessor`` without
torchvision), encoded in process: every caption's stored rows equal the pipeline's own ``encode_prompt([caption])``
bit for bit in fp32 (the system message dropped by the pipeline's own ``_drop_idx``, the last layer before the
final norm), bf16 records one rounding of them; past our 1024-row cap (the pipeline has none) the rows are the
first 1024 of the pipeline's. The latents equal the pipeline's ``_encode_vae_image`` of the image converted to
RGBA, as ``__call__`` converts a condition image. A real embed job (Ray) writes the cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import TextLayout, read_cache_meta
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import qwen_image21
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.families.tiny_qwen21 import QWEN3VL_WIDTH
from pipeline.embed.latents import LatentSpec
from pipeline.embed.loading import quiet_loading, to_storage
from tests.embed_data import embed_cache, make_dataset, records_by_id

MISSING = missing_classes("qwen-image-2.1")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

FAMILY = "qwen-image-2.1"
# empty (" " to the pipeline), unicode, spaces, equal token counts (one group) and others; under the 1024 cap
CAPTIONS = ["a photo of the cat", "", "  The RED Dog, naïve café 漢字 🙂  ", "thing 0", "a photo of the dog",
            "a blue picture", " "]  # fmt: skip
LONG = "red dog " * 700  # past 1024 rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    quiet_loading()
    return str(build_tiny(FAMILY, tmp_path_factory.mktemp("tiny-qwen21") / FAMILY))


@pytest.fixture(scope="module")
def pipe(tiny):
    from diffusers import QwenImage21Pipeline

    return QwenImage21Pipeline.from_pretrained(tiny, processor=qwen_image21.load_processor(tiny))


def _text(model: str, **options):
    _, spec = encoder_specs(family=FAMILY, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec.load()


def _reference(pipe, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        embeds, mask, image_mask = pipe.encode_prompt(captions, device="cpu")
    assert not image_mask.any()  # text to image: no position holds an image token
    return embeds, mask


def test_cached_text_equals_the_pipelines_encode_prompt(tiny, pipe):
    encoders = _text(tiny)
    layout = TextLayout.from_json(encoders.describe()["layout"])
    assert (layout.masked, layout.lengths, layout.widths, layout.pooled_dim) == (True, (1024,), (QWEN3VL_WIDTH,), None)
    # the template, the system message and the rows dropped are the pipeline's own
    assert (pipe.prompt_template_t2i, pipe.sys_prompt) == (qwen_image21.TEMPLATE, qwen_image21.SYSTEM)
    assert qwen_image21.drop_count(encoders.models[0].tokenizer) == pipe._drop_idx
    encoded = encoders.encode(list(CAPTIONS))
    for caption, (tokens, pooled) in zip(CAPTIONS, encoded):
        want, mask = _reference(pipe, [caption])
        assert mask is None  # one prompt: nothing padded, encode_prompt drops the mask
        assert pooled is None and len(tokens) == 1
        assert tokens[0].shape == want[0].shape and torch.equal(tokens[0], want[0]), caption  # fp32: bit for bit
        assert np.array_equal(to_storage(tokens[0], "BF16"), to_storage(want[0], "BF16"))  # bf16: one rounding
    rows = [t[0].shape[0] for t, _ in encoded]
    assert [n for (n,) in encoders.rows(list(CAPTIONS + [LONG]))] == rows + [1024]  # from the tokenizer alone
    # <|im_start|>user\n, the caption's tokens, the 5 closing ones; "" is encoded as " "
    assert rows[1] == rows[6] == len(pipe.processor.tokenizer(" ").input_ids) + 3 + 5
    assert torch.equal(encoded[1][0][0], encoded[6][0][0])
    # a caption's rows do not depend on the captions encoded beside it, and equal a batch the pipeline pads not
    assert torch.equal(encoders.encode([CAPTIONS[2]])[0][0][0], encoded[2][0][0])
    same = [CAPTIONS[0], CAPTIONS[4]]  # equal token counts
    assert rows[0] == rows[4]
    want, mask = _reference(pipe, same)
    assert mask is None and all(torch.equal(want[i], encoded[c][0][0]) for i, c in enumerate((0, 4)))


def test_padded_batches_pad_rows_on_the_right_as_the_trainer_does(tiny, pipe):
    """The pipeline's batch of two lengths: right-padded rows with a mask, what ``TextLayout.prompt_embeds`` builds
    from the records (its real rows equal each caption's alone up to float rounding: the encoder's left padding)."""
    from manifests.cache.records import TextRecord

    encoders = _text(tiny)
    captions = [CAPTIONS[0], CAPTIONS[2]]
    want, mask = _reference(pipe, captions)
    records = [TextRecord(caption_key=i, tokens=(t[0].numpy(),), pooled=None, dtype="F32")
               for i, (t, _) in enumerate(encoders.encode(captions))]  # fmt: skip
    layout = TextLayout.from_json(encoders.describe()["layout"])
    embeds, got_mask, _ = layout.prompt_embeds(records)
    assert embeds.shape == tuple(want.shape) and np.array_equal(got_mask, mask.numpy())
    assert np.allclose(embeds, want.numpy(), atol=1e-5) and not embeds[0, int(got_mask[0].sum()):].any()


def test_the_rows_are_the_last_layer_before_the_final_norm(tiny):
    encoders = _text(tiny)
    m = encoders.models[0]
    (rows,), _ = encoders.encode([CAPTIONS[0]])[0]
    enc = m.tokenizer([qwen_image21.TEMPLATE.format(CAPTIONS[0])], return_tensors="pt")
    with torch.no_grad():
        normed = m.model(enc.input_ids, attention_mask=enc.attention_mask).last_hidden_state[0]
        drop = qwen_image21.drop_count(m.tokenizer)
        assert torch.allclose(m.model.language_model.norm(rows), normed[drop:], atol=1e-5)  # the norm's input
    assert not torch.allclose(rows, normed[drop:], atol=1e-2)


def test_rows_past_the_cap_are_the_first_of_the_pipelines(tiny, pipe):
    (tokens,), _ = _text(tiny).encode([LONG])[0]
    want, _ = _reference(pipe, [LONG])  # the pipeline keeps them all
    assert want.shape[1] > 1024 and tokens.shape == (1024, QWEN3VL_WIDTH)
    # causal: the same rows; the pipeline's attention sums over the longer sequence (float rounding)
    assert torch.allclose(tokens, want[0, :1024], atol=1e-5, rtol=1e-5)


def test_max_text_tokens_cuts_the_rows(tiny, pipe):
    encoders = _text(tiny, max_tokens=8)
    assert TextLayout.from_json(encoders.describe()["layout"]).lengths == (8,)
    (tokens,), _ = encoders.encode([CAPTIONS[2]])[0]
    assert torch.equal(tokens, _reference(pipe, [CAPTIONS[2]])[0][0, :8])
    with pytest.raises(UsageError, match="--max-text-tokens 2048 is above qwen-image-2.1's 1024"):
        _text(tiny, max_tokens=2048)


def test_latents_are_the_pipelines_rgba_vae_path(tiny, pipe):
    from PIL import Image

    source = encoder_specs(family=FAMILY, model=tiny, vae=None, vae_subfolder=None, text_encoders=None,
                           text_subfolders=None)[0].source  # fmt: skip
    encoder = LatentSpec(source, "posterior").load()
    pixels = np.random.default_rng(0).integers(0, 255, (2, 32, 64, 3), dtype=np.uint8)  # (B, H, W, 3)
    out = encoder.encode(pixels)
    # __call__'s own steps for a condition image: convert("RGBA"), preprocess, a 1-frame clip, _encode_vae_image
    images = pipe.image_processor.preprocess([Image.fromarray(p).convert("RGBA") for p in pixels], 32, 64)
    assert images.shape == (2, 4, 32, 64) and bool((images[:, 3] == 1).all())
    with torch.no_grad():
        want = pipe._encode_vae_image(images.unsqueeze(2), None)  # (B, 64, 1, 2, 4)
        std = pipe.vae.encode(images.unsqueeze(2)).latent_dist.std
    assert out["latent"].shape == (2, 64, 2, 4) and torch.equal(out["latent"], want[:, :, 0])
    scale = torch.tensor(pipe.vae.config.latents_std).view(1, 64, 1, 1, 1)
    assert torch.equal(out["latent_std"], (std / scale)[:, :, 0])
    info = encoder.describe()
    assert (info["class"], info["factor"], info["channels"], info["scaling_factor"]) == (
        "AutoencoderKLQwenImage21", 16, 64, 1.0)  # fmt: skip
    assert info["normalised"]["latents_mean"] == [float(x) for x in pipe.vae.config.latents_mean]
    with pytest.raises(UsageError, match="multiples of 32 pixels"):
        encoder.encode(pixels[:, :, :48])


def test_the_processor_loads_without_torchvision(tiny, pipe):
    processor = qwen_image21.load_processor(tiny)
    assert type(processor).__name__ == "Qwen3VLProcessor" and processor.chat_template
    out = processor(text=["a b", "c"], padding=True, padding_side="left", return_tensors="pt")
    assert out.input_ids.shape[0] == 2 and not out.attention_mask[1, 0] and not out.mm_token_type_ids.any()


@pytest.mark.ray
@pytest.mark.slow
def test_embed_job_writes_the_qwen_image21_cache(tiny, tmp_path, ray_local):
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 4)
    embed_cache(manifest, out, family=FAMILY, model=tiny, dtype="fp32")
    meta = read_cache_meta(out)
    assert meta.family == FAMILY and meta.text_layout.lengths == (1024,)
    assert (meta.latent.scaling_factor, meta.latent.shift_factor, meta.latent.channels) == (1.0, None, 64)
    assert "RGBA" in meta.latent._extra["normalised"]["how"]
    captions = {r["sample_id"]: r["caption"] for r in read_manifest(manifest).samples.to_pylist()}
    records = records_by_id(out)
    assert set(records) == set(captions)
    encoders = _text(tiny)
    for sample_id, record in records.items():
        (want,), _ = encoders.encode([captions[sample_id] or ""])[0]
        assert record.latent.shape == (64, *(n // 16 for n in record.target_size)) and record.text.dtype == "F32"
        assert np.array_equal(record.text.tokens[0], want.numpy())


def test_the_system_message_is_14_tokens_of_the_real_qwen_vocabulary(tmp_path):
    """With the real Qwen vocabulary (Qwen-Image's tokenizer fixture: the BPE Qwen3-VL shares) and a Qwen3-VL-style
    template the system message is 14 tokens, the first 14 of the template (the real 2.1 processor/ is absent)."""
    from transformers import Qwen2Tokenizer

    from pipeline.embed.families.tiny_qwen21 import CHAT_TEMPLATE
    from tests.checkpoints import materialize

    tokenizer = Qwen2Tokenizer.from_pretrained(materialize("qwen-image", tmp_path) / "tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = tokenizer(qwen_image21.TEMPLATE.format("a cat")).input_ids
    assert qwen_image21.drop_count(tokenizer) == 14
    assert tokenizer.convert_ids_to_tokens(ids[14:17]) == ["<|im_start|>", "user", "\u010a"]  # the user turn


@pytest.mark.slow
def test_the_estimate_bill_is_what_embed_writes(tiny, tmp_path):
    """``bucketeer estimate``'s bytes for this family (64-channel 16x latents, masked rows of the template) are what
    the embed run then writes, read back."""
    from pipeline import EmbedJob, run
    from pipeline.estimate import EstimateJob, estimate
    from tests.test_estimate import _written

    manifest = str(tmp_path / "manifest")
    make_dataset(str(tmp_path / "ds"), manifest, n=6, unique_from=4)
    job = EmbedJob(manifest=manifest, out=str(tmp_path / "cache"), family=FAMILY, model=tiny, executor="local",
                   batch_size=4, shard_records=4)  # fmt: skip
    bill = estimate(EstimateJob(embed=job, gpu="cpu"))
    assert run(job).embedded == 6
    assert (bill.latent_bytes, bill.text_bytes) == _written(str(tmp_path / "cache"))
