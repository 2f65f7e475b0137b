"""inv audit: one probe per host (one SSH round trip), in parallel: versions, GPUs, services, speculators
files edited since install, each patch's state and the vLLM API preflight."""
from invoke import task
from invoke.exceptions import Exit

from tasks._cli import COMMON_HELP, clean_errors, console, emit_json, escape, load, number

_STYLE = {"pass": "green", "pending": "cyan", "warn": "yellow", "fail": "bold red"}


@task(help=COMMON_HELP | {"strict": "exit non-zero when a host is unreachable or a check fails",
                          "workers": "hosts probed at once (default 8)"})
@clean_errors
def audit(c, inventory=None, hosts=None, json=False, strict=False, workers=None):
    """Probe each host (versions, GPUs, services, speculators files, patches) in one round trip."""
    from harness import audit as _audit

    workers = number(workers, "--workers", int, default=8, minimum=1, why="hosts probed at once")
    inv, selected = load(inventory, hosts)
    results = _audit.run_audit(inv, selected, workers=workers)
    emit_json(_audit.as_json(results)) if json else render(results)
    bad = _audit.strict_failures(results)
    if strict and bad:
        raise Exit(f"audit --strict: {', '.join(bad)} failed", code=1)


def render(results) -> None:
    """A table per host: system, packages, GPUs and their processes, vLLM servers, env, checks."""
    from rich.table import Table

    out = console()
    for name, r in results.items():
        if name in results.failed:
            out.print(f"[bold red]{escape(name)}: {escape(r.kind)}[/] {escape(r.message)}")
            continue
        s, pk = r["system"], r["packages"]
        t = Table(title=f"{name}  ({s['hostname']}, {s['os']}, kernel {s['kernel']}, python {s['python']})",
                  title_justify="left", show_header=True, header_style="bold")
        t.add_column("fact")
        t.add_column("value", overflow="fold")
        t.add_row("python", s["python_path"])
        bf16 = ("native" if s.get("native_bf16") else
                "emulated (without GPUs the current stages compute in float32, pipeline.dtype auto)")
        t.add_row("CPU", f"{s['arch']}, {s['cpus']} cores, bf16 {bf16}")
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
        disk = r["disk"]
        t.add_row("disk", f"{disk['free_bytes'] / 2**30:.1f} GiB free of {disk['total_bytes'] / 2**30:.1f} at {disk['path']}")
        t.add_row("vLLM servers", ", ".join(f"pid {v['pid']} port {v['port']} {v['model'] or ''}" for v in r["vllm_servers"]) or "none")
        t.add_row("NCCL/VLLM env", " ".join(f"{k}={v}" for k, v in r["env"].items()) or "none set")
        for chk in r["checks"]:
            t.add_row(f"check: {chk['name']}", f"[{_STYLE[chk['status']]}]{chk['status']}[/] {escape(chk['detail'])}")
        out.print(t)


def render_brief(results) -> None:
    """After setup: a line per host that counts its checks, and one per check that did not pass
    (``inv audit`` shows the whole table)."""
    from collections import Counter

    out = console()
    for name, r in results.items():
        if name in results.failed:
            continue  # the failure is printed once, by finish
        counts = Counter(c["status"] for c in r["checks"])
        summary = ", ".join(f"[{_STYLE[k]}]{counts[k]} {k}[/]" for k in _STYLE if counts[k])
        out.print(f"[bold cyan]\\[{escape(name)}][/] audit: {summary} (the table: inv audit --hosts {escape(name)})")
        pending = [c for c in r["checks"] if c["status"] == "pending"]
        if pending:
            out.print(f"    [cyan]pending[/] {len(pending)} patch checks: "
                      f"{escape(pending[0]['detail'])}")
        for c in r["checks"]:
            if c["status"] in ("warn", "fail"):
                out.print(f"    [{_STYLE[c['status']]}]{c['status']}[/] {escape(c['name'])}: {escape(c['detail'])}")
