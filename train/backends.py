"""What the plan fixes in every accelerate backend (DDP, FSDP2, DeepSpeed ZeRO 1-3), and their checks.

The plan decides the per-rank batch of every step and the gradient accumulation (``bucketeer plan
--grad-accum``): the trainer passes the accumulation to ``Accelerator`` and, under DeepSpeed,
writes the micro batch, the accumulation and the global batch into the DeepSpeed config before
``prepare`` (no DataLoader is prepared, so DeepSpeed's ``"auto"`` values would otherwise have
nothing to resolve from). A value that an accelerate or DeepSpeed config sets to something else is
an error naming both, never silently overridden either way.

Backends that cannot honour the project's rules are refused up front: an accelerate config that
asks for FSDP or DeepSpeed where accelerate does not run it (on a CPU-only machine accelerate 1.x
falls back to plain multi-CPU DDP), and FSDP's ``SHARDED_STATE_DICT``, whose
torch.distributed.checkpoint metadata is read back with pickle (``FULL_STATE_DICT`` is saved as
tensors and loaded with ``weights_only=True``).
"""

from __future__ import annotations

import os
from pathlib import Path

from manifests.plan import PlanMeta
from manifests.errors import UsageError

__all__ = ["choose_attention", "plan_grad_accum", "plan_micro_batch", "check_backend", "prepare_fsdp_wrap",
           "configure_deepspeed", "is_sharded", "save_model"]

ACCUM_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"  # set by `accelerate launch` from a deepspeed_config


def plan_grad_accum(plan_meta: PlanMeta, config_value: int | None, plan_name: str) -> int:
    """The plan's gradient accumulation. Raises UsageError when the training config or the accelerate
    config (``gradient_accumulation_steps``, which ``accelerate launch`` passes as $ACCELERATE_GRADIENT_
    ACCUMULATION_STEPS and accelerate would prefer to ours) says otherwise, naming both."""
    planned = plan_meta.inputs.grad_accum
    if config_value is not None and config_value != planned:
        raise UsageError(f"--plan {plan_name} was made with --grad-accum {planned} but the config says grad_accum: "
                         f"{config_value}; remove grad_accum from the config (the plan decides) or set it to "
                         f"{planned}, or re-plan with --grad-accum {config_value}")  # fmt: skip
    launched = os.environ.get(ACCUM_ENV, "")
    if launched.isdigit() and int(launched) != planned:
        raise UsageError(f"the accelerate config sets gradient_accumulation_steps: {launched} (${ACCUM_ENV}) but "
                         f"--plan {plan_name} was made with --grad-accum {planned}; set it to {planned} or remove it "
                         "from the accelerate config (the plan decides)")  # fmt: skip
    return planned


def plan_micro_batch(plan_meta: PlanMeta) -> int:
    """Samples per rank per step: the plan's batch size (packing mode: the largest bucket batch)."""
    return max(b.batch_size for b in plan_meta.buckets.values())


def choose_attention(setting: str, capability: tuple[int, int] | None, torch_version: str) -> tuple[bool | None, str]:
    """``(allow cuDNN attention, why)`` of the config's ``cudnn_attention`` on a device of compute ``capability``
    (None: no CUDA; then nothing to choose, ``(None, "")``). ``auto`` turns it off where torch prefers it (2.10 and
    newer on sm90 and sm100, with the cuDNN its wheels bundle): the Flux-width trainer failed there twice
    (``CUBLAS_STATUS_EXECUTION_FAILED``, then an illegal memory access) and the lead is cuDNN's attention backward,
    which since cuDNN 9.5 takes a gradient whose strides differ from the output's as it is, and Flux's
    single-stream blocks hand it one with a row stride of 5 x the width where the double-stream blocks' is 1 x
    (``tests/test_train_attention.py``). Unconfirmed on a GPU; with it off torch runs flash attention, the
    backend it chose before 2.10. ``on`` leaves torch's choice; ``off`` turns it off everywhere."""
    if capability is None:
        return None, ""
    if setting == "on":
        return True, "attention: torch's choice of SDPA backend (cudnn_attention: on)"
    if setting == "off":
        return False, "attention: cuDNN SDPA off (cudnn_attention: off); flash or memory-efficient attention"
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 10) and capability[0] in (9, 10):
        return False, (f"attention: cuDNN SDPA off (cudnn_attention: auto: torch {torch_version} prefers it on "
                       f"sm{capability[0]}{capability[1]}, where the Flux-width trainer failed with an illegal "
                       "memory access, cause unconfirmed; flash attention instead; cudnn_attention: on allows it)")
    return None, f"attention: torch's choice of SDPA backend (sm{capability[0]}{capability[1]}, torch {torch_version})"


