"""bucketeer embed on a video manifest: clips decoded with PyAV in the workers, through AutoencoderKLWan.

Tiny clips written with PyAV (the writer of tests/test_video_scan.py): 64x64 and 96x64, 9 to 27 frames,
H.264 (VP9 where available), one rotated 90 degrees, an image joining as a 1-frame clip. Every latent is
compared with the tiny Wan VAE run directly on the same clip decoded with PyAV (plain ``av.open`` of the
file) and cropped by the images' rule.
"""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")

from manifests.buckets import BucketSpec  # noqa: E402
from manifests.cache import CacheReader  # noqa: E402
from manifests.cache.records import to_float32  # noqa: E402
from manifests.errors import UsageError  # noqa: E402
from manifests.frames import FrameLadder  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from pipeline.cli import main  # noqa: E402
from pipeline.embed import EmbedJob, run as embed  # noqa: E402
from pipeline.embed.clips import clip_starts, decode_clip_frames  # noqa: E402
from pipeline.embed.loading import to_storage  # noqa: E402
from pipeline.embed.families.tiny import ensure_tiny  # noqa: E402
from pipeline.embed.imaging import cover_and_crop, crop_resized  # noqa: E402
from pipeline.scan import ScanConfig, ScanJob, run as scan  # noqa: E402
from tests.test_video_scan import H264, _write  # noqa: E402

FRAMES = 9


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-embed")
    _write(root / "a.mp4", H264, 9, size=(64, 64), seed=1)
    (root / "a.txt").write_text("a red ball\n")
    _write(root / "long.mp4", H264, 27, size=(96, 64), seed=2)  # 3 clips of 9
    if hasattr(av.video.stream.VideoStream, "set_display_rotation"):
        _write(root / "rotated.mp4", H264, 10, size=(96, 64), rotate=90, seed=3)  # displayed 64x96
    if "libvpx-vp9" in av.codecs_available:
        _write(root / "vp9.webm", "libvpx-vp9", 9, size=(64, 64), options={"deadline": "realtime", "cpu-used": "8"})
    from PIL import Image

    rng = np.random.default_rng(4)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / "still.png")
    return root


@pytest.fixture(scope="module")
def scanned(folder, ray_local, tmp_path_factory):
    manifest = str(tmp_path_factory.mktemp("video-embed-manifest") / "m")
    scan(ScanJob(source=str(folder), out=manifest, spec=BucketSpec(area=64 * 64, step=32),
                 frames=FrameLadder((FRAMES,)), config=ScanConfig(progress=False)))  # fmt: skip
    return manifest


@pytest.fixture(scope="module")
def embedded(scanned, tmp_path_factory):
    manifest, cache = scanned, str(tmp_path_factory.mktemp("video-embed-cache") / "c")
    result = embed(EmbedJob(manifest=manifest, out=cache, family="wan", model="default", flip=True, max_clips=2,
                            dtype="fp32", device="cpu", batch_size=4))  # fmt: skip
    return manifest, cache, result


def _vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(str(ensure_tiny("wan")), subfolder="vae").eval()


def _direct_clip(path, bucket: tuple[int, int], start: int, frames: int, flip: bool) -> np.ndarray:
    """(F, H, W, 3) uint8: the clip decoded with plain PyAV, rotated for display, center-cropped like images."""
    with av.open(str(path)) as container:
        decoded = [f for i, f in enumerate(container.decode(video=0)) if start <= i < start + frames]
    from PIL import Image

    out = []
    for f in decoded:
        pixels = f.to_ndarray(format="rgb24")
        pixels = np.rot90(pixels, int(round(f.rotation / 90)) % 4) if f.rotation else pixels
        img = Image.fromarray(np.ascontiguousarray(pixels))
        resized, top_left = cover_and_crop((img.height, img.width), bucket)
        out.append(crop_resized(img, resized, top_left, bucket))
    clip = np.stack(out)
    return clip[:, :, ::-1] if flip else clip


