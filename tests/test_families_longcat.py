"""LongCat-Image: the cache holds what ``LongCatImagePipeline`` gives its transformer.

The tiny random-weight pipeline of the real classes (:mod:`pipeline.embed.families.tiny_longcat`), saved and loaded
with ``from_pretrained``, and the same models around the real Qwen2.5-VL tokenizer (Qwen-Image's, in
``tests/fixtures/checkpoints/qwen-image``: the vocabulary and merges LongCat-Image's Qwen2.5-VL-7B ships too; its own
copy was not at hand). The cached text equals the pipeline's own ``encode_prompt`` bit for bit in fp32 (all 512 rows,
the pads' included), with the token ids it feeds Qwen2.5-VL: quoted text one character at a time, a caption past 512
tokens cut; bf16 records are that rounded once; a caption's rows do not depend on its batch; a pad row changes the
transformer's output (why every row is stored). The latents are FLUX.1's posterior mean, which the loader turns into
``LongCatImageEditPipeline._encode_vae_image``'s ``(mode - shift) * scale``: the very latents a Chroma (or Flux,
Z-Image) cache holds for the same VAE, which ``embed --reuse`` therefore takes. And the bytes per caption and sample
at the published sizes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import TextLayout
from manifests.errors import UsageError
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import longcat_image
from pipeline.embed.families.tiny import build_tiny, save_pipeline, tiny_pipeline
from pipeline.embed.families.tiny_qwen import QWEN_WIDTH
from pipeline.embed.loading import quiet_loading, to_storage
from tests.checkpoint_text import recorded_inputs, sequences

MISSING = missing_classes("longcat-image")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

FAMILY = "longcat-image"
QUOTED = 'a sign saying "HELLO"'
# a plain one, empty, quoted text (double, single, curly) and a word-internal apostrophe split_quotation leaves alone,
# one past 512 tokens (cut), unicode and spaces
CAPTIONS = ["a photo of the cat", "", QUOTED, "don't say 'no' to “café” or ‘naïve’", "red dog " * 400,
            "  The RED Dog, 漢字 🙂  "]  # fmt: skip


def _real_tokenizer_folder(folder: Path) -> Path:
    """The tiny pipeline with the real Qwen2.5-VL tokenizer files (verbatim) as ``tokenizer/`` and ``text_processor/``,
    the text encoder's vocabulary resized to it and its special token ids the real config's."""
    from transformers import Qwen2Tokenizer

    from tests import checkpoints

    files = checkpoints.materialize("qwen-image", folder.parent / ".qwen-image-files")
    tokenizer = Qwen2Tokenizer.from_pretrained(files / "tokenizer")
    pipe = tiny_pipeline(FAMILY)
    torch.manual_seed(0)
    pipe.text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    real = json.loads((files / "text_encoder" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id"):  # fmt: skip
        setattr(pipe.text_encoder.config, key, real[key])
    pipe.tokenizer, pipe.text_processor = tokenizer, tokenizer
    save_pipeline(pipe, folder)
    for name in ("tokenizer", "text_processor"):  # the fixture's files, not a re-serialisation of them
        shutil.rmtree(folder / name)
        shutil.copytree(files / "tokenizer", folder / name)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-longcat")
    return {"tiny": str(build_tiny(FAMILY, base / "tiny")), "real": str(_real_tokenizer_folder(base / "real"))}


def _text(model: str, **options):
    _, spec = encoder_specs(family=FAMILY, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec.load(dtype="F32")


def _pipeline(model: str):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(model)


@pytest.mark.parametrize("tokenizer", ["tiny", "real"])
def test_cached_text_equals_the_pipelines_encode_prompt(folders, tokenizer):
    encoders = _text(folders[tokenizer])
    layout = TextLayout.from_json(encoders.describe()["layout"])
    assert (layout.masked, layout.lengths, layout.widths, layout.pooled_dim) == (False, (512,), (QWEN_WIDTH,), None)
    pipe = _pipeline(folders[tokenizer])
    assert type(pipe).__name__ == "LongCatImagePipeline" and pipe.tokenizer_max_length == longcat_image.TOKENS
    assert (pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_suffix) == (longcat_image.PREFIX,
                                                                                      longcat_image.SUFFIX)
    with recorded_inputs([encoders.models[0].model]) as ours:
        encoded = encoders.encode(list(CAPTIONS))
    with torch.no_grad(), recorded_inputs([pipe.text_encoder]) as theirs:
        embeds, text_ids = pipe.encode_prompt(list(CAPTIONS))
    assert sequences(ours[0]) == sequences(theirs[0])  # the same ids, the same mask
    assert embeds.shape == (len(CAPTIONS), 512, QWEN_WIDTH) and text_ids.shape == (512, 3)
    for i, (tokens, pooled) in enumerate(encoded):
        assert pooled is None and len(tokens) == 1
        assert torch.equal(tokens[0], embeds[i]), CAPTIONS[i][:30]  # fp32: every row, bit for bit
        assert np.array_equal(to_storage(tokens[0], "BF16"), to_storage(embeds[i], "BF16"))  # bf16: one rounding
    alone = encoders.encode([CAPTIONS[2]])[0][0][0]  # a caption's rows do not depend on the captions beside it
    assert torch.equal(alone, encoded[2][0][0])


def test_bf16_text_equals_the_pipelines_bf16_encode_prompt(folders):
    """The GPU's path (weights and compute in bf16, run here on the CPU) against the pipeline loaded in bf16: equal."""
    from diffusers import DiffusionPipeline

    _, spec = encoder_specs(family=FAMILY, model=folders["real"], vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    encoders = spec.load(dtype="BF16", compute="BF16")
    pipe = DiffusionPipeline.from_pretrained(folders["real"], torch_dtype=torch.bfloat16)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(list(CAPTIONS))
    for i, (tokens, _) in enumerate(encoders.encode(list(CAPTIONS))):
        assert torch.equal(tokens[0], embeds[i].float()), CAPTIONS[i][:30]


def test_quoted_text_is_fed_a_character_at_a_time_and_a_long_caption_is_cut(folders):
    """With the real vocabulary: ``"HELLO"`` as 7 ids (quotes included), where the word alone is one; the ids of a
    caption past 512 tokens cut at 512, so that its 512 rows hold no pad; the empty caption 512 pads."""
    encoders = _text(folders["real"])
    tok = encoders.models[0].tokenizer
    spelled = [tok(c, add_special_tokens=False)["input_ids"][0] for c in '"HELLO"']
    ids = longcat_image.caption_ids(tok, QUOTED)
    assert ids == tok("a sign saying ", add_special_tokens=False)["input_ids"] + spelled
    assert len(tok('"HELLO"', add_special_tokens=False)["input_ids"]) < 7 == len(spelled)
    assert longcat_image.caption_ids(tok, "don't") == tok("don't", add_special_tokens=False)["input_ids"]
    long_ids = longcat_image.caption_ids(tok, CAPTIONS[4])
    assert len(long_ids) > 512
    with recorded_inputs([encoders.models[0].model]) as calls:
        encoders.encode([CAPTIONS[4], "", QUOTED])
    (ids_in, mask), = calls[0]
    prefix = len(tok(longcat_image.PREFIX, add_special_tokens=False)["input_ids"])
    assert ids_in[0, prefix : prefix + 512].tolist() == long_ids[:512] and bool(mask[0].all())
    assert int(mask[1].sum()) == ids_in.shape[1] - 512 and ids_in[1, prefix].item() == tok.pad_token_id
    assert ids_in[2, prefix : prefix + len(ids)].tolist() == ids


def test_max_text_tokens_is_the_pipeline_with_that_tokenizer_max_length(folders):
    encoders = _text(folders["real"], max_tokens=24)
    assert TextLayout.from_json(encoders.describe()["layout"]).lengths == (24,)
    pipe = _pipeline(folders["real"])
    pipe.tokenizer_max_length = 24
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(list(CAPTIONS))
    for i, (tokens, _) in enumerate(encoders.encode(list(CAPTIONS))):
        assert tokens[0].shape == (24, QWEN_WIDTH) and torch.equal(tokens[0], embeds[i])
    with pytest.raises(UsageError, match="--max-text-tokens 600 is above longcat-image's 512 .* it can only be "
                                         "lowered"):  # fmt: skip
        _text(folders["real"], max_tokens=600)


def test_every_row_reaches_the_transformer_and_pad_rows_differ_per_caption(folders):
    """No text mask: changing a pad row changes the prediction, so the pads' rows are stored (an unmasked layout)."""
    from diffusers.pipelines.longcat_image.pipeline_longcat_image import prepare_pos_ids

    pipe = _pipeline(folders["real"])
    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt(["a photo of the cat", "red dog"])
        assert not torch.equal(embeds[0, -1], embeds[1, -1])  # right-padded: a pad row attends to its caption
        latents = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))  # 2x2 tokens of 4 x 16 channels
        img_ids = prepare_pos_ids(modality_id=1, type="image", start=(512, 512), height=2, width=2)

        def predict(text):
            return pipe.transformer(hidden_states=latents, timestep=torch.tensor([0.5]), guidance=None,
                                    encoder_hidden_states=text, txt_ids=text_ids, img_ids=img_ids,
                                    return_dict=False)[0]  # fmt: skip

        changed = embeds[:1].clone()
        changed[0, -1] = 0.0
        assert (predict(embeds[:1]) - predict(changed)).abs().max() > 1e-6


