"""Scene-cut clips: ``annotate --task scenes,motion`` finds the shots of videos with known cuts, and ``rebucket
--scenes`` cuts clips inside them that ``plan`` and ``embed`` take, never across a cut.

The video (64x48 H.264, 24 fps, 96 frames) is written here with PyAV: a red still shot (frames 0-19), a noise
texture (20-39), a green still shot fading to black (40-65) and in again from black to a blue shot with a
texture moving right (66-95). Hard cuts at 20 and 40; the fade is one cut, somewhere in 60..72.
"""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("scenedetect")

from manifests.annotations import read_annotations  # noqa: E402
from manifests.buckets import BucketSpec  # noqa: E402
from manifests.cache import CacheReader  # noqa: E402
from manifests.errors import UsageError  # noqa: E402
from manifests.frames import FrameLadder, scene_clips  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from manifests.plan import read_plan_rows  # noqa: E402
from pipeline import AnnotateJob, ScanJob, run  # noqa: E402
from pipeline.annotate.scenes import detect_scenes, merge_cuts  # noqa: E402
from pipeline.embed import EmbedJob  # noqa: E402
from pipeline.embed.clips import clip_starts  # noqa: E402
from pipeline.plan import PlanJob  # noqa: E402
from pipeline.rebucket import RebucketJob  # noqa: E402
from pipeline.scan import ScanConfig  # noqa: E402

H, W = 48, 64
FADE = (60, 72)  # the dark part of the fade: frames 60..71 are within 12 of black
LADDER = FrameLadder((9, 17))
pytestmark = pytest.mark.usefixtures("bucketeer_home")


def _write(path, frames: list[np.ndarray]) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())


def _shots() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    solid = lambda rgb, k=1.0: np.full((H, W, 3), np.array(rgb) * k, np.uint8)  # noqa: E731
    texture = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    moving = rng.integers(0, 255, (H, W * 3, 3), dtype=np.uint8)
    frames = [solid((200, 30, 30))] * 20 + [texture] * 20 + [solid((30, 200, 60))] * 14
    frames += [solid((30, 200, 60), 1 - i / 12) for i in range(1, 13)]  # 54..65: out to black
    frames += [solid((40, 40, 220), i / 12) for i in range(1, 13)]  # 66..77: in from black
    blue = solid((40, 40, 220))
    frames += [np.where(moving[:, 2 * i : 2 * i + W] > 200, moving[:, 2 * i : 2 * i + W], blue) for i in range(18)]
    return frames


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("scenes")
    _write(root / "cuts.mp4", _shots())
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    _write(root / "long.mp4", [noise] * 20 + [np.zeros((H, W, 3), np.uint8)] * 70)  # a shot over the longest bucket
    from PIL import Image

    Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)).save(root / "still.png")
    return root


def test_hard_cuts_are_found_and_a_fade_is_one_cut(folder):
    scenes = detect_scenes(str(folder / "cuts.mp4"))
    assert scenes.frame_count == 96
    starts = scenes.starts.tolist()
    assert starts[:3] == [0, 20, 40] and len(starts) == 4, starts
    assert FADE[0] <= starts[3] <= FADE[1]
    assert scenes.frames.sum() == 96 and (scenes.starts[1:] == np.cumsum(scenes.frames)[:-1]).all()
    assert np.allclose(scenes.times, scenes.starts / 24, atol=1e-6)
    # still shots score ~0; the texture moving 2 px a frame does not
    assert scenes.motion[0] < 0.05 and scenes.motion[1] < 0.05 and scenes.motion[3] > 0.5


def test_merge_cuts_keeps_one_cut_per_cluster():
    assert merge_cuts([20, 40, 69], [70], 15) == [20, 40, 70]  # the fade's cut wins its cluster
    assert merge_cuts([20, 35], [], 15) == [20, 35]
    assert merge_cuts([20, 50], [28], 15) == [28, 50]
    assert merge_cuts([], [], 15) == []


