"""Flux 2 and Flux 2 Klein: an LLM's hidden states of three layers, side by side, padded to 512, no mask.

Mirrors ``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` and ``Flux2KleinPipeline._get_qwen3_prompt_embeds``
(diffusers 0.42):

- ``flux2`` (FLUX.2-dev): each caption (``[IMG]`` removed) becomes a chat of the pipeline's ``SYSTEM_MESSAGE``
  and one user message, rendered by the tokenizer's chat template (Mistral Small 3.1: ``<s>[SYSTEM_PROMPT]...
  [/SYSTEM_PROMPT][INST]caption[/INST]``), no generation prompt;
- ``flux2-klein``: one user message, Qwen3's template with the generation prompt and ``enable_thinking=False``;

then padded to ``max_sequence_length`` (512) and truncated there, run **with** the attention mask, and the
hidden states of layers 10, 20, 30 (Klein: 9, 18, 27; ``hidden_states[0]`` being the embeddings) concatenated
per token: ``(512, 3 x hidden)``, 15,360 wide for Mistral Small (5120), 7,680 for Klein 4B's Qwen3 (2560).

The transformer takes all 512 rows and no text mask, so every row is stored. Whether a pad row is needed is
measured, not assumed (tests/test_families_flux2.py): padded on the right (Qwen), a pad row attends to the
caption and differs per caption; padded on the left, it attends to nothing and is one vector whatever the
caption. Either way it is the model's input; the left-padded case could be rebuilt from one stored row, which
this layout does not do (it would need a pad row in the cache's contract).

Where this differs from the pipeline's code, the result does not: the real FLUX.2 folder's tokenizer is a
``PixtralProcessor`` (which needs torchvision); for text-only chats it renders the same template and tokenizes
it without adding special tokens when the text starts with BOS (``ProcessorMixin.apply_chat_template``), as
:func:`encode` does with the plain tokenizer. The LLM runs without its language-model head, vision tower and
the layers after the last one read (:func:`prune`): the hidden states read are the same tensors, and a 24B
Mistral Small runs as 17.3B parameters (34.7 GB in bf16).
"""

from __future__ import annotations

from typing import Any

from manifests.cache.text_layout import TextLayout
from manifests.families import spec_of
from manifests.errors import UsageError
from pipeline.embed.families.base import PromptParts, TextModel, TextOptions, declared

TOKENS = spec_of("flux2").text.max_tokens(None)  # 512: the pipelines' max_sequence_length
DEV_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers
KLEIN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's


def prune(model: Any, layers: tuple[int, ...]) -> Any:
    """The decoder of ``model`` (a causal LM, or Mistral 3's image-text model) holding only its first
    ``max(layers)`` layers: hidden state ``k`` is the output of layer ``k - 1``, and later layers, the LM head
    and a vision tower are never run."""
    decoder = model.get_decoder()
    decoder.layers = decoder.layers[: max(layers)]
    decoder.config.num_hidden_layers = max(layers)
    if hasattr(decoder.config, "layer_types") and decoder.config.layer_types is not None:
        decoder.config.layer_types = decoder.config.layer_types[: max(layers)]
    return decoder


