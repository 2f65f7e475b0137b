"""Host keys: show a host's key fingerprint, and record it in known_hosts only when told to."""
from invoke import task

from tasks._cli import COMMON_HELP, clean_errors, console, emit_json, finish, load


@task(help=COMMON_HELP | {"yes": "record the key (after you checked its fingerprint)"})
@clean_errors
def trust(c, inventory=None, hosts=None, yes=False, json=False):
    """Show each host's SSH key fingerprint and, with --yes, record it in known_hosts."""
    from harness import hosts as _hosts
    from harness.parallel import on_hosts

    inv, selected = load(inventory, hosts)
    results = on_hosts(selected, lambda h: _hosts.trust(inv, h, yes))
    if json:
        emit_json(results.to_json())
    else:
        for r in results.succeeded.values():
            console().print(f"{r['host']}: {r['address']} {r['key_type']} {r['fingerprint']}: {r['action']}")
    finish(results)
