"""Cache record layouts side by side: decode CPU per sample and bytes per sample, for SDXL-512 samples.

    python benchmarks/records.py [--samples 100,300] [--rounds 3]

A sample as the trainer reads it: latent 4x64x64 bf16, text 77x2048 bf16 (CLIP-L + CLIP-G, padded) and a
pooled 1280 bf16, its caption its own (most datasets). Values are Normal(0, 1) bf16 (latents x 4): a
stand-in for real activations, whose exponent bytes are as skewed and mantissa bytes as random. Layouts:

- ``plain zlib`` / ``plain isal``: what bucketeer wrote before (``gzip(safetensors)``; zlib level 6, or
  ISA-L level 2 when installed), a sample record and its text record (two records, two reads);
- ``planar zlib`` / ``planar isal``: byte planes (:mod:`manifests.cache.codec`), the text inline in the
  sample's record (one record, one read), inflated by the standard library or by ISA-L;
- ``raw``: the same safetensors bytes uncompressed, parsed the same way: the floor any decoder sits on.

Decode = inflate + parse + reassemble the planes (what ``CacheReader.read`` does per sample besides the
read), in CPU seconds of this process (``time.process_time``), as a **marginal** rate between two sample
counts so that start-up and warm-up drop out. A second table compares codings of the high byte plane
(why Huffman-only): bytes, encode and decode (ISA-L) per sample. Each of ``--rounds`` rounds measures every
layout and coding once; the medians are published from ``benchmarks/results/records.json``
(:mod:`benchmarks.results`).
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import time
import zlib
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.results import Run  # noqa: E402
from manifests.cache import codec  # noqa: E402
from manifests.cache.records import SampleRecord, TextRecord, encode_sample, encode_text  # noqa: E402

try:
    from isal import igzip
except ImportError:  # pragma: no cover
    igzip = None


def bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return ((rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32) >> 16).astype(np.uint16)


def make_sample(i: int, rng: np.random.Generator) -> SampleRecord:
    text = TextRecord(caption_key=i, tokens=(bf16(rng, (77, 768)), bf16(rng, (77, 1280))),
                      pooled=bf16(rng, (1280,)), dtype="BF16")  # fmt: skip
    return SampleRecord(sample_id=i, bucket="512x512", latent=bf16(rng, (4, 64, 64), 4.0), dtype="BF16",
                        original_size=(512, 512), resized_size=(512, 512), crop_top_left=(0, 0),
                        target_size=(512, 512), caption_key=i, text=text)  # fmt: skip


def _plain(data: bytes, compress: Callable[[bytes], bytes]) -> bytes:
    return compress(gzip.decompress(data))


def layouts(samples: list[SampleRecord]) -> dict[str, tuple[list[list[bytes]], Callable[[bytes], bytes]]]:
    """name -> (per sample, the records it reads; the inflate that reads them)."""
    plain = [[encode_sample(s, layout="plain"), encode_text(s.text, layout="plain")] for s in samples]
    out = {"plain zlib": ([[_plain(r, lambda d: gzip.compress(d, 6, mtime=0)) for r in rs] for rs in plain],
                          gzip.decompress)}  # fmt: skip
    planar = [[encode_sample(s, inline_text=True)] for s in samples]
    if igzip is not None:
        out["plain isal"] = ([[_plain(r, lambda d: igzip.compress(d, 2, mtime=0)) for r in rs] for rs in plain],
                             igzip.decompress)  # fmt: skip
    out["planar zlib"] = (planar, gzip.decompress)
    if igzip is not None:
        out["planar isal"] = (planar, igzip.decompress)
    out["raw"] = ([[gzip.decompress(r) for r in rs] for rs in planar_plain(samples)], lambda d: d)
    return out


def planar_plain(samples: list[SampleRecord]) -> list[list[bytes]]:
    """The one-record samples with their text inline, as plain gzip(safetensors): uncompressed, the floor."""
    return [[encode_sample(s, inline_text=True, layout="plain")] for s in samples]


def decode_seconds(records: list[list[bytes]], inflate: Callable[[bytes], bytes], n: int) -> float:
    start = time.process_time()
    for rs in records[:n]:
        for r in rs:
            codec.decode_tensors(inflate(r))
    return time.process_time() - start


def marginal_us(records: list[list[bytes]], inflate: Callable[[bytes], bytes], small: int, large: int,
                repeat: int = 1) -> float:  # fmt: skip
    """Median over ``repeat`` of (CPU seconds for ``large`` samples - for ``small``) / (large - small), in µs."""
    runs = [(decode_seconds(records, inflate, large) - decode_seconds(records, inflate, small)) / (large - small)
            for _ in range(repeat)]  # fmt: skip
    return float(np.median(runs)) * 1e6


def high_plane_codings(run: Run, samples: list[SampleRecord], n: int) -> None:
    """The high byte plane of each sample through each candidate coding: bytes, encode and decode µs."""
    planes = []
    for s in samples[:n]:
        head, _ = codec.encode_planar({"latent": (s.latent, "BF16"), "t0": (s.text.tokens[0], "BF16"),
                                       "t1": (s.text.tokens[1], "BF16"), "p": (s.text.pooled, "BF16")}, {})
        planes.append(head)

    def z(level: int, strategy: int = zlib.Z_DEFAULT_STRATEGY) -> Callable[[bytes], bytes]:
        def compress(data: bytes) -> bytes:
            c = zlib.compressobj(level, zlib.DEFLATED, 31, 9, strategy)
            return c.compress(data) + c.flush()
        return compress

    codings = {"zlib 1": z(1), "zlib 6": z(6), "zlib 9": z(9), "zlib huffman-only (chosen)": z(6, zlib.Z_HUFFMAN_ONLY),
               "zlib rle": z(6, zlib.Z_RLE)}  # fmt: skip
    if igzip is not None:
        codings.update({f"isal {level}": (lambda lv: lambda d: igzip.compress(d, lv, mtime=0))(level)
                        for level in (1, 2, 3)})  # fmt: skip
    inflate = igzip.decompress if igzip is not None else gzip.decompress
    print(f"\nhigh byte plane (+ header), {n} samples: {'coding':28s} {'bytes/sample':>13s} {'encode µs':>10s} "
          f"{'decode µs':>10s}")  # fmt: skip
    for name, compress in codings.items():
        start = time.process_time()
        blobs = [compress(p) for p in planes]
        encode = (time.process_time() - start) / n * 1e6
        start = time.process_time()
        for b in blobs:
            inflate(b)
        decode = (time.process_time() - start) / n * 1e6
        size = float(np.mean([len(b) for b in blobs]))
        print(f"{'':44s}{name:28s} {size:>13,.0f} {encode:>10.0f} {decode:>10.0f}")
        run.add(f"high plane, {name}: bytes per sample", size, "B")
        run.add(f"high plane, {name}: encode", encode, "µs")
        run.add(f"high plane, {name}: decode", decode, "µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default="100,300", help="the two sample counts of the marginal rate")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every layout in each; medians published")
    args = parser.parse_args()
    small, large = (int(x) for x in args.samples.split(","))
    rng = np.random.default_rng(0)
    samples = [make_sample(i, rng) for i in range(large)]
    raw = len(codec.encode_tensors({"l": (samples[0].latent, "BF16"), "t0": (samples[0].text.tokens[0], "BF16"),
                                    "t1": (samples[0].text.tokens[1], "BF16"), "p": (samples[0].text.pooled, "BF16")},
                                   {}))  # fmt: skip
    print(f"SDXL-512 sample: {raw:,d} raw bytes; decode = inflate + parse + planes, marginal {small} -> {large} "
          f"samples, CPU µs per sample on one thread (load {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"{'layout':14s} {'reads/sample':>12s} {'bytes/sample':>13s} {'decode µs/sample':>17s} "
          f"{'vs plain zlib':>14s}")  # fmt: skip
    built = layouts(samples)
    run = Run("records", "python benchmarks/records.py" + "".join(f" {a}" for a in sys.argv[1:]), tools=["isal"])
    for _ in range(args.rounds):
        with run.round():
            base = None
            for name, (records, inflate) in built.items():
                us = marginal_us(records, inflate, small, large)
                base = base or us
                size = float(np.mean([sum(len(r) for r in rs) for rs in records]))
                print(f"{name:14s} {len(records[0]):>12d} {size:>13,.0f} {us:>17.0f} {base / us:>13.1f}x")
                run.add(f"{name}: reads per sample", len(records[0]))
                run.add(f"{name}: bytes per sample", size, "B")
                run.add(f"{name}: decode per sample", us, "µs")
                run.add(f"{name}: decode speed vs plain zlib", base / us, "x")
            high_plane_codings(run, samples, min(large, 100))
    run.save()


if __name__ == "__main__":
    main()
