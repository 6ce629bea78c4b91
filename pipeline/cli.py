"""``bucketeer`` — the command line. Each subcommand is a module with ``add_arguments(parser)``,
``job_from_args(args)`` (the one place where argparse's Namespace becomes the command's frozen, validated
job object) and ``run(job)`` (the same function the Python API calls, :func:`pipeline.run`), which returns
a typed result; a result's ``exit_code`` (0 when it has none) is the command's exit code.

Only the module of the command being run is imported, so ``bucketeer --help`` does not pay for
Ray or torch. Each Ray job is also runnable as ``python -m pipeline.<job>`` (for
``ray job submit -- python -m pipeline.scan …``) through :func:`module_main`.

Exit codes: 0 done; 2 for an error the user must act on (a :class:`manifests.errors.BucketeerError`,
also when a Ray task raised it, and argparse's usage errors), printed as one line
``bucketeer COMMAND: error: MESSAGE`` with credentials redacted (``-v`` adds its traceback to the
log); 1 from ``bucketeer plan --check`` when a plan breaks an invariant. Any other exception is a
bug: it propagates with its traceback (Python's exit code 1).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
import traceback
from types import ModuleType
from typing import Any, Callable, NoReturn, Sequence

from manifests import __version__
from manifests.errors import user_error

# name -> (module, one-line help). A registry is a dict from name to where the code lives.
COMMANDS: dict[str, tuple[str, str]] = {
    "scan": ("pipeline.scan", "read the headers and captions of images and videos (loose, tar shards, parquet) "
                              "into a bucketed parquet manifest (Ray job)"),
    "embed": ("pipeline.embed", "precompute VAE latents and text embeddings (and DINOv2 features, loss masks, "
                                "crop variants) into a cache (Ray job)"),
    "plan": ("pipeline.plan", "write per-rank plans (one bucket per batch, equal steps, disjoint ranks; mixtures, "
                              "--where, --weight-by); --check, --resume, --extend"),
    "annotate": ("pipeline.annotate", "caption, score (aesthetic, safety, watermark), hash (sha256, pHash), "
                                      "CLIP-embed and measure images, cut videos into scenes and score their "
                                      "motion, into an annotations folder (Ray job)"),
    "dedup": ("pipeline.dedup", "find exact, perceptual and semantic duplicates in annotations; one keeper per "
                                "cluster"),
    "estimate": ("pipeline.estimate", "the bill before an embed run: samples, captions, bytes written and read, "
                                      "device-hours and money, from the manifest and the model's configs alone"),
    "verify": ("pipeline.verify", "check every record of a cache: checksum, identity, shapes, finite values"),
    "rebucket": ("pipeline.rebucket", "re-assign buckets from stored sizes into a new manifest (no image I/O)"),
    "stats": ("pipeline.stats", "print a manifest's counts, buckets and errors; with --where, what a selection "
                                "keeps"),
    "report": ("pipeline.report", "write an HTML report of a manifest and its cache, plan and annotations"),
    "review": ("pipeline.review", "serve a local page to look at a manifest with its annotations, filter, sort, "
                                  "keep or reject and edit captions (decisions as annotations)"),
    "demo": ("pipeline.demo", "run scan, annotate, dedup, embed, plan (without the duplicates), train, verify and "
                              "report on a generated dataset, here"),
}


def _load(name: str):
    return importlib.import_module(COMMANDS[name][0])


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s own options are loaded (all of them when None)."""
    parser = argparse.ArgumentParser(
        prog="bucketeer",
        description="Offline preprocessing and metadata for diffusion training on S3 / R2 / local datasets.",
    )
    parser.add_argument("--version", action="version", version=f"bucketeer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            module = _load(name)
            module.add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def job_from_argv(argv: Sequence[str]):
    """The job that ``bucketeer ARGV`` would run, built by the same parser (so the demo and tests can print a
    command a user could type, then run it in this process with :func:`pipeline.run`). Usage errors exit
    as argparse's do (SystemExit 2)."""
    args = build_parser(argv[0]).parse_args(list(argv))
    return args._module.job_from_args(args)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted: a process that runs several commands
    (tests, a notebook, the demo) may have replaced it since, and a handler bound to a closed stream prints
    a "Logging error" traceback instead of the record."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[_StderrHandler()],
    )


def _invoke(module: ModuleType, args: argparse.Namespace) -> int:
    try:
        result = module.run(module.job_from_args(args))
        return int(getattr(result, "exit_code", 0))
    except Exception as e:
        error = user_error(e)
        if error is None:  # a bug: its traceback is what a report needs
            raise
        from manifests.storage import redact

        if getattr(args, "verbose", False):
            logging.getLogger("bucketeer").exception("failed")
        print(f"bucketeer {args.command or ''}: error: {redact(str(error))}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 0 if not argv else 2
    _setup_logging(args.verbose)
    return _invoke(args._module, args)


def module_main(name: str, argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.<name> …``: the same options as ``bucketeer <name> …``."""
    module = _load(name)
    parser = argparse.ArgumentParser(prog=f"python -m {COMMANDS[name][0]}", description=COMMANDS[name][1])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    module.add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    args.command = name
    _setup_logging(args.verbose)
    return _invoke(module, args)


def exit_after(command: Callable[..., int], *args: Any) -> NoReturn:
    """Run ``command(*args)`` and end the process with its exit code, without tearing the interpreter down:
    atexit handlers (Ray's shutdown) run and the output is flushed, then ``os._exit``. Interpreter
    finalization is skipped because a C++ library's static destructors can abort a process whose work is
    done ("terminate called without an active exception", exit 134 after `plan --check` had printed ok,
    seen in 1 of 3 test-suite runs); the trainer ends its ranks the same way for the same reason. An
    exception that escapes is a bug: its traceback is printed, exit 1."""
    code: int = 1
    try:
        code = command(*args)
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # the reader went away (`bucketeer stats M | head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass
        os._exit(int(code))


def console_main() -> NoReturn:
    """The ``bucketeer`` console script: :func:`main` through :func:`exit_after`."""
    exit_after(main)


if __name__ == "__main__":
    exit_after(main)
