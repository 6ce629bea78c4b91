"""Shot captions: ``annotate --task scenes,caption`` captions each shot from its own frames, given to a video
model (the tiny random Qwen2.5-VL of ``--model default``) as video input, in the decode that finds the shots.

The video (64x48 H.264, 24 fps) is a grey shot, a noise texture and a red shot of 30 frames each
(tests/test_video_shots.py); beside it a still image, one 1-frame shot. Each shot's caption must be the model's
on that shot's picked frames alone. The numpy video input is checked against transformers' own Qwen2-VL image
processor (a still video equals its image, which that processor repeats over the temporal patch) and against the
video processor's patch layout computed here in torch.
"""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("scenedetect")

from manifests.annotations import read_annotations  # noqa: E402
from manifests.buckets import BucketSpec  # noqa: E402
from manifests.errors import UsageError  # noqa: E402
from pipeline import AnnotateJob, ScanJob, run  # noqa: E402
from pipeline.annotate.engines import DEFAULT_VIDEO_PROMPT, CaptionSpec  # noqa: E402
from pipeline.annotate.scenes import detect_scenes  # noqa: E402
from pipeline.annotate.video_captions import ShotCaptioner, VideoGrid, video_patches  # noqa: E402
from pipeline.scan import ScanConfig  # noqa: E402
from tests.test_video_scenes import LADDER, H, W, _write  # noqa: E402
from tests.test_video_shots import _frames  # noqa: E402

TASKS = ("scenes", "caption")
TOKENS = 6
pytestmark = pytest.mark.usefixtures("bucketeer_home")


