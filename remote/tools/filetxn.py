"""A journaled file transaction (stdlib only): replace several files of an installed package all or
nothing, and finish the transaction a killed process left behind.

Each package's environment (``target``: ``envdir``, its state directory under the workdir, and
``path(rel)``, a file of the package) has a lock, a journal and staged copies. A transaction stages
every new file, writes the journal (the files' hashes before and after), then swaps the files in one
rename each; a live failure puts the old bytes back, a kill leaves the journal, and ``recover`` rolls
it forward on the next call. Every write is durable (fsynced with its directory): a patched package
must survive a power cut as well as a dropped link.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path

from hostcore import TEMP_MARK, Refused, fsync_dir, proc_start, read_json, write_bytes
from patchstate import file_sha, sha256_hex

#: hostcore.write_bytes' temp files are ``.<name>.eh-<pid>`` beside the file they replace
_TEMP = re.compile(r"^\.(?P<name>.+)" + re.escape(TEMP_MARK) + r"(?P<pid>\d+)$")


def drop_temp_files(target, journal: dict | None) -> int:
    """Remove the temp files a process killed inside ``write_bytes`` left behind: beside each file of
    the interrupted transaction (in site-packages) and anywhere in this environment's state dir. The
    caller holds the lock, so no live patch operation on this environment is writing them; in
    site-packages a temp file is removed only when the process that wrote it is gone (or is us).
    Returns how many were removed."""
    removed = 0
    envdir = target.envdir
    candidates: list[tuple[Path, bool]] = []  # (temp file, lives in our state dir)
    for f in (journal or {}).get("files") or []:
        path = Path(f["path"])
        try:
            entries = list(path.parent.iterdir())
        except OSError:
            continue
        candidates += [(e, False) for e in entries if (m := _TEMP.match(e.name)) and m.group("name") == path.name]
    if envdir.is_dir():
        candidates += [(e, True) for e in envdir.rglob(f".*{TEMP_MARK}*") if _TEMP.match(e.name)]
    for tmp, ours in dict.fromkeys(candidates):
        pid = int(_TEMP.match(tmp.name).group("pid"))
        if not ours and pid != os.getpid() and proc_start(pid) is not None:
            continue
        try:
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    if removed:
        for d in {t.parent for t, _ in candidates}:
            fsync_dir(d)
    return removed


class Lock:
    """An fcntl lock per environment: a second apply/rollback on the same host is refused."""

    def __init__(self, envdir: Path):
        envdir.mkdir(parents=True, exist_ok=True)
        self.path = envdir / "lock"
        self.fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)

    def __enter__(self):
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise Refused(f"another patch operation is running on this host (pid {holder}, lock {self.path}); "
                          "wait for it to finish")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc):
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


class Locks:
    """The locks of several environments, taken in order (so that a second call on the same host is
    refused at once) and released together."""

    def __init__(self, targets):
        self.targets, self.held = targets, []

    def __enter__(self):
        try:
            for t in self.targets:
                lock = Lock(t.envdir)
                lock.__enter__()
                self.held.append(lock)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        while self.held:
            self.held.pop().__exit__()


def check_writable(target, rels) -> None:
    """Refuse, before anything changes, a file whose folder this user cannot write."""
    for rel in rels:
        folder = target.path(rel).parent
        if not os.access(folder, os.W_OK):
            raise Refused(f"cannot write {folder} as user {os.environ.get('USER', os.getuid())}: run as the owner "
                          "of this python environment (inventory 'user'); nothing was changed")


def run_journal(target, journal: dict) -> None:
    """Bring every file of the journal to its ``to`` content (roll forward), then finish the
    manifest step and drop the journal. Used both by a live transaction and by recovery."""
    envdir = target.envdir
    for f in journal["files"]:
        path = Path(f["path"])
        cur = file_sha(path)
        if cur == f["to"]:
            continue
        if cur != f["from"]:
            raise Refused(f"an interrupted {journal['op']} cannot complete: {f['rel']} changed meanwhile "
                          f"({'sha256 ' + cur if cur else 'file missing'}); run patch.rollback --force --reinstall")
        data = (envdir / f["staged"]).read_bytes()
        if sha256_hex(data) != f["to"]:
            raise Refused(f"an interrupted {journal['op']} cannot complete: staged copy of {f['rel']} is damaged")
        write_bytes(path, data, f.get("mode"), durable=True)
    manifest = journal.get("manifest")
    if manifest is None:
        for p in (envdir / "manifest.json",):
            if p.exists():
                p.unlink()
        shutil.rmtree(envdir / "backup", ignore_errors=True)
    else:
        write_bytes(envdir / "manifest.json", json.dumps(manifest, indent=2).encode(), durable=True)
    (envdir / "journal.json").unlink()
    fsync_dir(envdir)
    shutil.rmtree(envdir / "tx", ignore_errors=True)


def recover(target) -> str | None:
    """Complete a transaction a previous call left behind (killed mid-swap). Caller holds the lock."""
    journal = read_json(target.envdir / "journal.json")
    # a kill inside write_bytes leaves its temp file: never needed (the staged copies are the source)
    dropped = drop_temp_files(target, journal)
    if journal is None:
        shutil.rmtree(target.envdir / "tx", ignore_errors=True)  # staging that never reached the swap
        return None
    run_journal(target, journal)
    also = f"; removed {dropped} leftover temp file{'s' if dropped != 1 else ''}" if dropped else ""
    return f"completed an interrupted {journal['op']} ({journal['txid']}){also}"


def transact(target, op: str, changes: list[dict], manifest: dict | None) -> None:
    """Stage ``changes`` ([{rel, from, to, data}]), journal them, swap them in; all or nothing."""
    envdir = target.envdir
    check_writable(target, [c["rel"] for c in changes])
    txid = f"{op}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    files = []
    for c in changes:
        staged = Path("tx") / txid / c["rel"]
        write_bytes(envdir / staged, c["data"], durable=True)
        path = target.path(c["rel"])
        files.append({"rel": c["rel"], "path": str(path), "from": c["from"], "to": c["to"],
                      "staged": str(staged), "mode": os.stat(path).st_mode & 0o7777})
    journal = {"op": op, "txid": txid, "files": files, "manifest": manifest}
    write_bytes(envdir / "journal.json", json.dumps(journal, indent=2).encode(), durable=True)
    originals = {f["rel"]: Path(f["path"]).read_bytes() for f in files}
    try:
        run_journal(target, journal)
    except Exception:
        # a live failure (not a crash): put back every file this swap changed (the one that failed to
        # be replaced, by a full disk or an immutable file, still has its old bytes), drop the journal
        for f in files:
            if file_sha(Path(f["path"])) != f["from"]:
                write_bytes(Path(f["path"]), originals[f["rel"]], f["mode"], durable=True)
        (envdir / "journal.json").unlink(missing_ok=True)
        shutil.rmtree(envdir / "tx", ignore_errors=True)
        raise
