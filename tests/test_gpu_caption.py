"""benchmarks/gpu_caption.py (gpu_check's ``caption`` section): the published shape is Qwen2.5-VL-7B-Instruct's,
its tokenizer has the real special ids and renders the real chat template, and the tiny shape captions end to end
through the transformers engine on the CPU with no caption stopping early."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_caption import (CaptionSweep, caption_config, caption_rows, caption_tokenizer, model_bytes,
                                    write_caption_model)

QWEN_VL_7B_PARAMETERS = 8_292_166_656  # Qwen/Qwen2.5-VL-7B-Instruct's safetensors index: 8.29B


def test_the_published_shape_has_qwen2_5_vl_7b_instructs_dimensions_and_parameters(tmp_path):
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    caption_config("published").save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)  # what the folder's config.json says
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
            text.intermediate_size, text.vocab_size) == (3584, 28, 28, 4, 18944, 152064)  # fmt: skip
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.out_hidden_size,
            vision.window_size, vision.fullatt_block_indexes) == (32, 1280, 3420, 16, 3584, 112, [7, 15, 23, 31])
    assert (config.image_token_id, config.vision_start_token_id, text.eos_token_id) == (151655, 151652, 151645)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == QWEN_VL_7B_PARAMETERS
    assert model_bytes("published") == 2 * QWEN_VL_7B_PARAMETERS  # bf16


def test_the_tokenizer_has_the_real_vocabulary_size_special_ids_and_chat_template():
    from pipeline.annotate.engines import DEFAULT_PROMPT

    tokenizer = caption_tokenizer()
    assert len(tokenizer) == 151665
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>")] == [
        151643, 151645, 151655]  # fmt: skip
    assert len(tokenizer(DEFAULT_PROMPT)["input_ids"]) == 17  # a token a word or mark, as Qwen2's vocabulary
    chat = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                           "text": "Hi"}]}],
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert chat == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                    "<|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode([151000]).startswith(" w")  # a filler word
    assert tokenizer.decode([151700, 152063]) == ""  # ids the real vocabulary has no token for decode to nothing


@pytest.mark.slow
def test_the_tiny_shape_captions_every_batch_through_the_engine_without_stopping_early(tmp_path):
    sweep = CaptionSweep("tiny", (1, 2), new_tokens=4, source=320, image_size=224)
    rows = caption_rows(tmp_path / "work", "cpu", sweep, seconds=300)
    setup, *batches = rows
    assert [r.status for r in rows] == ["ok"] * 3, [r.result for r in rows]
    assert setup.values["load_seconds"] > 0 and "TransformersCaptioner" in setup.measure
    assert [r.values["batch"] for r in batches] == [1, 2]
    for row in batches:
        v = row.values
        assert v["generated_tokens"] == v["batch"] * 4  # the engine's own counts: nothing stopped early
        assert v["captions_per_second"] > 0 and v["tokens_per_second"] > 0 and v["alone_captions_per_second"] > 0
        # 320 -> 224 (annotate's decode) -> a 16x16 patch grid merged 2x2: 64 image tokens, then the template's 38
        assert (v["vision_tokens"], v["prefill_tokens"]) == (64, 64 + 38)
        assert 0 < v["prefill_seconds"] and v["ratio"] > 0
    assert not (tmp_path / "work" / "model").exists()  # its folder removed after its rows


@pytest.mark.slow
def test_the_saved_generation_config_keeps_a_model_that_prefers_eos_generating_to_the_count(tmp_path):
    """Random weights may pick an end-of-sequence token at any step: the folder's generation config masks those
    until ``new_tokens`` (the engine passes only ``max_new_tokens``); without it the same model stops at once."""
    from PIL import Image

    from pipeline.annotate.engines import CaptionSpec, TransformersCaptioner

    folder = write_caption_model(tmp_path / "model", "tiny", new_tokens=5)
    captioner = TransformersCaptioner(CaptionSpec(model=str(folder), max_new_tokens=5, image_size=56), "cpu")
    eos = captioner.model.generation_config.eos_token_id
    assert eos == [151645, 151643] and captioner.model.generation_config.min_new_tokens == 5

    def prefer_eos(module, args, logits):
        logits[..., eos] = 1e4
        return logits

    captioner.model.lm_head.register_forward_hook(prefer_eos)
    image = Image.new("RGB", (56, 56), "gray")
    assert [n for _, n in captioner.caption([image, image])] == [5, 5]
    captioner.model.generation_config.min_new_tokens = None
    assert [n for _, n in captioner.caption([image, image])] == [1, 1]
