"""WebDataset tar shards written with ``tarfile``, with the ground truth a scan must find.

Every usable image's expected ``(width, height)`` is Pillow's full decode after
``ImageOps.exif_transpose`` (:func:`tests.corpus.truth`). Images are small noise JPEGs of ~50-80 KB,
larger than the scan's 8 KiB window, so that reading a shard whole shows in the bytes read.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from tests.corpus import truth

W_H = ((320, 240), (240, 320), (400, 200), (256, 256))


def photo(seed: int, fmt: str = "JPEG", orientation: int = 1, size: tuple[int, int] | None = None) -> bytes:
    """A noise image of ~50-80 KB (JPEG) in one of four shapes."""
    rng = np.random.default_rng(seed)
    w, h = size or W_H[seed % len(W_H)]
    img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    kwargs = {"quality": 90} if fmt == "JPEG" else {}
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def camera_jpeg(seed: int) -> bytes:
    """A JPEG held sideways (orientation 6) behind 40 KB of EXIF maker notes and a 60 KB ICC profile."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (90, 150, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    exif.get_ifd(0x8769)[0x927C] = rng.bytes(40_000)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, exif=exif.tobytes(), icc_profile=rng.bytes(60_000))
    return buf.getvalue()


def tar_bytes(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar archive of ``(name, data)`` members in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass
class ShardSet:
    root: Path
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # <shard>/<member> -> display size
    captions: dict[str, str | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # filename (member or shard) -> error kind
    shard_bytes: int = 0


def good_shard(shards: ShardSet, name: str, first: int, n: int, fmt: int = tarfile.PAX_FORMAT) -> None:
    """``n`` samples ``key.jpg`` + ``key.txt`` (every 3rd with ``key.json`` instead) in shard ``name``."""
    members = []
    for i in range(first, first + n):
        key = f"sample_{i:05d}"
        data = photo(i, orientation=6 if i % 7 == 0 else 1)
        members.append((f"{key}.jpg", data))
        caption = f"a photo number {i}"
        if i % 3 == 0:
            members.append((f"{key}.json", json.dumps({"caption": caption, "width": 1}).encode()))
        else:
            members.append((f"{key}.txt", caption.encode()))
        shards.sizes[f"{name}/{key}.jpg"] = truth(data)
        shards.captions[f"{name}/{key}.jpg"] = caption
    put(shards, name, tar_bytes(members, fmt))


def put(shards: ShardSet, name: str, data: bytes) -> None:
    path = shards.root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    shards.shard_bytes += len(data)


def awkward_shards(root: Path) -> ShardSet:
    """Good shards plus every case the scan must report: see the comments."""
    s = ShardSet(root)
    good_shard(s, "good-000.tar", 0, 8)
    good_shard(s, "sub/good-001.tar", 8, 8, fmt=tarfile.GNU_FORMAT)
    long_dir = "/".join(["a-rather-long-folder-name"] * 5)  # > 100 characters: GNU ././@LongLink / pax path
    cases = [
        (f"{long_dir}/deep.png", photo(100, "PNG"), "deep", b"from a .caption member", ".caption"),
        ("orient.webp", photo(101, "WEBP", orientation=8), "orient", b"sideways", ".txt"),
        ("plain.jpg", photo(102), None, None, None),  # no caption: a sample with a null caption
        ("camera.jpg", camera_jpeg(104), "camera", b"40 KB of EXIF, 60 KB of ICC", ".txt"),  # skipped bodies
    ]
    members: list[tuple[str, bytes]] = []
    for member, data, key, caption, ext in cases:
        members.append((member, data))
        s.sizes[f"mixed.tar/{member}"] = truth(data)
        s.captions[f"mixed.tar/{member}"] = caption.decode() if caption else None
        if caption:
            members.append((member.rsplit(".", 1)[0] + ext, caption))
    members.append(("plain.cls", b"7"))  # not an image, not a caption: counted by extension
    members.append(("orphan.txt", b"a caption without an image"))
    members += [("twice.jpg", photo(103)), ("twice.png", photo(103, "PNG")), ("twice.txt", b"two images")]
    s.errors["mixed.tar/twice.jpg"] = s.errors["mixed.tar/twice.png"] = "duplicate_key"
    members.append(("html.jpg", b"<html>not an image</html>"))
    s.errors["mixed.tar/html.jpg"] = "not_an_image"
    put(s, "mixed.tar", tar_bytes(members, tarfile.GNU_FORMAT))

    # cut in the middle of its last image: that image is truncated, and the shard is reported
    whole = tar_bytes([("a.jpg", photo(200)), ("a.txt", b"first"), ("b.jpg", photo(201)), ("b.txt", b"second")])
    b_at = whole.index(b"b.jpg")  # its header
    put(s, "cut.tar", whole[: b_at + 512 + 3000])
    s.sizes["cut.tar/a.jpg"], s.captions["cut.tar/a.jpg"] = truth(photo(200)), "first"
    s.errors["cut.tar/b.jpg"] = "truncated"
    s.errors["cut.tar"] = "corrupt_container"

    # the first member's header lies about its size: the walk lands inside its data and stops there
    liar = bytearray(tar_bytes([("a.jpg", photo(300)), ("a.txt", b"liar"), ("b.jpg", photo(301))]))
    size = len(photo(300))
    liar[124:136] = f"{size - 2000:011o}\0".encode()
    liar[148:156] = b"        "
    liar[148:156] = f"{sum(liar[:512]):06o}\0 ".encode()
    put(s, "liar.tar", bytes(liar))
    s.errors["liar.tar"] = "corrupt_container"
    s.errors["liar.tar/a.jpg"] = "corrupt_container"  # the member whose size misleads the walk
    return s
