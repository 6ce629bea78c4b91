"""The trainer's setup steps, in the order :func:`train.loop.run` takes them: launch, position, data, model.

Each step reads what the one before produced and returns a small typed record of its own. Plan and
cache metadata (``_plan.json``, ``_cache.json``) are read here and nowhere else in the run: the loop
sees the values they decide (the run's epochs, the recipe's family, the schedule's length).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from manifests.errors import UsageError
from manifests.storage import redact
from train.checkpoint import Checkpoint, Cursor
from train.config import TrainConfig
from train.job import TrainJob
from train.output import OutputDir

if TYPE_CHECKING:
    from manifests.cache import CacheReader
    from train.data import BatchLoader, RankSteps
    from train.ema import EMA, ShardedEMA
    from train.lora import LoraRecord
    from train.recipes import Denoiser

__all__ = ["Launch", "Position", "Data", "Model", "setup_launch", "setup_position", "setup_data", "setup_model"]

# The prepared (DDP-wrapped) model lives until os._exit. When the run returns, its frame would free
# the model, and the DDP Reducer's destructor joins the gloo process group's worker threads while
# holding the GIL; a worker still finishing the last barrier needs the GIL to drop a tensor, and the
# rank deadlocks after "done" (seen about once in 12 two-process runs, with py-spy showing
# ~ProcessGroupGloo in std::thread::join against AsyncBarrierWork waiting in gil_scoped_acquire).
_KEEP_ALIVE: list[object] = []


@dataclass(frozen=True)
class Launch:
    """The accelerator and what it was made from: the root plan, its accumulation, the output folder."""

    accelerator: Any  # accelerate.Accelerator
    cfg: TrainConfig
    output: OutputDir
    root_url: str
    root_meta: dict[str, Any]  # the root plan's _plan.json
    grad_accum: int  # plan steps per optimizer step
    max_steps: int | None  # --max-steps rounded down to whole optimizer steps
    epochs: int  # the run's epochs (the root plan's inputs.epochs, however many are planned yet)


@dataclass(frozen=True)
class Position:
    """Where the run starts and the plan it follows (the root plan, or an elastic resume's re-cut)."""

    cursor: Cursor
    checkpoint: Checkpoint | None  # the checkpoint resumed from
    plan_url: str
    plan_meta: dict[str, Any]  # the followed plan's _plan.json
    planned_epochs: int  # epochs the followed plan holds (fewer than Launch.epochs before --extend)


@dataclass(frozen=True)
class Data:
    """This rank's steps and the loader that turns them into batches."""

    reader: CacheReader  # the first cache's
    steps: RankSteps
    loader: BatchLoader
    family: str  # the cache's model family ("generic" for none)


@dataclass(frozen=True)
class Model:
    """The family's recipe, the prepared model, optimizer and schedule (and the EMA, if any)."""

    denoiser: Denoiser
    ema: EMA | ShardedEMA | None
    model: Any  # prepared by accelerate (DDP / FSDP / DeepSpeed wrapped)
    optimizer: Any
    lr_scheduler: Any
    plan_steps: int  # plan steps of the whole run (root plan)
    total_updates: int  # optimizer steps in the schedule
    lora: LoraRecord | None  # what the adapters are trained on and with (None: the whole model is trained)
    repa: Any = None  # train.repa.Repa: the REPA hook, projector and loss term (config repa:)


def setup_launch(job: TrainJob) -> Launch:
    """The plan's accumulation (checked against the configs), the output folder, the Accelerator."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    from manifests.plan import read_plan_meta
    from train.backends import check_backend, plan_grad_accum
    from train.output import check_shared, check_writable, open_output

    cfg = job.config
    root_url = job.plan_url
    root_meta = read_plan_meta(root_url, job.read_options)
    grad_accum = plan_grad_accum(root_meta, cfg.grad_accum, redact(job.plan))
    if cfg.checkpoint_every % grad_accum:
        raise UsageError(f"config: checkpoint_every {cfg.checkpoint_every} must be a multiple of the plan's "
                         f"--grad-accum {grad_accum} (a checkpoint is taken between optimizer steps)")  # fmt: skip
    # the first rank of this node names its local folder (torchrun and accelerate launch set both)
    node = int(os.environ.get("RANK", 0)) - int(os.environ.get("LOCAL_RANK", 0))
    output = open_output(job.output_dir, job.storage_options, node)
    check_writable(output)  # before the Accelerator's TensorBoard folder and any model load
    # expert: both (Wan 2.2 A14B) runs one of the model's two experts per step: DDP must find the unused one
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if cfg.expert == "both" else []
    accelerator = Accelerator(
        kwargs_handlers=handlers,
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=grad_accum,
        step_scheduler_with_optimizer=False,  # we step the schedule once per optimizer step, on any world size
        log_with="tensorboard" if _has_tensorboard() else None,
        project_dir=str(output.local("logs")),
    )
    check_backend(accelerator)
    _choose_attention(accelerator, cfg.cudnn_attention)
    if cfg.expert == "both" and accelerator.distributed_type.name in ("FSDP", "DEEPSPEED"):
        raise UsageError(f"config expert: both runs under DDP only ({accelerator.distributed_type.value} here shards "
                         "a model whose steps leave half of it unused): use a DDP accelerate config, or train each "
                         "expert in its own run (expert: high, expert: low)")  # fmt: skip
    check_shared(accelerator, output)
    set_seed(cfg.seed)  # identical initial weights on every rank
    max_steps = _whole_updates(job.max_steps, grad_accum)
    if max_steps != job.max_steps:
        accelerator.print(f"--max-steps {job.max_steps} is not a multiple of grad_accum {grad_accum}: stopping "
                          f"after {max_steps} plan steps, the last optimizer step before it (runs stop and "
                          "checkpoint only between optimizer steps)")  # fmt: skip
    epochs = root_meta.inputs.epochs
    return Launch(accelerator, cfg, output, root_url, root_meta, grad_accum, max_steps, epochs)


def _choose_attention(accelerator: Any, setting: str) -> None:
    """Apply :func:`train.backends.choose_attention` on a CUDA device, and say what it chose."""
    import torch

    from train.backends import choose_attention

    cuda = accelerator.device.type == "cuda"
    allow, why = choose_attention(setting, torch.cuda.get_device_capability(accelerator.device) if cuda else None,
                                  torch.__version__)  # fmt: skip
    if allow is not None:
        torch.backends.cuda.enable_cudnn_sdp(allow)
    if why:
        accelerator.print(why)


def setup_position(job: TrainJob, launch: Launch) -> Position:
    """Where to start: the plan's beginning or the latest checkpoint's cursor; the plan to follow."""
    from train.checkpoint import find_checkpoint, resume_elastic

    accelerator, world, output = launch.accelerator, launch.accelerator.num_processes, launch.output
    checkpoint = find_checkpoint(output) if job.resume else None
    if checkpoint is not None:
        cursor = checkpoint.cursor
        if cursor.root_fingerprint != launch.root_meta.fingerprint:
            raise UsageError(f"{output.name(checkpoint.rel)} was trained on another plan than --plan "
                             f"{redact(job.plan)}; pass that plan, or use a new --output-dir")  # fmt: skip
        accelerator.print(f"resuming from {output.name(checkpoint.rel)}: epoch {cursor.epoch} step "
                          f"{cursor.step} (trained on {cursor.world_size} processes, now {world})")  # fmt: skip
    else:
        if job.resume:
            accelerator.print(f"--resume: no checkpoint in {output.name()}; starting at the beginning of the plan")
        if launch.root_meta.inputs.world_size != world:
            raise UsageError(f"--plan {redact(job.plan)} is for {launch.root_meta.inputs.world_size} ranks but "
                             f"{world} processes are running: plan with --world-size {world}")  # fmt: skip
        cursor = Cursor.start(launch.root_meta, launch.root_url, world)
    with accelerator.main_process_first():  # rank 0 writes an elastic plan, the others then read it
        plan_url, plan_meta = resume_elastic(cursor, launch.root_url, launch.root_meta, output, world,
                                             job.read_options, write=accelerator.is_main_process)  # fmt: skip
    cursor = replace(cursor, world_size=world, plan_url=plan_url, plan_fingerprint=plan_meta.fingerprint)
    planned = plan_meta.epochs[-1].epoch + 1
    return Position(cursor, checkpoint, plan_url, plan_meta, planned)


def setup_data(job: TrainJob, launch: Launch, position: Position) -> Data:
    """This rank's steps (read epoch by epoch), the cache readers (checked against the plan), the loader."""
    import torch

    from manifests.cache import CacheReader
    from manifests.storage import is_local
    from train.data import BatchLoader, rank_steps
    from train.data.processes import choose_readers, main_is_safe, usable_cores

    accelerator, cursor, cfg, output = launch.accelerator, position.cursor, launch.cfg, launch.output
    caches = list(job.caches)
    mix = position.plan_meta.inputs.mix
    wanted = list(mix.cache_fingerprints) if mix else [position.plan_meta.inputs.cache_fingerprint]
    if len(caches) != len(wanted):
        raise UsageError(f"--cache names {len(caches)} caches, the plan mixes {len(wanted)} manifests: pass one "
                         "cache per manifest, comma-separated, in the order `bucketeer plan` was given "
                         "them")  # fmt: skip
    readers = [CacheReader(c, job.read_options) for c in caches]
    for d, (cache, reader, fp) in enumerate(zip(caches, readers, wanted)):
        if fp and fp != reader.meta.fingerprint:
            raise UsageError(f"the plan was made for a cache with fingerprint {fp[:12]}"
                             + (f" for dataset {d}" if mix else "") + f", but --cache {redact(cache)} has "
                             f"{reader.meta.fingerprint[:12]}: pass that cache or re-plan")  # fmt: skip
    reader = readers[0]
    plan_so = job.read_options if "://" in position.plan_url else None
    if not output.is_local and position.plan_url.startswith(output.url_of("")):
        plan_so = output.fs.storage_options  # an elastic plan written under a URL --output-dir
    limit = None if launch.max_steps is None else max(launch.max_steps - cursor.position, 0)
    steps = rank_steps(position.plan_url, accelerator.process_index, plan_so, start=(cursor.epoch, cursor.step),
                       limit=limit)  # fmt: skip
    counts = accelerator.gather(torch.tensor([len(steps)], device=accelerator.device)).tolist()
    if len(set(counts)) != 1:  # a plan invariant; checked because a violation would hang DDP
        raise UsageError(f"ranks have different step counts {counts}: run `bucketeer plan --check`")
    processes, why = choose_readers(cfg.read_processes, local=all(is_local(r.fs) for r in readers),
                                    cores=usable_cores(),
                                    ranks=int(os.environ.get("LOCAL_WORLD_SIZE") or accelerator.num_processes),
                                    safe_main=main_is_safe())  # fmt: skip
    accelerator.print(f"loader: {why}")
    loader = BatchLoader(readers, steps, reader.meta.latent, rank=accelerator.process_index,
                         prefetch=cfg.prefetch, read_threads=cfg.read_threads,
                         skip_bad_records=job.skip_bad_records, pin_memory=accelerator.device.type == "cuda",
                         log=lambda line: print(redact(line), file=sys.stderr, flush=True),
                         caption_dropout=cfg.caption_dropout, seed=cfg.seed,
                         posterior_sampling=cfg.posterior_sampling, widen=cfg.loader_float32,
                         read_ahead_mb=cfg.read_ahead_mb, read_processes=processes)  # fmt: skip
    return Data(reader, steps, loader, reader.meta.family or "generic")


def setup_model(launch: Launch, position: Position, data: Data) -> Model:
    """The family's model (LoRA, EMA), optimizer and LR schedule, prepared (DeepSpeed filled from the plan
    first), and resumed."""
    import torch
    from diffusers.optimization import get_scheduler

    from train.backends import configure_deepspeed, plan_micro_batch, prepare_fsdp_wrap
    from train.checkpoint import fetch_checkpoint
    from train.ema import EMA, ShardedEMA, sharded_ema
    from train.lora import check_resume
    from train.recipes import recipe_for

    accelerator, cfg, root_meta, reader = launch.accelerator, launch.cfg, launch.root_meta, data.reader
    # the recipe sees the plan's accumulation (wan2.2-a14b expert: both picks one expert per optimizer step)
    recipe_cfg = replace(cfg, grad_accum=launch.grad_accum)
    denoiser = recipe_for(cfg, reader.meta).setup(recipe_cfg, reader.meta)
    model = denoiser.model
    lora = _setup_lora(accelerator, cfg, denoiser, data.family) if cfg.lora_rank else None
    trained = [p for p in model.parameters() if p.requires_grad]
    # FSDP2: the EMA is DTensor shards beside the model's, made once prepare has sharded it (ZeRO-3, FSDP1: refused)
    sharded = bool(cfg.ema_decay) and sharded_ema(accelerator)
    repa = None
    if cfg.repa is not None:  # its projector trains in the optimizer's second group, and is checkpointed
        from train.repa import setup_repa

        repa = setup_repa(accelerator, cfg.repa, model, reader.meta, cfg.seed)
    ema: EMA | ShardedEMA | None = EMA(model, cfg.ema_decay) if cfg.ema_decay and not sharded else None
    if ema is not None:
        ema.register(accelerator)  # ema.safetensors in every checkpoint, read back by load_state
    # linear scaling by the ROOT plan's world size: an elastic resume keeps the global batch, so the lr too
    lr = cfg.lr * root_meta.inputs.world_size if cfg.scale_lr else cfg.lr
    groups = [{"params": trained}, *([{"params": repa.parameters()}] if repa else [])]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)  # fmt: skip
    # the schedule's length: the run's epochs (inputs.epochs, however many are planned yet) of the root plan
    plan_steps = root_meta.steps_per_epoch * launch.epochs
    total_updates = plan_steps // launch.grad_accum  # exact: steps per epoch are a multiple of grad_accum
    schedule = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.lr_schedule]
    lr_scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=cfg.warmup_steps,
                                 num_training_steps=total_updates)  # fmt: skip
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:  # no DataLoader is prepared: DeepSpeed's batch settings come from the plan
        configure_deepspeed(plugin, micro_batch=plan_micro_batch(position.plan_meta), grad_accum=launch.grad_accum,
                            world_size=accelerator.num_processes, max_grad_norm=cfg.max_grad_norm)  # fmt: skip
    prepare_fsdp_wrap(accelerator, model)
    # only model/optimizer/schedule are prepared: the loader is already this rank's shard (see train.data)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    _KEEP_ALIVE.append(model)  # never deallocated before os._exit: see _KEEP_ALIVE
    if sharded:
        ema = ShardedEMA(accelerator.unwrap_model(model), cfg.ema_decay)
        ema.register(accelerator)  # ema/ (a shard per rank) and ema.json in every checkpoint
    if position.checkpoint is not None:
        local = fetch_checkpoint(accelerator, launch.output, position.checkpoint)
        note = check_resume(local, launch.output.name(position.checkpoint.rel), lora)  # base model, rank, targets
        if note:
            accelerator.print(note)
        # accelerate 1.x reads optimizer, schedule and RNG files with torch.load(weights_only=True)
        accelerator.load_state(str(local), load_kwargs={"weights_only": True})
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            launch.output.drop_local_copy(position.checkpoint.rel)
    accelerator.wait_for_everyone()
    return Model(denoiser, ema, model, optimizer, lr_scheduler, plan_steps, total_updates, lora, repa)


