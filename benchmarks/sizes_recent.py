"""The families of mid-2026 at real size on the meta device: parameters, bytes per caption and per sample.

    python benchmarks/text_bytes.py        # prints this table after the others (text_bytes-recent.json)

ERNIE-Image, Qwen-Image 2.1, Krea 2, LongCat-Image, Anima and Kandinsky 5 (T2I) (docs/families-mid-2026.md). No
weights: the text encoder and VAE are :func:`benchmarks.gpu_models.real_encoders`' (the classes each pipeline loads,
from :mod:`benchmarks.real_configs`; ERNIE-Image's Pixtral tower, whose config is unknown, transformers' default),
the other text models :func:`benchmarks.gpu_models.real_text_parts`' (Anima's LLM adapter, Kandinsky 5's CLIP-L) and
the transformer the family's real config, built on the ``meta`` device and counted. "As run": the text encoder as
``embed`` loads it (the class the declaration names, pruned by the family's ``prune``: no vision tower, no LM head,
no layer past the last one read), through :func:`pipeline.embed.memory.text_encoder_bytes`, the figure embed checks
against the GPU's free memory, plus the other text models, which embed runs too.

Per caption, for a caption of ``tokens`` tokens: the rows bucketeer stores (bf16; the declaration's ``rows``: the
caption's real rows where the transformer reads a mask or lengths, all of them where it reads the padding) against
what the pipeline's ``encode_prompt`` returns for that caption alone, saved in fp32 (the alternative cache), with
its mask where it returns one. The rows, from each pipeline's template (docs/families-mid-2026.md):

- ERNIE-Image: the caption's tokens, 3072 wide; ``encode_prompt`` returns the same rows (a list, no padding).
- Qwen-Image 2.1: ``<|im_start|>user\\n`` (3) + the caption + the 5 closing tokens, 4096 wide; ``encode_prompt`` of
  one prompt is those rows (its mask None).
- Krea 2: the caption + the 5 suffix tokens, 12 hidden states x 2560 side by side; ``encode_prompt`` returns all
  512 rows ``(512, 12, 2560)`` and a bool mask.
- LongCat-Image: all 512 rows, 3584 wide, whatever the caption (the transformer reads the padding);
  ``encode_prompt`` the same 512 rows.
- Anima: one row per T5 token (``</s>`` included) of the LLM adapter's output, 1024 wide; the pipeline hands its
  transformer those rows zero-padded to 512 (the conditioning step's ``prompt_embeds``).
- Kandinsky 5 (T2I): the caption + the closing ``<|im_end|>`` (its 40 prefix tokens dropped), 3584 wide, and
  CLIP-L's pooled 768; ``encode_prompt`` returns the same rows, the pooled vector and the row counts.

``gzip(noise)``: the stored record of that shape filled with Normal(0, 1) bf16 values (a stand-in for real
activations); latents: a 1024x1024 sample's, bf16, as the cache stores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from benchmarks.real_configs import ANIMA_TRANSFORMER, ERNIE_IMAGE, KANDINSKY5_T2I, KREA2_TRANSFORMER, LONGCAT_IMAGE
from benchmarks.real_configs import QWEN_IMAGE21_TRANSFORMER

__all__ = ["FAMILIES", "recent_sizes"]


@dataclass(frozen=True)
class RecentFamily:
    """One family's shapes: its transformer (diffusers class, kwargs), text rows for a caption of ``n`` tokens,
    the stored width, the rows ``encode_prompt`` returns for it (and whether with a mask), its 1024² latent
    ``(C, h, w)`` and its pooled vector's width."""

    family: str
    transformer: tuple[str, dict[str, Any]]
    rows: Callable[[int], int]
    width: int
    output_rows: Callable[[int], int]
    output_mask: bool
    latent: tuple[int, int, int]
    pooled: int = 0  # a pooled vector stored beside the rows (and returned by encode_prompt)


FAMILIES = [
    RecentFamily("ernie-image", ("ErnieImageTransformer2DModel", ERNIE_IMAGE), lambda n: n, 3072, lambda n: n, False,
                 (128, 64, 64)),
    RecentFamily("qwen-image-2.1", ("QwenImage21Transformer2DModel", QWEN_IMAGE21_TRANSFORMER), lambda n: 3 + n + 5,
                 4096, lambda n: 3 + n + 5, False, (64, 64, 64)),
    RecentFamily("krea-2", ("Krea2Transformer2DModel", KREA2_TRANSFORMER), lambda n: n + 5, 12 * 2560,
                 lambda n: 512, True, (16, 128, 128)),
    RecentFamily("longcat-image", ("LongCatImageTransformer2DModel", LONGCAT_IMAGE), lambda n: 512, 3584,
                 lambda n: 512, False, (16, 128, 128)),
    RecentFamily("anima", ("CosmosTransformer3DModel", ANIMA_TRANSFORMER), lambda n: n + 1, 1024, lambda n: 512,
                 False, (16, 128, 128)),
    RecentFamily("kandinsky-5", ("Kandinsky5Transformer3DModel", KANDINSKY5_T2I), lambda n: n + 1, 3584,
                 lambda n: n + 1, False, (16, 128, 128), pooled=768),
]  # fmt: skip


