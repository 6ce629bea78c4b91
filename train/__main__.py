"""Train a diffusion model from a plan and a cache: the lean Accelerate loop, one for every model family.

    accelerate launch -m train --plan PLAN --cache CACHE [--config FILE] [--output-dir DIR] [--resume]
    ACCELERATE_USE_CPU=true accelerate launch --config_file infra/accelerate/cpu-2proc.yaml -m train --plan P --cache C
    python -m train --plan PLAN --cache CACHE                 # one process (the plan must be for 1 rank)

PLAN is made for as many ranks as there are processes (``bucketeer plan --world-size N``); each rank
trains on exactly its plan rows. ``--resume`` continues from the latest checkpoint in
``--output-dir`` with exactly the batches an uninterrupted run would have seen, on any number of
processes that divides the global batch (the plan is re-cut for it). Nothing is listed: the plan,
the cache's ``_cache.json`` and index are read by name, records by ranged reads. A plan over several
manifests (``bucketeer plan M1 M2 ...``) takes one cache per manifest, ``--cache C1,C2,...`` in the
plan's order; each is checked against the cache fingerprint the plan recorded for its dataset, and
each sample is read from its dataset's cache.

What is trained is the cache's model family's recipe (:mod:`train.recipes`: SDXL's UNet, the SD3
and Flux transformers fine-tuned from their pretrained weights, PixArt's from-scratch transformer),
fully or as LoRA adapters (:mod:`train.lora`), with caption dropout (:mod:`train.data`), an EMA
(:mod:`train.ema`) and validation images (:mod:`train.validation`) as the config says.

Reads top to bottom: arguments; setup (accelerator, position, data, model, optimizer); the loop;
the end. The parts are in :mod:`train.data`, :mod:`train.recipes`, :mod:`train.checkpoint`,
:mod:`train.metrics` and :mod:`train.config`.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from manifests.errors import UsageError, user_error
from manifests.storage import parse_storage_options, redact

if TYPE_CHECKING:
    from manifests.plan import PlanMeta

# The prepared (DDP-wrapped) model lives until os._exit. When train() returns, its frame would free
# the model, and the DDP Reducer's destructor joins the gloo process group's worker threads while
# holding the GIL; a worker still finishing the last barrier needs the GIL to drop a tensor, and the
# rank deadlocks after "done" (seen about once in 12 two-process runs, with py-spy showing
# ~ProcessGroupGloo in std::thread::join against AsyncBarrierWork waiting in gil_scoped_acquire).
_KEEP_ALIVE: list[object] = []


class StopReason(enum.Enum):
    """Why the loop ended. It decides the last checkpoint, the saved model and the exit code."""

    PLAN_FINISHED = "plan finished"
    WINDOW_FINISHED = "planned epochs finished (the plan has more to --extend)"
    MAX_STEPS = "--max-steps reached"
    PREEMPTED = "stop requested (SIGTERM)"
    NON_FINITE_LOSS = "non-finite loss"

    @property
    def keeps_weights(self) -> bool:
        """A checkpoint at the stop and the final model are written (never for diverged weights)."""
        return self is not StopReason.NON_FINITE_LOSS

    @property
    def exit_code(self) -> int:
        return 1 if self is StopReason.NON_FINITE_LOSS else 0

    def describe(self, *, max_steps: int | None, position: int) -> str:
        """The text of the trainer's ``done: ...`` line."""
        if self is StopReason.MAX_STEPS:
            return f"--max-steps {max_steps} reached"
        if self is StopReason.NON_FINITE_LOSS:
            return f"non-finite loss at position {position}"
        return self.value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="plan folder (local path or URL) from `bucketeer plan`")
    p.add_argument("--cache", required=True, help="cache folder (local path or URL) from `bucketeer embed`; for "
                   "a plan over several manifests one cache per manifest, comma-separated, in the plan's order")
    p.add_argument("--config", default=None, help="YAML/JSON training config (default: train/configs/<family>.yaml "
                   "for an sdxl, sd3 or flux cache, else train/configs/tiny.yaml)")
    p.add_argument("--output-dir", default="train-output",
                   help="checkpoints, logs, the final model: a local folder, or a URL (s3://bucket/run) that "
                        "every node reaches; several nodes need a URL or a shared filesystem")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    p.add_argument("--record-samples", metavar="DIR", default=None,
                   help="write DIR/rank-<r>.jsonl: the sample ids each rank trained on, one line per step")  # fmt: skip
    p.add_argument("--max-steps", type=int, default=None, help="stop once this many plan steps have run in total")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="drop missing/corrupt cache records (counted, logged) instead of stopping")  # fmt: skip
    p.add_argument("--storage-options", default=None,
                   help="fsspec options as JSON for the plan, cache and --output-dir URLs")  # fmt: skip
    return p.parse_args(argv)


