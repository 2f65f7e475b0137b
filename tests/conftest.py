"""Test fixtures: real OpenSSH servers on 127.0.0.1 standing for GPU hosts, and real python
environments with speculators installed from PyPI standing for the hosts' interpreters.

No SSH, file system or library is mocked: each "host" is an ``sshd -D`` process with its own generated
host key, reached with a generated user key; several of them stand for several hosts.
"""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("EAGLE_HARNESS_CACHE", "~/.cache/eagle-harness")).expanduser()


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


@pytest.fixture(scope="session")
def user_key(tmp_path_factory) -> tuple[Path, Path]:
    """A user key pair and an authorized_keys file accepting it."""
    d = tmp_path_factory.mktemp("userkey")
    key = d / "id_ed25519"
    pub = keygen(key)
    ak = d / "authorized_keys"
    ak.write_text(pub + "\n")
    return key, ak


@pytest.fixture(scope="session")
def sshd_factory(tmp_path_factory, user_key):
    """``make(name, extra_config=[...]) -> SshdHost``: start a fresh sshd; all are stopped at the end."""
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    started: list[SshdHost] = []

    def make(name: str = "host", extra_config: list[str] | None = None) -> SshdHost:
        h = SshdHost(name=name, root=tmp_path_factory.mktemp(f"sshd-{name}"), identity=user_key[0],
                     authorized_keys=user_key[1], extra_config=extra_config or [])
        h.start()
        started.append(h)
        return h

    yield make
    for h in started:
        h.stop()


@pytest.fixture(scope="session")
def sshd_hosts(sshd_factory):
    """``get(n) -> [SshdHost]``: n long-lived loopback hosts shared by the session (host0, host1, ...)."""
    pool: list[SshdHost] = []

    def get(n: int) -> list[SshdHost]:
        while len(pool) < n:
            pool.append(sshd_factory(f"host{len(pool)}"))
        for h in pool[:n]:
            if h.proc is None or h.proc.poll() is not None:
                h.start()
        return pool[:n]

    return get


@pytest.fixture
def sshd(sshd_hosts) -> SshdHost:
    return sshd_hosts(1)[0]


def write_inventory(path: Path, hosts: dict, **top) -> Path:
    """Write an inventory.yaml with these host entries (and any top-level sections)."""
    path = Path(path)
    if path.is_dir():
        path = path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": hosts, **top}, sort_keys=False))
    return path


@pytest.fixture
def inventory_file(tmp_path):
    return lambda hosts, **top: write_inventory(tmp_path / "inventory.yaml", hosts, **top)


# ------------------------------------------------------------------------------------------------
# real python environments with speculators from PyPI

def make_venv(path: Path, *pip_args: str, system_site_packages: bool = False) -> Path:
    """A venv at ``path`` with ``pip install *pip_args`` done; returns its python."""
    args = [sys.executable, "-m", "venv", str(path)]
    if system_site_packages:
        args.insert(3, "--system-site-packages")
    subprocess.run(args, check=True)
    py = path / "bin" / "python"
    if pip_args:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--cache-dir", str(CACHE / "pip"), *pip_args], check=True)
    return py


@pytest.fixture(scope="session")
def speculators_env(tmp_path_factory):
    """``get(version) -> python``: a venv with that speculators version installed from its PyPI wheel
    (``--no-deps``: the audit and the patch tool read its files and metadata, they do not import it)."""
    envs: dict[str, Path] = {}

    def get(version: str = "0.3.0", fresh: bool = False) -> Path:
        if fresh or version not in envs:
            d = tmp_path_factory.mktemp(f"venv-spec-{version}")
            envs[version] = make_venv(d / "venv", "--no-deps", f"speculators=={version}")
        return envs[version]

    return get


def run_inv(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real ``inv`` CLI of this repo (so exit codes and output are what a user sees)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args],
                          cwd=cwd or REPO, env=e, capture_output=True, text=True, timeout=timeout)
