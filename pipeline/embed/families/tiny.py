"""Tiny random-weight models of each family's real classes, saved as the hub folders they stand for.

``build_tiny(family, folder)`` writes a diffusers pipeline folder (``model_index.json``, ``vae/``,
``text_encoder*/``, ``tokenizer*/``, the denoiser and its scheduler) of the family's real pipeline
class, with every model shrunk to a few layers of a few dozen channels, so that everything that
loads a real model (``from_pretrained``, ``DiffusionPipeline.from_pretrained``, ``encode_prompt``,
a training step) runs on it in seconds on a CPU:

- ``sdxl``: ``StableDiffusionXLPipeline``: ``CLIPTextModel`` (32 wide) + ``CLIPTextModelWithProjection``
  (48 wide, projection 40), ``tokenizer_2`` padding with ``"!"`` as SDXL's does, a text-time
  ``UNet2DConditionModel``, ``EulerDiscreteScheduler``, a 4-channel VAE (scaling 0.13025).
- ``sd3``: ``StableDiffusion3Pipeline``: two ``CLIPTextModelWithProjection`` (32 / 48 wide, projections
  36 / 40) and a ``T5EncoderModel`` (96 wide, wider than both CLIPs together, as in SD3),
  ``SD3Transformer2DModel``, ``FlowMatchEulerDiscreteScheduler``, a 16-channel VAE with shift.
- ``flux``: ``FluxPipeline``: ``CLIPTextModel`` (pooled) + ``T5EncoderModel``, ``FluxTransformer2DModel``
  with guidance embedding, a 16-channel VAE with Flux's scaling and shift.
- ``pixart``: ``PixArtAlphaPipeline`` (``variant="sigma"``: ``PixArtSigmaPipeline``): ``T5EncoderModel``,
  ``PixArtTransformer2DModel``, ``DPMSolverMultistepScheduler``, a 4-channel VAE (scaling 0.18215).
- ``wan``: ``WanPipeline`` (video): ``UMT5EncoderModel`` (64 wide), ``WanTransformer3DModel`` (2 layers,
  patch 1x2x2), ``UniPCMultistepScheduler`` with ``flow_shift`` 3.0 as the Wan 2.1 folders ship it, and an
  ``AutoencoderKLWan`` (causal 3D, 4x temporal and 8x spatial compression, 16 channels, Wan 2.1's
  per-channel ``latents_mean``/``latents_std``).
- ``qwen-image``, ``qwen-image-edit``, ``z-image``: :mod:`pipeline.embed.families.tiny_qwen`.
- ``generic``: bucketeer's embedded default encoders (a VAE and one CLIP text model; no denoiser).
- ``flux2``, ``flux2-klein``: :mod:`pipeline.embed.families.tiny_flux2` (Mistral 3 / Qwen3 LLMs with their chat
  templates, ``Flux2Transformer2DModel``, ``AutoencoderKLFlux2``).
- ``wan2.2-a14b``, ``wan2.2-ti2v-5b``: :mod:`pipeline.embed.families.tiny_wan22` (two experts and
  ``boundary_ratio``; per-token timesteps and Wan 2.2's 48-channel VAE).
- ``ltx-2``: :mod:`pipeline.embed.families.tiny_ltx2` (Gemma 3, the text connectors, LTX-2's video and audio
  VAEs, vocoder and audio-video transformer).
- ``hunyuanvideo-1.5``: :mod:`pipeline.embed.families.tiny_hunyuan` (Qwen2.5-VL text model and glyph ByT5,
  ``HunyuanVideo15Transformer3DModel``, ``AutoencoderKLHunyuanVideo15``).
- ``chroma``: ``ChromaPipeline``: the T5 above, a ``ChromaTransformer2DModel``, Flux.1's VAE and scheduler.

The T5 tokenizer is a Unigram model over a few words plus single characters (anything else is
``<unk>``); the CLIP tokenizers are byte-level BPE with a few merges, so any text tokenizes. Their
outputs are noise: these models exist to run the pipeline, not to make images.
:func:`ensure_tiny` builds one once under ``$BUCKETEER_HOME/default-encoders/`` (what
``--model default`` loads).
"""

from __future__ import annotations

import functools
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from manifests.errors import UsageError
from manifests.families import SPECS
from pipeline.embed.families import tiny_hunyuan, tiny_ltx2, tiny_qwen, tiny_wan22

__all__ = ["DEFAULT_NOTICE", "TINY_VERSION", "build_tiny", "ensure_tiny", "tiny_dir", "tiny_pipeline", "save_pipeline",
           "clip_tokenizer", "t5_tokenizer"]  # fmt: skip

