"""Encoders behind one small protocol: the VAE (latents) and text encoders (token + pooled embeddings).

Every encoder is loaded with ``from_pretrained`` from a hub id or a local folder. The embedded
default (``--vae default`` / ``--text-encoder default``) is a set of tiny **random-weight** models
of the real architectures (an 8x-downsampling ``AutoencoderKL``, a ``CLIPTextModelWithProjection``
and a byte-level CLIP tokenizer) that bucketeer builds once, saves with ``save_pretrained`` under
``$BUCKETEER_HOME/default-encoders/<version>`` (default ``~/.cache/bucketeer``) and then loads
through the same ``from_pretrained`` path as a real model. They exist to try the pipeline without
a model hub; their outputs are noise and useless for training a real model.

Latents are the VAE posterior **mean** (``latent_dist.mean``), unscaled: the trainer multiplies by
``scaling_factor`` (after subtracting ``shift_factor`` when set), both stored in ``_cache.json``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import numpy as np

from manifests.errors import UsageError

__all__ = [
    "DEFAULT_ID",
    "DEFAULT_NOTICE",
    "Encoder",
    "EncoderSource",
    "LatentEncoder",
    "TextEncoders",
    "TEXT_MODELS",
    "default_encoders_dir",
    "ensure_default_encoders",
    "weights_sha256",
    "to_storage",
    "quiet_loading",
    "STORAGE_DTYPES",
]

DEFAULT_ID = "default"
_DEFAULT_VERSION = "v1"
DEFAULT_NOTICE = (
    "bucketeer: using the embedded DEFAULT encoders (tiny random-weight AutoencoderKL + CLIP text model). "
    "They are for trying the pipeline, NOT for training a real model: pass --vae / --text-encoder."
)
STORAGE_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


Batch = TypeVar("Batch", contravariant=True)


class Encoder(Protocol[Batch]):
    """What the embed workers need from an encoder, and all they use: ``describe()`` (ids, weight
    hashes and shapes, for the cache's fingerprint) and ``encode(batch)``. :class:`LatentEncoder` is
    an ``Encoder[np.ndarray]`` (pixels), :class:`TextEncoders` an ``Encoder[list[str]]`` (captions)."""

    def describe(self) -> dict[str, Any]: ...

    def encode(self, batch: Batch) -> Any: ...


@dataclass(frozen=True)
class EncoderSource:
    """Where an encoder comes from: hub id or local folder, and the subfolder inside it."""

    source: str
    subfolder: str | None = None
    home: str | None = None  # $BUCKETEER_HOME of the driver, so every worker finds the same default


    @property
    def is_default(self) -> bool:
        return self.source == DEFAULT_ID

    def resolve(self, default_subfolder: str) -> tuple[str, str | None, str]:
        """``(path_or_id, subfolder, id for the fingerprint)``; the default is built on first use."""
        if self.is_default:
            path = str(ensure_default_encoders(self.home))
            return path, self.subfolder or default_subfolder, f"bucketeer:default-{_DEFAULT_VERSION}"
        return self.source, self.subfolder, self.source


def default_encoders_dir(home: str | None = None) -> Path:
    """``<home>/default-encoders/<version>``; home defaults to ``$BUCKETEER_HOME`` or ``~/.cache/bucketeer``."""
    home = home or os.environ.get("BUCKETEER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "bucketeer")
    return Path(home) / "default-encoders" / _DEFAULT_VERSION


def _byte_level_vocab() -> list[str]:
    # CLIP's byte-to-unicode table: every byte maps to a printable character, so any text tokenizes
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(extra))]


def _clip_tokenizer(model_max_length: int = 77, pad_token: str | None = None):
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


def _build_default(target: Path) -> None:
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(0)
    tokenizer = _clip_tokenizer()
    vocab = tokenizer.get_vocab()
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    tokenizer.save_pretrained(target / "tokenizer")
    text = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
            bos_token_id=vocab[bos], eos_token_id=vocab[eos], pad_token_id=vocab[eos],
        )
    )  # fmt: skip
    text.save_pretrained(target / "text_encoder")
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 32, 32), layers_per_block=1, latent_channels=4, norm_num_groups=8,
        sample_size=256, scaling_factor=0.18215,
    )  # fmt: skip
    vae.save_pretrained(target / "vae")
    (target / "README.txt").write_text(DEFAULT_NOTICE + "\n")


def ensure_default_encoders(home: str | None = None) -> Path:
    """Build the default encoders once (atomically: build aside, then rename) and return their folder."""
    target = default_encoders_dir(home)
    if (target / "README.txt").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".build-{uuid.uuid4().hex}"
    try:
        _build_default(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first; theirs is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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


class LatentEncoder:
    """``AutoencoderKL`` latents: uint8 pixels ``(B, H, W, 3)`` -> posterior mean ``(B, C, H/f, W/f)``."""

    def __init__(self, source: EncoderSource, *, use_gpu: bool = False, dtype: str = "BF16"):
        from diffusers import AutoencoderKL

        path, subfolder, self.id = source.resolve("vae")
        _check_local(path, subfolder, "--vae", "vae", ("config.json",))
        self.device, self.compute_dtype = _device_and_dtype(use_gpu, dtype)
        self.vae = AutoencoderKL.from_pretrained(path, subfolder=subfolder).eval()
        self.weights = weights_sha256(self.vae)  # of the weights as published, before any cast
        self.vae.to(self.device)
        if self.compute_dtype != self.vae.dtype:
            self.vae.to(dtype=self.compute_dtype)
        self.subfolder = subfolder

    def describe(self) -> dict[str, Any]:
        cfg = self.vae.config
        return {
            "id": self.id,
            "subfolder": self.subfolder,
            "class": type(self.vae).__name__,
            "weights_sha256": self.weights,
            "factor": 2 ** (len(cfg.block_out_channels) - 1),
            "channels": int(cfg.latent_channels),
            "scaling_factor": float(cfg.scaling_factor),
            "shift_factor": None if getattr(cfg, "shift_factor", None) is None else float(cfg.shift_factor),
            "device": str(self.device),  # where it runs: recorded in _cache.json, not fingerprinted
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
        }

    def encode(self, batch: np.ndarray) -> Any:
        import torch

        with torch.inference_mode():
            batch = batch if batch.flags.writeable else batch.copy()  # Ray hands out read-only arrays
            x = torch.from_numpy(batch).to(self.device).permute(0, 3, 1, 2)  # (B, 3, H, W) uint8
            x = x.to(self.compute_dtype) / 127.5 - 1.0
            return self.vae.encode(x).latent_dist.mean.float()


def _load_clip(path: str, subfolder: str):
    from transformers import CLIPTextModel

    return CLIPTextModel.from_pretrained(path, subfolder=subfolder)


def _load_clip_projection(path: str, subfolder: str):
    from transformers import CLIPTextModelWithProjection

    return CLIPTextModelWithProjection.from_pretrained(path, subfolder=subfolder)


def _load_t5(path: str, subfolder: str):
    from transformers import T5EncoderModel

    return T5EncoderModel.from_pretrained(path, subfolder=subfolder)


# config.architectures[0] -> factory(path, subfolder); transformers spells "no subfolder" "" (None fails there)
TEXT_MODELS: dict[str, Callable[[str, str], Any]] = {
    "CLIPTextModel": _load_clip,
    "CLIPTextModelWithProjection": _load_clip_projection,
    "CLIPModel": _load_clip_projection,
    "T5EncoderModel": _load_t5,
    "T5ForConditionalGeneration": _load_t5,
}


def _load_text_model(path: str, subfolder: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, subfolder=subfolder)
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch not in TEXT_MODELS:
        raise UsageError(f"--text-encoder {path} ({subfolder or '.'}) is a {arch or config.model_type!r}; "
                         f"bucketeer knows {sorted(TEXT_MODELS)}")  # fmt: skip
    return TEXT_MODELS[arch](path, subfolder)


class TextEncoders:
    """One or more text encoders (SDXL: two) applied to the same captions.

    ``encode(captions)`` returns per caption ``(tokens, pooled)``: ``tokens[i]`` float32
    ``(L_i, D_i)`` unpadded, ``pooled`` float32 ``(D,)`` from the last encoder that has one, or None.
    ``layer`` is ``last`` (last hidden state) or ``penultimate`` (SDXL's choice).
    """

    def __init__(
        self, sources: list[EncoderSource], *, use_gpu: bool = False, dtype: str = "BF16", layer: str = "last"
    ):
        from transformers import AutoTokenizer

        if layer not in ("last", "penultimate"):
            raise UsageError(f"--text-layer must be 'last' or 'penultimate', got {layer!r}")
        self.device, self.compute_dtype = _device_and_dtype(use_gpu, dtype)
        self.layer = layer
        self.parts = []
        for i, source in enumerate(sources):
            path, subfolder, ident = source.resolve("text_encoder")
            # a pipeline repo keeps text_encoder_2's tokenizer in tokenizer_2; a bare model repo, beside it
            tok_sub = subfolder.replace("text_encoder", "tokenizer") if subfolder else ""
            _check_local(path, subfolder, "--text-encoder", "text_encoder", ("config.json",))
            _check_local(path, tok_sub, "--text-encoder", "tokenizer", ("tokenizer_config.json", "tokenizer.json"),
                         " The tokenizer is read from the tokenizer* folder matching --text-encoder-subfolder "
                         "(text_encoder_2 -> tokenizer_2), or from beside config.json without one.")
            tokenizer = AutoTokenizer.from_pretrained(path, subfolder=tok_sub)
            model = _load_text_model(path, subfolder or "").eval()
            weights = weights_sha256(model)
            model.to(device=self.device, dtype=self.compute_dtype)
            limit = getattr(model.config, "max_position_embeddings", None) or 512
            max_length = min(int(tokenizer.model_max_length), int(limit))
            self.parts.append((tokenizer, model, {"id": ident, "subfolder": subfolder, "class": type(model).__name__,
                                                  "weights_sha256": weights, "max_length": max_length,
                                                  "hidden_size": int(model.config.hidden_size)}))  # fmt: skip

    def describe(self) -> dict[str, Any]:
        pooled = None
        for _, model, info in self.parts:
            if info["class"] == "CLIPTextModelWithProjection":
                pooled = int(model.config.projection_dim)
            elif info["class"] == "CLIPTextModel":
                pooled = int(model.config.hidden_size)
        return {"encoders": [info for *_, info in self.parts], "layer": self.layer, "pooled_dim": pooled}

    def encode(self, captions: list[str]) -> list[tuple[tuple[Any, ...], Any]]:
        import torch

        tokens: list[list[Any]] = [[] for _ in captions]
        pooled: list[Any] = [None] * len(captions)
        with torch.inference_mode():
            for tokenizer, model, info in self.parts:
                enc = tokenizer(captions, padding="longest", truncation=True, max_length=info["max_length"],
                                return_tensors="pt")  # fmt: skip
                mask = enc["attention_mask"].to(self.device)
                out = model(input_ids=enc["input_ids"].to(self.device), attention_mask=mask, output_hidden_states=True)
                hidden = out.hidden_states[-2] if self.layer == "penultimate" else out.last_hidden_state  # (B, L, D)
                lengths = mask.sum(dim=1).tolist()
                for j, n in enumerate(lengths):
                    tokens[j].append(hidden[j, : int(n)].float().cpu())  # unpadded (L_j, D)
                p = getattr(out, "text_embeds", None)
                if p is None and info["class"] == "CLIPTextModel":
                    p = out.pooler_output
                if p is not None:
                    for j in range(len(captions)):
                        pooled[j] = p[j].float().cpu()
        return [(tuple(t), p) for t, p in zip(tokens, pooled)]
