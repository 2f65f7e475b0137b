"""Stages one at a time: run a stage of remote/stages/ detached on the host and follow it (the same
run path as the pipeline: launch, follow, check the run and the service, pull)."""
from invoke import Collection, task

from tasks._cli import COMMON_HELP, LiveView, clean_errors, dest_for, emit_json, finish, load


def _stage_task(name: str):
    def body(c, inventory=None, hosts=None, json=False, run_id=None, inputs=None, gpu="auto", follow=True,
             pull=False, dest=None, verbose=False):
        from harness import runner, runs
        from harness.errors import HarnessError
        from harness.parallel import on_hosts, with_connection

        inv, selected = load(inventory, hosts)
        if gpu not in ("auto", "on", "off"):
            raise HarnessError(f"--gpu {gpu!r}: use auto, on or off")
        ins = runs.parse_inputs(inputs)
        with LiveView([h.name for h in selected], verbose=verbose, show=not json) as view:
            def one(conn):
                d = dest_for(dest, conn.name, len(selected) > 1)
                view.begin(conn.name, name)
                res = runner.run_stage(conn, inv, name, run_id=run_id, inputs=ins,
                                       gpu={"auto": None, "on": True, "off": False}[gpu], follow=follow,
                                       pull=pull, dest=d, on_line=view.for_host(conn.name))
                what = (f"run {res.run_id}: launched, state {res.status.get('state')}" if not follow else
                        f"run {res.run_id} {res.status.get('state')}" + ("" if res.ran else " earlier (not run again)")
                        + (f", pulled to {res.pulled}" if res.pulled else ""))
                view.end(conn.name, what)
                return res

            results = on_hosts(selected, with_connection(inv, one))
        if json:
            emit_json(results.to_json(lambda r: r.as_dict()))
        finish(results)

    body.__name__ = body.__qualname__ = name
    body.__doc__ = f"Run stage '{name}' (remote/stages/{name}.py) detached on the host, following its progress."
    return task(name=name, help=COMMON_HELP | {
        "run_id": "run id (default: <stage>-<time>-<random>); a finished run with this id is not run again",
        "inputs": "upstream runs as STAGE=RUN_ID[,STAGE=RUN_ID]",
        "gpu": "GPU guard (service stop/start, free-GPU wait, host lock): auto (host has GPUs), on, off",
        "follow": "follow the log until the run ends (--no-follow: launch and return)",
        "pull": "pull the artifacts when the run has succeeded", "dest": "pull destination (default runs/<run-id>)",
        "verbose": "print every line of the stage's log as it comes (by default: one live row per host)",
    })(clean_errors(body))


def collection() -> Collection:
    """One task per stage module of remote/stages/ (read from the files, not imported)."""
    from harness.stagelist import stage_names

    return Collection("stage", *[_stage_task(n) for n in stage_names()])