@dataclass
class Run:
    """What the setup steps of :func:`train` produce and the loop uses."""

    accelerator: Any
    cfg: Any
    output: Any  # train.output.OutputDir
    storage_options: dict
    root_url: str
    root_meta: PlanMeta
    grad_accum: int
    max_steps: int | None
    checkpoint: Any = None  # train.checkpoint.Checkpoint to resume from
    cursor: Any = None  # train.checkpoint.Cursor
    plan_url: str = ""
    plan_meta: PlanMeta | None = None


def _setup_accelerator(args: argparse.Namespace) -> Run:
    """The plan's accumulation (checked against the configs), the output folder, the Accelerator."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from manifests.cache import read_cache_meta
    from manifests.plan import read_plan_meta
    from train.backends import check_backend, plan_grad_accum
    from train.config import default_config, load_config
    from train.output import check_shared, open_output

    so = _no_head_options(parse_storage_options(args.storage_options), args.plan, *args.cache.split(","))
    cfg = load_config(args.config or default_config(read_cache_meta(args.cache.split(",")[0], so).get("family")))
    root_url = args.plan if "://" in args.plan else os.path.abspath(args.plan)
    root_meta = read_plan_meta(root_url, so)
    grad_accum = plan_grad_accum(root_meta, cfg.grad_accum, redact(args.plan))
    if cfg.checkpoint_every % grad_accum:
        raise UsageError(f"config: checkpoint_every {cfg.checkpoint_every} must be a multiple of the plan's "
                         f"--grad-accum {grad_accum} (a checkpoint is taken between optimizer steps)")  # fmt: skip
    # the first rank of this node names its local folder (torchrun and accelerate launch set both)
    node = int(os.environ.get("RANK", 0)) - int(os.environ.get("LOCAL_RANK", 0))
    output = open_output(args.output_dir, parse_storage_options(args.storage_options), node)
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=grad_accum,
        step_scheduler_with_optimizer=False,  # we step the schedule once per optimizer step, on any world size
        log_with="tensorboard" if _has_tensorboard() else None,
        project_dir=str(output.local("logs")),
    )
    check_backend(accelerator)
    check_shared(accelerator, output)
    set_seed(cfg.seed)  # identical initial weights on every rank
    max_steps = _whole_updates(args.max_steps, grad_accum)
    if max_steps != args.max_steps:
        accelerator.print(f"--max-steps {args.max_steps} is not a multiple of grad_accum {grad_accum}: stopping "
                          f"after {max_steps} plan steps, the last optimizer step before it (runs stop and "
                          "checkpoint only between optimizer steps)")  # fmt: skip
    return Run(accelerator, cfg, output, so, root_url, root_meta, grad_accum, max_steps)


def _setup_position(run: Run, args: argparse.Namespace) -> None:
    """Where to start: the plan's beginning or the latest checkpoint's cursor; the plan to follow."""
    from train.checkpoint import Cursor, find_checkpoint, resume_elastic

    accelerator, world = run.accelerator, run.accelerator.num_processes
    checkpoint = find_checkpoint(run.output) if args.resume else None
    if checkpoint is not None:
        cursor = checkpoint.cursor
        if cursor.root_fingerprint != run.root_meta.fingerprint:
            raise UsageError(f"{run.output.name(checkpoint.rel)} was trained on another plan than --plan "
                             f"{redact(args.plan)}; pass that plan, or use a new --output-dir")  # fmt: skip
        accelerator.print(f"resuming from {run.output.name(checkpoint.rel)}: epoch {cursor.epoch} step "
                          f"{cursor.step} (trained on {cursor.world_size} processes, now {world})")  # fmt: skip
    else:
        if args.resume:
            accelerator.print(f"--resume: no checkpoint in {run.output.name()}; starting at the beginning of the plan")
        if run.root_meta.inputs.world_size != world:
            raise UsageError(f"--plan {redact(args.plan)} is for {run.root_meta.inputs.world_size} ranks but "
                             f"{world} processes are running: plan with --world-size {world}")  # fmt: skip
        cursor = Cursor.start(run.root_meta, run.root_url, world)
    with accelerator.main_process_first():  # rank 0 writes an elastic plan, the others then read it
        plan_url, plan_meta = resume_elastic(cursor, run.root_url, run.root_meta, run.output, world,
                                             run.storage_options, write=accelerator.is_main_process)  # fmt: skip
    run.checkpoint, run.plan_url, run.plan_meta = checkpoint, plan_url, plan_meta
    run.cursor = replace(cursor, world_size=world, plan_url=plan_url, plan_fingerprint=plan_meta.fingerprint)


def _setup_data(run: Run, args: argparse.Namespace):
    """This rank's steps (read epoch by epoch), the cache reader and the batch loader."""
    import torch

    from manifests.cache import CacheReader
    from train.data import BatchLoader, rank_steps

    accelerator, cursor, cfg = run.accelerator, run.cursor, run.cfg
    caches = [c.strip() for c in args.cache.split(",")]
    mix = run.plan_meta.inputs.mix
    wanted = list(mix.cache_fingerprints) if mix else [run.plan_meta.inputs.cache_fingerprint]
    if len(caches) != len(wanted):
        raise UsageError(f"--cache names {len(caches)} caches, the plan mixes {len(wanted)} manifests: pass one "
                         "cache per manifest, comma-separated, in the order `bucketeer plan` was given "
                         "them")  # fmt: skip
    readers = [CacheReader(c, run.storage_options) for c in caches]
    for d, (cache, reader, fp) in enumerate(zip(caches, readers, wanted)):
        if fp and fp != reader.meta["fingerprint"]:
            raise UsageError(f"the plan was made for a cache with fingerprint {fp[:12]}"
                             + (f" for dataset {d}" if mix else "") + f", but --cache {redact(cache)} has "
                             f"{reader.meta['fingerprint'][:12]}: pass that cache or re-plan")  # fmt: skip
    reader = readers[0]
    plan_so = run.storage_options if "://" in run.plan_url else None
    if not run.output.is_local and run.plan_url.startswith(run.output.url_of("")):
        plan_so = run.output.fs.storage_options  # an elastic plan written under a URL --output-dir
    limit = None if run.max_steps is None else max(run.max_steps - cursor.position, 0)
    steps = rank_steps(run.plan_url, accelerator.process_index, plan_so, start=(cursor.epoch, cursor.step),
                       limit=limit)  # fmt: skip
    counts = accelerator.gather(torch.tensor([len(steps)], device=accelerator.device)).tolist()
    if len(set(counts)) != 1:  # a plan invariant; checked because a violation would hang DDP
        raise UsageError(f"ranks have different step counts {counts}: run `bucketeer plan --check`")
    loader = BatchLoader(readers, steps, reader.meta["latent"], rank=accelerator.process_index,
                         prefetch=cfg.prefetch, read_threads=cfg.read_threads,
                         skip_bad_records=args.skip_bad_records, pin_memory=accelerator.device.type == "cuda",
                         log=lambda line: print(redact(line), file=sys.stderr, flush=True),
                         caption_dropout=cfg.caption_dropout, seed=cfg.seed,
                         posterior_sampling=cfg.posterior_sampling)  # fmt: skip
    return reader, steps, loader


