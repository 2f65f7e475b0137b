"""Connections to hosts: one verified SSH session (or this machine, for ``transport: local``) per host.

Why not plain ``fabric.Connection().run()``: Fabric auto-adds unknown host keys, and Invoke feeds a
command's stdin a byte at a time with a sleep after each. So the Fabric Connection here is built with paramiko's
``RejectPolicy`` and the inventory's known_hosts / pinned key, and commands are run on a raw paramiko
channel whose stdin is written in one ``sendall`` — a whole script reaches the host in one round trip.

``HostConnection`` gives the same small API for both transports:

* ``exec(cmd, stdin=None)`` — one shell command, one round trip, ``ExecResult(rc, stdout, stderr)``;
* ``run_script(entry, spec, modules=())`` — ship ``remote/tools/<entry>.py`` (plus helper modules and what
  ``REMOTE_DEPS`` says they import) and a JSON spec over stdin to the host's python, call
  ``main(spec)`` there, return its dict;
* ``ssh_argv()`` (for rsync ``-e``), ``close()``.
"""
from __future__ import annotations

import functools
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import fabric
import paramiko

from harness import remote_source
from harness.endpoint import Endpoint, endpoint_for, known_hosts_name
from harness.errors import HarnessError, HostKeyError, HostUnreachable, RemoteError
from harness.hostkeys import RejectAndRemember, fingerprint, host_keys, known_hosts_text
from harness.inventory import HostSpec, Inventory

CONNECT_TIMEOUT = 10
KEEPALIVE_SECONDS = 15

#: remote/ modules that a shipped module imports: run_script ships them along (one place to say it)
REMOTE_DEPS: dict[str, tuple[str, ...]] = {
    "probe": ("distinfo",),
    "patchtool": ("patchstate", "diffapply", "filetxn", "probe", "distinfo"),
    "filetxn": ("patchstate", "probe", "distinfo"),
    "patchstate": ("probe", "distinfo"),
    "apicheck": ("distinfo", "vllmuses"),
    "runctl": ("probe", "distinfo"),
    "plan": ("probe", "runctl", "distinfo"),
}


def with_deps(names: Iterable[str]) -> list[str]:
    """``names`` plus every module they import from remote/ (transitively), each once, in order; the host
    core (remote/hostcore.py) always."""
    out: list[str] = ["hostcore"]

    def add(n: str) -> None:
        if n not in out:
            out.append(n)
            for dep in REMOTE_DEPS.get(n, ()):
                add(dep)

    for n in names:
        add(n)
    return out


# Reads {"modules": {name: source}, "entry": name, "spec": {...}} from stdin, makes the modules
# importable by name (a sys.meta_path finder ahead of the host's own), imports the entry, calls its
# main(spec) and prints {"ok": true, "result"} or {"ok": false, "kind", "error"} as JSON on stdout: an
# exception whose ``kind`` attribute is a string (e.g. runctl's Refused) is a refusal of that kind,
# SystemExit is a "refused", anything else an "exception" (with its traceback). A module is compiled only when
# something imports it (compiling costs a host's CPU in proportion to the source): the audit ships the
# vLLM API check to every host, but a host without vLLM never needs it.
_BOOTSTRAP = r"""
import json, sys
if sys.version_info < (3, 8):
    sys.stdout.write(json.dumps({"ok": False, "error": "python %d.%d is too old: the harness needs >= 3.8; "
                                 "point 'python' at a newer interpreter" % sys.version_info[:2]}))
    sys.exit(0)
from importlib.machinery import ModuleSpec
d = json.loads(sys.stdin.buffer.read())
class Shipped:
    sources = d["modules"]
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return ModuleSpec(name, cls) if name in cls.sources else None
    @staticmethod
    def create_module(spec):
        return None
    @classmethod
    def exec_module(cls, m):
        m.__file__ = "<remote/tools/%s.py>" % m.__name__
        exec(compile(cls.sources[m.__name__], "remote/tools/%s.py" % m.__name__, "exec"), m.__dict__)
sys.meta_path.insert(0, Shipped)
out = sys.stdout; sys.stdout = sys.stderr
try:
    r = {"ok": True, "result": __import__(d["entry"]).main(d["spec"])}
except SystemExit as e:
    r = {"ok": False, "kind": "refused", "error": str(e.code) if not isinstance(e.code, int) else "exit %d" % e.code}
except BaseException as e:
    if isinstance(getattr(e, "kind", None), str):
        r = {"ok": False, "kind": e.kind, "error": str(e)}
    else:
        import traceback
        r = {"ok": False, "kind": "exception", "error": "%s: %s" % (type(e).__name__, e),
             "traceback": traceback.format_exc()}
out.write(json.dumps(r)); out.flush()
"""