def _setup_lora(accelerator, cfg: TrainConfig, denoiser: Denoiser, family: str) -> LoraRecord:
    """Adapters on the frozen model, their record (base id and weight hash: hashed once, on the main process),
    and checkpoints that hold the adapters only."""
    from accelerate.utils import broadcast_object_list

    from train.lora import add_lora, lora_record, register_adapter_checkpoints, weights_sha256

    # a model without LoRA loaders is refused by add_lora below, unhashed
    digest = [weights_sha256(denoiser.model) if accelerator.is_main_process and denoiser.lora else None]
    broadcast_object_list(digest)  # every rank compares the same hash at a resume, so all refuse or none
    add_lora(denoiser.model, cfg, targets=denoiser.lora_targets, supported=denoiser.lora)
    record = lora_record(denoiser.model, family=family, pipeline=str(denoiser.pipeline_class),
                         component=denoiser.lora_component or denoiser.component, base_model=str(denoiser.source),
                         base_sha256=digest[0])  # fmt: skip
    register_adapter_checkpoints(accelerator, record)
    return record


def _whole_updates(max_steps: int | None, grad_accum: int) -> int | None:
    """``--max-steps`` rounded down to whole optimizer steps. Raises ValueError when none is left."""
    if max_steps is None:
        return None
    if max_steps < grad_accum:
        raise UsageError(f"--max-steps {max_steps} is less than one optimizer step (grad_accum: {grad_accum} plan "
                         f"steps); pass --max-steps {grad_accum} or more")  # fmt: skip
    return max_steps - max_steps % grad_accum


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
