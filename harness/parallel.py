"""Fan work out over hosts: bounded parallelism, one host's failure isolated.

A host that fails (unreachable, refused, or a bug) becomes a ``HostFailure`` in the ``HostResults``
instead of an exception, so the other hosts' work still completes and the report can show every host.
"""
from __future__ import annotations

import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from harness.errors import HarnessError, HostKeyError, HostUnreachable
from harness.inventory import HostSpec
from harness.results import HostFailure, HostResults

T = TypeVar("T")
DEFAULT_WORKERS = 8


def failure_of(host: str, e: BaseException) -> HostFailure:
    """The ``HostFailure`` an exception raised for ``host`` stands for."""
    if isinstance(e, HostUnreachable):
        return HostFailure(host, "unreachable", str(e))
    if isinstance(e, HostKeyError):
        return HostFailure(host, "host key", str(e))
    if isinstance(e, HarnessError):
        return HostFailure(host, getattr(e, "kind", None) or "error", str(e))
    if os.environ.get("HARNESS_DEBUG"):
        traceback.print_exception(e)
    return HostFailure(host, "internal", f"host {host}: internal error {type(e).__name__}: {e} "
                                         "(set HARNESS_DEBUG=1 for the traceback)")


def on_hosts(hosts: list[HostSpec], fn: Callable[[HostSpec], T], workers: int = DEFAULT_WORKERS) -> HostResults:
    """Run ``fn(host)`` for every host, at most ``workers`` at a time; results keep inventory order."""
    def guarded(h: HostSpec):
        try:
            return fn(h)
        except Exception as e:  # noqa: BLE001 - one host's failure or bug must not take the others down
            return failure_of(h.name, e)

    if len(hosts) <= 1:
        return HostResults((h.name, guarded(h)) for h in hosts)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(hosts)))) as pool:
        futures = {h.name: pool.submit(guarded, h) for h in hosts}
        return HostResults((name, f.result()) for name, f in futures.items())


def with_connection(inv, fn: Callable, timeout: float | None = None) -> Callable[[HostSpec], T]:
    """``fn(conn)`` wrapped as ``fn(host)``: opens the host's verified connection and closes it after."""
    def run(h: HostSpec):
        from harness.connection import CONNECT_TIMEOUT, open_host

        with open_host(h, inv, timeout=timeout or CONNECT_TIMEOUT) as conn:
            return fn(conn)
    return run