def _setup_model(run: Run, reader):
    """The family's model (LoRA, EMA), optimizer and LR schedule, prepared (DeepSpeed filled from the plan
    first), and resumed."""
    import torch
    from diffusers.optimization import get_scheduler

    from train.backends import configure_deepspeed, plan_micro_batch
    from train.checkpoint import fetch_checkpoint
    from train.ema import EMA
    from train.lora import add_lora
    from train.recipes import recipe_for

    accelerator, cfg, root_meta = run.accelerator, run.cfg, run.root_meta
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    model = denoiser.model
    if cfg.lora_rank:
        add_lora(model, cfg, targets=denoiser.lora_targets, supported=denoiser.lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    if cfg.ema_decay and _sharded(accelerator):
        raise UsageError("config ema_decay: the EMA averages whole weights, which FSDP and DeepSpeed ZeRO-3 shard; "
                         "train with DDP or ZeRO-1/2, or without ema_decay")  # fmt: skip
    ema = EMA(model, cfg.ema_decay) if cfg.ema_decay else None
    if ema is not None:
        ema.register(accelerator)  # ema.safetensors in every checkpoint, read back by load_state
    # linear scaling by the ROOT plan's world size: an elastic resume keeps the global batch, so the lr too
    lr = cfg.lr * root_meta.inputs.world_size if cfg.scale_lr else cfg.lr
    optimizer = torch.optim.AdamW(trained, lr=lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)  # fmt: skip
    # the schedule's length: the run's epochs (inputs.epochs, however many are planned yet) of the root plan
    plan_steps = root_meta.steps_per_epoch * root_meta.inputs.epochs
    total_updates = plan_steps // run.grad_accum  # exact: steps per epoch are a multiple of grad_accum
    schedule = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.lr_schedule]
    lr_scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=cfg.warmup_steps,
                                 num_training_steps=total_updates)  # fmt: skip
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:  # no DataLoader is prepared: DeepSpeed's batch settings come from the plan
        configure_deepspeed(plugin, micro_batch=plan_micro_batch(run.plan_meta), grad_accum=run.grad_accum,
                            world_size=accelerator.num_processes, max_grad_norm=cfg.max_grad_norm)  # fmt: skip
    # only model/optimizer/schedule are prepared: the loader is already this rank's shard (see train.data)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    _KEEP_ALIVE.append(model)  # never deallocated before os._exit: see _KEEP_ALIVE
    if run.checkpoint is not None:
        local = fetch_checkpoint(accelerator, run.output, run.checkpoint)
        # accelerate 1.x reads optimizer, schedule and RNG files with torch.load(weights_only=True)
        accelerator.load_state(str(local), load_kwargs={"weights_only": True})
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            run.output.drop_local_copy(run.checkpoint.rel)
    accelerator.wait_for_everyone()
    return denoiser, ema, model, optimizer, lr_scheduler, plan_steps, total_updates


