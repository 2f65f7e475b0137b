"""What the env, stage, runs and pull tasks do, so tasks.py stays a list of thin task functions.

Each function takes the loaded inventory and selected hosts, works host by host (in parallel where
nothing is followed live), prints for people or returns data for ``--json``. A host that fails comes
back as a ``HostFailure`` beside the others' results: the task renders every host, then exits
non-zero naming each failure (``exit_if_failed``), so one dead host neither hides the rest nor
passes unnoticed.
"""
from __future__ import annotations

import os
from pathlib import Path

from invoke.exceptions import Exit
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from harness import envfile, runs
from harness.connection import open_host
from harness.errors import HarnessError
from harness.inventory import HostSpec, Inventory
from harness.parallel import HostFailure, HostOutput, on_hosts


def _with_conn(inv: Inventory, fn):
    def run(h: HostSpec):
        conn = open_host(h, inv)
        try:
            return fn(conn)
        finally:
            conn.close()
    return run


def failures(results: dict) -> list[HostFailure]:
    return [r for r in results.values() if isinstance(r, HostFailure)]


def exit_if_failed(results: dict) -> None:
    """After every host was rendered: exit 1 with one ``error:`` line per failed host, if any."""
    bad = failures(results)
    if bad:
        raise Exit("\n".join(f"error: {f.message}" for f in bad), code=1)


def print_failures(results: dict, console: Console) -> None:
    """Each failed host's message on one line (never wrapped), prefixed by its name, in red."""
    for f in failures(results):
        console.print(f"[bold cyan]\\[{escape(f.host)}][/] [red]{escape(f.message)}[/]", highlight=False,
                      soft_wrap=True)


def as_jsonable(results: dict) -> dict:
    return {k: (v.as_dict() if isinstance(v, HostFailure) else v) for k, v in results.items()}


# ---------------------------------------------------------------------------------------------------
# env

def env_render(inv: Inventory, hosts: list[HostSpec], diff: bool, out: Console, err: Console) -> dict:
    results = {}
    for h in hosts:
        e = envfile.render_env(h, inv, require_secrets=False)
        for name in e.missing_secrets:
            err.print(f"[yellow]warning:[/] host {h.name}: secret {name} is not set in this shell; "
                      "a run would refuse to start", highlight=False, soft_wrap=True)
        if diff:
            def last(conn):
                return runs.last_env(conn)
            got = _with_conn(inv, last)(h)
            label = f"{h.name}: last run {got['run_id']}" if got["run_id"] else f"{h.name}: (no run yet)"
            text = envfile.diff_env(got["text"], e, label, f"{h.name}: rendered now",
                                    old_secrets=got.get("secrets") or ())
            results[h.name] = {"diff": text, "last_run": got["run_id"]}
            out.print(escape(text) if text else f"{h.name}: no difference from the last run ({got['run_id']})",
                      highlight=False, soft_wrap=True)
        else:
            results[h.name] = {"profile": e.profile, "template": e.template, "text": e.masked(),
                               "values": {k: (envfile.MASK if k in e.secrets else v) for k, v in e.values.items()}}
            out.rule(f"{h.name}  ({e.template})")
            out.print(escape(e.masked()), highlight=False, soft_wrap=True)
    return results


def env_lint(inv: Inventory, hosts: list[HostSpec], offline: bool) -> tuple[dict, list[str]]:
    """Problems per host (each a dict) and the flat list of one-line messages."""
    results: dict = {}
    lines: list[str] = []

    def one(h: HostSpec):
        try:
            e = envfile.render_env(h, inv, require_secrets=False)
        except HarnessError as exc:
            return {"problems": [{"host": h.name, "name": "(template)", "message": str(exc), "origin": ""}]}
        facts = None if offline else _with_conn(inv, lambda c: envfile.host_facts(c, e))(h)
        probs = envfile.lint_env(e, facts, gpus=h.gpus)
        return {"problems": [p.as_dict() for p in probs], "facts": facts,
                "messages": [str(p) for p in probs]}

    for name, r in on_hosts(hosts, one).items():
        if isinstance(r, HostFailure):
            results[name] = r.as_dict()
            lines.append(r.message)
        else:
            results[name] = r
            lines += r.get("messages") or [p["message"] for p in r["problems"]]
    return results, lines


