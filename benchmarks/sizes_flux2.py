"""Flux 2, Flux 2 Klein and Chroma at real size on the meta device: parameters, bytes per caption, one H100.

    python benchmarks/text_bytes.py        # prints this table after the other families'

No weights: each model is built from its published configuration on the ``meta`` device and its parameters
counted. The text encoder is counted twice: as published, and as ``embed`` runs it (the family's ``prune``:
the LLM's first layers up to the last hidden state read, no vision tower or language-model head), through
:func:`pipeline.embed.memory.text_encoder_bytes`, the function whose figure embed checks against the GPU's
free memory before it loads a weight. The configurations (``diffusers``/``transformers`` keyword arguments,
:mod:`benchmarks.real_configs`) are the published ``config.json`` values: FLUX.2-dev's and FLUX.2 [klein]'s
transformers as diffusers' ``scripts/convert_flux2_to_diffusers.py`` builds them, Mistral Small 3.1 24B (the
FLUX.2-dev text encoder), Qwen3-4B and Qwen3-8B (Klein 4B and 9B), T5-v1.1-XXL's encoder (Chroma), Flux.1's VAE
(Chroma) and the ``AutoencoderKLFlux2`` defaults (FLUX.2's VAE).

Per caption: what the cache stores (bf16, all 512 rows: every one is an input of the transformer; Chroma's
mask beside them) against ``encode_prompt``'s fp32 output (the prompt embeddings, Chroma's mask). What one
H100 (80 GB) holds is arithmetic on these counts: the embed text phase holds the pruned text encoder in
bf16 (a VAE worker that encodes captions no other sample shares holds it beside the VAE); training keeps
fp32 weights (the trainer's ``load_pretrained``), and a full fine-tune adds fp32 gradients and AdamW's two
moments (16 bytes a parameter before activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from benchmarks.real_configs import FLUX1_VAE, FLUX2_TRANSFORMER, MISTRAL_SMALL_31, QWEN3_4B, QWEN3_8B, T5_XXL

__all__ = ["FAMILIES", "family_sizes", "print_sizes"]

GB = 1e9
H100 = 80e9
TOKENS = 512

@dataclass(frozen=True)
class RealFamily:
    """One family at real size: its text encoder (class, config factory), transformer and VAE (class, kwargs),
    the stored text width, and the latent shape of a 1024² image."""

    name: str
    family: str  # the bucketeer family whose prune and layout apply
    text_class: str
    text_config: Callable[[], Any]
    transformer: tuple[str, dict[str, Any]]
    vae: tuple[str, dict[str, Any]]
    text_width: int
    mask: bool  # the record's pooled holds the transformer's text mask (Chroma)
    latent: tuple[int, int, int]  # (C, h, w) stored for 1024x1024 pixels


def _mistral():
    from transformers import Mistral3Config

    return Mistral3Config(**MISTRAL_SMALL_31)


def _qwen3(config: dict[str, Any]):
    from transformers import Qwen3Config

    return lambda: Qwen3Config(**config)


def _t5():
    from transformers import T5Config

    return T5Config(**T5_XXL)


FAMILIES = [
    RealFamily("FLUX.2-dev", "flux2", "Mistral3ForConditionalGeneration", _mistral,
               ("Flux2Transformer2DModel", FLUX2_TRANSFORMER["dev"]), ("AutoencoderKLFlux2", {}), 3 * 5120, False,
               (128, 64, 64)),
    RealFamily("FLUX.2 [klein] 4B", "flux2-klein", "Qwen3ForCausalLM", _qwen3(QWEN3_4B),
               ("Flux2Transformer2DModel", FLUX2_TRANSFORMER["klein-4b"]), ("AutoencoderKLFlux2", {}), 3 * 2560,
               False, (128, 64, 64)),
    RealFamily("FLUX.2 [klein] 9B", "flux2-klein", "Qwen3ForCausalLM", _qwen3(QWEN3_8B),
               ("Flux2Transformer2DModel", FLUX2_TRANSFORMER["klein-9b"]), ("AutoencoderKLFlux2", {}), 3 * 4096,
               False, (128, 64, 64)),
    RealFamily("Chroma1-HD", "chroma", "T5EncoderModel", _t5, ("ChromaTransformer2DModel", {}),
               ("AutoencoderKL", FLUX1_VAE), 4096, True, (16, 128, 128)),
]  # fmt: skip


def _diffusers_parameters(class_name: str, kwargs: dict[str, Any]) -> int:
    import diffusers
    import torch

    from pipeline.embed.memory import parameter_count

    with torch.device("meta"):
        return parameter_count(getattr(diffusers, class_name)(**kwargs))


def family_sizes(f: RealFamily) -> dict[str, Any]:
    """Parameter counts (meta device) and bytes of one family (see the module docstring)."""
    import torch

    from pipeline.embed.families import get_family
    from pipeline.embed.memory import text_encoder_bytes

    config = f.text_config()
    text_all = text_encoder_bytes(f.text_class, config, None, torch.float32) // 4
    text_run = text_encoder_bytes(f.text_class, config, get_family(f.family).prune, torch.bfloat16)
    transformer = _diffusers_parameters(*f.transformer)
    vae = _diffusers_parameters(*f.vae)
    stored = 2 * (TOKENS * f.text_width + (TOKENS if f.mask else 0))
    output = 4 * (TOKENS * f.text_width + (TOKENS if f.mask else 0))
    return {"text_params": text_all, "text_run_params": text_run // 2, "text_run_bytes": text_run,
            "transformer_params": transformer, "vae_params": vae, "stored": stored, "encode_prompt": output,
            "latent": 2 * int(np.prod(f.latent))}  # fmt: skip


def print_sizes(rng: np.random.Generator, run: Any = None) -> list[dict[str, Any]]:
    """Print the table (and return its rows): parameters, bytes per caption and per sample, one H100; each figure
    is also added to ``run`` (a :class:`benchmarks.results.Run`) when one is given."""
    import warnings

    from manifests.cache import TextLayout
    from manifests.cache.records import TextRecord, encode_text

    warnings.filterwarnings("ignore", category=FutureWarning)  # diffusers' deprecation notes, not figures

    def bf16(shape) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    print(f"{'family (real size, meta device)':22s} {'text enc.':>10s} {'as run':>9s} {'transformer':>11s} "
          f"{'VAE':>6s} {'bf16/caption':>13s} {'gzip(noise)':>12s} {'encode_prompt fp32':>19s} {'ratio':>6s} "
          f"{'latent/1024²':>13s}")  # fmt: skip
    rows = []
    for f in FAMILIES:
        s = family_sizes(f)
        layout = TextLayout(f.family, "features", False, (TOKENS,), (f.text_width,), TOKENS if f.mask else None)
        record = TextRecord(0, (bf16((TOKENS, f.text_width)),), bf16((TOKENS,)) if f.mask else None, "BF16")
        assert layout.check(record) is None
        s["gzip"] = len(encode_text(record))
        rows.append({"name": f.name, **s})
        print(f"{f.name:22s} {s['text_params'] / 1e9:>9.2f}B {s['text_run_params'] / 1e9:>8.2f}B "
              f"{s['transformer_params'] / 1e9:>10.2f}B {s['vae_params'] / 1e6:>5.0f}M {s['stored']:>13,d} "
              f"{s['gzip']:>12,d} {s['encode_prompt']:>19,d} {s['encode_prompt'] / s['stored']:>5.1f}x "
              f"{s['latent']:>13,d}")  # fmt: skip
        if run is not None:
            for key, label, unit in (("text_params", "text encoder, published", "B params"),
                                     ("text_run_params", "text encoder as embed runs it", "B params"),
                                     ("transformer_params", "transformer", "B params"),
                                     ("vae_params", "VAE", "M params")):
                run.add(f"{f.name}: {label}", s[key] / (1e6 if unit[0] == "M" else 1e9), unit)
            run.add(f"{f.name}: record (bf16, raw)", s["stored"], "B")
            run.add(f"{f.name}: gzip(noise)", s["gzip"], "B")
            run.add(f"{f.name}: encode_prompt output, fp32", s["encode_prompt"], "B")
            run.add(f"{f.name}: encode_prompt / record", s["encode_prompt"] / s["stored"], "x")
            run.add(f"{f.name}: latent per sample, 1024², bf16", s["latent"], "B")
    print("\none H100 (80 GB), from the parameter counts (weights only, before activations):")
    for r in rows:
        text, t = r["text_run_bytes"], r["transformer_params"]
        if run is not None:
            run.add(f"{r['name']}: embed text phase, bf16", text / GB, "GB")
            for what, per in (("fp32 weights", 4), ("full fine-tune with AdamW", 16)):
                run.add(f"{r['name']}: training, transformer {what}", per * t / GB, "GB")
        print(f"  {r['name']:20s} embed text phase {text / GB:5.1f} GB bf16 ({'fits' if text < H100 else 'no'}); "
              f"training: fp32 weights {4 * t / GB:5.1f} GB ({'fits' if 4 * t < H100 else 'does not fit'}), "
              f"full fine-tune with AdamW {16 * t / GB:5.1f} GB ({'fits' if 16 * t < H100 else 'shard: FSDP'})")
    return rows
