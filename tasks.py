"""Invoke entry point: builds the task namespace. No logic lives here: every task calls a function of
``harness`` so everything is callable and testable without the CLI.
"""
from invoke import Collection, task
from invoke.exceptions import Exit

from harness import audit as _audit
from harness import hosts as _hosts
from harness.cli import COMMON_HELP, clean_errors, emit_json, load, stdout


@task(help=COMMON_HELP | {"strict": "exit non-zero when a host is unreachable or a check fails",
                          "workers": "hosts probed at once (default 8)"})
@clean_errors
def audit(c, inventory=None, hosts=None, json=False, strict=False, workers=8):
    """Probe each host (versions, GPUs, services, speculators files, patches) in one round trip."""
    inv, selected = load(inventory, hosts)
    results = _audit.run_audit(inv, selected, workers=workers)
    if json:
        emit_json(_audit.as_json(results))
    else:
        _audit.render(results, stdout)
    bad = _audit.failed(results)
    if strict and bad:
        raise Exit(f"audit --strict: {', '.join(bad)} failed", code=1)


@task(help=COMMON_HELP | {"yes": "record the key (after you checked its fingerprint)"})
@clean_errors
def trust(c, inventory=None, hosts=None, yes=False, json=False):
    """Show each host's SSH key fingerprint and, with --yes, record it in known_hosts."""
    inv, selected = load(inventory, hosts)
    results = [_hosts.trust(inv, h, yes) for h in selected]
    if json:
        emit_json(results)
    else:
        for r in results:
            stdout.print(f"{r['host']}: {r['address']} {r['key_type']} {r['fingerprint']}: {r['action']}")


# --- setup and the whole pipeline (harness/setup.py, harness/pipeline.py) ------------------------------
@task(help=COMMON_HELP | {"base_python": "the host's interpreter that creates the venv (default python3)"})
@clean_errors
def setup(c, inventory=None, hosts=None, json=False, base_python="python3"):
    """Create each host's Python environment from the pinned profile in remote/, then audit it."""
    from harness import setup as _setup
    from harness.connection import open_host
    from harness.parallel import HostOutput, on_hosts

    inv, selected = load(inventory, hosts)
    out = HostOutput(enabled=not json)

    def one(h):
        with open_host(h, inv) as conn:
            return _setup.run_setup(conn, on_line=out.for_host(h.name, "dim"), base_python=base_python)

    done = on_hosts(selected, one)
    failed = {n: r for n, r in done.items() if not isinstance(r, dict)}
    results = _audit.run_audit(inv, [h for h in selected if h.name not in failed])
    if json:
        emit_json({"setup": {n: r if isinstance(r, dict) else r.as_dict() for n, r in done.items()},
                   "audit": _audit.as_json(results)})
    else:
        _audit.render(results, stdout)
    if failed:
        raise Exit("\n".join(f"error: {f.message}" for f in failed.values()), code=1)


@task(help=COMMON_HELP | {"from": "first stage to run (earlier ones must have succeeded before)",
                          "to": "last stage to run", "no_pull": "leave the artifacts on the host",
                          "no_patch": "do not apply the patch set first"})
@clean_errors
def pipeline(c, inventory=None, hosts=None, json=False, from_=None, to=None, no_pull=False, no_patch=False):
    """Patch if needed, then prepare -> extract -> vocab -> train -> evaluate, skipping unchanged stages."""
    from harness import pipeline as _pipeline
    from harness.connection import open_host
    from harness.parallel import on_hosts

    inv, selected = load(inventory, hosts)
    _pipeline.select_stages(from_, to)  # bad stage names fail before any connection

    def one(h):
        with open_host(h, inv) as conn:
            return _pipeline.run_pipeline(conn, inv, start=from_, stop=to, progress=not json,
                                          pull=not no_pull, patch=not no_patch)

    results = on_hosts(selected, one)
    if json:
        emit_json({n: [o.as_dict() for o in r] if isinstance(r, list) else r.as_dict() for n, r in results.items()})
    else:
        for n, r in results.items():
            if isinstance(r, list):
                # not a terminal (CI, a log file): print the table whole rather than squeezed to 80 columns
                stdout.print(_pipeline.summary_table(n, r), width=None if stdout.is_terminal else 220)
    bad = [r for r in results.values() if not isinstance(r, list)]
    if bad:
        raise Exit("\n".join(f"error: {f.message}" for f in bad), code=1)


# --- patch: audit, apply and roll back the version-keyed patch series (harness/patches.py) -------------
from harness import patches as _patches  # noqa: E402

