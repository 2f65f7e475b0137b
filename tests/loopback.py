"""Real OpenSSH servers on 127.0.0.1 that stand for GPU hosts (used by the tests and by bench/).

Each "host" is an ``sshd -D`` process with its own generated host key, reached with a generated user
key; several of them stand for several hosts. sshd needs an absolute path, ``UsePAM no``,
``StrictModes no``, 0600 keys and /run/sshd, and cannot bind port 0: a free port is picked and retried.
"""
from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def start_hosts(root: Path, n: int, prefix: str = "host") -> list["SshdHost"]:
    """Start ``n`` loopback hosts under ``root`` sharing one user key (for benchmarks)."""
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    Path(root).mkdir(parents=True, exist_ok=True)
    key, ak = user_keypair(Path(root))
    hosts = []
    for i in range(n):
        d = Path(root) / f"{prefix}{i}"
        d.mkdir(parents=True, exist_ok=True)
        h = SshdHost(name=f"{prefix}{i}", root=d, identity=key, authorized_keys=ak)
        h.start()
        hosts.append(h)
    return hosts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, kind: str = "ed25519") -> str:
    """Generate a key pair; returns the public key line ("type base64")."""
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path), "-C", ""], check=True)
    path.chmod(0o600)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


@dataclass
class SshdHost:
    """One real sshd on loopback: a stand-in GPU host."""

    name: str
    root: Path
    identity: Path
    authorized_keys: Path
    port: int = 0
    host_key: str = ""  # "ssh-ed25519 AAAA..."
    proc: subprocess.Popen | None = None
    extra_config: list[str] = field(default_factory=list)

    @property
    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_key}"

    def write_known_hosts(self, path: Path | None = None) -> Path:
        path = path or (self.root / "known_hosts")
        path.write_text(self.known_hosts_line + "\n")
        return path

    def entry(self, **extra) -> dict:
        """This host as an inventory entry (keys verified through its own known_hosts file)."""
        d = {"address": "127.0.0.1", "port": self.port, "user": getpass.getuser(),
             "identity": str(self.identity), "known_hosts": str(self.write_known_hosts()),
             "python": sys.executable}
        d.update(extra)
        return {k: v for k, v in d.items() if v is not None}

    def start(self) -> None:
        hostkey = self.root / "ssh_host_ed25519_key"
        if not hostkey.exists():
            self.host_key = keygen(hostkey)
        for attempt in range(20):
            port = self.port or free_port()
            cfg = self.root / "sshd_config"
            cfg.write_text("\n".join([
                f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {hostkey}",
                f"PidFile {self.root / 'sshd.pid'}", f"AuthorizedKeysFile {self.authorized_keys}",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no",
                "Subsystem sftp internal-sftp", "AllowTcpForwarding yes", "MaxStartups 200",
                "MaxSessions 100", "LogLevel ERROR", "ClientAliveInterval 0", *self.extra_config, ""]))
            proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                    stderr=open(self.root / "sshd.log", "ab"))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    self.port, self.proc = port, proc
                    return
                except OSError:
                    time.sleep(0.05)
            proc.kill()
            proc.wait()
            if self.port:  # a fixed port that is (still) busy: wait a moment and retry it
                time.sleep(0.3)
        raise RuntimeError(f"sshd for {self.name} did not start: {(self.root / 'sshd.log').read_text()[-500:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port with the same host key (a dropped link for clients)."""
        self.stop()
        self.start()

    def rekey(self) -> None:
        """Give the host a new host key (as after a reinstall) and restart it."""
        self.stop()
        hostkey = self.root / "ssh_host_ed25519_key"
        hostkey.unlink()
        hostkey.with_suffix(".pub").unlink()
        self.start()


def user_keypair(d: Path) -> tuple[Path, Path]:
    """A user key pair in ``d`` and an authorized_keys file accepting it."""
    key = d / "id_ed25519"
    pub = keygen(key)
    ak = d / "authorized_keys"
    ak.write_text(pub + "\n")
    return key, ak
