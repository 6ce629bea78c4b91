"""LoRA: train low-rank adapters (peft) on a frozen pretrained model; export them for diffusers' pipelines.

``lora_rank: N`` in the config freezes the model and adds adapters of rank N (scale ``lora_alpha / N``) to
the recipe's attention projections (or ``lora_targets``); only the adapters are optimised. Needs ``peft``
(``pip install 'bucketeer[lora]'``). What a LoRA run writes:

    OUTPUT/lora/pytorch_lora_weights.safetensors   the family pipeline's own format (its ``save_lora_weights``):
                                                   keys ``unet.…`` / ``transformer.…``, peft's LoraConfig
                                                   (rank, alpha, targets) in the file's metadata
    OUTPUT/lora/lora.json                          a :class:`LoraRecord`: base model id and weight hash,
                                                   family, rank, alpha, targets, steps
    checkpoints/step-*/adapters.safetensors        the adapters by parameter name, + lora.json; no base weights

so that, for a Flux run (``StableDiffusionXLPipeline`` / ``StableDiffusion3Pipeline`` alike)::

    pipe = FluxPipeline.from_pretrained(BASE)
    pipe.load_lora_weights("OUTPUT/lora")

loads the trained adapters at their trained scale. A pipeline without LoRA loaders (``HunyuanVideo15Pipeline`` in
diffusers 0.42.1) gets the model's own format (``save_lora_adapter``, unprefixed keys), which its component
loads: ``pipe.transformer.load_lora_adapter("OUTPUT/lora", prefix=None, ...)``. :func:`load_lora` loads the
file into a bare model, also the model-level files (of earlier versions, written by ``save_lora_adapter``); it
tells them apart by their keys: the pipeline format's all start with the component's name and a dot (``unet.``,
``transformer.``), which no parameter name of the model itself does (``down_blocks.…``,
``transformer_blocks.…``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from manifests.errors import UsageError
from manifests.jsonrecord import JsonRecord, optional
from train.config import TrainConfig

__all__ = ["add_lora", "save_lora", "export_parts", "export_folder",
           "load_lora", "LoraRecord", "weights_sha256", "register_adapter_checkpoints",
           "check_resume", "lora_record", "LORA_FILE", "RECORD_FILE", "ADAPTERS_FILE"]  # fmt: skip

LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' LoRA loaders look for
RECORD_FILE = "lora.json"
ADAPTERS_FILE = "adapters.safetensors"  # a checkpoint's adapters, by the trained model's parameter names
KIND = "bucketeer-lora"
FORMAT_VERSION = 1
COMPONENTS = ("unet", "transformer")  # the denoiser's name in the pipelines (prefix of the exported keys)


@dataclass(frozen=True, kw_only=True)
class LoraRecord(JsonRecord):
    """What a set of adapters was trained on and with: ``lora.json`` of ``OUTPUT/lora/`` and of each checkpoint.

    ``pipeline``: the diffusers pipeline class whose ``load_lora_weights`` reads the export, ``component``:
    the denoiser's name in it (``unet``, ``transformer``); ``base_model``: the pretrained id or folder;
    ``base_sha256``: :func:`weights_sha256` of its frozen weights; ``steps``: plan steps trained (the
    cursor's position) when the adapters were written.
    """

    kind: str = KIND
    format_version: int = FORMAT_VERSION
    family: str
    pipeline: str
    component: str
    base_model: str
    base_sha256: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    steps: int | None = optional()

    @classmethod
    def read(cls, path: str | Path) -> "LoraRecord":
        """Parse ``path`` (a ``lora.json``). UsageError for another kind or format version."""
        data = json.loads(Path(path).read_text())
        if data.get("kind") != KIND or data.get("format_version") != FORMAT_VERSION:
            raise UsageError(f"{path}: not a {KIND} record of format {FORMAT_VERSION} (kind {data.get('kind')!r}, "
                             f"format {data.get('format_version')!r})")  # fmt: skip
        return cls.from_json(data)

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over ``model``'s state dict (sorted names, dtypes, shapes, raw bytes): the same weights give
    the same hash whether loaded from a hub id or a folder. Reads every weight once: ~0.6 s of one core per GB
    (1.8 GB/s measured), ~30 s for Flux's 12B transformer in fp32."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy())  # hashed in place, no copy
    return h.hexdigest()


def add_lora(model: torch.nn.Module, cfg: TrainConfig, *, targets: tuple[str, ...], supported: bool = True) -> None:
    """Freeze ``model`` and add LoRA adapters (``cfg.lora_rank``, ``lora_alpha``, ``lora_targets`` or ``targets``).

    Raises UsageError when peft is missing or the model class cannot save adapters (``supported``).
    """
    if not supported:
        raise UsageError(f"config lora_rank: {type(model).__name__} has no LoRA loaders in diffusers; "
                         "train it fully (lora_rank: 0)")
    try:
        from peft import LoraConfig
    except ImportError:
        raise UsageError("config lora_rank needs peft: pip install 'bucketeer[lora]'") from None
    model.requires_grad_(False)
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or cfg.lora_rank, init_lora_weights="gaussian",
                        target_modules=list(cfg.lora_targets or targets))  # fmt: skip
    try:
        model.add_adapter(config)
    except ValueError as e:  # peft: none of the target modules is in the model
        raise UsageError(f"config lora_targets {config.target_modules}: {e}") from None


def save_lora(model: torch.nn.Module, directory: Path, record: LoraRecord) -> None:
    """Write ``model``'s (unwrapped) adapters to ``directory`` as the family's pipeline writes them
    (``save_lora_weights``, :data:`LORA_FILE`, with peft's config as metadata), and ``record`` as ``lora.json``."""
    import diffusers
    from peft.utils import get_peft_model_state_dict

    pipeline = getattr(diffusers, record.pipeline)
    if not hasattr(pipeline, "save_lora_weights"):  # no LoRA loaders (HunyuanVideo15Pipeline): the model's own format
        model.save_lora_adapter(str(directory), weight_name=LORA_FILE)  # with peft's config as metadata
        record.write(Path(directory) / RECORD_FILE)
        return
    layers = get_peft_model_state_dict(model)  # adapter weights, without peft's adapter name in the keys
    metadata = model.peft_config["default"].to_dict()  # rank, alpha, targets: the loaders rebuild the scale from it
    if pipeline.save_lora_weights.__qualname__ == "LoraBaseMixin.save_lora_weights":  # loaders, no saver: Anima's
        # (it raises NotImplementedError); the helper every saver calls writes the same format
        pipeline._save_lora_weights(str(directory), {record.component: layers}, {record.component: metadata},
                                    weight_name=LORA_FILE)  # fmt: skip
    else:
        pipeline.save_lora_weights(str(directory), weight_name=LORA_FILE, **{
            f"{record.component}_lora_layers": layers, f"{record.component}_lora_adapter_metadata": metadata})
    record.write(Path(directory) / RECORD_FILE)


def export_folder(name: str, index: int) -> str:
    """The folder of the ``index``-th model of an export called ``name``: ``lora``, then ``lora_2``, ``lora_3``."""
    return name if index == 0 else f"{name}_{index + 1}"


def export_parts(model: torch.nn.Module, name: str) -> list[tuple[str, torch.nn.Module]]:
    """``(folder, model)`` of each model the export ``name`` writes: ``model`` itself, or for a model that holds
    several (``experts``: Wan 2.2 A14B's two under ``expert: both``) each of them in :func:`export_folder` order,
    one diffusers export each (``transformer`` in ``lora``, ``transformer_2`` in ``lora_2``): diffusers'
    ``save_lora_weights`` writes one component per file, and ``load_lora_weights`` loads a file into one."""
    experts = getattr(model, "experts", None) or {"model": model}
    return [(export_folder(name, i), part) for i, part in enumerate(experts.values())]


def load_lora(model: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """Load the adapters in ``directory`` (:data:`LORA_FILE`) into ``model``, the pretrained model they were
    trained on; returns it. Reads the pipeline format and the model-level one of earlier versions (see the
    module docstring)."""
    from safetensors import safe_open

    with safe_open(str(Path(directory) / LORA_FILE), "pt") as f:
        heads = {key.split(".", 1)[0] for key in f.keys()}
    prefix = next(iter(heads)) if len(heads) == 1 and heads <= set(COMPONENTS) else None  # None: the old format
    # safetensors only: without use_safetensors diffusers may fall back to a pickled .bin
    model.load_lora_adapter(str(directory), prefix=prefix, use_safetensors=True, weight_name=LORA_FILE,
                            adapter_name="default")  # peft's name for the adapter trained here
    return model


# ---------------------------------------------------------------- checkpoints of a LoRA run


def _adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def register_adapter_checkpoints(accelerator, record: LoraRecord) -> None:
    """Make ``accelerator.save_state`` write the adapters (``adapters.safetensors``) and ``lora.json`` instead of
    the whole model, and ``load_state`` read them back. The optimizer, schedule and random states stay
    accelerate's. Under FSDP and DeepSpeed the backend saves the model itself (sharded, whole): only
    ``lora.json`` is added there."""

    def save(models: list, weights: list, folder: str) -> None:
        if accelerator.is_main_process:
            record.write(Path(folder) / RECORD_FILE)
        if not weights:  # FSDP / DeepSpeed: saved by the backend
            return
        weights.pop()  # accelerate writes no model.safetensors
        if accelerator.is_main_process:
            from safetensors.torch import save_file

            adapters = _adapters(accelerator.unwrap_model(models[0]))
            tensors = {n: p.detach().cpu().contiguous() for n, p in adapters.items()}
            save_file(tensors, str(Path(folder) / ADAPTERS_FILE))

    def load(models: list, folder: str) -> None:
        path = Path(folder) / ADAPTERS_FILE
        if not models or not path.exists():  # a backend's own model files, or a whole-model checkpoint
            return
        from safetensors.torch import load_file

        adapters, saved = _adapters(accelerator.unwrap_model(models.pop())), load_file(str(path))
        if saved.keys() != adapters.keys() or any(saved[n].shape != p.shape for n, p in adapters.items()):
            raise UsageError(f"{path}: its adapters are not the ones this run trains (lora_rank or lora_targets "
                             "changed); resume with the settings it was trained with, or use a new --output-dir")
        with torch.no_grad():
            for name, param in adapters.items():
                param.copy_(saved[name])

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def check_resume(folder: str | Path, name: str, record: LoraRecord | None) -> str | None:
    """Whether the checkpoint in ``folder`` (called ``name`` in messages) resumes this run: its ``lora.json``
    against ``record`` (this run's; None for a full fine-tune). Raises UsageError for adapters of another base
    model (by weight hash), of another rank, alpha or targets, or for adapters when this run trains the whole
    model. Returns a note to print, or None."""
    path = Path(folder) / RECORD_FILE
    saved = LoraRecord.read(path) if path.exists() else None
    if record is None:
        if saved is not None:
            raise UsageError(f"{name} holds LoRA adapters (lora_rank {saved.rank}) but the config trains the whole "
                             f"model: set lora_rank: {saved.rank}, or use a new --output-dir")  # fmt: skip
        return None
    if saved is None:
        return f"{name}: a whole-model checkpoint of an earlier version; its base model is not checked"
    if saved.base_sha256 != record.base_sha256:
        raise UsageError(f"{name} trained adapters on another base model ({saved.base_model}, weights "
                         f"{saved.base_sha256[:12]}) than this run loads ({record.base_model}, weights "
                         f"{record.base_sha256[:12]}): set pretrained: to that model, or use a new --output-dir")
    if (saved.rank, saved.alpha, saved.targets) != (record.rank, record.alpha, record.targets):
        raise UsageError(f"{name} trained adapters of rank {saved.rank}, alpha {saved.alpha}, targets "
                         f"{list(saved.targets)}; this config asks for rank {record.rank}, alpha {record.alpha}, "
                         f"targets {list(record.targets)}: resume with its settings, or use a new --output-dir")
    if saved.base_model != record.base_model:
        return f"{name}: base model {saved.base_model} then, {record.base_model} now: the same weights (hash)"
    return None


def lora_record(model: torch.nn.Module, *, family: str, pipeline: str, component: str, base_model: str,
                base_sha256: str) -> LoraRecord:  # fmt: skip
    """The :class:`LoraRecord` of ``model`` once :func:`add_lora` has added its adapters."""
    config = model.peft_config["default"]
    return LoraRecord(family=family, pipeline=pipeline, component=component, base_model=base_model,
                      base_sha256=base_sha256, rank=int(config.r), alpha=float(config.lora_alpha),
                      targets=tuple(sorted(config.target_modules)))  # fmt: skip
