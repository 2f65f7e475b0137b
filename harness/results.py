"""One result per many-host call: every host's value, or why it has none.

Modelled on Fabric's ``GroupResult``: a mapping from host name to that host's result, in inventory
order, that also knows which hosts failed. A failure is data (``HostFailure``: the host, a kind
and one line), never text to parse back, so the CLI decides how to show it and what exit code it
means, and code calling the harness can branch on ``kind``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class HostFailure:
    """Why a host produced no result. ``kind``: ``unreachable`` (network, auth), ``host key``, or
    the error kind the host answered with (e.g. ``refused``, ``version mismatch``, ``error``)."""

    host: str
    kind: str
    message: str

    def as_dict(self) -> dict:
        """The remote contract's shape: ``{"ok": false, "kind": ..., "error": ...}``."""
        return {"ok": False, "kind": self.kind, "error": self.message}


class HostResults(dict):
    """``{host: value | HostFailure}`` plus ``failed`` / ``succeeded`` views and one JSON shape."""

    @property
    def failed(self) -> dict[str, HostFailure]:
        return {h: r for h, r in self.items() if isinstance(r, HostFailure)}

    @property
    def succeeded(self) -> dict[str, Any]:
        return {h: r for h, r in self.items() if not isinstance(r, HostFailure)}

    def to_json(self, value: Callable[[Any], Any] | None = None) -> dict:
        """Each host's value (through ``value``, e.g. ``as_dict``), or its failure's dict."""
        return {h: r.as_dict() if isinstance(r, HostFailure) else (value(r) if value else r)
                for h, r in self.items()}

    def error_lines(self) -> list[str]:
        """One ``error:`` line per failed host, for the exit message."""
        return [f"error: {f.message}" for f in self.failed.values()]