TINY_VERSION = "v1"
DEFAULT_NOTICE = (
    "bucketeer: using the embedded DEFAULT encoders (tiny random-weight models of the real architectures). "
    "They are for trying the pipeline, NOT for training a real model: pass --model (with --family) or "
    "--vae / --text-encoder."
)
# widths chosen pairwise different, so that a test catches any mix-up of encoder, layer or pooled source
CLIP_L, CLIP_G, T5_WIDTH = 32, 48, 96
CLIP_L_PROJECTION, CLIP_G_PROJECTION = 36, 40
UMT5_WIDTH = 64
_T5_WORDS = "a photo of thing 0 1 2 3 the cat dog red blue picture shape broken".split()


def _byte_level_vocab() -> list[str]:
    # CLIP's byte-to-unicode table: every byte maps to a printable character, so any text tokenizes
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(extra))]


def clip_tokenizer(model_max_length: int = 77, pad_token: str | None = None):
    """A byte-level CLIP BPE tokenizer with a tiny vocabulary (every text tokenizes; few merges).

    ``pad_token``: None pads with ``<|endoftext|>`` (SD 1.x / SDXL ``tokenizer``); SDXL's
    ``tokenizer_2`` pads with ``"!"``.
    """
    from transformers import CLIPTokenizer

    chars = _byte_level_vocab()
    # a handful of English merges: enough to exercise BPE, and each side is an existing symbol
    merges = [("t", "h"), ("th", "e</w>"), ("o", "n"), ("i", "n"), ("e", "r"), ("p", "h")]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    vocab[bos], vocab[eos] = len(vocab), len(vocab) + 1
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length, pad_token=pad_token or eos)


def t5_tokenizer(model_max_length: int = 512):
    """A ``T5Tokenizer`` (Unigram, ``</s>`` appended, no BOS) over a few words plus single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    pieces += [("\u2581" + w, -1.0 - i / 100) for i, w in enumerate(_T5_WORDS)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def _clip(tokenizer, width: int, *, projection: int | None):
    """A 3-layer CLIP text model; ``projection``: a ``CLIPTextModelWithProjection`` with that projection."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = tokenizer.get_vocab()
    config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=3,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=projection or width, hidden_act="gelu",
        bos_token_id=vocab[tokenizer.bos_token], eos_token_id=vocab[tokenizer.eos_token],
        pad_token_id=vocab[tokenizer.pad_token],
    )  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(tokenizer):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=len(tokenizer.get_vocab()), d_model=T5_WIDTH, d_kv=16, d_ff=128, num_layers=2,
                      num_heads=3, feed_forward_proj="gated-gelu", decoder_start_token_id=0)  # fmt: skip
    return T5EncoderModel(config)


def _vae(channels: int, scaling: float, shift: float | None = None, quant_convs: bool = True):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=channels, norm_num_groups=8,
        sample_size=64, scaling_factor=scaling, shift_factor=shift, use_quant_conv=quant_convs,
        use_post_quant_conv=quant_convs,
    )  # fmt: skip


def _sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    tok, tok2 = clip_tokenizer(), clip_tokenizer(pad_token="!")
    time_dim = 8  # SDXL: 256; the UNet's added embedding takes pooled + 6 time ids of this width
    unet = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=time_dim, transformer_layers_per_block=(1, 2), cross_attention_dim=CLIP_L + CLIP_G,
        projection_class_embeddings_input_dim=CLIP_G_PROJECTION + 6 * time_dim, norm_num_groups=32,
    )  # fmt: skip
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading", prediction_type="epsilon")
    return StableDiffusionXLPipeline(
        vae=_vae(4, 0.13025), text_encoder=_clip(tok, CLIP_L, projection=None), tokenizer=tok,
        text_encoder_2=_clip(tok2, CLIP_G, projection=CLIP_G_PROJECTION), tokenizer_2=tok2, unet=unet,
        scheduler=scheduler, add_watermarker=False,
    )  # fmt: skip


def _sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(pad_token="!"), t5_tokenizer(256)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=CLIP_L_PROJECTION + CLIP_G_PROJECTION, pos_embed_max_size=96,
    )  # fmt: skip
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(16, 1.5305, 0.0609, quant_convs=False),
        text_encoder=_clip(tok, CLIP_L, projection=CLIP_L_PROJECTION), tokenizer=tok,
        text_encoder_2=_clip(tok2, CLIP_G, projection=CLIP_G_PROJECTION), tokenizer_2=tok2,
        text_encoder_3=_t5(tok3), tokenizer_3=tok3,
    )  # fmt: skip


