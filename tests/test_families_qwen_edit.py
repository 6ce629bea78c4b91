"""Qwen-Image-Edit: the cached text of (instruction, reference) equals the pipeline's own, and so do the reference
latents; the cache keys that text by instruction and reference, never by the caption alone.

A tiny random-weight ``QwenImageEditPipeline`` of the real classes is built and saved
(:mod:`pipeline.embed.families.tiny_qwen`) and loaded with ``from_pretrained``, its ``processor`` passed in (the
one bucketeer loads: this environment has no torchvision, see :mod:`pipeline.embed.families.qwen_image_edit`).
The pipeline's ``__call__`` is run on a reference crop with its ``encode_prompt`` and ``_encode_vae_image``
recorded: bucketeer's text and reference latent for that crop equal what it computed there, bit for bit in fp32.
A real embed job (Ray) of a paired manifest (``scan --conditioning``) stores per sample what the encoders give
for its reference crop, with two samples of one instruction and other references apart, one (instruction,
reference) pair twice under one key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from manifests.buckets import BucketSpec, parse_bucket
from manifests.cache import CacheReader, read_cache_meta
from manifests.cache.verify import verify_cache
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from pipeline.embed.loading import quiet_loading
from pipeline.embed.latents import LatentSpec
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import qwen_image_edit as edit
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.imaging import prepare_views
from tests.embed_data import embed_cache, jpeg

FAMILY = "qwen-image-edit"
INSTRUCTIONS = ["make it red", "", "  Turn the CAT into a naïve café 漢字 🙂 sketch  "]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    quiet_loading()
    return str(build_tiny(FAMILY, tmp_path_factory.mktemp("tiny-edit") / FAMILY))


def _encoders(model: str, **options):
    latent, text = encoder_specs(family=FAMILY, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                                 text_subfolders=None, **options)  # fmt: skip
    return LatentSpec(latent.source).load(dtype="F32"), text.load(dtype="F32")


def _pipeline(model: str, processor):
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline.from_pretrained(model, processor=processor)


@pytest.mark.parametrize("height, width", [(1024, 1024), (896, 1152), (64, 96), (512, 512), (100, 300), (37, 53)])
def test_the_reference_is_resized_as_the_pipeline_resizes_it(height, width):
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    w, h, _ = calculate_dimensions(1024 * 1024, width / height)
    assert edit.reference_size(height, width) == (h, w)
    crop = np.random.default_rng(height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    resized = VaeImageProcessor(vae_scale_factor=16).resize(Image.fromarray(crop), h, w)  # the pipeline's resize
    assert np.array_equal(edit.reference_pixels(crop), np.asarray(resized))
    if (height, width) in ((1024, 1024), (896, 1152)):  # a megapixel bucket is the reference's own size
        assert edit.reference_pixels(crop) is crop


def _recorded_call(pipe, crop: np.ndarray, instruction: str) -> dict[str, torch.Tensor]:
    """``pipe(image=crop, prompt=instruction)`` (one step, no CFG), recording what its ``encode_prompt`` returned and
    its ``_encode_vae_image`` encoded."""
    seen: dict[str, torch.Tensor] = {}
    encode_prompt, encode_vae = pipe.encode_prompt, pipe._encode_vae_image

    def prompt(*args, **kwargs):
        seen["text"], seen["mask"] = encode_prompt(*args, **kwargs)
        return seen["text"], seen["mask"]

    def vae(image, generator):
        seen["latent"] = encode_vae(image, generator)
        return seen["latent"]

    pipe.encode_prompt, pipe._encode_vae_image = prompt, vae
    try:
        pipe(image=Image.fromarray(crop), prompt=instruction, num_inference_steps=1, true_cfg_scale=1.0,
             height=64, width=64, output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        pipe.encode_prompt, pipe._encode_vae_image = encode_prompt, encode_vae
    return seen


@pytest.mark.slow
@pytest.mark.full
def test_text_and_reference_latent_are_what_the_pipeline_computes(tiny):
    vae, text = _encoders(tiny)
    pipe = _pipeline(tiny, text.models[0].processor)
    layout = text.describe()["layout"]
    assert (layout["family"], layout["masked"], layout["widths"], layout["pooled_dim"]) == (FAMILY, True, [40], None)
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) == (edit.TEMPLATE, edit.DROP)
    rng = np.random.default_rng(0)
    crops = [rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8), rng.integers(0, 256, (64, 96, 3), np.uint8)]
    for crop, instruction in [(crops[0], INSTRUCTIONS[0]), (crops[1], INSTRUCTIONS[1]), (crops[1], INSTRUCTIONS[2])]:
        seen = _recorded_call(pipe, crop, instruction)
        reference = edit.reference_pixels(crop)
        ((tokens,), pooled), = text.encode([instruction], images=[reference])
        assert seen["mask"] is None and pooled is None  # one prompt: no padding, the pipeline drops the mask
        assert tokens.shape == seen["text"][0].shape and torch.equal(tokens, seen["text"][0]), instruction  # fp32
        latent = vae.encode(reference[None])["latent"]  # (1, C, h', w'): normalised as _encode_vae_image does
        assert latent.shape[-2:] == tuple(n // 8 for n in reference.shape[:2])
        assert torch.equal(latent, seen["latent"][:, :, 0])
    # the reference's tokens are stored: 1,369 for a 1024² reference (37 x 37 merged patches of 28 pixels), with
    # <|vision_start|>, <|vision_end|>, the instruction and the template's 5 closing tokens around them
    ((tokens,), _), = text.encode([""], images=[crops[0]])
    assert tokens.shape[0] == 1 + 37 * 37 + 1 + 5


def test_the_key_is_the_instruction_and_the_reference_pixels():
    pixels = np.zeros((32, 64, 3), np.uint8)
    other = pixels.copy()
    other[0, 0, 0] = 1
    key = edit.reference_key("make it red", pixels)
    assert key == edit.reference_key("make it red", pixels.copy())
    assert len({key, edit.reference_key("make it red", other), edit.reference_key("make it blue", pixels),
                edit.reference_key("make it red", pixels.reshape(64, 32, 3))}) == 4  # fmt: skip
    assert edit.reference_key(None, pixels) == edit.reference_key("", pixels)  # a null caption: the empty one


def test_what_the_edit_family_refuses(tiny, tmp_path):
    from pipeline import EmbedJob, run

    base = dict(manifest=str(tmp_path / "m"), out=str(tmp_path / "c"), family=FAMILY, model=tiny)
    for extra, says in (({"crops": 2}, "--crops/--flip"), ({"flip": True}, "--crops/--flip"),
                        ({"validation_prompts": "p.txt"}, "--validation-prompts"),
                        ({"max_text_tokens": 512}, "no max_sequence_length cut"),
                        ({"reference_resolution": 8}, "32 to 4096")):  # fmt: skip
        with pytest.raises(UsageError, match=says):
            EmbedJob(**base, **extra)
    with pytest.raises(UsageError, match="for --family qwen-image-edit, not sdxl"):
        EmbedJob(**{**base, "family": "sdxl"}, reference_resolution=512)
    from tests.embed_data import make_dataset

    make_dataset(str(tmp_path / "data"), base["manifest"], 2)  # no pairs
    with pytest.raises(UsageError, match="scan with --conditioning"):
        run(EmbedJob(**base, executor="local"))


# ---- a real embed job (Ray) of a paired manifest -------------------------------------------------------------

SPEC = BucketSpec(area=64 * 64, step=32)
REFERENCE = 96  # --reference-resolution: references of 96² (bucket 64x64: 96x96; 128x32: 192x64), few tokens


def make_edit_pairs(base: Path, n: int = 6) -> str:
    """``n`` targets under ``base/ds`` and their references under ``base/cond``, scanned into ``base/manifest``
    (returned). img_0..3 share an instruction (img_3's reference is img_0's, so they are one (instruction,
    reference) pair), img_4 has none (null caption), the others their own; buckets 64x64 and 128x32."""
    from pipeline import ScanJob, run
    from pipeline.scan import ScanConfig

    ds, cond = base / "ds", base / "cond"
    ds.mkdir()
    cond.mkdir()
    for i in range(n):
        w, h = [(64, 64), (128, 32), (64, 64)][i % 3]
        (ds / f"img_{i}.jpg").write_bytes(jpeg(w, h, i))
        if i != 4:
            (ds / f"img_{i}.txt").write_text("make it red" if i < 4 else f"make the sky green {i}")
        (cond / f"img_{i}.jpg").write_bytes(jpeg(w, h, 100 + (0 if i == 3 else i)))
    manifest = str(base / "manifest")
    run(ScanJob(source=str(ds), out=manifest, spec=SPEC, conditioning=str(cond), config=ScanConfig(progress=False)))
    return manifest


@pytest.fixture(scope="module")
def paired(tiny, tmp_path_factory, ray_local):
    """The pairs of :func:`make_edit_pairs`, embedded."""
    base = tmp_path_factory.mktemp("edit-pairs")
    manifest, cache = make_edit_pairs(base), str(base / "cache")
    # one torch thread in the workers and in the test: fp32 sums on a CPU depend on how the threads split them
    result = embed_cache(manifest, cache, family=FAMILY, model=tiny, dtype="fp32", reference_resolution=REFERENCE,
                         torch_threads=1)  # fmt: skip
    return base, manifest, cache, result


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.full
def test_embed_stores_each_samples_text_of_its_instruction_and_reference(tiny, paired, one_thread):
    base, manifest, cache, result = paired
    meta = read_cache_meta(cache)
    assert meta.family == FAMILY and meta.text.empty_caption_key is None and not meta.text.validation_prompts
    assert meta.settings.conditioning == edit.conditioning_setting(REFERENCE**2)
    assert verify_cache(cache).ok
    vae, text = _encoders(tiny)
    reader = CacheReader(cache)
    rows = {r["filename"]: r for r in read_manifest(manifest).samples.to_pylist()}
    records = {r.sample_id: r for r in reader.read(list(reader.sample_ids))}
    assert result.embedded == 6 and set(records) == {r["sample_id"] for r in rows.values()}
    keys = {}
    for name, row in rows.items():
        record = records[row["sample_id"]]
        bw, bh = parse_bucket(row["bucket"])
        (view,) = prepare_views(Path(base, "ds", name).read_bytes(), (bh, bw))
        (crop,) = prepare_views(Path(base, "cond", name).read_bytes(), (bh, bw), at=[view.crop_top_left],
                                size=view.original_size, out=edit.reference_size(bh, bw, REFERENCE**2))  # fmt: skip
        reference = crop.pixels  # the crop's region, resized once from the full image
        assert reference.shape[:2] == edit.reference_size(bh, bw, REFERENCE**2)
        ((want,), _), = text.encode([row["caption"] or ""], images=[reference])
        assert record.text is not None and np.array_equal(record.text.tokens[0], want.numpy()), name
        assert record.caption_key == edit.reference_key(row["caption"], reference)
        assert np.array_equal(record.cond_latent, vae.encode(reference[None])["latent"][0].numpy())  # one at a time
        keys[name] = record.caption_key
    # one instruction, other references: other keys and other embeddings; one (instruction, reference): one key
    assert len({keys[f"img_{i}.jpg"] for i in range(3)}) == 3 and keys["img_3.jpg"] == keys["img_0.jpg"]
    first, third = (records[rows[f"img_{i}.jpg"]["sample_id"]].text.tokens[0] for i in (0, 2))
    assert first.shape == third.shape and not np.array_equal(first, third)
    assert meta.counts.texts == 5  # text index rows: one per key (each names a record holding it)
    # the 128x32 bucket's reference is 192x64 (48 rounds to 64): the reference latent has its own grid
    wide = records[rows["img_1.jpg"]["sample_id"]]
    assert wide.latent.shape[1:] == (4, 16) and wide.cond_latent.shape[1:] == (8, 24)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.full
def test_a_rerun_embeds_nothing_and_a_changed_reference_re_embeds_its_sample(tiny, paired, tmp_path):
    import shutil

    base, manifest, cache, _ = paired
    again = embed_cache(manifest, cache, family=FAMILY, model=tiny, dtype="fp32", reference_resolution=REFERENCE)
    assert again.up_to_date
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    from pipeline import ScanJob, run
    from pipeline.scan import ScanConfig

    Path(base, "cond", "img_2.jpg").write_bytes(jpeg(64, 64, 999))  # another reference for img_2
    rescanned = str(tmp_path / "manifest")
    run(ScanJob(source=str(base / "ds"), out=rescanned, spec=SPEC, conditioning=str(base / "cond"),
                config=ScanConfig(progress=False), previous=manifest))  # fmt: skip
    reader = CacheReader(str(copy))
    before = {r.sample_id: r.caption_key for r in reader.read(list(reader.sample_ids))}
    result = embed_cache(rescanned, str(copy), family=FAMILY, model=tiny, dtype="fp32",
                         reference_resolution=REFERENCE)  # fmt: skip
    assert (result.embedded, result.changed) == (1, 1)
    reader = CacheReader(str(copy))
    after = {r.sample_id: r.caption_key for r in reader.read(list(reader.sample_ids))}
    changed = [sid for sid in after if after[sid] != before[sid]]
    assert len(changed) == 1 and verify_cache(str(copy)).ok


def test_a_manifest_without_pairs_or_with_several_captions_a_row_is_refused(tmp_path):
    import pyarrow as pa

    from manifests.cache import IndexLookup
    from manifests.manifest import read_manifest_meta, write_manifest
    from manifests.manifest_meta import ManifestConditioning
    from pipeline.embed.work import find_work
    from tests.embed_data import make_dataset

    manifest = str(tmp_path / "m")
    make_dataset(str(tmp_path / "data"), manifest, 3)
    m = read_manifest(manifest)
    lists = pa.array([["one", "two"] if name == "img_001.jpg" else None for name in m.samples["filename"].to_pylist()],
                     pa.list_(pa.string()))  # fmt: skip
    samples = m.samples.set_column(m.samples.schema.get_field_index("captions"), "captions", lists)
    write_manifest(manifest, samples, m.errors, source=str(tmp_path / "data"),
                   spec=read_manifest_meta(manifest).bucket_spec)  # fmt: skip
    meta = read_manifest_meta(manifest)
    with pytest.raises(UsageError, match="scan with --conditioning"):
        find_work(manifest, meta, None, IndexLookup.empty(), np.zeros(0, np.uint64), per_sample_text=FAMILY)
    paired = dataclasses.replace(meta, conditioning=ManifestConditioning(root=str(tmp_path / "refs"), column=None))
    with pytest.raises(UsageError, match="'img_001.jpg' has several captions; --family qwen-image-edit"):
        find_work(manifest, paired, None, IndexLookup.empty(), np.zeros(0, np.uint64), per_sample_text=FAMILY)
    assert find_work(manifest, meta, None, IndexLookup.empty(), np.zeros(0, np.uint64)).todo == 3  # others take it
