"""Captions: sidecar ``.txt`` / ``.caption`` files next to the images, or one metadata table.

Decoding (:func:`decode_caption`): a UTF-8 (or UTF-16) byte-order mark is stripped; bytes that
are not valid UTF-8 are read as Windows-1252 (what Windows editors write; it covers Latin-1's
printable range), and, where even that fails, as Latin-1, which maps every byte: a caption is
never a crash. All whitespace runs (newlines, CRLF, tabs) collapse to one space and the ends are
stripped; a caption that is empty after that is null.

Generated captions (``--captions ANNOTATIONS``, a folder written by ``bucketeer annotate``, found by its
``_annotations.json``): each sample's generated caption is **added** to its caption list beside the
originals (sidecars, the container's, a parquet column), after them and once
(:func:`with_generated`); a sample with no original caption gets the generated one alone. The
trainer then picks one of the list per epoch, as for any caption list.

The table (``--captions URL``) is parquet, jsonl or csv with a filename column (``filename``,
``file_name``, ``path`` or ``image``) and a caption column (``caption``, ``text`` or ``prompt``);
filenames are relative to the dataset root. Its ``version`` is a hash of its content as read
(``{filename: caption}`` after normalising), so a reformatted but equal table has the same version.

Caption lists: the table's caption column may be a list of strings (a parquet ``list<string>``, a JSON
array in jsonl), a ``.json`` member of a tar shard may hold a list in its caption field, and a loose
image may have numbered sidecars (:func:`sidecar_number`). Each caption of a list is normalised as
above; empty ones are dropped (and counted). A sample's manifest ``caption`` is the first, its
``captions`` the whole list when it has more than one (:func:`caption_list`).
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

from manifests.errors import MissingError, UsageError
from manifests.storage import open_url, read_bytes, redact

__all__ = [
    "SIDECAR_EXTENSIONS",
    "CaptionTable",
    "decode_caption",
    "normalise_caption",
    "sidecar_stem",
    "sidecar_number",
    "caption_list",
    "load_caption_table",
    "load_captions",
    "with_generated",
    "read_table",
    "table_filenames",
]

SIDECAR_EXTENSIONS = (".txt", ".caption")  # when both exist, .txt wins
_FILENAME_COLUMNS = ("filename", "file_name", "path", "image")
_CAPTION_COLUMNS = ("caption", "text", "prompt")


def normalise_caption(text: str | None) -> str | None:
    """Collapse whitespace runs (newlines included) to one space and strip; empty gives None."""
    if text is None:
        return None
    text = " ".join(text.replace("\ufeff", " ").split())
    return text or None


def decode_caption(data: bytes) -> str | None:
    """Decode a sidecar file's bytes (see the module docstring for the fallbacks) and normalise."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return normalise_caption(data.decode("utf-16"))
        except UnicodeDecodeError:
            pass
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    for encoding in ("utf-8", "cp1252"):
        try:
            return normalise_caption(data.decode(encoding))
        except UnicodeDecodeError:
            continue
    return normalise_caption(data.decode("latin-1"))


def sidecar_stem(filename: str) -> str:
    """``a/b/img.jpg`` -> ``a/b/img``: the name a sidecar caption shares with its image."""
    head, _, base = filename.rpartition("/")
    stem = base.rsplit(".", 1)[0] if "." in base else base
    return f"{head}/{stem}" if head else stem


def sidecar_number(stem: str) -> tuple[str, int]:
    """The image stem and caption number of a sidecar's stem: ``a/img.2`` -> ``("a/img", 2)``; ``a/img`` -> 0.

    Numbered sidecars give an image several captions: ``img.txt`` (or ``img.0.txt``) is caption 0,
    ``img.1.txt`` caption 1, and so on, in number order (gaps are fine). Only a number of at most 3
    digits counts, so that ``photo.2023.txt`` stays the sidecar of ``photo.2023.jpg``; and where an
    image ``img.1.jpg`` exists, ``img.1.txt`` is its caption, not ``img``'s (the listing sees to that).
    """
    head, dot, number = stem.rpartition(".")
    if dot and head and not head.endswith("/") and number.isdigit() and len(number) <= 3:
        return head, int(number)
    return stem, 0


