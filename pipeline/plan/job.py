"""``bucketeer plan`` as a job: :class:`PlanJob` (plan, ``check``, ``extend`` or ``resume``) and ``run(job)``.

    from pipeline import PlanJob, run
    result = run(PlanJob(manifests=("manifest/",), out="plan/", world_size=8, batch_size=4, epochs=10))
    result = run(PlanJob(check="plan/", manifests=("manifest/",)))         # result.exit_code 1 on a violation
    result = run(PlanJob(manifests=("manifest/",), extend="plan/", epochs=20))
    result = run(PlanJob(resume="plan/", at=(3, 1200), world_size=4, out="plan2/"))
    result = run(PlanJob(manifests=("manifest/",), out="plan/", world_size=8, batch_size=4,
                         annotations=("scores/", "dups/"), where="aesthetic > 5 AND NOT duplicate",
                         weight_by="aesthetic"))

The planning is :mod:`manifests.plan`; this module loads the inputs, runs the mode and prints what the
command prints.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from manifests.lock import writer_lock
from manifests.errors import UsageError
from manifests.throttles import counting_throttles
from manifests.plan import PlanConfig, PlanMeta
from manifests.plan.mix import MixRule
from manifests.plan.schedule import parse_shuffle
from manifests.storage import redact
from pipeline.plan.inputs import cache_inputs, load_datasets, read_manifests
from pipeline.plan.summary import print_summary

__all__ = ["PlanJob", "PlanResult", "run"]

# the planning options: --extend takes them from the plan, and refuses one given with another value
_INPUTS = {"world_size": "--world-size", "batch_size": "--batch-size", "seed": "--seed", "leftover": "--leftover",
           "grad_accum": "--grad-accum", "max_tokens": "--max-tokens", "latent_factor": "--latent-factor",
           "patch_size": "--patch-size", "temporal_factor": "--temporal-factor", "shuffle": "--shuffle"}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PlanJob:
    """One ``bucketeer plan`` run. The mode: ``check`` (re-check the plan there against ``manifests``),
    ``extend`` (write more epochs of the plan there), ``resume`` (re-cut the plan there from ``at`` =
    (epoch, step) for ``world_size`` ranks into ``out``), else plan ``manifests`` into ``out``.

    ``cache``: none, or one cache folder per manifest. ``annotations``, ``where``, ``weight_by``: the selection
    (:mod:`manifests.select`); ``check`` and ``extend`` take the plan's, from the annotations given or else the
    ones it recorded. Options left None take the plan's value
    (``extend``) or the defaults of :class:`manifests.plan.PlanConfig`. Raises UsageError naming the
    option for a missing or bad one.
    """

    manifests: tuple[str, ...] = ()
    out: str | None = None
    world_size: int | None = None
    batch_size: int | None = None
    seed: int | None = None
    epochs: int | None = None
    window: int | None = None
    leftover: str | None = None
    grad_accum: int | None = None
    cache: tuple[str, ...] = ()
    repeats: str | None = None
    weights: str | None = None
    max_tokens: int | None = None
    latent_factor: int | None = None
    patch_size: int | None = None
    temporal_factor: int | None = None  # video manifests: frames per latent frame (default: the cache's, else 4)
    shuffle: str | None = None  # "full" (default) or "window[:SIZE]"
    check: str | None = None
    extend: str | None = None
    resume: str | None = None
    at: tuple[int, int] | None = None
    annotations: tuple[str, ...] = ()
    where: str | None = None
    weight_by: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    json: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "manifests", tuple(self.manifests))
        object.__setattr__(self, "cache", tuple(self.cache))
        object.__setattr__(self, "annotations", tuple(self.annotations))
        if self.shuffle is not None:
            object.__setattr__(self, "shuffle", parse_shuffle(self.shuffle))
        if (self.check or self.extend or self.resume) and (self.where is not None or self.weight_by is not None):
            raise UsageError("--where / --weight-by make a new plan; --check and --extend take the plan's "
                             "(give its --annotations), --resume needs none")  # fmt: skip
        if self.annotations and not (self.check or self.extend) and self.where is None and self.weight_by is None:
            raise UsageError("--annotations is read by --where / --weight-by: give one of them (e.g. --where "
                             "\"aesthetic > 5\")")  # fmt: skip
        if self.check:
            self.caches()
            return
        if not self.out and not self.extend:
            raise UsageError("--out PLAN is required (the plan folder to write)")
        if not self.extend and self.world_size is None:
            raise UsageError("--world-size is required (number of training processes)")
        if self.resume and not self.extend:
            if self.at is None:
                raise UsageError("--at must be EPOCH:STEP, e.g. 3:1200, got None")
            return
        if not self.extend:
            self.config()  # raises for a bad planning option before anything is read
        if not self.manifests:
            raise UsageError("MANIFEST is required: bucketeer plan MANIFEST [MANIFEST ...] --out PLAN … (or --extend "
                             "PLAN)")  # fmt: skip
        if self.weights and self.repeats:
            raise UsageError("give --weights or --repeats, not both")
        self.caches()

    @property
    def mode(self) -> str:
        """``check``, ``extend``, ``resume`` or ``plan``."""
        return "check" if self.check else "extend" if self.extend else "resume" if self.resume else "plan"

    def config(self) -> PlanConfig:
        """The planning options, defaults filled in. Raises UsageError for a value out of range."""
        keys = ("seed", "epochs", "leftover", "grad_accum", "latent_factor", "patch_size", "temporal_factor",
                "shuffle")
        given = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        return PlanConfig(world_size=self.world_size, batch_size=self.batch_size, max_tokens=self.max_tokens,
                          **given)  # type: ignore[arg-type]

    def caches(self) -> list[str | None]:
        """One cache per manifest (None each without ``cache``). Raises UsageError for another count."""
        manifests = len(self.manifests) or 1
        if not self.cache:
            return [None] * manifests
        if len(self.cache) != manifests:
            raise UsageError(f"--cache names {len(self.cache)} caches for {manifests} manifests: give one per "
                             "manifest, comma-separated, in the same order")  # fmt: skip
        return list(self.cache)

    def rule(self) -> MixRule | None:
        """``--weights`` or ``--repeats`` parsed (None when neither is given)."""
        if not (self.weights or self.repeats):
            return None
        kind = "weights" if self.weights else "repeats"
        return MixRule.parse(kind, self.weights or self.repeats or "", len(self.manifests))


@dataclass(frozen=True)
class PlanResult:
    """What a plan run did: the plan (``url``, its ``meta`` and fingerprint), the counts the summary
    prints, the violations ``check`` found, and the command's exit code (1 when there are any)."""

    url: str
    fingerprint: str
    seconds: float
    meta: PlanMeta
    planned: int
    padded: int
    dropped: int
    steps_per_epoch: int
    epochs_held: int
    violations: tuple[str, ...] = ()
    throttled: int = 0  # storage answers that asked for fewer requests (never in _plan.json: same inputs, same bytes)

    @property
    def exit_code(self) -> int:
        return 1 if self.violations else 0


