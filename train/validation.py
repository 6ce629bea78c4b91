"""Validation images: the family's diffusers pipeline on the cache's validation prompts, no text encoder loaded.

``bucketeer embed --validation-prompts FILE`` embedded the prompts (and the empty caption, the
negative prompt) into the cache; every ``validation_every`` plan steps the main process builds the
recipe's pipeline around the model being trained (its EMA weights when there is an EMA), the
cache's VAE (``_cache.json`` ``settings.vae``: the same model folder) and the recipe's sampler, and
calls it with ``prompt_embeds=`` (pooled, masks, negatives) joined from the cached records. One image
per prompt, seeded by ``(seed, prompt index)`` so the series across steps is comparable, written to
``OUTPUT/validation/step-<position>/<i>.png`` and to TensorBoard.
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

__all__ = ["Validator", "validation_size"]


def validation_size(cfg: TrainConfig, meta: CacheMeta) -> int:
    """The square side in pixels: the config's ``validation_size``, else the side of the cache's bucket area
    (a multiple of 16: Flux packs 2x2 latents of an 8x VAE)."""
    if cfg.validation_size:
        return int(cfg.validation_size)
    area = (meta.settings.buckets.area if meta.settings.buckets else None) or 512 * 512
    return max(16, int(math.isqrt(area)) // 16 * 16)


class Validator:
    """Samples the validation images of one run (call :meth:`sample` on the main process only)."""

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
        self._vae = None

    def vae(self) -> Any:
        """The cache's VAE (what encoded the latents), loaded once."""
        from diffusers import AutoencoderKL

        if self._vae is None:
            vae = self.meta.settings.vae
            self._vae = AutoencoderKL.from_pretrained(vae.id, subfolder=vae.subfolder)
        return self._vae

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, folder: Path, device: torch.device) -> list[Any]:
        """One PIL image per prompt from ``model`` (unwrapped), written as ``folder/<i>.png``; the images."""
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
                image = pipe(**self.denoiser.prompt_kwargs(self._to(prompt, device), negative), height=self.size,
                             width=self.size, num_inference_steps=self.cfg.validation_steps,
                             guidance_scale=self.cfg.validation_guidance, generator=generator,
                             output_type="pil").images[0]  # fmt: skip
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
