"""inv deploy: serve a trained draft from the host's production vLLM, checked live, rolled back by itself."""
from invoke import task

from tasks._cli import (COMMON_HELP, LiveView, WaivablePositionalTask, clean_errors, console, emit_json, escape, finish,
                        load, number)


@task(klass=WaivablePositionalTask, waive={"run": ("rollback", "best")}, positional=["run"], help=COMMON_HELP | {
    "run": "the train run whose checkpoint to serve (inv runs.list)",
    "k": "draft tokens per step (default: the inventory's deploy.k)",
    "min_acceptance": "the live acceptance length to clear (default: deploy.min_acceptance)",
    "min_speedup": "tokens/s with the draft / without it to clear, one request at a time and at deploy.concurrency "
                   "(default: deploy.min_speedup)",
    "rollback": "undo the current deploy: the server runs what it ran before it",
    "best": "deploy the fastest draft of each host's last inv pipeline --compare (instead of RUN)",
    "verbose": "print every line of the deploy's log (by default: one live row per host)"})
@clean_errors
def deploy(c, run=None, inventory=None, hosts=None, json=False, k=None, min_acceptance=None, min_speedup=None,
           rollback=False, verbose=False, best=False):
    """Serve RUN's draft from the production server: measure the server without it, restart it with the draft,
    wait for health, measure it again on the same prompts; unhealthy, below deploy.min_acceptance or slower
    than deploy.min_speedup times the server without it, roll back by itself."""
    from harness import deploy as _deploy
    from harness.errors import HarnessError
    from harness.parallel import on_hosts, with_connection

    if rollback and (run or best):
        raise HarnessError("--rollback undoes the current deploy: give no RUN or --best with it")
    if best and run:
        raise HarnessError("--best deploys the fastest draft of the last comparison: give no RUN with it")
    if not rollback and not run and not best:
        raise HarnessError("name the train run to deploy: inv deploy RUN (inv runs.list shows them), --best, or --rollback")
    inv, selected = load(inventory, hosts)
    runs = {h.name: run for h in selected}
    if best:  # each host's own fastest variant, found before any connection
        from harness.compare import best_train_run

        runs = {h.name: best_train_run(h.name)[0] for h in selected}
    k = number(k, "-k", int)
    min_acceptance = number(min_acceptance, "--min-acceptance")
    min_speedup = number(min_speedup, "--min-speedup")
    _deploy.settings(inv, k, min_acceptance, min_speedup)  # a floor that can never be met fails before any host
    with LiveView([h.name for h in selected], verbose=verbose, show=not json) as view:
        def one(conn):
            view.begin(conn.name, "rollback" if rollback else "deploy")
            return _deploy.deploy(conn, inv, runs[conn.name], rollback=rollback, k=k, min_acceptance=min_acceptance,
                                  min_speedup=min_speedup, on_line=view.for_host(conn.name))

        results = on_hosts(selected, with_connection(inv, one))
    if json:
        emit_json(results.to_json(lambda r: r.as_dict()))
    else:
        for host, r in results.succeeded.items():
            res = r.result
            if res.get("state") == "deployed":
                m = res.get("measurement") or {}
                fast, slow = m.get("speed") or {}, m.get("without_draft") or {}
                speeds = "; ".join(f"{c} in flight {fast[c]['tokens_per_s']:.1f} tokens/s against {slow[c]['tokens_per_s']:.1f} "
                                   f"without ({r:.2f}x)" for c, r in (m.get("speedup") or {}).items())
                line = (f"deployed run {escape(res.get('run_id'))} as {escape(res.get('deploy_id'))} (k={res.get('k')}): "
                        f"live acceptance length {m.get('acceptance_length')} over {m.get('prompts')} prompts; {speeds}")
            else:
                back = res.get("restored")
                line = (f"rolled back deploy {escape(res.get('undid'))}: the service runs "
                        + (f"the draft of run {escape(back.get('run_id'))}" if back else "without a draft"))
            console("out").print(f"[bold cyan]\\[{escape(host)}][/] [green]{line}[/]")
    finish(results)
