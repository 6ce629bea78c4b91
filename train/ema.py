"""An exponential moving average of the trained weights (diffusers ``EMAModel``), checkpointed and resumed exactly.

The average covers the trained parameters (all of them, or the LoRA adapters), is stepped after
every optimizer step on every rank (the weights are the same on each after DDP's all-reduce), and is
written into each checkpoint as ``ema.safetensors``: the shadow weights by parameter name, EMAModel's
counters in the safetensors metadata. A resumed run reads it back without pickle and continues with
the same average an uninterrupted run would hold. The final average is saved as ``model_ema/`` (or
``lora_ema/``) next to ``model/``. Sharded backends (FSDP, ZeRO-3) hold shards, not weights: EMA
runs on DDP or one process.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from manifests.errors import UsageError

__all__ = ["EMA", "EMA_FILE"]

EMA_FILE = "ema.safetensors"


class EMA:
    """The EMA of ``model``'s trainable parameters with ``decay``; hooks into ``accelerator``'s save/load_state."""

    def __init__(self, model: torch.nn.Module, decay: float):
        from diffusers.training_utils import EMAModel

        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.average = EMAModel([p for p in model.parameters() if p.requires_grad], decay=decay)

    def _params(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def step(self, model: torch.nn.Module) -> None:
        """Fold the current weights of ``model`` (unwrapped) into the average; once per optimizer step."""
        params = self._params(model)
        if params and self.average.shadow_params[0].device != params[0].device:
            # made before accelerator.prepare moved the model to the GPU (and read back from a checkpoint on the
            # CPU): diffusers' EMAModel.step subtracts the two, which needs them on one device
            self.average.to(device=params[0].device)
        self.average.step(params)

    def state(self) -> dict[str, torch.Tensor]:
        """The shadow weights by parameter name (CPU, contiguous)."""
        return {n: p.detach().cpu().contiguous() for n, p in zip(self.names, self.average.shadow_params)}

    def save(self, folder: str | Path) -> None:
        """Write ``folder/ema.safetensors``."""
        from safetensors.torch import save_file

        counters = {k: v for k, v in self.average.state_dict().items() if k != "shadow_params"}
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(self.state(), str(Path(folder) / EMA_FILE), metadata={"ema": json.dumps(counters)})

    def load(self, folder: str | Path) -> None:
        """Read ``folder/ema.safetensors`` (tensors and JSON only). UsageError when it is absent or does not fit."""
        from safetensors import safe_open

        path = Path(folder) / EMA_FILE
        if not path.exists():
            raise UsageError(f"{path.parent.name}: the config asks for ema_decay but the checkpoint has no {EMA_FILE} "
                             "(it was trained without EMA); resume without ema_decay, or use a new --output-dir")
        with safe_open(str(path), "pt") as f:
            if sorted(f.keys()) != sorted(self.names):
                raise UsageError(f"{path}: its EMA covers other parameters than this run trains "
                                 "(another model, or LoRA settings changed); use a new --output-dir")
            counters = json.loads(f.metadata()["ema"])
            shadow = [f.get_tensor(n) for n in self.names]
        self.average.load_state_dict({**counters, "shadow_params": shadow})

    def register(self, accelerator) -> None:
        """Save with every ``accelerator.save_state`` (main process) and load with every ``load_state``."""

        def save(models, weights, folder):
            if accelerator.is_main_process:
                self.save(folder)

        accelerator.register_save_state_pre_hook(save)
        accelerator.register_load_state_pre_hook(lambda models, folder: self.load(folder))

    @contextmanager
    def swapped_into(self, model: torch.nn.Module) -> Iterator[None]:
        """``model`` (unwrapped) holds the averaged weights inside the block, its own again after it."""
        params = self._params(model)
        self.average.store(params)
        self.average.copy_to(params)
        try:
            yield
        finally:
            self.average.restore(params)
