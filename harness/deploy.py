"""``inv deploy``: serve a trained draft from the host's production vLLM, checked live, rolled back by itself.

A deploy is a job on the host (remote/runtime/deploy.py) launched through the one run path
(``runner.run_stage``: detached, followed, its status and log kept like a stage's), so the switch, the
health wait, the live measurement and any rollback all happen on the host in one go, whatever the link
does. Its run id is ``deploy-<time>-<random>``; the host records each deploy under
``<workdir>/deploys/<run id>/`` and in ``deploys/history.jsonl``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from harness import runner, runs
from harness.connection import HostConnection
from harness.errors import HarnessError
from harness.inventory import Inventory
from harness.runner import StageRun
from harness import service
from harness.service import require_service

MODULE = "runtime.deploy"


def settings(inv: Inventory, k: int | None = None, min_acceptance: float | None = None,
             min_speedup: float | None = None) -> dict:
    """The deploy settings: the inventory's ``deploy:`` with the command line's over them, checked
    (a floor above k + 1, the most a step can give, could never be met)."""
    out = inv.deploy.model_dump()
    if k is not None:
        if not 1 <= k <= 16:
            raise HarnessError(f"--k {k}: draft tokens per step must be 1..16")
        out["k"] = k
    if min_acceptance is not None:
        out["min_acceptance"] = min_acceptance
    if min_speedup is not None:
        if min_speedup <= 0:
            raise HarnessError(f"--min-speedup {min_speedup}: a ratio of tokens/s, above 0 (1.0: never slower)")
        out["min_speedup"] = min_speedup
    if not 1.0 <= out["min_acceptance"] <= out["k"] + 1:
        raise HarnessError(f"min_acceptance {out['min_acceptance']} can never be met with k = {out['k']} (a step "
                           f"gives 1 to {out['k'] + 1} tokens); lower it (--min-acceptance, deploy.min_acceptance)")
    return out


def deploy(conn: HostConnection, inv: Inventory, train_run: str | None = None, *, rollback: bool = False,
           k: int | None = None, min_acceptance: float | None = None, min_speedup: float | None = None,
           code_root: Path | None = None,
           on_line: Callable[[str], None] | None = None, poll_interval: float = 2.0) -> StageRun:
    """Deploy ``train_run``'s checkpoint (or, with ``rollback``, undo the current deploy) on ``conn``'s
    host and follow the job to its end. Raises ``HarnessError`` when it failed or rolled itself back."""
    svc = require_service(conn)
    if not rollback:
        if not train_run:
            raise HarnessError("name the train run to deploy (inv deploy RUN; inv runs.list shows them), "
                               "or pass --rollback")
        runs.check_run_id(train_run)
        if not svc.base_url:
            raise HarnessError(f"host {conn.name}: a deploy measures the draft through the server, but "
                               f"hosts.{conn.name}.service has no url; set it (e.g. http://127.0.0.1:8000)")
    extra = {"module": MODULE, "action": "rollback" if rollback else "deploy",
             "deploy": settings(inv, k, min_acceptance, min_speedup)}
    if rollback and not service.status(conn, inv).get("draft"):
        raise HarnessError(f"host {conn.name}: nothing to roll back: the service runs no deployed draft "
                           "(inv service.status)", kind="refused")
    rid = runs.new_run_id("deploy")
    try:
        return runner.run_stage(conn, inv, "deploy", run_id=rid, inputs=None if rollback else {"train": train_run},
                                extra=extra, gpu=False, code_root=code_root, on_line=on_line,
                                poll_interval=poll_interval)
    except HarnessError as e:
        if e.kind != "stage failed":
            raise
        why = runs.status(conn, rid).get("error") or str(e)
        why = why.removeprefix("stage deploy failed: ")
        raise HarnessError(f"host {conn.name}: deploy {rid}: {why}; its log: inv runs.logs {rid} --hosts {conn.name}",
                           kind="deploy failed") from None
