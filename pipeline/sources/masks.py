"""Loss masks of a scan (``bucketeer scan --masks alpha,files``): which samples have one, and where it is.

The manifest's ``mask`` column (:data:`manifests.schema.MASK_FIELDS`) says where a sample's mask is:

- ``files``: a **mask file beside the image**, named ``<stem>.mask.<ext>`` for the image ``<stem>.<ext>``
  (``a/cat.mask.png`` is the mask of ``a/cat.jpg``; any image extension, any case of it). Mask files
  are taken out of the listing before the probe (:func:`split_mask_files`): they are never samples, and
  ``_manifest.json`` counts them (``summary.mask_files``). The column holds the file's path relative to
  the source root. In a WebDataset tar shard the same name makes a **mask member** of the key
  (``000017.mask.png`` beside ``000017.jpg``: the key is the part before the first dot): the column
  holds ``<shard>/<member>`` and ``mask_offset``/``mask_size`` its byte range (one key, one mask: the
  first by name when there are several). The scan reads none of their bytes: a mask of another size than
  its image is found by embed, which makes the sample a ``mask_mismatch`` error row of the cache (never
  a guessed crop).
- ``alpha``: an image whose **header** declares an alpha channel (PNG RGBA/LA or with a tRNS chunk, a
  palette with transparency, WebP with alpha, ...; no pixel is decoded) gets ``"alpha"``. A mask file
  wins over the alpha channel when both are asked for.

Without ``--masks`` the column stays null and ``*.mask.*`` files are images like any other (what scans
did before). A rescan keeps a reused loose row's ``mask`` as it was unless its mask file appeared or went:
give a new ``--out`` to re-judge alpha channels after changing ``--masks`` (tar shards are read again
when ``--masks`` changes).
- ``column:NAME`` (``scan --format parquet``): a **column of mask bytes** beside the image column (binary, or
  HF's ``Image`` struct), a null value meaning no mask; the row's ``mask`` is ``column:NAME`` and
  ``mask_size`` the value's length; embed reads the column by row group like the images.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pyarrow as pa

from manifests.errors import UsageError
from manifests.schema import MASK_ALPHA, MASK_INFIX
from pipeline.sources.listing import FileEntry, Listing

__all__ = ["MASK_MODES", "MaskFiles", "parse_masks", "mask_column", "split_mask_files", "attach_masks", "mask_counts",
           "is_mask_member"]

MASK_MODES = ("alpha", "files")


def parse_masks(option: str | None) -> str | None:
    """``--masks`` as a canonical string (``alpha``, ``files``, ``column:NAME``, comma-separated in that
    order), None without it. Raises UsageError naming an unknown mode."""
    if option is None:
        return None
    modes = {m.strip() for m in option.split(",") if m.strip()}
    columns = sorted(m for m in modes if m.startswith("column:") and len(m) > len("column:"))
    unknown = sorted(modes - set(MASK_MODES) - set(columns))
    if unknown or not modes or len(columns) > 1:
        raise UsageError(f"--masks {option!r}: give {', '.join(MASK_MODES)} or column:NAME (a parquet column of "
                         "mask bytes), comma-separated")  # fmt: skip
    return ",".join([m for m in MASK_MODES if m in modes] + columns)


def mask_column(masks: str | None) -> str | None:
    """The parquet column of mask bytes that ``--masks`` names (``column:NAME``), else None."""
    return next((m[len("column:"):] for m in (masks or "").split(",") if m.startswith("column:")), None)


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name.rsplit("/", 1)[-1] else name


@dataclass(frozen=True)
class MaskFiles:
    """The mask files of a listing, by the stem of the image they belong to (``a/cat`` -> ``a/cat.mask.png``)."""

    by_stem: dict[str, FileEntry]

    def of(self, filename: str) -> FileEntry | None:
        """The mask file of image ``filename`` (relative to the root), None when it has none."""
        return self.by_stem.get(_stem(filename))


def split_mask_files(listing: Listing) -> tuple[Listing, MaskFiles]:
    """``listing`` without its mask files (``<stem>.mask.<ext>``), and those files by their image's stem."""
    masks: dict[str, FileEntry] = {}
    keep = []
    for entry in listing.images:
        if is_mask_member(entry.name):
            masks[_stem(entry.name)[: -len(MASK_INFIX)]] = entry
        else:
            keep.append(entry)
    return replace(listing, images=keep), MaskFiles(masks)


def attach_masks(images: pa.Table, probed: pa.Table, modes: str, files: MaskFiles) -> pa.Table:
    """Fill the mask columns of image rows (IMAGE_SCHEMA, reused and new) for ``--masks`` ``modes``: ``mask``,
    and for a mask file its size, ETag and mtime (``mask_size``, ``mask_etag``, ``mask_mtime``: a changed
    mask file re-embeds its sample). ``probed``: this scan's probe table (its ``alpha`` column for the rows
    read now); a reused row keeps an ``"alpha"`` it had.
    """
    names = images.column("filename").to_pylist()
    before = images.column("mask").to_pylist()
    alpha = set()
    if "alpha" in modes and probed.num_rows:
        read = probed.filter(probed.column("probed"))
        alpha = {n for n, a in zip(read.column("name").to_pylist(), read.column("alpha").to_pylist()) if a}
    wanted_files = "files" in modes
    masks, entries = [], []
    for name, old in zip(names, before):
        entry = files.of(name) if wanted_files else None
        mask = entry.name if entry is not None else None
        if mask is None and "alpha" in modes and (name in alpha or old == MASK_ALPHA):
            mask = MASK_ALPHA
        masks.append(mask)
        entries.append(entry)
    columns = {"mask": pa.array(masks, pa.string()), "mask_size": pa.array([e and e.size for e in entries], pa.int64()),
               "mask_etag": pa.array([e and e.etag for e in entries], pa.string()),
               "mask_mtime": pa.array([e and e.mtime for e in entries], pa.float64())}  # fmt: skip
    for name, values in columns.items():
        images = images.set_column(images.schema.get_field_index(name), name, values)
    return images


def mask_counts(samples: pa.Table, mask_files: int) -> dict[str, int]:
    """The summary's counts: samples masked by their alpha channel, by a mask file (or tar member); the
    ``mask_files`` (or members) listed, which are not samples."""
    masks = samples.column("mask").to_pylist()
    by_alpha = sum(m == MASK_ALPHA for m in masks)
    return {"masks_alpha": by_alpha, "masks_files": sum(m is not None for m in masks) - by_alpha,
            "mask_files": mask_files}


def is_mask_member(name: str) -> bool:
    """A tar member (or file) named as a mask: ``<stem>.mask.<ext>`` (:data:`manifests.schema.MASK_INFIX`)."""
    stem = _stem(name)
    return stem.endswith(MASK_INFIX) and len(stem.rsplit("/", 1)[-1]) > len(MASK_INFIX)
