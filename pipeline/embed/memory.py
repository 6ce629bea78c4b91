"""Device memory of the embed encoders: what a text encoder's weights take, checked before they load.

A family's text encoder can be an LLM (Flux 2: Mistral Small 3.1, 24B parameters, 48 GB in bf16): loading one
a GPU cannot hold ends, minutes later, in an out-of-memory error. :func:`text_encoder_bytes` counts the
parameters the family runs (after its ``prune``: Flux 2 keeps 30 of Mistral's 40 layers and no vision tower)
on the meta device, from the folder's ``config.json`` alone, in the compute dtype; :func:`check_fits` refuses
in one line when they exceed the device's free memory. :class:`pipeline.embed.encoders.TextEncoders` does
both before it loads a weight, on the device it was given (a CUDA device's free memory: ``torch.cuda.
mem_get_info``, so that a VAE already loaded by the same worker counts; the CPU is not checked). Activations
come on top: ``--text-batch-size`` bounds them.
"""

from __future__ import annotations

from typing import Any, Callable

from manifests.errors import UsageError

__all__ = ["parameter_count", "text_encoder_bytes", "free_bytes", "check_fits", "check_text_encoders"]

GB = 1e9


def parameter_count(model: Any) -> int:
    """Parameters of ``model`` (a meta-device model is fine)."""
    return sum(p.numel() for p in model.parameters())


def text_encoder_bytes(class_name: str, config: Any, prune: Callable[[Any], Any] | None, dtype: Any) -> int:
    """Bytes of a ``transformers`` ``class_name`` built from ``config`` on the meta device and ``prune`` d
    (None: whole), in ``dtype`` (a ``torch.dtype``). Reads no weight."""
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, class_name)._from_config(config)
        model.tie_weights()  # transformers 5.0 leaves tied embeddings (T5's) untied on meta: counted twice
    if prune is not None:
        model = prune(model)
    return parameter_count(model) * torch.empty((), dtype=dtype).element_size()


def free_bytes(device: Any) -> int | None:
    """Free memory of a CUDA ``device`` in bytes (None for the CPU: not checked)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def check_fits(need: int, free: int | None, what: str) -> None:
    """UsageError (one line) when ``need`` bytes of ``what`` exceed ``free`` (None: nothing to check)."""
    if free is not None and need > free:
        raise UsageError(f"{what} needs {_gb(need)} for its weights alone, and the GPU has {_gb(free)} free: use a "
                         "GPU with more memory, --dtype bf16 (fp16 and fp32 caches compute in fp32), or --device cpu")


def check_text_encoders(family: Any, encoders: list[tuple[str, str, Any]], dtype: Any, free: int | None) -> None:
    """Refuse in one line, before a weight loads, a ``family``'s text ``encoders`` (``(id, class, config)`` each)
    whose weights in ``dtype`` (after the family's ``prune``) exceed ``free`` bytes (None: nothing checked)."""
    if free is None:
        return
    need = sum(text_encoder_bytes(cls, config, family.prune, dtype) for _, cls, config in encoders)
    names = ", ".join(f"{cls} ({ident})" for ident, cls, _ in encoders)
    check_fits(need, free, f"--family {family.name}: the text encoder {names} in {str(dtype).replace('torch.', '')}")


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.2f} MB"