def _encode(vae, clip: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        x = torch.from_numpy(clip.copy()).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0  # (1, 3, F, H, W)
        return to_float32(to_storage(vae.encode(x).latent_dist.mean[0], "F32"), "F32")


def test_clip_starts_are_evenly_spaced():
    assert clip_starts(1, 9, 4) == [0]
    assert clip_starts(3, 9, 2) == [0, 18]
    assert clip_starts(10, 17, 4) == [0, 51, 102, 153]


def test_decode_stops_after_the_last_clip(folder):
    seen = []
    decoded = decode_clip_frames(str(folder / "long.mp4"), [9], 9, lambda c, k, img: seen.append((c, k, img.size)))
    assert decoded == 18 and [k for _, k, _ in seen] == list(range(9)) and seen[0] == (0, 0, (96, 64))


@pytest.mark.slow  # an embed through Ray Data with the tiny Wan: ~1 minute on 2 busy cores
@pytest.mark.full
def test_video_latents_equal_the_vae_on_the_decoded_clip(embedded, folder):
    manifest, cache, result = embedded
    rows = {r["filename"]: r for r in read_manifest(manifest).samples.to_pylist()}
    reader = CacheReader(cache)
    meta = reader.meta
    assert meta.latent.temporal_factor == 4 and len(meta.latent.latents_mean) == 16
    assert meta.latent.latents_std == tuple(_vae().config.latents_std)
    assert meta.settings.video.max_clips == 2
    vae = _vae()
    for name in [n for n in rows if n.endswith((".mp4", ".webm"))]:
        row = rows[name]
        record = reader.read([row["sample_id"]])[0]
        w, h, f = (int(x) for x in row["bucket"].split("x"))
        starts = clip_starts(row["clips"], f, 2)
        assert record.variants == 2 * len(starts)  # clips x (plain, mirrored)
        assert record.latent.shape == (16, (f - 1) // 4 + 1, h // 8, w // 8)
        assert list(record.clip_starts) == [s for s in starts for _ in (0, 1)]
        for v in range(record.variants):
            want = _encode(vae, _direct_clip(folder / name, (h, w), starts[v // 2], f, flip=v % 2 == 1))
            got = to_float32(record.variant(v).latent, record.dtype)
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4, err_msg=f"{name} variant {v}")
    if "long.mp4" in rows:  # 3 clips of 9, 2 kept: the first and the last, distinct latents
        record = reader.read([rows["long.mp4"]["sample_id"]])[0]
        assert list(record.clip_starts) == [0, 0, 18, 18]
        assert not np.allclose(record.variant(0).latent, record.variant(2).latent)
    if "rotated.mp4" in rows:  # stored 96x64, displayed 64x96
        assert (rows["rotated.mp4"]["width"], rows["rotated.mp4"]["height"]) == (64, 96)
        assert reader.read([rows["rotated.mp4"]["sample_id"]])[0].original_size == (96, 64)


@pytest.mark.slow
@pytest.mark.full
def test_an_image_is_a_one_frame_clip(embedded, folder):
    manifest, cache, _ = embedded
    row = next(r for r in read_manifest(manifest).samples.to_pylist() if r["filename"] == "still.png")
    assert row["bucket"] == "64x64x1"
    record = CacheReader(cache).read([row["sample_id"]])[0]
    assert record.latent.shape == (16, 1, 8, 8) and record.variants == 2
    from PIL import Image

    clip = np.asarray(Image.open(folder / "still.png").convert("RGB"))[None]  # (1, 64, 64, 3)
    np.testing.assert_allclose(to_float32(record.latent, record.dtype), _encode(_vae(), clip), atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.full
def test_verify_and_rerun_add_nothing(embedded, capsys):
    manifest, cache, result = embedded
    assert result.errors == 0 and result.embedded == len(read_manifest(manifest).samples)
    assert main(["verify", cache]) == 0
    again = embed(EmbedJob(manifest=manifest, out=cache, family="wan", model="default", flip=True, max_clips=2,
                           dtype="fp32", device="cpu", batch_size=4))  # fmt: skip
    assert again.up_to_date and again.embedded == 0


@pytest.mark.slow
@pytest.mark.full
def test_an_undecodable_video_is_an_error_row(tmp_path, ray_local):
    _write(tmp_path / "ok.mp4", H264, 9, size=(64, 64))
    manifest, cache = str(tmp_path / "m"), str(tmp_path / "c")
    scan(ScanJob(source=str(tmp_path), out=manifest, spec=BucketSpec(area=64 * 64, step=32),
                 frames=FrameLadder((FRAMES,)), config=ScanConfig(progress=False)))  # fmt: skip
    data = (tmp_path / "ok.mp4").read_bytes()
    (tmp_path / "ok.mp4").write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))  # same size
    result = embed(EmbedJob(manifest=manifest, out=cache, family="wan", model="default", device="cpu"))
    assert result.embedded == 0 and result.errors == 1


@pytest.mark.parametrize("options, words", [({"features": "dinov2"}, "--features"), ({"crops": 2}, "--crops"),
                                             ({"latents": "posterior"}, "--latents posterior"),
                                             ({"family": "generic", "model": None}, "need a video VAE")])  # fmt: skip
def test_what_video_cannot_take_is_refused(scanned, tmp_path, options, words):
    manifest = scanned
    with pytest.raises(UsageError, match=words):
        embed(EmbedJob(manifest=manifest, out=str(tmp_path / "c"), **{"family": "wan", "model": "default", **options}))


def test_ranged_reads_stop_after_the_clip_and_match_a_local_decode(tmp_path):
    """Over object storage (memory://) the workers read ranges, keep a few chunks and stop after the clip."""
    import fsspec

    from pipeline.embed.prepare import prepare_batch
    from pipeline.sources.headers import RangeReader

    options = {"crf": "0", "preset": "ultrafast"} if H264 == "libx264" else {"qscale": "1"}
    _write(tmp_path / "big.mp4", H264, 60, size=(96, 64), options=options)  # lossless noise: ~1 MB
    data = (tmp_path / "big.mp4").read_bytes()
    reader = RangeReader(lambda a, b: data[a:b], len(data), 64 * 1024, max_bytes=1 << 62, max_fetch=128 * 1024,
                         keep_chunks=2)  # fmt: skip
    assert decode_clip_frames(reader, [0], FRAMES, lambda c, k, img: None) == FRAMES
    assert reader.bytes_read < len(data) / 2 and len(reader._chunks) <= 3
    fs = fsspec.filesystem("memory")
    fs.pipe("/videos/big.mp4", data)
    row = {"sample_id": 7, "filename": "big.mp4", "container": None, "size": len(data), "clips": 6}
    remote = prepare_batch("/videos", None, "64x64x9", [row], "center", 0, 1 << 30, fs=fs, max_clips=2)
    local = prepare_batch(str(tmp_path), None, "64x64x9", [row], "center", 0, 1 << 30, max_clips=2)
    assert remote["errors"] == [] and remote["rows"][0]["clip_starts"] == [0, 45]
    assert remote["pixels"].shape == (2, FRAMES, 64, 64, 3)
    np.testing.assert_array_equal(remote["pixels"], local["pixels"])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["tar", "parquet"])
@pytest.mark.full
def test_videos_in_tar_shards_and_parquet_columns(folder, ray_local, tmp_path, where):
    """A tar member's clip is decoded from ranged reads of its byte range, a parquet value from its bytes: the
    latents equal the VAE on the loose file's decoded clip."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.shards import tar_bytes

    root = tmp_path / "src"
    root.mkdir()
    names = ["a.mp4", "long.mp4"]
    if where == "tar":
        (root / "shard-000.tar").write_bytes(tar_bytes([(n, (folder / n).read_bytes()) for n in names]))
        config = ScanConfig(progress=False)
    else:
        pq.write_table(pa.table({"video": [(folder / n).read_bytes() for n in names]}), root / "v.parquet")
        config = ScanConfig(progress=False, format="parquet", image_column="video")
    manifest, cache = str(tmp_path / "m"), str(tmp_path / "c")
    scan(ScanJob(source=str(root), out=manifest, spec=BucketSpec(area=64 * 64, step=32),
                 frames=FrameLadder((FRAMES,)), config=config))  # fmt: skip
    result = embed(EmbedJob(manifest=manifest, out=cache, family="wan", model="default", dtype="fp32",
                            device="cpu", max_clips=2))  # fmt: skip
    rows = read_manifest(manifest).samples.to_pylist()
    assert result.errors == 0 and result.embedded == len(rows) == 2
    reader, vae = CacheReader(cache), _vae()
    for row, name in zip(sorted(rows, key=lambda r: r["filename"]), names):
        record = reader.read([row["sample_id"]])[0]
        w, h, f = (int(x) for x in row["bucket"].split("x"))
        last = clip_starts(row["clips"], f, 2)[-1]
        want = _encode(vae, _direct_clip(folder / name, (h, w), last, f, flip=False))
        np.testing.assert_allclose(to_float32(record.variant(record.variants - 1).latent, record.dtype), want,
                                   atol=2e-4, rtol=1e-4, err_msg=f"{where} {name}")  # fmt: skip


def _forward(path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.mark.parametrize("vfr", [False, True])
def test_a_late_clip_seeks_to_its_keyframe_frame_exact(tmp_path, vfr):
    """A clip far into the video: a seek to the keyframe before it (few frames decoded), the same frames as a
    decode from frame 0; variable-rate video decodes forward from the start instead, with the same frames."""
    path = tmp_path / "gop.mp4"
    pts = list(np.cumsum(np.random.default_rng(5).integers(30, 55, 140)) - 30) if vfr else None
    _write(path, H264, 140, options={"g": "12"} if H264 == "libx264" else None, pts=pts, seed=6)
    reference = _forward(path)
    got: dict[tuple[int, int], np.ndarray] = {}
    decoded = decode_clip_frames(str(path), [0, 120], FRAMES,
                                 lambda c, k, img: got.__setitem__((c, k), np.asarray(img)))  # fmt: skip
    assert sorted(got) == [(c, k) for c in (0, 1) for k in range(FRAMES)]
    for (c, k), pixels in got.items():
        np.testing.assert_array_equal(pixels, reference[[0, 120][c] + k])
    if vfr:
        assert decoded == 120 + FRAMES  # forward from the start
    elif H264 == "libx264":
        assert decoded <= FRAMES + 12 + FRAMES, decoded  # the first clip, then a GOP at most before the late one
