"""Detached runs on the hosts: list them, one run's status, its log (live with --follow), stop it."""
from invoke import task

from tasks._cli import (COMMON_HELP, StageView, clean_errors, console, emit_json, escape, finish, load,
                        number, print_wide)

_STYLE = {"succeeded": "green", "failed": "red", "lost": "red", "stopped": "yellow"}


def _each(inventory, hosts, fn):
    from harness.parallel import on_hosts, with_connection

    inv, selected = load(inventory, hosts)
    return on_hosts(selected, with_connection(inv, fn))


@task(name="list", help=COMMON_HELP)
@clean_errors
def list_(c, inventory=None, hosts=None, json=False):
    """The runs on each host with their state, times and exit code."""
    from harness import runs

    results = _each(inventory, hosts, runs.list_runs)
    if json:
        emit_json(results.to_json())
        return finish(results)
    from rich.table import Table

    t = Table("host", "run", "stage", "attempt", "state", "started", "ended", "exit", "error")
    for host, rs in results.items():
        if host in results.failed:
            t.add_row(host, "", "", "", f"[red]{escape(rs.kind)}[/]", "", "", "", "(below)")
            continue
        for r in rs:
            t.add_row(host, r["run_id"], r.get("stage") or "", str(r.get("attempt") or ""),
                      f"[{_STYLE.get(r['state'], 'cyan')}]{r['state']}[/]", r.get("started_at") or "",
                      r.get("ended_at") or "", "" if r.get("exit_code") is None else str(r["exit_code"]),
                      escape(r.get("error") or ""))
    print_wide(t)
    finish(results)


@task(help=COMMON_HELP | {"run": "the run id"})
@clean_errors
def status(c, run, inventory=None, hosts=None, json=False):
    """One run's status: state, pid, boot id, times, exit code, GPU guard outcome."""
    from harness import runs

    results = _each(inventory, hosts, lambda conn: runs.status(conn, run))
    if json:
        emit_json(results.to_json())
        return finish(results)
    out = console()
    for host, st in results.items():
        if host in results.failed:
            out.print(f"{escape(host)}: [red]{escape(st.message)}[/]")
            continue
        svc = st.get("service") or {}
        out.print(f"[bold]{host}[/] run {st['run_id']} (stage {st.get('stage')}, attempt {st.get('attempt')}): "
                  f"[bold]{st['state']}[/]" + ("" if st.get("exit_code") is None else f", exit code {st['exit_code']}"))
        out.print(f"  pid {st.get('pid')} stage pid {st.get('stage_pid')} boot {st.get('boot_id')}  "
                  f"started {st.get('started_at')} ended {st.get('ended_at') or '-'}  log {st.get('log_size', 0)} bytes")
        if st.get("gpu_guard"):
            out.print(f"  GPU guard: service stopped={svc.get('stopped')} restarted={svc.get('restarted')} "
                      f"healthy={svc.get('healthy')}" + (f" [red]{escape(svc['error'])}[/]" if svc.get("error") else ""))
        if st.get("error"):
            out.print(f"  [red]{escape(st['error'])}[/]")
    finish(results)


@task(help=COMMON_HELP | {"run": "the run id",
                          "follow": "keep following until the run ends; reattaches where it left off"})
@clean_errors
def logs(c, run, inventory=None, hosts=None, json=False, follow=False):
    """Print a run's log (secrets masked); --follow streams it live with progress."""
    from harness import envfile, runs
    from harness.errors import HarnessError

    inv, selected = load(inventory, hosts)
    masker = envfile.Masker(envfile.secret_values(inv))
    if json:
        results = _each(inventory, hosts, lambda conn: runs.read_whole_log(conn, run, masker))
        emit_json(results.to_json())
        return finish(results)
    if len(selected) > 1 and follow:
        raise HarnessError("--follow follows one host at a time; pass --hosts NAME")
    from harness.parallel import on_hosts, with_connection

    out, err = console(), console("err")

    def one(conn):  # one host after the other: their logs must not interleave
        if not follow:
            text = runs.read_whole_log(conn, run, masker)["log"]
            out.file.write(text)
            out.file.flush()
            return None
        state = runs.FollowState(run, conn.name)
        if state.offset:
            err.print(f"[dim]{conn.name}: reattaching to run {run} at byte {state.offset}[/]")
        with StageView(f"{conn.name} {run}", echo=lambda l: out.print(escape(l))) as view:
            st = runs.follow(conn, run, masker=masker, on_line=view.line)
        err.print(f"{conn.name}: run {run} {st.get('state')}"
                  + ("" if st.get("exit_code") is None else f" (exit code {st['exit_code']})"))
        return st

    results = on_hosts(selected, with_connection(inv, one), workers=1)
    finish(results)


@task(help=COMMON_HELP | {"run": "the run id", "grace": "seconds between TERM and KILL (default 10)"})
@clean_errors
def stop(c, run, inventory=None, hosts=None, json=False, grace=None):
    """Stop a run's whole process group; the wrapper still restores the service."""
    from harness import runs

    grace = number(grace, "--grace", default=10.0, minimum=0, why="seconds between TERM and KILL")
    results = _each(inventory, hosts, lambda conn: runs.stop(conn, run, grace=grace))
    if json:
        emit_json(results.to_json())
    else:
        for host, r in results.items():
            if host in results.failed:
                console().print(f"{host}: [red]{escape(r.message)}[/]")
                continue
            st, state = r.get("status", {}), r.get("status", {}).get("state", "?")
            killed = " (killed after grace)" if r.get("killed") else ""
            if state == "restoring":  # the stage is gone; the wrapper brings the service back first
                console().print(f"{host}: run {run} stage stopped{killed}; restoring the service, then it reads "
                                f"stopped (inv runs.status {run})")
            else:
                console().print(f"{host}: run {run} {state}{killed}")
    finish(results)
