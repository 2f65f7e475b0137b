"""inv pull: a run's artifacts to this machine, resumable, each file verified against SHA256SUMS."""
from invoke import task

from tasks._cli import ByteBar, COMMON_HELP, clean_errors, console, dest_for, emit_json, escape, finish, load


@task(help=COMMON_HELP | {"run": "the run id", "dest": "destination directory (default runs/<run-id>)",
                          "all": "also pull large intermediates (e.g. hidden states)",
                          "include": "comma-separated globs to pull even if they are intermediates",
                          "method": "auto (rsync, else SFTP), rsync or sftp"})
@clean_errors
def pull(c, run, inventory=None, hosts=None, json=False, dest=None, all=False, include=None, method="auto"):
    """Pull a run's artifacts, resumable, each file verified against SHA256SUMS before it is placed."""
    from harness import pull as _pull
    from harness.parallel import on_hosts, with_connection

    inv, selected = load(inventory, hosts)
    globs = tuple(g for g in (include or "").split(",") if g)

    def one(conn):
        d = dest_for(dest, conn.name, len(selected) > 1)
        bar = ByteBar(f"{conn.name} {run}", show=not json and len(selected) == 1)
        try:
            return _pull.pull(conn, run, d, include_all=all, include=globs, method=method, on_progress=bar)
        finally:
            bar.close()

    results = on_hosts(selected, with_connection(inv, one))
    if json:
        emit_json(results.to_json(lambda r: r.as_dict()))
    else:
        for host, r in results.items():
            if host in results.failed:
                console().print(f"{host}: [red]{escape(r.message)}[/]")
                continue
            d = r.as_dict()
            console().print(f"{host}: {len(d['files'])} file(s), {d['bytes'] / 1e6:.1f} MB verified in {escape(d['dest'])}"
                            f" ({d['rate_mb_s']} MB/s via {d['method']})"
                            + (f"; left on host: {len(d['left_on_host'])} intermediate(s)" if d["left_on_host"] else ""))
    finish(results)