def run(job: PlanJob) -> PlanResult:
    """Run ``job`` as ``bucketeer plan`` does: print the summary (or ``_plan.json`` with ``json``, or the
    check's violations) and return the result. Raises UsageError / PlanError for what the user must fix."""
    start = time.perf_counter()
    if job.check:
        return _check(job, start)
    url = job.extend or job.out or ""
    with writer_lock(url, job.storage_options, "plan"), counting_throttles() as throttles:  # one writer per plan
        meta = _extend(job) if job.extend else _resume(job) if job.resume else _plan(job)
    if job.json:
        print(json.dumps(meta.to_json(), indent=2, sort_keys=True))
    else:
        print_summary(meta)
        if throttles.total:
            print(f"storage:  throttled {throttles.total:,} requests (retried)")
    return replace(_result(url, meta, start), throttled=throttles.total)


def _result(url: str, meta: PlanMeta, start: float, violations: tuple[str, ...] = ()) -> PlanResult:
    counts = meta.counts
    return PlanResult(url=url, fingerprint=meta.fingerprint, seconds=time.perf_counter() - start, meta=meta,
                      planned=meta.samples.planned, padded=counts.padded if counts else 0,
                      dropped=counts.dropped if counts else 0, steps_per_epoch=meta.steps_per_epoch,
                      epochs_held=len(meta.epochs), violations=violations)  # fmt: skip


def _check(job: PlanJob, start: float) -> PlanResult:
    from manifests.manifest import read_manifest
    from manifests.plan import read_plan_meta
    from manifests.plan.check import check_plan

    options = job.storage_options
    manifests = [read_manifest(m, dict(options)) for m in job.manifests]
    meta = read_plan_meta(job.check or "", options)
    evaluation = _recorded_selection(job, meta, manifests) if manifests else None
    available, cache_fps = [], []
    for d, cache in enumerate(job.caches()):
        ids, cache_meta, _ = cache_inputs(cache, options, manifests[d] if manifests else None) if cache else (
            None, None, 0)
        available.append(ids)
        cache_fps.append(cache_meta.fingerprint if cache_meta else None)
    problems = check_plan(job.check, options, manifests=manifests, available_ids=available,  # type: ignore[arg-type]
                          cache_fingerprints=cache_fps, progress=job.progress,
                          selections=evaluation.selections if evaluation else ())  # fmt: skip
    if evaluation is not None:
        from manifests.plan.selection import fingerprint_problems

        problems = fingerprint_problems(meta, evaluation) + problems
    where = redact(job.check or "")
    for p in problems:
        print(f"violation: {redact(p)}")
    if problems:
        print(f"{where}: {len(problems)} violation(s)", file=sys.stderr)
    else:
        print(f"{where}: ok" + ("" if manifests else " (no MANIFEST given: membership not checked)"))
    return _result(job.check or "", read_plan_meta(job.check or "", options), start, tuple(problems))


def _resume(job: PlanJob) -> PlanMeta:
    from manifests.plan import resume_plan

    assert job.resume and job.out and job.at and job.world_size is not None
    epoch, step = job.at
    return resume_plan(job.resume, job.out, epoch=epoch, step=step, world_size=job.world_size,
                       batch_size=job.batch_size, storage_options=job.storage_options,
                       out_storage_options=job.storage_options, progress=job.progress)  # fmt: skip


