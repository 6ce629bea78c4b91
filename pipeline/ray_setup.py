"""Where the Ray jobs run: the cluster named by ``--ray-address`` / ``$RAY_ADDRESS`` (which
``ray job submit`` sets), or else a Ray started in-process on this machine, bound to 127.0.0.1."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

# Ray reads this once, when it is first imported: "0" selects its single-machine mode, in which a
# local Ray binds 127.0.0.1 instead of the machine's routable address on all interfaces
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only() -> None:
    """Make a Ray started later in this process (and its workers) listen on 127.0.0.1 only.

    Call before ``ray`` is imported; ``RAY_USAGE_STATS_ENABLED=0`` keeps a local start from
    reporting anywhere. ``RAY_AUTH_MODE=token`` asks for what a local Ray does by default (token
    authentication, a token made once in ``~/.ray/auth_token``), so that Ray does not print a line
    saying it chose that; it is read when Ray is imported, and set only before (set after, the
    driver and the cluster it starts would disagree, and the driver could not connect). Values the
    user set are left alone.
    """
    os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def init_ray(address: str | None = None, *, local: bool = False):
    """Return the ``ray`` module, initialised, and whether this call started it.

    ``address`` (else ``$RAY_ADDRESS``) connects to that cluster; with neither, or with
    ``local=True``, a new Ray starts on this machine, bound to 127.0.0.1. An already initialised
    Ray is reused, so the demo's stages share one.
    """
    address = None if local else (address or os.environ.get("RAY_ADDRESS"))
    if not address:
        loopback_only()
    import ray

    if ray.is_initialized():
        return ray, False
    if address:
        ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
    else:
        # address="local": a new Ray on this machine even when $RAY_ADDRESS names a cluster
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=False, log_to_driver=False)  # fmt: skip
    return ray, True


@contextlib.contextmanager
def ray_session(address: str | None = None, *, local: bool = False) -> Iterator[object]:
    """:func:`init_ray` as a context: yields ``ray``; shuts it down on exit if it started it here."""
    ray, started_here = init_ray(address, local=local)
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()