_patches.register_audit_extension()  # inv audit also shows patch states and the vLLM API preflight


def _patch_op(op, inventory, hosts, json, **extra):
    inv, selected = load(inventory, hosts)
    if json:
        results = _patches.run_op(inv, selected, op, **extra)
    else:
        from harness.cli import stderr as _err

        with _err.status(f"patch {op} on {len(selected)} host(s)..."):
            results = _patches.run_op(inv, selected, op, **extra)
    if json:
        emit_json(_patches.as_json(results))
    else:
        _patches.render(results, stdout, op)
    bad = _patches.failures(results)
    if bad:
        raise Exit(f"patch.{'apply' if op == 'plan' else op}: failed on {', '.join(bad)}", code=1)


@task(name="status", help=COMMON_HELP)
@clean_errors
def patch_status(c, inventory=None, hosts=None, json=False):
    """Per host and patch: not needed / pristine / applied / applied by hand / drifted / version mismatch."""
    _patch_op("status", inventory, hosts, json)


@task(name="apply", help=COMMON_HELP | {"dry_run": "print the unified diff that would be applied; change nothing"})
@clean_errors
def patch_apply(c, inventory=None, hosts=None, json=False, dry_run=False):
    """Apply the series for the installed speculators as one transaction per host (all or nothing)."""
    _patch_op("plan" if dry_run else "apply", inventory, hosts, json)


@task(name="rollback", help=COMMON_HELP | {
    "force": "restore the backups even over files edited since apply",
    "reinstall": "last resort: reinstall the pristine wheel with pip (--force-reinstall --no-deps)"})
@clean_errors
def patch_rollback(c, inventory=None, hosts=None, json=False, force=False, reinstall=False):
    """Restore byte-identical pristine files (checked against pip's RECORD)."""
    _patch_op("rollback", inventory, hosts, json, force=force, reinstall=reinstall)


# --- env, stage, runs, pull: environment files and detached stage runs (harness/runcli.py) ---------------
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402

from harness import runcli as _runcli  # noqa: E402
from harness.cli import stderr  # noqa: E402
from harness.parallel import HostFailure as _HostFailure  # noqa: E402
from harness.runs import stages as _stage_names  # noqa: E402


@task(name="render", help=COMMON_HELP | {"diff": "show the difference from the env file of the host's last run"})
@clean_errors
def env_render(c, inventory=None, hosts=None, json=False, diff=False):
    """Print each host's rendered env file (profile + inventory env + secrets, secrets masked)."""
    inv, selected = load(inventory, hosts)
    res = _runcli.env_render(inv, selected, diff, stdout if not json else Console(quiet=True), stderr)
    if json:
        emit_json(res)


@task(name="lint", help=COMMON_HELP | {"offline": "check names and values only; do not ask the hosts for facts"})
@clean_errors
def env_lint(c, inventory=None, hosts=None, json=False, offline=False):
    """Unknown NCCL_/VLLM_/CUDA_ names, values the host contradicts, missing template variables."""
    inv, selected = load(inventory, hosts)
    res, problems = _runcli.env_lint(inv, selected, offline)
    if json:
        emit_json(res)
    else:
        for line in problems:
            stderr.print(f"[red]error:[/] {escape(line)}", soft_wrap=True)
        if not problems:
            stdout.print(f"env.lint: {len(selected)} host(s), no problems")
    if problems:
        raise Exit(f"env.lint: {len(problems)} problem(s)", code=1)


def _stage_task(name):
    def body(c, inventory=None, hosts=None, json=False, run_id=None, inputs=None, gpu="auto", follow=True,
             pull=False, dest=None):
        inv, selected = load(inventory, hosts)
        res = _runcli.stage_run(inv, selected, name, run_id=run_id, inputs=inputs, gpu=gpu, follow=follow,
                                pull=pull, dest=dest, err=stderr)
        if json:
            emit_json(_runcli.as_jsonable(res))
        _runcli.exit_if_failed(res)
    body.__name__ = body.__qualname__ = f"stage_{name}"
    body.__doc__ = f"Run stage '{name}' (remote/stages/{name}.py) detached on the host, following its progress."
    return task(name=name, help=COMMON_HELP | {
        "run_id": "run id (default: <stage>-<time>-<random>); a finished run with this id is not run again",
        "inputs": "upstream runs as STAGE=RUN_ID[,STAGE=RUN_ID]",
        "gpu": "GPU guard (service stop/start, free-GPU wait, host lock): auto (host has GPUs), on, off",
        "follow": "follow the log until the run ends (--no-follow: launch and return)",
        "pull": "pull the artifacts when the run has succeeded", "dest": "pull destination (default runs/<run-id>)",
    })(clean_errors(body))


