"""Training settings: one flat dataclass, read from a YAML or JSON file; unknown keys are an error.

A config file starts with the command that uses it (see ``train/configs/``). Every key is a field
of :class:`TrainConfig`; ``model`` holds ``PixArtTransformer2DModel`` arguments of the from-scratch
transformer (checked in :mod:`train.model`). Values left out keep the defaults below, which train the
tiny default model. Without ``--config`` the trainer reads :func:`default_config` of the cache's family.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manifests.errors import MissingError, UsageError
from manifests.families import SPECS
from train.masks import MaskedLoss
from train.shift import parse_shift

__all__ = ["TrainConfig", "load_config", "default_config", "DEFAULT_CONFIG"]

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny.yaml"
# families whose default config (train/configs/<family>.yaml) fine-tunes the cache's --model: Objective.config
FINE_TUNED = tuple(name for name, spec in SPECS.items() if spec.objective is not None and spec.objective.config)
LR_SCHEDULES = ("cosine", "linear", "constant")
WEIGHTING_SCHEMES = ("logit_normal", "uniform", "mode")
MIXED_PRECISION = ("no", "bf16", "fp16")
# keys whose default is None: their type when given
OPTIONAL = {"grad_accum": int, "family": str, "pretrained": str, "ema_decay": float, "lora_alpha": float,
            "lora_targets": list, "repa": dict, "masked_loss": dict, "expert": str}
# Wan 2.2 A14B: transformer (timesteps >= the pipeline's boundary), transformer_2 (below), or LoRA on each in one run
EXPERTS = ("high", "low", "both")


@dataclass(frozen=True)
class TrainConfig:
    """What a run is made with (the plan and the cache say what it is made of)."""

    seed: int = 0
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate autocast; weights stay fp32)
    # optimisation
    lr: float = 1e-4
    scale_lr: bool = False  # lr *= number of processes (linear scaling with the global batch)
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    grad_accum: int | None = None  # plan steps per optimizer step: the plan's --grad-accum (set: must agree)
    lr_schedule: str = "cosine"  # cosine | linear | constant, after warmup; length from the plan
    warmup_steps: int = 0  # optimizer steps
    # rectified flow: timestep density (diffusers.training_utils.compute_density_for_timestep_sampling)
    weighting_scheme: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    # where the drawn t is shifted towards noise (train/shift.py): auto (the family's scheduler: Flux per bucket by
    # its token count, SD3 its fixed shift, others none) | none | a number (a fixed shift, any flow family)
    timestep_shift: str | float = "auto"
    # bookkeeping
    checkpoint_every: int = 500  # plan steps; a multiple of grad_accum
    keep_checkpoints: int = 2
    log_every: int = 10  # plan steps
    prefetch: int = 4  # batches read ahead of the model
    read_threads: int = 2  # of those, batches being read at once (concurrent ranged reads + decode)
    # > 0: read and decode in this many processes (forked from a fork server) instead of read_threads threads,
    # out of the training step's GIL (batches come back through shared memory, one copy); 0: threads; auto: 2
    # processes for a cache on a local disk with >= 2 cores per rank, else threads (the log says which)
    read_processes: int | str = "auto"
    # records read ahead of the model, per rank, in MB: the loader reads groups of steps at once so that ranges
    # close in a shard merge into one request across steps (at least `prefetch` steps ahead whatever the budget)
    read_ahead_mb: float = 256
    # widen latents and text to float32 (and scale the latents) on the CPU in the loader; false: hand the
    # stored bf16 to the device and widen there (half the bytes to copy, no loader CPU; the same values)
    loader_float32: bool = False
    # cuDNN's attention on CUDA: auto (off where torch >= 2.10 prefers it, sm90/sm100: train.backends.choose_attention)
    # | on (torch's choice) | off
    cudnn_attention: str = "auto"
    model: dict[str, Any] = field(default_factory=dict)
    # what is trained (train/recipes/): the family's recipe and where its weights start
    family: str | None = None  # the cache's family; set, it must agree (a check that the right cache is passed)
    pretrained: str | None = None  # diffusers pipeline folder or hub id; default: the cache's --model (not pixart)
    guidance: float = 3.5  # Flux: the guidance embedding's value in training (guidance-distilled transformers)
    lora_rank: int = 0  # 0: full fine-tuning; > 0: train LoRA adapters of this rank (peft), the model frozen
    lora_alpha: float | None = None  # LoRA scale numerator (default: lora_rank)
    lora_targets: list | None = None  # module names LoRA adapts (default: the recipe's attention projections)
    # Wan 2.2 A14B (two experts): which one a run trains, on its timesteps only; high: transformer, t >= boundary_ratio
    # * num_train_timesteps; low: transformer_2, below; both: LoRA on each, one expert per optimizer step
    # (docs/families-video.md). Other families: leave it out
    expert: str | None = None
    caption_dropout: float = 0.0  # probability of training a sample on the empty caption (classifier-free guidance)
    # a cache embedded with --latents posterior: train on a fresh draw mean + std * eps from each latent's VAE
    # posterior every epoch (eps a pure function of seed, epoch, sample id); false: on the mean, as a means cache
    posterior_sampling: bool = True
    ema_decay: float | None = None  # keep an EMA of the trained weights (diffusers EMAModel) with this decay
    # validation images: the family's pipeline on the cache's validation prompts, every N plan steps
    validation_every: int = 0  # plan steps; 0: never
    validation_steps: int = 20  # sampler steps per image
    validation_guidance: float = 5.0  # classifier-free guidance scale (Flux: its guidance embedding)
    validation_size: int = 0  # square image side in pixels; 0: the side of the cache's bucket area
    validation_frames: int = 0  # video caches: frames per validation clip (Wan: 4k+1); 0: 4 x VAE temporal factor + 1
    # REPA (train/repa.py): {weight: 0.5, depth: N, projector_dim: 2048}; the cache needs embed --features dinov2
    repa: dict | None = None
    # loss masks (scan --masks): {weight_outside: 0.0} weights each pixel's loss by its sample's mask (train/masks.py)
    masked_loss: dict | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.mixed_precision in MIXED_PRECISION, f"mixed_precision must be one of {MIXED_PRECISION}"),
            (self.lr_schedule in LR_SCHEDULES, f"lr_schedule must be one of {LR_SCHEDULES}"),
            (self.weighting_scheme in WEIGHTING_SCHEMES, f"weighting_scheme must be one of {WEIGHTING_SCHEMES}"),
            (self.lr > 0, "lr must be > 0"),
            (self.grad_accum is None or self.grad_accum >= 1, "grad_accum must be >= 1"),
            (self.warmup_steps >= 0, "warmup_steps must be >= 0"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (self.checkpoint_every % (self.grad_accum or 1) == 0,
             "checkpoint_every must be a multiple of grad_accum (a checkpoint is taken between optimizer steps)"),
            (self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1"),
            (self.log_every >= 1, "log_every must be >= 1"),
            (self.prefetch >= 1, "prefetch must be >= 1"),
            (self.cudnn_attention in ("auto", "on", "off"), "cudnn_attention must be auto, on or off"),
            (1 <= self.read_threads <= self.prefetch, "read_threads must be between 1 and prefetch"),
            (self.read_processes == "auto" or (type(self.read_processes) is int and self.read_processes >= 0),
             "read_processes must be auto or a number >= 0 (0: read on read_threads threads)"),
            (self.read_ahead_mb >= 0, "read_ahead_mb must be >= 0 (0: read prefetch steps ahead)"),
            (self.max_grad_norm > 0, "max_grad_norm must be > 0"),
            (len(self.adam_betas) == 2, "adam_betas must be two numbers, e.g. [0.9, 0.999]"),
            (0.0 <= self.caption_dropout < 1.0, "caption_dropout must be in [0, 1)"),
            (self.ema_decay is None or 0.0 < self.ema_decay < 1.0, "ema_decay must be in (0, 1), e.g. 0.9999"),
            (self.lora_rank >= 0, "lora_rank must be >= 0 (0: full fine-tuning)"),
            (self.expert in (None, *EXPERTS), f"expert must be one of {EXPERTS} (Wan 2.2 A14B's two experts)"),
            (self.validation_every >= 0, "validation_every must be >= 0 (0: no validation images)"),
            (self.validation_steps >= 1, "validation_steps must be >= 1"),
            (self.validation_size % 16 == 0, "validation_size must be a multiple of 16 (0: from the cache)"),
            (self.validation_frames >= 0, "validation_frames must be >= 0 (0: from the cache's VAE)"),
        ]  # fmt: skip
        object.__setattr__(self, "timestep_shift", parse_shift(self.timestep_shift))  # UsageError naming the key
        for ok, message in checks:
            if not ok:
                raise UsageError(f"config: {message}")
        if self.repa is not None:
            from train.repa import RepaConfig

            RepaConfig.from_json(self.repa)  # UsageError naming the key
        MaskedLoss.from_config(self.masked_loss)  # raises UsageError naming a bad key

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_config(family: str | None) -> Path:
    """The config a run without ``--config`` reads: ``train/configs/<family>.yaml`` for a family that
    fine-tunes a pretrained model, else the tiny from-scratch config."""
    return Path(__file__).parent / "configs" / f"{family}.yaml" if family in FINE_TUNED else DEFAULT_CONFIG


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Read a YAML/JSON config file (default: the tiny config) and apply ``overrides``.

    Raises UsageError (a ValueError) naming the file and the key for unknown keys, wrong types or
    bad values, and MissingError (a FileNotFoundError) when the file does not exist.
    """
    import yaml

    path = Path(path) if path else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MissingError(f"--config {path}: no such file") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"config {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(data, (dict, type(None))):
        raise UsageError(f"config {path} must be a mapping of settings, got {type(data).__name__}")
    data = dict(data or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UsageError(f"config {path}: unknown keys {unknown}; valid keys: {sorted(fields)}")
    if "adam_betas" in data:
        data["adam_betas"] = tuple(data["adam_betas"])
    defaults = TrainConfig()
    for name, value in data.items():
        if name == "timestep_shift":  # auto | none | a number: checked by parse_shift
            try:
                data[name] = parse_shift(value)
            except UsageError as e:
                raise UsageError(f"{path}: {e}") from None
            continue
        if name == "cudnn_attention" and isinstance(value, bool):  # YAML 1.1 reads on/off as booleans
            value = data[name] = "on" if value else "off"
        if name == "read_processes":  # auto | a number >= 0
            if value == "auto" or (type(value) is int and value >= 0):
                continue
            raise UsageError(f"config {path}: read_processes must be auto or a number >= 0, got {value!r}")
        want = OPTIONAL.get(name) or type(getattr(defaults, name))
        if value is None and name in OPTIONAL:  # written out as null: the default
            continue
        if want is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                value = data[name] = float(value)
            except ValueError:
                pass
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = data[name] = float(value)
        if not isinstance(value, want) or isinstance(value, bool) != (want is bool):
            raise UsageError(f"config {path}: {name} must be a {want.__name__}, got {value!r}")
    try:
        return TrainConfig(**data)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
