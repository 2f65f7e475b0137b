"""Where a host is and how to log in to it: the inventory's entry combined with ~/.ssh/config, as ssh would
combine them (an alias's HostName, Port, User, IdentityFile, UserKnownHostsFile), and its jump host, an
inventory host or ``user@host:port``, resolved the same way. Data only: nothing here opens a socket.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from harness.errors import HarnessError
from harness.inventory import HostSpec, Inventory, expand_local, split_host_key


def known_hosts_name(address: str, port: int) -> str:
    """The name known_hosts records a host under: ``address``, or ``[address]:port`` off port 22."""
    return address if port == 22 else f"[{address}]:{port}"


@dataclass
class Endpoint:
    """Where and how to reach a host over SSH, after ~/.ssh/config and the inventory are combined."""

    host: HostSpec
    hostname: str
    port: int
    user: str
    jump: "Endpoint | None" = None  # the jump host, resolved the same way
    proxy_jump: str | None = None  # from ~/.ssh/config, when the inventory names none (refused: name it there)
    identity: list[str] = field(default_factory=list)  # key files, the inventory's or ~/.ssh/config's
    known_hosts: list[Path] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)  # known_hosts lines built from host_key

    def hops(self) -> list["Endpoint"]:
        """This endpoint and every jump host behind it, nearest the target first."""
        return [self, *(self.jump.hops() if self.jump else [])]


def _ssh_config_for(alias: str) -> dict:
    cfg = paramiko.SSHConfig()
    path = Path("~/.ssh/config").expanduser()
    if path.is_file():
        with open(path) as f:
            cfg.parse(f)
    return cfg.lookup(alias)


def endpoint_for(host: HostSpec, inv: Inventory | None, _depth: int = 0) -> Endpoint:
    """Resolve a host's address as ssh would (~/.ssh/config aliases), plus key files and jump host."""
    if _depth > 4:
        raise HarnessError(f"host {host.name}: jump host chain too long (a loop in 'jump'?)")
    base = Path(inv.source).parent if inv and inv.source else None
    sc = _ssh_config_for(host.address or host.name)
    hostname = sc.get("hostname", host.address)
    port = host.port or int(sc.get("port", 22))
    user = host.user or sc.get("user") or os.environ.get("USER") or "root"
    identity = [str(expand_local(host.identity, base))] if host.identity else [
        str(Path(p).expanduser()) for p in sc.get("identityfile", [])]
    known = [expand_local(host.known_hosts, base)] if host.known_hosts else []
    for default in sc.get("userknownhostsfile", "~/.ssh/known_hosts").split():
        p = Path(default).expanduser()
        if p not in known:
            known.append(p)
    pinned = []
    if host.host_key:
        ktype, body = split_host_key(host.host_key)
        pinned.append(f"{known_hosts_name(hostname, port)} {ktype} {body}")
    ep = Endpoint(host=host, hostname=hostname, port=port, user=user, identity=identity,
                  known_hosts=known, pinned=pinned)
    if host.jump:
        if inv and host.jump in inv.hosts:
            ep.jump = endpoint_for(inv.hosts[host.jump], inv, _depth + 1)
        else:
            user_part, _, rest = host.jump.rpartition("@")
            jhost, _, jport = rest.partition(":")
            spec = HostSpec(name=host.jump, address=jhost, port=int(jport) if jport else None,
                            user=user_part or None, identity=host.identity, known_hosts=host.known_hosts)
            ep.jump = endpoint_for(spec, inv, _depth + 1)
    elif sc.get("proxyjump"):
        ep.proxy_jump = sc["proxyjump"]
    return ep
