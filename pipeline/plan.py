"""Write per-rank shard plans: bucketed batches, disjoint ranks, equal steps, deterministic, resumable.

    bucketeer plan MANIFEST --out PLAN --world-size 8 --batch-size 4 --seed 0 --epochs 10
    bucketeer plan MANIFEST --out PLAN --world-size 8 --max-tokens 16384 --cache CACHE   # packing mode
    bucketeer plan MANIFEST --out PLAN --world-size 1024 --batch-size 4 --epochs 100 --window 10  # 10 now
    bucketeer plan MANIFEST --extend PLAN --epochs 20         # write epochs 10..19 of that plan
    bucketeer plan --check PLAN MANIFEST                      # re-check every invariant (exit 1 if violated)
    bucketeer plan --resume PLAN --at 3:1200 --world-size 4 --out PLAN2   # elastic resume
    bucketeer plan M1 M2 M3 --out PLAN --weights 0.6,0.3,0.1 --cache C1,C2,C3 --world-size 8 --batch-size 4
    bucketeer plan M1 M2 --out PLAN --repeats 1,2.5 ...       # a mixture: see manifests/plan/mix.py

A mixture (several manifests, or ``--weights``/``--repeats``, or a manifest with caption lists)
counts samples per epoch by this rule: ``--repeats r``: ``round(r * n)`` samples of a dataset of
``n`` (halves up); ``--weights w`` (normalised): an epoch holds as many samples as all datasets
together, split by largest remainder. Each dataset's count is spread over its buckets by largest
remainder; within an epoch a sample repeats only once every sample of its dataset and bucket has
been drawn as often (fresh draw per epoch). Bucket leftovers are then dropped or padded as usual.
``--cache C1,C2,...`` gives one cache per manifest, in the same order.

``python -m pipeline.plan`` takes the same options. The planning is pure numpy
(:mod:`manifests.plan.schedule`); this module reads the inputs and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa

from manifests.errors import UsageError
from manifests.plan.mix import RULE_HELP
from manifests.plan.schedule import LEFTOVER_POLICIES, PlanConfig, cached_mask
from manifests.storage import parse_storage_options, redact


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", nargs="*", help="manifest folder(s) (local path or URL); several make a mixture")
    parser.add_argument("--out", help="plan folder to write (local path or URL)")
    parser.add_argument("--world-size", type=int, help="number of training processes (ranks)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="samples per rank per step (in packing mode: an optional cap)"
    )
    parser.add_argument("--seed", type=int, default=None,
                        help="shuffle seed; each epoch is seeded by (seed, epoch) (default 0)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of the run (default 1); with --extend: epochs the plan holds afterwards")
    parser.add_argument("--window", type=int, default=None,
                        help="write only this many epochs now (default: all), the rest later with --extend")
    parser.add_argument(
        "--leftover",
        choices=LEFTOVER_POLICIES,
        default=None,
        help="a bucket's last partial global batch: drop it (no repeats) or pad it with repeats "
        "from the same bucket (every sample seen); default drop",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help="plan steps per optimizer step (default 1); steps per epoch become a multiple of it (whole "
        "global batches dropped or repeated), and the trainer accumulates gradients over it",
    )
    parser.add_argument("--cache", default=None, help="plan only samples with a good record in this cache folder; "
                        "for several manifests one cache each, comma-separated, in the manifests' order")
    m = parser.add_argument_group("mixtures (several manifests)", description=RULE_HELP)
    m.add_argument("--repeats", default=None, metavar="R1,R2,...",
                   help="samples per epoch of each manifest = round(r * its samples), halves up; r may be "
                   "fractional (0.5: half of it each epoch, 3: each sample 3 times)")
    m.add_argument("--weights", default=None, metavar="W1,W2,...",
                   help="share of each manifest in an epoch of as many samples as all manifests hold "
                   "together (normalised; counts by largest remainder)")  # fmt: skip
    g = parser.add_argument_group("packing mode")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="latent tokens per rank per step; per-bucket batch = max_tokens // tokens(bucket)",
    )
    g.add_argument("--latent-factor", type=int, default=None, help="VAE downsampling factor (default 8)")
    g.add_argument("--patch-size", type=int, default=None, help="transformer patch size on latents (default 2)")
    c = parser.add_argument_group("check, extend and resume")
    c.add_argument(
        "--check",
        metavar="PLAN",
        default=None,
        help="re-check every invariant of PLAN against MANIFEST (and --cache); exit 1 on a violation",
    )
    c.add_argument(
        "--extend",
        metavar="PLAN",
        default=None,
        help="write more epochs of PLAN (made with --window) from MANIFEST (and --cache): up to --epochs, "
        "--window more, or all",
    )
    c.add_argument(
        "--resume",
        metavar="PLAN",
        default=None,
        help="write the rest of PLAN from --at for --world-size ranks into --out (same global batch)",
    )
    c.add_argument(
        "--at",
        metavar="EPOCH:STEP",
        default=None,
        help="with --resume: the position reached (STEP = first step of EPOCH not yet run)",
    )
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--json", action="store_true", help="print _plan.json instead of the summary")


def _cache_inputs(url: str, options: dict[str, Any], manifest: Any = None) -> tuple[np.ndarray, dict[str, Any], int]:
    """``(ids with a good record, cache meta, stale count)``; with a manifest only fresh records count.

    A record is fresh when it was made from the manifest row as it is now (same size, etag or
    mtime, caption and bucket); stale ones are left out of the plan, never trained on.
    """
    from manifests.cache import available_sample_ids, cache_freshness, read_cache_meta

    meta = read_cache_meta(url, options)
    if manifest is None:
        return np.asarray(available_sample_ids(url, options), dtype=np.uint64), meta, 0
    status = cache_freshness(url, manifest, options)
    return np.unique(status.sample_ids[status.fresh]), meta, int(status.stale.sum())


def _print_summary(meta: dict[str, Any]) -> None:
    inputs = meta["inputs"]
    print(
        f"plan:     {meta['mode']} batches, world size {inputs['world_size']}, "
        + (
            f"batch {inputs['batch_size']} per rank (global {meta['global_batch']})"
            if meta["mode"] == "fixed"
            else f"max {inputs['max_tokens']} latent tokens per rank"
        )
        + f", seed {inputs['seed']}, leftover {inputs['leftover']}, grad accum {inputs['grad_accum']}"
    )
    samples = meta["samples"]
    print(
        f"samples:  {samples['planned']} planned"
        + (f", {samples['not_in_cache']} not in the cache (left out)" if inputs.get("cache_fingerprint") else "")
        + (f", {samples['stale']} stale in the cache (left out)" if samples.get("stale") else "")
    )
    if samples.get("stale"):
        source = (meta.get("sources") or {}).get("manifest") or "MANIFEST"
        cache = (meta.get("sources") or {}).get("cache") or "CACHE"
        print(
            f"note:     {samples['stale']} samples changed (image bytes, caption or bucket) since they were "
            f"embedded; run `bucketeer embed {source} --out {cache}` to re-embed them, then plan again"
        )
    epochs = meta["epochs"]
    run = inputs["epochs"]
    _print_mix(meta)
    print(
        f"steps:    {meta['steps_per_epoch']} per epoch, epochs {epochs[0]['epoch']}..{epochs[-1]['epoch']}"
        + (f" of {run} planned (write the rest with --extend)" if epochs[-1]["epoch"] < run - 1 else "")
        + (
            f" (resumed at epoch {meta['resumed_from']['epoch']} step {meta['resumed_from']['step']})"
            if meta.get("resumed_from")
            else ""
        )
    )
    counts = meta["counts"]
    print(f"padded:   {counts['padded']} repeats over all epochs; dropped: {counts['dropped']} sample-epochs")
    print(f"  {'bucket':>10}  {'samples':>9}  {'batch':>5}  {'padded':>8}  {'dropped':>8}")
    for name, b in sorted(meta["buckets"].items(), key=lambda kv: -kv[1]["samples"]):
        print(
            f"  {name:>10}  {b['samples']:>9}  {b['batch_size']:>5}  "
            f"{counts['padded_per_bucket'].get(name, 0):>8}  {counts['dropped_per_bucket'].get(name, 0):>8}"
        )
    if meta["mode"] == "packing":
        t = meta["tokens_per_step"]
        print(
            f"tokens:   per rank per step min {t['min']} / mean {t['mean']} / max {t['max']}"
            f" (budget {inputs['max_tokens']})"
        )
    size = sum(e["bytes"] for e in epochs)
    slots = sum(e["steps"] for e in epochs) * (meta["global_batch"] or 0)
    print(f"files:    {len(epochs)} epoch files, {size / 1e6:.1f} MB"
          + (f" ({size / slots:.2f} bytes per sample slot)" if slots else ""))  # fmt: skip
    print(f"fingerprint: {meta['fingerprint']}")


def mix_lines(meta: dict[str, Any]) -> list[str]:
    """Per dataset of a mixture plan: "n samples, weight w -> k per epoch (x times each on average)", the slots
    trained after bucket leftovers, and per bucket samples -> slots per epoch. Empty for a one-manifest plan."""
    if "mix" not in meta:
        return []
    mix, trained = meta["mix"], meta["counts"].get("per_dataset")
    kind = meta["inputs"]["mix"]["kind"][:-1]  # weight | repeat
    held = len(meta["epochs"])
    lines = [f"{len(mix['datasets'])} datasets ({mix['rule']})"]
    for d, info in enumerate(mix["datasets"]):
        value = info[kind] + (f" (share {info['share']:g})" if "share" in info and info["share"] != float(info[kind])
                              else "")  # fmt: skip
        lines.append(f"  [{d}] {info['manifest'] or '-'}: {info['samples']} samples, {kind} {value} -> "
                     f"{info['per_epoch']} per epoch ({info['times']:g} times each on average)"
                     + (f"; trained {trained[d] / held:g} per epoch after bucket leftovers" if trained
                        else ""))  # fmt: skip
        per_bucket = ", ".join(f"{b} {c['samples']}->{c['per_epoch']}" for b, c in info["buckets"].items())
        lines.append(f"      per bucket (samples -> per epoch): {per_bucket}")
    return lines


def _print_mix(meta: dict[str, Any]) -> None:
    for i, line in enumerate(mix_lines(meta)):
        print(("mix:      " if i == 0 else "") + line)


def _run_check(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from manifests.manifest import read_manifest
    from manifests.plan import read_plan_meta
    from manifests.plan.check import check_plan

    manifests = [read_manifest(m, options) for m in args.manifest]
    caches = _cache_list(args.cache, len(manifests) or 1)
    available, cache_fps = [], []
    for d, cache in enumerate(caches):
        ids, cache_meta, _ = (_cache_inputs(cache, options, manifests[d] if manifests else None) if cache
                              else (None, {"fingerprint": None}, 0))  # fmt: skip
        available.append(ids)
        cache_fps.append(cache_meta["fingerprint"])
    mixture = "mix" in read_plan_meta(args.check, options)["inputs"]
    if len(manifests) > 1 and not mixture:
        raise UsageError(f"{redact(args.check)} is a one-manifest plan: check it against its one MANIFEST")
    if mixture:
        problems = check_plan(args.check, options, manifests=manifests, available_ids=available,
                              cache_fingerprints=cache_fps, progress=True)  # fmt: skip
    else:
        problems = check_plan(args.check, options, manifest=manifests[0] if manifests else None,
                              available_ids=available[0], cache_fingerprint=cache_fps[0], progress=True)  # fmt: skip
    manifest = manifests[0] if manifests else None
    for p in problems:
        print(f"violation: {redact(p)}")
    if problems:
        print(f"{redact(args.check)}: {len(problems)} violation(s)", file=sys.stderr)
        return 1
    print(f"{redact(args.check)}: ok" + ("" if manifest else " (no MANIFEST given: membership not checked)"))
    return 0


def _run_resume(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from manifests.plan import resume_plan

    try:
        epoch, step = (int(x) for x in (args.at or "").split(":"))
    except ValueError:
        raise UsageError(f"--at must be EPOCH:STEP, e.g. 3:1200, got {args.at!r}") from None
    return resume_plan(
        args.resume,
        args.out,
        epoch=epoch,
        step=step,
        world_size=args.world_size,
        batch_size=args.batch_size,
        storage_options=options,
        out_storage_options=options,
        progress=True,
    )


def run(args: argparse.Namespace) -> int:
    options = parse_storage_options(args.storage_options)
    if args.check:
        return _run_check(args, options)
    if not args.out and not args.extend:
        raise UsageError("--out PLAN is required (the plan folder to write)")
    if args.extend:
        meta = _extend(args, options)
    elif args.world_size is None:
        raise UsageError("--world-size is required (number of training processes)")
    elif args.resume:
        meta = _run_resume(args, options)
    else:
        meta = _plan(args, options)
    if args.json:
        print(json.dumps(meta, indent=2, sort_keys=True))
    else:
        _print_summary(meta)
    return 0


def _cache_list(cache: str | None, manifests: int) -> list[str | None]:
    """``--cache``: None, or one cache per manifest (comma-separated). Raises UsageError for another count."""
    if not cache:
        return [None] * manifests
    caches = [c.strip() for c in cache.split(",")]
    if len(caches) != manifests:
        raise UsageError(f"--cache names {len(caches)} caches for {manifests} manifests: give one per manifest, "
                         "comma-separated, in the same order")  # fmt: skip
    return caches


def _dataset(url: str, cache: str | None, options: dict[str, Any]):
    """``(manifest, sample ids, buckets, caption counts | None, cache fingerprint, not in the cache, stale)``."""
    from manifests.manifest import read_manifest
    from manifests.plan.mix import caption_counts

    manifest = read_manifest(url, options)
    ids = manifest.samples.column("sample_id").to_numpy()
    buckets = manifest.samples.column("bucket")
    counts = caption_counts(manifest.samples)
    cache_fp, left_out, stale = None, 0, 0
    if cache:
        available, cache_meta, stale = _cache_inputs(cache, options, manifest)
        keep = cached_mask(ids, available)
        left_out = int((~keep).sum()) - stale
        if stale and not keep.any():
            raise UsageError(
                f"none of the {len(ids)} samples of {redact(url)} has an up-to-date record in "
                f"{redact(cache)} ({stale} changed since they were embedded): run "
                f"`bucketeer embed {redact(url)} --out {redact(cache)}` first"
            )
        ids, buckets = ids[keep], buckets.filter(pa.array(keep))
        counts = None if counts is None else counts[keep]
        cache_fp = cache_meta["fingerprint"]
    return manifest, ids, buckets, counts, cache_fp, left_out, stale


def _samples(args: argparse.Namespace, options: dict[str, Any], rule_json: dict[str, Any] | None = None):
    """What to plan: ``("one", manifest, ids, buckets, cache fp, not in cache, stale)`` for a one-manifest plan,
    ``("mix", MixedSamples, manifest fps, cache fps, per-dataset info)`` for a mixture.

    ``rule_json``: the mixture rule recorded in a plan (``--extend``). Raises UsageError for no manifest, the
    same manifest twice, both --weights and --repeats, or a rule for another number of manifests.
    """
    from manifests.plan.mix import DatasetSamples, MixRule, mix_samples

    if not args.manifest:
        raise UsageError("MANIFEST is required: bucketeer plan MANIFEST [MANIFEST ...] --out PLAN … (or --extend PLAN)")
    if args.weights and args.repeats:
        raise UsageError("give --weights or --repeats, not both")
    caches = _cache_list(args.cache, len(args.manifest))
    loaded = [_dataset(url, cache, options) for url, cache in zip(args.manifest, caches)]
    seen: dict[str, int] = {}
    for d, (manifest, *_rest) in enumerate(loaded):
        if manifest.fingerprint in seen:
            first = seen[manifest.fingerprint]
            raise UsageError(f"manifest {redact(args.manifest[d])} is the same as manifest {first} "
                             f"({redact(args.manifest[first])}): give each once and raise its "
                             "--repeats or --weights instead")  # fmt: skip
        seen[manifest.fingerprint] = d
    if rule_json is not None:
        rule = MixRule.from_json(rule_json)
    elif args.weights or args.repeats:
        kind = "weights" if args.weights else "repeats"
        rule = MixRule.parse(kind, args.weights or args.repeats, len(loaded))
    elif len(loaded) > 1 or loaded[0][3] is not None:
        rule = MixRule("repeats", (Fraction(1),) * len(loaded))  # every sample once per epoch
    else:
        manifest, ids, buckets, _, cache_fp, left_out, stale = loaded[0]
        return "one", manifest, ids, buckets, cache_fp, left_out, stale
    if len(rule.values) != len(loaded):
        raise UsageError(f"the plan mixes {len(rule.values)} manifests, {len(loaded)} given: give the manifests it "
                         "was made from, in the same order")  # fmt: skip
    mix = mix_samples([DatasetSamples(ids, buckets, counts, redact(url))
                       for url, (_, ids, buckets, counts, *_r) in zip(args.manifest, loaded)], rule)  # fmt: skip
    info = [{"manifest": url, "cache": cache, "not_in_cache": left_out, "stale": stale}
            for url, cache, (*_r, left_out, stale) in zip(args.manifest, caches, loaded)]  # fmt: skip
    return "mix", mix, [x[0].fingerprint for x in loaded], [x[4] for x in loaded], info


# the planning options: --extend takes them from the plan, and refuses one given with another value
_INPUTS = {"world_size": "--world-size", "batch_size": "--batch-size", "seed": "--seed", "leftover": "--leftover",
           "grad_accum": "--grad-accum", "max_tokens": "--max-tokens", "latent_factor": "--latent-factor",
           "patch_size": "--patch-size"}  # fmt: skip


def _extend(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from manifests.plan import extend_mix_plan, extend_plan, read_plan_meta

    inputs = read_plan_meta(args.extend, options)["inputs"]
    for key, option in _INPUTS.items():
        given = getattr(args, key)
        if given is not None and given != inputs.get(key):
            raise UsageError(f"{option} {given} differs from the plan's {inputs.get(key)}: --extend writes more "
                             f"epochs of {redact(args.extend)} as it was made; leave {option} out")  # fmt: skip
    if "mix" in inputs:
        if args.weights or args.repeats:
            raise UsageError("--extend takes the mixture's --weights/--repeats from the plan; leave them out")
        _, mix, manifest_fps, cache_fps, _ = _samples(args, options, inputs["mix"])
        return extend_mix_plan(args.extend, mix, manifest_fingerprints=manifest_fps, cache_fingerprints=cache_fps,
                               epochs=args.epochs, window=args.window, storage_options=options,
                               progress=True)  # fmt: skip
    picked = _samples(args, options)
    if picked[0] != "one":
        raise UsageError(f"{redact(args.extend)} is a one-manifest plan: extend it with its one manifest, "
                         "without --weights/--repeats")  # fmt: skip
    _, manifest, ids, buckets, cache_fp, _, _ = picked
    return extend_plan(args.extend, ids, buckets, manifest_fingerprint=manifest.fingerprint,
                       cache_fingerprint=cache_fp, epochs=args.epochs, window=args.window,
                       sources={"manifest": args.manifest[0], "cache": args.cache}, storage_options=options,
                       progress=True)  # fmt: skip


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _plan(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from manifests.plan import write_mix_plan, write_plan

    config = PlanConfig(
        world_size=args.world_size,
        batch_size=args.batch_size,
        seed=_given(args.seed, 0),
        epochs=_given(args.epochs, 1),
        leftover=_given(args.leftover, "drop"),
        grad_accum=_given(args.grad_accum, 1),
        max_tokens=args.max_tokens,
        latent_factor=_given(args.latent_factor, 8),
        patch_size=_given(args.patch_size, 2),
    )
    picked = _samples(args, options)
    if picked[0] == "mix":
        _, mix, manifest_fps, cache_fps, info = picked
        return write_mix_plan(args.out, mix, config, manifest_fingerprints=manifest_fps, cache_fingerprints=cache_fps,
                              datasets=info, storage_options=options, window=args.window, progress=True)  # fmt: skip
    _, manifest, ids, buckets, cache_fp, left_out, stale = picked
    return write_plan(
        args.out,
        ids,
        buckets,
        config,
        manifest_fingerprint=manifest.fingerprint,
        cache_fingerprint=cache_fp,
        not_in_cache=left_out,
        stale=stale,
        sources={"manifest": args.manifest[0], "cache": args.cache},
        storage_options=options,
        window=args.window,
        progress=True,
    )


if __name__ == "__main__":
    from pipeline.cli import module_main

    sys.exit(module_main("plan"))
