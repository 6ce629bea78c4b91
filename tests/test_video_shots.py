"""Shot tasks: ``annotate --task scenes,motion,aesthetic,embedding`` scores each shot of a video on its first,
middle and last frame in the one decode that finds the shots, and ``rebucket --shot-where`` selects clips by it.

The video (64x48 H.264, 24 fps) is a flat grey shot (frames 0-29) cut hard to a noise texture (30-59) and to a
red shot (60-89): the scores of each shot must be the embedder's on that shot's own frames.
"""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("scenedetect")

from manifests.annotations import part_schema, read_annotations, read_parts  # noqa: E402
from manifests.buckets import BucketSpec  # noqa: E402
from manifests.errors import UsageError  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from manifests.plan import read_plan_rows  # noqa: E402
from pipeline import AnnotateJob, ScanJob, run  # noqa: E402
from pipeline.annotate.scenes import LOOKBACK, ShotFrames, detect_scenes, final_cuts  # noqa: E402
from pipeline.annotate.vision import ImageEmbedder, VisionSpec  # noqa: E402
from pipeline.plan import PlanJob  # noqa: E402
from pipeline.rebucket import RebucketJob  # noqa: E402
from pipeline.scan import ScanConfig  # noqa: E402
from tests.test_video_scenes import LADDER, H, W, _write  # noqa: E402

TASKS = ("scenes", "motion", "aesthetic", "embedding")
pytestmark = pytest.mark.usefixtures("bucketeer_home")


def _frames() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    texture = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    return ([np.full((H, W, 3), 128, np.uint8)] * 30 + [texture] * 30
            + [np.full((H, W, 3), (200, 30, 30), np.uint8)] * 30)  # fmt: skip


def test_shot_frames_keep_first_middle_and_last_of_every_segment():
    kept = ShotFrames(3, reservoir=4, lookback=8)
    frames = [np.full((2, 2, 3), i, np.uint8) for i in range(100)]
    for i, f in enumerate(frames):
        kept.add(i, f)
        if i == 43:
            kept.cut(40)  # reported 3 frames late, as the detectors do
    kept.finish()
    assert len(kept.kept) <= 2 * (4 + 2) + 1  # bounded: a reservoir and two pinned frames per segment
    first, middle, last = (int(f[0, 0, 0]) for f in kept.pick(40, 60, 3))
    assert (first, last) == (40, 99) and abs(middle - 69.5) <= 60 / 4
    assert [int(f[0, 0, 0]) for f in kept.pick(0, 40, 3)][::2] == [0, 39]


def test_final_cuts_are_those_no_later_cut_can_change():
    assert final_cuts([20, 40, 69], [70], 15, 100) == [20, 40, 70]
    assert final_cuts([20, 40, 69], [70], 15, 80) == [20, 40]  # 69/70's cluster may still grow
    assert final_cuts([20, 40, 52], [], 15, 60) == [20]  # 40 chains to 52, which is too close to the bound


