"""Will the model's training state fit the GPU? Refuse in one line, before loading any weight, what cannot.

The trainer keeps the pretrained denoiser in float32 (accelerate autocasts the forward): a full fine-tune holds
16 bytes per parameter (weights, gradients, AdamW's two moments; 4 more with an EMA), a LoRA run the frozen
weights (4 bytes per parameter) and its small adapters. Activations come on top, so a run that passes this
check can still run out of memory; one that fails it cannot fit. The parameter count comes from the model's
``config.json`` alone (the model built on the meta device: no weight is read). FSDP and DeepSpeed shard that
state over the processes (``WORLD_SIZE``), plain DDP does not.

The GPU's memory is ``torch.cuda``'s; :data:`MEMORY_ENV` replaces it (a figure in GB: to plan for another GPU
on this one, and how a CPU test fakes a GPU). Without CUDA and without the variable nothing is checked.
"""

from __future__ import annotations

import os
from manifests.errors import UsageError
from train.config import TrainConfig

__all__ = ["MEMORY_ENV", "check_fits", "device_memory", "parameters", "state_bytes"]

MEMORY_ENV = "BUCKETEER_GPU_MEMORY_GB"


def device_memory() -> int | None:
    """Bytes of memory of this process's GPU (:data:`MEMORY_ENV` when set); None without CUDA."""
    if os.environ.get(MEMORY_ENV):
        return int(float(os.environ[MEMORY_ENV]) * 1e9)
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def parameters(cls: type, source: str, subfolder: str = "transformer") -> int:
    """Parameters of ``cls`` as ``source``/``subfolder``'s ``config.json`` sizes it (built on the meta device)."""
    import torch

    config = cls.load_config(source, subfolder=subfolder)
    with torch.device("meta"):
        model = cls.from_config(config)
    return sum(p.numel() for p in model.parameters())


def state_bytes(params: int, cfg: TrainConfig) -> int:
    """Bytes the trainer keeps per process for a model of ``params`` parameters (see the module docstring)."""
    per = 4 if cfg.lora_rank else 16 + (4 if cfg.ema_decay else 0)
    shards = int(os.environ.get("WORLD_SIZE", 1)) if (os.environ.get("ACCELERATE_USE_FSDP") == "true"
                                                       or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true") else 1
    return params * per // max(1, shards)


def check_fits(family: str, cls: type, source: str, cfg: TrainConfig,
               subfolder: str | tuple[str, ...] = "transformer") -> None:  # fmt: skip
    """UsageError (one line) when the training state of ``source``'s model cannot fit this GPU's memory;
    ``subfolder``: the model's, or a tuple of several trained together (Wan 2.2 A14B's two experts)."""
    memory = device_memory()
    if memory is None:
        return
    folders = (subfolder,) if isinstance(subfolder, str) else subfolder
    try:
        params = sum(parameters(cls, source, folder) for folder in folders)
    except (OSError, EnvironmentError):
        return  # no config to size it by: loading the model says what is missing
    need = state_bytes(params, cfg)
    if need <= memory:
        return
    what = "LoRA (frozen float32 weights)" if cfg.lora_rank else "a full fine-tune (float32 weights, gradients, AdamW)"
    lora = 4 * params
    hint = (f"shard it with FSDP over >= {-(-need // memory)} GPUs (accelerate config)"
            + ("" if cfg.lora_rank or lora > memory else
               f", or train LoRA (lora_rank: 16; {lora / 1e9:.1f} GB of frozen weights)"))
    if len(folders) > 1:  # expert: both holds both experts: one each per run fits where both do not
        hint += f", or train {' and '.join(folders)} in separate runs (expert: high, expert: low)"
    model = cls.__name__ + (f" ({' + '.join(folders)})" if len(folders) > 1 else "")
    raise UsageError(f"{family}: {what} of its {params / 1e9:.2f}B-parameter {model} needs {need / 1e9:.1f} GB "
                     f"per GPU before activations; this GPU has {memory / 1e9:.1f} GB: {hint}")  # fmt: skip

