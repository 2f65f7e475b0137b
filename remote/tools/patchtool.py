"""Patch the installed packages on a host as one transaction: status, plan, apply, rollback.

Runs ON the host (stdlib only), shipped by the harness with a JSON spec together with the modules it
imports, or by hand next to them: ``python patchtool.py < spec.json``. Why here and not over SSH step by
step: a dropped link must leave the host finished or untouched, so every mutation is one local
transaction with a journal (filetxn.py); which state the files are in is patchstate.py's part, and the
exact diff applier diffapply.py's.

Spec: ``op`` (status | plan | apply | rollback); ``packages``, ``[{"package", "series", "required"}]``
(every distribution with patch sets, as harness/patches.py builds them; a required one must be
installed with a series for its version); ``facts`` ({"profile": ..., "vllm": version}; vllm defaults to
the host's installed one, or ``vllm_path``'s dist-info); ``workdir`` (default ~/.eagle-harness);
``force``, ``reinstall``, ``pip_args`` (extra pip args).

Answer: ``{"op", "packages": {package: its answer}}``, every package in the same shape, in spec order;
one with nothing to patch here answers ``{"state": "no patch set", "message": ...}``. A refusal is
hostcore's ``Refused`` (kind + one line), and nothing on the host changed. Why one call for all
packages: one round trip per host, and apply stays all or nothing for the host: every package is
checked and staged before any file changes, and a failure while swapping a later package undoes the
packages this call already swapped. (A process killed between two packages' swaps leaves each package
whole, one patched and one not; each one's journal lets the next call finish its own.)
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from diffapply import HunkFailed, apply_file_patch, parse_diff
from distinfo import record_b64
from filetxn import Locks, check_writable, recover, transact
from hostcore import Refused, read_json, write_bytes
from patchstate import Target, file_chains, file_sha, patch_states, selected_patches, sha256_hex, status, targets


@dataclass
class PackagePlan:
    """What an apply or a rollback does to one package, decided before a byte of any package changes."""
    target: Target
    rows: list                                            # its patches' states before
    todo: list = field(default_factory=list)              # apply: the patches still to apply, in series order
    changes: list = field(default_factory=list)           # [{rel, from, to, data, before}]
    backups: dict = field(default_factory=dict)           # apply: pristine bytes still to keep, by file
    manifest: dict | None = None                          # what manifest.json becomes (None: removed)
    old_manifest: dict | None = None                      # what it was (an undo puts it back)
    drifted: list = field(default_factory=list)           # rollback --force: files restored over an edit
    restore_backups: dict = field(default_factory=dict)   # rollback: the backups an undo puts back


# ------------------------------------------------------------------------------------------------
# what apply would do

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


def _plan_apply(target: Target) -> PackagePlan:
    """Everything apply decides before it changes a byte: the pending patches (refusing drift),
    the staged results (checked against the series' hashes), the pristine backups still to take,
    the manifest and the file changes. Run for every package first, so that a refusal of any of
    them leaves the whole host untouched."""
    rows, files, todo, _ = _pending(target)
    pkg = PackagePlan(target, rows, todo=todo, old_manifest=read_json(target.envdir / "manifest.json"))
    if not todo:
        return pkg
    staged = _stage_apply(target, todo, files)
    # byte-exact pristine backups (kept from an earlier partial apply, else taken now)
    for rel, f in files.items():
        b = target.envdir / "backup" / rel
        if b.exists() and file_sha(b) == f["pristine"]:
            continue
        cur = target.path(rel).read_bytes()
        if sha256_hex(cur) != f["pristine"]:
            cur = _reverse_to_pristine(target, rel, cur)
        pkg.backups[rel] = cur
    old = pkg.old_manifest or {}
    order = [p["name"] for p in target.series["patches"]]
    pkg.manifest = {
        "package": target.package, "version": target.version, "site": str(target.site),
        "python": sys.executable, "env_id": target.env_id, "facts": target.facts,
        "applied": sorted(set(old.get("applied", [])) | {p["name"] for p in todo}, key=order.index),
        "files": {rel: {"pristine": f["pristine"], "patched": f["target"], "backup": f"backup/{rel}"}
                  for rel, f in files.items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    pkg.changes = [{"rel": rel, "from": files[rel]["sha256"], "to": sha256_hex(staged[rel]), "data": staged[rel],
                     "before": target.path(rel).read_bytes()}
                    for rel in files if sha256_hex(staged[rel]) != files[rel]["sha256"]]
    check_writable(target, [c["rel"] for c in pkg.changes])
    return pkg


# ------------------------------------------------------------------------------------------------
# the operations

def _named(target: Target, e) -> str:
    """A refusal's line, naming the package it is about."""
    return f"{target.label}: {e}"


def _selected(spec: dict, need_series: bool = True) -> tuple[list[Target], dict[str, dict], list[str]]:
    """(the packages that have a series here, the "no patch set" answers of the others, every name in
    spec order); without ``need_series``, a required package comes in without one too."""
    found = targets(spec, need_series)
    return ([t for _, t, _ in found if t is not None], {n: none for n, t, none in found if t is None},
            [n for n, _, _ in found])


def _answer(op: str, order: list[str], results: dict[str, dict], absent: dict[str, dict]) -> dict:
    return {"op": op, "packages": {n: results[n] if n in results else absent[n] for n in order}}


def _recover_all(ts: list[Target]) -> dict[str, str | None]:
    """Complete what an earlier call left behind, package by package (each has its own journal)."""
    out = {}
    for t in ts:
        try:
            out[t.package] = recover(t)
        except Refused as e:
            raise Refused(_named(t, e), e.kind)
    return out


def _planned(ts: list[Target], plan_one: Callable[[Target], PackagePlan]) -> dict[str, PackagePlan]:
    """Every package's plan, before anything changes: a refusal of any leaves the whole host untouched."""
    plans = {}
    for t in ts:
        try:
            plans[t.package] = plan_one(t)
        except Refused as e:
            later = "; no package on this host was changed" if len(ts) > 1 else ""
            raise Refused(_named(t, e) + later, e.kind)
    return plans


def plan(spec: dict) -> dict:
    """The dry run: every package's pending patches, proven to apply on in-memory copies; nothing
    on the host changes. Refuses exactly what apply would refuse."""
    ts, absent, order = _selected(spec)
    results = {}
    for t, p in _planned(ts, _plan_apply).items():
        results[t] = {"package": t, "installed": p.target.version, "site": str(p.target.site), "patches": p.rows,
                      "would_apply": [x["name"] for x in p.todo], "diff": _diff_text(p.todo),
                      "message": "nothing to apply" if not p.todo else f"{len(p.todo)} patches would be applied"}
    return _answer("plan", order, results, absent)


def _undo(pkg: PackagePlan) -> None:
    """Take back what this call's transaction did to one package: its files to the bytes they had
    before, its backups and manifest as they were (a journaled transaction of its own)."""
    for rel, data in pkg.restore_backups.items():
        write_bytes(pkg.target.envdir / "backup" / rel, data, None, durable=True)
    back = [{"rel": c["rel"], "from": c["to"], "to": c["from"], "data": c["before"]} for c in pkg.changes]
    transact(pkg.target, "undo", back, pkg.old_manifest)


def _commit(plans: dict[str, PackagePlan], op: str, write: Callable[[PackagePlan], None]) -> None:
    """Run each package's transaction in order; when one fails, undo those this call already
    changed, so that the call stays all or nothing for the host."""
    done: list[PackagePlan] = []
    for p in plans.values():
        if not p.changes:
            continue
        try:
            write(p)
            transact(p.target, op, p.changes, p.manifest)
        except Exception as e:  # noqa: BLE001 - a live failure: any of them is reported in one line
            why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
            undone, broken = [], []
            for d in reversed(done):
                try:
                    _undo(d)
                    undone.append(d.target.label)
                except Exception as e2:  # noqa: BLE001
                    broken.append(f"{d.target.label} ({e2})")
            tail = (f"; undid this call's changes to {', '.join(undone)}" if undone else "")
            tail += (f"; could not undo {', '.join(broken)}: see inv patch.status" if broken else
                     "; no package on this host was changed")
            raise Refused(f"{_named(p.target, why)}; its files are unchanged{tail}")
        done.append(p)


def apply(spec: dict) -> dict:
    """Every package's series as one call: all packages are checked and staged first (a refusal of
    any leaves the host untouched), then swapped in one after the other (a failure undoes the
    packages already swapped)."""
    ts, absent, order = _selected(spec)
    with Locks(ts):
        recovered = _recover_all(ts)
        plans = _planned(ts, _plan_apply)

        def write_backups(p: PackagePlan) -> None:
            for rel, data in p.backups.items():
                write_bytes(p.target.envdir / "backup" / rel, data, None, durable=True)

        _commit(plans, "apply", write_backups)
    results = {}
    for name, p in plans.items():
        t = p.target
        base = {"package": name, "recovered": recovered[name], "installed": t.version, "site": str(t.site)}
        if not p.todo:
            results[name] = {**base, "changed": False, "patches": p.rows,
                             "message": "nothing changed: every needed patch is already applied"}
            continue
        rows, _, _ = patch_states(t)
        results[name] = {
            **base, "changed": True, "applied": [x["name"] for x in p.todo], "files": [c["rel"] for c in p.changes],
            "message": f"applied {len(p.todo)} patches to {len(p.changes)} files", "patches": rows,
            "manifest": str(t.envdir / "manifest.json")}
    return _answer("apply", order, results, absent)


def rollback(spec: dict) -> dict:
    """Every package with applied patches back to pip's RECORD in one call. Each package is checked
    first (a refusal of any leaves the host untouched), then restored in order (a failure undoes the
    packages already restored). ``reinstall``: a required package's wheel is reinstalled; another
    package's only when a file of it cannot be restored from its backups."""
    force, reinstall = bool(spec.get("force")), bool(spec.get("reinstall"))
    ts, absent, order = _selected(spec, need_series=not reinstall)
    required = {e.get("package") for e in spec.get("packages") or [] if e.get("required")}
    with Locks(ts):
        recovered = _recover_all(ts)
        results: dict[str, dict] = {}
        if reinstall:
            # the last resort, package by package: pip's reinstall cannot be undone, so neither is
            # anything else here; a failure says which packages were already restored
            done: list[str] = []
            for t in ts:
                try:
                    if t.package in required:
                        results[t.package] = _reinstall(t, spec)
                    else:
                        try:
                            p = _plan_rollback(t, force=True, reinstall_ok=True)
                        except _NeedsReinstall:
                            results[t.package] = _reinstall(t, spec)
                        else:
                            if p.changes:
                                transact(t, "rollback", p.changes, None)
                            results[t.package] = _rollback_result(t, p, recovered[t.package])
                except Exception as e:  # noqa: BLE001 - reported in one line
                    why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
                    already = f"; already restored: {', '.join(done)}" if done else ""
                    raise Refused(_named(t, why) + already, getattr(e, "kind", "refused"))
                if results[t.package].get("changed"):
                    done.append(t.label)
            for t in ts:
                results[t.package]["recovered"] = recovered[t.package]
            return _answer("rollback", order, results, absent)
        plans = _planned(ts, lambda t: _plan_rollback(t, force))
        _commit(plans, "rollback", lambda _: None)
    for name, p in plans.items():
        results[name] = _rollback_result(p.target, p, recovered[name])
    return _answer("rollback", order, results, absent)


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
    return {"package": target.package, "changed": True, "installed": target.version, "reinstalled": True,
            "message": f"reinstalled {target.package}=={target.version} from its wheel; every file matches RECORD"}


class _NeedsReinstall(Exception):
    """A file no backup or series step can restore: only reinstalling the wheel can."""


def _plan_rollback(target: Target, force: bool, reinstall_ok: bool = False) -> PackagePlan:
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
    check_writable(target, [c["rel"] for c in changes])
    backups = target.envdir / "backup"
    return PackagePlan(target, rows, changes=changes, drifted=drifted, manifest=None,
                       old_manifest=read_json(target.envdir / "manifest.json"),
                       # the transaction drops the backups with the manifest; an undo puts them back
                       restore_backups={str(f.relative_to(backups)): f.read_bytes()
                                        for f in backups.rglob("*") if f.is_file()} if backups.is_dir() else {})


def _rollback_result(t: Target, pkg: PackagePlan, recovered: str | None) -> dict:
    base = {"package": t.package, "recovered": recovered, "installed": t.version, "site": str(t.site)}
    if not pkg.changes:
        return {**base, "changed": False, "patches": pkg.rows,
                "message": "nothing changed: every file already matches pip's RECORD"}
    bad = _record_check(t, [c["rel"] for c in pkg.changes])
    if bad:
        raise Refused(f"after rollback {', '.join(bad)} do not match pip's RECORD")
    rows, _, _ = patch_states(t)
    return {**base, "changed": True, "restored": [c["rel"] for c in pkg.changes], "forced": pkg.drifted,
            "message": f"restored {len(pkg.changes)} files; each matches pip's RECORD", "patches": rows}


# ------------------------------------------------------------------------------------------------

OPS = {"status": status, "plan": plan, "apply": apply, "rollback": rollback}


def main(spec: dict) -> dict:
    """Run one op; never prints. A refusal raises hostcore's Refused (its kind and one line)."""
    op = spec.get("op", "status")
    if op not in OPS:
        raise Refused(f"unknown op {op!r} (use {', '.join(OPS)})")
    if op in ("apply", "rollback"):
        # a dropped SSH link must not stop a transaction half way
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    return OPS[op](spec)


if __name__ == "__main__":
    try:
        answer = {"ok": True, "result": main(json.loads(sys.stdin.read() or "{}"))}
    except Refused as e:
        answer = {"ok": False, "kind": e.kind, "error": str(e)}
    try:
        sys.stdout.write(json.dumps(answer, indent=2) + "\n")
        sys.stdout.flush()
    except OSError:
        pass
