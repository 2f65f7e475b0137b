"""inv pipeline: patch if needed, then prepare -> extract -> vocab -> train -> evaluate on each host,
skipping every stage whose inputs hash to those of its last successful run."""
from invoke import task

from tasks._cli import (COMMON_HELP, HostOutput, StageView, clean_errors, emit_json, finish, load, print_failures,
                        print_wide)


@task(help=COMMON_HELP | {"from": "first stage to run (earlier ones must have succeeded before)",
                          "to": "last stage to run", "no_pull": "leave the artifacts on the host",
                          "no_patch": "do not apply the patch set first"})
@clean_errors
def pipeline(c, inventory=None, hosts=None, json=False, from_=None, to=None, no_pull=False, no_patch=False):
    """Patch if needed, then prepare -> extract -> vocab -> train -> evaluate, skipping unchanged stages."""
    from harness import pipeline as _pipeline
    from harness.parallel import on_hosts, with_connection

    inv, selected = load(inventory, hosts)
    _pipeline.select_stages(from_, to)  # bad stage names fail before any connection
    out = HostOutput(enabled=not json)
    live = len(selected) == 1 and not json  # one host: a live progress bar; several: prefixed lines

    def one(conn):
        with StageView(conn.name, show=live, echo=None if live else out.for_host(conn.name, "dim")) as view:
            return _pipeline.run_pipeline(conn, inv, start=from_, stop=to, pull=not no_pull, patch=not no_patch,
                                          say=out.for_host(conn.name), on_line=view.line)

    results = on_hosts(selected, with_connection(inv, one))
    if json:
        emit_json(results.to_json(lambda runs: [r.as_dict() for r in runs]))
    else:
        for name, runs in results.succeeded.items():
            print_wide(summary_table(name, runs))
        print_failures(results)
    finish(results)


def summary_table(host: str, runs):
    """Per stage: time, samples, tokens, loss, acceptance length, where the artifacts are."""
    from rich.table import Table

    t = Table(title=f"pipeline on {host}", title_justify="left", header_style="bold")
    for col in ("stage", "run", "state", "time", "samples", "tokens", "loss", "acceptance", "artifacts"):
        t.add_column(col, justify="right" if col in ("time", "samples", "tokens", "loss", "acceptance") else "left")
    for o in runs:
        r = o.result
        loss = r.get("loss", r.get("final_loss"))
        acc = r.get("acceptance_length")
        t.add_row(o.stage, o.run_id, o.state, f"{o.seconds:.1f}s",
                  str(r.get("samples", "")), str(r.get("tokens", "")),
                  f"{loss:.3f}" if isinstance(loss, (int, float)) else "",
                  f"{acc:.2f}" if isinstance(acc, (int, float)) else "", o.pulled or "")
    return t