def _parameters(family: str) -> dict[str, int]:
    """Parameter counts of ``family`` at real size on the meta device: text models as published and as embed runs
    them, transformer, VAE."""
    import diffusers
    import torch

    from benchmarks.gpu_models import real_encoders, real_text_parts, text_tokenizer
    from manifests.families import SPECS
    from pipeline.embed.families import get_family
    from pipeline.embed.families.tiny import tiny_pipeline
    from pipeline.embed.memory import parameter_count, text_encoder_bytes

    f = next(f for f in FAMILIES if f.family == family)
    pipe = tiny_pipeline(family)
    with torch.device("meta"):
        text, vae = real_encoders(family, text_tokenizer(pipe))
        parts = sum(parameter_count(m) for m in real_text_parts(family, pipe).values())
        transformer = parameter_count(getattr(diffusers, f.transformer[0])(**f.transformer[1]))
    run = text_encoder_bytes(SPECS[family].text.encoders[0].cls, text.config, get_family(family).prune,
                             torch.bfloat16) // 2  # fmt: skip
    return {"text": parameter_count(text) + parts, "text_run": run + parts, "transformer": transformer,
            "vae": parameter_count(vae)}


def recent_sizes(tokens: int, rng: np.random.Generator, run: Any = None) -> list[dict[str, Any]]:
    """Print the table (and return its rows) for a caption of ``tokens`` tokens (module docstring); each figure is
    also added to ``run`` (a :class:`benchmarks.results.Run`) when one is given."""
    import warnings

    from manifests.cache import TextLayout
    from manifests.cache.records import TextRecord, encode_text
    from manifests.families import SPECS

    warnings.filterwarnings("ignore", category=FutureWarning)  # diffusers' deprecation notes, not figures

    def bf16(shape) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    print(f"\n{'family (real size, meta device)':32s} {'text enc.':>10s} {'as run':>9s} {'transformer':>11s} "
          f"{'VAE':>6s} {'rows':>5s} {'bf16/caption':>13s} {'gzip(noise)':>12s} {'encode_prompt fp32':>19s} "
          f"{'ratio':>6s} {'latent/1024²':>13s}")  # fmt: skip
    out = []
    for f in FAMILIES:
        p = _parameters(f.family)
        rows, masked = f.rows(tokens), SPECS[f.family].text.rows == "real"
        length = SPECS[f.family].text.max_tokens(None) or rows
        layout = TextLayout(f.family, "features", masked, (length,), (f.width,), f.pooled or None)
        record = TextRecord(0, (bf16((rows, f.width)),), bf16((f.pooled,)) if f.pooled else None, "BF16")
        assert layout.check(record) is None
        stored = 2 * (rows * f.width + f.pooled)
        output = 4 * (f.output_rows(tokens) * f.width + f.pooled) + (f.output_rows(tokens) if f.output_mask else 0)
        s = {"family": f.family, **p, "rows": rows, "stored": stored, "gzip": len(encode_text(record)),
             "encode_prompt": output, "latent": 2 * int(np.prod(f.latent))}  # fmt: skip
        out.append(s)
        name = f"{f.family} ({tokens}-token caption)"
        print(f"{name:32s} {p['text'] / 1e9:>9.2f}B {p['text_run'] / 1e9:>8.2f}B {p['transformer'] / 1e9:>10.2f}B "
              f"{p['vae'] / 1e6:>5.0f}M {rows:>5d} {stored:>13,d} {s['gzip']:>12,d} {output:>19,d} "
              f"{output / stored:>5.1f}x {s['latent']:>13,d}")  # fmt: skip
        if run is None:
            continue
        for key, label, unit in (("text", "text encoder, published", "B params"),
                                 ("text_run", "text encoder as embed runs it", "B params"),
                                 ("transformer", "transformer", "B params"), ("vae", "VAE", "M params")):
            run.add(f"{f.family}: {label}", p[key] / (1e6 if unit[0] == "M" else 1e9), unit)
        run.add(f"{name}: record (bf16, {rows} rows x {f.width})", stored, "B")
        run.add(f"{name}: gzip(noise)", s["gzip"], "B")
        run.add(f"{name}: encode_prompt output, fp32", output, "B")
        run.add(f"{name}: encode_prompt / record", output / stored, "x")
        run.add(f"{f.family}: latent per sample, 1024², bf16", s["latent"], "B")
    return out
