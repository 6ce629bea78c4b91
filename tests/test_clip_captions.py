"""Each clip trains on its own shot's caption: ``rebucket --scenes`` of captioned shots -> embed -> the trainer.

A 2-shot video with a hard cut (two noise textures, 18 frames each: ladder 9, 17 gives one 17-frame clip per
shot) and an image. The shots are found by the real ``annotate --task scenes``; their captions are given here
(``scene_caption`` added to what rebucket reads, as ``annotate --task scenes,caption`` writes it), so the test
needs no VLM. Checked by caption keys: each batch's text is the text record of its clip's shot's caption,
whatever caption the plan chose; a resumed run draws the same; a record without the field trains as before.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

av = pytest.importorskip("av")

from manifests.buckets import BucketSpec  # noqa: E402
from manifests.cache import CacheReader, read_cache_meta  # noqa: E402
from manifests.cache.records import caption_key, decode_sample, encode_sample, to_float32  # noqa: E402
from manifests.cache.verify import verify_cache  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from pipeline import AnnotateJob, ScanJob, run  # noqa: E402
from pipeline.embed import EmbedJob  # noqa: E402
from pipeline.rebucket import RebucketJob, _shot_captions  # noqa: E402
from pipeline.scan import ScanConfig  # noqa: E402
from tests.test_video_scenes import LADDER, H, W, _write  # noqa: E402
from train.data import BatchLoader, PlanStep  # noqa: E402
from train.data.batch import _per_channel, latent_normaliser  # noqa: E402
from train.data.draws import variant_text_keys  # noqa: E402

pytestmark = pytest.mark.usefixtures("bucketeer_home")

SHOTS = ("a red car on a wet road", "a dog runs across a beach")


def test_shot_captions_are_the_distinct_captions_of_the_shots_that_give_clips():
    texts = {"caption": "the video's own", "captions": None}
    got, on = _shot_captions([1, 0, 2, 1, 1], ["a", "unused", "b", "a", None], texts)
    assert got == {"caption": "a", "captions": ["a", "b", "the video's own"]}
    assert on == [0, 1, 1, 0, 2]  # clips of shot 0, shot 2 (twice), shot 3 (a again), shot 4 (no caption)
    assert _shot_captions([2], ["only"], texts) == ({"caption": "only", "captions": None}, [0, 0])


@pytest.fixture(scope="module")
def cut(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("clipcap")
    source = root / "videos"
    source.mkdir()
    rng = np.random.default_rng(7)
    one, two = (rng.integers(0, 255, (H, W, 3), dtype=np.uint8) for _ in range(2))
    _write(source / "two.mp4", [one] * 18 + [two] * 18)
    from PIL import Image

    Image.fromarray(np.full((H, W, 3), 90, np.uint8)).save(source / "still.png")
    (source / "still.txt").write_text("a grey square\n")
    manifest, scenes = str(root / "m"), str(root / "a")
    run(ScanJob(source=str(source), out=manifest, spec=BucketSpec(area=W * H, step=16), frames=LADDER,
                config=ScanConfig(progress=False)))  # fmt: skip
    run(AnnotateJob(manifest=manifest, out=scenes, tasks=("scenes",), device="cpu", unit_rows=1))
    plain = str(root / "plain")
    run(RebucketJob(manifest=manifest, out=plain, spec=BucketSpec(area=W * H, step=16), scenes=scenes))
    import pipeline.rebucket as rebucket

    read = rebucket._read_scenes

    def captioned(url, options):
        rows = read(url, options)
        said = [list(SHOTS[: len(s)]) for s in rows.column("scenes").to_pylist()]
        return rows.append_column("scene_caption", pa.array(said, pa.list_(pa.string())))

    out, cache = str(root / "cut"), str(root / "cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rebucket, "_read_scenes", captioned)
        run(RebucketJob(manifest=manifest, out=out, spec=BucketSpec(area=W * H, step=16), scenes=scenes))
    run(EmbedJob(manifest=out, out=cache, family="wan", model="default", flip=True, max_clips=2, dtype="fp32",
                 device="cpu", batch_size=4))  # fmt: skip
    rows = {r["filename"]: r for r in read_manifest(out).samples.to_pylist()}
    return plain, rows, cache


@pytest.mark.ray
@pytest.mark.slow
def test_rebucket_gives_each_clip_its_shots_caption(cut):
    plain, rows, _ = cut
    video = rows["two.mp4"]
    assert video["clip_starts"] == [0, 18] and video["bucket"].endswith("x17")
    assert video["captions"] == list(SHOTS) and video["caption"] == SHOTS[0]
    assert video["clip_captions"] == [0, 1]
    assert rows["still.png"]["caption"] == "a grey square" and rows["still.png"]["clip_captions"] is None
    uncaptioned = {r["filename"]: r for r in read_manifest(plain).samples.to_pylist()}["two.mp4"]
    assert uncaptioned["clip_starts"] == [0, 18] and uncaptioned["clip_captions"] is None  # shots not captioned
    assert uncaptioned["captions"] is None


@pytest.mark.ray
def test_each_clip_variant_carries_its_shots_caption_and_verifies(cut):
    _, rows, cache = cut
    (record,) = CacheReader(cache).read([rows["two.mp4"]["sample_id"]])
    assert record.clip_starts.tolist() == [0, 0, 18, 18]  # 2 clips x --flip
    assert record.variant_captions.tolist() == [0, 0, 1, 1]
    assert record.caption_keys == tuple(caption_key(c) for c in SHOTS)
    (still,) = CacheReader(cache).read([rows["still.png"]["sample_id"]])
    assert still.variant_captions is None
    assert verify_cache(cache).ok


def _batches(cache: str, steps: list[PlanStep]) -> list:
    reader = CacheReader(cache)
    return list(BatchLoader(reader, steps, read_cache_meta(cache).latent, seed=3, log=lambda _: None))


@pytest.mark.ray
def test_the_trainer_pairs_each_clip_with_its_own_shots_text(cut):
    _, rows, cache = cut
    video = rows["two.mp4"]
    reader = CacheReader(cache)
    layout = reader.meta.text_layout
    (record,) = reader.read([video["sample_id"]])
    shift, scale = latent_normaliser(read_cache_meta(cache).latent)
    # the plan's caption choice alternates; it must not decide the text of a clip
    steps = [PlanStep(e, 0, video["bucket"], (video["sample_id"],), caption_index=np.array([e % 2], np.uint8))
             for e in range(12)]  # fmt: skip
    batches = _batches(cache, steps)
    seen = set()
    for batch in batches:
        v = batch.variants[0]
        shot = v // 2  # variant v is clip v // flips; clip i lies in shot i
        seen.add(shot)
        want, _, _ = layout.prompt_embeds(reader.read_texts([caption_key(SHOTS[shot])]))
        np.testing.assert_array_equal(batch.text.numpy(), want)
        latent = to_float32(record.variant(v).latent, record.dtype)[None]  # (1, C, F', h, w)
        np.testing.assert_allclose(batch.latents.numpy(), (latent - _per_channel(shift, latent))
                                   * _per_channel(scale, latent), rtol=0, atol=0)  # fmt: skip
        clip = record.variant(v)
        assert int(clip.clip_starts[0]) == [0, 18][shot] and variant_text_keys([clip]) == [caption_key(SHOTS[shot])]
    assert seen == {0, 1}  # both clips, each with its own caption
    resumed = _batches(cache, steps[5:])
    for a, b in zip(batches[5:], resumed):
        assert a.variants == b.variants
        np.testing.assert_array_equal(a.text.numpy(), b.text.numpy())
        np.testing.assert_array_equal(a.latents.numpy(), b.latents.numpy())


@pytest.mark.ray
def test_a_record_without_clip_captions_trains_on_the_plans_caption(cut):
    _, rows, cache = cut
    reader = CacheReader(cache)
    (record,) = reader.read([rows["two.mp4"]["sample_id"]])
    old = decode_sample(encode_sample(replace(record, variant_captions=None, text=None)))  # as written before
    assert old.variant_captions is None and variant_text_keys([old.variant(2)]) == [None]
    still = rows["still.png"]
    (batch,) = _batches(cache, [PlanStep(0, 0, still["bucket"], (still["sample_id"],))])
    want, _, _ = reader.meta.text_layout.prompt_embeds(reader.read_texts([caption_key("a grey square")]))
    np.testing.assert_array_equal(batch.text.numpy(), want)
