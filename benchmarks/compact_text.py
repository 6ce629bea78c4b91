"""Compact text records (``encode_text(..., compact="fp8")``): bytes per caption and the denoiser's error.

    python benchmarks/compact_text.py [--caption-tokens 120] [--blocks 1] [--batch 4] [--rounds 3]

One run, side by side, saved through :mod:`benchmarks.results` as ``results/compact_text.json``:

1. **Speed** on a FLUX.2-dev-sized part (512 x 15360 float32): :func:`manifests.cache.compact.quantize_e4m3`
   per row and per channel, against what the same record costs the codec exactly (``encode_text`` of the bf16
   record, and plain ``gzip -6`` of its safetensors bytes), and the compact record's encode and decode.
2. **The codes' entropy coder**: the float8 codes of a FLUX.2-dev caption (a left-padded prompt: zero rows)
   deflated Huffman-only, run-length only (``Z_RLE``), deflate levels 1 and 6, and stored: bytes, encode
   and inflate (ISA-L) times.
3. **Bytes per caption** of every family at its real widths and lengths (:mod:`benchmarks.real_configs`,
   :mod:`benchmarks.text_bytes`), through the record codec: exact bf16 against fp8 per row and per channel,
   and the relative error of the text itself (``||x' - x|| / ||x||`` against float32; bf16's beside it).
4. **The denoiser's error**: ``||pred(text') - pred(text)|| / ||pred(text)||`` of the family's transformer for a
   batch of captions of different lengths, text' = fp8 per row, fp8 per channel, and bf16, each against float32
   text (and fp8 against bf16), at one noise level (sigma 0.5); the pooled vector stays float32 in each (the
   compact modes keep it as stored; "bf16 record" rounds it too); and, as a second yardstick, the same
   transformer run in bf16 (weights and inputs, as training runs it) on float32 text against fp32. On (a) the
   tiny random model of the family (:mod:`pipeline.embed.families.tiny`) with its tiny encoders' real outputs,
   and (b) a random transformer of the
   real model's widths and heads with ``--blocks`` blocks of each kind (a real FLUX.2-dev, 32B parameters, does
   not fit this machine's 24 GB) fed the stand-in text at the real width.

**The stand-in.** No weights are downloaded, so real hidden states are not available. Normal noise is not what
LLM and T5 hidden states look like: they have a few channels tens of times larger than the rest on every token
(outlier features, Dettmers et al. 2022, LLM.int8()) and a couple of channels with values in the thousands on the
first token (massive activations, Sun et al. 2024). The stand-in (:func:`hidden_states`) is Normal(0, 1) times a
log-normal scale per channel (sigma 0.5), 6 channels x30, 2 channels of the first row set to +-1500; FLUX.2's
three stacked layers with gains 1, 2, 4. Padding follows what the tiny encoders show: FLUX.2-dev's Mistral pads
on the left and its pad rows come out as zero rows (measured on the tiny Mistral 3 here, printed); T5's, CLIP's
and Qwen's (right) pad rows are hidden states like the others. Masked families store only their real rows.
The tiny encoders' outputs (section 4a) are real outputs of the real classes, with random weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.results import Run  # noqa: E402
from benchmarks.real_configs import FLUX2_TRANSFORMER, QWEN_IMAGE  # noqa: E402
from manifests.cache import TextLayout  # noqa: E402
from manifests.cache.codec import encode_tensors, gzip_compress, gzip_decompress  # noqa: E402
from manifests.cache.compact import quantize_e4m3  # noqa: E402
from manifests.cache.records import TextRecord, decode_text, encode_text, to_float32  # noqa: E402

MODES = ("fp8-row", "fp8-channel")
SIGMA = 0.5
FLUX2_TEMPLATE = 40  # rows of Mistral's chat template and FLUX.2's system message around a caption (~35 + 5)
BATCH_CAPTIONS = (100, 160, 230, 300)  # caption tokens of the denoiser batch (cut to each family's length)


def hidden_states(rng: np.random.Generator, rows: int, width: int, layers: int = 1) -> np.ndarray:
    """``(rows, layers * width)`` float32 LLM-like hidden states (the module docstring's stand-in)."""
    out = []
    for k in range(layers):
        gain = np.float32(2.0**k)
        scale = rng.lognormal(0.0, 0.5, width).astype(np.float32)  # (width,)
        scale[rng.choice(width, 6, replace=False)] *= 30  # outlier features: on every token
        h = rng.standard_normal((rows, width), dtype=np.float32) * scale * gain  # (rows, width)
        if rows:
            h[0, rng.choice(width, 2, replace=False)] = gain * 1500 * rng.choice([-1, 1], 2)  # massive: first token
        out.append(h)
    return np.concatenate(out, axis=1)


def bf16(x: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) of float32 ``x``, rounded to nearest even (torch's and the embed job's rounding)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(
        np.uint16)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _median_seconds(fn: Callable[[], Any], repeat: int = 5) -> float:
    fn()  # warm: page faults of the first pass are not the marginal cost
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def variants(record: TextRecord) -> dict[str, TextRecord]:
    """A float32 record as a reader gets it back: exactly (``fp32``); from a bf16 record, its tokens only
    (``bf16``: the pooled vector kept float32, as the compact modes keep it) and whole (``bf16 record``); from
    each compact mode (quantized from the encoder's float32, as a worker holding float32 does)."""
    exact = TextRecord(record.caption_key, tuple(record.tokens), record.pooled, "F32")
    stored = decode_text(encode_text(TextRecord(record.caption_key, tuple(bf16(t) for t in record.tokens),
                                                None if record.pooled is None else bf16(record.pooled), "BF16")))
    tokens = tuple(to_float32(t, stored.dtype) for t in stored.tokens)
    out = {"fp32": exact, "bf16": TextRecord(record.caption_key, tokens, record.pooled, "F32"),
           "bf16 record": stored}  # fmt: skip
    for mode in MODES:
        out[mode] = decode_text(encode_text(exact, compact=mode))
    return out


# ---------------------------------------------------------------- 1. speed, 2. the codes' coder


def speed(run: Run) -> None:
    rng = np.random.default_rng(1)
    x = np.zeros((512, 15360), np.float32)
    x[512 - (FLUX2_TEMPLATE + 300):] = hidden_states(rng, FLUX2_TEMPLATE + 300, 5120, 3)  # a 300-token caption
    exact = TextRecord(0, (bf16(x),), None, "BF16")
    wide = TextRecord(0, (x,), None, "F32")
    compact, enc = encode_text(wide, compact="fp8"), encode_text(exact)
    rows = {
        "quantize_e4m3, per row": lambda: quantize_e4m3(x, 1),
        "quantize_e4m3, per channel": lambda: quantize_e4m3(x, 0),
        "encode_text, exact bf16 record": lambda: encode_text(exact),
        "gzip -6 of the bf16 record's safetensors bytes": lambda: gzip_compress(
            encode_tensors({"tokens.0": (exact.tokens[0], "BF16")}, {})),
        "encode_text, compact fp8 (per row), from float32": lambda: encode_text(wide, compact="fp8"),
        "decode_text, exact bf16 record": lambda: decode_text(enc),
        "decode_text, compact record (dequantized to float32)": lambda: decode_text(compact),
    }
    print(f"\n1. speed on a FLUX.2-dev part (512 x 15360, a 300-token caption), median of 5, "
          f"{os.cpu_count()} cores")  # fmt: skip
    for name, fn in rows.items():
        s = _median_seconds(fn)
        print(f"  {name:58s} {s * 1e3:8.1f} ms")
        run.add(f"speed, FLUX.2-dev part 512x15360: {name}", s * 1e3, "ms")


def coders(run: Run, caption_tokens: int) -> None:
    rng = np.random.default_rng(2)
    real = FLUX2_TEMPLATE + caption_tokens
    x = np.zeros((512, 15360), np.float32)
    x[512 - real:] = hidden_states(rng, real, 5120, 3)
    print(f"\n2. the float8 codes of a FLUX.2-dev caption ({caption_tokens} tokens: {real} rows, {512 - real} zero "
          "pad rows), per coder")  # fmt: skip
    print(f"  {'granularity':12s} {'coder':14s} {'bytes':>11s} {'encode ms':>10s} {'inflate ms':>11s}")
    for axis, granularity in ((1, "per row"), (0, "per channel")):
        codes = quantize_e4m3(x, axis)[0].tobytes()
        for coder, (level, strategy) in {"huffman-only": (6, zlib.Z_HUFFMAN_ONLY), "rle": (6, zlib.Z_RLE),
                                         "deflate -1": (1, zlib.Z_DEFAULT_STRATEGY),
                                         "deflate -6": (6, zlib.Z_DEFAULT_STRATEGY),
                                         "stored": (0, zlib.Z_DEFAULT_STRATEGY)}.items():  # fmt: skip
            def deflate():
                c = zlib.compressobj(level, zlib.DEFLATED, 31, 9, strategy)
                return c.compress(codes) + c.flush()

            data = deflate()
            te, td = _median_seconds(deflate, 3), _median_seconds(lambda: gzip_decompress(data), 5)
            print(f"  {granularity:12s} {coder:14s} {len(data):>11,d} {te * 1e3:>10.1f} {td * 1e3:>11.1f}")
            name = f"codes of a FLUX.2-dev caption ({caption_tokens} tokens), {granularity}, {coder}"
            run.add(f"{name}: bytes", len(data), "B")
            run.add(f"{name}: encode", te * 1e3, "ms")
            run.add(f"{name}: inflate", td * 1e3, "ms")


# ---------------------------------------------------------------- 3. bytes per caption


def families(caption_tokens: int) -> list[tuple[str, list[tuple[int, int, int]], int | None, bool]]:
    """``(family, parts, pooled, zero_pad_left)``: each part ``(rows stored, real rows, width)``, pooled width (its
    values kept as stored), at the real models' widths and lengths for a ``caption_tokens``-token caption."""
    n = caption_tokens  # CLIP's 77 and T5's padded rows are all hidden states (pads too): stored whole
    return [
        ("sdxl", [(77, 77, 768), (77, 77, 1280)], 1280, False),
        ("sd3 (T5 256)", [(77, 77, 768), (77, 77, 1280), (256, 256, 4096)], 2048, False),
        ("flux (T5 512)", [(512, 512, 4096)], 768, False),
        ("chroma (T5 512, mask in pooled)", [(512, 512, 4096)], 512, False),
        ("pixart-alpha (T5 120, masked)", [(min(n + 1, 120),) * 2 + (4096,)], None, False),
        ("pixart-sigma (T5 300, masked)", [(min(n + 1, 300),) * 2 + (4096,)], None, False),
        (f"flux2 / FLUX.2-dev (512 x 3 x 5120, {n}-token caption)", [(512, FLUX2_TEMPLATE + n, 15360)], None, True),
        ("flux2 / FLUX.2-dev, 472-token caption (no pad row)", [(512, 512, 15360)], None, True),
        ("flux2-klein 4B (512 x 3 x 2560)", [(512, 512, 7680)], None, False),
        ("flux2-klein 9B (512 x 3 x 4096)", [(512, 512, 12288)], None, False),
        ("qwen-image (masked, caption + 5)", [(n + 5, n + 5, 3584)], None, False),
        ("qwen-image-edit (1024² reference, 20-token instruction)", [(1396, 1396, 3584)], None, False),
        ("z-image (masked, caption + 8)", [(n + 8, n + 8, 2560)], None, False),
        ("anima (LLM adapter's rows, masked, T5 tokens + 1)", [(n + 1, n + 1, 1024)], None, False),
        ("wan / wan2.2 (UMT5, masked, caption + 1)", [(n + 1, n + 1, 4096)], None, False),
        ("ltx-2 (Gemma 3 12B, 49 x 3840 stacked, masked)", [(n + 1, n + 1, 3840 * 49)], None, False),
        ("hunyuanvideo-1.5 (Qwen2.5-VL, masked; no glyph text)", [(n + 5, n + 5, 3584), (0, 0, 1472)], None, False),
    ]  # fmt: skip


def bytes_per_caption(run: Run, caption_tokens: int) -> None:
    print(f"\n3. bytes per caption at real widths, the stand-in text, a {caption_tokens}-token caption "
          "(masked families: their real rows)")  # fmt: skip
    print(f"  {'family':58s} {'exact bf16':>12s} {'fp8/row':>11s} {'fp8/chan':>11s} {'row/bf16':>9s} "
          f"{'err bf16':>9s} {'err row':>8s} {'err chan':>8s}")  # fmt: skip
    for f, (name, parts, pooled_dim, zero_left) in enumerate(families(caption_tokens)):
        rng = np.random.default_rng(100 + f)
        tokens = []
        for rows, real, width in parts:
            x = np.zeros((rows, width), np.float32)
            layers = 3 if width in (15360, 7680, 12288) else 1
            h = hidden_states(rng, real, width // layers, layers)
            if zero_left:
                x[rows - real:] = h
            else:
                x[:real] = h
            tokens.append(x)
        pooled = None if pooled_dim is None else rng.standard_normal(pooled_dim, dtype=np.float32)
        record = TextRecord(0, tuple(tokens), pooled, "F32")
        got = variants(record)
        sizes = {"bf16": len(encode_text(TextRecord(0, tuple(bf16(t) for t in tokens),
                                                    None if pooled is None else bf16(pooled), "BF16")))}
        for mode in MODES:
            sizes[mode] = len(encode_text(record, compact=mode))
        flat = np.concatenate([t.ravel() for t in tokens])
        errs = {k: _rel(np.concatenate([to_float32(t, got[k].dtype).ravel() for t in got[k].tokens]), flat)
                for k in ("bf16", *MODES)}  # fmt: skip
        print(f"  {name:58s} {sizes['bf16']:>12,d} {sizes['fp8-row']:>11,d} {sizes['fp8-channel']:>11,d} "
              f"{sizes['fp8-row'] / sizes['bf16']:>9.3f} {errs['bf16']:>9.2e} {errs['fp8-row']:>8.2e} "
              f"{errs['fp8-channel']:>8.2e}")  # fmt: skip
        for k in ("bf16", *MODES):
            run.add(f"bytes per caption: {name}, {k}", sizes[k], "B",
                    target="<= 8000000" if k == "fp8-row" and "FLUX.2-dev" in name else "")  # fmt: skip
            run.add(f"text error vs fp32: {name}, {k}", errs[k] * 1e6, "ppm")  # the tables print 2 decimals
        del got, record, tokens


# ---------------------------------------------------------------- 4. the denoiser


def _flux2_pred(model: Any, text: Any, mask: Any, pooled: Any, latents: Any) -> Any:
    import torch
    from diffusers import Flux2Pipeline

    b = latents.shape[0]
    guidance = torch.full((b,), 4.0) if model.config.guidance_embeds else None
    return model(hidden_states=Flux2Pipeline._pack_latents(latents), timestep=torch.full((b,), SIGMA),
                 guidance=guidance, encoder_hidden_states=text, txt_ids=Flux2Pipeline._prepare_text_ids(text),
                 img_ids=Flux2Pipeline._prepare_latent_ids(latents), return_dict=False)[0]  # fmt: skip


def _flux_pred(model: Any, text: Any, mask: Any, pooled: Any, latents: Any) -> Any:
    import torch
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    guidance = torch.full((b,), 3.5) if model.config.guidance_embeds else None
    return model(hidden_states=FluxPipeline._pack_latents(latents, b, c, h, w), timestep=torch.full((b,), SIGMA),
                 guidance=guidance, pooled_projections=pooled, encoder_hidden_states=text,
                 txt_ids=torch.zeros(text.shape[1], 3),
                 img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32),
                 return_dict=False)[0]  # fmt: skip


def _sd3_pred(model: Any, text: Any, mask: Any, pooled: Any, latents: Any) -> Any:
    import torch

    return model(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled,
                 timestep=torch.full((latents.shape[0],), SIGMA * 1000.0), return_dict=False)[0]  # fmt: skip


def _qwen_pred(model: Any, text: Any, mask: Any, pooled: Any, latents: Any) -> Any:
    import torch

    from train.recipes.qwen_image import model_inputs

    inputs = model_inputs(latents, text, mask)
    return model(**inputs, timestep=torch.full((latents.shape[0],), SIGMA), return_dict=False)[0]


# family -> (transformer class, forward, latent (C, h, w) fed to the real-width model)
DENOISERS = {
    "flux2": ("Flux2Transformer2DModel", _flux2_pred, (128, 16, 16)),
    "flux": ("FluxTransformer2DModel", _flux_pred, (16, 32, 32)),
    "sd3": ("SD3Transformer2DModel", _sd3_pred, (16, 32, 32)),
    "qwen-image": ("QwenImageTransformer2DModel", _qwen_pred, (16, 32, 32)),
}


def real_width(family: str, blocks: int) -> dict[str, Any]:
    """The keyword arguments of a random transformer with the real model's widths and heads, ``blocks`` deep."""
    if family == "flux2":
        return {**FLUX2_TRANSFORMER["dev"], "num_layers": blocks, "num_single_layers": blocks}
    if family == "flux":  # black-forest-labs/FLUX.1-dev transformer/config.json: 24 x 128 heads, 19 + 38 blocks
        return {"in_channels": 64, "num_layers": blocks, "num_single_layers": blocks, "attention_head_dim": 128,
                "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
                "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}  # fmt: skip
    if family == "sd3":  # stabilityai/stable-diffusion-3.5-large transformer/config.json: 38 x 64 heads, 38 blocks
        return {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": blocks, "attention_head_dim": 64,
                "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
                "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192,
                "qk_norm": "rms_norm"}  # fmt: skip
    assert family == "qwen-image", family
    return {**QWEN_IMAGE, "num_layers": blocks}


def real_layout(family: str) -> TextLayout:
    return {
        "flux2": TextLayout("flux2", "features", False, (512,), (15360,)),
        "flux": TextLayout("flux", "features", False, (512,), (4096,), 768),
        "sd3": TextLayout("sd3", "sequence", False, (77, 77, 256), (768, 1280, 4096), 2048),
        "qwen-image": TextLayout("qwen-image", "features", True, (512,), (3584,)),
    }[family]


def stand_in_records(family: str, layout: TextLayout, rng: np.random.Generator) -> list[TextRecord]:
    """A batch of float32 stand-in records of ``layout`` for captions of :data:`BATCH_CAPTIONS` tokens."""
    out = []
    for i, n in enumerate(BATCH_CAPTIONS):
        parts = []
        for length, width in zip(layout.lengths, layout.widths):
            layers = 3 if family == "flux2" else 1
            if layout.masked:
                parts.append(hidden_states(rng, min(n + 5, length), width // layers, layers))
            elif family == "flux2":  # left-padded: zero pad rows before the template and caption
                x = np.zeros((length, width), np.float32)
                real = min(FLUX2_TEMPLATE + n, length)
                x[length - real:] = hidden_states(rng, real, width // layers, layers)
                parts.append(x)
            else:
                parts.append(hidden_states(rng, length, width))
        pooled = None if layout.pooled_dim is None else rng.standard_normal(layout.pooled_dim, dtype=np.float32)
        out.append(TextRecord(i, tuple(parts), pooled, "F32"))
    return out


def denoiser_errors(model: Any, predict: Callable, layout: TextLayout, records: list[TextRecord],
                    latents: Any, bf16_compute: bool) -> dict[str, float]:  # fmt: skip
    """Relative prediction errors (module docstring) of ``model`` on ``records`` against float32 text; with
    ``bf16_compute``, also the model cast to bf16 (weights and inputs: how training runs it) on float32 text
    against itself in float32 (the model is left in bf16)."""
    import torch

    kinds = [variants(r) for r in records]
    preds = {}
    with torch.inference_mode():
        for k in ("fp32", "bf16", "bf16 record", *MODES):
            text, mask, pooled = layout.prompt_embeds([v[k] for v in kinds])
            preds[k] = predict(model, torch.from_numpy(text), torch.from_numpy(mask),
                               None if pooled is None else torch.from_numpy(pooled), latents).numpy()  # fmt: skip
        if bf16_compute:
            text, mask, pooled = layout.prompt_embeds([v["fp32"] for v in kinds])
            half = torch.bfloat16
            model.to(half)
            preds["bf16 compute"] = predict(model, torch.from_numpy(text).to(half), torch.from_numpy(mask),
                                            None if pooled is None else torch.from_numpy(pooled).to(half),
                                            latents.to(half)).float().numpy()  # fmt: skip
    out = {f"{k} vs fp32": _rel(preds[k], preds["fp32"]) for k in ("bf16", "bf16 record", *MODES)}
    out.update({f"{k} vs bf16": _rel(preds[k], preds["bf16"]) for k in MODES})
    out["bf16 compute vs fp32"] = _rel(preds["bf16 compute"], preds["fp32"]) if bf16_compute else float("nan")
    return out


def _report(run: Run, label: str, errors: dict[str, float], seconds: float) -> None:
    print(f"  {label:62s} " + " ".join(f"{errors[k]:>10.2e}" for k in COLUMNS) + f" {seconds:>6.0f} s")
    for k, v in errors.items():
        if not np.isnan(v):
            run.add(f"denoiser error, {label}: {k}", v * 1e6, "ppm")


COLUMNS = ("bf16 vs fp32", "fp8-row vs fp32", "fp8-channel vs fp32", "fp8-row vs bf16", "fp8-channel vs bf16",
           "bf16 record vs fp32", "bf16 compute vs fp32")


def tiny_denoisers(run: Run, folder: str) -> None:
    import diffusers
    import torch

    from pipeline.embed.encoders import encoder_specs
    from pipeline.embed.families.tiny import build_tiny
    from pipeline.embed.loading import quiet_loading

    words = "a photo of the red cat and the blue dog 0 1 2 3 picture shape".split()
    captions = [" ".join(words[(i + j) % len(words)] for j in range(n // 4)) for i, n in enumerate(BATCH_CAPTIONS)]
    for family, (cls, predict, _) in DENOISERS.items():
        t = time.perf_counter()
        path = build_tiny(family, os.path.join(folder, family))
        _, spec = encoder_specs(family=family, model=str(path), vae=None, vae_subfolder=None, text_encoders=None,
                                text_subfolders=None)  # fmt: skip
        quiet_loading()
        encoders = spec.load(dtype="F32")
        model = getattr(diffusers, cls).from_pretrained(str(path), subfolder="transformer").eval()
        records = [TextRecord(i, tuple(p.numpy() for p in tokens), None if pooled is None else pooled.numpy(), "F32")
                   for i, (tokens, pooled) in enumerate(encoders.encode(captions))]  # fmt: skip
        if family == "flux2":
            x = records[0].tokens[0]
            pads = int((np.abs(x).max(axis=1) == 0).sum())
            print(f"  (tiny Mistral 3, left-padded: {pads} of {len(x)} rows of the first caption are all zero)")
            run.add("tiny flux2 encoder: zero rows of the first caption (left padding)", pads)
        sizes = {"bf16": sum(len(encode_text(TextRecord(r.caption_key, tuple(bf16(t) for t in r.tokens),
                                                        None if r.pooled is None else bf16(r.pooled), "BF16")))
                             for r in records)}  # fmt: skip
        for mode in MODES:
            sizes[mode] = sum(len(encode_text(r, compact=mode)) for r in records)
        for k, v in sizes.items():
            run.add(f"tiny {family} encoder outputs, {len(records)} captions: bytes, {k}", v, "B")
        c, h, w = model.config.in_channels, 8, 8
        if family in ("flux", "qwen-image"):
            c, h, w = c // 4, 16, 16  # packed 2x2 by the pipeline
        torch.manual_seed(0)
        latents = torch.randn(len(records), c, h, w)
        rows = [r.lengths for r in records]
        errors = denoiser_errors(model, predict, encoders.layout, records, latents, bf16_compute=True)
        _report(run, f"{family}, tiny model, rows {rows[0]}..{rows[-1]}", errors, time.perf_counter() - t)
        print(f"    tiny records, {len(records)} captions: bf16 {sizes['bf16']:,d} B, fp8/row {sizes['fp8-row']:,d} B, "
              f"fp8/channel {sizes['fp8-channel']:,d} B")  # fmt: skip


def real_width_denoisers(run: Run, blocks: int, batch: int) -> None:
    import diffusers
    import torch

    for f, (family, (cls, predict, (c, h, w))) in enumerate(DENOISERS.items()):
        t = time.perf_counter()
        torch.manual_seed(f)
        model = getattr(diffusers, cls)(**real_width(family, blocks)).eval()
        params = sum(p.numel() for p in model.parameters())
        layout = real_layout(family)
        records = stand_in_records(family, layout, np.random.default_rng(200 + f))[:batch]
        latents = torch.randn(len(records), c, h, w)
        errors = denoiser_errors(model, predict, layout, records, latents, bf16_compute=True)
        label = f"{family}, real width, {blocks}+{blocks} blocks ({params / 1e9:.2f}B)" if family in (
            "flux2", "flux") else f"{family}, real width, {blocks} block(s) ({params / 1e9:.2f}B)"
        _report(run, label, errors, time.perf_counter() - t)
        del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caption-tokens", type=int, default=120, help="tokens of a typical caption (bytes table)")
    parser.add_argument("--blocks", type=int, default=1, help="blocks of each kind in the real-width transformers")
    parser.add_argument("--batch", type=int, default=4, help="captions in the real-width denoiser batch (<= 4)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the bytes and errors are the same in each)")
    parser.add_argument("--skip-real-width", action="store_true", help="leave out the real-width transformers")
    args = parser.parse_args()
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(os.cpu_count() or 1)
    run = Run("compact_text", "python benchmarks/compact_text.py" + "".join(f" {a}" for a in sys.argv[1:]),
              tools=["diffusers", "transformers"])  # fmt: skip
    for _ in range(args.rounds):
        with run.round():
            print(f"load before: {os.getloadavg()[0]:.2f}")
            speed(run)
            coders(run, args.caption_tokens)
            bytes_per_caption(run, args.caption_tokens)
            print("\n4. denoiser prediction error, sigma 0.5, relative L2 (text' vs text)")
            print(f"  {'model':62s} " + " ".join(f"{k:>10s}" for k in ("bf16/fp32", "row/fp32", "chan/fp32",
                                                                          "row/bf16", "chan/bf16", "bf16rec/32",
                                                                          "bf16 model")))  # fmt: skip
            print("  (bf16: the tokens rounded to bf16, the pooled vector kept; bf16rec: the pooled vector too; "
                  "bf16 model: fp32 text, the transformer and its inputs cast to bf16)")
            with tempfile.TemporaryDirectory() as folder:
                tiny_denoisers(run, folder)
            if not args.skip_real_width:
                real_width_denoisers(run, args.blocks, args.batch)
            print(f"load after: {os.getloadavg()[0]:.2f}")
    run.save()


if __name__ == "__main__":
    main()