def caption_list(values: list | None) -> tuple[str | None, list[str] | None, int]:
    """``(caption, captions, dropped)`` of a sample's captions in order: each normalised, empty ones
    dropped (``dropped`` counts them); ``captions`` only when more than one is left."""
    kept = [c for c in (normalise_caption(v) for v in values or ()) if c is not None]
    dropped = len(values or ()) - len(kept)
    return (kept[0] if kept else None), (kept if len(kept) > 1 else None), dropped


def _clean_name(name: str) -> str:
    name = name.replace("\\", "/")
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/")


@dataclass(frozen=True)
class CaptionTable:
    """A loaded ``--captions`` table: ``{filename: caption}`` (the first caption of a list),
    ``{filename: captions}`` for the files with several, and a hash of that content."""

    captions: dict[str, str | None]
    version: str  # 16 hex digits of sha256 over the sorted (filename, caption) pairs (and the lists)
    lists: dict[str, list[str]] = field(default_factory=dict)
    dropped: int = 0  # empty captions left out of lists
    generated: bool = False  # from an ANNOTATIONS folder: added to the originals, not replacing them

    @classmethod
    def of(cls, captions: dict[str, str | None], lists: dict[str, list[str]] | None = None,
           dropped: int = 0, generated: bool = False) -> CaptionTable:  # fmt: skip
        content = sorted(captions.items()) + ([["lists", sorted(lists.items())]] if lists else [])
        content += [["generated"]] if generated else []  # a table without lists keeps its old version
        pairs = json.dumps(content, ensure_ascii=False).encode()
        return cls(captions, hashlib.sha256(pairs).hexdigest()[:16], lists or {}, dropped, generated)

    def merged(self, name: str, caption: str | None, captions: list[str] | None) -> tuple[str | None, list[str] | None]:
        """``name``'s ``(caption, captions)`` given its originals: the table's (replacing them), or for generated
        captions the originals with the generated one added (:func:`with_generated`)."""
        if self.generated:
            return with_generated(caption, captions, self.captions[name])
        return self.captions[name], self.lists.get(name)


def with_generated(caption: str | None, captions: list[str] | None, generated: str | None) -> tuple[
        str | None, list[str] | None]:  # fmt: skip
    """``(caption, captions)`` of a sample whose originals are ``caption``/``captions`` with the ``generated``
    one added after them (once: a rescan merging the same annotations again adds nothing). The first
    caption stays the first original; without originals, the generated caption is the caption."""
    originals = list(captions) if captions else ([caption] if caption is not None else [])
    merged = originals + ([generated] if generated is not None and generated not in originals else [])
    first, several, _ = caption_list(merged)
    return first, several


def read_table(url: str, storage_options: dict[str, Any] | None = None) -> pa.Table:
    """The ``--captions`` table at ``url`` as read (parquet, jsonl or csv; columns as they are).

    Raises MissingError (a FileNotFoundError) when it is missing, UsageError for an unknown format
    or bytes that do not parse.
    """
    fs, path = open_url(url, storage_options)
    try:
        data = read_bytes(fs, path)
    except FileNotFoundError:
        raise MissingError(f"--captions {redact(url)}: no such file") from None
    suffix = path.lower().rsplit(".", 1)[-1]
    try:
        if suffix == "parquet":
            return pq.read_table(io.BytesIO(data))
        if suffix in ("jsonl", "ndjson", "json"):
            return pjson.read_json(io.BytesIO(data))
        if suffix in ("csv", "tsv"):
            parse = pcsv.ParseOptions(delimiter="\t" if suffix == "tsv" else ",", newlines_in_values=True)
            return pcsv.read_csv(io.BytesIO(data), parse_options=parse)
    except pa.ArrowInvalid as e:
        raise UsageError(f"--captions {redact(url)}: cannot parse it as {suffix}: {e}") from None
    raise UsageError(f"--captions {redact(url)}: unknown table format '.{suffix}'; use .parquet, .jsonl or .csv")


