"""The training loop: :func:`run` sets a job up, takes one :meth:`Trainer.train_step` per batch, and ends.

    from train import job_from_args, run
    result = run(job_from_args(["--plan", PLAN, "--cache", CACHE]))   # what `python -m train` does

Reads top to bottom: :meth:`Trainer.setup` (the steps of :mod:`train.setup`: launch, position, data,
model; then validation, metrics and trackers), :meth:`Trainer.loop` (batches in plan order, one
``train_step`` each; checkpoints, validation and stops only between optimizer steps) and
:meth:`Trainer.finish` (the last checkpoint, the final weights, the ``done:`` line and the diffusers code
that loads the weights). Why the loop stopped is a :class:`StopReason`, which carries its consequences.
"""

from __future__ import annotations

import contextlib
import enum
import math
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from manifests.progress import Progress
from manifests.storage import redact
from train.checkpoint import save_checkpoint, save_weights, truncate_records
from train.job import TrainJob
from train.metrics import MetricsFile, SampleRecorder, Window
from train.model import step_generator
from train.output import how_to_load
from train.setup import Data, Launch, Model, Position, setup_data, setup_launch, setup_model, setup_position
from train.validation import Validator

__all__ = ["StopReason", "TrainResult", "Trainer", "run"]


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


@dataclass(frozen=True)
class TrainResult:
    """What a run did (on this rank; every rank takes the same steps and stops at the same one)."""

    stop: StopReason
    steps: int  # plan steps this run took
    position: int  # plan steps since the start of the root plan (a resumed run counts the earlier ones)
    epoch: int  # with step: the first plan step not yet run
    step: int
    optimizer_steps: int  # since the start of the root plan
    last_loss: float | None  # this rank's loss at its last step; None when no step was run
    skipped_records: int  # bad records dropped (--skip-bad-records), all ranks together
    output_dir: str
    seconds: float  # wall time of the run, setup included

    @property
    def exit_code(self) -> int:
        """The process's exit code: 0, or 1 when the loss diverged."""
        return self.stop.exit_code


def run(job: TrainJob) -> TrainResult:
    """Train as ``job`` says on this process's rank (all ranks of a launch call it together).

    SIGTERM, for the run's length, means: finish the optimizer step under way, checkpoint, stop; the
    previous handler is restored on return. Raises BucketeerError (UsageError, MissingError, ...) for
    problems a user can fix: a plan for another world size, a cache the plan was not made for, bad
    records, a bad config combination. Any other exception is a bug.
    """
    started = time.perf_counter()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        trainer = Trainer.setup(job)
        stop = trainer.loop()
        return trainer.finish(stop, started)
    finally:
        signal.signal(signal.SIGTERM, previous)


