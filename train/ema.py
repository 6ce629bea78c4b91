"""An exponential moving average of the trained weights (diffusers ``EMAModel``), checkpointed and resumed exactly.

The average covers the trained parameters (all of them, or the LoRA adapters), is stepped after
every optimizer step on every rank (the weights are the same on each after DDP's all-reduce), and is
written into each checkpoint as ``ema.safetensors``: the shadow weights by parameter name, EMAModel's
counters in the safetensors metadata. A resumed run reads it back without pickle and continues with
the same average an uninterrupted run would hold. The final average is saved as ``model_ema/`` (or
``lora_ema/``) next to ``model/``.

Under FSDP2 (``fsdp_version: 2``) the weights are DTensor shards and so is the average
(:class:`ShardedEMA`): each rank averages its own shards, with the same arithmetic and decay schedule
as ``EMAModel`` (so it holds exactly the shards of the unsharded average), and a checkpoint holds
``ema/``: one safetensors file per rank written by torch.distributed.checkpoint's
``HuggingFaceStorageWriter`` (the shard's offsets in its safetensors metadata, JSON; no pickle),
read back, re-sharded to any world size, by ``HuggingFaceStorageReader``, with the counters in
``ema.json``. The final average is gathered to whole weights as the model's are. DeepSpeed ZeRO-3
partitions parameters its own way (not DTensors) and is refused (:func:`sharded_ema`).
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from manifests.errors import UsageError

__all__ = ["EMA", "EMA_FILE", "ShardedEMA", "sharded_ema"]

EMA_FILE = "ema.safetensors"
SHARDED_DIR = "ema"  # ShardedEMA: one safetensors file per rank (torch.distributed.checkpoint)
COUNTERS_FILE = "ema.json"


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
            why = (f"it holds a sharded EMA ({SHARDED_DIR}/, FSDP2): resume it under FSDP2"
                   if (Path(folder) / SHARDED_DIR).is_dir() else "it was trained without EMA")  # fmt: skip
            raise UsageError(f"{path.parent.name}: the config asks for ema_decay but the checkpoint has no {EMA_FILE} "
                             f"({why}); resume without ema_decay, or use a new --output-dir")  # fmt: skip
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


class ShardedEMA:
    """The EMA of an FSDP2 model's trainable parameters, kept as DTensor shards beside the model's own.

    The same interface as :class:`EMA`. ``step`` runs ``EMAModel``'s update (``s -= (1 - decay) (s - p)``, its
    decay schedule and counters) on each rank's local shards: no communication. Works on plain tensors too
    (one process, no FSDP), which is how a sharded checkpoint is read back whole.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        from diffusers.training_utils import EMAModel

        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert all(_is_dtensor(p) for p in self._params(model)) or not torch.distributed.is_initialized(), \
            "ShardedEMA: make it from the model prepared by FSDP2 (DTensor parameters)"
        self.counters = EMAModel([], decay=decay)  # the decay schedule and counters; holds no weights
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self._params(model)]  # DTensors with the params' placements

    def _params(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def step(self, model: torch.nn.Module) -> None:
        """Fold the current shards of ``model`` into the average; once per optimizer step, on every rank."""
        c = self.counters
        c.optimization_step += 1
        c.cur_decay_value = decay = c.get_decay(c.optimization_step)
        for s, p in zip(self.shadow, self._params(model)):
            local = _local(s)
            local.sub_((1 - decay) * (local - _local(p)))  # EMAModel.step's arithmetic, on this rank's shard

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole averaged weights by name (a collective under FSDP: every rank calls it)."""
        return {n: (s.full_tensor() if _is_dtensor(s) else s).detach().cpu() for n, s in zip(self.names, self.shadow)}

    def save(self, folder: str | Path) -> None:
        """Every rank writes its shards to ``folder/ema/``; the main process the counters to ``folder/ema.json``.
        A collective: call it on every rank."""
        import torch.distributed as dist
        from torch.distributed.checkpoint import save

        distributed = dist.is_available() and dist.is_initialized()
        writer = _hf_storage()[0](str(Path(folder) / SHARDED_DIR), save_distributed=distributed)
        with _one_process_on_purpose():
            save(dict(zip(self.names, self.shadow)), storage_writer=writer, no_dist=not distributed)
        if not distributed or dist.get_rank() == 0:
            counters = {k: v for k, v in self.counters.state_dict().items() if k != "shadow_params"}
            (Path(folder) / COUNTERS_FILE).write_text(json.dumps(counters))

    def load(self, folder: str | Path) -> None:
        """Read ``folder/ema/`` into this rank's shards (any world size wrote it) and the counters. UsageError when
        the checkpoint has no sharded EMA or one of other parameters. A collective: call it on every rank."""
        from safetensors import safe_open
        from torch.distributed.checkpoint import load

        base = Path(folder) / SHARDED_DIR
        files = sorted(base.glob("*.safetensors"))
        if not files or not (Path(folder) / COUNTERS_FILE).is_file():
            other = " (it holds an unsharded ema.safetensors: resume it without FSDP)" if (
                Path(folder) / EMA_FILE).exists() else " (it was trained without EMA)"  # fmt: skip
            raise UsageError(f"{Path(folder).name}: the config asks for ema_decay under FSDP but the checkpoint has no "
                             f"sharded EMA {SHARDED_DIR}/{other}; resume without ema_decay, or use a new "
                             "--output-dir")  # fmt: skip
        saved: set[str] = set()
        for f in files:
            with safe_open(str(f), "pt") as shard:
                saved.update(shard.keys())
        if saved != set(self.names):
            raise UsageError(f"{base}: its EMA covers other parameters than this run trains (another model, or LoRA "
                             "settings changed); use a new --output-dir")  # fmt: skip
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        with _one_process_on_purpose():
            load(dict(zip(self.names, self.shadow)), storage_reader=_hf_storage()[1](str(base)),
                 no_dist=not distributed)  # in place, re-sharded to this run's shards  # fmt: skip
        counters = json.loads((Path(folder) / COUNTERS_FILE).read_text())
        shadow, self.counters.shadow_params = self.counters.shadow_params, []
        self.counters.load_state_dict({**counters, "shadow_params": shadow})

    def register(self, accelerator) -> None:
        """Save with every ``accelerator.save_state`` and load with every ``load_state`` (every rank)."""
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: self.save(folder))
        accelerator.register_load_state_pre_hook(lambda models, folder: self.load(folder))

    @contextmanager
    def swapped_into(self, model: torch.nn.Module) -> Iterator[None]:
        """``model``'s shards hold the averaged ones inside the block (on this rank; a gather of the model's state
        dict inside it on every rank gathers the average), its own again after it."""
        with torch.no_grad():  # to_local() without grad: the shard's own storage, what FSDP2 gathers from
            params = [_local(p) for p in self._params(model)]
            kept = [p.clone() for p in params]
            for p, s in zip(params, self.shadow):
                p.copy_(_local(s))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(params, kept):
                    p.copy_(k)


def sharded_ema(accelerator) -> bool:
    """Whether an EMA under ``accelerator``'s backend is a :class:`ShardedEMA` (FSDP2; made once the model is
    prepared) rather than an :class:`EMA` (made before). Raises UsageError for DeepSpeed ZeRO-3 and FSDP1, which
    shard parameters other than as DTensors, and for a torch without the safetensors DCP storage."""
    from train.backends import is_sharded

    if not is_sharded(accelerator):
        return False
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        raise UsageError("config ema_decay: DeepSpeed ZeRO-3 partitions the weights its own way (not DTensor "
                         "shards) and diffusers' EMA would gather every whole weight each step; use FSDP2 "
                         "(fsdp_version: 2), DDP or ZeRO-1/2 for an EMA, or no ema_decay")  # fmt: skip
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise UsageError("config ema_decay: under FSDP the EMA is kept as DTensor shards, which FSDP1's flat "
                         "parameters are not; set fsdp_version: 2 in the accelerate config")  # fmt: skip
    _hf_storage()
    return True


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the storage itself, under no_grad), or the tensor."""
    return t.to_local() if _is_dtensor(t) else t


@contextmanager
def _one_process_on_purpose() -> Iterator[None]:
    """Without a process group DCP reads and writes whole tensors, and warns that it assumed so: meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _hf_storage():
    """torch.distributed.checkpoint's safetensors writer and reader (no pickle). UsageError when torch has none."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    except ImportError:
        raise UsageError(f"ema_decay under FSDP needs torch.distributed.checkpoint's HuggingFaceStorageWriter "
                         f"(torch {torch.__version__} has none; 2.13 is tested): upgrade torch") from None
    return HuggingFaceStorageWriter, HuggingFaceStorageReader
