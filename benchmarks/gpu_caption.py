"""The caption engine at real size (issue 55): Qwen2.5-VL-7B-Instruct's shape, random weights, through bucketeer's
transformers engine; the ``caption`` section of ``gpu_check.py``, run only when named.

    python3 benchmarks/gpu_check.py --wheels .gpu-wheels --sections caption   # GPU: the published shape, batch 1..64
    python3 benchmarks/gpu_check.py --smoke --sections caption                # this code on the CPU: the tiny shape

What a real ``bucketeer annotate --task caption --model Qwen/Qwen2.5-VL-7B-Instruct`` run does per batch, with the
lengths of such a run: a 1024x1024 JPEG decoded as the annotate workers decode it (``decode_for_caption``: long
side at most ``--image-size`` 768), Qwen2.5-VL's image processor (768 -> 756x756, a 54x54 patch grid merged 2x2:
729 vision tokens), the project's default caption prompt in the model's own chat template (its default system
message included): 767 prefill tokens per caption; then greedy decoding of exactly ``new_tokens`` tokens (128: a
detailed caption). Random weights would stop at any end-of-sequence token they happen to pick, and the engine
passes only ``max_new_tokens`` and ``do_sample=False`` to ``generate``: so the saved ``generation_config.json`` sets
``min_new_tokens`` to the same count (transformers masks the end-of-sequence ids until then), beside the hub's
greedy-relevant values (end-of-sequence ids 151645 and 151643, ``repetition_penalty`` 1.05; its sampling values
are left out: the engine does not sample).

Per batch size, two sides on the same decoded images: the engine (``TransformersCaptioner.caption``: the
processor, the batch to the device, the one batched ``generate``, the tokens back and decoded) and the model alone
(the same ``generate`` call on the processor's output already on the device), and the prefill alone (the same
call stopping after one token). Generated tokens are counted from the engine's own per-caption counts; a run where
any caption stopped early fails its row.

The model folder (:func:`write_caption_model`) is built on the device in bf16 (8.29B parameters in seconds on a
GPU; the CPU would need minutes), saved, and loaded back by the engine from disk as ``annotate`` loads it. The
tokenizer cannot be downloaded here: it is a ``Qwen2Tokenizer`` made as :mod:`pipeline.embed.families.tiny_qwen`
makes its own (a byte-level BPE with Qwen2's pre-tokenizer, trained here on the chat template's and the prompt's
words, so that each is one token as in the real vocabulary), padded with filler tokens to the real 151643 regular
tokens, then the real 22 special tokens at their real ids (151643..151664). What differs from the real one: its
merges (any text besides these words falls back to bytes, more tokens than the real tokenizer gives), and the
decoded text of generated ids (filler words; ids the real vocabulary has no token for, 151665..152063, decode to
nothing in both).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_measures import Row
from benchmarks.real_configs import QWEN_VL_7B

__all__ = ["CaptionSweep", "REAL_SWEEP", "SMOKE_SWEEP", "SHAPES", "caption_tokenizer", "caption_config", "model_bytes",
           "write_caption_model", "caption_rows"]  # fmt: skip

# Qwen/Qwen2.5-VL-7B-Instruct's special tokens in id order from 151643 (its tokenizer.json's added tokens)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
           "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")  # fmt: skip
REGULAR_TOKENS = 151643  # the real vocabulary's regular tokens; the model's embedding has 152064 rows
# its chat_template.json (the default system message when the conversation has none)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)  # fmt: skip
# its preprocessor_config.json: min_pixels 3136, max_pixels 12845056, patch 14, merge 2, temporal patch 2
PIXELS = {"shortest_edge": 3136, "longest_edge": 12845056}
_MEAN, _STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# what QWEN_VL_7B (the published text encoder of Qwen-Image) leaves at transformers' defaults and the hub's
# config.json sets otherwise; neither changes the work done
_PUBLISHED = {"text_config": {**QWEN_VL_7B["text_config"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0},
              "vision_config": {**QWEN_VL_7B["vision_config"], "tokens_per_second": 2}}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "published": {**QWEN_VL_7B, **_PUBLISHED},
    # the same classes a few dozen wide (M-RoPE sections 2/3/3 of heads of 16), the real vocabulary and window
    "tiny": {"text_config": {"vocab_size": 152064, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                             "tie_word_embeddings": False,
                             "rope_scaling": {"type": "default", "mrope_section": [2, 3, 3]}},
             "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                               "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                               "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1]},
             "tie_word_embeddings": False},
}  # fmt: skip
SECONDS_PER_GB = 2.0  # the folder written once and read once at ~1 GB/s (its build on a GPU: seconds)


@dataclass(frozen=True)
class CaptionSweep:
    """What the section runs: the model's ``shape`` (a key of :data:`SHAPES`), the batch sizes, the tokens each
    caption generates, the source JPEG's side and annotate's ``--image-size`` (pixels), timed calls per side."""

    shape: str
    batches: tuple[int, ...]
    new_tokens: int
    source: int = 1024
    image_size: int = 768
    iters: int = 1  # a call is 128 decode steps: its own average


REAL_SWEEP = CaptionSweep("published", (1, 8, 32, 64), 128)
SMOKE_SWEEP = CaptionSweep("tiny", (1, 2), 16)


def caption_tokenizer():
    """The ``Qwen2Tokenizer`` of the module docstring: the real vocabulary's size and special tokens' ids, eos
    ``<|im_end|>``, pad ``<|endoftext|>`` (as the hub's tokenizer_config.json), the chat template set."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from pipeline.annotate.engines import DEFAULT_PROMPT

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(["system\nYou are a helpful assistant.", "user\n", "assistant\n", DEFAULT_PROMPT], trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab, filler = dict(model["vocab"]), 0
    while len(vocab) < REGULAR_TOKENS:  # " w0", " w1", ...: what generated ids decode to
        vocab.setdefault(f"\u0120w{filler}", len(vocab))
        filler += 1
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=131072)  # adds <|endoftext|>: 151643
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL[1:])})
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    assert [tokenizer.convert_tokens_to_ids(s) for s in SPECIAL] == list(range(REGULAR_TOKENS, 151665))
    return tokenizer