def _extend(job: PlanJob) -> PlanMeta:
    from manifests.plan import extend_plan, read_plan_meta

    assert job.extend
    plan_meta = read_plan_meta(job.extend, job.storage_options)
    inputs = plan_meta.inputs
    for key, option in _INPUTS.items():
        given, planned = getattr(job, key), getattr(inputs.config, key)
        if given is not None and given != planned:
            raise UsageError(f"{option} {given} differs from the plan's {planned}: --extend writes more "
                             f"epochs of {redact(job.extend)} as it was made; leave {option} out")  # fmt: skip
    if inputs.mix is not None and (job.weights or job.repeats):
        raise UsageError("--extend takes the mixture's --weights/--repeats from the plan; leave them out")
    manifests = read_manifests(job.manifests, job.storage_options)
    evaluation = _recorded_selection(job, plan_meta, manifests)
    datasets = load_datasets(manifests, job.caches(), job.storage_options,
                             evaluation.selections if evaluation else ())  # fmt: skip
    if inputs.mix is None and (job.rule() or len(datasets) > 1 or datasets[0].caption_counts is not None or
                               datasets[0].weights is not None):  # fmt: skip
        raise UsageError(f"{redact(job.extend)} is a one-manifest plan: extend it with its one manifest, "
                         "without --weights/--repeats")  # fmt: skip
    return extend_plan(job.extend, datasets, epochs=job.epochs, window=job.window,
                       storage_options=job.storage_options, progress=job.progress,
                       selection=_records(evaluation)[0] if evaluation else None)  # fmt: skip


def _plan(job: PlanJob) -> PlanMeta:
    from manifests.plan import write_plan

    assert job.out
    manifests = read_manifests(job.manifests, job.storage_options)
    config = replace(job.config(), temporal_factor=_temporal_factor(job, manifests))
    evaluation = None
    if job.where is not None or job.weight_by is not None:
        from manifests.select import evaluate

        evaluation = evaluate(manifests, job.annotations, job.where, job.weight_by, job.storage_options)
    datasets = load_datasets(manifests, job.caches(), job.storage_options,
                             evaluation.selections if evaluation else ())  # fmt: skip
    return write_plan(job.out, datasets, config, rule=job.rule(), storage_options=job.storage_options,
                      window=job.window, progress=job.progress,
                      selection=_records(evaluation) if evaluation else None)  # fmt: skip


def _temporal_factor(job: PlanJob, manifests: list[Any]) -> int | None:
    """Frames per latent frame of a plan of video manifests: the caches' (``_cache.json`` latent.temporal_factor),
    else ``--temporal-factor``, else DEFAULT_TEMPORAL_FACTOR; None for image manifests only. Raises UsageError
    for ``--temporal-factor`` with image manifests only, or one that differs from a cache's."""
    if all(m.meta.frame_ladder is None for m in manifests):
        if job.temporal_factor is not None:
            raise UsageError("--temporal-factor counts the latent frames of video buckets (WxHxF): these manifests "
                             "hold none (scan with --frames), leave it out")  # fmt: skip
        return None
    from manifests.cache import read_cache_meta
    from manifests.frames import DEFAULT_TEMPORAL_FACTOR

    recorded: dict[int, str] = {}
    for cache in job.caches():
        latent = read_cache_meta(cache, dict(job.storage_options)).latent if cache else None
        if latent is not None and latent.temporal_factor is not None:
            recorded.setdefault(latent.temporal_factor, cache)  # type: ignore[arg-type]
    if len(recorded) > 1:
        raise UsageError("the caches were embedded with temporal factors " + ", ".join(
            f"{t} ({redact(c)})" for t, c in recorded.items()) + ": plan caches of one video VAE together")
    if recorded:
        (factor, cache), = recorded.items()
        if job.temporal_factor is not None and job.temporal_factor != factor:
            raise UsageError(f"--temporal-factor {job.temporal_factor} differs from the {factor} of the VAE that "
                             f"embedded {redact(cache)}: leave it out")  # fmt: skip
        return factor
    return job.temporal_factor or DEFAULT_TEMPORAL_FACTOR


def _records(evaluation: Any) -> Any:
    from manifests.plan.selection import selection_records

    return selection_records(evaluation)


def _recorded_selection(job: PlanJob, meta: PlanMeta, manifests: list[Any]) -> Any:
    """The plan's selection evaluated again over ``manifests`` (None for a plan without one): its expressions,
    over ``job.annotations`` or else the annotations folders it recorded."""
    recorded = meta.inputs.selection
    if recorded is None:
        if job.annotations:
            raise UsageError("the plan was made without --where / --weight-by: leave --annotations out")
        return None
    from manifests.select import evaluate

    urls = job.annotations or (tuple(a.url for a in meta.selection.annotations) if meta.selection else ())
    return evaluate(manifests, urls, recorded.where, recorded.weight_by, job.storage_options)
