"""Small, varied, deterministic datasets for demos: shapes, formats, captions, a few broken files.

``make_sample_dataset(folder, n=300)`` writes ``n`` images of several aspect ratios (JPEG, PNG and
WebP; some with an EXIF orientation that rotates them), ``.txt`` captions for most of them, and a
handful of broken files (truncated, empty, HTML saved as .jpg) that a scan must report as errors.
``add_curation_cases(folder)`` adds what a curation pass should find in such a folder: exact copies and
re-encoded copies of some of its images (duplicates) and a few blank frames (no contrast).
``make_sample_clips(folder, n=24)`` writes short video clips (H.264 mp4 and VP9 webm through PyAV, the
``video`` extra) of moving colour fields in three aspect ratios, some long enough for several clips,
one too short for any frame bucket, one rotated 90 degrees, a few still images, and a broken file.
``make_references(folder)`` gives each image of such a dataset a reference image (its grey version) under
``folder/_references``, for ``scan --conditioning`` and an edit model (``qwen-image-edit``).
"""

from __future__ import annotations

import collections
import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["make_sample_dataset", "add_curation_cases", "make_references", "make_sample_clips", "REFERENCES"]

REFERENCES = "_references"  # make_references' folder under the dataset: scan --conditioning DATASET/_references

# (width, height) shapes in the ratios photo datasets have: square, 4:3, 3:2, 16:9, 2:1 and portraits
SHAPES = ((512, 512), (576, 432), (432, 576), (600, 400), (400, 600), (640, 360), (360, 640), (640, 320), (480, 480))
SUBJECTS = ("a red fox", "a mountain lake", "an old bicycle", "a bowl of ramen", "a city at night", "a tabby cat")
STYLES = ("photo", "watercolour painting", "pencil sketch", "35mm film still")


