"""The env tasks' work per host: the env file a run would get (and its diff against the host's last
run), and its lint against the host's own facts (the probe's interfaces, GPUs, files)."""
from __future__ import annotations

from harness import envfile, runs
from harness.errors import HarnessError
from harness.inventory import HostSpec, Inventory
from harness.parallel import on_hosts, with_connection
from harness.results import HostResults


def render_hosts(inv: Inventory, hosts: list[HostSpec], diff: bool = False) -> HostResults:
    """Per host: the rendered env file (secrets masked) with the secrets not set in this shell, or,
    with ``diff``, the unified diff from the env file of the host's last run."""
    def one(h: HostSpec) -> dict:
        e = envfile.render_env(h, inv, require_secrets=False)
        out = {"profile": e.profile, "template": e.template, "missing_secrets": list(e.missing_secrets)}
        if not diff:
            return out | {"text": e.masked(),
                          "values": {k: (envfile.MASK if k in e.secrets else v) for k, v in e.values.items()}}
        got = with_connection(inv, runs.last_env)(h)
        label = f"{h.name}: last run {got['run_id']}" if got["run_id"] else f"{h.name}: (no run yet)"
        text = envfile.diff_env(got["text"], e, label, f"{h.name}: rendered now", old_secrets=got.get("secrets") or ())
        return out | {"diff": text, "last_run": got["run_id"]}

    return on_hosts(hosts, one)


def lint_hosts(inv: Inventory, hosts: list[HostSpec], offline: bool = False) -> HostResults:
    """Per host: ``{"problems": [...], "facts": ...}``; ``offline`` checks names and values only."""
    def one(h: HostSpec) -> dict:
        try:
            e = envfile.render_env(h, inv, require_secrets=False)
        except HarnessError as exc:
            return {"problems": [{"host": h.name, "name": "(template)", "message": str(exc), "origin": "",
                                  "line": str(exc)}],
                    "facts": None}
        facts = None if offline else with_connection(inv, lambda c: envfile.host_facts(c, e))(h)
        return {"problems": [p.as_dict() for p in envfile.lint_env(e, facts, gpus=h.gpus)], "facts": facts}

    return on_hosts(hosts, one)
