"""The one run path: launch a stage, follow it to its end, check it, pull its artifacts.

``inv stage.<name>`` and the pipeline both run stages through ``run_stage``, so a check added here
(the run succeeded; the production service the run stopped came back healthy) holds for both.
A run id that already succeeded on the host is not run again: ``ran`` is then False, and the
pipeline reports the stage as skipped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness import generations, runs
from harness.connection import HostConnection
from harness.envfile import Masker, secret_values
from harness.errors import HarnessError
from harness.inventory import HostSpec, Inventory
from harness.pull import pull as pull_run


@dataclass
class StageRun:
    """What one pass through the run path did on one host."""

    host: str
    stage: str
    run_id: str
    ran: bool                       # launched and followed now (False: an earlier run with this id)
    status: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)
    pulled: str | None = None
    seconds: float = 0.0

    @property
    def state(self) -> str:
        """``ran`` now, or ``skipped`` (that run id had already succeeded)."""
        return "ran" if self.ran else "skipped"

    def as_dict(self) -> dict:
        return {"host": self.host, "stage": self.stage, "run_id": self.run_id, "state": self.state,
                "run_state": self.status.get("state"), "status": self.status, "result": self.result,
                "pulled": self.pulled, "seconds": round(self.seconds, 1)}


def guarded(host: HostSpec, stage: str, generation: str) -> bool:
    """Whether ``stage`` runs under the guard (host lock, service stopped, free GPUs): it runs the
    target or trains (its contract's ``GPU``) on a host with GPUs, or with a production service that
    needs the hardware given up (on a CPU host, the cores and the memory)."""
    from harness import stagecontract

    contracts = stagecontract.load(generation=generation)
    return stage in contracts.gpu_stages and (host.gpus > 0 or host.service is not None)


def check_finished(conn: HostConnection, stage: str, st: dict) -> None:
    """Raise unless the run succeeded and, when its guard stopped the service, the service is back."""
    rid = st.get("run_id")
    if st.get("state") != "succeeded":
        mirror = runs.FollowState(rid, conn.name).log if rid else None  # the log as followed, on this machine
        here = f" (followed here: {mirror})" if mirror is not None and mirror.is_file() else ""
        raise HarnessError(f"host {conn.name}: stage {stage}: {runs.describe_failure(st)}; "
                           f"see: inv runs.logs {rid} --hosts {conn.name}{here}", kind="stage failed")
    if (st.get("service") or {}).get("healthy") is False:
        raise HarnessError(f"host {conn.name}: stage {stage}: run {rid} succeeded but the service did not come "
                           f"back: {st['service'].get('error')}", kind="service unhealthy")


def run_stage(conn: HostConnection, inv: Inventory | None, stage: str, *, run_id: str | None = None,
              inputs: dict[str, str] | None = None, extra: dict | None = None, gpu: bool | None = None,
              follow: bool = True, pull: bool = False, dest: Path | None = None, pull_all: bool = False,
              code_root: Path | None = None, environ: dict | None = None, poll_interval: float = 2.0,
              lock_wait: int = 0, on_line: Callable[[str], None] | None = None,
              on_pull_progress: Callable[[int, int], None] | None = None) -> StageRun:
    """Launch ``stage`` on ``conn``'s host and (unless ``follow`` is off) follow it to its end,
    check it and, with ``pull``, pull its artifacts (to ``dest``, default ``runs/<run-id>/``).
    Without ``pull`` the result comes from the host's result.json. Raises ``HarnessError`` when
    the run did not succeed or left the service unhealthy."""
    t0 = time.monotonic()
    if not (extra or {}).get("generation") and not (extra or {}).get("module") and code_root is None:
        # the stages of the host's speculators line (a job naming its module, a deploy, has none)
        extra = {**(extra or {}), "generation": generations.host_generation(conn)}
    if gpu is None and (extra or {}).get("generation"):
        gpu = guarded(conn.host, stage, extra["generation"])
    h = runs.launch(conn, inv, stage, run_id=run_id, inputs=inputs, extra=extra, gpu=gpu, code_root=code_root,
                    environ=environ, poll_interval=poll_interval, lock_wait=lock_wait)
    out = StageRun(conn.name, stage, h.run_id, ran=h.launched, status=h.status)
    if not follow:
        return out
    if h.launched or h.status.get("state") not in runs.FINAL:
        out.status = runs.follow(conn, h.run_id, on_line=on_line, masker=Masker(secret_values(inv, environ)))
        out.ran = True
    check_finished(conn, stage, out.status)
    if pull:
        res = pull_run(conn, h.run_id, dest=dest, include_all=pull_all, on_progress=on_pull_progress)
        out.pulled, out.result = str(res.dest), res.result or {}
    else:
        out.result = out.status.get("result") or runs.status(conn, h.run_id).get("result") or {}
    out.seconds = time.monotonic() - t0 if out.ran else float(out.result.get("seconds", 0.0) or 0.0)
    return out