def _crops(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)  # (B, H, W, 3)


def _specs(family: str, folder: str):
    """``family``'s latent and text specs with ``--vae FOLDER`` (the text encoders named, never loaded)."""
    return encoder_specs(family=family, model=None, vae=folder, vae_subfolder="vae",
                         text_encoders=["unused"] * (2 if family == "flux" else 1), text_subfolders=None)


def test_latents_are_what_the_loader_turns_into_the_pipelines_vae_path(folders):
    """``LongCatImagePipeline`` has no image-to-latent path; its edit twin's ``_encode_vae_image`` (``retrieve_latents
    argmax``, then ``(z - shift_factor) * scaling_factor``) is the inverse of its decode: the loader's ops on the
    stored posterior mean, ``_cache.json``'s factors the VAE config's."""
    from diffusers import AutoencoderKL, LongCatImageEditPipeline
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    from manifests.cache.meta import LatentInfo
    from train.data.batch import latent_normaliser

    encoder = _specs(FAMILY, folders["tiny"])[0].load()
    pixels = _crops()
    out = encoder.encode(pixels)
    info = encoder.describe()
    shift, scale = latent_normaliser(LatentInfo(scaling_factor=info["scaling_factor"],
                                                shift_factor=info["shift_factor"]))  # fmt: skip
    vae = AutoencoderKL.from_pretrained(folders["tiny"], subfolder="vae")
    processor = VaeImageProcessor(vae_scale_factor=16)  # the pipelines': 8 x their 2x2 packing
    images = processor.preprocess([Image.fromarray(p) for p in pixels], 32, 48)  # (B, 3, H, W) in [-1, 1]
    with torch.no_grad():
        want = LongCatImageEditPipeline._encode_vae_image(SimpleNamespace(vae=vae), images, None)
    assert (shift, scale) == (vae.config.shift_factor, vae.config.scaling_factor) == (0.1159, 0.3611)
    assert out["latent"].shape == (2, 16, 4, 6) and torch.equal((out["latent"] - shift) * scale, want)


