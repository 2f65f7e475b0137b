"""inv setup: create each host's Python environment from the pinned profile in remote/requirements/."""
from invoke import task

from tasks._cli import COMMON_HELP, PROGRESS, LiveView, clean_errors, emit_json, finish, load

#: pip's line for each requirement it considers: the setup row counts them
_REQUIREMENT = ("Collecting ", "Requirement already satisfied: ")


@task(help=COMMON_HELP | {"base_python": "the host's interpreter that creates the venv (default python3)",
                          "verbose": "print every line of pip and the whole audit table (by default: one live row "
                                     "per host, the audit's counts and what did not pass; pip's log stays on the host)"})
@clean_errors
def setup(c, inventory=None, hosts=None, json=False, base_python="python3", verbose=False):
    """Create each host's Python environment from the pinned profile in remote/, then audit it."""
    import json as _json
    import time

    from harness import audit as _audit
    from harness import setup as _setup
    from harness.parallel import on_hosts, with_connection
    from tasks.audit import render, render_brief

    inv, selected = load(inventory, hosts)

    with LiveView([h.name for h in selected], verbose=verbose, show=not json) as view:
        def one(conn):
            seen = [0]

            def line(text: str) -> None:
                if text.startswith(_REQUIREMENT):
                    seen[0] += 1
                    view.line(conn.name, PROGRESS + _json.dumps({"done": seen[0], "unit": "requirements"}))
                view.line(conn.name, text)

            t0 = time.monotonic()
            view.begin(conn.name, "setup", "pip")
            res = _setup.run_setup(conn, on_line=line, base_python=base_python)
            m, sec = divmod(int(time.monotonic() - t0), 60)
            view.end(conn.name, f"setup done in {m}:{sec:02d}: the {res['profile']} profile in {res['venv']} "
                                f"({seen[0]} requirements; pip's log: {conn.host.workdir}/setup/setup.log)", "green")
            return res

        done = on_hosts(selected, with_connection(inv, one))
    results = _audit.run_audit(inv, [h for h in selected if h.name not in done.failed])
    if json:
        emit_json({"setup": done.to_json(), "audit": _audit.as_json(results)})
    else:
        (render if verbose else render_brief)(results)
    finish(done)
