"""What ``bucketeer plan`` prints: the summary of a plan's ``_plan.json`` (or the mixture's lines of it)."""

from __future__ import annotations

from manifests.plan import PlanMeta

__all__ = ["print_summary", "mix_lines", "selection_lines"]


def print_summary(meta: PlanMeta) -> None:
    """The plan's world shape, samples, steps, padding and drops per bucket, files and fingerprint."""
    inputs, samples = meta.inputs, meta.samples
    print(
        f"plan:     {meta.mode} batches, world size {inputs.world_size}, "
        + (
            f"batch {inputs.batch_size} per rank (global {meta.global_batch})"
            if meta.mode == "fixed"
            else f"max {inputs.max_tokens} latent tokens per rank"
        )
        + f", seed {inputs.seed}, leftover {inputs.leftover}, grad accum {inputs.grad_accum}"
        + (f", {inputs.temporal_factor} frames per latent frame" if inputs.temporal_factor else "")
    )
    print(
        f"samples:  {samples.planned} planned"
        + (f", {samples.not_in_cache} not in the cache (left out)" if inputs.cache_fingerprint else "")
        + (f", {samples.stale} stale in the cache (left out)" if samples.stale else "")
    )
    if samples.stale:
        source = (meta.sources or {}).get("manifest") or "MANIFEST"
        cache = (meta.sources or {}).get("cache") or "CACHE"
        print(
            f"note:     {samples.stale} samples changed (image bytes, caption or bucket) since they were "
            f"embedded; run `bucketeer embed {source} --out {cache}` to re-embed them, then plan again"
        )
    for line in selection_lines(meta):
        print(line)
    epochs = meta.epochs
    run = inputs.epochs
    for i, line in enumerate(mix_lines(meta)):
        print(("mix:      " if i == 0 else "") + line)
    resumed = meta.resumed_from
    print(
        f"steps:    {meta.steps_per_epoch} per epoch, epochs {epochs[0].epoch}..{epochs[-1].epoch}"
        + (f" of {run} planned (write the rest with --extend)" if epochs[-1].epoch < run - 1 else "")
        + (f" (resumed at epoch {resumed.epoch} step {resumed.step})" if resumed else "")
    )
    counts = meta.counts
    assert counts is not None
    print(f"padded:   {counts.padded} repeats over all epochs; dropped: {counts.dropped} sample-epochs")
    print(f"  {'bucket':>10}  {'samples':>9}  {'batch':>5}  {'padded':>8}  {'dropped':>8}")
    for name, b in sorted(meta.buckets.items(), key=lambda kv: -kv[1].samples):
        print(
            f"  {name:>10}  {b.samples:>9}  {b.batch_size:>5}  "
            f"{counts.padded_per_bucket.get(name, 0):>8}  {counts.dropped_per_bucket.get(name, 0):>8}"
        )
    if meta.mode == "packing" and meta.tokens_per_step is not None:
        t = meta.tokens_per_step
        print(f"tokens:   per rank per step min {t.min} / mean {t.mean} / max {t.max} (budget {inputs.max_tokens})")
    size = sum(e.bytes for e in epochs)
    slots = sum(e.steps for e in epochs) * (meta.global_batch or 0)
    print(f"files:    {len(epochs)} epoch files, {size / 1e6:.1f} MB"
          + (f" ({size / slots:.2f} bytes per sample slot)" if slots else ""))  # fmt: skip
    print(f"fingerprint: {meta.fingerprint}")


def mix_datasets(meta: PlanMeta) -> list[tuple[int, str, str]]:
    """Per dataset of a mixture plan: its index, "n samples, weight w -> k per epoch (x times each on average)"
    with the slots trained after bucket leftovers, and per bucket samples -> slots per epoch. Empty for a
    one-manifest plan. What the summary prints (:func:`mix_lines`) and the report shows."""
    if meta.mix is None or meta.inputs.mix is None:
        return []
    trained = meta.counts.per_dataset if meta.counts is not None else None
    kind = meta.inputs.mix.kind[:-1]  # weight | repeat
    held = len(meta.epochs)
    rows = []
    for d, info in enumerate(meta.mix.datasets):
        given = (info.weight if kind == "weight" else info.repeat) or ""
        value = given + (f" (share {info.share:g})" if info.share is not None and info.share != float(given) else "")
        line = (f"{info.manifest or '-'}: {info.samples} samples, {kind} {value} -> {info.per_epoch} per epoch "
                f"({info.times:g} times each on average)"
                + (f"; trained {trained[d] / held:g} per epoch after bucket leftovers" if trained else ""))
        per_bucket = ", ".join(f"{b} {c.samples}->{c.per_epoch}" for b, c in info.buckets.items())
        rows.append((d, line, f"per bucket (samples -> per epoch): {per_bucket}"))
    return rows


def mix_lines(meta: PlanMeta) -> list[str]:
    """The summary's lines of a mixture plan (see :func:`mix_datasets`); empty for a one-manifest plan."""
    if meta.mix is None:
        return []
    lines = [f"{len(meta.mix.datasets)} datasets ({meta.mix.rule})"]
    for d, line, per_bucket in mix_datasets(meta):
        lines += [f"  [{d}] {line}", f"      {per_bucket}"]
    return lines


def selection_lines(meta: PlanMeta) -> list[str]:
    """The summary's lines of a plan's selection (``--where`` / ``--weight-by``); empty without one."""
    sel = meta.selection
    if sel is None:
        return []
    kept, dropped = sum(d.kept for d in sel.datasets), sum(d.dropped for d in sel.datasets)
    lines = [f"select:   {kept} of {kept + dropped} samples kept ({dropped} dropped)"
             + (f" where {sel.where}" if sel.where else "")
             + (f"; drawn by weight {sel.weight_by}" if sel.weight_by else "")]  # fmt: skip
    if len(sel.datasets) > 1:
        lines += [f"  [{d}] {c.manifest}: {c.kept} kept, {c.dropped} dropped" for d, c in enumerate(sel.datasets)]
    lines += [f"  annotations {a.url} ({a.fingerprint})" for a in sel.annotations]
    return lines
