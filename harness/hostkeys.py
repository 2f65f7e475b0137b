"""Host keys: what the workstation has recorded for a host (its known_hosts files, hashed names included,
and a key pinned in the inventory), the policy that refuses any other key, and the key a host offers
(for ``inv hosts.trust``). A key is verified, never added on the fly.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

import paramiko

from harness.endpoint import Endpoint, known_hosts_name
from harness.errors import HarnessError


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:...`` fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class RejectAndRemember(paramiko.MissingHostKeyPolicy):
    """Refuse an unknown host key, keeping it so the error (and ``hosts.trust``) can show it."""

    def __init__(self) -> None:
        self.seen: tuple[str, paramiko.PKey] | None = None

    def missing_host_key(self, client, hostname, key):
        self.seen = (hostname, key)
        raise paramiko.SSHException(f"unknown host key for {hostname}")


def host_keys(ep: Endpoint) -> paramiko.HostKeys:
    """The recorded keys of this one host (its known_hosts name, as paramiko looks it up), from the
    known_hosts files and the pinned key. Only the lines that name the host are parsed: paramiko's
    ``HostKeys.load`` parses every key of a file and checks each name against all entries before it
    (an HMAC each for hashed names, Debian's default), which grows with the square of the file."""
    name = known_hosts_name(ep.hostname, ep.port)
    keys = paramiko.HostKeys()
    for p in ep.known_hosts:
        if not p.is_file():
            continue
        try:
            lines = _lines_naming(p, name)
        except OSError as e:
            raise HarnessError(f"host {ep.host.name}: cannot read known_hosts file {p}: {e.strerror or e}")
        for lineno, line in lines:
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
            except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey) as e:
                raise HarnessError(f"host {ep.host.name}: known_hosts file {p}:{lineno}: the key for {name} "
                                   f"does not decode ({getattr(e, 'exc', e)}); fix or remove that line")
            # None: a key type paramiko does not know, which its own load skips; of two lines with keys
            # of one type, the first counts, as with paramiko's load
            if entry is not None and entry.key.get_name() not in (keys.lookup(name) or {}):
                keys.add(name, entry.key.get_name(), entry.key)
    for line in ep.pinned:
        entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
        if entry is None:
            raise HarnessError(f"host {ep.host.name}: host_key is not a valid public key line")
        for n in entry.hostnames:
            keys.add(n, entry.key.get_name(), entry.key)
    return keys


def _lines_naming(path: Path, name: str) -> list[tuple[int, str]]:
    """(line number, line) of the known_hosts lines whose host field names ``name``, plainly or hashed
    (``|1|salt|hmac``): the matches paramiko's own lookup makes. Markers (@cert-authority, @revoked)
    and patterns are not paramiko's, and not matched here either."""
    out = []
    with open(path, errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for h in line.split(None, 1)[0].split(","):
                if h == name or (h.startswith("|1|") and _hashed_name_is(h, name)):
                    out.append((lineno, line))
                    break
    return out


def _hashed_name_is(hashed: str, name: str) -> bool:
    parts = hashed.split("|")
    if len(parts) != 4:
        return False
    try:
        salt, digest = base64.b64decode(parts[2]), base64.b64decode(parts[3])
    except ValueError:
        return False
    return hmac.compare_digest(hmac.new(salt, name.encode(), "sha1").digest(), digest)


def known_hosts_text(ep: Endpoint) -> str:
    """The known_hosts lines of every hop (pinned keys included), for an OpenSSH that must verify
    exactly what paramiko verifies."""
    lines = []
    for hop in ep.hops():
        for p in hop.known_hosts:
            if p.is_file():
                lines.append(p.read_text())
        lines.extend(l + "\n" for l in hop.pinned)
    return "".join(lines)
