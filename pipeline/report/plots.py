"""The report's figures: plain functions from numbers to a matplotlib Figure (Agg, no display).

Each function takes already-aggregated arrays or dicts (the report module does the reading) and
returns a Figure; :func:`png_bytes` renders one. Nothing here touches storage.
"""

from __future__ import annotations

import io
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: the report is written on servers and in CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = [
    "png_bytes",
    "bucket_histogram",
    "aspect_ratio_distribution",
    "resolution_distribution",
    "caption_length_histogram",
    "error_kinds",
    "plan_waste",
    "tokens_per_step",
    "cache_record_sizes",
    "score_histogram",
    "value_counts",
    "frame_histogram",
    "frame_bucket_counts",
]

BLUE, ORANGE, RED, GREY = "#3b6fb6", "#e08a2c", "#c0392b", "#8a8f98"
_STYLE = {
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.25,
    "font.size": 9,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
}


def _figure(width: float = 7.5, height: float = 3.6, ncols: int = 1) -> tuple[Figure, list]:
    with plt.rc_context(_STYLE):
        fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained")
    return fig, list(np.atleast_1d(axes))


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color=GREY, fontsize=11)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    """Render ``fig`` as PNG bytes and free it."""
    buf = io.BytesIO()
    with plt.rc_context(_STYLE):
        fig.savefig(buf, format="png", dpi=dpi, facecolor="white", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _bucket_aspect(name: str) -> float:
    w, _, h = name.partition("x")
    h = h.partition("x")[0]  # a video bucket WxHxF: the pixel part
    try:
        return int(w) / int(h)
    except ValueError:
        return float("inf")


def bucket_histogram(counts: Mapping[str, int]) -> Figure:
    """Samples per bucket, buckets ordered from tallest (portrait) to widest (landscape)."""
    fig, (ax,) = _figure(height=max(3.0, 0.22 * len(counts) + 1.2))
    ax.set_title("Samples per bucket")
    if not counts:
        _empty(ax, "no samples")
        return fig
    names = sorted(counts, key=_bucket_aspect)
    values = np.array([counts[n] for n in names])
    ax.barh(names, values, color=BLUE)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, f" {v} ({100 * v / values.sum():.1f}%)", va="center", fontsize=7, color="#333")
    ax.set_xlim(0, values.max() * 1.25)
    ax.set_xlabel("samples")
    ax.set_ylabel("bucket (W x H, px)")
    return fig


def aspect_ratio_distribution(widths: np.ndarray, heights: np.ndarray) -> Figure:
    """Histogram of image aspect ratios on a log scale (1:1 in the middle)."""
    fig, (ax,) = _figure()
    ax.set_title("Aspect ratio (width / height)")
    if len(widths) == 0:
        _empty(ax, "no samples")
        return fig
    log_ar = np.log2(np.asarray(widths, np.float64) / np.asarray(heights, np.float64))  # (N,)
    # beyond 1:8 / 8:1 no bucket exists: such images are counted in the outermost bins
    lim = min(3.0, max(2.0, float(np.ceil(np.abs(log_ar).max()))))
    ax.hist(np.clip(log_ar, -lim, lim), bins=np.linspace(-lim, lim, 49), color=BLUE)
    ticks = np.arange(-lim, lim + 1)
    ax.set_xticks(ticks, [f"1:{2 ** -t:g}" if t < 0 else f"{2 ** t:g}:1" for t in ticks])
    ax.axvline(0, color=GREY, lw=1, ls="--")
    ax.set_xlabel("aspect ratio (portrait <- 1:1 -> landscape)")
    ax.set_ylabel("images")
    return fig


_POINT_AREA = 6  # points², the scatter's markers
_MARGIN = 0.06  # of the largest value: room above it inside the axes