def test_a_still_video_is_patched_as_the_image_processor_patches_its_image():
    try:  # transformers 5.2x: the PIL backend has its own class; 5.0 (the floor): the slow class is PIL's
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Pil
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Pil

    rng = np.random.default_rng(3)
    frame = rng.integers(0, 255, (144, 256, 3), dtype=np.uint8)
    grid = VideoGrid(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    patches, thw = video_patches([frame, frame], grid)
    images = Pil(size={"shortest_edge": grid.min_pixels, "longest_edge": grid.max_pixels},
                 patch_size=14, merge_size=2, temporal_patch_size=2)  # fmt: skip
    want = images(images=[frame], return_tensors="np")
    assert list(want["image_grid_thw"][0]) == [1, thw[1], thw[2]] and thw[0] == 1
    assert patches.shape == want["pixel_values"].shape
    assert np.allclose(patches, want["pixel_values"], atol=1e-5)


def test_a_moving_video_has_the_video_processors_patch_layout():
    """Qwen2VLVideoProcessor.patchify's view and permute (its module needs torchvision), on our normalised
    frames; an odd frame count repeats the last frame."""
    import torch

    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 255, (48, 64, 3), dtype=np.uint8) for _ in range(3)]
    grid = VideoGrid(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    patches, (t, h, w) = video_patches(frames, grid)
    same, _ = video_patches([*frames, frames[-1]], grid)
    assert t == 2 and np.array_equal(patches, same)
    from PIL import Image

    rh, rw = h * 14, w * 14
    mean, std = np.asarray(grid.mean, np.float32), np.asarray(grid.std, np.float32)
    v = np.stack([(np.asarray(Image.fromarray(f).resize((rw, rh), Image.BICUBIC)) / 255.0 - mean) / std
                  for f in [*frames, frames[-1]]]).astype(np.float32)  # fmt: skip
    video = torch.from_numpy(v).permute(0, 3, 1, 2)[None]  # (1, F, C, H, W)
    ref = video.reshape(1, t, 2, 3, h // 2, 2, 14, w // 2, 2, 14).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    ref = ref.reshape(t * h * w, 3 * 2 * 14 * 14).numpy()
    assert np.allclose(patches, ref, atol=1e-5)


@pytest.fixture(scope="module")
def captioned(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("captions")
    source = root / "videos"
    source.mkdir()
    _write(source / "three.mp4", _frames())
    from PIL import Image

    Image.fromarray(np.full((H, W, 3), 90, np.uint8)).save(source / "still.png")
    manifest, out = str(root / "m"), str(root / "a")
    run(ScanJob(source=str(source), out=manifest, spec=BucketSpec(area=W * H, step=16), frames=LADDER,
                config=ScanConfig(progress=False)))  # fmt: skip
    result = run(AnnotateJob(manifest=manifest, out=out, tasks=TASKS, device="cpu", unit_rows=1,
                             max_new_tokens=TOKENS))  # fmt: skip
    return source, manifest, out, result


@pytest.mark.ray
def test_each_shot_is_captioned_from_its_own_frames_as_video(captioned):
    source, _, out, result = captioned
    assert result.captioned == 2 and result.errors == 0
    _, rows, _ = read_annotations(out, columns=["scenes", "caption", "scene_caption", "generated_tokens"])
    by_name = {r["filename"]: r for r in rows.to_pylist()}
    video = by_name["three.mp4"]
    assert [s["start"] for s in video["scenes"]] == [0, 30, 60]
    scenes = detect_scenes(str(source / "three.mp4"), keep=(8,))
    import os

    captioner = ShotCaptioner(CaptionSpec(model="default", home=os.environ["BUCKETEER_HOME"],
                                          prompt=DEFAULT_VIDEO_PROMPT, max_new_tokens=TOKENS, shot_frames=8))
    alone = [captioner.caption([scenes.kept.pick(s, 30, 8)], [24 * 8 / 30])[0] for s in (0, 30, 60)]
    assert video["scene_caption"] == [c for c, _ in alone]
    assert video["generated_tokens"] == sum(k for _, k in alone)
    assert video["caption"] == alone[0][0]  # equal shots: the first of the longest
    assert len(set(video["scene_caption"])) > 1  # the shots' own frames reach the model
    still = by_name["still.png"]
    assert len(still["scene_caption"]) == 1 and still["caption"] == still["scene_caption"][0]


@pytest.mark.ray
def test_a_rerun_skips_captioned_videos_and_a_killed_one_redoes_its_unit(captioned, tmp_path):
    import shutil

    _, manifest, out, _ = captioned
    again = run(AnnotateJob(manifest=manifest, out=out, tasks=TASKS, device="cpu", unit_rows=1,
                            max_new_tokens=TOKENS))  # fmt: skip
    assert again.up_to_date and again.skipped == 2 and again.captioned == 0
    copy = tmp_path / "killed"
    shutil.copytree(out, copy)
    (copy / "_annotations.json").unlink()
    parts = sorted((copy / "parts").glob("*.parquet"))
    assert len(parts) == 2
    parts[0].unlink()
    redo = run(AnnotateJob(manifest=manifest, out=str(copy), tasks=TASKS, device="cpu", unit_rows=1,
                           max_new_tokens=TOKENS))  # fmt: skip
    assert redo.skipped == 1 and redo.captioned == 1
    _, a, _ = read_annotations(str(copy), columns=["scene_caption"])
    _, b, _ = read_annotations(out, columns=["scene_caption"])
    key = lambda t: sorted(zip(t.column("sample_id").to_pylist(), t.column("scene_caption").to_pylist()))  # noqa: E731
    assert key(a) == key(b)


def test_shot_frames_must_be_even_and_at_least_two():
    for bad in (0, 1, 3):
        with pytest.raises(UsageError, match="--shot-frames"):
            AnnotateJob(manifest="m", out="a", tasks=TASKS, shot_frames=bad)
    AnnotateJob(manifest="m", out="a", tasks=TASKS, shot_frames=4)  # accepted


@pytest.mark.ray
def test_an_image_only_captioner_is_refused_for_shots(captioned, tmp_path):
    from pipeline.annotate.default_model import ensure_default_model

    _, manifest, _, _ = captioned
    llava = str(ensure_default_model())
    with pytest.raises(UsageError, match="--model .*takes images only"):
        run(AnnotateJob(manifest=manifest, out=str(tmp_path / "x"), tasks=TASKS, model=llava, device="cpu"))


@pytest.mark.ray
def test_a_rescan_takes_each_videos_caption_from_its_shots(captioned, tmp_path):
    """``scan --captions CAPTIONED``: the video's caption (its longest shot's) is what embed encodes for it."""
    source, _, out, _ = captioned
    rescan = str(tmp_path / "m2")
    run(ScanJob(source=str(source), out=rescan, spec=BucketSpec(area=W * H, step=16), frames=LADDER, captions=out,
                config=ScanConfig(progress=False)))  # fmt: skip
    from manifests.manifest import read_manifest

    _, rows, _ = read_annotations(out, columns=["caption"])
    generated = dict(zip(rows.column("filename").to_pylist(), rows.column("caption").to_pylist()))
    samples = read_manifest(rescan).samples.to_pylist()
    got = {r["filename"]: r["caption"] for r in samples}
    from pipeline.sources.captions import normalise_caption

    assert got["three.mp4"] == normalise_caption(generated["three.mp4"])
