"""Encoders behind one small protocol: the VAE (latents) and a model family's text encoders.

The embed workers get a picklable spec (:class:`LatentSpec`, :class:`TextSpec`), ``load()`` it
into an :class:`Encoder` and use only ``describe()`` (ids, weight hashes, shapes: the cache's
fingerprint) and ``encode(batch)``. :func:`encoder_specs` makes the specs from the ``embed``
options: ``--family F --model ID_OR_PATH`` takes the VAE and text encoders from the subfolders of
one diffusers pipeline folder or hub id (``vae``, ``text_encoder``, ``text_encoder_2``, ...), and
``--vae`` / ``--text-encoder`` replace any of them; without ``--family`` (the ``generic`` family)
the encoders are whatever ``--vae`` and ``--text-encoder`` name. How each family encodes text is in
:mod:`pipeline.embed.families`.

Every model is loaded with ``from_pretrained``. ``default`` (``--model default``, or no encoder
options at all) is a tiny **random-weight** model of the family's real classes
(:mod:`pipeline.embed.families.tiny`), built once under ``$BUCKETEER_HOME/default-encoders/``
(default ``~/.cache/bucketeer``) and then loaded like a real one: for trying the pipeline, useless
for training a real model.

Latents are the VAE posterior **mean** (``latent_dist.mean``), unscaled, and with
``--latents posterior`` also its standard deviation: the trainer draws ``mean + std * noise`` and
multiplies by ``scaling_factor`` (after subtracting ``shift_factor`` when set), both stored in
``_cache.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from manifests.errors import UsageError
from manifests.storage import redact
from pipeline.embed.families import Family, TextModel, family_of_pipeline, get_family, qwen_image
from pipeline.embed.families.tiny import DEFAULT_NOTICE, TINY_VERSION, ensure_tiny
from pipeline.embed.processors import load_qwen2vl_processor

__all__ = ["DEFAULT_ID", "DEFAULT_NOTICE", "LATENTS", "Encoder", "EncoderSource", "LatentEncoder", "LatentSpec",
           "TextEncoders", "TextSpec", "TEXT_MODELS", "encoder_specs", "weights_sha256", "to_storage", "quiet_loading",
           "STORAGE_DTYPES"]

DEFAULT_ID = "default"
STORAGE_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
LATENTS = ("mean", "posterior")  # --latents: the posterior mean, or mean and std (for per-step sampling)


Batch = TypeVar("Batch", contravariant=True)


class Encoder(Protocol[Batch]):
    """What the embed workers need from an encoder, and all they use: ``describe()`` (ids, weight
    hashes and shapes, for the cache's fingerprint) and ``encode(batch)``. :class:`LatentEncoder` is
    an ``Encoder[np.ndarray]`` (pixels), :class:`TextEncoders` an ``Encoder[list[str]]`` (captions)."""

    def describe(self) -> dict[str, Any]: ...

    def encode(self, batch: Batch) -> Any: ...


@dataclass(frozen=True)
class EncoderSource:
    """Where a model comes from: hub id or local folder, and the subfolder inside it.

    ``default`` is the tiny random-weight model of ``family`` (built on first use under ``home``, the
    driver's ``$BUCKETEER_HOME``, so that every worker finds the same one).
    """

    source: str
    subfolder: str | None = None
    home: str | None = None
    family: str = "generic"

    @property
    def is_default(self) -> bool:
        return self.source == DEFAULT_ID

    @property
    def ident(self) -> str:
        """The id recorded in ``_cache.json`` (credentials redacted; the default's names its version)."""
        if self.is_default:
            return f"bucketeer:default-{TINY_VERSION}" if self.family == "generic" else \
                f"bucketeer:default-{self.family}-{TINY_VERSION}"  # fmt: skip
        return redact(self.source)

    def resolve(self, default_subfolder: str | None = None) -> tuple[str, str | None]:
        """``(path_or_id, subfolder)`` to pass to ``from_pretrained``; the default is built on first use."""
        if self.is_default:
            return str(ensure_tiny(self.family, self.home)), self.subfolder or default_subfolder
        return self.source, self.subfolder


@dataclass(frozen=True)
class LatentSpec:
    """The VAE to load and what to keep of its posterior (``latents``: one of :data:`LATENTS`); ``features``: a
    :class:`pipeline.embed.features.FeatureSpec` run on the same pixels (``--features``), or None."""

    source: EncoderSource
    latents: str = "mean"
    features: Any = None

    def load(self, *, use_gpu: bool = False, dtype: str = "BF16") -> "LatentEncoder":
        return LatentEncoder(self, use_gpu=use_gpu, dtype=dtype)


@dataclass(frozen=True)
class TextSpec:
    """A family's text encoders to load, in the family's order, and its options.

    ``model``: the ``--model`` folder or id, whose ``model_index.json`` names the pipeline class
    (checked against the family; PixArt's default length depends on it). ``max_tokens``: the
    user's ``--max-text-tokens`` (None: the family's default). ``layer``: ``--text-layer`` (generic only).
    """

    family: str
    sources: tuple[EncoderSource, ...]
    model: EncoderSource | None = None
    max_tokens: int | None = None
    layer: str | None = None

    def load(self, *, use_gpu: bool = False, dtype: str = "BF16") -> "TextEncoders":
        return TextEncoders(self, use_gpu=use_gpu, dtype=dtype)


def encoder_specs(
    *,
    family: str | None,
    model: str | None,
    vae: str | None,
    vae_subfolder: str | None,
    text_encoders: list[str] | None,
    text_subfolders: list[str] | None,
    max_tokens: int | None = None,
    layer: str | None = None,
    latents: str = "mean",
    home: str | None = None,
) -> tuple[LatentSpec, TextSpec]:
    """The specs the ``embed`` options ask for (see the module docstring); UsageError for options
    that do not go together, naming them."""
    fam = get_family(family or "generic")
    texts = list(text_encoders or ([DEFAULT_ID] if fam.name == "generic" else []))
    subs = list(text_subfolders or [])
    if len(subs) > len(texts):
        raise UsageError(f"{len(subs)} --text-encoder-subfolder options for {len(texts)} --text-encoder options")
    subs += [None] * (len(texts) - len(subs))
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-text-tokens must be >= 1, got {max_tokens}")
    if latents not in LATENTS:
        raise UsageError(f"--latents must be one of {LATENTS}, got {latents!r}")

    def source(name: str, subfolder: str | None = None) -> EncoderSource:
        return EncoderSource(name, subfolder, home, fam.name)

    if fam.name == "generic":
        if model:
            raise UsageError("--model needs --family (one of sdxl, sd3, flux, pixart): it says which subfolders "
                             "hold which encoder. Without --family, name them with --vae and --text-encoder")
        text_sources = tuple(source(t, s) for t, s in zip(texts, subs))
        return (LatentSpec(source(vae or DEFAULT_ID, vae_subfolder), latents),
                TextSpec(fam.name, text_sources, None, max_tokens, layer or "last"))  # fmt: skip
    if layer is not None:
        raise UsageError(f"--text-layer is for encoders without a --family; --family {fam.name} takes each "
                         "encoder's layer as its pipeline does")  # fmt: skip
    need = f"--family {fam.name} needs --model (a diffusers folder or hub id; 'default': a tiny random one)"
    if texts and len(texts) != len(fam.text_encoders):
        raise UsageError(f"--family {fam.name} has {len(fam.text_encoders)} text encoders "
                         f"({', '.join(fam.text_encoders)}); got {len(texts)} --text-encoder options")  # fmt: skip
    if not model and not (vae and texts):
        raise UsageError(f"{need}, or --vae and {len(fam.text_encoders)} --text-encoder options")
    if texts:
        text_sources = tuple(source(t, s) for t, s in zip(texts, subs))
    else:
        text_sources = tuple(source(model, role) for role in fam.text_encoders)
    vae_source = source(vae, vae_subfolder) if vae else source(model, vae_subfolder or fam.vae)
    return (LatentSpec(vae_source, latents),
            TextSpec(fam.name, text_sources, source(model) if model else None, max_tokens, None))  # fmt: skip


def weights_sha256(model: Any) -> str:
    """sha256 over the model's state dict (sorted names, dtypes, shapes, raw bytes): source-independent."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def to_storage(tensor: Any, dtype: str) -> np.ndarray:
    """A torch tensor as numpy in the storage dtype tag (BF16 returned as its uint16 bits)."""
    import torch

    if dtype == "BF16":
        return tensor.to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.to(torch.float16 if dtype == "F16" else torch.float32).cpu().numpy()


def quiet_loading() -> None:
    """Silence per-file progress bars of from_pretrained (one per worker would flood the job log)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


def _device_and_dtype(use_gpu: bool, dtype: str):
    import torch

    if use_gpu and torch.cuda.is_available():
        # fp16 VAEs overflow (SDXL's VAE NaNs in fp16): compute in bf16 or fp32, store in `dtype`
        return torch.device("cuda"), torch.bfloat16 if dtype == "BF16" else torch.float32
    return torch.device("cpu"), torch.float32


def _check_local(path: str, subfolder: str | None, option: str, expected: str, files: tuple[str, ...],
                 note: str = "") -> None:
    """Fail early and clearly when a local folder lacks what ``from_pretrained`` will look for.

    Hub ids (not local folders) are left to ``from_pretrained``. Raises ValueError naming the
    option and the folder, with the subfolder to pass when ``path`` is a diffusers pipeline folder.
    """
    if not os.path.isdir(path):
        return
    folder = Path(path, subfolder or "")
    if any((folder / f).is_file() for f in files):
        return
    hint = note
    if not subfolder and (Path(path) / expected / files[0]).is_file():
        hint = f" It looks like a diffusers pipeline folder: pass {option}-subfolder {expected}."
    raise UsageError(f"{option} {path}{f' ({option}-subfolder {subfolder})' if subfolder else ''}: "
                     f"no {' or '.join(files)} in {folder}.{hint}")  # fmt: skip


# what a VAE config's _class_name may name; Wan's takes clips; Qwen-Image's (Wan-style) encodes images as 1-frame clips
VAE_CLASSES = ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLQwenImage")


def _vae_class(path: str, subfolder: str | None):
    """The diffusers VAE class ``path``/``subfolder``'s config names (else ``AutoencoderKL``, as always)."""
    import diffusers

    try:
        name = diffusers.AutoencoderKL.load_config(path, subfolder=subfolder).get("_class_name")
    except (OSError, ValueError):  # let from_pretrained say what is missing, as it always did
        name = None
    return getattr(diffusers, name if name in VAE_CLASSES else "AutoencoderKL")


class LatentEncoder:
    """``AutoencoderKL`` latents: uint8 pixels ``(B, H, W, 3)`` -> ``{"latent": posterior mean (B, C, H/f, W/f)}``,
    plus ``"latent_std"`` (same shape) with ``--latents posterior``. A video VAE (``AutoencoderKLWan``, when the
    folder's config names it) takes clips ``(B, F, H, W, 3)`` -> ``(B, C, F', H/f, W/f)``, F' = (F - 1) //
    temporal_factor + 1 (an image is a 1-frame clip)."""

    def __init__(self, spec: LatentSpec, *, use_gpu: bool = False, dtype: str = "BF16"):
        path, subfolder = spec.source.resolve("vae")
        self.id, self.latents = spec.source.ident, spec.latents
        _check_local(path, subfolder, "--vae", "vae", ("config.json",))
        self.device, self.compute_dtype = _device_and_dtype(use_gpu, dtype)
        self.vae = _vae_class(path, subfolder).from_pretrained(path, subfolder=subfolder).eval()
        self.video = type(self.vae).__name__ == "AutoencoderKLWan"
        # Qwen-Image: per-channel statistics applied here, as QwenImageEditPipeline._encode_vae_image applies them
        self.normalised = type(self.vae).__name__ == "AutoencoderKLQwenImage"
        self.weights = weights_sha256(self.vae)  # of the weights as published, before any cast
        self.vae.to(self.device)
        if self.compute_dtype != self.vae.dtype:
            self.vae.to(dtype=self.compute_dtype)
        self.subfolder = subfolder
        self.features = None if spec.features is None else spec.features.load(use_gpu=use_gpu, dtype=dtype)

    def describe(self) -> dict[str, Any]:
        cfg = self.vae.config
        if self.normalised:  # stored as the denoiser sees them: nothing left for the trainer to scale
            shape = qwen_image.vae_description(cfg)
        elif self.video:  # Wan: no scaling factor; the trainer normalises per channel with latents_mean/std
            shape = {"factor": int(cfg.scale_factor_spatial), "channels": int(cfg.z_dim), "scaling_factor": 1.0,
                     "shift_factor": None, "latents_mean": [float(x) for x in cfg.latents_mean],
                     "latents_std": [float(x) for x in cfg.latents_std],
                     "temporal_factor": int(cfg.scale_factor_temporal)}  # fmt: skip
        else:
            shape = {"factor": 2 ** (len(cfg.block_out_channels) - 1), "channels": int(cfg.latent_channels),
                     "scaling_factor": float(cfg.scaling_factor),
                     "shift_factor": None if getattr(cfg, "shift_factor", None) is None else float(cfg.shift_factor)}
        return {
            "id": self.id,
            "subfolder": self.subfolder,
            "class": type(self.vae).__name__,
            "weights_sha256": self.weights,
            **shape,
            "latents": self.latents,
            "device": str(self.device),  # where it runs: recorded in _cache.json, not fingerprinted
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "features": None if self.features is None else self.features.describe(),
        }

    def encode(self, batch: np.ndarray, features_of: int | None = None) -> dict[str, Any]:
        """``features_of``: with ``--features``, also ``"features"`` ``(n, gh, gw, D)`` of the first n images."""
        import torch

        with torch.inference_mode():
            batch = batch if batch.flags.writeable else batch.copy()  # Ray hands out read-only arrays
            extra = {} if self.features is None else {"features": self.features.encode(batch[:features_of])}
            x = torch.from_numpy(batch).to(self.device)
            # (B, 3, H, W) uint8, or a clip (B, 3, F, H, W)
            x = x.permute(0, 4, 1, 2, 3) if x.ndim == 5 else x.permute(0, 3, 1, 2)
            # [-1, 1] in float32, then the compute dtype, as diffusers' image processor does: in bf16 the division
            # rounds to 1/128 above 1.0 and the subtraction keeps that, up to half a level off for bright pixels
            x = (x.float() / 127.5 - 1.0).to(self.compute_dtype)
            if self.normalised:
                return {**qwen_image.vae_latents(self.vae, x, std=self.latents == "posterior"), **extra}
            posterior = self.vae.encode(x).latent_dist
            out = {"latent": posterior.mean.float()}  # (B, C, h, w), a clip's (B, C, F', h, w)
            if self.latents == "posterior":
                out["latent_std"] = posterior.std.float()  # (B, C, h, w): exp(logvar / 2), logvar clamped
            return {**out, **extra}


# config.architectures[0] -> the class it loads as (generic family: whatever the config names)
TEXT_MODELS: dict[str, str] = {
    "CLIPTextModel": "CLIPTextModel",
    "CLIPTextModelWithProjection": "CLIPTextModelWithProjection",
    "CLIPModel": "CLIPTextModelWithProjection",
    "T5EncoderModel": "T5EncoderModel",
    "T5ForConditionalGeneration": "T5EncoderModel",
    "UMT5EncoderModel": "UMT5EncoderModel",
}


def _load_text_model(path: str, subfolder: str, class_name: str | None, what: str):
    """``class_name`` (None: the class the config names) from ``path``/``subfolder``; refuses a
    checkpoint that lacks weights of that class (e.g. a CLIP without the projection SD3 pools)."""
    import transformers
    from transformers import AutoConfig

    if class_name is None:
        config = AutoConfig.from_pretrained(path, subfolder=subfolder)
        arch = (getattr(config, "architectures", None) or [""])[0]
        if arch not in TEXT_MODELS:
            raise UsageError(f"--text-encoder {path} ({subfolder or '.'}) is a {arch or config.model_type!r}; "
                             f"bucketeer knows {sorted(TEXT_MODELS)}")  # fmt: skip
        class_name = TEXT_MODELS[arch]
    model, loading = getattr(transformers, class_name).from_pretrained(path, subfolder=subfolder,
                                                                       output_loading_info=True)  # fmt: skip
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        raise UsageError(f"{what} {path} ({subfolder or '.'}) lacks weights of a {class_name} "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): it is not the encoder "
                         "that family's pipeline loads there")  # fmt: skip
    return model


def _pipeline_class(model: EncoderSource | None) -> str | None:
    """``_class_name`` of the ``model_index.json`` of ``--model`` (None: no model, or it has none)."""
    if model is None:
        return None
    path, _ = model.resolve()
    if os.path.isdir(path):
        index = Path(path, "model_index.json")
        return json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.load_config(path).get("_class_name")
    except OSError:  # no model_index.json in the repo: its subfolders are loaded (and checked) one by one
        return None


def _check_pipeline(fam: Family, pipeline: str | None, model: EncoderSource | None) -> None:
    if pipeline is None or pipeline in fam.pipelines:
        return
    other = family_of_pipeline(pipeline)
    hint = f"pass --family {other}" if other else f"--family {fam.name} reads {', '.join(fam.pipelines)} folders"
    raise UsageError(f"--model {model.ident}: its model_index.json says {pipeline}, not a {fam.name} pipeline; {hint}")


class TextEncoders:
    """A family's text encoders applied to the same captions (:mod:`pipeline.embed.families`).

    ``encode(captions)`` returns per caption ``(tokens, pooled)``: ``tokens[i]`` float32 ``(L_i, D_i)``
    (part ``i`` of the cache's ``text.layout``: padded, or the real tokens of a masked family),
    ``pooled`` float32 ``(P,)`` or None.
    """

    def __init__(self, spec: TextSpec, *, use_gpu: bool = False, dtype: str = "BF16"):
        from transformers import AutoTokenizer

        self.family = get_family(spec.family)
        self.device, self.compute_dtype = _device_and_dtype(use_gpu, dtype)
        self.pipeline = _pipeline_class(spec.model)
        _check_pipeline(self.family, self.pipeline, spec.model)
        classes = self.family.text_classes or (None,) * len(spec.sources)
        self.models: list[TextModel] = []
        for source, class_name in zip(spec.sources, classes):
            path, subfolder = source.resolve("text_encoder")
            # a pipeline repo keeps text_encoder_2's tokenizer in tokenizer_2; a bare model repo, beside it
            tok_sub = subfolder.replace("text_encoder", "tokenizer") if subfolder else ""
            _check_local(path, subfolder, "--text-encoder", "text_encoder", ("config.json",))
            _check_local(path, tok_sub, "--text-encoder", "tokenizer", ("tokenizer_config.json", "tokenizer.json"),
                         " The tokenizer is read from the tokenizer* folder matching --text-encoder-subfolder "
                         "(text_encoder_2 -> tokenizer_2), or from beside config.json without one.")
            tokenizer = AutoTokenizer.from_pretrained(path, subfolder=tok_sub)
            # a multimodal family's processor: the pipeline's folder beside the text encoder's (a bare repo: its root)
            processor = load_qwen2vl_processor(path, self.family.processor if subfolder else "") \
                if self.family.processor else None  # fmt: skip
            model = _load_text_model(path, subfolder or "", class_name, "--text-encoder").eval()
            weights = weights_sha256(model)
            model.to(device=self.device, dtype=self.compute_dtype)
            config = model.config.get_text_config()  # a multimodal model's (Qwen2.5-VL) is nested
            limit = getattr(config, "max_position_embeddings", None) or 512
            info = {"id": source.ident, "subfolder": subfolder, "class": type(model).__name__,
                    "weights_sha256": weights, "max_length": min(int(tokenizer.model_max_length), int(limit)),
                    "hidden_size": int(getattr(config, "hidden_size", None) or config.d_model)}
            self.models.append(TextModel(tokenizer, model, self.device, info, processor))  # fmt: skip
        self.options = replace(spec, max_tokens=self._max_tokens(spec.max_tokens))
        self.layout = self.family.layout(self.models, self.options)

    def _max_tokens(self, asked: int | None) -> int | None:
        default = self.family.max_text_tokens(self.pipeline)
        if default is not None and asked is not None and asked > default:
            raise UsageError(f"--max-text-tokens {asked} is above {self.family.name}'s {default} "
                             f"({self.pipeline or 'its pipeline'}'s max_sequence_length); it can only be lowered")
        return asked or default

    def describe(self) -> dict[str, Any]:
        return {"family": self.family.name, "pipeline": self.pipeline, "encoders": [m.info for m in self.models],
                "layout": self.layout.to_json(), "pooled_dim": self.layout.pooled_dim,
                "max_tokens": self.options.max_tokens, "layer": self.options.layer}  # fmt: skip

    def encode(self, captions: list[str], images: list[np.ndarray] | None = None) -> list[tuple[tuple[Any, ...], Any]]:
        """``images``: a ``reference`` family's reference image per caption (``(h, w, 3)`` uint8)."""
        import torch

        with torch.inference_mode():
            extra = {} if images is None else {"images": images}
            prompt = self.family.encode(self.models, list(captions), self.options, **extra)
            parts = [p.float().cpu() for p in prompt.parts]  # (B, L_i, D_i) each
            rows = None if prompt.rows is None else [r.cpu().tolist() for r in prompt.rows]
            pooled = None if prompt.pooled is None else prompt.pooled.float().cpu()  # (B, P)
        out = []
        for j in range(len(captions)):
            tokens = tuple(p[j] if rows is None else p[j, : int(rows[i][j])] for i, p in enumerate(parts))
            out.append((tokens, None if pooled is None else pooled[j]))
        return out