# ---------------------------------------------------------------------------------------------------
# stages

def parse_inputs(text: str | None) -> dict[str, str]:
    """``prepare=RUN,vocab=RUN`` -> {stage: run id}."""
    out = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        stage, sep, rid = item.partition("=")
        if not sep or not stage.strip() or not rid.strip():
            raise HarnessError(f"--inputs: {item!r} is not STAGE=RUN_ID")
        out[stage.strip()] = runs.check_run_id(rid.strip())
    return out


def stage_run(inv: Inventory, hosts: list[HostSpec], stage: str, *, run_id: str | None, inputs: str | None,
              gpu: str, follow: bool, pull: bool, dest: str | None, err: Console) -> dict:
    gpu_flag = {"auto": None, "on": True, "off": False}.get(gpu)
    if gpu not in ("auto", "on", "off"):
        raise HarnessError(f"--gpu {gpu!r}: use auto, on or off")
    ins = parse_inputs(inputs)
    out = HostOutput(err)
    live = len(hosts) == 1

    def one(conn):
        if not follow:
            h = runs.launch(conn, inv, stage, run_id=run_id, inputs=ins, gpu=gpu_flag)
            msg = f"run {h.run_id}: {'launched' if h.launched else h.reason}, state {h.status.get('state')}"
            out.line(conn.name, msg)
            return {"run_id": h.run_id, "launched": h.launched, "status": h.status, "round_trips": h.round_trips}
        st = runs.run_stage(conn, inv, stage, run_id=run_id, inputs=ins, gpu=gpu_flag, progress=live, console=err,
                            pull=pull, dest=Path(dest) if dest else None,
                            on_line=None if live else out.for_host(conn.name))
        out.line(conn.name, f"run {st['run_id']} {st['state']}" + (f", pulled to {st['pulled']}" if st.get("pulled") else ""))
        return st

    results = on_hosts(hosts, _with_conn(inv, one))
    print_failures(results, err)
    return results


# ---------------------------------------------------------------------------------------------------
# runs

def runs_list(inv: Inventory, hosts: list[HostSpec]) -> dict:
    return on_hosts(hosts, _with_conn(inv, runs.list_runs))


def render_list(results: dict, console: Console) -> None:
    t = Table("host", "run", "stage", "attempt", "state", "started", "ended", "exit", "error")
    for host, rs in results.items():
        if isinstance(rs, HostFailure):
            t.add_row(host, "", "", "", f"[red]{escape(rs.kind)}[/]", "", "", "", "(below)")
            continue
        for r in rs:
            style = {"succeeded": "green", "failed": "red", "lost": "red", "stopped": "yellow"}.get(r["state"], "cyan")
            t.add_row(host, r["run_id"], r.get("stage") or "", str(r.get("attempt") or ""),
                      f"[{style}]{r['state']}[/]", r.get("started_at") or "", r.get("ended_at") or "",
                      "" if r.get("exit_code") is None else str(r["exit_code"]), escape(r.get("error") or ""))
    # a table wider than a pipe's 80 columns would be cut to "succee…": give it the width it needs there
    if not console.is_terminal:
        width = Measurement.get(console, console.options.update_width(10_000), t).maximum
        console = Console(file=console.file, width=max(width, 80), color_system=console.color_system,
                          highlight=False)
    console.print(t)
    print_failures(results, console)  # a message in a table cell would wrap into a column of fragments


def runs_status(inv: Inventory, hosts: list[HostSpec], run_id: str) -> dict:
    return on_hosts(hosts, _with_conn(inv, lambda c: runs.status(c, run_id)))


