"""A model family's text encoders, and the encoder specs the ``embed`` options make.

The embed workers get a picklable spec (:class:`~pipeline.embed.latents.LatentSpec`, :class:`TextSpec`),
``load()`` it into an :class:`~pipeline.embed.loading.Encoder` and use only ``describe()`` (ids, weight hashes,
shapes: the cache's fingerprint) and ``encode(batch)``. :func:`encoder_specs` makes the specs from the ``embed``
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

The latent side (each VAE's path, ``--latents``) is :mod:`pipeline.embed.latents`.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from manifests.errors import UsageError
from pipeline.embed import memory
from pipeline.embed.families import Family, TextModel, family_of_pipeline, get_family
from pipeline.embed.families.base import PAD_STEP
from pipeline.embed.families.tiny import DEFAULT_NOTICE
from pipeline.embed.latents import LatentSpec
from pipeline.embed.loading import DEFAULT_ID, LATENTS, EncoderSource, check_local, device_and_dtype, weights_sha256
from pipeline.embed.processors import load_qwen2vl_processor, processor_identity

__all__ = ["DEFAULT_NOTICE", "TextEncoders", "TextSpec", "TEXT_MODELS", "encoder_specs"]

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

    def load(self, *, use_gpu: bool = False, dtype: str = "BF16", device_memory: int | None = None,
             compute: str | None = None, weights: bool = True) -> "TextEncoders":  # fmt: skip
        """The encoders, loaded (``device_memory``: free bytes to check them against instead of the device's;
        ``compute``: :func:`~pipeline.embed.loading.device_and_dtype`'s; ``weights=False``: none read, for
        :meth:`TextEncoders.rows`)."""
        return TextEncoders(self, use_gpu=use_gpu, dtype=dtype, device_memory=device_memory, compute=compute,
                            weights=weights)


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


# config.architectures[0] -> the class it loads as (generic family: whatever the config names)
TEXT_MODELS: dict[str, str] = {
    "CLIPTextModel": "CLIPTextModel",
    "CLIPTextModelWithProjection": "CLIPTextModelWithProjection",
    "CLIPModel": "CLIPTextModelWithProjection",
    "T5EncoderModel": "T5EncoderModel",
    "T5ForConditionalGeneration": "T5EncoderModel",
    "UMT5EncoderModel": "UMT5EncoderModel",
}


def _text_class(path: str, subfolder: str, class_name: str | None) -> tuple[str, Any]:
    """``(class, config)`` of the text encoder in ``path``/``subfolder``: ``class_name``, or (None) the class its
    config's architecture loads as (:data:`TEXT_MODELS`; UsageError for another)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, subfolder=subfolder)
    if class_name is None:
        arch = (getattr(config, "architectures", None) or [""])[0]
        if arch not in TEXT_MODELS:
            raise UsageError(f"--text-encoder {path} ({subfolder or '.'}) is a {arch or config.model_type!r}; "
                             f"bucketeer knows {sorted(TEXT_MODELS)}")  # fmt: skip
        class_name = TEXT_MODELS[arch]
    return class_name, config


