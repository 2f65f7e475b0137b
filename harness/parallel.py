"""Fan work out over hosts: bounded parallelism, host-prefixed output, one host's failure isolated.

An unreachable host becomes a ``HostFailure`` in the result map instead of an exception, so the other
hosts' work still completes and the report can show every host.
"""
from __future__ import annotations

import os
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

from rich.console import Console
from rich.markup import escape

from harness.errors import HarnessError, HostKeyError, HostUnreachable
from harness.inventory import HostSpec

T = TypeVar("T")
DEFAULT_WORKERS = 8


@dataclass
class HostFailure:
    """Why a host produced no result: ``unreachable`` (network, auth), ``host key`` or ``error``."""

    host: str
    kind: str
    message: str

    def as_dict(self) -> dict:
        return {"host": self.host, "error": self.kind, "message": self.message}


class HostOutput:
    """Prints lines prefixed with their host, one whole line at a time, from many threads."""

    def __init__(self, console: Console | None = None, enabled: bool = True):
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.enabled = enabled
        self._lock = threading.Lock()

    def line(self, host: str, text: str, style: str = "") -> None:
        if not self.enabled:
            return
        with self._lock:
            body = escape(text)
            self.console.print(f"[bold cyan]\\[{escape(host)}][/] " + (f"[{style}]{body}[/]" if style else body))

    def for_host(self, host: str, style: str = "") -> Callable[[str], None]:
        return lambda text: self.line(host, text, style)


def on_hosts(hosts: list[HostSpec], fn: Callable[[HostSpec], T], workers: int = DEFAULT_WORKERS) -> dict[str, T | HostFailure]:
    """Run ``fn(host)`` for every host, at most ``workers`` at a time; results keep inventory order."""
    def guarded(h: HostSpec):
        try:
            return fn(h)
        except HostUnreachable as e:
            return HostFailure(h.name, "unreachable", str(e))
        except HostKeyError as e:
            return HostFailure(h.name, "host key", str(e))
        except HarnessError as e:
            return HostFailure(h.name, "error", str(e))
        except Exception as e:  # noqa: BLE001 - one host's bug must not take the others down
            if os.environ.get("HARNESS_DEBUG"):
                traceback.print_exc()
            return HostFailure(h.name, "error", f"host {h.name}: internal error {type(e).__name__}: {e} "
                                                "(set HARNESS_DEBUG=1 for the traceback)")

    if len(hosts) <= 1:
        return {h.name: guarded(h) for h in hosts}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(hosts)))) as pool:
        futures = {h.name: pool.submit(guarded, h) for h in hosts}
        return {name: f.result() for name, f in futures.items()}