def test_latents_are_a_flux1_vae_caches_so_embed_reuse_takes_them(folders):
    """A Chroma (or Flux) cache of the same VAE folder stores these very latents with the same ``_cache.json``
    identity (class, weights hash, factors: :func:`pipeline.embed.reuse.latent_identity`)."""
    from pipeline.embed.reuse import latent_identity
    from pipeline.embed.settings import request_settings, vae_settings

    pixels = _crops(1)
    identities, latents = [], []
    for family in (FAMILY, "chroma", "flux"):
        spec, text = _specs(family, folders["tiny"])
        encoder = spec.load()
        request = request_settings(spec, text, dtype="BF16", bucket_spec={}, crop="center", seed=0, crops=1,
                                   flip=False)  # fmt: skip
        identities.append(latent_identity(vae_settings(request, encoder.describe())))
        latents.append(encoder.encode(pixels)["latent"])
    assert identities[0] == identities[1] == identities[2] and identities[0]["vae"]["shift_factor"] == 0.1159
    assert torch.equal(latents[0], latents[1]) and torch.equal(latents[0], latents[2])


def test_bytes_per_caption_and_sample_at_the_published_sizes():
    """512 rows of Qwen2.5-VL-7B's 3584 in bf16 per caption, whatever its length (every row stored); a 1024x1024
    sample's latent 16 x 128 x 128 in bf16 (FLUX.1's VAE): from benchmarks/real_configs.py."""
    from benchmarks.real_configs import FLUX1_VAE, LONGCAT_IMAGE, QWEN_VL_7B

    width = QWEN_VL_7B["text_config"]["hidden_size"]
    layout = TextLayout("longcat-image", "features", False, (longcat_image.TOKENS,), (width,))
    assert LONGCAT_IMAGE["joint_attention_dim"] == width and LONGCAT_IMAGE["in_channels"] == 4 * 16
    assert 2 * layout.length * layout.width == 3_670_016  # bytes per caption (3.5 MiB)
    assert 2 * FLUX1_VAE["latent_channels"] * 128 * 128 == 524_288  # bytes per 1024² sample (posterior mean)