def caption_config(shape: str, tokenizer=None):
    """``Qwen2_5_VLConfig`` of ``shape`` (a key of :data:`SHAPES`), the special tokens at the real ids (those of
    :func:`caption_tokenizer`). Raises ValueError for another shape."""
    from transformers import Qwen2_5_VLConfig

    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: one of {sorted(SHAPES)}")
    ids = {s: REGULAR_TOKENS + i for i, s in enumerate(SPECIAL)}
    if tokenizer is not None:
        ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIAL}
    config = SHAPES[shape]
    text = {**config["text_config"], "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}  # fmt: skip
    return Qwen2_5_VLConfig(**{**config, "text_config": text}, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip


def model_bytes(shape: str) -> int:
    """Bytes of ``shape``'s weights in bf16 (counted on the meta device): its folder, and its weights on the GPU."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from pipeline.embed.memory import parameter_count

    with torch.device("meta"):
        return 2 * parameter_count(Qwen2_5_VLForConditionalGeneration(caption_config(shape)))


def write_caption_model(folder: str | os.PathLike, shape: str, *, new_tokens: int, device: str = "cpu") -> Path:
    """Write a Qwen2.5-VL-7B-Instruct-like folder to ``folder``: ``shape``'s model (:data:`SHAPES`) with random
    weights built in bf16 on ``device`` (seeded), its generation config greedy for exactly ``new_tokens`` tokens
    (module docstring), :func:`caption_tokenizer`, the published chat template and image processor config, and a
    video processor config (written as JSON: building its class needs torchvision, loading the folder does not).
    Returns the folder."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from pipeline.embed.processors import qwen2vl_image_processor_class

    target = Path(folder)
    tokenizer = caption_tokenizer()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(caption_config(shape, tokenizer))
    finally:
        torch.set_default_dtype(default)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in ("<|im_end|>", "<|endoftext|>")}
    generation = model.generation_config
    generation.bos_token_id = generation.pad_token_id = ids["<|endoftext|>"]
    generation.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    generation.repetition_penalty = 1.05
    generation.min_new_tokens = new_tokens  # random weights: no end-of-sequence before the count
    model.save_pretrained(target)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    tokenizer.save_pretrained(target)
    shape_ = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    qwen2vl_image_processor_class()(size=dict(PIXELS), image_mean=_MEAN, image_std=_STD,
                                    **shape_).save_pretrained(target)  # fmt: skip
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "size": dict(PIXELS), **shape_, "image_mean": _MEAN,
             "image_std": _STD, "processor_class": "Qwen2_5_VLProcessor"}  # fmt: skip
    (target / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return target


def _images(work: Path, sweep: CaptionSweep, n: int) -> list:
    """``n`` PIL images as annotate's workers give them to the engine: ``sweep.source``-square JPEGs (4 distinct)
    through ``decode_for_caption`` at ``sweep.image_size``."""
    from benchmarks.gpu_models import make_jpegs
    from manifests.schema import MAX_PIXELS
    from pipeline.annotate.workers import decode_for_caption

    side = sweep.source
    names = make_jpegs(work / "images", 4, (side, side))
    decoded = [decode_for_caption((work / "images" / f).read_bytes(), side, side, sweep.image_size, MAX_PIXELS, f)
               for f in names]  # fmt: skip
    return [decoded[i % len(decoded)] for i in range(n)]


def _seconds(fn, gpu: bool, iters: int) -> tuple[float, Any]:
    """Seconds per call of ``fn`` (no warm-up here), the device synchronized before the clock stops; its last output."""
    import torch

    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
    if gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters, out


def _setup(work: Path, sweep: CaptionSweep, device: str, seconds: float) -> tuple[Row, Any]:
    """The folder written and loaded by the engine: ``(its row, the TransformersCaptioner)``; the captioner is None
    (and the row skipped, with the reason) where the disk, the GPU or the time left cannot hold the folder."""
    import torch

    from pipeline.annotate.engines import DEFAULT_PROMPT, CaptionSpec, TransformersCaptioner

    need = model_bytes(sweep.shape)
    cfg = caption_config(sweep.shape)
    params, gb = need // 2, need / 1e9
    text, vision = cfg.text_config, cfg.vision_config
    what = (f"Qwen2.5-VL-7B-Instruct {sweep.shape} shape ({params / 1e9:.2f}B parameters: text {text.hidden_size} x "
            f"{text.num_hidden_layers}, vision {vision.hidden_size} x {vision.depth}), random weights built in bf16 on "
            f"{device}, saved, loaded by TransformersCaptioner")  # fmt: skip
    estimate = SECONDS_PER_GB * gb + 10
    gpu_free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    why = None
    if need + (1 << 30) > shutil.disk_usage(work).free:
        why = f"its folder needs {gb:.1f} GB of disk"
    elif gpu_free is not None and 1.25 * need > gpu_free:
        why = f"its weights need {gb:.1f} GB of GPU memory (and its cache more), {gpu_free / 1e9:.1f} GB are free"
    elif estimate > seconds / 2:
        why = f"its setup needs ~{estimate:.0f} s and {seconds:.0f} s are left for the section: raise --budget"
    if why:
        return Row("caption", what, f"skipped: {why}", status="skipped", values={"bytes": need}), None
    t0 = time.perf_counter()
    folder = write_caption_model(work / "model", sweep.shape, new_tokens=sweep.new_tokens, device=device)
    t1 = time.perf_counter()
    spec = CaptionSpec(model=str(folder), prompt=DEFAULT_PROMPT, max_new_tokens=sweep.new_tokens,
                       image_size=sweep.image_size)  # fmt: skip
    captioner = TransformersCaptioner(spec, device)
    t2 = time.perf_counter()
    size = f"{gb:.1f} GB" if gb >= 0.1 else f"{gb * 1000:.0f} MB"
    result = f"{size}; built and written in {t1 - t0:.0f} s, loaded in {t2 - t1:.0f} s (estimate ~{estimate:.0f} s)"
    return Row("caption", what, result, values={"parameters": params, "bytes": need, "write_seconds": t1 - t0,
                                                "load_seconds": t2 - t1, "estimate_seconds": estimate}), captioner


def caption_rows(work: str | os.PathLike, device: str, sweep: CaptionSweep = REAL_SWEEP,
                 seconds: float = 400.0) -> list[Row]:  # fmt: skip
    """The section's rows (module docstring): the setup row, then per batch size of ``sweep`` the engine's
    captions/s and generated tokens/s against the model alone's, the prefill tokens per caption; within ``seconds``
    (a batch size the time left cannot hold is a skipped row). ``device``: cuda or cpu. The folder is removed."""
    import torch

    work, gpu = Path(work), device == "cuda"
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + seconds
    try:
        setup, captioner = _setup(work, sweep, device, seconds)
        rows = [setup]
        if captioner is not None:
            rows += _sweep(work, sweep, captioner, gpu, deadline)
        del captioner
        if gpu:
            torch.cuda.empty_cache()
        return rows
    finally:
        shutil.rmtree(work / "model", ignore_errors=True)


def _sweep(work: Path, sweep: CaptionSweep, captioner, gpu: bool, deadline: float) -> list[Row]:
    import torch

    images = _images(work, sweep, max(sweep.batches))
    model, n, rows, last = captioner.model, sweep.new_tokens, [], 0.0
    for batch in sweep.batches:
        what = f"batch {batch}: TransformersCaptioner.caption vs the same generate alone"
        if time.monotonic() + 3 * last > deadline:
            rows.append(Row("caption", what, "skipped: the section's time is spent", status="skipped"))
            continue
        started = time.perf_counter()
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        pictures = images[:batch]
        captioner.caption(pictures)  # warm-up: this batch shape's kernels and allocations
        t_engine, captions = _seconds(lambda: captioner.caption(pictures), gpu, sweep.iters)
        inputs = captioner.processor(images=pictures, text=[captioner.text] * batch, return_tensors="pt",
                                     padding=True).to(captioner.device)  # fmt: skip
        with torch.inference_mode():
            t_alone, out = _seconds(lambda: model.generate(**inputs, max_new_tokens=n, do_sample=False), gpu,
                                    sweep.iters)  # fmt: skip
            t_prefill, _ = _seconds(lambda: model.generate(**inputs, max_new_tokens=1, min_new_tokens=1,
                                                           do_sample=False), gpu, sweep.iters)  # fmt: skip
        prompt = inputs["input_ids"].shape[1]
        vision = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
        generated = sum(k for _, k in captions)
        alone_generated = batch * (out.shape[1] - prompt)
        ok = generated == alone_generated == batch * n
        rate, alone, tokens = batch / t_engine, batch / t_alone, generated / t_engine
        peak = torch.cuda.max_memory_allocated() / 1e9 if gpu else None
        result = (f"{rate:.2f} captions/s, {tokens:.0f} tokens/s vs {alone:.2f} captions/s alone "
                  f"({rate / alone:.2f}x); prefill {t_prefill:.2f} s of {t_alone:.2f} s")
        if not ok:
            result = f"failed: {generated} tokens generated (alone {alone_generated}), not {batch} x {n}: " + result
        rows.append(Row("caption", f"{what} ({prompt} prefill tokens per caption, {vision} of them the image's; {n} "
                        f"new tokens; peak {'-' if peak is None else f'{peak:.1f} GB'})", result,
                        ">= 0.9x the model alone" if gpu else "", status="ok" if ok else "failed",
                        values={"batch": batch, "captions_per_second": rate, "tokens_per_second": tokens,
                                "alone_captions_per_second": alone, "ratio": rate / alone,
                                "alone_tokens_per_second": alone_generated / t_alone, "prefill_seconds": t_prefill,
                                "prefill_tokens": prompt, "vision_tokens": vision, "generated_tokens": generated,
                                "new_tokens": n, "peak_gb": peak}))  # fmt: skip
        last = time.perf_counter() - started
    return rows
