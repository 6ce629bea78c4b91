"""Cache bytes per sample with loss masks and without.

    python benchmarks/cache_bytes.py [--samples 32] [--buckets 512,1024] [--rounds 3]

A sample record as embed writes it (``planar`` layout): latent 4 x h x w bf16 (SDXL's VAE, h = side / 8) and
the caption's text inline (CLIP-L + CLIP-G 77 tokens, pooled 1280; the common case of a caption of its own),
with and without ``embed --flip`` (2 variants). Latent and text values are Normal(0, 1) bf16 (a stand-in for
real activations, as in ``benchmarks/records.py``). Masks are drawn at the image's pixels and brought to the
latent grid exactly as embed does (:func:`pipeline.embed.masks.to_latent_grid`: area average, uint8):

- ``object``: a filled ellipse covering ~30 % of the image (a segmentation mask: 0/255 with a soft rim);
- ``feathered``: the same with a 32-pixel linear fall-off (an alpha matte);
- ``noise``: every latent pixel its own random value (the worst case: nothing to compress).

Side by side, the alternative a user would otherwise keep: the mask as a PNG file beside the image at full
resolution (``<stem>.mask.png``, Pillow's default PNG settings), which the trainer would read and downsample
itself. Each sample's record is encoded twice, with its mask and without (the same latents and text), so
the mask's bytes are the exact difference. Bytes only: nothing here is timed, so every one of ``--rounds`` rounds
gives the same bytes; they are saved to ``benchmarks/results/cache_bytes.json`` (:mod:`benchmarks.results`).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from dataclasses import replace

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.results import Run  # noqa: E402
from manifests.cache.records import SampleRecord, TextRecord, encode_sample  # noqa: E402
from pipeline.embed.masks import to_latent_grid  # noqa: E402

F = 8  # the VAE's downsampling factor


def bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return ((rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32) >> 16).astype(np.uint16)


def pixel_mask(kind: str, side: int, rng: np.random.Generator) -> np.ndarray:
    """A ``(side, side)`` uint8 mask at the image's pixels (``noise`` is drawn at the latent grid instead)."""
    y, x = np.mgrid[0:side, 0:side].astype(np.float32)
    cy, cx = side * rng.uniform(0.4, 0.6, 2)
    ry, rx = side * rng.uniform(0.25, 0.35, 2)
    d = np.sqrt(((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2)  # 1 on the ellipse's rim
    if kind == "object":
        return np.where(d <= 1.0, 255, 0).astype(np.uint8)
    assert kind == "feathered", kind
    return np.clip((1.0 - d) * min(ry, rx) / 32.0 * 255.0 + 255.0 * 0.5, 0, 255).astype(np.uint8)


def make_record(i: int, side: int, flips: int, mask: str | None, rng: np.random.Generator):
    """One sample's record bytes with its mask and without it (the same latents and text), and (for a mask
    drawn at the pixels) its full-resolution PNG's bytes."""
    h = w = side // F
    text = TextRecord(caption_key=i, tokens=(bf16(rng, (77, 768)), bf16(rng, (77, 1280))),
                      pooled=bf16(rng, (1280,)), dtype="BF16")  # fmt: skip
    latents = bf16(rng, (flips, 4, h, w), 4.0)
    grid, png = None, b""
    if mask == "noise":
        grid = rng.integers(0, 256, (flips, h, w), dtype=np.uint8)
    elif mask is not None:
        pixels = pixel_mask(mask, side, rng)
        variants = np.stack([pixels, pixels[:, ::-1]])[:flips]  # (V, side, side): the flip, as embed cuts it
        grid = to_latent_grid(variants, (h, w))
        buf = io.BytesIO()
        Image.fromarray(pixels, "L").save(buf, "PNG")
        png = buf.getvalue()
    several = flips > 1
    plain = SampleRecord(
        sample_id=i, bucket=f"{side}x{side}", latent=latents[0], dtype="BF16", original_size=(side, side),
        resized_size=(side, side), crop_top_left=(0, 0), target_size=(side, side), caption_key=i, text=text,
        variant_latents=latents[1:] if several else None,
        variant_crops=np.zeros((flips, 2), np.int32) if several else None,
        variant_flips=np.arange(flips, dtype=np.uint8) if several else None,
    )  # fmt: skip
    masked = replace(plain, mask=None if grid is None else grid[0],
                     variant_masks=grid[1:] if grid is not None and several else None)  # fmt: skip
    return encode_sample(masked, inline_text=True), encode_sample(plain, inline_text=True), png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32, help="samples per row (random masks and latents)")
    parser.add_argument("--buckets", default="512,1024", help="square bucket sides in pixels")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (every one computes the same bytes)")
    args = parser.parse_args()
    run = Run("cache_bytes", "python benchmarks/cache_bytes.py" + "".join(f" {a}" for a in sys.argv[1:]))
    for _ in range(args.rounds):
        with run.round():
            one_round(run, args.samples, [int(s) for s in args.buckets.split(",")])
    run.save()


def one_round(run: Run, samples: int, sides: list[int]) -> None:
    """Every (bucket, variants, mask) row once: printed and added to ``run``."""
    print("| bucket | variants | mask | record B/sample | mask B/sample | overhead | the mask as a PNG beside the "
          "image, full resolution |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for side in sides:
        for flips in (1, 2):
            for mask in ("object", "feathered", "noise"):
                rng = np.random.default_rng(0)
                made = [make_record(i, side, flips, mask, rng) for i in range(samples)]
                size, base = (float(np.mean([len(m[k]) for m in made])) for k in (0, 1))
                png = f"{np.mean([len(m[2]) for m in made]):,.0f}" if mask != "noise" else "-"
                print(f"| {side}x{side} | {flips} | {mask} | {size:,.0f} | {size - base:,.0f} | "
                      f"{100 * (size - base) / base:.2f} % | {png} |")
                row = f"{side}x{side}, {flips} variant{'s' if flips > 1 else ''}, {mask}"
                run.add(f"{row}: record per sample", size, "B")
                run.add(f"{row}: mask per sample", size - base, "B")
                run.add(f"{row}: overhead", 100 * (size - base) / base, "%")
                if mask != "noise":
                    png_bytes = float(np.mean([len(m[2]) for m in made]))
                    run.add(f"{row}: the mask as a PNG beside the image", png_bytes, "B")


if __name__ == "__main__":
    main()