def resolution_distribution(widths: np.ndarray, heights: np.ndarray) -> Figure:
    """Width x height density (log colour) and a megapixel histogram."""
    fig, (ax, ax_mp) = _figure(width=11.0, height=3.8, ncols=2)
    ax.set_title("Resolution")
    ax_mp.set_title("Megapixels")
    if len(widths) == 0:
        _empty(ax, "no samples")
        _empty(ax_mp, "no samples")
        return fig
    w = np.asarray(widths, np.float64)
    h = np.asarray(heights, np.float64)
    # both axes end 6% past the largest side: a point there is drawn whole, not cut in half by the frame
    top = max(w.max(), h.max()) * (1 + _MARGIN)
    if len(w) <= 5000:
        ax.scatter(w, h, s=_POINT_AREA, alpha=0.5, color=BLUE, linewidths=0)
    else:  # a density: millions of points would be one blot
        _, _, _, image = ax.hist2d(w, h, bins=80, range=[[0, top], [0, top]], cmap="viridis", norm=LogNorm(), cmin=1)
        fig.colorbar(image, ax=ax, label="images")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.plot([0, top], [0, top], color=GREY, lw=0.8, ls="--")
    ax.set_xlabel("width (px)")
    ax.set_ylabel("height (px)")
    ax.set_aspect("equal")
    mp = w * h / 1e6
    counts, _, _ = ax_mp.hist(mp, bins=50, color=ORANGE)
    ax_mp.set_ylim(0, counts.max() * (1 + _MARGIN))  # the tallest bar below the frame, not touching it
    ax_mp.axvline(np.median(mp), color=RED, lw=1, label=f"median {np.median(mp):.2f} MP")
    ax_mp.legend(frameon=False)
    ax_mp.set_xlabel("megapixels")
    ax_mp.set_ylabel("images")
    return fig


def caption_length_histogram(words: np.ndarray, missing: int) -> Figure:
    """Caption length in words; images without a caption are counted in the title."""
    fig, (ax,) = _figure()
    ax.set_title(f"Caption length ({missing} without caption)")
    if len(words) == 0:
        _empty(ax, "no captions")
        return fig
    words = np.asarray(words)
    ax.hist(words, bins=np.arange(0, words.max() + 2) - 0.5 if words.max() < 80 else 60, color=BLUE)
    ax.axvline(np.median(words), color=RED, lw=1, label=f"median {np.median(words):g} words")
    ax.legend(frameon=False)
    ax.set_xlabel("words")
    ax.set_ylabel("captions")
    return fig


def error_kinds(counts: Mapping[str, int], title: str = "Errors by kind") -> Figure:
    """Bar chart of error rows by kind (``truncated``, ``not_an_image``, ...)."""
    fig, (ax,) = _figure(height=min(3.6, max(2.0, 0.35 * len(counts) + 1.2)))
    ax.set_title(title)
    if not counts:
        _empty(ax, "no errors")
        return fig
    names = sorted(counts, key=lambda k: -counts[k])
    values = [counts[k] for k in names]
    ax.barh(names, values, color=RED, height=0.6)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, f" {v}", va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.2)
    ax.set_xlabel("files")
    return fig


def plan_waste(buckets: Sequence[str], used: Sequence[int], padded: Sequence[int], dropped: Sequence[int]) -> Figure:
    """Per bucket in one epoch: samples trained once, padding repeats and dropped samples."""
    fig, (ax,) = _figure(height=max(3.0, 0.22 * len(buckets) + 1.4))
    ax.set_title("Plan: padding and drops per bucket (first epoch)")
    if not buckets:
        _empty(ax, "empty plan")
        return fig
    order = sorted(range(len(buckets)), key=lambda i: _bucket_aspect(buckets[i]))
    names = [buckets[i] for i in order]
    u, p, d = (np.array([seq[i] for i in order]) for seq in (used, padded, dropped))
    ax.barh(names, u, color=BLUE, label="trained")
    ax.barh(names, p, left=u, color=ORANGE, label="padding (repeats)")
    ax.barh(names, d, left=u + p, color=RED, label="dropped")
    ax.invert_yaxis()
    ax.legend(frameon=True, framealpha=0.9, loc="best")
    ax.set_xlabel("samples")
    return fig


