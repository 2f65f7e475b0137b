"""``inv hosts.trust``: look at a host's key, show its fingerprint, and record it only when confirmed.

A changed key is never recorded here: that is the one case that must stay loud.
"""
from __future__ import annotations

from pathlib import Path

from harness.connection import scan_host_key
from harness.endpoint import endpoint_for
from harness.hostkeys import fingerprint
from harness.errors import HostKeyError
from harness.inventory import HostSpec, Inventory, expand_local


def known_hosts_file(inv: Inventory, host: HostSpec) -> Path:
    """Where a trusted key is written: the host's ``known_hosts`` file, else ~/.ssh/known_hosts."""
    if host.known_hosts:
        return expand_local(host.known_hosts, Path(inv.source).parent if inv.source else None)
    return Path("~/.ssh/known_hosts").expanduser()


def trust(inv: Inventory, host: HostSpec, yes: bool) -> dict:
    """Scan the host's key; with ``yes``, append it to the known_hosts file. Returns what happened."""
    name, key, status = scan_host_key(host, inv)
    fp = fingerprint(key)
    out = {"host": host.name, "address": name, "key_type": key.get_name(), "fingerprint": fp, "status": status}
    if status == "changed":
        raise HostKeyError(
            f"host {host.name}: HOST KEY CHANGED for {name}: it now offers {fp}; refusing to record it "
            "(remove the old line from known_hosts yourself if the host was really reinstalled)")
    if status == "known":
        out["action"] = "already trusted"
        return out
    if not yes:
        out["action"] = "not recorded (re-run with --yes after checking the fingerprint)"
        return out
    path = known_hosts_file(inv, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    with open(path, "a") as f:
        if text and not text.endswith("\n"):
            f.write("\n")
        f.write(f"{name} {key.get_name()} {key.get_base64()}\n")
    out["action"] = f"recorded in {path}"
    return out


__all__ = ["trust", "known_hosts_file", "endpoint_for"]
