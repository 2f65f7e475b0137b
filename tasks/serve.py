"""What the production server does now: vLLM's spec-decode counters (acceptance length, per-position
rates, tokens/s, requests), read from its Prometheus /metrics with prometheus_client's parser."""
from invoke import task

from tasks._cli import COMMON_HELP, clean_errors, console, emit_json, escape, finish, load, number, print_failures


def line(s: dict) -> str:
    acc = s.get("acceptance_length")
    pos = " ".join(f"{r:.2f}" for r in s.get("acceptance_rate_per_position") or [])
    tps = f", {s['tokens_per_s']:.1f} tokens/s" if s.get("tokens_per_s") is not None else ""
    rate = f"{s['acceptance_rate']:.3f}" if s.get("acceptance_rate") is not None else "-"
    return (f"acceptance length {acc:.3f}, rate {rate}, per position [{pos}]" if acc
            else "no drafts counted (no draft served, or no traffic)") + (
        f"; {s['drafts']} drafts, {s['generation_tokens']} tokens generated, {s['requests']} requests{tps}")


@task(help=COMMON_HELP | {"watch": "print the interval's figures every N seconds until Ctrl-C",
                          "count": "with --watch: stop after this many intervals (0: until Ctrl-C)"})
@clean_errors
def metrics(c, inventory=None, hosts=None, json=False, watch=None, count=None):
    """Live acceptance of each host's server by vLLM's own counters: since it started, or per interval."""
    import json as _json
    import time

    from harness import service
    from harness.parallel import on_hosts, with_connection

    inv, selected = load(inventory, hosts)
    watch = number(watch, "--watch", default=0, minimum=0, why="seconds between reports (0: once)")
    count = number(count, "--count", int, default=0, minimum=0, why="intervals to report (0: until Ctrl-C)")
    previous: dict = {}

    def once():
        def one(conn):
            r = service.metrics(conn, inv, since=previous.get(conn.name))
            return r
        results = on_hosts(selected, with_connection(inv, one))
        for host, r in results.succeeded.items():
            previous[host] = r["counters"]
        return results

    results = once()
    if not watch:
        if json:
            emit_json(results.to_json(lambda r: r["summary"]))
        else:
            for host, r in results.succeeded.items():
                console("out").print(f"[bold cyan]\\[{escape(host)}][/] since the server started: {line(r['summary'])}")
        return finish(results)
    n = 0
    try:
        while not count or n < int(count):
            time.sleep(float(watch))
            results = once()
            n += 1
            if json:
                print(_json.dumps({"interval": n, **results.to_json(lambda r: r["summary"])}), flush=True)
            else:
                for host, r in results.succeeded.items():
                    console("out").print(f"[bold cyan]\\[{escape(host)}][/] last {float(watch):.0f} s: {line(r['summary'])}")
                print_failures(results)
    except KeyboardInterrupt:
        pass
    finish(results, printed=not json)  # each interval printed its failures