def _flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tok, tok2 = clip_tokenizer(), t5_tokenizer(512)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=T5_WIDTH, pooled_projection_dim=CLIP_L, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    return FluxPipeline(
        scheduler=scheduler, vae=_vae(16, 0.3611, 0.1159, quant_convs=False),
        text_encoder=_clip(tok, CLIP_L, projection=None), tokenizer=tok, text_encoder_2=_t5(tok2), tokenizer_2=tok2,
        transformer=transformer,
    )  # fmt: skip


def _pixart(variant: str = "alpha"):
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline
    from diffusers import PixArtTransformer2DModel

    tok = t5_tokenizer(512)
    transformer = PixArtTransformer2DModel(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3,
        caption_channels=T5_WIDTH, in_channels=4, out_channels=8, cross_attention_dim=24,
        norm_type="ada_norm_single", use_additional_conditions=False,
    )  # fmt: skip
    cls = PixArtSigmaPipeline if variant == "sigma" else PixArtAlphaPipeline
    return cls(tokenizer=tok, text_encoder=_t5(tok), vae=_vae(4, 0.18215), transformer=transformer,
               scheduler=DPMSolverMultistepScheduler())  # fmt: skip


def _umt5():
    """``(tokenizer, UMT5EncoderModel)``: the tiny Wan text encoder (64 wide, 2 layers) and its T5 tokenizer."""
    from transformers import UMT5Config, UMT5EncoderModel

    tok = t5_tokenizer(512)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tok.get_vocab()), d_model=UMT5_WIDTH, d_kv=16, d_ff=96,
                                               num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                                               decoder_start_token_id=0))  # fmt: skip
    return tok, text_encoder


def _wan():
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    tok, text_encoder = _umt5()
    # Wan 2.1's VAE layout (3 spatial downsamples, the last two also temporal) at base width 8 instead of 96
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                           temperal_downsample=[False, True, True])  # fmt: skip
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=UMT5_WIDTH, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=1024,
    )  # fmt: skip
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)  # fmt: skip
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)  # fmt: skip


def _build_generic(target: Path) -> None:
    """bucketeer's embedded default encoders: ``tokenizer/``, ``text_encoder/`` (CLIP with projection), ``vae/``."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(0)  # the same weights as every earlier build of this version
    tokenizer = clip_tokenizer()
    vocab = tokenizer.get_vocab()
    tokenizer.save_pretrained(target / "tokenizer")
    CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
            bos_token_id=vocab[tokenizer.bos_token], eos_token_id=vocab[tokenizer.eos_token],
            pad_token_id=vocab[tokenizer.eos_token],
        )
    ).save_pretrained(target / "text_encoder")  # fmt: skip
    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 32, 32), layers_per_block=1, latent_channels=4, norm_num_groups=8,
        sample_size=256, scaling_factor=0.18215,
    ).save_pretrained(target / "vae")  # fmt: skip


_PIPELINES: dict[str, Callable[[], object]] = {"sdxl": _sdxl, "sd3": _sd3, "flux": _flux, "pixart": _pixart,
                                               "wan": _wan}  # fmt: skip
_PIPELINES.update({"qwen-image": tiny_qwen.qwen_image, "z-image": tiny_qwen.z_image})  # tiny_qwen.py
# each family's seed: manifests/families (FamilySpec.tiny_seed)
_SEEDS = {name: spec.tiny_seed for name, spec in SPECS.items() if spec.tiny_seed is not None}


def _declared(where: str) -> object:
    """The pipeline built by a declaration's ``tiny`` (``"module:function"`` of this package), imported when built."""
    import importlib

    module, name = where.split(":")
    return getattr(importlib.import_module(f"pipeline.embed.families.{module}"), name)()


def _tiny_flux2(family: str) -> object:
    """A pipeline of :mod:`pipeline.embed.families.tiny_flux2` (Flux 2, Flux 2 Klein)."""
    from pipeline.embed.families.tiny_flux2 import PIPELINES

    return PIPELINES[family]()