def shapes_only(class_name: str, config: Any) -> Any:
    """A module standing for a text encoder of ``class_name`` with ``config`` (its text config) and no weights: its
    forward returns zeros ``(B, L, 1)`` as ``last_hidden_state``, every hidden state, ``pooler_output`` and
    ``text_embeds``, so a family's ``encode`` runs its own tokenization, template and masks and yields each caption's
    row counts (:meth:`TextEncoders.rows`). Its class is named as the one it stands for, which layouts read."""
    import torch
    from transformers.utils import ModelOutput

    @dataclass
    class Zeros(ModelOutput):
        last_hidden_state: Any = None
        pooler_output: Any = None
        text_embeds: Any = None
        hidden_states: Any = None

    def forward(self, input_ids: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
        zeros = torch.zeros(*input_ids.shape, 1)  # (B, L, 1)
        layers = int(getattr(self.config, "num_hidden_layers", None) or getattr(self.config, "num_layers", 1))
        return Zeros(last_hidden_state=zeros, pooler_output=zeros[:, 0], text_embeds=zeros[:, 0],
                     hidden_states=(zeros,) * (layers + 1))  # fmt: skip

    def init(self, config: Any) -> None:
        torch.nn.Module.__init__(self)
        self.config = config

    cls = type(class_name, (torch.nn.Module,), {"__init__": init, "forward": forward})
    return cls(config)


def _load_tokenizer(path: str, subfolder: str) -> Any:
    """The tokenizer in ``path``/``subfolder`` as the pipeline loads it: the class its ``model_index.json`` names
    there (a folder without a tokenizer_config.json, as LTX-2's Gemma one, gets no special tokens from
    ``AutoTokenizer``), ``AutoTokenizer`` for a bare repo or where it names a processor (FLUX.2-dev's
    ``PixtralProcessor``, which needs torchvision: its tokenizer renders text-only chats the same,
    tests/test_qwen2vl_vision.py)."""
    import transformers

    index = Path(path, "model_index.json") if subfolder and os.path.isdir(path) else None
    named = json.loads(index.read_text()).get(subfolder) if index is not None and index.is_file() else None
    name = named[1] if isinstance(named, list) and len(named) == 2 and isinstance(named[1], str) else ""
    cls = getattr(transformers, name, None) if name.endswith(("Tokenizer", "TokenizerFast")) else None
    return (cls or transformers.AutoTokenizer).from_pretrained(path, subfolder=subfolder)


def _load_text_model(path: str, subfolder: str, class_name: str, what: str, dtype: Any = None):
    """``class_name`` from ``path``/``subfolder`` (``dtype``: loaded in that dtype; None: as the checkpoint holds
    it); refuses a checkpoint that lacks weights of that class (e.g. a CLIP without the projection SD3 pools)."""
    import transformers

    model, loading = getattr(transformers, class_name).from_pretrained(path, subfolder=subfolder, dtype=dtype,
                                                                       output_loading_info=True)  # fmt: skip
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        raise UsageError(f"{what} {path} ({subfolder or '.'}) lacks weights of a {class_name} "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): it is not the encoder "
                         "that family's pipeline loads there")  # fmt: skip
    return model


def _pipeline_index(model: EncoderSource | None) -> dict:
    """The ``model_index.json`` of ``--model``, else its ``modular_model_index.json`` (a modular pipeline's, e.g.
    ``AnimaModularPipeline``: ``_class_name`` names it too); empty: no model, or it has neither."""
    if model is None:
        return {}
    path, _ = model.resolve()
    if os.path.isdir(path):
        index = next((p for p in (Path(path, "model_index.json"), Path(path, "modular_model_index.json"))
                      if p.is_file()), None)  # fmt: skip
        return json.loads(index.read_text()) if index is not None else {}
    from diffusers import DiffusionPipeline, ModularPipeline

    for pipeline in (DiffusionPipeline, ModularPipeline):
        try:
            return dict(pipeline.load_config(path))
        except OSError:  # no such index in the repo: its subfolders are loaded (and checked) one by one
            continue
    return {}


