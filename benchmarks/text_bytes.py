"""Bytes per caption and per sample of each model family's cache, from the real architectures' sizes.

    python benchmarks/text_bytes.py [--pixart-tokens 40]

No weights are downloaded: the sizes are the published configs' (CLIP ViT-L/14 text: 768 wide,
projection 768; OpenCLIP bigG text: 1280, projection 1280; T5-v1.1-XXL: 4096) and each family's
default sequence lengths, put through the same :class:`manifests.cache.TextLayout` the embed job
writes. Side by side, in one run:

1. raw bf16 bytes of the text record bucketeer stores (the parts: padded where the model attends
   to the pads, the real tokens where it takes a mask), and with ``--max-text-tokens`` lowered;
2. the alternative a trainer's own cache holds: ``encode_prompt``'s joined output (SD3: the CLIPs
   zero-padded to 4096 wide; PixArt: padded to 120 with its mask) saved as fp32 ``torch.save``;
3. what gzip does to a record of that shape filled with Normal(0, 1) bf16 values (a stand-in for
   real activations, whose compressibility needs the real weights: the embed summary reports it);
4. latent bytes per sample at 1024x1024 (posterior mean; ``--latents posterior`` doubles it).

Then Flux 2, Flux 2 Klein and Chroma at real size (:mod:`sizes_flux2`: parameter counts on the meta device).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from manifests.cache import TextLayout  # noqa: E402
from manifests.cache.records import TextRecord, encode_text  # noqa: E402

CLIP_L, CLIP_G, T5 = 768, 1280, 4096


def layouts(pixart_tokens: int) -> list[tuple[str, TextLayout, int, int]]:
    """``(name, layout, real tokens of a masked caption, latent channels)`` of each family at its defaults."""
    def sd3(t5: int) -> TextLayout:
        return TextLayout("sd3", "sequence", False, (77, 77, t5), (CLIP_L, CLIP_G, T5), CLIP_L + CLIP_G)

    def flux(t5: int) -> TextLayout:
        return TextLayout("flux", "features", False, (t5,), (T5,), CLIP_L)

    return [
        ("sdxl", TextLayout("sdxl", "features", False, (77, 77), (CLIP_L, CLIP_G), CLIP_G), 0, 4),
        ("sd3 (T5 256)", sd3(256), 0, 16),
        ("sd3 --max-text-tokens 128", sd3(128), 0, 16),
        ("flux (T5 512)", flux(512), 0, 16),
        ("flux --max-text-tokens 256", flux(256), 0, 16),
        (f"pixart-alpha (120; {pixart_tokens}-token caption)", TextLayout("pixart", "features", True, (120,), (T5,)),
         pixart_tokens, 4),
        (f"pixart-sigma (300; {pixart_tokens}-token caption)", TextLayout("pixart", "features", True, (300,), (T5,)),
         pixart_tokens, 4),
    ]  # fmt: skip


def record(layout: TextLayout, tokens: int, rng: np.random.Generator) -> TextRecord:
    """A bf16 text record of ``layout``'s shapes (masked: ``tokens`` rows) with Normal(0, 1) values."""
    def bf16(shape) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    rows = [tokens if layout.masked else n for n in layout.lengths]
    parts = tuple(bf16((n, d)) for n, d in zip(rows, layout.widths))
    return TextRecord(0, parts, None if layout.pooled_dim is None else bf16((layout.pooled_dim,)), "BF16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pixart-tokens", type=int, default=40, help="real T5 tokens of a typical PixArt caption")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'family':44s} {'bucketeer bf16':>15s} {'gzip(noise)':>12s} {'encode_prompt fp32':>19s} {'ratio':>6s} "
          f"{'latent/sample':>14s}")  # fmt: skip
    for name, layout, tokens, channels in layouts(args.pixart_tokens):
        stored = sum((tokens if layout.masked else n) * d for n, d in zip(layout.lengths, layout.widths))
        stored = 2 * (stored + (layout.pooled_dim or 0))
        gz = len(encode_text(record(layout, tokens, rng)))
        joined = 4 * (layout.length * layout.width + (layout.pooled_dim or 0)) + (4 * layout.length
                                                                                  if layout.masked else 0)
        latent = 2 * channels * 128 * 128
        print(f"{name:44s} {stored:>15,d} {gz:>12,d} {joined:>19,d} {joined / stored:>5.1f}x {latent:>14,d}")
    print()
    from sizes_flux2 import print_sizes  # Flux 2, Flux 2 Klein, Chroma: real sizes on the meta device

    print_sizes(rng)


if __name__ == "__main__":
    main()
