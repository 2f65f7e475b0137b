"""inv setup: create each host's Python environment from the pinned profile in remote/requirements/."""
from invoke import task

from tasks._cli import COMMON_HELP, HostOutput, clean_errors, emit_json, finish, load


@task(help=COMMON_HELP | {"base_python": "the host's interpreter that creates the venv (default python3)"})
@clean_errors
def setup(c, inventory=None, hosts=None, json=False, base_python="python3"):
    """Create each host's Python environment from the pinned profile in remote/, then audit it."""
    from harness import audit as _audit
    from harness import setup as _setup
    from harness.parallel import on_hosts, with_connection
    from tasks.audit import render

    inv, selected = load(inventory, hosts)
    out = HostOutput(enabled=not json)
    done = on_hosts(selected, lambda h: with_connection(inv, lambda conn: _setup.run_setup(
        conn, on_line=out.for_host(h.name, "dim"), base_python=base_python))(h))
    results = _audit.run_audit(inv, [h for h in selected if h.name not in done.failed])
    if json:
        emit_json({"setup": done.to_json(), "audit": _audit.as_json(results)})
    else:
        render(results)
    finish(done)
