"""``inv audit``: one probe per host, in parallel, turned into checks and a report.

The facts come from ``remote/tools/probe.py`` (one SSH round trip per host after the handshake); this module
only decides what they mean (``checks``) and how to show them (a rich table, or JSON).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.connection import open_host
from harness.inventory import HostSpec, Inventory
from harness.parallel import HostFailure, on_hosts

#: hooks that add to the probe spec and to the checks (the patch issue registers one); each is
#: ``(extend_spec(inv, host, spec) -> modules, checks(host, facts) -> list[Check])``
EXTENSIONS: list[tuple[Callable[..., list[str]], Callable[..., list["Check"]]]] = []


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail}


def probe_host(inv: Inventory, host: HostSpec, timeout: float = 10) -> dict[str, Any]:
    """Connect, run the probe (with any extension modules) and return the facts with their checks."""
    spec: dict[str, Any] = {"workdir": host.workdir}
    modules: list[str] = []
    for extend, _ in EXTENSIONS:
        modules += extend(inv, host, spec)
    with open_host(host, inv, timeout=timeout) as conn:
        facts = conn.run_script("probe", spec, modules=modules)
        facts["round_trips"] = conn.round_trips
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
        elif drift["edited"]:
            out.append(Check("speculators files", "warn",
                             f"{len(drift['edited'])} edited after install: {', '.join(drift['edited'][:3])}"
                             + (" ..." if len(drift["edited"]) > 3 else "")))
        else:
            out.append(Check("speculators files", "pass", f"{drift['checked']} files match pip's RECORD"))
    free = facts["disk"]["free_bytes"]
    out.append(Check("free disk", "pass" if free > 10 * 2**30 else "warn", f"{free / 2**30:.1f} GiB free at {facts['disk']['path']}"))
    for _, extra_checks in EXTENSIONS:
        out += extra_checks(host, facts)
    return out


def run_audit(inv: Inventory, hosts: list[HostSpec], workers: int = 8, timeout: float = 10) -> dict[str, dict | HostFailure]:
    return on_hosts(hosts, lambda h: probe_host(inv, h, timeout), workers=workers)


def as_json(results: dict[str, dict | HostFailure]) -> dict:
    return {"hosts": {name: (r.as_dict() | {"reachable": False}) if isinstance(r, HostFailure) else (r | {"reachable": True})
                      for name, r in results.items()}}


def failed(results: dict[str, dict | HostFailure]) -> list[str]:
    """Hosts that make ``--strict`` fail: unreachable, or any check failed."""
    bad = []
    for name, r in results.items():
        if isinstance(r, HostFailure) or any(c["status"] == "fail" for c in r["checks"]):
            bad.append(name)
    return bad


_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def render(results: dict[str, dict | HostFailure], console: Console) -> None:
    for name, r in results.items():
        if isinstance(r, HostFailure):
            console.print(f"[bold red]{name}: {r.kind}[/] {escape(r.message)}", soft_wrap=True)
            continue
        s, pk = r["system"], r["packages"]
        t = Table(title=f"{name}  ({s['hostname']}, {s['os']}, kernel {s['kernel']}, python {s['python']})",
                  title_justify="left", show_header=True, header_style="bold")
        t.add_column("fact")
        t.add_column("value", overflow="fold")
        t.add_row("python", s["python_path"])
        t.add_row("packages", "  ".join(f"{k} {v or '-'}" for k, v in pk.items()))
        t.add_row("speculators at", r.get("speculators_path") or "-")
        gpus = r.get("gpus")
        if gpus is None:
            t.add_row("GPUs", "no GPU (nvidia-smi not found)")
        else:
            for g in gpus:
                procs = ", ".join(f"{p['pid']} {p['name']}" for p in g["processes"]) or "idle"
                t.add_row(f"GPU {g['index']}", f"{g['name']}  {g['memory_used_mib']}/{g['memory_total_mib']} MiB  "
                                                f"driver {g['driver']}  [{procs}]")
        t.add_row("vLLM servers", ", ".join(f"pid {v['pid']} port {v['port']} {v['model'] or ''}" for v in r["vllm_servers"]) or "none")
        t.add_row("NCCL/VLLM env", " ".join(f"{k}={v}" for k, v in r["env"].items()) or "none set")
        for c in r["checks"]:
            t.add_row(f"check: {c['name']}", f"[{_STYLE[c['status']]}]{c['status']}[/] {c['detail']}")
        console.print(t)