def train(args: argparse.Namespace) -> int:
    import torch

    from manifests.progress import Progress
    from train.checkpoint import save_checkpoint, truncate_records
    from train.metrics import MetricsFile, SampleRecorder, Window
    from train.model import step_generator
    from train.validation import Validator

    # ---- setup: accelerator, position, data, model -----------------------------------------------
    run = _setup_accelerator(args)
    accelerator, cfg, output = run.accelerator, run.cfg, run.output
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    say = accelerator.print
    _setup_position(run, args)
    reader, steps, loader = _setup_data(run, args)
    if args.record_samples and args.resume:
        with accelerator.main_process_first():
            if main:  # the steps a killed run took past its checkpoint are taken again below
                ranks = max(world, run.checkpoint.cursor.world_size if run.checkpoint else 1)
                truncate_records(args.record_samples, ranks, run.cursor)
    recorder = SampleRecorder(args.record_samples, rank)
    denoiser, ema, model, optimizer, lr_scheduler, plan_steps, total_updates = _setup_model(run, reader)
    unwrapped = accelerator.unwrap_model(model)
    # on every rank: a cache without validation prompts stops them all here, not one rank at the first validation
    validator = Validator(denoiser, reader, cfg) if cfg.validation_every else None
    cursor, max_steps = run.cursor, run.max_steps

    # ---- trackers ------------------------------------------------------------------------------
    accelerator.init_trackers("bucketeer", config=_flat(cfg.to_json(), world=world, plan_steps=plan_steps,
                                                        grad_accum=run.grad_accum))  # fmt: skip
    if main:
        output.download_file("metrics.jsonl")  # a resumed run appends to it
    metrics = MetricsFile(output.local("metrics.jsonl") if main else None)
    # Preemption (SIGTERM to this rank; torchrun / accelerate launch forward theirs to every rank): finish the
    # optimizer step under way, checkpoint, stop. torchrun SIGKILLs ranks 30 s after forwarding, so at real
    # sizes keep a checkpoint's save_state well under that.
    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    planned = run.plan_meta.epochs[-1].epoch + 1
    if planned < run.root_meta.inputs.epochs and max_steps is None:
        say(f"the plan holds epochs up to {planned - 1} of {run.root_meta.inputs.epochs}: this run stops "
            f"there; write more with `bucketeer plan MANIFEST --extend {redact(args.plan)}` and --resume")  # fmt: skip
    say(f"training {len(steps)} steps per rank on {world} process(es) from epoch {cursor.epoch} step {cursor.step}; "
        f"{reader.meta.get('family') or 'generic'} recipe, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"parameters ({sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M trained), "
        f"{total_updates} optimizer steps in the schedule")  # fmt: skip

    def checkpoint() -> None:
        save_checkpoint(accelerator, output, cursor, cfg.keep_checkpoints)
        if main:
            metrics.flush()
            output.upload_logs()

    def validate() -> None:  # the main process samples (with the EMA weights if any); the others wait
        if main:
            with ema.swapped_into(unwrapped) if ema is not None else contextlib.nullcontext():
                images = validator.sample(unwrapped, output.local("validation", f"step-{cursor.position:08d}"),
                                          accelerator.device)  # fmt: skip
            validator.log(accelerator, images, cursor.position)
            output.upload(f"validation/step-{cursor.position:08d}")
        accelerator.wait_for_everyone()

    # ---- the loop ------------------------------------------------------------------------------
    window, stop, saved_at = Window(), None, None
    updates = cursor.optimizer_steps
    progress = Progress("train", "steps", total=len(steps), unit="steps", enabled=main)  # a bar, or log lines
    model.train()
    batches = iter(loader)
    while stop is None:
        t0 = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        t_data = time.perf_counter()
        batch = batch.to(accelerator.device, non_blocking=True)
        with accelerator.accumulate(model):
            loss = denoiser.loss(model, batch, step_generator(cfg.seed, batch.epoch, batch.step, rank))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()  # a no-op between accumulation boundaries (accelerate)
            optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # also syncs the device, so the step time below is real
        if accelerator.sync_gradients:
            updates += 1
            if not accelerator.optimizer_step_was_skipped:
                lr_scheduler.step()
            if ema is not None:
                ema.step(unwrapped)
        recorder.write(batch.epoch, batch.step, batch.sample_ids, batch.skipped, batch.datasets)
        cursor = cursor.after(batch.epoch, batch.step, optimizer_steps=updates)
        window.add(loss_value, len(batch.sample_ids), int(batch.latent_positions * denoiser.tokens_per_position),
                   t_data - t0, time.perf_counter() - t0)  # fmt: skip
        shown = {}
        if cursor.position % cfg.log_every == 0:
            values = window.reduce(accelerator) | {"lr": lr_scheduler.get_last_lr()[0], "epoch": cursor.epoch}
            accelerator.log(values, step=cursor.position)
            metrics.write({"position": cursor.position, "step": batch.step, **values})
            shown = {"loss": f"{values['loss']:.4f}", "data_wait": f"{values['data_wait']:.1%}"}
        progress.update(1, **shown)
        if not accelerator.sync_gradients:
            continue  # checkpoints, validation and stops only between optimizer steps
        if validator is not None and cursor.position % cfg.validation_every == 0:
            validate()
        if not math.isfinite(loss_value) or stop_requested.is_set():
            accelerator.set_trigger()
        if accelerator.check_trigger():  # some rank asked to stop: every rank stops at this step
            finite = accelerator.gather(torch.tensor([float(math.isfinite(loss_value))], device=accelerator.device))
            stop = StopReason.PREEMPTED if bool(finite.all()) else StopReason.NON_FINITE_LOSS
        elif max_steps is not None and cursor.position >= max_steps:
            stop = StopReason.MAX_STEPS
        elif cursor.position % cfg.checkpoint_every == 0:
            checkpoint()
            saved_at = cursor.position
    if stop is None:
        finished = cursor.epoch >= run.root_meta.inputs.epochs - 1
        stop = StopReason.PLAN_FINISHED if finished or not len(steps) else StopReason.WINDOW_FINISHED
    progress.close()
    loader.close()
    recorder.close()

    # ---- the end -------------------------------------------------------------------------------
    # the stop's checkpoint (SIGTERM, --max-steps, the plan's end) unless this step has one already
    if stop.keeps_weights and saved_at != cursor.position and len(steps):
        assert cursor.position % run.grad_accum == 0, "stops, the plan's end and --max-steps are optimizer steps"
        checkpoint()
    skipped = int(accelerator.reduce(torch.tensor([loader.skipped], device=accelerator.device), "sum").item())
    if stop.keeps_weights:
        _save_weights(accelerator, model, output, "lora" if cfg.lora_rank else "model")
        if ema is not None:
            with ema.swapped_into(unwrapped):
                _save_weights(accelerator, model, output, "lora_ema" if cfg.lora_rank else "model_ema")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    metrics.close()
    if main:
        output.upload_logs()
    say(f"done: {stop.describe(max_steps=max_steps, position=cursor.position)}; position {cursor.position}, "
        f"epoch {cursor.epoch} step {cursor.step}, {updates} optimizer steps, {skipped} bad records skipped; "
        f"output in {output.name()}")  # fmt: skip
    return stop.exit_code


def _sharded(accelerator) -> bool:
    """Whether the backend shards parameters (FSDP, DeepSpeed ZeRO-3)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage") if plugin is not None else None
    return accelerator.distributed_type.name == "FSDP" or stage == 3


def _save_weights(accelerator, model, output, name: str) -> None:
    """The final weights as ``OUTPUT/<name>``: the whole model (``model``, ``model_ema``: ``from_pretrained``
    loads it) or the LoRA adapters (``lora``, ``lora_ema``: ``load_lora_adapter`` loads them)."""
    from train.backends import save_model
    from train.lora import save_lora

    if name.startswith("lora"):
        if accelerator.is_main_process:
            save_lora(accelerator.unwrap_model(model), output.local(name))
    else:
        save_model(accelerator, model, output.local(name))  # every rank: FSDP / ZeRO-3 gather shards here
    if accelerator.is_main_process:
        output.upload(name)


def _whole_updates(max_steps: int | None, grad_accum: int) -> int | None:
    """``--max-steps`` rounded down to whole optimizer steps. Raises ValueError when none is left."""
    if max_steps is None:
        return None
    if max_steps < grad_accum:
        raise UsageError(f"--max-steps {max_steps} is less than one optimizer step (grad_accum: {grad_accum} plan "
                         f"steps); pass --max-steps {grad_accum} or more")  # fmt: skip
    return max_steps - max_steps % grad_accum


def _no_head_options(storage_options: dict, *urls: str) -> dict:
    """Storage options under which s3fs reads a whole object with one GET and no HEAD.

    The plan and cache readers read small files whole with ``fs.cat_file`` / ``fs.cat`` (JSON,
    plan and index parquet). With ``max_concurrency`` > 1 (default 10), s3fs's ``_cat_file`` first
    HEADs the object for its size, only to decide whether to split it into concurrent ranged GETs
    of ``default_block_size`` (50 MiB); below that it then sends the same single GET. So at 1 the
    requests are the same minus the HEAD for every file under 50 MiB (index parts of MBs
    included); a file over 50 MiB (a merged index of several million samples) comes in one stream
    instead of up to 10 parallel ones, a one-off start-up cost. ``max_concurrency`` touches nothing
    else the trainer does: record reads are ``cat_ranges`` (explicit ranges, never a HEAD), and
    the trainer writes nothing to S3 (uploads are what it would slow). A user's own
    ``max_concurrency`` in ``--storage-options`` wins.
    """
    if any(u.startswith(("s3://", "s3a://")) for u in urls):
        return {"max_concurrency": 1, **storage_options}
    return storage_options


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _flat(config: dict, **extra) -> dict:
    """Scalars only: what TensorBoard's hparams accept."""
    out = {}
    for k, v in {**config, **extra}.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv if isinstance(vv, (int, float, str, bool)) else str(vv)
                        for kk, vv in v.items()})  # fmt: skip
        else:
            out[k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point: errors a user can fix (:class:`manifests.errors.BucketeerError`) are printed as one
    line (credentials redacted), exit code 2; any other exception is a bug and keeps its traceback."""
    args = parse_args(argv)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        return train(args)
    except Exception as e:
        error = user_error(e)
        if error is None:
            raise
        print(f"error: {redact(str(error))}", file=sys.stderr, flush=True)
        return 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # train() installs its own (checkpoint, then stop)


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # a bug: its traceback, then the same exit without teardown as below
        traceback.print_exc()
        code = 1
    # Everything is written and closed, and every rank has passed the final barrier. Tearing the
    # process group down can still hang, in destroy_process_group (pytorch/pytorch#75097) or in
    # interpreter finalization (gloo/autograd threads racing the GIL's teardown, #190489): seen
    # about once in 8-12 two-process runs here, "done" printed and the rank never exiting. So each
    # rank leaves without either; nothing collective happens after the barrier.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
