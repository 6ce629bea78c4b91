"""Where rectified-flow training draws its noise levels: the config's ``timestep_shift``, exact per bucket.

A flow sampler does not spend its steps evenly in ``sigma``: ``FlowMatchEulerDiscreteScheduler`` moves
the schedule towards noise by a shift ``s``, ``sigma = s t / (1 + (s - 1) t)``. SD3 uses a fixed
``shift`` (3.0), Wan 2.1 a fixed ``flow_shift`` (``UniPCMultistepScheduler`` with ``use_flow_sigmas``: the
same formula; 3.0 for 480p, 5.0 for 720p); Flux (``use_dynamic_shifting``) a shift that grows with the
image's token count, computed by the pipeline at sampling time::

    mu = calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len, base_shift, max_shift)
    sigma = exp(mu) / (exp(mu) + (1 / t - 1))          # scheduler.time_shift(mu, 1.0, t)

which is the fixed-shift formula with ``s = exp(mu)`` (``s = mu`` for ``time_shift_type: linear``). Flux 2's
pipelines compute ``mu`` by another rule (``compute_empirical_mu`` of the token count and the number of sampling
steps): a recipe passes it as ``mu_rule``.
Training draws ``t`` from the config's density and shifts it the same way, so the noise levels it
trains on are those the sampler visits. Every batch is one bucket (one latent size), so its shift is
exact: ``image_seq_len`` is the batch's token count after patching (Flux: ``(h / 2) * (w / 2)`` for
latents ``(h, w)``, i.e. ``(H / 16) * (W / 16)`` pixels). ``timestep_shift``:

- ``auto`` (default): the scheduler's own rule (dynamic: per bucket; else its ``shift`` or ``flow_shift``); a family
  without a flow scheduler (PixArt from scratch, generic) trains unshifted.
- ``none``: unshifted (``sigma = t``).
- a number: that fixed shift, for any rectified-flow family.

The first batch of each bucket logs its shift once (main process), e.g.
``timestep shift: bucket 1024x1024 (4096 tokens): mu 1.1500, shift 3.1582``.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Mapping

from manifests.errors import UsageError

__all__ = ["SHIFT_MODES", "TimestepShift", "parse_shift", "timestep_shift", "refuse_shift"]

SHIFT_MODES = ("auto", "none")


def parse_shift(value: str | float) -> str | float:
    """``auto``, ``none`` or a shift > 0 (a number, or a string holding one). Raises UsageError otherwise."""
    if isinstance(value, str) and value not in SHIFT_MODES:
        try:
            value = float(value)
        except ValueError:
            value = math.nan
    if isinstance(value, bool) or (not isinstance(value, str) and not (isinstance(value, (int, float)) and value > 0)):
        raise UsageError(f"config: timestep_shift must be auto, none or a number > 0 (e.g. 3.0), got {value!r}")
    return value if isinstance(value, str) else float(value)


def _main_process_log(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


class TimestepShift:
    """The shift of a batch of one bucket: fixed (``shift``), or Flux's dynamic rule (``dynamic``: the
    scheduler config's ``base_image_seq_len``, ``max_image_seq_len``, ``base_shift``, ``max_shift``,
    ``time_shift_type``). ``patch``: latent pixels per token along a side (Flux: 2, by packing).
    ``log`` receives one line the first time each bucket is shifted."""

    def __init__(self, shift: float = 1.0, *, dynamic: Mapping[str, Any] | None = None, patch: int = 1,
                 log: Callable[[str], None] = _main_process_log,
                 mu_rule: Callable[[int], float] | None = None):  # fmt: skip
        self.fixed, self.dynamic, self.patch, self.log = float(shift), dynamic, patch, log
        self.mu_rule = mu_rule  # tokens -> mu, instead of calculate_shift (Flux 2's compute_empirical_mu)
        self.seen: set[str] = set()

    def mu(self, h: int, w: int) -> float | None:
        """The pipeline's ``mu`` for latents ``(h, w)`` (None for a fixed shift): ``calculate_shift`` of
        ``diffusers.pipelines.flux.pipeline_flux`` with the scheduler config, as ``FluxPipeline`` calls it."""
        if self.dynamic is None:
            return None
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = self.dynamic
        if self.mu_rule is not None:
            return float(self.mu_rule((h // self.patch) * (w // self.patch)))
        return calculate_shift((h // self.patch) * (w // self.patch), c.get("base_image_seq_len", 256),
                               c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                               c.get("max_shift", 1.15))  # fmt: skip

    def shift(self, h: int, w: int) -> float:
        """The factor ``s`` of ``sigma = s t / (1 + (s - 1) t)`` for latents ``(h, w)``."""
        mu = self.mu(h, w)
        if mu is None:
            return self.fixed
        return mu if self.dynamic.get("time_shift_type", "exponential") == "linear" else math.exp(mu)

    def for_bucket(self, bucket: str, h: int, w: int, frames: int = 1) -> float:
        """:meth:`shift`, logged the first time ``bucket`` is seen (``frames``: token frames of a video
        bucket, counted in the logged tokens only)."""
        s = self.shift(h, w)
        if bucket not in self.seen:
            self.seen.add(bucket)
            mu = self.mu(h, w)
            tokens = frames * (h // self.patch) * (w // self.patch)
            self.log(f"timestep shift: bucket {bucket} ({tokens} tokens): "
                     + (f"mu {mu:.4f}, " if mu is not None else "") + f"shift {s:.4f}")  # fmt: skip
        return s


def timestep_shift(setting: str | float, scheduler_config: Mapping[str, Any] | None, *,
                   patch: int = 1, mu_rule: Callable[[int], float] | None = None) -> TimestepShift:  # fmt: skip
    """The shift the config's ``timestep_shift`` asks for, for a family whose flow scheduler has
    ``scheduler_config`` (None: the family's objective has no flow scheduler of its own).

    ``auto``: dynamic when the config says ``use_dynamic_shifting`` (its ``mu`` by ``calculate_shift``, or by
    ``mu_rule(tokens)`` when given), else its ``shift`` (FlowMatchEuler) or ``flow_shift`` (UniPC / DPM-Solver
    with flow sigmas, as the Wan folders ship), 1.0 without either.
    """
    if setting == "none":
        return TimestepShift(1.0)
    if setting != "auto":
        return TimestepShift(float(setting))
    config = scheduler_config or {}
    if config.get("use_dynamic_shifting"):
        return TimestepShift(dynamic=dict(config), patch=patch, mu_rule=mu_rule)
    return TimestepShift(float(config.get("shift", config.get("flow_shift") or 1.0)), patch=patch)


def refuse_shift(setting: str | float, family: str) -> None:
    """UsageError for a fixed shift asked of a family trained with DDPM noise (no sigma to shift)."""
    if setting not in SHIFT_MODES:
        raise UsageError(f"config timestep_shift: {setting}: {family} trains with DDPM noise here, which has no "
                         "flow sigma to shift; set timestep_shift: auto (or none)")  # fmt: skip