@pytest.mark.parametrize("lengths", [[20, 20, 26, 30], [5, 40, 3], [8, 8], [100], [17, 1, 18, 35]])
def test_scene_clips_stay_inside_shots(lengths):
    ladder = FrameLadder((9, 17, 33))
    starts = np.cumsum([0, *lengths[:-1]])
    f, clips = scene_clips(ladder, starts, lengths)
    if max(lengths) < 9:
        assert (f, clips) == (0, [])
        return
    assert f == max(r for r in ladder.frames if r <= max(lengths))
    expected = sum(n // f for n in lengths)
    assert len(clips) == expected
    for c in clips:  # inside one shot, never across a cut
        shot = np.searchsorted(starts, c, side="right") - 1
        assert c + f <= starts[shot] + lengths[shot]


@pytest.fixture(scope="module")
def cut(folder, ray_local, tmp_path_factory):
    base = tmp_path_factory.mktemp("scenes-out")
    manifest, scenes, manifest_cut = (str(base / n) for n in ("m", "a", "m-cut"))
    run(ScanJob(source=str(folder), out=manifest, spec=BucketSpec(area=W * H, step=16),
                frames=LADDER, config=ScanConfig(progress=False)))  # fmt: skip
    result = run(AnnotateJob(manifest=manifest, out=scenes, tasks=("scenes", "motion"), device="cpu"))
    run(RebucketJob(manifest=manifest, out=manifest_cut, spec=BucketSpec(area=W * H, step=16), scenes=scenes))
    return manifest, scenes, manifest_cut, result


@pytest.mark.ray
def test_annotate_writes_shots_and_motion_and_resumes(cut):
    manifest, scenes, _, result = cut
    assert result.captioned == 3 and result.errors == 0
    meta, rows, _ = read_annotations(scenes, columns=["scenes", "motion", "scene_motion"])
    by_name = {r["filename"]: r for r in rows.to_pylist()}
    shots = by_name["cuts.mp4"]["scenes"]
    assert [s["start"] for s in shots][:3] == [0, 20, 40] and len(shots) == 4
    assert [s["frames"] for s in shots] == detect_scenes(str(read_manifest(manifest).source)
                                                         + "/cuts.mp4").frames.tolist()
    assert by_name["still.png"]["scenes"] == [{"start": 0, "frames": 1, "time": 0.0}]
    assert len(by_name["cuts.mp4"]["scene_motion"]) == 4 and by_name["cuts.mp4"]["motion"] > 0
    again = run(AnnotateJob(manifest=manifest, out=scenes, tasks=("scenes", "motion"), device="cpu"))
    assert again.up_to_date and again.captioned == 0


@pytest.mark.ray
@pytest.mark.slow  # an embed through Ray Data with the tiny Wan: ~30 s on 2 busy cores
@pytest.mark.full
def test_rebucketed_clips_never_cross_a_cut_in_plan_or_embed(cut, tmp_path):
    manifest, scenes, manifest_cut, _ = cut
    _, shots, _ = read_annotations(scenes, columns=["scenes"])
    shots = {r["sample_id"]: r["scenes"] for r in shots.to_pylist()}
    new = read_manifest(manifest_cut)
    rows = {r["filename"]: r for r in new.samples.to_pylist()}
    # cuts.mp4: longest shot 20 (fade: 26..30) frames -> 17-frame clips, one per shot that holds one
    video = rows["cuts.mp4"]
    assert video["bucket"].endswith("x17") and video["clips"] == len(video["clip_starts"]) >= 3
    # long.mp4: a 20-frame shot and a 70-frame one (over the longest bucket): 4 clips inside it, 1 in the short one
    assert rows["long.mp4"]["clip_starts"] == [0, 20, 37, 54, 71] and rows["long.mp4"]["bucket"].endswith("x17")
    assert rows["still.png"]["bucket"].endswith("x1") and rows["still.png"]["clip_starts"] is None

    plan = str(tmp_path / "plan")
    run(PlanJob(manifests=(manifest_cut,), out=plan, world_size=1, batch_size=1, seed=0, epochs=1))
    planned = {int(i) for ids in read_plan_rows(plan).table().column("sample_ids").to_pylist() for i in ids}
    assert planned == set(new.samples.column("sample_id").to_pylist())

    cache = str(tmp_path / "cache")
    run(EmbedJob(manifest=manifest_cut, out=cache, family="wan", model="default", max_clips=2, dtype="fp32",
                 device="cpu", batch_size=4))  # fmt: skip
    reader = CacheReader(cache)
    for name in ("cuts.mp4", "long.mp4"):
        row = rows[name]
        f = int(row["bucket"].rsplit("x", 1)[1])
        record = reader.read([row["sample_id"]])[0]
        assert list(record.clip_starts) == clip_starts(row["clips"], f, 2, row["clip_starts"])  # first, last
        starts = [s["start"] for s in shots[row["sample_id"]]]
        ends = [s["start"] + s["frames"] for s in shots[row["sample_id"]]]
        for c in record.clip_starts:
            assert any(a <= c and c + f <= b for a, b in zip(starts, ends)), (name, c, f)


@pytest.mark.ray
def test_a_video_without_scenes_is_an_error_row(cut, folder, tmp_path):
    manifest, scenes, _, _ = cut
    _write(folder / "late.mp4", _shots()[:40])  # scanned now, never annotated
    rescanned = str(tmp_path / "m2")
    run(ScanJob(source=str(folder), out=rescanned, spec=BucketSpec(area=W * H, step=16),
                frames=LADDER, config=ScanConfig(progress=False)))  # fmt: skip
    out = str(tmp_path / "m2-cut")
    run(RebucketJob(manifest=rescanned, out=out, spec=BucketSpec(area=W * H, step=16), scenes=scenes))
    errors = {r["filename"]: r["error"] for r in read_manifest(out).errors.to_pylist()}
    assert errors == {"late.mp4": "no_scenes"}
    (folder / "late.mp4").unlink()


@pytest.mark.ray
def test_video_tasks_are_refused_where_they_cannot_run(cut, tmp_path):
    with pytest.raises(UsageError, match="two annotate runs"):
        AnnotateJob(manifest="m", out="a", tasks=("scenes", "phash"))
    with pytest.raises(UsageError, match="scenes,motion"):
        AnnotateJob(manifest="m", out="a", tasks=("motion",))
    manifest, _, _, _ = cut
    hashes = str(tmp_path / "hashes")
    run(AnnotateJob(manifest=manifest, out=hashes, tasks=("sha256",), device="cpu"))
    with pytest.raises(UsageError, match="holds sha256, no scenes"):
        run(RebucketJob(manifest=manifest, out=str(tmp_path / "x"), scenes=hashes))


@pytest.mark.ray
def test_motion_selects_shots_and_videos(cut, tmp_path):
    manifest, scenes, manifest_cut, _ = cut
    _, shots, _ = read_annotations(scenes, columns=["scenes", "scene_motion"])
    moving = {r["filename"]: [s["start"] for s, m in zip(r["scenes"], r["scene_motion"]) if m > 0.5]
              for r in shots.to_pylist()}  # fmt: skip
    assert moving["long.mp4"] == [] and moving["still.png"] == [] and moving["cuts.mp4"][0] == 40
    out = str(tmp_path / "moving")
    run(RebucketJob(manifest=manifest, out=out, spec=BucketSpec(area=W * H, step=16), scenes=scenes,
                    shot_where="motion > 0.5"))  # fmt: skip
    new = read_manifest(out)
    rows = {r["filename"]: r for r in new.samples.to_pylist()}
    assert min(rows["cuts.mp4"]["clip_starts"]) >= 40  # only the shots that move
    assert {r["filename"]: r["error"] for r in new.errors.to_pylist()} == {"long.mp4": "too_short"}
    # the video's motion selects whole videos in a plan
    plan = str(tmp_path / "plan")
    run(PlanJob(manifests=(manifest_cut,), out=plan, world_size=1, batch_size=1, seed=0, epochs=1,
                annotations=(scenes,), where="motion > 0.5"))  # fmt: skip
    planned = {int(i) for ids in read_plan_rows(plan).table().column("sample_ids").to_pylist() for i in ids}
    assert planned == {rows["cuts.mp4"]["sample_id"]}
    with pytest.raises(UsageError, match="--shot-where"):
        run(RebucketJob(manifest=manifest, out=out, scenes=scenes, shot_where="motion +"))
