"""Text encoders batched by token length on a GPU (``Family.count_tokens``): the rows of a caption padded to
``max_tokens`` up to float32 rounding, with the padding the pipeline computes and drops left out. On the CPU the
records stay the pipeline's bit for bit (``tests/test_families*.py``): grouping is for the GPU only."""

from __future__ import annotations

import pytest
import torch

from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families.base import PAD_STEP
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.loading import quiet_loading

# short, long (past PixArt-alpha's 120 tokens: truncated), empty, unicode, one word: several length groups
CAPTIONS = ["a photo of the cat", "red dog running on a beach at sunset " * 12, "", "naïve café 漢字 🙂",
            "thing", "two birds on a wire above a quiet street in the rain, film grain, wide shot " * 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-by-length")
    return {f: str(build_tiny(f, base / f)) for f in ("z-image", "wan", "pixart")}


@pytest.mark.parametrize("family", ["z-image", "wan", "pixart"])
def test_length_groups_give_the_rows_of_full_padding_and_compute_less_of_it(tiny, family, monkeypatch):
    _, spec = encoder_specs(family=family, model=tiny[family], vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    enc = spec.load(use_gpu=False, dtype="F32")
    (model,) = enc.models
    limit = int(enc.options.max_tokens)
    full = enc._plain(CAPTIONS, enc.options)  # every caption padded to max_tokens, as the pipeline pads it
    seen: list[tuple[int, int]] = []
    forward = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, ids, **kw: seen.append(tuple(ids.shape))
                        or forward(self, ids, **kw))  # fmt: skip
    assert enc.encode(CAPTIONS)[1][0][0].shape == full[1][0][0].shape and seen == [(len(CAPTIONS), limit)]
    seen.clear()  # on the CPU: one batch padded to max_tokens, as the pipeline pads it; on a GPU, in groups:
    monkeypatch.setattr(enc, "device", torch.device("cuda"))
    monkeypatch.setattr(enc, "_plain", lambda captions, options: type(enc)._plain(enc, captions, options))
    grouped = enc.encode(CAPTIONS)
    for caption, (a, _), (b, _) in zip(CAPTIONS, full, grouped):
        assert a[0].shape == b[0].shape, (family, caption[:20])
        err = float((a[0] - b[0]).abs().max() / a[0].abs().max())
        assert err <= 4 * torch.finfo(torch.float32).eps, (family, caption[:20], err)  # an ulp or so, at most
    assert enc.rows(CAPTIONS) == [(a[0].shape[0],) for a, _ in full]  # counted by the tokenizer alone
    assert all(n == limit or n % PAD_STEP == 0 for _, n in seen) and len(seen) > 1  # several groups
    assert sum(b * n for b, n in seen) < len(CAPTIONS) * limit  # the padding not computed
    assert sum(torch.equal(a[0], b[0]) for (a, _), (b, _) in zip(full, grouped)) >= len(CAPTIONS) - 2
