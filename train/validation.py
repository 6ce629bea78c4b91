"""Validation images: the family's diffusers pipeline on the cache's validation prompts, no text encoder loaded.

``bucketeer embed --validation-prompts FILE`` embedded the prompts (and the empty caption, the
negative prompt) into the cache; every ``validation_every`` plan steps the main process builds the
recipe's pipeline around the model being trained (its EMA weights when there is an EMA), the
cache's VAE (``_cache.json`` ``settings.vae``: the same model folder) and the recipe's sampler, and
calls it with ``prompt_embeds=`` (pooled, masks, negatives) joined from the cached records. One image
per prompt, seeded by ``(seed, prompt index)`` so the series across steps is comparable, written to
``OUTPUT/validation/step-<position>/<i>.png`` and to TensorBoard.

A video cache (``_cache.json`` ``latent.temporal_factor``: Wan) samples one clip per prompt instead,
``validation_frames`` long (default ``4 t + 1``, 17 for Wan's VAE): ``<i>.png`` is a strip of its first,
middle and last frames side by side (what TensorBoard shows), ``<i>.mp4`` the clip (H.264 at
:data:`CLIP_FPS`, written with PyAV when it is installed: ``pip install 'bucketeer[video]'``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from manifests.cache.meta import CacheMeta
from manifests.cache import CacheReader
from manifests.errors import UsageError
from manifests.storage import redact
from train.config import TrainConfig
from train.recipes import Denoiser, PromptEmbeds

__all__ = ["Validator", "validation_size", "validation_frames", "frame_strip", "write_mp4", "CLIP_FPS"]

CLIP_FPS = 16  # Wan 2.1's frame rate


def validation_size(cfg: TrainConfig, meta: CacheMeta) -> int:
    """The square side in pixels: the config's ``validation_size``, else the side of the cache's bucket area
    (a multiple of 16: Flux packs 2x2 latents of an 8x VAE)."""
    if cfg.validation_size:
        return int(cfg.validation_size)
    area = (meta.settings.buckets.area if meta.settings.buckets else None) or 512 * 512
    return max(16, int(math.isqrt(area)) // 16 * 16)


def validation_frames(cfg: TrainConfig, meta: CacheMeta) -> int | None:
    """Frames of a validation clip of a video cache (its VAE's ``latent.temporal_factor`` ``t``): the config's
    ``validation_frames``, else ``4 t + 1``; None for an image cache. Raises UsageError when ``F - 1`` is not a
    multiple of ``t`` (a causal video VAE decodes ``1 + t k`` frames)."""
    t = meta.latent.temporal_factor if meta.latent is not None else None
    if t is None:
        return None
    frames = int(cfg.validation_frames) or 4 * int(t) + 1
    if (frames - 1) % int(t):
        raise UsageError(f"config validation_frames {frames}: the cache's video VAE decodes 1 + {t}k frames; set "
                         f"one of those, e.g. {4 * int(t) + 1}")  # fmt: skip
    return frames


def frame_strip(clip: np.ndarray) -> Any:
    """A PIL image of ``clip``'s (F, H, W, 3) float frames in [0, 1]: the first, middle and last side by side."""
    from PIL import Image

    frames = (np.clip(clip, 0.0, 1.0) * 255).round().astype(np.uint8)
    picks = sorted({0, len(frames) // 2, len(frames) - 1})
    return Image.fromarray(np.concatenate([frames[i] for i in picks], axis=1))  # (H, len(picks) W, 3)


def write_mp4(clip: np.ndarray, path: Path, fps: int = CLIP_FPS) -> bool:
    """``clip`` (F, H, W, 3) float in [0, 1] as an H.264 (else MPEG-4) ``path``; False when PyAV is not installed."""
    try:
        import av
    except ImportError:
        return False
    frames = (np.clip(clip, 0.0, 1.0) * 255).round().astype(np.uint8)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())  # flush the encoder
    return True


class Validator:
    """Samples the validation images (or clips) of one run (call :meth:`sample` on the main process only)."""

    def __init__(self, denoiser: Denoiser, reader: CacheReader, cfg: TrainConfig):
        text = reader.meta.text
        prompts = (text.validation_prompts if text else None) or ()
        self.prompts = [p.prompt for p in prompts]
        if not self.prompts:
            raise UsageError(f"config validation_every {cfg.validation_every}: cache {redact(reader.url)} holds no "
                             "validation prompts; embed them with `bucketeer embed ... --validation-prompts FILE` "
                             "(only they are embedded, once), or set validation_every: 0")  # fmt: skip
        keys = [int(p.caption_key) for p in prompts] + [int(text.empty_caption_key)]
        layout = reader.meta.text_layout
        embeds, mask, pooled = layout.prompt_embeds(reader.read_texts(keys))  # (P + 1, L, D), (P + 1, L), (P + 1, D)
        self.embeds = [PromptEmbeds(torch.from_numpy(embeds[i : i + 1]), torch.from_numpy(mask[i : i + 1]),
                                    None if pooled is None else torch.from_numpy(pooled[i : i + 1]))
                       for i in range(len(keys))]  # fmt: skip
        self.denoiser, self.cfg, self.meta = denoiser, cfg, reader.meta
        self.size = validation_size(cfg, reader.meta)
        self.frames = validation_frames(cfg, reader.meta)
        self._vae = None

    def vae(self) -> Any:
        """The cache's VAE (what encoded the latents; its recorded class, e.g. ``AutoencoderKLWan``), loaded once."""
        import diffusers

        if self._vae is None:
            vae = self.meta.settings.vae
            cls = getattr(diffusers, vae.class_ or "AutoencoderKL", diffusers.AutoencoderKL)
            self._vae = cls.from_pretrained(vae.id, subfolder=vae.subfolder)
        return self._vae

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, folder: Path, device: torch.device) -> list[Any]:
        """One PIL image per prompt from ``model`` (unwrapped), written as ``folder/<i>.png``; the images (a video
        cache: a clip per prompt, ``<i>.mp4``, and its frame strip ``<i>.png``, the image returned)."""
        pipe = self.denoiser.pipeline(model, self.vae().to(device))
        pipe.set_progress_bar_config(disable=True)
        negative = self._to(self.embeds[-1], device)
        folder.mkdir(parents=True, exist_ok=True)
        images = []
        was_training = model.training
        model.eval()
        try:
            for i, prompt in enumerate(self.embeds[:-1]):
                generator = torch.Generator().manual_seed(self.cfg.seed * 1000 + i)
                kwargs = dict(**self.denoiser.prompt_kwargs(self._to(prompt, device), negative), height=self.size,
                              width=self.size, num_inference_steps=self.cfg.validation_steps,
                              guidance_scale=self.cfg.validation_guidance, generator=generator)  # fmt: skip
                if self.frames is None:
                    image = pipe(**kwargs, output_type="pil").images[0]
                else:
                    clip = pipe(**kwargs, num_frames=self.frames, output_type="np").frames[0]  # (F, H, W, 3)
                    write_mp4(clip, folder / f"{i:02d}.mp4")
                    image = frame_strip(clip)
                image.save(folder / f"{i:02d}.png")
                images.append(image)
        finally:
            model.train(was_training)
        return images

    @staticmethod
    def _to(p: PromptEmbeds, device: torch.device) -> PromptEmbeds:
        return PromptEmbeds(p.embeds.to(device), p.mask.to(device), None if p.pooled is None else p.pooled.to(device))

    def log(self, accelerator, images: list[Any], position: int) -> None:
        """The images to TensorBoard (when the run logs there), tagged by prompt."""
        try:
            writer = accelerator.get_tracker("tensorboard", unwrap=True)
        except (ValueError, KeyError):
            return
        if not hasattr(writer, "add_image"):
            return
        for i, (prompt, image) in enumerate(zip(self.prompts, images)):
            writer.add_image(f"validation/{i:02d} {prompt[:60]}", np.asarray(image), position, dataformats="HWC")