def _chroma():
    """``ChromaPipeline``: T5, a ``ChromaTransformer2DModel`` and Flux.1's VAE and scheduler (dynamic shifting)."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tok = t5_tokenizer(512)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=T5_WIDTH, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
        approximator_hidden_dim=32, approximator_layers=1,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    return ChromaPipeline(scheduler=scheduler, vae=_vae(16, 0.3611, 0.1159, quant_convs=False), text_encoder=_t5(tok),
                          tokenizer=tok, transformer=transformer)  # fmt: skip


_PIPELINES.update({"chroma": _chroma, **{f: functools.partial(_tiny_flux2, f) for f in ("flux2", "flux2-klein")}})
_PIPELINES.update({"wan2.2-a14b": lambda: tiny_wan22.wan22_a14b(*_umt5()),
                   "wan2.2-ti2v-5b": lambda: tiny_wan22.wan22_ti2v(*_umt5())})
_PIPELINES["ltx-2"] = tiny_ltx2.ltx2
_PIPELINES["hunyuanvideo-1.5"] = tiny_hunyuan.hunyuan_video15  # tiny_hunyuan.py
_PIPELINES.update({name: functools.partial(_declared, spec.tiny) for name, spec in SPECS.items() if spec.tiny})


def tiny_pipeline(family: str, variant: str | None = None) -> object:
    """The tiny random-weight pipeline object of ``family`` (see the module docstring), not saved; its weights a
    function of the family (seeded). ``variant``: ``"sigma"`` for pixart gives a ``PixArtSigmaPipeline``, ``"2.3"`` for
    ltx-2 LTX-2.3's layout; a
    ``QwenImageEditPipeline``'s processor is None (:func:`save_pipeline` writes it from its parts). Raises
    ValueError for a family without a tiny model (and for ``generic``, which is no pipeline)."""
    import torch

    from pipeline.embed.families.base import missing_classes

    if family not in _PIPELINES and family != "qwen-image-edit":
        raise ValueError(f"no tiny model for family {family!r}; families: {sorted(_SEEDS)}")
    if (missing := missing_classes(family)) is not None:
        raise UsageError(missing)
    torch.manual_seed(_SEEDS[family])
    if family == "qwen-image-edit":
        return tiny_qwen.qwen_image("QwenImageEditPipeline", processor=None)
    if family == "ltx-2":
        return tiny_ltx2.ltx2(variant)  # "2.3": LTX-2.3's layout of the same classes
    return _pixart(variant or "alpha") if family == "pixart" else _PIPELINES[family]()


def save_pipeline(pipe, folder: str | os.PathLike) -> Path:
    """``pipe.save_pretrained(folder)``, a ``QwenImageEditPipeline``'s ``processor/`` written from its parts
    (:func:`tiny_qwen.save_qwen_image_edit`); a component set to None (a model not built) is left out, and
    ``model_index.json`` says so, as ``save_pretrained`` writes it. Returns the folder."""
    from diffusers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # not its "None cannot be saved" of each component left out on purpose
    try:
        if type(pipe).__name__ == "QwenImageEditPipeline":
            tiny_qwen.save_qwen_image_edit(folder, pipe)
        else:
            pipe.save_pretrained(str(folder))  # str: a ModularPipeline's splits it
    finally:
        logging.set_verbosity(verbosity)
    return Path(folder)


def build_tiny(family: str, folder: str | os.PathLike, variant: str | None = None) -> Path:
    """Write the tiny random-weight model folder of ``family`` (see the module docstring) to ``folder``.

    ``variant``: ``"sigma"`` for pixart writes a ``PixArtSigmaPipeline``. The weights are a function
    of the family (seeded). Raises ValueError for a family without a tiny model.
    """
    target = Path(folder)
    if family == "generic":
        _build_generic(target)
    else:
        save_pipeline(tiny_pipeline(family, variant), target)
    (target / "README.txt").write_text(DEFAULT_NOTICE + "\n")
    return target


def tiny_dir(family: str, home: str | None = None) -> Path:
    """``<home>/default-encoders/<version>`` (generic) or ``.../<family>-<version>``; home defaults
    to ``$BUCKETEER_HOME`` or ``~/.cache/bucketeer``."""
    home = home or os.environ.get("BUCKETEER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "bucketeer")
    name = TINY_VERSION if family == "generic" else f"{family}-{TINY_VERSION}"
    return Path(home) / "default-encoders" / name


def ensure_tiny(family: str, home: str | None = None) -> Path:
    """Build the tiny model of ``family`` once (atomically: build aside, then rename); its folder."""
    return build_once(tiny_dir(family, home), lambda tmp: build_tiny(family, tmp))


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target`` built by ``build(folder)`` once: aside, then renamed into place (its ``README.txt``
    says it is complete); a concurrent builder's folder is as good as ours."""
    if (target / "README.txt").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".build-{uuid.uuid4().hex}"
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first; theirs is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
