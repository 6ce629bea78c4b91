"""Writing plans: all epochs or a window of them (:func:`write_plan`), more of them later (:func:`extend_plan`).

A plan folder holds one parquet file per epoch, ``epoch-EEEEE.parquet``, with one row group per
rank (:mod:`manifests.plan.parts`), and ``_plan.json`` (:mod:`manifests.plan.meta`), written last,
which makes the folder valid. Objects grow with epochs, not epochs x ranks. ``_plan.json`` has one
small entry per epoch (steps, padding and drops per bucket, the file's sha256, size and footer
length), never one per rank. The schedule itself is :mod:`manifests.plan.schedule`, what is planned
(one manifest, or a mixture) :func:`manifests.plan.mix.plan_samples`; elastic resume is
:mod:`manifests.plan.resume`.

``inputs.epochs`` is the length of the run (what a trainer sizes its learning-rate schedule by).
``--window W`` writes only the first W epochs, and :func:`extend_plan` (``bucketeer plan MANIFEST
--extend PLAN``) writes more later; epoch ``e`` is a pure function of the inputs and ``e``, so a plan
extended to its last epoch has the same bytes, ``_plan.json`` included, as one planned at once. The
fingerprint hashes the inputs and the first epoch's file, so it does not change when epochs are
added: a run started on a window resumes on the extended plan.

    datasets = [DatasetSamples(ids, buckets, manifest_fingerprint=...)]   # one per manifest
    meta = write_plan(url, datasets, config, window=10)                   # a PlanMeta
    meta = extend_plan(url, datasets, epochs=20)
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from fractions import Fraction
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from manifests import __version__
from manifests.errors import UsageError
from manifests.plan.meta import (
    PLAN_FILE,
    PLAN_FORMAT_VERSION,
    PLAN_KIND,
    BucketInfo,
    EpochEntry,
    MixBucket,
    MixDataset,
    MixInputs,
    MixSummary,
    PlanCounts,
    PlanError,
    PlanInputs,
    PlanMeta,
    PlanSamplesCount,
    SelectionInputs,
    SelectionSummary,
    TokensPerStep,
    read_plan_meta,
)
from manifests.plan.mix import (
    DatasetSamples,
    MixedSamples,
    MixRule,
    PlanSamples,
    combined_fingerprint,
    plan_samples,
    schedule_epoch,
)
from manifests.plan.parts import EpochFile, encode_epoch, epoch_part
from manifests.plan.schedule import EpochSchedule, PlanConfig, bucket_batch_sizes, latent_tokens
from manifests.progress import Progress
from manifests.storage import call_storage, join, open_url, redact, write_bytes_atomic, write_json_atomic

__all__ = ["write_plan", "extend_plan", "epoch_entry", "with_epochs", "begin_plan", "commit_plan", "write_epochs"]


def epoch_entry(
    schedule: EpochSchedule, file: EpochFile, steps_total: int, tokens: np.ndarray, world_size: int
) -> EpochEntry:
    """``_plan.json``'s entry for one epoch. ``tokens``: (k,) latent tokens per sample of each bucket
    of ``schedule.names``."""
    names = schedule.names
    padded = {n: int(c) for n, c in zip(names, schedule.padded) if c}
    dropped = {n: int(c) for n, c in zip(names, schedule.dropped) if c}
    per_step = tokens[schedule.step_buckets] * (schedule.step_sizes // world_size)  # (S,) per rank
    return EpochEntry(
        epoch=schedule.epoch, first_step=schedule.first_step, steps=schedule.steps, steps_in_epoch=steps_total,
        padded=padded, dropped=dropped, padded_total=sum(padded.values()), dropped_total=sum(dropped.values()),
        # per rank and step: min, max and sum of latent tokens (the plan's tokens_per_step adds these up)
        tokens=(int(per_step.min()), int(per_step.max()), int(per_step.sum())) if len(per_step) else (0, 0, 0),
        sha256=file.sha256, bytes=len(file.data), footer_bytes=file.footer_bytes,
        # mixture plans: sample slots each dataset trains on in the whole epoch (after bucket leftovers)
        datasets=None if schedule.dataset_counts is None else tuple(int(c) for c in schedule.dataset_counts),
    )  # fmt: skip


def _totals(epochs: Sequence[EpochEntry]) -> PlanCounts:
    padded: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for e in epochs:
        for n, c in e.padded.items():
            padded[n] = padded.get(n, 0) + c
        for n, c in e.dropped.items():
            dropped[n] = dropped.get(n, 0) + c
    per_dataset = None
    if epochs and epochs[0].datasets is not None:  # mixture plans: slots per dataset over every epoch planned
        per_dataset = tuple(sum(e.datasets[d] for e in epochs) for d in range(len(epochs[0].datasets)))  # type: ignore[index]
    return PlanCounts(padded=sum(padded.values()), dropped=sum(dropped.values()),
                      padded_per_bucket=dict(sorted(padded.items())), dropped_per_bucket=dict(sorted(dropped.items())),
                      per_dataset=per_dataset)  # fmt: skip


def _tokens_per_step(epochs: Sequence[EpochEntry]) -> TokensPerStep:
    """Per-rank latent tokens per step over every epoch planned: min / mean / max."""
    steps = sum(e.steps for e in epochs)
    lo = min((e.tokens[0] for e in epochs if e.steps and e.tokens), default=None)
    hi = max((e.tokens[1] for e in epochs if e.steps and e.tokens), default=None)
    total = sum(e.tokens[2] for e in epochs if e.tokens)
    return TokensPerStep(min=lo, mean=round(total / max(steps, 1), 3), max=hi, per="rank")


def _fingerprint(meta: PlanMeta, first_epoch_sha256: str) -> str:
    """The plan's identity: its inputs and its first epoch's bytes (not the epochs planned so far)."""
    resumed_from = None if meta.resumed_from is None else meta.resumed_from.to_json()
    blob = json.dumps([PLAN_FORMAT_VERSION, meta.inputs.to_json(), resumed_from, first_epoch_sha256], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def with_epochs(meta: PlanMeta, epochs: Sequence[EpochEntry]) -> PlanMeta:
    """``meta`` holding ``epochs``: the per-epoch entries and the totals derived from them."""
    return replace(meta, epochs=tuple(epochs), counts=_totals(epochs), tokens_per_step=_tokens_per_step(epochs),
                   fingerprint=_fingerprint(meta, epochs[0].sha256))  # fmt: skip


def begin_plan(fs, root: str) -> None:
    """Invalidate a plan at ``root`` before writing a new one: a reader must never pair its _plan.json
    with new files."""
    meta = join(root, PLAN_FILE)
    call_storage(fs, "creating", root, lambda: fs.makedirs(root, exist_ok=True))
    if call_storage(fs, "checking", meta, lambda: fs.exists(meta)):
        call_storage(fs, "removing", meta, lambda: fs.rm(meta))


def commit_plan(fs, root: str, meta: PlanMeta) -> None:
    """Write ``_plan.json`` (the commit point), then remove plan files it does not name (older plans')."""
    write_json_atomic(fs, join(root, PLAN_FILE), meta.to_json())
    keep = {epoch_part(e.epoch) for e in meta.epochs}
    for path in call_storage(fs, "listing", root, lambda: fs.find(root)):
        rel = path[len(root) :].lstrip("/")
        if rel.startswith("epoch-") and rel.endswith(".parquet") and rel not in keep:
            call_storage(fs, "removing", path, lambda: fs.rm(path))


def write_epochs(
    fs,
    root: str,
    schedules: Iterable[EpochSchedule],
    world_size: int,
    entry: Callable[[EpochSchedule, EpochFile], EpochEntry],
    progress: Progress,
) -> list[EpochEntry]:
    """Encode and write each epoch (the upload of one overlaps the planning of the next); its entries.

    Memory: two epochs at most. Raises StorageError when storage refuses a write.
    """
    entries: list[EpochEntry] = []
    written = 0
    with ThreadPoolExecutor(1, thread_name_prefix="plan-upload") as pool:
        pending: Future | None = None
        for schedule in schedules:
            file = encode_epoch(schedule, world_size)
            if pending is not None:
                pending.result()
            pending = pool.submit(write_bytes_atomic, fs, join(root, file.path), file.data)
            entries.append(entry(schedule, file))
            written += len(file.data)
            progress.update(1, written=f"{written / 1e6:.1f} MB")
        if pending is not None:
            pending.result()
    progress.close()
    return entries


def _plan_epochs(fs, root: str, samples: PlanSamples, config: PlanConfig, epochs: range, job: str,
                 progress: bool) -> list[EpochEntry]:  # fmt: skip
    tokens = latent_tokens(samples.names, config.latent_factor, config.patch_size, config.temporal_factor)
    steps = schedule_epoch(samples, config, 0).steps if epochs.start else None
    reporter = Progress(job, "epochs", total=len(epochs), unit="epochs", enabled=progress)

    def entry(schedule: EpochSchedule, file: EpochFile) -> EpochEntry:
        nonlocal steps
        steps = schedule.steps if steps is None else steps
        assert schedule.steps == steps, "steps per epoch depend only on bucket sizes"
        return epoch_entry(schedule, file, steps, tokens, config.world_size)

    schedules = (schedule_epoch(samples, config, e) for e in epochs)
    return write_epochs(fs, root, schedules, config.world_size, entry, reporter)


def _recorded_inputs(datasets: Sequence[DatasetSamples], samples: PlanSamples) -> tuple[Any, Any, MixInputs | None]:
    """``(manifest fingerprint, cache fingerprint, inputs.mix)`` as ``_plan.json`` records them: a mixture's
    are the combined fingerprints of its datasets'."""
    manifests = [d.manifest_fingerprint for d in datasets]
    caches = [d.cache_fingerprint for d in datasets]
    if not isinstance(samples, MixedSamples):
        return manifests[0], caches[0], None
    mix = MixInputs(kind=samples.rule.kind, values=tuple(samples.rule.to_json()["values"]),  # type: ignore[arg-type]
                    manifest_fingerprints=tuple(manifests), cache_fingerprints=tuple(caches))  # fmt: skip
    return combined_fingerprint(manifests), combined_fingerprint(caches), mix


def write_plan(
    url: str,
    datasets: Sequence[DatasetSamples],
    config: PlanConfig,
    *,
    rule: MixRule | None = None,
    storage_options: Mapping[str, Any] | None = None,
    window: int | None = None,
    progress: bool = False,
    selection: tuple[SelectionInputs, SelectionSummary] | None = None,
) -> PlanMeta:
    """Plan ``datasets`` (one per manifest; a mixture by ``rule`` when there are several, see
    :func:`manifests.plan.mix.plan_samples`) and commit the plan at ``url``; returns its ``_plan.json``.

    ``window``: write only epochs ``0..window-1`` of ``config.epochs`` (default: all); the rest
    later with :func:`extend_plan`. Files are written epoch by epoch (memory: two epochs),
    ``_plan.json`` last. The datasets' URLs are recorded redacted, outside the fingerprint.
    ``progress``: report epochs written (on stderr). ``selection``: the records of the ``--where`` /
    ``--weight-by`` that made ``datasets`` (:mod:`manifests.plan.selection`). Raises UsageError for bad inputs (see
    :class:`PlanConfig`, :func:`plan_samples`, :func:`plan_epoch`) before anything is written.
    """
    samples = plan_samples(datasets, rule)
    config = config.for_buckets(samples.names)  # a video plan records its temporal factor, an image plan none
    if window is not None and window < 1:
        raise UsageError(f"--window must be >= 1 (epochs to write now), got {window}")
    per_rank = bucket_batch_sizes(samples.names, config)  # raises before anything is written
    tokens = latent_tokens(samples.names, config.latent_factor, config.patch_size, config.temporal_factor)
    first = schedule_epoch(samples, config, 0)  # raises "nothing to train" before anything is written
    manifest_fp, cache_fp, mix_inputs = _recorded_inputs(datasets, samples)
    mix = isinstance(samples, MixedSamples)
    one = datasets[0]
    sources = {} if mix or one.manifest is None else {"manifest": redact(one.manifest),
                                                      "cache": redact(one.cache) if one.cache else None}  # fmt: skip
    counted = dict(not_in_cache=sum(int(d.not_in_cache) for d in datasets), stale=sum(int(d.stale) for d in datasets))
    meta = PlanMeta(
        kind=PLAN_KIND, format_version=PLAN_FORMAT_VERSION, tool_version=__version__,
        mode="packing" if config.packing else "fixed",
        inputs=PlanInputs.of(config, manifest_fp, cache_fp, mix_inputs, selection[0] if selection else None),
        sources=sources, selection=selection[1] if selection else None,
        layout=epoch_part(0).replace("00000", "{epoch:05d}") + ", one row group per rank",
        buckets={n: BucketInfo(samples=int(c), batch_size=int(b), latent_tokens=int(t))
                 for n, c, b, t in zip(samples.names, samples.counts, per_rank, tokens)},
        samples=PlanSamplesCount(planned=int(len(samples.ids)),
                                 per_epoch=int(samples.per_epoch.sum()) if mix else None, **counted),
        global_batch=None if config.packing else config.world_size * config.batch_size,
        steps_per_epoch=first.steps, resumed_from=None,
        columns=_mix_columns(samples) if mix else None, mix=_mix_summary(samples, datasets) if mix else None,
        epochs=(), counts=None, fingerprint="",  # with_epochs sets them
    )  # fmt: skip
    fs, root = open_url(url, dict(storage_options or {}))
    begin_plan(fs, root)
    epochs = range(min(window or config.epochs, config.epochs))
    meta = with_epochs(meta, _plan_epochs(fs, root, samples, config, epochs, "plan", progress))
    commit_plan(fs, root, meta)
    return meta


def _mix_columns(mix: MixedSamples) -> tuple[str, ...]:
    """The plan columns a mixture adds: ``dataset`` (several datasets), ``caption_index`` (caption lists)."""
    return tuple((["dataset"] if mix.strata.shape[1] > 1 else []) +
                 (["caption_index"] if mix.caption_counts is not None else []))  # fmt: skip


def _mix_summary(mix: MixedSamples, datasets: Sequence[DatasetSamples]) -> MixSummary:
    """``_plan.json["mix"]``: the rule, and per dataset its samples, value, slots per epoch, per bucket."""
    out = []
    for d, info in enumerate(datasets):
        n, k = int(mix.sizes[d]), int(mix.per_epoch[d])
        value = _decimal(mix.rule.values[d])
        out.append(MixDataset(
            manifest=redact(info.manifest) if info.manifest else None, cache=redact(info.cache) if info.cache else None,
            samples=n, weight=value if mix.rule.kind == "weights" else None,
            repeat=value if mix.rule.kind == "repeats" else None, per_epoch=k, times=round(k / n, 4),
            share=round(float(mix.rule.values[d] / sum(mix.rule.values)), 6) if mix.rule.kind == "weights" else None,
            not_in_cache=int(info.not_in_cache), stale=int(info.stale),
            buckets={name: MixBucket(samples=int(mix.strata[b, d]), per_epoch=int(mix.slots[b, d]))
                     for b, name in enumerate(mix.names) if mix.strata[b, d]},
        ))  # fmt: skip
    rule = ("repeats: k = round(r * n), halves up" if mix.rule.kind == "repeats" else
            "weights: epoch = sum of samples, k by largest remainder")  # fmt: skip
    return MixSummary(rule=rule + "; per bucket by largest remainder; see manifests/plan/mix.py", datasets=tuple(out))


def _decimal(value: Fraction) -> str:
    """``value`` as the user wrote it when it is a short decimal (0.1), else as a fraction (1/3)."""
    text = f"{float(value):.10g}"
    return text if Fraction(text) == value else str(value)


def extend_plan(
    url: str,
    datasets: Sequence[DatasetSamples],
    *,
    epochs: int | None = None,
    window: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
    selection: SelectionInputs | None = None,
) -> PlanMeta:
    """Write more epochs of the plan at ``url`` (made with ``window``) and commit; returns ``_plan.json``.

    ``epochs``: hold epochs ``0..epochs-1`` afterwards; else ``window`` more; else all of the run's.
    ``datasets`` must be the ones the plan was made from (same manifest and cache fingerprints, same
    samples per bucket); a mixture's rule is the one it recorded. The plan stays valid while this runs:
    new files are written first, the new ``_plan.json`` last. Raises PlanError for a plan that cannot be
    extended or other inputs (``selection``: the selection's inputs now, which must be the recorded ones).
    """
    meta = read_plan_meta(url, storage_options)
    inputs = meta.inputs
    where = redact(url)
    if meta.resumed_from is not None:
        raise PlanError(f"{where} is a resumed plan; extend the plan it was resumed from, then resume again")
    samples = plan_samples(datasets, None if inputs.mix is None else inputs.mix.rule)
    if isinstance(samples, MixedSamples) != (inputs.mix is not None):
        raise PlanError(f"{where} is {'a mixture' if inputs.mix else 'a one-manifest'} plan: extend it with "
                        "the manifest(s), --cache and rule it was made from")  # fmt: skip
    manifest_fingerprint, cache_fingerprint, _ = _recorded_inputs(datasets, samples)
    if inputs.manifest_fingerprint != manifest_fingerprint:
        raise PlanError(f"{where} was made from manifest {(inputs.manifest_fingerprint or '')[:16]}…, not this one "
                        f"({(manifest_fingerprint or '')[:16]}…): extend it with the manifest it was made "
                        "from")  # fmt: skip
    if inputs.cache_fingerprint != cache_fingerprint:
        raise PlanError(f"{where} was made with --cache of fingerprint {inputs.cache_fingerprint}, not "
                        f"{cache_fingerprint}: pass the same --cache as when it was made")  # fmt: skip
    if inputs.selection != selection:
        raise PlanError(f"{where} was made with selection {_shown(inputs.selection)}, not {_shown(selection)}: "
                        "extend it with the --annotations it was made with (the --where is the plan's)")  # fmt: skip
    if dict(zip(samples.names, samples.counts.tolist())) != {n: b.samples for n, b in meta.buckets.items()}:
        raise PlanError(f"{where}: the samples per bucket differ from the ones planned (the cache changed since?); "
                        "re-run `bucketeer plan` without --extend")  # fmt: skip
    config = inputs.config
    held = len(meta.epochs)
    target = epochs if epochs is not None else (held + window if window is not None else config.epochs)
    if not held < target <= config.epochs:
        raise PlanError(f"{where} holds epochs 0..{held - 1} of a {config.epochs}-epoch run: --epochs must be "
                        f"between {held + 1} and {config.epochs} (got {target})")  # fmt: skip
    fs, root = open_url(url, dict(storage_options or {}))
    added = _plan_epochs(fs, root, samples, config, range(held, target), "plan --extend", progress)
    new = with_epochs(meta, [*meta.epochs, *added])
    assert new.fingerprint == meta.fingerprint, "extending keeps the plan's identity"
    commit_plan(fs, root, new)
    return new


def _shown(selection: SelectionInputs | None) -> str:
    return "none" if selection is None else json.dumps(selection.to_json(), sort_keys=True)
