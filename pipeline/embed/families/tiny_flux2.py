"""Tiny random-weight Flux 2 and Flux 2 Klein pipelines: the real classes, a few dozen channels wide.

What :func:`pipeline.embed.families.tiny.build_tiny` writes for ``flux2`` and ``flux2-klein`` (``chroma``'s
tiny pipeline is in :mod:`pipeline.embed.families.tiny`, beside the T5 and VAE it shares with Flux.1):

- ``flux2``: ``Flux2Pipeline``: a ``Mistral3ForConditionalGeneration`` (a 1-layer Pixtral vision tower and a
  32-layer Mistral language model 40 wide, so that hidden states 10, 20 and 30 exist and are intermediate
  layers, as in Mistral Small 3.1's 40), its tokenizer with a Mistral chat template ([SYSTEM_PROMPT], [INST]),
  a ``Flux2Transformer2DModel`` with the guidance embedding (FLUX.2-dev is guidance-distilled), the
  ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting, and an ``AutoencoderKLFlux2`` (32 latent channels,
  2x2 patches, batch-norm statistics set to random values so that a missing normalisation shows).
- ``flux2-klein``: ``Flux2KleinPipeline``: a 29-layer ``Qwen3ForCausalLM`` 24 wide (hidden states 9, 18, 27),
  a Qwen2 tokenizer with Qwen3's chat template (``enable_thinking``), a transformer without guidance embedding.

The tokenizers are byte-level BPEs over single bytes plus a few merges (every text tokenizes). The Flux 2
folder holds the plain tokenizer where the real one holds a ``PixtralProcessor``: that processor needs
torchvision, and for text it renders the same chat template and tokenizes it the same way
(:mod:`pipeline.embed.families.flux2`). The Mistral tokenizer pads on the left (``LlamaTokenizerFast``'s
side), Qwen's on the right.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["PIPELINES", "MISTRAL_WIDTH", "QWEN3_WIDTH", "mistral_tokenizer", "qwen3_tokenizer"]

MISTRAL_WIDTH, QWEN3_WIDTH = 40, 24  # stacked 3x: 120 and 72 wide prompt embeddings, unlike every other family's
MISTRAL_LAYERS, QWEN3_LAYERS = 32, 29
FLUX2_LATENT_CHANNELS = 32

# Mistral Small 3.1's chat template, for what Flux2Pipeline sends (a system message, a user message; text blocks)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if system_message is defined %}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if message['content'] is string %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' }}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{{- '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
# Qwen3's chat template, for what Flux2KleinPipeline sends (one user message, a generation prompt, no thinking)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
_MERGES = [("t", "h"), ("th", "e"), ("o", "n"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("Ġ", "t")]


def _byte_bpe(specials: list[str]):
    """A ``tokenizers`` byte-level BPE: one token per byte, a few merges, ``specials`` after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # the 256 byte symbols
    for a, b in _MERGES:
        vocab.setdefault(a + b, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return tokenizer, vocab


def mistral_tokenizer():
    """A byte-level BPE with Mistral's special tokens and chat template, padding on the left."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                "[IMG_BREAK]", "[IMG_END]"]  # fmt: skip
    tokenizer, _ = _byte_bpe(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", padding_side="left", model_max_length=131072,
                                   chat_template=MISTRAL_TEMPLATE)  # fmt: skip


def qwen3_tokenizer():
    """A byte-level BPE with Qwen's special tokens and Qwen3's chat template, padding on the right."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tokenizer, _ = _byte_bpe(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="right", model_max_length=131072,
                                   chat_template=QWEN3_TEMPLATE)  # fmt: skip


def _mistral3(tokenizer):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    vocab = len(tokenizer)
    text = MistralConfig(vocab_size=vocab, hidden_size=MISTRAL_WIDTH, intermediate_size=64,
                         num_hidden_layers=MISTRAL_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=20,
                         max_position_embeddings=1024, sliding_window=None, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=56, patch_size=14)  # fmt: skip
    config = Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))  # fmt: skip
    return Mistral3ForConditionalGeneration(config)


def _qwen3(tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=QWEN3_WIDTH, intermediate_size=48, num_hidden_layers=QWEN3_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=12, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))  # fmt: skip


def _flux2_vae():
    """An ``AutoencoderKLFlux2`` with random batch-norm statistics (a fresh one has mean 0, variance 1)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16, 16), layers_per_block=1,
                             latent_channels=FLUX2_LATENT_CHANNELS, norm_num_groups=8, sample_size=64)  # fmt: skip
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean) * 0.5)
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) * 2 + 0.25)
    return vae


def _flux2_transformer(text_width: int, *, guidance: bool):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * FLUX2_LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_width, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance,
    )  # fmt: skip


def _flow_scheduler():
    """Flux's ``FlowMatchEulerDiscreteScheduler`` as the FLUX.2 and Chroma folders ship it (dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip


def flux2():
    from diffusers import Flux2Pipeline

    tok = mistral_tokenizer()
    return Flux2Pipeline(scheduler=_flow_scheduler(), vae=_flux2_vae(), text_encoder=_mistral3(tok), tokenizer=tok,
                         transformer=_flux2_transformer(3 * MISTRAL_WIDTH, guidance=True))  # fmt: skip


def flux2_klein():
    from diffusers import Flux2KleinPipeline

    tok = qwen3_tokenizer()
    return Flux2KleinPipeline(scheduler=_flow_scheduler(), vae=_flux2_vae(), text_encoder=_qwen3(tok), tokenizer=tok,
                              transformer=_flux2_transformer(3 * QWEN3_WIDTH, guidance=False))  # fmt: skip


PIPELINES: dict[str, Callable[[], object]] = {"flux2": flux2, "flux2-klein": flux2_klein}
