"""Bytes per caption and per sample of each model family's cache, from the real architectures' sizes.

    python benchmarks/text_bytes.py [--pixart-tokens 40] [--rounds 3]

Each table is saved through :mod:`benchmarks.results` (``--rounds`` rounds; the figures are computed, so every
round gives the same bytes): ``text_bytes.json`` (the families at their default lengths), ``text_bytes-qwen.json``
(Qwen-Image, Z-Image, Qwen-Image-Edit), ``text_bytes-flux2.json`` (Flux 2, Flux 2 Klein, Chroma) and
``text_bytes-recent.json`` (ERNIE-Image, Qwen-Image 2.1, Krea 2, LongCat-Image, Anima).

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

Qwen-Image and Z-Image (:func:`qwen_zimage`): their text encoders, VAEs and transformers are built from the
published configs (:mod:`benchmarks.real_configs`) on the meta device (no weight is allocated) to count
parameters, and a caption's record is its real rows (Qwen-Image: the caption's tokens + the template's 5
closing ones, 3584 wide; Z-Image: + the chat template's 8, 2560 wide) against ``encode_prompt``'s fp32 output
for that caption alone and padded to the pipeline's length (what a fixed-shape cache stores).

Then Flux 2, Flux 2 Klein and Chroma at real size (:mod:`sizes_flux2`: parameter counts on the meta device), and
the families of mid-2026 (:mod:`benchmarks.sizes_recent`: the same, a ``--qwen-tokens`` caption).

Qwen-Image-Edit (:func:`qwen_image_edit`): a sample's text record is its rows of (instruction, reference): the
reference's image tokens are counted by Qwen2.5-VL's own image processor (the published config: patch 14, merge 2,
``max_pixels`` 12845056) on the reference as the pipeline resizes it (``calculate_dimensions(1024 * 1024, ...)``),
plus ``<|vision_start|>``, ``<|vision_end|>``, the instruction's tokens and the template's 5 closing ones, 3584 wide;
against ``encode_prompt``'s fp32 output for it, and with the reference latent beside the target's.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.results import Run  # noqa: E402
from benchmarks.real_configs import FLUX1_VAE, QWEN3_4B, QWEN_IMAGE, QWEN_VL_7B, Z_IMAGE  # noqa: E402
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
    parser.add_argument("--qwen-tokens", type=int, default=40,
                        help="tokens of a typical caption (Qwen-Image, Z-Image, the families of mid-2026)")
    parser.add_argument("--instruction-tokens", type=int, default=20, help="tokens of a typical edit instruction")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (every one computes the same bytes)")
    args = parser.parse_args()
    command = "python benchmarks/text_bytes.py" + "".join(f" {a}" for a in sys.argv[1:])
    runs = [Run(name, command, tools=["transformers", "diffusers"])
            for name in ("text_bytes", "text_bytes-qwen", "text_bytes-flux2", "text_bytes-recent")]
    from sizes_flux2 import print_sizes  # Flux 2, Flux 2 Klein, Chroma: real sizes on the meta device

    from benchmarks.sizes_recent import recent_sizes  # the families of mid-2026, the same way

    for _ in range(args.rounds):
        with runs[0].round():
            families(runs[0], args.pixart_tokens)
        with runs[1].round():
            qwen_zimage(runs[1], args.qwen_tokens)
            qwen_image_edit(runs[1], args.instruction_tokens)
        with runs[2].round():
            print()
            print_sizes(np.random.default_rng(0), runs[2])
        with runs[3].round():
            recent_sizes(args.qwen_tokens, np.random.default_rng(0), runs[3])
    for run in runs:
        run.save()


def families(run: Run, pixart_tokens: int) -> None:
    """Bytes per caption of each family at its default lengths, against ``encode_prompt``'s fp32 output."""
    rng = np.random.default_rng(0)  # the same noise every round: the gzip figure is a byte count
    print(f"{'family':44s} {'bucketeer bf16':>15s} {'gzip(noise)':>12s} {'encode_prompt fp32':>19s} {'ratio':>6s} "
          f"{'latent/sample':>14s}")  # fmt: skip
    for name, layout, tokens, channels in layouts(pixart_tokens):
        stored = sum((tokens if layout.masked else n) * d for n, d in zip(layout.lengths, layout.widths))
        stored = 2 * (stored + (layout.pooled_dim or 0))
        gz = len(encode_text(record(layout, tokens, rng)))
        joined = 4 * (layout.length * layout.width + (layout.pooled_dim or 0)) + (4 * layout.length
                                                                                  if layout.masked else 0)
        latent = 2 * channels * 128 * 128
        print(f"{name:44s} {stored:>15,d} {gz:>12,d} {joined:>19,d} {joined / stored:>5.1f}x {latent:>14,d}")
        run.add(f"{name}: bucketeer record (bf16, raw)", stored, "B")
        run.add(f"{name}: gzip(noise)", gz, "B")
        run.add(f"{name}: encode_prompt output, fp32", joined, "B")
        run.add(f"{name}: encode_prompt / record", joined / stored, "x")
        run.add(f"{name}: latent per sample, 1024², bf16", latent, "B")