class Trainer:
    """One rank's run once set up: what it steps (model, optimizer, loader) and where it stands (cursor)."""

    def __init__(self, job: TrainJob, launch: Launch, position: Position, data: Data, model: Model, *,
                 validator: Validator | None, metrics: MetricsFile, recorder: SampleRecorder):  # fmt: skip
        self.job, self.launch, self.position, self.data, self.parts = job, launch, position, data, model
        self.accelerator, self.cfg, self.output = launch.accelerator, launch.cfg, launch.output
        self.model, self.denoiser, self.ema = model.model, model.denoiser, model.ema
        self.unwrapped = self.accelerator.unwrap_model(model.model)
        self.validator, self.metrics, self.recorder = validator, metrics, recorder
        self.cursor = position.cursor
        self.updates = self.cursor.optimizer_steps  # optimizer steps since the start of the root plan
        self.last_loss: float | None = None
        self.saved_at: int | None = None  # the position of the last checkpoint this run wrote
        self.stop_requested = threading.Event()

    @classmethod
    def setup(cls, job: TrainJob) -> "Trainer":
        """Launch, position, data, model (:mod:`train.setup`); then validation prompts, the sample record,
        metrics and trackers."""
        launch = setup_launch(job)
        accelerator, cfg, output = launch.accelerator, launch.cfg, launch.output
        world, main = accelerator.num_processes, accelerator.is_main_process
        position = setup_position(job, launch)
        data = setup_data(job, launch, position)
        if job.record_samples and job.resume:
            with accelerator.main_process_first():
                if main:  # the steps a killed run took past its checkpoint are taken again below
                    ranks = max(world, position.checkpoint.cursor.world_size if position.checkpoint else 1)
                    truncate_records(job.record_samples, ranks, position.cursor)
        recorder = SampleRecorder(job.record_samples, accelerator.process_index)
        model = setup_model(launch, position, data)
        # on every rank: a cache without validation prompts stops them all here, not one rank at the first validation
        validator = Validator(model.denoiser, data.reader, cfg) if cfg.validation_every else None
        accelerator.init_trackers("bucketeer", config=_flat(cfg.to_json(), world=world, plan_steps=model.plan_steps,
                                                            grad_accum=launch.grad_accum))  # fmt: skip
        if main:
            output.download_file("metrics.jsonl")  # a resumed run appends to it
        metrics = MetricsFile(output.local("metrics.jsonl") if main else None)
        return cls(job, launch, position, data, model, validator=validator, metrics=metrics, recorder=recorder)

    def train_step(self, batch: Any) -> float:
        """One plan step on ``batch`` (a :class:`train.data.Batch` on the device): forward, loss, backward;
        at an accumulation boundary also gradient clipping, the optimizer and schedule step and the EMA.

        The noise is a function of the batch's plan position (:func:`train.model.step_generator`), so a
        resumed run draws what an uninterrupted one would. Returns this rank's loss.
        """
        accelerator, cfg, model, optimizer = self.accelerator, self.cfg, self.model, self.parts.optimizer
        generator = step_generator(cfg.seed, batch.epoch, batch.step, accelerator.process_index)
        with accelerator.accumulate(model):
            loss = self.denoiser.loss(model, batch, generator)
            if self.parts.repa is not None:  # REPA: align block `depth` with the cached DINOv2 features
                loss = loss + self.parts.repa.loss(batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()  # a no-op between accumulation boundaries (accelerate)
            optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # also syncs the device, so the step time is real
        if accelerator.sync_gradients:
            self.updates += 1
            if not accelerator.optimizer_step_was_skipped:
                self.parts.lr_scheduler.step()
            if self.ema is not None:
                self.ema.step(self.unwrapped)
        return loss_value

    def loop(self) -> StopReason:
        """Every batch of this rank in plan order, one :meth:`train_step` each, until the steps run out or
        a stop (SIGTERM, ``--max-steps``, a non-finite loss); checkpoints, validation and stops only
        between optimizer steps."""
        accelerator, cfg = self.accelerator, self.cfg
        # Preemption (SIGTERM to this rank; torchrun / accelerate launch forward theirs to every rank): finish the
        # optimizer step under way, checkpoint, stop. torchrun SIGKILLs ranks 30 s after forwarding, so at real
        # sizes keep a checkpoint's save_state well under that.
        signal.signal(signal.SIGTERM, lambda *_: self.stop_requested.set())
        self._announce()
        window, stop, last_step = Window(), None, 0
        steps = self.data.steps
        progress = Progress("train", "steps", total=len(steps), unit="steps", enabled=accelerator.is_main_process)
        self.model.train()
        batches = iter(self.data.loader)
        while stop is None:
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            t_data = time.perf_counter()
            batch = batch.to(accelerator.device, non_blocking=True)
            self.last_loss = loss = self.train_step(batch)
            self.recorder.write(batch.epoch, batch.step, batch.sample_ids, batch.skipped, batch.datasets,
                                self.denoiser.step_record)  # fmt: skip
            self.cursor = self.cursor.after(batch.epoch, batch.step, optimizer_steps=self.updates)
            window.add(loss, len(batch.sample_ids), int(batch.latent_positions * self.denoiser.tokens_per_position),
                       t_data - t0, time.perf_counter() - t0)  # fmt: skip
            progress.update(1, **self._log(window, batch.step))
            last_step = batch.step
            if not accelerator.sync_gradients:
                continue  # checkpoints, validation and stops only between optimizer steps
            if self.validator is not None and self.cursor.position % cfg.validation_every == 0:
                self.validate()
            stop = self._stop(loss)
            if stop is None and self.cursor.position % cfg.checkpoint_every == 0:
                self.checkpoint()
                self.saved_at = self.cursor.position
        if window.values["steps"]:  # the steps since the last log point: the last step is always logged
            self._log(window, last_step, final=True)
        if stop is None:
            finished = self.cursor.epoch >= self.launch.epochs - 1
            stop = StopReason.PLAN_FINISHED if finished or not len(steps) else StopReason.WINDOW_FINISHED
        progress.close()
        self.data.loader.close()
        self.recorder.close()
        return stop

    def _stop(self, loss: float) -> StopReason | None:
        """Whether every rank stops at this optimizer step, and why (a collective when some rank asks)."""
        accelerator = self.accelerator
        if not math.isfinite(loss) or self.stop_requested.is_set():
            accelerator.set_trigger()
        if accelerator.check_trigger():  # some rank asked to stop: every rank stops at this step
            finite = accelerator.gather(torch.tensor([float(math.isfinite(loss))], device=accelerator.device))
            return StopReason.PREEMPTED if bool(finite.all()) else StopReason.NON_FINITE_LOSS
        if self.launch.max_steps is not None and self.cursor.position >= self.launch.max_steps:
            return StopReason.MAX_STEPS
        return None

    def _log(self, window: Any, step: int, *, final: bool = False) -> dict[str, str]:
        """At a log point (every ``log_every`` steps, and the ``final`` one): the window's values, gathered from
        every rank, to the trackers and metrics.jsonl; what the progress bar shows."""
        if self.cursor.position % self.cfg.log_every and not final:
            return {}
        values = window.reduce(self.accelerator) | {"lr": self.parts.lr_scheduler.get_last_lr()[0],
                                                    "epoch": self.cursor.epoch}  # fmt: skip
        self.accelerator.log(values, step=self.cursor.position)
        self.metrics.write({"position": self.cursor.position, "step": step, **values})
        return {"loss": f"{values['loss']:.4f}", "data_wait": f"{values['data_wait']:.1%}"}

    def _announce(self) -> None:
        """The run's first lines: how much of the plan it covers, the recipe, the model's size."""
        say, cursor, params = self.accelerator.print, self.cursor, list(self.model.parameters())
        if self.position.planned_epochs < self.launch.epochs and self.launch.max_steps is None:
            say(f"the plan holds epochs up to {self.position.planned_epochs - 1} of {self.launch.epochs}: this run "
                f"stops there; write more with `bucketeer plan MANIFEST --extend {redact(self.job.plan)}` and "
                "--resume")  # fmt: skip
        say(f"training {len(self.data.steps)} steps per rank on {self.accelerator.num_processes} process(es) from "
            f"epoch {cursor.epoch} step {cursor.step}; {self.data.family} recipe, "
            f"{sum(p.numel() for p in params) / 1e6:.2f}M parameters "
            f"({sum(p.numel() for p in params if p.requires_grad) / 1e6:.2f}M trained), "
            f"{self.parts.total_updates} optimizer steps in the schedule")  # fmt: skip

    def checkpoint(self) -> None:
        """A checkpoint at the cursor (every rank), then the metrics and logs uploaded."""
        save_checkpoint(self.accelerator, self.output, self.cursor, self.cfg.keep_checkpoints)
        if self.accelerator.is_main_process:
            self.metrics.flush()
            self.output.upload_logs()

    def validate(self) -> None:
        """The main process samples the validation images (with the EMA weights if any); the others wait."""
        accelerator, position = self.accelerator, self.cursor.position
        if accelerator.is_main_process:
            with self.ema.swapped_into(self.unwrapped) if self.ema is not None else contextlib.nullcontext():
                images = self.validator.sample(self.unwrapped, self.output.local("validation", f"step-{position:08d}"),
                                               accelerator.device)  # fmt: skip
            self.validator.log(accelerator, images, position)
            self.output.upload(f"validation/step-{position:08d}")
        accelerator.wait_for_everyone()

    def finish(self, stop: StopReason, started: float) -> TrainResult:
        """The stop's checkpoint and the final weights (unless the loss diverged), the ``done:`` line."""
        accelerator, cursor, output, lora = self.accelerator, self.cursor, self.output, self.parts.lora
        steps = len(self.data.steps)
        # the stop's checkpoint (SIGTERM, --max-steps, the plan's end) unless this step has one already
        if stop.keeps_weights and self.saved_at != cursor.position and steps:
            assert cursor.position % self.launch.grad_accum == 0, "stops, the plan's end, --max-steps: optimizer steps"
            self.checkpoint()
        local = torch.tensor([self.data.loader.skipped], device=accelerator.device)
        skipped = int(accelerator.reduce(local, "sum").item())
        if stop.keeps_weights:
            record = replace(lora, steps=cursor.position) if lora else None
            save_weights(accelerator, self.model, output, "lora" if lora else "model", record)
            if self.ema is not None:
                with self.ema.swapped_into(self.unwrapped):
                    save_weights(accelerator, self.model, output, "lora_ema" if lora else "model_ema", record)
        accelerator.wait_for_everyone()
        accelerator.end_training()
        self.metrics.close()
        if accelerator.is_main_process:
            output.upload_logs()
        accelerator.print(f"done: {stop.describe(max_steps=self.launch.max_steps, position=cursor.position)}; "
                          f"position {cursor.position}, epoch {cursor.epoch} step {cursor.step}, {self.updates} "
                          f"optimizer steps, {skipped} bad records skipped; output in {output.name()}")  # fmt: skip
        if stop.keeps_weights:  # the last lines: where the results are, and how to load them
            d = self.denoiser
            for line in how_to_load(output, model_class=type(self.unwrapped).__name__, pipeline=d.pipeline_class,
                                    component=d.component, base=d.source, lora=lora is not None,
                                    ema=self.ema is not None, lora_load=d.lora_load,
                                    more_lora_loads=d.more_lora_loads):  # fmt: skip
                accelerator.print(line)
        return TrainResult(stop, cursor.position - self.position.cursor.position, cursor.position, cursor.epoch,
                           cursor.step, self.updates, self.last_loss, skipped, self.job.output_dir,
                           time.perf_counter() - started)  # fmt: skip


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