def render_status(results: dict, console: Console) -> None:
    for host, st in results.items():
        if isinstance(st, HostFailure):
            console.print(f"{escape(host)}: [red]{escape(st.message)}[/]", highlight=False, soft_wrap=True)
            continue
        svc = st.get("service") or {}
        console.print(f"[bold]{host}[/] run {st['run_id']} (stage {st.get('stage')}, attempt {st.get('attempt')}): "
                      f"[bold]{st['state']}[/]" + ("" if st.get("exit_code") is None else f", exit code {st['exit_code']}"),
                      highlight=False, soft_wrap=True)
        console.print(f"  pid {st.get('pid')} stage pid {st.get('stage_pid')} boot {st.get('boot_id')}  "
                      f"started {st.get('started_at')} ended {st.get('ended_at') or '-'}  log {st.get('log_size', 0)} bytes",
                      highlight=False, soft_wrap=True)
        if st.get("gpu_guard"):
            console.print(f"  GPU guard: service stopped={svc.get('stopped')} restarted={svc.get('restarted')} "
                          f"healthy={svc.get('healthy')}" + (f" [red]{escape(svc['error'])}[/]" if svc.get("error") else ""),
                          highlight=False, soft_wrap=True)
        if st.get("error"):
            console.print(f"  [red]{escape(st['error'])}[/]", highlight=False, soft_wrap=True)


def runs_logs(inv: Inventory, hosts: list[HostSpec], run_id: str, follow: bool, out: Console, err: Console) -> dict:
    """Print each host's log in turn; a host that fails is reported on its line and the next one is
    shown. Returns {host: None | HostFailure} for ``exit_if_failed``."""
    masker = envfile.Masker(envfile.secret_values(inv))
    if len(hosts) > 1 and follow:
        raise HarnessError("--follow follows one host at a time; pass --hosts NAME")
    results: dict = {}
    for h in hosts:
        try:
            results[h.name] = _host_log(inv, h, run_id, follow, masker, out, err)
        except HarnessError as e:
            results[h.name] = HostFailure(h.name, "error", str(e))
            print_failures({h.name: results[h.name]}, err)
    return results


def _host_log(inv: Inventory, h: HostSpec, run_id: str, follow: bool, masker, out: Console, err: Console) -> None:
    conn = open_host(h, inv)
    try:
        if follow:
            state = runs.FollowState(run_id, conn.name)
            if state.offset:
                err.print(f"[dim]{h.name}: reattaching to run {run_id} at byte {state.offset}[/]", soft_wrap=True)
            st = runs.follow(conn, run_id, masker=masker, console=err,
                             on_line=lambda l: out.print(escape(l), highlight=False, soft_wrap=True))
            err.print(f"{h.name}: run {run_id} {st.get('state')}"
                      + ("" if st.get("exit_code") is None else f" (exit code {st['exit_code']})"),
                      highlight=False, soft_wrap=True)
        else:
            offset = 0
            while True:
                text, new, st = runs.read_log(conn, run_id, offset, masker)
                if text:
                    out.file.write(text)
                    out.file.flush()
                if new == offset or new >= st.get("log_size", 0):
                    break
                offset = new
    finally:
        conn.close()


def runs_log_texts(inv: Inventory, hosts: list[HostSpec], run_id: str) -> dict:
    """{host: {"log": text, "state": ...}} for ``runs.logs --json`` (secrets masked)."""
    masker = envfile.Masker(envfile.secret_values(inv))

    def one(conn):
        text, offset, chunks = "", 0, []
        while True:
            text, new, st = runs.read_log(conn, run_id, offset, masker)
            chunks.append(text)
            if new == offset or new >= st.get("log_size", 0):
                return {"log": "".join(chunks), "state": st.get("state"), "exit_code": st.get("exit_code")}
            offset = new

    return on_hosts(hosts, _with_conn(inv, one))


def runs_stop(inv: Inventory, hosts: list[HostSpec], run_id: str, grace: float) -> dict:
    return on_hosts(hosts, _with_conn(inv, lambda c: runs.stop(c, run_id, grace=grace)))


# ---------------------------------------------------------------------------------------------------
# pull

def pull_runs(inv: Inventory, hosts: list[HostSpec], run_id: str, dest: str | None, include_all: bool,
              include: str | None, method: str, progress: bool, err: Console) -> dict:
    globs = tuple(g for g in (include or "").split(",") if g)
    from harness.pull import pull

    def one(conn):
        d = Path(dest) if dest else None
        if d is not None and len(hosts) > 1:
            d = d / conn.name
        return pull(conn, run_id, d, include_all=include_all, include=globs, method=method,
                    progress=progress and len(hosts) == 1, console=err).as_dict()

    return on_hosts(hosts, _with_conn(inv, one))