@dataclass
class ExecResult:
    rc: int
    stdout: str
    stderr: str


def shell_path(path: str) -> str:
    """Quote a host path for the shell while keeping a leading ``~/`` expandable (as ``"$HOME"/...``)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


@functools.lru_cache(maxsize=None)
def _fabric_config() -> "fabric.Config":
    """One Fabric Config for every connection (building one is invoke's whole config merge); a
    Connection only reads it."""
    return fabric.Config(overrides={"load_ssh_configs": False})


def fabric_connection(ep: Endpoint, timeout: float):
    """A Fabric Connection for ``ep`` that verifies host keys (Fabric's default auto-adds them).

    ~/.ssh/config was already applied by ``endpoint_for``, so Fabric's own ssh_config loading is off.
    Returns ``(connection, policy)``; the policy remembers an unknown key for the error message.
    """
    kwargs = {"look_for_keys": not ep.identity, "allow_agent": not ep.identity,
              "banner_timeout": timeout, "auth_timeout": timeout}
    if ep.identity:  # Fabric cannot take key_filename=None
        kwargs["key_filename"] = ep.identity
    conn = fabric.Connection(ep.hostname, user=ep.user, port=ep.port, config=_fabric_config(),
                             connect_timeout=timeout, connect_kwargs=kwargs)
    policy = RejectAndRemember()
    conn.client.set_missing_host_key_policy(policy)
    for name, per_type in host_keys(ep).items():
        for ktype, key in per_type.items():
            conn.client.get_host_keys().add(name, ktype, key)
    return conn, policy


class _PromptSocket(socket.socket):
    """A TCP socket that neither holds back our small packets nor delays its ACKs of the host's.

    An SSH exchange is a train of small packets, which is what Nagle's algorithm and delayed ACKs are
    worst at: without TCP_NODELAY and quick ACKs each key-exchange step, and the first channel opened
    (sshd holds its confirmation back, by Nagle, until two earlier messages are acknowledged), waits
    out the kernel's delayed-ACK timer. TCP_QUICKACK is not sticky, so it is set again after each read
    (Linux only; elsewhere only TCP_NODELAY applies)."""

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if _QUICKACK is not None and data:
            try:
                self.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
            except OSError:
                pass
        return data


_QUICKACK = getattr(socket, "TCP_QUICKACK", None)


def prompt_connection(hostname: str, port: int, timeout: float) -> socket.socket:
    """``socket.create_connection`` for SSH: a ``_PromptSocket`` with TCP_NODELAY set."""
    plain = socket.create_connection((hostname, port), timeout=timeout)
    sock = _PromptSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
    sock.settimeout(timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    return sock


def reach(ep: Endpoint, timeout: float, via: "fabric.Connection | None" = None):
    """The one way to a host's SSH port: a tuned TCP socket, or, behind a jump host, a ``direct-tcpip``
    channel of the jump host's own verified session ``via`` (what OpenSSH's ``-W`` opens for rsync)."""
    if via is None:
        return prompt_connection(ep.hostname, ep.port, timeout)
    try:
        return via.transport.open_channel("direct-tcpip", (ep.hostname, ep.port), ("127.0.0.1", 0), timeout=timeout)
    except paramiko.ChannelException as e:
        raise HostUnreachable(f"host {ep.host.name}: unreachable through jump host {ep.jump.host.name}: "
                              f"{ep.hostname}:{ep.port}: {e.text}") from None


def _open(ep: Endpoint, timeout: float, via=None):
    """Open ``ep``'s Fabric connection, turning every failure into one line that names the host."""
    conn, policy = fabric_connection(ep, timeout)
    name = ep.host.name
    try:
        conn.connect_kwargs["sock"] = reach(ep, timeout, via)
        try:
            conn.open()
        except BaseException:
            conn.client.close()
            conn.connect_kwargs["sock"].close()
            raise
    except paramiko.BadHostKeyException as e:
        raise HostKeyError(
            f"host {name}: HOST KEY CHANGED for {known_hosts_name(ep.hostname, ep.port)}: it offered "
            f"{fingerprint(e.key)} but {fingerprint(e.expected_key)} is recorded; refusing to connect "
            "(if the host was really reinstalled, remove the old key from known_hosts, then run inv hosts.trust)")
    except paramiko.AuthenticationException as e:
        raise HostUnreachable(f"host {name}: authentication failed for user {ep.user} ({e}); check 'user' and 'identity'")
    except paramiko.SSHException as e:
        if policy.seen:
            raise HostKeyError(
                f"host {name}: unknown host key {fingerprint(policy.seen[1])} for "
                f"{known_hosts_name(ep.hostname, ep.port)}; verify it, then run: inv hosts.trust --hosts {name}")
        raise HostUnreachable(f"host {name}: SSH error at {ep.hostname}:{ep.port}: {e}")
    except (socket.timeout, TimeoutError):
        raise HostUnreachable(f"host {name}: unreachable: no answer from {ep.hostname}:{ep.port} within {timeout:g}s")
    except EOFError:  # paramiko's word for a connection the host (or the link) closed mid-handshake
        raise HostUnreachable(f"host {name}: unreachable: {ep.hostname}:{ep.port} closed the connection "
                              "during the SSH handshake")
    except OSError as e:
        raise HostUnreachable(f"host {name}: unreachable: {ep.hostname}:{ep.port}: {e.strerror or e}")
    conn.transport.set_keepalive(KEEPALIVE_SECONDS)
    return conn


def _jump_session(ep: Endpoint, timeout: float):
    """(the session of ``ep``'s jump host or None, every session opened for it): each hop is reached and
    verified the same way as the host itself."""
    if ep.proxy_jump and ep.jump is None:
        raise HarnessError(
            f"host {ep.host.name}: ~/.ssh/config gives ProxyJump {ep.proxy_jump}; name it in the inventory's 'jump' field instead")
    if ep.jump is None:
        return None, []
    via, hops = _connect_chain(ep.jump, timeout)
    return via, hops + [via]


def _connect_chain(ep: Endpoint, timeout: float):
    """Open ``ep`` through its jump hosts (if any); every hop's key is verified. Returns (conn, hops)."""
    via, hops = _jump_session(ep, timeout)
    try:
        return _open(ep, timeout, via), hops
    except BaseException:
        for h in reversed(hops):
            h.close()
        raise


def _pump(chan: paramiko.Channel, stdin: bytes | None,
          on_stdout: Callable[[str], None] | None, on_stderr: Callable[[str], None] | None,
          timeout: float | None) -> ExecResult:
    """Write stdin in one go on a thread, and read both streams until the command exits."""
    if stdin is not None:
        def feed():
            try:
                chan.sendall(stdin)
                chan.shutdown_write()
            except (OSError, EOFError, paramiko.SSHException):
                pass
        threading.Thread(target=feed, daemon=True).start()
    else:
        chan.shutdown_write()
    out, err = bytearray(), bytearray()
    line_buf = {1: bytearray(), 2: bytearray()}

    def emit(kind: int, data: bytes, cb):
        if cb is None:
            return
        buf = line_buf[kind]
        buf.extend(data)
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            cb(line.decode(errors="replace"))

    deadline = time.monotonic() + timeout if timeout else None
    chan.settimeout(0.2)
    while True:
        got = False
        if chan.recv_ready():
            data = chan.recv(65536)
            out.extend(data); emit(1, data, on_stdout); got = True
        if chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            err.extend(data); emit(2, data, on_stderr); got = True
        if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if chan.closed and not got:
            break
        if deadline and time.monotonic() > deadline:
            chan.close()
            raise TimeoutError
        if not got:
            # asleep until either stream has data or the channel's EOF (paramiko's pipe behind
            # fileno()), not polled: polling burns CPU for as long as the command runs. After
            # EOF the pipe stays readable while the exit status is on its way: a short nap then
            if select.select([chan], [], [], 0.2)[0] and chan.eof_received:
                time.sleep(0.001)
    rc = chan.recv_exit_status() if chan.exit_status_ready() else -1
    for kind, cb in ((1, on_stdout), (2, on_stderr)):
        if cb and line_buf[kind]:
            cb(bytes(line_buf[kind]).decode(errors="replace"))
    return ExecResult(rc, out.decode(errors="replace"), err.decode(errors="replace"))


class HostConnection:
    """One host, one session: SSH through a verified paramiko client, or a local shell."""

    def __init__(self, host: HostSpec, inv: Inventory | None = None, timeout: float = CONNECT_TIMEOUT):
        self.host = host
        self.inv = inv
        self.timeout = timeout
        self.endpoint: Endpoint | None = None
        self._conn: fabric.Connection | None = None
        self._hops: list[fabric.Connection] = []
        #: how many commands (round trips) this connection has run; benchmarks and tests read it
        self.round_trips = 0

    @property
    def name(self) -> str:
        return self.host.name

    # -- lifecycle ---------------------------------------------------------------------------------
    def open(self) -> "HostConnection":
        if self.host.is_local or self._conn is not None:
            return self
        self.endpoint = endpoint_for(self.host, self.inv)
        self._conn, self._hops = _connect_chain(self.endpoint, self.timeout)
        return self

    def close(self) -> None:
        for c in [self._conn, *reversed(self._hops)]:
            if c is not None:
                c.close()
        self._conn, self._hops = None, []

    def __enter__(self) -> "HostConnection":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def fabric(self) -> fabric.Connection:
        """The verified Fabric Connection (ssh transport only), for anything beyond this API."""
        if self.host.is_local:
            raise HarnessError(f"host {self.name}: transport local has no SSH connection")
        self.open()
        assert self._conn is not None
        return self._conn

    @property
    def client(self) -> paramiko.SSHClient:
        return self.fabric.client

    # -- commands ----------------------------------------------------------------------------------
    def exec(self, cmd: str, stdin: bytes | Callable[[], bytes] | None = None, timeout: float | None = None,
             on_stdout: Callable[[str], None] | None = None,
             on_stderr: Callable[[str], None] | None = None) -> ExecResult:
        """Run one shell command on the host (``bash -c`` semantics; quote values yourself).

        ``stdin`` may be a callable: it is called once the command has started, so the host starts
        its shell and interpreter while this side is still building what to send."""
        self.round_trips += 1
        if self.host.is_local:
            return self._exec_local(cmd, stdin, timeout, on_stdout, on_stderr)
        try:
            chan = self.client.get_transport().open_session(timeout=self.timeout)
            chan.exec_command(cmd)
            return _pump(chan, stdin() if callable(stdin) else stdin, on_stdout, on_stderr, timeout)
        except TimeoutError:
            raise HarnessError(f"host {self.name}: command timed out after {timeout}s")
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise HostUnreachable(f"host {self.name}: connection lost: {e or type(e).__name__}")

    def _exec_local(self, cmd, stdin, timeout, on_stdout, on_stderr) -> ExecResult:
        proc = subprocess.Popen(["bash", "-c", cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        if callable(stdin):
            stdin = stdin()
        if on_stdout is None and on_stderr is None:
            try:
                out, err = proc.communicate(stdin, timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise HarnessError(f"host {self.name}: command timed out after {timeout}s")
            return ExecResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
        chunks: dict[int, list[str]] = {1: [], 2: []}

        def reader(stream, kind, cb):
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace")
                chunks[kind].append(line)
                if cb:
                    cb(line.rstrip("\n"))

        threads = [threading.Thread(target=reader, args=(proc.stdout, 1, on_stdout), daemon=True),
                   threading.Thread(target=reader, args=(proc.stderr, 2, on_stderr), daemon=True)]
        for t in threads:
            t.start()
        if stdin:
            proc.stdin.write(stdin)
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise HarnessError(f"host {self.name}: command timed out after {timeout}s")
        for t in threads:
            t.join()
        return ExecResult(proc.returncode, "".join(chunks[1]), "".join(chunks[2]))

    @property
    def python(self) -> str:
        return shell_path(self.host.python)

    def run_script(self, entry: str, spec: dict | Callable[[], dict], modules: Iterable[str] = (),
                   timeout: float | None = None, remote_dir: Path | None = None) -> dict:
        """Run ``remote/tools/<entry>.py``'s ``main(spec)`` on the host's python, in one round trip.
        ``spec`` may be a callable, called while the host starts its interpreter (see ``exec``)."""
        modules = with_deps([entry, *modules])

        def source(n: str) -> str:
            return (remote_dir / f"{n}.py" if remote_dir and (remote_dir / f"{n}.py").exists()
                    else remote_source(n)).read_text()

        def payload() -> bytes:
            return json.dumps({"modules": {n: source(n) for n in modules}, "entry": entry,
                               "spec": spec() if callable(spec) else spec}).encode()

        cmd = f"{self.python} -c {shlex.quote(_BOOTSTRAP)}"
        res = self.exec(cmd, stdin=payload, timeout=timeout)
        try:
            reply = json.loads(res.stdout)
        except json.JSONDecodeError:
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
            if res.rc == -1:  # the channel closed without an exit status: the link, not the script
                raise HostUnreachable(f"host {self.name}: connection lost while remote/tools/{entry}.py ran")
            if res.rc in (126, 127):  # the shell's own codes: command not found / not executable
                raise HarnessError(
                    f"host {self.name}: python interpreter {self.host.python!r} not found on the host "
                    f"({tail}); fix 'python' in the inventory or run inv setup", kind="no python")
            raise RemoteError(f"host {self.name}: remote/tools/{entry}.py failed (exit {res.rc}): {tail}",
                              kind="exception")
        if not reply.get("ok"):
            kind = reply.get("kind") or "exception"
            # a refusal is the host's one line; a crash also says which script crashed
            where = f"{entry}: " if kind == "exception" else ""
            raise RemoteError(f"host {self.name}: {where}{reply.get('error')}", kind=kind)
        return reply["result"]

    # -- files -------------------------------------------------------------------------------------
    def ssh_argv(self, known_hosts_file: str | None = None) -> list[str]:
        """An OpenSSH command line with this host's settings (for ``rsync -e``): same port, key,
        user, verified host keys (``StrictHostKeyChecking yes``) and jump hosts, reached as ``reach``
        reaches them: a ``direct-tcpip`` channel (``-W``) of each jump host's own session.

        ``known_hosts_file`` receives the known_hosts lines of every hop (pinned keys included) so
        OpenSSH verifies exactly what paramiko verified; callers pass a temp file path.
        """
        if self.host.is_local:
            raise HarnessError(f"host {self.name}: transport local has no ssh command line")
        if known_hosts_file is None:
            raise HarnessError("ssh_argv needs a known_hosts_file to write the verified keys to")
        ep = self.endpoint or endpoint_for(self.host, self.inv)
        Path(known_hosts_file).write_text(known_hosts_text(ep))
        common = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                  "-o", f"UserKnownHostsFile={known_hosts_file}", "-o", "GlobalKnownHostsFile=/dev/null",
                  "-o", f"ConnectTimeout={int(self.timeout)}", "-o", f"ServerAliveInterval={KEEPALIVE_SECONDS}",
                  "-F", "/dev/null"]
        return _openssh_argv(ep, common)

    @property
    def ssh_target(self) -> str:
        ep = self.endpoint or endpoint_for(self.host, self.inv)
        return ep.hostname


def _openssh_argv(ep: Endpoint, common: list[str]) -> list[str]:
    """``ssh`` options reaching ``ep`` (the destination left to the caller): each jump host by a
    ProxyCommand of its own (its identity and port), nested for a chain. A ``%`` of an inner
    command is doubled, so that only this level's ``-W %h:%p`` is expanded here."""
    argv = ["ssh", *common]
    for ident in ep.identity:
        argv += ["-i", ident, "-o", "IdentitiesOnly=yes"]
    if ep.jump is not None:
        inner = " ".join(shlex.quote(a) for a in _openssh_argv(ep.jump, common)).replace("%", "%%")
        argv += ["-o", f"ProxyCommand={inner} -W %h:%p {shlex.quote(ep.jump.hostname)}"]
    return argv + ["-p", str(ep.port), "-l", ep.user]


def open_host(host: HostSpec, inv: Inventory | None = None, timeout: float = CONNECT_TIMEOUT) -> HostConnection:
    """Open a verified connection to ``host`` (raises HostKeyError / HostUnreachable, one line each)."""
    return HostConnection(host, inv, timeout).open()


def scan_host_key(host: HostSpec, inv: Inventory | None = None, timeout: float = CONNECT_TIMEOUT):
    """The key a host offers, fetched without authenticating (for ``hosts.trust``).

    Returns ``(known_hosts_name, key, status)`` with status ``known``, ``unknown`` or ``changed``.
    """
    ep = endpoint_for(host, inv)
    via, hops = _jump_session(ep, timeout)
    try:
        try:
            sock = reach(ep, timeout, via)
        except OSError as e:
            raise HostUnreachable(f"host {host.name}: unreachable: {ep.hostname}:{ep.port}: {e.strerror or e}")
        t = paramiko.Transport(sock)
        try:
            known = host_keys(ep)
            name = known_hosts_name(ep.hostname, ep.port)
            recorded = known.lookup(name) or {}
            if recorded:
                opts = t.get_security_options()
                first = list(recorded.keys())[0]
                opts.key_types = [first] + [k for k in opts.key_types if k != first]
            t.start_client(timeout=timeout)
            key = t.get_remote_server_key()
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise HostUnreachable(f"host {host.name}: SSH handshake with {ep.hostname}:{ep.port} failed: {e}")
        finally:
            t.close()
        if key.get_name() in recorded:
            status = "known" if recorded[key.get_name()] == key else "changed"
        else:
            status = "changed" if recorded else "unknown"
        return name, key, status
    finally:
        for h in reversed(hops):
            h.close()
