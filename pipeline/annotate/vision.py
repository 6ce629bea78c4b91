"""The embedding tasks: a CLIP image embedding and score heads on it (``embedding``, ``aesthetic``,
``safety``, ``watermark``).

- The embedder: ``CLIPVisionModelWithProjection`` + its image processor (``AutoImageProcessor``), loaded
  with ``from_pretrained`` from a hub id or a folder (a full CLIP checkpoint such as
  ``openai/clip-vit-large-patch14`` loads its vision half). The embedding is ``image_embeds``,
  L2-normalised, computed in float32 and stored as float16 (``D`` = the projection width).
- A head: a chain of ``Linear`` layers in a safetensors state dict (``layers.<i>.weight``/``.bias``, applied
  in the order of ``i``: the LAION aesthetic predictor's keys, whose Dropout layers hold no weights),
  optional safetensors metadata ``activation`` (``none`` or ``relu``, between the layers) and ``output``
  (``identity`` or ``sigmoid``; ``safety`` and ``watermark`` are always given as a sigmoid probability).
  Its input is the L2-normalised float32 embedding. A head is a ``.safetensors`` file or ``HUB_ID[:FILE]``
  (``FILE`` defaults to ``model.safetensors``, fetched with ``huggingface_hub``); never a pickle.
- ``default`` (each): tiny random weights with a fixed seed, built once under
  ``$BUCKETEER_HOME/default-annotators/`` like embed's default encoders: a 2-layer CLIP vision tower,
  32 wide at 32x32 pixels (D = 32), and heads of the LAION aesthetic shape (D-1024-128-64-16-1) and small
  D-64-1 sigmoid heads for safety and watermark, for whatever D the embedder has. Their values are noise:
  they exist to run the pipeline, and ``TaskSettings.model`` says ``default`` (``bucketeer dedup`` refuses
  ``--by embedding`` over a default embedder).

The head tasks need the embedding: it is computed whenever any of them is asked; the ``embedding``
column is stored only when ``embedding`` is asked too.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from manifests.errors import UsageError
from pipeline.embed.families.tiny import build_once

__all__ = ["HEAD_TASKS", "VisionSpec", "ImageEmbedder", "describe_vision", "build_default_embedder",
           "build_default_head", "load_head", "device_pixels"]  # fmt: skip

HEAD_TASKS = ("aesthetic", "safety", "watermark")
EMBEDDER_VERSION, HEADS_VERSION = "clip-vision-tiny-v1", "heads-v1"
_HEAD_SHAPES = {"aesthetic": (1024, 128, 64, 16), "safety": (64,), "watermark": (64,)}  # hidden widths
_HEAD_SEEDS = {"aesthetic": 261, "safety": 262, "watermark": 263}
_SIGMOID = ("safety", "watermark")


@dataclass(frozen=True)
class VisionSpec:
    """Which embedder and heads: ``model`` (hub id, folder, ``default``), ``heads`` ``((task, source), ...)``
    for the head tasks asked, ``home`` (the driver's ``$BUCKETEER_HOME``, where each node builds defaults)."""

    model: str = "default"
    heads: tuple[tuple[str, str], ...] = ()
    home: str | None = None

    def model_path(self) -> str:
        if self.model == "default":
            return str(build_once(_home(self.home) / EMBEDDER_VERSION, build_default_embedder))
        return self.model

    def head_path(self, task: str, source: str, dim: int) -> str:
        """A local safetensors file of ``source`` (built once for ``default``, fetched for a hub id)."""
        if source == "default":
            folder = build_once(_home(self.home) / HEADS_VERSION / f"{task}-{dim}",
                                lambda f: build_default_head(f, task, dim))  # fmt: skip
            return str(folder / "model.safetensors")
        if os.path.isfile(source):
            return source
        repo, _, name = source.partition(":")
        try:
            from huggingface_hub import hf_hub_download

            return hf_hub_download(repo, name or "model.safetensors")
        except Exception as e:  # the hub's own errors (offline, unknown id): all "cannot fetch"
            raise UsageError(f"--{task}-head {source}: neither a file nor a hub id it can fetch: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def _home(home: str | None) -> Path:
    home = home or os.environ.get("BUCKETEER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "bucketeer")
    return Path(home) / "default-annotators"


def build_default_embedder(folder: Path, *, width: int = 32, layers: int = 2, image: int = 32, patch: int = 8) -> None:
    """The tiny seeded CLIP vision tower + its processor, saved with ``save_pretrained``; ``width``, ``layers``,
    ``image`` (pixels, a multiple of ``patch``): a larger random one (benchmarks)."""
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                              num_attention_heads=max(2, width // 64), image_size=image, patch_size=patch,
                              projection_dim=width)  # fmt: skip
    torch.manual_seed(26)
    CLIPVisionModelWithProjection(config).save_pretrained(folder)
    crop = {"height": image, "width": image}
    CLIPImageProcessor(size={"shortest_edge": image}, crop_size=crop).save_pretrained(folder)
    (Path(folder) / "README.txt").write_text("bucketeer annotate's default embedder: random weights, for trying "
                                             "the pipeline only.\n")  # fmt: skip


def build_default_head(folder: Path, task: str, dim: int) -> None:
    """The seeded random head of ``task`` for ``dim``-wide embeddings, as ``folder/model.safetensors``."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(_HEAD_SEEDS[task])
    widths = (dim, *_HEAD_SHAPES[task], 1)
    tensors = {}
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        bound = a**-0.5  # nn.Linear's default init range
        tensors[f"layers.{2 * i}.weight"] = (torch.rand(b, a, generator=gen) * 2 - 1) * bound
        tensors[f"layers.{2 * i}.bias"] = (torch.rand(b, generator=gen) * 2 - 1) * bound
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(folder) / "model.safetensors"),
              metadata={"activation": "none" if task == "aesthetic" else "relu",
                        "output": "sigmoid" if task in _SIGMOID else "identity"})  # fmt: skip
    (Path(folder) / "README.txt").write_text(f"bucketeer annotate's default {task} head: random weights.\n")


@dataclass(frozen=True)
class Head:
    """A loaded head: ``layers`` ``[(weight (out, in), bias (out,)), ...]`` torch tensors, its settings."""

    task: str
    layers: tuple
    activation: str
    sigmoid: bool

    @property
    def dim(self) -> int:
        return int(self.layers[0][0].shape[1])

    def __call__(self, embedding):
        """(n,) float32 scores of (n, D) float32 L2-normalised embeddings."""
        import torch

        x = embedding
        for i, (w, b) in enumerate(self.layers):
            x = torch.nn.functional.linear(x, w, b)
            if self.activation == "relu" and i < len(self.layers) - 1:
                x = torch.relu(x)
        x = x[:, 0]
        return torch.sigmoid(x) if self.sigmoid else x


def load_head(task: str, path: str, source: str = "") -> Head:
    """The head in safetensors ``path``; UsageError (naming ``--<task>-head``) when it is not one."""
    from safetensors import safe_open

    flag = f"--{task}-head {source or path}"
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a file that is not one
        raise UsageError(f"{flag}: not a safetensors file ({type(e).__name__}: {e})") from None
    index = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.endswith(".weight")})
    layers = tuple((tensors[f"layers.{i}.weight"], tensors.get(f"layers.{i}.bias")) for i in index)
    chained = all(a[0].shape[0] == b[0].shape[1] for a, b in zip(layers, layers[1:]))
    if not layers or not chained or layers[-1][0].shape[0] != 1 or any(w.dim() != 2 for w, _ in layers):
        raise UsageError(f"{flag}: expected Linear layers 'layers.<i>.weight' chaining to one output, found "
                         f"{', '.join(sorted(tensors)[:6]) or 'no tensors'}")  # fmt: skip
    activation, output = meta.get("activation", "none"), meta.get("output", "identity")
    if activation not in ("none", "relu") or output not in ("identity", "sigmoid"):
        raise UsageError(f"{flag}: metadata activation={activation!r} output={output!r}: expected activation "
                         "none|relu, output identity|sigmoid")  # fmt: skip
    return Head(task, layers, activation, task in _SIGMOID or output == "sigmoid")


def file_sha256(path: str) -> str:
    """The sha256 (hex) of the local file ``path``, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def describe_vision(spec: VisionSpec) -> dict:
    """Check the embedder and heads without loading the embedder's weights: its config is a CLIP vision config,
    its processor loads, each head's input width is the embedder's D. ``{"dim", "class", "weight_sha256",
    "heads": {task: sha256}}``; UsageError in one line for what cannot be used."""
    from transformers import CLIPVisionConfig

    from pipeline.annotate.engines import weight_files_sha256
    from pipeline.embed.processors import load_image_processor

    _quiet()
    try:
        path = spec.model_path()
        config = CLIPVisionConfig.from_pretrained(path)
        load_image_processor(path)
        digest = weight_files_sha256(path)
    except (OSError, ValueError, KeyError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--embedding-model {spec.model}: cannot load it as a CLIP vision model "
                         f"(CLIPVisionModelWithProjection + AutoImageProcessor): {first}") from None  # fmt: skip
    dim = int(config.projection_dim)
    heads = {}
    for task, source in spec.heads:
        path = spec.head_path(task, source, dim)
        head = load_head(task, path, source)
        if head.dim != dim:
            raise UsageError(f"--{task}-head {source}: takes {head.dim}-wide embeddings, --embedding-model "
                             f"{spec.model} gives {dim}: pass a head trained on that model's embeddings")  # fmt: skip
        heads[task] = file_sha256(path)
    return {"dim": dim, "class": "CLIPVisionModelWithProjection", "weight_sha256": digest, "heads": heads}


class ImageEmbedder:
    """Embeds batches of PIL images and scores them with the heads, on ``device`` (``cuda`` or ``cpu``)."""

    def __init__(self, spec: VisionSpec, device: str = "cpu"):
        import torch
        from transformers import CLIPVisionModelWithProjection

        from pipeline.embed.processors import load_image_processor

        _quiet()
        self.device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        path = spec.model_path()
        self.processor = load_image_processor(path)
        dtype = torch.float16 if self.device == "cuda" else torch.float32
        self.model = CLIPVisionModelWithProjection.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.dim = int(self.model.config.projection_dim)
        self.heads = {task: load_head(task, spec.head_path(task, source, self.dim), source)
                      for task, source in spec.heads}  # fmt: skip

    def __call__(self, images: list):
        """``(embeddings (n, D) float32 L2-normalised numpy, {task: (n,) float32 scores})``. On cuda the images are
        resized, cropped and normalised there (:func:`device_pixels`), not by the processor on one CPU thread."""
        import torch

        pixels = device_pixels(images, self.processor, self.device) if self.device == "cuda" else None
        if pixels is None:
            pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            out = self.model(pixel_values=pixels.to(self.device, self.model.dtype)).image_embeds.float()
            emb = torch.nn.functional.normalize(out, dim=-1).cpu()  # (n, D)
            scores = {task: head(emb).numpy().astype("float32") for task, head in self.heads.items()}
        return emb.numpy(), scores


def device_pixels(images: list, processor, device: str):
    """CLIP's preprocessing as ``processor`` sets it (shortest-edge resize, bicubic and antialiased; center crop;
    rescale; normalise) computed on ``device``: each image travels there as uint8, and the resize, the crop and the
    arithmetic run there. ``(n, 3, crop_h, crop_w)`` float32, within a few intensity levels of the processor's own
    (PIL's bicubic and torch's antialiased one differ by about a level: ``tests/test_annotate_device_pixels.py``).
    None when the processor is not CLIP's kind (another resize rule, no center crop): the caller runs it instead."""
    import numpy as np
    import torch

    size, crop = getattr(processor, "size", None), getattr(processor, "crop_size", None)
    size, crop = (vars(x) if x is not None and not isinstance(x, dict) else x for x in (size, crop))
    if not (getattr(processor, "do_resize", False) and getattr(processor, "do_center_crop", False) and size
            and size.get("shortest_edge") and crop and crop.get("height")):  # fmt: skip
        return None
    short, (ch, cw) = int(size["shortest_edge"]), (int(crop["height"]), int(crop["width"]))
    scale = float(processor.rescale_factor) if processor.do_rescale else 1.0
    mean, std = ((torch.tensor(v if processor.do_normalize else d, dtype=torch.float32, device=device).view(3, 1, 1))
                 for v, d in ((processor.image_mean, (0.0,) * 3), (processor.image_std, (1.0,) * 3)))  # fmt: skip
    out = []
    for image in images:
        pixels = np.array(image.convert("RGB") if hasattr(image, "convert") else image, np.uint8)  # (H, W, 3) own
        x = torch.from_numpy(pixels).to(device).permute(2, 0, 1)[None].float()  # (1, 3, H, W): uint8 travels
        h, w = x.shape[-2:]
        long = int(short * max(h, w) / min(h, w))  # transformers' get_resize_output_image_size, not square
        nh, nw = (short, long) if h <= w else (long, short)
        if (nh, nw) != (h, w):  # rounded to uint8 levels, as the processor's resize returns
            x = torch.nn.functional.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False,
                                                antialias=True).round_().clamp_(0, 255)  # fmt: skip
        if nh < ch or nw < cw:
            return None  # the processor pads what is smaller than its crop
        top, left = (nh - ch) // 2, (nw - cw) // 2
        out.append((x[..., top : top + ch, left : left + cw] * scale - mean) / std)
    return torch.cat(out)
