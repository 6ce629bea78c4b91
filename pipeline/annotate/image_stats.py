"""The model-free annotate tasks: ``phash``, ``sha256`` and ``stats``, plain numpy on one decoded image.

- :func:`phash`: imagehash's ``phash`` (hash_size 8, highfreq_factor 4): the image in grayscale (PIL
  ``L``) resized to 32x32 with Lanczos, a 2-D DCT-II, the top-left 8x8 coefficients compared with their
  median; bit 63 (the most significant) is coefficient (0, 0), row-major, so ``f"{h:016x}"`` is
  imagehash's hex string. Written here with numpy (a DCT matrix) rather than depending on imagehash,
  which brings scipy and PyWavelets for one 32x32 transform. It equals ``int(str(imagehash.phash(img)), 16)``
  (tests/test_annotate_tasks.py checks both on random and flat images; coefficients are rounded to 1e-6
  so that a flat image's AC terms, 0 in exact arithmetic, tie as they do in scipy's FFTPACK).
- :func:`sha256_hex`: of the bytes read for the sample (a tar member's or parquet cell's bytes, not the
  container's).
- :func:`image_stats`: on the decoded RGB pixels (uint8 ``(h, w, 3)``, the image as annotate decodes it:
  its long side at most ``--image-size``), see :data:`STATS` for each value's definition and range.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["STATS", "phash", "sha256_hex", "image_stats", "hamming"]

STATS = {
    "luminance": "mean of Y = 0.299 R + 0.587 G + 0.114 B (Rec. 601, as PIL's L), 0..1",
    "contrast": "standard deviation of Y, 0..0.5",
    "colourfulness": "Hasler & Suesstrunk (2003) M = sigma_rgyb + 0.3 mu_rgyb on 0..255 channels, 0 for grey; "
                     "~15 'slightly', ~33 'moderately', ~59 'quite', >100 'extremely' colourful",
    "sharpness": "variance of the 4-neighbour Laplacian of Y on 0..255 (the decoded size: it grows with detail "
                 "and falls when an image is scaled down), >= 0",
    "border_fraction": "of the pixels within 2% of the shorter side from an edge (at least 1 pixel), the fraction "
                       "near black (every channel <= 16) or near white (every channel >= 239), 0..1",
    "grayscale": "true when fewer than 1% of pixels have channels more than 12 apart (JPEG chroma noise allowed)",
}
_NEAR_BLACK, _NEAR_WHITE, _GREY_SPREAD = 16, 239, 12


def _dct_matrix(n: int) -> np.ndarray:
    """(n, n) DCT-II without normalisation, as ``scipy.fftpack.dct``: ``y[k] = 2 sum_i x[i] cos(pi k (2i+1) / 2n)``."""
    k, i = np.mgrid[0:n, 0:n]
    return 2.0 * np.cos(np.pi * k * (2 * i + 1) / (2 * n))


_DCT32 = _dct_matrix(32)


def phash(image) -> int:
    """64-bit perceptual hash of a PIL image (see the module docstring); compare with :func:`hamming`."""
    from PIL import Image

    pixels = np.asarray(image.convert("L").resize((32, 32), Image.Resampling.LANCZOS), dtype=np.float64)  # (32, 32)
    dct = _DCT32 @ pixels @ _DCT32.T  # along axis 0, then axis 1
    low = np.round(dct[:8, :8], 6)  # rounding noise (~1e-10) to 0: exact ties stay ties, as in scipy's FFTPACK
    bits = (low > np.median(low)).ravel()  # (64,), row-major: bit 63 first
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def hamming(a: int, b: int) -> int:
    """Bits that differ between two hashes."""
    return bin(int(a) ^ int(b)).count("1")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_stats(pixels: np.ndarray) -> dict[str, float | bool]:
    """The :data:`STATS` of uint8 RGB ``pixels`` ``(h, w, 3)``."""
    rgb = pixels.astype(np.float32)  # (h, w, 3)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    y = 0.299 * r + 0.587 * g + 0.114 * b  # (h, w), 0..255
    rg, yb = r - g, 0.5 * (r + g) - b
    colourful = np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean())
    h, w = y.shape
    if h >= 3 and w >= 3:
        lap = y[:-2, 1:-1] + y[2:, 1:-1] + y[1:-1, :-2] + y[1:-1, 2:] - 4 * y[1:-1, 1:-1]  # (h-2, w-2)
        sharpness = float(lap.var())
    else:
        sharpness = 0.0
    t = max(1, round(0.02 * min(h, w)))
    ring = np.ones((h, w), bool)
    ring[t:h - t, t:w - t] = False
    edge = pixels[ring]  # (border pixels, 3)
    extreme = (edge.max(axis=1) <= _NEAR_BLACK) | (edge.min(axis=1) >= _NEAR_WHITE)
    spread = pixels.max(axis=2).astype(np.int16) - pixels.min(axis=2)  # (h, w)
    return {"luminance": float(y.mean() / 255), "contrast": float(y.std() / 255), "colourfulness": float(colourful),
            "sharpness": sharpness, "border_fraction": float(extreme.mean()) if len(edge) else 0.0,
            "grayscale": bool(np.count_nonzero(spread > _GREY_SPREAD) < 0.01 * spread.size)}  # fmt: skip
