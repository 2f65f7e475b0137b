"""Environment files: the NCCL/vLLM profile + inventory env + secrets that each host's runs get."""
from invoke import task
from invoke.exceptions import Exit

from tasks._cli import COMMON_HELP, clean_errors, console, emit_json, escape, finish, load


@task(help=COMMON_HELP | {"diff": "show the difference from the env file of the host's last run"})
@clean_errors
def render(c, inventory=None, hosts=None, json=False, diff=False):
    """Print each host's rendered env file (profile + inventory env + secrets, secrets masked)."""
    from harness import envcheck

    inv, selected = load(inventory, hosts)
    results = envcheck.render_hosts(inv, selected, diff)
    if json:
        emit_json(results.to_json())
    else:
        out, err = console(), console("err")
        for name, r in results.succeeded.items():
            for secret in r["missing_secrets"]:
                err.print(f"[yellow]warning:[/] host {escape(name)}: secret {secret} is not set in this shell; "
                          "a run would refuse to start")
            if diff:
                out.print(escape(r["diff"]) if r["diff"] else
                          f"{escape(name)}: no difference from the last run ({r['last_run']})")
            else:
                out.rule(f"{name}  ({r['template']})")
                out.print(escape(r["text"]))
    finish(results)


@task(help=COMMON_HELP | {"offline": "check names and values only; do not ask the hosts for facts"})
@clean_errors
def lint(c, inventory=None, hosts=None, json=False, offline=False):
    """Unknown NCCL_/VLLM_/CUDA_ names, values the host contradicts, missing template variables."""
    from harness import envcheck

    inv, selected = load(inventory, hosts)
    results = envcheck.lint_hosts(inv, selected, offline)
    problems = [p["line"] for r in results.succeeded.values() for p in r["problems"]]
    if json:
        emit_json(results.to_json())
    else:
        for line in problems:
            console("err").print(f"[red]error:[/] {escape(line)}")
        if not problems and not results.failed:
            console().print(f"env.lint: {len(selected)} host(s), no problems")
    finish(results)
    if problems:
        raise Exit(f"env.lint: {len(problems)} problem(s)", code=1)
