"""``bucketeer plan``'s options, and :func:`job_from_args`: the one place they become a :class:`PlanJob`."""

from __future__ import annotations

import argparse

from manifests.errors import UsageError
from manifests.plan.mix import RULE_HELP
from manifests.plan.schedule import LEFTOVER_POLICIES
from manifests.storage import parse_storage_options
from pipeline.plan.job import PlanJob

__all__ = ["add_arguments", "job_from_args"]


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
    parser.add_argument("--shuffle", default=None, metavar="full|window[:SIZE]",
                        help="full: every epoch a uniform shuffle of each bucket (default); window: windows of SIZE "
                        "samples in cache order (default 256), shuffled, samples shuffled within and across "
                        "neighbouring windows: the trainer reads each window with a few large ranged reads")
    parser.add_argument("--cache", default=None, help="plan only samples with a good record in this cache folder; "
                        "for several manifests one cache each, comma-separated, in the manifests' order")
    m = parser.add_argument_group("mixtures (several manifests)", description=RULE_HELP)
    m.add_argument("--repeats", default=None, metavar="R1,R2,...",
                   help="samples per epoch of each manifest = round(r * its samples), halves up; r may be "
                   "fractional (0.5: half of it each epoch, 3: each sample 3 times)")
    m.add_argument("--weights", default=None, metavar="W1,W2,...",
                   help="share of each manifest in an epoch of as many samples as all manifests hold "
                   "together (normalised; counts by largest remainder)")  # fmt: skip
    s = parser.add_argument_group("selection (annotations)", description=(
        "Keep the samples a SQL condition over the manifest's and the annotations' columns holds for (joined on "
        "sample_id; a sample without an annotations row has NULL there, so a comparison drops it), and draw them "
        "by weight. Recorded in _plan.json and re-checked by --check. See manifests/select.py and "
        "manifests/filters.py."))
    s.add_argument("--annotations", default=None, metavar="A[,B...]",
                   help="annotations folders (bucketeer annotate, bucketeer dedup) whose columns --where and "
                   "--weight-by read, comma-separated")
    s.add_argument("--where", default=None, metavar="SQL",
                   help="keep only samples for which this condition is true (SQL's conditions: bucketeer's filter "
                   "language, docs/annotate.md), e.g. \"aesthetic > 5.5 AND NOT duplicate AND width >= 768\"")
    s.add_argument("--weight-by", default=None, metavar="EXPR",
                   help="draw each kept sample in proportion to this non-negative number (e.g. aesthetic): per "
                   "epoch floor or ceil of its expected draws, exactly as many draws as samples kept")
    g = parser.add_argument_group("packing mode")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="latent tokens per rank per step; per-bucket batch = max_tokens // tokens(bucket)",
    )
    g.add_argument("--latent-factor", type=int, default=None, help="VAE downsampling factor (default 8)")
    g.add_argument("--patch-size", type=int, default=None, help="transformer patch size on latents (default 2)")
    g.add_argument("--temporal-factor", type=int, default=None,
                   help="video manifests: frames per latent frame after the first, so a WxHxF bucket has "
                   "(F-1)//t+1 latent frames (default: the --cache's VAE, else 4 as Wan/HunyuanVideo)")
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


def job_from_args(args: argparse.Namespace) -> PlanJob:
    """The job the command line asks for. Raises UsageError naming the option for a bad value."""
    return PlanJob(
        manifests=tuple(args.manifest), out=args.out, world_size=args.world_size, batch_size=args.batch_size,
        seed=args.seed, epochs=args.epochs, window=args.window, leftover=args.leftover, grad_accum=args.grad_accum,
        cache=tuple(c.strip() for c in args.cache.split(",")) if args.cache else (), repeats=args.repeats,
        weights=args.weights, max_tokens=args.max_tokens, latent_factor=args.latent_factor,
        patch_size=args.patch_size, temporal_factor=args.temporal_factor, shuffle=args.shuffle, check=args.check,
        extend=args.extend, resume=args.resume,
        at=_position(args.at) if args.resume and not (args.check or args.extend) else None,
        annotations=tuple(a.strip() for a in args.annotations.split(",")) if args.annotations else (),
        where=args.where, weight_by=args.weight_by,
        storage_options=parse_storage_options(args.storage_options), json=args.json,
    )  # fmt: skip


def _position(text: str | None) -> tuple[int, int]:
    """``--at EPOCH:STEP``. Raises UsageError for anything else."""
    try:
        epoch, step = (int(x) for x in (text or "").split(":"))
    except ValueError:
        raise UsageError(f"--at must be EPOCH:STEP, e.g. 3:1200, got {text!r}") from None
    return epoch, step