def test_a_long_video_keeps_its_picks_per_shot_not_its_frames(tmp_path):
    rng = np.random.default_rng(3)
    frames = [f for k in range(16) for f in [rng.integers(0, 255, (H, W, 3), dtype=np.uint8)] * 40]  # 16 shots
    _write(tmp_path / "long.mp4", frames)
    scenes = detect_scenes(str(tmp_path / "long.mp4"), keep=3)
    assert scenes.starts.tolist() == list(range(0, 640, 40))
    kept = scenes.kept
    settled = [i for i in kept.kept if i < kept.settled]
    assert kept.settled >= len(frames) - 2 * LOOKBACK - 40 and len(settled) == 3 * (kept.settled // 40)
    pictures = np.stack(frames[::40]).astype(int)  # (16, H, W, 3): every frame of a shot is its picture
    for k, s in enumerate(scenes.starts):  # each shot's picks are its own picture (after H.264), no other's
        for p in kept.pick(int(s), 40, 3):
            assert np.abs(pictures - p.astype(int)).mean(axis=(1, 2, 3)).argmin() == k


@pytest.fixture(scope="module")
def shots(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("shots")
    source = root / "videos"
    source.mkdir()
    _write(source / "three.mp4", _frames())
    from PIL import Image

    Image.fromarray(np.full((H, W, 3), 90, np.uint8)).save(source / "still.png")
    manifest, out = str(root / "m"), str(root / "a")
    run(ScanJob(source=str(source), out=manifest, spec=BucketSpec(area=W * H, step=16), frames=LADDER,
                config=ScanConfig(progress=False)))  # fmt: skip
    result = run(AnnotateJob(manifest=manifest, out=out, tasks=TASKS, device="cpu", unit_rows=1))
    return source, manifest, out, result


@pytest.mark.ray
def test_each_shot_is_scored_on_its_own_frames(shots):
    source, _, out, result = shots
    assert result.captioned == 2 and result.errors == 0
    _, rows, _ = read_annotations(out, columns=["scenes", "aesthetic", "scene_aesthetic", "embedding",
                                                "scene_embedding", "motion"])  # fmt: skip
    by_name = {r["filename"]: r for r in rows.to_pylist()}
    video = by_name["three.mp4"]
    assert [s["start"] for s in video["scenes"]] == [0, 30, 60]
    # the embedder on the frames each shot holds (every frame of a shot is the same picture here)
    scenes = detect_scenes(str(source / "three.mp4"), keep=3)
    from PIL import Image

    embedder = ImageEmbedder(VisionSpec(heads=(("aesthetic", "default"),)))
    red = scenes.kept.pick(60, 30, 1)[0].reshape(-1, 3).mean(0)  # RGB, as the embedder takes it
    assert np.abs(red - (200, 30, 30)).max() < 8
    emb, scores = embedder([Image.fromarray(scenes.kept.pick(s, 30, 1)[0]) for s in (0, 30, 60)])
    got = np.asarray(video["scene_aesthetic"])
    assert np.allclose(got, scores["aesthetic"], rtol=0, atol=2e-5)
    # grey, texture and red score apart, each in its own place in the list
    assert len(set(np.round(scores["aesthetic"], 5))) == 3
    assert [int(np.abs(scores["aesthetic"] - g).argmin()) for g in got] == [0, 1, 2]
    assert np.isclose(video["aesthetic"], np.mean(scores["aesthetic"]), atol=2e-5)  # equal-length shots
    got = np.asarray(video["scene_embedding"], np.float32)  # (3, D)
    assert got.shape == emb.shape and np.allclose(got, emb, atol=2e-3)
    mean = emb.mean(0) / np.linalg.norm(emb.mean(0))
    assert np.allclose(np.asarray(video["embedding"], np.float32), mean, atol=2e-3)
    still = by_name["still.png"]
    assert len(still["scene_aesthetic"]) == 1 and still["aesthetic"] == still["scene_aesthetic"][0]
    names = [n for n, _ in part_schema(TASKS)]
    assert {"scene_aesthetic", "scene_embedding", "scene_motion"} <= set(names)


@pytest.mark.ray
def test_a_killed_run_resumes_from_its_parts(shots, tmp_path):
    """A killed run leaves its finished parts and no ``_annotations.json``: the rerun adopts them."""
    import shutil

    _, manifest, out, _ = shots
    copy = tmp_path / "killed"
    shutil.copytree(out, copy)
    (copy / "_annotations.json").unlink()
    parts = sorted((copy / "parts").glob("*.parquet"))
    assert len(parts) == 2  # one unit per sample
    parts[0].unlink()  # the unit in flight when it was killed
    kept = read_parts(str(copy), None, "parts").column("sample_id").to_pylist()
    again = run(AnnotateJob(manifest=manifest, out=str(copy), tasks=TASKS, device="cpu", unit_rows=1))
    assert again.skipped == 1 and again.captioned == 1
    _, rows, _ = read_annotations(str(copy), columns=["scene_aesthetic"])
    _, first, _ = read_annotations(out, columns=["scene_aesthetic"])
    scores = lambda t: sorted(zip(t.column("sample_id").to_pylist(), t.column("scene_aesthetic").to_pylist()))  # noqa: E731
    assert scores(rows) == scores(first)  # the adopted part and the redone one, as the uninterrupted run wrote them
    assert set(kept) < set(rows.column("sample_id").to_pylist())


@pytest.mark.ray
def test_shot_where_aesthetic_selects_clips_and_where_selects_videos(shots, tmp_path):
    _, manifest, out, _ = shots
    _, rows, _ = read_annotations(out, columns=["scene_aesthetic", "aesthetic"])
    video = next(r for r in rows.to_pylist() if r["filename"] == "three.mp4")
    scores = video["scene_aesthetic"]
    best = int(np.argmax(scores))
    cut = float(np.sort(scores)[-1] + np.sort(scores)[-2]) / 2  # only the best shot is above
    new = str(tmp_path / "best")
    run(RebucketJob(manifest=manifest, out=new, spec=BucketSpec(area=W * H, step=16), scenes=out,
                    shot_where=f"motion < 0.5 AND aesthetic > {cut}"))  # fmt: skip
    starts = {r["filename"]: r["clip_starts"] for r in read_manifest(new).samples.to_pylist()}
    assert starts["three.mp4"] and all(30 * best <= c and c + 17 <= 30 * (best + 1) for c in starts["three.mp4"])
    plan = str(tmp_path / "plan")
    run(PlanJob(manifests=(manifest,), out=plan, world_size=1, batch_size=1, seed=0, epochs=1,
                annotations=(out,), where=f"aesthetic <= {video['aesthetic']}"))  # fmt: skip
    planned = {int(i) for ids in read_plan_rows(plan).table().column("sample_ids").to_pylist() for i in ids}
    ids = {r["filename"]: r["sample_id"] for r in rows.to_pylist()}
    expected = {ids[r["filename"]] for r in rows.to_pylist() if r["aesthetic"] <= video["aesthetic"]}
    assert planned == expected and ids["three.mp4"] in planned


def test_shot_tasks_need_scenes_and_image_tasks_are_refused():
    with pytest.raises(UsageError, match="two annotate runs"):
        AnnotateJob(manifest="m", out="a", tasks=("scenes", "aesthetic", "phash"))
    AnnotateJob(manifest="m", out="a", tasks=("scenes", "aesthetic", "embedding"))  # accepted


@pytest.mark.ray
def test_a_shot_task_without_scenes_on_a_video_manifest_is_refused(shots, tmp_path):
    _, manifest, _, _ = shots
    with pytest.raises(UsageError, match="give --task scenes,aesthetic"):
        run(AnnotateJob(manifest=manifest, out=str(tmp_path / "x"), tasks=("aesthetic",), device="cpu"))
