"""How a cached text record becomes a model family's prompt embeddings: the ``text.layout`` contract.

A text record (:class:`~manifests.cache.records.TextRecord`) holds ``tokens``, one array per
**part**, and ``pooled``. ``_cache.json``'s ``text.layout`` (a :class:`TextLayout`; a cache's is
:attr:`manifests.cache.CacheMeta.text_layout`) says what the
parts are and how they join into what the family's diffusers pipeline returns from
``encode_prompt``, so a trainer rebuilds that output from the cache alone, without text encoders:

- ``join = "features"``: the parts side by side on the feature axis, ``(L, sum(widths))``.
  SDXL: CLIP-L and CLIP-G penultimate states, both 77 long, ``(77, 768 + 1280)``; Flux and PixArt
  have one part (T5), so the "join" is that part.
- ``join = "sequence"`` (SD3): every part but the last side by side on features, zero-padded to
  the last part's width, then followed on the sequence axis by the last part:
  ``cat([pad(cat([clip_l, clip_g], -1), 4096), t5], dim=-2)``, ``(77 + 256, 4096)``.
- ``masked = False``: each part is stored **padded** to its length in ``lengths`` (the pad
  positions of CLIP and of an unmasked T5 are computed states that the model conditions on), and
  there is no attention mask. ``masked = True`` (PixArt, and the generic layout): only the real
  tokens are stored (``rows <= length``); the model takes an attention mask, so the pad rows are
  zeros and the mask is 1 on the stored rows.
- ``join = "streams"`` (HunyuanVideo 1.5), always masked: each part is its own input to the model, with its own
  mask (Qwen2.5-VL's states and glyph ByT5's). :meth:`TextLayout.prompt_embeds` puts them side by side on the
  feature axis as ``features`` does, and the mask has one column per part, ``(B, L, parts)``; a recipe cuts
  part ``i`` out as ``embeds[..., cols_i][:, :lengths[i]]`` with ``mask[..., i]`` (:meth:`TextLayout.streams`).
- ``pooled``: ``(pooled_dim,)`` or absent; ``pooled_source`` says where it comes from (SDXL: CLIP-G's
  projection; SD3: CLIP-L's and CLIP-G's projections concatenated; Flux: CLIP-L's pooler output).

:meth:`TextLayout.prompt_embeds` does the joining for a batch; :meth:`TextLayout.check` is what
``bucketeer verify`` asks of every text record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from manifests.cache.records import TextRecord, to_float32
from manifests.errors import UsageError

__all__ = ["TextLayout", "JOINS"]

JOINS = ("features", "sequence", "streams")


@dataclass(frozen=True)
class TextLayout:
    """The parts of a family's text records and how they join (see the module docstring).

    ``lengths[i]`` / ``widths[i]``: part ``i``'s sequence length (padded parts have exactly this many
    rows, masked ones at most) and feature width. ``pooled_dim``: None when records have no pooled.
    """

    family: str
    join: str
    masked: bool
    lengths: tuple[int, ...]
    widths: tuple[int, ...]
    pooled_dim: int | None = None
    pooled_source: str | None = None

    def __post_init__(self) -> None:
        assert self.join in JOINS and len(self.lengths) == len(self.widths) >= 1, self
        assert not (self.masked and self.join == "sequence"), "no family masks a sequence join"
        assert self.masked or self.join != "streams", "streams are masked, each by its own mask"
        if self.join == "sequence":
            assert sum(self.widths[:-1]) <= self.widths[-1], "sequence join: the last part must be the widest"

    @property
    def width(self) -> int:
        """D of the joined embeddings ``(L, D)``: what a model's text input width must be."""
        return self.widths[-1] if self.join == "sequence" else sum(self.widths)

    @property
    def length(self) -> int:
        """L of the joined embeddings of one caption (masked layouts: the most it can be)."""
        if self.join != "sequence":
            return max(self.lengths)
        return max(self.lengths[:-1]) + self.lengths[-1]

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "join": self.join, "masked": self.masked, "lengths": list(self.lengths),
                "widths": list(self.widths), "pooled_dim": self.pooled_dim, "pooled_source": self.pooled_source,
                "width": self.width, "length": self.length, "recipe": self.recipe()}  # fmt: skip

    @classmethod
    def from_json(cls, layout: dict[str, Any]) -> "TextLayout":
        """Inverse of :meth:`to_json` (``width``, ``length`` and ``recipe`` are derived, not read)."""
        try:
            return cls(family=str(layout["family"]), join=str(layout["join"]), masked=bool(layout["masked"]),
                       lengths=tuple(int(n) for n in layout["lengths"]), widths=tuple(int(d) for d in layout["widths"]),
                       pooled_dim=None if layout.get("pooled_dim") is None else int(layout["pooled_dim"]),
                       pooled_source=layout.get("pooled_source"))  # fmt: skip
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            raise UsageError(f"_cache.json text.layout is malformed ({type(e).__name__}: {e}); "
                             "re-embed with this bucketeer") from None  # fmt: skip

    def recipe(self) -> str:
        """One line saying how the parts join, for people reading ``_cache.json``."""
        parts = [f"tokens.{i} ({'<=' if self.masked else ''}{n}, {d})"
                 for i, (n, d) in enumerate(zip(self.lengths, self.widths))]  # fmt: skip
        if self.join == "streams":
            return f"prompt_embeds_<i> = {', '.join(parts)}, each zero-padded to its length with its own mask"
        if self.join == "features":
            how = parts[0] if len(parts) == 1 else f"cat([{', '.join(parts)}], dim=-1)"
        else:
            how = f"cat([pad(cat([{', '.join(parts[:-1])}], dim=-1), to width {self.widths[-1]}), {parts[-1]}], dim=-2)"
        if self.masked:
            how += "; zero rows past each part's tokens, attention mask 1 on the stored rows"
        return f"prompt_embeds ({self.length}, {self.width}) = {how}"

    def check(self, record: TextRecord) -> str | None:
        """What is wrong with ``record`` for this layout (None when nothing is): parts, shapes."""
        shapes = [tuple(t.shape) for t in record.tokens]
        if len(shapes) != len(self.widths) or any(len(s) != 2 for s in shapes):
            return f"text parts {shapes} != the layout's {len(self.widths)} parts of widths {list(self.widths)}"
        for i, ((rows, width), length, want) in enumerate(zip(shapes, self.lengths, self.widths)):
            if width != want:
                return f"text part {i} is {width} wide, the layout says {want}"
            if rows > length or (not self.masked and rows != length):
                return f"text part {i} has {rows} rows, the layout says {'at most ' if self.masked else ''}{length}"
        pooled = None if record.pooled is None else tuple(record.pooled.shape)
        if pooled != (None if self.pooled_dim is None else (self.pooled_dim,)):
            return f"pooled shape {pooled} != ({self.pooled_dim},)"
        return None

    def prompt_embeds(
        self, texts: Sequence[TextRecord], pad_to: int | None = None, widen: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Join a batch of text records: ``(embeds (B, L, D), mask (B, L), pooled (B, P) or None)``, float32.

        Unmasked layouts give exactly the family pipeline's ``encode_prompt`` output, mask all ones.
        Masked layouts pad to ``pad_to`` rows (default: the batch's longest part), zeros past each
        part's tokens, mask 1 where any part has a token; ``streams``: the mask is ``(B, L, parts)``, column ``i``
        1 on part ``i``'s tokens (:meth:`streams` splits them). ``widen=False``: ``embeds`` and ``pooled``
        stay in the records' stored dtype (BF16 as uint16 bits; zero bits are 0.0 in every float
        format), which must then be one for the batch (else AssertionError). Raises ValueError for a
        record that does not fit the layout (see :meth:`check`).
        """
        for record in texts:
            problem = self.check(record)
            if problem:
                raise UsageError(f"text record {record.caption_key}: {problem}; run `bucketeer verify`")
        rows = [[t.shape[0] for t in r.tokens] for r in texts]
        if widen:
            parts = [[to_float32(t, r.dtype) for t in r.tokens] for r in texts]
            out = np.dtype(np.float32)
        else:
            assert len({r.dtype for r in texts}) == 1, "one stored text dtype per batch, or widen"
            parts = [list(r.tokens) for r in texts]
            out = parts[0][0].dtype
        if self.join != "sequence":
            length = max(max(n) for n in rows) if self.masked else self.length
            length = max(length, pad_to or 0)
            embeds = np.zeros((len(texts), length, self.width), out)  # (B, L, D)
            streams = self.join == "streams"
            mask = np.zeros((len(texts), length, len(self.widths)) if streams else (len(texts), length), np.float32)
            for b, record_parts in enumerate(parts):
                col = 0
                for i, part in enumerate(record_parts):
                    embeds[b, : len(part), col : col + part.shape[1]] = part
                    if streams:
                        mask[b, : len(part), i] = 1.0
                    else:
                        mask[b, : len(part)] = 1.0
                    col += part.shape[1]
        else:  # sequence: the features of all but the last part, zero-padded to its width, then the last
            head = max(self.lengths[:-1])
            embeds = np.zeros((len(texts), self.length, self.width), out)  # (B, L, D)
            for b, record_parts in enumerate(parts):
                col = 0
                for part in record_parts[:-1]:
                    embeds[b, :head, col : col + part.shape[1]] = part
                    col += part.shape[1]
                embeds[b, head:] = record_parts[-1]
            mask = np.ones(embeds.shape[:2], np.float32)
        pooled = None
        if self.pooled_dim is not None:
            pooled = np.stack([to_float32(r.pooled, r.dtype) if widen else r.pooled for r in texts])  # (B, P)
        return embeds, mask, pooled

    def streams(self, embeds: Any, mask: Any) -> list[tuple[Any, Any]]:
        """A ``streams`` layout's joined batch (:meth:`prompt_embeds`: ``(B, L, D)``, mask ``(B, L, parts)``; numpy or
        torch) as one ``(embeds (B, lengths[i], widths[i]), mask (B, lengths[i]))`` per part, each zero-padded (or
        cut: past a part's length every row is a pad) to its layout length: what the family's pipeline passes."""
        assert self.join == "streams", self.join
        out, col = [], 0
        for i, (length, width) in enumerate(zip(self.lengths, self.widths)):
            part, keep = embeds[:, :length, col : col + width], mask[:, :length, i]
            pad = length - part.shape[1]
            if pad:
                part = _pad_rows(part, pad)
                keep = _pad_rows(keep[..., None], pad)[..., 0]
            out.append((part, keep))
            col += width
        return out


def _pad_rows(x: Any, n: int) -> Any:
    """``x`` (B, L, D), numpy or torch, with ``n`` zero rows appended on axis 1."""
    if isinstance(x, np.ndarray):
        return np.concatenate([x, np.zeros((x.shape[0], n, x.shape[2]), x.dtype)], axis=1)
    import torch

    return torch.cat([x, x.new_zeros(x.shape[0], n, x.shape[2])], dim=1)
