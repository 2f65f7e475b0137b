"""The production vLLM server of each host: start it (and wait until it is healthy), stop it, its status."""
from invoke import task

from tasks._cli import COMMON_HELP, HostOutput, clean_errors, console, emit_json, escape, finish, load, number


def _each(inventory, hosts, fn):
    from harness.parallel import on_hosts, with_connection

    inv, selected = load(inventory, hosts)
    return on_hosts(selected, with_connection(inv, lambda conn: fn(conn, inv)))


def describe(st: dict) -> str:
    """One line for people: running or not, healthy or not, where, with which draft, since when."""
    if st.get("running") is False:
        state = "[red]stopped[/]"
    elif st.get("healthy"):
        state = "[green]healthy[/]"
    else:
        state = "[yellow]running, not healthy (yet)[/]"
    draft = st.get("draft")
    dep = st.get("deploy") or {}
    what = (f"draft of run {escape(draft.get('run_id'))} (deploy {escape(draft.get('deploy_id'))}, k={draft.get('k')}"
            + (f", live acceptance {dep['acceptance_length']:.3f}" if dep.get("acceptance_length") else "")
            + "".join(f", {r:.2f}x at {c} in flight" for c, r in (dep.get("speedup") or {}).items())
            + (f", [red]deploy {escape(dep.get('state'))}[/]" if dep.get("state") not in (None, "deployed") else "")
            + ")") if draft else "no draft"
    bits = [state, escape(st.get("url") or "no url"), what]
    if st.get("pid"):
        bits.append(f"pid {st['pid']}, up {st.get('uptime_s', 0):.0f} s")
    if st.get("last_error"):
        bits.append(f"last error: {escape(st['last_error'])}")
    return ", ".join(bits)


@task(help=COMMON_HELP | {"wait": "wait until the server is healthy (--no-wait: start it and return)",
                          "timeout": "seconds to wait for health (default: the service's health_timeout)"})
@clean_errors
def start(c, inventory=None, hosts=None, json=False, wait=True, timeout=None):
    """Start each host's production server (with the draft a deploy installed) and wait for its health."""
    from harness import service

    timeout = number(timeout, "--timeout", minimum=1, why="seconds to wait for health")  # before any host
    out = HostOutput(enabled=not json)

    def one(conn, inv):
        out.line(conn.name, "starting the service" + (" and waiting for its health" if wait else ""))
        return service.start(conn, inv, wait=wait, timeout=timeout)

    results = _each(inventory, hosts, one)
    if json:
        emit_json(results.to_json())
    else:
        for host, st in results.succeeded.items():
            took = f" in {st['seconds']:.0f} s" if st.get("seconds") is not None else ""
            console("out").print(f"[bold cyan]\\[{escape(host)}][/] " + (describe(st) + took if wait else
                                 f"started (pid {st['start'].get('pid')})"))
    finish(results)


@task(help=COMMON_HELP | {"grace": "seconds between SIGTERM and SIGKILL (a server the harness runs; default 60)"})
@clean_errors
def stop(c, inventory=None, hosts=None, json=False, grace=None):
    """Stop each host's production server."""
    from harness import service

    grace = number(grace, "--grace", default=60.0, minimum=0, why="seconds between TERM and KILL")  # before any host
    results = _each(inventory, hosts, lambda conn, inv: service.stop(conn, inv, grace=grace))
    if json:
        emit_json(results.to_json())
    else:
        for host, r in results.succeeded.items():
            console("out").print(f"[bold cyan]\\[{escape(host)}][/] " +
                                 ("stopped" if r.get("was_running") else "was not running"))
    finish(results)


@task(help=COMMON_HELP)
@clean_errors
def status(c, inventory=None, hosts=None, json=False):
    """Each host's production server: running, healthy, its URL, the draft it serves, the last deploys."""
    from harness import service

    results = _each(inventory, hosts, service.status)
    if json:
        emit_json(results.to_json())
    else:
        for host, st in results.succeeded.items():
            console("out").print(f"[bold cyan]\\[{escape(host)}][/] " + describe(st))
            for h in st.get("history") or []:
                extra = (f" acceptance {h['acceptance_length']:.3f}" if h.get("acceptance_length") else "") + "".join(
                    f", {r:.2f}x at {c} in flight" for c, r in (h.get("speedup") or {}).items()) + (
                    f" ({escape(h['reason'])})" if h.get("reason") else "")
                console("out").print(f"    {escape(h.get('ended_at') or h.get('started_at') or '')} "
                                     f"{escape(h.get('action'))} {escape(h.get('deploy_id'))} "
                                     f"{escape(h.get('run_id') or h.get('undid') or '')} {escape(h.get('state'))}{extra}")
    finish(results)