@task(name="list", help=COMMON_HELP)
@clean_errors
def runs_list(c, inventory=None, hosts=None, json=False):
    """The runs on each host with their state, times and exit code."""
    inv, selected = load(inventory, hosts)
    res = _runcli.runs_list(inv, selected)
    emit_json(_runcli.as_jsonable(res)) if json else _runcli.render_list(res, stdout)
    _runcli.exit_if_failed(res)


@task(name="status", help=COMMON_HELP | {"run": "the run id"})
@clean_errors
def runs_status(c, run, inventory=None, hosts=None, json=False):
    """One run's status: state, pid, boot id, times, exit code, GPU guard outcome."""
    inv, selected = load(inventory, hosts)
    res = _runcli.runs_status(inv, selected, run)
    emit_json(_runcli.as_jsonable(res)) if json else _runcli.render_status(res, stdout)
    _runcli.exit_if_failed(res)


@task(name="logs", help=COMMON_HELP | {"run": "the run id",
                                       "follow": "keep following until the run ends; reattaches where it left off"})
@clean_errors
def runs_logs(c, run, inventory=None, hosts=None, json=False, follow=False):
    """Print a run's log (secrets masked); --follow streams it live with progress."""
    inv, selected = load(inventory, hosts)
    if json:
        res = _runcli.runs_log_texts(inv, selected, run)
        emit_json(_runcli.as_jsonable(res))
    else:
        res = _runcli.runs_logs(inv, selected, run, follow, stdout, stderr)
    _runcli.exit_if_failed(res)


@task(name="stop", help=COMMON_HELP | {"run": "the run id", "grace": "seconds between TERM and KILL (default 10)"})
@clean_errors
def runs_stop(c, run, inventory=None, hosts=None, json=False, grace=10.0):
    """Stop a run's whole process group; the wrapper still restores the service."""
    inv, selected = load(inventory, hosts)
    res = _runcli.runs_stop(inv, selected, run, float(grace))
    if json:
        emit_json(_runcli.as_jsonable(res))
    else:
        for host, r in res.items():
            if isinstance(r, _HostFailure):
                stdout.print(f"{host}: [red]{escape(r.message)}[/]", soft_wrap=True)
                continue
            st = r.get("status", {})
            stdout.print(f"{host}: run {run} {st.get('state', '?')}" + (" (killed after grace)" if r.get("killed") else ""),
                         soft_wrap=True)
    _runcli.exit_if_failed(res)


@task(help=COMMON_HELP | {"run": "the run id", "dest": "destination directory (default runs/<run-id>)",
                          "all": "also pull large intermediates (e.g. hidden states)",
                          "include": "comma-separated globs to pull even if they are intermediates",
                          "method": "auto (rsync, else SFTP), rsync or sftp"})
@clean_errors
def pull(c, run, inventory=None, hosts=None, json=False, dest=None, all=False, include=None, method="auto"):
    """Pull a run's artifacts, resumable, each file verified against SHA256SUMS before it is placed."""
    inv, selected = load(inventory, hosts)
    res = _runcli.pull_runs(inv, selected, run, dest, all, include, method, not json, stderr)
    if json:
        emit_json(_runcli.as_jsonable(res))
    else:
        for host, r in res.items():
            if isinstance(r, _HostFailure):
                stdout.print(f"{host}: [red]{escape(r.message)}[/]", soft_wrap=True)
                continue
            stdout.print(f"{host}: {len(r['files'])} file(s), {r['bytes'] / 1e6:.1f} MB verified in {escape(r['dest'])}"
                         f" ({r['rate_mb_s']} MB/s via {r['method']})"
                         + (f"; left on host: {len(r['left_on_host'])} intermediate(s)" if r["left_on_host"] else ""),
                         soft_wrap=True)
    _runcli.exit_if_failed(res)


ns = Collection()
ns.add_task(audit)
ns.add_task(setup)
ns.add_task(pipeline)
ns.add_collection(Collection("hosts", trust))
ns.add_collection(Collection("patch", patch_status, patch_apply, patch_rollback))
ns.add_collection(Collection("env", env_render, env_lint))
ns.add_collection(Collection("stage", *[_stage_task(n) for n in _stage_names()]))
ns.add_collection(Collection("runs", runs_list, runs_status, runs_logs, runs_stop))
ns.add_task(pull)