def hidden_states(m: TextModel, ids: Any, mask: Any, layers: tuple[int, ...]) -> Any:
    """``(B, L, len(layers) * D)``: the hidden states ``layers`` of ``m`` (a :func:`prune` d decoder) on ``ids``
    with ``mask``, side by side per token, as the pipelines stack and reshape ``output.hidden_states``."""
    import torch

    captured: dict[int, Any] = {}
    hooks = [m.model.layers[k - 1].register_forward_hook(
        lambda module, args, out, k=k: captured.__setitem__(k, out[0] if isinstance(out, tuple) else out))
        for k in layers]  # fmt: skip
    try:
        m(ids, attention_mask=mask.to(m.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    out = torch.stack([captured[k] for k in layers], dim=1)  # (B, 3, L, D)
    b, n, length, width = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, length, n * width)


def _chat(m: TextModel, conversations: list[Any], options: TextOptions, **template: Any) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` of the chats rendered by the tokenizer's template, padded to the length."""
    tokenizer = m.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--model {m.info['id']}: its tokenizer has no chat template; this family encodes captions "
                         "as chats (pass the family's diffusers folder)")  # fmt: skip
    texts = [tokenizer.apply_chat_template(c, tokenize=False, **template) for c in conversations]
    # as ProcessorMixin.apply_chat_template: no special tokens added to a text the template began with BOS
    bos = tokenizer.bos_token
    special = not (bos is not None and texts[0].startswith(bos))
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=options.max_tokens,
                    add_special_tokens=special, return_tensors="pt")  # fmt: skip
    return enc["input_ids"], enc["attention_mask"]


def _layout(family: str):
    def layout(models: list[TextModel], options: TextOptions) -> TextLayout:
        (m,) = models
        layers = DEV_LAYERS if family == "flux2" else KLEIN_LAYERS
        return TextLayout(family=family, join="features", masked=False, lengths=(int(options.max_tokens),),
                          widths=(len(layers) * int(m.model.config.hidden_size),))  # fmt: skip

    return layout


def encode_dev(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    (m,) = models
    ids, mask = _chat(m, format_input(captions, system_message=SYSTEM_MESSAGE), options, add_generation_prompt=False)
    return PromptParts([hidden_states(m, ids, mask, DEV_LAYERS)])


def encode_klein(models: list[TextModel], captions: list[str], options: TextOptions) -> PromptParts:
    (m,) = models
    chats = [[{"role": "user", "content": c}] for c in captions]
    ids, mask = _chat(m, chats, options, add_generation_prompt=True, enable_thinking=False)
    return PromptParts([hidden_states(m, ids, mask, KLEIN_LAYERS)])


FAMILY = declared("flux2", layout=_layout("flux2"), encode=encode_dev, prune=lambda model: prune(model, DEV_LAYERS))
KLEIN = declared("flux2-klein", layout=_layout("flux2-klein"), encode=encode_klein,
                 prune=lambda model: prune(model, KLEIN_LAYERS))


# ---------------------------------------------------------------- latents (AutoencoderKLFlux2)

BN_NORMALISED = "(patchify(z) - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps), at embed"
LATENT_USAGE = ("latents as the Flux 2 pipelines' transformer sees them: the posterior mean (C, h, w) patchified "
                "2x2 to (4C, h/2, w/2) (Flux2Pipeline._patchify_latents) and normalised by the VAE's batch-norm "
                "running statistics, (z - running_mean) / sqrt(running_var + batch_norm_eps) "
                "(Flux2Pipeline._encode_vae_image); scaling 1, shift 0")  # fmt: skip


def denoiser_latents(vae: Any, mean: Any, std: Any = None, eps: float | None = None) -> tuple[Any, Any]:
    """``(latent, latent_std or None)`` ``(B, 4C, h/2, w/2)`` float32 of an ``AutoencoderKLFlux2`` posterior
    ``mean`` (and ``std``) ``(B, C, h, w)``: patchified and normalised as ``Flux2Pipeline._encode_vae_image``
    does (a posterior draw ``mean + std * noise`` normalises to ``latent + latent_std * noise``); ``eps``: the
    batch-norm eps (None: the config's ``batch_norm_eps``, as Flux 2's; ERNIE-Image's pipeline hard-codes 1e-5).
    Raises UsageError when ``h`` or ``w`` is odd (an image side that is not a multiple of 16 pixels)."""
    import torch
    from diffusers import Flux2Pipeline

    h, w = mean.shape[-2:]
    if h % 2 or w % 2:
        raise UsageError(f"a {w * 8}x{h * 8} image: Flux 2 packs 2x2 latents of an 8x VAE, so its sides must be "
                         "multiples of 16 pixels; scan with a --bucket-step that is a multiple of 16")  # fmt: skip
    bn = vae.bn
    bn_mean = bn.running_mean.view(1, -1, 1, 1).to(mean.device, torch.float32)
    eps = vae.config.batch_norm_eps if eps is None else eps
    bn_std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(mean.device, torch.float32)
    latent = (Flux2Pipeline._patchify_latents(mean.float()) - bn_mean) / bn_std
    return latent, None if std is None else Flux2Pipeline._patchify_latents(std.float()) / bn_std