def check_backend(accelerator) -> None:
    """Refuse a backend asked for but not running, and FSDP state dicts that are read back with pickle."""
    from accelerate.utils import DistributedType

    running = accelerator.distributed_type
    for env, backend, kind in (("ACCELERATE_USE_FSDP", "FSDP", DistributedType.FSDP),
                               ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed", DistributedType.DEEPSPEED)):  # fmt: skip
        if os.environ.get(env, "false").lower() == "true" and running != kind:
            raise UsageError(f"the accelerate config asks for {backend}, but accelerate runs {running.value} here "
                             f"(accelerate runs {backend} only on GPUs or other accelerators, not with "
                             "ACCELERATE_USE_CPU or on a CPU-only machine); use a DDP config such as "
                             "infra/accelerate/cpu-2proc.yaml, or run on GPUs")  # fmt: skip
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if running == DistributedType.FSDP and plugin is not None:
        kind = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
        if kind != "FULL_STATE_DICT":
            raise UsageError(f"fsdp_state_dict_type {kind}: its checkpoints are read back with pickle "
                             "(torch.distributed.checkpoint metadata); set fsdp_state_dict_type: FULL_STATE_DICT "
                             "(saved as tensors, loaded with weights_only=True)")  # fmt: skip


def prepare_fsdp_wrap(accelerator, model) -> None:
    """Make FSDP2's auto-wrap policy shard ``model``'s blocks, and refuse one that ``fully_shard`` would refuse.

    Under ``TRANSFORMER_BASED_WRAP`` without ``fsdp_transformer_layer_cls_to_wrap``, the block classes are the
    model's ``_no_split_modules``, written into the plugin: accelerate before 1.14 reads them there but wraps
    nothing unless the plugin names them, leaving one unsharded root. A policy that selects a container without
    ``forward`` (a ``ModuleList``), which torch's ``fully_shard`` rejects deep inside ``accelerator.prepare``, is
    refused in one line naming the module and the fix: size-based wrapping does this on diffusers models (an
    attention's ``to_out`` list passes the size)."""
    import torch
    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type != DistributedType.FSDP or plugin is None or plugin.fsdp_version != 2:
        return
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy_fn = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if policy_fn is transformer_auto_wrap_policy and plugin.transformer_cls_names_to_wrap is None:
        plugin.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        return
    for name, module in model.named_modules():
        if name and policy(module) and type(module).forward is torch.nn.Module.forward:
            raise UsageError(f"FSDP2's auto-wrap policy selects {name} ({type(module).__name__}), a container "
                             "without forward that torch's fully_shard refuses: set fsdp_auto_wrap_policy: "
                             "TRANSFORMER_BASED_WRAP (the model's blocks, as infra/accelerate/fsdp2-1x8.yaml does)")


def configure_deepspeed(plugin, *, micro_batch: int, grad_accum: int, world_size: int, max_grad_norm: float) -> None:
    """Write the plan's batch and accumulation (and the config's gradient clipping) into a DeepSpeed config.

    ``plugin``: ``AcceleratorState().deepspeed_plugin``. ``"auto"`` or absent values are filled;
    a number that contradicts the plan raises UsageError naming the key, both values and the fix.
    """
    config = plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": (micro_batch, f"the plan's per-rank batch ({micro_batch})"),
        "gradient_accumulation_steps": (grad_accum, f"the plan's --grad-accum ({grad_accum})"),
        "train_batch_size": (micro_batch * grad_accum * world_size,
                             f"the plan's batch x --grad-accum x {world_size} processes "
                             f"({micro_batch * grad_accum * world_size})"),
        "gradient_clipping": (max_grad_norm, f"the training config's max_grad_norm ({max_grad_norm})"),
    }  # fmt: skip
    for key, (value, source) in wanted.items():
        have = config.get(key, "auto")
        if have != "auto" and float(have) != float(value):
            raise UsageError(f"the DeepSpeed config sets {key}: {have}, which contradicts {source}; set it to "
                             f'{value} or "auto" (the trainer fills it)')  # fmt: skip
        config[key] = value
    plugin.gradient_accumulation_steps = grad_accum
    plugin.gradient_clipping = max_grad_norm


def is_sharded(accelerator) -> bool:
    """Whether the backend shards parameters (FSDP, DeepSpeed ZeRO-3)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage") if plugin is not None else None
    return accelerator.distributed_type.name == "FSDP" or stage == 3


def save_model(accelerator, model, directory: Path) -> None:
    """Save the whole model where ``from_pretrained`` loads it: its config and one safetensors file.

    Call it on every rank: ``accelerator.get_state_dict`` gathers the shards under FSDP and DeepSpeed
    ZeRO-3 (a collective), and the main process writes what it gathered.
    """
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        accelerator.unwrap_model(model).save_config(directory)
        tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()}
        save_file(tensors, directory / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
