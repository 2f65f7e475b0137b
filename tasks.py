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


ns = Collection()
ns.add_task(audit)
ns.add_collection(Collection("hosts", trust))