def table_filenames(table: pa.Table, url: str) -> list[str]:
    """The table's filename column (the first of ``filename``, ``file_name``, ``path``, ``image``), cleaned
    (``./`` and leading ``/`` dropped, ``\\`` -> ``/``). Raises UsageError when it has none, or a null."""
    name_col = next((c for c in _FILENAME_COLUMNS if c in table.column_names), None)
    if name_col is None:
        raise UsageError(f"--captions {redact(url)} has columns {table.column_names}; it needs a filename column "
                         f"(one of {list(_FILENAME_COLUMNS)})")
    names = table.column(name_col).cast(pa.string()).to_pylist()
    for row, name in enumerate(names):
        if name is None:
            raise UsageError(f"--captions {redact(url)}: row {row} has no {name_col}")
    return [_clean_name(n) for n in names]


def load_caption_table(url: str, storage_options: dict[str, Any] | None = None) -> CaptionTable:
    """Read ``--captions URL`` into a :class:`CaptionTable` (captions normalised).

    Raises MissingError (a FileNotFoundError) when the table is missing, UsageError (a ValueError)
    for an unknown format, missing columns or a filename given twice with different captions.
    """
    table = read_table(url, storage_options)
    name_col = next((c for c in _FILENAME_COLUMNS if c in table.column_names), None)
    text_col = next((c for c in _CAPTION_COLUMNS if c in table.column_names), None)
    if name_col is None or text_col is None:
        raise UsageError(
            f"--captions {redact(url)} has columns {table.column_names}; it needs a filename column "
            f"(one of {list(_FILENAME_COLUMNS)}) and a caption column (one of {list(_CAPTION_COLUMNS)})"
        )
    names = table.column(name_col).cast(pa.string()).to_pylist()
    column = table.column(text_col)
    is_list = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
    try:
        texts = column.cast(pa.list_(pa.string()) if is_list else pa.string()).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise UsageError(f"--captions {redact(url)}: column {text_col!r} ({column.type}) is neither text nor a "
                         "list of texts") from None  # fmt: skip
    out: dict[str, str | None] = {}
    lists: dict[str, list[str]] = {}
    dropped = 0
    for row, (name, text) in enumerate(zip(names, texts)):
        if name is None:
            raise UsageError(f"--captions {redact(url)}: row {row} has no {name_col}")
        key = _clean_name(name)
        caption, several, empty = caption_list(text) if is_list else (normalise_caption(text), None, 0)
        if key in out and (out[key], lists.get(key)) != (caption, several):
            raise UsageError(f"--captions {redact(url)}: {key!r} appears twice with different captions (row {row})")
        out[key] = caption
        if several:
            lists[key] = several
        dropped += empty
    return CaptionTable.of(out, lists, dropped)


def load_captions(url: str, storage_options: dict[str, Any] | None = None) -> CaptionTable:
    """``--captions URL``: a caption table (:func:`load_caption_table`), or an ANNOTATIONS folder (it holds
    ``_annotations.json``): its generated captions, keyed by filename, to add to the originals; or, from
    ``bucketeer review``'s decisions, the edited captions, which replace the sample's captions. Raises
    UsageError for annotations without a caption task."""
    from manifests.annotations import is_annotations, read_annotations

    if not is_annotations(url, storage_options):
        return load_caption_table(url, storage_options)
    meta, rows, _ = read_annotations(url, storage_options)
    if meta.task("review") is not None:  # a person's edited captions replace the sample's captions
        names = rows.column("filename").to_pylist()
        texts = [normalise_caption(t) for t in rows.column("caption").to_pylist()]
        return CaptionTable.of({n: t for n, t in zip(names, texts) if t is not None})
    if meta.task("caption") is None or "caption" not in rows.column_names:
        raise UsageError(f"--captions {redact(url)}: these annotations have no generated captions "
                         f"(tasks: {', '.join(t.task for t in meta.tasks)}); run `bucketeer annotate --task caption`")
    names = rows.column("filename").to_pylist()
    texts = [normalise_caption(t) for t in rows.column("caption").to_pylist()]
    return CaptionTable.of({n: t for n, t in zip(names, texts) if t is not None}, generated=True)