def _picture(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    # a coarse random colour field, upscaled smoothly, plus fine noise: compresses like a photo
    # and renders in about a millisecond
    coarse = rng.integers(0, 256, (max(2, h // 64), max(2, w // 64), 3), dtype=np.uint8)  # (h/64, w/64, 3)
    smooth = np.asarray(Image.fromarray(coarse, "RGB").resize((w, h), Image.Resampling.BICUBIC), np.int16)  # (h, w, 3)
    noisy = smooth + rng.integers(-6, 7, (h, w, 1), dtype=np.int16)  # (h, w, 3)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def _write_image(image: Image.Image, path: Path, fmt: str, options: dict[str, Any]) -> None:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    path.write_bytes(buf.getvalue())


def make_sample_dataset(folder: str | Path, n: int = 300, seed: int = 0) -> dict[str, Any]:
    """Write ``n`` images (plus a few broken files) under ``folder``; returns what was written.

    The summary has ``images`` (usable), ``broken``, ``captioned``, ``rotated`` (EXIF 6/8),
    ``formats`` (count per format) and ``folder``. Same ``seed``, same files.
    """
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    formats = {"JPEG": 0, "PNG": 0, "WEBP": 0}
    captioned = rotated = 0
    # every random draw is made here, in order (same seed, same files); the encoding (Pillow lets go of the GIL
    # while it compresses) and the writing run on threads, a bounded number of images ahead
    encoder = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    pending: collections.deque[Future] = collections.deque()
    for i in range(n):
        w, h = SHAPES[i % len(SHAPES)]
        fmt = ("JPEG", "JPEG", "JPEG", "PNG", "WEBP")[int(rng.integers(5))]
        ext = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[fmt]
        path = root / f"part{i % 4}" / f"img_{i:05d}.{ext}"
        path.parent.mkdir(exist_ok=True)
        kwargs: dict[str, Any] = {"quality": 85} if fmt != "PNG" else {}
        if fmt != "PNG" and rng.random() < 0.1:  # a camera held sideways: stored landscape, shown portrait
            exif = Image.Exif()
            exif[0x0112] = int(rng.choice([6, 8]))
            kwargs["exif"] = exif.tobytes()
            rotated += 1
        pending.append(encoder.submit(_write_image, _picture(rng, w, h), path, fmt, kwargs))
        if len(pending) > 16:
            pending.popleft().result()
        formats[fmt] += 1
        if rng.random() < 0.85:
            subject, style = SUBJECTS[int(rng.integers(len(SUBJECTS)))], STYLES[int(rng.integers(len(STYLES)))]
            path.with_suffix(".txt").write_text(f"{style} of {subject}, number {i}\n")
            captioned += 1
    for done in pending:
        done.result()
    encoder.shutdown()
    broken_dir = root / "broken"
    broken_dir.mkdir(exist_ok=True)
    good = next(iter(sorted((root / "part0").glob("*.jpg"))), None)
    head = good.read_bytes()[:200] if good else b"\xff\xd8\xff\xe0"
    broken = {"truncated.jpg": head, "empty.png": b"", "error_page.jpg": b"<!DOCTYPE html><html>403 Forbidden</html>"}
    for name, data in broken.items():
        (broken_dir / name).write_bytes(data)
    return {
        "folder": str(root), "images": n, "broken": len(broken), "captioned": captioned,
        "rotated": rotated, "formats": formats,
    }  # fmt: skip


def add_curation_cases(folder: str | Path, duplicates: int = 6, blanks: int = 3) -> dict[str, int]:
    """Add to a :func:`make_sample_dataset` folder, under ``curation/``: ``duplicates`` copies of its JPEGs
    (every other one byte for byte, the rest saved again at JPEG quality 70: equal pixels up to compression,
    a pHash within a few bits), each with its original's caption, and ``blanks`` flat grey frames (a
    contrast of 0), captioned. Returns the counts (``exact``, ``resaved``, ``blanks``)."""
    root = Path(folder)
    originals = sorted(root.glob("part*/*.jpg"))[:duplicates]
    if len(originals) < duplicates:
        raise ValueError(f"{root} has {len(originals)} JPEGs to copy, {duplicates} duplicates asked")
    out = root / "curation"
    out.mkdir(exist_ok=True)
    exact = resaved = 0
    for j, original in enumerate(originals):
        if j % 2 == 0:
            copy = out / f"copy_{j:02d}.jpg"
            copy.write_bytes(original.read_bytes())
            exact += 1
        else:
            copy = out / f"resaved_{j:02d}.jpg"
            with Image.open(original) as im:
                im.save(copy, "JPEG", quality=70, exif=im.info.get("exif", b""))
            resaved += 1
        caption = original.with_suffix(".txt")
        if caption.exists():
            copy.with_suffix(".txt").write_text(caption.read_text())
    for j in range(blanks):
        level = 96 + 32 * j  # three greys: flat frames look alike to a pHash, whatever their level
        Image.new("RGB", (512, 512), (level, level, level)).save(out / f"blank_{j:02d}.png")
        (out / f"blank_{j:02d}.txt").write_text("a blank frame\n")
    return {"exact": exact, "resaved": resaved, "blanks": blanks}


def make_references(folder: str | Path) -> int:
    """For each image under ``folder`` (a :func:`make_sample_dataset` folder), a reference image for an edit model
    under ``folder/_references`` at the same relative path and display size: the image in grey, as an editing
    pair "colour it" would have it. Same format as the image (by its extension); files that do not decode get
    none. Returns how many were written."""
    from PIL import ImageOps

    root = Path(folder)
    formats = {".jpg": "JPEG", ".png": "PNG", ".webp": "WEBP"}
    written = 0
    for path in sorted(p for p in root.rglob("*") if p.suffix in formats and REFERENCES not in p.parts):
        try:
            with Image.open(path) as img:
                grey = ImageOps.exif_transpose(img).convert("L").convert("RGB")  # display orientation, no EXIF
        except OSError:  # the broken files: their targets are scan errors anyway
            continue
        target = root / REFERENCES / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        grey.save(target, formats[path.suffix])
        written += 1
    return written


# (width, height, frames) of the demo's clips: square, landscape, portrait; 9-40 frames (at 24 fps: 0.4-1.7 s)
CLIP_SHAPES = ((128, 128, 17), (160, 96, 40), (96, 160, 21), (128, 128, 9), (160, 96, 26), (96, 160, 36))


def _write_clip(path: Path, rng: np.random.Generator, w: int, h: int, frames: int, *, codec: str,
                rotate: int | None = None) -> None:  # fmt: skip
    _write_frames(path, _panning(rng, w, h, frames), codec=codec, rotate=rotate)


def _panning(rng: np.random.Generator, w: int, h: int, frames: int) -> list[np.ndarray]:
    """``frames`` (h, w, 3) uint8 frames panning across a random picture twice as wide."""
    field = np.asarray(_picture(rng, 2 * w, h), np.uint8)  # (h, 2w, 3)
    return [np.ascontiguousarray(field[:, (i * w) // max(frames, 1):][:, :w]) for i in range(frames)]


def _write_frames(path: Path, frames: list[np.ndarray], *, codec: str, rotate: int | None = None) -> None:
    """Encode RGB ``frames`` (h, w, 3) to ``path`` at 24 frames/s with PyAV."""
    import av

    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=24)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if rotate is not None:
            stream.set_display_rotation(rotate)
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


CUT_AT = 20  # the planted cut clip: two panning shots of this many frames each


def add_video_cases(folder: str | Path, seed: int = 0) -> dict[str, Any]:
    """Plant what video curation finds under ``folder``/cases: ``cut.mp4``, two panning shots of :data:`CUT_AT`
    frames with a hard cut between them (a clip at fixed strides would span it), and ``still.mp4``, 17 frames of one
    picture (no motion); each with a caption sidecar. Returns ``{"cut": CUT_AT, "still": 1}``."""
    import av

    root = Path(folder) / "cases"
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    h264 = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    _write_frames(root / "cut.mp4", _panning(rng, 128, 128, CUT_AT) + _panning(rng, 128, 128, CUT_AT), codec=h264)
    (root / "cut.txt").write_text("a street, then a beach\n")
    _write_frames(root / "still.mp4", [np.asarray(_picture(rng, 128, 128), np.uint8)] * 17, codec=h264)
    (root / "still.txt").write_text("a painting on a wall, nothing moves\n")
    return {"cut": CUT_AT, "still": 1}


def make_sample_clips(folder: str | Path, n: int = 24, seed: int = 0) -> dict[str, Any]:
    """Write ``n`` short clips, 3 still images, a 5-frame clip (too short) and a broken ``.mp4`` under
    ``folder``; returns what was written (``clips``, ``images``, ``short``, ``broken``, ``rotated``,
    ``captioned``, ``codecs``, ``folder``). Same ``seed``, same files. Raises ImportError without PyAV.
    """
    import av

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h264 = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    vp9 = "libvpx-vp9" if "libvpx-vp9" in av.codecs_available else None
    codecs: dict[str, int] = {}
    captioned = rotated = 0
    for i in range(n):
        w, h, frames = CLIP_SHAPES[i % len(CLIP_SHAPES)]
        codec, ext = (vp9, "webm") if vp9 and i % 4 == 3 else (h264, "mp4")
        rotate = 90 if i == 5 else None  # a phone clip: stored landscape, shown portrait
        path = root / f"clips{i % 2}" / f"clip_{i:04d}.{ext}"
        path.parent.mkdir(exist_ok=True)
        _write_clip(path, rng, w, h, frames, codec=codec, rotate=rotate)
        codecs[codec] = codecs.get(codec, 0) + 1
        rotated += rotate is not None
        if rng.random() < 0.9:
            subject, style = SUBJECTS[int(rng.integers(len(SUBJECTS)))], STYLES[int(rng.integers(len(STYLES)))]
            path.with_suffix(".txt").write_text(f"{style} of {subject} moving, clip {i}\n")
            captioned += 1
    for i in range(3):  # stills join a video manifest as 1-frame samples
        w, h, _ = CLIP_SHAPES[i]
        _picture(rng, w, h).save(root / f"still_{i}.jpg", quality=90)
        (root / f"still_{i}.txt").write_text(f"photo of {SUBJECTS[i]}\n")
    _write_clip(root / "short.mp4", rng, 128, 128, 5, codec=h264)  # fewer frames than any demo bucket
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 40)  # a header and nothing
    return {"folder": str(root), "clips": n, "images": 3, "short": 1, "broken": 1, "rotated": rotated,
            "captioned": captioned, "codecs": codecs}  # fmt: skip