def _check_pipeline(fam: Family, index: dict, model: EncoderSource | None) -> None:
    pipeline = index.get("_class_name")
    if pipeline is None:
        return
    if pipeline in fam.pipelines:
        kind = fam.kind_of(index) if fam.kind_of else fam.name
        if kind != fam.name:  # e.g. a Wan 2.2 A14B folder (two experts) embedded as --family wan
            raise UsageError(f"--model {model.ident}: its model_index.json is a {kind} {pipeline}, not a {fam.name} "
                             f"one; pass --family {kind}")  # fmt: skip
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

    def __init__(self, spec: TextSpec, *, use_gpu: bool = False, dtype: str = "BF16",
                 device_memory: int | None = None, compute: str | None = None, weights: bool = True):  # fmt: skip
        """``weights=False``: tokenizers, processors and configs only, each model replaced by
        :func:`shapes_only` (no weight read): what :meth:`rows` needs to count each caption's rows."""
        self.family = get_family(spec.family)
        self.device, self.compute_dtype = device_and_dtype(use_gpu, dtype, compute)
        index = _pipeline_index(spec.model)
        self.pipeline = index.get("_class_name")
        _check_pipeline(self.family, index, spec.model)
        classes = self.family.text_classes or (None,) * len(spec.sources)
        found = []
        for source, class_name in zip(spec.sources, classes):
            path, subfolder = source.resolve("text_encoder")
            check_local(path, subfolder, "--text-encoder", "text_encoder", ("config.json",))
            found.append((source, path, subfolder, *_text_class(path, subfolder or "", class_name)))
        if weights:
            memory.check_text_encoders(self.family, [(s.ident, cls, config) for s, _, _, cls, config in found],
                                       self.compute_dtype, memory.free_bytes(self.device) if device_memory is None
                                       else device_memory)  # fmt: skip
        self.models: list[TextModel] = []
        read_weights = weights  # (the loop rebinds weights to each model's hash)
        for source, path, subfolder, class_name, full_config in found:
            # a pipeline repo keeps text_encoder_2's tokenizer in tokenizer_2; a bare model repo, beside it
            tok_sub = (self.family.tokenizer or subfolder.replace("text_encoder", "tokenizer")) if subfolder else ""
            check_local(path, tok_sub, "--text-encoder", "tokenizer", ("tokenizer_config.json", "tokenizer.json"),
                         " The tokenizer is read from the tokenizer* folder matching --text-encoder-subfolder "
                         "(text_encoder_2 -> tokenizer_2), or from beside config.json without one.")
            tokenizer = _load_tokenizer(path, tok_sub)
            # a multimodal family's processor: the pipeline's folder beside the text encoder's (a bare repo: its root)
            processor = load_qwen2vl_processor(path, self.family.processor if subfolder else "") \
                if self.family.processor else None  # fmt: skip
            if not weights:
                model = shapes_only(class_name, full_config.get_text_config())
                info = {"id": source.ident, "subfolder": subfolder, "class": class_name}
                self.models.append(TextModel(tokenizer, model, self.device, info, processor))
                continue
            model = _load_text_model(path, subfolder or "", class_name, "--text-encoder").eval()
            loaded = type(model).__name__
            if self.family.prune is not None:  # only what encode runs is hashed and moved (an LLM's first layers)
                model = self.family.prune(model)
            weights = weights_sha256(model)  # of the weights as the checkpoint holds them, whatever runs them
            if next(model.parameters()).dtype != self.compute_dtype:
                # loaded again in the compute dtype, as the pipeline loads it (from_pretrained(dtype=)): a cast would
                # also cast the buffers from_pretrained builds in fp32 (RoPE's inv_freq) or in the dtype (Gemma's
                # embed_scale), and every LLM family's bf16 text would differ from the pipeline's
                del model
                gc.collect()
                model = _load_text_model(path, subfolder or "", class_name, "--text-encoder",
                                         dtype=self.compute_dtype).eval()  # fmt: skip
                if self.family.prune is not None:
                    model = self.family.prune(model)
            model.to(device=self.device)
            config = model.config.get_text_config()  # a multimodal model's (Qwen2.5-VL) is nested
            limit = getattr(config, "max_position_embeddings", None) or 512
            info = {"id": source.ident, "subfolder": subfolder, "class": loaded,
                    "weights_sha256": weights, "max_length": min(int(tokenizer.model_max_length), int(limit)),
                    "hidden_size": int(getattr(config, "hidden_size", None) or config.d_model),
                    **({"processor": processor_identity(processor)} if processor is not None else {})}
            self.models.append(TextModel(tokenizer, model, self.device, info, processor))  # fmt: skip
        if self.family.companions is not None:  # what encode runs besides them, from the pipeline folder
            folder = spec.model or replace(spec.sources[0], subfolder=None)
            self.models += self.family.companions(folder.resolve()[0], folder.ident, self.compute_dtype,
                                                  self.device, read_weights)  # fmt: skip
        self.options = replace(spec, max_tokens=self._max_tokens(spec.max_tokens))
        self.layout = self.family.layout(self.models, self.options)

    def rows(self, captions: list[str], images: list[np.ndarray] | None = None) -> list[tuple[int, ...]]:
        """Per caption, the rows its record holds of each part: the layout's lengths, or (a masked layout) the real
        tokens the family's own tokenization and template give it (``images``: a reference family's)."""
        import torch

        if not self.layout.masked:
            return [tuple(self.layout.lengths)] * len(captions)
        if self.family.count_tokens is not None and images is None:  # the tokenizer's counts: no model run
            return [(n,) for n in self.family.count_tokens(self.models, list(captions), self.options)]
        with torch.inference_mode():
            extra = {} if images is None else {"images": images}
            prompt = self.family.encode(self.models, list(captions), self.options, **extra)
        counts = [r.tolist() for r in prompt.rows] if prompt.rows is not None else \
            [[p.shape[1]] * len(captions) for p in prompt.parts]  # fmt: skip
        return [tuple(int(c[i]) for c in counts) for i in range(len(captions))]

    def _by_length(self, captions: list[str]) -> list[tuple[tuple[Any, ...], Any]]:
        """:meth:`encode` of ``captions`` grouped by padded length: a caption's tokens rounded up to a multiple of
        :data:`~pipeline.embed.families.base.PAD_STEP` (at most ``max_tokens``), each group padded to its length
        instead of ``max_tokens``, so the padding the pipeline computes and drops is not computed. The same rows up
        to float rounding: the family's encoder does not see past a caption's mask (``count_tokens``), but its
        attention sums over another padded length (on the CPU: equal, or 1 ulp of float32 apart). A caption's group
        is a function of its own length, whatever the captions beside it."""
        limit = int(self.options.max_tokens)
        counts = self.family.count_tokens(self.models, list(captions), self.options)
        lengths = [min(limit, -(-max(n, 1) // PAD_STEP) * PAD_STEP) for n in counts]
        out: list[Any] = [None] * len(captions)
        for length in sorted(set(lengths)):
            group = [i for i, n in enumerate(lengths) if n == length]
            options = self.options if length == limit else replace(self.options, max_tokens=length)
            for i, got in zip(group, self._plain([captions[i] for i in group], options)):
                out[i] = got
        return out

    def _plain(self, captions: list[str], options: Any,
               images: list[np.ndarray] | None = None) -> list[tuple[tuple[Any, ...], Any]]:  # fmt: skip
        """One batch through the family's encode, padded as ``options`` say: per caption ``(tokens, pooled)``."""
        import torch

        with torch.inference_mode():
            extra = {} if images is None else {"images": images}
            prompt = self.family.encode(self.models, list(captions), options, **extra)
            parts = [p.float().cpu() for p in prompt.parts]  # (B, L_i, D_i) each
            rows = None if prompt.rows is None else [r.cpu().tolist() for r in prompt.rows]
            pooled = None if prompt.pooled is None else prompt.pooled.float().cpu()  # (B, P)
        return [(tuple(p[j] if rows is None else p[j, : int(rows[i][j])] for i, p in enumerate(parts)),
                 None if pooled is None else pooled[j]) for j in range(len(captions))]  # fmt: skip

    def _max_tokens(self, asked: int | None) -> int | None:
        default = self.family.max_text_tokens(self.pipeline)
        limit = self.family.text_tokens_limit or default
        if limit is not None and asked is not None and asked > limit:
            raise UsageError(f"--max-text-tokens {asked} is above {self.family.name}'s {limit} "
                             f"({self.pipeline or 'its pipeline'}'s longest max_sequence_length); "
                             + ("it can only be lowered" if limit == default else f"the default is {default}"))
        return asked or default

    def describe(self) -> dict[str, Any]:
        return {"family": self.family.name, "pipeline": self.pipeline, "encoders": [m.info for m in self.models],
                "layout": self.layout.to_json(), "pooled_dim": self.layout.pooled_dim,
                "max_tokens": self.options.max_tokens, "layer": self.options.layer}  # fmt: skip

    def encode(self, captions: list[str], images: list[np.ndarray] | None = None) -> list[tuple[tuple[Any, ...], Any]]:
        """``images``: a ``reference`` family's reference image per caption (``(h, w, 3)`` uint8). On a GPU, a family
        with ``count_tokens`` is encoded in groups by length (:meth:`_by_length`); on the CPU every batch is padded
        as the pipeline pads it, so that the records equal its ``encode_prompt`` bit for bit (a group's shorter
        padding can move a long caption's rows by an ulp of float32: another summation order in attention)."""

        if self.family.count_tokens is not None and images is None and len(captions) > 1 and self.device.type == "cuda":
            return self._by_length(captions)
        return self._plain(captions, self.options, images)