def tokens_per_step(steps: np.ndarray, tokens: np.ndarray) -> Figure:
    """Latent tokens per step for each rank (lines), ``tokens`` shaped (ranks, steps)."""
    fig, (ax,) = _figure()
    ax.set_title("Plan: latent tokens per step and rank (first epoch)")
    if tokens.size == 0:
        _empty(ax, "empty plan")
        return fig
    ranks = tokens.shape[0]
    if ranks <= 8:
        for r in range(ranks):
            ax.plot(steps, tokens[r], lw=1, drawstyle="steps-mid", label=f"rank {r}")
        ax.legend(frameon=False, ncols=min(ranks, 4), fontsize=7)
    else:
        ax.fill_between(steps, tokens.min(0), tokens.max(0), color=BLUE, alpha=0.3, step="mid", label="min..max")
        ax.plot(steps, tokens.mean(0), color=BLUE, lw=1, drawstyle="steps-mid", label="mean")
        ax.legend(frameon=False)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel("latent tokens")
    return fig


def cache_record_sizes(bytes_per_record: np.ndarray) -> Figure:
    """Histogram of compressed record sizes in KiB."""
    fig, (ax,) = _figure()
    ax.set_title("Cache: compressed bytes per sample record")
    if len(bytes_per_record) == 0:
        _empty(ax, "no records")
        return fig
    kib = np.asarray(bytes_per_record, np.float64) / 1024
    ax.hist(kib, bins=50, color=BLUE)
    ax.axvline(np.median(kib), color=RED, lw=1, label=f"median {np.median(kib):.1f} KiB")
    ax.legend(frameon=False)
    ax.set_xlabel("KiB")
    ax.set_ylabel("records")
    return fig


def score_histogram(name: str, edges: np.ndarray, counts: np.ndarray, missing: int) -> Figure:
    """One annotation score: ``counts`` (bins,) over ``edges`` (bins+1,), the samples without a score in the title."""
    fig, (ax,) = _figure(width=5.5, height=2.8)
    ax.set_title(f"{name} ({int(counts.sum())} scored, {missing} without)")
    if counts.sum() == 0:
        _empty(ax, "no scores")
        return fig
    ax.stairs(counts, edges, fill=True, color=BLUE)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel(name)
    ax.set_ylabel("samples")
    return fig


def value_counts(name: str, counts: Mapping[str, int]) -> Figure:
    """A bool annotation: samples per value (``true``, ``false``, ``no value``)."""
    fig, (ax,) = _figure(width=5.5, height=2.0)
    ax.set_title(name)
    labels = list(counts)
    values = [counts[k] for k in labels]
    ax.barh(labels, values, color=[BLUE, ORANGE, GREY][: len(labels)], height=0.6)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, f" {v}", va="center", fontsize=8)
    ax.set_xlim(0, max(max(values), 1) * 1.2)
    ax.set_xlabel("samples")
    return fig


def frame_histogram(frames: np.ndarray, ladder: Sequence[int]) -> Figure:
    """Frames per video (``frames``: (videos,)), the frame buckets ``ladder`` as dashed lines."""
    fig, (ax,) = _figure()
    ax.set_title("Frames per video")
    if len(frames) == 0:
        _empty(ax, "no videos")
        return fig
    ax.hist(frames, bins=min(50, max(5, len(np.unique(frames)))), color=BLUE)
    for f in ladder:
        if f <= frames.max():
            ax.axvline(f, color=ORANGE, lw=1, ls="--")
    ax.set_xlabel("frames")
    ax.set_ylabel("videos")
    return fig


def frame_bucket_counts(counts: Mapping[int, int]) -> Figure:
    """Samples per frame bucket (``F`` of ``WxHxF``; 1: images), shortest first."""
    fig, (ax,) = _figure(height=max(2.4, 0.22 * len(counts) + 1.2))
    ax.set_title("Samples per frame bucket")
    if not counts:
        _empty(ax, "no samples")
        return fig
    names = sorted(counts)
    values = np.array([counts[f] for f in names])
    ax.barh([f"{f} frames" for f in names], values, color=[GREY if f == 1 else BLUE for f in names])
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, f" {v} ({100 * v / values.sum():.1f}%)", va="center", fontsize=7, color="#333")
    ax.set_xlim(0, values.max() * 1.25)
    ax.set_xlabel("samples")
    return fig