def _params(build) -> int:
    """Parameters of the model ``build()`` makes on the meta device."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def qwen_zimage(run: Run, caption_tokens: int) -> None:
    """Parameter counts and bytes per caption of Qwen-Image and Z-Image at their real sizes (module docstring)."""
    import diffusers
    import transformers

    counts = {
        "Qwen2.5-VL-7B (as the pipeline loads it)": _params(lambda: transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig(**QWEN_VL_7B))),
        "Qwen2.5-VL-7B without lm_head (as bucketeer loads it)": _params(lambda: transformers.Qwen2_5_VLModel(
            transformers.Qwen2_5_VLConfig(**QWEN_VL_7B))),
        "Qwen-Image VAE (AutoencoderKLQwenImage)": _params(lambda: diffusers.AutoencoderKLQwenImage()),
        "Qwen-Image transformer": _params(lambda: diffusers.QwenImageTransformer2DModel(**QWEN_IMAGE)),
        "Qwen3-4B (Z-Image text encoder)": _params(lambda: transformers.Qwen3Model(
            transformers.Qwen3Config(**QWEN3_4B))),
        "Z-Image VAE (Flux.1's AutoencoderKL)": _params(lambda: diffusers.AutoencoderKL(**FLUX1_VAE)),
        "Z-Image transformer": _params(lambda: diffusers.ZImageTransformer2DModel(**Z_IMAGE)),
    }  # fmt: skip
    print(f"\n{'model':56s} {'parameters':>15s} {'bf16 GB':>8s} {'fp32 GB':>8s} {'full FT GB':>11s}")
    for name, n in counts.items():
        print(f"{name:56s} {n:>15,d} {2 * n / 1e9:>8.1f} {4 * n / 1e9:>8.1f} {16 * n / 1e9:>11.1f}")
        run.add(f"{name}: parameters", n)
        for what, per in (("bf16", 2), ("fp32", 4), ("full FT (16 B per parameter)", 16)):
            run.add(f"{name}: {what}", per * n / 1e9, "GB")
    print(f"\n{'family':44s} {'bucketeer bf16':>15s} {'encode_prompt fp32':>19s} {'ratio':>6s} "
          f"{'padded fp32':>12s} {'ratio':>6s} {'latent/sample':>14s}")  # fmt: skip
    rows = [(f"qwen-image ({caption_tokens}-token caption, 1024 max)", caption_tokens + 5, 3584, 1024),
            (f"z-image ({caption_tokens}-token caption, 512 max)", caption_tokens + 8, 2560, 512)]
    for name, n, width, length in rows:
        stored, alone, padded = 2 * n * width, 4 * n * width, 4 * length * width + 4 * length
        print(f"{name:44s} {stored:>15,d} {alone:>19,d} {alone / stored:>5.1f}x {padded:>12,d} "
              f"{padded / stored:>5.1f}x {2 * 16 * 128 * 128:>14,d}")
        run.add(f"{name}: bucketeer record (bf16, {n} rows x {width})", stored, "B")
        run.add(f"{name}: encode_prompt fp32", alone, "B")
        run.add(f"{name}: encode_prompt / record", alone / stored, "x")
        run.add(f"{name}: padded fp32", padded, "B")
        run.add(f"{name}: padded / record", padded / stored, "x")
        run.add(f"{name}: latent per sample, 1024², bf16", 2 * 16 * 128 * 128, "B")


def image_tokens(height: int, width: int) -> tuple[int, tuple[int, int]]:
    """Qwen2.5-VL tokens of a ``height x width`` reference as ``QwenImageEditPipeline`` feeds it (resized to its
    ``calculate_dimensions(1024 * 1024, ...)``, then the image processor's own resize), and that resized size."""
    from PIL import Image
    from pipeline.embed.processors import qwen2vl_image_processor_class

    from pipeline.embed.families.qwen_image_edit import reference_size

    h, w = reference_size(height, width)
    processor = qwen2vl_image_processor_class()(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384},
                                         patch_size=14, merge_size=2, temporal_patch_size=2)  # the published config
    grid = processor(Image.new("RGB", (w, h)), return_tensors="pt")["image_grid_thw"][0]  # (t, h/14, w/14)
    return int(grid.prod()) // 4, (h, w)  # 2x2 patches merged into one token


def qwen_image_edit(run: Run, instruction_tokens: int) -> None:
    """Bytes per sample of Qwen-Image-Edit at real size (module docstring): the text of (instruction, reference)."""
    print(f"\n{'qwen-image-edit reference (h x w)':44s} {'image tokens':>12s} {'rows':>6s} {'bucketeer bf16':>15s} "
          f"{'encode_prompt fp32':>19s} {'latents bf16':>13s}")  # fmt: skip
    for height, width in ((1024, 1024), (896, 1152), (512, 512), (1536, 1024)):
        tokens, (h, w) = image_tokens(height, width)
        rows = 1 + tokens + 1 + instruction_tokens + 5  # <|vision_start|>, image, <|vision_end|>, instruction, 5
        latents = 2 * 16 * (height // 8) * (width // 8) + 2 * 16 * (h // 8) * (w // 8)  # target + reference
        print(f"{f'{height}x{width} -> {h}x{w}, {instruction_tokens}-token instruction':44s} {tokens:>12,d} "
              f"{rows:>6,d} {2 * rows * 3584:>15,d} {4 * rows * 3584:>19,d} {latents:>13,d}")
        name = f"qwen-image-edit {height}x{width} -> {h}x{w}"
        run.add(f"{name}: image tokens", tokens)
        run.add(f"{name}: rows", rows)
        run.add(f"{name}: bucketeer record (bf16)", 2 * rows * 3584, "B")
        run.add(f"{name}: encode_prompt fp32", 4 * rows * 3584, "B")
        run.add(f"{name}: latents (target + reference)", latents, "B")


if __name__ == "__main__":
    main()
