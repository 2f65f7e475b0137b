"""Artifact pull: a run's outputs from the host to the workstation, resumable and checksummed.

Why not ``Connection.get``: artifacts are large (hidden states, checkpoints) and links drop. So:
rsync over the connection's own SSH settings and verified host key (``HostConnection.ssh_argv``)
where both ends have rsync, else SFTP with prefetch (pipelined reads); both resume a partial file
(rsync ``--append-verify``, SFTP from the partial's size). Files land in ``<dest>/.partial/`` and move
into place only after their SHA-256 matches the run's ``artifacts/SHA256SUMS`` (written on the host
by the wrapper), so a file in ``dest`` is always a verified one; a mismatch (a corrupted or altered
file on the host) is reported by name and never renamed into place.

Large intermediates (the globs a stage lists as ``intermediates`` in its result.json, e.g. extract's
``data_*.pt`` hidden states) stay on the host unless ``include_all`` or an ``include`` glob asks.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

import paramiko

from harness.connection import HostConnection
from harness.errors import HarnessError
from harness import hostcore
from harness.runs import FINAL, check_run_id, local_runs_dir, runctl

CHUNK = 4 << 20
METHODS = ("auto", "rsync", "sftp", "local")


@dataclass
class PullResult:
    host: str
    run_id: str
    dest: Path
    method: str
    files: list[str] = field(default_factory=list)
    left_on_host: list[str] = field(default_factory=list)
    bytes: int = 0           # size of the files pulled (verified)
    transferred: int = 0     # bytes that actually crossed the link (less after a resume)
    seconds: float = 0.0
    result: dict | None = None

    def as_dict(self) -> dict:
        return {"host": self.host, "run_id": self.run_id, "dest": str(self.dest), "method": self.method,
                "files": self.files, "left_on_host": self.left_on_host, "bytes": self.bytes,
                "transferred": self.transferred, "seconds": round(self.seconds, 3),
                "rate_mb_s": round(self.bytes / self.seconds / 1e6, 1) if self.seconds else None}


class _Meter:
    """Bytes done so far, reported to ``on_progress(done, total)`` (the CLI draws the bar), and the
    size of each read: one place for both, handed to every fetcher."""

    def __init__(self, total: int, on_progress: Callable[[int, int], None] | None, chunk: int):
        self.total, self.on_progress, self.chunk = total, on_progress, chunk

    def set(self, done: int) -> None:
        if self.on_progress:
            self.on_progress(done, self.total)


def check_method(conn: HostConnection, method: str) -> None:
    """Refuse a pull method that cannot work here, before anything is fetched or shown."""
    usable = ("auto", "local") if conn.host.is_local else ("auto", "rsync", "sftp")
    if method not in usable:
        why = f"host {conn.name} has transport {conn.host.transport}" if method in METHODS else "unknown method"
        raise HarnessError(f"pull --method {method!r}: {why}; use {', '.join(usable[:-1])} or {usable[-1]}")
    if method == "rsync" and not shutil.which("rsync"):
        raise HarnessError("pull --method rsync: rsync is not installed on this machine; install it "
                           "(apt install rsync) or use --method sftp")


def check_names(conn: HostConnection, run_id: str, names) -> None:
    """Every artifact name must stay inside the artifacts dir: the names come from the host's
    SHA256SUMS, and each is written under ``dest`` here (``../../.bashrc`` must not be)."""
    for rel in names:
        if rel.startswith("/") or ".." in PurePosixPath(rel).parts:
            raise HarnessError(f"host {conn.name}: run {run_id}: artifact name {rel!r} escapes the artifacts dir; "
                               "refusing to pull")


def _select(files: dict, result: dict | None, include_all: bool, include: tuple[str, ...]) -> tuple[list, list]:
    intermediates = list((result or {}).get("intermediates") or [])
    take, leave = [], []
    for rel in sorted(files):
        big = any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(Path(rel).name, g) for g in intermediates)
        wanted = any(fnmatch.fnmatch(rel, g) for g in include)
        (take if include_all or wanted or not big else leave).append(rel)
    return take, leave


def pull(conn: HostConnection, run_id: str, dest: Path | str | None = None, *, include_all: bool = False,
         include: tuple[str, ...] = (), method: str = "auto", bwlimit_kbps: int | None = None,
         on_progress: Callable[[int, int], None] | None = None, chunk: int = CHUNK) -> PullResult:
    """Pull run ``run_id``'s artifacts into ``dest`` (default ``runs/<run-id>/``), verified.

    ``method``: ``auto`` (rsync when the host and this machine have it, else SFTP), ``rsync``, ``sftp``.
    ``on_progress(done, total)`` hears the bytes as they come; ``chunk`` is the size of each read
    (SFTP, local copy, hashing). Raises ``HarnessError`` naming the file when a checksum does not match."""
    check_run_id(run_id)
    check_method(conn, method)
    t0 = time.monotonic()
    man = runctl(conn, "manifest", run_id=run_id)
    st = man["status"]
    if st.get("state") not in FINAL:
        raise HarnessError(f"host {conn.name}: run {run_id} is {st.get('state')}; pull it once it has finished")
    if man["sums"] is None:
        raise HarnessError(f"host {conn.name}: run {run_id} has no artifacts/SHA256SUMS (state {st.get('state')}); "
                           "nothing verified to pull")
    files = man["files"]
    check_names(conn, run_id, files)
    if method == "rsync" and not man.get("has_rsync"):
        raise HarnessError(f"host {conn.name}: pull --method rsync: the host has no rsync; install it there "
                           "or use --method sftp")
    dest = Path(dest) if dest else local_runs_dir() / run_id
    staging = dest / ".partial"
    staging.mkdir(parents=True, exist_ok=True)
    take, leave = _select(files, man.get("result"), include_all, include)
    missing = [r for r in take if files[r]["size"] is None]
    if missing:
        raise HarnessError(f"host {conn.name}: run {run_id}: artifact {missing[0]} is listed in SHA256SUMS but "
                           "missing on the host")
    # already here and verified? then it is not fetched again
    todo = [r for r in take if not ((dest / r).is_file() and (dest / r).stat().st_size == files[r]["size"]
                                    and hostcore.sha256_file(dest / r) == files[r]["sha256"])]
    if method == "auto":
        method = "local" if conn.host.is_local else (
            "rsync" if man.get("has_rsync") and shutil.which("rsync") else "sftp")
    total = sum(files[r]["size"] for r in todo)
    bar = _Meter(total, on_progress if todo else None, chunk)
    res = PullResult(conn.name, run_id, dest, method, files=take, left_on_host=leave,
                     bytes=sum(files[r]["size"] for r in take), result=man.get("result"))
    if todo:
        fetch = {"rsync": _rsync, "sftp": _sftp, "local": _local}[method]
        digests: dict = {}
        res.transferred = fetch(conn, man["artifacts"], todo, files, staging, bar, bwlimit_kbps, digests)
    bad = _verify_and_place(todo, files, staging, dest, digests if todo else None)
    for name, data in (("result.json", man.get("result")), ("status.json", st)):
        if data is not None:
            (dest / name).write_text(json.dumps(data, indent=2, sort_keys=True))
    (dest / "SHA256SUMS").write_text(man["sums"])
    res.seconds = time.monotonic() - t0
    if bad:
        rel, got = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise HarnessError(
            f"host {conn.name}: run {run_id}: artifact {rel} does not match SHA256SUMS (expected "
            f"{files[rel]['sha256'][:12]}..., got {got[:12]}...){more}; the file on the host changed after the run "
            f"wrote it. It was not placed in {dest}; rerun the stage or check the host's disk")
    _prune(staging)
    return res


def _prune(staging: Path) -> None:
    """Remove the staging dir's empty folders (and itself when empty); partial files stay to resume."""
    for d in sorted((p for p in staging.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    if staging.exists() and not any(staging.iterdir()):
        staging.rmdir()


def _verify_and_place(todo, files, staging: Path, dest: Path, digests: dict | None = None) -> list[tuple[str, str]]:
    """Check every staged file against SHA256SUMS (reusing a digest computed while it arrived, when
    that digest covers the whole final file) and rename the good ones into ``dest``."""
    bad = []
    digests = digests or {}
    for rel in todo:
        src = staging / rel
        pre = digests.get(rel)
        if src.is_file() and pre and pre[1] == src.stat().st_size:
            got = pre[0]
        else:
            got = hostcore.sha256_file(src) if src.is_file() else "missing"
        if got != files[rel]["sha256"]:
            bad.append((rel, got))
            src.unlink(missing_ok=True)  # a wrong partial must not be resumed from
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, target)
    return bad


# ---------------------------------------------------------------------------------------------------
# transports

_PROGRESS2 = re.compile(rb"^\s*([\d,]+)\s+\d+%")


class _TailHasher(threading.Thread):
    """Hashes files while rsync writes them, so verification costs no extra pass over the data.

    Only files that did not exist when the pull started are tailed: rsync ``--inplace`` writes a new
    file strictly front to back, so the bytes read here are final. A resumed partial (rewritten or
    appended after a check of its old part) is hashed afresh after the transfer instead."""

    def __init__(self, staging: Path, rels: list[str]):
        super().__init__(daemon=True)
        self.staging = staging
        self.state = {r: [hashlib.sha256(), 0] for r in rels if not (staging / r).exists()}
        self.done = threading.Event()

    def _step(self, final: bool) -> bool:
        moved = False
        for rel, st in self.state.items():
            p = self.staging / rel
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                continue
            if size <= st[1]:
                continue
            with open(p, "rb") as f:
                f.seek(st[1])
                while st[1] < size:
                    chunk = f.read(min(CHUNK, size - st[1]))
                    if not chunk:
                        break
                    st[0].update(chunk)
                    st[1] += len(chunk)
                    moved = True
                    if not final:
                        break
        return moved

    def run(self) -> None:
        while not self.done.is_set():
            if not self._step(False):
                self.done.wait(0.02)

    def finish(self) -> dict:
        self.done.set()
        self.join()
        self._step(True)
        return {rel: (st[0].hexdigest(), st[1]) for rel, st in self.state.items()}


def rsync_ssh_command(conn, known_hosts: str) -> str:
    """The ``rsync -e`` command: the connection's own ssh settings; AES-GCM first where the CPU has
    AES instructions (a third of chacha20's CPU per byte, and on loopback both ends share the CPU)."""
    argv = conn.ssh_argv(known_hosts_file=known_hosts)
    try:
        aes = " aes " in open("/proc/cpuinfo").read()
    except OSError:
        aes = False
    if aes:
        argv[1:1] = ["-o", "Ciphers=^aes128-gcm@openssh.com,aes256-gcm@openssh.com"]
    return " ".join(shlex.quote(a) for a in argv)


def _rsync(conn, remote_dir, todo, files, staging: Path, bar: _Meter, bwlimit, digests: dict) -> int:
    """rsync over ``ssh_argv()`` into the staging dir, in place. A partial file left by an interrupted
    pull continues with --append-verify (rsync then checks the whole file's checksum); a new file
    goes with --whole-file (no delta search: there is no older version of an artifact to diff
    against) and is hashed while it arrives."""
    fresh = [r for r in todo if not (staging / r).exists()]
    partial = [r for r in todo if r not in fresh]
    moved = 0
    with tempfile.TemporaryDirectory(prefix="harness-pull-") as tmp:
        ssh = rsync_ssh_command(conn, os.path.join(tmp, "known_hosts"))
        base = 0
        if partial:
            moved += _rsync_run(conn, ssh, remote_dir, partial, staging, bar, bwlimit, ["--append-verify"], base)[0]
            base = sum(files[r]["size"] for r in partial)
        if fresh:
            tail = _TailHasher(staging, fresh)
            tail.start()
            try:
                n, rewrote = _rsync_run(conn, ssh, remote_dir, fresh, staging, bar, bwlimit, ["--whole-file"], base)
            finally:
                hashed = tail.finish()
            moved += n
            if not rewrote:  # rsync rewrote a file after a failed check: hash the final files afresh
                digests.update(hashed)
    return moved


def _rsync_run(conn, ssh: str, remote_dir: str, rels: list[str], staging: Path, bar: _Meter, bwlimit,
               mode: list[str], base: int) -> tuple[int, bool]:
    argv = ["rsync", "-s", "--inplace", *mode, "--no-compress", "--times", "--stats", "--info=progress2",
            "--no-inc-recursive", "--files-from=-", "-e", ssh]
    if bwlimit:
        argv.append(f"--bwlimit={int(bwlimit)}")
    argv += [f"{conn.ssh_target}:{remote_dir.rstrip('/')}/", str(staging) + "/"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[bytes] = []
    t = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    t.start()
    proc.stdin.write("".join(r + "\n" for r in rels).encode())
    proc.stdin.close()
    out = bytearray()
    buf = b""
    while chunk := proc.stdout.read1(65536):
        out.extend(chunk)
        buf += chunk
        *parts, buf = re.split(rb"[\r\n]", buf)
        for part in parts:
            m = _PROGRESS2.match(part)
            if m:
                bar.set(base + int(m.group(1).replace(b",", b"")))
    rc = proc.wait()
    t.join()
    errtext = err[0].decode(errors="replace") if err else ""
    if rc != 0:
        msg = (errtext.strip().splitlines() or [f"exit {rc}"])[-1]
        raise HarnessError(f"host {conn.name}: rsync failed ({msg}); run the pull again to resume")
    m = re.search(rb"Total bytes received: ([\d,]+)", bytes(out))
    return (int(m.group(1).replace(b",", b"")) if m else 0), "failed verification" in errtext


def _resume_hasher(local: Path, size: int):
    """(hasher over the partial already on disk, its length): resumed data continues that hash."""
    h = hashlib.sha256()
    offset = local.stat().st_size if local.exists() else 0
    if offset > size:
        local.unlink()
        return h, 0
    if offset:
        with open(local, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return h, offset


def _copy_resuming(rel: str, size: int, staging: Path, open_src, bar: _Meter, done: int,
                   digests: dict) -> tuple[int, int]:
    """Copy one file into ``staging`` from where its partial ends, hashing as it goes (the hash
    continues over the partial already there). ``open_src(offset)`` gives a readable positioned at
    ``offset``. Returns (bytes done overall, bytes moved now)."""
    local = staging / rel
    local.parent.mkdir(parents=True, exist_ok=True)
    h, offset = _resume_hasher(local, size)
    done += offset
    moved = 0
    with open_src(offset) as rf, open(local, "ab") as lf:
        while offset < size:
            data = rf.read(min(bar.chunk, size - offset))
            if not data:
                break
            lf.write(data)
            h.update(data)
            offset += len(data)
            done += len(data)
            moved += len(data)
            bar.set(done)
    digests[rel] = (h.hexdigest(), offset)
    return done, moved


_LINK_ERRORS = (OSError, EOFError, paramiko.SSHException)


def _is_prefetch(thread: threading.Thread | None) -> bool:
    """Whether ``thread`` is one of paramiko's SFTP prefetch threads (named after their target)."""
    return thread is not None and thread.name.endswith("(_prefetch_thread)")


class _QuietPrefetch:
    """While an SFTP pull runs: paramiko's prefetch thread (it sends a file's read requests) dies with a
    traceback on stderr when the link drops under it. The pull itself reports the dropped link in one
    line, so that thread's link errors are not printed; every other thread's exception still is."""

    def __enter__(self):
        self._previous = threading.excepthook

        def hook(args, previous=self._previous):
            if _is_prefetch(args.thread) and issubclass(args.exc_type, _LINK_ERRORS):
                return
            previous(args)

        threading.excepthook = hook
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:  # the link dropped: let the prefetch threads die while still quiet
            deadline = time.monotonic() + 2
            for t in filter(_is_prefetch, threading.enumerate()):
                t.join(max(0.0, deadline - time.monotonic()))
        threading.excepthook = self._previous


def _sftp(conn, remote_dir, todo, files, staging: Path, bar: _Meter, bwlimit, digests: dict) -> int:
    """SFTP with prefetch (many read requests in flight), resuming from the partial file's size. A
    link that drops mid-file is reported as such: the partial stays, and the next pull resumes it."""
    done = moved = 0
    sftp = None

    def opener(rel: str, size: int):
        def open_src(offset: int):
            rf = sftp.open(f"{remote_dir.rstrip('/')}/{rel}", "rb")
            rf.seek(offset)
            rf.prefetch(size)
            return rf
        return open_src

    try:
        sftp = conn.client.open_sftp()
        with _QuietPrefetch():
            for rel in todo:
                size = files[rel]["size"]
                done, n = _copy_resuming(rel, size, staging, opener(rel, size), bar, done, digests)
                moved += n
    except _LINK_ERRORS as e:
        raise HarnessError(f"host {conn.name}: SFTP pull failed ({str(e) or type(e).__name__}); "
                           "run the pull again to resume") from None
    finally:
        if sftp is not None:
            try:
                sftp.close()
            except (OSError, EOFError, paramiko.SSHException):
                pass
    return moved


def _local(conn, remote_dir, todo, files, staging: Path, bar: _Meter, bwlimit, digests: dict) -> int:
    """transport local: a plain copy that resumes from the partial's size, like the others."""
    done = moved = 0
    for rel in todo:
        def open_src(offset: int, src=Path(remote_dir) / rel):
            f = open(src, "rb")
            f.seek(offset)
            return f
        done, n = _copy_resuming(rel, files[rel]["size"], staging, open_src, bar, done, digests)
        moved += n
    return moved
